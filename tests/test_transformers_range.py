"""Checkpoint conversion with the oldest transformers `pyproject.toml` allows (4.57), beside the
installed (newest) one.

The oldest is pip-installed once per test run into a temporary folder (`--target`, with the
tokenizers and huggingface_hub versions it needs; about 140 MB, ~15 s with a warm pip cache) and
put first on PYTHONPATH of a subprocess. There, `jaxspec.checkpoint.convert` turns a tiny GGUF
(weights, tokenizer, chat template) into a checkpoint, and GGUF tokenizers of each family are
rebuilt; the ids must equal the plain-Python references of tests/test_tokenizer_gguf.py. What each
version saves must load in the other. Without access to a package index the test is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import unicodedata
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

from test_tokenizer_gguf import (SPECIALS, byte_level_fields, learn_spm_vocab, reference_bpe_encode,  # noqa: E402
                                 reference_spm_encode, texts, write_tokenizer_gguf)

OLDEST = "4.57"
#: transformers 4.57 with the versions of its own dependencies that differ from transformers 5's.
OLDEST_REQUIREMENTS = [f"transformers=={OLDEST}.*", "tokenizers>=0.22,<=0.23.0", "huggingface_hub>=0.34,<1.0"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def oldest_transformers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp(f"transformers-{OLDEST}")
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--target", str(target), *OLDEST_REQUIREMENTS]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip(f"cannot pip-install transformers {OLDEST} (no package index?): {r.stderr.strip()[-400:]}")
    return target


def run_with(target: Path, code: str, *args: str) -> dict:
    """Run `code` (which prints one JSON line last) with `target`'s packages first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(REPO), str(REPO / "tests")]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


CHILD = """
    import json, sys
    import transformers
    from jaxspec import gguf_io
    from jaxspec.checkpoint import _load_hf_tokenizer, convert
    from jaxspec.tokenizer import load_tokenizer
    texts = json.loads(open(sys.argv[1]).read())
    out = {"version": transformers.__version__, "ids": {}, "decoded": {}}
    for name in ("qwen2", "llama-bpe", "spm"):
        tok = gguf_io.load_tokenizer(f"{sys.argv[2]}/{name}.gguf")
        out["ids"][name] = [tok(t)["input_ids"] for t in texts]
        out["decoded"][name] = [tok.decode(tok(t)["input_ids"], skip_special_tokens=name == "spm") for t in texts]
    convert(f"{sys.argv[2]}/model.gguf", f"{sys.argv[2]}/ckpt-old", dtype="float32", progress=False)
    tok = _load_hf_tokenizer(f"{sys.argv[2]}/ckpt-old")
    out["ckpt_old"] = [tok(t)["input_ids"] for t in texts]
    out["chat_old"] = tok.apply_chat_template([{"role": "user", "content": texts[0]}], tokenize=False)
    fast = load_tokenizer(f"{sys.argv[2]}/ckpt-old")  # tokenizers + jinja2, no transformers
    out["fast_old"] = [fast(t)["input_ids"] for t in texts]
    out["fast_decoded_old"] = [fast.decode(i, skip_special_tokens=True) for i in out["fast_old"]]
    out["decoded_old"] = [tok.decode(i, skip_special_tokens=True) for i in out["fast_old"]]
    out["fast_chat_old"] = fast.apply_chat_template([{"role": "user", "content": texts[0]}],
                                                    tokenize=False)
    tok = _load_hf_tokenizer(f"{sys.argv[2]}/ckpt-new")  # converted under the newest transformers
    out["ckpt_new"] = [tok(t)["input_ids"] for t in texts]
    tok = _load_hf_tokenizer(f"{sys.argv[2]}/raw-new")  # saved by the newest, class name as it writes it
    out["raw_new"] = [tok(t)["input_ids"] for t in texts]
    print(json.dumps(out))
"""


def test_conversion_with_oldest_and_newest_transformers(tmp_path: Path, oldest_transformers: Path) -> None:
    import jinja2
    import transformers

    from jaxspec.checkpoint import _load_hf_tokenizer, convert
    from jaxspec.tokenizer import load_tokenizer
    from test_gguf_io import byte_level_vocab, tiny_model, write_tiny_gguf

    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    fields = {
        "qwen2": byte_level_fields(rng, "qwen2"),
        "llama-bpe": byte_level_fields(rng, "llama-bpe", add_bos_token=True),
        "spm": learn_spm_vocab(rng, n_merges=150),
    }
    for name, f in fields.items():
        write_tokenizer_gguf(tmp_path / f"{name}.gguf", f)
    sample = [t for t in texts(rng, tuple(SPECIALS), n=12) if t.strip()]
    (tmp_path / "texts.json").write_text(json.dumps(sample))
    vocab = byte_level_vocab()
    tiny = tiny_model("qwen2", vocab=len(vocab["tokens"]))
    write_tiny_gguf(tmp_path / "model.gguf", tiny.state, tiny.config, tokenizer=vocab)
    convert(tmp_path / "model.gguf", tmp_path / "ckpt-new", dtype="float32", progress=False)
    _load_hf_tokenizer(tmp_path / "ckpt-new").save_pretrained(tmp_path / "raw-new")

    old = run_with(oldest_transformers, CHILD, str(tmp_path / "texts.json"), str(tmp_path))
    assert old["version"].startswith(OLDEST + ".") and transformers.__version__ != old["version"]
    for name, f in fields.items():
        want = [reference_spm_encode(t, f) if name == "spm" else reference_bpe_encode(t, f, name) for t in sample]
        assert old["ids"][name] == want, name
        decoded = {"qwen2": [unicodedata.normalize("NFC", t) for t in sample],
                   "llama-bpe": [SPECIALS[1] + t for t in sample], "spm": sample}[name]  # llama-bpe: BOS
        assert old["decoded"][name] == decoded, name
    # the checkpoint written under the oldest loads under the newest and the other way round
    newest = _load_hf_tokenizer(tmp_path / "ckpt-old")
    assert newest is not None
    assert old["ckpt_old"] == old["ckpt_new"] == old["raw_new"] == [newest(t)["input_ids"] for t in sample]
    want_chat = jinja2.Template(vocab["chat_template"]).render(messages=[{"role": "user", "content": sample[0]}])
    # jaxspec's own tokenizer over either checkpoint: what either transformers gives
    for ckpt in ("ckpt-old", "ckpt-new"):
        fast = load_tokenizer(tmp_path / ckpt)
        assert fast is not None and [fast(t)["input_ids"] for t in sample] == old["ckpt_old"]
        assert fast.apply_chat_template([{"role": "user", "content": sample[0]}],
                                        tokenize=False) == want_chat
    assert old["fast_old"] == old["ckpt_old"] and old["fast_decoded_old"] == old["decoded_old"]
    assert old["fast_chat_old"] == want_chat
    assert old["chat_old"] == newest.apply_chat_template([{"role": "user", "content": sample[0]}],
                                                         tokenize=False) == want_chat
