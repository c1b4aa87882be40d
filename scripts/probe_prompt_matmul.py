"""GPU probe of `pallas_kernels.prompt_matmul` (the prompt rows' row-invariant product): its
error against a float32 product, whether each row's bits are the same for every M and place in
a tile, and its time against XLA's own product (cuBLAS) at a prefill chunk's shapes.

    python3 scripts/probe_prompt_matmul.py                  # the Qwen2.5-1.5B shapes
    python3 scripts/probe_prompt_matmul.py --shapes 896x1152,4864x896 --M 8192 --tiles 128

Timings are diagnostics (internal entry points): the mean of ``--reps`` calls after a warm-up,
each one jitted call over ``--arrays`` distinct weight arrays (so that the weights come from HBM,
as in a forward over many layers). Prints one JSON line per result.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import prompt_matmul as pm  # noqa: E402

QWEN15 = "1536x2048,1536x1536,1536x17920,8960x1536"  # qkv, o, gate|up, down (K x N)


def _shapes(s):
    out = []
    for part in s.split(","):
        k, n = part.lower().split("x")
        out.append((int(k), int(n)))
    return out


def _time(fn, args, reps):
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(reps):
        r = fn(*args)
    jax.block_until_ready(r)
    return (time.perf_counter() - t) / reps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=QWEN15, help="K x N products, comma-separated")
    ap.add_argument("--M", default="32768", help="rows to time at, comma-separated")
    ap.add_argument("--tiles", default="256,128", help="block_n caps to try")
    ap.add_argument("--stages", default="0", help="ring depths to try (0: as many as fit)")
    ap.add_argument("--programs", default="0", help="programs to try (0: one per output tile; "
                    "sms: one per SM, persistent)")
    ap.add_argument("--arrays", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--bits-M", default="1,7,100,128,129,1000,4096",
                    help="row counts whose rows are compared with the same rows of the largest")
    a = ap.parse_args()
    print(json.dumps({"device": jax.devices()[0].device_kind, "jax": jax.__version__}))
    sms = jax.devices()[0].core_count if hasattr(jax.devices()[0], "core_count") else 132
    progs = [sms if p == "sms" else (int(p) or None) for p in a.programs.split(",")]
    cfgs = [pm.PromptMatmulBlocks(block_n=int(b), stages=int(s) or None, programs=p)
            for b in a.tiles.split(",") for s in a.stages.split(",") for p in progs]
    key = jax.random.PRNGKey(0)
    for K, N in _shapes(a.shapes):
        kx, kw, key = jax.random.split(key, 3)
        Ms = [int(m) for m in a.bits_M.split(",")]
        big = max(Ms)
        x = jax.random.normal(kx, (big, K), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (K, N), jnp.float32) / np.sqrt(K)).astype(jnp.bfloat16)
        ref = pm.prompt_matmul_reference(x, w, out_dtype=jnp.float32)
        for cfg in cfgs:
            f = jax.jit(lambda x, w, cfg=cfg: pm.prompt_matmul(x, w, block_sizes=cfg))
            y = np.asarray(f(x, w))
            err = float(np.max(np.abs(y.astype(np.float32) - np.asarray(ref)))
                        / np.max(np.abs(np.asarray(ref))))
            bad = {}
            for m in Ms[:-1]:
                for off in sorted({0, big - m, (big - m) // 2 + 3}):
                    ys = np.asarray(f(x[off:off + m], w))
                    n = int(np.sum(np.any(ys.view(np.uint16) != y[off:off + m].view(np.uint16),
                                          axis=1)))
                    if n:
                        bad[f"M={m}@{off}"] = n
            print(json.dumps({"op": "bits", "K": K, "N": N, "programs": cfg.programs,
                              "block_n": pm.block_n_of(N, cfg.block_n),
                              "stages": cfg.stages or pm.stages_for(pm.block_n_of(N, cfg.block_n)),
                              "rel_err": err, "rows_differing": bad, "bitwise": not bad}),
                  flush=True)
    for M in [int(m) for m in a.M.split(",")]:
        for K, N in _shapes(a.shapes):
            kx, kw, key = jax.random.split(key, 3)
            x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
            ws = [(jax.random.normal(jax.random.fold_in(kw, i), (K, N), jnp.float32)
                   / np.sqrt(K)).astype(jnp.bfloat16) for i in range(a.arrays)]
            dot = jax.jit(lambda x, ws: [jnp.dot(x, w) for w in ws])
            row = {"op": "time", "M": M, "K": K, "N": N,
                   "tflop": 2 * M * K * N / 1e12,
                   "xla_us": _time(dot, (x, ws), a.reps) / a.arrays * 1e6}
            for cfg in cfgs:
                f = jax.jit(lambda x, ws, cfg=cfg: [pm.prompt_matmul(x, w, block_sizes=cfg)
                                                    for w in ws])
                name = f"n{cfg.block_n}s{cfg.stages or 0}p{cfg.programs or 0}"
                try:
                    row[name + "_us"] = _time(f, (x, ws), a.reps) / a.arrays * 1e6
                except Exception as e:  # noqa: BLE001 - report and go on
                    row[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            for k in list(row):
                if k.endswith("_us"):
                    row[k[:-3] + "_tflops"] = row["tflop"] / (row[k] * 1e-6)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
