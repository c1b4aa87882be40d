"""Diagnostic (a profile of public `jaxspec.generate` calls, labelled so): where a speculation
round's GPU time goes, with and without ``batch_invariant=True``.

For each variant (`jaxspec.bench.parse_variant` names, ``inv:`` for batch-invariant ones) the
same prompts are decoded once to compile, then twice under the profiler: with ``--new`` new
tokens and with 1 (the prefill and the first token). The difference of the two calls' GPU
kernel times, per kernel name, divided by the difference of their target steps, is the GPU time
of one round (a verification and its drafts, or one plain step) by kernel. The kernels are also
summed into classes (attention, matrix products, norms, the rest) to set two variants side by
side.

GPU: python scripts/probe_invariant_round.py [--batch 64 --prompt 8192 --new 64
     --variants g4-fixed,inv:g4-fixed --out FILE]
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))
import benchutil  # noqa: E402

import jaxspec  # noqa: E402
from jaxspec import bench  # noqa: E402

T0 = time.time()


def log(d):
    d["t"] = round(time.time() - T0, 1)
    print(json.dumps(d), flush=True)


CLASSES = (  # (class, substrings of a kernel name), the first match wins
    ("attention", ("attention", "attend", "flash", "mosaic")),
    ("products", ("matmul", "gemm", "cublas", "xmma", "cutlass", "dot")),
    ("norm", ("norm",)),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def profiled(call):
    """(result, {kernel name: (count, us)}) of one call under the profiler."""
    d = tempfile.mkdtemp(prefix="round")
    try:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            res = call()
        ev = benchutil.gpu_events(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    tot = {}
    for _, dur, name in ev:
        c, s = tot.get(name[:80], (0, 0.0))
        tot[name[:80]] = (c + 1, s + dur)
    return res, tot


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random-qwen15")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default="g4-fixed,inv:g4-fixed")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.new < 2:
        ap.error("--new must be at least 2 (a round is the difference of --new and 1 tokens)")
    model = bench.load_model(a.model)
    prompts = bench.make_prompts(model, a.batch, a.prompt, a.seed, "random")
    out = {"environment": bench.environment(), "args": vars(a), "variants": {}}
    for name in bench.split_variants(a.variants):
        inv, v = bench.split_variant(name)
        spec = bench.parse_variant(v)

        def gen(n):
            return jaxspec.generate(model, prompts, max_new_tokens=n, speculation=spec,
                                    ignore_eos=True, batch_invariant=inv)
        gen(a.new)
        gen(1)
        timed = gen(a.new).stats
        long, k_long = profiled(lambda: gen(a.new))
        short, k_short = profiled(lambda: gen(1))
        rounds = long.stats["target_steps"] - short.stats["target_steps"]
        per = {}
        for nm, (c, us) in k_long.items():
            c0, us0 = k_short.get(nm, (0, 0.0))
            if us - us0 > 0:
                per[nm] = ((c - c0) / rounds, (us - us0) / rounds)
        classes = {}
        for nm, (c, us) in per.items():
            classes[kernel_class(nm)] = classes.get(kernel_class(nm), 0.0) + us
        row = {"rounds": rounds, "decode_seconds": timed["decode_seconds"],
               "decode_ms_per_round": round(1e3 * timed["decode_seconds"]
                                            / max(timed["target_steps"], 1), 3),
               "gpu_us_per_round": round(sum(us for _, us in per.values()), 1),
               "classes_us": {k: round(x, 1) for k, x in sorted(classes.items())},
               "top": [[nm, round(c, 2), round(us, 1)] for nm, (c, us) in
                       sorted(per.items(), key=lambda kv: -kv[1][1])[:a.top]]}
        out["variants"][name] = row
        log({"variant": name, **row})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
