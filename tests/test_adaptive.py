"""Finished rows read no context, and adaptive decoding (stretches of speculative rounds and of
plain steps, as the cost model decides) stays lossless whichever it picks; a draft model's state
follows the plain steps, and ``gamma="auto"`` prefills a draft model only when it speculates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import Speculation
from jaxspec.costs import CostModel
from jaxspec.session import Decoder
from jaxspec.attention import AttentionPlan, attend

from test_speculative import (V, _chi2_pvalue, _exact_two_token_dist, _prompts, _samples)
from tiny import tiny_model


# ------------------------------------------------------------------ finished rows
@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_inactive_rows_read_no_context(impl):
    """An inactive row's output must not depend on its context (it is not read), an active
    row's must equal the plain attention; without ``active`` the context does matter (the check
    can fail)."""
    rng = np.random.default_rng(0)
    L, B, K, S_, D, T, G = 1, 3, 2, 256, 16, 3, 2
    q = jnp.asarray(rng.normal(size=(B, T, K * G, D)), jnp.float32)
    k = rng.normal(size=(L, B, K, S_, D)).astype(np.float32)
    v = rng.normal(size=(L, B, K, S_, D)).astype(np.float32)
    lengths = jnp.asarray([200, 150, 90], jnp.int32)
    active = jnp.asarray([True, False, True])
    k2, v2 = k.copy(), v.copy()
    k2[:, 1, :, T:150] = rng.normal(size=(L, K, 150 - T, D))  # row 1's context changes
    v2[:, 1, :, T:150] = np.nan  # ... even to NaN
    layer = jnp.int32(0)

    def run(kk, vv, act):
        plan = AttentionPlan(lengths=lengths, impl=impl, active=act)
        return np.asarray(attend(q, jnp.asarray(kk), jnp.asarray(vv), layer, plan))

    a, b = run(k, v, active), run(k2, v2, active)
    np.testing.assert_array_equal(a[1], b[1])
    assert np.isfinite(b).all()
    full = run(k, v, None)
    np.testing.assert_allclose(a[[0, 2]], full[[0, 2]], rtol=1e-5, atol=1e-6)
    assert not np.allclose(run(k2, np.nan_to_num(v2), None)[1], full[1])


# ------------------------------------------------------------------ forced round mixes
@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, scale=3.0)


@pytest.fixture(scope="module")
def prompts():
    return _prompts(np.random.default_rng(5), [30, 7, 45, 19])


@pytest.fixture(scope="module")
def reference(target, prompts):
    return jaxspec.generate(target, prompts, max_new_tokens=36).tokens


def _force_rounds(monkeypatch, kinds, rounds=2):
    """Decoding runs the kinds in ``kinds`` ("spec" / "plain") in turn, then the last one, each
    for ``rounds`` rounds. The decoder's own first speculative stretch (which measures the
    acceptance when the cost model says speculation might pay: timing-dependent) is turned off
    too, or a forced plain start could be overridden."""
    calls = []

    def next_round(self, spec_rd, view, rounds_left):
        kind = kinds[min(len(calls), len(kinds) - 1)]
        calls.append(kind)
        return (spec_rd if kind == "spec" else spec_rd.plain()), rounds
    monkeypatch.setattr(Decoder, "next_round", next_round)
    monkeypatch.setattr(CostModel, "worth_exploring", lambda self, *a: False)
    return calls


@pytest.mark.parametrize("kind", ["self", "ring", "full", "tree_self", "tree_ring"])
def test_adaptive_mix_is_lossless(target, prompts, reference, monkeypatch, kind):
    draft = tiny_model(seed=7, layers=1, scale=3.0)
    tree = (2, 1, 2) if kind.startswith("tree") else None
    spec = {"self": Speculation(draft="self", gamma=3, sink=2, window=6, adaptive=True),
            "ring": Speculation(draft=draft, gamma=3, sink=2, window=12, adaptive=True),
            "full": Speculation(draft=draft, gamma=3, window=None, adaptive=True),
            "tree_self": Speculation(draft="self", sink=2, window=6, tree=tree, adaptive=True),
            "tree_ring": Speculation(draft=draft, sink=2, window=12, tree=tree, adaptive=True),
            }[kind]
    _force_rounds(monkeypatch, ["spec", "plain", "spec", "plain", "plain", "spec"])
    res = jaxspec.generate(target, prompts, max_new_tokens=36, speculation=spec)
    assert res.tokens == reference
    plain = res.stats["plain_steps"]
    assert 0 < plain < res.stats["target_steps"]  # both kinds of rounds ran


@pytest.mark.parametrize("window", [None, 120])
def test_adaptive_mix_keeps_the_draft_in_step(target, prompts, reference, monkeypatch, window):
    """The draft == the target (a full cache, or a ring larger than any sequence): its cache
    must follow the plain steps too, or its drafts would stop being all accepted."""
    _force_rounds(monkeypatch, ["plain", "spec", "plain", "spec"])
    spec = Speculation(draft=target, gamma=3, sink=2, window=window, adaptive=True)
    res = jaxspec.generate(target, prompts, max_new_tokens=36, speculation=spec)
    assert res.tokens == reference
    assert 0 < res.stats["plain_steps"] < res.stats["target_steps"]
    assert res.stats["acceptance_rate"] == 1.0


def test_adaptive_mix_with_stop_token(target, prompts, reference, monkeypatch):
    stop = reference[2][5]
    want = jaxspec.generate(target, prompts, max_new_tokens=36, stop_tokens=[stop]).tokens
    _force_rounds(monkeypatch, ["spec", "plain"], rounds=3)
    spec = Speculation(draft="self", gamma=4, sink=2, window=6, adaptive=True)
    res = jaxspec.generate(target, prompts, max_new_tokens=36, stop_tokens=[stop],
                           speculation=spec)
    assert res.tokens == want


@pytest.mark.parametrize("kind,order", [
    ("self", "round_then_plain"), ("model", "plain_then_round"), ("model", "round_then_plain"),
    ("self", "plain_then_round")])
def test_adaptive_sampling_has_target_distribution(monkeypatch, order, kind):
    target = tiny_model(seed=1, vocab=V, scale=2.0)
    draft = tiny_model(seed=2, vocab=V, layers=1, scale=2.0)
    prompt = [1, 3, 0, 5, 2, 4, 1, 1, 0, 3, 2]
    n = 6000
    g = 2
    kinds = ["spec", "plain"] if order == "round_then_plain" else ["plain", "spec"]
    _force_rounds(monkeypatch, kinds, rounds=1)
    spec = Speculation(draft=draft if kind == "model" else "self", gamma=g, sink=1, window=4,
                       adaptive=True)
    res = jaxspec.generate(target, [prompt] * n, max_new_tokens=3, temperature=1.0, seed=11,
                           speculation=spec)
    assert 0 < res.stats["plain_steps"] < res.stats["target_steps"]
    samples = [tuple(t[:2]) for t in res.tokens]
    joint = _exact_two_token_dist(target, prompt, 1.0, 0)
    assert _chi2_pvalue(samples, joint) > 1e-3


def test_default_policy_is_lossless_and_decides_between_stretches(target, prompts, reference):
    """The cost model's own decisions (no forcing): tokens as plain decoding's, and the
    statistics say which kinds of rounds ran."""
    spec = Speculation(draft="self", gamma=3, sink=2, window=6)
    res = jaxspec.generate(target, prompts, max_new_tokens=36, speculation=spec)
    assert res.tokens == reference
    assert res.stats["plain_steps"] + (res.stats["tokens_per_step"] > 1) >= 1 or \
        res.stats["target_steps"] > 0


@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("chosen", [0, 2])
def test_auto_prefills_the_draft_only_when_it_speculates(target, prompts, reference, monkeypatch,
                                                         window, chosen):
    """With a draft model, `gamma="auto"` prefills the draft only if it chose to speculate (a
    plain run never pays for the draft's prefill); both ways the output is the autoregressive
    one, and with the target as its own full-cache draft every draft is accepted."""
    spec = Speculation(draft=target, gamma="auto", sink=2, window=window, adaptive=False)
    calls = []
    real = Decoder.draft_state

    def spy(self, token_lists, state):
        ds = real(self, token_lists, state)
        calls.append((ds.cache.k.shape, np.asarray(ds.cache.lengths)))
        return ds

    monkeypatch.setattr(Decoder, "draft_state", spy)
    monkeypatch.setattr(CostModel, "choose_gamma",
                        lambda self, ctx, cands, **kw: (chosen, 1.5 if chosen else 1.0))
    res = jaxspec.generate(target, prompts, max_new_tokens=36, speculation=spec)
    assert res.tokens == reference
    assert res.stats["gamma"] == chosen
    assert len(calls) == (1 if chosen else 0)
    if chosen:
        np.testing.assert_array_equal(calls[0][1], [len(p) - 1 for p in prompts])
        if window is None:
            assert res.stats["acceptance_rate"] == 1.0


def test_unknown_acceptance_is_measured_once(target, prompts, reference, monkeypatch):
    """Where the prior says plain but a good draft would pay, the first call speculates for a
    short stretch to measure the acceptance (lossless), and the cost model keeps what it saw."""
    from jaxspec.engine import decoder_for
    spec = Speculation(draft="self", gamma=3, sink=2, window=6)
    dec = decoder_for(target, spec)
    dec.costs.alpha = None
    calls = []

    def spy(self, *a):
        calls.append(self.explored)
        return not self.explored

    monkeypatch.setattr(CostModel, "worth_exploring", spy)
    monkeypatch.setattr(CostModel, "speculation_pays", lambda self, *a: False)
    res = jaxspec.generate(target, prompts, max_new_tokens=36, speculation=spec)
    assert res.tokens == reference
    assert res.stats["plain_steps"] < res.stats["target_steps"]  # a speculative stretch ran
    assert dec.costs.explored and 0.0 <= dec.costs.alpha <= 1.0
    res = jaxspec.generate(target, prompts, max_new_tokens=36, speculation=spec)
    assert res.tokens == reference and res.stats["plain_steps"] == res.stats["target_steps"]
    assert calls[0] is False and all(calls[1:])
