"""Mixed batches: a plain decode step and a piece of another row's prompt in one forward
(`jaxspec.model.forward_mixed`, `jaxspec.decoding.run_mixed_chunk`). Each part must be what its
own forward gives: the decode rows' logits and the K/V of both parts, against a decode step
followed by `jaxspec.prefill.prefill_paged_row` of the piece (float32, close; batch-invariant
bfloat16, bitwise)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import invariant
from jaxspec.attention import AttentionPlan
from jaxspec.model import forward, forward_mixed, fuse_layer_params, init_params, unstack_layers
from jaxspec.paged import PagedKVCache
from jaxspec.prefill import prefill_paged_row

from tiny import tiny_config

BS, MB = 8, 8  # block size, table entries per row


def _setup(rng, dtype, layout, **cfg):
    c = tiny_config(vocab=97, hidden=32, heads=4, kv_heads=2, head_dim=8, **cfg)
    params = init_params(c, jax.random.PRNGKey(int(rng.integers(1 << 30))), dtype=dtype)
    if layout != "scan":
        params = unstack_layers(params)
    if layout == "fused":
        params = fuse_layer_params(params)
    cache = PagedKVCache.create(c, 3, 3 * MB + 2, BS, MB, dtype=dtype)
    # rows' blocks scattered over the pool (row 2 gets the piece)
    perm = rng.permutation(3 * MB + 2)[:3 * MB].reshape(3, MB)
    cache = cache.replace(block_table=jnp.asarray(perm, jnp.int32))
    return c, params, cache


@pytest.mark.parametrize("layout", ["scan", "unrolled", "fused"])
@pytest.mark.parametrize("piece_start", [0, 16])
def test_a_piece_in_a_decode_step_equals_both_apart(layout, piece_start):
    rng = np.random.default_rng()
    c, params, cache = _setup(rng, jnp.float32, layout)
    impl = "xla"
    lens = [int(rng.integers(9, 30)), int(rng.integers(1, 30))]
    for row, n in enumerate(lens):
        cache = prefill_paged_row(c, params, cache, row, rng.integers(0, 97, n).tolist(), 0,
                                  impl=impl, chunk=16)
    if piece_start:  # row 2's first tokens already in (an earlier piece)
        cache = prefill_paged_row(c, params, cache, 2, rng.integers(0, 97, piece_start).tolist(),
                                  0, impl=impl, chunk=16)
    C = 16
    n_piece = int(rng.integers(1, C + 1))
    piece = rng.integers(0, 97, n_piece).tolist()
    tok = jnp.asarray(rng.integers(0, 97, (3, 1)), jnp.int32)
    lengths = cache.lengths
    active = jnp.asarray([True, True, False])
    plan = AttentionPlan(lengths=lengths, impl=impl, block_table=cache.block_table, active=active)
    pos = lengths[:, None]

    ref_logits, ref = forward(c, params, tok, pos, cache, plan)
    # (the prefill donates its cache: a copy, the original serves the mixed forward below)
    ref = prefill_paged_row(c, params, jax.tree.map(jnp.copy, ref), 2, piece, piece_start,
                            impl=impl, chunk=C)

    buf = np.zeros((1, C), np.int32)
    buf[0, :n_piece] = piece
    pplan = AttentionPlan(lengths=jnp.asarray([piece_start], jnp.int32), impl=impl,
                          block_table=cache.block_table[2:3])
    ppos = piece_start + jnp.arange(C, dtype=jnp.int32)[None]
    (logits, none), got = forward_mixed(
        c, params, [(tok, pos, plan, None), (jnp.asarray(buf), ppos, pplan, False)], cache)
    assert none is None
    np.testing.assert_allclose(np.asarray(logits[:2]), np.asarray(ref_logits[:2]), rtol=2e-5,
                               atol=2e-5)
    # every slot written: the decode rows' new K/V and the piece's (its padding too, as the
    # prefill pads its last chunk)
    np.testing.assert_allclose(np.asarray(got.k), np.asarray(ref.k), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got.v), np.asarray(ref.v), rtol=2e-5, atol=2e-5)
    # and the piece changed the pool (the check above is not vacuous)
    assert not np.allclose(np.asarray(got.k), np.asarray(cache.k))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_piece_in_a_decode_step_is_bitwise_with_invariant_numerics(dtype):
    """With batch-invariant numerics the decode rows get their decode step's bits and the piece
    (prompt tokens: ``AttentionPlan.prompt``, as `jaxspec.decoding` gives it) the bits a prefill
    gives it: its products and attention are the prompt forms (`jaxspec.invariant.prompt_matmul`,
    `prompt_attention`), other bits than a decode step's, which the piece taken as decode rows
    shows (products over K = 128 and attention over 150 keys: more than one block of each)."""
    rng = np.random.default_rng()
    bs, mb = 16, 16
    c = tiny_config(vocab=97, hidden=128, heads=4, kv_heads=2, head_dim=32)
    params = init_params(c, jax.random.PRNGKey(int(rng.integers(1 << 30))), dtype=dtype)
    cache = PagedKVCache.create(c, 3, 3 * mb + 2, bs, mb, dtype=dtype)
    perm = rng.permutation(3 * mb + 2)[:3 * mb].reshape(3, mb)
    cache = cache.replace(block_table=jnp.asarray(perm, jnp.int32))
    impl = invariant.invariant_impl("auto")
    for row, n in enumerate([int(rng.integers(130, 160)), int(rng.integers(1, 30))]):
        cache = prefill_paged_row(c, params, cache, row, rng.integers(0, 97, n).tolist(), 0,
                                  impl=impl, chunk=64)
    start = 144  # row 2's earlier pieces
    cache = prefill_paged_row(c, params, cache, 2, rng.integers(0, 97, start).tolist(), 0,
                              impl=impl, chunk=48)
    piece = rng.integers(0, 97, 16).tolist()
    tok = jnp.asarray(rng.integers(0, 97, (3, 1)), jnp.int32)
    plan = AttentionPlan(lengths=cache.lengths, impl=impl, block_table=cache.block_table,
                         active=jnp.asarray([True, True, False]))
    pos = cache.lengths[:, None]
    ref_logits, ref = forward(c, params, tok, pos, cache, plan)
    ref = prefill_paged_row(c, params, jax.tree.map(jnp.copy, ref), 2, piece, start, impl=impl,
                            chunk=16)

    def mixed(prompt):
        pplan = AttentionPlan(lengths=jnp.full((1,), start, jnp.int32), impl=impl,
                              block_table=cache.block_table[2:3], prompt=prompt)
        ppos = start + jnp.arange(16)[None]
        return forward_mixed(c, params, [(tok, pos, plan, None),
                                         (jnp.asarray([piece], jnp.int32), ppos, pplan, False)],
                             cache)

    (logits, _), got = mixed(True)
    assert np.array_equal(np.asarray(logits[:2]), np.asarray(ref_logits[:2]))
    assert np.array_equal(np.asarray(got.k), np.asarray(ref.k))
    assert np.array_equal(np.asarray(got.v), np.asarray(ref.v))
    if dtype == jnp.float32:  # (bf16 rounding may hide the difference in a tiny model)
        _, as_decode = mixed(False)
        assert not np.array_equal(np.asarray(as_decode.k), np.asarray(ref.k))


def test_segments_must_share_one_implementation():
    rng = np.random.default_rng(0)
    c, params, cache = _setup(rng, jnp.float32, "scan")
    a = AttentionPlan(lengths=cache.lengths, impl="xla", block_table=cache.block_table)
    b = AttentionPlan(lengths=cache.lengths[:1], impl="auto", block_table=cache.block_table[:1])
    t = jnp.zeros((3, 1), jnp.int32)
    with pytest.raises(ValueError, match="one attention implementation"):
        forward_mixed(c, params, [(t, t, a, None), (t[:1], t[:1], b, False)], cache)


# ----------------------------------------------------------------------------- mixed chunks
@pytest.mark.parametrize("kind", ["plain", "chain", "tree"])
def test_a_mixed_chunk_prefills_as_prefill_and_decodes_as_a_chunk(kind):
    """`run_mixed_chunk`: rows 1 and 2 decode while row 0's prompt goes in, one piece per round
    (the last one short). Row 0's K/V equal `prefill_paged_row`'s, and rows 1 and 2 commit what
    a chunk of the same rounds without pieces commits (greedy, float32), for plain steps, chain
    and tree speculation (a tree round must not move an idle row's slots)."""
    from jaxspec import Speculation
    from jaxspec.decoding import Pieces, run_chunk, run_mixed_chunk, set_block_tables, set_rows
    from jaxspec.serving import ServingEngine
    from serverkit import served_model

    model = served_model(eos=False)
    spec = None if kind == "plain" else Speculation(
        draft="self", gamma=2, tree=(2, 2) if kind == "tree" else None, sink=2, window=6,
        adaptive=False)
    e = ServingEngine(model, max_batch=3, max_len=128, rounds_per_chunk=4, prefill_chunk=16,
                      page_size=8, speculation=spec, mixed_prefill=8)
    rd, dec, MB = e._round(True), e.decoder, e.max_blocks
    rng = np.random.default_rng()
    st = set_block_tables(e.state, np.arange(3, dtype=np.int32),
                          rng.permutation(e.n_blocks)[:3 * MB].reshape(3, MB).astype(np.int32))
    prompts = [rng.integers(5, 60, size=n).tolist() for n in (20, 19, 12)]
    for b in (1, 2):  # the decoding rows
        st = dec.prefill_paged_row(st, b, prompts[b][:-1], 0)
    st = set_rows(st, np.asarray([1, 2, 3], np.int32),
                  np.asarray([prompts[1][-1], prompts[2][-1], 0], np.int32),
                  np.asarray([12, 12, 0], np.int32), np.zeros((3, 2), np.uint32),
                  np.asarray([len(prompts[1]) - 1, len(prompts[2]) - 1, 0], np.int32))
    fill, C = prompts[0][:-1], 8  # 19 tokens: pieces of 8, 8, 3
    tokens = np.zeros((4, C), np.int32)
    starts = np.arange(4, dtype=np.int32) * C
    ends = np.minimum(starts + C, len(fill)).astype(np.int32)
    for i in range(3):
        tokens[i, :ends[i] - starts[i]] = fill[starts[i]:ends[i]]
    pieces = Pieces(tokens=tokens, rows=np.zeros(4, np.int32), starts=starts, ends=ends)
    sp = e._sampling(True, False)

    got, outs = run_mixed_chunk(dec.params, dec.dparams, sp, jax.tree.map(jnp.copy, st),
                                jnp.int32(3), pieces, rd=rd)
    ref = dec.prefill_paged_row(jax.tree.map(jnp.copy, st), 0, fill, 0)
    ref, ref_outs = run_chunk(dec.params, dec.dparams, sp, ref, jnp.int32(3), rd=rd)

    assert int(got.cache.lengths[0]) == len(fill) and int(outs.steps) == 3
    blocks = np.asarray(st.cache.block_table[0])[:-(-len(fill) // 8)]

    def row0(pool):  # row 0's slots in order: [L, slots, K, D]
        x = np.asarray(pool)[:, blocks].transpose(0, 1, 3, 2, 4)
        return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :len(fill)]

    for a, b in ((got.cache.k, ref.cache.k), (got.cache.v, ref.cache.v)):
        np.testing.assert_allclose(row0(a), row0(b), rtol=2e-5, atol=2e-5)
    n = np.asarray(outs.n_out)
    assert n[0] == 0 and (n[1:] > 0).all()
    np.testing.assert_array_equal(n, np.asarray(ref_outs.n_out))
    for b in (1, 2):
        got_b, ref_b = np.asarray(outs.out)[b, :n[b]], np.asarray(ref_outs.out)[b, :n[b]]
        assert got_b.tolist() == ref_b.tolist()
