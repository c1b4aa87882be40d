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
    spec = Speculation(draft="self", sink=2, window=6, tree=tree)
    res = jaxspec.generate(target, prompts, max_new_tokens=30, speculation=spec)
    assert res.tokens == reference
    assert res.stats["tree_nodes"] == TokenTree.from_expansion(tree).num_nodes


@pytest.mark.parametrize("window", [None, 24])
def test_tree_draft_model_greedy_is_lossless(target, prompts, reference, window):
    draft = tiny_model(seed=7, layers=1, scale=3.0)
    spec = Speculation(draft=draft, sink=2, window=window, tree=(2, 2, 1))
    res = jaxspec.generate(target, prompts, max_new_tokens=30, speculation=spec)
    assert res.tokens == reference


def test_tree_with_draft_equal_to_target_accepts_full_depth(target, prompts, reference):
    spec = Speculation(draft="self", sink=0, window=None, tree=(2, 1, 1, 1))
    res = jaxspec.generate(target, prompts, max_new_tokens=30, speculation=spec)
    assert res.tokens == reference
    assert res.stats["tokens_per_step"] > 4.5  # depth 4 + bonus each round


def test_tree_stop_token_inside_accepted_path(target, prompts, reference):
    stop = reference[2][6]
    plain = jaxspec.generate(target, prompts, max_new_tokens=30, stop_tokens=[stop]).tokens
    for draft in ("self", target):
        spec = Speculation(draft=draft, sink=2, window=None if draft is target else 6,
                           tree=(3, 1, 1, 1, 1, 1, 1, 1))
        res = jaxspec.generate(target, prompts, max_new_tokens=30, stop_tokens=[stop],
                               speculation=spec)
        assert res.tokens == plain


def test_tree_given_as_parents_list(target, prompts, reference):
    parents = [-1, 0, 0, 1, 1, 2, 3, 3]
    res = jaxspec.generate(target, prompts, max_new_tokens=30,
                           speculation=Speculation(draft="self", sink=2, window=6, tree=parents))
    assert res.tokens == reference


@pytest.fixture(scope="module")
def tiny_vocab_models():
    return tiny_model(seed=1, vocab=V, scale=2.0), tiny_model(seed=2, vocab=V, layers=1, scale=2.0)


@pytest.mark.parametrize("mode", ["without_replacement", "iid"])
def test_tree_sampling_has_target_distribution(tiny_vocab_models, mode):
    target, draft = tiny_vocab_models
    prompt = [1, 3, 0, 5, 2, 4, 1, 1, 0, 3, 2]
    spec = Speculation(draft=draft, window=None, tree=(3, 2), tree_sampling=mode)
    joint = _exact_two_token_dist(target, prompt, 1.0, 0)
    assert _chi2_pvalue(_samples(target, spec, prompt, 6000, 1.0, 0, seed=5), joint) > 1e-3


def test_tree_sampling_test_has_power(tiny_vocab_models, monkeypatch):
    """Without removing rejected children from q (a classic bug) the test must fail."""
    import jaxspec.speculative as spec_mod
    from jaxspec import verify
    real = verify.verify_tree

    def wrong(rng, tree, node_tok, q, p, *, mode):
        return real(rng, tree, node_tok, q, p, mode=mode, _ablate="keep_q")

    monkeypatch.setattr(spec_mod, "verify_tree", wrong)
    target, draft = tiny_vocab_models
    prompt = [1, 3, 0, 5, 2, 4, 1, 1, 0, 3, 2]
    spec = Speculation(draft=draft, window=None, tree=(4, 1), tree_sampling="without_replacement")
    joint = _exact_two_token_dist(target, prompt, 1.0, 0)
    assert _chi2_pvalue(_samples(target, spec, prompt, 6000, 1.0, 0, seed=5), joint) < 1e-6


def test_bad_trees():
    m = tiny_model(seed=0)
    for tree, msg in (((0, 2), "expansion"), ((), "empty"), ("nope.json", "neither")):
        with pytest.raises(ValueError, match=msg):
            jaxspec.generate(m, [[1, 2]], max_new_tokens=2,
                             speculation=Speculation(tree=tree, window=4))
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
                           speculation=Speculation(draft="self", sink=2, window=6, tree=str(out)))
    assert res.tokens == reference
