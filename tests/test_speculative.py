"""Speculative decoding is lossless: greedy == autoregressive token for token; sampling keeps the
target's distribution exactly (checked against an exact enumeration on a tiny vocabulary)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jaxspec
from jaxspec import Speculation
from jaxspec.attention import AttentionPlan
from jaxspec.cache import KVCache
from jaxspec.model import forward

from tiny import tiny_model


def _prompts(rng, lengths, vocab=64):
    return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, scale=3.0)


@pytest.fixture(scope="module")
def prompts():
    return _prompts(np.random.default_rng(0), [37, 5, 52, 20])


@pytest.fixture(scope="module")
def reference(target, prompts):
    return jaxspec.generate(target, prompts, max_new_tokens=40).tokens


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_self_speculation_greedy_is_lossless(target, prompts, reference, gamma):
    # sink + window (2 + 6) much smaller than the prompts: sparsity bites; 40 new tokens slide it
    spec = Speculation(draft="self", gamma=gamma, sink=2, window=6)
    res = jaxspec.generate(target, prompts, max_new_tokens=40, speculation=spec)
    assert res.tokens == reference
    assert 0.0 <= res.stats["acceptance_rate"] <= 1.0
    assert res.stats["target_steps"] < 40 + 1 or gamma == 1


def test_dense_self_draft_accepts_everything(target, prompts, reference):
    """The draft == the target (window=None): every draft is accepted, gamma+1 tokens a step."""
    res = jaxspec.generate(target, prompts, max_new_tokens=40,
                           speculation=Speculation(draft="self", gamma=4, sink=0, window=None))
    assert res.tokens == reference
    assert res.stats["acceptance_rate"] == 1.0
    assert res.stats["tokens_per_step"] > 4.5


@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("gamma", [2, 5])
def test_draft_model_greedy_is_lossless(target, prompts, reference, window, gamma):
    draft = tiny_model(seed=7, layers=1, scale=3.0)
    spec = Speculation(draft=draft, gamma=gamma, sink=2, window=window)
    res = jaxspec.generate(target, prompts, max_new_tokens=40, speculation=spec)
    assert res.tokens == reference


def test_draft_equal_to_target_accepts_everything(target, prompts, reference):
    for window in (None, 20):  # full cache, then a ring buffer much shorter than the prompts
        spec = Speculation(draft=target, gamma=3, sink=2, window=window)
        res = jaxspec.generate(target, prompts, max_new_tokens=40, speculation=spec)
        assert res.tokens == reference
        if window is None:
            assert res.stats["acceptance_rate"] == 1.0


def test_stop_token_inside_a_round(target, prompts, reference):
    stop = reference[0][9]
    plain = jaxspec.generate(target, prompts, max_new_tokens=40, stop_tokens=[stop]).tokens
    for spec in (Speculation(draft="self", gamma=6, sink=2, window=6),
                 Speculation(draft=target, gamma=6, window=None)):
        res = jaxspec.generate(target, prompts, max_new_tokens=40, stop_tokens=[stop],
                               speculation=spec)
        assert res.tokens == plain
    for ref, got in zip(reference, plain):
        assert got == (ref[:ref.index(stop) + 1] if stop in ref else ref)


def test_budget_is_exact_per_row(target, prompts):
    ref = jaxspec.generate(target, prompts, max_new_tokens=7).tokens
    res = jaxspec.generate(target, prompts, max_new_tokens=7,
                           speculation=Speculation(draft="self", gamma=5, sink=2, window=6))
    assert res.tokens == ref
    assert all(len(t) == 7 for t in res.tokens)


# ------------------------------------------------------------------------- sampling
V = 6


def _exact_two_token_dist(model, prompt, temperature, top_k):
    """Exact distribution of the first two generated tokens, by enumeration (numpy filter)."""
    def probs(logits):
        z = np.asarray(logits, np.float64) / temperature
        if top_k:
            kth = np.sort(z)[-top_k]
            z = np.where(z >= kth, z, -np.inf)
        e = np.exp(z - z.max())
        return e / e.sum()

    cfg = model.config
    toks = np.array([prompt + [t] for t in range(V)])  # [V, n+1]
    n = toks.shape[1]
    cache = KVCache.create(cfg, V, n + 8, jnp.float32)
    plan = AttentionPlan(lengths=jnp.zeros((V,), jnp.int32), impl="xla")
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (V, n))
    logits, _ = forward(cfg, model.params, jnp.asarray(toks), pos, cache, plan)
    logits = np.asarray(logits)
    p1 = probs(logits[0, n - 2])
    joint = np.stack([p1[a] * probs(logits[a, n - 1]) for a in range(V)])
    return joint  # [V, V]


def _chi2_pvalue(samples, joint):
    counts = np.zeros((V, V))
    for a, b in samples:
        counts[a, b] += 1
    expected = joint * len(samples)
    keep = expected > 5
    # rare cells pooled into one bin (a wrong sampler that puts mass there is caught too)
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], max(expected[~keep].sum(), 1e-3))
    chi2 = ((obs - exp) ** 2 / exp).sum()
    return stats.chi2.sf(chi2, df=len(obs) - 1)


def _samples(target, spec, prompt, n, temperature, top_k, seed):
    res = jaxspec.generate(target, [prompt] * n, max_new_tokens=2, temperature=temperature,
                           top_k=top_k, seed=seed, speculation=spec)
    return [tuple(t[:2]) for t in res.tokens]


@pytest.fixture(scope="module")
def tiny_vocab_models():
    target = tiny_model(seed=1, vocab=V, scale=2.0)
    draft = tiny_model(seed=2, vocab=V, layers=1, scale=2.0)
    return target, draft


@pytest.mark.parametrize("kind,temperature,top_k", [("model", 1.0, 0), ("self", 0.8, 0),
                                                     ("model", 1.3, 4)])
def test_sampling_speculation_has_target_distribution(tiny_vocab_models, kind, temperature, top_k):
    target, draft = tiny_vocab_models
    prompt = [1, 3, 0, 5, 2, 4, 1, 1, 0, 3, 2]
    spec = Speculation(draft=draft if kind == "model" else "self", gamma=2, sink=1, window=4)
    joint = _exact_two_token_dist(target, prompt, temperature, top_k)
    samples = _samples(target, spec, prompt, 6000, temperature, top_k, seed=3)
    assert _chi2_pvalue(samples, joint) > 1e-3


def test_sampling_test_has_power(tiny_vocab_models, monkeypatch):
    """The same test must fail for a wrong verifier (one that accepts every draft)."""
    import jaxspec.speculative as spec_mod
    from jaxspec import sampling

    def always_accept(rng, drafts, q, p):
        B, g = drafts.shape
        return jnp.full((B,), g, jnp.int32), sampling.categorical(rng, p[:, g])

    monkeypatch.setattr(spec_mod, "verify_chain", always_accept)
    target, draft = tiny_vocab_models
    prompt = [1, 3, 0, 5, 2, 4, 1, 1, 0, 3, 2]
    joint = _exact_two_token_dist(target, prompt, 1.0, 0)
    samples = _samples(target, Speculation(draft=draft, gamma=2, window=None), prompt, 6000,
                       1.0, 0, seed=3)
    assert _chi2_pvalue(samples, joint) < 1e-6


def test_plain_sampling_has_target_distribution(tiny_vocab_models):
    target, _ = tiny_vocab_models
    prompt = [1, 3, 0, 5, 2, 4, 1, 1, 0, 3, 2]
    joint = _exact_two_token_dist(target, prompt, 1.0, 0)
    assert _chi2_pvalue(_samples(target, None, prompt, 6000, 1.0, 0, seed=4), joint) > 1e-3


# ------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw,msg", [
    (dict(gamma=0), "gamma"), (dict(gamma=2.5), "gamma"), (dict(sink=-1), "sink"),
    (dict(window=-3), "window"), (dict(draft=42), "draft"),
])
def test_bad_speculation_is_rejected_before_compiling(target, kw, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        jaxspec.generate(target, [[1, 2, 3]], max_new_tokens=4, speculation=Speculation(**kw))


def test_draft_vocab_and_dtype_mismatch(target):
    other_vocab = tiny_model(seed=3, vocab=50)
    with pytest.raises(ValueError, match="vocabulary"):
        jaxspec.generate(target, [[1, 2]], max_new_tokens=3,
                         speculation=Speculation(draft=other_vocab, window=None))
    bf16 = tiny_model(seed=3, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        jaxspec.generate(target, [[1, 2]], max_new_tokens=3,
                         speculation=Speculation(draft=bf16, window=None))
    short = tiny_model(seed=3, ctx=16)
    with pytest.raises(ValueError, match="context"):
        jaxspec.generate(target, [[1] * 10], max_new_tokens=30,
                         speculation=Speculation(draft=short, window=None))
    with pytest.raises(ValueError, match="window"):
        jaxspec.generate(target, [[1, 2]], max_new_tokens=3,
                         speculation=Speculation(draft=short, gamma=4, window=5))


# ------------------------------------------------------------------------- gamma="auto"
def test_cost_model_choice():
    from jaxspec.speculative import choose_gamma, expected_tokens, per_token_acceptance
    from jaxspec.speculative import AUTO_MARGIN as S_AUTO_MARGIN
    # KV-bound: verifying 7 tokens costs ~ one step, the draft is cheap -> speculate, deep
    kv_bound = {"plain": 10.0, "draft": 1.0, "verify": {g: 10.0 + 0.2 * g for g in range(1, 7)}}
    g, s = choose_gamma(kv_bound, 0.8)
    assert g >= 4 and s > 2
    # weight-bound: the self-draft costs as much as the target -> never speculate
    w_bound = {"plain": 10.0, "draft": 9.5, "verify": {g: 10.0 * (1 + 0.1 * g) for g in range(1, 7)}}
    assert choose_gamma(w_bound, 0.9) == (0, 1.0)
    # hysteresis: a previous choice within 5% of the best is kept (no recompile on noise),
    # one clearly worse is not
    best, s_best = choose_gamma(kv_bound, 0.8)
    near = [h for h in range(1, 7) if h != best and
            choose_gamma(kv_bound, 0.8, candidates=(h,))[1] * 1.05 >= s_best]
    far = [h for h in range(1, 7) if choose_gamma(kv_bound, 0.8, candidates=(h,))[1] * 1.05 < s_best]
    assert near and far
    assert choose_gamma(kv_bound, 0.8, previous=near[0])[0] == near[0]
    assert choose_gamma(kv_bound, 0.8, previous=far[0]) == (best, s_best)
    assert choose_gamma(w_bound, 0.9, previous=3) == (0, 1.0)
    # marginal: gamma 1 predicted ~1.07x (inside the cost measurements' scatter) -> plain
    marginal = {"plain": 10.0, "draft": 9.0, "verify": {g: 9.7 + 10.0 * (g - 1) for g in range(1, 7)}}
    s1 = choose_gamma(marginal, 1.0, candidates=(1,), margin=1.0)[1]
    assert 1.0 < s1 < S_AUTO_MARGIN and choose_gamma(marginal, 1.0) == (0, 1.0)
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert per_token_acceptance(0.5 + 0.25, 2) == pytest.approx(0.5, abs=1e-6)


def test_auto_gamma_is_lossless_and_reports_costs(target, prompts, reference):
    spec = Speculation(draft="self", gamma="auto", sink=2, window=6)
    res = jaxspec.generate(target, prompts, max_new_tokens=40, speculation=spec)
    assert res.tokens == reference
    assert res.stats["gamma"] in (0, 1, 2, 3, 4, 5, 6)
    if res.stats["gamma"]:  # per-row spread of tokens per step, slowest row first
        q = res.stats["tokens_per_step_rows"]
        assert 1.0 <= q[0] <= q[50] <= q[100] <= res.stats["gamma"] + 1
    assert set(res.stats["step_costs_ms"]) == {"plain", "draft", "verify"}
    # profiling with a fixed gamma reports the draft / verify split
    res = jaxspec.generate(target, prompts, max_new_tokens=40, profile=True,
                           speculation=Speculation(draft="self", gamma=3, sink=2, window=6))
    assert res.tokens == reference and res.stats["gamma"] == 3
    assert res.stats["draft_seconds_estimate"] > 0 and res.stats["verify_seconds_estimate"] > 0
