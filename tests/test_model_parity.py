"""Logits and greedy-generation parity with transformers' PyTorch models (tiny random configs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.attention import AttentionPlan
from jaxspec.cache import KVCache
from jaxspec.model import forward

from hf_models import VARIANTS, convert_hf, jax_logits, make_hf_model, torch_greedy, torch_logits


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant, tmp_path):
    hf = make_hf_model(variant, seed=len(variant))
    model = convert_hf(hf, tmp_path)
    rng = np.random.default_rng(len(variant))
    tokens = rng.integers(0, hf.config.vocab_size, size=(3, 40))
    ours = jax_logits(model, tokens)
    ref = torch_logits(hf, tokens)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    # and the reference is not trivially small: the tolerance means something
    assert np.abs(ref).max() > 0.5


@pytest.mark.parametrize("variant", [
    "llama3-rope", "qwen2-yarn", "qwen3", "qwen2-bias", "llama-gqa", "llama-bias"])
def test_incremental_decode_matches_full_forward(variant, tmp_path):
    """Chunked prefill + one-token steps give the logits of one full forward pass."""
    hf = make_hf_model(variant, seed=3)
    model = convert_hf(hf, tmp_path)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, hf.config.vocab_size, size=(2, 37))
    ref = torch_logits(hf, tokens)
    cfg = model.config
    cache = KVCache.create(cfg, 2, 64, dtype=jnp.float32)
    got = []
    start = 0
    for size in (16, 16, 1, 1, 3):
        chunk = tokens[:, start:start + size]
        T = chunk.shape[1]
        pos = jnp.broadcast_to(start + jnp.arange(T, dtype=jnp.int32), (2, T))
        plan = AttentionPlan(lengths=jnp.full((2,), start, jnp.int32), impl="xla")
        logits, cache = forward(cfg, model.params, jnp.asarray(chunk), pos, cache, plan)
        got.append(np.asarray(logits))
        start += T
    got = np.concatenate(got, axis=1)
    np.testing.assert_allclose(got, ref[:, :start], atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mqa-tied", "qwen2-bias", "llama-bias",
                                     "qwen2-yarn", "qwen3", "qwen3-bias"])
def test_greedy_generate_matches_transformers(variant, tmp_path):
    hf = make_hf_model(variant, seed=11)
    model = convert_hf(hf, tmp_path)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, hf.config.vocab_size, size=n).tolist() for n in (1, 7, 23, 12)]
    res = jaxspec.generate(model, prompts, max_new_tokens=14, prefill_chunk=16)
    for p, got in zip(prompts, res.tokens):
        assert got == torch_greedy(hf, p, 14)
    assert res.stats["new_tokens"] == sum(len(t) for t in res.tokens)
    assert res.stats["tokens_per_second"] > 0


def test_generation_stops_at_eos_per_sequence(tmp_path):
    hf = make_hf_model("llama-gqa", seed=2)
    model0 = convert_hf(hf, tmp_path)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 101, size=n).tolist() for n in (5, 9, 3)]
    free = jaxspec.generate(model0, prompts, max_new_tokens=12).tokens
    # make the 4th token generated for prompt 1 a stop token: that row stops there, others go on
    stop = free[1][3]
    res = jaxspec.generate(model0, prompts, max_new_tokens=12, stop_tokens=[stop])
    for ref, got in zip(free, res.tokens):
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert got == ref[:cut]
    assert res.tokens[1][-1] == stop and len(res.tokens[1]) <= 4


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias", "llama-bias", "qwen3-bias"])
def test_per_layer_and_fused_layouts_match_transformers(variant, tmp_path):
    """The GPU decode layouts (per-layer arrays; fused wqkv / w_gateup) against the PyTorch model,
    and the fused layout stacks back to the stored parameters exactly."""
    from jaxspec.model import fuse_layer_params, stack_layers, unstack_layers
    hf = make_hf_model(variant, seed=3)
    model = convert_hf(hf, tmp_path)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, hf.config.vocab_size, size=(2, 24))
    ref = torch_logits(hf, tokens)
    per_layer = unstack_layers(model.params)
    fused = fuse_layer_params(per_layer)
    assert "wqkv" in fused["layers"][0] and "wq" not in fused["layers"][0]
    assert ("bqkv" in fused["layers"][0]) == model.config.attention_bias
    for params in (per_layer, fused):
        got = jax_logits(jaxspec.Model(config=model.config, params=params), tokens)
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    back = stack_layers(fused)
    for name, leaf in model.params["layers"].items():
        np.testing.assert_array_equal(np.asarray(back["layers"][name]), np.asarray(leaf))


def test_decode_params_fuses_on_one_device_and_generation_is_unchanged():
    """`sharding.decode_params` (per-layer and fused on one GPU; forced here with
    ``layout="unrolled"``) gives the tokens of the stacked layout, plain and speculative, and
    ``layout="scan"`` stacks the fused layers back into the stored names."""
    from tiny import tiny_model

    from jaxspec.sharding import decode_params
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (9, 23, 4)]
    spec = jaxspec.Speculation(draft="self", gamma=3, sink=2, window=6, adaptive=False)
    stacked = tiny_model(seed=4, scale=3.0)
    decode_params(stacked, layout="scan")  # the reference stays stacked on any backend
    ref = jaxspec.generate(stacked, prompts, max_new_tokens=16).tokens
    ref_spec = jaxspec.generate(stacked, prompts, max_new_tokens=16, speculation=spec).tokens
    assert ref_spec == ref
    fused = tiny_model(seed=4, scale=3.0)
    layers = decode_params(fused, layout="unrolled")["layers"]
    assert isinstance(layers, list) and {"wqkv", "w_gateup"} <= set(layers[0])
    assert not {"wq", "wk", "wv", "w_gate", "w_up"} & set(layers[0])
    # generate keeps the layout it finds
    assert jaxspec.generate(fused, prompts, max_new_tokens=16).tokens == ref
    assert jaxspec.generate(fused, prompts, max_new_tokens=16, speculation=spec).tokens == ref
    assert isinstance(fused.params["layers"], list) and "wqkv" in fused.params["layers"][0]
    apart = tiny_model(seed=4, scale=3.0)
    assert "wq" in decode_params(apart, layout="unrolled", fuse=False)["layers"][0]
    back = decode_params(fused, layout="scan")["layers"]
    for name, leaf in stacked.params["layers"].items():
        np.testing.assert_array_equal(np.asarray(back[name]), np.asarray(leaf))
