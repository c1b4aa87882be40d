#!/usr/bin/env python
"""Probe: the default prefix_attention / decode_attention on a Hopper GPU (Hopper kernel where
the row thresholds pick it) against the Triton kernels at the engine's shapes: Qwen2.5-1.5B
(K=2, G=6) and the Llama-8B shape (K=8, G=4), shared prefix 16k (P=1) and verify over an 8k
cache. Prints one line per shape; writes <out>.json.
Usage: python scripts/probe_hopper_default.py [--out /tmp/probe_default]
"""
import argparse, json, os, sys
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE)); sys.path.insert(0, HERE)
import jax, jax.numpy as jnp, numpy as np  # noqa: E401,E402
from benchutil import log, timeit  # noqa: E402
from pallas_kernels import decode_attention, prefix_attention  # noqa: E402
from pallas_kernels.decode_attention import _GPU_DEFAULTS as DEC  # noqa: E402
from pallas_kernels.prefix_attention import _GPU_DEFAULTS as PRE  # noqa: E402


def main():
  ap = argparse.ArgumentParser(); ap.add_argument("--out", default="/tmp/probe_default")
  a = ap.parse_args()
  res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=[])
  ks = jax.random.split(jax.random.key(0), 3)
  for name, K, G in (("qwen1.5b", 2, 6), ("llama8b", 8, 4)):
    for B, T, L in ((64, 1, 16384), (64, 5, 16384), (256, 1, 4096)):
      q = jax.random.normal(ks[0], (B, T, K * G, 128), jnp.bfloat16)
      kp = jax.random.normal(ks[1], (1, L, K, 128), jnp.bfloat16)
      vp = jax.random.normal(ks[2], (1, L, K, 128), jnp.bfloat16)
      ln = jnp.full((1,), L, jnp.int32)
      t = {}
      for tag, bs in (("default", None), ("triton", PRE)):
        def step(i, q, kp, vp, ln, bs=bs):
          o, l = prefix_attention(q, kp, vp, ln - (i % 2), block_sizes=bs)
          return o[0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]
        t[tag] = timeit(step, (q, kp, vp, ln), inner=10, reps=7)[0] * 1e6
      res["rows"].append(dict(model=name, kind="prefix", B=B, T=T, L=L, **t))
      log(res["rows"][-1])
    for B, T, S in ((64, 8, 8192), (64, 64, 8192)):
      q = jax.random.normal(ks[0], (B, T, K * G, 128), jnp.bfloat16)
      kc = jax.random.normal(ks[1], (B, K, S, 128), jnp.bfloat16)
      lens = jnp.asarray(np.random.default_rng(1).integers(S // 2, S - T + 1, B), jnp.int32)
      t = {}
      for tag, bs in (("default", None), ("triton", DEC)):
        def step(i, q, kc, lens, bs=bs):
          o, l = decode_attention(q, kc, kc, lens - (i % 2), block_sizes=bs)
          return o[0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]
        t[tag] = timeit(step, (q, kc, lens), inner=10, reps=7)[0] * 1e6
      res["rows"].append(dict(model=name, kind="verify", B=B, T=T, S=S, **t))
      log(res["rows"][-1])
  json.dump(res, open(a.out + ".json", "w"), indent=1)


if __name__ == "__main__":
  main()
