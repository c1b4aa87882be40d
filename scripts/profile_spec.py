"""Where the time of a speculative round goes (GPU): standalone plain / draft / verify step costs
(`profile=True`), whole-loop time, and copies of the whole KV cache in the compiled loop.

    python scripts/profile_spec.py [--batch 64 --context 7680 --gamma 3]
"""
import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import jaxspec  # noqa: E402
from jaxspec import sampling, speculative as S  # noqa: E402
from jaxspec.cache import KVCache  # noqa: E402
from jaxspec.engine import DecodeState  # noqa: E402
from jaxspec.model import init_params  # noqa: E402

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
               rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=7680)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--impl", default="auto")
    a = ap.parse_args()
    cfg = jaxspec.ModelConfig(**SMOLLM2)
    model = jaxspec.Model(config=cfg, params=init_params(cfg, jax.random.PRNGKey(0),
                                                         dtype=jnp.bfloat16))
    B = a.batch
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, size=(B, a.context)).tolist()
    spec = jaxspec.Speculation(draft="self", gamma=a.gamma, sink=16, window=496)
    for name, sp_ in (("ar", None), ("spec", spec)):
        for _ in range(2):
            r = jaxspec.generate(model, prompts, max_new_tokens=64, speculation=sp_,
                                 profile=True, attn_impl=a.impl)
        print(name, json.dumps({k: v for k, v in r.stats.items()}, default=str))
    # copies of the whole cache inside the compiled speculative loop
    S_ = r.stats["max_len"]
    cache = KVCache.create(cfg, B, S_, jnp.bfloat16, abstract=True)
    st = DecodeState(cache=cache, last=jax.ShapeDtypeStruct((B,), jnp.int32),
                     out=jax.ShapeDtypeStruct((B, 80), jnp.int32),
                     n_out=jax.ShapeDtypeStruct((B,), jnp.int32),
                     budget=jax.ShapeDtypeStruct((B,), jnp.int32),
                     done=jax.ShapeDtypeStruct((B,), bool), rng=jax.random.PRNGKey(0),
                     steps=jax.ShapeDtypeStruct((), jnp.int32))
    loop = S.SpecLoop(config=cfg, stop_ids=(), gamma=a.gamma, sink=16, window=496, greedy=True,
                      impl=a.impl)
    ds = S.DraftState(cache=KVCache.create(cfg, 1, 1, jnp.bfloat16, abstract=True),
                      prev=jax.ShapeDtypeStruct((B,), jnp.int32))
    sp = sampling.SamplingParams.make(B, temperature=0.0)
    txt = S._run_spec.lower(model.params, jnp.zeros(()), sp, st, ds, loop=loop).compile().as_text()
    shape = f"[{cfg.num_layers},{B},{cfg.num_kv_heads},{S_},{cfg.head_dim}]"
    hits = [ln.strip()[:200] for ln in txt.splitlines()
            if shape in ln and " = " in ln and any(k in ln.split(" = ", 1)[1][:60]
                                                  for k in ("copy", "fusion(", "scatter("))]
    print("ops producing a whole-cache array:", len(hits))
    for h in hits[:12]:
        print("   ", h)


if __name__ == "__main__":
    main()
