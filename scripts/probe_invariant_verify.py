"""Diagnostic (kernel level, internal entry points, labelled so): a verification's attention with
batch-invariant numerics against the default kernel, with and without the retrieving
self-draft's block scores, per tiling of the invariant kernel.

B rows of ``--ctx`` context (lengths random in the last 256 below it), KV heads 2, G = 6,
head dim 128, bf16, 4 layers of one cache per call; T = 1 (a decode step) and ``--T`` (a
verification), per layer (us, the median of ``--reps`` calls). Tilings (``--attn``:
`InvariantAttentionBlocks`' fields in order, tilings separated by ``;``) that differ only in
how tiles group into programs or in pipeline stages must give the first tiling's bits: that is
checked for every one of them (output and scores).

GPU: python scripts/probe_invariant_verify.py [--ctx 8192 --T 5 --out FILE]
"""
import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_invariant import attn_inputs, median_time, parse_attn  # noqa: E402

from jaxspec import invariant  # noqa: E402
from jaxspec.attention import AttentionPlan, attend  # noqa: E402

BF16 = jnp.bfloat16
T0 = time.time()
SCORE_BLOCK = 64


def log(d):
    d["t"] = round(time.time() - T0, 1)
    print(json.dumps(d), flush=True)


def layers_fn(one, n_layers=4):
    @jax.jit
    def run(q, k, v, L):
        outs = []
        for layer in range(n_layers):
            outs.append(jax.lax.optimization_barrier(one(q, k, v, L, jnp.int32(layer))))
        return outs
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--T", type=int, default=5)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--attn", default="16,128,4096,4,2,4,2;16,128,4096,4,2,4,1;"
                    "16,128,4096,4,3,4,2;16,128,4096,4,3,4,1")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    B = a.batch
    k, v, L = attn_inputs(B, a.ctx, a.ctx + 256)
    cfgs = parse_attn(a.attn)
    rows = []
    for T in (1, a.T):
        q = jax.random.normal(jax.random.key(T), (B, T, 12, 128), BF16)
        for scores in (False, True):
            sb = SCORE_BLOCK if scores else None
            fns = {"default": layers_fn(lambda q, k, v, L, layer: attend(
                q, k, v, layer, AttentionPlan(lengths=L, impl="auto", score_block=sb)))}
            for i, bs in enumerate(cfgs):
                fns[f"at{i}"] = layers_fn(
                    lambda q, k, v, L, layer, bs=bs: invariant._attention_tiles(
                        q, k, v, layer, L, None, num_new=T, sm_scale=None, sliding_window=None,
                        interpret=False, blocks=bs, score_block=sb))
            row = {"T": T, "scores": scores, "batch": B, "ctx": a.ctx}
            ref = None
            for name, fn in fns.items():
                try:
                    row[name + "_us"] = round(median_time(fn, (q, k, v, L), a.reps) / 4 * 1e6, 1)
                    if name != "default":
                        got = jax.tree.leaves(fn(q, k, v, L))
                        got = [np.asarray(x, np.float32) for x in got]
                        if ref is None:
                            ref = got
                        else:
                            row[name + "_bits_equal_at0"] = all(
                                np.array_equal(x, y, equal_nan=True) for x, y in zip(got, ref))
                except Exception as e:  # noqa: BLE001
                    row[name + "_err"] = repr(e)[:300]
            rows.append(row)
            log(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                       "args": vars(a), "attn": [str(c) for c in cfgs], "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
