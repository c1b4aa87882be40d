"""The CPU attention path reads only the context: blocked over keys with a trip count set by the
longest context, merged with the new tokens by log-sum-exp; it computes what the plain-jnp
reference computes, and a decode step's cost follows the context, not the cache's size."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.attention import attention_xla, blocked_attention

from tiny import tiny_model


@pytest.mark.parametrize("case", ["decode", "verify", "tree", "t_new_gt_t", "empty_rows"])
def test_blocked_attention_equals_the_reference(case):
    rng = np.random.default_rng()  # fresh inputs every run
    B, K, G, S, D, L = 3, 2, 2, 384, 16, 2
    T, T_new, mask = {"decode": (1, 1, None), "verify": (5, 5, None), "tree": (4, 4, "tree"),
                      "t_new_gt_t": (2, 5, "tree"), "empty_rows": (3, 3, None)}[case]
    q = jnp.asarray(rng.normal(size=(B, T, K * G, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(L, B, K, S, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(L, B, K, S, D)), jnp.float32)
    lengths = rng.integers(1, S - T_new, size=B)
    if case == "empty_rows":
        lengths[1] = 0
    lengths = jnp.asarray(lengths, jnp.int32)
    m = None
    if mask == "tree":  # ancestors: a random forest over the new tokens, each sees itself
        par = [-1] + [int(rng.integers(0, j)) for j in range(1, T_new)]
        anc = np.eye(T_new, dtype=bool)
        for j in range(T_new):
            p = par[j]
            while p >= 0:
                anc[j, p] = True
                p = par[p]
        m = jnp.asarray(anc[T_new - T:])
    for layer in range(L):
        o1, l1 = blocked_attention(q, k, v, lengths, m, layer=layer, num_new=T_new, block=128)
        o2, l2 = attention_xla(q, k[layer], v[layer], lengths, m, num_new=T_new)
        np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=2e-5, atol=2e-5)
        assert np.isfinite(np.asarray(o1)).all()


def test_blocked_attention_reads_no_slot_past_the_context():
    """Garbage (NaN) past every row's context and new tokens must not reach the output."""
    rng = np.random.default_rng()
    B, K, G, S, D = 2, 1, 2, 512, 8
    lengths = np.array([100, 37])
    k = rng.normal(size=(1, B, K, S, D)).astype(np.float32)
    v = rng.normal(size=(1, B, K, S, D)).astype(np.float32)
    for b, n in enumerate(lengths):
        k[:, b, :, n + 3:] = np.nan
        v[:, b, :, n + 3:] = np.nan
    q = jnp.asarray(rng.normal(size=(B, 3, K * G, D)), jnp.float32)
    o, lse = blocked_attention(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths, jnp.int32),
                               layer=0, num_new=3)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(lse)).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_decode_cost_follows_the_context_not_the_cache(dtype):
    """A decode step at max_len 8192 with ~100-token contexts costs at most 1.3x a step at max_len
    128 (a dense pass over every slot costs tens of times more there; so does a 16-bit cache that
    the backend converts whole around each update): a ratio of the best of several interleaved
    runs, not a timed bound."""
    model = tiny_model(seed=0, layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16,
                       ctx=16384, dtype=jnp.dtype(dtype))
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, 64, size=(4, 70)).tolist()  # contexts of 70-118 tokens

    def step(max_len):
        r = jaxspec.generate(model, prompts, max_new_tokens=48, max_len=max_len, ignore_eos=True)
        return r.stats["decode_seconds"] / r.stats["target_steps"]

    step(128), step(8192)  # compile both
    small, large = [], []
    for _ in range(7):  # interleaved pairs: a busy machine slows both of a pair alike
        small.append(step(128))
        large.append(step(8192))
    ratios = [a / b for a, b in zip(large, small)]
    assert min(ratios) <= 1.3, (ratios, large, small)


def test_a_bfloat16_model_decodes_in_float32_on_the_cpu():
    """On the CPU a 16-bit model decodes in float32 (`jaxspec.cache.compute_dtype`): weights,
    activations and K/V cache; the tokens are those of the same weights loaded in float32, plain
    and speculative, and the caller's model keeps its dtype. The kernels' interpret mode keeps
    the model's dtype (it stands for the GPU)."""
    from jaxspec.session import Decoder
    model = tiny_model(seed=4, scale=3.0, dtype=jnp.bfloat16)
    f32 = tiny_model(seed=4, scale=3.0, dtype=jnp.bfloat16)
    f32.params = jax.tree.map(lambda x: x.astype(jnp.float32), f32.params)
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 64, size=int(n)).tolist() for n in rng.integers(3, 40, size=3)]
    spec = jaxspec.Speculation(draft="self", gamma=3, sink=2, window=6, adaptive=False)
    dec = Decoder(model, None)
    assert dec.cache_dtype == jnp.float32 and dec.params["embed"].dtype == jnp.float32
    assert Decoder(model, None, attn_impl="interpret").cache_dtype == jnp.bfloat16
    for s in (None, spec):
        got = jaxspec.generate(model, prompts, max_new_tokens=12, speculation=s).tokens
        assert got == jaxspec.generate(f32, prompts, max_new_tokens=12, speculation=s).tokens
    assert model.dtype == jnp.bfloat16
