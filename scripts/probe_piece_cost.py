#!/usr/bin/env python
"""What a prompt piece adds to a decode round (diagnostic: internal entry points, not what users
get). A paged pool holds ``--batch`` rows decoding at ``--context`` tokens each and one row being
filled; for each piece size (``--pieces``) and offset of the piece in its prompt (``--offsets``)
it times, median of 15 after warm-up: the plain forward of the decoding rows
(`jaxspec.model.forward`), the same forward with the piece in it (`jaxspec.model.forward_mixed`,
what a mixed round runs), the piece prefilled alone (`jaxspec.prefill.prefill_paged_row`'s
chunk), the piece's attention alone over all layers, and the matrix products alone at the
decoding rows vs those rows plus the piece's; then again with the piece's attention forced onto
the gathered Hopper route (``pallas_kernels.dispatch``). Last, with ``--profile``, the GPU
kernels of one plain and one mixed forward (piece 256 at offset 16384), summed by name from a
`jax.profiler` trace. Results: printed, and ``<out>/piece_cost.json``."""
import argparse
import collections
import functools
import glob
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels.dispatch as dsp
from jaxspec.attention import AttentionPlan, attend, plan_for
from jaxspec.bench import load_model
from jaxspec.model import forward, forward_mixed
from jaxspec.paged import PagedKVCache
from jaxspec.prefill import _prefill_paged_chunk
from jaxspec.sharding import decode_params

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--model", default="random-qwen15")
p.add_argument("--batch", type=int, default=64, help="rows decoding")
p.add_argument("--context", type=int, default=4096, help="their context (tokens)")
p.add_argument("--pieces", default="64,128,256,512,2048", help="piece sizes (tokens)")
p.add_argument("--offsets", default="0,8192,16384,30720", help="piece offsets in the prompt")
p.add_argument("--max-len", type=int, default=32768 + 2048, help="slots of the filled row")
p.add_argument("--profile", action="store_true")
p.add_argument("--out", default=".")
args = p.parse_args()
OUT, B, LD = args.out, args.batch, args.context
CS = [int(x) for x in args.pieces.split(",")]
OFFS = [int(x) for x in args.offsets.split(",")]
BS = 16
MB = args.max_len // BS
model = load_model(args.model)
params = decode_params(model, layout="unrolled")
cfg = model.config
HD, NH, FF = cfg.num_heads * cfg.head_dim, cfg.num_heads, cfg.intermediate_size
DM = cfg.hidden_size
rng = np.random.default_rng(0)
R = B + 1  # row B is the one being filled
NB = B * (LD // BS + 8) + MB + 64
perm = rng.permutation(NB).astype(np.int32)
table = np.full((R, MB), NB, np.int32)
for r in range(B):
    n = LD // BS + 8
    table[r, :n] = perm[r * n:(r + 1) * n]
table[B, :MB] = perm[B * (LD // BS + 8):B * (LD // BS + 8) + MB]
cache = PagedKVCache.create(cfg, R, NB, BS, MB)
k = jax.random.normal(jax.random.PRNGKey(1), cache.k.shape, cache.k.dtype) * 0.5
cache = cache.replace(k=k, v=k * 0.7, block_table=jnp.asarray(table),
                      lengths=jnp.asarray([LD] * B + [0], jnp.int32))
del k
active = jnp.asarray([True] * B + [False])
tokens = jnp.asarray(rng.integers(100, 1000, (R, 1)).astype(np.int32))


def timeit(f, n=15):
    f(); jax.block_until_ready(f())
    ts = []
    for _ in range(n):
        t = time.perf_counter(); jax.block_until_ready(f()); ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


@functools.partial(jax.jit, donate_argnums=(1,))
def plain(params, cache, tokens):
    plan = plan_for(cache, cache.lengths, impl="auto", active=active)
    logits, c = forward(cfg, params, tokens, cache.lengths[:, None], cache, plan)
    return logits, c.replace(lengths=c.lengths.at[:B].set(LD))


@functools.partial(jax.jit, donate_argnums=(1,))
def mixed(params, cache, tokens, tok, start):
    plan = plan_for(cache, cache.lengths, impl="auto", active=active)
    C = tok.shape[1]
    tab = jax.lax.dynamic_slice_in_dim(cache.block_table, B, 1, axis=0)
    pplan = AttentionPlan(lengths=start[None], impl="auto", block_table=tab)
    ppos = start + jnp.arange(C, dtype=jnp.int32)[None]
    (logits, _), c = forward_mixed(cfg, params, [(tokens, cache.lengths[:, None], plan, None),
                                                 (tok, ppos, pplan, False)], cache)
    return logits, c.replace(lengths=c.lengths.at[:B].set(LD))


@functools.partial(jax.jit, donate_argnums=(1,))
def piece_prefill(params, cache, tok, start):
    return _prefill_paged_chunk(params, cache, jnp.int32(B), tok, start, start + tok.shape[1],
                                config=cfg, impl="auto")


def _all_layers(q, cache, plan):
    """Attention of ``q`` by ``plan`` in every layer (one element of each kept)."""
    o = 0.
    for layer in range(cfg.num_layers):
        o = o + attend(q, cache.k, cache.v, jnp.int32(layer), plan)[0, 0, 0, 0].astype(jnp.float32)
    return o


@jax.jit
def piece_attn(q, cache, start):
    tab = jax.lax.dynamic_slice_in_dim(cache.block_table, B, 1, axis=0)
    return _all_layers(q, cache, AttentionPlan(lengths=start[None], impl="auto", block_table=tab))


@jax.jit
def decode_attn(q, cache):
    return _all_layers(q, cache, plan_for(cache, cache.lengths, impl="auto", active=active))


@jax.jit
def gemms(params, x):
    o = 0.
    for p in params["layers"]:
        a = x @ p["wqkv"]
        b = a[:, :HD] @ p["wo"]
        g = b @ p["w_gateup"]
        d = g[:, :FF] @ p["w_down"]
        o = o + d[0, 0].astype(jnp.float32)
    return o


res = {"B": B, "LD": LD, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": []}
st = {"cache": cache}


def run_plain():
    lg, st["cache"] = plain(params, st["cache"], tokens); return lg


t_plain = timeit(run_plain)
q1 = jax.random.normal(jax.random.PRNGKey(3), (R, 1, NH, cfg.head_dim), jnp.bfloat16)
t_dattn = timeit(lambda: decode_attn(q1, st["cache"]))
t_g0 = timeit(lambda: gemms(params, jnp.ones((R, DM), jnp.bfloat16)))
print(f"plain forward {t_plain:.3f} ms | decode attention alone (all layers) {t_dattn:.3f} | GEMMs M={R} {t_g0:.3f}", flush=True)
res.update(plain_ms=t_plain, decode_attn_ms=t_dattn, gemm_ms_base=t_g0)
toks = {C: jnp.asarray(rng.integers(100, 1000, (1, C)).astype(np.int32)) for C in CS}
qs = {C: jax.random.normal(jax.random.PRNGKey(4), (1, C, NH, cfg.head_dim), jnp.bfloat16) for C in CS}
for route in ("triton", "gathered"):
    if route == "gathered":
        dsp.PAGED_HOPPER_MIN_ROWS, dsp.PAGED_HOPPER_MAX_SLOTS_PER_TOKEN = 0, 1 << 30
        jax.clear_caches()
    for C in CS:
        tok, qC = toks[C], qs[C]
        t_g = timeit(lambda: gemms(params, jnp.ones((R + C, DM), jnp.bfloat16))) if route == "triton" else None
        for off in OFFS:
            s = jnp.int32(off)

            def run_mixed():
                lg, st["cache"] = mixed(params, st["cache"], tokens, tok, s); return lg

            def run_piece():
                st["cache"] = piece_prefill(params, st["cache"], tok, s); return st["cache"].lengths

            try:  # (the gathered pass times the attention alone: the route is global, so
                # the decoding rows of a mixed forward would take it too)
                t_mixed = timeit(run_mixed) if route == "triton" else None
                t_piece = timeit(run_piece) if route == "triton" else None
                t_pa = timeit(lambda: piece_attn(qC, st["cache"], s))
            except Exception as e:  # noqa
                print(route, C, off, "failed", repr(e)[:300], flush=True); continue
            fl_attn = 4 * C * cfg.num_layers * HD * (off + C / 2)
            row = dict(route=route, C=C, off=off, piece_attn=t_pa,
                       attn_tflops=fl_attn / t_pa / 1e9)
            if t_mixed is not None:
                row.update(mixed=t_mixed, extra=t_mixed - t_plain, piece_alone=t_piece)
            if t_g is not None:
                row["gemm_extra"] = t_g - t_g0
            res["rows"].append(row)
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
dsp.PAGED_HOPPER_MIN_ROWS, dsp.PAGED_HOPPER_MAX_SLOTS_PER_TOKEN = 2048, 16
jax.clear_caches()
os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "piece_cost.json"), "w") as f:
    json.dump(res, f, indent=1)

# profile: plain and mixed C=256 off=16384
if args.profile:
    tok = jnp.asarray(rng.integers(100, 1000, (1, 256)).astype(np.int32))
    s = jnp.int32(16384)
    for name, fn in (("plain", run_plain),
                     ("mixed256", lambda: mixed(params, st["cache"], tokens, tok, s))):
        if name == "mixed256":
            def fn():
                lg, st["cache"] = mixed(params, st["cache"], tokens, tok, s); return lg
        fn(); jax.block_until_ready(fn())
        d = f"/tmp/prof_{name}"
        with jax.profiler.trace(d):
            for _ in range(5):
                jax.block_until_ready(fn())
        pb = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1]
        pdata = jax.profiler.ProfileData.from_file(pb)
        agg = collections.Counter(); cnt = collections.Counter()
        for pl in pdata.planes:
            if not pl.name.startswith("/device:GPU"):
                continue
            lines = list(pl.lines)
            print("  lines:", [(l.name, sum(1 for _ in l.events)) for l in lines][:10])
            ops = [l for l in lines if "XLA Ops" in l.name] or [l for l in lines if "Stream" in l.name]
            for line in ops:
                for e in line.events:
                    nm = e.name
                    agg[nm] += e.duration_ns / 5e6; cnt[nm] += 1
        tot = sum(agg.values())
        print(f"== profile {name}: XLA ops total {tot:.3f} ms per forward", flush=True)
        groups = collections.Counter()
        for nm, v in agg.items():
            key = nm.split(".")[0].rstrip("0123456789_")
            groups[key] += v
        for nm, v in groups.most_common(12):
            print(f"   group {nm:40s} {v:.3f} ms")
        for nm, v in agg.most_common(25):
            print(f"   {nm[:70]:70s} {v:.3f} ms x{cnt[nm] // 5}")
