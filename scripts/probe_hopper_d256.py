"""Probe: does the Hopper kernel serve head dim 256 with smaller tiles, and does it beat the
Triton kernel there? (The default sends D=256 to Triton: block_kv=128 x 2 stages overflows
shared memory at D=256.) Checks each variant against the float32 reference, then times it.

    python3 scripts/probe_hopper_d256.py [--out benchmarks/probe_hopper_d256_h100]
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import benchutil  # noqa: E402
from pallas_kernels import (HopperBlockSizes, decode_attention, decode_attention_reference,  # noqa: E402
                            prefix_attention, prefix_attention_reference)


def main():
  a = benchutil.probe_args()
  rng = np.random.default_rng(0)
  rows = []
  variants = [("triton (default)", None)] + [
      (f"hopper bkv={b} st={s} ov={int(o)}", HopperBlockSizes(block_kv=b, stages=s, overlap=o))
      for b, s, o in [(64, 2, False), (64, 2, True), (64, 3, False)]]
  D = 256
  shapes = [("verify B=16 T=64 G=4 K=2 S=4096", "decode", (16, 64, 4, 2, 4096)),
            ("prefix P=1 B=64 T=1 G=4 K=2 L=8192", "prefix", (64, 1, 4, 2, 8192))]
  for name, kind, (B, T, G, K, S) in shapes:
    q = jnp.asarray(rng.standard_normal((B, T, G * K, D)), jnp.bfloat16)
    if kind == "decode":
      k = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.bfloat16)
      v = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.bfloat16)
      lengths = jnp.asarray(rng.integers(S // 2, S - T, size=B), jnp.int32)
      fn = lambda q, k, v, bs: decode_attention(q, k, v, lengths, block_sizes=bs)  # noqa: E731
      ref = decode_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), lengths)
    else:
      k = jnp.asarray(rng.standard_normal((1, S, K, D)), jnp.bfloat16)
      v = jnp.asarray(rng.standard_normal((1, S, K, D)), jnp.bfloat16)
      fn = lambda q, k, v, bs: prefix_attention(q, k, v, block_sizes=bs)  # noqa: E731
      ref = prefix_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)))
    for vname, bs in variants:
      try:
        out, lse = fn(q, k, v, bs)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref[0])) / jnp.max(jnp.abs(ref[0])))
        med, best, _ = benchutil.timeit(
            lambda i, q, k, v: fn(q, k, v, bs)[0][0, 0, 0, 0], (q, k, v), inner=10, reps=a.reps)
        row = dict(shape=name, variant=vname, err=err, us=med * 1e6, ok=err < 2e-2)
      except Exception as e:  # noqa: BLE001
        row = dict(shape=name, variant=vname, error=f"{type(e).__name__}: {str(e)[:200]}")
      benchutil.log(row)
      rows.append(row)
  if a.out:
    json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, rows=rows),
              open(a.out + ".json", "w"), indent=1)


if __name__ == "__main__":
  main()
