"""``jaxspec bench server``: the OpenAI-compatible server under load, measured over HTTP only.

For each speculation variant (``off``; ``default`` = ``jaxspec.Speculation()``; ``auto`` =
``Speculation(gamma="auto")``; or any `jaxspec.bench.parse_variant` string such as
``g4-w496-fixed``) a server is started in this process (`jaxspec.serving.ServingEngine` behind
`jaxspec.server.BackgroundServer`, listening on 127.0.0.1 only), warmed up with requests of the
benchmark's shapes (so compilation is not measured; outside the shared-document workload
the shortest runs alone, then they arrive one after another, so that their prefills overlap
decoding as the measured prompts' will), and then, for each request rate, sent the same ``--requests`` streamed
``/v1/completions`` requests: token-id prompts cut from a text source
(`jaxspec.bench.make_prompts`; random tokens for a model without a tokenizer), lengths from
``--prompt`` (``4096``, or a range ``8192-32768`` drawn per request with ``--seed``),
``max_tokens=--new``, greedy. Arrivals: all at once (rate ``inf``) or a Poisson process of that
rate; every variant sees the same prompts and arrival times.

``--servers`` compares server setups, each with every variant: ``dense`` (one K/V row of
``max_len`` slots per slot, the default) and
``paged[N][-blocksM][-budgetT][-mixedC|-nomixed][-fillfirstS|-nofillfirst][-noshare]`` (paged
K/V in pages of N slots, default 16, with automatic prefix caching; M blocks in the pool, T
prefill tokens between decode chunks, C prompt tokens prefilled inside each decode round or
``-nomixed`` none, S seconds that filled prompts may wait for a burst's others while nothing
decodes or ``-nofillfirst`` none; default: the server's; ``-noshare``: without the
shared-context attention). Speedups are then relative to the
first setup
with speculation off. ``--workload`` (comma-separated, run in turn on each server): ``independent``
(the prompts above) or ``shared-doc``: every request is the same ``--doc``-token document followed
by its own ``--question`` tokens (both cut from the text source); with ``--doc-cache warm`` one
unmeasured request with the document and another question precedes each point, so a paged
server holds the document in its prefix cache; ``short``: prompts of ``--short`` tokens with
the same arrivals, whose streams' inter-token latency is the baseline of the others' (the report
gives each point's ITL against it at the same rate and seed). ``--seed 5,6,7`` runs every
workload at each seed in turn on each server (warmed up once). ``--timeline`` also writes
``NAME.timeline.json``: each point's token events as the client stamped them and the server's
decode chunks (`jaxspec.serving.ServingEngine.chunk_timeline`), on one clock, to tell what a slow
token waited for. Per point the report sums the responses'
``usage.prompt_tokens_details.cached_tokens`` and, for a paged server, gives the prefix-cache hits
over the point, its hit rate, preemptions and the most K/V blocks in use while the point ran.

The client runs in a separate Python process (httpx, asyncio; no JAX there), so the server's
process shares its interpreter with nobody but itself, as under ``jaxspec serve``. It stamps every
server-sent event as it arrives:

- TTFT: request sent -> first event carrying tokens (queueing + prefill + the first chunk);
- ITL: the gap between two token-carrying events, split evenly over the tokens the later one
  brought (the server streams once per decode chunk; the raw gaps are ``chunk_gap_s``); also
  over the gaps that begin after every request's first token (``itl_after_last_first_token_s``:
  with all requests sent at once, the streams' ITL once no prompt is left to prefill);
- e2e: request sent -> ``data: [DONE]``; TPOT: (e2e - TTFT) / (tokens - 1) per request;
- throughput: tokens (requests) completed / (first send -> last completion).

The server's own counters (``GET /metrics``, before and after each point) give its acceptance rate,
tokens per target step and decode-only throughput (generated tokens / seconds in decode chunks).
Each variant is compared with ``off`` at the same rate. One reference is measured in the same run:
`jaxspec.generate`'s plain decode throughput (new tokens / ``stats["decode_seconds"]``, fixed
length) at batch = the server's slots on prompts of the benchmark's lengths; the report says whether
the server's decode throughput with speculation off stays within 10% of it (``--no-reference``:
not measured). The greedy outputs of the first ``--check`` requests of every point are compared
with `jaxspec.generate`'s for the same prompts.

The server stops a completion at the model's EOS (it has no ``ignore_eos``): the report counts
finish reasons. Every loop is bounded: ``--point-timeout-s`` per point (requests still running then
are cancelled and counted as unfinished), ``--time-budget-s`` for the whole run (points left are
recorded as skipped). Results: ``--out DIR`` gets ``NAME.json`` and ``NAME.md`` (device, versions,
date, exact command), rewritten after every point.

This module's top level imports only the standard library and numpy: the client process loads this
file alone (not the ``jaxspec`` package) and runs `client_main`.
"""

from __future__ import annotations

import argparse
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
WORKLOADS = ("independent", "shared-doc", "short")


# ============================================================================= the client process
async def _load(job: dict) -> list[dict]:
    """Sends every request of ``job`` at its arrival time and records its stream."""
    import httpx
    prompts = json.loads(pathlib.Path(job["prompts_file"]).read_text())
    reqs = job["requests"]  # [{"prompt": index into prompts, "arrival": seconds}]
    deadline = float(job["deadline_s"])
    url = job["url"] + "/v1/completions"
    bodies = [json.dumps({"model": job["model"], "prompt": prompts[r["prompt"]],
                          "max_tokens": r.get("max_tokens", job["max_tokens"]),
                          "temperature": 0, "stream": True,
                          "stream_options": {"include_usage": True},
                          "return_token_ids": True}).encode() for r in reqs]
    del prompts
    records = [{"i": i, "prompt": r["prompt"], "arrival": r["arrival"], "status": "unfinished",
                "t_send": None, "events": [], "t_done": None, "finish_reason": None,
                "token_ids": None, "usage": None, "error": None} for i, r in enumerate(reqs)]
    n = len(reqs)
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    timeout = httpx.Timeout(deadline + 5.0, connect=min(30.0, deadline + 5.0))
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        t0 = time.perf_counter()
        for rec in records:  # (perf_counter: on Linux one clock for every process)
            rec["clock0"] = t0

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
                    if obj.get("usage"):  # the last chunk before [DONE] (include_usage)
                        rec["usage"] = obj["usage"]
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
    if len(set(out)) != len(out):
        raise ValueError(f"--rates: give distinct rates, got {text!r}")
    return out


def parse_seeds(text) -> list[int]:
    """``5,6,7`` (or an int) -> [5, 6, 7]: distinct integer seeds, each a run of its own prompts,
    lengths and arrivals."""
    if isinstance(text, int):
        return [text]
    out = []
    for part in str(text).split(","):
        try:
            out.append(int(part.strip()))
        except ValueError:
            raise ValueError(f"--seed: {part.strip()!r} is not an integer") from None
    if len(set(out)) != len(out):
        raise ValueError(f"--seed: give distinct seeds, got {text!r}")
    return out


def parse_lengths(text: str) -> tuple[int, int]:
    """``16384`` -> (16384, 16384); ``8192-32768`` or ``1024~32768`` -> (LO, HI) (see
    `length_spread`)."""
    text = str(text)
    lo, _, hi = text.replace("~", "-", 1).partition("-")
    try:
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--prompt must be a length, a range LO-HI (uniform) or LO~HI "
                         f"(log-uniform) of lengths, got {text!r}") from None
    if lo_i < 1 or hi_i < lo_i:
        raise ValueError(f"--prompt: lengths must be >= 1 and LO <= HI, got {text!r}")
    return lo_i, hi_i


def length_spread(text: str) -> str:
    """How ``--prompt`` draws a request's length in [LO, HI]: ``uniform`` (``LO-HI``) or ``log``
    (``LO~HI``: log-uniform, as many requests of 1k-2k tokens as of 16k-32k, the skew of real
    traffic, where most requests are short)."""
    return "log" if "~" in str(text) else "uniform"


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times of ``n`` requests: all at 0 for rate ``inf``, else a Poisson process of
    ``rate`` requests/s (exponential gaps) starting at 0."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(n - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist()


def draw_lengths(n: int, lo: int, hi: int, seed: int, spread: str = "uniform") -> np.ndarray:
    """``n`` lengths in [lo, hi] drawn with ``seed``: uniformly, or log-uniformly
    (``spread="log"``)."""
    rng = np.random.default_rng(seed)
    if spread == "log":
        x = np.exp(rng.uniform(np.log(lo), np.log(hi + 1), size=n))
        return np.clip(np.floor(x).astype(np.int64), lo, hi)
    return rng.integers(lo, hi + 1, size=n)


def plan_requests(model, n: int, lo: int, hi: int, seed: int, source: str,
                  spread: str = "uniform") -> list[list[int]]:
    """``n`` token-id prompts, lengths drawn from [lo, hi] with ``seed`` (uniformly, or
    log-uniformly with ``spread="log"``), each cut from the start of a ``hi``-token prompt of
    `jaxspec.bench.make_prompts`."""
    from jaxspec.bench import make_prompts
    lengths = draw_lengths(n, lo, hi, seed, spread)
    pool = make_prompts(model, n, hi, seed, source)
    return [list(p[:int(k)]) for p, k in zip(pool, lengths)]


def plan_shared_doc(model, n: int, doc_len: int, question_len: int, seed: int,
                    source: str) -> list[list[int]]:
    """``n`` prompts that share one document: the same ``doc_len`` tokens of the text source
    (`jaxspec.bench.make_prompts`, ``seed``), each followed by its own ``question_len`` tokens
    (disjoint passages of the same source, ``seed + 1``; random tokens for a model without a
    tokenizer)."""
    from jaxspec.bench import make_prompts
    (doc,) = make_prompts(model, 1, doc_len, seed, source)
    return [list(doc) + list(q) for q in make_prompts(model, n, question_len, seed + 1, source)]


SETUP_PAGE_SIZE = 16  # the page size of a setup named ``paged``


def parse_servers(text: str) -> list[dict]:
    """``dense,paged,paged8-blocks4096-budget8192`` -> server setups: ``dense`` (one dense K/V
    row per slot) or ``paged[N]`` (paged K/V, pages of N slots, default 16) with optional
    ``-blocksM`` (blocks in the pool), ``-budgetT`` (prefill tokens between decode chunks),
    ``-mixedC`` / ``-nomixed`` (``mixed_prefill=C`` / 0: prompt tokens prefilled inside each
    decode round), ``-stretchK`` (``mixed_stretch=K``), ``-fillfirstS`` / ``-nofillfirst``
    (``fill_first=S`` / 0) and ``-noshare`` (no shared-context attention:
    ``share_min_tokens=None``); any setup takes
    ``-slotsN`` (N slots instead of ``--max-batch``: a paged pool of the dense cache's size with
    more slots)."""
    out, seen = [], set()
    for name in (x.strip() for x in str(text).split(",")):
        if not name:
            continue
        if name in seen:
            raise ValueError(f"--servers: {name!r} is given twice")
        seen.add(name)
        head, *opts = name.split("-")
        setup = {"name": name, "page_size": None, "kv_blocks": None, "prefill_budget": None,
                 "mixed_prefill": None, "share": True, "max_batch": None, "fill_first": None,
                 "mixed_stretch": None}
        slots = [o for o in opts if o.startswith("slots") and o[5:].isdigit()]
        if slots:
            setup["max_batch"] = int(slots[-1][5:])
            if setup["max_batch"] < 1:
                raise ValueError(f"--servers: {name!r}: sizes must be >= 1")
            opts = [o for o in opts if o not in slots]
        if head == "dense":
            if opts:
                raise ValueError(f"--servers: {name!r}: a dense setup takes no options but "
                                 f"slotsN")
        elif head.startswith("paged") and (head[5:] == "" or head[5:].isdigit()):
            setup["page_size"] = int(head[5:] or SETUP_PAGE_SIZE)
            for o in opts:
                if o == "noshare":
                    setup["share"] = False
                    continue
                if o == "nomixed":
                    setup["mixed_prefill"] = 0
                    continue
                if o == "nofillfirst":
                    setup["fill_first"] = 0
                    continue
                for key, word in (("kv_blocks", "blocks"), ("prefill_budget", "budget"),
                                  ("mixed_prefill", "mixed"), ("fill_first", "fillfirst"),
                                  ("mixed_stretch", "stretch")):
                    if o.startswith(word) and o[len(word):].isdigit():
                        setup[key] = int(o[len(word):])
                        break
                else:
                    raise ValueError(f"--servers: {name!r}: unknown option {o!r} (blocksM, "
                                     f"budgetT, mixedC, nomixed, stretchK, fillfirstS, "
                                     f"nofillfirst, noshare, slotsN)")
            if min(v for v in (setup["page_size"], setup["kv_blocks"], setup["prefill_budget"])
                   if v is not None) < 1 \
                    or any(o.startswith("mixed") and int(o[5:]) < 1 for o in opts) \
                    or (setup["mixed_stretch"] is not None and setup["mixed_stretch"] < 1):
                raise ValueError(f"--servers: {name!r}: sizes must be >= 1")
        else:
            raise ValueError(f"--servers: {name!r} is not 'dense' or 'paged[N][-blocksM]"
                             f"[-budgetT][-mixedC|-nomixed][-stretchK][-fillfirstS|-nofillfirst]"
                             f"[-noshare]'")
        out.append(setup)
    if not out:
        raise ValueError("--servers: give at least one server setup")
    return out


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


#: Seconds between the arrivals of the warm-up requests (all but the shared-document workload).
WARMUP_SPACING_S = 0.25


def warmup_requests(first: int, n: int, staggered: bool) -> list[dict]:
    """The warm-up requests of prompts ``first .. first + n - 1``. ``staggered``: each arrives
    `WARMUP_SPACING_S` after the one before (shortest first, `warmup_lengths`), so that it comes
    while the ones before it decode and its prefill runs as the measured load's will (a paged
    server's pieces in mixed chunks, the smaller batches' programs) instead of all of them
    starting together; else all at once."""
    step = WARMUP_SPACING_S if staggered else 0.0
    return [{"prompt": first + i, "arrival": i * step} for i in range(n)]


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
    quiet = []  # ITL of the gaps that begin once every request had its first token
    last_first = max((r["events"][0][0] for r in ok), default=None)
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
            if t0 >= last_first:
                quiet.extend([(t1 - t0) / (n1 - n0)] * (n1 - n0))
        finish[r["finish_reason"]] = finish.get(r["finish_reason"], 0) + 1
    duration = (max(r["t_done"] for r in ok) - min(sent)) if ok else 0.0
    errors = sorted({r["error"] for r in records if r["status"] == "error"})
    cached = [_cached_tokens(r) for r in ok]
    reported = [c for c in cached if c is not None]
    return {
        "requests": len(records), "completed": len(ok),
        "failed": sum(r["status"] == "error" for r in records),
        "unfinished": sum(r["status"] == "unfinished" for r in records),
        "errors": errors[:5], "duration_s": duration, "output_tokens": tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_tok_s": tokens / duration if duration > 0 else 0.0,
        "ttft_s": _pct(ttft), "itl_s": _pct(itl), "e2e_s": _pct(e2e), "tpot_s": _pct(tpot),
        # with every request sent at once, no prompt is left to prefill then: the streams'
        # inter-token latency without prefills in their way
        "itl_after_last_first_token_s": _pct(quiet),
        "chunk_gap_s": _pct(gaps), "finish_reasons": finish,
        # prompt tokens the server found in its prefix cache, summed over the completed requests
        # whose usage said (None: no response carried usage.prompt_tokens_details)
        "cached_tokens": sum(reported) if reported else None,
        "cached_tokens_reported": len(reported),
        "per_request": [{"prompt_tokens": r.get("prompt_tokens"), "ttft_s": r["events"][0][0] -
                         r["t_send"], "e2e_s": r["t_done"] - r["t_send"],
                         "tokens": r["events"][-1][1], "finish_reason": r["finish_reason"],
                         "cached_tokens": c} for r, c in zip(ok, cached)],
    }


def _cached_tokens(rec: dict):
    """``usage.prompt_tokens_details.cached_tokens`` of a record's response, or None."""
    details = (rec.get("usage") or {}).get("prompt_tokens_details") or {}
    c = details.get("cached_tokens")
    return None if c is None else int(c)


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
    position = []  # acceptance at each draft position over the point (1: the first draft)
    for i in range(1, 1 + sum(k.startswith("jaxspec_draft_position_proposed_total{")
                              for k in after)):
        n = d(f'draft_position_proposed_total{{position="{i}"}}')
        position.append(d(f'draft_position_accepted_total{{position="{i}"}}') / n if n else None)
    return {"generation_tokens": int(gen), "target_steps": int(steps),
            "decode_rounds": int(d("decode_rounds_total")),
            "decode_chunks": int(d("decode_chunks_total")), "decode_seconds": secs,
            "draft_proposed": int(proposed), "draft_accepted": int(accepted),
            "acceptance_rate": accepted / proposed if proposed else None,
            "tokens_per_target_step": gen / steps if steps else None,
            "position_acceptance": position,
            "decode_tok_s": gen / secs if secs > 0 else None}


def served_gamma(metrics: dict):
    for k in metrics:
        if k.startswith("jaxspec_model_info{") and 'gamma="' in k:
            return int(k.split('gamma="', 1)[1].split('"', 1)[0])
    return None


KV_GAUGES = ("kv_blocks_total", "kv_blocks_used", "kv_blocks_free", "kv_blocks_cached",
             "prefix_cache_hit_rate")
KV_COUNTERS = ("preemptions", "prefix_hit_tokens", "prefix_query_tokens",
               "shared_context_copies", "shared_context_row_chunks", "held_sequences")


def kv_metrics(prom: dict, engine_metrics: dict | None = None) -> dict | None:
    """A paged server's block and prefix-cache numbers: each from ``/metrics`` where it has it
    (``jaxspec_NAME`` or ``jaxspec_NAME_total``), else from the engine's own ``metrics()``
    (the benchmark's server runs in this process); None for a server without a block pool."""
    out, src = {}, set()
    for k in KV_GAUGES + KV_COUNTERS:
        for name in (f"jaxspec_{k}", f"jaxspec_{k}_total"):
            if name in prom:
                out[k] = prom[name]
                src.add("/metrics")
                break
        else:
            if engine_metrics is not None and k in engine_metrics:
                out[k] = float(engine_metrics[k])
                src.add("engine")
    if "kv_blocks_total" not in out:
        return None
    out["source"] = "+".join(sorted(src))
    return out


def kv_delta(before: dict | None, after: dict | None, peak: int | None) -> dict | None:
    """A paged server's numbers over one point: blocks (total, the peak in use while the point
    ran, in use and cached after it), preemptions, and the prefix cache's hits over the point
    (``prefix_hit_rate``) and since the server started (``prefix_cache_hit_rate``)."""
    if before is None or after is None:
        return None

    def d(k):
        return int(after.get(k, 0) - before.get(k, 0)) if k in after else None
    hit, query = d("prefix_hit_tokens"), d("prefix_query_tokens")
    return {"kv_blocks_total": int(after["kv_blocks_total"]),
            "kv_blocks_peak": None if peak is None else int(peak),
            "kv_blocks_used_after": int(after.get("kv_blocks_used", 0)),
            "kv_blocks_cached_after": int(after.get("kv_blocks_cached", 0)),
            "preemptions": d("preemptions"), "prefix_hit_tokens": hit,
            "prefix_query_tokens": query,
            "prefix_hit_rate": hit / query if hit is not None and query else None,
            "prefix_cache_hit_rate": after.get("prefix_cache_hit_rate"),
            "shared_context_copies": d("shared_context_copies"),
            "shared_context_row_chunks": d("shared_context_row_chunks"),
            "held_sequences": d("held_sequences"),
            "source": after.get("source")}


class _BlockPeak:
    """The most blocks in use in a paged engine's pool (``peak``, sampled every ``period``
    seconds by a thread in the server's process: the pool has no high-water mark) and the most
    sequences in its slots (``running``: the engine's ``running_peak``, reset when the point
    starts, and the samples)."""

    def __init__(self, engine, period: float = 0.02):
        import threading
        self.engine, self.period, self.peak, self.running = engine, period, None, 0
        self._stop = threading.Event()
        self._thread = None
        if engine is not None:
            self._thread = threading.Thread(target=self._run, name="bench-kv-peak", daemon=True)

    def _sample(self):
        blocks = getattr(self.engine, "blocks", None)
        if blocks is not None:
            used = int(blocks.used)
            self.peak = used if self.peak is None else max(self.peak, used)
        slots = getattr(self.engine, "slots", None)
        if slots is not None:
            self.running = max(self.running, sum(s is not None for s in list(slots)))

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period)

    def __enter__(self):
        if self._thread is not None:
            self._sample()
            if hasattr(self.engine, "running_peak"):  # (its own high-water mark, from now)
                self.engine.running_peak = self.running
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()
            # sequences that came and went between two samples
            self.running = max(self.running, getattr(self.engine, "running_peak", 0))


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
    a.seed_list = parse_seeds(getattr(a, "seed", 0))
    a.seed = a.seed_list[0]
    a.short = getattr(a, "short", 64)
    if not isinstance(a.short, int) or a.short < 2:
        raise ValueError(f"--short must be an integer >= 2 tokens, got {a.short!r}")
    a.lengths = parse_lengths(a.prompt)
    a.spread = length_spread(a.prompt)
    for name in ("requests", "new", "max_batch"):
        v = getattr(a, name)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
    for flag, name in (("--check", "check_outputs"), ("--warmup", "warmup")):
        if getattr(a, name) < 0:
            raise ValueError(f"{flag} must be >= 0, got {getattr(a, name)!r}")
    if a.rounds_per_chunk < 1 or (a.prefill_chunk is not None and a.prefill_chunk < 1):
        raise ValueError("--rounds-per-chunk and --prefill-chunk must be >= 1")
    if not a.point_timeout_s > 0:
        raise ValueError(f"--point-timeout-s must be > 0, got {a.point_timeout_s!r}")
    budget = getattr(a, "time_budget_s", None)
    if budget is not None and not budget > 0:
        raise ValueError(f"--time-budget-s must be > 0 seconds, got {budget!r}")
    if hasattr(a, "out"):
        from jaxspec.bench import _check_out
        _check_out(a)  # --out / --name: writable, before the model and the reference
    servers = getattr(a, "servers", None)
    a.setups_given = servers is not None
    a.setups = parse_servers(servers if a.setups_given else "dense")
    names = [w.strip() for w in str(getattr(a, "workload", "independent")).split(",")
             if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(f"--workload: give distinct names of {', '.join(WORKLOADS)}, got "
                         f"{getattr(a, 'workload', None)!r}")
    a.workload_list = names
    a.reference = bool(getattr(a, "reference", True))
    a.question = getattr(a, "question", 32)
    a.doc_cache = getattr(a, "doc_cache", "warm")
    a.doc_len = getattr(a, "doc", None)
    if "shared-doc" in names:
        if a.doc_len is None:
            if a.lengths[0] != a.lengths[1]:
                raise ValueError(f"--prompt: --workload shared-doc takes one document length "
                                 f"(or give --doc), not a range, got {a.prompt!r}")
            a.doc_len = a.lengths[1]
        if not isinstance(a.doc_len, int) or a.doc_len < 1:
            raise ValueError(f"--doc must be an integer >= 1, got {a.doc_len!r}")
        if not isinstance(a.question, int) or a.question < 1:
            raise ValueError(f"--question must be an integer >= 1, got {a.question!r}")
        if a.doc_cache not in ("warm", "cold"):
            raise ValueError(f"--doc-cache must be 'warm' or 'cold', got {a.doc_cache!r}")
    from jaxspec.bench import split_variants
    variants = split_variants(a.variants)
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


def _workloads(args, model) -> list[dict]:
    """The measured prompts of each workload at each seed (seeds outer), the warm-up prompts of
    its shapes (other text) and, for shared-doc, the priming prompt (the document with a question
    of its own)."""
    seeds = getattr(args, "seed_list", None) or [args.seed]
    out = []
    for seed in seeds:
        for name in args.workload_list:
            w = _workload(args, model, name, seed)
            w.update(seed=seed, label=name if len(seeds) == 1 else f"{name}@{seed}")
            out.append(w)
    return out


def _workload(args, model, name: str, seed: int) -> dict:
    """One workload's prompts at ``seed`` (see `_workloads`). ``short``: ``--short`` tokens per
    prompt, from a seed of their own (``seed + 4000``: no prefix of another workload's prompts),
    the same arrivals as the others: the latency of the streams without long prefills."""
    lo, hi = args.lengths
    N, B = args.requests, args.max_batch
    if name == "short":
        lo = hi = args.short
        seed += 4000
    w = {"name": name, "prime": None}
    if name == "shared-doc":
        L, Q = args.doc_len, args.question
        # one document, a question per request; the last question primes the document
        # (seeds of its own: no independent prompt starts with the document)
        prompts = plan_shared_doc(model, max(N, B) + 1, L, Q, seed + 2000, args.source)
        w["prime"] = prompts.pop()
        n_warm = max(args.warmup, 2)
        # warm-up: another document of the same length (the measured one stays new); the
        # first request alone, then the others (a paged server then finds their document
        # cached: the prefix-hit path is compiled before measuring)
        pool = plan_shared_doc(model, max(B, n_warm), L, Q, seed + 3000, args.source)
        w.update(prompts=prompts, ref_warm=pool[:B], warm=pool[:n_warm],
                 longest=L + Q, waves=[1, n_warm - 1])
    else:
        prompts = plan_requests(model, max(N, B), lo, hi, seed, args.source,
                                args.spread)
        # warm-up prompts: other text, the shapes of the measured ones (the reference's
        # warm-up call: the same lengths; the servers': every prefill length bucket)
        lens = warmup_lengths(lo, hi)
        n_warm = max(args.warmup, len(lens))
        pool = plan_requests(model, max(B, n_warm), hi, hi, seed + 1000, args.source)
        warm = [x[:lens[i % len(lens)]] for i, x in enumerate(pool[:n_warm])]
        # the shortest alone first (the first runs of the prefill and decode programs), then
        # all of them (`warmup_requests`): each later prefill then finds the earlier
        # requests decoding, as the measured ones will (were the first still filling when
        # the second came, fill-first would hold them to start together)
        w.update(prompts=prompts, ref_warm=[x[:len(p)] for x, p in zip(pool, prompts[:B])],
                 warm=warm[:1] + warm, longest=hi, waves=[1, n_warm])
    return w


def bench_server(args, model=None, draft=None) -> dict:
    """Runs the benchmark (``args`` from `add_arguments`); ``model`` / ``draft``: in-memory models
    instead of ``--model`` / ``--draft``. Returns what it writes to ``NAME.json``, whose
    ``status`` says ``complete``, or ``interrupted`` after a Ctrl-C (``running`` while it runs)."""
    state = {}
    try:
        out = _bench_server(args, model, draft, state)
    except KeyboardInterrupt:
        if "out" in state:
            state["out"]["status"] = "interrupted"
            state["save"]()
        raise
    out["status"] = "complete"
    state["save"]()
    return out


def _bench_server(args, model, draft, state) -> dict:
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
    shared = "shared-doc" in args.workload_list
    longest = max(hi if "independent" in args.workload_list else 0,
                  args.doc_len + args.question if shared else 0)
    ctx = model.config.max_position_embeddings
    max_len = args.max_len or longest + new
    if longest + new > min(max_len, ctx):
        what = (f"--doc {args.doc_len} + --question {args.question}"
                if shared and longest == args.doc_len + args.question else f"--prompt up to {hi}")
        raise ValueError(f"{what} tokens + --new {new} need {longest + new} tokens per sequence, "
                         f"more than {'--max-len' if args.max_len else 'the model'} allows "
                         f"({min(max_len, ctx)})")
    wls = _workloads(args, model)
    first_w = wls[0]["name"]
    out = {"env": environment(), "status": "running", "model": label,
           "draft": args.draft, "max_batch": B, "max_len": max_len,
           "rounds_per_chunk": args.rounds_per_chunk, "prefill_chunk": args.prefill_chunk,
           "prompt": [lo, hi], "prompt_spread": args.spread, "workloads": args.workload_list,
           "doc_tokens": args.doc_len if shared else None,
           "question_tokens": args.question if shared else None,
           "doc_cache": args.doc_cache if shared else None,
           "source": args.source if model.tokenizer else "random",
           "seed": args.seed, "seeds": list(args.seed_list), "short_tokens": args.short
           if "short" in args.workload_list else None, "new_tokens": new, "requests": N,
           "rates": [rate_label(r) for r in args.rate_list], "variants": args.variant_list,
           "setups": [dict(s) for s in args.setups], "setups_given": args.setups_given,
           "stop_tokens": list(stop_token_ids(model, None)), "reference": None, "check": None,
           "servers": {}, "points": [], "speedups": [], "verdict": None}

    def save():
        _finish(out)
        if args.out:
            write_results(out, args.out, args.name, markdown)

    state.update(out=out, save=save)
    timeline = [] if getattr(args, "timeline", False) else None

    def save_timeline():
        if args.out:
            path = pathlib.Path(args.out) / f"{args.name}.timeline.json"
            path.write_text(json.dumps({"env": out["env"], "points": timeline}))

    def over_budget():
        return args.time_budget_s is not None and time.monotonic() - t_start > args.time_budget_s

    # reference and check outputs (plain jaxspec.generate, in this process, before any server)
    K = min(args.check_outputs, N)
    ref = None
    if args.reference:
        print(f"reference: jaxspec.generate, plain, batch {B} ({first_w})", flush=True)
        ref = _reference(model, wls[0]["prompts"][:B], wls[0]["ref_warm"], new)
        ref["workload"] = first_w
    out["check"] = {"requests": K, "outputs": {}}
    for i, w in enumerate(wls):
        if not K:
            w["check"] = []
        elif i == 0 and ref is not None and not out["stop_tokens"] and K <= B:
            w["check"] = ref["tokens"][:K]  # no stop token: fixed-length rows are the outputs
        else:
            w["check"] = jaxspec.generate(model, w["prompts"][:K], max_new_tokens=new).tokens
        out["check"]["outputs"][w["label"]] = w["check"]
    if len(wls) == 1:  # one workload: its outputs, as a list
        out["check"]["outputs"] = wls[0]["check"]
    if ref is not None:
        del ref["tokens"]
        out["reference"] = ref
        print(f"reference: {ref['decode_tok_s']:.1f} tok/s decode, {ref['e2e_tok_s']:.1f} tok/s "
              f"end to end", flush=True)
    save()

    limits = ServerLimits(max_generation_tokens=max(ServerLimits().max_generation_tokens, new))
    with tempfile.TemporaryDirectory(prefix="jaxspec-bench-server-") as work:
        prompts_file = str(pathlib.Path(work) / "prompts.json")
        every = []  # one file of prompts; requests name them by index
        for w in wls:
            base = len(every)
            every += w["prompts"][:N] + w["warm"] + ([w["prime"]] if w["prime"] else [])
            w["plan"] = {r: [{"prompt": base + i, "arrival": a} for i, a in
                             enumerate(arrival_times(N, r, w["seed"] + 1 + j))]
                         for j, r in enumerate(args.rate_list)}
            warm = warmup_requests(base + N, len(w["warm"]), staggered=w["prime"] is None)
            k = w["waves"][0]
            w["warm_waves"] = [x for x in (warm[:k], warm[k:]) if x]
            w["prime_req"] = [{"prompt": base + N + len(w["warm"]), "arrival": 0.0,
                               "max_tokens": 1}] if w["prime"] else []
            w["base"] = base
        pathlib.Path(prompts_file).write_text(json.dumps(every))
        n_warm = sum(len(w["warm"]) for w in wls)
        for setup in args.setups:
            for v in args.variant_list:
                key = server_key(out, setup["name"], v)
                info = out["servers"][key] = {"setup": setup["name"], "variant": v}

                def record_all(status, error, done=()):
                    for w in wls:
                        for r in args.rate_list:
                            if (w["name"], w["seed"], rate_label(r)) not in done:
                                out["points"].append({"setup": setup["name"], "variant": v,
                                                      "workload": w["name"], "seed": w["seed"],
                                                      "rate": rate_label(r), "status": status,
                                                      "error": error})
                if over_budget():
                    info["error"] = "skipped: time budget spent"
                    record_all("skipped", "time budget spent")
                    save()
                    continue
                engine = server = None
                try:
                    t = time.perf_counter()
                    paged = {}
                    if setup["page_size"] is not None:
                        paged = {"page_size": setup["page_size"],
                                 "kv_blocks": setup["kv_blocks"],
                                 "prefill_budget": setup["prefill_budget"],
                                 "mixed_prefill": setup.get("mixed_prefill"),
                                 "fill_first": setup.get("fill_first"),
                                 "mixed_stretch": setup.get("mixed_stretch")}
                        if not setup.get("share", True):
                            paged["share_min_tokens"] = None
                    engine = ServingEngine(model, max_batch=setup.get("max_batch") or B,
                                           max_len=max_len,
                                           speculation=specs[v],
                                           rounds_per_chunk=args.rounds_per_chunk,
                                           max_queue=max(1024, N + n_warm),
                                           prefill_chunk=args.prefill_chunk,
                                           warmup_prefill=longest, **paged)
                    info["prefill_chunk"] = engine.prefill_chunk
                    if engine.paged:
                        info.update(page_size=engine.page_size, kv_blocks=engine.n_blocks,
                                    blocks_per_sequence=engine.max_blocks,
                                    prefill_budget=engine.prefill_budget,
                                    mixed_prefill=engine.mixed_prefill,
                                    mixed_stretch=engine.mixed_stretch,
                                    fill_first=engine.fill_first,
                                    share_min_tokens=engine.share_min_tokens)
                    engine.start(variants=[(True, False)])  # greedy requests only
                    server = BackgroundServer(engine, SERVED_NAME, limits=limits)
                    info["start_seconds"] = time.perf_counter() - t
                    t = time.perf_counter()
                    for w in wls:  # (the first seed's: the others have the same shapes)
                        if w["seed"] != wls[0]["seed"]:
                            continue
                        for wave in w["warm_waves"]:
                            recs = run_client(server.url, prompts_file, wave, new,
                                              args.point_timeout_s, work)
                            bad = [r for r in recs if r["status"] != "ok"]
                            if bad:
                                raise RuntimeError(f"warm-up request failed: {bad[0]['error']}")
                            m = _wait_idle(server.url)
                    while engine.metrics()["programs_compiling"] and \
                            time.perf_counter() - t < args.point_timeout_s:
                        time.sleep(0.5)  # the smaller batches' programs (`compact_rows`)
                    info["warmup_seconds"] = time.perf_counter() - t
                    info["warmup_mixed_chunks"] = int(engine.metrics().get("mixed_chunks", 0))
                    info["gamma"] = served_gamma(m)
                    print(f"{key}: server ready (start {info['start_seconds']:.1f} s, warm-up "
                          f"{info['warmup_seconds']:.1f} s with {info['warmup_mixed_chunks']} "
                          f"mixed chunks, gamma {info['gamma']})", flush=True)
                    for w in wls:
                        for r in args.rate_list:
                            point = {"setup": setup["name"], "variant": v,
                                     "workload": w["name"], "seed": w["seed"],
                                     "rate": rate_label(r)}
                            if over_budget():
                                point.update(status="skipped", error="time budget spent")
                                out["points"].append(point)
                                continue
                            out["points"].append(_measure(
                                point, server.url, engine, prompts_file, work, w, r, args,
                                every, K, timeline))
                            if timeline is not None:
                                save_timeline()
                            print(_point_line(out["points"][-1]), flush=True)
                            save()
                except Exception as e:  # noqa: BLE001 - a server that fails is recorded
                    info["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                    print(f"{key}: {info['error']}", file=sys.stderr, flush=True)
                    record_all("error", info["error"], {
                        (p["workload"], p["seed"], p["rate"]) for p in out["points"]
                        if p["variant"] == v and p.get("setup") == setup["name"]})
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


def _measure(point, url, engine, prompts_file, work, w, rate, args, every, K,
             timeline=None) -> dict:
    """One point: ``w``'s requests at ``rate`` (after the document's priming request for
    shared-doc with ``--doc-cache warm``), with the server's counters before and after; with a
    ``timeline`` list, the point's client records and engine chunks are appended to it."""
    N, new = args.requests, args.new
    if w["prime_req"] and args.doc_cache == "warm":  # the document, once, unmeasured
        recs = run_client(url, prompts_file, w["prime_req"], new, args.point_timeout_s, work)
        if recs[0]["status"] != "ok":
            raise RuntimeError(f"the priming request failed: {recs[0]['error']}")
    m0 = _wait_idle(url)
    kv0 = kv_metrics(m0, engine.metrics())
    t0 = time.perf_counter()
    with _BlockPeak(engine) as peak:
        recs = run_client(url, prompts_file, w["plan"][rate], new, args.point_timeout_s, work)
        m1 = _wait_idle(url)
    kv1 = kv_metrics(m1, engine.metrics())
    if timeline is not None:  # the client's stamps and the engine's chunks, on one clock
        timeline.append({key: point[key] for key in ("setup", "variant", "workload", "seed",
                                                    "rate")} | {
            "requests": [{"clock0": r.get("clock0"), "t_send": r["t_send"],
                          "t_done": r["t_done"], "events": r["events"],
                          "prompt_tokens": len(every[r["prompt"]]), "status": r["status"]}
                         for r in recs],
            "chunks": engine.chunk_timeline(since=t0)})
    for rec in recs:
        rec["prompt_tokens"] = len(every[rec["prompt"]])
    point.update(summarize(recs))
    point["status"] = "ok" if point["completed"] == N else "incomplete"
    point["server"] = server_delta(m0, m1)
    point["kv"] = kv_delta(kv0, kv1, peak.peak)
    point["peak_running"] = peak.running
    got = [recs[i]["token_ids"] for i in range(K)]
    point["outputs"] = got
    point["rows_checked"] = sum(g is not None for g in got)
    point["rows_equal_generate"] = sum(g == c for g, c in zip(got, w["check"]))
    return point


def server_key(out: dict, setup: str, variant: str) -> str:
    """The key of a server in ``out["servers"]``: the variant alone when no ``--servers`` was
    given, else ``SETUP/VARIANT``."""
    return f"{setup}/{variant}" if out.get("setups_given") else variant


def _finish(out: dict) -> None:
    """Speedups vs the first setup's ``off`` on the same workload at the same rate, and the
    verdict against the reference."""
    first = out["setups"][0]["name"] if out.get("setups") else "dense"
    w0 = (out.get("workloads") or ["independent"])[0]
    ok = {(p.get("setup", first), p["variant"], p.get("workload", w0), p["rate"],
           p.get("seed")): p for p in out["points"] if p.get("status") == "ok"}
    out["speedups"] = []
    out["itl_vs_short"] = []
    for (st, v, w, r, sd), p in ok.items():
        short = ok.get((st, v, "short", r, sd))
        if w != "short" and short is not None:  # the streams' latency against no long prefill
            row = {"setup": st, "variant": v, "workload": w, "rate": r, "seed": sd}
            for q in ("p50", "p90", "p99"):
                a, b = p["itl_s"].get(q), short["itl_s"].get(q)
                row[f"itl_{q}"] = a / b if a and b else None
            out["itl_vs_short"].append(row)
    for (st, v, w, r, sd), p in ok.items():
        base = ok.get((first, "off", w, r, sd))
        if (st, v) == (first, "off") or base is None:
            continue

        def ratio(a, b):
            return a / b if a and b else None
        out["speedups"].append({
            "setup": st, "variant": v, "workload": w, "rate": r, "seed": sd,
            "output_tok_s": ratio(p["output_tok_s"], base["output_tok_s"]),
            "request_throughput": ratio(p["request_throughput"], base["request_throughput"]),
            "ttft_p50": ratio(base["ttft_s"]["p50"], p["ttft_s"]["p50"]),
            "ttft_p99": ratio(base["ttft_s"]["p99"], p["ttft_s"]["p99"]),
            "itl_p50": ratio(base["itl_s"]["p50"], p["itl_s"]["p50"]),
            "e2e_p50": ratio(base["e2e_s"]["p50"], p["e2e_s"]["p50"]),
            "decode_tok_s": ratio(p["server"]["decode_tok_s"], base["server"]["decode_tok_s"])})
    ref = out.get("reference")
    offs = [p for (st, v, w, _, sd), p in ok.items()
            if (st, v) == (first, "off") and ref and w == ref.get("workload", w0)
            and sd == out.get("seed", sd)]
    if ref and offs:  # the highest load: the point with the most requests per second offered
        top = max(offs, key=lambda p: math.inf if p["rate"] == "inf" else float(p["rate"]))
        dec = top["server"]["decode_tok_s"]
        ratio = dec / ref["decode_tok_s"] if dec else None
        out["verdict"] = {"setup": first, "workload": top.get("workload", w0),
                          "rate": top["rate"], "server_decode_tok_s": dec,
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
    if p.get("setup") is not None:
        head = f"{p['setup']}/{head}"
    if p.get("workload") is not None:
        head = f"{p['workload']}: {head}"
    if p.get("seed") is not None:
        head = f"seed {p['seed']}, {head}"
    if p.get("status") not in ("ok", "incomplete"):
        return f"{head}: {p.get('status')}: {p.get('error')}"
    s = p["server"]
    line = (f"{head}: {p['completed']}/{p['requests']} done (at most "
            f"{_f(p.get('peak_running'), 'd')} at once), {p['request_throughput']:.2f} req/s, "
            f"{p['output_tok_s']:.1f} tok/s, TTFT p50 {_f(p['ttft_s']['p50'], '.3f')} s, ITL p50 "
            f"{_ms(p['itl_s'], ('p50',))} ms, e2e p50 {_f(p['e2e_s']['p50'], '.3f')} s, accept "
            f"{_f(s['acceptance_rate'])}, tok/step {_f(s['tokens_per_target_step'])}, "
            f"= generate {p['rows_equal_generate']}/{p['rows_checked']}")
    if any(r is not None for r in s.get("position_acceptance") or ()):
        line += ", accept by position " + "/".join(_f(r) for r in s["position_acceptance"])
    if p.get("cached_tokens") is not None:
        line += f", cached tokens {p['cached_tokens']}"
    kv = p.get("kv")
    if kv:
        line += (f", KV blocks peak {_f(kv['kv_blocks_peak'], 'd')}/{kv['kv_blocks_total']}, "
                 f"prefix hit rate {_f(kv['prefix_hit_rate'])}, preemptions "
                 f"{_f(kv['preemptions'], 'd')}")
        if kv.get("held_sequences"):
            line += f", held {kv['held_sequences']}"
    return line


def _setup_words(out: dict) -> str:
    from jaxspec.serving import MIXED_STRETCH, PIECE_SHARE

    words = []
    for s in out.get("setups") or []:
        if s["page_size"] is None:
            words.append(f"`{s['name']}`: one dense K/V row of max_len slots per slot")
        else:
            info = next((i for i in out["servers"].values()
                         if i.get("setup") == s["name"] and i.get("kv_blocks")), {})
            budget = (f"prefill budget {info['prefill_budget']} tokens per chunk"
                      if info.get("prefill_budget") else
                      f"prompt pieces of {info['mixed_prefill']} tokens inside the decode rounds "
                      f"while streams decode (at most {PIECE_SHARE} of a chunk's time; a chunk "
                      f"stretched up to {info.get('mixed_stretch') or MIXED_STRETCH}x for a "
                      f"costly piece), whole "
                      f"prefill chunks while none does" if info.get("mixed_prefill") else
                      "prefill budget adaptive (the batch fills first, then half a decode "
                      "chunk's time) per chunk")
            pool = (f"{info['kv_blocks']} blocks ({info['blocks_per_sequence']} per sequence of "
                    f"max_len), {budget}"
                    if info else "pool size and budget: the server's defaults")
            words.append(f"`{s['name']}`: paged K/V, pages of {s['page_size']} slots, {pool}, "
                         f"automatic prefix caching")
    return "; ".join(words)


def markdown(out: dict) -> str:
    from jaxspec.serving import MIXED_STRETCH

    env = out["env"]
    stretch = "/".join(str(k) for k in sorted({i.get("mixed_stretch") or MIXED_STRETCH
                                                for i in out["servers"].values()
                                                if i.get("mixed_prefill")}) or [MIXED_STRETCH])
    lo, hi = out["prompt"]
    workloads = out.get("workloads") or ["independent"]
    shared = "shared-doc" in workloads
    whats = []
    seeds = out.get("seeds") or [out["seed"]]
    multi_s = len(seeds) > 1

    def plus(k):
        return ", ".join(str(x + k) for x in seeds)
    for w in workloads:
        if w == "short":
            whats.append(f"short: token-id prompts of {out['short_tokens']} tokens "
                         f"({out['source']}, seed {plus(4000)}), the same arrivals: the "
                         f"streams' latency without long prefills")
        elif w == "shared-doc":
            whats.append(
                f"shared-doc: one document of {out['doc_tokens']} tokens followed by a distinct "
                f"{out['question_tokens']}-token question per request (token ids; document and "
                f"questions from {out['source']}, seeds {plus(2000)} / "
                f"{plus(2001)}); "
                + ("before each point one unmeasured request with the document and another "
                   "question (`--doc-cache warm`)" if out.get("doc_cache") == "warm" else
                   "no priming: the document is new to each server at its first point only "
                   "(`--doc-cache cold`)"))
        else:
            spread = ("log-uniform" if out.get("prompt_spread") == "log" else "uniform")
            lengths = f"{lo}" if lo == hi else f"{lo}-{hi} ({spread} per request)"
            whats.append(("independent: " if len(workloads) > 1 else "") +
                         f"token-id prompts of {lengths} tokens ({out['source']}, seed "
                         f"{plus(0)})")
    what = "; ".join(whats)
    eos = (f"honoured (stop ids {out['stop_tokens']})" if out["stop_tokens"] else
           "none in this model")
    multi = bool(out.get("setups_given"))
    multi_w = len(workloads) > 1
    sizes = sorted({(i.get("setup") or k, i["prefill_chunk"]) for k, i in out["servers"].items()
                    if i.get("prefill_chunk")})
    chunks = (", ".join(f"{c} ({s})" for s, c in sizes) if len({c for _, c in sizes}) > 1
              else str(sizes[0][1]) if sizes else "the server's default")
    lines = [f"# `jaxspec bench server`: the OpenAI-compatible server under load "
             f"({env['device']})", ""]
    if out.get("status") != "complete":
        lines += [f"**{str(out.get('status', 'running')).upper()}: the points below are those "
                  f"measured so far; the others have not run.**", ""]
    lines += [
             f"- device: {env['device']} x{env['devices']} ({env['backend']}), jax {env['jax']}, "
             f"flax {env['flax']}, python {env['python']}, commit {env['commit']}, {env['date']}",
             f"- command: `{env['command']}`",
             f"- model: {out['model']}" + (f", draft {out['draft']}" if out["draft"] else ""),
             f"- server: {out['max_batch']} slots, max_len {out['max_len']}, "
             f"{out['rounds_per_chunk']} rounds per chunk at most (a mixed chunk with a "
             f"costly prompt piece: up to {stretch}x), prefill chunk "
             f"{out['prefill_chunk'] or chunks}; HTTP on 127.0.0.1, a client in its own process"]
    if multi:
        lines.append(f"- server setups: {_setup_words(out)}")
    lines += [f"- load: {out['requests']} streamed `/v1/completions` requests per point, "
              f"{what}, max_tokens {out['new_tokens']}, greedy, EOS {eos}; "
              f"arrivals all at once (inf) or Poisson (seed + 1 for the first rate, + 2 for the "
              f"next, ...); the same prompts and arrivals for every server; each server warmed "
              f"up with requests of these shapes first (other "
              f"text).",
              "- TTFT: sent -> first token event; ITL: gaps between token events split over their "
              "tokens; e2e: sent -> `[DONE]`; throughput: completed / (first send -> last "
              "completion). Server columns from its `/metrics` over the point: decode tok/s = "
              "generated tokens / seconds in decode chunks; accept = accepted / proposed drafts; "
              "tok/step = tokens per target step.", ""]
    ref, ver = out.get("reference"), out.get("verdict")
    if ref:
        lines.append(f"Reference: `jaxspec.generate`, plain decoding at batch {ref['batch']} on "
                     f"the {ref.get('workload', 'independent')} prompts, {out['new_tokens']} new "
                     f"tokens per row (fixed length): **{ref['decode_tok_s']:.1f} tok/s** decoding "
                     f"(`stats['decode_seconds']`), {ref['e2e_tok_s']:.1f} tok/s end to end.")
    if ver:
        word = {True: "within", False: "NOT within", None: "-"}[ver["within"]]
        where = (f"`{ver['setup']}`, " if multi else "") + \
            (f"{ver['workload']}, " if multi_w else "")
        lines.append(f"Server, {where}speculation off, rate {ver['rate']}: "
                     f"{_f(ver['server_decode_tok_s'], '.1f')} tok/s decoding = "
                     f"{_f(ver['decode_ratio'])}x the reference ({word} {WITHIN:.0%}); "
                     f"{ver['server_output_tok_s']:.1f} tok/s end to end = "
                     f"{ver['e2e_ratio']:.2f}x the reference's end to end.")
    lines.append("")
    for key, info in out["servers"].items():
        if info.get("error"):
            lines.append(f"- {key}: {info['error']}")
    col = ("| setup " if multi else "") + ("| workload " if multi_w else "") + \
        ("| seed " if multi_s else "")
    sep = "|---" * (multi + multi_w + multi_s)

    def cells(p):
        return ((f"| {p.get('setup')} " if multi else "") +
                (f"| {p.get('workload')} " if multi_w else "") +
                (f"| {p.get('seed')} " if multi_s else "") + f"| {p['variant']} ")
    lines += ["", f"{col}| variant | gamma | rate req/s | done/sent | running at most | req/s | "
              "out tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | ITL p99 after the "
              "last first token ms | e2e p50 / p99 s | server decode tok/s | accept | tok/step | "
              "finish | = generate |",
              f"{sep}|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in out["points"]:
        info = out["servers"].get(server_key(out, p.get("setup"), p["variant"]), {})
        gamma = _f(info.get("gamma"), "d")
        if p.get("status") not in ("ok", "incomplete"):
            lines.append(f"{cells(p)}| {gamma} | {p['rate']} | {p.get('status')}: "
                         f"{p.get('error')} | | | | | | | | | | | | |")
            continue
        s = p["server"]
        e2e = p["e2e_s"]
        fin = ", ".join(f"{k} {n}" for k, n in sorted(p["finish_reasons"].items()))
        lines.append(
            f"{cells(p)}| {gamma} | {p['rate']} | {p['completed']}/{p['requests']} | "
            f"{_f(p.get('peak_running'), 'd')} | {p['request_throughput']:.2f} | {p['output_tok_s']:.1f} | {_ms(p['ttft_s'])} | "
            f"{_ms(p['itl_s'])} | {_ms(p.get('itl_after_last_first_token_s'), ('p99',))} | "
            f"{_f(e2e['p50'], '.3f')} / {_f(e2e['p99'], '.3f')} | "
            f"{_f(s['decode_tok_s'], '.1f')} | {_f(s['acceptance_rate'])} | "
            f"{_f(s['tokens_per_target_step'])} | {fin} | "
            f"{p['rows_equal_generate']}/{p['rows_checked']} |")
    kv_points = [p for p in out["points"] if p.get("status") in ("ok", "incomplete")
                 and (p.get("kv") or shared or multi)]
    if kv_points:
        lines += ["", "K/V and prefix cache: cached tokens = the sum of "
                  "`usage.prompt_tokens_details.cached_tokens` over the completed responses "
                  "(responses that carried it / completed); a paged server's numbers over the "
                  "point (from `/metrics`, or its engine's counters where `/metrics` lacks them: "
                  "source): prefix hit tokens / looked-up prompt tokens, its hit rate since "
                  "start after the point, the most blocks in use while the point ran (sampled "
                  "every 20 ms) / blocks in the pool, blocks cached after, preemptions, "
                  "held: sequences whose prompt was in that waited for others' to fill "
                  "(fill-first), shared context: sequences that read it once together, summed "
                  "over decode chunks (its copies out of the pool).", "",
                  f"{col}| variant | rate req/s | cached tokens | prefix hit / looked up | "
                  "hit rate (since start) | KV blocks peak / total | cached after | "
                  "preemptions | held | shared context | source |",
                  f"{sep}|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in kv_points:
            kv = p.get("kv") or {}
            ct = (f"{p['cached_tokens']} ({p['cached_tokens_reported']}/{p['completed']})"
                  if p.get("cached_tokens") is not None else "- (not reported)")
            if kv:
                hit = (f"{_f(kv['prefix_hit_tokens'], 'd')} / {_f(kv['prefix_query_tokens'], 'd')}"
                       f" = {_f(kv['prefix_hit_rate'])}")
                lines.append(
                    f"{cells(p)}| {p['rate']} | {ct} | {hit} | "
                    f"{_f(kv['prefix_cache_hit_rate'])} | {_f(kv['kv_blocks_peak'], 'd')} / "
                    f"{kv['kv_blocks_total']} | {kv['kv_blocks_cached_after']} | "
                    f"{_f(kv['preemptions'], 'd')} | {_f(kv.get('held_sequences'), 'd')} | "
                    f"{_f(kv.get('shared_context_row_chunks'), 'd')} "
                    f"({_f(kv.get('shared_context_copies'), 'd')}) | {kv['source']} |")
            else:
                lines.append(f"{cells(p)}| {p['rate']} | {ct} | - (dense) | | | | | | | |")
    if out["speedups"]:
        first = out["setups"][0]["name"] if out.get("setups") else "dense"
        base = f"`{first}` with `off`" if multi else "`off`"
        lines += ["", f"Speedups vs {base} on the same workload at the same rate (throughputs: "
                  f"point / {base}; latencies: {base} / point):", "",
                  f"{col}| variant | rate req/s | out tok/s | req/s | server decode tok/s | "
                  "TTFT p50 | TTFT p99 | ITL p50 | e2e p50 |",
                  f"{sep}|---|---|---|---|---|---|---|---|---|"]
        for s in out["speedups"]:
            x = [_f(s.get(k)) + ("x" if s.get(k) is not None else "") for k in (
                "output_tok_s", "request_throughput", "decode_tok_s", "ttft_p50", "ttft_p99",
                "itl_p50", "e2e_p50")]
            lines.append(f"{cells(s)}| {s['rate']} | " + " | ".join(x) + " |")
    if out.get("itl_vs_short"):
        lines += ["", "Inter-token latency against the `short` workload (the same arrivals "
                  "without long prompts) on the same server, rate and seed: point / short:", "",
                  f"{col}| variant | rate req/s | ITL p50 | ITL p90 | ITL p99 |",
                  f"{sep}|---|---|---|---|---|"]
        for s in out["itl_vs_short"]:
            x = [_f(s.get(k)) + ("x" if s.get(k) is not None else "")
                 for k in ("itl_p50", "itl_p90", "itl_p99")]
            lines.append(f"{cells(s)}| {s['rate']} | " + " | ".join(x) + " |")
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
    s.add_argument("--servers", default=None,
                   help="server setups to compare, each with every variant: 'dense' (one K/V "
                        "row of max_len per slot), 'paged' (paged K/V, pages of "
                        f"{SETUP_PAGE_SIZE} slots, prefix caching), 'pagedN' (pages of N), "
                        "options '-blocksM' (pool size) '-budgetT' (prefill tokens between "
                        "decode chunks) '-mixedC' / '-nomixed' (prompt tokens prefilled inside "
                        "each decode round, or none) '-fillfirstS' / '-nofillfirst' (seconds "
                        "that filled prompts may wait for a burst's others while nothing "
                        "decodes, or none) '-noshare' (requests that share leading blocks do not "
                        "read them together); e.g. dense,paged,paged32-budget8192 (default: dense "
                        "only, reported as before); speedups are vs the first setup's off")
    s.add_argument("--workload", default="independent",
                   help="comma-separated, run in this order on each server: independent (each "
                        "request its own prompt of --prompt tokens), shared-doc (every request "
                        "the same document of --doc tokens followed by its own --question "
                        "tokens), short (prompts of --short tokens, the same arrivals: the "
                        "baseline of the streams' latency without long prefills)")
    s.add_argument("--doc", type=int, default=None,
                   help="shared-doc: the document's tokens (default: --prompt, a single length)")
    s.add_argument("--question", type=int, default=32,
                   help="shared-doc: tokens of each request's own question after the document")
    s.add_argument("--doc-cache", default="warm", choices=("warm", "cold"),
                   help="shared-doc: warm = one unmeasured request with the document before "
                        "each point (a paged server then has it cached); cold = none")
    s.add_argument("--prompt", default="4096",
                   help="prompt tokens: a length, or a range drawn per request: LO-HI "
                        "(uniform) or LO~HI (log-uniform: most requests short)")
    s.add_argument("--new", type=int, default=256, help="max_tokens of each request")
    s.add_argument("--max-batch", type=int, default=64,
                   help="server slots (the reference decodes a batch of this many)")
    s.add_argument("--max-len", type=int, default=None,
                   help="tokens per sequence (default: the longest prompt + --new)")
    s.add_argument("--rounds-per-chunk", type=int, default=8,
                   help="most rounds per decode chunk (default: jaxspec serve's)")
    s.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill forward (default: the server's: 2048 for "
                        "a paged one on GPU/TPU, else 512)")
    s.add_argument("--source", default="shakespeare",
                   help="text source of the prompts (jaxspec.textdata) or 'random' tokens")
    s.add_argument("--seed", default="0",
                   help="prompts, their lengths and arrivals; several, comma-separated (5,6,7): "
                        "each server runs every workload at each seed in turn")
    s.add_argument("--short", type=int, default=64,
                   help="--workload short: tokens per prompt (default 64)")
    s.add_argument("--timeline", action="store_true",
                   help="also write NAME.timeline.json: per point every stream's token events "
                        "as the client stamped them and the server's decode chunks "
                        "(ServingEngine.chunk_timeline), on one clock")
    s.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                   help="measure jaxspec.generate's plain decoding at batch --max-batch on the "
                        "first workload's prompts (--no-reference: skip it, no verdict)")
    s.add_argument("--check", type=int, default=8, dest="check_outputs",
                   help="compare the greedy outputs of the first N requests with "
                        "jaxspec.generate's (0: none)")
    s.add_argument("--warmup", type=int, default=4,
                   help="warm-up requests per server (at least one per prefill length bucket; "
                        "except for shared-doc, the shortest also runs alone first, then they "
                        "all arrive 0.25 s apart, shortest first)")
    s.add_argument("--point-timeout-s", type=float, default=600.0,
                   help="a point's requests still running after this long are cancelled")
    s.add_argument("--time-budget-s", type=float, default=None,
                   help="skip the points left after this many seconds")
    s.add_argument("--out", default=None, help="directory for NAME.json and NAME.md")
    s.add_argument("--name", default="server")
    s.set_defaults(bench=bench_server)
