"""Sliding-window attention (Mistral-style: the token at position p sees the keys at positions
p - W < j <= p): the attention paths against a plain reference, and generation of any length
against transformers' MistralForCausalLM, plain and speculative."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.attention import AttentionPlan, attend

# ------------------------------------------------------------------ attention vs a reference


def _tree(parents):
    """Ancestor mask [N, N] and depths of a tree given by parents (parents[0] = -1)."""
    N = len(parents)
    anc = np.zeros((N, N), bool)
    depth = np.zeros(N, np.int64)
    for i, p in enumerate(parents):
        anc[i, i] = True
        if p >= 0:
            anc[i] |= anc[p]
            depth[i] = depth[p] + 1
    return anc, depth


def _reference(q, k, v, lengths, W, anc=None, depth=None, T_new=None, sparse=None):
    """Attention written out per query from positions: context slot s is position s, new token j
    (slot L + j) is position L + depth[j]; query t (new token T_new - T + t) at position p sees
    the keys at positions p - W < pos <= p that are its context or its ancestors (causal: every
    earlier new token). numpy float64, [B, K, S, D] caches. ``sparse=(sink, window)``: a sparse
    draft's view instead of the window over the context (slots < sink or >= L - window)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, D = q.shape
    K = k.shape[1]
    G = H // K
    T_new = T if T_new is None else T_new
    if anc is None:  # causal chain
        anc = np.tril(np.ones((T_new, T_new), bool))
        depth = np.arange(T_new)
    out = np.zeros_like(q)
    for b in range(B):
        L = int(lengths[b])
        for t in range(T):
            i = T_new - T + t
            p = L + depth[i]
            if sparse is None:
                slots = [s for s in range(L) if s > p - W]
            else:
                slots = [s for s in range(L) if s < sparse[0] or s >= L - sparse[1]]
            slots += [L + j for j in range(T_new) if anc[i, j] and L + depth[j] > p - W]
            for h in range(H):
                kk, vv = k[b, h // G, slots], v[b, h // G, slots]
                sc = kk @ q[b, t, h] / np.sqrt(D)
                w = np.exp(sc - sc.max())
                out[b, t, h] = (w / w.sum()) @ vv
    return out


PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5, 6]  # depths 0..4


@pytest.mark.parametrize("impl", ["xla", "interpret"])
@pytest.mark.parametrize("case", [
    # (T, T_new, tree?, W): decode, chain verify, a chain that is the last 3 of 5 new tokens,
    # prefill chunks larger and smaller than W (the last: xla's dense pass, W - 1 + T_new >= S),
    # token trees (all nodes / the last level over the earlier ones; deeper than W or not)
    (1, 1, False, 5), (4, 4, False, 6), (3, 5, False, 7), (12, 12, False, 5), (12, 12, False, 40),
    (12, 12, False, 53), (9, 9, True, 3), (9, 9, True, 11), (4, 9, True, 4), (4, 9, True, 12)],
    ids=["decode", "chain", "chain-last", "chunk-gt-W", "chunk-lt-W", "chunk-dense", "tree-gt-W",
         "tree", "tree-level-gt-W", "tree-level"])
def test_attention_matches_reference(impl, case):
    T, T_new, tree, W = case
    rng = np.random.default_rng(T * 100 + W)
    B, H, K, D, S, NL = 3, 4, 2, 16, 64, 2
    lengths = np.array([0, 9, 50])  # ragged, one shorter and one far longer than W
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    kv = rng.standard_normal((2, NL, B, K, S, D)).astype(np.float32)
    for b in range(B):  # garbage past the new tokens must not leak in
        kv[:, :, b, :, lengths[b] + T_new:] = np.nan
    layer = 1
    anc = depth = mask = None
    if tree:
        anc, depth = _tree(PARENTS)
        mask = jnp.asarray(anc[T_new - T:])
    plan = AttentionPlan(lengths=jnp.asarray(lengths, jnp.int32), mask=mask, impl=impl,
                         num_new=T_new, sliding_window=W)
    k_all, v_all = jnp.asarray(kv[0]), jnp.asarray(kv[1])
    got = jax.jit(lambda q, k, v, lay, p: attend(q, k, v, lay, p))(
        jnp.asarray(q), k_all, v_all, jnp.int32(layer), plan)
    want = _reference(q, kv[0, layer], kv[1, layer], lengths, W, anc, depth, T_new)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)
    # the window matters here: attention without it differs
    full = _reference(q, kv[0, layer], kv[1, layer], lengths, 10 ** 6, anc, depth, T_new)
    assert np.abs(full - want).max() > 1e-2


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_sparse_draft_plans(impl):
    """A sparse (sink + window) plan, the self-draft's proposal: its own view over the context while
    sink + window < W - 1 (new tokens windowed: this tree is deeper than W), the exact sliding
    window once sink + window >= W - 1."""
    rng = np.random.default_rng(3)
    B, H, K, D, S, W = 2, 4, 2, 16, 64, 4
    lengths = np.array([3, 40])
    anc, depth = _tree(PARENTS)
    T_new = len(PARENTS)
    q = rng.standard_normal((B, T_new, H, D)).astype(np.float32)
    k, v = rng.standard_normal((2, 1, B, K, S, D)).astype(np.float32)
    run = jax.jit(lambda q, k, v, p: attend(q, k, v, jnp.int32(0), p))
    for sink, window, sparse in ((1, 1, (1, 1)), (2, 4, None)):
        plan = AttentionPlan(lengths=jnp.asarray(lengths, jnp.int32), mask=jnp.asarray(anc),
                             sink=sink, window=window, impl=impl, sliding_window=W)
        got = run(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), plan)
        want = _reference(q, k[0], v[0], lengths, W, anc, depth, sparse=sparse)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)


# ------------------------------------------------------------------ models vs transformers
W = 6


@pytest.fixture(scope="module")
def hf_and_model(tmp_path_factory):
    pytest.importorskip("torch")
    from hf_models import convert_hf, make_hf_model
    hf = make_hf_model("mistral", seed=5, sliding_window=W, num_hidden_layers=2)
    m = convert_hf(hf, tmp_path_factory.mktemp("mistral"))
    assert m.config.sliding_window == W
    return hf, m


PROMPTS = [[7, 1, 99, 45, 3, 12, 60, 8, 33, 2, 71, 19, 5], [4, 88, 23],
           [50, 9, 9, 61, 14, 77, 30, 2, 40]]
NEW = 24


@pytest.fixture(scope="module")
def reference(hf_and_model):
    from hf_models import torch_greedy
    hf, _ = hf_and_model
    return [torch_greedy(hf, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("impl,chunk", [("xla", 4), ("xla", 16), ("interpret", 4),
                                        ("interpret", 8)])
def test_generate_matches_transformers(hf_and_model, reference, impl, chunk):
    """Prompts longer and shorter than W (ragged), generation 4 windows past it, prefill chunks
    smaller and larger than W (16: one chunk; 8: the second one over a context)."""
    _, m = hf_and_model
    res = jaxspec.generate(m, PROMPTS, max_new_tokens=NEW, attn_impl=impl, prefill_chunk=chunk)
    assert res.tokens == reference


def test_full_attention_differs(hf_and_model, reference):
    """The comparison has power: the same weights without the window give other tokens."""
    _, m = hf_and_model
    full = jaxspec.Model(config=dataclasses.replace(m.config, sliding_window=None),
                         params=m.params)
    assert jaxspec.generate(full, PROMPTS, max_new_tokens=NEW).tokens != reference


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory):
    """A smaller Mistral with its own (smaller) window."""
    from hf_models import convert_hf, make_hf_model
    d_hf = make_hf_model("mistral", seed=9, sliding_window=4, num_hidden_layers=1)
    return convert_hf(d_hf, tmp_path_factory.mktemp("draft"))


@pytest.mark.parametrize("spec", [
    dict(draft="self", gamma=3, sink=1, window=3),  # sparse draft (4 < W - 1 slots)
    dict(draft="self", gamma=4, sink=0, window=None),  # the target itself: all accepted
    dict(draft="self", sink=1, window=2, tree=(2, 2, 1)),
    dict(draft="model", gamma=3, sink=2, window=None),
    dict(draft="model", gamma=2, sink=1, window=5),  # ring buffer
    dict(draft="model", sink=1, window=None, tree=(2, 1, 1, 1, 1, 1, 1)),  # deeper than W
], ids=["self-sparse", "self-dense", "self-tree", "model", "model-ring", "model-deep-tree"])
def test_speculation_equals_plain_greedy(hf_and_model, reference, draft_model, spec):
    _, m = hf_and_model
    spec = dict(spec)
    if spec["draft"] == "model":
        spec["draft"] = draft_model
    res = jaxspec.generate(m, PROMPTS, max_new_tokens=NEW, speculation=jaxspec.Speculation(**spec, adaptive=False))
    assert res.tokens == reference
    if spec["draft"] == "self" and spec["window"] is None:  # the draft attends like the target
        assert res.stats["acceptance_rate"] == 1.0


def test_speculation_interpret(hf_and_model, reference):
    _, m = hf_and_model
    res = jaxspec.generate(m, PROMPTS, max_new_tokens=NEW, attn_impl="interpret",
                           speculation=jaxspec.Speculation(draft="self", gamma=3, sink=1,
                                                           window=2, adaptive=False))
    assert res.tokens == reference


def test_shared_prefix_is_not_used(hf_and_model, reference):
    """No shared-prefix attention for a sliding window: 'auto' and n just repeat rows, an
    explicit prefix is refused."""
    _, m = hf_and_model
    res = jaxspec.generate(m, PROMPTS, max_new_tokens=NEW, shared_prefix="auto", n=2)
    assert res.tokens == [t for t in reference for _ in range(2)]
    assert "shared_prefix_tokens" not in res.stats
    with pytest.raises(ValueError, match="sliding-window"):
        jaxspec.generate(m, [[1, 2, 3, 4], [1, 2, 3, 5]], max_new_tokens=2, shared_prefix=3)


def test_serving_engine_is_not_capped(hf_and_model, reference):
    from jaxspec.serving import SamplingOptions, ServingEngine
    _, m = hf_and_model
    engine = ServingEngine(m, max_batch=2, max_len=64, rounds_per_chunk=8).start(
        variants=[(True, False)])  # greedy requests only
    try:
        assert engine.max_len == 64
        got = [engine.generate(p, SamplingOptions(max_tokens=NEW, temperature=0), timeout=120)
               for p in PROMPTS[:2]]
        assert [s.tokens for s in got] == reference[:2]
    finally:
        engine.stop()


@pytest.mark.parametrize("variant", ["qwen2-bias", "qwen3"])
def test_qwen2_sliding_layers(tmp_path, variant):
    """Qwen2 (and Qwen3) slide only from layer max_window_layers on. Every layer sliding: exact
    past the window; none (max_window_layers >= layers, as Qwen2.5's own configs): full attention,
    exact; some: refused when the config is read (one window per model only), never silently
    wrong."""
    from hf_models import convert_hf, make_hf_model, torch_greedy
    from jaxspec.config import ConfigError
    prompt = [3, 9, 27, 81, 50, 11, 2, 60, 61, 5]
    for first, window in ((0, 4), (2, None)):
        hf = make_hf_model(variant, seed=2, use_sliding_window=True, sliding_window=4,
                           max_window_layers=first, num_hidden_layers=2)
        m = convert_hf(hf, tmp_path / f"q{first}")
        assert m.config.sliding_window == window
        assert jaxspec.generate(m, [prompt], max_new_tokens=8).tokens[0] == torch_greedy(hf, prompt, 8)
    hf = make_hf_model(variant, seed=2, use_sliding_window=True, sliding_window=4,
                       max_window_layers=1, num_hidden_layers=2)
    with pytest.raises(ConfigError, match="1 of 2 layers"):
        convert_hf(hf, tmp_path / "q1")
    # a window as long as the context hides nothing: full attention, whatever the layers
    hf = make_hf_model(variant, seed=2, use_sliding_window=True, sliding_window=256,
                       max_window_layers=1, num_hidden_layers=2)  # max_position_embeddings 256
    m = convert_hf(hf, tmp_path / "q256")
    assert m.config.sliding_window is None
    assert jaxspec.generate(m, [prompt], max_new_tokens=8).tokens[0] == torch_greedy(hf, prompt, 8)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (simulated) devices")
@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_sharded_generation(hf_and_model, reference, impl):
    """On a (data 2, model 2) mesh the attention runs per shard (band gathers included)."""
    from jaxspec import sharding as shd
    _, m = hf_and_model
    model = shd.shard_model(m, jaxspec.make_mesh(2, 2, devices=jax.devices()[:4]))
    res = jaxspec.generate(model, PROMPTS, max_new_tokens=NEW, attn_impl=impl,
                           speculation=jaxspec.Speculation(draft="self", gamma=2, sink=1,
                                                           window=2, adaptive=False))
    assert res.tokens == reference


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [4, 16])
def test_generate_on_gpu_kernel(hf_and_model, reference, chunk):
    """The compiled Triton kernel path (sparse kernel + jnp band + merge) on a GPU: plain and
    speculative greedy generation equal transformers' tokens."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU (JAX_PLATFORMS=cuda)")
    _, m = hf_and_model
    res = jaxspec.generate(m, PROMPTS, max_new_tokens=NEW, attn_impl="pallas", prefill_chunk=chunk)
    assert res.tokens == reference
    for spec in (jaxspec.Speculation(draft="self", gamma=3, sink=1, window=3, adaptive=False),
                 jaxspec.Speculation(draft="self", sink=1, window=2, tree=(2, 2, 1), adaptive=False)):
        res = jaxspec.generate(m, PROMPTS, max_new_tokens=NEW, attn_impl="pallas",
                               prefill_chunk=chunk, speculation=spec)
        assert res.tokens == reference
