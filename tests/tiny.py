"""Tiny random jaxspec models for engine tests (no transformers needed)."""

import jax
import jax.numpy as jnp

import jaxspec
from jaxspec.model import init_params


def tiny_config(vocab=64, layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ctx=512, **kw):
    return jaxspec.ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden,
                               intermediate_size=2 * hidden, num_layers=layers, num_heads=heads,
                               num_kv_heads=kv_heads, head_dim=head_dim,
                               max_position_embeddings=ctx, **kw)


def tiny_model(seed=0, dtype=jnp.float32, scale=1.0, **kw):
    cfg = tiny_config(**kw)
    params = init_params(cfg, jax.random.PRNGKey(seed), dtype=dtype)
    if scale != 1.0:  # sharper distributions
        params = dict(params)
        params["embed"] = params["embed"] * scale
    return jaxspec.Model(config=cfg, params=params)
