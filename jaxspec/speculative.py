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

Sliding-window models (`jaxspec.attention`): the target's verification is exact, so every kind of
speculation stays lossless. The drafts are proposals: a sparse self-draft keeps its sink + window
view while that is smaller than the model's window (else it attends exactly like the target), a
ring-buffer draft attends to its whole ring (whose slots are not positions), and a full-cache draft
applies its own model's window exactly.
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
from jaxspec.cache import SLOT_ALIGN, KVCache, kv_bytes_per_token, round_up, set_bits
from jaxspec.checkpoint import Model
from jaxspec.config import ModelConfig
from jaxspec.engine import DecodeLoop, DecodeState, commit_tokens, prefill
from jaxspec.model import forward, sliding_window_of
from jaxspec.prefix import positions_of
from jaxspec.sharding import cache_sharding_like
from jaxspec.tree import TokenTree, compact_path
from jaxspec.verify import verify_chain, verify_greedy, verify_tree, verify_tree_greedy


@dataclasses.dataclass(frozen=True, eq=False)
class Speculation:
    """How to speculate.

    draft: ``"self"`` (the target's weights over a sparse sink + window view of its own cache) or a
        `jaxspec.Model` sharing the target's vocabulary.
    gamma: drafts per round (>= 1), or ``"auto"`` to pick it from measured step costs.
    sink, window: StreamingLLM sparse KV of the draft. ``window=None`` means a full cache: for a
        separate draft its own full cache; for ``draft="self"`` the whole target cache (the draft is
        then the target itself and ``sink`` is unused: every draft is accepted, for testing).
    tree: token-tree speculation instead of a chain: SpecInfer's expansion config ``(k1, .., km)``
        (the node at depth i gets k_{i+1} children), a parents list (starting with -1), a
        `jaxspec.tree.TokenTree`, or the path of a JSON file written by ``jaxspec tree-search``.
        ``gamma`` is then unused.
    tree_sampling: how children are drawn at temperature > 0: ``"without_replacement"``
        (Gumbel-top-k, higher acceptance) or ``"iid"`` (SpecInfer's independent draws). At
        temperature 0 children are the draft's top-k.
    adaptive: each round chooses between speculating and one plain decode step, from a cost
        model of what the round reads for the rows still running and each row's own running
        acceptance (`SpecLoop.speculation_pays`). In a batch whose other rows have finished,
        a straggler with a low acceptance is then decoded plainly instead of paying for
        ``gamma`` draft steps per token. ``None`` (default): on with ``gamma="auto"`` (whose
        measured step costs calibrate the model), off for a fixed gamma (pure byte counts
        then).
    """

    draft: Any = "self"
    gamma: int | str = 4
    sink: int = 16
    window: int | None = 496
    tree: Any = None
    tree_sampling: str = "without_replacement"
    adaptive: bool | None = None


def resolve_tree(tree) -> TokenTree | None:
    """A TokenTree from any accepted ``Speculation.tree`` form (see `Speculation`)."""
    if tree is None or isinstance(tree, TokenTree):
        return tree
    if isinstance(tree, str):
        import json
        import pathlib
        path = pathlib.Path(tree)
        if not path.exists():
            raise ValueError(f"tree {tree!r} is neither an expansion config nor a tree file")
        data = json.loads(path.read_text())
        parents = data["parents"] if isinstance(data, dict) else data
        return TokenTree.from_parents(parents)
    try:
        seq = [int(x) for x in tree]
    except (TypeError, ValueError):
        raise ValueError(f"tree must be an expansion config, a parents list, a TokenTree or a "
                         f"file, got {tree!r}") from None
    if not seq:
        raise ValueError("tree is empty")
    if seq[0] == -1:
        return TokenTree.from_parents(seq)
    if any(k < 1 for k in seq):
        raise ValueError(f"tree expansion counts must be >= 1, got {seq}")
    return TokenTree.from_expansion(seq)


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
    tree: Any = None  # a static TokenTree: token-tree speculation instead of a chain
    tree_mode: str = "without_replacement"  # how sampled children are drawn (see verify_tree)
    skip_finished: bool = True  # finished rows read no context (`AttentionPlan.active`)
    # each round chooses between speculating and a plain decode step from a cost model
    # (`round_costs`, passed to `run`); False: every round speculates
    adaptive: bool = False

    def _active(self, state: DecodeState):
        return ~state.done if self.skip_finished else None

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
                                 window=self.window, active=self._active(state))
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

    def _catch_up(self, dparams, state: DecodeState, dstate: DraftState):
        """First forward of a separate draft in a round: two tokens, [prev, last] when the draft has
        not seen ``prev`` yet (all drafts accepted last round), else [last, pad]; K/V of a token
        already present is rewritten identically. Returns the draft logits at ``last`` [B, 1, V],
        the draft cache, the first position processed (``start``) and the slot it went to
        (``base``: equal to ``start`` for a full cache, the ring fill for a ring buffer), and
        ``pending`` (1 or 2)."""
        dc = dstate.cache
        L = positions_of(state.cache)  # position of `last` (after a shared prefix, if any)
        pending = L - dc.lengths + 1  # positions < dc.lengths are in the draft cache
        start = L + 1 - pending
        base = jnp.minimum(start, self.sink + self.window) if self.ring else start
        two = jnp.where((pending == 2)[:, None], jnp.stack([dstate.prev, state.last], 1),
                        jnp.stack([state.last, state.last], 1))
        pos0 = start[:, None] + jnp.arange(2, dtype=jnp.int32)[None]
        logits, dc = forward(self.draft_config, dparams, two, pos0, dc,
                             AttentionPlan(lengths=base, impl=self.impl,
                                           active=self._active(state),
                                           model_window=not self.ring),
                             logits_at=(pending - 1)[:, None])
        return logits, dc, start, base, pending

    def _model_draft(self, dparams, sp, state: DecodeState, dstate: DraftState, rng):
        """gamma steps of a separate draft model. The first step takes two tokens, [prev, last]
        when the draft has not seen ``prev`` yet (all drafts accepted last round), otherwise
        [last, pad]; its K/V is idempotent for a token already present."""
        L = positions_of(state.cache)  # position of `last`
        g = self.gamma
        logits, dc, start, base, pending = self._catch_up(dparams, state, dstate)
        rng, sub = jax.random.split(rng)
        d1, q1 = self._propose(sub, logits[:, 0], sp)

        def step(carry, j):
            k, v, tok, rng = carry
            rng, sub = jax.random.split(rng)
            off = L + j - start  # slot offset of position L + j within this round's tokens
            plan = AttentionPlan(lengths=base + off, impl=self.impl, active=self._active(state),
                                 model_window=not self.ring)
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
            # The gathered entries must exist before the scatter: fused into it, the gather
            # reads the buffer the scatter updates in place, and XLA (GPU) then copies the whole
            # draft cache twice per round (measured: 4 copies of ~0.9 GB at B=64, window 1008).
            k_src, v_src = jax.lax.optimization_barrier((k_src, v_src))
            k = set_bits(dc.k, (slice(None), b, slice(None), dst), k_src)
            v = set_bits(dc.v, (slice(None), b, slice(None), dst), v_src)
            dc = dc.replace(k=k, v=v)
        return dc.replace(lengths=have)

    # ------------------------------------------------------------------ one round
    def body(self, params, dparams, sp, carry):
        spec = self._tree_body if self.tree is not None else self._chain_body
        if not self.adaptive:
            return spec(params, dparams, sp, carry)
        return jax.lax.cond(self.speculation_pays(carry),
                            functools.partial(spec, params, dparams, sp),
                            functools.partial(self._plain_body, params, dparams, sp), carry)

    def speculation_pays(self, carry):
        """Whether a speculative round is expected to commit tokens faster than a plain step for
        the rows still running (``acc["round_costs"]``: see `round_costs`). Row b is expected to
        commit ``E_b`` tokens per round: its own running mean, shrunk toward the prior.

        Lossless whichever way it goes: a round of either kind commits tokens with exactly the
        target's distribution given everything before it (greedy: the target's argmax), and the
        choice depends only on the past, so the whole sequence keeps the target's distribution."""
        state, _, acc = carry
        c = acc["round_costs"]
        active = ~state.done
        L = state.cache.lengths.astype(jnp.float32)
        W = sliding_window_of(self.config)
        if W is not None:  # a target step reads at most its window
            L = jnp.minimum(L, float(W))
        span = c[5]
        if self.draft_config is None:
            ctx_d = jnp.minimum(L, span) if self.window is not None else L
        else:
            ctx_d = jnp.full_like(L, span) if self.ring else L
        n = jnp.sum(active.astype(jnp.float32))
        sum_L = jnp.sum(jnp.where(active, L, 0.0))
        sum_d = jnp.sum(jnp.where(active, ctx_d, 0.0))
        e = ((acc["rows_committed"].astype(jnp.float32) + c[7] * c[6])
             / (acc["rows_steps"].astype(jnp.float32) + c[7]))
        tokens = jnp.sum(jnp.where(active, e, 0.0))
        plain = c[0] + c[1] * sum_L
        spec = c[2] + c[3] * sum_L + c[4] * sum_d
        return tokens * plain >= n * spec

    def _plain_body(self, params, dparams, sp, carry):
        """A plain decode step inside the speculative loop (`speculation_pays` chose it): the
        plain loop's own step (one target token per row, from the target's distribution). A
        separate draft model reads the token it has not seen yet, so it never lags by more than
        one position."""
        state, dstate, acc = carry
        st = DecodeLoop(config=self.config, stop_ids=self.stop_ids, impl=self.impl,
                        skip_finished=self.skip_finished).body(params, sp, state)
        active = ~state.done
        if self.draft_config is not None:
            _, dc, start, base, _ = self._catch_up(dparams, state, dstate)
            have = jnp.minimum(positions_of(st.cache), positions_of(state.cache) + 1)
            dc = self._commit_draft(dc, start, base, have, n_kv_max=2)
            # nothing accepted: the token before the new `last` is the old one
            dstate = _next_draft_state(dc, st.last[:, None], jnp.zeros_like(st.last), state,
                                       dstate, active)
        acc = dict(acc)
        acc["committed"] = acc["committed"] + jnp.sum(st.n_out - state.n_out)
        acc["row_steps"] = acc["row_steps"] + jnp.sum(active.astype(jnp.int32))
        acc["plain_steps"] = acc["plain_steps"] + 1
        return st, dstate, acc

    def _chain_body(self, params, dparams, sp, carry):
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
        plan = AttentionPlan(lengths=L, impl=self.impl, active=self._active(state))
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
            # the draft computed K/V for positions start .. L+g-1 (not for the last draft d_g)
            have = jnp.minimum(positions_of(st.cache), positions_of(state.cache) + g)
            dc = self._commit_draft(dc, start, base, have, n_kv_max=g + 1)
            dstate = _next_draft_state(dc, drafts, n_acc, state, dstate, active)
        return st, dstate, _count(acc, g, n_acc, state, st)


    # ------------------------------------------------------------------ token trees
    def _children(self, rng, logits, sp, k):
        """k children per node from draft logits [B, n, V]: top-k (greedy) or sampled."""
        if self.greedy:
            return jax.lax.top_k(logits, k)[1].astype(jnp.int32), None
        q = sampling.probs_from_logits(logits, sp)
        kids = sampling.sample_children(rng, q, k, replacement=self.tree_mode == "iid")
        return kids.astype(jnp.int32), q

    def _draft_tree(self, params, dparams, sp, state, dstate, rng, *, level_only=True):
        """Drafts the whole tree: one draft forward per level giving the child distributions of
        that level's nodes (the deepest level's nodes are never forwarded).

        The forward of level d runs over that level's nodes ``[a, b)`` only: their K/V go to
        slots ``root_slot + a .. root_slot + b - 1`` and they attend to the context (the sparse
        sink + window view for self-speculation; the draft's full or ring cache otherwise) plus
        the earlier levels' K/V, already in the cache at ``root_slot + 0 .. a - 1``, and
        themselves, under ``anc[a:b, :b]`` (an `AttentionPlan` with ``T_new = b`` new tokens of
        which the forward computes the last ``b - a``). The root's K/V come from level 0's
        forward (self) or the catch-up forward (a separate draft). ``level_only=False``: the
        former forward over all nodes ``[0, b)`` per level, recomputing the earlier levels (the
        same result up to rounding; a reference for tests)."""
        tree = self.tree
        N, D = tree.num_nodes, tree.max_depth
        par, depths, rank = tree.parents, tree.depths, tree.sibling_rank
        levels = tree.levels
        anc = jnp.asarray(tree.ancestor_mask)
        L = state.cache.lengths
        B = L.shape[0]
        node_tok = jnp.zeros((B, N), jnp.int32).at[:, 0].set(state.last)
        q_all = None if self.greedy else jnp.zeros((B, N, self.config.vocab_size), jnp.float32)
        depths_j = jnp.asarray(depths, jnp.int32)
        if self.draft_config is None:
            cache, cfg, prm = state.cache, self.config, params
            root_slot = L
            sparse = self.window is not None
            sink, window = (self.sink, self.window) if sparse else (None, None)
            extra = {}
        else:
            L = positions_of(state.cache)  # the draft's cache holds whole prompts: positions
            root_logits, dc, start, base, pending = self._catch_up(dparams, state, dstate)
            cache, cfg, prm = dc, self.draft_config, dparams
            root_slot = base + pending - 1
            sink = window = None
            extra = {"start": start, "base": base, "root_slot": root_slot}
        for d in range(D):
            a, b = levels[d]
            a2, b2 = levels[d + 1]
            rng, sub = jax.random.split(rng)
            if d == 0 and self.draft_config is not None:
                logits = root_logits
            else:
                lo = a if level_only else 0  # first node this forward computes
                plan = AttentionPlan(lengths=root_slot, mask=anc[lo:b, :b], sink=sink,
                                     window=window, impl=self.impl, active=self._active(state),
                                     model_window=not self.ring)
                idx = jnp.broadcast_to(jnp.arange(a - lo, b - lo, dtype=jnp.int32), (B, b - a))
                logits, cache = forward(cfg, prm, node_tok[:, lo:b],
                                        L[:, None] + depths_j[None, lo:b], cache, plan,
                                        logits_at=idx)
            k = int(max(len(tree.children[i]) for i in range(a, b)))
            kids, q = self._children(sub, logits, sp, k)  # [B, b-a, k]
            if q is not None:
                q_all = q_all.at[:, a:b].set(q)
            src_node = jnp.asarray(par[a2:b2] - a, jnp.int32)
            src_rank = jnp.asarray(rank[a2:b2], jnp.int32)
            node_tok = node_tok.at[:, a2:b2].set(kids[:, src_node, src_rank])
        return cache, node_tok, q_all, extra

    def _tree_body(self, params, dparams, sp, carry):
        state, dstate, acc = carry
        tree = self.tree
        N, D = tree.num_nodes, tree.max_depth
        rng, r_draft, r_verify = jax.random.split(state.rng, 3)
        L = state.cache.lengths
        dcache, node_tok, q_all, extra = self._draft_tree(params, dparams, sp, state, dstate,
                                                          r_draft)
        cache = dcache if self.draft_config is None else state.cache
        positions = L[:, None] + jnp.asarray(tree.depths, jnp.int32)[None]
        plan = AttentionPlan(lengths=L, mask=jnp.asarray(tree.ancestor_mask), impl=self.impl,
                             active=self._active(state))
        logits, cache = forward(self.config, params, node_tok, positions, cache, plan)
        if self.greedy:
            n_acc, acc_nodes, nxt = verify_tree_greedy(tree, node_tok, logits)
        else:
            p = sampling.probs_from_logits(logits, sp)
            n_acc, acc_nodes, nxt = verify_tree(r_verify, tree, node_tok, q_all, p,
                                                mode=self.tree_mode)
        n_acc = n_acc.astype(jnp.int32)
        acc_nodes = acc_nodes.astype(jnp.int32)
        # accepted path's K/V to consecutive slots L + 0..n (root already at L)
        k, v = compact_path((cache.k, cache.v), acc_nodes, L, slot_axis=3, batch_axis=1)
        cache = cache.replace(k=k, v=v)
        path = jnp.take_along_axis(node_tok, jnp.maximum(acc_nodes, 0), axis=1)  # [B, D]
        idx = jnp.arange(D + 1, dtype=jnp.int32)[None]
        new = jnp.where(idx < n_acc[:, None], jnp.pad(path, ((0, 0), (0, 1))),
                        nxt[:, None].astype(jnp.int32))
        active = ~state.done
        st = commit_tokens(state.replace(cache=cache, rng=rng, steps=state.steps + 1), new,
                           jnp.where(active, n_acc + 1, 0), self.stop_ids)
        if self.draft_config is not None:
            dc = dcache
            # the draft holds K/V for the root and every node above the deepest level
            dk, dv = compact_path((dc.k, dc.v), jnp.where(acc_nodes >= 0, acc_nodes, -1),
                                  extra["root_slot"], slot_axis=3, batch_axis=1)
            dc = dc.replace(k=dk, v=dv)
            have = jnp.minimum(positions_of(st.cache), positions_of(state.cache) + D)
            dc = self._commit_draft(dc, extra["start"], extra["base"], have, n_kv_max=D + 1)
            dstate = _next_draft_state(dc, path, n_acc, state, dstate, active)
        return st, dstate, _count(acc, D, n_acc, state, st)

    def cond(self, carry):
        return carry[0].running()

    def run(self, params, dparams, sp, state, dstate, round_costs=None):
        """The loop from ``state``; ``round_costs`` (float32 [8], see `round_costs`) is needed
        by an adaptive loop."""
        acc = {k: jnp.zeros((), jnp.int32) for k in ("proposed", "accepted", "committed",
                                                      "row_steps", "plain_steps")}
        B = state.last.shape[0]
        acc["rows_committed"] = jnp.zeros((B,), jnp.int32)
        acc["rows_steps"] = jnp.zeros((B,), jnp.int32)
        if self.adaptive:
            if round_costs is None:
                raise ValueError("an adaptive loop needs round_costs")
            acc["round_costs"] = jnp.asarray(round_costs, jnp.float32)
        return jax.lax.while_loop(self.cond, functools.partial(self.body, params, dparams, sp),
                                  (state, dstate, acc))


def _next_draft_state(dc, accepted_BN, n_acc, state, dstate, active) -> DraftState:
    """The token at position new_L - 1 (``prev`` of the next round): the last accepted draft, or
    the old ``last``; finished rows keep theirs."""
    prev = jnp.where(n_acc > 0, jnp.take_along_axis(
        accepted_BN, jnp.maximum(n_acc - 1, 0)[:, None], 1)[:, 0], state.last)
    return DraftState(cache=dc, prev=jnp.where(active, prev, dstate.prev))


def _count(acc, proposed_per_row, n_acc, state, st):
    """Round counters: drafts proposed / accepted, tokens committed, active row-steps (and, when
    the carry has them, per-row ``rows_committed`` / ``rows_steps``)."""
    active = ~state.done
    out = dict(acc)
    out |= {"proposed": acc["proposed"] + jnp.sum(jnp.where(active, proposed_per_row, 0)),
           "accepted": acc["accepted"] + jnp.sum(jnp.where(active, n_acc, 0)),
           "committed": acc["committed"] + jnp.sum(st.n_out - state.n_out),
           "row_steps": acc["row_steps"] + jnp.sum(active.astype(jnp.int32))}
    if "rows_steps" in acc:
        out["rows_committed"] = acc["rows_committed"] + (st.n_out - state.n_out)
        out["rows_steps"] = acc["rows_steps"] + active.astype(jnp.int32)
    return out


def _qs_BgV(qs):
    return None if qs is None else jnp.swapaxes(qs, 0, 1)


@functools.partial(jax.jit, static_argnames=("loop",), donate_argnames=("state", "dstate"))
def _run_spec(params, dparams, sp, state, dstate, round_costs=None, *, loop: SpecLoop):
    return loop.run(params, dparams, sp, state, dstate, round_costs)


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
        if spec.window is not None and spec.tree is None:
            gmax = 8 if g == "auto" else int(g)
            if spec.window < gmax + 2:
                raise ValueError(f"a ring-buffer draft needs window >= gamma + 2 = "
                                 f"{gmax + 2}, got {spec.window}")
    else:
        raise TypeError(f"draft must be 'self' or a jaxspec.Model, got {type(spec.draft).__name__}")
    if spec.adaptive not in (None, True, False):
        raise ValueError(f"adaptive must be True, False or None, got {spec.adaptive!r}")
    if spec.tree_sampling not in ("without_replacement", "iid"):
        raise ValueError(f"tree_sampling must be 'without_replacement' or 'iid', "
                         f"got {spec.tree_sampling!r}")
    if spec.tree is not None:
        tree = resolve_tree(spec.tree)
        if g == "auto":
            raise ValueError("gamma='auto' picks a chain length; it cannot be combined with a tree")
        if (isinstance(spec.draft, Model) and spec.window is not None
                and spec.window < tree.max_depth + 2):
            raise ValueError(f"a ring-buffer draft needs window >= tree depth + 2 = "
                             f"{tree.max_depth + 2}, got {spec.window}")


@dataclasses.dataclass
class _Runner:
    spec: Speculation
    gamma: int
    extra_slots: int
    draft: Model | None
    token_lists: list
    tree: TokenTree | None = None
    skip_finished: bool = True  # finished rows read no context (benchmarks compare with False)

    def run(self, model: Model, sp, state: DecodeState, *, stop_ids, impl, profile=False,
            dstate: DraftState | None = None):
        """The speculative loop from ``state``; ``dstate``: the draft's prefilled state (default:
        prefilled here, see `draft_state`)."""
        greedy = bool(np.all(np.asarray(sp.temperature) <= 0))
        cfg = model.config
        measure = self.spec.gamma == "auto" or profile
        # A draft model's prefill waits until it is needed: `auto` may decode plainly, and its
        # step costs are timed on a zero cache of the same shape and lengths.
        placeholder = dstate is None and measure and self.draft is not None
        if dstate is None:
            dstate = (self.draft_placeholder(state) if placeholder
                      else self.draft_state(model, state, impl))
        dparams = jnp.zeros(()) if self.draft is None else self.draft.decode_params()
        stats: dict[str, Any] = {}
        gamma = self.gamma
        costs = None
        if measure:
            costs, state, dstate = measure_costs(model, self.spec, self.draft, state, dstate,
                                                 impl, GAMMA_CANDIDATES)
            stats["step_costs_ms"] = {k: (round(v * 1e3, 4) if isinstance(v, float) else
                                          {g: round(t * 1e3, 4) for g, t in v.items()})
                                      for k, v in costs.items()}
        key = _acceptance_key(model, self.spec)
        if self.spec.gamma == "auto":
            alpha = _ACCEPTANCE.get(key, PRIOR_ACCEPTANCE)
            gamma, predicted = choose_gamma(costs, alpha, previous=_CHOSEN.get(key))
            _CHOSEN[key] = gamma
            stats.update({"auto_alpha": alpha, "predicted_speedup": predicted})
        stats["gamma"] = gamma
        if self.tree is not None:
            stats["tree_nodes"] = self.tree.num_nodes
            stats["tree_depth"] = self.tree.max_depth
        if gamma == 0:  # speculation would not pay: plain decoding
            from jaxspec.engine import _run_loop
            del dstate
            loop = DecodeLoop(config=cfg, stop_ids=stop_ids, impl=impl,
                              skip_finished=self.skip_finished)
            final = _run_loop(model.decode_params(), sp, state, loop=loop)
            stats.update({"acceptance_rate": 0.0, "tokens_per_step": 1.0})
            return final, stats
        if placeholder:
            dstate = None  # release the zero cache before the real one is filled
            dstate = self.draft_state(model, state, impl)
        adaptive = self.spec.gamma == "auto" if self.spec.adaptive is None else self.spec.adaptive
        rc = None
        if adaptive:
            n_fwd = gamma if self.tree is None else self.tree.max_depth
            alpha = _ACCEPTANCE.get(key, PRIOR_ACCEPTANCE)
            lens = np.asarray(state.cache.lengths)[~np.asarray(state.done)]
            W = sliding_window_of(cfg)
            if W is not None:  # a target step reads at most its window
                lens = np.minimum(lens, W)
            rc = round_costs(model, self.spec, self.draft, n_forwards=n_fwd,
                             prior_tokens=expected_tokens(alpha, n_fwd), batch=len(lens),
                             context=float(lens.mean()) if lens.size else 0.0, costs=costs,
                             gamma=gamma)
        loop = self.loop(model, stop_ids=stop_ids, impl=impl, gamma=gamma, greedy=greedy,
                         adaptive=adaptive, skip_finished=self.skip_finished)
        final, _, acc = _run_spec(model.decode_params(), dparams, sp, state, dstate, rc,
                                  loop=loop)
        acc.pop("round_costs", None)
        rows_c, rows_s = np.asarray(acc.pop("rows_committed")), np.asarray(acc.pop("rows_steps"))
        acc = {k: int(v) for k, v in acc.items()}
        stats["plain_steps"] = acc["plain_steps"]
        rate = acc["accepted"] / max(acc["proposed"], 1)
        per_row = (rows_c / np.maximum(rows_s, 1))[rows_s > 0]
        stats.update({
            "acceptance_rate": rate,
            "tokens_per_step": acc["committed"] / max(acc["row_steps"], 1),
            # spread over rows: the slowest row sets the rounds a whole batch needs
            "tokens_per_step_rows": {q: float(np.percentile(per_row, q)) if per_row.size else 0.0
                                     for q in (0, 10, 50, 90, 100)},
        })
        if acc["proposed"]:
            # per speculative row-round (plain steps of an adaptive loop proposed nothing)
            alpha = per_token_acceptance(acc["accepted"] / max(int(rows_s.sum()), 1), gamma)
            old = _ACCEPTANCE.get(key)
            _ACCEPTANCE[key] = alpha if old is None else 0.5 * old + 0.5 * alpha
        if costs is not None:
            rounds = int(final.steps) - acc["plain_steps"]
            d = costs["draft"] * gamma
            v = costs["verify"][gamma]
            stats.update({"draft_seconds_estimate": rounds * d,
                          "verify_seconds_estimate": rounds * v})
        return final, stats

    def loop(self, model: Model, *, stop_ids, impl, gamma: int, greedy: bool,
             adaptive: bool = False, skip_finished: bool = True) -> SpecLoop:
        """The static loop description for this speculation at ``gamma`` (chains)."""
        return SpecLoop(config=model.config, stop_ids=stop_ids, gamma=gamma, sink=self.spec.sink,
                        window=self.spec.window, greedy=greedy, impl=impl,
                        draft_config=None if self.draft is None else self.draft.config,
                        ring=self.draft is not None and self.spec.window is not None,
                        tree=self.tree, tree_mode=self.spec.tree_sampling,
                        adaptive=adaptive, skip_finished=skip_finished)

    def draft_state(self, model: Model, state: DecodeState, impl: str) -> DraftState:
        """The draft's state at the start of decoding: a placeholder for self-speculation, else
        the draft model's cache prefilled with the prompts (full, or a ring buffer)."""
        if self.draft is None:
            return DraftState(cache=KVCache.create(model.config, 1, 1, model.dtype),
                              prev=jnp.array(state.last, copy=True))
        return self._draft_prefill(state, impl)

    def draft_placeholder(self, state: DecodeState) -> DraftState:
        """A draft state of the real one's shapes and lengths with zero K/V and no prefill: what
        `measure_costs` times draft steps on (the cost of a step does not depend on the values).
        Draft models only (self-speculation has no draft cache)."""
        d = self.draft
        B = len(self.token_lists)
        if self.spec.window is None:
            S = state.cache.max_len
        else:
            S = ring_cache_len(self.spec.sink, self.spec.window, self.extra_slots,
                               ring_chunk(self.spec.window))
        dc = KVCache.create(d.config, B, S, dtype=d.dtype,
                            sharding=cache_sharding_like(d.config, d.params, B))
        lens = jnp.asarray([len(t) - 1 for t in self.token_lists], jnp.int32)
        return DraftState(cache=dc.replace(lengths=lens), prev=jnp.array(state.last, copy=True))

    def _draft_prefill(self, state: DecodeState, impl: str) -> DraftState:
        d = self.draft
        d_params = d.decode_params()
        B = len(self.token_lists)
        prompts = [t[:-1] for t in self.token_lists]
        if self.spec.window is None:
            S = state.cache.max_len
            dc = KVCache.create(d.config, B, S, dtype=d.dtype,
                                sharding=cache_sharding_like(d.config, d.params, B))
            dc = prefill(d.config, d_params, dc, prompts, impl=impl)
        else:
            dc = ring_prefill(d.config, d_params, prompts, sink=self.spec.sink,
                              window=self.spec.window, scratch=self.extra_slots, impl=impl,
                              dtype=d.dtype)
        return DraftState(cache=dc, prev=jnp.array(state.last, copy=True))


def ring_chunk(window: int) -> int:
    """Tokens per chunk of a ring cache's streaming prefill (its scratch area holds one)."""
    return max(8, min(256, window // 2))


def ring_cache_len(sink: int, window: int, scratch: int, chunk: int) -> int:
    # a multiple of SLOT_ALIGN like every cache: the attention kernel's key blocks divide it
    return round_up(sink + window + max(scratch, chunk), SLOT_ALIGN)


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
    plan = AttentionPlan(lengths=base, impl=impl, model_window=False)  # ring slots: not positions
    _, cache = forward(config, params, tokens_BC, positions, cache, plan,
                       logits_at=jnp.zeros((B, 1), jnp.int32))
    loop = SpecLoop(config=config, stop_ids=(), gamma=1, sink=sink, window=window, greedy=True,
                    draft_config=config, ring=True)
    return loop._commit_draft(cache, start, base, start + n_valid, n_kv_max=C)


def ring_prefill(config, params, prompts, *, sink, window, scratch, impl="auto",
                 dtype=jnp.bfloat16) -> KVCache:
    B = len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    C = ring_chunk(window)
    S = ring_cache_len(sink, window, scratch, C)
    cache = KVCache.create(config, B, S, dtype=dtype,
                           sharding=cache_sharding_like(config, params, B))
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
        gamma = max(GAMMA_CANDIDATES)  # the cache is sized for the largest candidate
    draft = None if spec.draft == "self" else spec.draft
    if draft is not None and spec.window is None:
        ctx = draft.config.max_position_embeddings
        # new tokens stop at the target's context (`engine.prepare`): count only those
        tctx = model.config.max_position_embeddings
        longest = max(len(t) + max(0, min(max_new_tokens, tctx - len(t))) for t in token_lists)
        if longest > ctx:
            raise ValueError(f"the draft model's context is {ctx} tokens but prompts + new tokens "
                             f"reach {longest}; use a ring-buffer draft (window=...) instead")
    tree = resolve_tree(spec.tree)
    extra = (tree.num_nodes + 1) if tree is not None else int(gamma) + 2
    return _Runner(spec=spec, gamma=int(gamma), extra_slots=extra, draft=draft,
                   token_lists=token_lists, tree=tree)


# ---------------------------------------------------------------------------- gamma="auto"
GAMMA_CANDIDATES = (1, 2, 3, 4, 5, 6)
PRIOR_ACCEPTANCE = 0.6  # per-token acceptance assumed before any speculative run of a model
# Speculate only where the model predicts at least this speedup. The measured step costs scatter
# by up to ~10% at small batch (an H100, B=1 x 1k: a 2-token verify timed below a 1-token step),
# and a 1.05 margin let a predicted 1.06x run at 0.98x there.
AUTO_MARGIN = 1.10
_ACCEPTANCE: dict = {}  # running per-token acceptance, per (model, draft kind)
_COSTS: dict = {}  # measured step costs, per shape
_CHOSEN: dict = {}  # last gamma chosen by gamma="auto", per (model, draft kind)


def _acceptance_key(model: Model, spec: Speculation):
    draft = "self" if spec.draft == "self" else id(spec.draft)
    return (id(model), draft, spec.sink, spec.window)


def per_token_acceptance(accepted_per_round: float, gamma: int) -> float:
    """Solves ``sum_{i=1..gamma} a^i = accepted_per_round`` for the per-token acceptance a."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(1, gamma + 1)) < accepted_per_round:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens committed per round of a chain of ``gamma`` drafts (i.i.d. acceptance)."""
    return sum(alpha ** i for i in range(gamma + 1))


def _interp(table: dict, T: int) -> float:
    """Linear interpolation of a cost table keyed by number of tokens."""
    xs = sorted(table)
    if T in table:
        return table[T]
    lo = max([x for x in xs if x <= T], default=xs[0])
    hi = min([x for x in xs if x >= T], default=xs[-1])
    if lo == hi:
        return table[lo]
    return table[lo] + (table[hi] - table[lo]) * (T - lo) / (hi - lo)


def choose_gamma(costs: dict, alpha: float, candidates=GAMMA_CANDIDATES,
                 margin: float = AUTO_MARGIN, previous: int | None = None,
                 hysteresis: float = 1.05) -> tuple[int, float]:
    """MagicDec's cost model: speedup(g) = E[tokens](alpha, g) * t_plain / (g t_draft + t_verify(g+1)).
    Returns (gamma, predicted speedup); gamma 0 (plain decoding) unless a gamma beats it by
    ``margin``. ``previous`` (the last choice for this model and draft) is kept unless another
    gamma is predicted ``hysteresis`` times faster: every new gamma compiles a new loop, so the
    choice must not flip on noise in the running acceptance."""
    def speedup(g):
        if g == 0:
            return 1.0
        return expected_tokens(alpha, g) * costs["plain"] / (g * costs["draft"] + costs["verify"][g])
    best, best_s = 0, 1.0
    for g in candidates:
        s = speedup(g)
        if s > best_s:
            best, best_s = g, s
    if best_s < margin:
        best, best_s = 0, 1.0
    if previous is not None and previous != best and (
            previous == 0 or (previous in candidates and speedup(previous) >= margin)):
        if speedup(previous) * hysteresis >= best_s:
            return previous, speedup(previous)
    return best, best_s


def _param_bytes(params) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))


def round_costs(model: Model, spec: Speculation, draft: Model | None, *, n_forwards: int,
                prior_tokens: float, batch: int, context: float, costs: dict | None = None,
                gamma: int | None = None) -> np.ndarray:
    """Coefficients of the adaptive loop's cost model (`SpecLoop.speculation_pays`), float32:
    ``[plain_fixed, plain_per_token, spec_fixed, spec_per_token, draft_per_token, draft_span,
    prior_tokens, prior_weight]``. A plain step costs ``plain_fixed + plain_per_token * sum L``
    and a round ``spec_fixed + spec_per_token * sum L + draft_per_token * sum ctx_d`` over the
    running rows (L: context, ctx_d: the draft's context, at most ``draft_span`` slots for a
    sparse self-draft or a ring buffer). The terms are bytes read: weights once per forward, K/V
    per context token; with measured step ``costs`` (gamma="auto", taken at ``batch`` rows of
    mean ``context``), each kind of forward's bytes are scaled to its measured time."""
    W = _param_bytes(model.params)
    kv = kv_bytes_per_token(model.config, model.dtype)
    if draft is None:
        Wd, kvd = W, kv
    else:
        Wd, kvd = _param_bytes(draft.params), kv_bytes_per_token(draft.config, draft.dtype)
    span = spec.sink + (spec.window or 0)
    if spec.window is None:
        ctx_d = context
    else:
        ctx_d = span if draft is not None else min(context, span)
    s_p = s_d = s_v = 1.0
    if costs is not None and batch > 0:
        s_p = costs["plain"] / (W + kv * batch * context)
        s_d = costs["draft"] / (Wd + kvd * batch * ctx_d)
        t_v = costs["verify"].get(gamma, max(costs["verify"].values()))
        s_v = t_v / (W + kv * batch * context)
    return np.asarray([s_p * W, s_p * kv, n_forwards * s_d * Wd + s_v * W, s_v * kv,
                       n_forwards * s_d * kvd, span, prior_tokens, 2.0], np.float32)


COST_STEPS = 4   # forwards per timed device loop (amortizes dispatch and sync)
COST_REPEATS = 3  # timed loops per kind of forward, interleaved across kinds; median


@functools.partial(jax.jit, static_argnames=("config", "T", "sink", "window", "impl", "n"),
                   donate_argnames=("cache",))
def _cost_steps(params, cache, *, config, T, sink, window, impl, n=COST_STEPS):
    """``n`` forwards of T tokens at the cache's current lengths inside one device loop (each
    writes only the uncommitted slots ``lengths + [0, T)``, so the cache's contents stay valid)."""
    B = cache.batch
    L = cache.lengths
    pos = L[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    plan = AttentionPlan(lengths=L, sink=sink, window=window, impl=impl)

    def body(i, carry):
        c, acc = carry
        tokens = jnp.full((B, T), i, jnp.int32)  # differs per step: no step can be hoisted
        logits, c = forward(config, params, tokens, pos, c, plan)
        return c, acc + jnp.sum(logits[:, -1, :8].astype(jnp.float32))

    return jax.lax.fori_loop(0, n, body, (cache, jnp.zeros((), jnp.float32)))


def _compile_concurrently(lowered) -> None:
    """Compiles lowered computations on threads; the jitted functions then find the executables
    in jax's compilation cache."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max(1, min(len(lowered), 8))) as ex:
        list(ex.map(lambda low: low.compile(), lowered))


def measure_costs(model, spec, draft, state, dstate, impl, gammas):
    """Median wall time of a plain decode step, a draft step and verify forwards of g+1 tokens,
    at the actual batch, cache and context lengths (measured once per shape, then cached).

    Each measurement is a device loop of `COST_STEPS` forwards (one dispatch, one sync), after a
    warm-up call of every kind, repeated `COST_REPEATS` times round-robin over the kinds: timing
    single jitted calls one kind after another charged the first kind with the dispatch and
    clock ramp (a plain step measured 3.1 ms standalone against 2.2 ms inside the loop on an
    H100, and ``gamma="auto"`` then chose a gamma that lost). The caches pass through (donated);
    only slots past the committed lengths are written."""
    cfg = model.config
    cache = state.cache
    L_mean = int(np.mean(np.asarray(cache.lengths)) // 256)
    key = (cfg, cache.k.shape, str(cache.k.dtype), impl, spec.sink, spec.window,
           None if draft is None else (draft.config, dstate.cache.k.shape), L_mean)
    if key in _COSTS:
        return _COSTS[key], state, dstate

    Ts = sorted({2, max(gammas) + 1, (min(gammas) + max(gammas)) // 2 + 1})
    sparse = spec.window is not None
    # (name, params, config, T, sink, window, on the draft's cache?)
    kinds = [("plain", model.decode_params(), cfg, 1, None, None, False)]
    kinds += [(T, model.decode_params(), cfg, T, None, None, False) for T in Ts]
    if draft is None:
        kinds.append(("draft", model.decode_params(), cfg, 1, spec.sink if sparse else None,
                      spec.window, False))
    else:
        kinds.append(("draft", draft.decode_params(), draft.config, 1, None, None, True))
    caches = {False: cache, True: None if draft is None else dstate.cache}
    # Compile every kind at once (XLA compiles outside the GIL): the first `auto` call of a
    # shape otherwise waits for one compile after another.
    _compile_concurrently([
        _cost_steps.lower(params, caches[on_draft], config=cfg_, T=T, sink=sink, window=window,
                          impl=impl)
        for _, params, cfg_, T, sink, window, on_draft in kinds])
    times: dict = {k[0]: [] for k in kinds}
    for rep in range(COST_REPEATS + 1):  # repetition 0: warm up (compiled above)
        for name, params, cfg_, T, sink, window, on_draft in kinds:
            t = time.perf_counter()
            c, acc = _cost_steps(params, caches[on_draft], config=cfg_, T=T, sink=sink,
                                 window=window, impl=impl)
            jax.block_until_ready(acc)
            if rep:
                times[name].append((time.perf_counter() - t) / COST_STEPS)
            caches[on_draft] = c
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    cache = caches[False]
    if draft is not None:
        dstate = dstate.replace(cache=caches[True])
    t_plain, t_draft = med["plain"], med["draft"]
    verify = {T: med[T] for T in Ts}
    costs = {"plain": t_plain, "draft": t_draft,
             "verify": {g: _interp(verify, g + 1) for g in gammas}}
    _COSTS[key] = costs
    return costs, state.replace(cache=cache), dstate
