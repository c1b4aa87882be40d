#!/usr/bin/env python
"""Where a paged serving engine's wall time goes under a burst of mixed-length prompts
(diagnostic: the engine's own API, no HTTP, its methods timed by wrapping them).

For each ``--setups`` value (``--mixed-prefill``: 0 = prompts prefilled between decode chunks),
a `jaxspec.serving.ServingEngine` with a paged pool takes ``--requests`` random-token prompts of
``--lo``-``--hi`` tokens drawn log-uniformly (``jaxspec.bench_server.draw_lengths``, seed 0; the
same prompts for every setup), all submitted at once (or, with ``--rate R``, at the times of a Poisson process of R requests/s,
``jaxspec.bench_server.arrival_times``), ``--new`` greedy tokens each. Every call
of the engine-thread steps (`_tick`, `_step`'s parts, prefill, program lookups) and of the
device thread's chunk (`_chunk_on_device`) is recorded with its start and duration.

Printed per setup: wall time, TTFT p50 / p99, the summed time per recorded function (waits
included: a function that reads the engine's state waits for the running chunk), the device
thread's chunk time, and the gaps between consecutive chunks (the device idle unless a prefill
runs there). ``<out>/serving_timeline.json`` keeps every event and each sequence's submit /
first token / done times. Each sequence's token events are timed as a client sees them, and
its inter-token latency computed as ``jaxspec.bench_server`` does (a gap between two events
split over the tokens of the later one); the gaps of the ITL p99 and above are printed with
the engine calls that overlapped them (a chunk's rounds and whether it carried prompt pieces).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import threading
import time

import numpy as np

ENGINE = ["_tick", "_prefill_step", "_start_filled", "_grow", "_tables", "_process",
          "_run_chunk", "_chunk_on_device", "_admit_paged", "_pieces", "_resolve", "_share",
          "_apply_shared", "_pieces_done"]
DECODER = ["prefill_paged_row", "prefill_draft_row", "mixed_program", "chunk_program",
           "call_chunk"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random-qwen15")
    p.add_argument("--setups", default="2048,0", help="--mixed-prefill values, comma-separated")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--lo", type=int, default=1024)
    p.add_argument("--hi", type=int, default=32000)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--kv-blocks", type=int, default=32768)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--rounds-per-chunk", type=int, default=8)
    p.add_argument("--rate", type=float, default=float("inf"),
                   help="requests/s of a Poisson process (inf: all at once)")
    p.add_argument("--worst", type=int, default=8, help="slowest ITL gaps to print")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)

    from jaxspec.bench import load_model
    from jaxspec.bench_server import arrival_times, draw_lengths
    from jaxspec.serving import SamplingOptions, Sequence, ServingEngine

    model = load_model(args.model)
    V = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(min(100, V // 4), V - min(100, V // 4), size=int(n)).tolist()
               for n in draw_lengths(args.requests, args.lo, args.hi, 0, "log")]
    results = {}
    for setup in args.setups.split(","):
        e = ServingEngine(model, max_batch=args.max_batch, max_len=args.hi + args.new,
                          page_size=args.page_size, kv_blocks=args.kv_blocks,
                          rounds_per_chunk=args.rounds_per_chunk, max_queue=4 * args.requests,
                          prefill_chunk=args.prefill_chunk, warmup_prefill=args.hi,
                          mixed_prefill=int(setup), ignore_eos=True)
        t = time.perf_counter()
        e.start(variants=[(True, False)])
        while e.metrics()["programs_compiling"]:
            time.sleep(0.5)
        print(f"mixed_prefill {setup}: engine ready in {time.perf_counter() - t:.1f} s",
              flush=True)
        events = []

        def wrap(obj, name, label):
            fn = getattr(obj, name)

            def timed(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    if name == "_chunk_on_device":  # (program, sp, state, rounds, ...)
                        label_ = f"{label}[{a[3]}{'+pieces' if k.get('pieces') is not None or len(a) > 7 and a[7] is not None else ''}]"
                    else:
                        label_ = label
                    events.append((label_, threading.current_thread().name, t0,
                                   time.perf_counter()))
            setattr(obj, name, timed)
        for name in ENGINE:
            wrap(e, name, name)
        for name in DECODER:
            wrap(e.decoder, name, "decoder." + name)
        pieces_seen = []  # (pieces' attended keys, seconds they added, predicted before)
        cost = e._piece_cost
        observe = cost.observe

        def observed(keys, seconds, _observe=observe):
            pieces_seen.append((list(keys), float(seconds),
                                None if cost.coef is None else sum(cost.predict(k) for k in keys)))
            return _observe(keys, seconds)
        cost.observe = observed
        seqs = [Sequence(x, SamplingOptions(max_tokens=args.new, temperature=0.0))
                for x in prompts]
        deltas = collections.defaultdict(list)  # sequence index -> [(time, tokens so far)]
        index = {id(s): i for i, s in enumerate(seqs)}
        emit = Sequence._emit

        def record(seq, event, _emit=emit):
            if event.get("type") == "delta" and id(seq) in index:
                deltas[index[id(seq)]].append((time.perf_counter(), event["n_tokens"]))
            return _emit(seq, event)
        Sequence._emit = record
        when = arrival_times(len(seqs), args.rate, 0)
        t0 = time.perf_counter()
        for s, at in zip(seqs, when):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            e.submit([s])
        for s in seqs:
            s.finished.wait()
        Sequence._emit = emit
        wall = time.perf_counter() - t0
        m = e.metrics()
        e.stop()
        ev = [(n, th, a - t0, b - a) for n, th, a, b in events if a >= t0]
        total = collections.defaultdict(lambda: [0, 0.0])
        for n, _, _, d in ev:
            total[n][0] += 1
            total[n][1] += d
        chunks = sorted((a, a + d) for n, _, a, d in ev if n.startswith("_chunk_on_device"))
        gaps = [b[0] - a[1] for a, b in zip(chunks, chunks[1:])]
        failed = [s.error for s in seqs if s.error is not None]
        if failed:
            print(f"{len(failed)} sequences failed, e.g.: {failed[0]}", flush=True)
        ttft = np.asarray([s.t_first - s.t_submit for s in seqs if s.t_first is not None])
        itl = []  # (seconds per token, gap start, gap end, tokens), as a client sees them
        for pts in deltas.values():
            for (ta, na), (tb, nb) in zip(pts, pts[1:]):
                if nb > na:
                    itl.extend([((tb - ta) / (nb - na), ta - t0, tb - t0, nb - na)] * (nb - na))
        itl.sort()
        worst = []
        if itl:
            p99 = itl[min(len(itl) - 1, int(0.99 * len(itl)))][0]
            seen = set()
            for per, a, b, n in reversed(itl):
                if per < p99 or len(worst) >= args.worst:
                    break
                if (a, b) in seen:
                    continue
                seen.add((a, b))
                worst.append({"itl_ms": round(per * 1e3, 2), "gap": [round(a, 4), round(b, 4)],
                              "tokens": n, "calls": [(nm, round(x, 4), round(d * 1e3, 2))
                                                     for nm, _, x, d in ev
                                                     if x < b and x + d > a and d > 0.0005]})
        # what the gaps of the ITL p99 and above overlapped, counted in tokens
        slow = collections.Counter()
        if itl:
            for per, a, b, n in itl[int(0.99 * len(itl)):]:
                kinds = {("mixed" if "+pieces" in nm else "chunk")
                         if nm.startswith("_chunk_on_device") else
                         "prefill" if nm.startswith("decoder.prefill") else None
                         for nm, _, x, d in ev if x < b and x + d > a and d > 0.0005}
                slow["mixed" if "mixed" in kinds else "prefill" if "prefill" in kinds else
                     "plain chunks only"] += 1
        # (over the chunks the piece cost learned from: full length, not well under their
        # rounds' prediction)
        predicted = [(x, p) for _, x, p in pieces_seen if p is not None]
        res = {"mixed_prefill": int(setup), "wall_s": wall,
               "slow_tokens_overlapping": dict(slow),
               "piece_cost": {"chunks_learned": len(pieces_seen),
                              "coef": None if cost.coef is None else [float(c) for c in
                                                                      cost.coef],
                              "measured_over_predicted_p50_p90": [
                                  float(np.percentile([x / max(p, 1e-9) for x, p in predicted],
                                                      q)) for q in (50, 90)]
                              if predicted else None,
                              "chunks": pieces_seen},
               "itl_p50_ms": float(np.percentile([x[0] for x in itl], 50) * 1e3) if itl else None,
               "itl_p99_ms": float(np.percentile([x[0] for x in itl], 99) * 1e3) if itl else None,
               "worst_gaps": worst,
               "ttft_p50_s": float(np.percentile(ttft, 50)),
               "ttft_p99_s": float(np.percentile(ttft, 99)),
               "calls": {k: [v[0], round(v[1], 4)] for k, v in
                         sorted(total.items(), key=lambda kv: -kv[1][1])},
               "chunks": len(chunks), "chunk_s": sum(b - a for a, b in chunks),
               "gaps_s": sum(gaps), "largest_gaps_s": sorted(gaps)[-10:],
               "metrics": {k: m[k] for k in ("chunks", "rounds", "chunk_seconds",
                                             "mixed_chunks", "mixed_prefill_tokens",
                                             "prefill_tokens", "preemptions",
                                             "compact_chunks")},
               "events": [(n, th, round(a, 5), round(d, 5)) for n, th, a, d in ev],
               "sequences": [(len(s.prompt_ids), s.t_submit - t0,
                              None if s.t_first is None else s.t_first - t0,
                              None if s.t_done is None else s.t_done - t0) for s in seqs]}
        print(json.dumps({k: v for k, v in res.items()
                          if k not in ("events", "sequences", "worst_gaps")} | {
            "piece_cost": {k: v for k, v in res["piece_cost"].items() if k != "chunks"}}),
            flush=True)
        for w in res["worst_gaps"]:
            print("  slow gap", json.dumps(w), flush=True)
        results[setup] = res
        del e
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "serving_timeline.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
