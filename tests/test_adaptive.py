"""Finished rows read no context, and the adaptive loop (each round: speculate or one plain step)
stays lossless whichever rounds it picks; its cost model reproduces the measured step costs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import Speculation
from jaxspec import speculative as S
from jaxspec.attention import AttentionPlan, attend
from jaxspec.cache import kv_bytes_per_token

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


def _threshold_costs(x):
    """Speculate iff the running rows' total context >= x (plain cost = sum L, speculative
    cost = x, one expected token per row either way)."""
    def fake(*args, **kw):
        return np.asarray([0.0, 1.0, x, 0.0, 0.0, 8.0, 1.0, 1e9], np.float32)
    return fake


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
    start = sum(len(p) - 1 for p in prompts)
    monkeypatch.setattr(S, "round_costs", _threshold_costs(start + 40))
    res = jaxspec.generate(target, prompts, max_new_tokens=36, speculation=spec)
    assert res.tokens == reference
    plain = res.stats["plain_steps"]
    assert 0 < plain < res.stats["target_steps"]  # both kinds of rounds ran


@pytest.mark.parametrize("window", [None, 120])
def test_adaptive_mix_keeps_the_draft_in_step(target, prompts, reference, monkeypatch, window):
    """The draft == the target (a full cache, or a ring larger than any sequence): its cache
    must follow the plain steps too, or its drafts would stop being all accepted."""
    start = sum(len(p) - 1 for p in prompts)
    monkeypatch.setattr(S, "round_costs", _threshold_costs(start + 40))
    spec = Speculation(draft=target, gamma=3, sink=2, window=window, adaptive=True)
    res = jaxspec.generate(target, prompts, max_new_tokens=36, speculation=spec)
    assert res.tokens == reference
    assert 0 < res.stats["plain_steps"] < res.stats["target_steps"]
    assert res.stats["acceptance_rate"] == 1.0


def test_adaptive_mix_with_stop_token(target, prompts, reference, monkeypatch):
    stop = reference[2][5]
    want = jaxspec.generate(target, prompts, max_new_tokens=36, stop_tokens=[stop]).tokens
    start = sum(len(p) - 1 for p in prompts)
    monkeypatch.setattr(S, "round_costs", _threshold_costs(start + 20))
    spec = Speculation(draft="self", gamma=4, sink=2, window=6, adaptive=True)
    res = jaxspec.generate(target, prompts, max_new_tokens=36, stop_tokens=[stop],
                           speculation=spec)
    assert res.tokens == want


@pytest.mark.parametrize("order", ["round_then_plain", "plain_then_round"])
@pytest.mark.parametrize("kind", ["self", "model"])
def test_adaptive_sampling_has_target_distribution(monkeypatch, order, kind):
    target = tiny_model(seed=1, vocab=V, scale=2.0)
    draft = tiny_model(seed=2, vocab=V, layers=1, scale=2.0)
    prompt = [1, 3, 0, 5, 2, 4, 1, 1, 0, 3, 2]
    n = 6000
    g = 2
    if order == "round_then_plain":
        # prior 100 tokens a round: the first round speculates; then each row's own count
        # (<= g + 1 < g + 1.5) says plain
        c = [1.0, 0.0, g + 1.5, 0.0, 0.0, 8.0, 100.0, 1e-6]
    else:
        # speculate once the rows' total context passes the prompt's: a plain step first
        c = [0.0, 1.0, n * (len(prompt) - 1 + 0.5), 0.0, 0.0, 8.0, 1.0, 1e9]
    monkeypatch.setattr(S, "round_costs", lambda *a, **k: np.asarray(c, np.float32))
    spec = Speculation(draft=draft if kind == "model" else "self", gamma=g, sink=1, window=4,
                       adaptive=True)
    res = jaxspec.generate(target, [prompt] * n, max_new_tokens=3, temperature=1.0, seed=11,
                           speculation=spec)
    assert 0 < res.stats["plain_steps"] < res.stats["target_steps"]
    samples = [tuple(t[:2]) for t in res.tokens]
    joint = _exact_two_token_dist(target, prompt, 1.0, 0)
    assert _chi2_pvalue(samples, joint) > 1e-3


# ------------------------------------------------------------------ the cost model
def test_round_costs_reproduce_measured_costs():
    """Calibrated on measured step costs at the full batch, the model gives back exactly those
    costs there; the byte model charges weights once per forward and K/V per context token."""
    model = tiny_model(seed=0)
    spec = Speculation(draft="self", gamma=3, sink=4, window=60)
    B, ctx, g = 8, 300.0, 3
    costs = {"plain": 2e-3, "draft": 0.7e-3, "verify": {1: 2.1e-3, 3: 2.4e-3, 6: 3e-3}}
    c = S.round_costs(model, spec, None, n_forwards=g, prior_tokens=2.5, batch=B, context=ctx,
                      costs=costs, gamma=g)
    plain = c[0] + c[1] * B * ctx
    span = spec.sink + spec.window
    round_ = c[2] + c[3] * B * ctx + c[4] * B * min(ctx, span)
    assert plain == pytest.approx(costs["plain"], rel=1e-5)
    assert round_ == pytest.approx(g * costs["draft"] + costs["verify"][g], rel=1e-5)
    b = S.round_costs(model, spec, None, n_forwards=g, prior_tokens=2.5, batch=B, context=ctx)
    W = S._param_bytes(model.params)
    kv = kv_bytes_per_token(model.config, model.dtype)
    np.testing.assert_allclose(b[:5], [W, kv, (g + 1) * W, kv, g * kv], rtol=1e-6)
    assert b[5] == span and b[6] == 2.5


def test_stragglers_are_decoded_plainly():
    """Bytes of a KV-bound shape: with every row running at a good acceptance the round pays;
    once only a low-acceptance straggler is left, a plain step is cheaper."""
    cfg = tiny_model(seed=0).config
    loop = S.SpecLoop(config=cfg, stop_ids=(), gamma=4, sink=16, window=496, greedy=True,
                      adaptive=True)
    B, W, kv = 64, 3e9, 28672.0
    c = jnp.asarray([W, kv, 5 * W, kv, 4 * kv, 512.0, 3.0, 2.0], jnp.float32)

    class St:  # the fields speculation_pays reads
        def __init__(self, done, lengths):
            self.done = jnp.asarray(done)
            self.cache = type("C", (), {"lengths": jnp.asarray(lengths, jnp.int32)})

    lengths = np.full(B, 16384)
    acc = {"round_costs": c, "rows_committed": jnp.full((B,), 40, jnp.int32),
           "rows_steps": jnp.full((B,), 10, jnp.int32)}
    assert bool(loop.speculation_pays((St(np.zeros(B, bool), lengths), None, acc)))
    done = np.ones(B, bool)
    done[7] = False
    slow = dict(acc, rows_committed=acc["rows_committed"].at[7].set(14))
    assert not bool(loop.speculation_pays((St(done, lengths), None, slow)))


@pytest.mark.parametrize("draft", ["self", "model"])
def test_measure_costs_keeps_the_caches(target, prompts, draft):
    """`measure_costs` runs device loops of forwards on the live caches: every committed slot
    and the lengths must come back bit for bit (only slots past the lengths are written), and
    every cost must be a positive finite time."""
    d = "self" if draft == "self" else tiny_model(seed=7, layers=1)
    spec = Speculation(draft=d, gamma=2, sink=4, window=12)
    prep = jaxspec.engine.prepare(target, prompts, max_new_tokens=8, speculation=spec)
    runner = prep.spec
    state = prep.fresh_state(jax.tree.map(jnp.copy, prep.state.cache))
    dstate = runner.draft_state(target, state, "auto")
    before = (np.asarray(state.cache.k), np.asarray(state.cache.v),
              np.asarray(state.cache.lengths))
    dbefore = (np.asarray(dstate.cache.k), np.asarray(dstate.cache.lengths))
    S._COSTS.clear()
    costs, st2, ds2 = S.measure_costs(target, spec, runner.draft, state, dstate, "auto", (1, 2, 3))
    L = before[2]
    k2, v2 = np.asarray(st2.cache.k), np.asarray(st2.cache.v)
    for b, n in enumerate(L):
        np.testing.assert_array_equal(k2[:, b, :, :n], before[0][:, b, :, :n])
        np.testing.assert_array_equal(v2[:, b, :, :n], before[1][:, b, :, :n])
    np.testing.assert_array_equal(np.asarray(st2.cache.lengths), L)
    dk2 = np.asarray(ds2.cache.k)
    for b, n in enumerate(dbefore[1]):
        np.testing.assert_array_equal(dk2[:, b, :, :n], dbefore[0][:, b, :, :n])
    flat = [costs["plain"], costs["draft"], *costs["verify"].values()]
    assert set(costs["verify"]) == {1, 2, 3}
    assert all(np.isfinite(t) and t > 0 for t in flat)


@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("chosen", [0, 2])
def test_auto_prefills_the_draft_only_when_it_speculates(target, prompts, reference, monkeypatch,
                                                         window, chosen):
    """With a draft model, `gamma="auto"` times the draft on a zero cache of the real shape and
    prefills the draft only if it chose to speculate (a plain run never pays for the draft's
    prefill); both ways the output is the autoregressive one, and the placeholder has the
    prefilled cache's shape and lengths (so the timing is of the same step)."""
    # the draft is the target itself: with a full cache every draft must be accepted, which
    # fails if the loop ran on the placeholder's zero cache
    spec = Speculation(draft=target, gamma="auto", sink=2, window=window, adaptive=False)
    calls, shapes = [], []
    real_prefill, real_measure = S._Runner._draft_prefill, S.measure_costs

    def spy_prefill(self, state, impl):
        ds = real_prefill(self, state, impl)
        calls.append((ds.cache.k.shape, np.asarray(ds.cache.lengths)))
        return ds

    def spy_measure(model, spec_, d, state, dstate, *a):
        shapes.append((dstate.cache.k.shape, np.asarray(dstate.cache.lengths)))
        return real_measure(model, spec_, d, state, dstate, *a)

    monkeypatch.setattr(S._Runner, "_draft_prefill", spy_prefill)
    monkeypatch.setattr(S, "measure_costs", spy_measure)
    monkeypatch.setattr(S, "choose_gamma", lambda *a, **k: (chosen, 1.5 if chosen else 1.0))
    S._COSTS.clear()
    res = jaxspec.generate(target, prompts, max_new_tokens=36, speculation=spec)
    assert res.tokens == reference
    assert res.stats["gamma"] == chosen
    assert len(shapes) == 1
    assert len(calls) == (1 if chosen else 0)
    if chosen:
        assert calls[0][0] == shapes[0][0]
        np.testing.assert_array_equal(calls[0][1], shapes[0][1])
        if window is None:
            assert res.stats["acceptance_rate"] == 1.0
