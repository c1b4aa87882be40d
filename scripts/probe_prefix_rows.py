"""Probe: the shared-prefix kernel at B=64, T=1, P=1, L=16384 (8 KV heads x 4) with 64-row vs
128-row warpgroups. With 64-row ones a KV head's 256 query rows are two programs that each
read the whole prefix (from L2 if they run together); with 128-row ones one program holds
all 256 rows and reads each prefix byte once. GPU time (benchutil.device_time) vs the
roofline (prefix bytes / copy ceiling, FLOPs / matmul rate, both measured here).
Usage: python3 scripts/probe_prefix_rows.py [--shapes 64x1 256x1] [--bkv64] [--out PATH]"""
import argparse
import json
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_prefix import ceilings  # noqa: E402
from benchutil import device_time, log  # noqa: E402
from pallas_kernels import hopper, prefix_attention  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", nargs="*", default=["64x1", "64x5", "256x1"])
  ap.add_argument("--inner", type=int, default=10)
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--out", default="")
  ap.add_argument("--bkv64", action="store_true",
                  help="128-row warpgroups with 64-key blocks (S + O fit the registers at D=128)")
  a = ap.parse_args()
  ceil = ceilings(1 << 30, 10, 3)
  bw, mm = ceil["copy_TBps_device"] * 1e12, ceil["matmul_TFLOPs_device"] * 1e12
  log(f"GPU-time ceilings: copy {bw / 1e12:.3f} TB/s, matmul {mm / 1e12:.0f} TFLOP/s")
  K, G, D, L, P = 8, 4, 128, 16384, 1
  variants = [("rw=64 splits=auto (default)", None)]
  if a.bkv64:  # a 128-row warpgroup's S tile at block_kv=64 is 64 registers per thread, O 128
    for st, sp in ((2, None), (3, None), (4, None), (3, 16), (4, 8)):
      variants.append((f"rw=128 bkv=64 st={st} splits={sp or 'auto'}",
                       hopper.HopperBlockSizes(rows_per_wg=128, block_kv=64, stages=st,
                                               splits=sp)))
  else:
    for sp in (None, 8, 16, 32):
      variants.append((f"rw=128 splits={sp or 'auto'}",
                       hopper.HopperBlockSizes(rows_per_wg=128, splits=sp)))
    variants.append(("rw=64 splits=16", hopper.HopperBlockSizes(splits=16)))
  rows = []
  for shape in a.shapes:
    B, T = map(int, shape.split("x"))
    ks = jax.random.split(jax.random.key(B * 10 + T), 3)
    q = jax.random.normal(ks[0], (B, T, K * G, D), jnp.bfloat16)
    kp = jax.random.normal(ks[1], (P, L, K, D), jnp.bfloat16)
    vp = jax.random.normal(ks[2], (P, L, K, D), jnp.bfloat16)
    plen = jnp.full((P,), L, jnp.int32)
    flops, nbytes = 4 * B * T * K * G * L * D, 2 * P * L * K * D * 2
    roof = max(nbytes / bw, flops / mm)
    ref = None
    for tag, bs in variants:
      def step(i, q, kp, vp, plen, bs=bs):
        o, l = prefix_attention(q, kp, vp, plen - (i % 2), block_sizes=bs)
        return o[0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]
      try:
        o, _ = jax.jit(lambda *x, bs=bs: prefix_attention(*x, block_sizes=bs))(q, kp, vp, plen)
        o = o.astype(jnp.float32)
        if ref is None:
          ref = o
        err = float(jnp.max(jnp.abs(o - ref)))
        med, _, kern = device_time(step, (q, kp, vp, plen), inner=a.inner, reps=a.reps)
      except Exception as e:  # noqa: BLE001
        log(f"{shape} {tag}: FAILED {type(e).__name__}: {str(e)[:200]}")
        rows.append(dict(shape=shape, impl=tag, error=str(e)[:300]))
        continue
      log(f"B={B} T={T} {tag:32s} GPU {med * 1e6:7.1f} us  x roof {med / roof:.2f}  "
          f"max |diff| vs default {err:.2e}  ({kern:.1f} kernels/call)")
      rows.append(dict(shape=shape, impl=tag, gpu_us=med * 1e6, x_roof=med / roof,
                       roof_us=roof * 1e6, max_abs_diff=err))
  if a.out:
    with open(a.out, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, ceilings=ceil,
                     rows=rows, command=" ".join(sys.argv)), f, indent=1)


if __name__ == "__main__":
  main()
