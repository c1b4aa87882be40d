"""Timing helpers shared by the kernel benchmarks (device-side loops, median of repeats)."""
import statistics
import time

import jax
import jax.numpy as jnp

T0 = time.time()


def log(*a):
  print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def timeit(step, arrays, *, inner, reps):
  """Median and best seconds per call of step(i, *arrays) -> scalar, looped on device; compile s."""
  @jax.jit
  def loop(*arrays):
    def body(i, acc):
      return acc + step(i, *arrays).astype(jnp.float32)
    return jax.lax.fori_loop(0, inner, body, jnp.float32(0))
  t = time.time()
  jax.block_until_ready(loop(*arrays))
  compile_s = time.time() - t
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(loop(*arrays))
    times.append((time.perf_counter() - t) / inner)
  return statistics.median(times), min(times), compile_s
