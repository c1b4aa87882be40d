#!/usr/bin/env python
"""The fixed cost of one program of the Hopper verification kernel, from a fit (GPU).

B=64 sequences of one length L (so every program has the same number of key blocks n), K=8,
G=4, T=64, D=128, bf16: 1024 programs of 128 rows on the GPU's SMs, one program per SM at a
time, i.e. ``waves = ceil(1024 / SMs)`` programs after one another on the busiest SM. GPU
time per call ~ waves x (n + c) x t_block, with n = ceil((L + T) / block_kv): a straight line
in n whose intercept over slope is c, the per-program cost (q load, pipeline fill, epilogue,
launch) in units of one block's time. That cost is what a persistent kernel (programs that
prefetch the next work item's K/V while finishing the last) could hide.

With the fitted block time it also models the benchmark's ragged case (B=64, S=8192, lengths
in [S/2, S-T] from the benchmarks' seed): the GPU's block scheduler as greedy list
scheduling in launch order (longest first), and a persistent kernel's static snake order,
for several per-program costs c. ``--model BLOCK_US`` runs the model alone (no GPU).

Usage: python scripts/probe_program_overhead.py --out benchmarks/probe_program_overhead_h100
"""
import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchutil import device_time, log  # noqa: E402


def schedule_model(block_us, sms=132, overheads=(0.0, 0.5, 1.0, 2.0, 3.3), B=64, S=8192,
                   T=64, K=8, D=128, row_tiles=2, block_kv=128):
  """Predicted GPU time (us) of the ragged T=64 verification for per-program costs c (blocks):
  the hardware's dynamic block scheduling (each program to the SM that frees first, launch
  order longest first) and a static snake order over the SMs (a persistent kernel's)."""
  rng = np.random.default_rng(1)  # bench_hopper.py's and bench_attention.py's lengths
  lengths = rng.integers(S // 2, S - T + 1, B)
  jobs = []
  for b in sorted(range(B), key=lambda b: -lengths[b]):
    jobs += [-(-(int(lengths[b]) + T) // block_kv)] * (K * row_tiles)
  out = dict(ideal_us=sum(jobs) / sms * block_us, kv_bytes=2 * K * D * 2 * float(sum(lengths)))
  for c in overheads:
    dyn = [0.0] * sms
    for j in jobs:
      i = int(np.argmin(dyn))
      dyn[i] += j + c
    snake = np.zeros(sms)
    for k, j in enumerate(jobs):
      w, p = divmod(k, sms)
      snake[p if w % 2 == 0 else sms - 1 - p] += j + c
    out[f"c={c}"] = dict(dynamic_us=max(dyn) * block_us, snake_us=float(snake.max()) * block_us)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="benchmarks/probe_program_overhead_h100")
  ap.add_argument("--lengths", type=int, nargs="*", default=[960, 1984, 4032, 6080, 8064])
  ap.add_argument("--model", type=float, help="block time (us): run the schedule model only")
  a = ap.parse_args()
  if a.model:
    log(schedule_model(a.model))
    return
  if jax.default_backend() != "gpu":
    sys.exit("probe_program_overhead.py times GPU kernels: it needs a GPU")
  from pallas_kernels import decode_attention, hopper
  K, G, D, T, B = 8, 4, 128, 64, 64
  S = max(a.lengths) + T
  S = -(-S // 128) * 128
  env = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
             python=platform.python_version(), command="python3 " + " ".join(sys.argv),
             date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), sms=hopper._num_sms())
  log(env)
  ks = jax.random.split(jax.random.key(0), 3)
  kc = jax.random.normal(ks[1], (B, K, S, D), jnp.bfloat16)
  vc = jax.random.normal(ks[2], (B, K, S, D), jnp.bfloat16)
  q = jax.random.normal(ks[0], (B, T, K * G, D), jnp.bfloat16)
  bkv = hopper.HopperBlockSizes().block_kv
  waves = -(-B * K * 2 // env["sms"])
  rows = []
  for L in a.lengths:
    lengths = jnp.full((B,), L, jnp.int32)

    def step(i, q, kc, vc, n):
      o, l = decode_attention(q, kc, vc, n - (i % 2))
      return o[0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]
    t = device_time(step, (q, kc, vc, lengths), inner=10, reps=5)[0]
    n = -(-(L + T) // bkv)
    rows.append(dict(L=L, blocks=n, us=t * 1e6))
    log(f"L={L:5d} blocks={n:3d} GPU {t * 1e6:8.1f} us")
  x = np.array([r["blocks"] for r in rows], float)
  y = np.array([r["us"] for r in rows])
  slope, icpt = np.polyfit(x, y, 1)
  fit = dict(waves=waves, us_per_block_per_wave=slope, intercept_us=icpt,
             block_us=slope / waves, overhead_blocks=icpt / slope,
             max_residual_us=float(np.max(np.abs(y - (slope * x + icpt)))))
  log(fit)
  model = schedule_model(fit["block_us"], sms=env["sms"])
  log(model)
  with open(a.out + ".json", "w") as f:
    json.dump(dict(env=env, rows=rows, fit=fit, model=model), f, indent=1)


if __name__ == "__main__":
  main()
