#!/usr/bin/env python
"""Diagnostic (kernel timings, not what a user gets): batch-invariant attention over a block
pool, read through the block table by the kernel, against the same attention over a gathered
dense view of each row's blocks (what the paged engine did before: a copy of the context per
layer per step), and the default paged kernel. Qwen2.5-1.5B's attention shapes (KV heads 2,
G = 6, D = 128), bf16, ``--batch`` rows of ``--ctx`` context (lengths random in the last 256
below it), pages of ``--page`` slots shuffled in the pool; T = 1 (decode) and 5 (a
verification). Each timing runs ``--layers`` layers of one pool in one jitted call (median of
``--reps``). Checks that the pool and the view give the same bits on the device.

    python scripts/probe_invariant_paged.py --batch 64 --ctx 16384 --page 16
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxspec.attention import AttentionPlan, attend  # noqa: E402
from jaxspec.paged import gather_view  # noqa: E402
from bench_invariant import median_time  # noqa: E402  (scripts/, this script's folder)

BF16 = jnp.bfloat16


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    B, BS, nl = a.batch, a.page, a.layers
    MB = -(-(a.ctx + 8) // BS)
    NB = B * MB + 1
    rng = np.random.default_rng(0)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    kp = jax.random.normal(k1, (nl, NB, 2, BS, 128), BF16)
    vp = jax.random.normal(k2, (nl, NB, 2, BS, 128), BF16)
    tab = jnp.asarray(rng.permutation(NB)[:B * MB].reshape(B, MB), jnp.int32)
    L = jnp.asarray(rng.integers(a.ctx - 256, a.ctx - 8, size=B), jnp.int32)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "batch": B,
           "ctx": a.ctx, "page": BS, "layers": nl, "ms_per_layer": {}, "same_bits": {}}

    def fn(kind, T):
        def one(q, k, v, tab, L, layer):
            if kind == "view":  # the gathered view, then the dense invariant kernel
                kv = gather_view(k, layer, tab)[None], gather_view(v, layer, tab)[None]
                return attend(q, *kv, jnp.int32(0), AttentionPlan(lengths=L, impl="invariant"))
            impl = "auto" if kind == "default" else "invariant"
            return attend(q, k, v, layer, AttentionPlan(lengths=L, impl=impl, block_table=tab))

        @jax.jit
        def run(q, k, v, tab, L):
            outs = [jax.lax.optimization_barrier(one(q, k, v, tab, L, jnp.int32(i)))
                    for i in range(nl)]
            return jnp.stack(outs)
        return run

    for T in (1, 5):
        q = jax.random.normal(k3, (B, T, 12, 128), BF16)
        outs = {}
        for kind in ("pool", "view", "default"):
            f = fn(kind, T)
            t = median_time(f, (q, kp, vp, tab, L), a.reps)
            res["ms_per_layer"][f"{kind}_T{T}"] = 1e3 * t / nl
            outs[kind] = np.asarray(f(q, kp, vp, tab, L), np.float32)
            print(kind, f"T={T}", f"{1e3 * t / nl:.3f} ms/layer", flush=True)
        res["same_bits"][f"T{T}"] = bool(np.array_equal(outs["pool"], outs["view"]))
        print("pool == view bitwise:", res["same_bits"][f"T{T}"], flush=True)
    ctx_bytes = 2 * B * 2 * a.ctx * 128 * 2  # K and V of one layer
    res["context_bytes_per_layer"] = ctx_bytes
    print(json.dumps(res), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
