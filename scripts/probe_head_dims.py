"""Probe: the Triton decode kernel at head dims that are not powers of 2 (tiles of the next
power of 2, lanes past D masked) against the XLA attention the engine used for them before,
and against the power-of-2 neighbours. Wall clock of 10-call loops, median of --reps;
K/V bytes of the valid slots over the time.

    python3 scripts/probe_head_dims.py [--out benchmarks/probe_head_dims_h100]
"""
import json
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import benchutil  # noqa: E402
from jaxspec.attention import attention_xla  # noqa: E402
from pallas_kernels import decode_attention  # noqa: E402


def main():
  a = benchutil.probe_args()
  rng = np.random.default_rng(0)
  B, S, K, G = 32, 4096, 8, 4
  rows = []
  for D in (64, 80, 96, 100, 128):
    for T in (1, 5):
      q = jnp.asarray(rng.standard_normal((B, T, G * K, D)), jnp.bfloat16)
      k = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.bfloat16)
      v = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.bfloat16)
      lengths = jnp.asarray(rng.integers(S // 2, S - T + 1, size=B), jnp.int32)
      nbytes = float(np.sum(np.asarray(lengths) + T)) * K * D * 2 * 2
      impls = {"kernel": lambda q, k, v: decode_attention(q, k, v, lengths)[0],
               "xla": lambda q, k, v: attention_xla(q, k, v, lengths, None)[0]}
      outs = {}
      for name, fn in impls.items():
        row = dict(D=D, T=T, impl=name)
        try:
          outs[name] = jax.jit(fn)(q, k, v).astype(jnp.float32)
          med, _, _ = benchutil.timeit(lambda i, q, k, v, fn=fn: fn(q, k, v)[0, 0, 0, 0],
                                       (q, k, v), inner=10, reps=a.reps)
          row.update(us=med * 1e6, kv_tbs=nbytes / med / 1e12)
        except Exception as e:  # noqa: BLE001
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        benchutil.log(row)
      if len(outs) == 2:
        err = float(jnp.max(jnp.abs(outs["kernel"] - outs["xla"])))
        rows.append(dict(D=D, T=T, check="kernel vs xla max abs diff", err=err, ok=err < 3e-2))
        benchutil.log(rows[-1])
  if a.out:
    json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                   python=platform.python_version(), command=" ".join(sys.argv),
                   shape=dict(B=B, S=S, K=K, G=G, dtype="bfloat16"), rows=rows),
              open(a.out + ".json", "w"), indent=1)


if __name__ == "__main__":
  main()
