"""Engine faults through the HTTP layer: an exception raised while a sequence is admitted (the
engine's ``fault_hook``) fails exactly the requests whose sequences it hit, with a 500 in OpenAI's
error format (an error chunk for a stream), frees their slots and leaves the server serving; every
other request in the same batch completes with the text it gets when run alone. The metrics add
up (sequences submitted = stop + length + cancelled + error). An engine that is not running gives
503."""

import asyncio
import json
import logging

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from jaxspec.server import BackgroundServer  # noqa: E402
from jaxspec.serving import SamplingOptions, Sequence, ServingEngine  # noqa: E402

from serverkit import (ENGINE_KW, WORDS, is_openai_error, metrics, served_model,  # noqa: E402
                       sse_data)

pytestmark = pytest.mark.timeout(240)

MARK = "robot"  # requests whose prompt holds this word fail at admission


@pytest.fixture(scope="module")
def engine():
    e = ServingEngine(served_model(), **ENGINE_KW).start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def server(engine):
    s = BackgroundServer(engine, "tiny")
    yield s
    s.close()


class Injected(RuntimeError):
    pass


def _marked_hook(engine, exc=Injected, message="injected admission fault"):
    mark = engine.tokenizer.convert_tokens_to_ids(MARK)
    hits = []

    def hook(seq):
        if mark in seq.prompt_ids:
            hits.append(seq)
            raise exc(message)
    return hook, hits


def _finished_total(m) -> float:
    return sum(m.get(f'jaxspec_sequences_finished_total{{reason="{r}"}}', 0)
               for r in ("stop", "length", "cancelled", "error"))


def _wait_idle(url):
    import time
    deadline = time.time() + 30
    while time.time() < deadline:
        m = metrics(url)
        if m["jaxspec_slots_busy"] == 0 and m["jaxspec_queue_depth"] == 0 and \
                _finished_total(m) == m["jaxspec_sequences_submitted_total"]:
            return m
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {m}")


async def _send(ac, path, body):
    r = await ac.post(path, json=body)
    if body.get("stream") and r.status_code == 200:
        return r.status_code, sse_data(r.text)
    return r.status_code, r.content


def _text_of(path, status, out):
    """(texts per choice index) of a successful answer."""
    assert status == 200, out
    chat = path.endswith("chat/completions")
    if isinstance(out, list):  # a stream
        assert out[-1] == "[DONE]" and not any("error" in e for e in out[:-1]), out
        texts = {}
        for e in out[:-1]:
            for c in e["choices"]:
                piece = (c["delta"].get("content") or "") if chat else c["text"]
                texts[c["index"]] = texts.get(c["index"], "") + piece
        return texts
    obj = json.loads(out)
    return {c["index"]: c["message"]["content"] if chat else c["text"] for c in obj["choices"]}


def test_admission_faults_fail_only_their_requests(engine, server):
    rng = np.random.default_rng()  # fresh requests every run
    reqs = []
    for i in range(24):
        words = list(rng.choice([w for w in WORDS if w != MARK], size=int(rng.integers(2, 12))))
        marked = i % 3 == 1
        if marked:
            words.insert(int(rng.integers(0, len(words) + 1)), MARK)
        text = " ".join(words)
        chat = bool(rng.random() < 0.5)
        body = {"max_tokens": int(rng.integers(1, 24)), "temperature": 0,
                "n": int(rng.integers(1, 3)), "stream": bool(rng.random() < 0.5)}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        path = "/v1/chat/completions" if chat else "/v1/completions"
        reqs.append((path, body, marked))

    before = metrics(server.url)
    hook, hits = _marked_hook(engine)
    engine.fault_hook = hook
    try:
        async def together():
            async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                         limits=httpx.Limits(max_connections=64)) as ac:
                return await asyncio.gather(*(_send(ac, p, b) for p, b, _ in reqs))
        results = asyncio.run(together())
    finally:
        engine.fault_hook = None
    assert hits, "the hook never fired"
    # the same requests one at a time, with no faults anywhere: the reference texts
    alone = {}

    async def one_by_one():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ac:
            for i, (p, b, marked) in enumerate(reqs):
                if not marked:
                    alone[i] = _text_of(p, *await _send(ac, p, {**b, "stream": False}))
    asyncio.run(one_by_one())

    for i, ((path, body, marked), (status, out)) in enumerate(zip(reqs, results)):
        if not marked:
            assert _text_of(path, status, out) == alone[i], (i, body)
            continue
        if body["stream"]:  # the stream carries an error chunk instead of a finish
            assert status == 200, out
            errors = [e for e in out[:-1] if "error" in e]
            assert len(errors) == 1 and "injected admission fault" in \
                errors[0]["error"]["message"], out
            assert errors[0]["error"]["type"] == "internal_error"
            assert not any(c.get("finish_reason") for e in out[:-1] if "choices" in e
                           for c in e["choices"]), out
        else:
            assert status == 500 and is_openai_error(status, out), out
            assert "injected admission fault" in json.loads(out)["error"]["message"]

    after = _wait_idle(server.url)
    d = lambda k: after.get(k, 0) - before.get(k, 0)  # noqa: E731
    n_marked_seqs = sum(b["n"] for _, b, m in reqs if m)
    n_clean_seqs = sum(b["n"] for _, b, m in reqs if not m) * 2  # run twice
    assert d("jaxspec_sequences_submitted_total") == n_marked_seqs + n_clean_seqs
    failed = d('jaxspec_sequences_finished_total{reason="error"}')
    cancelled = d('jaxspec_sequences_finished_total{reason="cancelled"}')
    # a marked request's sequences fail at admission or, once a sibling failed, are cancelled
    assert failed == len(hits) >= sum(1 for _, _, m in reqs if m)
    assert failed + cancelled == n_marked_seqs
    assert d('jaxspec_sequences_finished_total{reason="stop"}') + \
        d('jaxspec_sequences_finished_total{reason="length"}') == n_clean_seqs
    assert d('jaxspec_http_requests_total{path="/v1/completions",code="500"}') + \
        d('jaxspec_http_requests_total{path="/v1/chat/completions",code="500"}') == \
        sum(1 for _, b, m in reqs if m and not b["stream"])


@pytest.mark.parametrize("stream", [False, True])
def test_fault_in_one_sample_ends_its_siblings(engine, server, client_sync, stream):
    """n=3: only the third sample's admission fails; the request fails and its other samples are
    cancelled (or already done), their slots free again."""
    before = metrics(server.url)

    def hook(seq):
        if seq.index == 2:
            raise Injected("third sample")
    engine.fault_hook = hook
    try:
        r = client_sync.post("/v1/completions", json={
            "prompt": "tell me a story about the sea", "max_tokens": 60, "n": 3,
            "temperature": 0.8, "stream": stream})
    finally:
        engine.fault_hook = None
    if stream:
        events = sse_data(r.text)
        assert r.status_code == 200 and "third sample" in events[-2]["error"]["message"]
    else:
        assert r.status_code == 500 and "third sample" in r.json()["error"]["message"]
    after = _wait_idle(server.url)
    d = lambda k: after.get(k, 0) - before.get(k, 0)  # noqa: E731
    assert d("jaxspec_sequences_submitted_total") == 3
    assert d('jaxspec_sequences_finished_total{reason="error"}') == 1
    assert _finished_total(after) - _finished_total(before) == 3


@pytest.mark.parametrize("exc,message", [
    (RuntimeError, "RESOURCE_EXHAUSTED: out of memory allocating 1.2GiB"),
    (MemoryError, ""),
    (ValueError, "NaN guard tripped: \ud800 lone surrogate and " + "x" * 5000),
    (KeyError, "slot"),
    (FloatingPointError, "overflow"),
], ids=["oom", "memoryerror", "surrogate", "keyerror", "fpe"])
def test_any_exception_is_an_openai_500(engine, server, client_sync, exc, message, caplog):
    # the engine logs the fault; keep its message (a lone surrogate) out of the test report,
    # which pytest-xdist cannot send between processes
    caplog.set_level(logging.CRITICAL + 1, logger="jaxspec")
    hook, hits = _marked_hook(engine, exc, message)
    engine.fault_hook = hook
    try:
        r = client_sync.post("/v1/completions", json={"prompt": f"{MARK} sea", "max_tokens": 4})
        assert r.status_code == 500 and is_openai_error(r.status_code, r.content), r.text
        assert exc.__name__ in r.json()["error"]["message"]
        r = client_sync.post("/v1/completions", json={"prompt": f"sea {MARK}", "max_tokens": 4,
                                                      "stream": True})
        events = sse_data(r.text)
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert exc.__name__ in events[-2]["error"]["message"]
        ok = client_sync.post("/v1/completions", json={"prompt": "sea sky", "max_tokens": 4})
        assert ok.status_code == 200, ok.text
    finally:
        engine.fault_hook = None
    assert len(hits) == 2
    assert client_sync.get("/health").status_code == 200


@pytest.fixture(scope="module")
def client_sync(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_fault_storm_then_recovery(engine, server):
    """Every admission fails for a while (e.g. the device is out of memory); the server answers
    each request with a 500 and serves normally once the faults stop."""
    def hook(seq):
        raise RuntimeError("device out of memory")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=60)
    ref = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=12,
                                    temperature=0).choices[0].text
    engine.fault_hook = hook
    try:
        async def storm():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                return await asyncio.gather(*(ac.post("/v1/completions", json={
                    "prompt": "the cat sat", "max_tokens": 12, "n": 2}) for _ in range(16)))
        rs = asyncio.run(storm())
        assert [r.status_code for r in rs] == [500] * 16
        with pytest.raises(openai.APIError, match="device out of memory"):
            list(client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                stream=True))
    finally:
        engine.fault_hook = None
    _wait_idle(server.url)
    again = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=12,
                                      temperature=0).choices[0].text
    assert again == ref
    assert httpx.get(server.url + "/health").status_code == 200


def test_engine_not_running_is_503():
    engine = ServingEngine(served_model(), **ENGINE_KW)  # never started
    s = BackgroundServer(engine, "tiny")
    try:
        for path, body in (("/v1/completions", {"prompt": "hello"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}]})):
            r = httpx.post(s.url + path, json=body, timeout=30)
            assert r.status_code == 503 and is_openai_error(r.status_code, r.content), r.text
        r = httpx.get(s.url + "/health", timeout=30)
        assert r.status_code == 503 and is_openai_error(r.status_code, r.content)
    finally:
        s.close()


def test_a_broken_engine_loop_fails_everything_and_stops():
    """An exception the engine loop does not handle (here: a pass of the loop itself raises; in
    practice a fresh state that cannot be made after a failed chunk): the engine thread ended,
    and the sequences in slots and in the queue never finished (clients hung); now they fail
    with the cause, the engine is not alive and refuses new sequences."""
    from jaxspec.serving import EngineStopped
    engine = ServingEngine(served_model(), **ENGINE_KW).start(variants=[(True, False)])
    try:
        opts = SamplingOptions(max_tokens=8, temperature=0)
        engine.pause_admission()
        seqs = [Sequence([5, 6, 7], opts) for _ in range(ENGINE_KW["max_batch"] + 2)]
        engine.submit(seqs)
        real, calls = engine._tick, []

        def tick():
            calls.append(1)
            if len(calls) > 1:  # the first pass admits; the next one breaks
                raise RuntimeError("the loop broke")
            return real()
        engine._tick = tick
        engine.resume_admission()
        for s in seqs:
            assert s.finished.wait(60), "a sequence never finished"
            assert s.error is not None and "the loop broke" in s.error, s.error
        assert not engine.alive
        with pytest.raises(EngineStopped):
            engine.submit([Sequence([5, 6], opts)])
    finally:
        engine.stop()


def test_decode_step_fault_fails_the_requests_in_that_step(engine, server):
    """A fault in a decode chunk (the engine's ``step_fault_hook``, called with the chunk's
    sequences) fails every request that was decoding in it, mid-stream for a stream; their slots
    free up and the next requests decode as before."""
    prompts = ["the cat sat on the mat", "tell me a story about the sea", "red blue green"]
    ref = {}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for p in prompts:
            ref[p] = c.post("/v1/completions", json={
                "prompt": p, "max_tokens": 40, "temperature": 0}).json()["choices"][0]["text"]
    before = metrics(server.url)
    calls = []

    def hook(seqs):
        calls.append(len(seqs))
        if len(calls) == 3:  # the third chunk: both requests have streamed a little already
            raise FloatingPointError("NaN in the logits")
    engine.pause_admission()
    engine.step_fault_hook = hook
    try:
        async def both():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                tasks = [asyncio.create_task(ac.post("/v1/completions", json={
                    "prompt": prompts[0], "max_tokens": 40, "temperature": 0, "stream": True})),
                    asyncio.create_task(ac.post("/v1/completions", json={
                        "prompt": prompts[1], "max_tokens": 40, "temperature": 0}))]
                t0 = asyncio.get_running_loop().time()
                while engine.metrics()["waiting"] < 2:  # both admitted together
                    assert asyncio.get_running_loop().time() - t0 < 10
                    await asyncio.sleep(0.01)
                engine.resume_admission()
                return await asyncio.gather(*tasks)
        stream, plain = asyncio.run(both())
    finally:
        engine.step_fault_hook = None
        engine.resume_admission()
    assert calls[:3] == [2, 2, 2], calls
    events = sse_data(stream.text)
    assert stream.status_code == 200 and events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert "NaN in the logits" in err["message"] and err["type"] == "internal_error"
    streamed = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert streamed and ref[prompts[0]].startswith(streamed)  # a correct prefix, then the error
    assert plain.status_code == 500 and is_openai_error(500, plain.content)
    assert "NaN in the logits" in plain.json()["error"]["message"]
    after = _wait_idle(server.url)
    assert after['jaxspec_sequences_finished_total{reason="error"}'] - \
        before['jaxspec_sequences_finished_total{reason="error"}'] == 2
    with httpx.Client(base_url=server.url, timeout=60) as c:  # serving as before
        for p in prompts:
            r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 40, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref[p]


def test_fault_on_the_device_thread_fails_its_requests(engine, server):
    """A decode chunk runs on the engine's device thread; when it raises there (a device error),
    the requests decoding in it fail with that error, the state is rebuilt, and the next
    requests decode as before (greedy: the same text as before the fault)."""
    prompts = ["the cat sat on the mat", "tell me a story about the sea"]
    with httpx.Client(base_url=server.url, timeout=60) as c:
        def complete(p):
            return c.post("/v1/completions", json={"prompt": p, "max_tokens": 40,
                                                   "temperature": 0})
        ref = {p: complete(p).json()["choices"][0]["text"] for p in prompts}
        before = metrics(server.url)
        real = engine._chunk_on_device
        calls = []

        def failing(*args):
            calls.append(1)
            if len(calls) == 3:  # the third chunk: the request has decoded a little already
                raise FloatingPointError("device fault in the chunk")
            return real(*args)
        engine._chunk_on_device = failing
        try:
            bad = complete(prompts[0])
        finally:
            del engine._chunk_on_device
        assert len(calls) >= 3
        assert bad.status_code == 500 and is_openai_error(500, bad.content)
        assert "device fault in the chunk" in bad.json()["error"]["message"]
        after = _wait_idle(server.url)
        assert after['jaxspec_sequences_finished_total{reason="error"}'] - \
            before['jaxspec_sequences_finished_total{reason="error"}'] == 1
        for p in prompts:  # the rebuilt state serves as before
            r = complete(p)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref[p]
