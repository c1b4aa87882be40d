#!/usr/bin/env python
"""Checks and times the Hopper (Mosaic GPU, wgmma) attention kernel of pallas_kernels/hopper.py.

On an NVIDIA Hopper GPU, in one run:
  * correctness: ``hopper.rows_attention`` (both K/V layouts, ragged lengths incl. 0, NaN
    garbage past the lengths, several splits) and ``prefix_attention`` through it, against
    the plain-jnp references in float32;
  * ceilings: copy bandwidth and the bf16 matmul rate (``bench_prefix.ceilings``);
  * the shared-prefix shape of benchmarks/prefix_attention*.md (B=64, P=1, L=16384, K=8, G=4,
    D=128, bf16, T in {1, 5}; and P=4 at T=1): the Triton kernel, the Hopper kernel with
    its defaults and a sweep of (block_kv, stages, splits), and jax's own FlashAttention-3
    port (``jax.experimental.pallas.ops.gpu.attention_mgpu``, float16 only, no length
    masking; q folded into rows, key splits as its batch axis, no merge) as a peer;
  * T=64 verification of the decode shape (B=64, S=8192, K=8, G=4): context attention of the
    256 rows per (sequence, KV head) through the Hopper kernel in the cache layout, vs the
    Triton ``decode_attention`` (which also does the causal new-token part).

Writes ``<out>.json`` and ``<out>.md``. Usage:
  python scripts/bench_hopper.py [--out benchmarks/hopper_attention_h100] [--inner 20 --reps 5]
"""
import argparse
import json
import math
import os
import platform
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchutil import log, timeit  # noqa: E402

K, G, D = 8, 4, 128


def check(results):
  """Float32 references vs the kernel on random shapes; records max errors."""
  from pallas_kernels import hopper, prefix_attention, prefix_attention_reference
  rng = np.random.default_rng(0)
  ok = True
  for layout in ("PLKD", "BKSD"):
    for (N1, N2, R, L, bkv, st, sp) in ((3, 2, 128, 1000, 64, 2, 3), (2, 4, 256, 4096, 64, 3, None),
                                        (5, 1, 384, 704, 128, 2, 2)):
      lengths = rng.integers(1, L + 1, N1)
      lengths[0] = 0
      lengths[-1] = L
      q = jnp.asarray(rng.standard_normal((N1, N2, R, D)), jnp.bfloat16)
      shape = (N1, L, N2, D) if layout == "PLKD" else (N1, N2, L, D)
      k = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
      v = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
      pos = (np.arange(L)[None, :, None, None] if layout == "PLKD"
             else np.arange(L)[None, None, :, None])
      bad = jnp.asarray(pos >= lengths[:, None, None, None])
      kg, vg = jnp.where(bad, jnp.nan, k), jnp.where(bad, jnp.nan, v)
      o, lse = hopper.attention_with_tail(
          q, kg.astype(jnp.bfloat16), vg.astype(jnp.bfloat16), jnp.asarray(lengths, jnp.int32),
          kv_layout=layout, sm_scale=1 / math.sqrt(D),
          block_sizes=hopper.HopperBlockSizes(block_kv=bkv, stages=st, splits=sp),
          out_dtype=jnp.float32)
      kk = jnp.swapaxes(k, 1, 2) if layout == "PLKD" else k
      vv = jnp.swapaxes(v, 1, 2) if layout == "PLKD" else v
      s = jnp.einsum("abrd,absd->abrs", q.astype(jnp.float32), kk.astype(jnp.float32),
                     precision="highest") / math.sqrt(D)
      valid = jnp.arange(L)[None, None, None, :] < jnp.asarray(lengths)[:, None, None, None]
      s = jnp.where(valid, s, -jnp.inf)
      rl = jax.nn.logsumexp(s, -1)
      p = jnp.where(valid, jnp.exp(s - jnp.where(jnp.isfinite(rl), rl, 0)[..., None]), 0)
      ro = jnp.einsum("abrs,absd->abrd", p, vv.astype(jnp.float32), precision="highest")
      fin = jnp.isfinite(rl)
      e_o = float(jnp.max(jnp.abs(o - ro)))
      e_l = float(jnp.max(jnp.where(fin, jnp.abs(lse - rl), 0)))
      inf_ok = bool(jnp.all(fin == jnp.isfinite(lse))) and not bool(jnp.any(jnp.isnan(o)))
      good = e_o < 2e-2 and e_l < 1e-2 and inf_ok
      ok &= good
      results.append(dict(kind="check", what=f"rows_attention {layout} N1={N1} N2={N2} R={R} "
                          f"L={L} bkv={bkv} stages={st} splits={sp}",
                          max_err_out=e_o, max_err_lse=e_l, inf_ok=inf_ok, ok=good))
      log(results[-1])
  for (B, T, P, L, lens) in ((64, 1, 1, 5000, [5000]), (32, 5, 4, 3000, [3000, 0, 700, 129]),
                             (16, 3, 2, 600, [597, 40])):
    q = jnp.asarray(rng.standard_normal((B, T, K * G, D)), jnp.bfloat16)
    kp = jnp.asarray(rng.standard_normal((P, L, K, D)), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((P, L, K, D)), jnp.bfloat16)
    pl_ = jnp.asarray(lens, jnp.int32)
    o, l = prefix_attention(q, kp, vp, pl_, block_sizes=hopper.HopperBlockSizes())
    ro, rl = prefix_attention_reference(q.astype(jnp.float32), kp.astype(jnp.float32),
                                        vp.astype(jnp.float32), pl_)
    fin = jnp.isfinite(rl)
    e_o = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ro)))
    e_l = float(jnp.max(jnp.where(fin, jnp.abs(l - rl), 0)))
    good = e_o < 2e-2 and e_l < 1e-2 and bool(jnp.all(fin == jnp.isfinite(l)))
    ok &= good
    results.append(dict(kind="check", what=f"prefix_attention hopper B={B} T={T} P={P} L={L} "
                        f"lengths={lens}", max_err_out=e_o, max_err_lse=e_l, ok=good))
    log(results[-1])
  return ok


def bench(results, ceil, inner, reps):
  from jax.experimental.pallas.ops.gpu import attention_mgpu as am
  from pallas_kernels import decode_attention, hopper, prefix_attention
  mm, bw = ceil["matmul_TFLOPs"], ceil["copy_TBps"]

  def record(shape, name, step, arrays, flops, nbytes):
    try:
      sec = timeit(step, arrays, inner=inner, reps=reps)[0]
    except Exception as e:  # noqa: BLE001
      log(f"{shape} {name} FAILED {type(e).__name__}: {str(e)[:400]}")
      results.append(dict(kind="time", shape=shape, impl=name, error=f"{type(e).__name__}"))
      return
    roof = max(flops / mm / 1e12, nbytes / bw / 1e12)
    r = dict(kind="time", shape=shape, impl=name, us=sec * 1e6, TFLOPs=flops / sec / 1e12,
             roof_us=roof * 1e6, x_roof=sec / roof)
    results.append(r)
    log(f"{shape:32s} {name:52s} {r['us']:8.1f} us {r['TFLOPs']:6.0f} TFLOP/s "
        f"x roof {r['x_roof']:5.2f}")

  ks = jax.random.split(jax.random.key(0), 3)
  B, L = 64, 16384
  for T, P in ((1, 1), (5, 1), (1, 4)):
    shape = f"prefix B={B} T={T} P={P} L={L}"
    q = jax.random.normal(ks[0], (B, T, K * G, D), jnp.bfloat16)
    kp = jax.random.normal(ks[1], (P, L, K, D), jnp.bfloat16)
    vp = jax.random.normal(ks[2], (P, L, K, D), jnp.bfloat16)
    plen = jnp.full((P,), L, jnp.int32)
    flops, nbytes = 4 * B * T * K * G * L * D, 2 * P * L * K * D * 2

    def pstep(bs):
      def step(i, q, kp, vp, plen):
        o, l = prefix_attention(q, kp, vp, plen - (i % 2), block_sizes=bs)
        return o[0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]
      return step
    from pallas_kernels.prefix_attention import _GPU_DEFAULTS
    record(shape, "triton prefix kernel", pstep(_GPU_DEFAULTS), (q, kp, vp, plen), flops, nbytes)
    for bkv, st, sp in ((128, 2, None), (64, 2, None), (64, 4, None),
                        (128, 2, 4), (128, 2, 8), (128, 2, 16), (64, 3, 8)):
      hb = hopper.HopperBlockSizes(block_kv=bkv, stages=st, splits=sp)
      record(shape, f"hopper bkv={bkv} stages={st} splits={sp or 'auto'}", pstep(hb),
             (q, kp, vp, plen), flops, nbytes)
    R = (B // P) * T * G
    kp16, vp16 = kp.astype(jnp.float16), vp.astype(jnp.float16)
    for ns in (8, 16):
      cfg = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2)

      def mg(i, q, kp, vp, ns=ns, cfg=cfg):
        qr = (q * (1 / math.sqrt(D))).reshape(P, B // P, T, K, G, D).transpose(0, 1, 2, 4, 3, 5)
        qr = jnp.broadcast_to(qr.reshape(P, 1, R, K, D), (P, ns, R, K, D)).reshape(P * ns, R, K, D)
        o, (lse,) = am.attention(qr.astype(jnp.float16), kp.reshape(P * ns, L // ns, K, D),
                                 vp.reshape(P * ns, L // ns, K, D), cfg, save_residuals=True)
        return o[0, 0, 0, 0].astype(jnp.float32) + lse[-1, -1, -1]
      if R % 128 == 0:
        record(shape, f"jax attention_mgpu f16 splits={ns} (no merge)", mg, (q, kp16, vp16),
               flops, nbytes)
    del kp, vp, kp16, vp16

  B, T, S = 64, 64, 8192
  shape = f"verify B={B} T={T} S={S}"
  rng = np.random.default_rng(1)
  lengths = jnp.asarray(rng.integers(S // 2, S - T + 1, B), jnp.int32)
  q = jax.random.normal(ks[0], (B, T, K * G, D), jnp.bfloat16)
  kc = jax.random.normal(ks[1], (B, K, S, D), jnp.bfloat16)
  vc = jax.random.normal(ks[2], (B, K, S, D), jnp.bfloat16)
  ctx = float(jnp.sum(lengths))
  flops, nbytes = 4 * T * K * G * D * ctx, 2 * K * D * 2 * ctx

  def dec(i, q, kc, vc, lengths):
    o, l = decode_attention(q, kc, vc, lengths - (i % 2))
    return o[0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]
  record(shape, "triton decode_attention (context + new tokens)", dec, (q, kc, vc, lengths),
         flops, nbytes)
  for bkv, st in ((128, 2), (64, 2), (64, 4)):
    hb = hopper.HopperBlockSizes(block_kv=bkv, stages=st)

    def hs(i, q, kc, vc, lengths, hb=hb):
      qr = q.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, D)
      o, l2 = hopper.attention_with_tail(qr, kc, vc, lengths - (i % 2), kv_layout="BKSD",
                                         sm_scale=1 / math.sqrt(D), block_sizes=hb)
      return o[0, 0, 0, 0].astype(jnp.float32) + l2[-1, -1, -1]
    record(shape, f"hopper attention_with_tail, context only, bkv={bkv} stages={st}", hs,
           (q, kc, vc, lengths), flops, nbytes)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="benchmarks/hopper_attention_h100")
  ap.add_argument("--inner", type=int, default=20)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--skip-check", action="store_true")
  ap.add_argument("--check-only", action="store_true")
  a = ap.parse_args()
  from bench_prefix import ceilings
  dev = jax.devices()[0]
  env = dict(device=dev.device_kind, jax=jax.__version__, python=platform.python_version(),
             command="python3 " + " ".join(sys.argv))
  log(env)
  results = []
  ok = True
  if not a.skip_check:
    try:
      ok = check(results)
    except Exception:  # noqa: BLE001
      traceback.print_exc()
      ok = False
  if a.check_only:
    log("checks", "pass" if ok else "FAILED")
    sys.exit(0 if ok else 1)
  ceil = ceilings(1 << 30, 10, 3)
  log(f"copy {ceil['copy_TBps']:.3f} TB/s, matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s")
  bench(results, ceil, a.inner, a.reps)
  with open(a.out + ".json", "w") as f:
    json.dump(dict(env=env, ceilings=ceil, checks_ok=ok, results=results), f, indent=1)
  lines = [f"# Hopper (Mosaic GPU) attention kernel\n",
           f"- device: {env['device']}, jax {env['jax']}, python {env['python']}",
           f"- command: `{env['command']}`",
           f"- ceilings in this run: copy {ceil['copy_TBps']:.3f} TB/s, bf16 matmul "
           f"{ceil['matmul_TFLOPs']:.0f} TFLOP/s; roofline = max(FLOPs / matmul, K/V bytes / copy)",
           f"- correctness checks (float32 references, NaN garbage past lengths): "
           f"{'all pass' if ok else 'FAILED'}\n",
           "| shape | implementation | time (us) | TFLOP/s | x roofline |", "|---|---|---|---|---|"]
  for r in results:
    if r["kind"] == "time" and "us" in r:
      lines.append(f"| {r['shape']} | {r['impl']} | {r['us']:.1f} | {r['TFLOPs']:.0f} | "
                   f"{r['x_roof']:.2f} |")
  lines += ["", "| check | max err out | max err lse | ok |", "|---|---|---|---|"]
  for r in results:
    if r["kind"] == "check":
      lines.append(f"| {r['what']} | {r['max_err_out']:.2e} | {r['max_err_lse']:.2e} | {r['ok']} |")
  with open(a.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  log("wrote", a.out)
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  main()
