"""The server's streamed text. The engine decodes a chunk's new tokens of one source (draft or
target) at once; a client must get what decoding them one token at a time gives: the same text
at every chunk's end, the same draft segments, the same final text, which is the tokenizer's
decoding of the tokens. Checked on random tokens (byte-level tokens that end inside characters,
SentencePiece pieces with their leading spaces, words) cut into random chunks."""
import random

import numpy as np
import pytest

from jaxspec.serving import SamplingOptions, Sequence, ServingEngine
from serverkit import served_model
from test_server_paged import _byte_level_model
from test_tokenizer_gguf import learn_spm_vocab, write_tokenizer_gguf
from tiny import tiny_model


def _spm_model(tmp_path):
    from jaxspec.gguf_io import GGUFFile
    fields = learn_spm_vocab(np.random.default_rng(3))
    tok = GGUFFile(write_tokenizer_gguf(tmp_path / "spm.gguf", fields)).tokenizer()
    m = tiny_model(seed=1, vocab=len(tok), eos_token_ids=(tok.eos_token_id,))
    m.tokenizer = tok
    return m


def _stream(engine, tokens, flags, cuts, stop=None):
    """Delivers ``tokens`` in chunks ending at ``cuts`` (the last one finishing the sequence):
    ``(text emitted by each chunk's end, draft segments merged, final text, finish reason)``."""
    s = Sequence([1, 2], SamplingOptions(max_tokens=len(tokens), stop=stop))
    events = []
    s._emit = events.append
    emitted, start = [], 0
    for end in cuts:
        engine._deliver(s, tokens[start:end], flags[start:end], device_done=end == len(tokens))
        emitted.append("".join(e["text"] for e in events if e["type"] == "delta"))
        start = end
        if s.finish_reason is not None:
            break
    segs = []
    for e in events:
        for text, f in e.get("segments", ()):
            if segs and segs[-1][1] == f:
                segs[-1][0] += text
            elif text:
                segs.append([text, f])
    return emitted, segs, s.text, s.finish_reason


@pytest.mark.parametrize("kind", ["byte", "spm", "words"])
def test_chunks_stream_the_text_of_tokens_one_by_one(kind, tmp_path):
    model = {"byte": _byte_level_model, "words": lambda: served_model(eos=True),
             "spm": lambda: _spm_model(tmp_path)}[kind]()
    engine = ServingEngine(model, max_batch=1, max_len=64)  # (not started: its host side only)
    tok = model.tokenizer
    rng = random.Random()
    specials = set(tok.all_special_ids)
    normal = [t for t in range(len(tok)) if t not in specials]
    if kind == "spm":  # (byte pieces out of their characters are invalid UTF-8, whose
        # replacement characters differ by decoding window whichever way it is streamed: they
        # come from encoded text, whole)
        normal = [t for t in normal if not tok.convert_ids_to_tokens(t).startswith("<0x")]
    for trial in range(60):
        n = rng.randint(1, 40)
        encoded = kind != "words" and trial % 2
        if encoded:  # a text's tokens: characters of several bytes (or pieces)
            text = "".join(rng.choice(["a", "é", "€", "😀", " ", " the", "ab"]) for _ in range(n))
            tokens = tok.encode(text, add_special_tokens=False)
            if kind == "byte":  # (SentencePiece's byte pieces: whole characters, see above)
                tokens = tokens[:n]
        else:
            tokens = [rng.choice(normal) for _ in range(n)]
        eos = trial % 5 == 0  # the sequence ends with its stop token (not in the text)
        if eos:
            tokens = tokens + [engine.stop_ids[0]]
        n = len(tokens)
        flags = [rng.random() < 0.4 for _ in range(n)] if trial % 3 else [False] * n
        cuts = sorted(set(rng.sample(range(1, n), min(n - 1, rng.randint(0, 6))) + [n]))
        one_by_one = list(range(1, n + 1))
        got = _stream(engine, tokens, flags, cuts)
        want = _stream(engine, tokens, flags, one_by_one)
        assert got[0] == [want[0][c - 1] for c in cuts], (tokens, flags, cuts)
        assert got[1:] == want[1:], (tokens, flags, cuts)
        assert got[2] == tok.decode(tokens[:-1] if eos else tokens, skip_special_tokens=True,
                                    clean_up_tokenization_spaces=False)
        assert got[3] == ("stop" if eos else "length")


def test_a_stop_string_cuts_where_it_would_one_by_one():
    model = served_model(eos=False)
    engine = ServingEngine(model, max_batch=1, max_len=64)
    rng = random.Random()
    words = [t for t in range(len(model.tokenizer)) if t not in set(model.tokenizer.all_special_ids)]
    for _ in range(30):
        tokens = [rng.choice(words) for _ in range(rng.randint(4, 30))]
        text = model.tokenizer.decode(tokens, skip_special_tokens=True,
                                      clean_up_tokenization_spaces=False)
        stop = [text[len(text) // 2:len(text) // 2 + 3]] if len(text) > 8 else None
        flags = [rng.random() < 0.5 for _ in tokens]
        cuts = sorted(set(rng.sample(range(1, len(tokens)), 3) + [len(tokens)]))
        got = _stream(engine, tokens, flags, cuts, stop)
        want = _stream(engine, tokens, flags, list(range(1, len(tokens) + 1)), stop)
        assert got[1:] == want[1:], (tokens, stop)
        if stop and stop[0].strip():
            assert got[3] == "stop" and stop[0] not in got[2]
