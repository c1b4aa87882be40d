"""``jaxspec bench server``: the OpenAI-compatible server under load, measured over HTTP only.

For each speculation variant (``off``; ``default`` = ``jaxspec.Speculation()``; ``auto`` =
``Speculation(gamma="auto")``; or any `jaxspec.bench.parse_variant` string such as
``g4-w496-fixed``) a server is started in this process (`jaxspec.serving.ServingEngine` behind
`jaxspec.server.BackgroundServer`, listening on 127.0.0.1 only), warmed up with requests of the
benchmark's shapes (so compilation is not measured), and then, for each request rate, sent the
same ``--requests`` streamed ``/v1/completions`` requests: token-id prompts cut from a text source
(`jaxspec.bench.make_prompts`; random tokens for a model without a tokenizer), lengths from
``--prompt`` (``16384``, or a range ``8192-32768`` drawn per request with ``--seed``),
``max_tokens=--new``, greedy. Arrivals: all at once (rate ``inf``) or a Poisson process of that
rate; every variant sees the same prompts and arrival times.

The client runs in a separate Python process (httpx, asyncio; no JAX there), so the server's
process shares its interpreter with nobody but itself, as under ``jaxspec serve``. It stamps every
server-sent event as it arrives:

- TTFT: request sent -> first event carrying tokens (queueing + prefill + the first chunk);
- ITL: the gap between two token-carrying events, split evenly over the tokens the later one
  brought (the server streams once per decode chunk; the raw gaps are ``chunk_gap_s``);
- e2e: request sent -> ``data: [DONE]``; TPOT: (e2e - TTFT) / (tokens - 1) per request;
- throughput: tokens (requests) completed / (first send -> last completion).

The server's own counters (``GET /metrics``, before and after each point) give its acceptance rate,
tokens per target step and decode-only throughput (generated tokens / seconds in decode chunks).
Each variant is compared with ``off`` at the same rate. One reference is measured in the same run:
`jaxspec.generate`'s plain decode throughput (new tokens / ``stats["decode_seconds"]``, fixed
length) at batch = the server's slots on prompts of the benchmark's lengths; the report says whether
the server's decode throughput with speculation off stays within 10% of it. The greedy outputs of
the first ``--check`` requests are compared with `jaxspec.generate`'s for the same prompts.

The server stops a completion at the model's EOS (it has no ``ignore_eos``): the report counts
finish reasons. Every loop is bounded: ``--point-timeout-s`` per point (requests still running then
are cancelled and counted as unfinished), ``--time-budget-s`` for the whole run (points left are
recorded as skipped). Results: ``--out DIR`` gets ``NAME.json`` and ``NAME.md`` (device, versions,
date, exact command), rewritten after every point.

This module's top level imports only the standard library and numpy: the client process loads this
file alone (not the ``jaxspec`` package) and runs `client_main`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

WITHIN = 0.10  # the server's plain decode throughput should be within this of generate's
SERVED_NAME = "jaxspec-bench"  # the model name the benchmark's server answers to
IDLE_TIMEOUT_S = 120.0  # waiting for the server to finish what a point left running


# ============================================================================= the client process
async def _load(job: dict) -> list[dict]:
    """Sends every request of ``job`` at its arrival time and records its stream."""
    import httpx
    prompts = json.loads(pathlib.Path(job["prompts_file"]).read_text())
    reqs = job["requests"]  # [{"prompt": index into prompts, "arrival": seconds}]
    deadline = float(job["deadline_s"])
    url = job["url"] + "/v1/completions"
    bodies = [json.dumps({"model": job["model"], "prompt": prompts[r["prompt"]],
                          "max_tokens": job["max_tokens"], "temperature": 0, "stream": True,
                          "return_token_ids": True}).encode() for r in reqs]
    del prompts
    records = [{"i": i, "prompt": r["prompt"], "arrival": r["arrival"], "status": "unfinished",
                "t_send": None, "events": [], "t_done": None, "finish_reason": None,
                "token_ids": None, "error": None} for i, r in enumerate(reqs)]
    n = len(reqs)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    timeout = httpx.Timeout(deadline + 5.0, connect=min(30.0, deadline + 5.0))
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        t0 = time.perf_counter()

        async def one(rec, body):
            wait = t0 + rec["arrival"] - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            rec["t_send"] = time.perf_counter() - t0
            last = 0
            async with client.stream("POST", url, content=body, headers=headers) as r:
                if r.status_code != 200:
                    text = (await r.aread())[:300].decode("utf-8", "replace")
                    rec.update(status="error", error=f"HTTP {r.status_code}: {text}")
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    now = time.perf_counter() - t0
                    if data == "[DONE]":
                        rec["t_done"] = now
                        rec["status"] = "ok" if rec["finish_reason"] else "error"
                        if not rec["finish_reason"]:
                            rec["error"] = "the stream ended without a finish reason"
                        return
                    obj = json.loads(data)
                    if "error" in obj:
                        rec.update(status="error", error=str(obj["error"].get("message"))[:300])
                        return
                    for ch in obj.get("choices", []):
                        n_tok = (ch.get("jaxspec") or {}).get("n_tokens")
                        if ch.get("finish_reason") is not None:
                            rec["finish_reason"] = ch["finish_reason"]
                            ids = ch.get("token_ids")
                            if ids is not None:
                                rec["token_ids"] = ids
                                n_tok = len(ids)
                        elif n_tok is None and ch.get("text"):
                            n_tok = last + 1  # a server without the n_tokens extension
                        if n_tok is not None and n_tok > last:
                            rec["events"].append([now, int(n_tok)])
                            last = int(n_tok)
            rec.update(status="error", error="the stream ended before data: [DONE]")

        async def guarded(rec, body):
            try:
                await one(rec, body)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a failed request is a record, not a crash
                rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")

        tasks = [asyncio.create_task(guarded(rec, body)) for rec, body in zip(records, bodies)]
        _, pending = await asyncio.wait(tasks, timeout=deadline)
        for t in pending:  # past the deadline: cancelled (the server frees their slots)
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return records


def client_main(job_path: str, out_path: str) -> int:
    """The client process: runs the job in ``job_path`` and writes its records to ``out_path``."""
    job = json.loads(pathlib.Path(job_path).read_text())
    try:  # one socket per concurrent request
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = len(job["requests"]) + 64
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY
                                                        else min(want, hard), hard))
    except (ImportError, ValueError, OSError):
        pass
    records = asyncio.run(_load(job))
    pathlib.Path(out_path).write_text(json.dumps(records))
    return 0


_BOOT = ("import importlib.util, sys; "
         "s = importlib.util.spec_from_file_location('jaxspec_bench_client', sys.argv[1]); "
         "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
         "sys.exit(m.client_main(sys.argv[2], sys.argv[3]))")


def run_client(url: str, prompts_file: str, requests: list[dict], max_tokens: int,
               deadline_s: float, workdir: str) -> list[dict]:
    """Runs one load (``requests``: ``{"prompt": index, "arrival": s}``) through a client
    process; returns its records (times in seconds from the client's start)."""
    job = pathlib.Path(workdir) / "job.json"
    out = pathlib.Path(workdir) / "records.json"
    out.unlink(missing_ok=True)
    job.write_text(json.dumps({"url": url, "model": SERVED_NAME, "prompts_file": prompts_file,
                               "requests": requests,
                               "max_tokens": int(max_tokens), "deadline_s": float(deadline_s)}))
    p = subprocess.run([sys.executable, "-c", _BOOT, os.path.abspath(__file__), str(job),
                        str(out)], cwd=workdir, capture_output=True, text=True,
                       timeout=deadline_s + 120)
    if p.returncode != 0 or not out.exists():
        raise RuntimeError(f"the benchmark client failed (exit {p.returncode}): "
                           f"{p.stderr.strip()[-1500:]}")
    return json.loads(out.read_text())


# ============================================================================= the plan
def parse_rates(text: str) -> list[float]:
    """``inf,4,1`` -> [inf, 4.0, 1.0] (requests per second; ``inf``: all at once)."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            r = float(part)
        except ValueError:
            raise ValueError(f"--rates: {part!r} is not a number or 'inf'") from None
        if math.isnan(r) or r <= 0:
            raise ValueError(f"--rates: each rate must be > 0 requests/s or 'inf', got {part!r}")
        out.append(r)
    if not out:
        raise ValueError("--rates: give at least one rate")
    return out


def parse_lengths(text: str) -> tuple[int, int]:
    """``16384`` -> (16384, 16384); ``8192-32768`` -> (8192, 32768)."""
    lo, _, hi = str(text).partition("-")
    try:
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--prompt must be a length or a range LO-HI of lengths, "
                         f"got {text!r}") from None
    if lo_i < 1 or hi_i < lo_i:
        raise ValueError(f"--prompt: lengths must be >= 1 and LO <= HI, got {text!r}")
    return lo_i, hi_i


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times of ``n`` requests: all at 0 for rate ``inf``, else a Poisson process of
    ``rate`` requests/s (exponential gaps) starting at 0."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(n - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist()


def plan_requests(model, n: int, lo: int, hi: int, seed: int, source: str) -> list[list[int]]:
    """``n`` token-id prompts, lengths drawn uniformly from [lo, hi] with ``seed``, each cut from
    the start of a ``hi``-token prompt of `jaxspec.bench.make_prompts`."""
    from jaxspec.bench import make_prompts
    lengths = np.random.default_rng(seed).integers(lo, hi + 1, size=n)
    pool = make_prompts(model, n, hi, seed, source)
    return [list(p[:int(k)]) for p, k in zip(pool, lengths)]


def warmup_lengths(lo: int, hi: int) -> list[int]:
    """Prompt lengths whose prefills cover the shapes of prompts of [lo, hi] tokens: the ends and
    each power of two between (the server buckets prefill lengths by powers of two)."""
    out = {lo, hi}
    p = 16
    while p < hi:
        if p > lo:
            out.add(p)
        p *= 2
    return sorted(out)


# ============================================================================= statistics
def _pct(xs) -> dict:
    if not len(xs):
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    a = np.asarray(xs, np.float64)
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "max": float(a.max())}


def summarize(records: list[dict]) -> dict:
    """Client-side numbers of one point (see the module docstring for the definitions)."""
    ok = [r for r in records if r["status"] == "ok" and r["events"]]
    sent = [r["t_send"] for r in records if r["t_send"] is not None]
    ttft, e2e, tpot, itl, gaps, finish = [], [], [], [], [], {}
    tokens = 0
    for r in ok:
        ev = r["events"]
        n = ev[-1][1]
        tokens += n
        ttft.append(ev[0][0] - r["t_send"])
        e2e.append(r["t_done"] - r["t_send"])
        if n > 1:
            tpot.append((r["t_done"] - r["t_send"] - ttft[-1]) / (n - 1))
        for (t0, n0), (t1, n1) in zip(ev, ev[1:]):
            gaps.append(t1 - t0)
            itl.extend([(t1 - t0) / (n1 - n0)] * (n1 - n0))
        finish[r["finish_reason"]] = finish.get(r["finish_reason"], 0) + 1
    duration = (max(r["t_done"] for r in ok) - min(sent)) if ok else 0.0
    errors = sorted({r["error"] for r in records if r["status"] == "error"})
    return {
        "requests": len(records), "completed": len(ok),
        "failed": sum(r["status"] == "error" for r in records),
        "unfinished": sum(r["status"] == "unfinished" for r in records),
        "errors": errors[:5], "duration_s": duration, "output_tokens": tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_tok_s": tokens / duration if duration > 0 else 0.0,
        "ttft_s": _pct(ttft), "itl_s": _pct(itl), "e2e_s": _pct(e2e), "tpot_s": _pct(tpot),
        "chunk_gap_s": _pct(gaps), "finish_reasons": finish,
        "per_request": [{"prompt_tokens": r.get("prompt_tokens"), "ttft_s": r["events"][0][0] -
                         r["t_send"], "e2e_s": r["t_done"] - r["t_send"],
                         "tokens": r["events"][-1][1], "finish_reason": r["finish_reason"]}
                        for r in ok],
    }


def parse_metrics(text: str) -> dict:
    """Prometheus text -> ``{"name{labels}": value}``."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            try:
                out[k] = float(v)
            except ValueError:
                continue
    return out


def server_delta(before: dict, after: dict) -> dict:
    """The server's own numbers over one point, from its ``/metrics`` counters."""
    def d(name):
        return after.get(f"jaxspec_{name}", 0.0) - before.get(f"jaxspec_{name}", 0.0)
    proposed, accepted = d("draft_tokens_proposed_total"), d("draft_tokens_accepted_total")
    gen, steps, secs = (d("generation_tokens_total"), d("target_steps_total"),
                        d("decode_seconds_total"))
    return {"generation_tokens": int(gen), "target_steps": int(steps),
            "decode_rounds": int(d("decode_rounds_total")),
            "decode_chunks": int(d("decode_chunks_total")), "decode_seconds": secs,
            "draft_proposed": int(proposed), "draft_accepted": int(accepted),
            "acceptance_rate": accepted / proposed if proposed else None,
            "tokens_per_target_step": gen / steps if steps else None,
            "decode_tok_s": gen / secs if secs > 0 else None}


def served_gamma(metrics: dict):
    for k in metrics:
        if k.startswith("jaxspec_model_info{") and 'gamma="' in k:
            return int(k.split('gamma="', 1)[1].split('"', 1)[0])
    return None


# ============================================================================= the server side
def _get_metrics(url: str) -> dict:
    import httpx
    r = httpx.get(url + "/metrics", timeout=30, trust_env=False)
    r.raise_for_status()
    return parse_metrics(r.text)


def _wait_idle(url: str, timeout: float = IDLE_TIMEOUT_S) -> dict:
    """The server's metrics once no slot is busy and nothing waits (at most ``timeout`` s)."""
    t_end = time.monotonic() + timeout
    while True:
        m = _get_metrics(url)
        if m.get("jaxspec_slots_busy", 0) == 0 and m.get("jaxspec_queue_depth", 0) == 0:
            return m
        if time.monotonic() > t_end:
            raise TimeoutError(f"the server was still busy {timeout:.0f} s after the load ended")
        time.sleep(0.05)


def _speculation(name: str, draft):
    from jaxspec.bench import parse_variant
    if name in ("off", "plain"):
        return None
    return parse_variant(name, draft)


def check_args(a, has_draft: bool = False) -> None:
    """Every argument, before a model is loaded; ValueError naming the argument."""
    a.rate_list = parse_rates(a.rates)
    a.lengths = parse_lengths(a.prompt)
    for name in ("requests", "new", "max_batch"):
        v = getattr(a, name)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
    for flag, name in (("--check", "check_outputs"), ("--warmup", "warmup")):
        if getattr(a, name) < 0:
            raise ValueError(f"{flag} must be >= 0, got {getattr(a, name)!r}")
    if a.rounds_per_chunk < 1 or a.prefill_chunk < 1:
        raise ValueError("--rounds-per-chunk and --prefill-chunk must be >= 1")
    if not a.point_timeout_s > 0:
        raise ValueError(f"--point-timeout-s must be > 0, got {a.point_timeout_s!r}")
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if not variants or len(set(variants)) != len(variants):
        raise ValueError(f"--variants: give distinct variant names, got {a.variants!r}")
    a.variant_list = ["off"] + [v for v in variants if v not in ("off", "plain")]
    from jaxspec.bench import parse_variant
    for v in a.variant_list[1:]:  # names parse before anything is loaded
        if "draft" in v.split("-"):
            if not (a.draft or has_draft):
                raise ValueError(f"--variants: {v!r} needs --draft")
            continue
        try:
            parse_variant(v)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--variants: {e}") from None
    import importlib
    missing = []
    for mod in ("fastapi", "uvicorn", "httpx"):
        try:
            importlib.import_module(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise ValueError(f"jaxspec bench server needs fastapi, uvicorn and httpx "
                         f"(pip install 'jaxspec[serve]' httpx); missing: {', '.join(missing)}")


def _reference(model, prompts, warm_prompts, new) -> dict:
    """`jaxspec.generate`'s plain decoding at this batch: decode and end-to-end throughput."""
    import jaxspec
    jaxspec.generate(model, warm_prompts, max_new_tokens=new, ignore_eos=True)  # compile
    res = jaxspec.generate(model, prompts, max_new_tokens=new, ignore_eos=True)
    st = res.stats
    e2e = st["seconds"] - st["compile_seconds"]
    return {"batch": len(prompts), "prompt_tokens": [len(p) for p in prompts],
            "new_tokens": st["new_tokens"], "decode_seconds": st["decode_seconds"],
            "prefill_seconds": st["prefill_seconds"], "seconds": e2e,
            "compile_seconds": st["compile_seconds"],
            "decode_tok_s": st["new_tokens"] / st["decode_seconds"],
            "e2e_tok_s": st["new_tokens"] / e2e, "tokens": res.tokens}


def bench_server(args, model=None, draft=None) -> dict:
    """Runs the benchmark (``args`` from `add_arguments`); ``model`` / ``draft``: in-memory models
    instead of ``--model`` / ``--draft``. Returns what it writes to ``NAME.json``."""
    check_args(args, has_draft=draft is not None)
    import jax

    import jaxspec
    from jaxspec.bench import environment, load_model, write_results
    from jaxspec.server import BackgroundServer, ServerLimits
    from jaxspec.serving import ServingEngine
    from jaxspec.session import stop_token_ids

    t_start = time.monotonic()
    label = args.model if model is None else "(in memory)"
    if model is None:
        model = load_model(args.model, args.dtype)
    if draft is None and args.draft:
        draft = load_model(args.draft, args.dtype)
    specs = {v: _speculation(v, draft) for v in args.variant_list}
    lo, hi = args.lengths
    N, B, new = args.requests, args.max_batch, args.new
    ctx = model.config.max_position_embeddings
    max_len = args.max_len or hi + new
    if hi + new > min(max_len, ctx):
        raise ValueError(f"--prompt up to {hi} tokens + --new {new} need {hi + new} tokens per "
                         f"sequence, more than {'--max-len' if args.max_len else 'the model'} "
                         f"allows ({min(max_len, ctx)})")
    prompts = plan_requests(model, max(N, B), lo, hi, args.seed, args.source)
    # warm-up prompts: other text, the shapes of the measured ones (the reference's warm-up call:
    # the same lengths; the servers': every prefill length bucket at least once)
    pool = plan_requests(model, max(B, args.warmup, len(warmup_lengths(lo, hi))), hi, hi,
                         args.seed + 1000, args.source)
    ref_warm = [w[:len(p)] for w, p in zip(pool, prompts[:B])]
    lens = warmup_lengths(lo, hi)
    n_warm = max(args.warmup, len(lens))
    warm = [w[:lens[i % len(lens)]] for i, w in enumerate(pool[:n_warm])]
    out = {"env": environment(), "model": label,
           "draft": args.draft, "max_batch": B, "max_len": max_len,
           "rounds_per_chunk": args.rounds_per_chunk, "prefill_chunk": args.prefill_chunk,
           "prompt": [lo, hi], "source": args.source if model.tokenizer else "random",
           "seed": args.seed, "new_tokens": new, "requests": N,
           "rates": [rate_label(r) for r in args.rate_list], "variants": args.variant_list,
           "stop_tokens": list(stop_token_ids(model, None)), "reference": None, "check": None,
           "servers": {}, "points": [], "speedups": [], "verdict": None}

    def save():
        _finish(out)
        if args.out:
            write_results(out, args.out, args.name, markdown)

    def over_budget():
        return args.time_budget_s is not None and time.monotonic() - t_start > args.time_budget_s

    # reference and check outputs (plain jaxspec.generate, in this process, before any server)
    print(f"reference: jaxspec.generate, plain, batch {B}", flush=True)
    ref = _reference(model, prompts[:B], ref_warm, new)
    K = min(args.check_outputs, N)
    if K and not out["stop_tokens"] and K <= B:
        check_tokens = ref["tokens"][:K]  # no stop token: fixed-length rows are the outputs
    elif K:
        check_tokens = jaxspec.generate(model, prompts[:K], max_new_tokens=new).tokens
    else:
        check_tokens = []
    del ref["tokens"]
    out["reference"] = ref
    out["check"] = {"requests": K, "outputs": check_tokens}
    print(f"reference: {ref['decode_tok_s']:.1f} tok/s decode, {ref['e2e_tok_s']:.1f} tok/s "
          f"end to end", flush=True)
    save()

    limits = ServerLimits(max_generation_tokens=max(ServerLimits().max_generation_tokens, new))
    with tempfile.TemporaryDirectory(prefix="jaxspec-bench-server-") as work:
        prompts_file = str(pathlib.Path(work) / "prompts.json")
        pathlib.Path(prompts_file).write_text(json.dumps(prompts[:N] + warm))
        plan = {r: [{"prompt": i, "arrival": a} for i, a in
                    enumerate(arrival_times(N, r, args.seed + 1 + j))]
                for j, r in enumerate(args.rate_list)}
        warm_reqs = [{"prompt": N + i, "arrival": 0.0} for i in range(len(warm))]
        for v in args.variant_list:
            info = out["servers"][v] = {}
            if over_budget():
                info["error"] = "skipped: time budget spent"
                for r in args.rate_list:
                    out["points"].append({"variant": v, "rate": rate_label(r),
                                          "status": "skipped", "error": info["error"]})
                save()
                continue
            engine = server = None
            try:
                t = time.perf_counter()
                engine = ServingEngine(model, max_batch=B, max_len=max_len,
                                       speculation=specs[v],
                                       rounds_per_chunk=args.rounds_per_chunk,
                                       max_queue=max(1024, N + len(warm_reqs)),
                                       prefill_chunk=args.prefill_chunk, warmup_prefill=hi)
                engine.start(variants=[(True, False)])  # greedy requests only
                server = BackgroundServer(engine, SERVED_NAME, limits=limits)
                info["start_seconds"] = time.perf_counter() - t
                t = time.perf_counter()
                recs = run_client(server.url, prompts_file, warm_reqs, new,
                                  args.point_timeout_s, work)
                bad = [r for r in recs if r["status"] != "ok"]
                if bad:
                    raise RuntimeError(f"warm-up request failed: {bad[0]['error']}")
                m = _wait_idle(server.url)
                info["warmup_seconds"] = time.perf_counter() - t
                info["gamma"] = served_gamma(m)
                print(f"{v}: server ready (start {info['start_seconds']:.1f} s, warm-up "
                      f"{info['warmup_seconds']:.1f} s, gamma {info['gamma']})", flush=True)
                for r in args.rate_list:
                    point = {"variant": v, "rate": rate_label(r)}
                    if over_budget():
                        point.update(status="skipped", error="time budget spent")
                        out["points"].append(point)
                        continue
                    m0 = _wait_idle(server.url)
                    recs = run_client(server.url, prompts_file, plan[r], new,
                                      args.point_timeout_s, work)
                    m1 = _wait_idle(server.url)
                    for rec in recs:
                        rec["prompt_tokens"] = len(prompts[rec["prompt"]])
                    point.update(summarize(recs))
                    point["status"] = "ok" if point["completed"] == N else "incomplete"
                    point["server"] = server_delta(m0, m1)
                    got = [recs[i]["token_ids"] for i in range(K)]
                    point["outputs"] = got
                    point["rows_checked"] = sum(g is not None for g in got)
                    point["rows_equal_generate"] = sum(g == c for g, c in zip(got, check_tokens))
                    out["points"].append(point)
                    print(_point_line(point), flush=True)
                    save()
            except Exception as e:  # noqa: BLE001 - a variant that fails is recorded, not fatal
                info["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                print(f"{v}: {info['error']}", file=sys.stderr, flush=True)
                done = {p["rate"] for p in out["points"] if p["variant"] == v}
                for r in args.rate_list:
                    if rate_label(r) not in done:
                        out["points"].append({"variant": v, "rate": rate_label(r),
                                              "status": "error", "error": info["error"]})
            finally:
                if server is not None:
                    server.close()
                if engine is not None:
                    engine.stop()
                del engine, server
                gc.collect()
                jax.clear_caches()
            save()
    return out


def _finish(out: dict) -> None:
    """Speedups vs ``off`` at the same rate, and the verdict against the reference."""
    ok = {(p["variant"], p["rate"]): p for p in out["points"] if p.get("status") == "ok"}
    out["speedups"] = []
    for (v, r), p in ok.items():
        base = ok.get(("off", r))
        if v == "off" or base is None:
            continue

        def ratio(a, b):
            return a / b if a and b else None
        out["speedups"].append({
            "variant": v, "rate": r,
            "output_tok_s": ratio(p["output_tok_s"], base["output_tok_s"]),
            "request_throughput": ratio(p["request_throughput"], base["request_throughput"]),
            "ttft_p50": ratio(base["ttft_s"]["p50"], p["ttft_s"]["p50"]),
            "itl_p50": ratio(base["itl_s"]["p50"], p["itl_s"]["p50"]),
            "e2e_p50": ratio(base["e2e_s"]["p50"], p["e2e_s"]["p50"]),
            "decode_tok_s": ratio(p["server"]["decode_tok_s"], base["server"]["decode_tok_s"])})
    ref = out.get("reference")
    offs = [p for (v, _), p in ok.items() if v == "off"]
    if ref and offs:  # the highest load: the point with the most requests per second offered
        top = max(offs, key=lambda p: math.inf if p["rate"] == "inf" else float(p["rate"]))
        dec = top["server"]["decode_tok_s"]
        ratio = dec / ref["decode_tok_s"] if dec else None
        out["verdict"] = {"rate": top["rate"], "server_decode_tok_s": dec,
                          "reference_decode_tok_s": ref["decode_tok_s"],
                          "decode_ratio": ratio,
                          "within": None if ratio is None else bool(ratio >= 1 - WITHIN),
                          "server_output_tok_s": top["output_tok_s"],
                          "reference_e2e_tok_s": ref["e2e_tok_s"],
                          "e2e_ratio": top["output_tok_s"] / ref["e2e_tok_s"]}
    else:
        out["verdict"] = None


# ============================================================================= report
def _ms(d, keys=("p50", "p90", "p99")) -> str:
    if not d or d.get("p50") is None:
        return "-"
    return " / ".join(f"{d[k] * 1e3:.1f}" for k in keys)


def _f(x, fmt=".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _point_line(p: dict) -> str:
    head = f"{p['variant']} @ {p['rate']} req/s"
    if p.get("status") not in ("ok", "incomplete"):
        return f"{head}: {p.get('status')}: {p.get('error')}"
    s = p["server"]
    return (f"{head}: {p['completed']}/{p['requests']} done, {p['request_throughput']:.2f} req/s, "
            f"{p['output_tok_s']:.1f} tok/s, TTFT p50 {_f(p['ttft_s']['p50'], '.3f')} s, ITL p50 "
            f"{_ms(p['itl_s'], ('p50',))} ms, e2e p50 {_f(p['e2e_s']['p50'], '.3f')} s, accept "
            f"{_f(s['acceptance_rate'])}, tok/step {_f(s['tokens_per_target_step'])}, "
            f"= generate {p['rows_equal_generate']}/{p['rows_checked']}")


def markdown(out: dict) -> str:
    env = out["env"]
    lo, hi = out["prompt"]
    lengths = f"{lo}" if lo == hi else f"{lo}-{hi} (uniform per request)"
    eos = (f"honoured (stop ids {out['stop_tokens']})" if out["stop_tokens"] else
           "none in this model")
    lines = [f"# `jaxspec bench server`: the OpenAI-compatible server under load "
             f"({env['device']})", "",
             f"- device: {env['device']} x{env['devices']} ({env['backend']}), jax {env['jax']}, "
             f"flax {env['flax']}, python {env['python']}, commit {env['commit']}, {env['date']}",
             f"- command: `{env['command']}`",
             f"- model: {out['model']}" + (f", draft {out['draft']}" if out["draft"] else ""),
             f"- server: {out['max_batch']} slots, max_len {out['max_len']}, "
             f"{out['rounds_per_chunk']} rounds per chunk at most, prefill chunk "
             f"{out['prefill_chunk']}; HTTP on 127.0.0.1, a client in its own process",
             f"- load: {out['requests']} streamed `/v1/completions` requests per point, token-id "
             f"prompts of {lengths} tokens ({out['source']}, seed {out['seed']}), max_tokens "
             f"{out['new_tokens']}, greedy, EOS {eos}; "
             f"arrivals all at once (inf) or Poisson; the same prompts and arrivals for every "
             f"variant; each server warmed up with requests of these shapes first.",
             "- TTFT: sent -> first token event; ITL: gaps between token events split over their "
             "tokens; e2e: sent -> `[DONE]`; throughput: completed / (first send -> last "
             "completion). Server columns from its `/metrics` over the point: decode tok/s = "
             "generated tokens / seconds in decode chunks; accept = accepted / proposed drafts; "
             "tok/step = tokens per target step.", ""]
    ref, ver = out.get("reference"), out.get("verdict")
    if ref:
        lines.append(f"Reference: `jaxspec.generate`, plain decoding at batch {ref['batch']} on "
                     f"prompts of these lengths, {out['new_tokens']} new tokens per row (fixed "
                     f"length): **{ref['decode_tok_s']:.1f} tok/s** decoding "
                     f"(`stats['decode_seconds']`), {ref['e2e_tok_s']:.1f} tok/s end to end.")
    if ver:
        word = {True: "within", False: "NOT within", None: "-"}[ver["within"]]
        lines.append(f"Server, speculation off, rate {ver['rate']}: "
                     f"{_f(ver['server_decode_tok_s'], '.1f')} tok/s decoding = "
                     f"{_f(ver['decode_ratio'])}x the reference ({word} {WITHIN:.0%}); "
                     f"{ver['server_output_tok_s']:.1f} tok/s end to end = "
                     f"{ver['e2e_ratio']:.2f}x the reference's end to end.")
    lines.append("")
    for v, info in out["servers"].items():
        if info.get("error"):
            lines.append(f"- {v}: {info['error']}")
    lines += ["", "| variant | gamma | rate req/s | done/sent | req/s | out tok/s | "
              "TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | e2e p50 / p99 s | "
              "server decode tok/s | accept | tok/step | finish | = generate |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in out["points"]:
        gamma = _f(out["servers"].get(p["variant"], {}).get("gamma"), "d")
        if p.get("status") not in ("ok", "incomplete"):
            lines.append(f"| {p['variant']} | {gamma} | {p['rate']} | {p.get('status')}: "
                         f"{p.get('error')} | | | | | | | | | | |")
            continue
        s = p["server"]
        e2e = p["e2e_s"]
        fin = ", ".join(f"{k} {n}" for k, n in sorted(p["finish_reasons"].items()))
        lines.append(
            f"| {p['variant']} | {gamma} | {p['rate']} | {p['completed']}/{p['requests']} | "
            f"{p['request_throughput']:.2f} | {p['output_tok_s']:.1f} | {_ms(p['ttft_s'])} | "
            f"{_ms(p['itl_s'])} | {_f(e2e['p50'], '.3f')} / {_f(e2e['p99'], '.3f')} | "
            f"{_f(s['decode_tok_s'], '.1f')} | {_f(s['acceptance_rate'])} | "
            f"{_f(s['tokens_per_target_step'])} | {fin} | "
            f"{p['rows_equal_generate']}/{p['rows_checked']} |")
    if out["speedups"]:
        lines += ["", "Speedups vs `off` at the same rate (throughputs: variant / off; latencies: "
                  "off / variant):", "",
                  "| variant | rate req/s | out tok/s | req/s | server decode tok/s | TTFT p50 | "
                  "ITL p50 | e2e p50 |", "|---|---|---|---|---|---|---|---|"]
        for s in out["speedups"]:
            x = [_f(s[k]) + ("x" if s[k] is not None else "") for k in (
                "output_tok_s", "request_throughput", "decode_tok_s", "ttft_p50", "itl_p50",
                "e2e_p50")]
            lines.append(f"| {s['variant']} | {s['rate']} | " + " | ".join(x) + " |")
    if out.get("check") and out["check"]["requests"]:
        lines += ["", f"= generate: of the first {out['check']['requests']} requests, those whose "
                  f"greedy tokens equal `jaxspec.generate`'s (plain, same prompts, same "
                  f"max_tokens) / those completed (equal by promise in float32; in bfloat16 a "
                  f"row may part where two logits are within rounding)."]
    return "\n".join(lines) + "\n"


# ============================================================================= CLI
def add_arguments(sub) -> None:
    """``jaxspec bench server`` on the ``bench`` subparsers."""
    from jaxspec.bench import RANDOM_SHAPES
    s = sub.add_parser("server", help="the OpenAI-compatible server under load over HTTP: "
                                      "throughput, TTFT, ITL and latency per speculation variant "
                                      "and request rate, against jaxspec.generate")
    s.add_argument("--model", default="random-qwen15",
                   help="checkpoint path or a random shape: " + ", ".join(RANDOM_SHAPES))
    s.add_argument("--dtype", default=None)
    s.add_argument("--draft", default=None, help="a draft checkpoint for variants with 'draft'")
    s.add_argument("--variants", default="off,default,auto",
                   help="comma-separated: off, default, auto, or e.g. g4-w496-fixed (see "
                        "jaxspec.bench.parse_variant); off is always run first")
    s.add_argument("--rates", default="inf",
                   help="request rates (requests/s, Poisson arrivals), 'inf': all at once; e.g. "
                        "inf,4,1")
    s.add_argument("--requests", type=int, default=128, help="requests per point")
    s.add_argument("--prompt", default="4096",
                   help="prompt tokens: a length, or a range LO-HI drawn per request")
    s.add_argument("--new", type=int, default=256, help="max_tokens of each request")
    s.add_argument("--max-batch", type=int, default=64,
                   help="server slots (the reference decodes a batch of this many)")
    s.add_argument("--max-len", type=int, default=None,
                   help="tokens per sequence (default: the longest prompt + --new)")
    s.add_argument("--rounds-per-chunk", type=int, default=8,
                   help="most rounds per decode chunk (default: jaxspec serve's)")
    s.add_argument("--prefill-chunk", type=int, default=512)
    s.add_argument("--source", default="shakespeare",
                   help="text source of the prompts (jaxspec.textdata) or 'random' tokens")
    s.add_argument("--seed", type=int, default=0, help="prompts, their lengths and arrivals")
    s.add_argument("--check", type=int, default=8, dest="check_outputs",
                   help="compare the greedy outputs of the first N requests with "
                        "jaxspec.generate's (0: none)")
    s.add_argument("--warmup", type=int, default=4,
                   help="warm-up requests per server (at least one per prefill length bucket)")
    s.add_argument("--point-timeout-s", type=float, default=600.0,
                   help="a point's requests still running after this long are cancelled")
    s.add_argument("--time-budget-s", type=float, default=None,
                   help="skip the points left after this many seconds")
    s.add_argument("--out", default=None, help="directory for NAME.json and NAME.md")
    s.add_argument("--name", default="server")
    s.set_defaults(bench=bench_server)
