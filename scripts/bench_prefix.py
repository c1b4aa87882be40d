#!/usr/bin/env python
"""Benchmark of the shared-prefix (Hydragen) attention kernel.

Writes ``<out>.json`` and ``<out>.md``:
  * ceilings measured in the same run: copy bandwidth (read + write bytes / time,
    best of a few loops over 2 GiB) and the bf16 matmul rate (chained 8192^3
    ``jnp.dot``s);
  * the prefix kernel at B=64, one shared prefix of L=16384 tokens, K=8, G=4,
    D=128, bf16, T in {1, 5} (and P=4 groups of 16 sequences at T=1) against
    its roofline ``max(prefix K/V bytes / copy bw, 4 * B*T*H*L*D / matmul rate)``;
  * the non-shared path: ``decode_attention`` over per-sequence copies of the
    prefix (``[B, K, S, D]`` caches, the same L keys per query), and the jnp
    reference of the prefix attention under XLA;
  * one whole attention (prefix + a per-sequence suffix of ~256 tokens, merged)
    shared vs non-shared;
  * a budgeted sweep of block sizes per shape (``--budget`` seconds).

Timing: each candidate runs ``--inner`` times inside one jitted ``fori_loop``
(the prefix length changes with the loop index so nothing is hoisted); median
over ``--reps`` calls after a warm-up call.

Usage: python scripts/bench_prefix.py [--budget 90] [--out benchmarks/prefix_attention]
       python scripts/bench_prefix.py --smoke   # tiny shapes, interpret mode, any backend
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import decode_attention, merge_attention_states  # noqa: E402
from pallas_kernels.prefix_attention import (  # noqa: E402
    PrefixAttentionBlockSizes, _GPU_DEFAULTS, _plan, prefix_attention,
    prefix_attention_reference)

from benchutil import T0, log, timeit  # noqa: E402,F401


def ceilings(nbytes, inner, reps):
  """Copy bandwidth (TB/s, read + write) and bf16 matmul rate (TFLOP/s), by the wall clock and
  in GPU time (all the loop's kernels), from loops over a donated carry
  (``benchutil.carry_ceiling``: no copy of the input into the loop state first)."""
  from benchutil import carry_ceiling, copy_ceiling
  copy, copy_dev = copy_ceiling(nbytes, inner=inner, reps=reps)
  mm, mm_dev = {}, {}
  for n in (8192, 16384):
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(2), (n, n), jnp.float32) / math.sqrt(n)).astype(
        jnp.bfloat16)
    r = carry_ceiling(lambda i, c: (jnp.dot(c[0], c[1]), c[1]), (a, w),
                      inner=max(2, inner // 4), reps=reps)
    mm[f"bf16 {n}^3"] = 2 * n ** 3 / r["wall_s"] / 1e12
    if r["gpu_s"]:
      mm_dev[f"bf16 {n}^3"] = 2 * n ** 3 / r["gpu_s"] / 1e12
    del a, w
  out = {"bytes": int(nbytes), "copy_TBps": max(copy.values()), "copy_variants_TBps": copy,
         "matmul_TFLOPs": max(mm.values()), "matmul_variants_TFLOPs": mm}
  if copy_dev and mm_dev:  # for kernels timed the same way (benchutil.device_time)
    out.update(copy_TBps_device=max(copy_dev.values()), copy_variants_TBps_device=copy_dev,
               matmul_TFLOPs_device=max(mm_dev.values()), matmul_variants_TFLOPs_device=mm_dev)
  return out


def prefix_step(bs, interpret=False):
  def step(i, q, kp, vp, plen):
    o, l = prefix_attention(q, kp, vp, plen - (i % 2), block_sizes=bs,
                            interpret=interpret or None)
    return o[0, 0, 0, 0] + l[-1, -1, -1]
  return step


def prefix_ref_step(i, q, kp, vp, plen):
  o, l = prefix_attention_reference(q, kp, vp, plen - (i % 2))
  return o[0, 0, 0, 0] + l[-1, -1, -1]


def decode_step(interpret=False):
  def step(i, q, kc, vc, lengths):
    o, l = decode_attention(q, kc, vc, lengths - (i % 2), interpret=interpret or None)
    return o[0, 0, 0, 0] + l[-1, -1, -1]
  return step


def shared_full_step(bs, interpret=False):
  """Prefix kernel + decode over the per-sequence suffix + merge (Hydragen)."""
  def step(i, q, kp, vp, plen, ks, vs, slen):
    o1, l1 = prefix_attention(q, kp, vp, plen - (i % 2), block_sizes=bs,
                              interpret=interpret or None)
    o2, l2 = decode_attention(q, ks, vs, slen, interpret=interpret or None)
    o, l = merge_attention_states([o1, o2], [l1, l2])
    return o[0, 0, 0, 0] + l[-1, -1, -1]
  return step


def try_time(name, step, arrays, args, results, extra, roof=None):
  try:
    med, best, comp = timeit(step, arrays, inner=args.inner, reps=args.reps)
    rec = {"name": name, "time_us": med * 1e6, "best_us": best * 1e6, "compile_s": comp,
           **extra}
    msg = f"{name:70s} {med * 1e6:9.1f} us"
    if roof:
      rec["x_roofline"] = med / roof
      msg += f"  {med / roof:5.2f}x roofline"
    log(msg + f"  (compile {comp:.1f}s)")
  except Exception as e:  # record and go on
    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    rec = {"name": name, "error": msg, **extra}
    log(f"{name:70s} FAILED {msg}")
    if args.verbose:
      traceback.print_exc()
  results.append(rec)
  return rec


def bs_label(bs):
  if bs is None:
    return "default"
  d, default = dataclasses.asdict(bs), dataclasses.asdict(_GPU_DEFAULTS)
  return ",".join(f"{k}={v}" for k, v in d.items() if v != default[k]) or "default"


def tune_space():
  """Block-size deltas tried per shape, most promising first (first H200 sweep:
  block_q 64 / 4 warps and block_k 32 / 4 stages were close to the defaults;
  block_k 128, 2 stages and one split were clearly slower)."""
  return [dict(block_q=64, block_k=64, num_warps=4),
          dict(block_q=128, block_k=64, num_warps=4),
          dict(num_stages=4, block_k=32),
          dict(fast_exp=False),
          dict(block_q=64, block_k=32, num_warps=4, num_stages=4),
          dict(block_q=128, block_k=32, num_warps=4, num_stages=4),
          dict(target_programs=10 ** 6, min_split_size=1024),      # many splits
          dict(block_q=128, block_k=128, num_warps=8, num_stages=2),
          dict(split_size=1 << 20)]                                 # one split


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", default="benchmarks/prefix_attention")
  p.add_argument("--budget", type=float, default=90.0,
                 help="seconds for the block-size sweep (all shapes together)")
  p.add_argument("--inner", type=int, default=20)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--L", type=int, default=16384)
  p.add_argument("--B", type=int, default=64)
  p.add_argument("--K", type=int, default=8, help="KV heads")
  p.add_argument("--G", type=int, default=4, help="query heads per KV head")
  p.add_argument("--shapes", default="1x1,5x1,1x4", help="TxP shapes, comma-separated")
  p.add_argument("--splits", default="",
                 help="split counts to add to the sweep (num_splits=n), comma-separated")
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--verbose", action="store_true")
  args = p.parse_args()

  dev = jax.devices()[0]
  env = {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
         "num_sms": getattr(dev, "core_count", None), "jax": jax.__version__,
         "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
         "python": platform.python_version(),
         "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
  log("env", env)
  results = {"env": env, "ceiling": None, "main": [], "tune": []}

  B, K, G, D, L, S_suf = args.B, args.K, args.G, 128, args.L, 512
  interpret = False
  if args.smoke:
    B, K, G, D, L, S_suf = 4, 2, 2, 64, 256, 64
    args.inner, args.reps, args.budget = 2, 2, 0.0
    interpret = True
  else:
    results["ceiling"] = ceilings(2 << 30, args.inner, args.reps)
    c = results["ceiling"]
    log(f"copy {c['copy_TBps']:.3f} TB/s {c['copy_variants_TBps']}; "
        f"matmul {c['matmul_TFLOPs']:.0f} TFLOP/s {c['matmul_variants_TFLOPs']}")
  H = K * G
  dt = jnp.bfloat16
  keys = jax.random.split(jax.random.key(0), 8)
  # The non-shared path's per-sequence caches (prefix copies + a suffix): [B, K, L+S_suf, D].
  kc = jax.random.normal(keys[0], (B, K, L + S_suf, D), dt)
  vc = jax.random.normal(keys[1], (B, K, L + S_suf, D), dt)
  rng = np.random.default_rng(0)
  suf_len = jnp.asarray(rng.integers(S_suf // 4, S_suf * 3 // 4, size=B), jnp.int32)
  ks, vs = kc[:, :, :S_suf], vc[:, :, :S_suf]        # suffix caches of the shared path

  shapes = [tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(",")]  # (T, P)
  extra_space = [dict(num_splits=int(n)) for n in args.splits.split(",") if n]
  for T, P in shapes:
    deadline = time.time() + args.budget / len(shapes)
    q = jax.random.normal(keys[2 + T], (B, T, H, D), dt)
    kp = jax.random.normal(keys[6], (P, L, K, D), dt)
    vp = jax.random.normal(keys[7], (P, L, K, D), dt)
    plen = jnp.full((P,), L, jnp.int32)
    itemsize = 2
    prefix_bytes = 2 * P * L * K * D * itemsize + 2 * q.size * itemsize
    flops = 4 * B * T * H * L * D
    base = dict(B=B, T=T, P=P, K=K, G=G, D=D, L=L, prefix_bytes=prefix_bytes, flops=flops)
    roof = None
    if results["ceiling"]:
      c = results["ceiling"]
      t_mem = prefix_bytes / (c["copy_TBps"] * 1e12)
      t_fl = flops / (c["matmul_TFLOPs"] * 1e12)
      roof = max(t_mem, t_fl)
      base.update(roofline_us=roof * 1e6, roof_mem_us=t_mem * 1e6, roof_flops_us=t_fl * 1e6)
      log(f"T={T} P={P}: roofline {roof * 1e6:.1f} us (memory {t_mem * 1e6:.1f}, "
          f"flops {t_fl * 1e6:.1f})")
    tag = f"B={B} T={T} P={P} L={L}"
    plan = _plan(P, K, (B // P) * T * G, L, D, bs=_GPU_DEFAULTS, on_gpu=not interpret,
                 itemsize=2)
    rec = try_time(f"prefix kernel {tag} [default {plan[:4]}]", prefix_step(None, interpret),
                   (q, kp, vp, plen), args, results["main"],
                   dict(base, impl="prefix kernel (defaults)",
                        plan=dict(zip(("block_q", "block_k", "split", "splits"), plan))), roof)
    best = (rec.get("time_us", math.inf), None)
    for delta in extra_space + tune_space():
      if time.time() > deadline:
        break
      bs = dataclasses.replace(_GPU_DEFAULTS, **delta)
      r = try_time(f"  tune {tag} {bs_label(bs)}", prefix_step(bs, interpret),
                   (q, kp, vp, plen), args, results["tune"],
                   dict(base, block_sizes=dataclasses.asdict(bs)), roof)
      if r.get("time_us", math.inf) < best[0]:
        best = (r["time_us"], bs)
    if best[1] is not None:
      try_time(f"prefix kernel {tag} [best: {bs_label(best[1])}]", prefix_step(best[1], interpret),
               (q, kp, vp, plen), args, results["main"],
               dict(base, impl="prefix kernel (best of sweep)",
                    block_sizes=dataclasses.asdict(best[1])), roof)
    if P == 1:
      try_time(f"prefix jnp reference (XLA) {tag}", prefix_ref_step, (q, kp, vp, plen), args,
               results["main"], dict(base, impl="prefix jnp reference (XLA)"), roof)
      # Non-shared: every sequence reads its own copy of the prefix (L keys per query:
      # L - T context + the T new tokens under the causal mask).
      try_time(f"non-shared decode_attention {tag}", decode_step(interpret),
               (q, kc, vc, jnp.full((B,), L - T + 1, jnp.int32)), args, results["main"],
               dict(base, impl="non-shared decode_attention (per-sequence prefix copies)"), roof)
      # Whole attention: prefix + own suffix (~256 tokens), shared vs non-shared.
      full = dict(base, suffix_mean=float(np.mean(np.asarray(suf_len))))
      try_time(f"whole attention, shared (prefix kernel + suffix decode + merge) {tag}",
               shared_full_step(best[1], interpret), (q, kp, vp, plen, ks, vs, suf_len), args,
               results["main"], dict(full, impl="whole attention: shared"))
      try_time(f"whole attention, non-shared decode_attention {tag}", decode_step(interpret),
               (q, kc, vc, L + suf_len + 1), args, results["main"],
               dict(full, impl="whole attention: non-shared"))
    del q, kp, vp
    if not args.smoke:
      write_outputs(results, args.out)
  if args.smoke:
    bad = [r for r in results["main"] + results["tune"] if "error" in r]
    log("smoke done;", "FAILED: " + str(bad) if bad else "all ran")
    sys.exit(1 if bad else 0)


def write_outputs(results, out):
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  with open(out + ".json", "w") as f:
    json.dump(results, f, indent=1)
  env, c = results["env"], results["ceiling"]
  lines = ["# Shared-prefix (Hydragen) attention kernel", "",
           f"- device: {env['device']} ({env['num_sms']} SMs), jax {env['jax']}, "
           f"python {env['python']}",
           f"- command: `{env['command']}`",
           f"- ceilings measured in this run: copy {c['copy_TBps']:.3f} TB/s (read+write), "
           f"bf16 matmul {c['matmul_TFLOPs']:.0f} TFLOP/s",
           f"- K={results['main'][0]['K'] if results['main'] else '?'}, "
           f"G={results['main'][0]['G'] if results['main'] else '?'}, D=128, bf16; "
           "P groups share one prefix of L tokens each; "
           "roofline = max(prefix K/V + q/out bytes / copy bw, 4*B*T*H*L*D / matmul rate)",
           "- non-shared: `decode_attention` over per-sequence copies of the prefix "
           "([B, K, S, D] caches, L keys per query)",
           "- whole attention: + a per-sequence suffix (random 128..383 tokens); shared = "
           "prefix kernel + suffix decode_attention + merge", "",
           "| B | T | P | L | implementation | time (us) | roofline (us) | x roofline | "
           "speedup vs non-shared |", "|---|---|---|---|---|---|---|---|---|"]
  nonshared = {(r["T"], r["P"]): r["time_us"] for r in results["main"]
               if r.get("impl", "").startswith("non-shared") and "time_us" in r}
  whole_ns = {r["T"]: r["time_us"] for r in results["main"]
              if r.get("impl") == "whole attention: non-shared" and "time_us" in r}
  for r in results["main"]:
    head = f"| {r['B']} | {r['T']} | {r['P']} | {r['L']} | {r['impl']} |"
    if "error" in r:
      lines.append(f"{head} failed: {r['error'][:80]} | | | |")
      continue
    roof = r.get("roofline_us")
    xr = f"{r['x_roofline']:.2f}" if "x_roofline" in r and not r["impl"].startswith("whole") \
        else ""
    ns = whole_ns.get(r["T"]) if r["impl"].startswith("whole") else nonshared.get((r["T"], 1))
    sp = f"{ns / r['time_us']:.1f}x" if ns else ""
    roof_s = f"{roof:.1f}" if roof and not r["impl"].startswith("whole") else ""
    lines.append(f"{head} {r['time_us']:.1f} | {roof_s} | {xr} | {sp} |")
  if results["tune"]:
    lines += ["", "Block-size sweep (prefix kernel):", "",
              "| T | P | block sizes (vs defaults) | time (us) | x roofline |", "|---|---|---|---|---|"]
    for r in results["tune"]:
      bs = PrefixAttentionBlockSizes(**r["block_sizes"])
      t = f"{r['time_us']:.1f} | {r.get('x_roofline', float('nan')):.2f}" if "time_us" in r \
          else f"failed: {r['error'][:60]} |"
      lines.append(f"| {r['T']} | {r['P']} | {bs_label(bs)} | {t} |")
  with open(out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  log("wrote", out + ".{json,md}")


if __name__ == "__main__":
  main()
