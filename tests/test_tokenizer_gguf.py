"""GGUF tokenizers rebuilt by `jaxspec.gguf_io` against references that share none of its code.

Each test writes a small GGUF file with the `gguf` package's writer: a vocabulary learned from
random multilingual text, the way llama.cpp's converter stores one (byte-level BPE with merges, or
SentencePiece BPE with scores and byte tokens). The tokenizer `gguf_io` builds from it must encode
fresh random text to the same ids as

* a plain-Python reference of the tokenizer the vocabulary belongs to (GPT-2's BPE over the
  family's published split regex; SentencePiece's highest-score-first merging with byte fallback,
  as llama.cpp runs it), and
* transformers' own GGUF loading (`AutoTokenizer.from_pretrained(folder, gguf_file=...)`), where
  it supports the family,

and decode back to the text; its special tokens, BOS/EOS flags and chat template must match the
file. A checkpoint's tokenizer must survive saving and reloading in this transformers and in the
oldest one `pyproject.toml` allows (tests/test_transformers_range.py).
"""

from __future__ import annotations

import json
import os
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
regex = pytest.importorskip("regex")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from jaxspec import gguf_io  # noqa: E402

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# ----------------------------------------------------------------------------------------------
# Random text.
# ----------------------------------------------------------------------------------------------

_WORDS = [
    "the", "The", "THE", "cat", "and", "hat", "in", "an", "ant", "don't", "WE'LL", "I'm", "you're", "it's",
    "naïve", "Straße", "ünïcode", "café", "e\u0301te\u0301", "ﬁne", "日本語", "中文字", "東京", "Привет", "мир",
    "مرحبا", "שלום", "γειά", "Ω", "😀", "🤖👍", "👩\u200d💻", "qxz", "Qxz", "x", "CamelCaseWord", "snake_case",
    "HTTPServer", "i18n", "v2", "a1b2",
]
#: Words the learned vocabularies never see; some are added to them as whole tokens.
UNSEEN = ["zqvwk", "Zqvwk", "ЖЪЖ"]
_PUNCT = ["!", "?!", "...", ",", ".", "(", ")", "[x]", "--", "\"", "'", "#", "$5", "%", "&&", "->", ";", "{}", "/", "\\"]
_SPACE = [" ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\r\n", "\u00a0", "\u3000"]


def random_text(rng: np.random.Generator, n: int, specials: tuple[str, ...] = (), unseen: bool = True) -> str:
    """`n` pieces: words, numbers of 1-7 digits, punctuation, whitespace runs, special tokens."""
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.05 and unseen:
            out.append(str(rng.choice(UNSEEN)))
        elif r < 0.45:
            out.append(str(rng.choice(_WORDS)))
        elif r < 0.55:
            out.append(str(rng.integers(0, 10 ** int(rng.integers(1, 8)))))
        elif r < 0.68:
            out.append(str(rng.choice(_PUNCT)))
        elif r < 0.72 and specials:
            out.append(str(rng.choice(specials)))
        out.append(str(rng.choice(_SPACE)) if rng.random() < 0.8 else "")
    return "".join(out)


def corpus(rng: np.random.Generator) -> list[str]:
    return [random_text(rng, 40, unseen=False) for _ in range(300)]


# ----------------------------------------------------------------------------------------------
# Byte-level BPE: a vocabulary, a GGUF file, a reference tokenizer.
# ----------------------------------------------------------------------------------------------


def gpt2_bytes() -> dict[int, str]:
    """GPT-2's byte -> printable character table (from transformers, not from jaxspec)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def learn_byte_level_vocab(rng: np.random.Generator, specials: list[str], user: list[str],
                           extra_words: list[str]) -> dict[str, Any]:
    """GGUF tokenizer fields of a byte-level BPE vocabulary learned from random text (llama.cpp's
    layout: tokens by id, merges as "a b", control tokens first). `extra_words` become whole tokens
    that no merge sequence builds (only a tokenizer that looks whole words up first produces them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    learner.train_from_iterator(corpus(rng), trainer)
    model = json.loads(learner.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    learned = sorted(model["vocab"], key=model["vocab"].get)
    table = gpt2_bytes()
    extra = ["".join(table[b] for b in w.encode()) for w in extra_words]
    tokens = specials + learned + [t for t in extra if t not in model["vocab"]] + user
    types = [CONTROL] * len(specials) + [NORMAL] * (len(tokens) - len(specials) - len(user)) + [USER_DEFINED] * len(user)
    return {"model": "gpt2", "tokens": tokens, "token_type": types, "merges": merges}


# The split regexes of the models' own tokenizer.json files, restated here.
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

#: pre-tokenizer name -> (splitter, NFC first, whole words looked up first)
FAMILIES = {
    "gpt-2": (lambda s: regex.findall(GPT2_SPLIT, s), False, False),
    "smollm": (lambda s: [w for part in regex.findall(r"\p{N}|\P{N}+", s)
                          for w in (regex.findall(GPT2_SPLIT, part) if not regex.fullmatch(r"\p{N}", part) else [part])],
               False, False),
    "llama-bpe": (lambda s: regex.findall(LLAMA3_SPLIT, s), False, True),
    "qwen2": (lambda s: regex.findall(QWEN2_SPLIT, s), True, False),
}


def split_added(text: str, added: list[str]) -> list[tuple[str, bool]]:
    """Text cut at added tokens (longest first at each position): [(piece, is_added)]."""
    if not added:
        return [(text, False)] if text else []
    pattern = "|".join(regex.escape(t) for t in sorted(added, key=len, reverse=True))
    out, pos = [], 0
    for m in regex.finditer(pattern, text):
        if m.start() > pos:
            out.append((text[pos:m.start()], False))
        out.append((m.group(), True))
        pos = m.end()
    if pos < len(text):
        out.append((text[pos:], False))
    return out


def bpe_word(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """GPT-2's BPE of one word: merge the best-ranked adjacent pair, everywhere, until none is left."""
    parts = list(word)
    while len(parts) > 1:
        pairs = {(a, b) for a, b in zip(parts, parts[1:])}
        best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
        if best not in ranks:
            break
        merged, i = [], 0
        while i < len(parts):
            if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts


def reference_bpe_encode(text: str, fields: dict[str, Any], family: str) -> list[int]:
    split, nfc, whole_words = FAMILIES[family]
    tokens = fields["tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(fields["merges"])}
    added = [t for t, k in zip(tokens, fields["token_type"]) if k in (CONTROL, USER_DEFINED)]
    table = gpt2_bytes()
    ids = [vocab[fields["tokens"][fields["bos_token_id"]]]] if fields.get("add_bos_token") else []
    for piece, is_added in split_added(text, added):
        if is_added:
            ids.append(vocab[piece])
            continue
        if nfc:
            piece = unicodedata.normalize("NFC", piece)
        for word in split(piece):
            spelled = "".join(table[b] for b in word.encode())
            if whole_words and spelled in vocab:
                ids.append(vocab[spelled])
            else:
                ids.extend(vocab[t] for t in bpe_word(spelled, ranks))
    return ids


# ----------------------------------------------------------------------------------------------
# SentencePiece BPE: a vocabulary, a reference tokenizer.
# ----------------------------------------------------------------------------------------------


def learn_spm_vocab(rng: np.random.Generator, n_merges: int = 400) -> dict[str, Any]:
    """A SentencePiece-BPE vocabulary learned from random text in plain Python: <unk>, <s>, </s>,
    256 byte tokens, then pieces with score -rank (merges, best first), then single characters.
    Characters seen once only are left out (they fall back to bytes)."""
    from collections import Counter

    words = Counter()
    for line in corpus(rng):
        for w in regex.findall(r" ?\S+", " " + " ".join(line.split())):
            words[w.replace(" ", "\u2581")] += 1
    chars = Counter(c for w, n in words.items() for c in w for _ in range(n))
    alphabet = {c for c, n in chars.items() if n > 1}
    seqs = {w: [c for c in w] for w in words}
    pieces: list[str] = []
    for _ in range(n_merges):
        pairs = Counter()
        for w, seq in seqs.items():
            for a, b in zip(seq, seq[1:]):
                if a in alphabet or len(a) > 1:
                    if b in alphabet or len(b) > 1:
                        pairs[a, b] += words[w]
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        pieces.append(a + b)
        for w, seq in seqs.items():
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[w] = out
    singles = sorted(alphabet - set(pieces))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *singles, "<tool>"]
    types = [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * (len(pieces) + len(singles)), USER_DEFINED]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *(-float(r) for r in range(len(pieces))),
              *(-float(len(pieces) + r) for r in range(len(singles))), 0.0]
    return {"model": "llama", "tokens": tokens, "token_type": types, "scores": scores,
            "unk_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def reference_spm_encode(text: str, fields: dict[str, Any]) -> list[int]:
    """llama.cpp's SentencePiece tokenization: a space before every text that starts the input or
    follows a special token, spaces as "▁", then merge the adjacent pair whose concatenation is the
    highest-scoring token (the leftmost on ties) until none is a token; characters outside the
    vocabulary become their UTF-8 byte tokens."""
    tokens, scores = fields["tokens"], fields["scores"]
    vocab = {t: i for i, t in enumerate(tokens)}
    added = [t for t, k in zip(tokens, fields["token_type"]) if k in (CONTROL, USER_DEFINED)]
    space_prefix = fields.get("add_space_prefix", True)
    ids = [fields["bos_token_id"]] if fields.get("add_bos_token", True) else []
    after_special = True
    for piece, is_added in split_added(text, added):
        if is_added:
            ids.append(vocab[piece])
            after_special = True
            continue
        symbols = list(((" " if space_prefix and after_special else "") + piece).replace(" ", "\u2581"))
        while True:
            best, best_score = None, None
            for i in range(len(symbols) - 1):
                j = vocab.get(symbols[i] + symbols[i + 1])
                if j is not None and (best_score is None or scores[j] > best_score):
                    best, best_score = i, scores[j]
            if best is None:
                break
            symbols[best:best + 2] = [symbols[best] + symbols[best + 1]]
        for s in symbols:
            ids.extend([vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()])
        after_special = False
    return ids


# ----------------------------------------------------------------------------------------------
# Writing the GGUF.
# ----------------------------------------------------------------------------------------------


def write_tokenizer_gguf(path: Path, fields: dict[str, Any]) -> Path:
    """A GGUF holding `fields` as llama.cpp's tokenizer metadata, plus the least a llama model needs."""
    writer = gguf.GGUFWriter(str(path), "llama")
    n = len(fields["tokens"])
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 64), (writer.add_embedding_length, 8),
                       (writer.add_feed_forward_length, 16), (writer.add_head_count, 2), (writer.add_vocab_size, n)):
        add(value)
    writer.add_tokenizer_model(fields["model"])
    if "pre" in fields:
        writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["token_type"])
    if "scores" in fields:
        writer.add_token_scores(fields["scores"])
    if fields.get("merges"):
        writer.add_token_merges(fields["merges"])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("unk_token_id", writer.add_unk_token_id), ("pad_token_id", writer.add_pad_token_id),
                     ("add_bos_token", writer.add_add_bos_token), ("add_eos_token", writer.add_add_eos_token),
                     ("add_space_prefix", writer.add_add_space_prefix), ("chat_template", writer.add_chat_template)):
        if key in fields:
            add(fields[key])
    writer.add_tensor("token_embd.weight", np.zeros((n, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_fields(rng: np.random.Generator, pre: str, **flags: Any) -> dict[str, Any]:
    fields = learn_byte_level_vocab(rng, SPECIALS, ["<think>"], extra_words=[" zqvwk", "Zqvwk"])
    fields.update(pre=pre, bos_token_id=1, eos_token_id=2, pad_token_id=0, chat_template=CHAT_TEMPLATE, **flags)
    return fields


def texts(rng: np.random.Generator, specials: tuple[str, ...], n: int = 40, unseen: bool = True) -> list[str]:
    return [random_text(rng, int(rng.integers(1, 30)), specials, unseen) for _ in range(n)] + ["", " ", "\n"]


@pytest.fixture
def rng(request) -> np.random.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"{request.node.name}: seed {seed}")  # shown when the test fails
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------------------------
# Tests.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pre", sorted(FAMILIES))
def test_byte_level_bpe_matches_reference(tmp_path: Path, rng: np.random.Generator, pre: str) -> None:
    fields = byte_level_fields(rng, pre, add_bos_token=pre == "llama-bpe")
    tok = gguf_io.load_tokenizer(write_tokenizer_gguf(tmp_path / "t.gguf", fields))
    assert len(tok) == len(fields["tokens"])
    for text in texts(rng, tuple(SPECIALS + ["<think>"])):
        ids = tok(text)["input_ids"]
        assert ids == reference_bpe_encode(text, fields, pre), repr(text)
        body = ids[1:] if fields["add_bos_token"] else ids
        nfc = FAMILIES[pre][1]
        assert tok.decode(body) == (unicodedata.normalize("NFC", text) if nfc else text), repr(text)
    # the family's rules are what make the ids: a word that is a whole token but no merge result
    whole = tok(" zqvwk")["input_ids"][int(fields["add_bos_token"]):]
    assert (len(whole) == 1) == FAMILIES[pre][2]
    digits = tok("2024")["input_ids"][int(fields["add_bos_token"]):]
    assert len(digits) == {"smollm": 4, "qwen2": 4}.get(pre, len(digits)) and (pre not in ("smollm", "qwen2") or all(
        tok.decode([i]) in "0123456789" for i in digits))


def test_special_tokens_flags_and_chat_template(tmp_path: Path, rng: np.random.Generator) -> None:
    import jinja2

    fields = byte_level_fields(rng, "qwen2", add_bos_token=True, add_eos_token=True)
    tok = gguf_io.load_tokenizer(write_tokenizer_gguf(tmp_path / "t.gguf", fields))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    text = random_text(rng, 12)
    body = reference_bpe_encode(text, {**fields, "add_bos_token": False}, "qwen2")
    assert tok(text)["input_ids"] == [1, *body, 2]
    assert tok(text, add_special_tokens=False)["input_ids"] == body
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == unicodedata.normalize("NFC", text)
    # control tokens are whole and special; user-defined ones whole but not special
    think = fields["tokens"].index("<think>")
    assert tok("a<think>b", add_special_tokens=False)["input_ids"].count(think) == 1
    assert tok.decode([1, think, 2], skip_special_tokens=True) == "<think>"
    # ... unless the file names one its BOS / EOS / UNK / PAD: then special too (it was decoded
    # with skip_special_tokens, where transformers' reload of the checkpoint skips it)
    ud = dict(fields, token_type=[4 if i == 2 else k for i, k in enumerate(fields["token_type"])])
    tok2 = gguf_io.load_tokenizer(write_tokenizer_gguf(tmp_path / "u.gguf", ud))
    ids = tok2("a" + tok2.eos_token, add_special_tokens=False)["input_ids"]
    assert ids[-1] == 2 and tok2.decode(ids, skip_special_tokens=True) == "a"
    messages = [{"role": "system", "content": random_text(rng, 5)}, {"role": "user", "content": random_text(rng, 5)}]
    want = jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == want


def test_spm_matches_reference(tmp_path: Path, rng: np.random.Generator) -> None:
    fields = learn_spm_vocab(rng)
    tok = gguf_io.load_tokenizer(write_tokenizer_gguf(tmp_path / "s.gguf", fields))
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")
    for text in texts(rng, ("<s>", "</s>", "<tool>")):
        ids = tok(text)["input_ids"]
        assert ids == reference_spm_encode(text, fields), repr(text)
        if not any(s in text for s in ("<s>", "</s>", "<tool>")):  # each adds a space prefix after it
            assert tok.decode(ids, skip_special_tokens=True) == text, repr(text)
    # no space prefix, no BOS: as the file says
    fields.update(add_space_prefix=False, add_bos_token=False)
    tok = gguf_io.load_tokenizer(write_tokenizer_gguf(tmp_path / "s2.gguf", fields))
    for text in texts(rng, ("<s>", "<tool>"), n=10):
        assert tok(text)["input_ids"] == reference_spm_encode(text, fields), repr(text)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm", "spm"])
def test_matches_transformers_gguf_loading(tmp_path: Path, rng: np.random.Generator, pre: str) -> None:
    """transformers' own GGUF tokenizer, where it rebuilds the family: same ids on NFC text. (It
    neither looks whole words up first for Llama 3, as that tokenizer.json's `ignore_merges` does,
    so the words no merge builds are left out.)"""
    pytest.importorskip("torch")  # transformers' GGUF reader imports torch
    from transformers import AutoTokenizer

    fields = learn_spm_vocab(rng) if pre == "spm" else byte_level_fields(rng, pre, add_bos_token=False)
    path = write_tokenizer_gguf(tmp_path / "t.gguf", fields)
    ours = gguf_io.load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    specials = () if pre == "spm" else tuple(SPECIALS)
    for text in texts(rng, specials, n=20, unseen=False):
        text = unicodedata.normalize("NFC", text)
        if pre == "smollm":  # transformers leaves numbers whole for this family; llama.cpp does not
            text = regex.sub(r"\p{N}", "", text)
        if pre == "spm":
            text = text.lstrip(" ")
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], repr(text)


@pytest.mark.parametrize("kind,problem", [
    ("gpt2", {"pre": "made-up-pre"}),
    ("gpt2", {"merges": None}),
    ("bert", {}),
    ("llama", {"scores": None}),
    ("llama", {"drop_bytes": True}),
])
def test_unbuildable_tokenizer_is_an_error_with_a_remedy(tmp_path: Path, rng: np.random.Generator, kind: str,
                                                         problem: dict[str, Any]) -> None:
    fields = learn_spm_vocab(rng, n_merges=50) if kind == "llama" else byte_level_fields(rng, "qwen2")
    if kind == "bert":
        fields["model"] = "bert"
    for key, value in problem.items():
        if key == "drop_bytes":
            keep = [i for i, k in enumerate(fields["token_type"]) if k != BYTE]
            for name in ("tokens", "token_type", "scores"):
                fields[name] = [fields[name][i] for i in keep]
        elif value is None:
            fields.pop(key)
        else:
            fields[key] = value
    path = write_tokenizer_gguf(tmp_path / "bad.gguf", fields)
    with pytest.raises(gguf_io.TokenizerError) as e:
        gguf_io.load_tokenizer(path)
    message = str(e.value)
    assert str(path) in message and "Hugging Face folder" in message and "--no-tokenizer" in message


def test_saved_tokenizer_reloads_the_same(tmp_path: Path, rng: np.random.Generator) -> None:
    """What `convert` writes reloads (AutoTokenizer) with the same ids, flags and chat template."""
    from transformers import AutoTokenizer

    from jaxspec.checkpoint import save_tokenizer

    for name, fields in (("bpe", byte_level_fields(rng, "llama-bpe", add_bos_token=True)),
                         ("spm", {**learn_spm_vocab(rng, n_merges=100), "chat_template": CHAT_TEMPLATE})):
        tok = gguf_io.load_tokenizer(write_tokenizer_gguf(tmp_path / f"{name}.gguf", fields))
        save_tokenizer(tok, tmp_path / name)
        config = json.loads((tmp_path / name / "tokenizer_config.json").read_text())
        assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # a class every transformers knows
        again = AutoTokenizer.from_pretrained(tmp_path / name)
        for text in texts(rng, ("<|im_start|>", "<s>"), n=10):
            assert again(text)["input_ids"] == tok(text)["input_ids"], repr(text)
            assert again.decode(tok(text)["input_ids"]) == tok.decode(tok(text)["input_ids"])
        assert again.chat_template == CHAT_TEMPLATE
        assert (again.bos_token, again.eos_token) == (tok.bos_token, tok.eos_token)


# ----------------------------------------------------------------------------------------------
# The real SmolLM2 file (network; see jaxspec.fetch).
# ----------------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_smollm2_tokenizer() -> None:
    """SmolLM2-135M-Instruct's GGUF tokenizer behaves as its Hugging Face tokenizer does: special
    tokens 0-2, digits one by one, its chat template with the default system prompt."""
    from jaxspec.fetch import fetch_gguf

    tok = gguf_io.load_tokenizer(fetch_gguf("smollm2-135m-instruct"))
    assert len(tok) == 49152
    assert [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    ids = tok("In 2024")["input_ids"]
    assert [tok.decode([i]) for i in ids] == ["In", " ", "2", "0", "2", "4"]
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    text = "Ünïcode ✓ 日本語 🤖\n\tdone, don't WE'LL?  <|im_end|>"
    assert tok.decode(tok(text)["input_ids"]) == text
    pytest.importorskip("torch")  # transformers' GGUF reader imports torch
    from transformers import AutoTokenizer

    path = fetch_gguf("smollm2-135m-instruct")
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert tok(text)["input_ids"] == theirs(text)["input_ids"]
