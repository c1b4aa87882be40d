"""Graceful shutdown of the OpenAI-compatible server: once it starts (SIGTERM / Ctrl-C, or
`Shutdown.request`), new requests get 503 in OpenAI's format, running ones finish if they can
within ``--shutdown-timeout`` seconds and are otherwise ended (a final error chunk for a stream,
503 otherwise, their sequences cancelled), and the server exits; nothing hangs. In-process tests
hold requests in the queue (`pause_admission`) to control timing exactly; one test runs
``python -m jaxspec serve`` on a tiny checkpoint and sends it SIGTERM mid-stream."""

import argparse
import asyncio
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import jaxspec  # noqa: E402
from jaxspec.server import BackgroundServer, add_arguments, build_engine  # noqa: E402

from serverkit import is_openai_error, metrics, served_model, sse_data  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# the served engine, in-process and in the subprocess alike (so both compile the same programs,
# once, through the run's XLA cache): no stop token, so a sequence runs to its budget, and a long
# context, so a long one takes seconds
SERVE_ARGS = ["--max-batch", "2", "--max-len", "8192", "--rounds-per-chunk", "1",
              "--warmup-prefill", "16", "--prefill-chunk", "64", "--max-queue", "16"]
KEY = "shutdown-test-key"


@pytest.fixture(scope="module")
def model():
    return served_model(eos=False, ctx=8192)


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "tiny"
    jaxspec.save(model, path)
    return path


@pytest.fixture(scope="module")
def engine(model, checkpoint):
    """The engine `jaxspec serve` builds from these arguments (the model in memory, as the
    checkpoint would load it)."""
    a = add_arguments(argparse.ArgumentParser()).parse_args(["--model", str(checkpoint)]
                                                            + SERVE_ARGS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jaxspec, "load", lambda path, dtype=None, mesh=None: model)
        e, _ = build_engine(a)
    e.start()
    yield e
    e.stop()


async def _until(cond, timeout=10.0, what="condition"):
    t0 = time.time()
    while not cond():
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _draining(url) -> bool:
    return metrics(url).get("jaxspec_draining") == 1


def _refused(r):
    assert r.status_code == 503 and is_openai_error(r.status_code, r.content), r.text
    assert r.json()["error"]["code"] == "shutting_down"


def test_running_requests_finish_new_ones_are_refused(engine):
    srv = BackgroundServer(engine, "tiny", shutdown_timeout=30)
    engine.pause_admission()
    try:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as ac:
                stream = asyncio.create_task(ac.post("/v1/completions", json={
                    "prompt": "hello world", "max_tokens": 6, "temperature": 0,
                    "stream": True}))
                plain = asyncio.create_task(ac.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                    "temperature": 0}))
                await _until(lambda: engine.metrics()["waiting"] == 2, what="2 queued")
                srv.shutdown()
                await _until(lambda: _draining(srv.url), what="draining")
                async with httpx.AsyncClient(base_url=srv.url, timeout=10) as other:
                    _refused(await other.post("/v1/completions", json={"prompt": "a"}))
                    _refused(await other.get("/health"))
                    _refused(await other.get("/v1/models"))
                    assert (await other.get("/metrics")).status_code == 200
                t = time.time()
                engine.resume_admission()
                return await stream, await plain, t
        stream, plain, t_resume = asyncio.run(main())
        events = sse_data(stream.text)
        assert stream.status_code == 200 and events[-1] == "[DONE]", stream.text
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) != ""
        assert plain.status_code == 200, plain.text
        assert plain.json()["usage"]["completion_tokens"] == 5
        # the server exits as soon as they are done, long before the 30 s deadline
        srv.thread.join(timeout=10)
        assert not srv.thread.is_alive()
        assert time.time() - t_resume < 10
        sd = srv.app.state.shutdown
        assert (sd.finished_in_time, sd.cut_off) == (2, 0)
    finally:
        engine.resume_admission()
        srv.close()


def test_deadline_ends_the_rest_with_an_error(engine):
    srv = BackgroundServer(engine, "tiny", shutdown_timeout=1.0)
    before = engine.metrics()
    engine.pause_admission()
    out = {}

    def openai_stream():  # the official client sees the final error chunk as an APIError
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        try:
            list(c.chat.completions.create(model="tiny", max_tokens=4, stream=True,
                                           messages=[{"role": "user", "content": "hi"}]))
            out["openai"] = "finished"
        except openai.APIError as e:
            out["openai"] = e
    try:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as ac:
                th = threading.Thread(target=openai_stream)
                th.start()
                stream = asyncio.create_task(ac.post("/v1/completions", json={
                    "prompt": "hello world", "max_tokens": 6, "stream": True}))
                plain = asyncio.create_task(ac.post("/v1/completions", json={
                    "prompt": "hello world", "max_tokens": 6, "n": 2}))
                await _until(lambda: engine.metrics()["waiting"] == 4, what="4 queued")
                t0 = time.time()
                srv.shutdown()
                r = await stream, await plain, time.time() - t0
                th.join(timeout=30)
                return r
        stream, plain, elapsed = asyncio.run(main())
        assert 0.9 < elapsed < 5, elapsed
        events = sse_data(stream.text)
        assert stream.status_code == 200 and events[-1] == "[DONE]", stream.text
        assert is_openai_error(0, json.dumps(events[-2]).encode()), events
        assert events[-2]["error"]["code"] == "shutting_down"
        _refused(plain)
        assert isinstance(out["openai"], openai.APIError) and "shut down" in str(out["openai"])
        srv.thread.join(timeout=10)
        assert not srv.thread.is_alive()
        assert srv.app.state.shutdown.cut_off == 3
        # their sequences were cancelled: nothing is left to run once admission resumes
        engine.resume_admission()
        t0 = time.time()
        while time.time() - t0 < 10:
            m = engine.metrics()
            if m["waiting"] == 0 and m["slots_busy"] == 0:
                break
            time.sleep(0.02)
        assert m["waiting"] == 0 and m["slots_busy"] == 0
        assert m["finished_cancelled"] - before["finished_cancelled"] == 4
        assert m["generation_tokens"] == before["generation_tokens"]
    finally:
        engine.resume_admission()
        srv.close()


def test_second_request_ends_the_wait(engine):
    srv = BackgroundServer(engine, "tiny", shutdown_timeout=60)
    engine.pause_admission()
    try:
        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as ac:
                stream = asyncio.create_task(ac.post("/v1/completions", json={
                    "prompt": "hello", "max_tokens": 4, "stream": True}))
                await _until(lambda: engine.metrics()["waiting"] == 1, what="queued")
                srv.shutdown()
                await _until(lambda: _draining(srv.url), what="draining")
                t0 = time.time()
                srv.shutdown()  # a second Ctrl-C
                return await stream, time.time() - t0
        stream, elapsed = asyncio.run(main())
        assert elapsed < 2, elapsed
        assert sse_data(stream.text)[-2]["error"]["code"] == "shutting_down"
        srv.thread.join(timeout=10)
        assert not srv.thread.is_alive()
    finally:
        engine.resume_admission()
        srv.close()


# ----------------------------------------------------------------------------- a real process
class _Stream:
    """A streaming completion read in a thread: its events with arrival times."""

    def __init__(self, url, body, headers):
        self.events: list[tuple[float, object]] = []
        self.status = None
        self.error = None
        self.thread = threading.Thread(target=self.run, args=(url, body, headers), daemon=True)
        self.thread.start()

    def run(self, url, body, headers):
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                              timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        d = line[6:]
                        self.events.append((time.time(), d if d == "[DONE]" else json.loads(d)))
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def wait_events(self, n, timeout):
        t0 = time.time()
        while len(self.events) < n and time.time() - t0 < timeout and self.error is None:
            time.sleep(0.01)
        assert len(self.events) >= n, (self.error, self.events[-3:])


def test_sigterm_on_a_real_server_process(checkpoint, tmp_path):
    root = pathlib.Path(jaxspec.__file__).resolve().parent.parent
    env = dict(os.environ, JAXSPEC_API_KEY=KEY,
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    timeout = 3.0
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxspec", "serve", "--model", str(checkpoint), "--host",
         "127.0.0.1", "--port", "0", "--shutdown-timeout", str(timeout), *SERVE_ARGS],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    port: list[int] = []

    def read_log():
        for line in proc.stderr:
            log.append(line)
            m = re.search(r"serving .* on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port.append(int(m.group(1)))
    threading.Thread(target=read_log, daemon=True).start()
    try:
        t0 = time.time()
        while not port:
            assert proc.poll() is None, "".join(log[-30:])
            assert time.time() - t0 < 240, "the server did not start:\n" + "".join(log[-30:])
            time.sleep(0.1)
        url = f"http://127.0.0.1:{port[0]}"
        auth = {"Authorization": f"Bearer {KEY}"}
        # The port listens before the model loads; the app answers once uvicorn has started.
        while True:
            try:
                assert httpx.get(url + "/health", timeout=30).status_code == 200
                break
            except httpx.TransportError:
                assert proc.poll() is None, "".join(log[-30:])
                assert time.time() - t0 < 240, "the server did not start:\n" + "".join(log[-30:])
                time.sleep(0.1)
        assert httpx.get(url + "/v1/models").status_code == 401  # the key from the environment
        # a long stream (8000 tokens: many seconds) and a short one (40 tokens)
        long = _Stream(url, {"prompt": "hello", "max_tokens": 8000, "temperature": 0,
                             "stream": True}, auth)
        long.wait_events(2, 60)
        short = _Stream(url, {"prompt": "the cat", "max_tokens": 40, "temperature": 0,
                              "stream": True, "return_token_ids": True}, auth)
        short.wait_events(1, 60)
        t_sig = time.time()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        r = httpx.post(url + "/v1/completions", json={"prompt": "a"}, headers=auth, timeout=10)
        _refused(r)
        short.thread.join(timeout=30)
        long.thread.join(timeout=30)
        rc = proc.wait(timeout=60)
        t_exit = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    text = "".join(log)
    assert rc == 0, text[-3000:]
    assert re.search(r"shutting down: refusing new requests; 2 in flight", text), text[-3000:]
    # the short stream finished normally, all 40 tokens
    assert short.error is None and short.status == 200
    assert short.events[-1][1] == "[DONE]"
    last = short.events[-2][1]["choices"][0]
    assert last["finish_reason"] == "length" and len(last["token_ids"]) == 40
    # the long one was ended at the deadline with a final error chunk
    assert long.error is None and long.status == 200
    assert long.events[-1][1] == "[DONE]"
    t_err, err = long.events[-2]
    assert err["error"]["code"] == "shutting_down", err
    assert not any("choices" in e and e["choices"][0]["finish_reason"]
                   for _, e in long.events[:-2]), "the long stream finished before the deadline"
    assert timeout - 0.5 < t_err - t_sig < timeout + 3, t_err - t_sig
    assert t_exit - t_sig < timeout + 20
