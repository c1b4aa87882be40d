#!/usr/bin/env python
"""How much of a timed kernel call is the timing loop's own cost (GPU).

``benchutil.timeit`` runs ``inner`` calls in a device ``fori_loop``. Each loop iteration
costs the GPU some idle time (the loop's own work between bodies). For a kernel of tens of
microseconds that idle time is a large share of the measured time. This probe times the same
calls three ways, side by side: the rolled loop, the loop unrolled into back-to-back calls
(as a model's unrolled layers run them), and the GPU-busy time per call from a profiler
trace. Shapes: a tiny elementwise step (the loop's floor), the B=64, P=1, L=16k shared
prefix at T=1 and T=5 (Hopper kernel), and the B=64, S=8192 verification at T=1 (Triton)
and T=64 (Hopper).

Usage: python scripts/probe_loop_overhead.py [--out benchmarks/probe_loop_overhead_h100]
"""
import argparse
import json
import math
import os
import platform
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchutil import kernel_table, log, timeit  # noqa: E402


def gpu_events(trace_dir):
  """(start us, duration us, name) of every GPU event of a perfetto trace, by start time."""
  import glob
  import gzip
  pf = glob.glob(trace_dir + "/**/perfetto_trace.json.gz", recursive=True)[0]
  ev = json.load(gzip.open(pf))
  ev = ev["traceEvents"] if isinstance(ev, dict) else ev
  pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("name") == "process_name"}
  gpu = [(e["ts"], e.get("dur", 0), e["name"]) for e in ev
         if e.get("ph") == "X" and "GPU" in pname.get(e.get("pid"), "")]
  return sorted(gpu)


def gaps(trace_dir, min_us=50.0):
  """The idle times between consecutive GPU events (quantiles), and the long ones (reps)."""
  g = gpu_events(trace_dir)
  idle = [max(0.0, b[0] - (a[0] + a[1])) for a, b in zip(g, g[1:])]
  big = [round(x, 1) for x in idle if x > min_us]
  small = sorted(x for x in idle if x <= min_us)
  q = lambda f: small[int(f * (len(small) - 1))] if small else float("nan")  # noqa: E731
  return dict(events=len(g), idle_sum_small_us=sum(small), idle_p50_us=q(0.5),
              idle_p90_us=q(0.9), idle_max_small_us=small[-1] if small else float("nan"),
              long_idles_us=big[:12])


def busy_us(step, arrays, inner, reps):
  loop = jax.jit(lambda *a: jax.lax.fori_loop(
      0, inner, lambda i, acc: acc + step(i, *a).astype(jnp.float32), jnp.float32(0),
      unroll=True))
  jax.block_until_ready(loop(*arrays))
  d = tempfile.mkdtemp()
  with jax.profiler.trace(d, create_perfetto_trace=True):
    for _ in range(reps):
      jax.block_until_ready(loop(*arrays))
  kt = kernel_table(d, inner * reps, top=6, width=50)
  if kt:
    kt["gaps"] = gaps(d)
  return kt.get("busy_us", float("nan")), kt


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="benchmarks/probe_loop_overhead_h100")
  ap.add_argument("--inner", type=int, default=10)
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--sustain", type=float, default=0.0,
                  help="seconds of back-to-back verification at T=64 and T=1 (clock drift)")
  a = ap.parse_args()
  from pallas_kernels import decode_attention, prefix_attention
  from pallas_kernels.decode_attention import _GPU_DEFAULTS as DEC
  K, G, D = 8, 4, 128
  ks = jax.random.split(jax.random.key(0), 3)
  rows = []

  def measure(name, step, arrays):
    r = dict(name=name)
    try:
      for mode, kw in (("rolled", dict(unroll=False)), ("unrolled", dict(unroll=True))):
        r[mode + "_us"] = timeit(step, arrays, inner=a.inner, reps=a.reps, **kw)[0] * 1e6
      r["unrolled_x4_us"] = timeit(step, arrays, inner=4 * a.inner, reps=a.reps,
                                   unroll=True)[0] * 1e6
      r["busy_us"], r["kernels"] = busy_us(step, arrays, a.inner, 3)
      log(name, r["kernels"].get("gaps"))
    except Exception as e:  # noqa: BLE001
      log(name, "FAILED", type(e).__name__, str(e)[:600])
      return
    rows.append(r)
    log(f"{name:40s} rolled {r['rolled_us']:8.1f}  unrolled {r['unrolled_us']:8.1f}  "
        f"unrolled x4 {r['unrolled_x4_us']:8.1f}  GPU busy {r['busy_us']:8.1f} us")

  x = jax.random.normal(ks[0], (1 << 19,), jnp.bfloat16)
  measure("tiny elementwise (1 MB)", lambda i, x: jnp.sum(x[:1024] * i.astype(x.dtype)), (x,))
  L = 16384
  kp = jax.random.normal(ks[1], (1, L, K, D), jnp.bfloat16)
  vp = jax.random.normal(ks[2], (1, L, K, D), jnp.bfloat16)
  plen = jnp.full((1,), L, jnp.int32)
  for B, T in ((64, 1), (64, 5)):
    q = jax.random.normal(ks[0], (B, T, K * G, D), jnp.bfloat16)

    def pstep(i, q, kp, vp, plen):
      o, l = prefix_attention(q, kp, vp, plen - i)
      return o[0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]
    measure(f"prefix B={B} T={T} P=1 L={L} (default)", pstep, (q, kp, vp, plen))
  del kp, vp
  B, S = 64, 8192
  kc = jax.random.normal(ks[1], (B, K, S, D), jnp.bfloat16)
  vc = jax.random.normal(ks[2], (B, K, S, D), jnp.bfloat16)
  lengths = jnp.asarray(np.random.default_rng(1).integers(S // 2, S - 64 - a.inner, B),
                        jnp.int32)
  for T in (1, 64):
    q = jax.random.normal(ks[0], (B, T, K * G, D), jnp.bfloat16)

    def vstep(i, q, kc, vc, lengths):
      o, l = decode_attention(q, kc, vc, lengths - i, block_sizes=DEC if T == 1 else None)
      return o[0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]
    measure(f"verify B={B} T={T} S={S} (default)", vstep, (q, kc, vc, lengths))
  if a.sustain:  # per-rep times over a few seconds of back-to-back T=64 / T=1 verification
    import time
    for T in (64, 1):
      q = jax.random.normal(ks[0], (B, T, K * G, D), jnp.bfloat16)

      def vloop(q, kc, vc, lengths, T=T):
        def body(i, acc):
          o, l = decode_attention(q, kc, vc, lengths - i, block_sizes=DEC if T == 1 else None)
          return acc + o[0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]
        return jax.lax.fori_loop(0, a.inner, body, jnp.float32(0), unroll=True)
      f = jax.jit(vloop)
      jax.block_until_ready(f(q, kc, vc, lengths))
      per, t_end = [], time.perf_counter() + a.sustain
      while time.perf_counter() < t_end:
        t = time.perf_counter()
        jax.block_until_ready(f(q, kc, vc, lengths))
        per.append((time.perf_counter() - t) / a.inner * 1e6)
      qs = [per[int(f_ * (len(per) - 1))] for f_ in (0.0, 0.1, 0.5, 0.9, 1.0)]
      rows.append(dict(name=f"sustained verify T={T} ({a.sustain} s)", per_call_us=per[:400],
                       first5=per[:5], last5=per[-5:], quantiles=qs))
      log(f"sustained T={T}: {len(per)} reps, first {[round(x) for x in per[:5]]} last "
          f"{[round(x) for x in per[-5:]]} min/p10/p50/p90/max {[round(x) for x in qs]}")
  env = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
             python=platform.python_version(), command="python3 " + " ".join(sys.argv))
  with open(a.out + ".json", "w") as f:
    json.dump(dict(env=env, rows=rows), f, indent=1)
  lines = ["# Timing-loop overhead (rolled vs unrolled device loop vs GPU busy time)\n",
           f"- device: {env['device']}, jax {env['jax']}, python {env['python']}",
           f"- command: `{env['command']}`; {a.inner} calls per loop, median of {a.reps}\n",
           f"| step | rolled loop (us/call) | unrolled (us/call) | unrolled, {4 * a.inner} "
           "calls | GPU busy (us/call) |", "|---|---|---|---|---|"]
  lines += [f"| {r['name']} | {r['rolled_us']:.1f} | {r['unrolled_us']:.1f} | "
            f"{r['unrolled_x4_us']:.1f} | {r['busy_us']:.1f} |" for r in rows if "busy_us" in r]
  for r in rows:
    if "quantiles" in r:
      lines.append(f"\n{r['name']}: per call (us) first reps {[round(x) for x in r['first5']]}, "
                   f"last {[round(x) for x in r['last5']]}, min/p10/p50/p90/max "
                   f"{[round(x) for x in r['quantiles']]}")
  with open(a.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  log("wrote", a.out)


if __name__ == "__main__":
  main()
