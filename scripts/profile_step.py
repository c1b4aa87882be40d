"""Where the time of one decode step goes (GPU): variants of the KV write and attention, and the
copies/converts of the whole cache found in the compiled HLO.

    JAXSPEC_KV_WRITE=bits|native|none python scripts/profile_step.py [--batch 32 --context 8192]
"""
import argparse
import functools
import json
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from jaxspec.attention import AttentionPlan  # noqa: E402
from jaxspec.config import llama31_8b_shape  # noqa: E402
from jaxspec.model import forward  # noqa: E402
from benchmark import random_cache, random_params  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--impl", default="auto")
    a = ap.parse_args()
    cfg = llama31_8b_shape(num_layers=a.layers)
    params = random_params(cfg)
    B, S = a.batch, a.context + 128
    cache = random_cache(cfg, B, S, np.full((B,), a.context, np.int32))

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache, tok):
        plan = AttentionPlan(lengths=cache.lengths, impl=a.impl)
        logits, cache = forward(cfg, params, tok[:, None], cache.lengths[:, None], cache, plan)
        return cache, jnp.argmax(logits[:, 0], -1).astype(jnp.int32)

    tok = jnp.zeros((B,), jnp.int32)
    compiled = step.lower(params, cache, tok).compile()
    shape = f"[{cfg.num_layers},{B},{cfg.num_kv_heads},{S},{cfg.head_dim}]"
    big = [ln.strip()[:180] for ln in compiled.as_text().splitlines()
           if shape in ln and any(op in ln for op in (" copy(", " convert(", "fusion(", "scatter("))
           and "ROOT" not in ln]
    res = {}
    for ctx_name, lengths in (("ctx", a.context), ("empty", 0)):
        c = cache.replace(lengths=jnp.full((B,), lengths, jnp.int32))
        for _ in range(3):
            c, tok = step(params, c, tok)
        jax.block_until_ready(tok)
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            c, tok = step(params, c.replace(lengths=jnp.full((B,), lengths, jnp.int32)), tok)
            jax.block_until_ready(tok)
            ts.append(time.perf_counter() - t)
        res[ctx_name + "_ms"] = statistics.median(ts) * 1e3
        cache = c
    print(json.dumps({"kv_write": os.environ.get("JAXSPEC_KV_WRITE", "bits"), "impl": a.impl,
                      **res, "big_ops": len(big)}))
    for ln in big[:8]:
        print("   ", ln)


if __name__ == "__main__":
    main()
