"""Paged K/V (`jaxspec.paged`): a batch whose cache is a shuffled block pool decodes exactly as the
same batch with a dense cache, for plain steps, speculative chains, token trees (whose accepted
paths are compacted through the block table) and sampling with a seed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import Speculation
from jaxspec.paged import PagedKVCache, gather_view, write_pages
from jaxspec.session import Decoder

from tiny import tiny_model


def _to_paged(cache, page_size, rng, spare=3):
    """The dense cache's rows copied into a pool of shuffled blocks (plus spare unused blocks)."""
    L, B, K, S, D = cache.k.shape
    MB = S // page_size
    NB = B * MB + spare
    perm = rng.permutation(NB)[:B * MB].reshape(B, MB)
    k = np.zeros((L, NB, K, page_size, D), np.asarray(cache.k).dtype)
    v = np.zeros_like(k)
    ck, cv = np.asarray(cache.k), np.asarray(cache.v)
    for b in range(B):
        for j in range(MB):
            sl = slice(j * page_size, (j + 1) * page_size)
            k[:, perm[b, j]] = ck[:, b, :, sl]
            v[:, perm[b, j]] = cv[:, b, :, sl]
    return PagedKVCache(k=jnp.asarray(k), v=jnp.asarray(v), lengths=cache.lengths,
                        block_table=jnp.asarray(perm, jnp.int32))


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, scale=3.0)


SPECS = {
    "plain": None,
    "chain": Speculation(draft="self", gamma=3, sink=2, window=10, adaptive=False),
    "tree": Speculation(draft="self", sink=2, window=10, tree=(2, 2, 1), adaptive=False),
    "dense_draft": Speculation(draft="self", gamma=4, sink=0, window=None, adaptive=False),
}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_paged_decoding_equals_dense(target, name, temperature):
    if name == "dense_draft" and temperature > 0:
        pytest.skip("covered by the greedy case")
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 64, size=int(n)).tolist() for n in rng.integers(5, 70, size=4)]
    dec = Decoder(target, SPECS[name])
    kw = dict(max_new_tokens=30, temperature=temperature, seed=5, max_len=128)
    dense = dec.prepare(prompts, **kw)
    dec.decode(dense)
    paged = dec.prepare(prompts, **kw)
    paged.state = paged.state.replace(cache=_to_paged(paged.state.cache, 16, rng))
    dec.decode(paged)
    a, b = dec.result(dense), dec.result(paged)
    assert a.tokens == b.tokens
    assert sum(len(t) for t in a.tokens) > 4 * 20
    if name != "plain":
        assert a.stats["acceptance_rate"] == b.stats["acceptance_rate"]


@pytest.mark.parametrize("name", ["plain", "chain"])
def test_paged_kernel_in_the_model_equals_dense(target, name):
    """The model's attention on a paged cache through the paged Pallas kernel (interpret mode,
    as on a GPU) decodes exactly as the dense cache through the jnp path."""
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 64, size=int(n)).tolist() for n in rng.integers(5, 40, size=2)]
    kw = dict(max_new_tokens=6, temperature=0.0, max_len=64)
    ref = Decoder(target, SPECS[name])
    dense = ref.prepare(prompts, **kw)
    ref.decode(dense)
    dec = Decoder(target, SPECS[name], attn_impl="interpret")
    paged = dec.prepare(prompts, **kw)
    paged.state = paged.state.replace(cache=_to_paged(paged.state.cache, 16, rng))
    dec.decode(paged)
    assert ref.result(dense).tokens == dec.result(paged).tokens


def test_write_and_view_through_the_table():
    """Writes land in the mapped block at the right offset, nothing else changes, slots past a
    row's blocks are dropped, and the view reads a row's blocks in table order."""
    rng = np.random.default_rng()
    L, NB, K, BS, D, B, MB = 2, 7, 2, 4, 3, 2, 3
    pages = jnp.asarray(rng.normal(size=(L, NB, K, BS, D)), jnp.float32)
    table = jnp.asarray([[5, 1, NB], [0, 6, 2]], jnp.int32)
    slots = jnp.asarray([[3, 4, 9], [0, 11, 7]], jnp.int32)  # row 0's slot 9 has no block
    new = jnp.asarray(rng.normal(size=(B, 3, K, D)), jnp.float32)
    out = np.asarray(write_pages(pages, 1, table, slots, new))
    want = np.asarray(pages).copy()
    for b in range(B):
        for t in range(3):
            s = int(slots[b, t])
            blk = int(table[b, s // BS])
            if blk < NB:
                want[1, blk, :, s % BS] = np.asarray(new[b, t])
    np.testing.assert_array_equal(out, want)
    view = np.asarray(gather_view(jnp.asarray(out), 1, table))  # [B, K, MB * BS, D]
    for b in range(B):
        for j in range(MB):
            blk = int(table[b, j])
            if blk < NB:
                np.testing.assert_array_equal(view[b, :, j * BS:(j + 1) * BS], out[1, blk])
