"""Speculative decoding is lossless: greedy == autoregressive token for token; sampling keeps the
target's distribution exactly (checked against an exact enumeration on a tiny vocabulary)."""

import os

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
    spec = Speculation(draft="self", gamma=gamma, sink=2, window=6, adaptive=False)
    res = jaxspec.generate(target, prompts, max_new_tokens=40, speculation=spec)
    assert res.tokens == reference
    assert 0.0 <= res.stats["acceptance_rate"] <= 1.0
    assert res.stats["target_steps"] < 40 + 1 or gamma == 1


def test_dense_self_draft_accepts_everything(target, prompts, reference):
    """The draft == the target (window=None): every draft is accepted, gamma+1 tokens a step."""
    res = jaxspec.generate(target, prompts, max_new_tokens=40,
                           speculation=Speculation(draft="self", gamma=4, sink=0, window=None, adaptive=False))
    assert res.tokens == reference
    assert res.stats["acceptance_rate"] == 1.0
    assert res.stats["tokens_per_step"] > 4.5


@pytest.mark.parametrize("gamma,window", [
    (2, None), (2, 12), (5, None), (5, 12)])
def test_draft_model_greedy_is_lossless(target, prompts, reference, window, gamma):
    draft = tiny_model(seed=7, layers=1, scale=3.0)
    spec = Speculation(draft=draft, gamma=gamma, sink=2, window=window, adaptive=False)
    res = jaxspec.generate(target, prompts, max_new_tokens=40, speculation=spec)
    assert res.tokens == reference


def test_draft_equal_to_target_accepts_everything(target, prompts, reference):
    for window in (None, 20):  # full cache, then a ring buffer much shorter than the prompts
        spec = Speculation(draft=target, gamma=3, sink=2, window=window, adaptive=False)
        res = jaxspec.generate(target, prompts, max_new_tokens=40, speculation=spec)
        assert res.tokens == reference
        if window is None:
            assert res.stats["acceptance_rate"] == 1.0


def test_stop_token_inside_a_round(target, prompts, reference):
    stop = reference[0][9]
    plain = jaxspec.generate(target, prompts, max_new_tokens=40, stop_tokens=[stop]).tokens
    for spec in (Speculation(draft="self", gamma=6, sink=2, window=6, adaptive=False),
                 Speculation(draft=target, gamma=6, window=None, adaptive=False)):
        res = jaxspec.generate(target, prompts, max_new_tokens=40, stop_tokens=[stop],
                               speculation=spec)
        assert res.tokens == plain
    for ref, got in zip(reference, plain):
        assert got == (ref[:ref.index(stop) + 1] if stop in ref else ref)


def test_budget_is_exact_per_row(target, prompts):
    ref = jaxspec.generate(target, prompts, max_new_tokens=7).tokens
    res = jaxspec.generate(target, prompts, max_new_tokens=7,
                           speculation=Speculation(draft="self", gamma=5, sink=2, window=6, adaptive=False))
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


@pytest.mark.parametrize("kind,temperature,top_k", [
    ("model", 1.0, 0), ("self", 0.8, 0), ("model", 1.3, 4)])
def test_sampling_speculation_has_target_distribution(tiny_vocab_models, kind, temperature, top_k):
    target, draft = tiny_vocab_models
    prompt = [1, 3, 0, 5, 2, 4, 1, 1, 0, 3, 2]
    spec = Speculation(draft=draft if kind == "model" else "self", gamma=2, sink=1, window=4, adaptive=False)
    joint = _exact_two_token_dist(target, prompt, temperature, top_k)
    samples = _samples(target, spec, prompt, 6000, temperature, top_k, seed=3)
    assert _chi2_pvalue(samples, joint) > 1e-3


def test_sampling_test_has_power(tiny_vocab_models, monkeypatch):
    """The same test must fail for a wrong verifier (one that accepts every draft)."""
    import jaxspec.decoding as spec_mod
    from jaxspec import sampling

    def always_accept(rng, drafts, q, p, **kw):
        B, g = drafts.shape
        return jnp.full((B,), g, jnp.int32), sampling.categorical(rng, p[:, g])

    monkeypatch.setattr(spec_mod, "verify_chain", always_accept)
    target, draft = tiny_vocab_models
    prompt = [1, 3, 0, 5, 2, 4, 1, 1, 0, 3, 2]
    joint = _exact_two_token_dist(target, prompt, 1.0, 0)
    samples = _samples(target, Speculation(draft=draft, gamma=2, window=None, adaptive=False), prompt, 6000,
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
        jaxspec.generate(target, [[1, 2, 3]], max_new_tokens=4, speculation=Speculation(**kw, adaptive=False))


def test_draft_vocab_and_dtype_mismatch(target):
    other_vocab = tiny_model(seed=3, vocab=50)
    with pytest.raises(ValueError, match="vocabulary"):
        jaxspec.generate(target, [[1, 2]], max_new_tokens=3,
                         speculation=Speculation(draft=other_vocab, window=None, adaptive=False))
    bf16 = tiny_model(seed=3, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        jaxspec.generate(target, [[1, 2]], max_new_tokens=3,
                         speculation=Speculation(draft=bf16, window=None, adaptive=False))
    short = tiny_model(seed=3, ctx=16)
    with pytest.raises(ValueError, match="context"):
        jaxspec.generate(target, [[1] * 10], max_new_tokens=30,
                         speculation=Speculation(draft=short, window=None, adaptive=False))
    with pytest.raises(ValueError, match="window"):
        jaxspec.generate(target, [[1, 2]], max_new_tokens=3,
                         speculation=Speculation(draft=short, gamma=4, window=5, adaptive=False))


# ------------------------------------------------------------------------- gamma="auto"
def _cost_model(span, rates=None):
    from jaxspec.costs import CostModel, DeviceRates
    # a fixed device: 1 TB/s, 100 TFLOP/s, no overhead (the choice is a function of the roofline)
    rates = rates or DeviceRates(bandwidth=1e12, matmul=1e14, overhead=0.0)
    return CostModel(tiny_model(seed=0), None, span=span, rates=rates)


def test_cost_model_choice():
    from jaxspec.costs import AUTO_MARGIN, HYSTERESIS, expected_tokens, per_token_acceptance
    from jaxspec.speculation import GAMMA_CANDIDATES as G
    cm = _cost_model(span=8)
    cm.alpha = 0.8
    # KV-bound: long contexts, the sparse draft reads 8 keys a row -> speculate, deep
    kv_bound = np.full(64, 4000.0)
    g, s = cm.choose_gamma(kv_bound, G)
    assert g >= 4 and s > 2
    # weight-bound: contexts within the draft's span, the draft costs what the target costs
    cm2 = _cost_model(span=8)
    cm2.alpha = 0.9
    assert cm2.choose_gamma(np.full(2, 4.0), G) == (0, 1.0)
    # hysteresis: a previous choice within HYSTERESIS of the best is kept (no recompile on
    # noise), one clearly worse is not
    mid = np.full(64, 500.0)
    one = {}
    for h in G:
        c = _cost_model(span=8)
        c.alpha = 0.6
        one[h] = c.choose_gamma(mid, (h,))[1]
    best = max(one, key=one.get)
    near = [h for h in G if h != best and one[h] * HYSTERESIS >= one[best]]
    far = [h for h in G if one[h] * HYSTERESIS < one[best]]
    assert near and far
    for prev, want in ((near[0], near[0]), (far[0], best)):
        c = _cost_model(span=8)
        c.alpha, c.gamma = 0.6, prev
        assert c.choose_gamma(mid, G)[0] == want
    c = _cost_model(span=8)
    c.alpha, c.gamma = 0.9, 3
    assert c.choose_gamma(np.full(2, 4.0), G) == (0, 1.0)
    # marginal: a predicted gain under the margin decodes plainly
    c = _cost_model(span=8)
    c.alpha = 0.01
    assert c.choose_gamma(kv_bound, G) == (0, 1.0)
    assert AUTO_MARGIN > 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert per_token_acceptance(0.5 + 0.25, 2) == pytest.approx(0.5, abs=1e-6)


def test_auto_switches_to_an_uncompiled_gamma_only_when_it_has_paid_for_its_compilation():
    """With loops compiled for some gammas, `choose_gamma` keeps the best of those while the time
    an uncompiled better gamma was predicted to save, summed over calls, stays under a loop's
    compile time; then it switches (once). Without a compile time or a compiled set it picks the
    best outright."""
    from jaxspec.speculation import GAMMA_CANDIDATES as G
    rng = np.random.default_rng()
    mid = np.full(64, float(rng.uniform(300, 800)))
    c = _cost_model(span=8)
    c.alpha = float(rng.uniform(0.6, 0.9))
    best, best_s = c.choose_gamma(mid, G, remember=False)
    others = {g: c.choose_gamma(mid, (g,), remember=False)[1] for g in G if g != best}
    alt = max(others, key=others.get)
    assert best and others[alt] < best_s
    steps = int(rng.integers(50, 400))
    saved = steps * c.plain_time(mid) * (1 / others[alt] - 1 / best_s)
    calls = int(rng.integers(2, 6))
    c.observe_compile(saved * (calls - 0.5))
    c.observe_compile(saved * 0.1)  # (the largest compile time counts)
    got = [c.choose_gamma(mid, G, remember=False, compiled={0, alt}, steps=steps)[0]
           for _ in range(calls + 1)]
    assert got == [alt] * (calls - 1) + [best] + [alt], (got, calls)  # pays once, then again
    assert c.choose_gamma(mid, G, remember=False, compiled={0, alt, best}, steps=steps)[0] == best
    fresh = _cost_model(span=8)
    fresh.alpha = c.alpha
    assert fresh.choose_gamma(mid, G, compiled={0, alt}, steps=steps)[0] == best  # no compile seen


def test_cost_model_learns_from_timed_stretches():
    """Observed times replace the roofline's guess: stretches measured twice as slow as their
    roofline make later predictions of that kind twice as slow; before any round was timed, rounds
    are predicted from what plain steps measured; repeated measurements average, the newer
    weighing more."""
    from jaxspec.costs import PRIOR_ROUND_FACTOR
    cm = _cost_model(span=8)
    ctx = np.full(16, 1000.0)
    levels, nodes = (1, 1, 1), 4
    r0, p0 = cm.round_roofline(ctx, levels, nodes), cm.plain_roofline(ctx)
    assert cm.plain_time(ctx) == pytest.approx(p0)
    cm.observe("plain", 3 * 5 * p0, 5 * p0, rounds=5)
    assert cm.plain_time(ctx) == pytest.approx(3 * p0)
    assert cm.round_time(ctx, levels, nodes) == pytest.approx(3 * PRIOR_ROUND_FACTOR * r0)
    cm.observe(("round", levels, nodes), 2 * r0, r0)
    assert cm.round_time(ctx, levels, nodes) == pytest.approx(2 * r0)
    cm.observe(("round", levels, nodes), 4 * r0, r0)
    assert 3 * r0 < cm.round_time(ctx, levels, nodes) < 4 * r0
    cm.observe_acceptance(accepted=3 * (0.5 + 0.25), spec_rounds=3, gamma=2)
    assert cm.alpha == pytest.approx(0.5, abs=1e-6)


def test_cost_model_fits_the_fixed_cost_of_a_forward():
    """A device whose forwards cost 0.9 x their roofline plus a fixed part each (kernel
    latencies; here a tenth of a full batch's plain step): once plain steps were timed at two batch sizes, plain steps and rounds of any
    size are predicted from that law, so a round over the last few rows of a batch is priced
    at its real cost, not at the full batch's ratio."""
    cm = _cost_model(span=8)
    levels, nodes = (1, 1, 1, 1), 5
    kind = ("round", levels, nodes)
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    big, small = np.full(64, 4000.0), np.full(int(rng.integers(2, 5)), 1000.0)
    fixed = 0.1 * cm.plain_roofline(big)

    def true_plain(c):
        return 0.9 * cm.plain_roofline(c) + fixed

    def true_round(c):
        return 0.9 * cm.round_roofline(c, levels, nodes) + 5 * fixed

    n = int(rng.integers(3, 40))
    cm.observe("plain", n * true_plain(big), n * cm.plain_roofline(big), rounds=n)
    cm.observe(kind, 9 * true_round(big), 9 * cm.round_roofline(big, levels, nodes), rounds=9)
    # one size only: the full batch's ratio, which underprices the few rows
    assert cm.round_time(small, levels, nodes) < 0.8 * true_round(small)
    cm.observe("plain", n * true_plain(small), n * cm.plain_roofline(small), rounds=n)
    assert cm.fixed_per_forward() == pytest.approx(fixed, rel=1e-6)
    mid = np.full(17, 3500.0)
    assert cm.plain_time(mid) == pytest.approx(true_plain(mid), rel=1e-6)
    # the rounds were timed at one size: their fixed part is the plain steps' per forward
    assert cm.round_time(small, levels, nodes) == pytest.approx(true_round(small), rel=1e-6)
    assert cm.round_time(big, levels, nodes) == pytest.approx(true_round(big), rel=1e-6)
    # whether the last rows should speculate follows: at 3.5 tokens per round a full batch pays,
    # a few rows do not
    tokens = 3.5
    assert cm.speculation_pays(big, np.full(len(big), tokens), levels, nodes)
    assert not cm.speculation_pays(small, np.full(len(small), tokens), levels, nodes)


def test_a_borrowed_fixed_cost_does_not_make_plain_steps_look_free():
    """Plain steps timed at one size only (the last few rows of a batch) and rounds timed at two:
    the plain steps' fixed part is borrowed from the rounds (per forward; a draft forward's is
    larger than a plain one's), but never so much that their bytes would read faster than
    `FIT_MIN_SCALE` x the roofline, so a full batch's plain step is not predicted far too cheap
    (which made `gamma="auto"` decode plainly where rounds paid)."""
    from jaxspec.costs import FIT_MIN_SCALE
    cm = _cost_model(span=8)
    levels, nodes = (1, 1, 1, 1), 5
    kind = ("round", levels, nodes)
    big, small = np.full(64, 4000.0), np.full(4, 1000.0)
    fp = 0.1 * cm.plain_roofline(big)  # a plain forward's fixed part; a draft forward's: 3x

    def true_plain(c):
        return 0.95 * cm.plain_roofline(c) + fp

    def true_round(c):
        return 0.95 * cm.round_roofline(c, levels, nodes) + 5 * 3 * fp

    for c in (big, small):
        cm.observe(kind, 9 * true_round(c), 9 * cm.round_roofline(c, levels, nodes), rounds=9)
    cm.observe("plain", 50 * true_plain(small), 50 * cm.plain_roofline(small), rounds=50)
    assert cm.fixed_per_forward() > 2 * fp  # the rounds' (no plain fit at two sizes)
    assert cm.plain_time(small) == pytest.approx(true_plain(small), rel=1e-6)
    got = cm.plain_time(big)
    assert got >= FIT_MIN_SCALE * cm.plain_roofline(big)
    assert got == pytest.approx(true_plain(big), rel=0.1)


def test_plain_steps_of_self_speculation_are_plain_decodings_program(target):
    """With self-speculation a plain step needs nothing of the drafter, so the adaptive plain
    stretches and ``gamma="auto"``'s plain choice are the very round (one compiled program) of
    decoding without speculation; a draft model's plain step keeps its drafter (its cache
    follows the committed token)."""
    from jaxspec.session import Decoder
    plain = Decoder(target, None).round(0)
    for gamma in (2, 4):
        rd = Decoder(target, Speculation(gamma=gamma, sink=2, window=6)).round(gamma)
        assert rd.speculative and rd.plain() == plain and hash(rd.plain()) == hash(plain)
    draft = tiny_model(seed=3, layers=1)
    rd = Decoder(target, Speculation(draft=draft, gamma=3, window=None)).round(3)
    assert not rd.plain().speculative and rd.plain().drafter is rd.drafter
    assert rd.plain() != plain


def test_stragglers_are_decoded_plainly():
    """KV-bound rows with a good acceptance: the round pays; once only a low-acceptance
    straggler is left (its context no longer outweighs the weights), plain steps are cheaper."""
    cm = _cost_model(span=8)
    ctx = np.full(64, 4000.0)
    levels, nodes = (1, 1, 1, 1), 5
    assert cm.speculation_pays(ctx, np.full(64, 4.0), levels, nodes)
    assert not cm.speculation_pays(ctx[:1], np.full(1, 1.4), levels, nodes)
    assert not cm.speculation_pays(ctx[:0], np.zeros(0), levels, nodes)


def test_auto_gamma_is_lossless_and_reports_its_choice(target, prompts, reference):
    spec = Speculation(draft="self", gamma="auto", sink=2, window=6)
    res = jaxspec.generate(target, prompts, max_new_tokens=40, speculation=spec)
    assert res.tokens == reference
    assert res.stats["gamma"] in (0, 1, 2, 3, 4, 5, 6)
    assert res.stats["predicted_speedup"] >= 1.0
    if res.stats["gamma"]:  # per-row spread of tokens per step, slowest row first
        q = res.stats["tokens_per_step_rows"]
        assert 1.0 <= q[0] <= q[50] <= q[100] <= res.stats["gamma"] + 1


def test_second_auto_call_costs_what_plain_decoding_costs(target):
    """``gamma="auto"``'s choice and the loops it compiles are paid once per shape: a second
    call with the same shapes decodes in at most 1.5x plain decoding's time plus a few tens of
    ms, and reports no compile time (decode time excludes compilation)."""
    rng = np.random.default_rng(11)
    ps = [rng.integers(0, V, size=int(n)).tolist() for n in rng.integers(20, 60, size=4)]
    spec = Speculation(draft="self", gamma="auto", sink=2, window=6)
    for _ in range(2):
        plain = jaxspec.generate(target, ps, max_new_tokens=48)
        auto = jaxspec.generate(target, ps, max_new_tokens=48, speculation=spec)
    assert auto.tokens == plain.tokens
    assert auto.stats["compile_seconds"] == 0.0 and plain.stats["compile_seconds"] == 0.0
    t_plain = min(jaxspec.generate(target, ps, max_new_tokens=48).stats["decode_seconds"]
                  for _ in range(3))
    t_auto = min(jaxspec.generate(target, ps, max_new_tokens=48, speculation=spec)
                 .stats["decode_seconds"] for _ in range(3))
    assert t_auto <= 1.5 * t_plain + 0.05, (t_auto, t_plain)
