"""Timing helpers shared by the kernel benchmarks (device-side loops, median of repeats)."""
import statistics
import time

import jax
import jax.numpy as jnp

T0 = time.time()


def log(*a):
  print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def probe_args(reps=5):
  """The command line of a probe script: ``--out`` (a path prefix for its JSON; none: print
  only) and ``--reps`` (timed loops per variant, their median reported)."""
  import argparse
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=None)
  ap.add_argument("--reps", type=int, default=reps)
  return ap.parse_args()


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


def gpu_events(trace_dir):
  """(start us, duration us, name) of the GPU events of a ``jax.profiler.trace(trace_dir,
  create_perfetto_trace=True)``, by start time ([] when it has none: CPU)."""
  import glob, gzip, json
  pf = glob.glob(trace_dir + "/**/perfetto_trace.json.gz", recursive=True)
  if not pf:
    return []
  ev = json.load(gzip.open(pf[0]))
  ev = ev["traceEvents"] if isinstance(ev, dict) else ev
  pname = {e["pid"]: e["args"]["name"] for e in ev if e.get("name") == "process_name"}
  return sorted((e["ts"], e.get("dur", 0), e["name"]) for e in ev
                if e.get("ph") == "X" and "GPU" in pname.get(e.get("pid"), ""))


_REP_PAUSE_S = 0.005


def device_time(step, arrays, *, inner, reps):
  """GPU time per call of step(i, *arrays): the sum of the GPU kernels' durations (device
  timestamps, as a profiler reads them) of ``inner`` calls in a device loop, divided by
  ``inner``; the median over ``reps`` loops (a pause between loops tells them apart in the
  trace). Returns (median s, min s, kernels per call), or None without GPU events (CPU).

  Unlike ``timeit``'s wall clock this leaves out what the GPU does not spend on the calls:
  the dispatch of each loop and the wait for its end (about 0.3-0.9 ms per loop on the H100,
  i.e. 30-90 us per call of a 10-call loop) and the loop's own gaps between iterations. It
  includes every kernel of the loop body: besides the step's own, the loop's few scalar
  kernels (the index arithmetic, the scalar read out of the result, the running sum: about
  2 us per call on the H100; time a step without the work to see them)."""
  @jax.jit
  def loop(*arrays):
    return jax.lax.fori_loop(0, inner, lambda i, acc: acc + step(i, *arrays).astype(
        jnp.float32), jnp.float32(0))
  return device_time_of(loop, arrays, calls=inner, reps=reps)


def _traced(run, reps, pause_s=_REP_PAUSE_S):
  """GPU events of ``reps`` calls of ``run()`` under a profiler, ``pause_s`` before each."""
  import shutil
  import tempfile
  d = tempfile.mkdtemp(prefix="devtime")
  try:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(reps):
        time.sleep(pause_s)
        run()
    return gpu_events(d)
  finally:
    shutil.rmtree(d, ignore_errors=True)


def call_times(ev, gap_us):
  """The GPU time (us, the sum of its kernels' durations) of each call in ``ev`` (``gpu_events``
  of calls made with pauses between them): calls are told apart by idle gaps over ``gap_us``."""
  groups, cur, end = [], 0.0, None
  for ts, dur, _ in ev:
    if end is not None and ts - end > gap_us:
      groups.append(cur)
      cur = 0.0
    cur += dur
    end = ts + dur if end is None else max(end, ts + dur)
  return groups + [cur] if ev else []


def single_call_times(fn, arrays, *, calls, pause_s):
  """GPU time (us) of each of ``calls`` calls of a jitted ``fn(*arrays)``, made ``pause_s``
  apart (after one untimed call); [] without GPU events (CPU)."""
  jax.block_until_ready(fn(*arrays))
  ev = _traced(lambda: jax.block_until_ready(fn(*arrays)), calls, pause_s)
  return call_times(ev, min(pause_s * 1e6 / 2, 1000.0))


def device_time_of(fn, arrays, *, calls, reps):
  """``device_time`` of a jitted ``fn(*arrays)`` that does ``calls`` units of work (e.g. a
  loop that copies a buffer ``calls`` times): (median s, min s, kernels) per unit, or None.
  Every kernel of a call counts, also one-off work such as copying an input into a loop's
  state (``carry_ceiling`` donates its loop's carry to avoid that)."""
  jax.block_until_ready(fn(*arrays))
  ev = _traced(lambda: jax.block_until_ready(fn(*arrays)), reps)
  if not ev:
    return None
  groups = call_times(ev, _REP_PAUSE_S * 1e6 / 2)
  if len(groups) == reps:
    per = sorted(g / calls * 1e-6 for g in groups)
  else:  # a pause inside a call: the calls cannot be told apart, so their mean
    log(f"device_time: {len(groups)} groups of GPU events for {reps} calls; using the mean")
    per = [sum(dur for _, dur, _ in ev) / (calls * reps) * 1e-6] * reps
  return statistics.median(per), per[0], len(ev) / (calls * reps)


def carry_ceiling(body, init, *, inner, reps):
  """Per-iteration times of ``fori_loop(0, inner, body, init)`` for a ceiling (a copy or a
  matmul in the loop carry), with the carry donated so that the loop needs no copy of its
  input first (without donation XLA copies ``init`` into the loop state once per call: one
  extra pass that makes a copy ceiling about 10% low at 10 iterations).
  Returns {"wall_s": median wall clock per iteration, "gpu_s": GPU time per iteration (all
  kernels of the calls, the loop's few scalar kernels included as in ``device_time``; None
  on CPU), "kernels": GPU kernels per call}. (Picking the body's kernel by name instead
  fails: a matmul's body can be several kernels, and the scalar ones then look like it.)"""
  f = jax.jit(lambda c: jax.lax.fori_loop(0, inner, body, c), donate_argnums=0)
  state = [jax.tree.map(jnp.copy, init)]

  def run():
    state[0] = f(state[0])
    jax.block_until_ready(state[0])
  run()
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    run()
    ts.append((time.perf_counter() - t) / inner)
  out = {"wall_s": statistics.median(ts), "gpu_s": None, "kernels": None}
  ev = _traced(run, reps)
  if ev:
    out.update(gpu_s=sum(d for _, d, _ in ev) / (inner * reps) * 1e-6, kernels=len(ev) / reps)
  state[0] = None
  return out


def copy_ceiling(nbytes, *, inner, reps, key=0):
  """Copy bandwidth (read + write bytes / time, TB/s) of a ``nbytes`` buffer in three
  loop-carry forms, each through ``carry_ceiling``: in place (bf16 ``y = y + 1``, u32
  ``y = y ^ i``) and out of place (u32 ``y = x ^ i``, x read-only); all move 2x the bytes.
  Returns ({form: TB/s by the wall clock}, {form: TB/s in GPU time}, empty on CPU)."""
  x = jax.random.normal(jax.random.key(key), (nbytes // 2 // 1024, 1024), jnp.bfloat16)
  xu = jax.lax.bitcast_convert_type(x.reshape(-1, 2), jnp.uint32)
  cases = {"bf16 y=y+1 (loop carry)": (lambda i, y: y + jnp.bfloat16(1), x),
           "u32 y=y^i (in place)": (lambda i, y: y ^ i.astype(jnp.uint32), xu),
           "u32 y=x^i (out of place)": (lambda i, c: (c[0], c[0] ^ i.astype(jnp.uint32)),
                                        (xu, xu))}
  moved = 2 * x.size * 2
  wall, gpu = {}, {}
  for name, (body, init) in cases.items():
    r = carry_ceiling(body, init, inner=inner, reps=reps)
    wall[name] = moved / r["wall_s"] / 1e12
    if r["gpu_s"]:
      gpu[name] = moved / r["gpu_s"] / 1e12
  return wall, gpu


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
