"""Shared pieces of the server tests (tests/test_server_*.py): a tiny random model with a tiny
word-level tokenizer and chat template, one engine configuration (every file that uses it reuses
the compiled programs through the run's on-disk XLA cache), SSE parsing and raw loopback sockets.
"""

import json
import socket
import time

import numpy as np

SPECIAL = ["<unk>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
WORDS = (list("abcdefghijklmnopqrstuvwxyz") + [str(i) for i in range(10)] +
         "the cat dog sat on mat hello world robot story tell me a short about sea sky red blue "
         "green is was and".split())

# one engine configuration for the server test files (small: compiles in seconds)
# (compact_rows: tests/test_serving_compact.py; off here, so that no test waits on background
# compiles of smaller batches)
ENGINE_KW = dict(max_batch=4, max_len=96, rounds_per_chunk=4, max_queue=64, prefill_chunk=64,
                 compact_rows=False)


def tiny_tokenizer(eos: bool = True):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {}
    for w in SPECIAL + WORDS:
        vocab.setdefault(w, len(vocab))
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    kw = {"eos_token": "<eos>"} if eos else {}
    tok = PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>",
                                  additional_special_tokens=SPECIAL[2:], **kw)
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return tok


def served_model(seed: int = 0, eos: bool = True, **kw):
    """A tiny random llama with the word tokenizer; ``eos=False``: no stop token at all (a
    sequence runs to its budget)."""
    from tiny import tiny_model
    m = tiny_model(seed=seed, scale=3.0, eos_token_ids=(1,) if eos else (), **kw)
    m.tokenizer = tiny_tokenizer(eos=eos)
    return m


def prompts(k: int, seed: int, lo: int = 3, hi: int = 20) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi)))) for _ in range(k)]


def sse_data(text: str) -> list:
    """The ``data:`` payloads of a server-sent event stream: parsed JSON, or the string
    ``"[DONE]"``."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            d = line[6:]
            out.append(d if d == "[DONE]" else json.loads(d))
    return out


def metrics(url: str, headers=None) -> dict:
    import httpx
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def is_openai_error(status: int, body: bytes) -> bool:
    """An OpenAI-style error body: ``{"error": {"message": str, "type": str, "param", "code"}}``."""
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    if not isinstance(obj, dict) or set(obj) != {"error"} or not isinstance(obj["error"], dict):
        return False
    e = obj["error"]
    return (set(e) == {"message", "type", "param", "code"} and isinstance(e["message"], str)
            and bool(e["message"]) and isinstance(e["type"], str)
            and (e["param"] is None or isinstance(e["param"], str))
            and (e["code"] is None or isinstance(e["code"], str)))


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[int | None, dict, bytes,
                                                                         bool]:
    """Reads one HTTP/1.1 response (status, lower-cased headers, body) and whether the server
    then closed the connection; status None when it closed without answering."""
    sock.settimeout(timeout)
    deadline = time.time() + timeout
    buf = b""
    closed = False
    while b"\r\n\r\n" not in buf:
        if time.time() > deadline:
            raise TimeoutError("no response headers")
        try:
            part = sock.recv(65536)
        except ConnectionResetError:
            part = b""
        if not part:
            closed = True
            break
        buf += part
    if b"\r\n\r\n" not in buf:
        return None, {}, buf, True
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length", "0"))
    while len(rest) < n and not closed:
        if time.time() > deadline:
            raise TimeoutError("the response body did not arrive")
        part = sock.recv(65536)
        if not part:
            closed = True
            break
        rest += part
    if not closed:  # did the server close after the response?
        sock.settimeout(0.5)
        try:
            closed = sock.recv(1) == b""
        except (TimeoutError, socket.timeout):
            closed = False
        except ConnectionResetError:
            closed = True
    return status, headers, rest[:n], closed


def wait_closed(sock: socket.socket, timeout: float) -> float | None:
    """Seconds until the peer closes the connection (reading and dropping what it sends), or
    None if it stays open for ``timeout`` seconds."""
    t0 = time.time()
    sock.settimeout(0.2)
    while time.time() - t0 < timeout:
        try:
            if sock.recv(65536) == b"":
                return time.time() - t0
        except (TimeoutError, socket.timeout):
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.time() - t0
    return None
