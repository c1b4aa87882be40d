#!/usr/bin/env python
"""One row's prompt chunk through a paged cache: which attention route a server's prefill should
take (diagnostic, internal entry points).

For each chunk size C and context offset (the chunk's first slot), one compiled prefill chunk
of one row (``jaxspec.prefill``'s chunk programs) of a model (random weights of a named shape,
or a checkpoint), timed synced (median of ``--reps`` after a warm-up call):

* ``dense``: the row in a dense cache (the Hopper kernel on a Hopper GPU from 128 query rows per
  KV head);
* ``paged_triton``: the row's blocks in a shuffled pool, read through its block table by the
  Triton paged kernel;
* ``paged_gathered``: the same pool; the row's blocks gathered into a dense copy per layer and
  the Hopper kernel over it (``pallas_kernels.dispatch``'s ``"hopper-gathered"`` route, which
  by default serves from ``PAGED_HOPPER_MIN_ROWS`` query rows per KV head and tables of at most
  ``PAGED_HOPPER_MAX_SLOTS_PER_TOKEN`` slots per query token; each variant is forced here,
  so on a GPU without the Hopper kernel this column is the Triton kernel again).

Before the timings, the gathered route's output is checked against the Triton paged kernel's
on random bf16 data (max abs difference of out and of the log-sum-exp).

The weights are in the layout decoding uses on this backend (``jaxspec.sharding.decode_params``:
per-layer and fused on a GPU). FLOPs per chunk: 2 x (parameters less the embedding) per token
plus 4 x layers x heads x head_dim x (offset + C/2) per token for attention.

Output: ``<out>/paged_prefill.json``; the routes' times and the implied TFLOP/s printed.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random-qwen15")
    p.add_argument("--chunks", default="2048,512")
    p.add_argument("--offsets", default="0,4096,8192,16384,30720")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)

    import pallas_kernels.dispatch as dsp
    from pallas_kernels.dispatch import paged_decode_attention
    from pallas_kernels.triton_decode import GPU_DEFAULTS
    from jaxspec.bench import load_model
    from jaxspec.cache import KVCache
    from jaxspec.paged import PagedKVCache
    from jaxspec.prefill import _prefill_chunk, _prefill_paged_chunk
    from jaxspec.sharding import decode_params

    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "checks": {},
           "prefill": []}
    rng = np.random.default_rng(0)
    for T, ctx in ((2048, 8192), (512, 20000), (2048, 0)):  # the gathered route vs Triton
        B, K, G, D, BS, MB, NB = 1, 2, 6, 128, 16, 2048, 4096
        kq, kk, kv = jax.random.split(jax.random.PRNGKey(1), 3)
        q = jax.random.normal(kq, (B, T, K * G, D), jnp.bfloat16)
        kp = jax.random.normal(kk, (NB, K, BS, D), jnp.bfloat16)
        vp = jax.random.normal(kv, (NB, K, BS, D), jnp.bfloat16)
        table = jnp.asarray(rng.permutation(NB)[:MB][None].astype(np.int32))
        ln = jnp.asarray([ctx], jnp.int32)
        o1, l1 = paged_decode_attention(q, kp, vp, table, ln)
        o2, l2 = paged_decode_attention(q, kp, vp, table, ln, block_sizes=GPU_DEFAULTS)
        d_out = float(jnp.max(jnp.abs(o1.astype(jnp.float32) - o2.astype(jnp.float32))))
        d_lse = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(l1), l1 - l2, 0))))
        route = dsp.paged_decode_route(q, kp).kernel
        print(f"check T={T} context={ctx}: route {route}, max |out diff| {d_out:.3g}, "
              f"max |lse diff| {d_lse:.3g}", flush=True)
        out["checks"][f"T{T}_ctx{ctx}"] = {"route": route, "out": d_out, "lse": d_lse}

    model = load_model(args.model)
    cfg = model.config
    params = decode_params(model)
    n_params = sum(x.size for x in jax.tree.leaves(params)) - cfg.vocab_size * cfg.hidden_size
    offsets = [int(x) for x in args.offsets.split(",")]
    S = max(offsets) + max(int(c) for c in args.chunks.split(","))
    BS = args.page_size
    MB = -(-S // BS)

    def timeit(f):
        f()
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            jax.block_until_ready(f())
            ts.append(time.perf_counter() - t)
        return float(np.median(ts))

    dense_fn = jax.jit(functools.partial(_prefill_chunk, config=cfg, impl="auto"),
                       donate_argnums=(1,))
    for C in (int(c) for c in args.chunks.split(",")):
        toks = jnp.asarray(rng.integers(100, 1000, (1, C)).astype(np.int32))
        box = {"dense": KVCache.create(cfg, 1, S)}
        for off in offsets:
            st = jnp.int32(off)

            def run_dense():
                box["dense"] = dense_fn(params, box["dense"], None, toks, st)
                return box["dense"].k
            row = {"C": C, "offset": off, "dense": timeit(run_dense)}
            for variant, rows in (("paged_triton", 1 << 30), ("paged_gathered", 0)):
                keep = dsp.PAGED_HOPPER_MIN_ROWS, dsp.PAGED_HOPPER_MAX_SLOTS_PER_TOKEN
                # each variant forced (the default route depends on the chunk and table sizes)
                dsp.PAGED_HOPPER_MIN_ROWS = rows
                dsp.PAGED_HOPPER_MAX_SLOTS_PER_TOKEN = 1 << 30
                jax.clear_caches()  # (the route is chosen when the chunk is traced)
                cache = PagedKVCache.create(cfg, 1, MB, BS, MB)
                box["paged"] = cache.replace(block_table=jnp.asarray(
                    rng.permutation(MB)[None].astype(np.int32)))

                def run_paged():
                    box["paged"] = _prefill_paged_chunk(params, box["paged"], jnp.int32(0), toks,
                                                        st, jnp.int32(off + C), config=cfg,
                                                        impl="auto")
                    return box["paged"].k
                try:
                    row[variant] = timeit(run_paged)
                finally:
                    dsp.PAGED_HOPPER_MIN_ROWS, dsp.PAGED_HOPPER_MAX_SLOTS_PER_TOKEN = keep
                del box["paged"], cache
            jax.clear_caches()
            flops = C * 2 * n_params + C * 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (
                off + C / 2)
            row["tflop"] = flops / 1e12
            print(json.dumps(row), "  TFLOP/s: " + ", ".join(
                f"{k} {flops / row[k] / 1e12:.0f}" for k in ("dense", "paged_triton",
                                                              "paged_gathered")), flush=True)
            out["prefill"].append(row)
        del box
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "paged_prefill.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
