"""Soak test of the OpenAI-compatible server (`jaxspec.server` over `jaxspec.serving`).

Several concurrent clients send a bounded random mix of requests to a server on loopback (the
dense K/V cache, a tiny random model on the CPU): completions and chat, streaming and not,
``n > 1``, several prompts in one request, stop strings, greedy and seeded sampling, unseeded
sampling. Some clients hang up mid-stream (closing the connection after a few events, or
resetting it), some give up on a non-streaming request, and injected faults fail some admissions
and some decode chunks. The engine speculates in every chunk (a StreamingLLM self-draft at a
fixed gamma; the cost model's adaptive choice would pick plain steps on the CPU).

A warm-up wave of the same mix compiles every program first; then the soak wave runs. Afterwards:

- every completed greedy choice equals plain offline `jaxspec.generate` of its prompt alone
  (float32: the same tokens), cut where its EOS, ``max_tokens`` or stop string cuts it; a greedy
  stream that hung up received a prefix of that text;
- every completed seeded sampled request equals the same request sent again alone;
- every completed choice's text is its token ids decoded and cut at its first stop string;
- nothing leaks: no busy slot, no waiting sequence, no request in flight, no `Sequence` object
  alive, the same JAX arrays (count and bytes), and resident memory growing over the soak wave's
  second half by at most its share of 5% of what it was after the warm-up wave;
- the counters add up: sequences submitted = stop + length + cancelled + error; errors = the
  injected faults' victims; every HTTP request is counted once, with the status its client saw;
  ``/metrics`` says what the engine counts.

Each run draws fresh requests; a failure names its seed (``JAXSPEC_SOAK_SEED=<seed>`` replays the
same requests; ``-s`` prints a run's figures as one JSON line). Every soak runs over an engine
that speculates and one that decodes plainly; ``-m slow`` adds a soak of minutes (with top-k /
top-p sampling too).
"""

import asyncio
import contextlib
import ctypes
import dataclasses
import gc
import json
import logging
import os
import socket
import struct
import time
import types
import weakref

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import jax  # noqa: E402

import jaxspec  # noqa: E402
from jaxspec.server import BackgroundServer  # noqa: E402
from jaxspec.serving import SamplingOptions, Sequence, ServingEngine  # noqa: E402

from serverkit import ENGINE_KW, WORDS, is_openai_error, metrics, served_model  # noqa: E402

pytestmark = pytest.mark.timeout(900)

MARK = "robot"  # a prompt holding this word fails at admission (the injected admission fault)
TEXT_WORDS = [w for w in WORDS if w != MARK]
ADMISSION_FAULT = "injected admission fault"
STEP_FAULT = "injected decode fault"
MAX_TOKENS = 40  # a prompt (at most 44 words: 46 tokens with the chat template) + 40 < 96
# every chunk speculates (adaptive=False: on the CPU the cost model would choose plain steps)
SPECULATION = jaxspec.Speculation(draft="self", gamma=3, sink=2, window=8, adaptive=False)
MEMORY_GROWTH = 0.05  # resident memory grown per soak wave (pro rata over its second half), <= 5%
# of resident memory after the warm-up wave


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model():
    return served_model()


@pytest.fixture(scope="module",
                params=["speculative", "plain"])
def engine(request, model):
    spec = SPECULATION if request.param == "speculative" else None
    # greedy and sampling chunks compile here; top-k / top-p chunks (slow soaks only) in the
    # warm-up wave of the first soak that sends them
    e = ServingEngine(model, speculation=spec, **ENGINE_KW).start(
        variants=[(True, False), (False, False)])
    yield e
    e.stop()


# ----------------------------------------------------------------------------- the requests
@dataclasses.dataclass
class Plan:
    """One request of the soak and how its client behaves."""

    path: str
    body: dict
    mode: str  # "full" | "drop" (close after `after` events) | "reset" (RST after `after`
    # events) | "abandon" (a non-streaming request given up after `after` ms)
    after: int
    marked: bool  # holds MARK: its admission fails
    prompts: list  # each prompt's token ids (as the engine tokenizes it)

    @property
    def chat(self) -> bool:
        return self.path.endswith("chat/completions")

    @property
    def greedy(self) -> bool:
        return self.body.get("temperature") == 0

    @property
    def seeded(self) -> bool:
        return not self.greedy and self.body.get("seed") is not None


@dataclasses.dataclass
class Outcome:
    status: int | None = None
    texts: dict = dataclasses.field(default_factory=dict)  # choice index -> text received
    finish: dict = dataclasses.field(default_factory=dict)  # choice index -> finish_reason
    ids: dict = dataclasses.field(default_factory=dict)  # choice index -> token ids
    usage: dict | None = None
    error: str | None = None
    done: bool = False  # the whole answer arrived ([DONE] or the JSON body)
    hung_up: bool = False  # the client left before the end
    seconds: float = 0.0


def _words(rng, lo, hi):
    return " ".join(rng.choice(TEXT_WORDS, size=int(rng.integers(lo, hi + 1))))


def make_plan(rng, engine, *, fault_rate: float, words: tuple[int, int],
              filtering: bool = False, leave: bool = False) -> Plan:
    """A random request (``filtering``: some sampled ones with top-k / top-p; ``leave``: a
    stream the client drops after its first event or two, with no admission fault and no stop
    string, so that it still runs when the client leaves)."""
    chat = rng.random() < 0.35
    stream = leave or rng.random() < 0.5
    marked = not leave and rng.random() < fault_rate
    n = int(rng.choice([1, 1, 1, 2, 3]))
    k = 2 if not chat and rng.random() < 0.15 else 1  # prompts in one completions request
    texts = []
    for _ in range(k):
        t = _words(rng, *words).split()
        if marked and not texts:
            t = t[:words[1] - 1]
            t.insert(int(rng.integers(0, len(t) + 1)), MARK)
        texts.append(" ".join(t))
    body = {"max_tokens": int(rng.integers(1, MAX_TOKENS + 1)), "n": n, "stream": stream,
            "return_token_ids": True}
    u = rng.random()
    if u < 0.45:
        body["temperature"] = 0
        if rng.random() < 0.2:
            body["seed"] = int(rng.integers(0, 2**31))  # ignored when greedy
    else:
        body["temperature"] = round(float(rng.uniform(0.3, 1.5)), 3)
        if u < 0.9:
            body["seed"] = int(rng.integers(-2**31, 2**32))
        if filtering and rng.random() < 0.25:
            body["top_k"] = int(rng.integers(1, 24))
        if filtering and rng.random() < 0.2:
            body["top_p"] = round(float(rng.uniform(0.5, 0.97)), 3)
    if not leave and rng.random() < 0.35:  # stop strings: words the model often says, or any text
        body["stop"] = [str(rng.choice(["a", "and", " a", "n", "the", "a a", "0", "sea"]))
                        for _ in range(int(rng.integers(1, 3)))]
        if len(body["stop"]) == 1 and rng.random() < 0.5:
            body["stop"] = body["stop"][0]
    if stream and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    if chat:
        msgs = [{"role": "user", "content": texts[0]}]
        body["messages"] = msgs
        prompts = [engine.encode_chat(msgs)]
    else:
        body["prompt"] = texts[0] if k == 1 else texts
        prompts = [engine.encode_prompt(t) for t in texts]
    u = rng.random()
    if leave:
        mode, after = "drop", int(rng.integers(1, 3))
    elif stream and u < 0.15:
        mode, after = "drop", int(rng.integers(1, 5))
    elif stream and u < 0.22:
        mode, after = "reset", int(rng.integers(1, 5))
    elif not stream and u < 0.08:
        mode, after = "abandon", int(rng.integers(20, 400))
    else:
        mode, after = "full", 0
    if mode != "full":  # long enough to be running when the client leaves (else nothing to
        # cancel: a speculative chunk can end a short request within the first event)
        body["max_tokens"] = max(body["max_tokens"], int(rng.integers(MAX_TOKENS // 2,
                                                                      MAX_TOKENS + 1)))
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Plan(path, body, mode, after, marked, prompts)


def _apply_event(o: Outcome, e: dict, chat: bool):
    if "error" in e:
        o.error = e["error"]["message"]
        return
    if e.get("usage"):
        o.usage = e["usage"]
    for c in e["choices"]:
        i = c["index"]
        piece = (c["delta"].get("content") or "") if chat else c["text"]
        o.texts[i] = o.texts.get(i, "") + piece
        if c.get("finish_reason"):
            o.finish[i] = c["finish_reason"]
            o.ids[i] = c["token_ids"]


async def send(ac: "httpx.AsyncClient", port: int, plan: Plan) -> Outcome:
    o = Outcome()
    t0 = time.perf_counter()
    try:
        if plan.mode == "reset":
            await _send_reset(port, plan, o)
        elif not plan.body["stream"]:
            await _send_plain(ac, plan, o)
        else:
            await _send_stream(ac, plan, o)
    finally:
        o.seconds = time.perf_counter() - t0
    return o


async def _send_plain(ac, plan, o):
    req = ac.post(plan.path, json=plan.body)
    if plan.mode == "abandon":
        try:
            r = await asyncio.wait_for(req, plan.after / 1000)
        except asyncio.TimeoutError:  # httpx closes the connection
            o.hung_up = True
            return
    else:
        r = await req
    o.status = r.status_code
    if r.status_code != 200:
        assert is_openai_error(r.status_code, r.content), r.content
        o.error = r.json()["error"]["message"]
        return
    obj = r.json()
    for c in obj["choices"]:
        o.texts[c["index"]] = c["message"]["content"] if plan.chat else c["text"]
        o.finish[c["index"]] = c["finish_reason"]
        o.ids[c["index"]] = c["token_ids"]
    o.usage = obj["usage"]
    o.done = True


async def _send_stream(ac, plan, o):
    async with ac.stream("POST", plan.path, json=plan.body) as resp:
        o.status = resp.status_code
        if resp.status_code != 200:
            content = await resp.aread()
            assert is_openai_error(resp.status_code, content), content
            o.error = json.loads(content)["error"]["message"]
            return
        events = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                o.done = o.error is None
                return
            _apply_event(o, json.loads(data), plan.chat)
            events += 1
            if plan.mode == "drop" and events >= plan.after:
                o.hung_up = True
                return  # leaving the block closes the connection mid-stream
    raise AssertionError("the stream ended without [DONE]")


async def _send_reset(port, plan, o):
    """A raw connection that reads ``plan.after`` events, then resets (RST) the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps(plan.body).encode()
    writer.write(f"POST {plan.path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    seen = b""
    try:
        await writer.drain()
        while seen.count(b"data: ") < plan.after and b"[DONE]" not in seen:
            part = await asyncio.wait_for(reader.read(65536), 60)
            if not part:
                break
            seen += part
    finally:
        o.status = int(seen.split(b" ", 2)[1]) if seen.startswith(b"HTTP/1.1 ") else None
        o.hung_up = b"[DONE]" not in seen
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def run_wave(url: str, port: int, plans: list[Plan], clients: int, seconds: float):
    """``clients`` concurrent clients work through ``plans`` (each one request at a time); the
    wave gives up (and the test fails) after ``seconds``."""
    out: list[Outcome | None] = [None] * len(plans)
    todo = iter(range(len(plans)))

    async def client(ac):
        for i in todo:
            out[i] = await send(ac, port, plans[i])

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as ac:
        await asyncio.wait_for(asyncio.gather(*(client(ac) for _ in range(clients))), seconds)
    return out


# ----------------------------------------------------------------------------- faults
class Faults:
    """Admission faults (prompts holding MARK) and decode-chunk faults (each chunk fails with
    probability ``p_step``, at most ``max_step`` times), with who they hit."""

    def __init__(self, engine, rng, p_step: float, max_step: int):
        self.engine, self.rng = engine, rng
        self.p_step, self.max_step = p_step, max_step
        self.mark = engine.tokenizer.convert_tokens_to_ids(MARK)
        self.admission_hits = 0
        self.step_faults = 0
        # sequences holding a slot when a chunk failed that decoded, streamed or started over
        # once already (the others, whose prompts still filled, start over on the fresh state)
        self.step_victims = 0
        self.chunks = 0

    def admission(self, seq):
        if self.mark in seq.prompt_ids:
            self.admission_hits += 1
            raise RuntimeError(ADMISSION_FAULT)

    def step(self, seqs):
        self.chunks += 1
        if self.step_faults < self.max_step and self.rng.random() < self.p_step:
            self.step_faults += 1
            self.step_victims += sum(
                s is not None and bool(s.tokens or s.retried or s.slot in self.engine._started)
                for s in self.engine.slots)
            raise FloatingPointError(STEP_FAULT)

    def __enter__(self):
        self.engine.fault_hook = self.admission
        self.engine.step_fault_hook = self.step
        return self

    def __exit__(self, *exc):
        self.engine.fault_hook = None
        self.engine.step_fault_hook = None


class _DropInjected(logging.Filter):
    """Counts and drops the engine's log records of injected faults (a record keeps its
    traceback, and so the failed `Sequence`, alive in pytest's log capture)."""

    def __init__(self):
        super().__init__()
        self.dropped = 0

    def filter(self, record):
        if record.exc_info and any(m in str(record.exc_info[1]) for m in (ADMISSION_FAULT,
                                                                             STEP_FAULT)):
            self.dropped += 1
            return False
        return True


@contextlib.contextmanager
def drop_injected_logs():
    f = _DropInjected()
    loggers = [logging.getLogger(n) for n in ("jaxspec.serving", "jaxspec.server")]
    for lg in loggers:
        lg.addFilter(f)
    try:
        yield f
    finally:
        for lg in loggers:
            lg.removeFilter(f)


# ----------------------------------------------------------------------------- measuring
def _trim():
    """Hands freed heap memory back to the OS (glibc), so resident memory measures what is
    alive rather than what the allocator keeps for later."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def park_engine_loop(engine) -> Sequence:
    """Cancels a probe sequence while admission is paused and returns it (the caller keeps it).

    The engine loop keeps its last cancelled (or failed) sequence in a local variable until it
    cancels another one (see `test_a_cancelled_sequence_is_released`); after this, that variable
    names the probe rather than a sequence of the soak, so every other `Sequence` still alive is
    a leak."""
    engine.pause_admission()
    try:
        probe = Sequence(engine.encode_prompt("the cat"), SamplingOptions(max_tokens=1))
        engine.submit([probe])
        engine.cancel(probe)
        assert probe.finished.wait(30) and probe.finish_reason == "cancelled", probe.error
    finally:
        engine.resume_admission()
    return probe


def footprint(probe: Sequence) -> dict:
    """Resident memory, live JAX arrays and live `Sequence` objects (other than ``probe``)."""
    gc.collect()
    _trim()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    arrays = jax.live_arrays()
    return {"rss_bytes": rss, "live_arrays": len(arrays),
            "live_array_bytes": int(sum(a.nbytes for a in arrays)),
            "sequences_alive": sum(isinstance(o, Sequence) and o is not probe
                                   for o in gc.get_objects())}


def _describe(r) -> str:
    if isinstance(r, types.FrameType):
        return f"frame {r.f_code.co_name} ({r.f_code.co_filename}:{r.f_lineno})"
    if isinstance(r, dict):
        return f"dict keys={list(r)[:8]}"
    return type(r).__name__


def holders(kind=Sequence, exclude=()) -> list[str]:
    """What refers to each live ``kind`` object (and what refers to those), to name a leak."""
    gc.collect()
    objs = [o for o in gc.get_objects() if isinstance(o, kind) and o not in exclude]
    out = []
    for obj in objs:
        parts = []
        refs = gc.get_referrers(obj)
        for r in refs:
            if r is objs or isinstance(r, types.FrameType) and r.f_code is holders.__code__:
                continue
            up = [_describe(u) for u in gc.get_referrers(r) if u is not refs and u is not objs
                  and not (isinstance(u, types.FrameType) and u.f_code is holders.__code__)][:4]
            parts.append(_describe(r) + (f" <- [{', '.join(up)}]" if up else ""))
        out.append(f"{kind.__name__} {getattr(obj, 'id', '?')}: " + "; ".join(parts))
    return out


def wait_idle(engine, app=None, timeout: float = 30.0):
    """Waits until no slot is busy, nothing waits, every submitted sequence has finished and
    (with the server's ``app``) no HTTP request is in flight (a hung-up request's handler may
    take a second to notice)."""
    deadline = time.time() + timeout
    while True:
        m = engine.metrics()
        finished = sum(m[f"finished_{r}"] for r in ("stop", "length", "cancelled", "error"))
        in_flight = 0 if app is None else app.state.http_stats.in_flight
        tracked = 0 if app is None else len(app.state.shutdown.inflight)
        if (m["slots_busy"] == 0 and m["waiting"] == 0 and finished == m["sequences_submitted"]
                and in_flight == 0 and tracked == 0):
            return m
        if time.time() > deadline:
            raise AssertionError(f"the server did not go idle: {m}, http in flight {in_flight}, "
                                 f"tracked {tracked}")
        time.sleep(0.05)


# ----------------------------------------------------------------------------- references
def _decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _continuation(tok, prompt, out):
    """The text ``out`` adds to the text of ``prompt`` (a completion continues its prompt: a
    SentencePiece word's leading space is kept)."""
    before = _decode(tok, prompt)
    whole = _decode(tok, list(prompt) + out)
    assert whole.startswith(before), (prompt, out)
    return whole[len(before):]


def cut(tok, tokens, max_tokens, stops, eos, prompt=()) -> tuple[str, list[int], str]:
    """What the server answers for a sequence whose model output (without limits) starts with
    ``tokens``: (text, token ids, finish reason). ``prompt``: the completion's prompt ids (a chat
    answer's text starts afresh: none)."""
    out = []
    for t in tokens[:max_tokens]:
        out.append(int(t))
        if t in eos:
            return _continuation(tok, prompt, out[:-1]), out, "stop"
        if stops:
            text = _continuation(tok, prompt, out)
            hits = [text.find(s) for s in stops if s in text]
            if hits:
                return text[:min(hits)], out, "stop"
    assert len(out) == max_tokens, "the reference ended early"
    return _continuation(tok, prompt, out), out, "length"


def _stops(body) -> tuple:
    s = body.get("stop")
    return () if s is None else (s,) if isinstance(s, str) else tuple(s)


# ----------------------------------------------------------------------------- the soak
def soak(model, engine, *, warm: int, requests: int, clients: int, seconds: float,
         p_step: float, max_step: int, fault_rate: float = 0.05, filtering: bool = False,
         independent: bool = False, max_words: int = 30) -> dict:
    """Runs a warm-up wave and then the soak wave of ``requests`` random requests (prompts of
    1 to ``max_words`` words) on a server over ``engine``, checks them (see the module docstring)
    and returns the run's figures. ``p_step``: the chance that a decode chunk fails (at most
    ``max_step`` times); ``fault_rate``: the share of requests whose admission fails;
    ``filtering``: top-k / top-p requests too; ``independent``: greedy answers also against
    offline `jaxspec.generate`."""
    seed = int(os.environ.get("JAXSPEC_SOAK_SEED") or np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    # the warm-up wave covers every prefill bucket and holds an admission fault
    kw = dict(filtering=filtering, words=(1, max_words))
    # prompts of each prefill bucket (16, 32, 64 tokens)
    spans = [(3, 10), (17, min(28, max_words))] + [(34, max_words)] * (max_words >= 34)
    warm_plans = [make_plan(rng, engine, fault_rate=0.0, filtering=filtering, words=w)
                  for w in spans * 3]
    warm_plans += [make_plan(rng, engine, fault_rate=1.0, **kw)]
    warm_plans += [make_plan(rng, engine, fault_rate=fault_rate, **kw) for _ in range(warm)]
    # (every 12th client leaves for sure: the random ones may all have failed or ended first)
    plans = [make_plan(rng, engine, fault_rate=fault_rate, leave=i % 12 == 5, **kw)
             for i in range(requests)]
    fault_rng = np.random.default_rng([seed, 1])  # chunk counts vary: its own stream
    tok = model.tokenizer
    eos = set(engine.stop_ids)
    server = BackgroundServer(engine, "tiny")
    app = server.app
    figures = {"seed": seed, "speculative": engine.speculative, "slots": engine.B,
               "clients": clients}
    try:
        with drop_injected_logs() as logs:
            # warm-up wave: every program compiles (each prefill bucket, the chunk variants the
            # soak uses, the fault paths), then memory is measured
            t0 = time.perf_counter()
            with Faults(engine, fault_rng, p_step=0.2, max_step=1):
                asyncio.run(run_wave(server.url, server.port, warm_plans, clients, seconds))
            wait_idle(engine, app)
            figures["warmup_seconds"] = round(time.perf_counter() - t0, 1)
            probe = park_engine_loop(engine)
            warm_fp = footprint(probe)
            before = engine.metrics()
            http_before = dict(app.state.http_stats.requests)
            dropped_before = logs.dropped

            # the soak wave in two halves: memory that a leak holds grows with the requests
            # served, so the second half is measured on its own (what the first half grows
            # once, such as allocator arenas of threads shared with earlier tests, is not a leak)
            t0 = time.perf_counter()
            half = len(plans) // 2
            with Faults(engine, fault_rng, p_step=p_step, max_step=max_step) as faults:
                outs = asyncio.run(run_wave(server.url, server.port, plans[:half], clients,
                                            seconds))
                wait_idle(engine, app)
                mid_fp = footprint(None)  # (no probe: the wave's counters stay its own)
                outs += asyncio.run(run_wave(server.url, server.port, plans[half:], clients,
                                             seconds))
            soak_s = time.perf_counter() - t0
            after = wait_idle(engine, app)
            idle_s = time.perf_counter() - t0 - soak_s
            http_after = dict(app.state.http_stats.requests)
            dropped = logs.dropped - dropped_before
            prom = metrics(server.url)
            probe = park_engine_loop(engine)
            soak_fp = footprint(probe)
        figures.update(check_counters(plans, outs, before, after, http_before, http_after,
                                      faults, prom, dropped))
        figures.update({"requests": len(plans), "soak_seconds": round(soak_s, 1),
                        "idle_after_seconds": round(idle_s, 2),
                        "rss_after_warmup_mib": round(warm_fp["rss_bytes"] / 2**20, 1),
                        "rss_after_half_mib": round(mid_fp["rss_bytes"] / 2**20, 1),
                        "rss_after_soak_mib": round(soak_fp["rss_bytes"] / 2**20, 1),
                        "rss_growth": round(soak_fp["rss_bytes"] / warm_fp["rss_bytes"] - 1, 4),
                        "rss_growth_second_half": round(
                            (soak_fp["rss_bytes"] - mid_fp["rss_bytes"]) / warm_fp["rss_bytes"], 4),
                        "live_arrays": (warm_fp["live_arrays"], soak_fp["live_arrays"]),
                        "live_array_bytes": (warm_fp["live_array_bytes"],
                                             soak_fp["live_array_bytes"]),
                        "sequences_alive": soak_fp["sequences_alive"]})
        # no leak
        assert after["slots_busy"] == 0 and after["waiting"] == 0, after
        assert soak_fp["sequences_alive"] == 0, (soak_fp, holders(exclude=(probe,)))
        assert soak_fp["live_arrays"] == warm_fp["live_arrays"], (warm_fp, soak_fp)
        assert soak_fp["live_array_bytes"] == warm_fp["live_array_bytes"], (warm_fp, soak_fp)
        assert (soak_fp["rss_bytes"] - mid_fp["rss_bytes"]
                <= MEMORY_GROWTH * (len(plans) - half) / len(plans) * warm_fp["rss_bytes"]), \
            (warm_fp, mid_fp, soak_fp)
        # the answers
        t0 = time.perf_counter()
        figures.update(check_answers(model, server, plans, outs, tok, eos, independent))
        figures["reference_seconds"] = round(time.perf_counter() - t0, 1)
    except BaseException as e:
        e.add_note(f"soak seed {seed} (JAXSPEC_SOAK_SEED={seed} replays these requests)")
        raise
    finally:
        server.close()
    print("soak figures:", json.dumps(figures))
    return figures


def check_counters(plans, outs, before, after, http_before, http_after, faults, prom,
                   dropped) -> dict:
    d = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
    seqs = [len(p.prompts) * p.body["n"] for p in plans]
    full = [i for i, p in enumerate(plans) if p.mode == "full" or outs[i].done]
    ok = [i for i in full if outs[i].done]
    failed = [i for i in full if not outs[i].done]
    hung = [i for i, o in enumerate(outs) if o.hung_up]
    # every sequence of the wave was submitted once and finished once, for one reason
    # (a request given up early may leave before its sequences are submitted)
    gave_up = sum(seqs[i] for i, p in enumerate(plans) if p.mode == "abandon" and outs[i].hung_up)
    assert sum(seqs) - gave_up <= d["sequences_submitted"] <= sum(seqs), (d, sum(seqs), gave_up)
    assert d["sequences_submitted"] == (d["finished_stop"] + d["finished_length"] +
                                        d["finished_cancelled"] + d["finished_error"]), d
    # errors: exactly the injected faults' victims
    assert d["finished_error"] == faults.admission_hits + faults.step_victims, \
        (d, vars(faults))
    assert dropped == faults.admission_hits + faults.step_faults, (dropped, vars(faults))
    # the completed choices finished normally; only requests that left or failed were cancelled
    n_ok = sum(seqs[i] for i in ok)
    assert d["finished_stop"] + d["finished_length"] >= n_ok, d
    assert sum(1 for i in ok for r in outs[i].finish.values() if r == "stop") <= \
        d["finished_stop"]
    assert d["finished_cancelled"] <= sum(seqs[i] for i in hung + failed), d
    tokens = sum(len(ids) for i in ok for ids in outs[i].ids.values())
    assert d["generation_tokens"] >= tokens
    # the HTTP counters: every request once, with the status its client saw
    api = ("/v1/completions", "/v1/chat/completions")
    hd = {k: v - http_before.get(k, 0) for k, v in http_after.items()
          if k[0] in api and v - http_before.get(k, 0)}
    seen = {}
    for i, o in enumerate(outs):
        if o.status is not None:
            seen[(plans[i].path, o.status)] = seen.get((plans[i].path, o.status), 0) + 1
    # a client that gave up before an answer may have left before the server read its request
    abandoned = [i for i, o in enumerate(outs) if o.status is None]
    assert all(plans[i].mode == "abandon" for i in abandoned), abandoned
    assert len(plans) - len(abandoned) <= sum(hd.values()) <= len(plans), (hd, len(abandoned))
    for k in set(hd) | set(seen):
        assert hd.get(k, 0) >= seen.get(k, 0), (k, hd, seen)
    assert sum(hd.values()) - sum(seen.values()) <= len(abandoned), (hd, seen)
    # /metrics says what the engine counts
    for r in ("stop", "length", "cancelled", "error"):
        assert prom[f'jaxspec_sequences_finished_total{{reason="{r}"}}'] == after[f"finished_{r}"]
    assert prom["jaxspec_slots_busy"] == 0 and prom["jaxspec_queue_depth"] == 0
    assert prom["jaxspec_sequences_submitted_total"] == after["sequences_submitted"]
    if after["speculative_chunks"]:
        assert d["speculative_chunks"] > 0 and d["draft_proposed"] > 0
        assert 0 <= d["draft_accepted"] <= d["draft_proposed"]
    modes = [p.mode for p in plans]
    return {
        "sequences": int(d["sequences_submitted"]),
        "completed_requests": len(ok), "failed_requests": len(failed),
        "completed_streams": sum(1 for i in ok if plans[i].body["stream"]),
        "completed_with_n_gt_1": sum(1 for i in ok if plans[i].body["n"] > 1),
        "hung_up": {m: sum(1 for i in hung if plans[i].mode == m)
                    for m in ("drop", "reset", "abandon")},
        "disconnect_plans": {m: modes.count(m) for m in ("drop", "reset", "abandon")},
        "finished": {r: int(d[f"finished_{r}"]) for r in ("stop", "length", "cancelled",
                                                          "error")},
        "admission_faults": faults.admission_hits, "step_faults": faults.step_faults,
        "step_fault_victims": faults.step_victims, "chunks": int(d["chunks"]),
        "speculative_chunks": int(d["speculative_chunks"]),
        "generation_tokens": int(d["generation_tokens"]),
        "acceptance_rate": round(d["draft_accepted"] / d["draft_proposed"], 3)
        if d["draft_proposed"] else None,
        "http": {f"{p} {c}": n for (p, c), n in sorted(hd.items())},
        "abandoned_before_an_answer": len(abandoned),
        "abandoned_unseen_by_the_server": len(plans) - sum(hd.values()),
    }


def _choices(p: Plan, r) -> dict:
    """A non-streaming answer's choices: index -> (text, token ids, finish reason)."""
    return {c["index"]: (c["message"]["content"] if p.chat else c["text"], c["token_ids"],
                         c["finish_reason"]) for c in r.json()["choices"]}


def check_answers(model, server, plans, outs, tok, eos, independent: bool) -> dict:
    """Checks every answer; the deterministic ones (greedy, or sampled with a seed) against the
    same request sent again alone (one at a time on the idle server), and with ``independent``
    every greedy choice also against plain offline `jaxspec.generate` of its prompt."""
    compared = {"greedy_choices": 0, "seeded_choices": 0, "hung_up_prefixes": 0,
                "other_choices": 0, "generate_choices": 0, "stop_string_cuts": 0}
    t0 = time.perf_counter()
    alone = {}  # plan index -> the choices of the same request sent alone
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for i, (p, o) in enumerate(zip(plans, outs)):
            if (p.greedy or p.seeded) and not p.marked and (o.done or o.texts):
                alone_body = {k: v for k, v in p.body.items() if k != "stream_options"}
                r = c.post(p.path, json={**alone_body, "stream": False})
                assert r.status_code == 200, (i, p.body, r.text)
                alone[i] = _choices(p, r)
    compared["replay_seconds"] = round(time.perf_counter() - t0, 1)
    ref = {}
    if independent:  # plain offline generate of every greedy prompt (float32: the same tokens)
        t0 = time.perf_counter()
        prompts = sorted({tuple(ids) for i in alone if plans[i].greedy
                          for ids in plans[i].prompts})
        ref = dict(zip(prompts, jaxspec.generate(model, [list(x) for x in prompts],
                                                 max_new_tokens=MAX_TOKENS).tokens))
        compared["generate_seconds"] = round(time.perf_counter() - t0, 1)
    for i, (p, o) in enumerate(zip(plans, outs)):
        stops = _stops(p.body)
        k = len(p.prompts) * p.body["n"]
        where = (i, p.path, p.body, p.mode)
        if p.mode == "full" or o.done:
            if p.marked:
                assert not o.done and ADMISSION_FAULT in (o.error or ""), (where, o)
            elif not o.done:  # only a failed decode chunk may fail an unmarked request
                assert STEP_FAULT in (o.error or ""), (where, o)
        if o.error is not None:
            assert o.error.startswith("generation failed") and (
                ADMISSION_FAULT in o.error or STEP_FAULT in o.error), (where, o.error)
            assert o.status == (200 if p.body["stream"] else 500), (where, o)
        answers = [{c: (o.texts[c], o.ids[c], o.finish[c]) for c in o.ids}]
        if o.done:
            assert sorted(o.texts) == sorted(o.ids) == list(range(k)), (where, o)
            compared["stop_string_cuts"] += sum(o.finish[c] == "stop" and o.ids[c][-1] not in eos
                                                for c in o.ids)
            if o.usage is not None:  # prompt tokens once per prompt (not per sample)
                assert o.usage["completion_tokens"] == sum(len(x) for x in o.ids.values())
                assert o.usage["prompt_tokens"] == sum(len(x) for x in p.prompts), (where, o)
        if i in alone:
            assert sorted(alone[i]) == list(range(k)), (where, alone[i])
            answers.append(alone[i])
        def prompt_of(c):  # the text a completion continues
            return () if p.chat else p.prompts[c // p.body["n"]]

        for ans in answers:  # each finished choice's text is its tokens decoded, cut at a stop
            for c, (text, ids, finish) in ans.items():
                assert (text, ids, finish) == cut(tok, ids, len(ids), stops, eos,
                                                  prompt_of(c)), (where, c, ans)
                assert 0 < len(ids) <= p.body["max_tokens"], (where, c, ans)
        if i not in alone:
            compared["other_choices"] += len(o.ids) if o.done else 0
            continue
        # the same answer as the request alone (a client that hung up: a prefix of it)
        for c in range(k):
            want = alone[i][c]
            if o.done:
                assert (o.texts[c], o.ids[c], o.finish[c]) == want, (where, c, o, want)
                compared["greedy_choices" if p.greedy else "seeded_choices"] += 1
            elif c in o.ids:  # finished before the client left
                assert (o.texts[c], o.ids[c], o.finish[c]) == want, (where, c, o, want)
                compared["hung_up_prefixes"] += 1
            elif c in o.texts:
                assert want[0].startswith(o.texts[c]), (where, c, o.texts[c], want)
                compared["hung_up_prefixes"] += 1
            if p.greedy and independent:
                gen = cut(tok, ref[tuple(p.prompts[c // p.body["n"]])], p.body["max_tokens"],
                          stops, eos, prompt_of(c))
                assert want == gen, (where, c, want, gen)
                compared["generate_choices"] += 1
    return compared


# ----------------------------------------------------------------------------- the tests
def test_soak(model, engine):
    spec = engine.speculative
    f = soak(model, engine, warm=8, requests=72 if spec else 40, clients=6, seconds=240,
             p_step=0.02, max_step=2)
    # the mix held what it is for (each of these fails to show up about never)
    for k in ("completed_streams", "completed_with_n_gt_1", "greedy_choices", "seeded_choices",
              "stop_string_cuts"):
        assert f[k] > 0, (k, f)
    assert f["completed_requests"] > f["requests"] // 3, f  # about 70% complete
    assert sum(f["hung_up"].values()) > 0 and f["finished"]["cancelled"] > 0, f
    assert spec == (f["speculative_chunks"] > 0)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_long(model, engine):
    f = soak(model, engine, warm=40, requests=1500, clients=8, seconds=1500,
             p_step=0.004, max_step=8, filtering=True, independent=True, max_words=44)
    assert f["completed_requests"] > f["requests"] // 2 and sum(f["hung_up"].values()) > 50, f


def test_a_cancelled_sequence_is_released(model, engine):
    """A sequence cancelled while it waits (admission paused) finishes, and then nothing in the
    engine refers to it any more."""
    wait_idle(engine)
    engine.pause_admission()
    try:
        s = Sequence(engine.encode_prompt("the cat sat"), SamplingOptions(max_tokens=4))
        engine.submit([s])
        engine.cancel(s)
        assert s.finished.wait(30) and s.finish_reason == "cancelled"
    finally:
        engine.resume_admission()
    ref = weakref.ref(s)
    del s
    time.sleep(0.2)  # the engine loop is back waiting
    gc.collect()
    assert ref() is None, "the engine still refers to the finished sequence"


def test_an_idle_engine_holds_its_state_and_nothing_else(model, engine):
    """Once idle, the engine holds the same device arrays whether its last chunk finished or
    failed (which starts a fresh state): the last chunk's outputs are not kept alive."""
    def serve_one(fault: bool) -> dict:
        def fail(_seqs):
            raise FloatingPointError(STEP_FAULT)
        engine.step_fault_hook = fail if fault else None
        try:
            with drop_injected_logs():
                s = Sequence(engine.encode_prompt("the cat sat on the mat"),
                             SamplingOptions(max_tokens=6, temperature=0.0))
                engine.submit([s])
                assert s.finished.wait(60)
                assert (s.error is not None) == fault and (fault or s.finish_reason == "length"), \
                    (s.finish_reason, s.error)
                wait_idle(engine)
        finally:
            engine.step_fault_hook = None
        del s
        return footprint(park_engine_loop(engine))

    served, failed, served_again = serve_one(False), serve_one(True), serve_one(False)
    for k in ("live_arrays", "live_array_bytes"):
        assert served[k] == failed[k] == served_again[k], (served, failed, served_again)
