"""Request limits of the OpenAI-compatible server (`jaxspec.server.ServerLimits`): body size (413
from the Content-Length before a byte is read, and for a chunked body as it arrives), the read
deadline (slowloris senders of headers or body, idle and kept-alive connections are closed on
time while other clients are served; a slow but in-time sender and a long response are not cut),
``n x max_tokens``, stop strings, messages, prompts, sequences past the queue, and a huge prompt
tokenized off the event loop. Every refusal is an OpenAI-style error body."""

import argparse
import asyncio
import dataclasses
import json
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from jaxspec.server import BackgroundServer, ServerLimits, add_arguments  # noqa: E402
from jaxspec.serving import ServingEngine  # noqa: E402

from serverkit import (ENGINE_KW, WORDS, connect, is_openai_error, read_response,  # noqa: E402
                       served_model, sse_data, wait_closed)

pytestmark = pytest.mark.timeout(240)

READ_TIMEOUT = 2.0
LIMITS = ServerLimits(max_body_bytes=4096, request_read_timeout=READ_TIMEOUT,
                      max_generation_tokens=50, max_prompts=2, max_messages=3, max_stop=2,
                      max_stop_chars=8)


@pytest.fixture(scope="module")
def engine():
    e = ServingEngine(served_model(), **ENGINE_KW).start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def server(engine):
    s = BackgroundServer(engine, "tiny", limits=LIMITS)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _post(client, path, body):
    return client.post(path, content=json.dumps(body).encode(),
                       headers={"Content-Type": "application/json"})


def _err(r, status, text):
    assert r.status_code == status, r.text
    assert is_openai_error(r.status_code, r.content), r.text
    assert text in r.json()["error"]["message"], r.text
    return r.json()["error"]


# ----------------------------------------------------------------------------- flags
def test_help_documents_every_limit():
    text = add_arguments(argparse.ArgumentParser(prog="serve")).format_help()
    for f in dataclasses.fields(ServerLimits):
        flag = "--" + f.name.replace("_", "-")
        assert flag in text, flag
        parsed = getattr(add_arguments(argparse.ArgumentParser()).parse_args([]), f.name)
        assert parsed == f.default, f.name
    for flag in ("--api-key", "JAXSPEC_API_KEY", "--metrics-public", "--page-public",
                 "--shutdown-timeout", "--max-queue", "Retry-After"):
        assert flag in text, flag
    a = add_arguments(argparse.ArgumentParser()).parse_args(
        ["--max-body-bytes", "100", "--request-read-timeout", "1.5", "--max-stop", "3"])
    lim = ServerLimits.from_args(a)
    assert (lim.max_body_bytes, lim.request_read_timeout, lim.max_stop) == (100, 1.5, 3)
    for bad in (["--max-body-bytes", "0"], ["--request-read-timeout", "-1"],
                ["--max-stop", "x"], ["--request-read-timeout", "nan"]):
        with pytest.raises(SystemExit):
            add_arguments(argparse.ArgumentParser()).parse_args(bad)
    with pytest.raises(ValueError, match="max_prompts"):
        ServerLimits(max_prompts=0)


# ----------------------------------------------------------------------------- body size
def _padded(body: dict, size: int) -> bytes:
    raw = json.dumps(body).encode()
    return raw + b" " * (size - len(raw))


def test_body_size_limit(server, client):
    ok = {"prompt": "hello world", "max_tokens": 2, "temperature": 0}
    r = client.post("/v1/completions", content=_padded(ok, 4096))
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", content=_padded(ok, 4097))
    err = _err(r, 413, "4097 bytes; at most 4096")
    assert err["code"] == "request_too_large"
    # a Content-Length past the limit: answered before any byte of the body is sent
    with connect(server.port) as s:
        t0 = time.time()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n")
        status, headers, body, closed = read_response(s)
        assert status == 413 and is_openai_error(status, body) and closed
        assert b"1000000000 bytes" in body
        assert time.time() - t0 < 2.0


def _chunked_headers(path="/v1/completions"):
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def test_chunked_body_counted_as_it_arrives(server):
    ok = json.dumps({"prompt": "hello world", "max_tokens": 2, "temperature": 0}).encode()
    with connect(server.port) as s:  # a chunked body under the limit is served
        s.sendall(_chunked_headers())
        for i in range(0, len(ok), 7):
            s.sendall(_chunk(ok[i:i + 7]))
        s.sendall(b"0\r\n\r\n")
        status, _, body, _ = read_response(s)
        assert status == 200, body
        assert json.loads(body)["choices"][0]["finish_reason"] in ("stop", "length")
    # past the limit: 413 as soon as the count passes it, though the body never ends
    with connect(server.port) as s:
        s.sendall(_chunked_headers())
        for _ in range(5):
            s.sendall(_chunk(b" " * 1000))
        s.sendall(_chunk(b" " * 200))  # 5200 bytes sent, no final chunk
        status, _, body, closed = read_response(s, timeout=5)
        assert status == 413 and is_openai_error(status, body) and closed, body


# ----------------------------------------------------------------------------- slow clients
class _Prober:
    """Sends small requests in a thread and records their latencies (the server must keep
    serving while slow clients hang on)."""

    def __init__(self, url, body):
        self.url, self.body = url, body
        self.latencies, self.failures = [], []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        with httpx.Client(base_url=self.url, timeout=10) as c:
            for _ in range(400):  # bounded
                if self.stop.is_set():
                    break
                t0 = time.time()
                try:
                    r = c.post("/v1/completions", json=self.body)
                    if r.status_code != 200:
                        self.failures.append(r.text)
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                self.latencies.append(time.time() - t0)
                time.sleep(0.05)

    def finish(self):
        self.stop.set()
        self.thread.join(timeout=20)
        return self.latencies, self.failures


def _answered_or_closed(sock) -> bool:
    """Whether the server sent something (a 408) or closed the connection (not consuming)."""
    try:
        sock.setblocking(False)
        try:
            sock.recv(1, socket.MSG_PEEK)
            return True  # data, or b"": closed
        finally:
            sock.setblocking(True)
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_slow_senders_are_cut_off_while_others_are_served(server):
    """Clients that send a byte per second: 12 of them dribble request headers, one a body (its
    headers sent whole), one the next request on a kept-alive connection; one sends nothing. Each
    is closed about the read timeout after its first byte (a 408 where it sent any), never
    before; other requests keep being served the whole time."""
    prober = _Prober(server.url, {"prompt": "hello world", "max_tokens": 2, "temperature": 0})
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: 60\r\n\r\n")
    socks = {f"headers{i}": connect(server.port) for i in range(12)}
    socks["body"] = connect(server.port)
    socks["kept_alive"] = connect(server.port)
    idle = connect(server.port)
    t_idle = time.time()
    closed_at = {}
    try:
        # the kept-alive connection: one whole request first
        socks["kept_alive"].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, _, closed = read_response(socks["kept_alive"])
        assert status == 200 and not closed
        t0 = time.time()
        socks["body"].sendall(request)
        step = 0
        while time.time() - t0 < 3 * READ_TIMEOUT + 1 and len(closed_at) < len(socks):
            if time.time() >= t0 + step:  # one byte per second on each open connection
                for name, s in socks.items():
                    if name not in closed_at:
                        try:
                            s.sendall(b" " if name == "body" else request[step:step + 1])
                        except OSError:
                            pass
                step += 1
            for name, s in socks.items():
                if name not in closed_at and _answered_or_closed(s):
                    closed_at[name] = time.time() - t0
            time.sleep(0.05)
        idle_closed = wait_closed(idle, READ_TIMEOUT + 2 - (time.time() - t_idle))
        idle_closed = None if idle_closed is None else time.time() - t_idle
        # what they were told: 408 in OpenAI's format
        for name in ("body", "headers0", "kept_alive"):
            status, _, body, closed = read_response(socks[name], timeout=2)
            assert status == 408 and is_openai_error(status, body) and closed, (name, body)
    finally:
        latencies, failures = prober.finish()
        for s in list(socks.values()) + [idle]:
            s.close()
    assert set(closed_at) == set(socks), closed_at
    assert READ_TIMEOUT - 0.3 < min(closed_at.values()), closed_at
    assert max(closed_at.values()) < READ_TIMEOUT + 1.0, closed_at
    assert idle_closed is not None and READ_TIMEOUT - 0.3 < idle_closed < READ_TIMEOUT + 1.0
    assert not failures, failures[:3]
    assert len(latencies) >= 10 and max(latencies) < 1.5, (len(latencies), max(latencies))


def test_slow_but_in_time_sender_and_long_response_are_served(server, engine):
    body = json.dumps({"prompt": "hello world", "max_tokens": 2, "temperature": 0}).encode()
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(body)) + body
    with connect(server.port) as s:  # 5 pieces over ~1.2 s: within the 2 s deadline
        for i in range(5):
            s.sendall(raw[i * len(raw) // 5:(i + 1) * len(raw) // 5])
            time.sleep(0.3)
        status, _, out, _ = read_response(s)
        assert status == 200, out
    # the deadline is for reading the request: a response longer than it is not cut
    engine.pause_admission()
    try:
        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as ac:
                task = asyncio.create_task(ac.post("/v1/completions", json={
                    "prompt": "tell me a story", "max_tokens": 8, "temperature": 0,
                    "stream": True}))
                await asyncio.sleep(READ_TIMEOUT + 1.0)
                engine.resume_admission()
                return await task
        r = asyncio.run(main())
    finally:
        engine.resume_admission()
    assert r.status_code == 200
    events = sse_data(r.text)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in (
        "stop", "length")


# ----------------------------------------------------------------------------- request limits
def test_generation_token_limit(client):
    _err(_post(client, "/v1/completions", {"prompt": "a b", "n": 2, "max_tokens": 30}), 400,
         "at most 50")
    e = _err(_post(client, "/v1/completions", {"prompt": ["a b", "c"], "n": 2,
                                               "max_tokens": 20}), 400, "80 completion tokens")
    assert e["param"] == "max_tokens"
    r = _post(client, "/v1/completions", {"prompt": "a b", "max_tokens": 50, "temperature": 0})
    assert r.status_code == 200, r.text
    r = _post(client, "/v1/completions", {"prompt": ["a b", "c"], "n": 1, "max_tokens": 25,
                                          "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    # chat without max_tokens asks for the room its prompt leaves (96 - prompt > 50)
    msgs = [{"role": "user", "content": "hello"}]
    _err(_post(client, "/v1/chat/completions", {"messages": msgs}), 400, "at most 50")
    r = _post(client, "/v1/chat/completions", {"messages": msgs, "max_tokens": 10})
    assert r.status_code == 200, r.text


def test_stop_message_and_prompt_limits(client):
    base = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
    _err(_post(client, "/v1/completions", {**base, "stop": ["a", "b", "c"]}), 400, "at most 2")
    _err(_post(client, "/v1/completions", {**base, "stop": "123456789"}), 400,
         "9 characters; at most 8")
    _err(_post(client, "/v1/completions", {**base, "stop": ["ok", "x" * 100]}), 400,
         "at most 8")
    assert _post(client, "/v1/completions", {**base, "stop": ["a", "12345678"]}).status_code == 200
    msg = {"role": "user", "content": "hi"}
    _err(_post(client, "/v1/chat/completions", {"messages": [msg] * 4, "max_tokens": 2}), 400,
         "4 messages; at most 3")
    assert _post(client, "/v1/chat/completions",
                 {"messages": [msg] * 3, "max_tokens": 2}).status_code == 200
    _err(_post(client, "/v1/completions", {**base, "prompt": ["a", "b", "c"]}), 400,
         "3 prompts; at most 2")
    _err(_post(client, "/v1/completions", {**base, "prompt": [[5], [6], [7]]}), 400,
         "3 prompts; at most 2")
    r = _post(client, "/v1/completions", {**base, "prompt": [5, 6, 7, 8, 9]})  # one prompt
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_more_sequences_than_the_queue_holds(engine):
    s = BackgroundServer(engine, "tiny", limits=ServerLimits(max_prompts=64))
    try:
        n = engine.B
        k = engine.max_queue // n + 1
        r = httpx.post(s.url + "/v1/completions", timeout=30, json={
            "prompt": ["hello"] * k, "n": n, "max_tokens": 1})
        _err(r, 400, f"makes {k * n} sequences")
        r = httpx.post(s.url + "/v1/completions", timeout=60, json={
            "prompt": ["hello"] * (k - 1), "n": n, "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200 and len(r.json()["choices"]) == (k - 1) * n
    finally:
        s.close()


def test_huge_prompt_is_tokenized_off_the_event_loop(engine):
    """A prompt that takes the tokenizer seconds leaves the server answering meanwhile."""
    s = BackgroundServer(engine, "tiny", limits=ServerLimits(max_body_bytes=16 << 20))
    try:
        words = np.random.default_rng(0).choice(WORDS, size=400_000)
        body = json.dumps({"prompt": " ".join(words), "max_tokens": 1}).encode()
        out = {}

        def big():
            t0 = time.time()
            out["r"] = httpx.post(s.url + "/v1/completions", content=body, timeout=120)
            out["t"] = time.time() - t0
        th = threading.Thread(target=big)
        th.start()
        worst = 0.0
        with httpx.Client(base_url=s.url, timeout=30) as c:
            for _ in range(2000):  # bounded
                if not th.is_alive():
                    break
                t0 = time.time()
                assert c.get("/health").status_code == 200
                worst = max(worst, time.time() - t0)
                time.sleep(0.02)
        th.join(timeout=120)
        _err(out["r"], 400, "maximum context length is 96")
        assert worst < min(0.5, out["t"] / 2), (worst, out["t"])
    finally:
        s.close()
