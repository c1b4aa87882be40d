"""Retrieval for the self-draft (`Speculation(retrieve=N)`, `jaxspec.retrieval`): the block scores,
the selection and the attention over sink + window + retrieved blocks against brute-force numpy;
speculation with retrieval is lossless (greedy in float32, and sampling keeps the target's exact
distribution) on one device, on a mesh and in the paged server; and retrieval is what raises the
acceptance where the window alone misses the context."""

import functools
import itertools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import Speculation
from jaxspec.attention import AttentionPlan, attend
from jaxspec.cache import KVCache
from jaxspec.model import forward
from jaxspec.retrieval import block_scores, select_blocks
from jaxspec.serving import SamplingOptions, Sequence, ServingEngine
from serverkit import served_model
from test_speculative import _chi2_pvalue
from tiny import tiny_model


def _seed():
    return random.randrange(1 << 30)


# ----------------------------------------------------------------------------- pieces
def test_block_scores_are_the_largest_logit_per_block():
    rng = np.random.default_rng(_seed())
    B, T, K, G, S, D, blk = 3, 2, 2, 3, 40, 8, 8
    q = rng.standard_normal((B, T, K * G, D)).astype(np.float32)
    k = rng.standard_normal((B, K, S, D)).astype(np.float32)
    lengths = np.array([40, 13, 0], np.int32)
    got = np.asarray(block_scores(jnp.asarray(q), jnp.asarray(k), jnp.asarray(lengths),
                                  block=blk, sm_scale=0.3))
    want = np.full((B, K, S // blk), -np.inf)
    for b, h, s in itertools.product(range(B), range(K), range(S)):
        if s < lengths[b]:
            logit = max(0.3 * float(q[b, t, h * G + g] @ k[b, h, s])
                        for t in range(T) for g in range(G))
            want[b, h, s // blk] = max(want[b, h, s // blk], logit)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_selection_takes_the_best_eligible_blocks():
    rng = np.random.default_rng(_seed())
    L, B, K, n, blk = 2, 4, 3, 10, 8
    scores = rng.standard_normal((L, B, K, n)).astype(np.float32)
    verified = np.array([80, 80, 30, 5], np.int32)
    lengths = verified + np.array([3, 0, 2, 1], np.int32)
    sink, window, count = 10, 12, 3
    got = np.asarray(select_blocks(jnp.asarray(scores), jnp.asarray(verified),
                                   jnp.asarray(lengths), sink=sink, window=window, block=blk,
                                   count=count))
    assert got.shape == (B, L, K, count)
    for l, b, h in itertools.product(range(L), range(B), range(K)):
        ok = [j for j in range(n) if (j + 1) * blk > sink
              and j * blk < min(verified[b], lengths[b] - window)]
        best = sorted(ok, key=lambda j: -scores[l, b, h, j])[:count]
        assert sorted(x for x in got[b, l, h] if x >= 0) == sorted(best)
        assert list(got[b, l, h]).count(-1) == count - len(best)


def _union_attention(q, k, v, lengths, sink, window, blocks, blk, T_new):
    """float64 numpy: each query over its row's sink, window, retrieved blocks (per KV head)
    and the causal new tokens."""
    B, T, H, D = q.shape
    K = k.shape[1]
    G = H // K
    out = np.zeros((B, T, H, D))
    for b, hq, t in itertools.product(range(B), range(H), range(T)):
        h, n = hq // G, int(lengths[b])
        keys = set(range(min(sink, n))) | set(range(max(n - window, sink, 0), n))
        for j in blocks[b, h]:
            if j >= 0:  # a block's context slots (those past the context are the new tokens')
                keys |= set(range(j * blk, min((j + 1) * blk, n)))
        keys |= {n + j for j in range(T_new - T + t + 1)}
        idx = sorted(keys)
        s = np.array([q[b, t, hq] @ k[b, h, i] for i in idx], np.float64) / np.sqrt(D)
        p = np.exp(s - s.max())
        out[b, t, hq] = (p / p.sum()) @ v[b, h, idx]
    return out


@pytest.mark.parametrize("impl,paged", [("xla", False), ("interpret", False), ("xla", True),
                                        ("interpret", True)])
def test_sparse_view_with_retrieved_blocks_is_attention_over_their_union(impl, paged):
    rng = np.random.default_rng(_seed())
    B, T, K, G, S, D, blk, Lyr = 2, 2, 2, 2, 128, 16, 16, 2
    sink, window = 3, 10
    lengths = np.array([100, 61], np.int32)
    q = rng.standard_normal((B, T, K * G, D)).astype(np.float32)
    k = rng.standard_normal((Lyr, B, K, S, D)).astype(np.float32)
    v = rng.standard_normal((Lyr, B, K, S, D)).astype(np.float32)
    blocks = np.full((B, Lyr, K, 3), -1, np.int32)
    for b, l, h in itertools.product(range(B), range(Lyr), range(K)):
        # blocks reaching into [sink, lengths - window) (into the sink or window too)
        ok = [j for j in range(S // blk) if (j + 1) * blk > sink
              and j * blk < lengths[b] - window]
        pick = rng.choice(ok, size=min(len(ok), int(rng.integers(1, 4))), replace=False)
        blocks[b, l, h, :len(pick)] = pick
    layer = 1
    kw = dict(sink=sink, window=window, impl=impl, retrieved=jnp.asarray(blocks),
              retrieve_block=blk)
    if paged:  # the same slots in a shuffled pool of 8-slot pages
        BS, MB = 8, S // 8
        perm = rng.permutation(B * MB).astype(np.int32)
        table = perm.reshape(B, MB)
        pool_k = np.zeros((Lyr, B * MB, K, BS, D), np.float32)
        pool_v = np.zeros_like(pool_k)
        for b, m in itertools.product(range(B), range(MB)):
            pool_k[:, table[b, m]] = k[:, b, :, m * BS:(m + 1) * BS]
            pool_v[:, table[b, m]] = v[:, b, :, m * BS:(m + 1) * BS]
        plan = AttentionPlan(lengths=jnp.asarray(lengths), block_table=jnp.asarray(table), **kw)
        got = attend(jnp.asarray(q), jnp.asarray(pool_k), jnp.asarray(pool_v), layer, plan)
    else:
        plan = AttentionPlan(lengths=jnp.asarray(lengths), **kw)
        got = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), layer, plan)
    want = _union_attention(q, k[layer], v[layer], lengths, sink, window, blocks[:, layer], blk,
                            T)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)
    if not paged:  # without the blocks: a different result (the blocks were read)
        plain = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), layer,
                       AttentionPlan(lengths=jnp.asarray(lengths), sink=sink, window=window,
                                     impl=impl))
        assert np.abs(np.asarray(plain) - want).max() > 1e-2


@pytest.mark.parametrize("T,tree,split", [(1, False, None), (5, False, 32), (3, True, 48)])
def test_the_kernel_writes_the_block_scores_while_it_reads(T, tree, split):
    """The decode kernel with ``score_block`` (interpret mode): the same output and lse as
    without, and scores equal to the reference's, over key splits, padded query rows, a tree
    mask and a stacked cache."""
    from pallas_kernels import DecodeAttentionBlockSizes, decode_attention
    from pallas_kernels.reference import block_max_reference
    rng = np.random.default_rng(_seed())
    B, K, G, S, D, Lyr, blk = 3, 2, 3, 128, 16, 2, 16
    q = jnp.asarray(rng.standard_normal((B, T, K * G, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((Lyr, B, K, S, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((Lyr, B, K, S, D)), jnp.float32)
    lengths = jnp.asarray([100, 37, 0], jnp.int32)
    # a tree: each node sees itself and some of the nodes before it
    mask = jnp.asarray((np.tri(T, dtype=bool) & (rng.random((T, T)) < 0.6))
                       | np.eye(T, dtype=bool)) if tree else None
    bs = DecodeAttentionBlockSizes(split_size=split)
    kw = dict(layer=1, interpret=True, block_sizes=bs, sm_scale=0.2)
    o, lse, sc = decode_attention(q, k, v, lengths, mask, score_block=blk, **kw)
    o0, lse0 = decode_attention(q, k, v, lengths, mask, **kw)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse0), rtol=1e-5, atol=1e-5)
    want = block_max_reference(q, k[1], lengths, block=blk, sm_scale=0.2)
    np.testing.assert_allclose(np.asarray(sc), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [None, 16])
def test_the_sparse_kernel_reads_retrieved_blocks_in_place(split):
    """The decode kernel with ``retrieved`` (interpret mode, one or several key splits) against
    the reference route (sparse reference + retrieved reference, merged)."""
    from pallas_kernels import DecodeAttentionBlockSizes, decode_attention
    rng = np.random.default_rng(_seed())
    B, K, G, S, D, blk, T = 2, 2, 2, 128, 16, 16, 3
    q = jnp.asarray(rng.standard_normal((B, T, K * G, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.float32)
    lengths = jnp.asarray([110, 50], jnp.int32)
    # blocks reaching into the sink (0) or the window (6; 2 for the second row) count once
    blocks = jnp.asarray([[[0, 4, 6], [5, 2, 3]], [[1, -1, -1], [-1, 2, -1]]], jnp.int32)
    kw = dict(sink=4, window=12, sm_scale=0.3, retrieved=blocks, retrieve_block=blk)
    got = decode_attention(q, k, v, lengths, interpret=True,
                           block_sizes=DecodeAttentionBlockSizes(split_size=split), **kw)
    want = decode_attention(q, k, v, lengths, **kw)  # the CPU route: references, merged
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page", [8, 32])
def test_the_paged_kernel_reads_blocks_and_writes_scores(page):
    """The paged kernel (interpret mode, several key splits) through shuffled block tables:
    retrieved blocks read in place and block scores written, against the dense references."""
    from pallas_kernels import (DecodeAttentionBlockSizes, decode_attention,
                                paged_decode_attention)
    rng = np.random.default_rng(_seed())
    B, K, G, S, D, blk, T = 2, 2, 2, 128, 16, 16, 3
    q = jnp.asarray(rng.standard_normal((B, T, K * G, D)), jnp.float32)
    k = rng.standard_normal((B, K, S, D)).astype(np.float32)
    v = rng.standard_normal((B, K, S, D)).astype(np.float32)
    MB = S // page
    table = rng.permutation(B * MB).astype(np.int32).reshape(B, MB)
    pk = np.zeros((B * MB, K, page, D), np.float32)
    pv = np.zeros_like(pk)
    for b, m in itertools.product(range(B), range(MB)):
        pk[table[b, m]] = k[b, :, m * page:(m + 1) * page]
        pv[table[b, m]] = v[b, :, m * page:(m + 1) * page]
    lengths = jnp.asarray([110, 50], jnp.int32)
    blocks = jnp.asarray([[[0, 4, 6], [5, 2, 3]], [[1, -1, -1], [-1, 2, -1]]], jnp.int32)
    bs = DecodeAttentionBlockSizes(split_size=32)
    paged = functools.partial(paged_decode_attention, q, jnp.asarray(pk), jnp.asarray(pv),
                              jnp.asarray(table), lengths, sm_scale=0.3, interpret=True,
                              block_sizes=bs)
    dense = functools.partial(decode_attention, q, jnp.asarray(k), jnp.asarray(v), lengths,
                              sm_scale=0.3)
    for kw in (dict(sink=4, window=12, retrieved=blocks, retrieve_block=blk),
               dict(score_block=blk)):
        for g, w in zip(paged(**kw), dense(**kw)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_a_kernel_tile_that_does_not_fit_falls_back_to_the_references(monkeypatch):
    """Where shared memory makes the plan halve the key tile (large head dims on a GPU), the
    scores and the retrieved blocks come from the references instead of an error."""
    from pallas_kernels import decode_attention, triton_core
    rng = np.random.default_rng(_seed())
    B, K, G, S, D = 2, 2, 2, 128, 16
    q = jnp.asarray(rng.standard_normal((B, 2, K * G, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.float32)
    lengths = jnp.asarray([100, 60], jnp.int32)
    blocks = jnp.asarray([[[1, 3], [2, -1]], [[1, -1], [-1, 2]]], jnp.int32)
    cases = (dict(score_block=16), dict(sink=4, window=8, retrieved=blocks, retrieve_block=16))
    want = [decode_attention(q, k, v, lengths, interpret=True, **kw) for kw in cases]

    refused = []

    def too_big(block_k, *, score_block, n_retrieved, retrieve_block):
        if score_block is not None or n_retrieved:
            refused.append(block_k)
            raise triton_core.BlockTileError("planned tile halved")
    monkeypatch.setattr(triton_core, "check_block_tile", too_big)
    jax.clear_caches()  # trace the kernel calls again
    for kw, w in zip(cases, want):
        got = decode_attention(q, k, v, lengths, interpret=True, **kw)
        for g, x in zip(got, w):
            np.testing.assert_allclose(np.asarray(g), np.asarray(x), rtol=1e-5, atol=1e-5)
    assert len(refused) == 2


def test_retrieval_through_the_kernels_is_lossless(target, long_prompts, reference):
    """Interpret mode: the verification's kernel writes the scores, the draft's sparse kernel
    merges with the retrieved blocks."""
    spec = Speculation(draft="self", gamma=3, sink=0, window=16, adaptive=False, retrieve=256)
    res = jaxspec.generate(target, long_prompts, max_new_tokens=12, speculation=spec,
                           attn_impl="interpret")
    assert res.tokens == [r[:12] for r in reference]


def test_rows_with_nothing_selected_read_the_blocks_before_the_window():
    from jaxspec.retrieval import with_recent
    rng = np.random.default_rng(_seed())
    B, L, K, R, blk, sink, window = 5, 3, 2, 3, 8, 10, 20
    blocks = rng.integers(0, 9, size=(B, L, K, R)).astype(np.int32)
    blocks[0] = -1  # a new row
    blocks[1, 2, 1] = -1  # one layer and head of a row with nothing eligible scored
    blocks[2, 0, 0, 1:] = -1  # fewer blocks than asked: kept as they are
    blocks[4] = -1
    lengths = np.array([100, 75, 60, 90, 25], np.int32)  # row 4: nothing past the sink
    got = np.asarray(with_recent(jnp.asarray(blocks), jnp.asarray(lengths), sink=sink,
                                 window=window, block=blk))
    want = blocks.copy()
    for b, l, k in itertools.product(range(B), range(L), range(K)):
        if (blocks[b, l, k] < 0).all():
            end = max(lengths[b] - window, 0)  # eligible slots [sink, end): newest blocks first
            js = [j for j in range(-(-end // blk) - 1, -1, -1) if (j + 1) * blk > sink][:R]
            want[b, l, k] = js + [-1] * (R - len(js))
    np.testing.assert_array_equal(got, want)


def test_a_new_rows_first_drafts_read_the_recent_view(target):
    """Before any verification, window 16 + two retrieved blocks of 64 read what a window of 144
    reads (prompts whose length less 16 is a multiple of 64): the first round's drafts are the
    same, so is their acceptance; the window of 16 alone gives another."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 64, size=16 + 64 * int(k)).tolist()
               for k in rng.integers(3, 7, size=24)]
    acc = {}
    for name, kw in (("retrieve", dict(window=16, retrieve=128)),
                     ("window", dict(window=144, retrieve=0)),
                     ("short", dict(window=16, retrieve=0))):
        spec = Speculation(draft="self", gamma=1, sink=0, adaptive=False, **kw)
        res = jaxspec.generate(target, prompts, max_new_tokens=2, speculation=spec)
        acc[name] = res.stats["acceptance_rate"]
    assert acc["retrieve"] == acc["window"] != acc["short"], acc


# ----------------------------------------------------------------------------- lossless
@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, ctx=2048)


@pytest.fixture(scope="module")
def long_prompts():
    rng = np.random.default_rng(_seed())
    return [rng.integers(0, 64, size=int(n)).tolist() for n in (300, 5, 420, 200)]


@pytest.fixture(scope="module")
def reference(target, long_prompts):
    return jaxspec.generate(target, long_prompts, max_new_tokens=48).tokens


def test_retrieval_is_lossless_and_raises_the_acceptance(target, long_prompts, reference):
    """A 16-slot window misses most of the context; 512 retrieved slots cover most of it: the
    drafts are accepted far more often, and the tokens stay plain greedy decoding's."""
    acc = {}
    for r in (0, 512):
        spec = Speculation(draft="self", gamma=3, sink=0, window=16, adaptive=False, retrieve=r)
        res = jaxspec.generate(target, long_prompts, max_new_tokens=48, speculation=spec)
        assert res.tokens == reference
        assert res.stats["draft_view"] == {"sink": 0, "window": 16, "retrieve": r}
        acc[r] = res.stats["acceptance_rate"]
    assert acc[512] > acc[0] + 0.3, acc
    res = jaxspec.generate(target, long_prompts, max_new_tokens=8, speculation=Speculation())
    assert res.stats["draft_view"] == {"sink": 16, "window": 496, "retrieve": 512}


def test_adaptive_stretches_keep_the_selection_across_plain_steps(target, long_prompts,
                                                                   reference, monkeypatch):
    """Speculative stretches and plain ones in turn: a plain stretch runs plain decoding's
    program on the state without its selection and puts the selection back."""
    from test_adaptive import _force_rounds
    _force_rounds(monkeypatch, ["spec", "plain", "spec", "plain", "plain", "spec"], rounds=3)
    spec = Speculation(gamma=3, sink=0, window=16, retrieve=256, adaptive=True)
    res = jaxspec.generate(target, long_prompts, max_new_tokens=48, speculation=spec)
    assert res.tokens == reference
    assert 0 < res.stats["plain_steps"] < res.stats["target_steps"]
    assert res.stats["acceptance_rate"] > 0


def test_a_compiled_plain_loop_is_found_for_a_state_with_a_selection(target, long_prompts):
    """Plain stretches run plain decoding's program on the state without its selection; the
    compiled-loop check gamma="auto" relies on looks that program up the same way."""
    from jaxspec.drafter import RetrievalState
    from jaxspec.session import Decoder
    dec = Decoder(target, Speculation(gamma=2, sink=0, window=16, retrieve=128))
    batch = dec.prepare(long_prompts, max_new_tokens=8)
    assert isinstance(batch.state.draft, RetrievalState)
    assert dec.compiled_gammas((0, 2), batch, batch.state) == set()
    plain = dec.round(0, greedy=batch.greedy, stop_ids=batch.stop_ids)
    st, _ = dec.run(plain, batch.sp, batch.state, 2)
    assert isinstance(st.draft, RetrievalState)  # put back
    assert dec.compiled_gammas((0, 2), batch, st) == {0}


def test_tree_speculation_with_retrieval_is_lossless(target, long_prompts, reference):
    spec = Speculation(draft="self", sink=2, window=8, tree=(2, 1, 1), adaptive=False,
                       retrieve=128)
    res = jaxspec.generate(target, long_prompts, max_new_tokens=48, speculation=spec)
    assert res.tokens == reference


V = 6


def test_sampling_with_retrieval_keeps_the_target_distribution():
    """Tokens 3 and 4 of 4 come from rounds whose drafts read a retrieved block (gamma 1: the
    first verification selects it); their joint distribution is the target's, exactly
    enumerated."""
    target = tiny_model(seed=1, vocab=V, scale=2.0)
    prompt = np.random.default_rng(5).integers(0, V, size=136).tolist()
    n = len(prompt)
    toks = np.array([prompt + list(c) for c in itertools.product(range(V), repeat=3)])
    cache = KVCache.create(target.config, len(toks), n + 8, jnp.float32)
    plan = AttentionPlan(lengths=jnp.zeros((len(toks),), jnp.int32), impl="xla")
    pos = jnp.broadcast_to(jnp.arange(n + 3, dtype=jnp.int32), toks.shape)
    logits = np.asarray(forward(target.config, target.params, jnp.asarray(toks), pos, cache,
                                plan)[0], np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    joint = np.zeros((V, V))  # P(t3, t4)
    for i, (a, b, c) in enumerate(itertools.product(range(V), repeat=3)):
        joint[c] += p[i, n - 1, a] * p[i, n, b] * p[i, n + 1, c] * p[i, n + 2]
    spec = Speculation(draft="self", gamma=1, sink=0, window=4, adaptive=False, retrieve=64)
    res = jaxspec.generate(target, [prompt] * 4000, max_new_tokens=4, temperature=1.0, seed=11,
                           speculation=spec)
    samples = [tuple(t[2:4]) for t in res.tokens]
    assert _chi2_pvalue(samples, joint) > 1e-3


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (simulated) devices: make test")
def test_retrieval_on_a_mesh_equals_one_device(long_prompts, reference, target):
    from jaxspec import sharding as shd
    model = tiny_model(seed=0, ctx=2048, heads=8, kv_heads=4, hidden=64, head_dim=8)
    ref = jaxspec.generate(model, long_prompts, max_new_tokens=32).tokens
    spec = Speculation(draft="self", gamma=3, sink=0, window=16, adaptive=False, retrieve=256)
    sharded = shd.shard_model(model, jaxspec.make_mesh(2, 4))
    res = jaxspec.generate(sharded, long_prompts, max_new_tokens=32, speculation=spec)
    assert res.tokens == ref
    assert res.stats["acceptance_rate"] > 0
    # the kernels per shard (interpret mode): block scores written by the verify kernel, the
    # blocks read in place by the draft's
    res = jaxspec.generate(sharded, long_prompts, max_new_tokens=8, speculation=spec,
                           attn_impl="interpret")
    assert res.tokens == [r[:8] for r in ref]


@pytest.mark.parametrize("page_size", [8, None])
def test_the_server_with_retrieval_equals_generate(page_size):
    """Paged and dense slots: rows start, finish and are reused with their selections reset."""
    model = served_model(eos=False)
    rng = np.random.default_rng(_seed())
    prompts = [rng.integers(5, 60, size=int(n)).tolist() for n in (70, 9, 55)]
    ref = jaxspec.generate(model, prompts, max_new_tokens=24).tokens
    spec = Speculation(draft="self", gamma=3, sink=0, window=6, adaptive=False, retrieve=64)
    e = ServingEngine(model, max_batch=2, max_len=96, rounds_per_chunk=2, prefill_chunk=16,
                      page_size=page_size, speculation=spec).start(
        variants=[(True, False)])  # greedy requests only
    try:
        seqs = [Sequence(p, SamplingOptions(max_tokens=24, temperature=0)) for p in prompts]
        e.submit(seqs)
        for s in seqs:
            assert s.finished.wait(600) and s.error is None, s.error
        assert [s.tokens for s in seqs] == ref
    finally:
        e.stop()


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_a_verification_over_a_shared_context_scores_no_block(impl):
    """Over a block pool's shared context the verification's scores are all -inf (a pass of its
    own would gather every row's copy of the shared keys, which the attention reads once), and
    its output is the attention's; the same rows without the shared context are scored."""
    from jaxspec.paged import shared_context
    rng = np.random.default_rng(_seed())
    L, NB, K, BS, D, G, T, B, MB = 2, 24, 2, 8, 16, 2, 3, 3, 8
    kp, vp, q = (jnp.asarray(rng.normal(size=sh), jnp.float32)
                 for sh in ((L, NB, K, BS, D), (L, NB, K, BS, D), (B, T, K * G, D)))
    common = rng.choice(NB, size=3, replace=False)  # the first 3 blocks of every row
    rest = rng.permutation([b for b in range(NB) if b not in common])
    table = np.stack([np.concatenate([common, rest[5 * i:5 * i + 5]]) for i in range(B)])
    table = jnp.asarray(table, jnp.int32)
    lengths = jnp.asarray(rng.integers(3 * BS + T, MB * BS, size=B), jnp.int32)
    plan = AttentionPlan(lengths=lengths, impl=impl, block_table=table, score_block=16)
    sh = shared_context(kp, vp, table[0], jnp.int32(3 * BS), jnp.ones(B, bool))
    out, scores = attend(q, kp, vp, 1, plan.replace(shared=sh))
    assert scores.shape == (B, K, MB * BS // 16)
    assert bool(jnp.all(scores == -jnp.inf))
    want = attend(q, kp, vp, 1, plan.replace(shared=sh, score_block=None))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)
    _, plain = attend(q, kp, vp, 1, plan)
    assert plain.shape == scores.shape and bool(jnp.all(jnp.isfinite(plain[:, :, 0])))


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw,msg", [
    (dict(retrieve=100), "multiple of 64"), (dict(retrieve=-64), "retrieve"),
    (dict(retrieve=64, window=None), "sparse view"),
])
def test_bad_retrieval_settings_are_rejected(target, kw, msg):
    with pytest.raises(ValueError, match=msg):
        jaxspec.generate(target, [[1, 2, 3]], max_new_tokens=4,
                         speculation=Speculation(**kw, adaptive=False))


def test_retrieval_refuses_a_draft_model(target):
    with pytest.raises(ValueError, match="self-speculation"):
        jaxspec.generate(target, [[1, 2, 3]], max_new_tokens=4,
                         speculation=Speculation(draft=tiny_model(seed=3), retrieve=64))


def test_auto_gives_half_the_window_to_retrieval():
    assert Speculation().resolved() == (496, 512)
    assert Speculation(window=200).resolved() == (72, 128)
    assert Speculation().resolved(sliding=True) == (1008, 0)
    assert Speculation(window=6).resolved() == (6, 0)  # too small to split
    assert Speculation(window=None).resolved() == (None, 0)
    assert Speculation(window=300, retrieve=128).resolved(sliding=True) == (300, 128)


@pytest.mark.parametrize("page_size", [None, 16])
def test_the_serving_engine_retrieves_by_default_as_generate_does(target, page_size):
    """`Speculation()` in the serving engine (dense slots or a block pool) reads what it reads in
    `generate`: the last 496 positions and 512 retrieved slots, not the window alone."""
    kw = {} if page_size is None else {"page_size": page_size}
    e = ServingEngine(target, max_batch=2, max_len=1024, speculation=Speculation(), **kw)
    gen = jaxspec.engine.decoder_for(target, Speculation())
    for d in (e.decoder.drafter, gen.drafter):
        assert (d.sink, d.window, d.retrieve) == (16, 496, 512)


def test_retrieval_with_a_shared_prefix_is_lossless(target):
    """The draft reads the prefix's sink and window positions and retrieved blocks of each
    row's own suffix."""
    rng = np.random.default_rng(_seed())
    shared = rng.integers(0, 64, size=150).tolist()
    prompts = [shared + rng.integers(0, 64, size=int(n)).tolist() for n in (230, 170, 260)]
    ref = jaxspec.generate(target, prompts, max_new_tokens=32).tokens
    spec = Speculation(draft="self", gamma=3, sink=4, window=16, adaptive=False, retrieve=128)
    res = jaxspec.generate(target, prompts, max_new_tokens=32, speculation=spec,
                           shared_prefix=150)
    assert res.tokens == ref
    assert res.stats["shared_prefix_tokens"] == 150


# ----------------------------------------------------------------------------- compiled (GPU)
def _reference_route(q, k, v, lengths, mask=None, *, sm_scale, score_block=None, sink=None,
                     window=None, retrieved=None, retrieve_block=None, T_new=None):
    """What the kernels must compute, from the references alone (dense cache [B, K, S, D])."""
    from pallas_kernels.dispatch import _between
    from pallas_kernels.merge import merge_partials
    from pallas_kernels.reference import (block_max_reference, decode_attention_reference,
                                          retrieved_attention_reference)
    o, lse = decode_attention_reference(q, k, v, lengths, mask, sink=sink, window=window,
                                        sm_scale=sm_scale, num_new=T_new)
    if score_block is not None:
        return o, lse, block_max_reference(q, k, lengths, block=score_block, sm_scale=sm_scale)
    if retrieved is None:
        return o, lse
    lo, hi = _between(lengths, sink, window)
    o2, lse2 = retrieved_attention_reference(q, k[None], v[None], 0, retrieved,
                                             block=retrieve_block, sm_scale=sm_scale, lo=lo,
                                             hi=hi)
    return merge_partials([o[None], o2[None]], [lse[None], lse2[None]], o.dtype)


def _no_fallback(monkeypatch):
    """The dispatch may not quietly fall back to the references: the kernels must do it."""
    from pallas_kernels import dispatch

    def refuse(*a, **k):
        raise AssertionError("fell back to a reference")
    for name in ("block_max_reference", "retrieved_attention_reference"):
        monkeypatch.setattr(dispatch, name, refuse)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T,tree", [(1, False), (5, False), (6, True)])
def test_retrieval_kernels_compiled_gpu(T, tree, dtype, monkeypatch):
    """The compiled Triton kernels at the real model's head shape (G 6, D 128, 64-slot blocks):
    block scores written by the verify kernel, retrieved blocks read by the sparse draft
    kernel, dense and through shuffled page tables, against the references. (In float32 at
    this head dim the key tiles that fit shared memory are smaller than a block: the dispatch
    then takes the references' route, checked here too.)"""
    from pallas_kernels import decode_attention, paged_decode_attention
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    if dtype == "bfloat16":
        _no_fallback(monkeypatch)
    rng = np.random.default_rng(_seed())
    B, K, G, S, D, blk = 4, 2, 6, 4096, 128, 64
    dt = jnp.dtype(dtype)
    q = jnp.asarray(rng.standard_normal((B, T, K * G, D)), dt)
    k = jnp.asarray(rng.standard_normal((B, K, S, D)), dt)
    v = jnp.asarray(rng.standard_normal((B, K, S, D)), dt)
    lengths = np.array([4000, 1500, 3001, 0], np.int32) - T  # the new tokens' K/V are in
    lengths = jnp.asarray(np.maximum(lengths, 0))
    mask = jnp.asarray((np.tri(T, dtype=bool) & (rng.random((T, T)) < 0.6))
                       | np.eye(T, dtype=bool)) if tree else None
    sink, window, R = 16, 496, 8
    sel = np.full((B, K, R), -1, np.int32)
    for b, h in itertools.product(range(B), range(K)):
        hi = max(int(lengths[b]) - window, 0) // blk
        pick = rng.permutation(np.arange(0, hi + 1))[:R]  # a block may reach into sink/window
        sel[b, h, :len(pick)] = pick
    sel = jnp.asarray(sel)
    tol = 1e-4 if dtype == "float32" else 2e-2
    sm = 1 / np.sqrt(D)
    cases = (dict(score_block=blk),
             dict(sink=sink, window=window, retrieved=sel, retrieve_block=blk))
    for kw in cases:
        with jax.default_matmul_precision("highest"):  # float32 references, not TF32 (the
            want = _reference_route(q, k, v, lengths, mask, sm_scale=sm, T_new=T, **kw)
            got = decode_attention(q, k, v, lengths, mask, sm_scale=sm, **kw)  # routes too)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                       rtol=tol, atol=tol)
        for page in (16, 64):
            MB = S // page
            table = rng.permutation(B * MB).astype(np.int32).reshape(B, MB)
            order = np.argsort(table.reshape(-1))
            pk = k.reshape(B, K, MB, page, D).transpose(0, 2, 1, 3, 4).reshape(B * MB, K,
                                                                                 page, D)[order]
            pv = v.reshape(B, K, MB, page, D).transpose(0, 2, 1, 3, 4).reshape(B * MB, K,
                                                                                 page, D)[order]
            with jax.default_matmul_precision("highest"):
                got = paged_decode_attention(q, pk, pv, jnp.asarray(table), lengths, mask,
                                             sm_scale=sm, **kw)
            for g, w in zip(got, want):
                np.testing.assert_allclose(np.asarray(g, np.float32),
                                           np.asarray(w, np.float32), rtol=tol, atol=tol)
