#!/usr/bin/env python
"""Probe: the Hopper kernel's schedule variants (ping-pong, 64 / 128 rows per warpgroup) against
the Triton kernels and jax's FlashAttention-3 port, at the two shapes issues 4 and 6 miss.

  * verify: B=64, T=64, S=8192 (lengths in [S/2, S-T]), K=8, G=4, D=128, bf16: the 256 query
    rows of each (sequence, KV head) against its context;
  * prefix: B=64, P=1, L=16384, T in {1, 5}.

First checks every variant against float32 jnp on small ragged shapes with NaN garbage, then
times (median of reps after warm-up, looped on device). Writes ``<out>.json``.
Usage: python scripts/probe_hopper_v2.py --out /tmp/probe [--inner 10 --reps 5]
"""
import argparse
import json
import math
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchutil import log, timeit  # noqa: E402

K, G, D = 8, 4, 128
VARIANTS = [  # (rows_per_wg, block_kv, stages, pingpong)
    (64, 128, 2, False), (64, 128, 2, True), (64, 64, 3, True), (64, 128, 3, True),
    (128, 64, 2, True), (128, 64, 3, True), (128, 64, 4, True), (128, 128, 2, True),
    (128, 64, 2, False),
]


def name(v):
  rw, bkv, st, pp = v
  return f"hopper rw={rw} bkv={bkv} st={st} pp={int(pp)}"


def check(results):
  from pallas_kernels import hopper
  rng = np.random.default_rng(0)
  ok = True
  for v in VARIANTS:
    rw, bkv, st, pp = v
    for layout in ("PLKD", "BKSD"):
      N1, N2, R, L = 3, 2, 2 * rw * 2, 1000
      lengths = np.array([0, 777, 1000])
      q = jnp.asarray(rng.standard_normal((N1, N2, R, D)), jnp.bfloat16)
      shape = (N1, L, N2, D) if layout == "PLKD" else (N1, N2, L, D)
      k = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
      vv_ = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
      pos = (np.arange(L)[None, :, None, None] if layout == "PLKD"
             else np.arange(L)[None, None, :, None])
      bad = jnp.asarray(pos >= lengths[:, None, None, None])
      try:
        o, lse = hopper.attention(
            q, jnp.where(bad, jnp.nan, k).astype(jnp.bfloat16),
            jnp.where(bad, jnp.nan, vv_).astype(jnp.bfloat16), jnp.asarray(lengths, jnp.int32),
            kv_layout=layout, sm_scale=1 / math.sqrt(D),
            block_sizes=hopper.HopperBlockSizes(block_kv=bkv, stages=st, rows_per_wg=rw,
                                                pingpong=pp, splits=2),
            out_dtype=jnp.float32)
      except Exception as e:  # noqa: BLE001
        log(name(v), layout, "FAILED", type(e).__name__, str(e)[:600])
        results.append(dict(kind="check", impl=name(v), layout=layout, error=str(e)[:300]))
        ok = False
        continue
      kk = jnp.swapaxes(k, 1, 2) if layout == "PLKD" else k
      vv = jnp.swapaxes(vv_, 1, 2) if layout == "PLKD" else vv_
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
      good = (e_o < 2e-2 and e_l < 1e-2 and bool(jnp.all(fin == jnp.isfinite(lse)))
              and not bool(jnp.any(jnp.isnan(o))))
      ok &= good
      results.append(dict(kind="check", impl=name(v), layout=layout, err_out=e_o, err_lse=e_l,
                          ok=good))
      log(results[-1])
  return ok


def bench(results, inner, reps, mm, bw):
  from jax.experimental.pallas.ops.gpu import attention_mgpu as am
  from pallas_kernels import decode_attention, hopper, prefix_attention
  from pallas_kernels.prefix_attention import _GPU_DEFAULTS

  def record(shape, impl, step, arrays, flops, nbytes):
    try:
      sec = timeit(step, arrays, inner=inner, reps=reps)[0]
    except Exception as e:  # noqa: BLE001
      log(shape, impl, "FAILED", type(e).__name__, str(e)[:600])
      results.append(dict(kind="time", shape=shape, impl=impl, error=str(e)[:300]))
      return
    roof = max(flops / mm / 1e12, nbytes / bw / 1e12)
    results.append(dict(kind="time", shape=shape, impl=impl, us=sec * 1e6,
                        TFLOPs=flops / sec / 1e12, x_roof=sec / roof))
    log(f"{shape:28s} {impl:58s} {sec * 1e6:8.1f} us {flops / sec / 1e12:5.0f} TFLOP/s "
        f"x roof {sec / roof:5.2f}")

  ks = jax.random.split(jax.random.key(0), 3)
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
  for v in VARIANTS:
    rw, bkv, st, pp = v
    hb = hopper.HopperBlockSizes(block_kv=bkv, stages=st, rows_per_wg=rw, pingpong=pp)

    def kern(i, q, kc, vc, lengths, hb=hb):
      qr = q.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, D)
      o, l2 = hopper.rows_attention(qr, kc, vc, lengths - (i % 2), kv_layout="BKSD",
                                    sm_scale=1 / math.sqrt(D), block_sizes=hb)
      return o[0, 0, 0, 0, 0].astype(jnp.float32) + l2[-1, -1, -1, -1]
    record(shape, name(v) + " kernel only", kern, (q, kc, vc, lengths), flops, nbytes)

    def full(i, q, kc, vc, lengths, hb=hb):
      qr = q.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, D)
      o, l2 = hopper.attention(qr, kc, vc, lengths - (i % 2), kv_layout="BKSD",
                                         sm_scale=1 / math.sqrt(D), block_sizes=hb)
      return o[0, 0, 0, 0].astype(jnp.float32) + l2[-1, -1, -1]
    record(shape, name(v) + " + tail + merge", full, (q, kc, vc, lengths), flops, nbytes)
  # jax's FA3 port at the mean context (fixed length, no masking, f16), [B, S, K, D] layout.
  Sm = int(ctx / B) // 128 * 128
  qa = jax.random.normal(ks[0], (B, T * G, K, D), jnp.float16)
  ka = jax.random.normal(ks[1], (B, Sm, K, D), jnp.float16)
  va = jax.random.normal(ks[2], (B, Sm, K, D), jnp.float16)
  fl2 = 4 * B * T * K * G * D * Sm
  for bq, bkv, st in ((64, 128, 2), (128, 64, 2), (128, 64, 3), (64, 64, 3)):
    cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=st)

    def mg(i, q, k, v, cfg=cfg):
      o, (lse,) = am.attention(q, k, v, cfg, save_residuals=True)
      return o[0, 0, 0, 0].astype(jnp.float32) + lse[-1, -1, -1]
    record(f"verify B={B} T={T} S=mean {Sm}", f"jax attention_mgpu f16 bq={bq} bkv={bkv} st={st}",
           mg, (qa, ka, va), fl2, 2 * B * K * D * 2 * Sm)
  del q, kc, vc, qa, ka, va

  B, L = 64, 16384
  for T in (1, 5):
    P = 1
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
    record(shape, "triton prefix kernel", pstep(_GPU_DEFAULTS), (q, kp, vp, plen), flops, nbytes)
    for v in VARIANTS:
      rw, bkv, st, pp = v
      for sp in (None, 8):
        hb = hopper.HopperBlockSizes(block_kv=bkv, stages=st, rows_per_wg=rw, pingpong=pp,
                                     splits=sp)
        record(shape, name(v) + f" splits={sp or 'auto'}", pstep(hb), (q, kp, vp, plen), flops,
               nbytes)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="/tmp/probe_hopper_v2")
  ap.add_argument("--inner", type=int, default=10)
  ap.add_argument("--reps", type=int, default=5)
  a = ap.parse_args()
  from bench_prefix import ceilings
  env = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
             python=platform.python_version(), command="python3 " + " ".join(sys.argv))
  log(env)
  results = []
  ok = check(results)
  log("checks", "pass" if ok else "FAILED")
  ceil = ceilings(1 << 30, 10, 3)
  log(f"copy {ceil['copy_TBps']:.3f} TB/s, matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s")
  bench(results, a.inner, a.reps, ceil["matmul_TFLOPs"], ceil["copy_TBps"])
  with open(a.out + ".json", "w") as f:
    json.dump(dict(env=env, ceilings=ceil, checks_ok=ok, results=results), f, indent=1)
  log("wrote", a.out + ".json")


if __name__ == "__main__":
  main()
