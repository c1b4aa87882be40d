"""Token-tree speculation (SpecInfer) through the engine: greedy == autoregressive, sampling keeps
the target's distribution; both drafters; trees wide, deep and of 128+ nodes."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import Speculation
from jaxspec.tree import TokenTree

from test_speculative import (V, _chi2_pvalue, _exact_two_token_dist, _prompts, _samples)
from tiny import tiny_model


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, scale=3.0)


@pytest.fixture(scope="module")
def prompts():
    return _prompts(np.random.default_rng(0), [37, 5, 52, 20])


@pytest.fixture(scope="module")
def reference(target, prompts):
    return jaxspec.generate(target, prompts, max_new_tokens=30).tokens


TREES = {
    "specinfer": (1, 1, 3, 1, 1),
    "wide": (8, 2),
    "deep": (1,) * 16,
    "big": (4, 4, 2, 2, 1),  # 4 + 16 + 32 + 64 + 64 = 180 nodes + root
}


@pytest.mark.parametrize("name", sorted(TREES))
def test_tree_self_speculation_greedy_is_lossless(target, prompts, reference, name):
    tree = TREES[name]
    spec = Speculation(draft="self", sink=2, window=6, tree=tree, adaptive=False)
    res = jaxspec.generate(target, prompts, max_new_tokens=30, speculation=spec)
    assert res.tokens == reference
    assert res.stats["tree_nodes"] == TokenTree.from_expansion(tree).num_nodes


@pytest.mark.parametrize("window", [None, 24])
def test_tree_draft_model_greedy_is_lossless(target, prompts, reference, window):
    draft = tiny_model(seed=7, layers=1, scale=3.0)
    spec = Speculation(draft=draft, sink=2, window=window, tree=(2, 2, 1), adaptive=False)
    res = jaxspec.generate(target, prompts, max_new_tokens=30, speculation=spec)
    assert res.tokens == reference


def test_tree_with_draft_equal_to_target_accepts_full_depth(target, prompts, reference):
    spec = Speculation(draft="self", sink=0, window=None, tree=(2, 1, 1, 1), adaptive=False)
    res = jaxspec.generate(target, prompts, max_new_tokens=30, speculation=spec)
    assert res.tokens == reference
    assert res.stats["tokens_per_step"] > 4.5  # depth 4 + bonus each round


def test_tree_stop_token_inside_accepted_path(target, prompts, reference):
    stop = reference[2][6]
    plain = jaxspec.generate(target, prompts, max_new_tokens=30, stop_tokens=[stop]).tokens
    for draft in ("self", target):
        spec = Speculation(draft=draft, sink=2, window=None if draft is target else 6,
                           tree=(3, 1, 1, 1, 1), adaptive=False)
        res = jaxspec.generate(target, prompts, max_new_tokens=30, stop_tokens=[stop],
                               speculation=spec)
        assert res.tokens == plain


def test_tree_given_as_parents_list(target, prompts, reference):
    parents = [-1, 0, 0, 1, 1, 2, 3, 3]
    res = jaxspec.generate(target, prompts, max_new_tokens=30,
                           speculation=Speculation(draft="self", sink=2, window=6, tree=parents, adaptive=False))
    assert res.tokens == reference


@pytest.fixture(scope="module")
def tiny_vocab_models():
    return tiny_model(seed=1, vocab=V, scale=2.0), tiny_model(seed=2, vocab=V, layers=1, scale=2.0)


@pytest.mark.parametrize("mode", ["without_replacement", "iid"])
def test_tree_sampling_has_target_distribution(tiny_vocab_models, mode):
    target, draft = tiny_vocab_models
    prompt = [1, 3, 0, 5, 2, 4, 1, 1, 0, 3, 2]
    spec = Speculation(draft=draft, window=None, tree=(3, 2), tree_sampling=mode, adaptive=False)
    joint = _exact_two_token_dist(target, prompt, 1.0, 0)
    assert _chi2_pvalue(_samples(target, spec, prompt, 6000, 1.0, 0, seed=5), joint) > 1e-3


@pytest.mark.parametrize("draft", ["self", "ring"])
def test_tree_sampling_other_drafts_have_target_distribution(tiny_vocab_models, draft):
    """Sampled trees (3 levels, level-only draft forwards) from the sparse self-draft and a
    ring-buffer draft model keep the target's distribution."""
    target, model = tiny_vocab_models
    prompt = [1, 3, 0, 5, 2, 4, 1, 1, 0, 3, 2]
    spec = (Speculation(draft="self", sink=1, window=4, tree=(2, 2, 1), adaptive=False) if draft == "self" else
            Speculation(draft=model, sink=1, window=5, tree=(2, 2, 1), adaptive=False))
    joint = _exact_two_token_dist(target, prompt, 1.0, 0)
    assert _chi2_pvalue(_samples(target, spec, prompt, 6000, 1.0, 0, seed=6), joint) > 1e-3


def test_tree_sampling_test_has_power(tiny_vocab_models, monkeypatch):
    """Without removing rejected children from q (a classic bug: children drawn without
    replacement verified by the iid rule) the test must fail."""
    import jaxspec.decoding as spec_mod
    from jaxspec import verify
    real = verify.verify_tree

    def wrong(rng, tree, node_tok, q, p, *, mode, **kw):
        return real(rng, tree, node_tok, q, p, mode="iid", **kw)

    monkeypatch.setattr(spec_mod, "verify_tree", wrong)
    target, draft = tiny_vocab_models
    prompt = [1, 3, 0, 5, 2, 4, 1, 1, 0, 3, 2]
    spec = Speculation(draft=draft, window=None, tree=(4, 1), tree_sampling="without_replacement", adaptive=False)
    joint = _exact_two_token_dist(target, prompt, 1.0, 0)
    assert _chi2_pvalue(_samples(target, spec, prompt, 6000, 1.0, 0, seed=5), joint) < 1e-6


def test_bad_trees():
    m = tiny_model(seed=0)
    for tree, msg in (((0, 2), "expansion"), ((), "empty"), ("nope.json", "neither")):
        with pytest.raises(ValueError, match=msg):
            jaxspec.generate(m, [[1, 2]], max_new_tokens=2,
                             speculation=Speculation(tree=tree, window=4, adaptive=False))
    with pytest.raises(ValueError, match="auto"):
        jaxspec.generate(m, [[1, 2]], max_new_tokens=2,
                         speculation=Speculation(tree=(2, 1), gamma="auto"))


def test_tree_search_cli_writes_a_usable_tree(tmp_path, target, prompts, reference):
    from jaxspec.cli import main
    out = tmp_path / "tree.json"
    main(["tree-search", "--acceptance", "0.8,0.3,0.1", "--budget", "20", "--verify-ms", "5",
          "--verify-ms-per-token", "0.01", "--draft-ms", "0.5", "--out", str(out)])
    import json
    parents = json.loads(out.read_text())["parents"]
    assert parents[0] == -1 and 2 <= len(parents) <= 21
    res = jaxspec.generate(target, prompts, max_new_tokens=30,
                           speculation=Speculation(draft="self", sink=2, window=6, tree=str(out), adaptive=False))
    assert res.tokens == reference


# ----------------------------------------------------------------------------- level-only drafting
LEVEL_CASES = {
    # name: (draft, sink, window, shared_prefix, lag, impl)
    "self-sparse": ("self", 2, 6, None, False, "xla"),
    "self-dense": ("self", 0, None, None, False, "xla"),
    "self-sparse-prefix": ("self", 2, 6, 30, False, "xla"),
    "self-dense-prefix": ("self", 0, None, 30, False, "xla"),
    "full": ("model", 2, None, None, False, "xla"),
    "full-lag": ("model", 2, None, None, True, "xla"),
    "ring": ("model", 2, 12, None, False, "xla"),
    "ring-lag": ("model", 2, 12, None, True, "xla"),
    # the Pallas decode kernel (interpret mode) through the model, and the prefix path's kernels
    "self-sparse-kernel": ("self", 2, 6, None, False, "interpret"),
    "ring-lag-kernel": ("model", 2, 38, None, True, "interpret"),  # ring of 64 slots
    "self-dense-prefix-kernel": ("self", 0, None, 30, False, "interpret"),
}


def _draft_both_ways(target, prompts, case, temperature, tree=(2, 2, 1, 1)):
    """One round's tree draft from the prefilled state, level-only and all-nodes (jitted)."""
    import jax
    from jaxspec import sampling
    from jaxspec.session import Decoder
    draft_kind, sink, window, shared, lag, impl = case
    if impl == "interpret":  # the prefix kernel needs head_dim >= 16
        target = tiny_model(seed=0, scale=3.0, head_dim=16)
    draft = "self" if draft_kind == "self" else tiny_model(seed=7, layers=1, scale=3.0)
    spec = Speculation(draft=draft, sink=sink, window=window, tree=tree, adaptive=False)
    if shared is not None:  # every prompt starts with the same 40 tokens
        system = prompts[2][:40]
        prompts = [system + p[:k] for p, k in zip(prompts, (1, 5, 12, 3))]
    dec = Decoder(target, spec, attn_impl=impl)
    batch = dec.prepare(prompts, max_new_tokens=8, temperature=temperature,
                        shared_prefix=shared)
    state = batch.state
    ds = dec.draft_state(batch.token_lists, state)
    if lag:  # the draft has not seen the token before `last`: the catch-up forward takes two
        dc = ds.cache
        ds = ds.replace(cache=dc.replace(lengths=dc.lengths - 1),
                        prev=jnp.asarray([p[-2] for p in prompts], jnp.int32))
    state = state.replace(draft=ds)
    rd = dec.round(dec.tree.max_depth, greedy=temperature == 0, stop_ids=batch.stop_ids)
    keys = sampling.row_keys(3, len(prompts))

    def run(level_only):
        f = jax.jit(lambda p, dp, sp, st, k: rd.drafter.tree(rd, p, dp, sp, st, k,
                                                             level_only=level_only))
        cache, tok, q, ctx = jax.device_get(f(dec.params, dec.dparams, batch.sp, state, keys))
        if ctx is not None:  # a draft model: its own cache holds the drafts' K/V
            cache = ctx["dc"]
        return cache, tok, q, ctx

    return rd, state, run(True), run(False)


@pytest.mark.parametrize("name,temperature", [
    (n, t) for t in (0.0, 1.0) for n in sorted(LEVEL_CASES)])
def test_level_only_draft_equals_all_nodes_draft(target, prompts, name, temperature):
    """Each level's draft forward over only that level's nodes (over the earlier levels' cached
    K/V) drafts what the forward over all nodes so far drafts: the same node tokens, the same
    child distributions (temperature 1: softmax of the draft logits, float32) and the same draft
    K/V at every forwarded node's slot (what `compact_path` later moves)."""
    case = LEVEL_CASES[name]
    if case[-1] == "interpret" and temperature > 0:
        pytest.skip("the kernel cases run greedy only (interpret mode is slow)")
    loop, state, new, old = _draft_both_ways(target, prompts, case, temperature)
    (c_new, tok_new, q_new, extra_new), (c_old, tok_old, q_old, extra_old) = new, old
    tree = loop.tree
    np.testing.assert_array_equal(tok_new, tok_old)
    assert len(set(tok_new[:, 1:].ravel().tolist())) > 3  # not a degenerate draft
    if temperature > 0:
        n_fwd = tree.levels[-1][0]  # nodes with children distributions
        np.testing.assert_allclose(q_new[:, :n_fwd], q_old[:, :n_fwd], rtol=1e-5, atol=1e-6)
        assert np.abs(q_new[:, :n_fwd] - q_old[:, :n_fwd]).max() < 1e-5
    else:
        assert q_new is None and q_old is None
    # K/V of the forwarded nodes (all but the deepest level) at root_slot + i
    root = np.asarray(extra_new["root_slot"] if extra_new else state.cache.lengths)
    if extra_new:
        np.testing.assert_array_equal(root, extra_old["root_slot"])
    n_fwd = tree.levels[-1][0]
    for name_kv in ("k", "v"):
        a, b = getattr(c_new, name_kv), getattr(c_old, name_kv)  # [L, B, K, S, D]
        for row in range(a.shape[1]):
            sl = slice(int(root[row]), int(root[row]) + n_fwd)
            np.testing.assert_allclose(a[:, row, :, sl], b[:, row, :, sl], rtol=1e-5, atol=1e-5)
            # and nothing before the root changed
            np.testing.assert_array_equal(a[:, row, :, :int(root[row])],
                                          b[:, row, :, :int(root[row])])


def test_level_only_comparison_has_power(target, prompts, monkeypatch):
    """A plausible wrong level-only draft, whose level forward sees the earlier levels as plain
    context (plan lengths root_slot + a: every earlier node visible, not only the ancestors),
    must fail the comparison."""
    import jaxspec.drafter as spec_mod
    real = spec_mod.forward

    def wrong(cfg, params, tokens, positions, cache, plan, logits_at=None):
        T = tokens.shape[1]
        if plan.mask is not None and plan.mask.shape[-1] > T:
            first = plan.mask.shape[-1] - T
            plan = plan.replace(lengths=plan.lengths + first, mask=plan.mask[:, first:])
        return real(cfg, params, tokens, positions, cache, plan, logits_at)

    monkeypatch.setattr(spec_mod, "forward", wrong)
    _, _, new, old = _draft_both_ways(target, prompts, LEVEL_CASES["self-sparse"], 1.0)
    n_fwd = TokenTree.from_expansion((2, 2, 1, 1)).levels[-1][0]
    assert np.abs(new[2][:, :n_fwd] - old[2][:, :n_fwd]).max() > 1e-3
