#!/usr/bin/env python
"""The batch-invariant kernels against the default path at Qwen2.5-1.5B's shapes, with bitwise
checks of each tiling on the device.

* matmul: ``invariant_matmul`` (each tiling given by ``--mm``) vs ``jnp.dot`` for the model's
  projections (q|k|v 1536x2048, o 1536x1536, gate|up 1536x17920, down 8960x1536, the tied LM
  head 151936x1536), M = 64 and 320 (decode, verify of 5) and 4096 / 32768 (prefill rows). Each
  timing runs the product over 28 distinct weight arrays (as the model's layers do: the weights
  come from HBM, not L2) in one jitted call; the median of ``--reps`` calls over 28.
* attention: `jaxspec.invariant` attention tiles (each tiling given by ``--attn``) vs the
  default kernel (`jaxspec.attention.attend`, impl "auto"), B = 64, KV heads 2, G = 6, D = 128,
  context ``--ctx`` (lengths random in the last 256 below it), T = 1 and 5, and a prefill chunk
  of 512 tokens at ``--ctx / 2``; each over 4 layers of one cache in one call.
* bitwise: for each tiling, a matmul row alone vs inside M = 64 / 320 / 4096 rows and split vs
  fold; attention verify (T = 5) vs five one-token steps, split vs fold, a row alone in a
  smaller cache vs in the batch.

Tilings: ``--mm "bm,bn,bk,warps,stages,split_programs,min_part;..."``, ``--attn
"rows,block_k,chunk,warps,stages,fold_tiles,split_tiles,unmasked_interior,fast_exp;..."`` (the fields of `InvariantMatmulBlocks` and
`InvariantAttentionBlocks` in order; trailing ones may be left out).

Usage: python scripts/bench_invariant.py [--quick] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxspec import invariant  # noqa: E402
from jaxspec.attention import AttentionPlan, attend  # noqa: E402
from pallas_kernels.invariant_attention import InvariantAttentionBlocks  # noqa: E402
from pallas_kernels.invariant_matmul import InvariantMatmulBlocks, invariant_matmul  # noqa: E402

BF16 = jnp.bfloat16
LAYERS = 28
BATCH = 64
SHAPES = {"qkv": (1536, 2048, False), "o": (1536, 1536, False), "gateup": (1536, 17920, False),
          "down": (8960, 1536, False), "head": (1536, 151936, True)}
T0 = time.time()
BUDGET = [1e9]  # seconds after which timings are skipped
MODES = [("fold", "split")]  # attention: the modes timed for decode and verification
ROUNDS = [1]  # attention: rounds over all the variants (the median of the rounds reported)


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def median_time(fn, args, reps):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def parse_mm(s):
    out = []
    for part in s.split(";"):
        out.append(InvariantMatmulBlocks(*(int(v) for v in part.split(","))))
    return out


def parse_attn(s):
    out = []
    for part in s.split(";"):
        out.append(InvariantAttentionBlocks(*(int(v) for v in part.split(","))))
    return out


def mm_fn(kind, bs=None, mode="auto", nk=False):
    def one(x, w):
        if kind == "dot":
            return jnp.dot(x, w.T if nk else w, preferred_element_type=jnp.float32).astype(BF16)
        return invariant_matmul(x, w, block_sizes=bs, mode=mode, transpose_w=nk)

    @jax.jit
    def run(x, ws):
        acc = jnp.float32(0)
        for w in ws:
            acc = acc + jax.lax.optimization_barrier(one(x, w))[0, 0].astype(jnp.float32)
        return acc
    return run


def bench_matmul(cfgs, Ms, names, reps, results):
    rng = np.random.default_rng(0)
    for name in names:
        K, N, nk = SHAPES[name]
        n_w = 2 if name == "head" else LAYERS if max(Ms) <= 320 else 4
        ws = tuple(jnp.asarray(rng.normal(size=(N, K) if nk else (K, N)) / np.sqrt(K), BF16)
                   for _ in range(n_w))
        for M in Ms:
            if name == "head" and M > 320:
                continue
            x = jnp.asarray(rng.normal(size=(M, K)), BF16)
            row = {"op": "matmul", "shape": name, "M": M, "K": K, "N": N}
            try:
                row["dot_us"] = median_time(mm_fn("dot", nk=nk), (x, ws), reps) / n_w * 1e6
            except Exception as e:  # noqa: BLE001
                row["dot_err"] = repr(e)[:200]
            for i, bs in enumerate(cfgs):
                modes = ("fold", "split") if M <= 320 and bs.split_programs else ("auto",)
                for mode in modes:
                    if time.time() - T0 > BUDGET[0]:
                        continue
                    key = f"mm{i}_{mode}"
                    try:
                        row[key + "_us"] = median_time(mm_fn("inv", bs, mode, nk), (x, ws),
                                                       reps) / n_w * 1e6
                    except Exception as e:  # noqa: BLE001
                        row[key + "_err"] = repr(e)[:300]
            results.append(row)
            log(json.dumps(row))
            del x
        del ws


def check_matmul_bits(cfgs, results):
    rng = np.random.default_rng(1)
    for i, bs in cfgs.items():
        if time.time() - T0 > BUDGET[0] + 60:
            break
        for name in ("down", "head"):
            K, N, nk = SHAPES[name]
            w = jnp.asarray(rng.normal(size=(N, K) if nk else (K, N)) / np.sqrt(K), BF16)
            row1 = jnp.asarray(rng.normal(size=(1, K)), BF16)
            f = lambda x, mode="auto": np.asarray(invariant_matmul(  # noqa: E731
                x, w, out_dtype=jnp.float32, block_sizes=bs, transpose_w=nk, mode=mode))
            ref = f(row1)[0]
            ok = True
            for M in (64, 320, 4096) if name != "head" else (64, 320):
                X = jnp.asarray(rng.normal(size=(M, K)), BF16)
                for pos in (0, M - 1):
                    Xp = X.at[pos].set(row1[0])
                    for mode in ("fold", "split"):
                        ok &= bool(np.array_equal(f(Xp, mode)[pos], ref))
            rel = None
            X = jnp.asarray(rng.normal(size=(64, K)), BF16)
            got = f(X).astype(np.float64)
            r64 = np.asarray(X, np.float64) @ (np.asarray(w, np.float64).T if nk
                                                else np.asarray(w, np.float64))
            rel = float(np.linalg.norm(got - r64) / np.linalg.norm(r64))
            res = {"op": "matmul-bits", "cfg": i, "shape": name, "bitwise": ok, "rel_err": rel}
            results.append(res)
            log(json.dumps(res))


def attn_inputs(B, ctx, S, n_layers=4, seed=0):
    rng = np.random.default_rng(seed)
    key = jax.random.key(seed)
    k1, k2 = jax.random.split(key)
    k = jax.random.normal(k1, (n_layers, B, 2, S, 128), BF16)
    v = jax.random.normal(k2, (n_layers, B, 2, S, 128), BF16)
    L = jnp.asarray(rng.integers(ctx - 256, ctx - 8, size=B), jnp.int32)
    return k, v, L


def attn_fn(kind, T, bs=None, mode="auto", n_layers=4):
    def one(q, k, v, L, layer):
        if kind == "default":
            return attend(q, k, v, layer, AttentionPlan(lengths=L, impl="auto"))
        return invariant._attention_tiles(q, k, v, layer, L, None, num_new=T, sm_scale=None,
                                          sliding_window=None, interpret=False, blocks=bs,
                                          mode=mode)

    @jax.jit
    def run(q, k, v, L):
        acc = jnp.float32(0)
        for layer in range(n_layers):
            o = jax.lax.optimization_barrier(one(q, k, v, L, jnp.int32(layer)))
            acc = acc + o[0, 0, 0, 0].astype(jnp.float32)
        return acc
    return run


def bench_attention(cfgs, ctx, reps, results, cases=("decode", "verify5", "prefill512")):
    B, S = BATCH, ctx + 256
    k, v, L = attn_inputs(B, ctx, S)
    cases = [c for c in [("decode", 1, L), ("verify5", 5, L),
                         ("prefill512", 512, jnp.full((B,), ctx // 2, jnp.int32))]
             if c[0] in cases]
    for name, T, Lc in cases:
        q = jax.random.normal(jax.random.key(T), (B, T, 12, 128), BF16)
        kv_bytes = float(np.sum(np.asarray(Lc) + T)) * 2 * 2 * 128 * 2  # K and V, 2 heads
        row = {"op": "attention", "case": name, "B": B, "ctx": ctx, "T": T,
               "kv_GB_per_layer": kv_bytes / 1e9}
        fns = {"default": attn_fn("default", T)}
        for i, bs in enumerate(cfgs):
            for mode in ("auto",) if T > 5 else MODES[0]:
                fns[f"at{i}_{mode}"] = attn_fn("inv", T, bs, mode)
        times = {}
        for _ in range(ROUNDS[0]):  # rounds over every variant in turn: drifts hit them all
            for key, fn in fns.items():
                if (key in times and times[key] is None) or (
                        key != "default" and time.time() - T0 > BUDGET[0]):
                    continue
                try:
                    times.setdefault(key, []).append(
                        median_time(fn, (q, k, v, Lc), reps) / 4 * 1e6)
                except Exception as e:  # noqa: BLE001
                    row[key + "_err"] = repr(e)[:300]
                    times[key] = None
        for key, ts in times.items():
            if ts:
                row[key + "_us"] = statistics.median(ts)
                if len(ts) > 1:
                    row[key + "_us_rounds"] = [round(t, 1) for t in ts]
        results.append(row)
        log(json.dumps(row))
    del k, v


def check_attention_bits(cfgs, results, ctx=5000):
    """Per tiling: verify of 5 vs five steps (split and fold), split == fold, a row alone in a
    cache of its own capacity vs in the batch."""
    B, T = 6, 5
    S = ctx + 64
    k, v, L = attn_inputs(B, ctx, S, n_layers=1, seed=3)
    L = L - 40
    q = jax.random.normal(jax.random.key(5), (B, T, 12, 128), BF16)
    for i, bs in cfgs.items():
        if time.time() - T0 > BUDGET[0] + 60:
            break
        def run(q, k, v, L, mode, T=T):
            return np.asarray(invariant._attention_tiles(
                q, k, v, 0, L, None, num_new=T, sm_scale=None, sliding_window=None,
                interpret=False, blocks=bs, mode=mode), np.float32)
        try:
            ver = {m: run(q, k, v, L, m) for m in ("fold", "split")}
            steps = {m: np.stack([run(q[:, t:t + 1], k, v, L + t, m, T=1)[:, 0]
                                  for t in range(T)], 1) for m in ("fold", "split")}
            # a prefill of 24 tokens at once (tiles folded in groups) vs in chunks of 8
            T2 = 24
            q2 = jax.random.normal(jax.random.key(6), (B, T2, 12, 128), BF16)
            whole = run(q2, k, v, L, "auto", T=T2)
            chunks = np.concatenate([run(q2[:, j:j + 8], k, v, L + j, "auto", T=8)
                                     for j in range(0, T2, 8)], 1)
            b = 2
            S2 = int(L[b]) + T + 3
            alone = run(q[b:b + 1], k[:, b:b + 1, :, :S2], v[:, b:b + 1, :, :S2], L[b:b + 1],
                        "split")[0]
            res = {"op": "attention-bits", "cfg": i,
                   "split==fold": bool(np.array_equal(ver["fold"], ver["split"])),
                   "verify==steps": bool(all(np.array_equal(ver[a], steps[c])
                                             for a in ver for c in steps)),
                   "alone==batch": bool(np.array_equal(alone, ver["fold"][b])),
                   "prefill chunks==whole": bool(np.array_equal(whole, chunks))}
        except Exception as e:  # noqa: BLE001
            res = {"op": "attention-bits", "cfg": i, "err": repr(e)[:300]}
            traceback.print_exc()
        results.append(res)
        log(json.dumps(res))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mm", default="16,64,64,4,3,0;64,128,64,4,4,264,8")
    ap.add_argument("--attn", default="16,64,1048576,4,2,1;16,64,2048,4,2,4")
    ap.add_argument("--ctx", default="16384")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--skip", default="", help="comma-separated: mm,attn,bits")
    ap.add_argument("--mm-shapes", default="qkv,o,gateup,down,head")
    ap.add_argument("--mm-M", default="64,320,4096,32768")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=1, help="attention: time every variant in "
                    "turn this many times, report the median")
    ap.add_argument("--attn-cases", default="decode,verify5,prefill512")
    ap.add_argument("--attn-modes", default="fold,split", help="modes timed at T <= 5")
    ap.add_argument("--budget", type=float, default=1e9, help="skip timings after this many s")
    a = ap.parse_args()
    skip = set(a.skip.split(","))
    BUDGET[0] = a.budget
    ROUNDS[0] = a.rounds
    MODES[0] = tuple(a.attn_modes.split(","))
    mm_cfgs, at_cfgs = parse_mm(a.mm), parse_attn(a.attn)
    log("jax", jax.__version__, jax.devices()[0].device_kind)
    for i, c in enumerate(mm_cfgs):
        log(f"mm{i}", c)
    for i, c in enumerate(at_cfgs):
        log(f"at{i}", c)
    results = []
    first = min(1, len(mm_cfgs) - 1), min(1, len(at_cfgs) - 1)  # the candidates: bits first
    if "bits" not in skip:
        check_matmul_bits({first[0]: mm_cfgs[first[0]]}, results)
        check_attention_bits({first[1]: at_cfgs[first[1]]}, results)
    if "attn" not in skip:
        for ctx in (int(c) for c in a.ctx.split(",")):
            bench_attention(at_cfgs, ctx, a.reps, results, cases=a.attn_cases.split(","))
    if "mm" not in skip:
        Ms = [int(m) for m in a.mm_M.split(",")]
        bench_matmul(mm_cfgs, [m for m in Ms if m <= 320], a.mm_shapes.split(","), a.reps,
                     results)
        bench_matmul(mm_cfgs, [m for m in Ms if m > 320], a.mm_shapes.split(","), a.reps,
                     results)
    if "bits" not in skip:  # the other tilings, while the budget lasts
        check_matmul_bits({i: c for i, c in enumerate(mm_cfgs) if i != first[0]}, results)
        check_attention_bits({i: c for i, c in enumerate(at_cfgs) if i != first[1]}, results)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                       "mm": [str(c) for c in mm_cfgs], "attn": [str(c) for c in at_cfgs],
                       "results": results}, f, indent=1)
    # summary
    for r in results:
        if r["op"] == "matmul":
            base = r.get("dot_us")
            cols = " ".join(f"{k[:-3]}={v:.1f}" + (f"({v / base:.2f}x)" if base else "")
                            for k, v in r.items() if k.startswith("mm") and k.endswith("_us"))
            print(f"MM {r['shape']:6s} M={r['M']:5d} dot={base and round(base, 1)}us {cols}")
        elif r["op"] == "attention":
            base = r.get("default_us")
            cols = " ".join(f"{k[:-3]}={v:.0f}" + (f"({v / base:.2f}x)" if base else "")
                            for k, v in r.items() if k.startswith("at") and k.endswith("_us"))
            print(f"AT {r['case']:10s} ctx={r['ctx']} default={base and round(base)}us {cols}")
        else:
            print("BITS", json.dumps(r))


if __name__ == "__main__":
    main()
