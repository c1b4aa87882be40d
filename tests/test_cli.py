"""The command line: every argument is checked before a model loads, and every error names its
option; a missing server extra is one line with its remedy; `fetch --list` describes the models;
the commands that compile turn the persistent compilation cache on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

import jaxspec
from jaxspec import cli

REPO = Path(__file__).resolve().parents[1]


class Loaded(Exception):
    """Raised by the stand-ins for the model loaders: a check came too late."""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny converted checkpoint with a tokenizer and a chat template."""
    pytest.importorskip("gguf")
    from test_gguf_io import byte_level_vocab, tiny_model, write_tiny_gguf

    root = tmp_path_factory.mktemp("cli")
    vocab = byte_level_vocab()
    tiny = tiny_model("llama", vocab=len(vocab["tokens"]), tie=True)
    gguf_path = write_tiny_gguf(root / "tiny.gguf", tiny.state, tiny.config, tokenizer=vocab)
    return jaxspec.convert(gguf_path, root / "tiny", dtype="float32", progress=False)


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Model loading (and the server's engine) raise `Loaded`; the compile cache records its calls."""
    import jaxspec.checkpoint
    import jaxspec.server
    from jaxspec import compile_cache

    def refuse(*args, **kwargs):
        raise Loaded(f"a model was loaded: {args}")

    monkeypatch.setattr(jaxspec, "load", refuse)
    monkeypatch.setattr(jaxspec.checkpoint, "load", refuse)
    monkeypatch.setattr(jaxspec.server, "build_engine", refuse)
    calls: list[str] = []
    monkeypatch.setattr(compile_cache, "enable", lambda path=None: calls.append("enable"))
    return calls


def fails(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run the CLI, expect exit code 2 without a model load; return stderr."""
    start = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    assert time.perf_counter() - start < 5.0, f"slow rejection of {argv}"
    return err


def test_generate_arguments_checked_before_the_model_loads(ckpt: Path, tmp_path: Path, no_load: list[str],
                                                            capsys: pytest.CaptureFixture) -> None:
    hf_like = tmp_path / "hf"
    hf_like.mkdir()
    (hf_like / "config.json").write_text("{}")
    tree_file = tmp_path / "tree.json"
    tree_file.write_text(json.dumps({"parents": [-1, 0, 0, 5]}))
    m, p = str(ckpt), ["--prompt", "the cat"]
    cases = {
        "--prompt": [m],
        "--temperature": [m, *p, "--temperature", "-1"],
        "--temperature ": [m, *p, "--temperature", "nan"],
        "--top-k": [m, *p, "--top-k", "-1"],
        "--top-p": [m, *p, "--top-p", "0"],
        "--top-p ": [m, *p, "--top-p", "1.5"],
        "--max-new-tokens": [m, *p, "--max-new-tokens", "0"],
        "--seed": [m, *p, "--seed", "abc"],
        "--dtype": [m, *p, "--dtype", "float64"],
        "--gamma": [m, *p, "--draft", "self", "--gamma", "0"],
        "--window": [m, *p, "--draft", "self", "--window", "-3"],
        "--sink": [m, *p, "--draft", "self", "--sink", "-1"],
        "--sink ": [m, *p, "--draft", "self", "--sink", "0", "--window", "0"],
        "--tree": [m, *p, "--draft", "self", "--tree", "1,0"],
        "--tree ": [m, *p, "--draft", "self", "--tree", str(tmp_path / "missing.json")],
        "--tree  ": [m, *p, "--draft", "self", "--tree", str(tree_file)],
        "--gamma ": [m, *p, "--draft", "self", "--gamma", "auto", "--tree", "2,2"],
        "--draft": [m, *p, "--draft", str(tmp_path / "nowhere")],
        "--window ": [m, *p, "--draft", m, "--gamma", "4", "--window", "5"],
        "--tp": [m, *p, "--tp", "0"],
        "--tp ": [m, *p, "--tp", "4096"],
        "--dp": [m, *p, "--dp", "-2"],
        "model: no checkpoint": [str(tmp_path / "nowhere"), *p],
        "jaxspec convert": [str(hf_like), *p],
        # speculation options without --draft were ignored (plain decoding, exit 0)
        "--tree   ": [m, *p, "--tree", "2,1"],
        "--gamma  ": [m, *p, "--gamma", "8", "--window", "64"],
        # refused only after the model loaded (a NotImplementedError traceback)
        "--batch-invariant": [m, *p, "--batch-invariant", "--tp", "2"] if len(jax.devices()) > 1
        else [m, *p, "--batch-invariant", "--tp", "0"],
    }
    for option, argv in cases.items():
        err = fails(["generate", *argv], capsys)
        assert option.strip() in err, (argv, err)
    assert no_load == []  # nothing compiles when the arguments are bad


def test_generate_needs_a_tokenizer_and_a_chat_template(ckpt: Path, tmp_path: Path, no_load: list[str],
                                                         capsys: pytest.CaptureFixture) -> None:
    from tiny import tiny_model

    bare = jaxspec.save(tiny_model(), tmp_path / "bare")  # no tokenizer
    assert "no tokenizer" in fails(["generate", str(bare), "--prompt", "hi"], capsys)
    plain = tmp_path / "plain"
    import shutil
    shutil.copytree(ckpt, plain)
    for f in plain.glob("chat_template.*"):
        f.unlink()
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    assert "--chat" in fails(["generate", str(plain), "--prompt", "hi", "--chat"], capsys)
    # good arguments reach the load, after the compilation cache is on
    with pytest.raises(Loaded):
        cli.main(["generate", str(ckpt), "--prompt", "hi", "--chat", "--draft", "self", "--tree", "2,1"])
    assert no_load == ["enable"]


def test_serve_convert_fetch_and_tree_search_arguments(ckpt: Path, tmp_path: Path, no_load: list[str],
                                                       capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    m = ["--model", str(ckpt)]
    serve = {
        "--model": ["--model", str(tmp_path / "nowhere")],
        "--max-batch": [*m, "--max-batch", "0"],
        "--max-len": [*m, "--max-len", "1"],
        "--max-queue": [*m, "--max-queue", "0"],
        "--prefill-chunk": [*m, "--prefill-chunk", "0"],
        "--mixed-prefill": [*m, "--mixed-prefill", "-1"],
        "--mixed-stretch": [*m, "--page-size", "16", "--mixed-stretch", "0"],
        "--mixed-stretch ": [*m, "--mixed-stretch", "2"],  # (an option of a block pool)
        "--port": [*m, "--port", "70000"],
        "--log-level": [*m, "--log-level", "loud"],
        "--dtype": [*m, "--dtype", "int8"],
        "--gamma": [*m, "--draft", "self", "--gamma", "auto", "--tree", "2,2"],
        "--sink": [*m, "--draft", "self", "--sink", "-4"],
        "--draft": [*m, "--draft", str(tmp_path / "nowhere")],
        "--model ": [str(tmp_path / "nowhere")],  # the checkpoint as a positional argument
        "given twice": [str(ckpt), "--model", str(tmp_path / "other")],
        "--tp": [*m, "--tp", "0"],
        "--dp": [*m, "--dp", str(len(jax.devices()) + 1)],
        # (with an even number of devices: 2 data shards do not divide 3 slots)
        **({"--max-batch 3": [*m, "--dp", "2", "--max-batch", "3"]}
           if len(jax.devices()) % 2 == 0 else {}),
        # options of a block pool without --page-size
        "--kv-blocks": [*m, "--kv-blocks", "100"],
        # a pool smaller than one sequence: refused before the load
        "--kv-blocks 3": [*m, "--page-size", "16", "--kv-blocks", "3", "--max-len", "256"],
        "--fill-first": [*m, "--fill-first", "1"],
        "--window": [*m, "--window", "64"],  # speculation options need --draft
    }
    for option, argv in serve.items():
        assert option.strip() in fails(["serve", *argv], capsys), argv
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    text_file = tmp_path / "model.bin"
    text_file.write_text("x")
    convert = {
        "src": [str(tmp_path / "nowhere"), str(tmp_path / "out")],
        "src ": [str(text_file), str(tmp_path / "out")],
        "--overwrite": [str(ckpt.parent / "tiny.gguf"), str(full)],
        "--dtype": [str(ckpt.parent / "tiny.gguf"), str(tmp_path / "out"), "--dtype", "int8"],
        # --overwrite deleted any folder it was given: one that is no checkpoint, the folder
        # holding the source
        "not a jaxspec checkpoint": [str(ckpt.parent / "tiny.gguf"), str(full), "--overwrite"],
        "holds it": [str(ckpt.parent / "tiny.gguf"), str(ckpt.parent), "--overwrite"],
        # a destination that cannot be written failed after all the weights were read
        "cannot write": [str(ckpt.parent / "tiny.gguf"), str(text_file / "sub")],
    }
    for option, argv in convert.items():
        assert option.strip() in fails(["convert", *argv], capsys), argv
    assert (full / "x").read_text() == "x" and (ckpt.parent / "tiny.gguf").is_file()
    err = fails(["fetch", "no-such-model"], capsys)
    assert "name" in err and "smollm2-135m-instruct" in err
    assert "--dir" in fails(["fetch", "smollm2-135m-instruct", "--dir", str(text_file)], capsys)
    assert "--dtype" in fails(["fetch", "smollm2-135m-instruct", "--dtype", "f64"], capsys)
    for argv in (["--acceptance", "abc"], ["--acceptance", "0.5,1.5"], ["--acceptance", ""]):
        assert "--acceptance" in fails(["tree-search", *argv], capsys), argv
    assert "--budget" in fails(["tree-search", "--acceptance", "0.5", "--budget", "0"], capsys)
    assert no_load == []
    # --max-len beyond the model's context (256) is cut to it: 16 blocks of 16 hold a sequence
    with pytest.raises(Loaded):
        cli.main(["serve", *m, "--page-size", "16", "--kv-blocks", "16", "--max-len", "8192"])


def test_tree_search_runs_without_compiling(no_load: list[str], capsys: pytest.CaptureFixture) -> None:
    cli.main(["tree-search", "--acceptance", "0.7,0.2", "--budget", "6"])
    out = json.loads(capsys.readouterr().out)
    assert out["num_nodes"] <= 7 and out["inputs"]["acceptance_by_rank"] == [0.7, 0.2]
    assert no_load == []


def test_fetch_list_describes_the_models(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    models = json.loads((REPO / "checkpoints" / "models.json").read_text())["models"]
    ready = tmp_path / models[0]["name"]
    ready.mkdir()
    (ready / "jaxspec_config.json").write_text("{}")
    cli.main(["fetch", "--list", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    lines = out.splitlines()
    for entry in models:
        head = next(line for line in lines if line.startswith(entry["name"] + " "))
        for fact in (entry["arch"], entry["parameters"], entry["license"], entry["quantization"]):
            assert fact in head, (fact, head)
        size = entry["gguf_size"]
        assert (f"{size / 1e6:.0f} MB" if size < 1e9 else f"{size / 1e9:.1f} GB") in head
        assert ("[ready:" in head) == (entry is models[0])
        words = " ".join(entry["description"].split()[:6])
        assert words in " ".join(out.split())


def _hidden_server_extra(tmp_path: Path) -> dict:
    """An environment where `import fastapi` / `import uvicorn` fail as if they were not installed."""
    hide = tmp_path / "hide"
    hide.mkdir(exist_ok=True)
    for name in ("fastapi", "uvicorn"):
        (hide / f"{name}.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(hide), str(REPO)]), JAX_PLATFORMS="cpu")


@pytest.mark.parametrize("command", [["scripts/serve.py"], ["-m", "jaxspec", "serve"]])
def test_missing_server_extra_is_one_line(tmp_path: Path, command: list[str]) -> None:
    r = subprocess.run([sys.executable, *command, "--model", str(tmp_path / "nowhere")], cwd=REPO,
                       env=_hidden_server_extra(tmp_path), capture_output=True, text=True, timeout=300)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "needs the server extra: pip install 'jaxspec[serve]'" in lines[0]
    assert "fastapi" in lines[0] and "uvicorn" in lines[0]


def test_generate_prints_what_the_api_generates(ckpt: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["generate", str(ckpt), "--prompt", "the cat", "--prompt", "an ant", "--max-new-tokens", "4", "--chat"]
    cli.main(argv)
    out = capsys.readouterr().out
    want = jaxspec.generate(jaxspec.load(ckpt), ["the cat", "an ant"], max_new_tokens=4, chat=True).texts
    assert out == "".join(f"--- prompt {i}: {p!r}\n{t}\n\n" for i, (p, t) in enumerate(zip(["the cat", "an ant"], want)))
