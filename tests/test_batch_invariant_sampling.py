"""Batch-invariant *sampling* (``generate(..., batch_invariant=True)`` at temperature > 0, top-k,
top-p; the serving engine's ``batch_invariant``): with a per-prompt seed, a prompt's sampled tokens
are bitwise the same alone and inside any batch (other prompts, positions, batch sizes, padding,
cache capacity, prefill chunking), plain and with each kind of speculation (a speculative run
against the same speculation), in bfloat16 and float32.

The function-level checks compare float32 distributions (where one rounding difference shows)
in fresh jitted closures, so that the swap tests, which put XLA's own reductions back, see the
swap and show the bitwise checks are not vacuous."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import Speculation, invariant, sampling
from jaxspec.sampling import SamplingParams
from jaxspec.verify import _residual

from tiny import tiny_model

BF16 = jnp.bfloat16
VOCAB = 256
NEW = 10
SAMPLE = dict(temperature=0.9, top_k=60, top_p=0.9)


# ----------------------------------------------------------------------------- the reductions
def _row_cases(fn, V=1000, seed=0):
    """(row 5 alone, row 5 inside batches of 6 .. 64 rows) pairs of ``fn(x[B, V])`` for logits
    of the sizes where XLA's CPU reductions change with the number of rows."""
    rng = np.random.default_rng(seed)
    X = jnp.asarray(rng.normal(size=(64, V)) * 3, jnp.float32)
    f = jax.jit(fn)  # a fresh closure: a swap made before is seen
    ref = np.asarray(f(X[5:6]))[0]
    for M in (6, 16, 64):
        yield ref, np.asarray(f(X[:M]))[5]


def _probs(inv, **kw):
    def fn(x):
        sp = SamplingParams.make(x.shape[0], **{**SAMPLE, **kw}, invariant=inv)
        return sampling.probs_from_logits(x, sp)
    return fn


def _residuals(inv):
    """The speculative-sampling residual norm(max(0, p - q)) of two softmaxes."""
    def fn(x):
        p = invariant.fixed_softmax(x, -1)
        q = invariant.fixed_softmax(jnp.roll(x, 1, -1) * 0.7, -1)
        return _residual(p, q, inv)
    return fn


def _cdf(inv):
    """The inverse CDF's cumulative sums of `categorical` (one level and two levels)."""
    def fn(x):
        p = jnp.exp(x)
        big = jnp.tile(p, (1, 3))  # > 1024: blocks of 1024
        return jnp.concatenate([sampling._cumsum(p, -1, inv),
                                sampling._cumsum(sampling.row_sum(
                                    big.reshape(big.shape[0], -1, 1000), -1, invariant=inv),
                                    -1, inv)],
                               -1)
    return fn


def _all_cases(inv, seed=0):
    """Every pair (lazily: a swap test stops at the first difference)."""
    for V in (1000, 256):
        yield from _row_cases(_probs(inv), V, seed)
        yield from _row_cases(_probs(inv, top_k=0, top_p=1.0), V, seed)
    yield from _row_cases(_residuals(inv), 1000, seed)
    yield from _row_cases(_cdf(inv), 1000, seed)


def test_fixed_reductions_are_correct():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 37)).astype(np.float32)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(np.asarray(invariant.fixed_cumsum(jnp.asarray(x), -1)),
                               np.cumsum(x64, -1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(invariant.fixed_cumsum(jnp.asarray(x.T), 0)),
                               np.cumsum(x64, -1).T, rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.asarray(invariant.fixed_max(jnp.asarray(x), -1)), x.max(-1))
    lse = np.log(np.exp(x64).sum(-1))
    np.testing.assert_allclose(np.asarray(invariant.fixed_logsumexp(jnp.asarray(x), -1)), lse,
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(invariant.fixed_softmax(jnp.asarray(x), -1)),
                               np.exp(x64 - lse[:, None]), rtol=1e-6, atol=1e-7)
    # the invariant distribution is the default one up to rounding
    X = jnp.asarray(rng.normal(size=(4, 500)) * 2, jnp.float32)
    for kw in ({}, {"top_k": 0, "top_p": 1.0}, {"top_k": 7, "top_p": 1.0}):
        a, b = (np.asarray(_probs(inv, **kw)(X)) for inv in (False, True))
        assert np.array_equal(a > 0, b > 0)  # the same tokens kept by top-k / top-p
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_sampling_reductions_are_row_invariant():
    """Filtered distributions, speculative residuals and inverse-CDF sums: a row's bits alone and
    inside batches of every size are the same."""
    for i, (a, b) in enumerate(_all_cases(True)):
        assert np.array_equal(a, b), i


def _xla_max(x, axis=-1, keepdims=False):
    return jnp.max(x, axis=axis, keepdims=keepdims)


def _xla_sum(x, axis=-1, keepdims=False):
    return jnp.sum(x, axis=axis, keepdims=keepdims)


@pytest.mark.parametrize("piece", ["sum", "max", "all"])
def test_swapping_a_reduction_back_breaks_invariance(monkeypatch, piece):
    """With `fixed_sum` or `fixed_max` replaced by XLA's reduction (``"all"``: the default,
    non-invariant sampling path), some row's distribution differs inside a batch from alone.
    (A maximum is exact, but XLA's CPU backend hands ``exp(x - max(x))`` to a kernel library
    for batches and not for one row, and its exp rounds differently.) XLA's CPU cumsum happens
    to be sequential at these shapes, so `fixed_cumsum` has no swap test here (on GPUs XLA's
    scan is a tree chosen by shape)."""
    inv = piece != "all"
    if piece == "sum":
        monkeypatch.setattr(invariant, "fixed_sum", _xla_sum)
    elif piece == "max":
        monkeypatch.setattr(invariant, "fixed_max", _xla_max)
    assert any(not np.array_equal(a, b) for a, b in _all_cases(inv)), \
        f"swapping the {piece} back changed nothing: the bitwise tests are vacuous"


def test_seeds_and_keys():
    """``seed`` as a list: each prompt's rows get the keys a single prompt gets with that seed;
    position keys fold the position into the row's key."""
    a = np.asarray(sampling.seeded_row_keys([5, 9], 3))
    assert np.array_equal(a[:3], np.asarray(sampling.row_keys(5, 3)))
    assert np.array_equal(a[3:], np.asarray(sampling.row_keys(9, 3)))
    keys = sampling.row_keys(1, 4)
    pos = jnp.asarray([0, 7, 7, 300], jnp.int32)
    got = np.asarray(sampling.position_keys(keys, pos))
    for b in range(4):
        assert np.array_equal(got[b], np.asarray(jax.random.fold_in(keys[b], int(pos[b]))))
    assert np.array_equal(np.asarray(sampling.position_keys(keys[1:2], pos[1:2]))[0], got[1])


# ----------------------------------------------------------------------------- generate, bitwise
def _model(seed=0, dtype=BF16):
    return tiny_model(seed=seed, dtype=dtype, vocab=VOCAB, hidden=64, heads=4, kv_heads=2,
                      head_dim=16, layers=2)


@pytest.fixture(scope="module")
def model():
    return _model(0)


@pytest.fixture(scope="module")
def texts():
    rng = np.random.default_rng(11)
    p = rng.integers(0, VOCAB, size=150).tolist()  # past a retrieving draft's sink and window
    others = [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 80, 230, 12)]
    return p, others


def _gen(m, rows, seeds, spec=None, **kw):
    return jaxspec.generate(m, rows, max_new_tokens=NEW, seed=seeds, speculation=spec,
                            batch_invariant=True, **SAMPLE, **kw)


def _check_alone_vs_batches(m, texts, spec=None, seed=1234, five=True):
    """The prompt alone (seed ``seed``) == at row 1 of 3 (chunks of 7, a cache of 512 slots)
    == (``five``) at row 3 of 5 (chunks of 16); returns its tokens."""
    p, others = texts
    alone = _gen(m, [p], [seed], spec).tokens[0]
    b3 = _gen(m, [others[0], p, others[1]], [1, seed, 2], spec, prefill_chunk=7,
              max_len=512).tokens[1]
    assert b3 == alone
    if five:
        b5 = _gen(m, [others[3], others[2], others[1], p, others[0]], [3, 4, 5, seed, 6], spec,
                  prefill_chunk=16).tokens[3]
        assert b5 == alone
    return alone


def test_plain_sampling_does_not_depend_on_the_batch(model, texts):
    alone = _check_alone_vs_batches(model, texts)
    # sampled (not greedy), and the seed matters
    greedy = jaxspec.generate(model, [texts[0]], max_new_tokens=NEW, batch_invariant=True)
    assert alone != greedy.tokens[0]
    assert _gen(model, [texts[0]], [99]).tokens[0] != alone


def test_float32_sampling_does_not_depend_on_the_batch(texts):
    _check_alone_vs_batches(_model(0, jnp.float32), texts, five=False)


def test_an_int_seed_keys_rows_by_index(model, texts):
    """``seed=int`` keeps its keys (row i: ``fold_in(key(seed), i)``): row 0 is the seed's own
    list entry, and the same prompt at another row samples with another key."""
    p, others = texts
    a = _gen(model, [p, others[0]], 7).tokens
    assert a[0] == _gen(model, [p, others[1]], [7, 8]).tokens[0]
    assert _gen(model, [others[0], p], 7).tokens[1] != a[0]
    with pytest.raises(ValueError, match="one per prompt"):
        _gen(model, [p, others[0]], [1])
    with pytest.raises(TypeError, match="seed"):
        _gen(model, [p], [1.5])


@pytest.fixture(scope="module")
def draft(model):
    """A separate draft model (the target's weights, another dtype path: its own cache)."""
    return jaxspec.Model(config=model.config, params=model.params)


SPECS = {
    "self-chain": lambda d: Speculation(gamma=3, sink=4, window=16, adaptive=False),
    "self-tree": lambda d: Speculation(tree=[2, 1, 1], sink=4, window=16, adaptive=False),
    "self-retrieve": lambda d: Speculation(gamma=2, sink=4, window=16, adaptive=False,
                                           retrieve=64),
    "draft": lambda d: Speculation(draft=d, gamma=3, window=None, adaptive=False),
}


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_speculative_sampling_does_not_depend_on_the_batch(model, draft, texts, kind):
    spec = SPECS[kind](draft)
    alone = _check_alone_vs_batches(model, texts, spec, five=False)
    res = _gen(model, [texts[0]], [1234], spec)
    assert res.tokens[0] == alone
    assert res.stats["target_steps"] < NEW  # speculation ran (several tokens per step)


# ----------------------------------------------------------------------------- the serving engine
def test_serving_engine_samples_as_generate_alone(model, texts):
    """Sampling requests with seeds, decoded side by side (self-speculation) in a paged engine
    whose small pool preempts and later resumes sequences: each gets the tokens its prompt gets
    alone from `jaxspec.generate` with its seed (draws are keyed by position, so a resumed
    sequence goes on with the draws it would have made)."""
    from jaxspec.serving import SamplingOptions, Sequence, ServingEngine
    p, others = texts
    prompts = [p[:38], others[1][:30], others[2][:45], others[3]]
    seeds = [5, 6, 7, 8]
    new = 40  # three sequences of up to ~85 tokens need 30 blocks of 8; the pool has 15
    speculation = Speculation(gamma=3, sink=4, window=16, adaptive=False)
    alone = [jaxspec.generate(model, [q], max_new_tokens=new, seed=[s], speculation=speculation,
                              batch_invariant=True, **SAMPLE).tokens[0]
             for q, s in zip(prompts, seeds)]
    kw = dict(max_batch=3, max_len=96, rounds_per_chunk=2, prefill_chunk=16, page_size=8,
              prefill_budget=16, speculation=speculation, warmup_prefill=0,
              batch_invariant=True)
    one = ServingEngine(model, **kw).max_blocks
    engine = ServingEngine(model, kv_blocks=one + 3, growth_reserve=0, **kw).start()
    try:
        seqs = [Sequence(q, SamplingOptions(max_tokens=new, seed=s, **SAMPLE))
                for q, s in zip(prompts, seeds)]
        engine.submit(seqs)
        for s in seqs:
            assert s.finished.wait(300)
            assert s.error is None, s.error
        assert [s.tokens for s in seqs] == alone
        assert engine.metrics()["preemptions"] > 0, "the small pool should have preempted"
    finally:
        engine.stop()


# ----------------------------------------------------------------------------- still lossless
@pytest.mark.parametrize("kind,tree,temperature,top_k", [
    ("model", None, 1.3, 4), ("self", (2, 2), 1.0, 0)])
def test_invariant_speculative_sampling_has_target_distribution(kind, tree, temperature, top_k):
    """Batch-invariant speculative sampling (fixed-order sums, position-keyed draws) keeps the
    target's distribution: the first two tokens of 6000 rows against the exact joint
    distribution (`test_speculative`'s chi-square test, which has power against wrong
    verifiers there)."""
    from test_speculative import V, _chi2_pvalue, _exact_two_token_dist
    target = tiny_model(seed=1, vocab=V, scale=2.0)
    draft = tiny_model(seed=2, vocab=V, layers=1, scale=2.0)
    prompt = [1, 3, 0, 5, 2, 4, 1, 1, 0, 3, 2]
    spec = Speculation(draft=draft if kind == "model" else "self", gamma=2, sink=1, window=4,
                       tree=tree, adaptive=False)
    res = jaxspec.generate(target, [prompt] * 6000, max_new_tokens=2, temperature=temperature,
                           top_k=top_k, seed=3, speculation=spec, batch_invariant=True)
    joint = _exact_two_token_dist(target, prompt, temperature, top_k)
    assert _chi2_pvalue([tuple(t[:2]) for t in res.tokens], joint) > 1e-3


def test_adaptive_speculation_with_invariant_sampling_warns(caplog):
    """Adaptive rounds are chosen for the whole batch: sampled tokens then depend on the other
    rows, which `generate` says (greedy and non-adaptive calls say nothing)."""
    import warnings

    from jaxspec.serving import ServingEngine
    model = tiny_model(seed=1, dtype=jnp.bfloat16)
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    with pytest.warns(UserWarning, match="adaptive speculation"):
        jaxspec.generate(model, prompts, max_new_tokens=3, temperature=0.8, seed=[1, 2],
                         batch_invariant=True, speculation=Speculation(gamma=2, sink=4, window=16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxspec.generate(model, prompts, max_new_tokens=3, temperature=0.0, batch_invariant=True,
                         speculation=Speculation(gamma=2, sink=4, window=16))
        jaxspec.generate(model, prompts, max_new_tokens=3, temperature=0.8, seed=[1, 2],
                         batch_invariant=True,
                         speculation=Speculation(gamma=2, sink=4, window=16, adaptive=False))
    with caplog.at_level("WARNING", logger="jaxspec.serving"):
        ServingEngine(model, max_batch=2, max_len=32, batch_invariant=True,
                      speculation=Speculation(gamma=2, sink=4, window=16))
    assert "sampled ones are not" in caplog.text
