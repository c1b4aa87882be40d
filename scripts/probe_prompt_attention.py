"""Diagnostic (internal entry points): is the Hopper (Mosaic GPU) attention kernel, with one key
split, chunk-invariant per row, and what does it cost against the batch-invariant Triton tiles?

For each (G, D) it prefills one cache's prompts in one call and in chunks of several sizes, alone
and inside a batch of other prompts, and compares every token's output row bitwise; then times a
prefill chunk of ``--time-chunk`` tokens after ``--time-start`` at B = ``--time-batch``.
Prints one JSON line per check and per timing.

    python scripts/probe_prompt_attention.py
"""
from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import invariant
from pallas_kernels import hopper


def hopper_prompt(q, k, v, lengths, layer, *, num_new, sm_scale, splits=1):
    bs = hopper.HopperBlockSizes(splits=splits)
    out, _ = hopper.verify_attention(q, k, v, lengths, layer=layer, sm_scale=sm_scale,
                                     num_new=num_new, block_sizes=bs,
                                     interpret=jax.default_backend() == "cpu")
    return out


def reference(q, k, v, lengths, layer, *, num_new, sm_scale):
    """float32 causal attention of the T new tokens after each row's context."""
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    kk = k[layer].astype(jnp.float32)  # [B, K, S, D]
    vv = v[layer].astype(jnp.float32)
    S = kk.shape[2]
    qq = q.astype(jnp.float32).reshape(B, T, K, G, D)
    s = jnp.einsum("btkgd,bksd->bkgts", qq, kk) * sm_scale
    pos = lengths[:, None] + jnp.arange(T)[None] + (num_new - T)  # [B, T]
    vis = jnp.arange(S)[None, None] <= pos[..., None]  # [B, T, S]
    s = jnp.where(vis[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bksd->btkgd", p, vv)
    return o.reshape(B, T, H, D)


def bits(x):
    return np.asarray(jax.device_get(x)).view(np.uint16)


def check(G, D, K, S, lens, chunks, seed, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    B = len(lens)
    H = G * K
    L = 2
    k = jnp.asarray(rng.standard_normal((L, B, K, S, D)), dtype)
    v = jnp.asarray(rng.standard_normal((L, B, K, S, D)), dtype)
    n = max(lens)
    qall = jnp.asarray(rng.standard_normal((B, n, H, D)) * 2, dtype)
    sm = 1.0 / math.sqrt(D)
    layer = jnp.int32(1)
    zero = jnp.zeros((B,), jnp.int32)
    one = jax.jit(lambda q, l: hopper_prompt(q, k, v, l, layer, num_new=q.shape[1], sm_scale=sm))
    whole = one(qall, zero)
    ref = reference(qall, k, v, zero, 1, num_new=n, sm_scale=sm)
    err = float(jnp.max(jnp.abs(whole.astype(jnp.float32) - ref)))
    want = bits(whole)
    res = {"G": G, "D": D, "lens": lens, "err_vs_f32": err, "chunks": {}}
    for C in chunks:
        got = np.zeros_like(want)
        for s0 in range(0, n, C):
            c = min(C, n - s0)
            o = one(qall[:, s0:s0 + c], jnp.full((B,), s0, jnp.int32))
            got[:, s0:s0 + c] = bits(o)
        diff = 0
        for b, ln in enumerate(lens):
            diff += int(np.sum(np.any(got[b, :ln] != want[b, :ln], axis=(-1, -2))))
        res["chunks"][C] = diff
    # row 0 alone in a batch of one (its own cache)
    k1, v1 = k[:, :1], v[:, :1]
    o1 = jax.jit(lambda q, l: hopper_prompt(q, k1, v1, l, layer, num_new=q.shape[1],
                                            sm_scale=sm))(qall[:1, :lens[0]], zero[:1])
    res["alone_rows_differ"] = int(np.sum(np.any(bits(o1)[0] != want[0, :lens[0]], axis=(-1, -2))))
    return res


def timeit(fn, *args, reps=5):
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def timing(B, K, G, D, start, chunk, layers=4, reps=5):
    rng = np.random.default_rng(0)
    H = G * K
    S = start + chunk
    k = jnp.asarray(rng.standard_normal((layers, B, K, S, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((layers, B, K, S, D)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((B, chunk, H, D)), jnp.bfloat16)
    lengths = jnp.full((B,), start, jnp.int32)
    sm = 1.0 / math.sqrt(D)

    def over_layers(f):
        def run(q, lengths):
            return [f(q, lengths, jnp.int32(i)) for i in range(layers)]
        return jax.jit(run)

    variants = {
        "hopper_splits1": lambda q, l, i: hopper_prompt(q, k, v, l, i, num_new=chunk,
                                                        sm_scale=sm),
        "hopper_default_splits": lambda q, l, i: hopper_prompt(q, k, v, l, i, num_new=chunk,
                                                               sm_scale=sm, splits=None),
        "invariant_tiles16": lambda q, l, i: invariant.attention(
            q, k, v, i, l, num_new=chunk, sm_scale=sm, impl="invariant"),
    }
    out = {}
    for name, f in variants.items():
        t = timeit(over_layers(f), q, lengths, reps=reps)
        out[name] = t / layers * 1e6
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-batch", type=int, default=64)
    ap.add_argument("--time-start", type=int, default=8192)
    ap.add_argument("--time-chunk", type=int, default=512)
    ap.add_argument("--seeds", type=int, default=1)
    a = ap.parse_args()
    print(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__}), flush=True)
    for seed in range(a.seeds):
        for G, D, K in ((6, 128, 2), (4, 128, 2), (8, 64, 2), (1, 128, 4), (7, 64, 1)):
            lens = [777, 1000, 333] if seed == 0 else [1024, 129, 640]
            r = check(G, D, K, 1152, lens, (1, 7, 100, 512), seed)
            print(json.dumps(r), flush=True)
    for G, K in ((6, 2), (4, 2)):
        r = timing(a.time_batch, K, G, 128, a.time_start, a.time_chunk)
        print(json.dumps({"timing_us_per_layer": r, "B": a.time_batch, "G": G, "K": K,
                          "start": a.time_start, "chunk": a.time_chunk}), flush=True)
    r = timing(a.time_batch, 2, 6, 128, 16384, 5)
    print(json.dumps({"timing_us_per_layer": r, "B": a.time_batch, "G": 6, "K": 2,
                      "start": 16384, "chunk": 5}), flush=True)


if __name__ == "__main__":
    main()
