#!/usr/bin/env python
"""Is the T=64 verification slower under load than alone? (GPU; power cap vs kernel)

Times the same attention calls (GPU kernel time from a profiler trace) three ways: single
calls, each after an idle pause (the GPU cool, at its full clock); calls in back-to-back bursts
of ``--burst`` (as the benchmarks time them); and a sustained run of ``--sustain`` seconds while
``nvidia-smi`` samples the SM clock, power and throttle reasons. Shapes: B=64, S=8192
verification at T=64 (Hopper kernel) and T=1 (Triton), and the B=256, P=1, L=16384 shared
prefix at T=1 (Hopper, little HBM traffic).

Usage: python scripts/probe_power_clock.py --out benchmarks/probe_power_clock_h100
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchutil import copy_ceiling, log, single_call_times  # noqa: E402

K, G, D = 8, 4, 128


def sample_smi(period_ms=20):
  """nvidia-smi sampling into a temporary CSV until terminated: (process, file), or
  (None, file) without nvidia-smi (no NVIDIA GPU here)."""
  import shutil
  f = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False)
  if shutil.which("nvidia-smi") is None:
    return None, f
  p = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,"
                        "clocks_event_reasons.active", "--format=csv,noheader,nounits",
                        f"-lms={period_ms}"], stdout=f, stderr=subprocess.DEVNULL)
  return p, f


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="benchmarks/probe_power_clock_h100")
  ap.add_argument("--single", type=int, default=15, help="single calls after a pause")
  ap.add_argument("--pause", type=float, default=0.4)
  ap.add_argument("--burst", type=int, default=10)
  ap.add_argument("--sustain", type=float, default=2.0)
  a = ap.parse_args()
  if jax.default_backend() != "gpu":
    sys.exit("probe_power_clock.py times GPU kernels from a profiler trace: it needs a GPU")
  from pallas_kernels import decode_attention, prefix_attention
  env = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
             python=platform.python_version(), command="python3 " + " ".join(sys.argv),
             date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
  log(env)
  _, gpu = copy_ceiling(1 << 30, inner=10, reps=3)
  copy_tbps = max(gpu.values()) if gpu else float("nan")
  log(f"copy ceiling (GPU time) {copy_tbps:.3f} TB/s")
  ks = jax.random.split(jax.random.key(0), 3)
  rng = np.random.default_rng(1)
  B, S = 64, 8192
  kc = jax.random.normal(ks[1], (B, K, S, D), jnp.bfloat16)
  vc = jax.random.normal(ks[2], (B, K, S, D), jnp.bfloat16)
  shapes = []
  for T in (64, 1):
    lengths = jnp.asarray(rng.integers(S // 2, S - T + 1, B), jnp.int32)
    q = jax.random.normal(ks[0], (B, T, K * G, D), jnp.bfloat16)
    ctx = float(jnp.sum(lengths))
    shapes.append((f"verify B=64 T={T} S=8192", q, kc, vc, lengths,
                   lambda q, k, v, n: decode_attention(q, k, v, n),
                   4 * T * K * G * D * ctx, 2 * K * D * 2 * ctx))
  L = 16384
  qp = jax.random.normal(ks[0], (256, 1, K * G, D), jnp.bfloat16)
  kp = jax.random.normal(ks[1], (1, L, K, D), jnp.bfloat16)
  vp = jax.random.normal(ks[2], (1, L, K, D), jnp.bfloat16)
  shapes.append(("prefix B=256 T=1 L=16384", qp, kp, vp, jnp.full((1,), L, jnp.int32),
                 lambda q, k, v, n: prefix_attention(q, k, v, n),
                 4 * 256 * K * G * L * D, 2 * L * K * D * 2))
  results = []
  for name, q, k, v, n, f, flops, nbytes in shapes:
    one = jax.jit(lambda q, k, v, n: f(q, k, v, n)[0][0, 0, 0, 0])

    def burst_fn(q, k, v, n):
      return jax.lax.fori_loop(0, a.burst, lambda i, acc: acc + f(q, k, v, n - (i % 2))[0][
          0, 0, 0, 0].astype(jnp.float32), jnp.float32(0))
    burst = jax.jit(burst_fn)
    single = single_call_times(one, (q, k, v, n), calls=a.single, pause_s=a.pause)
    bursts = [t / a.burst for t in single_call_times(burst, (q, k, v, n), calls=7, pause_s=a.pause)]
    # sustained: back-to-back bursts for a.sustain seconds while nvidia-smi samples
    jax.block_until_ready(burst(q, k, v, n))
    p, fcsv = sample_smi()
    time.sleep(0.3)
    t0, nb = time.perf_counter(), 0
    while time.perf_counter() - t0 < a.sustain:
      jax.block_until_ready(burst(q, k, v, n))
      nb += 1
    sus_us = (time.perf_counter() - t0) / (nb * a.burst) * 1e6
    time.sleep(0.2)
    if p is not None:
      p.terminate()
      p.wait()
    fcsv.seek(0)
    rows = [r.split(", ") for r in fcsv.read().strip().splitlines()]
    clocks = [float(r[1]) for r in rows if len(r) >= 4 and r[1].strip().isdigit()]
    power = [float(r[2]) for r in rows if len(r) >= 4 and r[1].strip().isdigit()]
    rec = dict(shape=name, flops=flops, kv_bytes=nbytes,
               single_us_median=statistics.median(single), single_us=single,
               burst_us_median=statistics.median(bursts), burst_us=bursts,
               sustained_wall_us=sus_us, smi_samples=len(rows),
               sm_clock_mhz=[min(clocks), statistics.median(clocks), max(clocks)] if clocks else None,
               power_w=[min(power), statistics.median(power), max(power)] if power else None,
               smi_rows=rows[:200])
    results.append(rec)
    log(f"{name:28s} single {rec['single_us_median']:8.1f} us  burst {rec['burst_us_median']:8.1f} us"
        f"  sustained (wall) {sus_us:8.1f} us  clock {rec['sm_clock_mhz']}  power {rec['power_w']}")
    log(f"   TFLOP/s single {flops / rec['single_us_median'] / 1e6:.0f} burst "
        f"{flops / rec['burst_us_median'] / 1e6:.0f}; KV TB/s single "
        f"{nbytes / rec['single_us_median'] / 1e6:.2f} burst {nbytes / rec['burst_us_median'] / 1e6:.2f}"
        f" (copy ceiling {copy_tbps:.3f})")
    time.sleep(2.0)  # cool down before the next shape
  with open(a.out + ".json", "w") as fo:
    json.dump(dict(env=env, copy_TBps_gpu=copy_tbps, results=results), fo, indent=1)
  log("wrote", a.out + ".json")


if __name__ == "__main__":
  main()
