#!/usr/bin/env python
"""What the slowest tokens of a `jaxspec bench server --timeline` run waited for (diagnostic).

Reads ``NAME.timeline.json`` (each point's token events as the client stamped them and the
server's decode chunks, `jaxspec.serving.ServingEngine.chunk_timeline`, on one clock). Per point:
the ITL p50 / p99 as ``jaxspec.bench_server.summarize`` computes them (a gap between two token
events split over the tokens of the later one), then for the gaps at or above the p99 what ran
on the device meanwhile: each chunk that overlaps the gap counts for the share of the gap it
covers, by kind (``mixed`` = carried prompt pieces, ``first`` = its program's first run,
``compact`` = over fewer rows than the slots, ``plain`` / ``speculative``); what no chunk covers
is ``idle`` (the device waited for the host, or ran a prefill step: counted apart). Also, over
every chunk of the point: measured / predicted device time (mixed: rounds + pieces), and the
host's turn between consecutive chunks.

    python scripts/itl_tail.py OUT/NAME.timeline.json [--point SEED:WORKLOAD ...]
"""
from __future__ import annotations

import argparse
import collections
import json

import numpy as np


def _kind(c: dict) -> str:
    if c.get("first_run"):
        return "first"
    if c.get("pieces"):
        return "mixed"
    if c.get("compact"):
        return "compact"
    return c.get("kind", "plain")


def analyze(point: dict) -> dict:
    """The slow-gap breakdown of one timeline point (see the module docstring)."""
    chunks = sorted((c for c in point["chunks"] if c.get("kind") != "prefill"),
                    key=lambda c: c["t_start"])
    prefills = [c for c in point["chunks"] if c.get("kind") == "prefill"]
    itl, gaps = [], []
    for r in point["requests"]:
        if r["status"] != "ok" or not r["events"]:
            continue
        ev = [(r["clock0"] + t, n) for t, n in r["events"]]
        for (t0, n0), (t1, n1) in zip(ev, ev[1:]):
            per = (t1 - t0) / (n1 - n0)
            itl.extend([per] * (n1 - n0))
            gaps.append((t0, t1, n1 - n0, per))
    if not itl:
        return {"tokens": 0}
    p50, p99 = (float(np.percentile(itl, q)) for q in (50, 99))
    share = collections.Counter()
    slow_tokens = 0
    for t0, t1, n, per in gaps:
        if per < p99:
            continue
        slow_tokens += n
        covered = 0.0
        for c in chunks:
            o = min(t1, c["t_end"]) - max(t0, c["t_start"])
            if o > 0:
                share[_kind(c)] += o * n
                covered += o
        pre = sum(1 for p in prefills if t0 <= p["t_dispatch"] <= t1)
        share["idle" if not pre else "idle (prefill step dispatched)"] += \
            max(t1 - t0 - covered, 0.0) * n
    total = sum(share.values()) or 1.0
    ratio = collections.defaultdict(list)
    for c in chunks:
        if c.get("predicted_s") and not c.get("first_run"):
            pred = c["predicted_s"] + (c.get("predicted_pieces_s") or 0.0)
            ratio["mixed" if c.get("pieces") else "plain"].append(c["device_s"] / pred)
    turns = [b["t_start"] - a["t_end"] for a, b in zip(chunks, chunks[1:])]
    return {
        "tokens": len(itl), "itl_p50_ms": p50 * 1e3, "itl_p99_ms": p99 * 1e3,
        "slow_tokens": slow_tokens,
        "slow_time_share": {k: v / total for k, v in share.most_common()},
        "measured_over_predicted": {k: [float(np.percentile(v, q)) for q in (50, 90, 99)]
                                    for k, v in ratio.items() if v},
        "host_turn_ms": [float(np.percentile(turns, q)) * 1e3 for q in (50, 90, 99)]
        if turns else None,
        "chunks": collections.Counter(_kind(c) for c in chunks),
        "mixed_chunk_ms": [float(np.percentile([c["device_s"] for c in chunks if c["pieces"]], q))
                           * 1e3 for q in (50, 90, 99)] if any(c["pieces"] for c in chunks)
        else None,
        "first_runs": [(round(c["device_s"] * 1e3, 1), c["rows"], c["batch"], c["pieces"])
                       for c in chunks if c.get("first_run")],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("timeline")
    p.add_argument("--point", action="append", default=None,
                   help="SEED:WORKLOAD (default: every point)")
    a = p.parse_args(argv)
    points = json.loads(open(a.timeline).read())["points"]
    for pt in points:
        name = f"{pt.get('seed')}:{pt['workload']}"
        if a.point and name not in a.point:
            continue
        r = analyze(pt)
        print(f"== {pt.get('setup')}/{pt['variant']} seed {pt.get('seed')} {pt['workload']} "
              f"@ {pt['rate']}")
        for k, v in r.items():
            if isinstance(v, float):
                v = round(v, 2)
            elif isinstance(v, dict):
                v = {kk: (round(x, 3) if isinstance(x, float) else
                          [round(y, 3) for y in x] if isinstance(x, list) else x)
                     for kk, x in v.items()}
            elif isinstance(v, list) and v and isinstance(v[0], float):
                v = [round(x, 2) for x in v]
            print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
