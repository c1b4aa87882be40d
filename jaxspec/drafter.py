"""Drafters: who proposes the tokens of a speculative round, and what they keep between rounds.

Three kinds, one interface (`jaxspec.decoding.Round` calls them):

- `SelfDrafter`: the target's own weights with attention restricted to the first ``sink`` and the
  last ``window`` positions of the target's own cache (StreamingLLM, after MagicDec). A draft step
  reads the weights plus ``sink + window`` keys per row, whatever the context length. It keeps no
  state: the K/V of its drafts land in the target cache's slots past the committed length, which
  verification overwrites.
- `ModelDrafter` with a full cache: a separate (small) model with its own cache of every position.
- `ModelDrafter` with a ring cache (``ring=True``): the draft's cache holds ``sink + window`` slots
  plus a scratch area for the tokens of the current round; position ``P`` lives at slot ``P`` if
  ``P < sink`` else ``sink + (P - sink) % window``, so the oldest window slot is evicted and
  generation of any length works. Positions are always original positions.

A separate draft model lags the target by up to two tokens at the start of a round: the first draft
forward ("catch-up") takes ``[prev, last]`` when the draft has not seen ``prev`` (every draft of the
last round was accepted) and ``[last, pad]`` otherwise; K/V of a token already present are written
again identically. After the round the draft's cache holds every committed position but the last.

Every drafter proposes either a chain (``gamma`` uniform steps, scanned) or a token tree (one draft
forward per level over that level's nodes, attending to the context and the earlier levels' K/V
under the ancestor mask). Sliding-window targets: the drafts are proposals; a sparse self-draft keeps
its view while that is smaller than the model's window, a ring-buffer draft attends to its whole
ring (its config is run without a window, since ring slots are not positions), a full-cache draft
applies its own model's window exactly.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec import sampling
from jaxspec.attention import AttentionPlan, plan_for
from jaxspec.cache import SLOT_ALIGN, KVCache, positions_of, round_up, set_bits
from jaxspec.config import ModelConfig
from jaxspec.invariant import is_invariant
from jaxspec.model import forward
from jaxspec.retrieval import RETRIEVE_BLOCK, select_blocks, with_recent
from jaxspec.tree import compact_path


@struct.dataclass
class RetrievalState:
    """A retrieving self-draft's state between rounds: the blocks its next drafts read."""

    blocks: jax.Array  # [B, L, K, R] int32 (`jaxspec.retrieval.select_blocks`), -1: none

    def start_rows(self, rows, last):
        """New sequences in ``rows``: nothing selected yet."""
        del last
        return self.replace(blocks=self.blocks.at[rows].set(-1, mode="drop"))


@struct.dataclass
class DraftState:
    """A separate draft model's state between rounds."""

    cache: KVCache  # the draft's cache; lengths = committed positions it holds
    prev: jax.Array  # [B] committed token at position L - 1 (needed when the draft lags by one)

    def start_rows(self, rows, last):
        """New sequences in ``rows`` whose draft caches hold their prompts but the last token."""
        return self.replace(prev=self.prev.at[rows].set(last, mode="drop"))


plan_on = plan_for  # an `AttentionPlan` over a cache (prefix segments, block table)


def draft_impl(rd) -> str:
    """The numerics of the self-draft's forwards and of the block scores that select what it
    reads: the round's, except that a greedy batch-invariant round uses the default ones
    (greedy drafts only propose: the verification's invariant logits decide every token and
    rewrite every position the drafts wrote; sampled drafts and their distributions decide
    tokens, so they stay invariant)."""
    if rd.greedy and is_invariant(rd.impl):
        return "auto"
    return rd.impl


def propose(rd, keys, logits_BV, sp):
    """One draft token per row (greedy: the argmax) and, when sampling, the distribution it was
    drawn from."""
    if rd.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), None
    q = sampling.probs_from_logits(logits_BV, sp)
    return sampling.categorical_rows(keys, q, invariant=sp.invariant).astype(jnp.int32), q


def children(rd, keys, logits, sp, k):
    """k children per node from draft logits ``[B, n, V]``: top-k (greedy) or sampled."""
    if rd.greedy:
        return jax.lax.top_k(logits, k)[1].astype(jnp.int32), None
    q = sampling.probs_from_logits(logits, sp)
    replacement = rd.tree_mode == "iid"
    kids = sampling.rowwise(
        lambda key, qq: sampling.sample_children(key, qq, k, replacement=replacement,
                                                 invariant=sp.invariant), keys, q)
    return kids.astype(jnp.int32), q


def _level_loop(rd, keys, sp, node_tok, q_all, first_logits, level_forward):
    """Shared tree drafting: for each level, the draft logits at its nodes (``first_logits`` for
    level 0 when given, else ``level_forward(d, a, b, node_tok)``), then the children of its nodes
    as the next level's tokens.

    The forward of level d runs over that level's nodes ``[a, b)`` only: their K/V go to slots
    ``root_slot + a .. root_slot + b - 1`` and they attend to the context plus the earlier levels'
    K/V (already in the cache at ``root_slot + 0 .. a - 1``) and themselves, under
    ``anc[a:b, :b]`` (a plan of ``T_new = b`` new tokens of which the forward computes the last
    ``b - a``). The deepest level's nodes are never forwarded."""
    tree = rd.tree
    par, rank, levels = tree.parents, tree.sibling_rank, tree.levels
    for d in range(tree.max_depth):
        a, b = levels[d]
        a2, b2 = levels[d + 1]
        keys, sub = sampling.split_rows(keys)
        logits = first_logits if (d == 0 and first_logits is not None) else \
            level_forward(d, a, b, node_tok)
        k = int(max(len(tree.children[i]) for i in range(a, b)))
        kids, q = children(rd, sub, logits, sp, k)  # [B, b-a, k]
        if q is not None:
            q_all = q_all.at[:, a:b].set(q)
        src_node = jnp.asarray(par[a2:b2] - a, jnp.int32)
        src_rank = jnp.asarray(rank[a2:b2], jnp.int32)
        node_tok = node_tok.at[:, a2:b2].set(kids[:, src_node, src_rank])
    return node_tok, q_all


def _empty_q(rd, B):
    return None if rd.greedy else jnp.zeros((B, rd.tree.num_nodes, rd.config.vocab_size),
                                            jnp.float32)


# ----------------------------------------------------------------------------- self
@dataclasses.dataclass(frozen=True)
class SelfDrafter:
    """The target over the sink + window slots of its own cache (``window=None``: the whole
    cache, i.e. the target itself: every draft is accepted; for tests), and with ``retrieve``
    also over that many slots in whole blocks of ``retrieve_block`` chosen by the latest
    verification's attention (`jaxspec.retrieval`)."""

    sink: int = 16
    window: int | None = 1008
    retrieve: int = 0
    retrieve_block: int = RETRIEVE_BLOCK

    kind = "self"
    observes_plain_steps = False  # its draft reads the target's cache: a plain step is no news

    @property
    def span(self) -> int | None:
        """Context keys a draft step reads per row (None: all)."""
        return None if self.window is None else self.sink + self.window + self.retrieve

    @property
    def score_block(self) -> int | None:
        """Block size of the scores a verification returns for the selection (None: none)."""
        return self.retrieve_block if self.retrieving else None

    @property
    def retrieving(self) -> bool:
        return bool(self.retrieve) and self.window is not None

    def init_state(self, batch: int, config: ModelConfig) -> RetrievalState | None:
        """The state of ``batch`` rows before any verification (nothing selected)."""
        if not self.retrieving:
            return None
        R = -(-int(self.retrieve) // self.retrieve_block)
        return RetrievalState(blocks=jnp.full((batch, config.num_layers, config.num_kv_heads, R),
                                              -1, jnp.int32))

    def _sparse(self):
        return (self.sink, self.window) if self.window is not None else (None, None)

    def _blocks(self, state):
        """The blocks this round's drafts read (once per round, not per draft step): the
        selection, or for a row with nothing selected yet the blocks before its window."""
        if not self.retrieving:
            return None
        return with_recent(state.draft.blocks, state.cache.lengths, sink=self.sink,
                           window=self.window, block=self.retrieve_block)

    def _plan(self, rd, state, cache, lengths, blocks, **kw):
        if blocks is not None:
            kw.update(retrieved=blocks, retrieve_block=self.retrieve_block)
        sink, window = self._sparse()
        return plan_on(cache, lengths, impl=draft_impl(rd), sink=sink, window=window,
                       active=rd.active(state), **kw)

    def chain(self, rd, params, dparams, sp, state, keys):
        """gamma draft steps -> (target cache with the drafts' K/V, drafts [B, g], q, None)."""
        cache = state.cache
        L = cache.lengths
        pos0 = positions_of(cache)
        blocks = self._blocks(state)

        def step(carry, i):
            k, v, tok, keys = carry
            keys, sub = sampling.split_rows(keys)
            plan = self._plan(rd, state, cache, L + i, blocks)
            c = cache.replace(k=k, v=v)
            logits, c = forward(rd.config, params, tok[:, None], (pos0 + i)[:, None], c, plan)
            d, q = propose(rd, sub, logits[:, 0], sp)
            return (c.k, c.v, d, keys), (d, q)

        (k, v, _, _), (drafts, qs) = jax.lax.scan(
            step, (cache.k, cache.v, state.last, keys), jnp.arange(rd.gamma, dtype=jnp.int32))
        q = None if qs is None else jnp.swapaxes(qs, 0, 1)
        return cache.replace(k=k, v=v), drafts.T, q, None

    def tree(self, rd, params, dparams, sp, state, keys, *, level_only: bool = True):
        """One draft forward per tree level -> (target cache, node tokens [B, N], q, None).
        ``level_only=False``: each level's forward over all nodes ``[0, b)`` so far, recomputing
        the earlier levels (the same result up to rounding: a reference for tests)."""
        cache = state.cache
        L, pos0 = cache.lengths, positions_of(cache)
        B = L.shape[0]
        anc = jnp.asarray(rd.tree.ancestor_mask)
        depths = jnp.asarray(rd.tree.depths, jnp.int32)
        holder = {"cache": cache}
        blocks = self._blocks(state)

        def level_forward(d, a, b, node_tok):
            lo = a if level_only else 0
            plan = self._plan(rd, state, cache, L, blocks, mask=anc[lo:b, :b])
            idx = jnp.broadcast_to(jnp.arange(a - lo, b - lo, dtype=jnp.int32), (B, b - a))
            logits, holder["cache"] = forward(rd.config, params, node_tok[:, lo:b],
                                              pos0[:, None] + depths[None, lo:b],
                                              holder["cache"], plan, logits_at=idx)
            return logits

        node_tok = jnp.zeros((B, rd.tree.num_nodes), jnp.int32).at[:, 0].set(state.last)
        node_tok, q_all = _level_loop(rd, keys, sp, node_tok, _empty_q(rd, B), None,
                                      level_forward)
        return holder["cache"], node_tok, q_all, None

    def after_round(self, rd, dparams, state, new_state, ctx, path, n_acc, acc_nodes):
        """Retrieving: the blocks the verification's scores (``ctx["scores"]``) select for the
        next round's drafts."""
        if not self.retrieving:
            return state.draft
        blocks = select_blocks(ctx["scores"], state.cache.lengths, new_state.cache.lengths,
                               sink=self.sink, window=self.window, block=self.retrieve_block,
                               count=state.draft.blocks.shape[-1])
        return state.draft.replace(blocks=blocks)

    def after_plain(self, rd, dparams, state, new_state):
        return state.draft


# ----------------------------------------------------------------------------- draft model
@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """A separate draft model with a full cache (``ring=False``) or a ring cache of
    ``sink + window`` slots plus scratch (``ring=True``)."""

    config: ModelConfig  # the draft model's (for a ring: without a sliding window)
    ring: bool = False
    sink: int = 16
    window: int | None = None

    kind = "model"
    observes_plain_steps = True  # its own cache catches up with each plain step's token
    score_block = None  # its verification needs no block scores

    def init_state(self, batch: int, config: ModelConfig) -> None:
        """No state before the draft cache is prefilled (`jaxspec.session.Decoder.draft_state`)."""
        return None

    @property
    def span(self) -> int | None:
        return self.sink + self.window if self.ring else None

    def ring_slots(self, pos):
        """Ring slot of original position ``pos``."""
        s, w = self.sink, self.window
        return jnp.where(pos < s, pos, s + (pos - s) % w)

    def catch_up(self, rd, dparams, state):
        """The round's first draft forward: two tokens, ``[prev, last]`` when the draft has not
        seen ``prev`` yet, else ``[last, pad]``. Returns the draft logits at ``last`` [B, 1, V],
        the draft cache, the first position processed (``start``), the slot it went to (``base``:
        ``start`` for a full cache, the ring fill for a ring) and ``pending`` (1 or 2)."""
        ds = state.draft
        dc = ds.cache
        L = positions_of(state.cache)  # position of `last`
        pending = L - dc.lengths + 1  # positions < dc.lengths are in the draft cache
        start = L + 1 - pending
        base = jnp.minimum(start, self.sink + self.window) if self.ring else start
        two = jnp.where((pending == 2)[:, None], jnp.stack([ds.prev, state.last], 1),
                        jnp.stack([state.last, state.last], 1))
        pos0 = start[:, None] + jnp.arange(2, dtype=jnp.int32)[None]
        logits, dc = forward(self.config, dparams, two, pos0, dc,
                             AttentionPlan(lengths=base, impl=rd.impl, active=rd.active(state)),
                             logits_at=(pending - 1)[:, None])
        return logits, dc, start, base, pending

    def chain(self, rd, params, dparams, sp, state, keys):
        """gamma steps of the draft model -> (target cache, drafts [B, g], q, ctx)."""
        L = positions_of(state.cache)
        logits, dc, start, base, pending = self.catch_up(rd, dparams, state)
        keys, sub = sampling.split_rows(keys)
        d1, q1 = propose(rd, sub, logits[:, 0], sp)

        def step(carry, j):
            k, v, tok, keys = carry
            keys, sub = sampling.split_rows(keys)
            off = L + j - start  # slot offset of position L + j within this round's tokens
            plan = AttentionPlan(lengths=base + off, impl=rd.impl, active=rd.active(state))
            c = dc.replace(k=k, v=v)
            lg, c = forward(self.config, dparams, tok[:, None], (L + j)[:, None], c, plan)
            d, q = propose(rd, sub, lg[:, 0], sp)
            return (c.k, c.v, d, keys), (d, q)

        (k, v, _, _), (ds_, qs) = jax.lax.scan(
            step, (dc.k, dc.v, d1, keys), jnp.arange(1, rd.gamma, dtype=jnp.int32))
        drafts = jnp.concatenate([d1[:, None], ds_.T], axis=1)
        q_all = None if rd.greedy else jnp.concatenate([q1[:, None], jnp.swapaxes(qs, 0, 1)], 1)
        ctx = {"dc": dc.replace(k=k, v=v), "start": start, "base": base}
        return state.cache, drafts, q_all, ctx

    def tree(self, rd, params, dparams, sp, state, keys, *, level_only: bool = True):
        """One draft forward per level (level 0's logits come from the catch-up forward);
        ``level_only`` as `SelfDrafter.tree`."""
        L = positions_of(state.cache)  # the draft's cache holds whole prompts: positions
        B = L.shape[0]
        root_logits, dc, start, base, pending = self.catch_up(rd, dparams, state)
        root_slot = base + pending - 1
        anc = jnp.asarray(rd.tree.ancestor_mask)
        depths = jnp.asarray(rd.tree.depths, jnp.int32)
        holder = {"cache": dc}

        def level_forward(d, a, b, node_tok):
            lo = a if level_only else 0
            plan = AttentionPlan(lengths=root_slot, mask=anc[lo:b, :b], impl=rd.impl,
                                 active=rd.active(state))
            idx = jnp.broadcast_to(jnp.arange(a - lo, b - lo, dtype=jnp.int32), (B, b - a))
            logits, holder["cache"] = forward(self.config, dparams, node_tok[:, lo:b],
                                              L[:, None] + depths[None, lo:b], holder["cache"],
                                              plan, logits_at=idx)
            return logits

        node_tok = jnp.zeros((B, rd.tree.num_nodes), jnp.int32).at[:, 0].set(state.last)
        node_tok, q_all = _level_loop(rd, keys, sp, node_tok, _empty_q(rd, B), root_logits,
                                      level_forward)
        ctx = {"dc": holder["cache"], "start": start, "base": base, "root_slot": root_slot}
        return state.cache, node_tok, q_all, ctx

    def commit(self, dc: KVCache, start, base, have, n_kv_max: int) -> KVCache:
        """Marks positions ``< have`` as held by the draft cache. This round processed positions
        ``start, start+1, ...`` (at most ``n_kv_max``); in a ring their entries (scratch slots
        ``base + i`` for position ``start + i``) are copied to their ring slots."""
        if self.ring:
            i = jnp.arange(n_kv_max, dtype=jnp.int32)[None]
            pos = start[:, None] + i
            src = base[:, None] + i
            dst = jnp.where(pos < have[:, None], self.ring_slots(pos), dc.max_len)  # else dropped
            b = jnp.arange(dc.batch, dtype=jnp.int32)[:, None]
            k_src = dc.k[:, b, :, src]  # [B, R, L, K, D] (advanced indices first)
            v_src = dc.v[:, b, :, src]
            # The gathered entries must exist before the scatter: fused into it, the gather
            # reads the buffer the scatter updates in place, and XLA then copies the whole draft
            # cache (twice, k and v) every round.
            k_src, v_src = jax.lax.optimization_barrier((k_src, v_src))
            k = set_bits(dc.k, (slice(None), b, slice(None), dst), k_src)
            v = set_bits(dc.v, (slice(None), b, slice(None), dst), v_src)
            dc = dc.replace(k=k, v=v)
        return dc.replace(lengths=have)

    def after_round(self, rd, dparams, state, new_state, ctx, path, n_acc, acc_nodes):
        """The draft state after a speculative round that accepted ``n_acc`` tokens of ``path``
        (the accepted drafts, [B, depth]); trees first compact the accepted path's K/V."""
        dc = ctx["dc"]
        depth = path.shape[1]
        if acc_nodes is not None:  # the draft holds K/V for the root and every inner node
            dk, dv = compact_path((dc.k, dc.v), jnp.where(acc_nodes >= 0, acc_nodes, -1),
                                  ctx["root_slot"], slot_axis=3, batch_axis=1)
            dc = dc.replace(k=dk, v=dv)
        # the draft computed K/V for positions start .. L + depth - 1 (not the last draft)
        have = jnp.minimum(positions_of(new_state.cache), positions_of(state.cache) + depth)
        dc = self.commit(dc, ctx["start"], ctx["base"], have, n_kv_max=depth + 1)
        return _next_draft_state(dc, path, n_acc, state)

    def after_plain(self, rd, dparams, state, new_state):
        """After a plain step: the draft reads the token it has not seen yet, so it never lags
        by more than one position."""
        _, dc, start, base, _ = self.catch_up(rd, dparams, state)
        have = jnp.minimum(positions_of(new_state.cache), positions_of(state.cache) + 1)
        dc = self.commit(dc, start, base, have, n_kv_max=2)
        # nothing accepted: the token before the new `last` is the old one
        return _next_draft_state(dc, new_state.last[:, None], jnp.zeros_like(new_state.last),
                                 state)


def _next_draft_state(dc, accepted_BN, n_acc, state) -> DraftState:
    """The token at position new_L - 1 (``prev`` of the next round): the last accepted draft, or
    the old ``last``; finished rows keep theirs."""
    prev = jnp.where(n_acc > 0, jnp.take_along_axis(
        accepted_BN, jnp.maximum(n_acc - 1, 0)[:, None], 1)[:, 0], state.last)
    return DraftState(cache=dc, prev=jnp.where(~state.done, prev, state.draft.prev))


# ----------------------------------------------------------------------------- ring prefill
def ring_chunk(window: int) -> int:
    """Tokens per chunk of a ring cache's streaming prefill (its scratch area holds one)."""
    return max(8, min(256, window // 2))


def ring_cache_len(sink: int, window: int, scratch: int) -> int:
    """Slots of a ring cache: a multiple of SLOT_ALIGN like every cache (the attention kernel's
    key blocks divide it)."""
    return round_up(sink + window + max(scratch, ring_chunk(window)), SLOT_ALIGN)


@functools.partial(jax.jit, static_argnames=("drafter", "impl"), donate_argnames=("cache",))
def _ring_prefill_chunk(params, cache: KVCache, tokens_BC, start, n_valid, *, drafter, impl):
    """One chunk of streaming prefill into a ring cache: the chunk attends to the ring (all valid
    slots) and causally to itself in the scratch area, then its valid tokens move to their ring
    slots."""
    B, C = tokens_BC.shape
    base = jnp.minimum(start, drafter.sink + drafter.window)
    positions = start[:, None] + jnp.arange(C, dtype=jnp.int32)[None]
    plan = AttentionPlan(lengths=base, impl=impl)
    _, cache = forward(drafter.config, params, tokens_BC, positions, cache, plan,
                       logits_at=jnp.zeros((B, 1), jnp.int32))
    return drafter.commit(cache, start, base, start + n_valid, n_kv_max=C)


def ring_prefill(drafter: ModelDrafter, params, cache: KVCache, prompts, *, impl="auto") -> KVCache:
    """Streams ``prompts`` (all but each prompt's last token) through a ring cache chunk by
    chunk; the cache keeps the sink and the last ``window`` positions of each row."""
    B = len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    C = ring_chunk(drafter.window)
    n = int(lens.max()) if B else 0
    total = round_up(max(n, 1), C)
    buf = np.zeros((B, total), np.int32)
    for i, p in enumerate(prompts):
        buf[i, :len(p)] = p
    for start in range(0, n, C):
        n_valid = np.clip(lens - start, 0, C).astype(np.int32)
        cache = _ring_prefill_chunk(params, cache, jnp.asarray(buf[:, start:start + C]),
                                    jnp.full((B,), start, jnp.int32), jnp.asarray(n_valid),
                                    drafter=drafter, impl=impl)
    return cache.replace(lengths=jnp.asarray(lens))
