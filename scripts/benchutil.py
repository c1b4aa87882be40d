"""Timing helpers shared by the kernel benchmarks (device-side loops, median of repeats)."""
import statistics
import time

import jax
import jax.numpy as jnp

T0 = time.time()


def log(*a):
  print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def timeit(step, arrays, *, inner, reps, unroll=False):
  """Median and best seconds per call of step(i, *arrays) -> scalar, looped on device; compile s.

  ``unroll=True`` unrolls the ``inner`` calls into straight-line code: back-to-back launches
  as in a model's unrolled layers, without the device loop's per-iteration cost (measured on
  the H100: 17-44 us per iteration, which dominates a 30 us kernel). Then step must make
  each call's inputs differ (use ``i``, not ``i % 2``), or XLA may merge identical calls."""
  @jax.jit
  def loop(*arrays):
    def body(i, acc):
      return acc + step(i, *arrays).astype(jnp.float32)
    return jax.lax.fori_loop(0, inner, body, jnp.float32(0), unroll=bool(unroll))
  t = time.time()
  jax.block_until_ready(loop(*arrays))
  compile_s = time.time() - t
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(loop(*arrays))
    times.append((time.perf_counter() - t) / inner)
  return statistics.median(times), min(times), compile_s


def forward_loop(cfg, B, T, sink, window, n):
  """A jitted ``run(params, cache, tok) -> (cache, tok)``: n forwards of T tokens at the cache's
  lengths inside one device loop (each step's argmax feeds the next, the cache is donated)."""
  import functools
  from jaxspec.attention import AttentionPlan
  from jaxspec.model import forward

  @functools.partial(jax.jit, donate_argnums=(1,))
  def run(params, cache, tok):
    def body(i, c):
      cache, tok = c
      L = cache.lengths
      pos = L[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
      plan = AttentionPlan(lengths=L, sink=sink, window=window)
      toks = jnp.broadcast_to(tok[:, None], (B, T))
      logits, cache = forward(cfg, params, toks, pos, cache, plan)
      return cache, jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    return jax.lax.fori_loop(0, n, body, (cache, tok))
  return run


def kernel_table(trace_dir, n, top=40, width=70):
  """GPU kernels of a `jax.profiler.trace(trace_dir, create_perfetto_trace=True)` of n steps:
  {"kernels", "busy_us", "span_us" (per step), "processes", "table": [{us, per_step, name}]};
  {} when the trace has no GPU events (CPU)."""
  import glob, gzip, json
  pf = glob.glob(trace_dir + "/**/perfetto_trace.json.gz", recursive=True)[0]
  ev = json.load(gzip.open(pf))
  ev = ev["traceEvents"] if isinstance(ev, dict) else ev
  pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("name") == "process_name"}
  gpu = [e for e in ev if e.get("ph") == "X" and "GPU" in pname.get(e.get("pid"), "")]
  if not gpu:
    return {}
  tot = {}
  for e in gpu:
    nm = e["name"][:width]
    c, s = tot.get(nm, (0, 0.0))
    tot[nm] = (c + 1, s + e.get("dur", 0))
  span = max(e["ts"] + e.get("dur", 0) for e in gpu) - min(e["ts"] for e in gpu)
  return {"kernels": sum(c for c, _ in tot.values()) / n,
          "busy_us": sum(s for _, s in tot.values()) / n, "span_us": span / n,
          "processes": sorted(set(pname.values()))[:6],
          "table": [{"us": s / n, "per_step": c / n, "name": nm}
                    for nm, (c, s) in sorted(tot.items(), key=lambda kv: -kv[1][1])[:top]]}
