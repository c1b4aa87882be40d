"""Speculative decoding in one jitted `lax.while_loop` (MagicDec-style sparse self-speculation,
or a separate draft model with a full or StreamingLLM ring-buffer cache).

One round, per sequence and ragged (each row accepts its own number of tokens):

1. draft: ``gamma`` draft steps from the last committed token -> drafts ``d_1..d_gamma`` and the
   draft distributions ``q`` they were drawn from (same temperature / top-k / top-p as the target);
2. verify: ONE target forward over ``[last, d_1..d_gamma]`` at positions ``L..L+gamma`` (their K/V
   are written at slots ``L..L+gamma``) -> target distributions ``p``;
3. accept: greedy (longest prefix equal to the target's argmax) or speculative sampling
   (`jaxspec.verify.verify_chain`), giving ``n`` accepted drafts and one more token;
4. commit: ``n + 1`` tokens, cut at a stop token or the budget; the cache length advances by the
   number committed, so the K/V of rejected drafts are simply overwritten next round.

Self-speculation (``draft="self"``) runs the target's own weights with attention restricted to the
first ``sink`` and the last ``window`` slots of the target's cache: it reads only those blocks, so a
draft step costs the weights plus ``sink + window`` keys, whatever the context length. The draft's
K/V for its own tokens land in the slots that verification overwrites next.

A separate draft model keeps its own cache, either full (``window=None``) or a ring buffer of
``sink + window`` slots (plus a scratch area for the tokens of the current round) in which position
``P`` lives at slot ``P`` if ``P < sink`` else ``sink + (P - sink) % window``; the oldest window
slot is evicted, so generation of any length works. Positions are always original positions.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec import sampling
from jaxspec.attention import AttentionPlan
from jaxspec.cache import KVCache, round_up
from jaxspec.checkpoint import Model
from jaxspec.config import ModelConfig
from jaxspec.engine import DecodeState, commit_tokens, prefill
from jaxspec.model import forward
from jaxspec.verify import verify_chain, verify_greedy


@dataclasses.dataclass(frozen=True, eq=False)
class Speculation:
    """How to speculate.

    draft: ``"self"`` (the target's weights over a sparse sink + window view of its own cache) or a
        `jaxspec.Model` sharing the target's vocabulary.
    gamma: drafts per round (>= 1), or ``"auto"`` to pick it from measured step costs.
    sink, window: StreamingLLM sparse KV of the draft (for a separate draft ``window=None`` means a
        full cache).
    tree: a token-tree expansion config (see `jaxspec.tree`), or None for a chain.
    """

    draft: Any = "self"
    gamma: int | str = 4
    sink: int = 16
    window: int | None = 496
    tree: Any = None


@struct.dataclass
class DraftState:
    cache: KVCache  # the draft model's own cache; lengths = committed positions it holds (Ld)
    prev: jax.Array  # [B] committed token at position L-1 (needed when the draft lags by one)


@dataclasses.dataclass(frozen=True)
class SpecLoop:
    """Static description of a speculative loop (hashable, a jit static argument)."""

    config: ModelConfig
    stop_ids: tuple[int, ...]
    gamma: int
    sink: int
    window: int | None
    greedy: bool  # every row has temperature 0: verify by argmax, no probabilities kept
    impl: str = "auto"
    draft_config: ModelConfig | None = None  # None: self-speculation
    ring: bool = False  # separate draft with a ring-buffer cache of sink + window slots

    # ------------------------------------------------------------------ drafting
    def _self_draft(self, params, sp, state: DecodeState, rng):
        """gamma draft steps of the target's weights over sink + window of its own cache."""
        cache = state.cache
        L = cache.lengths
        g = self.gamma

        def step(carry, i):
            k, v, tok, rng = carry
            rng, sub = jax.random.split(rng)
            plan = AttentionPlan(lengths=L + i, impl=self.impl,
                                 sink=self.sink if self.window is not None else None,
                                 window=self.window)
            c = cache.replace(k=k, v=v)
            logits, c = forward(self.config, params, tok[:, None], (L + i)[:, None], c, plan)
            d, q = self._propose(sub, logits[:, 0], sp)
            return (c.k, c.v, d, rng), (d, q)

        (k, v, _, _), (drafts, qs) = jax.lax.scan(
            step, (cache.k, cache.v, state.last, rng), jnp.arange(g, dtype=jnp.int32))
        return cache.replace(k=k, v=v), drafts.T, _qs_BgV(qs)

    def _propose(self, rng, logits_BV, sp):
        if self.greedy:
            return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), None
        q = sampling.probs_from_logits(logits_BV, sp)
        return sampling.categorical(rng, q).astype(jnp.int32), q

    def _ring_slots(self, pos):
        """Ring slot of original position ``pos`` (draft ring cache)."""
        s, w = self.sink, self.window
        return jnp.where(pos < s, pos, s + (pos - s) % w)

    def _model_draft(self, dparams, sp, state: DecodeState, dstate: DraftState, rng):
        """gamma steps of a separate draft model. The first step takes two tokens, [prev, last]
        when the draft has not seen ``prev`` yet (all drafts accepted last round), otherwise
        [last, pad]; its K/V is idempotent for a token already present."""
        dc = dstate.cache
        L = state.cache.lengths  # position of `last`
        Ld = dc.lengths  # positions < Ld are in the draft cache
        pending = L - Ld + 1  # 1 or 2
        start = L + 1 - pending  # first position processed this round
        g = self.gamma
        if self.ring:
            W = self.sink + self.window
            base = jnp.minimum(start, W)  # ring slots in use; this round's tokens follow them
        else:
            base = start
        two = jnp.where((pending == 2)[:, None], jnp.stack([dstate.prev, state.last], 1),
                        jnp.stack([state.last, state.last], 1))
        pos0 = start[:, None] + jnp.arange(2, dtype=jnp.int32)[None]
        plan0 = AttentionPlan(lengths=base, impl=self.impl)
        logits, dc = forward(self.draft_config, dparams, two, pos0, dc, plan0,
                             logits_at=(pending - 1)[:, None])
        rng, sub = jax.random.split(rng)
        d1, q1 = self._propose(sub, logits[:, 0], sp)

        def step(carry, j):
            k, v, tok, rng = carry
            rng, sub = jax.random.split(rng)
            off = L + j - start  # slot offset of position L + j within this round's tokens
            plan = AttentionPlan(lengths=base + off, impl=self.impl)
            c = dc.replace(k=k, v=v)
            lg, c = forward(self.draft_config, dparams, tok[:, None], (L + j)[:, None], c, plan)
            d, q = self._propose(sub, lg[:, 0], sp)
            return (c.k, c.v, d, rng), (d, q)

        (k, v, _, _), (ds, qs) = jax.lax.scan(
            step, (dc.k, dc.v, d1, rng), jnp.arange(1, g, dtype=jnp.int32))
        drafts = jnp.concatenate([d1[:, None], ds.T], axis=1)
        if self.greedy:
            q_all = None
        else:
            q_all = jnp.concatenate([q1[:, None], _qs_BgV(qs)], axis=1)
        dc = dc.replace(k=k, v=v)
        return dc, drafts, q_all, start, base

    def _commit_draft(self, dc: KVCache, start, base, have, n_kv_max):
        """Marks positions ``< have`` as held by the draft cache. This round processed positions
        ``start, start+1, ...`` (at most ``n_kv_max``); in ring mode their entries (scratch slots
        ``base + i`` for position ``start + i``) are copied to their ring slots."""
        if self.ring:
            R = n_kv_max
            i = jnp.arange(R, dtype=jnp.int32)[None]
            pos = start[:, None] + i
            src = base[:, None] + i
            dst = self._ring_slots(pos)
            ok = pos < have[:, None]
            dst = jnp.where(ok, dst, dc.max_len)  # dropped
            b = jnp.arange(dc.batch, dtype=jnp.int32)[:, None]
            k_src = dc.k[:, b, :, src]  # [B, R, L, K, D] (advanced indices first)
            v_src = dc.v[:, b, :, src]
            k = dc.k.at[:, b, :, dst].set(k_src, mode="drop")
            v = dc.v.at[:, b, :, dst].set(v_src, mode="drop")
            dc = dc.replace(k=k, v=v)
        return dc.replace(lengths=have)

    # ------------------------------------------------------------------ one round
    def body(self, params, dparams, sp, carry):
        state, dstate, acc = carry
        rng, r_draft, r_verify = jax.random.split(state.rng, 3)
        L = state.cache.lengths
        g = self.gamma
        if self.draft_config is None:
            cache, drafts, q = self._self_draft(params, sp, state, r_draft)
        else:
            dc, drafts, q, start, base = self._model_draft(dparams, sp, state, dstate, r_draft)
            cache = state.cache
        tokens = jnp.concatenate([state.last[:, None], drafts], axis=1)  # [B, g+1]
        positions = L[:, None] + jnp.arange(g + 1, dtype=jnp.int32)[None]
        plan = AttentionPlan(lengths=L, impl=self.impl)
        logits, cache = forward(self.config, params, tokens, positions, cache, plan)
        if self.greedy:
            n_acc, nxt = verify_greedy(drafts, logits)
        else:
            p = sampling.probs_from_logits(logits, sp)
            n_acc, nxt = verify_chain(r_verify, drafts, q, p)
        n_acc = n_acc.astype(jnp.int32)
        idx = jnp.arange(g + 1, dtype=jnp.int32)[None]
        new = jnp.where(idx < n_acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                        nxt[:, None].astype(jnp.int32))
        active = ~state.done
        st = commit_tokens(state.replace(cache=cache, rng=rng, steps=state.steps + 1), new,
                           jnp.where(active, n_acc + 1, 0), self.stop_ids)
        if self.draft_config is not None:
            new_L = st.cache.lengths
            # the draft computed K/V for positions start .. L+g-1 (not for the last draft d_g)
            have = jnp.minimum(new_L, L + g)
            dc = self._commit_draft(dc, start, base, have, n_kv_max=g + 1)
            # token at position new_L - 1: the last accepted draft, or the old `last`
            prev = jnp.where(n_acc > 0, jnp.take_along_axis(
                drafts, jnp.maximum(n_acc - 1, 0)[:, None], 1)[:, 0], state.last)
            dstate = DraftState(cache=dc, prev=jnp.where(active, prev, dstate.prev))
        acc = {"proposed": acc["proposed"] + jnp.sum(jnp.where(active, g, 0)),
               "accepted": acc["accepted"] + jnp.sum(jnp.where(active, n_acc, 0)),
               "committed": acc["committed"] + jnp.sum(st.n_out - state.n_out),
               "row_steps": acc["row_steps"] + jnp.sum(active.astype(jnp.int32))}
        return st, dstate, acc

    def cond(self, carry):
        return jnp.any(~carry[0].done)

    def run(self, params, dparams, sp, state, dstate):
        acc = {k: jnp.zeros((), jnp.int32) for k in ("proposed", "accepted", "committed",
                                                      "row_steps")}
        return jax.lax.while_loop(self.cond, functools.partial(self.body, params, dparams, sp),
                                  (state, dstate, acc))


def _qs_BgV(qs):
    return None if qs is None else jnp.swapaxes(qs, 0, 1)


@functools.partial(jax.jit, static_argnames=("loop",), donate_argnames=("state", "dstate"))
def _run_spec(params, dparams, sp, state, dstate, *, loop: SpecLoop):
    return loop.run(params, dparams, sp, state, dstate)


# ---------------------------------------------------------------------------- set-up
def validate(spec: Speculation, model: Model):
    """Checks a Speculation against a target model; raises ValueError/TypeError before compiling."""
    if not isinstance(spec, Speculation):
        raise TypeError(f"speculation must be a jaxspec.Speculation, got {type(spec).__name__}")
    g = spec.gamma
    if g != "auto" and (not isinstance(g, (int, np.integer)) or isinstance(g, bool) or g < 1):
        raise ValueError(f"gamma must be an int >= 1 or 'auto', got {g!r}")
    if not isinstance(spec.sink, (int, np.integer)) or spec.sink < 0:
        raise ValueError(f"sink must be an int >= 0, got {spec.sink!r}")
    if spec.window is not None and (not isinstance(spec.window, (int, np.integer))
                                    or spec.window < 0):
        raise ValueError(f"window must be an int >= 0 or None, got {spec.window!r}")
    if spec.draft == "self":
        if spec.window is None and spec.sink == 0:
            pass  # dense self-draft: allowed (it is just the target), mostly for testing
        elif (spec.window or 0) + spec.sink == 0:
            raise ValueError("self-speculation needs sink + window > 0 context slots")
    elif isinstance(spec.draft, Model):
        d = spec.draft
        if d.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"draft vocabulary ({d.config.vocab_size}) differs from the target's "
                             f"({model.config.vocab_size}): they must share a tokenizer")
        if d.tokenizer is not None and model.tokenizer is not None:
            if d.tokenizer.get_vocab() != model.tokenizer.get_vocab():
                raise ValueError("draft and target tokenizers differ")
        if d.dtype != model.dtype:
            raise ValueError(f"draft dtype {d.dtype} differs from the target's {model.dtype}; "
                             f"load both with the same dtype (jaxspec.load(path, dtype=...))")
        if spec.window is not None:
            gmax = 8 if g == "auto" else int(g)
            if spec.window < gmax + 2:
                raise ValueError(f"a ring-buffer draft needs window >= gamma + 2 = "
                                 f"{gmax + 2}, got {spec.window}")
    else:
        raise TypeError(f"draft must be 'self' or a jaxspec.Model, got {type(spec.draft).__name__}")
    if spec.tree is not None:
        raise NotImplementedError("token trees are not implemented yet (issue 5)")


@dataclasses.dataclass
class _Runner:
    spec: Speculation
    gamma: int
    extra_slots: int
    draft: Model | None
    token_lists: list

    def run(self, model: Model, sp, state: DecodeState, *, stop_ids, impl, profile=False):
        greedy = bool(np.all(np.asarray(sp.temperature) <= 0))
        cfg = model.config
        if self.draft is None:
            loop = SpecLoop(config=cfg, stop_ids=stop_ids, gamma=self.gamma, sink=self.spec.sink,
                            window=self.spec.window, greedy=greedy, impl=impl)
            dstate = DraftState(cache=KVCache.create(cfg, 1, 1, model.dtype),
                                prev=jnp.array(state.last, copy=True))
            dparams = jnp.zeros(())
        else:
            dstate = self._draft_prefill(state, impl)
            loop = SpecLoop(config=cfg, stop_ids=stop_ids, gamma=self.gamma,
                            sink=self.spec.sink, window=self.spec.window, greedy=greedy,
                            impl=impl, draft_config=self.draft.config,
                            ring=self.spec.window is not None)
            dparams = self.draft.params
        final, _, acc = _run_spec(model.params, dparams, sp, state, dstate, loop=loop)
        acc = {k: int(v) for k, v in acc.items()}
        stats = {
            "gamma": self.gamma,
            "acceptance_rate": acc["accepted"] / max(acc["proposed"], 1),
            "tokens_per_step": acc["committed"] / max(acc["row_steps"], 1),
        }
        return final, stats

    def _draft_prefill(self, state: DecodeState, impl: str) -> DraftState:
        d = self.draft
        B = len(self.token_lists)
        prompts = [t[:-1] for t in self.token_lists]
        if self.spec.window is None:
            S = state.cache.max_len
            dc = KVCache.create(d.config, B, S, dtype=d.dtype)
            dc = prefill(d.config, d.params, dc, prompts, impl=impl)
        else:
            dc = ring_prefill(d.config, d.params, prompts, sink=self.spec.sink,
                              window=self.spec.window, scratch=self.gamma + 1, impl=impl,
                              dtype=d.dtype)
        return DraftState(cache=dc, prev=jnp.array(state.last, copy=True))


def ring_cache_len(sink: int, window: int, scratch: int, chunk: int) -> int:
    return round_up(sink + window + max(scratch, chunk), 8)


@functools.partial(jax.jit, static_argnames=("config", "sink", "window", "impl"),
                   donate_argnames=("cache",))
def _ring_prefill_chunk(params, cache: KVCache, tokens_BC, start, n_valid, *, config, sink,
                        window, impl):
    """One chunk of streaming prefill into a ring cache: the chunk attends to the ring (all valid
    slots) and causally to itself in the scratch area, then its valid tokens move to their ring
    slots."""
    B, C = tokens_BC.shape
    W = sink + window
    base = jnp.minimum(start, W)
    positions = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
    plan = AttentionPlan(lengths=base, impl=impl)
    _, cache = forward(config, params, tokens_BC, positions, cache, plan,
                       logits_at=jnp.zeros((B, 1), jnp.int32))
    loop = SpecLoop(config=config, stop_ids=(), gamma=1, sink=sink, window=window, greedy=True,
                    draft_config=config, ring=True)
    return loop._commit_draft(cache, start, base, start + n_valid, n_kv_max=C)


def ring_prefill(config, params, prompts, *, sink, window, scratch, impl="auto",
                 dtype=jnp.bfloat16) -> KVCache:
    B = len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    C = max(8, min(256, window // 2))
    S = ring_cache_len(sink, window, scratch, C)
    cache = KVCache.create(config, B, S, dtype=dtype)
    n = int(lens.max()) if B else 0
    total = round_up(max(n, 1), C)
    buf = np.zeros((B, total), np.int32)
    for i, p in enumerate(prompts):
        buf[i, :len(p)] = p
    for start in range(0, n, C):
        n_valid = np.clip(lens - start, 0, C).astype(np.int32)
        cache = _ring_prefill_chunk(params, cache, jnp.asarray(buf[:, start:start + C]),
                                    jnp.full((B,), start, jnp.int32), jnp.asarray(n_valid),
                                    config=config, sink=sink, window=window, impl=impl)
    return cache.replace(lengths=jnp.asarray(lens))


def prepare_speculation(spec: Speculation, model: Model, token_lists, max_new_tokens) -> _Runner:
    validate(spec, model)
    gamma = spec.gamma
    if gamma == "auto":
        gamma = 4  # TODO(issue 3): pick from measured step costs and running acceptance
    draft = None if spec.draft == "self" else spec.draft
    if draft is not None and spec.window is None:
        ctx = draft.config.max_position_embeddings
        longest = max(len(t) for t in token_lists) + max_new_tokens
        if longest > ctx:
            raise ValueError(f"the draft model's context is {ctx} tokens but prompts + new tokens "
                             f"reach {longest}; use a ring-buffer draft (window=...) instead")
    return _Runner(spec=spec, gamma=int(gamma), extra_slots=int(gamma) + 2, draft=draft,
                   token_lists=token_lists)
