"""Probe: attention over caches far longer than their valid keys (a serving cache sized for
the longest request, a prefix cache padded to a bucket), where the kernels' flash-decoding
splits are planned over the cache's slots. GPU time per call (profiler; 10-call loops,
median of --reps) of the default dispatch: the Triton decode kernel (T = 1 and 5) and the
shared-prefix kernel (Hopper on an H100/H200). Run once per code version, e.g.

    PYTHONPATH=$PWD python3 scripts/probe_dynamic_splits.py --out /tmp/new
    PYTHONPATH=$PWD/_base python3 scripts/probe_dynamic_splits.py --out /tmp/base

Also checks each output against the float32 jnp reference.
"""
import json
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import benchutil  # noqa: E402
import pallas_kernels  # noqa: E402
from pallas_kernels import (decode_attention, decode_attention_reference,  # noqa: E402
                            prefix_attention, prefix_attention_reference)

DECODE = [  # B, T, K, G, S, (lo, hi) of the lengths
    (4, 1, 8, 4, 32768, (1536, 2560)),
    (4, 5, 8, 4, 32768, (1536, 2560)),
    (16, 1, 8, 4, 16384, (768, 1280)),
    (4, 1, 8, 4, 32768, (30000, 32000)),  # full caches: no change expected
]
PREFIX = [  # B, T, K, G, L, prefix length (one group)
    (64, 1, 2, 6, 16384, 1024),
    (64, 1, 2, 6, 16384, 4096),
    (64, 1, 2, 6, 16384, 16384),
    (64, 1, 8, 4, 16384, 2048),
]


def _time(fn, arrays, reps):
  dt = benchutil.device_time(lambda i, *a: fn(*a)[0].ravel()[0], arrays, inner=10, reps=reps)
  return None if dt is None else dt[0]


def main():
  a = benchutil.probe_args()
  rng = np.random.default_rng(0)
  rows = []
  D = 128
  for B, T, K, G, S, (lo, hi) in DECODE:
    q = jnp.asarray(rng.standard_normal((B, T, K * G, D)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.bfloat16)
    lengths = jnp.asarray(rng.integers(lo, min(hi, S - T), size=B), jnp.int32)
    fn = jax.jit(lambda q, k, v, lengths: decode_attention(q, k, v, lengths))
    o = fn(q, k, v, lengths)[0].astype(jnp.float32)
    ro = decode_attention_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                                    v.astype(jnp.float32), lengths)[0]
    row = dict(kind="decode", B=B, T=T, K=K, G=G, S=S, lengths=[lo, hi],
               err=float(jnp.max(jnp.abs(o - ro))))
    t = _time(fn, (q, k, v, lengths), a.reps)
    if t is not None:
      nbytes = float(np.sum(np.asarray(lengths) + T)) * K * D * 2 * 2
      row.update(us=t * 1e6, kv_tbs=nbytes / t / 1e12)
    rows.append(row)
    benchutil.log(row)
  for B, T, K, G, L, n in PREFIX:
    q = jnp.asarray(rng.standard_normal((B, T, K * G, D)), jnp.bfloat16)
    kp = jnp.asarray(rng.standard_normal((1, L, K, D)), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((1, L, K, D)), jnp.bfloat16)
    plen = jnp.asarray([n], jnp.int32)
    fn = jax.jit(lambda q, kp, vp, plen: prefix_attention(q, kp, vp, plen))
    o = fn(q, kp, vp, plen)[0].astype(jnp.float32)
    ro = prefix_attention_reference(q.astype(jnp.float32), kp.astype(jnp.float32),
                                    vp.astype(jnp.float32), plen)[0]
    row = dict(kind="prefix", B=B, T=T, K=K, G=G, L=L, prefix=n,
               err=float(jnp.max(jnp.abs(o - ro))))
    t = _time(fn, (q, kp, vp, plen), a.reps)
    if t is not None:
      flops = 4.0 * B * T * K * G * n * D
      row.update(us=t * 1e6, tflops=flops / t / 1e12, kv_tbs=n * K * D * 4 / t / 1e12)
    rows.append(row)
    benchutil.log(row)
  if a.out:
    json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                   python=platform.python_version(), command=" ".join(sys.argv),
                   kernels=pallas_kernels.__file__, dtype="bfloat16", D=D, rows=rows),
              open(a.out + ".json", "w"), indent=1)


if __name__ == "__main__":
  main()
