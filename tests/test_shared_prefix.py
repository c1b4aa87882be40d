"""Shared prefixes (Hydragen) in the engine: generating with a prefix prefilled once and attended to
once per group gives exactly the tokens of generation without sharing (greedy, float32), the same
samples for the same seed, and the same draft acceptance (the sparse self-draft sees the same
sink + window view), with plain decoding, chains, trees, draft models, ``n`` samples (two prefix
levels) and on a mesh."""

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec import Speculation
from jaxspec.prefix import AUTO_MIN_TOKENS, plan_sharing

from tiny import tiny_model

NEW = 16


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=0, scale=3.0)


@pytest.fixture(scope="module")
def draft():
    return tiny_model(seed=7, layers=1, scale=3.0)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    system = rng.integers(0, 64, size=40).tolist()
    return [system + rng.integers(0, 64, size=k).tolist() for k in (1, 5, 12, 3)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    return jaxspec.generate(target, prompts, max_new_tokens=NEW).tokens


# ----------------------------------------------------------------------------- detection
def test_plan_sharing_levels_and_errors():
    a, b = list(range(40)), list(range(40))
    p = [a + [50, 51], b + [52]]
    rows, share = plan_sharing(p, "auto")
    assert rows == p and share.levels == [(1, [a])] and share.offsets.tolist() == [40, 40]
    _, share = plan_sharing(p, 10)
    assert share.levels == [(1, [a[:10]])]
    _, share = plan_sharing(p, a[:7])
    assert share.levels == [(1, [a[:7]])]
    assert plan_sharing(p, None) == (p, None)
    short = [[1] * (AUTO_MIN_TOKENS - 1) + [2], [1] * (AUTO_MIN_TOKENS - 1) + [3]]
    assert plan_sharing(short, "auto")[1] is None  # below the threshold: no sharing
    # every prompt keeps its last token: identical prompts share all but that one
    _, share = plan_sharing([a, a], "auto")
    assert share.levels == [(1, [a[:-1]])]
    # n samples: rows are prompt-major; level 0 (all) + level 1 (each prompt, ragged)
    rows, share = plan_sharing(p, "auto", n=3)
    assert rows == [p[0]] * 3 + [p[1]] * 3
    assert share.levels == [(1, [a]), (2, [[50], []])]
    assert share.offsets.tolist() == [41] * 3 + [40] * 3
    _, share = plan_sharing([[5, 6, 7]], None, n=2)  # n > 1 shares each prompt by default
    assert share.levels == [(1, [[5, 6]])]
    with pytest.raises(ValueError, match="do not share"):
        plan_sharing([[1, 2, 3], [1, 3, 3]], 2)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        plan_sharing([[1, 2], [1, 2, 3]], 2)
    with pytest.raises(ValueError, match="does not start"):
        plan_sharing([[1, 2, 3], [1, 3, 3]], [1, 2])
    with pytest.raises(ValueError, match="n must be"):
        plan_sharing(p, None, n=0)
    with pytest.raises(ValueError, match="shared_prefix must be"):
        plan_sharing(p, "yes")


# ----------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("how", ["auto", 33, "tokens"])
def test_greedy_sharing_is_exact(target, prompts, reference, how):
    sp = prompts[0][:25] if how == "tokens" else how
    res = jaxspec.generate(target, prompts, max_new_tokens=NEW, shared_prefix=sp)
    assert res.tokens == reference
    assert res.stats["shared_prefix_tokens"] == {"auto": 40, 33: 33, "tokens": 25}[how]
    assert res.stats["max_len"] == 128  # suffix slots only


@pytest.mark.parametrize("spec", [
    dict(draft="self", gamma=3, sink=2, window=6),       # sinks in the prefix, window in the suffix
    dict(draft="self", gamma=2, sink=44, window=3),      # sinks reach into the suffix
    dict(draft="self", tree=(2, 2, 1), sink=2, window=6),
    dict(draft="model", gamma=3, sink=2, window=8),  # a ring-buffer draft over whole prompts
    dict(draft="model", tree=(2, 1), window=None),
], ids=["self-chain", "self-chain-long-sink", "self-tree", "draft-ring", "draft-tree"])
def test_speculation_with_sharing_is_exact(target, draft, prompts, reference, spec):
    spec = Speculation(**{**spec, "draft": draft if spec["draft"] == "model" else "self"}, adaptive=False)
    base = jaxspec.generate(target, prompts, max_new_tokens=NEW, speculation=spec)
    res = jaxspec.generate(target, prompts, max_new_tokens=NEW, speculation=spec,
                           shared_prefix=30)
    assert base.tokens == reference
    assert res.tokens == reference
    # the draft sees the same keys (prefix sinks, suffix window + prefix tail): same acceptance
    assert res.stats["acceptance_rate"] == pytest.approx(base.stats["acceptance_rate"])


def test_short_suffix_window_reaches_into_prefix(target, prompts, reference):
    """Suffixes (1-12 tokens) are shorter than the window (20): the window's older part comes
    from the prefix's tail."""
    spec = Speculation(draft="self", gamma=3, sink=4, window=20, adaptive=False)
    base = jaxspec.generate(target, prompts, max_new_tokens=NEW, speculation=spec)
    res = jaxspec.generate(target, prompts, max_new_tokens=NEW, speculation=spec,
                           shared_prefix="auto")
    assert res.tokens == base.tokens == reference
    assert res.stats["acceptance_rate"] == pytest.approx(base.stats["acceptance_rate"])


@pytest.mark.parametrize("chosen", [None, 3])
def test_auto_gamma_with_a_shared_prefix(target, prompts, reference, monkeypatch, chosen):
    """gamma="auto" stays lossless with a shared prefix whichever gamma it picks (its own
    choice, or forced to speculate), plain decoding included."""
    if chosen is not None:
        from jaxspec.costs import CostModel
        monkeypatch.setattr(CostModel, "choose_gamma", lambda self, ctx, c, **kw: (chosen, 2.0))
    res = jaxspec.generate(target, prompts, max_new_tokens=NEW, shared_prefix="auto",
                           speculation=Speculation(draft="self", gamma="auto", sink=4, window=20,
                                                   adaptive=chosen is None))
    assert res.tokens == reference
    assert res.stats["shared_prefix_tokens"] > 0
    if chosen is not None:
        assert res.stats["gamma"] == chosen and res.stats["acceptance_rate"] > 0


def test_n_samples_two_levels(target, prompts):
    rows = [p for p in prompts for _ in range(2)]
    ref = jaxspec.generate(target, rows, max_new_tokens=NEW).tokens
    res = jaxspec.generate(target, prompts, max_new_tokens=NEW, n=2, shared_prefix="auto")
    assert res.tokens == ref
    assert res.stats["shared_prefix_tokens"] == 40 + (0 + 4 + 11 + 2)  # system + each prompt
    spec = Speculation(draft="self", gamma=3, sink=2, window=6, adaptive=False)
    res = jaxspec.generate(target, prompts, max_new_tokens=NEW, n=2, shared_prefix="auto",
                           speculation=spec)
    assert res.tokens == ref


# ----------------------------------------------------------------------------- sampling
def test_sampling_same_seed_same_samples(target, prompts):
    """The random streams do not depend on sharing: a seed gives the same samples."""
    kw = dict(max_new_tokens=NEW, temperature=1.0, top_k=20, seed=5)
    ref = jaxspec.generate(target, prompts, **kw).tokens
    assert jaxspec.generate(target, prompts, shared_prefix="auto", **kw).tokens == ref
    spec = Speculation(draft="self", gamma=3, sink=2, window=6, adaptive=False)
    ref = jaxspec.generate(target, prompts, speculation=spec, **kw).tokens
    assert jaxspec.generate(target, prompts, shared_prefix=30, speculation=spec,
                            **kw).tokens == ref


def test_n_samples_sampling(target, prompts):
    kw = dict(max_new_tokens=NEW, temperature=1.0, top_k=20, seed=5)
    rows = [p for p in prompts for _ in range(2)]
    ref = jaxspec.generate(target, rows, **kw).tokens
    res = jaxspec.generate(target, prompts, n=2, **kw).tokens
    assert res == ref
    assert any(res[2 * i] != res[2 * i + 1] for i in range(4))  # the samples of a prompt differ


# ----------------------------------------------------------------------------- kernels, mesh
def test_kernels_interpret_mode(prompts):
    """The Pallas path (prefix kernel + decode kernel, interpret mode) gives the same tokens."""
    model = tiny_model(seed=1, scale=3.0, head_dim=16)
    ref = jaxspec.generate(model, prompts[:2], max_new_tokens=4).tokens
    res = jaxspec.generate(model, prompts[:2], max_new_tokens=4, shared_prefix="auto",
                           attn_impl="interpret", prefill_chunk=64)
    assert res.tokens == ref


HAVE8 = len(jax.devices()) >= 8


@pytest.mark.skipif(not HAVE8, reason="needs 8 devices: XLA_FLAGS="
                    "--xla_force_host_platform_device_count=8 (set by `make test`)")
def test_sharded_sharing(target, prompts):
    from jaxspec import sharding as shd
    mesh = jaxspec.make_mesh(2, 2)
    model = shd.shard_model(target, mesh)
    rows = [p for p in prompts for _ in range(2)]
    ref = jaxspec.generate(target, rows, max_new_tokens=NEW).tokens
    res = jaxspec.generate(model, prompts, max_new_tokens=NEW, n=2, shared_prefix="auto")
    assert res.tokens == ref
    spec = Speculation(draft="self", tree=(2, 1), sink=2, window=6, adaptive=False)
    res = jaxspec.generate(model, prompts, max_new_tokens=NEW, n=2, shared_prefix="auto",
                           speculation=spec)
    assert res.tokens == ref
    with pytest.raises(ValueError, match="multiple of the data axis"):
        jaxspec.generate(model, prompts[:3], max_new_tokens=2, shared_prefix="auto")
