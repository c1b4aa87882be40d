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


@pytest.mark.parametrize("temperature,name", [
    (t, n) for t in (0.0, 1.0) for n in SPECS])
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


# plain steps (T = 1) through the kernel: the paged server tests and the kernel's own tests
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


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_shared_context_attention_equals_reading_every_row(impl):
    """Attention over a pool whose rows begin with the same blocks, with those blocks' copy read
    once for the sharing rows (`SharedContext`) and each row's own blocks after them, equals the
    attention that reads every row's blocks (float32): plain steps, a causal chain and a tree
    mask per row, both layers; a non-sharing row, a row whose context is shorter than the shared
    part (read alone) and an inactive row are in the batch."""
    from jaxspec.attention import AttentionPlan, attend
    from jaxspec.paged import shared_context
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    L, NB, K, BS, D, B, H, MB = 2, 48, 2, 4, 16, 6, 4, 9
    kp = jnp.asarray(rng.normal(size=(L, NB, K, BS, D)), jnp.float32)
    vp = jnp.asarray(rng.normal(size=(L, NB, K, BS, D)), jnp.float32)
    order = [int(x) for x in rng.permutation(NB)]
    shared = [order.pop() for _ in range(3)]
    lengths = np.array([14, 21, 9, 26, 5, 17], np.int32)
    members = np.array([True, True, False, True, True, True])  # row 4: 5 < 12 shared slots
    tables = np.full((B, MB), NB, np.int32)
    for b in range(B):
        own = list(shared) if members[b] else []
        while len(own) * BS < lengths[b] + 6:
            own.append(order.pop())
        tables[b, :len(own)] = own
    tab = jnp.asarray(tables)
    sh = shared_context(kp, vp, tab[0], jnp.int32(len(shared) * BS), jnp.asarray(members))
    active = jnp.asarray([True, True, True, True, True, False])
    tree = jnp.asarray(rng.random((B, 3, 3)) < 0.5) | jnp.eye(3, dtype=bool)[None]
    run = jax.jit(lambda q, layer, plan: attend(q, kp, vp, layer, plan))
    # the kernels in interpret mode are slow on the CPU: one case of theirs (a tree, layer 1)
    cases = ((1, None), (3, None), (3, tree)) if impl == "xla" else ((3, tree),)
    for T, mask in cases:
        q = jnp.asarray(rng.normal(size=(B, T, H, D)), jnp.float32)
        plan = AttentionPlan(lengths=jnp.asarray(lengths), mask=mask, block_table=tab, impl=impl,
                             active=active)
        for layer in range(L) if impl == "xla" else (1,):
            want = run(q, layer, plan)
            got = run(q, layer, plan.replace(shared=sh))
            np.testing.assert_allclose(np.asarray(got)[:5], np.asarray(want)[:5], rtol=2e-5,
                                       atol=2e-5, err_msg=f"T={T} mask={mask is not None}")
            assert np.isfinite(np.asarray(got)).all()
        # a sparse (StreamingLLM) view reads its few keys per row: the shared copy is not used
        sparse = plan.replace(sink=2, window=4, impl="xla")
        np.testing.assert_array_equal(np.asarray(run(q, 0, sparse.replace(shared=sh))),
                                      np.asarray(run(q, 0, sparse)))


def test_paged_prefill_keeps_its_programs_by_shape(target):
    """`prefill_paged_row` with a ``programs`` dict compiles one program per chunk shape and runs
    it again for any pool of those shapes (one that came out of other programs too), writing
    what the jit path writes: the K/V of a dense prefill of the same tokens."""
    from jaxspec.cache import KVCache
    from jaxspec.prefill import bucket, prefill_paged_row, prefill_row
    cfg, params = target.config, target.params
    rng = np.random.default_rng()
    n = int(rng.integers(40, 60))
    tokens = rng.integers(2, cfg.vocab_size, size=n).tolist()
    pool = PagedKVCache.create(cfg, 2, 12, 8, 8, dtype=jnp.float32)
    pool = pool.replace(block_table=pool.block_table.at[1].set(
        jnp.asarray(rng.permutation(12)[:8], jnp.int32)))
    programs = {}
    a = prefill_paged_row(cfg, params, pool, 1, tokens, 0, impl="xla", chunk=32,
                          programs=programs)
    shapes = {32, bucket(n - 32, 32)[0]}  # a chunk of 32, then the rest in a power of two
    assert len(programs) == len(shapes)
    b = prefill_paged_row(cfg, params, jax.jit(lambda c: c)(a), 1, tokens, 0, impl="xla",
                          chunk=32, programs=programs)
    assert len(programs) == len(shapes)
    dense = prefill_row(cfg, params, KVCache.create(cfg, 2, 64, dtype=jnp.float32), 1, tokens,
                        impl="xla", chunk=32)
    for got in (a, b):
        assert int(got.lengths[1]) == n
        view = gather_view(got.k, 0, got.block_table[1:2])
        np.testing.assert_allclose(np.asarray(view)[0, :, :n], np.asarray(dense.k)[0, 1, :, :n],
                                   rtol=1e-5, atol=1e-5)
