"""Tests of jaxspec.sampling: settings, filtered distributions, draws."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec import sampling
from jaxspec.sampling import SamplingParams, categorical, draft_children, probs_from_logits, sample, sample_children

ALPHA = 1e-3  # fixed significance of every chi-square test in this suite


def chi2_pvalue(counts, probs):
    counts = np.asarray(counts, np.float64).ravel()
    exp = np.asarray(probs, np.float64).ravel() * counts.sum()
    assert np.all(counts[exp == 0] == 0), "drew an impossible outcome"
    keep = exp > 0
    counts, exp = counts[keep], exp[keep]
    small = exp < 5  # pool sparse cells
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    return stats.chisquare(counts, exp * counts.sum() / exp.sum()).pvalue


def ref_probs(logits, t, k, p):
    """float64 numpy reference of probs_from_logits for one row; None if too close to a
    top-p boundary to compare reliably in float32."""
    logits = np.asarray(logits, np.float64)
    V = logits.shape[-1]
    if t <= 0:
        out = np.zeros(V)
        out[np.argmax(logits)] = 1.0
        return out
    x = logits / np.float64(np.float32(t))
    order = np.lexsort((np.arange(V), -x))  # by -x, then index
    xs = x[order]
    ps = np.exp(xs - xs.max())
    ps /= ps.sum()
    kk = k if 0 < k < V else V
    ps_k = ps[:kk] / ps[:kk].sum()
    n = kk
    if p < 1.0:
        cum = np.cumsum(ps_k)
        if np.any(np.abs(cum - p) < 1e-4):
            return None
        n = int(np.searchsorted(cum, p, side="left")) + 1  # smallest prefix with mass >= p
        n = min(max(n, 1), kk)
    keep = order[:n]
    out = np.zeros(V)
    e = np.exp(x[keep] - x[keep].max())
    out[keep] = e / e.sum()
    return out


def test_make_broadcasts_and_filter_flag():
    sp = SamplingParams.make(3, temperature=0.5)
    assert sp.temperature.shape == (3,) and sp.top_k.dtype == jnp.int32 and sp.top_p.dtype == jnp.float32
    assert not sp.filtering
    assert SamplingParams.make(3, top_k=[0, 5, 0]).filtering
    assert SamplingParams.make(3, top_p=0.9).filtering
    assert SamplingParams.greedy(2).is_greedy.all()
    with pytest.raises(ValueError):
        SamplingParams.make(2, top_k=3, filtering=False)
    # a pytree whose static flag is part of the structure
    leaves, tdef = jax.tree.flatten(sp)
    assert len(leaves) == 3
    assert jax.tree.unflatten(tdef, leaves).filtering is False


@pytest.mark.parametrize("V", [7, 50])
def test_probs_match_numpy_reference(V):
    rng = np.random.default_rng(V)
    B = 256
    # integer-valued logits make many exact ties
    logits = np.where(rng.random((B, V)) < 0.5, rng.integers(-3, 3, (B, V)), rng.normal(0, 2, (B, V))).astype(np.float32)
    t = np.where(rng.random(B) < 0.2, 0.0, rng.uniform(0.3, 2.0, B)).astype(np.float32)
    k = np.where(rng.random(B) < 0.4, 0, rng.integers(1, V + 2, B)).astype(np.int32)
    p = np.where(rng.random(B) < 0.4, 1.0, rng.uniform(0.05, 0.99, B)).astype(np.float32)
    sp = SamplingParams.make(B, t, k, p)
    got = np.asarray(jax.jit(probs_from_logits)(jnp.asarray(logits), sp))
    checked = 0
    for b in range(B):
        ref = ref_probs(logits[b], t[b], k[b], p[b])
        if ref is None:
            continue
        checked += 1
        np.testing.assert_allclose(got[b], ref, atol=2e-6, err_msg=f"row {b}: t={t[b]} k={k[b]} p={p[b]}")
        assert np.all((got[b] > 0) == (ref > 0))
    assert checked > 0.9 * B
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("invariant", [False, True])
def test_top_k_and_top_p_keep_the_same_tokens_at_any_temperature(invariant):
    """Top-k ranks the logits, not the logits over the temperature: dividing by a huge
    temperature rounds distinct logits to one value or flushes them to 0, and must not change
    which tokens are kept (it only flattens the kept tokens' distribution)."""
    rng = np.random.default_rng(7)
    B, V = 12, 40
    logits = rng.normal(0, 3, (B, V)).astype(np.float32)
    k = rng.integers(1, 6, B).astype(np.int32)
    t = np.array([1e38, 1e30, 3e7] * 4, np.float32)
    sp = SamplingParams.make(B, t, k, 1.0, invariant=invariant)
    got = np.asarray(jax.jit(probs_from_logits)(jnp.asarray(logits), sp))
    for b in range(B):
        want = set(np.argsort(-logits[b], kind="stable")[: k[b]].tolist())
        assert set(np.flatnonzero(got[b] > 0).tolist()) == want, (b, t[b], k[b])
        np.testing.assert_allclose(got[b][sorted(want)], 1.0 / k[b], rtol=1e-5)
    # top-p over a flattened distribution: the kept prefix still follows the logits' order
    sp = SamplingParams.make(B, t, 0, 0.3, invariant=invariant)
    got = np.asarray(jax.jit(probs_from_logits)(jnp.asarray(logits), sp))
    for b in range(B):
        n = int(np.ceil(0.3 * V - 1e-6))  # near-uniform mass: the first ~30% of the ranking
        kept = np.flatnonzero(got[b] > 0)
        order = np.argsort(-logits[b], kind="stable")
        assert set(kept.tolist()) == set(order[: len(kept)].tolist()), (b, t[b])
        assert abs(len(kept) - n) <= 1, (b, len(kept), n)


def test_greedy_rows_are_first_argmax_one_hot_and_leading_dims_broadcast():
    logits = jnp.array([[[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, -1.0, 2.0]], [[0.0, 1.0, 5.0, 5.0], [9.0, 1.0, 1.0, 1.0]]])
    sp = SamplingParams.make(2, temperature=[0.0, 1.0], top_k=[0, 2])
    pfl = jax.jit(probs_from_logits)
    probs = pfl(logits, sp)  # [B, T, V] with [B] settings
    np.testing.assert_array_equal(probs[0], [[0, 1, 0, 0], [1, 0, 0, 0]])
    # row 1 at temperature 1, top-2: the two 5.0s / [9, first 1]
    np.testing.assert_allclose(probs[1, 0], [0, 0, 0.5, 0.5], atol=1e-6)
    np.testing.assert_allclose(probs[1, 1], [1 / (1 + np.exp(-8)), np.exp(-8) / (1 + np.exp(-8)), 0, 0], atol=1e-6)
    for tt in range(2):
        np.testing.assert_array_equal(probs[:, tt], pfl(logits[:, tt], sp))


def test_no_sort_without_filtering():
    x = jnp.zeros((2, 16))
    plain = jax.make_jaxpr(probs_from_logits)(x, SamplingParams.make(2, temperature=0.7))
    filt = jax.make_jaxpr(probs_from_logits)(x, SamplingParams.make(2, temperature=0.7, top_p=0.9))
    assert "sort" not in str(plain) and "sort" in str(filt)


def test_all_greedy_is_one_argmax_without_softmax_or_draw():
    """``stochastic=False`` (every row greedy, decided from concrete temperatures): the same
    tokens and one-hot distributions as the general path, with no exp (softmax) and no
    random bits traced; a mixed or traced batch keeps the general path."""
    assert SamplingParams.make(3, temperature=0.0).stochastic is False
    assert SamplingParams.make(3, temperature=[0.0, -1.0, 0.0]).stochastic is False
    assert SamplingParams.make(3, temperature=[0.0, 0.5, 0.0]).stochastic is True
    assert SamplingParams.greedy(2).stochastic is False
    assert jax.jit(lambda t: jnp.asarray(SamplingParams.make(2, temperature=t).stochastic))(
        jnp.zeros(2))  # traced temperatures: cannot promise greedy
    with pytest.raises(ValueError, match="stochastic=False"):
        SamplingParams.make(2, temperature=[0.0, 0.3], stochastic=False)
    leaves, tdef = jax.tree.flatten(SamplingParams.greedy(2))
    assert len(leaves) == 3 and jax.tree.unflatten(tdef, leaves).stochastic is False
    rng = np.random.default_rng(5)
    logits = jnp.asarray(np.where(rng.random((5, 3, 40)) < 0.3,  # ties: first index wins
                                  rng.integers(-2, 2, (5, 3, 40)), rng.normal(size=(5, 3, 40))),
                         jnp.float32)
    fast, general = SamplingParams.greedy(5), SamplingParams.make(5, temperature=0.0,
                                                                  stochastic=True)
    key = jax.random.key(3)
    np.testing.assert_array_equal(jax.jit(sample)(key, logits, fast),
                                  jax.jit(sample)(key, logits, general))
    np.testing.assert_array_equal(jax.jit(sample)(key, logits, fast), np.argmax(logits, -1))
    np.testing.assert_array_equal(jax.jit(probs_from_logits)(logits, fast),
                                  jax.jit(probs_from_logits)(logits, general))
    for fn in (lambda x, sp: sample(key, x, sp), probs_from_logits):
        lean = str(jax.make_jaxpr(fn)(logits, fast))
        full = str(jax.make_jaxpr(fn)(logits, general))
        assert " exp " not in lean and "random_bits" not in lean
        assert " exp " in full


def test_sample_greedy_exact_and_distribution():
    rng = np.random.default_rng(0)
    B, V = 120_000, 6
    row_logits = rng.normal(0, 1.5, V).astype(np.float32)
    logits = jnp.broadcast_to(jnp.asarray(row_logits), (B, V))
    t = np.where(np.arange(B) % 3 == 0, 0.0, 0.8).astype(np.float32)
    sp = SamplingParams.make(B, t, top_k=4, top_p=1.0)
    tok = np.asarray(jax.jit(sample)(jax.random.key(1), logits, sp))
    assert np.all(tok[t == 0] == np.argmax(row_logits))
    ref = ref_probs(row_logits, 0.8, 4, 1.0)
    counts = np.bincount(tok[t > 0], minlength=V)
    assert chi2_pvalue(counts, ref) > ALPHA
    # a [B, T, V] call: greedy rows take argmax at every position
    lg = jax.random.normal(jax.random.key(2), (4, 3, 9))
    out = jax.jit(sample)(jax.random.key(3), lg, SamplingParams.make(4, [0.0, 1.0, 0.0, 1.0]))
    np.testing.assert_array_equal(out[::2], jnp.argmax(lg[::2], -1))


@pytest.mark.parametrize("V", [5, 2500])
def test_categorical_exact_on_one_hot_and_never_draws_zero_prob(V):
    rng = np.random.default_rng(V)
    B = 512
    hot = rng.integers(0, V, B)
    onehot = np.zeros((B, V), np.float32)
    onehot[np.arange(B), hot] = 1.0
    cat = jax.jit(categorical)
    np.testing.assert_array_equal(cat(jax.random.key(0), jnp.asarray(onehot)), hot)
    # sparse support spread over blocks, unnormalized
    support = np.array(sorted({0, V // 3, V // 2, V - 1}))
    w = np.zeros(V, np.float32)
    w[support] = np.array([1.0, 2.0, 3.0, 4.0])[: len(support)]
    draws = np.asarray(cat(jax.random.key(1), jnp.broadcast_to(jnp.asarray(w), (10_000, V))))
    assert set(np.unique(draws)) <= set(support.tolist())
    counts = np.array([(draws == s).sum() for s in support])
    assert chi2_pvalue(counts, w[support] / w.sum()) > ALPHA


def test_categorical_draws_tokens_far_below_float32_resolution(monkeypatch):
    """A float32 uniform has 2^24 values at most: one uniform for both the block and the token
    inside it would leave most tokens of a block holding ~1e-6 of the mass undrawable. With
    the draw forced into such a block, the token inside it follows the block's probabilities."""
    V = 2 * 1024
    rng = np.random.default_rng(0)
    w = np.zeros(V, np.float32)
    w[0] = 1.0  # the first block holds all but ~1e-6 of the mass
    tiny = rng.uniform(0.5, 1.5, 1024).astype(np.float32) * 1e-9
    w[1024:] = tiny
    real = jax.random.uniform
    calls = []

    def uniform(key, shape=(), dtype=jnp.float32, *a, **kw):
        calls.append(shape)
        if len(calls) == 1:  # the block draw: into the second block (t in [1, 1 + 1e-6))
            return jnp.full(shape, 1.0 - 5e-7, dtype)
        return real(key, shape, dtype, *a, **kw)

    monkeypatch.setattr(jax.random, "uniform", uniform)
    n = 20_000
    draws = np.asarray(categorical(jax.random.key(1), jnp.asarray(w), n))
    assert draws.min() >= 1024, "the forced block draw was not the first uniform"
    counts = np.bincount(draws - 1024, minlength=1024)
    # 1024 cells, ~20 draws each: pooled into 64 cells for the chi-square
    pooled = counts.reshape(64, 16).sum(1)
    want = tiny.reshape(64, 16).sum(1) / tiny.sum()
    assert (counts > 0).sum() > 900, (counts > 0).sum()  # one shared uniform: ~17 tokens
    assert chi2_pvalue(pooled, want) > ALPHA


def test_categorical_many_draws_shape():
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (3, 2, 2000)))
    out = jax.jit(categorical, static_argnums=2)(jax.random.key(1), probs, 5)
    assert out.shape == (3, 2, 5) and out.dtype == jnp.int32


def test_sample_children_without_replacement_distribution():
    q = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    B = 100_000
    kids = np.asarray(sample_children(jax.random.key(0), jnp.broadcast_to(jnp.asarray(q), (B, 4)), 2, replacement=False))
    assert np.all(kids[:, 0] != kids[:, 1])
    pairs = list(itertools.permutations(range(4), 2))
    exact = np.array([q[a] * q[b] / (1 - q[a]) for a, b in pairs])
    counts = np.array([np.sum((kids[:, 0] == a) & (kids[:, 1] == b)) for a, b in pairs])
    assert chi2_pvalue(counts, exact) > ALPHA
    # with replacement: independent draws
    kids = np.asarray(sample_children(jax.random.key(1), jnp.broadcast_to(jnp.asarray(q), (B, 4)), 2, replacement=True))
    counts = np.bincount(kids[:, 0] * 4 + kids[:, 1], minlength=16)
    assert chi2_pvalue(counts, np.outer(q, q)) > ALPHA
    # support smaller than k: positive tokens first, in draw order
    q2 = jnp.asarray([[0.0, 1.0, 0.0, 0.0]])
    out = np.asarray(sample_children(jax.random.key(2), q2, 3, replacement=False))
    assert out[0, 0] == 1 and len(set(out[0].tolist())) == 3


@pytest.mark.parametrize("mode", ["iid", "without_replacement", "deterministic"])
def test_draft_children(mode):
    rng = np.random.default_rng(3)
    B, T, Vb, k = 6, 2, 10, 3
    logits = jnp.asarray(rng.normal(size=(B, T, Vb)), jnp.float32)
    sp = SamplingParams.make(B, temperature=[0.0, 1.0, 0.0, 0.7, 1.0, 1.0], top_k=[0, 0, 0, 4, 2, 0])
    kids, q = jax.jit(draft_children, static_argnums=(3, 4))(jax.random.key(0), logits, sp, k, mode)
    assert kids.shape == (B, T, k) and q.shape == (B, T, Vb)
    np.testing.assert_array_equal(q, probs_from_logits(logits, sp))
    top = np.argsort(-np.asarray(logits), -1, kind="stable")[..., :k]
    np.testing.assert_array_equal(kids[sp.is_greedy], top[np.asarray(sp.is_greedy)])
    qn = np.asarray(q)
    kn = np.asarray(kids)
    for b in np.nonzero(~np.asarray(sp.is_greedy))[0]:
        for t in range(T):
            support = int((qn[b, t] > 0).sum())
            if mode == "deterministic":
                np.testing.assert_array_equal(kn[b, t], top[b, t])
            if mode != "iid":
                assert len(set(kn[b, t].tolist())) == k
                assert np.all(qn[b, t, kn[b, t, : min(k, support)]] > 0)  # positive tokens first
            else:
                assert np.all(qn[b, t, kn[b, t]] > 0)


def test_start_keys_equal_row_keys_for_every_seed_range():
    """The server's batched key arithmetic gives exactly the keys of `row_keys` (and of a second
    fold for a resumed sequence), for seeds inside and outside 32 bits, in one call."""
    rng = np.random.default_rng()
    seeds = [0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, -1, -(2 ** 31), 2 ** 32, 2 ** 40 + 7,
             -(2 ** 31) - 1, -(2 ** 50)] + [int(x) for x in rng.integers(0, 2 ** 32, 5)]
    firsts = [int(x) for x in rng.integers(0, 1000, len(seeds))]
    refolds = [None if i % 3 else int(rng.integers(1, 500)) for i in range(len(seeds))]
    got = sampling.start_keys(seeds, firsts, refolds)
    assert got.dtype == np.uint32 and got.shape == (len(seeds), 2)
    # padded to a fixed size (one compiled shape for any number of starting rows): the same keys
    np.testing.assert_array_equal(sampling.start_keys(seeds, firsts, refolds, size=64), got)
    np.testing.assert_array_equal(sampling.start_keys(seeds[:3], firsts[:3], refolds[:3],
                                                      size=64), got[:3])
    for i, (s, f, r) in enumerate(zip(seeds, firsts, refolds)):
        want = sampling.row_keys(s, 1, first=f)[0]
        if r is not None:
            want = jax.random.fold_in(want, r)
        np.testing.assert_array_equal(got[i], np.asarray(want, np.uint32), err_msg=f"seed {s}")
    assert sampling.start_keys([], []).shape == (0, 2)
