"""Batch-invariant decoding (`jaxspec.invariant`, ``generate(..., batch_invariant=True)``): in
bfloat16, bitwise, a row's logits, K/V and tokens do not depend on the other rows, the batch size,
padding and cache capacity, prefill chunking or speculation (self-draft, draft model, tree).

The model-level checks run the forward in fresh jitted closures (not the library's cached
programs), so that the tests which swap one invariant piece back for XLA's shape-dependent
default see the swap; each swap test asserts that some comparison then differs (over a few
seeds), which shows the bitwise checks are not vacuous."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import Speculation, invariant
from jaxspec.attention import AttentionPlan, blocked_attention
from jaxspec.cache import KVCache
from jaxspec.model import forward, rms_norm
from jaxspec.tree import TokenTree
from pallas_kernels.invariant_matmul import (InvariantMatmulBlocks, invariant_matmul,
                                             invariant_matmul_reference)

from tiny import tiny_model

BF16 = jnp.bfloat16
VOCAB = 256
IMPL = "invariant"


def _model(seed=0, **kw):
    kw = {"vocab": VOCAB, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "layers": 2,
          **kw}
    return tiny_model(seed=seed, dtype=BF16, **kw)


@pytest.fixture(scope="module")
def model():
    return _model(0)


def _prompts(rng, lengths):
    return [rng.integers(0, VOCAB, size=int(n)).tolist() for n in lengths]


# ----------------------------------------------------------------------------- model-level harness
def _forward_fn(config, impl=IMPL, prompt=False):
    """A fresh jitted forward (a new closure: nothing traced before a monkeypatch is reused);
    ``prompt``: of prompt tokens (a prefill's: `AttentionPlan.prompt`)."""
    def f(params, k, v, tokens, positions, lengths, mask):
        cache = KVCache(k=k, v=v, lengths=lengths)
        plan = AttentionPlan(lengths=lengths, mask=mask, impl=impl, prompt=prompt)
        logits, c = forward(config, params, tokens, positions, cache, plan)
        return logits, c.k, c.v
    return jax.jit(f)


def _prefill(m, rows, S, chunk, fwd):
    """K/V of ``rows`` (ragged) written in chunks of ``chunk`` tokens into a [L, B, K, S, D]
    cache; returns (k, v, lengths)."""
    c = m.config
    B = len(rows)
    shape = (c.num_layers, B, c.num_kv_heads, S, c.head_dim)
    k = v = jnp.zeros(shape, BF16)
    n = max(len(r) for r in rows)
    total = -(-n // chunk) * chunk
    buf = np.zeros((B, total), np.int32)
    for i, r in enumerate(rows):
        buf[i, :len(r)] = r
    for start in range(0, n, chunk):
        pos = start + np.arange(chunk, dtype=np.int32)[None].repeat(B, 0)
        _, k, v = fwd(m.params, k, v, jnp.asarray(buf[:, start:start + chunk]), jnp.asarray(pos),
                      jnp.full((B,), start, jnp.int32), None)
    return k, v, jnp.asarray([len(r) for r in rows], jnp.int32)


def _step_logits(m, rows, S, chunk, fwd, new_tokens, mask=None, depths=None):
    """Prefills ``rows`` and runs one forward of ``new_tokens`` [B, T] after them (positions
    ``length + depths``; causal, or the tree ``mask``). Returns (logits [B, T, V], k, v)."""
    k, v, L = _prefill(m, rows, S, chunk, fwd)
    T = new_tokens.shape[1]
    depths = np.arange(T) if depths is None else np.asarray(depths)
    pos = np.asarray(L)[:, None] + depths[None]
    return fwd(m.params, k, v, jnp.asarray(new_tokens, jnp.int32), jnp.asarray(pos, jnp.int32),
               L, None if mask is None else jnp.asarray(mask))


def _row_alone_vs_batch(m, seed, fwd, *, batch=8):
    """One prompt's next-token logits alone (B=1, small cache) vs as row 3 of a batch of other
    prompts of other lengths (larger cache, other padding). Returns (alone, in batch)."""
    rng = np.random.default_rng(seed)
    p = _prompts(rng, [int(rng.integers(20, 70))])[0]
    others = _prompts(rng, rng.integers(3, 150, size=batch - 1))
    rows = others[:3] + [p] + others[3:]
    nxt = np.asarray([[r[-1]] for r in rows])
    a, _, _ = _step_logits(m, [p[:-1]], 96, 16, fwd, nxt[3:4])
    b, _, _ = _step_logits(m, [r[:-1] for r in rows], 192, 32, fwd, nxt)
    return np.asarray(a[0]), np.asarray(b[3])


def _verify_vs_steps(m, seed, fwd, *, gamma=5, batch=3):
    """Logits of gamma + 1 tokens verified in one forward vs the same tokens decoded one step at a
    time. Returns (verify [B, T, V], steps [B, T, V])."""
    rng = np.random.default_rng(seed)
    rows = _prompts(rng, rng.integers(20, 100, size=batch))
    new = rng.integers(0, VOCAB, size=(batch, gamma + 1))
    S = 128
    ver, _, _ = _step_logits(m, rows, S, 16, fwd, new)
    k, v, L = _prefill(m, rows, S, 16, fwd)
    steps = []
    for t in range(gamma + 1):
        lg, k, v = fwd(m.params, k, v, jnp.asarray(new[:, t:t + 1], jnp.int32),
                       (L + t)[:, None], L + t, None)
        steps.append(np.asarray(lg[:, 0]))
    return np.asarray(ver), np.stack(steps, 1)


# ----------------------------------------------------------------------------- primitives
@pytest.mark.parametrize("n", [1, 2, 7, 16, 33, 128])
def test_fixed_sum_is_correct_and_row_invariant(n):
    rng = np.random.default_rng(n)
    x = rng.normal(size=(5, n)).astype(np.float32)
    got = np.asarray(invariant.fixed_sum(jnp.asarray(x), -1))
    np.testing.assert_allclose(got, x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)
    # one row alone and inside a larger batch: the same bits
    big = np.concatenate([rng.normal(size=(11, n)).astype(np.float32), x[2:3]], 0)
    one = jax.jit(lambda a: invariant.fixed_sum(a, -1))
    assert np.array_equal(np.asarray(one(jnp.asarray(x[2:3])))[0],
                          np.asarray(one(jnp.asarray(big)))[-1])
    # and over another axis
    np.testing.assert_allclose(np.asarray(invariant.fixed_sum(jnp.asarray(x.T), 0)),
                               x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-5)


MM_IMPLS = {
    "reference": lambda x, w, dt=None: invariant_matmul_reference(x, w, out_dtype=dt),
    "reference-nk": lambda x, w, dt=None: invariant_matmul_reference(x, w.T, out_dtype=dt,
                                                                     transpose_w=True),
    "kernel": lambda x, w, dt=None: invariant_matmul(x, w, out_dtype=dt, interpret=True),
    "kernel-nk": lambda x, w, dt=None: invariant_matmul(x, w.T, out_dtype=dt, interpret=True,
                                                        transpose_w=True),
    "kernel-odd": lambda x, w, dt=None: invariant_matmul(
        x, w, out_dtype=dt, interpret=True, block_sizes=InvariantMatmulBlocks(block_n=32,
                                                                               block_k=32)),
}


@pytest.mark.parametrize("which", sorted(MM_IMPLS))
@pytest.mark.parametrize("K,N", [(64, 256), (96, 80), (128, 48)])
def test_invariant_matmul_is_correct(which, K, N):
    rng = np.random.default_rng(K + N)
    x = rng.normal(size=(21, K)).astype(np.float32)
    w = rng.normal(size=(K, N)).astype(np.float32) / np.sqrt(K)
    xb, wb = jnp.asarray(x, BF16), jnp.asarray(w, BF16)
    ref = np.asarray(xb, np.float64) @ np.asarray(wb, np.float64)
    got = MM_IMPLS[which](xb, wb, jnp.float32)
    assert got.shape == (21, N) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
    got16 = MM_IMPLS[which](xb, wb)
    assert got16.dtype == BF16
    np.testing.assert_allclose(np.asarray(got16, np.float64), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("which", sorted(MM_IMPLS))
def test_invariant_matmul_row_does_not_depend_on_the_batch(which):
    _check_matmul_rows(MM_IMPLS[which])


def _check_matmul_rows(fn, K=192, N=160):
    """A row gives the same bits alone, at any place of batches of any size (1 .. 3 tiles),
    whatever the other rows hold; float32 output, where any reordering would show."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.normal(size=(K, N)) / np.sqrt(K), BF16)
    row = jnp.asarray(rng.normal(size=(1, K)), BF16)
    ref = np.asarray(fn(row, w, jnp.float32))[0]
    for M in (2, 5, 16, 17, 40):
        X = jnp.asarray(rng.normal(size=(M, K)), BF16)
        for pos in sorted({0, M // 2, M - 1}):
            got = np.asarray(fn(X.at[pos].set(row[0]), w, jnp.float32))[pos]
            assert np.array_equal(got, ref), (M, pos)


@pytest.mark.parametrize("K,N", [(192, 160), (100, 48)])
def test_prompt_matmul_is_correct_row_invariant_and_not_the_decode_product(K, N):
    """`jaxspec.invariant.prompt_matmul` (prompt rows; on the CPU its `jnp` form: tiles of 16
    rows, K in blocks of 64) is the product, gives a row the same bits at any place of any M,
    and other bits than `matmul` (so the tests of which rows take which product can fail)."""
    assert invariant.prompt_product(IMPL, BF16, K, N) == "jnp"
    assert invariant.prompt_product("auto", BF16, K, N) == "decode"  # (not an invariant impl)
    fn = lambda x, w, dt=None: invariant.prompt_matmul(x, w, IMPL, out_dtype=dt)  # noqa: E731
    rng = np.random.default_rng(K)
    xb = jnp.asarray(rng.normal(size=(21, K)), BF16)
    wb = jnp.asarray(rng.normal(size=(K, N)) / np.sqrt(K), BF16)
    ref = np.asarray(xb, np.float64) @ np.asarray(wb, np.float64)
    got = fn(xb, wb, jnp.float32)
    assert got.shape == (21, N) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
    assert fn(xb[None], wb).shape == (1, 21, N) and fn(xb, wb).dtype == BF16
    _check_matmul_rows(fn, K, N)
    dec = invariant.matmul(xb, wb, IMPL, out_dtype=jnp.float32)
    if K > invariant.PROMPT_K_BLOCK:
        assert not np.array_equal(np.asarray(dec), np.asarray(got))


def test_xla_dot_is_shape_dependent_on_cpu():
    """Why the invariant matmul exists: XLA's own dot (float32 output) computes a row alone
    (M = 1, a matrix-vector product) with other bits than inside a batch."""
    rng = np.random.default_rng(2)
    K, N = 192, 160
    w = jnp.asarray(rng.normal(size=(K, N)) / np.sqrt(K), BF16)
    X = jnp.asarray(rng.normal(size=(8, K)), BF16)
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    differs = [not np.array_equal(np.asarray(dot(X[i:i + 1], w))[0], np.asarray(dot(X, w))[i])
               for i in range(8)]
    assert any(differs)


def _norm_cases(norm, seed=0):
    """(each row's rms_norm alone, the same rows inside batches of 7 .. 64 rows) pairs, float32,
    hidden sizes where XLA's CPU row reduction changes with the number of rows. Every row is
    compared: whether two summation orders round one row alike depends on its values (with
    some CPUs' vector widths a given row happened to agree in every batch)."""
    rng = np.random.default_rng(seed)
    fn = jax.jit(lambda x, w: norm(x, w, 1e-6))
    out = []
    for D in (128, 2048):
        X = jnp.asarray(rng.normal(size=(64, D)), jnp.float32)
        w = jnp.asarray(1 + 0.1 * rng.normal(size=(D,)), jnp.float32)
        alone = np.stack([np.asarray(fn(X[i:i + 1], w))[0] for i in range(64)])
        out += [(alone[:M], np.asarray(fn(X[:M], w))) for M in (7, 16, 33, 64)]
    return out


def test_rms_norm_is_correct_and_row_invariant():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(4, 96)).astype(np.float32)
    w = (1 + 0.1 * rng.normal(size=96)).astype(np.float32)
    ref = w * x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(invariant.rms_norm(jnp.asarray(x), jnp.asarray(w),
                                                             1e-6)), ref, rtol=1e-5, atol=1e-5)
    for a, b in _norm_cases(invariant.rms_norm):
        assert np.array_equal(a, b)


def test_xla_mean_is_shape_dependent_on_cpu():
    """Why norms use `fixed_sum`: XLA's own row reduction (the default `rms_norm`) gives a row
    other bits inside some batches than alone."""
    assert any(not np.array_equal(a, b) for a, b in _norm_cases(rms_norm))


def _attention_f64(q, k, v, lengths, vis_fn, sm_scale):
    """float64 attention: query (b, t) sees slot s iff vis_fn(b, t, s)."""
    B, T, H, D = q.shape
    K, S = k.shape[1], k.shape[2]
    G = H // K
    out = np.zeros((B, T, H, D))
    for b in range(B):
        for t in range(T):
            ok = np.array([vis_fn(b, t, s) for s in range(S)])
            for h in range(H):
                s = (k[b, h // G] @ q[b, t, h]) * sm_scale
                s = np.where(ok, s, -np.inf)
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ v[b, h // G]
    return out


@pytest.mark.parametrize("impl", ["invariant", "invariant-interpret"])
@pytest.mark.parametrize("case", ["decode", "verify", "tree", "window"])
def test_invariant_attention_is_correct(case, impl):
    rng = np.random.default_rng(3)
    B, H, K, D, S = 3, 4, 2, 16, 160
    lengths = np.array([5, 70, 130])
    tree = TokenTree.from_parents([-1, 0, 0, 1, 1, 2])
    T, mask, W = {"decode": (1, None, None), "verify": (4, None, None),
                  "tree": (6, tree.ancestor_mask, None), "window": (4, None, 37)}[case]
    q = rng.normal(size=(B, T, H, D))
    k = rng.normal(size=(B, K, S, D))
    v = rng.normal(size=(B, K, S, D))
    k[..., 150:, :] = np.nan  # never visible: must not leak
    v[..., 150:, :] = np.nan
    to = lambda a: jnp.asarray(a, BF16)  # noqa: E731
    qb, kb, vb = to(q), to(k), to(v)
    got = invariant.attention(qb, kb[None], vb[None], 0, jnp.asarray(lengths, jnp.int32),
                              None if mask is None else jnp.asarray(mask), num_new=T,
                              sliding_window=W, impl=impl)
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (qb, kb, vb))
    k64, v64 = np.nan_to_num(k64), np.nan_to_num(v64)

    def vis(b, t, s):
        L = lengths[b]
        if mask is None:
            ok = s <= L + t
        else:
            ok = s < L or (s - L < T and mask[t, s - L])
        if W is not None:
            ok = ok and s > L + t - W
        return bool(ok)

    ref = _attention_f64(q64, k64, v64, lengths, vis, 1 / np.sqrt(D))
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=2e-2, atol=2e-2)


def _attention_cases(dtype, seed, *, B=6, H=8, K=2, D=32, S=200, gamma=5, impl=IMPL):
    """`jaxspec.attention.attend` (invariant plan) three ways, each pair to be bitwise equal:
    (verify of gamma + 1 tokens, the same tokens as one-token steps), (a tree node, its path
    compacted to consecutive slots as a step after acceptance sees it), (a row alone in a
    smaller cache, the row in the batch)."""
    from jaxspec.attention import attend
    rng = np.random.default_rng(seed)
    T = gamma + 1
    L = rng.integers(10, S - 2 * T, size=B).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), dtype)
    k = jnp.asarray(rng.normal(size=(1, B, K, S, D)), dtype)
    v = jnp.asarray(rng.normal(size=(1, B, K, S, D)), dtype)
    run = jax.jit(lambda q, k, v, ln, mask: attend(  # a fresh closure per call (see module doc)
        q, k, v, 0, AttentionPlan(lengths=ln, mask=mask, impl=impl)))
    Lj = jnp.asarray(L)
    ver = np.asarray(run(q, k, v, Lj, None))
    steps = np.stack([np.asarray(run(q[:, t:t + 1], k, v, Lj + t, None))[:, 0]
                      for t in range(T)], 1)
    # a tree: node i at slot L + i; its path compacted to slots L + 0..depth for the step
    tree = TokenTree.from_parents([-1, 0, 0, 1, 2, 4])
    path = [0, 2, 4, 5]  # node 5's ancestors and itself
    tv = np.asarray(run(q, k, v, Lj, jnp.asarray(tree.ancestor_mask)))[:, 5]
    b_idx = np.arange(B)[:, None]
    slots_from = L[:, None] + np.asarray(path)[None]
    slots_to = L[:, None] + np.arange(len(path))[None]
    kc = k.at[0, b_idx, :, slots_to].set(k[0, b_idx, :, slots_from])
    vc = v.at[0, b_idx, :, slots_to].set(v[0, b_idx, :, slots_from])
    tstep = np.asarray(run(q[:, 5:6], kc, vc, Lj + len(path) - 1, None))[:, 0]
    # row 2 alone, in a cache of its own capacity
    b = 2
    S2 = int(L[b]) + T + 3
    alone = np.asarray(run(q[b:b + 1], k[:, b:b + 1, :, :S2], v[:, b:b + 1, :, :S2], Lj[b:b + 1],
                           None))[0]
    return [(ver, steps), (tv, tstep), (alone, ver[b])]


@pytest.mark.parametrize("impl", ["invariant", "invariant-interpret"])
@pytest.mark.parametrize("dtype", [BF16, jnp.float32])
def test_attention_is_bitwise_invariant(dtype, impl):
    """The `jnp` attention and the Pallas kernel (in the interpreter)."""
    for i, (a, b) in enumerate(_attention_cases(dtype, 0, impl=impl)):
        assert np.array_equal(a, b), i


def _prompt_cases(dtype, seed, *, impl=IMPL, B=3, H=8, K=2, D=64, S=384, n=300,
                  chunks=(7, 50, 128)):
    """`jaxspec.attention.attend` with a prompt plan (``prompt=True``): the rows of ``n`` prompt
    tokens computed in one call, in chunks of each size, and row 1 alone in a cache of its own
    capacity. Returns (whole, [chunked...], alone, the decode steps' attention of the same
    queries in one call)."""
    from jaxspec.attention import attend
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, n, H, D)), dtype)
    k = jnp.asarray(rng.normal(size=(2, B, K, S, D)), dtype)
    v = jnp.asarray(rng.normal(size=(2, B, K, S, D)), dtype)

    fns = {p: jax.jit(lambda q, k, v, ln, p=p: attend(q, k, v, 1, AttentionPlan(
        lengths=ln, impl=impl, prompt=p))) for p in (True, False)}  # (fresh: see module doc)

    def run(q, k, v, start, prompt=True):
        return np.asarray(fns[prompt](q, k, v, jnp.full((q.shape[0],), start, jnp.int32)))

    whole = run(q, k, v, 0)
    chunked = [np.concatenate([run(q[:, s0:s0 + c], k, v, s0) for s0 in range(0, n, c)], 1)
               for c in chunks]
    S1 = n + 8
    alone = run(q[1:2], k[:, 1:2, :, :S1], v[:, 1:2, :, :S1], 0)[0]
    return whole, chunked, alone, run(q, k, v, 0, prompt=False)


@pytest.mark.parametrize("dtype", [BF16, jnp.float32])
def test_prompt_attention_does_not_depend_on_the_chunking(dtype):
    """A prefill's attention (`jaxspec.invariant.prompt_attention`, here its `jnp` form in blocks
    of 128 keys) gives every prompt row the same bits in any chunking, batch and cache capacity;
    and not the decode step's bits (so the tests of which tokens take which attention below
    can fail)."""
    assert invariant.prompt_kernel(IMPL, dtype, 64) == "jnp"
    assert invariant.prompt_kernel(IMPL, dtype, 64, sliding_window=32) == "decode"
    assert invariant.prompt_kernel("auto", dtype, 64) == "decode"  # (not an invariant impl)
    whole, chunked, alone, decode = _prompt_cases(dtype, 0)
    for c in chunked:
        assert np.array_equal(c, whole)
    assert np.array_equal(alone, whole[1])
    if dtype == jnp.float32:
        assert not np.array_equal(decode, whole)


def _kv_rows(cache, row, n):
    return (np.asarray(cache.k[:, row, :, :n], np.float32),
            np.asarray(cache.v[:, row, :, :n], np.float32))


def test_a_resumed_fill_computes_generated_tokens_as_decode_steps():
    """A preempted sequence's cache, filled again from its prompt and the tokens it generated
    (`jaxspec.prefill.prefill_row` with ``prompt_end``), holds the bits its uninterrupted run had:
    the prompt's K/V from its prefill, its last prompt token's and generated tokens' from the
    one-token decode steps that computed them. Filled all as prompt tokens it does not."""
    from jaxspec.prefill import prefill, prefill_row
    m = tiny_model(seed=3, dtype=jnp.float32, vocab=VOCAB, hidden=64, heads=4, kv_heads=2,
                   head_dim=32, layers=2)
    c = m.config
    rng = np.random.default_rng(11)
    prompt, gen = _prompts(rng, [150, 24])
    S = 256
    ref = prefill(c, m.params, KVCache.create(c, 1, S, dtype=jnp.float32), [prompt[:-1]],
                  impl=IMPL, chunk=32)
    step = jax.jit(lambda p, cache, tok, L: forward(
        c, p, tok, L[:, None], cache, AttentionPlan(lengths=L, impl=IMPL))[1])
    for i, t in enumerate([prompt[-1]] + gen[:-1]):
        L = jnp.asarray([len(prompt) - 1 + i], jnp.int32)
        ref = step(m.params, ref.replace(lengths=L), jnp.asarray([[t]], jnp.int32), L)
    fill = (prompt + gen)[:-1]
    want = _kv_rows(ref, 0, len(fill))
    for chunk in (16, 64):
        got = prefill_row(c, m.params, KVCache.create(c, 2, S, dtype=jnp.float32), 1, fill,
                          impl=IMPL, chunk=chunk, prompt_end=len(prompt) - 1)
        for a, b in zip(_kv_rows(got, 1, len(fill)), want):
            assert np.array_equal(a, b), chunk
    all_prompt = prefill_row(c, m.params, KVCache.create(c, 2, S, dtype=jnp.float32), 1, fill,
                             impl=IMPL, chunk=16)
    assert not np.array_equal(_kv_rows(all_prompt, 1, len(fill))[0], want[0])


# ----------------------------------------------------------------------------- the model, bitwise
def test_row_logits_do_not_depend_on_the_batch(model):
    fwd = _forward_fn(model.config)
    for seed in range(2):
        alone, in_batch = _row_alone_vs_batch(model, seed, fwd)
        assert np.array_equal(alone, in_batch), seed


@pytest.mark.parametrize("prompt", [False, True], ids=["decode-rows", "prompt-rows"])
def test_prefill_kv_does_not_depend_on_the_chunking(model, prompt):
    fwd = _forward_fn(model.config, prompt=prompt)
    rng = np.random.default_rng(4)
    rows = _prompts(rng, [45, 9, 30])
    kvs = [_prefill(model, rows, 64, chunk, fwd) for chunk in (7, 16, 45)]
    for b, r in enumerate(rows):
        n = len(r)
        for k, v, _ in kvs[1:]:
            assert np.array_equal(np.asarray(k[:, b, :, :n]), np.asarray(kvs[0][0][:, b, :, :n]))
            assert np.array_equal(np.asarray(v[:, b, :, :n]), np.asarray(kvs[0][1][:, b, :, :n]))


def test_verify_logits_equal_decode_steps(model):
    fwd = _forward_fn(model.config)
    ver, steps = _verify_vs_steps(model, 0, fwd)
    assert np.array_equal(ver, steps)


def test_tree_verify_logits_equal_decode_steps(model):
    """Each node of a token tree, verified in one forward with the ancestor mask, gets the logits
    of decoding its root-to-node path one token at a time."""
    fwd = _forward_fn(model.config)
    tree = TokenTree.from_expansion([2, 2, 1])
    parents, depths = np.asarray(tree.parents), np.asarray(tree.depths)
    rng = np.random.default_rng(5)
    rows = _prompts(rng, [40, 75])
    nodes = rng.integers(0, VOCAB, size=(2, tree.num_nodes))
    ver, _, _ = _step_logits(model, rows, 128, 16, fwd, nodes, mask=tree.ancestor_mask,
                             depths=depths)
    ver = np.asarray(ver)
    k0, v0, L = _prefill(model, rows, 128, 16, fwd)
    for i in range(tree.num_nodes):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(int(parents[path[-1]]))
        k, v = k0, v0
        for d, node in enumerate(reversed(path)):
            lg, k, v = fwd(model.params, k, v, jnp.asarray(nodes[:, node:node + 1], jnp.int32),
                           (L + d)[:, None], L + d, None)
        assert np.array_equal(ver[:, i], np.asarray(lg[:, 0])), i


# ----------------------------------------------------------------------------- the swaps fail
def _plain_matmul(x, w, impl="invariant", out_dtype=None):
    out_dtype = x.dtype if out_dtype is None else out_dtype
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def _default_attention(q, k, v, layer, lengths, mask=None, *, num_new, sm_scale=None,
                       sliding_window=None, impl=None):
    return blocked_attention(q, k, v, lengths, mask, layer=layer, sm_scale=sm_scale,
                             num_new=num_new)[0]


@pytest.mark.parametrize("piece", ["matmul", "attention", "norm"])
def test_swapping_a_piece_back_breaks_invariance(monkeypatch, piece):
    """With the invariant matmul, attention or norm replaced by XLA's default, the same
    comparisons differ: a row alone vs in a batch, a verification vs decode steps, and the
    piece's own bitwise comparisons. (The prompt rows' product: XLA's CPU dot gives a row the
    same bits for every M > 1, so only the GPU tests can see it swapped for XLA's; swapped for
    the decode rows' product, ``tests/test_mixed_batch.py`` sees it.)"""
    m = _model(1, hidden=128, head_dim=32)
    if piece == "matmul":
        monkeypatch.setattr(invariant, "matmul", _plain_matmul)
    elif piece == "attention":
        monkeypatch.setattr(invariant, "attention", _default_attention)
    else:
        monkeypatch.setattr(invariant, "rms_norm", rms_norm)
    fwd = _forward_fn(m.config)
    seen = False
    for seed in range(4):
        if piece == "matmul":
            a, b = _row_alone_vs_batch(m, seed, fwd)
            seen |= not np.array_equal(a, b)
        elif piece == "attention":  # its own comparisons (float32: no rounding hides a change)
            seen |= any(not np.array_equal(a, b)
                        for a, b in _attention_cases(jnp.float32, seed))
        else:
            seen |= any(not np.array_equal(a, b) for a, b in _norm_cases(invariant.rms_norm, seed))
        ver, steps = _verify_vs_steps(m, seed, fwd)
        seen |= not np.array_equal(ver, steps)
        if seen:
            break
    assert seen, f"swapping the {piece} back changed nothing: the bitwise tests are vacuous"


# ----------------------------------------------------------------------------- generate, bitwise
NEW = 14


@pytest.fixture(scope="module")
def texts():
    rng = np.random.default_rng(7)
    p = _prompts(rng, [37])[0]
    others = _prompts(rng, [5, 80, 150, 12, 61])
    return p, others


@pytest.fixture(scope="module")
def alone(model, texts):
    return jaxspec.generate(model, [texts[0]], max_new_tokens=NEW, batch_invariant=True).tokens[0]


@pytest.mark.parametrize("where,chunk", [((1, 3), 16), ((4, 6), 7), ((0, 1), 512)])
def test_generate_row_does_not_depend_on_batch_or_chunking(model, texts, alone, where, chunk):
    """The prompt at row ``where[0]`` of a batch of ``where[1]`` (other prompts of other lengths:
    other padding, another cache capacity), prefilled in chunks of ``chunk``: its tokens are the
    ones it gets alone."""
    p, others = texts
    at, B = where
    rows = others[:at] + [p] + others[at:B - 1]
    res = jaxspec.generate(model, rows, max_new_tokens=NEW, prefill_chunk=chunk,
                           batch_invariant=True)
    assert res.tokens[at] == alone


@pytest.fixture(scope="module")
def draft(model):
    """A separate draft model with the target's weights: its proposals are often accepted, so
    most tokens come from positions past the first of a verification."""
    return jaxspec.Model(config=model.config, params=model.params)


SPECS = {
    "self": lambda d: Speculation(gamma=3, sink=4, window=16, adaptive=False),
    "self-adaptive": lambda d: Speculation(gamma=3, sink=4, window=16),
    "self-tree": lambda d: Speculation(tree=[2, 2, 1], sink=4, window=16, adaptive=False),
    "self-retrieve": lambda d: Speculation(gamma=3, sink=4, window=16, adaptive=False,
                                           retrieve=64),
    "draft": lambda d: Speculation(draft=d, gamma=4, window=None, adaptive=False),
    "draft-ring": lambda d: Speculation(draft=d, gamma=2, sink=4, window=12, adaptive=False),
    "draft-tree": lambda d: Speculation(draft=d, tree=[3, 1, 1], window=None, adaptive=False),
}


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_speculative_equals_plain_bitwise(model, draft, texts, alone, kind):
    """Greedy speculation in bfloat16 gives exactly the plain tokens, for every row of a ragged
    batch (the verification computes each token as a one-token step does)."""
    p, others = texts
    rows = [others[1], p, others[0]]
    plain = jaxspec.generate(model, rows, max_new_tokens=NEW, batch_invariant=True).tokens
    assert plain[1] == alone
    res = jaxspec.generate(model, rows, max_new_tokens=NEW, speculation=SPECS[kind](draft),
                           batch_invariant=True)
    assert res.tokens == plain
    if kind != "self-adaptive":  # (which may choose plain steps)
        assert res.stats["target_steps"] < NEW  # speculation ran (several tokens per step)


def test_shared_prefix_decodes_unshared_with_the_same_tokens(model):
    rng = np.random.default_rng(8)
    pre = _prompts(rng, [40])[0]
    rows = [pre + s for s in _prompts(rng, [3, 9, 20])]
    alone = [jaxspec.generate(model, [r], max_new_tokens=NEW, batch_invariant=True).tokens[0]
             for r in rows]
    res = jaxspec.generate(model, rows, max_new_tokens=NEW, shared_prefix="auto",
                           batch_invariant=True)
    assert res.tokens == alone
    assert "shared_prefix_tokens" not in res.stats  # nothing was shared
    res = jaxspec.generate(model, rows[:2], max_new_tokens=NEW, n=2, batch_invariant=True)
    assert res.tokens == [alone[0], alone[0], alone[1], alone[1]]


def test_generate_with_the_pallas_kernels_in_the_interpreter(model, texts):
    """``attn_impl="interpret"``: the Pallas matmul and attention kernels (the GPU's) in the
    interpreter; a row's tokens alone and in a batch, plain, speculative and with a tree, are
    the same."""
    p, others = texts
    kw = dict(max_new_tokens=6, attn_impl="interpret", batch_invariant=True)
    a = jaxspec.generate(model, [p], **kw).tokens[0]
    b = jaxspec.generate(model, [others[0], p], prefill_chunk=16, **kw).tokens[1]
    c = jaxspec.generate(model, [others[0], p], speculation=SPECS["self"](None), **kw).tokens[1]
    d = jaxspec.generate(model, [p, others[0]], speculation=SPECS["self-tree"](None),
                         **kw).tokens[0]
    assert a == b == c == d


def test_bad_settings_are_refused(model):
    with pytest.raises(TypeError, match="batch_invariant"):
        jaxspec.generate(model, [[1, 2]], max_new_tokens=2, batch_invariant="yes")
    from jax.sharding import Mesh
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    sharded = jaxspec.Model(config=model.config, params=model.params, mesh=mesh)
    with pytest.raises(NotImplementedError, match="sharded"):
        jaxspec.generate(sharded, [[1, 2]], max_new_tokens=2, batch_invariant=True)


# ----------------------------------------------------------------------------- the serving engine
@pytest.mark.parametrize("paged", [False, True])
def test_serving_engine_tokens_equal_generate_alone(model, texts, paged):
    """Requests submitted together to a batch-invariant engine (slots decoding side by side,
    self-speculation, a paged pool with prefix caching and prompts filled inside decode rounds)
    get the tokens each prompt gets alone from `jaxspec.generate`."""
    from jaxspec.serving import SamplingOptions, Sequence, ServingEngine
    p, others = texts
    prompts = [p, others[1], others[4], p[:20] + others[3]]  # the last waits: a prefix hit
    alone = [jaxspec.generate(model, [q], max_new_tokens=NEW, batch_invariant=True).tokens[0]
             for q in prompts]
    engine = ServingEngine(model, max_batch=3 + paged, max_len=256, rounds_per_chunk=3,
                           prefill_chunk=16,
                           speculation=Speculation(gamma=3, sink=4, window=16, retrieve=0),
                           page_size=16 if paged else None, warmup_prefill=0,
                           batch_invariant=True).start(variants=[(True, False)])
    try:
        seqs = [Sequence(q, SamplingOptions(max_tokens=NEW, temperature=0)) for q in prompts]
        if paged:  # the last one arrives while the others decode (a free slot waits for it)
            engine.submit(seqs[:3])
            t = time.monotonic()
            while engine.m["generation_tokens"] == 0 and time.monotonic() - t < 300:
                time.sleep(0.01)
            engine.submit(seqs[3:])
        else:
            engine.submit(seqs)
        for s in seqs:
            assert s.finished.wait(300)
        assert [s.tokens for s in seqs] == alone
        if paged:  # the last prompt's first block came from the prefix cache
            assert engine.m["prefix_hit_tokens"] > 0
            # and it filled inside the others' decode rounds (mixed chunks, the paged default)
            assert engine.m["mixed_prefill_tokens"] > 0
    finally:
        engine.stop()


def test_preempted_long_prompts_resume_with_their_tokens(texts):
    """Greedy requests with prompts longer than the attention's key blocks in a paged
    batch-invariant engine whose small pool preempts and resumes them, sharing a long prefix
    (prefix-cache hits) and filled in mixed chunks: each gets the tokens `jaxspec.generate` gives
    its prompt alone. (A resumed sequence's generated tokens are computed again as decode steps,
    its prompt as a prefill, and only prompt blocks enter the prefix cache.)"""
    from jaxspec.serving import SamplingOptions, Sequence, ServingEngine
    m = tiny_model(seed=5, dtype=BF16, vocab=VOCAB, hidden=64, heads=4, kv_heads=2,
                   head_dim=32, layers=2)
    rng = np.random.default_rng(13)
    doc = _prompts(rng, [140])[0]
    prompts = [doc + q for q in _prompts(rng, [9, 15, 4])] + _prompts(rng, [150])
    new = 30
    alone = [jaxspec.generate(m, [q], max_new_tokens=new, batch_invariant=True).tokens[0]
             for q in prompts]
    kw = dict(max_batch=3, max_len=192, rounds_per_chunk=2, prefill_chunk=32, page_size=16,
              warmup_prefill=0, batch_invariant=True)
    one = ServingEngine(m, **kw).max_blocks
    engine = ServingEngine(m, kv_blocks=one + 4, growth_reserve=0, **kw).start(
        variants=[(True, False)])
    fills = []  # (first slot, tokens, prompt_end) of every prefill step
    dec = engine.decoder
    real = dec.prefill_paged_row

    def spy(state, row, tokens, start, prompt_end=None):
        fills.append((start, len(tokens), prompt_end))
        return real(state, row, tokens, start, prompt_end=prompt_end)

    dec.prefill_paged_row = spy
    try:
        seqs = [Sequence(q, SamplingOptions(max_tokens=new, temperature=0)) for q in prompts]
        engine.submit(seqs)
        for s in seqs:
            assert s.finished.wait(300)
            assert s.error is None, s.error
        assert [s.tokens for s in seqs] == alone
        mt = engine.metrics()
        assert mt["preemptions"] > 0, "the small pool should have preempted"
        assert mt["prefix_hit_tokens"] > 0
        # resumed fills computed their generated tokens past the prompt as decode steps did
        assert any(pe is not None and st + n > pe for st, n, pe in fills), fills
    finally:
        engine.stop()


@pytest.mark.parametrize("BS", [16, 48])
def test_a_block_pool_is_read_through_its_table_or_in_whole_key_blocks(monkeypatch, BS):
    """A decode / verification over a block pool reaches the invariant attention kernel as the
    pool and its table where the kernel's key block divides the page size or is a multiple of
    it (16 slots), and else (48) as a gathered view rounded up to whole key blocks (contiguous
    loads); either way with the bits of the same keys in a dense cache of the table's own width
    (the kernel's per-key loads there), for a chain and a tree, in the interpreter."""
    from jaxspec.attention import attend
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    L, K, D, B, H, MB = 2, 2, 32, 3, 4, 5
    NB = B * MB + 4
    kp = jnp.asarray(rng.normal(size=(L, NB, K, BS, D)), BF16)
    vp = jnp.asarray(rng.normal(size=(L, NB, K, BS, D)), BF16)
    tab = jnp.asarray(rng.permutation(NB)[:B * MB].reshape(B, MB), jnp.int32)
    lengths = jnp.asarray(rng.integers(1, MB * BS - 4, size=B), jnp.int32)
    q = jnp.asarray(rng.normal(size=(B, 3, H, D)), BF16)
    k_dense = jnp.stack([kp[:, tab[b]].transpose(0, 2, 1, 3, 4).reshape(L, K, MB * BS, D)
                         for b in range(B)], 1)  # [L, B, K, MB * BS, D]
    v_dense = jnp.stack([vp[:, tab[b]].transpose(0, 2, 1, 3, 4).reshape(L, K, MB * BS, D)
                         for b in range(B)], 1)
    calls = []
    real = invariant.attention

    def spy(q_, k_, *a, **kw):
        calls.append((k_.shape, kw.get("block_table") is not None))
        return real(q_, k_, *a, **kw)

    monkeypatch.setattr(invariant, "attention", spy)
    unit = invariant.view_slots(D, BF16)
    tree = jnp.asarray([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    for mask in (None, tree):
        calls.clear()
        plan = AttentionPlan(lengths=lengths, mask=mask, impl="invariant-interpret")
        got = attend(q, kp, vp, 1, plan.replace(block_table=tab))
        want = attend(q, k_dense, v_dense, 1, plan)
        (shape, table), (dense_shape, _) = calls
        if BS == 16:  # the pool itself, read through the table
            assert table and shape == kp.shape, calls
        else:  # a gathered view of whole key blocks
            assert not table and shape[3] % unit == 0 and shape[3] >= MB * BS, calls
        assert dense_shape[3] == MB * BS
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("paged", [False, True])
def test_a_retrieving_verification_takes_its_block_scores_from_the_attention_kernel(monkeypatch,
                                                                                   paged):
    """A batch-invariant verification that also needs block scores (a retrieving self-draft's)
    gets them from the invariant attention kernel's own pass over the keys (no pass of their
    own), with the attention's bits unchanged and the scores of `block_max_reference`, over a
    dense cache and a block pool, in the interpreter."""
    from jaxspec import attention as att
    from pallas_kernels.reference import block_max_reference
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    L, K, D, B, H, BS, MB, T, blk = 2, 2, 32, 3, 4, 16, 6, 5, 16
    NB = B * MB
    kp = jnp.asarray(rng.normal(size=(L, NB, K, BS, D)), BF16)
    vp = jnp.asarray(rng.normal(size=(L, NB, K, BS, D)), BF16)
    tab = jnp.asarray(rng.permutation(NB).reshape(B, MB), jnp.int32)
    lengths = jnp.asarray(rng.integers(1, MB * BS - T, size=B), jnp.int32)
    q = jnp.asarray(rng.normal(size=(B, T, H, D)), BF16)
    k_dense = jnp.stack([kp[:, tab[b]].transpose(0, 2, 1, 3, 4).reshape(L, K, MB * BS, D)
                         for b in range(B)], 1)
    v_dense = jnp.stack([vp[:, tab[b]].transpose(0, 2, 1, 3, 4).reshape(L, K, MB * BS, D)
                         for b in range(B)], 1)
    kv = (kp, vp) if paged else (k_dense, v_dense)
    plan = AttentionPlan(lengths=lengths, impl="invariant-interpret",
                         block_table=tab if paged else None)
    passes = []
    monkeypatch.setattr(att, "context_scores", lambda *a, **kw: passes.append(1))
    out, scores = att.attend(q, *kv, 1, plan.replace(score_block=blk))
    assert not passes
    want_out = att.attend(q, *kv, 1, plan)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    want = np.asarray(block_max_reference(q, k_dense[1], lengths, block=blk))
    got = np.asarray(scores)
    assert got.shape == want.shape and np.array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=2e-5,
                               atol=2e-5)


def test_the_paged_engine_in_the_interpreter_reads_its_pool_and_scores_in_the_kernel(
        monkeypatch):
    """The GPU path of a paged batch-invariant engine, in the interpreter: a retrieving
    self-draft's verifications read the block pool through the tables and take their block
    scores from the attention kernel (no gathered view, no pass of their own), and every
    request gets the tokens `jaxspec.generate` gives its prompt alone (plain decoding, in the
    interpreter too)."""
    from jaxspec import attention as att
    from jaxspec.serving import SamplingOptions, Sequence, ServingEngine
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**32))
    prompts = _prompts(rng, [150, 80, 61])
    new = 8
    alone = [jaxspec.generate(_model(0), [q], max_new_tokens=new, batch_invariant=True,
                              attn_impl="interpret").tokens[0] for q in prompts]
    pooled, passes = [], []
    real = invariant.attention

    def spy(q_, k_, *a, **kw):
        if kw.get("block_table") is not None:
            pooled.append(kw.get("score_block"))
        return real(q_, k_, *a, **kw)

    monkeypatch.setattr(invariant, "attention", spy)
    monkeypatch.setattr(att, "context_scores", lambda *a, **kw: passes.append(1))
    spec = Speculation(gamma=3, sink=4, window=16, retrieve=64)
    engine = ServingEngine(_model(0), max_batch=3, max_len=256, rounds_per_chunk=3,
                           prefill_chunk=16, speculation=spec, page_size=16, warmup_prefill=0,
                           batch_invariant=True, attn_impl="interpret").start(
                               variants=[(True, False)])
    try:
        seqs = [Sequence(q, SamplingOptions(max_tokens=new, temperature=0)) for q in prompts]
        engine.submit(seqs)
        for sq in seqs:
            assert sq.finished.wait(600)
        assert [sq.tokens for sq in seqs] == alone
    finally:
        engine.stop()
    assert 64 in pooled and not passes, (pooled, passes)


@pytest.mark.parametrize("invariant_numerics", [True, False])
def test_prefix_cache_keeps_and_finds_prompt_blocks_only(model, invariant_numerics):
    """Batch-invariant serving caches and reuses only blocks of prompt tokens: a sequence resumed
    with generated tokens that match another request's cached prompt blocks finds only the
    blocks of its own prompt, and registers only those (the default numerics reuse them all)."""
    from jaxspec.blocks import BlockManager
    from jaxspec.serving import SamplingOptions, Sequence, ServingEngine
    e = ServingEngine(model, max_batch=2, max_len=128, page_size=8, warmup_prefill=0,
                      batch_invariant=invariant_numerics)
    e.blocks = BlockManager(32, 8)
    a = Sequence(list(range(1, 42)), SamplingOptions(max_tokens=4))  # fill: 40 tokens, 5 blocks
    e._fill_of(a)
    a.blocks = e.blocks.allocate(6)
    e._register(a, len(a.fill))
    b = Sequence(list(range(1, 20)), SamplingOptions(max_tokens=40))  # its prompt: 2 blocks
    b.tokens = list(range(20, 42))  # it generated a's prompt on: a resumed fill of 40 tokens
    e._fill_of(b)
    assert len(e.blocks.lookup(b.fill, b.fill_keys)) == 5
    assert len(e._lookup(b)) == (2 if invariant_numerics else 5)
    c = Sequence(list(range(100, 119)), SamplingOptions(max_tokens=40))
    c.tokens = list(range(119, 141))
    e._fill_of(c)
    c.blocks = e.blocks.allocate(6)
    e._register(c, len(c.fill))
    assert len(e.blocks.lookup(c.fill, c.fill_keys)) == (2 if invariant_numerics else 5)


def test_pallas_matmul_lowers_for_cuda():
    """The GPU path is compile-ready: the invariant matmul lowers to one Triton kernel for CUDA
    (cross-lowered here, no GPU needed), with a model-sized shape (Qwen2.5-1.5B's MLP)."""
    for shape, nk in (((1536, 8960), False), ((49152, 576), True)):  # an MLP, a tied head
        f = jax.jit(lambda x, w, nk=nk: invariant_matmul(x, w, transpose_w=nk))
        low = f.trace(jax.ShapeDtypeStruct((40, shape[1] if nk else shape[0]), BF16),
                      jax.ShapeDtypeStruct(shape, BF16)).lower(lowering_platforms=("cuda",))
        txt = low.as_text()
        assert "__gpu$xla.gpu.triton" in txt and "invariant_matmul" in txt


def test_pallas_attention_lowers_for_cuda():
    """The invariant attention kernel lowers to Triton for CUDA too (causal and tree tiles)."""
    B, T, H, K, D, S = 4, 5, 12, 2, 128, 1024
    q = jax.ShapeDtypeStruct((B, T, H, D), BF16)
    kv = jax.ShapeDtypeStruct((2, B, K, S, D), BF16)
    ln = jax.ShapeDtypeStruct((B,), jnp.int32)
    for mask in (None, jnp.asarray(TokenTree.from_parents([-1, 0, 0, 1, 2]).ancestor_mask)):
        f = jax.jit(lambda q, k, v, ln, mask=mask: invariant._attention_tiles(
            q, k, v, 1, ln, mask, num_new=T, sm_scale=None, sliding_window=None,
            interpret=False))
        txt = f.trace(q, kv, kv, ln).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in txt and "invariant_attention" in txt


def test_command_line_flags():
    from jaxspec.cli import build_parser
    p = build_parser()
    for cmd in (["generate", "ckpt", "--prompt", "x"], ["serve", "--model", "ckpt"]):
        assert p.parse_args(cmd + ["--batch-invariant"]).batch_invariant is True
        assert p.parse_args(cmd).batch_invariant is False


ARCHS = {
    "sliding-window": dict(model_type="mistral", sliding_window=24),
    "qwen3-tied": dict(model_type="qwen3", attention_bias=True, tie_word_embeddings=True),
    "llama-biases": dict(attention_bias=True, mlp_bias=True),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_other_architectures(texts, arch):
    """A sliding attention window (the invariant attention's window bound), Qwen3's per-head
    norms with a tied LM head, Llama's biases: a row alone == in a batch == speculative."""
    import dataclasses
    from jaxspec.model import init_params
    from tiny import tiny_config
    cfg = dataclasses.replace(tiny_config(vocab=VOCAB, hidden=64, heads=4, kv_heads=2,
                                          head_dim=16, layers=2), **ARCHS[arch])
    m = jaxspec.Model(config=cfg, params=init_params(cfg, jax.random.PRNGKey(2), dtype=BF16))
    p, others = texts
    alone = jaxspec.generate(m, [p], max_new_tokens=NEW, batch_invariant=True).tokens[0]
    rows = [others[1], others[0], p]
    res = jaxspec.generate(m, rows, max_new_tokens=NEW, prefill_chunk=16, batch_invariant=True,
                           speculation=Speculation(gamma=3, sink=4, window=8, adaptive=False))
    assert res.tokens[2] == alone


@pytest.mark.gpu
def test_on_the_gpu(model):
    """The same bitwise checks on a GPU: the Triton matmul compiled (model-sized shapes too), the
    `jnp` attention and the model under XLA's GPU backend."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    triton = lambda x, w, dt=None: invariant_matmul(x, w, out_dtype=dt)  # noqa: E731
    _check_matmul_rows(triton)
    _check_matmul_rows(triton, K=1536, N=8960)
    for dtype in (BF16, jnp.float32):  # the kernel (head dim 32) and the jnp form
        for a, b in _attention_cases(dtype, 0) + _attention_cases(dtype, 0, D=24):
            assert np.array_equal(a, b)
    for a, b in _norm_cases(invariant.rms_norm):
        assert np.array_equal(a, b)
    fwd = _forward_fn(model.config)
    alone, in_batch = _row_alone_vs_batch(model, 0, fwd)
    assert np.array_equal(alone, in_batch)
    ver, steps = _verify_vs_steps(model, 0, fwd)
    assert np.array_equal(ver, steps)


@pytest.mark.gpu
def test_prompt_attention_on_the_gpu():
    """On a Hopper GPU a prefill's attention is the Mosaic GPU kernel with one key range: the same
    bits in any chunking, batch and cache capacity (bf16, the real head shape); and through
    `jaxspec.generate` (a model of head dim 64: the kernel's prefill, the Triton decode steps) a
    prompt's tokens alone equal its tokens in a batch, in other chunks and speculative."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from pallas_kernels import hopper
    want = "hopper" if hopper.available() else "decode"
    assert invariant.prompt_kernel(IMPL, BF16, 128) == want
    for seed in range(2):
        whole, chunked, alone, _ = _prompt_cases(BF16, seed, H=12, K=2, D=128, S=896, n=700,
                                                 chunks=(1, 33, 256))
        for c in chunked:
            assert np.array_equal(c, whole), seed
        assert np.array_equal(alone, whole[1]), seed
    m = _model(1, hidden=256, heads=4, kv_heads=2, head_dim=64)
    rng = np.random.default_rng(8)
    p, *others = _prompts(rng, [300, 40, 450, 130])
    alone = jaxspec.generate(m, [p], max_new_tokens=24, batch_invariant=True).tokens[0]
    for chunk in (16, 128, 512):
        res = jaxspec.generate(m, [others[0], p, *others[1:]], max_new_tokens=24,
                               prefill_chunk=chunk, batch_invariant=True)
        assert res.tokens[1] == alone, chunk
    res = jaxspec.generate(m, [others[1], p], max_new_tokens=24, batch_invariant=True,
                           speculation=Speculation(gamma=3, sink=4, window=32, adaptive=False))
    assert res.tokens[1] == alone


def test_bench_variants_name_invariant_decoding():
    from jaxspec.bench import parse_variant, split_variant
    assert split_variant("inv:g4-fixed") == (True, "g4-fixed")
    assert split_variant("g4-fixed") == (False, "g4-fixed")
    assert parse_variant(split_variant("inv:plain")[1]) is None


def test_bench_variant_lists_keep_trees_whole():
    from jaxspec.bench import parse_variant, split_variant, split_variants
    got = split_variants("plain, t2,2,1,1,g4,inv:g3-t3,1,w496-r512")
    assert got == ["plain", "t2,2,1,1", "g4", "inv:g3-t3,1", "w496-r512"]
    assert parse_variant(got[1]).tree == (2, 2, 1, 1)
    assert parse_variant(split_variant(got[3])[1]).tree == (3, 1)
    with pytest.raises(ValueError, match="unknown part"):
        parse_variant(split_variants("g4,2")[1])  # a number after no tree is no variant


def test_greedy_rounds_select_blocks_with_the_default_scores(monkeypatch):
    """The block scores only steer a retrieving self-draft: a greedy invariant round computes
    them (as its drafts) with the default numerics; a sampled one with the invariant ones (its
    drafts decide tokens)."""
    jax.clear_caches()  # the programs below are traced here, with the counting stand-in
    model = _model(seed=2, layers=3)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 60, size=int(n)).tolist() for n in (150, 190)]
    spec = Speculation(gamma=2, sink=4, window=16, retrieve=64, adaptive=False)
    calls = []
    fixed = invariant.block_scores
    monkeypatch.setattr(invariant, "block_scores",
                        lambda *a, **k: calls.append(1) or fixed(*a, **k))
    jaxspec.generate(model, prompts, max_new_tokens=6, speculation=spec, batch_invariant=True)
    assert not calls
    jaxspec.generate(model, prompts, max_new_tokens=6, speculation=spec, batch_invariant=True,
                     temperature=0.8, seed=[1, 2])
    assert calls
