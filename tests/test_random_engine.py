"""Random draws of the whole engine: models, batches and generation options nobody picked.

Each case draws a tiny random model (llama / qwen2 / qwen3 / mistral, MHA / GQA / MQA, head dims
8-64 (powers of 2 or not), 1-3 layers, tied or untied embeddings, biases, RoPE scaling, sometimes a sliding window), a
ragged batch of prompts (often with a common system prompt), stop tokens, a prefill chunk, and
several ways of generating: a self-speculation chain (random gamma, sink and window), a separate
draft model of its own random shape, a token tree, a shared prefix (auto, a length or the tokens)
and ``n`` samples per prompt, through the XLA attention or the Pallas kernels (interpret mode).

Checks (greedy, float32):
  * the engine's plain autoregressive decoding equals an independent greedy loop that recomputes
    the whole sequence of one prompt at every step (one full forward, no KV cache reuse, no ragged
    batch, no chunked prefill);
  * every speculative / shared-prefix run equals that plain decoding token for token.
Where two runs differ, the reference's top-two logit gap at that token must be a float tie
(< ``TIE``): an argmax over two nearly equal logits may go either way under a different summation
order, which is not a bug; anything else fails.

``JAXSPEC_ENGINE_SWEEP_SEED`` / ``JAXSPEC_ENGINE_SWEEP_CASES`` draw other cases (e.g. a long sweep:
``JAXSPEC_ENGINE_SWEEP_CASES=40 python -m pytest tests/test_random_engine.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import Speculation
from jaxspec.attention import AttentionPlan
from jaxspec.cache import KVCache
from jaxspec.model import forward, init_params

SEED = int(os.environ.get("JAXSPEC_ENGINE_SWEEP_SEED", "2027"))
CASES = int(os.environ.get("JAXSPEC_ENGINE_SWEEP_CASES", "6"))
TIE = 1e-4  # a top-two logit gap below this is a float tie (logits are O(1-10) here)


@dataclasses.dataclass
class Case:
    config: jaxspec.ModelConfig
    draft_config: jaxspec.ModelConfig
    seed: int
    prompts: list
    max_new: int
    stop: list
    prefill_chunk: int
    runs: list  # (name, generate kwargs)

    def __repr__(self):  # the test id
        c = self.config
        sw = f"-sw{c.sliding_window}" if c.sliding_window else ""
        return (f"{c.model_type}-L{c.num_layers}H{c.num_heads}K{c.num_kv_heads}D{c.head_dim}"
                f"V{c.vocab_size}{sw}-B{len(self.prompts)}-new{self.max_new}"
                f"-ctx{c.max_position_embeddings}")


def _random_config(rng, vocab, allow_window=True):
    arch = str(rng.choice(["llama", "qwen2", "qwen3", "mistral"]))
    kv = int(rng.integers(1, 4))
    heads = kv * int(rng.choice([1, 2, 3, 4]))
    # head dims that are not powers of 2 too (the kernels mask their tiles' lanes past D)
    head_dim = int(rng.choice([8, 16, 24, 32, 40, 64]))
    hidden = int(rng.choice([16, 32, 48]))
    kw = dict(model_type=arch, vocab_size=vocab, hidden_size=hidden,
              intermediate_size=int(rng.choice([32, 64, 80])), num_layers=int(rng.integers(1, 4)),
              num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
              max_position_embeddings=256, tie_word_embeddings=bool(rng.integers(2)),
              rms_norm_eps=1e-5, rope_theta=float(rng.choice([10000.0, 500000.0])))
    if arch == "qwen2":
        kw["attention_bias"] = True
    elif arch in ("llama", "qwen3"):
        kw["attention_bias"] = bool(rng.integers(2))
    if arch == "llama":
        kw["mlp_bias"] = bool(rng.integers(2))
    rope = rng.integers(4)
    if rope == 1:
        kw["rope_scaling"] = (("factor", 2.0), ("rope_type", "linear"))
    elif rope == 2:
        kw["rope_scaling"] = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                              ("original_max_position_embeddings", 32), ("rope_type", "llama3"))
    elif rope == 3:
        kw["rope_scaling"] = (("factor", 4.0), ("original_max_position_embeddings", 32),
                              ("rope_type", "yarn"))
    if arch == "mistral" and allow_window and rng.random() < 0.5:
        kw["sliding_window"] = int(rng.integers(6, 30))
    return jaxspec.ModelConfig(**kw)


def _draw(i: int) -> Case:
    rng = np.random.default_rng([SEED, i])
    vocab = int(rng.integers(40, 300))
    # the Pallas kernels in interpret mode on the CPU (on a GPU every case runs the compiled ones)
    impl = "interpret" if rng.random() < 0.25 else "xla"
    cfg = _random_config(rng, vocab)
    draft_cfg = _random_config(rng, vocab, allow_window=False)
    B = int(rng.integers(1, 6))
    system = rng.integers(0, vocab, size=int(rng.integers(20, 50))).tolist()
    shared = rng.random() < 0.6
    prompts = [(system if shared else []) + rng.integers(0, vocab, size=int(rng.integers(1, 40))).tolist()
               for _ in range(B)]
    max_new = int(rng.integers(1, 28))
    if rng.random() < 0.3:  # a context that ends inside the generation: budgets are cut there
        ctx = max(map(len, prompts)) + int(rng.integers(1, max_new + 1))
        cfg = dataclasses.replace(cfg, max_position_embeddings=ctx)
        draft_cfg = dataclasses.replace(draft_cfg, max_position_embeddings=ctx)
    stop = sorted(set(rng.integers(0, vocab, size=int(rng.integers(0, 3))).tolist()))
    prefill_chunk = int(rng.choice([8, 16, 512]))

    def chain():
        window = None if rng.random() < 0.15 else int(rng.integers(2, 24))
        return Speculation(draft="self", gamma=int(rng.integers(1, 7)),
                           sink=int(rng.integers(0, 5)), window=window, adaptive=False)

    def draft():  # a ring-buffer draft cache holds at least a round's tokens + 2
        gamma = int(rng.integers(1, 6))
        window = None if rng.random() < 0.5 else int(rng.integers(gamma + 2, 30))
        return Speculation(draft=("draft",), gamma=gamma, sink=int(rng.integers(0, 4)),
                           window=window, adaptive=False)

    def tree():
        depth = int(rng.integers(1, 4))
        expansion = tuple(int(rng.integers(1, 4)) for _ in range(depth))
        d = ("draft",) if rng.random() < 0.4 else "self"
        return Speculation(draft=d, tree=expansion, sink=int(rng.integers(0, 4)),
                           window=int(rng.integers(depth + 2, 24)), adaptive=False)

    options = [("chain", lambda: dict(speculation=chain())),
               ("draft", lambda: dict(speculation=draft())),
               ("tree", lambda: dict(speculation=tree()))]
    if cfg.sliding_window is None:  # a sliding-window model shares nothing (engine docs)
        def share():
            how = rng.choice(["auto", "length", "tokens"]) if shared else "auto"
            common = os.path.commonprefix(prompts) if B > 1 else prompts[0]
            # every prompt keeps at least its last token outside the shared prefix
            k = int(rng.integers(0, min(len(common), min(map(len, prompts)) - 1) + 1))
            sp = {"auto": "auto", "length": k, "tokens": list(common[:k])}[str(how)]
            kw = dict(shared_prefix=sp)
            if rng.random() < 0.5:
                kw["speculation"] = (chain, draft, tree)[int(rng.integers(3))]()
            return kw

        def samples():
            kw = dict(n=int(rng.integers(2, 4)))
            if rng.random() < 0.5:
                kw["speculation"] = chain()
            return kw
        options += [("shared", share), ("n", samples)]
    picks = rng.choice(len(options), size=2, replace=False)
    runs = []
    for p in sorted(picks):
        name, make = options[p]
        kw = make()
        kw["attn_impl"] = impl
        runs.append((name, kw))
    return Case(cfg, draft_cfg, int(rng.integers(1 << 30)), prompts, max_new, stop, prefill_chunk,
                runs)


CASES_DRAWN = [_draw(i) for i in range(CASES)]


def _model(config, seed):
    params = init_params(config, jax.random.PRNGKey(seed), dtype=jnp.float32)
    params = dict(params)
    params["embed"] = params["embed"] * 3.0  # sharper distributions: fewer near-ties
    return jaxspec.Model(config=config, params=params)


@functools.partial(jax.jit, static_argnums=0)
def _full_forward(config, params, tokens):
    B, L = tokens.shape
    cache = KVCache.create(config, B, L, dtype=jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    plan = AttentionPlan(lengths=jnp.zeros((B,), jnp.int32), impl="xla")
    logits, _ = forward(config, params, tokens, pos, cache, plan)
    return logits


def _reference(model, prompts, max_new, stop_ids):
    """Greedy tokens and the top-two logit gap at each, recomputing every sequence whole at every
    step (causal attention: the padding after a sequence's end never reaches its logits). A
    sequence stops at a stop token, after ``max_new`` tokens, or at the model's context."""
    L = max(len(p) for p in prompts) + max_new
    ctx = model.config.max_position_embeddings
    seqs = [list(p) for p in prompts]
    out = [[] for _ in prompts]
    gaps = [[] for _ in prompts]
    done = [len(p) >= ctx for p in prompts]
    for _ in range(max_new):
        tokens = np.zeros((len(prompts), L), np.int32)
        for b, s in enumerate(seqs):
            tokens[b, :len(s)] = s
        logits = np.asarray(_full_forward(model.config, model.params, jnp.asarray(tokens)))
        for b, s in enumerate(seqs):
            if done[b]:
                continue
            row = logits[b, len(s) - 1]
            top2 = np.sort(row)[-2:]
            t = int(np.argmax(row))
            out[b].append(t)
            gaps[b].append(float(top2[1] - top2[0]))
            s.append(t)
            done[b] = t in stop_ids or len(s) >= ctx
        if all(done):
            break
    return out, gaps


def _same_up_to_ties(got, ref, gap, what):
    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            assert gap[i] < TIE, (f"{what}: token {i} is {a}, the reference's is {b} (top-two gap "
                                  f"{gap[i]:.3g}, not a tie)\n got {got}\n ref {ref}")
            return
    assert len(got) == len(ref), f"{what}: {len(got)} tokens, the reference has {len(ref)}\n got {got}\n ref {ref}"


def _check_case(case, impl=None):
    """``impl``: the attention implementation of every run (None: the draw's)."""
    model = _model(case.config, case.seed)
    draft = _model(case.draft_config, case.seed + 1)
    stop_ids = set(case.stop) | set(case.config.eos_token_ids)
    ref, gaps = _reference(model, case.prompts, case.max_new, stop_ids)
    common = dict(max_new_tokens=case.max_new, stop_tokens=case.stop or None,
                  prefill_chunk=case.prefill_chunk)
    plain = jaxspec.generate(model, case.prompts, **common,
                             **({"attn_impl": impl} if impl else {})).tokens
    for b in range(len(ref)):
        _same_up_to_ties(plain[b], ref[b], gaps[b], f"plain decoding, prompt {b}")
    for name, kw in case.runs:
        kw = dict(kw)
        spec = kw.get("speculation")
        if spec is not None and spec.draft == ("draft",):
            kw["speculation"] = dataclasses.replace(spec, draft=draft)
        if impl:
            kw["attn_impl"] = impl
        n = kw.get("n", 1)
        got = jaxspec.generate(model, case.prompts, **common, **kw).tokens
        assert len(got) == len(case.prompts) * n, name
        for b in range(len(ref)):
            for j in range(n):
                _same_up_to_ties(got[b * n + j], ref[b], gaps[b],
                                 f"{name} {kw}, prompt {b} sample {j}")


@pytest.mark.parametrize("case", [
    pytest.param(c, id=repr(c)) for c in CASES_DRAWN])
def test_random_engine_case(case):
    _check_case(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES_DRAWN, ids=repr)
def test_random_engine_case_gpu(case):
    """The same draws through the compiled kernels (Triton / Mosaic GPU) on a GPU; XLA's own
    float32 products at full precision there (not TF32), as on the CPU."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU (JAX_PLATFORMS=cuda)")
    with jax.default_matmul_precision("highest"):
        _check_case(case, impl="auto")


def test_draws_cover_the_options():
    """The default draws exercise something of each kind (a guard against a draw that quietly
    stopped producing, say, trees)."""
    runs = [name for c in (_draw(i) for i in range(24)) for name, _ in c.runs]
    for name in ("chain", "draft", "tree", "shared", "n"):
        assert name in runs, name
