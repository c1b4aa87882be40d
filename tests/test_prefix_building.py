"""Building shared-prefix caches (`jaxspec.prefix`): prefix levels padded to a fixed slot count,
suffix prefill in row blocks and with the chunk shapes of a longer suffix, and un-sharing a
prefixed cache all write the K/V that a plain prefill of the whole prompts
(`jaxspec.prefill.prefill`) writes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.cache import KVCache
from jaxspec.model import param_shapes
from jaxspec.prefill import prefill
from jaxspec.prefix import build_prefix, plan_sharing, prefill_shared, unshare_cache

from tiny import tiny_config


@pytest.fixture(scope="module")
def model():
    """A tiny random model drawn on the host (no compiled init)."""
    cfg = tiny_config()
    rng = np.random.default_rng(0)

    def draw(sd):
        return jnp.asarray(rng.standard_normal(sd.shape).astype(np.float32) / 3.0)

    params = jax.tree_util.tree_map(draw, param_shapes(cfg, jnp.float32))
    return jaxspec.Model(config=cfg, params=params)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 64, size=40).tolist()
    return [doc + rng.integers(0, 64, size=k).tolist() for k in (3, 6, 2, 5, 4)]


@pytest.fixture(scope="module")
def plain(model, prompts):
    """Every row's K/V from a plain prefill of the whole prompt (all but its last token)."""
    cfg, params = model.config, model.params
    return prefill(cfg, params, KVCache.create(cfg, len(prompts), 128, dtype=jnp.float32),
                   [r[:-1] for r in prompts], chunk=16)


def _valid(x_LBKSD, lengths):
    return [np.asarray(x_LBKSD[:, b, :, :int(n)]) for b, n in enumerate(np.asarray(lengths))]


def _assert_same_kv(got: KVCache, ref: KVCache):
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(ref.lengths))
    for a, b in zip(_valid(got.k, got.lengths), _valid(ref.k, ref.lengths)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for a, b in zip(_valid(got.v, got.lengths), _valid(ref.v, ref.lengths)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_prefix_padded_to_slots(model, prompts):
    cfg, params = model.config, model.params
    rows, share = plan_sharing(prompts, 40)
    unpadded = build_prefix(cfg, params, share, chunk=16)
    padded = build_prefix(cfg, params, share, chunk=16, slots=64)
    assert padded[0].k.shape[2] == 64 and unpadded[0].k.shape[2] == 48
    np.testing.assert_array_equal(np.asarray(padded[0].k[:, :, :40]),
                                  np.asarray(unpadded[0].k[:, :, :40]))
    np.testing.assert_array_equal(np.asarray(padded[0].v[:, :, :40]),
                                  np.asarray(unpadded[0].v[:, :, :40]))
    np.testing.assert_array_equal(np.asarray(padded[0].lengths), [40])
    with pytest.raises(ValueError, match="slots"):
        build_prefix(cfg, params, share, chunk=16, slots=32)


def test_row_blocks_then_unshare_equal_plain_prefill(model, prompts, plain):
    """Suffixes prefilled in blocks of rows [0,2), [2,4), [3,5) after a padded prefix, then
    un-shared: each row holds prefix + suffix, the K/V a plain prefill of the whole prompt
    writes."""
    cfg, params = model.config, model.params
    rows, share = plan_sharing(prompts, 40)
    padded = build_prefix(cfg, params, share, chunk=16, slots=64)
    blocks = prefill_shared(cfg, params, rows, share, S=128, chunk=16, prefix_levels=padded,
                            row_block=2)
    np.testing.assert_array_equal(np.asarray(blocks.lengths), [len(r) - 41 for r in rows])
    flat = unshare_cache(blocks, 128)
    assert isinstance(flat, KVCache) and not hasattr(flat, "prefix") and flat.max_len == 128
    _assert_same_kv(flat, plain)


def test_suffix_width_and_row_blocks_keep_kv(model, prompts, plain):
    """The chunk shapes of a longer suffix (``width``), with or without row blocks, write the same
    K/V; a width past the cache is refused."""
    cfg, params = model.config, model.params
    rows, share = plan_sharing(prompts, 40)
    for row_block in (None, 3):
        wide = prefill_shared(cfg, params, rows, share, S=128, chunk=16, width=40,
                              row_block=row_block)
        _assert_same_kv(unshare_cache(wide, 128), plain)
    with pytest.raises(ValueError, match="slots"):
        prefill_shared(cfg, params, rows, share, S=32, chunk=16, width=40)


def test_prefill_width_keeps_kv(model, prompts, plain):
    """`jaxspec.prefill.prefill` with the chunk shapes of longer rows writes the same K/V."""
    cfg, params = model.config, model.params
    wide = prefill(cfg, params, KVCache.create(cfg, len(prompts), 128, dtype=jnp.float32),
                   [r[:-1] for r in prompts], chunk=16, width=80)
    _assert_same_kv(wide, plain)
