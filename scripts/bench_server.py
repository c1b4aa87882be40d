#!/usr/bin/env python
"""Load-generator benchmark of the OpenAI-compatible server: throughput and latency at several
request rates, for speculation off / self (fixed gamma) / auto (gamma="auto").

    # GPU, a converted checkpoint, token-id prompts made beforehand (see --make-prompts):
    python scripts/bench_server.py --model checkpoints/smollm2-135m-instruct \\
        --prompts-file .bench/prompts_smol.json.gz --prompt-len 512,2048 --max-tokens 128 \\
        --rates inf,128,32,8 --requests-per-point 128 --point-seconds 4 \\
        --variants off,self,auto --time-budget-s 240 --out benchmarks/server_smol
    # CPU smoke test (tiny random model, well under a minute):
    python scripts/bench_server.py --tiny --out /tmp/bench_tiny
    # token-id prompts from long public-domain text (needs the network once; jaxspec.textdata):
    python scripts/bench_server.py --make-prompts .bench/prompts_smol.json.gz \\
        --tokenizer checkpoints/smollm2-135m-instruct --n-prompts 64 --prompt-tokens 4096

For each variant the engine is built (sharing the loaded weights), compiled (warm-up, timed and
reported, excluded from the numbers) and served; then, per rate, requests arrive as a Poisson
process (``inf``: all at once) and each one streams a completion of ``--max-tokens`` tokens (EOS
ignored by default, so every request produces the same number of tokens). ``--time-budget-s``
bounds the whole run: after each variant's set-up the time left is shared between its points and
those of the variants to come; a point that would not fit is recorded as skipped, one cut short as
truncated.

Modes (``--mode``): ``http`` runs uvicorn + the FastAPI app in-process on 127.0.0.1 (a free port)
and a client subprocess (httpx, no JAX, so it does not compete for this process's GIL) streams
``/v1/completions`` and stamps every server-sent event as it arrives; ``engine`` drives
`ServingEngine` directly from an asyncio loop in this process (the same events, without HTTP/SSE);
``auto`` (default): http when fastapi and uvicorn import (and the first warm-up through HTTP
works), else engine. The mode used is recorded.

Metrics, per (variant, rate), all from the client's side of the stream:
  TTFT       submit -> first event carrying tokens (prefill + queueing + the first decode chunk)
  ITL        inter-token latency: each gap between token-carrying events split evenly over the
             tokens it delivered (the engine streams once per chunk of ``--rounds-per-chunk``
             rounds, so a raw gap holds many tokens; ``chunk gap`` reports the raw gaps); the
             tokens that come with the first event are in TTFT, not in ITL
  TPOT       per request (e2e - TTFT) / (tokens - 1), as vLLM's benchmark defines it
  E2E        submit -> final event; throughput = tokens streamed (requests completed) / point
             duration (first submit -> last completion)
Server side (engine counters over the point): draft acceptance, tokens per target step, batch
occupancy. Outputs in --out: results.json (rows + environment + exact command), results.md,
results.png (throughput, ITL p50/p99 and TTFT p50/p99 against rate, one line per variant) and
requests.json.gz (every request's event times and token counts, for other statistics later). All
but the PNG are rewritten after every point, so a run cut short still leaves its numbers.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # the time budget counts from here (imports included)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = ("off", "self", "auto", "draft", "draft-auto")


def log(*a):
    print(f"[bench_server {time.perf_counter() - T_START:7.1f}s]", *a, flush=True)


# ============================================================================ load generation
# (no JAX and no numpy below this line until `# === orchestration`: the http client subprocess
# imports only this part)

def new_record(i: int, prompt_len: int, arrival: float) -> dict:
    return {"i": i, "prompt_len": prompt_len, "arrival": arrival, "t_send": None,
            "events": [], "n": 0, "t_done": None, "finish_reason": None, "error": None,
            "status": "pending", "stats": None}


def _on_tokens(rec: dict, now: float, n: int):
    if n > rec["n"]:
        rec["events"].append((now, n))
        rec["n"] = n


async def run_load(arrivals: list[float], request, deadline_s: float) -> tuple[list[dict], float]:
    """Starts request ``i`` at ``arrivals[i]`` seconds (``await request(i, t0, rec)``); after
    ``deadline_s`` the outstanding ones are cancelled (status ``"deadline"``)."""
    t0 = time.perf_counter()
    recs = [None] * len(arrivals)

    async def one(i):
        delay = arrivals[i] - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        await request(i, t0, recs[i])

    for i in range(len(arrivals)):
        recs[i] = {"i": i, "arrival": arrivals[i]}
    tasks = [asyncio.create_task(one(i)) for i in range(len(arrivals))]
    done, pending = await asyncio.wait(tasks, timeout=max(deadline_s, 0.01))
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    for t, rec in zip(tasks, recs):
        if t in pending and rec.get("status") in (None, "pending"):
            rec["status"] = "deadline"
        elif t.done() and not t.cancelled() and t.exception() is not None and \
                rec.get("status") in (None, "pending"):
            rec["status"], rec["error"] = "error", repr(t.exception())
    return recs, t0


def _finish_record(rec: dict, now: float, n_final: int | None):
    if n_final is not None and n_final > rec["n"]:
        _on_tokens(rec, now, n_final)
    rec["t_done"] = now
    if rec["error"] is None and rec["finish_reason"] is not None:
        rec["status"] = "ok"
    elif rec["error"] is None:
        rec["status"], rec["error"] = "error", "the stream ended without a finish_reason"
    else:
        rec["status"] = "error"


async def http_load(job: dict) -> dict:
    """Streams ``/v1/completions`` for every request of ``job`` (the client subprocess)."""
    import httpx
    url = job["url"] + "/v1/completions"
    reqs = job["requests"]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:

        async def request(i, t0, rec):
            r = reqs[i]
            rec.update(new_record(i, len(r["prompt"]), r["arrival"]))
            body = {"model": job["model"], "prompt": r["prompt"], "max_tokens": r["max_tokens"],
                    "temperature": job["temperature"], "stream": True,
                    "stream_options": {"include_usage": True}, "return_token_ids": True,
                    "seed": r.get("seed", i)}
            if job.get("top_p") is not None:
                body["top_p"] = job["top_p"]
            rec["t_send"] = time.perf_counter() - t0
            n_final = None
            try:
                async with client.stream("POST", url, json=body) as resp:
                    if resp.status_code != 200:
                        text = (await resp.aread()).decode("utf-8", "replace")
                        rec["error"] = f"HTTP {resp.status_code}: {text[:300]}"
                        _finish_record(rec, time.perf_counter() - t0, None)
                        return
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        now = time.perf_counter() - t0
                        data = line[6:]
                        if data == "[DONE]":
                            break
                        obj = json.loads(data)
                        if "error" in obj:
                            rec["error"] = str(obj["error"].get("message", obj["error"]))[:300]
                            break
                        if obj.get("usage"):
                            n_final = obj["usage"].get("completion_tokens", n_final)
                        for c in obj.get("choices") or ():
                            ext = c.get("jaxspec") or {}
                            if c.get("finish_reason") is not None:
                                rec["finish_reason"] = c["finish_reason"]
                                rec["stats"] = ext
                                if c.get("token_ids") is not None:
                                    n_final = len(c["token_ids"])
                                if n_final is not None:
                                    _on_tokens(rec, now, n_final)
                            elif "n_tokens" in ext:
                                _on_tokens(rec, now, int(ext["n_tokens"]))
            except (httpx.HTTPError, OSError, ValueError) as e:
                rec["error"] = f"{type(e).__name__}: {e}"[:300]
            _finish_record(rec, time.perf_counter() - t0, n_final)

        recs, _ = await run_load([r["arrival"] for r in reqs], request, job["deadline_s"])
    return {"records": recs}


def client_main(job_path: str) -> int:
    """Entry point of the http client subprocess: reads a job, writes ``job["result"]``."""
    job = json.loads(pathlib.Path(job_path).read_text())
    try:
        import uvloop  # faster event loop where it exists
        runner = getattr(uvloop, "run", asyncio.run)
    except ImportError:
        runner = asyncio.run
    t = time.perf_counter()
    out = runner(http_load(job))
    out["client_wall_s"] = time.perf_counter() - t
    pathlib.Path(job["result"]).write_text(json.dumps(out))
    return 0


# ============================================================================ orchestration
def _parse_rates(s: str) -> list[float]:
    out = []
    for x in s.split(","):
        x = x.strip().lower()
        if x:
            out.append(math.inf if x in ("inf", "burst") else float(x))
    if not out or any(r <= 0 for r in out):
        raise SystemExit(f"--rates must be positive numbers or 'inf', got {s!r}")
    return out


def _rate_str(r: float) -> str:
    return "inf" if math.isinf(r) else f"{r:g}"


def _parse_range(s: str) -> tuple[int, int]:
    parts = [int(x) for x in str(s).split(",") if x.strip()]
    if len(parts) == 1:
        parts = parts * 2
    lo, hi = parts[0], parts[-1]
    if not 1 <= lo <= hi:
        raise SystemExit(f"--prompt-len must be N or MIN,MAX with 1 <= MIN <= MAX, got {s!r}")
    return lo, hi


def _apply_defaults(a):
    tiny = {"prompt_len": "12,40", "max_tokens": 16, "max_batch": 4, "rates": "16,inf",
            "requests_per_point": 6, "min_requests": 4, "point_seconds": 0.5, "sink": 4,
            "window": 12, "gamma": 2, "rounds_per_chunk": 4, "time_budget_s": 240.0,
            "variants": "off,self,auto", "prefill_chunk": 64}
    full = {"prompt_len": "512,2048", "max_tokens": 128, "max_batch": 64,
            "rates": "1,4,16,64,inf", "requests_per_point": 64, "min_requests": 8,
            "point_seconds": 10.0, "sink": 16, "window": 496, "gamma": 4,
            "rounds_per_chunk": 8, "time_budget_s": 540.0, "variants": "off,self,auto",
            "prefill_chunk": 512}
    for k, v in (tiny if a.tiny else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.rate_list = _parse_rates(a.rates)
    a.prompt_range = _parse_range(a.prompt_len)
    a.variant_list = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in a.variant_list if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}; choose from {', '.join(VARIANTS)}")
    if any(v.startswith("draft") for v in a.variant_list) and not a.draft_model:
        raise SystemExit("variants 'draft' / 'draft-auto' need --draft-model PATH")
    if a.max_len is None:
        a.max_len = a.prompt_range[1] + a.max_tokens
    if a.prompt_range[1] + a.max_tokens > a.max_len:
        raise SystemExit(f"--max-len {a.max_len} < longest prompt {a.prompt_range[1]} + "
                         f"--max-tokens {a.max_tokens}")
    if a.model is None and not a.tiny:
        raise SystemExit("give --model PATH (a converted checkpoint) or --tiny")
    return a


def _resolve_mode(mode: str) -> tuple[str, str | None]:
    if mode == "engine":
        return "engine", None
    missing = []
    for mod in ("fastapi", "uvicorn", "httpx"):
        try:
            __import__(mod)
        except Exception as e:  # noqa: BLE001 - any import failure means: not usable
            missing.append(f"{mod} ({type(e).__name__}: {e})")
    if not missing:
        return "http", None
    if mode == "http":
        raise SystemExit(f"--mode http needs {', '.join(missing)}")
    return "engine", "http mode unavailable: " + "; ".join(missing)


def environment(mode: str) -> dict:
    import jax
    import jaxlib
    dev = jax.devices()[0]
    env = {"device": getattr(dev, "device_kind", str(dev)), "backend": jax.default_backend(),
           "device_count": jax.device_count(), "jax": jax.__version__,
           "jaxlib": getattr(jaxlib, "__version__", ""), "python": platform.python_version(),
           "platform": platform.platform(), "cpu_count": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "command": shlex.join([os.path.basename(sys.executable), *sys.argv]), "mode": mode}
    for mod in ("flax", "fastapi", "uvicorn", "starlette", "httpx", "uvloop"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            env[mod] = None
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True,
                                           timeout=5).stdout.strip() or None
    except Exception:  # noqa: BLE001
        env["git_commit"] = None
    return env


def load_prompt_pool(path: str | None) -> list[list[int]] | None:
    """A JSON (optionally gzipped) list of token-id lists, or {"prompts": [...], ...}."""
    if not path:
        return None
    raw = pathlib.Path(path).read_bytes()
    if path.endswith(".gz"):
        raw = gzip.decompress(raw)
    obj = json.loads(raw)
    if isinstance(obj, dict):
        obj = obj["prompts"]
    if not (isinstance(obj, list) and obj and all(isinstance(p, list) for p in obj)):
        raise SystemExit(f"{path}: expected a JSON list of token-id lists")
    return [[int(t) for t in p] for p in obj]


class PromptSource:
    """Prompts of a given length: windows cut at random places from the concatenated documents of
    a prompts file (real text), or random token ids when there is no file."""

    def __init__(self, pool, vocab_size: int, seed: int):
        import numpy as np
        self.np = np
        self.flat = None if pool is None else np.asarray([t for doc in pool for t in doc],
                                                         np.int64)
        self.V = vocab_size
        self.rng = np.random.default_rng(seed)
        if self.flat is not None:
            bad = int(((self.flat < 0) | (self.flat >= vocab_size)).sum())
            if bad:
                raise SystemExit(f"the prompts file has {bad} token ids outside this model's "
                                 f"vocabulary [0, {vocab_size}): made with another tokenizer?")

    @property
    def kind(self) -> str:
        return "random-tokens" if self.flat is None else f"file ({len(self.flat)} tokens)"

    def get(self, n: int) -> list[int]:
        if self.flat is None:
            return self.rng.integers(0, self.V, size=n).tolist()
        if len(self.flat) <= n:
            reps = n // len(self.flat) + 1
            return self.np.tile(self.flat, reps)[:n].tolist()
        s = int(self.rng.integers(0, len(self.flat) - n))
        return self.flat[s:s + n].tolist()


def plan_point(rate: float, a, prompts: PromptSource, seed: int) -> list[dict]:
    """Requests of one rate point: Poisson arrivals (first at 0), prompt lengths uniform in
    --prompt-len."""
    import numpy as np
    rng = np.random.default_rng(seed)
    if math.isinf(rate):
        n = a.requests_per_point
        arrivals = np.zeros(n)
    else:
        n = int(min(a.requests_per_point, max(a.min_requests, round(rate * a.point_seconds))))
        gaps = rng.exponential(1.0 / rate, size=n)
        arrivals = np.concatenate([[0.0], np.cumsum(gaps)[:-1]])
    lo, hi = a.prompt_range
    lens = rng.integers(lo, hi + 1, size=n)
    return [{"prompt": prompts.get(int(L)), "arrival": float(t), "max_tokens": a.max_tokens,
             "seed": seed * 1000 + i} for i, (t, L) in enumerate(zip(arrivals, lens))]


def warmup_lengths(lo: int, hi: int, k: int) -> list[int]:
    """Prompt lengths that hit every prefill bucket (power-of-two padded length, as
    `jaxspec.serving._bucket` picks it) of [lo, hi], plus more up to ``k`` requests."""
    from jaxspec.serving import _bucket
    seen, out = set(), []
    step = max(1, (hi - lo) // 4096)
    for L in list(range(lo, hi + 1, step)) + [hi]:
        b = _bucket(max(L - 1, 1), 1 << 30)[1]
        if b not in seen:
            seen.add(b)
            out.append(L)
    i = 0
    while len(out) < k:
        out.append(lo + (hi - lo) * i // max(k - 1, 1))
        i += 1
    return out


# ---------------------------------------------------------------------------- statistics
def _pct(xs, q):
    import numpy as np
    return float(np.percentile(np.asarray(xs, float), q)) if len(xs) else None


def _mean(xs):
    return float(sum(xs) / len(xs)) if len(xs) else None


def summarize(recs: list[dict], rate: float, wall_s: float) -> dict:
    ok = [r for r in recs if r.get("status") == "ok"]
    failed = [r for r in recs if r.get("status") == "error"]
    late = [r for r in recs if r.get("status") in ("deadline", "pending", None)]
    ttft, e2e, tpot, itl, gaps = [], [], [], [], []
    out_tokens = sum(r.get("n", 0) for r in recs)  # tokens streamed, also of unfinished ones
    for r in ok:
        ev = r["events"]
        if not ev:
            continue
        ttft.append(ev[0][0] - r["t_send"])
        e2e.append(r["t_done"] - r["t_send"])
        n = ev[-1][1]
        if n > 1:
            tpot.append((ev[-1][0] - ev[0][0]) / (n - 1))
        for (t_a, n_a), (t_b, n_b) in zip(ev, ev[1:]):
            gaps.append(t_b - t_a)
            itl.extend([(t_b - t_a) / (n_b - n_a)] * (n_b - n_a))
    ends = [r["t_done"] for r in recs if r.get("t_done") is not None]
    sends = [r["t_send"] for r in recs if r.get("t_send") is not None]
    duration = (max(ends) - min(sends)) if ends and sends else wall_s
    duration = max(duration, 1e-9)
    prompt_tokens = sum(r.get("prompt_len", 0) for r in ok)
    row = {
        "rate": _rate_str(rate), "rate_value": None if math.isinf(rate) else rate,
        "requests": len(recs), "completed": len(ok), "failed": len(failed),
        "unfinished": len(late),
        "errors": sorted({str(r.get("error"))[:200] for r in failed})[:5],
        "finish_reasons": {k: sum(r.get("finish_reason") == k for r in ok)
                           for k in sorted({r.get("finish_reason") for r in ok})},
        "duration_s": duration,
        "offered_span_s": max((r["arrival"] for r in recs), default=0.0),
        "achieved_arrival_rate": (len(sends) / max(sends) if sends and max(sends) > 0
                                  else None),
        "output_tokens": out_tokens, "prompt_tokens_completed": prompt_tokens,
        "request_throughput": len(ok) / duration, "output_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + prompt_tokens) / duration,
        "mean_output_tokens": _mean([r["n"] for r in ok]),
    }
    for name, xs in (("ttft_s", ttft), ("itl_s", itl), ("tpot_s", tpot), ("e2e_s", e2e),
                     ("chunk_gap_s", gaps)):
        row[name] = {"mean": _mean(xs), "p50": _pct(xs, 50), "p90": _pct(xs, 90),
                     "p99": _pct(xs, 99), "max": max(xs) if xs else None, "n": len(xs)}
    return row


def engine_delta(before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0) - before.get(k, 0) for k in (
        "generation_tokens", "draft_proposed", "draft_accepted", "target_row_steps",
        "busy_slot_rounds", "slot_rounds", "rounds", "chunks", "chunk_seconds", "prefill_tokens",
        "sequences_admitted", "finished_cancelled", "finished_error", "rejected_queue_full")}
    d["acceptance_rate"] = (d["draft_accepted"] / d["draft_proposed"]
                            if d["draft_proposed"] else None)
    d["tokens_per_target_step"] = (d["generation_tokens"] / d["target_row_steps"]
                                   if d["target_row_steps"] else None)
    d["batch_occupancy"] = d["busy_slot_rounds"] / d["slot_rounds"] if d["slot_rounds"] else None
    d["ms_per_round"] = 1e3 * d["chunk_seconds"] / d["rounds"] if d["rounds"] else None
    return d


# ---------------------------------------------------------------------------- one variant
def build_speculation(variant: str, a, draft_model):
    import jaxspec
    if variant == "off":
        return None
    draft = "self" if variant in ("self", "auto") else draft_model
    gamma = "auto" if variant.endswith("auto") else int(a.gamma)
    return jaxspec.Speculation(draft=draft, gamma=gamma, sink=a.sink, window=a.window)


def _wait_idle(engine, timeout: float):
    t = time.perf_counter() + timeout
    while time.perf_counter() < t:
        m = engine.metrics()
        if m["slots_busy"] == 0 and m["waiting"] == 0:
            return True
        time.sleep(0.02)
    return False


class Runner:
    """Runs the request plan of one point against a started engine, in http or engine mode."""

    def __init__(self, mode, engine, name, a, out_dir: pathlib.Path):
        self.mode, self.engine, self.name, self.a, self.out_dir = mode, engine, name, a, out_dir
        self.server = None
        if mode == "http":
            from jaxspec.server import BackgroundServer
            self.server = BackgroundServer(engine, name)

    def close(self):
        if self.server is not None:
            self.server.close()
            self.server = None

    def run(self, reqs: list[dict], deadline_s: float) -> tuple[list[dict], float, str | None]:
        t = time.perf_counter()
        if self.mode == "http":
            recs, err = self._run_http(reqs, deadline_s)
        else:
            recs, err = asyncio.run(self._run_engine(reqs, deadline_s)), None
        return recs, time.perf_counter() - t, err

    def _run_http(self, reqs, deadline_s):
        job_dir = self.out_dir / "_jobs"
        job_dir.mkdir(parents=True, exist_ok=True)
        job_path, res_path = job_dir / "job.json", job_dir / "result.json"
        if res_path.exists():
            res_path.unlink()
        job = {"url": self.server.url, "model": self.name, "requests": reqs,
               "temperature": self.a.temperature, "top_p": self.a.top_p,
               "deadline_s": deadline_s, "result": str(res_path)}
        job_path.write_text(json.dumps(job))
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--client-job",
               str(job_path)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline_s + 60)
        except subprocess.TimeoutExpired:
            return [], "the client subprocess timed out"
        if p.returncode != 0 or not res_path.exists():
            return [], f"client subprocess failed (rc={p.returncode}): {p.stderr[-2000:]}"
        return json.loads(res_path.read_text())["records"], None

    async def _run_engine(self, reqs, deadline_s):
        from jaxspec.serving import SamplingOptions, Sequence
        engine = self.engine
        loop = asyncio.get_running_loop()

        async def request(i, t0, rec):
            r = reqs[i]
            rec.update(new_record(i, len(r["prompt"]), r["arrival"]))
            opts = SamplingOptions(max_tokens=r["max_tokens"], temperature=self.a.temperature,
                                   top_p=1.0 if self.a.top_p is None else self.a.top_p,
                                   seed=r.get("seed", i))
            q: asyncio.Queue = asyncio.Queue()
            s = Sequence(r["prompt"], opts, loop=loop, queue=q)
            rec["t_send"] = time.perf_counter() - t0
            try:
                engine.submit([s])
            except Exception as e:  # noqa: BLE001 - QueueFull, PromptTooLong, ...
                rec["error"] = f"{type(e).__name__}: {e}"[:300]
                _finish_record(rec, time.perf_counter() - t0, None)
                return
            n_final = None
            try:
                while True:
                    ev = await q.get()
                    now = time.perf_counter() - t0
                    if ev["type"] == "delta":
                        _on_tokens(rec, now, int(ev["n_tokens"]))
                    elif ev["type"] == "done":
                        rec["finish_reason"] = ev["finish_reason"]
                        rec["stats"] = ev["stats"]
                        n_final = ev["usage"]["completion_tokens"]
                        break
                    else:
                        rec["error"] = str(ev.get("message"))[:300]
                        break
            finally:
                if not s.finished_flag:
                    engine.cancel(s)
            _finish_record(rec, time.perf_counter() - t0, n_final)

        recs, _ = await run_load([r["arrival"] for r in reqs], request, deadline_s)
        return recs


class Budget:
    """Splits the time left between variants: each variant's set-up (compile + warm-up) is paid
    first; the time after it is shared equally between the points of this variant and those of
    the variants still to come (whose set-up is assumed to cost as much as the dearest so far).
    A variant always gets at least the time of its first point if that fits at all."""

    def __init__(self, deadline: float, n_variants: int):
        self.deadline, self.left, self.setup = deadline, n_variants, []

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def can_start(self) -> bool:
        return self.remaining() > max(5.0, max(self.setup, default=0.0) + 2.0)

    def skip(self):
        self.left -= 1

    def points_deadline(self, setup_s: float, first_need: float) -> float:
        self.setup.append(setup_s)
        self.left -= 1  # now: variants after this one
        R = self.remaining()
        P = (R - self.left * max(self.setup)) / (self.left + 1)
        P = max(P, min(R, 1.2 * first_need + 1.0))
        return time.perf_counter() + P


def run_variant(variant, a, model, draft_model, prompts, mode, res, raw, out_dir, save,
                budget: Budget):
    from jaxspec.serving import ServingEngine
    info = {"variant": variant, "status": "ok", "error": None}
    res["variants"].append(info)
    runner = engine = None
    counted = False
    global_deadline = budget.deadline
    try:
        spec = build_speculation(variant, a, draft_model)
        t = time.perf_counter()
        engine = ServingEngine(model, max_batch=a.max_batch, max_len=a.max_len, speculation=spec,
                               rounds_per_chunk=a.rounds_per_chunk,
                               max_queue=max(1024, 2 * a.requests_per_point),
                               prefill_chunk=a.prefill_chunk, per_row=not a.shared_rng,
                               warmup_prefill=0)
        if a.ignore_eos:
            engine.stop_ids = ()  # every request generates exactly max_tokens tokens
        greedy = a.temperature <= 0
        filtering = a.top_p is not None and a.top_p < 1.0
        engine.start(variants=[(greedy, filtering and not greedy)])
        info["compile_s"] = time.perf_counter() - t
        info.update(gamma=engine.gamma, speculative=engine.speculative, slots=engine.B,
                    max_len=engine.max_len, cache_len=engine.S,
                    rounds_per_chunk=engine.rounds, tokens_per_round=engine.tokens_per_round,
                    sink=a.sink if spec else None, window=a.window if spec else None,
                    gamma_requested=None if spec is None else spec.gamma)
        log(f"{variant}: engine compiled in {info['compile_s']:.1f}s (gamma={engine.gamma}, "
            f"slots={engine.B}, max_len={engine.max_len})")
        info["stage"] = "warm-up"  # serving the warm-up requests (the first HTTP use)
        runner = Runner(mode, engine, a.served_name, a, out_dir)
        # warm-up requests through the same path: every prefill bucket, a few concurrent rows
        lens = warmup_lengths(*a.prompt_range, min(engine.B, a.warmup_requests))
        wreqs = [{"prompt": prompts.get(L), "arrival": 0.0, "max_tokens": a.max_tokens,
                  "seed": 10_000 + i} for i, L in enumerate(lens)]
        left = global_deadline - time.perf_counter()
        recs, wall, err = runner.run(wreqs, max(5.0, left))
        ws = summarize(recs, math.inf, wall) if recs else None
        info["warmup_requests"] = len(wreqs)
        info["warmup_s"] = wall
        info["warmup_completed"] = ws["completed"] if ws else 0
        info["warmup_e2e_max_s"] = ws["e2e_s"]["max"] if ws else None
        log(f"{variant}: {info['warmup_completed']}/{len(wreqs)} warm-up requests in {wall:.1f}s")
        if err or not ws or ws["completed"] < len(wreqs):
            errs = err or (ws["errors"] if ws else "no records")
            raise RuntimeError(f"warm-up requests failed: {errs}")
        del info["stage"]
        _wait_idle(engine, 30)
        # a request's duration at low load, for deciding whether a point still fits (the
        # warm-up's own E2E includes the prefill compilations)
        est_req = 0.5 + 1.5 * a.max_tokens * (ws["tpot_s"]["p50"] or 0.01)
        plans = [plan_point(rate, a, prompts, seed=a.seed + 7919 * k)
                 for k, rate in enumerate(a.rate_list)]
        info["setup_s"] = time.perf_counter() - t
        variant_deadline = budget.points_deadline(info["setup_s"],
                                                  plans[0][-1]["arrival"] + est_req)
        counted = True
        log(f"{variant}: {variant_deadline - time.perf_counter():.0f}s for its points")
        for rate, reqs in zip(a.rate_list, plans):
            span = reqs[-1]["arrival"]
            now = time.perf_counter()
            need = span + est_req
            row = {"variant": variant, "rate": _rate_str(rate),
                   "rate_value": None if math.isinf(rate) else rate}
            if now + need > variant_deadline:
                row.update(status="skipped", reason=f"time budget: ~{need:.0f}s needed, "
                           f"{max(0.0, variant_deadline - now):.0f}s left for this variant")
                res["rows"].append(row)
                log(f"{variant} rate={_rate_str(rate)}: skipped ({row['reason']})")
                save()
                continue
            before = engine.metrics()
            recs, wall, err = runner.run(reqs, variant_deadline - time.perf_counter())
            _wait_idle(engine, 10)
            after = engine.metrics()
            if err:
                row.update(status="error", reason=err)
            else:
                row.update(summarize(recs, rate, wall))
                row["status"] = "ok" if row["unfinished"] == 0 else "truncated"
                if row["unfinished"]:
                    row["reason"] = "the time budget ran out during the point"
                row["engine"] = engine_delta(before, after)
                row["wall_s"] = wall
                if row["e2e_s"]["max"]:
                    est_req = max(est_req, 0.5 * row["e2e_s"]["max"])
            res["rows"].append(row)
            raw.append({"variant": variant, "rate": _rate_str(rate), "records": recs})
            save()
            log(f"{variant} rate={_rate_str(rate)}: {_row_line(row)}")
    except Exception as e:  # noqa: BLE001 - record it, go on with the next variant
        info["status"] = "error"
        info["error"] = f"{type(e).__name__}: {e}"
        info["traceback"] = traceback.format_exc()[-4000:]
        log(f"{variant}: FAILED {info['error']}")
        done = {r["rate"] for r in res["rows"] if r["variant"] == variant}
        for rate in a.rate_list:
            if _rate_str(rate) not in done:
                res["rows"].append({"variant": variant, "rate": _rate_str(rate),
                                    "rate_value": None if math.isinf(rate) else rate,
                                    "status": "error", "reason": info["error"]})
    finally:
        if not counted:
            budget.skip()
        if runner is not None:
            runner.close()
        if engine is not None:
            engine.stop()
            engine.cache = engine.dstate = None  # free the KV cache before the next variant
        del engine, runner
        gc.collect()
        save()
    return info


def _row_line(r: dict) -> str:
    if r.get("status") not in ("ok", "truncated"):
        return f"{r.get('status')}: {r.get('reason')}"
    ms = lambda d, k: "-" if d.get(k) is None else f"{1e3 * d[k]:.1f}"  # noqa: E731
    e = r.get("engine", {})
    acc = e.get("acceptance_rate")
    return (f"{r['completed']}/{r['requests']} done, {r['output_tok_s']:.0f} tok/s, "
            f"{r['request_throughput']:.2f} req/s, TTFT p50 {ms(r['ttft_s'], 'p50')} ms, "
            f"ITL p50/p99 {ms(r['itl_s'], 'p50')}/{ms(r['itl_s'], 'p99')} ms, "
            f"E2E p50 {r['e2e_s']['p50'] or 0:.2f}s"
            + (f", accept {acc:.2f}" if acc is not None else ""))


# ---------------------------------------------------------------------------- outputs
def write_markdown(res: dict, path: pathlib.Path):
    env, cfg = res["environment"], res["config"]
    L = [f"# Server benchmark: {cfg['model']}", "",
         f"{env.get('date')} on {env.get('device')} ({env.get('backend')}), jax "
         f"{env.get('jax')} / jaxlib {env.get('jaxlib')}, Python {env.get('python')}, "
         f"mode **{env.get('mode')}**" + (f" ({res['mode_note']})" if res.get("mode_note") else "")
         + f", git {env.get('git_commit')}.", "",
         f"Command: `{env.get('command')}`", "",
         f"Prompts: {cfg['prompt_source']}, {cfg['prompt_len'][0]}-{cfg['prompt_len'][1]} tokens; "
         f"{cfg['max_tokens']} new tokens per request (EOS "
         f"{'ignored' if cfg['ignore_eos'] else 'honoured'}), temperature {cfg['temperature']}; "
         f"slots {cfg['max_batch']}, max_len {cfg['max_len']}, rounds/chunk "
         f"{cfg['rounds_per_chunk']}. Model load {res.get('model_load_s', 0):.1f}s; total "
         f"{res.get('total_s', 0):.0f}s of a {cfg['time_budget_s']:.0f}s budget.", "",
         "| variant | gamma | compile s | warm-up s | status |", "|---|---|---|---|---|"]
    for v in res["variants"]:
        L.append(f"| {v['variant']} | {v.get('gamma', '-')}"
                 + (" (auto)" if v.get("gamma_requested") == "auto" else "")
                 + f" | {_f(v.get('compile_s'), 1)} | {_f(v.get('warmup_s'), 1)} | "
                 f"{v['status']}{': ' + v['error'] if v.get('error') else ''} |")
    L += ["", "Latencies in ms unless marked; ITL = inter-token latency (chunk gaps split over "
          "their tokens), TPOT = (E2E - TTFT) / (tokens - 1).", "",
          "| variant | rate req/s | done/sent | req/s | out tok/s | TTFT p50 / p99 | "
          "ITL p50 / p99 | TPOT p50 | E2E p50 / p99 s | chunk gap p50 | accept | tok/step | "
          "occupancy | status |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if r.get("status") not in ("ok", "truncated"):
            L.append(f"| {r['variant']} | {r['rate']} | | | | | | | | | | | | {r['status']}: "
                     f"{str(r.get('reason', ''))[:120]} |")
            continue
        e = r.get("engine", {})
        L.append(
            f"| {r['variant']} | {r['rate']} | {r['completed']}/{r['requests']} | "
            f"{r['request_throughput']:.2f} | {r['output_tok_s']:.0f} | "
            f"{_ms(r['ttft_s']['p50'])} / {_ms(r['ttft_s']['p99'])} | "
            f"{_ms(r['itl_s']['p50'], 2)} / {_ms(r['itl_s']['p99'], 2)} | "
            f"{_ms(r['tpot_s']['p50'], 2)} | {_f(r['e2e_s']['p50'], 2)} / "
            f"{_f(r['e2e_s']['p99'], 2)} | {_ms(r['chunk_gap_s']['p50'])} | "
            f"{_f(e.get('acceptance_rate'), 2)} | {_f(e.get('tokens_per_target_step'), 2)} | "
            f"{_f(e.get('batch_occupancy'), 2)} | {r['status']} |")
    path.write_text("\n".join(L) + "\n")


def _f(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def _ms(x, nd=1):
    return "-" if x is None else f"{1e3 * x:.{nd}f}"


def write_plot(res: dict, path: pathlib.Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rates = res["config"]["rates"]
    order = sorted(rates, key=lambda s: math.inf if s == "inf" else float(s))
    xpos = {r: i for i, r in enumerate(order)}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for vi, v in enumerate(res["variants"]):
        rows = sorted([r for r in res["rows"] if r["variant"] == v["variant"]
                       and r.get("status") in ("ok", "truncated")], key=lambda r: xpos[r["rate"]])
        if not rows:
            continue
        x = [xpos[r["rate"]] for r in rows]
        c = f"C{vi}"
        lab = v["variant"] + (f" (gamma={v.get('gamma')})" if v["variant"] != "off" else "")
        axes[0].plot(x, [r["output_tok_s"] for r in rows], "o-", color=c, label=lab)
        axes[1].plot(x, [1e3 * r["itl_s"]["p50"] for r in rows], "o-", color=c, label=lab + " p50")
        axes[1].plot(x, [1e3 * r["itl_s"]["p99"] for r in rows], "s--", color=c,
                     label=lab + " p99")
        axes[2].plot(x, [1e3 * r["ttft_s"]["p50"] for r in rows], "o-", color=c, label=lab + " p50")
        axes[2].plot(x, [1e3 * r["ttft_s"]["p99"] for r in rows], "s--", color=c,
                     label=lab + " p99")
    titles = ("output tokens/s", "inter-token latency (ms)", "time to first token (ms)")
    for ax, t in zip(axes, titles):
        ax.set_title(t)
        ax.set_xticks(range(len(order)), order)
        ax.set_xlabel("request rate (req/s; inf = burst)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    env = res["environment"]
    fig.suptitle(f"{res['config']['model']} on {env.get('device')} ({env.get('mode')} mode), "
                 f"{res['config']['max_tokens']} new tokens, prompts "
                 f"{res['config']['prompt_len'][0]}-{res['config']['prompt_len'][1]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main
def bench(a) -> int:
    out_dir = pathlib.Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    global_deadline = T_START + a.time_budget_s
    mode, note = _resolve_mode(a.mode)
    if note:
        log(note, "-> engine mode")
    import jax

    import jaxspec
    env = environment(mode)
    log(json.dumps(env))
    t = time.perf_counter()
    if a.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny import tiny_model
        model = tiny_model(seed=0, scale=3.0, eos_token_ids=(1,))
        draft_model = tiny_model(seed=1, scale=3.0, eos_token_ids=(1,)) if a.draft_model else None
        name = "tiny"
    else:
        model = jaxspec.load(a.model, dtype=a.dtype)
        draft_model = jaxspec.load(a.draft_model, dtype=a.dtype) if a.draft_model else None
        name = pathlib.Path(a.model).name
    jax.block_until_ready(jax.tree_util.tree_leaves(model.params))
    load_s = time.perf_counter() - t
    a.served_name = name
    log(f"loaded {name} in {load_s:.1f}s: {model}")
    prompts = PromptSource(load_prompt_pool(a.prompts_file), model.config.vocab_size, a.seed)
    res = {"environment": env, "mode_note": note, "model_load_s": load_s,
           "config": {"model": name, "model_path": a.model, "draft_model": a.draft_model,
                      "variants": a.variant_list, "rates": [_rate_str(r) for r in a.rate_list],
                      "prompt_len": list(a.prompt_range), "prompt_source": prompts.kind,
                      "prompts_file": a.prompts_file, "max_tokens": a.max_tokens,
                      "max_batch": a.max_batch, "max_len": a.max_len,
                      "rounds_per_chunk": a.rounds_per_chunk, "prefill_chunk": a.prefill_chunk,
                      "gamma": a.gamma, "sink": a.sink, "window": a.window,
                      "temperature": a.temperature, "top_p": a.top_p,
                      "ignore_eos": a.ignore_eos, "requests_per_point": a.requests_per_point,
                      "min_requests": a.min_requests, "point_seconds": a.point_seconds,
                      "time_budget_s": a.time_budget_s, "seed": a.seed,
                      "per_row_rng": not a.shared_rng, "dtype": str(model.dtype)},
           "variants": [], "rows": []}

    raw: list[dict] = []  # per-request records of every point (event times, token counts)

    def save():
        res["total_s"] = time.perf_counter() - T_START
        for name, data in (("results.json", json.dumps(res, indent=1, default=str).encode()),
                           ("requests.json.gz", gzip.compress(json.dumps(raw).encode()))):
            tmp = out_dir / (name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(out_dir / name)
        write_markdown(res, out_dir / "results.md")

    save()
    reserve = 8.0  # seconds kept for the plot and the last teardown
    budget = Budget(global_deadline - reserve, len(a.variant_list))
    for variant in a.variant_list:
        if not budget.can_start():
            budget.skip()
            res["variants"].append({"variant": variant, "status": "skipped",
                                    "error": "time budget"})
            for rate in a.rate_list:
                res["rows"].append({"variant": variant, "rate": _rate_str(rate),
                                    "rate_value": None if math.isinf(rate) else rate,
                                    "status": "skipped", "reason": "time budget"})
            log(f"{variant}: skipped (time budget)")
            save()
            continue
        info = run_variant(variant, a, model, draft_model, prompts, mode, res, raw, out_dir,
                           save, budget)
        if (info.get("stage") == "warm-up" and mode == "http" and a.mode == "auto"
                and len(res["variants"]) == 1):
            # the HTTP stack imports but does not serve here (e.g. carried wheels that do not fit
            # this machine's anyio): measure in-process instead of losing the run
            log(f"http mode failed its warm-up ({info['error']}); again in engine mode")
            mode = res["environment"]["mode"] = "engine"
            res["mode_note"] = f"http mode failed its warm-up: {info['error'][:300]}"
            res["variants"].clear()
            res["rows"].clear()
            budget.left += 1
            run_variant(variant, a, model, draft_model, prompts, mode, res, raw, out_dir, save,
                        budget)
    save()
    try:
        write_plot(res, out_dir / "results.png")
    except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
        log(f"plot failed: {type(e).__name__}: {e}")
    jobs = out_dir / "_jobs"
    if jobs.exists():
        for f in jobs.iterdir():
            f.unlink()
        jobs.rmdir()
    n_ok = sum(r.get("status") == "ok" for r in res["rows"])
    log(f"done in {time.perf_counter() - T_START:.0f}s: {n_ok}/{len(res['rows'])} points ok; "
        f"{out_dir}/results.json, results.md, results.png")
    print((out_dir / "results.md").read_text(), flush=True)
    failed = [v["variant"] for v in res["variants"] if v["status"] == "error"]
    return 1 if failed or any(r.get("status") == "error" for r in res["rows"]) else 0


def make_prompts(a) -> int:
    """Writes a prompts file (token-id lists) from jaxspec.textdata's long public-domain texts."""
    from tokenizers import Tokenizer

    from jaxspec import textdata
    tok_path = pathlib.Path(a.tokenizer)
    if tok_path.is_dir():
        tok_path = tok_path / "tokenizer.json"
    tok = Tokenizer.from_file(str(tok_path))
    prompts = textdata.make_prompts(tok, n=a.n_prompts, length=a.prompt_tokens, seed=a.seed,
                                    source=a.text_source)
    obj = {"prompts": prompts, "tokenizer": str(a.tokenizer), "source": a.text_source,
           "n": len(prompts), "length": a.prompt_tokens, "seed": a.seed}
    raw = json.dumps(obj, separators=(",", ":")).encode()
    out = pathlib.Path(a.make_prompts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(gzip.compress(raw) if out.name.endswith(".gz") else raw)
    print(f"wrote {len(prompts)} prompts of {a.prompt_tokens} tokens to {out} "
          f"({out.stat().st_size / 1e6:.1f} MB)")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="converted checkpoint folder")
    p.add_argument("--tiny", action="store_true", help="a tiny random model (CPU smoke test)")
    p.add_argument("--dtype", default=None, help="cast the weights (default: as stored)")
    p.add_argument("--draft-model", default=None, help="a draft checkpoint (variants draft*)")
    p.add_argument("--variants", default=None,
                   help=f"comma list of {', '.join(VARIANTS)} (default off,self,auto)")
    p.add_argument("--gamma", type=int, default=None, help="drafts per round of 'self' (4)")
    p.add_argument("--sink", type=int, default=None, help="draft sink tokens (16)")
    p.add_argument("--window", type=int, default=None, help="draft window (496)")
    p.add_argument("--rates", default=None,
                   help="request rates in req/s, 'inf' = all at once (1,4,16,64,inf); run in "
                        "this order, so put the ones that matter most first")
    p.add_argument("--requests-per-point", type=int, default=None,
                   help="requests of the burst point, and the most of any point (64)")
    p.add_argument("--min-requests", type=int, default=None, help="fewest per point (8)")
    p.add_argument("--point-seconds", type=float, default=None,
                   help="arrival window of a rate point: rate x this many requests (10)")
    p.add_argument("--prompt-len", default=None, help="N or MIN,MAX tokens (512,2048)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (128)")
    p.add_argument("--prompts-file", default=None,
                   help="JSON (or .json.gz) list of token-id lists, or {'prompts': [...]}; "
                        "windows are cut from it; default: random token ids")
    p.add_argument("--max-batch", type=int, default=None, help="engine slots (64)")
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens per sequence (default longest prompt + max tokens)")
    p.add_argument("--rounds-per-chunk", type=int, default=None, help="(8)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="(512)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at EOS (by default EOS is ignored: fixed-length completions)")
    p.add_argument("--shared-rng", action="store_true", help="engine per_row=False")
    p.add_argument("--warmup-requests", type=int, default=4,
                   help="warm-up requests per variant (at least one per prefill bucket)")
    p.add_argument("--mode", choices=("auto", "http", "engine"), default="auto")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="the whole run, imports included (540); points that would not fit are "
                        "recorded as skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/server")
    g = p.add_argument_group("making a prompts file instead (needs the network once)")
    g.add_argument("--make-prompts", metavar="FILE", default=None)
    g.add_argument("--tokenizer", default=None, help="checkpoint folder or tokenizer.json")
    g.add_argument("--n-prompts", type=int, default=64)
    g.add_argument("--prompt-tokens", type=int, default=4096)
    g.add_argument("--text-source", default="shakespeare", help="jaxspec.textdata source")
    p.add_argument("--client-job", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    global T_START
    if __name__ != "__main__":  # called in-process (a test, a notebook): the budget counts from
        T_START = time.perf_counter()  # this call, not from whenever the module was imported
    a = parser().parse_args(argv)
    if a.client_job:
        return client_main(a.client_job)
    sys.path.insert(0, str(ROOT))
    if a.make_prompts:
        if not a.tokenizer:
            raise SystemExit("--make-prompts needs --tokenizer")
        return make_prompts(a)
    return bench(_apply_defaults(a))


if __name__ == "__main__":
    sys.exit(main())
