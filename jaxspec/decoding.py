"""The decode state and the one round every decoding loop runs.

A `Round` is a static (hashable) description: the target model, how to stop, and optionally a
drafter and a token tree. ``round(params, dparams, sp, state)`` advances every running row of
``state`` by one round:

1. draft: the drafter proposes the tree's tokens (a chain of ``gamma`` drafts is the linear tree)
   and, when sampling, the draft distributions ``q`` they were drawn from;
2. verify: ONE target forward over ``[last, drafts...]`` at per-row positions (the ancestor mask
   for a tree), writing their K/V into the target cache -> target logits ``p``;
3. accept: greedy (longest prefix equal to the target's argmax), speculative sampling, or the tree
   walk (`jaxspec.verify`) -> ``n`` accepted drafts and one more token per row;
4. commit: ``n + 1`` tokens per row (ragged), cut at a stop token or the budget; a tree first
   compacts the accepted path's K/V into consecutive slots; the cache length advances by the
   number committed, so rejected drafts' K/V are simply overwritten next round; the drafter
   updates what it keeps (a draft model's cache);
5. stop: a row is done at a stop token or its budget; finished rows stop changing and attend to
   no context (`AttentionPlan.active`), so a step gets cheaper as rows finish.

Without a drafter, or with ``speculate=False``, a round is one plain decode step (a separate draft
model is still fed the new token so it never falls behind). Both kinds commit tokens with exactly
the target's distribution (greedy: its argmax), so a loop may mix them freely: `jaxspec.session`
chooses between them from the cost model between calls of `run_rounds`.

Every row draws with its own PRNG key (``DecodeState.rng``): a round splits it, or, in a
batch-invariant round (an invariant ``impl``), draws with it folded with the position of the
row's last token, so that a token's draws depend on the row's key and position only.

`run_rounds` runs at most ``max_rounds`` rounds inside one jitted `lax.while_loop` (no host work
per round) and returns; the caller reads the state between calls.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec import compile_cache, sampling
from jaxspec.attention import AttentionPlan
from jaxspec.cache import KVCache, positions_of
from jaxspec.config import ModelConfig
from jaxspec.drafter import RetrievalState, draft_impl, plan_on
from jaxspec.invariant import is_invariant
from jaxspec.model import forward, forward_mixed
from jaxspec.paged import PagedKVCache, compact_pages
from jaxspec.tree import TokenTree, compact_path
from jaxspec.verify import verify_chain, verify_greedy, verify_tree, verify_tree_greedy


@struct.dataclass
class RoundStats:
    """Counters a loop keeps per row (``[B]`` int32): speculative rounds taken part in, drafts
    proposed and accepted, tokens committed in speculative rounds; and plain steps (scalar)."""

    spec_rounds: jax.Array
    proposed: jax.Array
    accepted: jax.Array
    committed: jax.Array
    plain_steps: jax.Array

    @classmethod
    def zeros(cls, B: int) -> "RoundStats":
        def z():  # distinct buffers: the loops donate the state
            return jnp.zeros((B,), jnp.int32)
        return cls(spec_rounds=z(), proposed=z(), accepted=z(), committed=z(),
                   plain_steps=jnp.zeros((), jnp.int32))


@struct.dataclass
class DecodeState:
    cache: KVCache
    last: jax.Array  # [B] last committed token, its K/V not yet in the cache
    out: jax.Array  # [B, W] committed tokens
    from_draft: jax.Array  # [B, W] bool: the token at out[b, i] was an accepted draft
    n_out: jax.Array  # [B]
    budget: jax.Array  # [B] tokens this row may still produce in total (out[:, :budget])
    done: jax.Array  # [B]
    rng: jax.Array  # [B, 2] one PRNG key per row
    steps: jax.Array  # target forward passes
    draft: object = None  # the drafter's state (`jaxspec.drafter.DraftState`) or None
    stats: RoundStats = None


def commit_tokens(state: DecodeState, new_BN, n_new_B, stop_ids, n_draft_B=None) -> DecodeState:
    """Appends up to ``n_new[b]`` tokens of ``new[b]`` to row b's output, stopping at a stop token
    or the budget; the cache length advances by the number of tokens committed (each committed
    token but the last already has its K/V in the cache; the last becomes ``state.last``). The
    first ``n_draft[b]`` of them are marked as accepted drafts."""
    B, N = new_BN.shape
    idx = jnp.arange(N, dtype=jnp.int32)[None, :]
    valid = idx < n_new_B[:, None]
    is_stop = jnp.isin(new_BN, jnp.asarray(stop_ids, jnp.int32)) if stop_ids else \
        jnp.zeros_like(valid)
    room = state.budget - state.n_out  # [B]
    stop_here = valid & is_stop
    first_stop = jnp.where(jnp.any(stop_here, axis=1), jnp.argmax(stop_here, axis=1), N)
    n_keep = jnp.minimum(jnp.minimum(n_new_B, first_stop + 1), room)
    n_keep = jnp.where(state.done, 0, jnp.maximum(n_keep, 0))
    keep = idx < n_keep[:, None]
    b_idx = jnp.arange(B, dtype=jnp.int32)[:, None]
    pos = jnp.where(keep, state.n_out[:, None] + idx, state.out.shape[1])
    out = state.out.at[b_idx, pos].set(new_BN, mode="drop")
    flags = jnp.zeros_like(keep) if n_draft_B is None else idx < n_draft_B[:, None]
    from_draft = state.from_draft.at[b_idx, pos].set(flags, mode="drop")
    n_out = state.n_out + n_keep
    last_idx = jnp.maximum(n_keep - 1, 0)
    last = jnp.where(n_keep > 0, jnp.take_along_axis(new_BN, last_idx[:, None], 1)[:, 0],
                     state.last)
    hit_stop = first_stop < n_keep
    done = state.done | hit_stop | (n_out >= state.budget)
    lengths = state.cache.lengths + n_keep
    return state.replace(cache=state.cache.replace(lengths=lengths), out=out,
                         from_draft=from_draft, n_out=n_out, last=last, done=done)


@dataclasses.dataclass(frozen=True)
class Round:
    """One round of decoding (a hashable jit static argument; see the module docstring)."""

    config: ModelConfig
    stop_ids: tuple[int, ...]
    impl: str = "auto"
    drafter: object = None  # `jaxspec.drafter.SelfDrafter` / `ModelDrafter`, or None
    tree: TokenTree | None = None  # the round's token tree (a chain: `TokenTree.chain(gamma)`)
    speculate: bool = True  # False: one plain decode step (the drafter only observes it)
    greedy: bool = True  # every row has temperature 0: verify by argmax, no probabilities kept
    tree_mode: str = "without_replacement"  # how sampled children are drawn (`verify_tree`)

    @property
    def speculative(self) -> bool:
        return self.drafter is not None and self.speculate

    @property
    def is_chain(self) -> bool:
        return self.tree is not None and self.tree.num_nodes == self.tree.max_depth + 1

    @property
    def gamma(self) -> int:
        """Drafts per round of a chain (the tree's depth)."""
        return 0 if self.tree is None else self.tree.max_depth

    def plain(self) -> "Round":
        """The same loop's plain step: with a drafter that observes plain steps (a draft model,
        whose cache follows), this round without speculating; otherwise the plain step of no
        speculation, so plain decoding, adaptive plain stretches and ``gamma="auto"``'s plain
        choice run (and compile) one program."""
        if self.drafter is not None and self.drafter.observes_plain_steps:
            return dataclasses.replace(self, speculate=False)
        return Round(config=self.config, stop_ids=self.stop_ids, impl=self.impl,
                     greedy=self.greedy)

    @staticmethod
    def active(state: DecodeState):
        """Rows whose attention output is used: finished rows read no context."""
        return ~state.done

    @property
    def invariant(self) -> bool:
        """Batch-invariant decoding (an invariant ``impl``): sampling sums in fixed orders
        (`jaxspec.sampling.SamplingParams.invariant`) and draws keyed by position (`_keys`)."""
        return is_invariant(self.impl)

    def _keys(self, state: DecodeState, num: int):
        """``(the rows' keys after this round, num [B, 2] keys for its draws)``. By default each
        round splits every row's key. Batch-invariant: a row's key stays as it is and the round
        draws with ``fold_in(key, position of its last token)`` split ``num`` ways, so a token's
        draws depend on the row's key and position only (not on how many rounds ran before, e.g.
        a sequence resumed after preemption)."""
        if not self.invariant:
            keys, *subs = sampling.split_rows(state.rng, num + 1)
            return keys, subs
        k = sampling.position_keys(state.rng, positions_of(state.cache))
        return state.rng, list(sampling.split_rows(k, num)) if num > 1 else [k]

    def __call__(self, params, dparams, sp, state: DecodeState, piece=None) -> DecodeState:
        """One round on ``state``; ``piece``: ``(tokens[1, C], row, start, end)``, a piece of a
        prompt that the round's target forward (a plain step's, or a speculative round's
        verification) also prefills into row ``row`` of a block pool (`run_mixed_chunk`)."""
        if self.invariant and not sp.invariant:
            sp = sp.replace(invariant=True)
        if not self.speculative:
            return self._plain(params, dparams, sp, state, piece)
        return self._speculative(params, dparams, sp, state, piece)

    # ------------------------------------------------------------------ plain step
    def _plain(self, params, dparams, sp, state, piece=None):
        cache = state.cache
        keys, (sub,) = self._keys(state, 1)
        plan = plan_on(cache, cache.lengths, impl=self.impl, active=self.active(state))
        tokens, positions = state.last[:, None], positions_of(cache)[:, None]
        if piece is None:
            logits, new_cache = forward(self.config, params, tokens, positions, cache, plan)
        else:
            logits, new_cache = self._with_piece(params, cache, tokens, positions, plan, piece)
        nxt = sampling.sample_rows(sub, logits[:, 0], sp).astype(jnp.int32)
        st = commit_tokens(state.replace(cache=new_cache, rng=keys, steps=state.steps + 1),
                           nxt[:, None], jnp.where(self.active(state), 1, 0), self.stop_ids)
        if self.drafter is not None:
            st = st.replace(draft=self.drafter.after_plain(self, dparams, state, st))
        stats = state.stats
        if stats is not None:
            st = st.replace(stats=stats.replace(plain_steps=stats.plain_steps + 1))
        return st

    def _with_piece(self, params, cache, tokens, positions, plan, piece):
        """The target forward of ``tokens`` by ``plan`` with a prompt piece in it
        (`forward_mixed`): ``(logits, cache)``, and the block scores when the plan asks for them.
        The piece's tokens go through row ``row``'s block table from slot ``start`` on, as
        `jaxspec.prefill.prefill_paged_row` writes them (padding past ``end`` lands in the row's
        own blocks or nowhere), and the row's length becomes ``end``."""
        tok, row, start, end = piece
        C = tok.shape[1]
        table = jax.lax.dynamic_slice_in_dim(cache.block_table, row, 1, axis=0)
        pplan = AttentionPlan(lengths=start[None], impl=self.impl, block_table=table,
                              prompt=True)  # (pieces carry prompt tokens only)
        ppos = start + jnp.arange(C, dtype=jnp.int32)[None]
        segments = [(tokens, positions, plan, None), (tok, ppos, pplan, False)]
        (logits, _), cache, *sc = forward_mixed(self.config, params, segments, cache)
        cache = cache.replace(lengths=cache.lengths.at[row].set(end))
        return (logits, cache, *(s[0] for s in sc))

    # ------------------------------------------------------------------ speculative round
    def _speculative(self, params, dparams, sp, state, piece=None):
        tree = self.tree
        chain = self.is_chain
        keys, (r_draft, r_verify) = self._keys(state, 2)
        L = state.cache.lengths
        pos0 = positions_of(state.cache)
        propose = self.drafter.chain if chain else self.drafter.tree
        cache, node_tok, q, ctx = propose(self, params, dparams, sp, state, r_draft)
        if chain:  # node_tok holds the drafts only; the root is `last`
            node_tok = jnp.concatenate([state.last[:, None], node_tok], axis=1)
        D = tree.max_depth
        depths = jnp.asarray(tree.depths, jnp.int32)
        mask = None if chain else jnp.asarray(tree.ancestor_mask)
        # a retrieving self-draft's selection comes from this verification's block scores
        plan = plan_on(state.cache, L, mask=mask, impl=self.impl, active=self.active(state),
                       score_block=self.drafter.score_block, score_impl=draft_impl(self))
        if piece is None:
            logits, cache, *scores = forward(self.config, params, node_tok,
                                             pos0[:, None] + depths[None], cache, plan)
        else:
            logits, cache, *scores = self._with_piece(params, cache, node_tok,
                                                      pos0[:, None] + depths[None], plan, piece)
        if scores:
            ctx = {**(ctx or {}), "scores": scores[0]}
        acc_nodes = None
        if chain:
            drafts = node_tok[:, 1:]
            if self.greedy:
                n_acc, nxt = verify_greedy(drafts, logits)
            else:
                p = sampling.probs_from_logits(logits, sp)
                inv = sp.invariant
                n_acc, nxt = sampling.rowwise(
                    lambda k, d, qq, pp: verify_chain(k, d, qq, pp, invariant=inv),
                    r_verify, drafts, q, p) if q is not None else sampling.rowwise(
                        lambda k, d, pp: verify_chain(k, d, None, pp, invariant=inv),
                        r_verify, drafts, p)
            path = drafts
        else:
            if self.greedy:
                n_acc, acc_nodes, nxt = verify_tree_greedy(tree, node_tok, logits)
            else:
                p = sampling.probs_from_logits(logits, sp)
                n_acc, acc_nodes, nxt = sampling.rowwise(
                    lambda k, t, qq, pp: verify_tree(k, tree, t, qq, pp, mode=self.tree_mode,
                                                     invariant=sp.invariant),
                    r_verify, node_tok, q, p)
            # an idle row (finished, or a prompt filling through its table) moves nothing: its
            # verification saw no context, and its slots hold a prompt or another's blocks
            acc_nodes = jnp.where(self.active(state)[:, None], acc_nodes.astype(jnp.int32), -1)
            # the accepted path's K/V to consecutive slots L + 0..n (the root is already at L)
            table = getattr(cache, "block_table", None)
            if table is None:
                k, v = compact_path((cache.k, cache.v), acc_nodes, L, slot_axis=3, batch_axis=1)
            else:
                k = compact_pages(cache.k, table, acc_nodes, L)
                v = compact_pages(cache.v, table, acc_nodes, L)
            cache = cache.replace(k=k, v=v)
            path = jnp.take_along_axis(node_tok, jnp.maximum(acc_nodes, 0), axis=1)  # [B, D]
        n_acc = n_acc.astype(jnp.int32)
        idx = jnp.arange(D + 1, dtype=jnp.int32)[None]
        new = jnp.where(idx < n_acc[:, None], jnp.pad(path, ((0, 0), (0, 1))),
                        nxt[:, None].astype(jnp.int32))
        active = self.active(state)
        st = commit_tokens(state.replace(cache=cache, rng=keys, steps=state.steps + 1), new,
                           jnp.where(active, n_acc + 1, 0), self.stop_ids, n_draft_B=n_acc)
        st = st.replace(draft=self.drafter.after_round(self, dparams, state, st, ctx, path,
                                                        n_acc, acc_nodes))
        stats = state.stats
        if stats is not None:
            a = active.astype(jnp.int32)
            st = st.replace(stats=stats.replace(
                spec_rounds=stats.spec_rounds + a,
                proposed=stats.proposed + a * D,
                accepted=stats.accepted + a * n_acc,
                committed=stats.committed + (st.n_out - state.n_out)))
        return st


def _rounds_loop(params, dparams, sp, state: DecodeState, max_rounds, rd: Round,
                 end_after=None) -> DecodeState:
    """The `lax.while_loop` of at most ``max_rounds`` rounds (stops when every row is done).
    With ``end_after`` (a traced int) it also stops after round i (counted from 1) when a row
    finished in it and i <= ``end_after``: a serving chunk then ends where a stream ends, so
    that stream's last tokens reach its client without waiting for the chunk's other rounds."""
    def cond(c):
        i, st, ended = c
        return (i < max_rounds) & jnp.any(~st.done) & ~ended

    def body(c):
        i, st, _ = c
        nxt = rd(params, dparams, sp, st)
        ended = jnp.zeros((), bool) if end_after is None else \
            jnp.any(nxt.done & ~st.done) & (i + 1 <= end_after)
        return i + 1, nxt, ended

    _, st, _ = jax.lax.while_loop(cond, body,
                                  (jnp.zeros((), jnp.int32), state, jnp.zeros((), bool)))
    return st


@functools.partial(jax.jit, static_argnames=("rd",), donate_argnames=("state",))
def run_rounds(params, dparams, sp, state: DecodeState, max_rounds, *, rd: Round) -> DecodeState:
    """At most ``max_rounds`` rounds of ``rd`` (fewer when every row is done), in one jitted
    `lax.while_loop`. ``max_rounds`` is a traced int: any count runs the same program."""
    return _rounds_loop(params, dparams, sp, state, max_rounds, rd)


@struct.dataclass
class ChunkOutputs:
    """What a serving chunk hands the host (copies: the state itself goes to the next chunk)."""

    out: jax.Array  # [B, W] tokens committed in the chunk
    from_draft: jax.Array  # [B, W]
    n_out: jax.Array  # [B]
    done: jax.Array  # [B]
    lengths: jax.Array  # [B] cache lengths after the chunk
    steps: jax.Array  # rounds run
    stats: RoundStats


def _chunk_begins(state: DecodeState) -> DecodeState:
    """A serving chunk's state at its start: the output buffer empty, each row's budget shrunk
    by what it committed before, the round counts and stats zero."""
    return state.replace(budget=state.budget - state.n_out, n_out=jnp.zeros_like(state.n_out),
                         steps=jnp.zeros_like(state.steps),
                         stats=RoundStats.zeros(state.last.shape[0]))


def _chunk_outputs(st: DecodeState) -> ChunkOutputs:
    return ChunkOutputs(out=st.out, from_draft=st.from_draft, n_out=st.n_out, done=st.done,
                        lengths=st.cache.lengths, steps=st.steps, stats=st.stats)


@functools.partial(jax.jit, static_argnames=("rd",), donate_argnames=("state",))
def run_chunk(params, dparams, sp, state: DecodeState, max_rounds, end_after=0, *, rd: Round):
    """A serving chunk: the output buffer starts empty (each row's budget shrinks by what it
    committed before), then at most ``max_rounds`` rounds run (`run_rounds`), fewer when a row
    finishes in round ``end_after`` or before (`_rounds_loop`; 0: never). Returns the state and
    the chunk's `ChunkOutputs`."""
    state = _chunk_begins(state)
    st = _rounds_loop(params, dparams, sp, state, max_rounds, rd, jnp.asarray(end_after, jnp.int32))
    return st, _chunk_outputs(st)


@struct.dataclass
class Pieces:
    """Prompt pieces for `run_mixed_chunk` (one per round of its first ones): piece i
    (``tokens[i]``, padded to C) goes into row ``rows[i]`` from slot ``starts[i]`` on, and that
    row's length becomes ``ends[i]``."""

    tokens: jax.Array  # [P, C] int32
    rows: jax.Array  # [P] int32
    starts: jax.Array  # [P] int32
    ends: jax.Array  # [P] int32


@functools.partial(jax.jit, static_argnames=("rd",), donate_argnames=("state",))
def run_mixed_chunk(params, dparams, sp, state: DecodeState, num, pieces: Pieces, max_rounds=0,
                    end_after=0, *, rd: Round):
    """A serving chunk of ``num`` rounds of ``rd`` (``num <= P``), round i also prefilling
    prompt piece i in its target forward (`jaxspec.model.forward_mixed`: the weights are read
    once for the running rows' step or verification and the piece), so prompts fill while the
    running rows keep decoding at about their own pace; then plain rounds of ``rd`` up to
    ``max_rounds`` in all, as `run_chunk`'s (they end early as its ``end_after`` says, counted
    from the chunk's first round; a row that finished during the pieces ends the chunk after
    them when ``num <= end_after``). A chunk of a few pieces thus still gives the running rows
    a chunk's worth of tokens for its host turn. Outputs as `run_chunk`'s."""
    state = _chunk_begins(state)

    def body(i, st):
        piece = (jax.lax.dynamic_slice_in_dim(pieces.tokens, i, 1, axis=0), pieces.rows[i],
                 pieces.starts[i], pieces.ends[i])
        return rd(params, dparams, sp, st, piece)

    st = jax.lax.fori_loop(0, num, body, state)
    end_after = jnp.asarray(end_after, jnp.int32)
    ended = jnp.any(st.done & ~state.done) & (num <= end_after)
    more = jnp.where(ended, 0, jnp.maximum(jnp.asarray(max_rounds, jnp.int32) - num, 0))
    st = _rounds_loop(params, dparams, sp, st, more, rd, end_after - num)
    return st, _chunk_outputs(st)


@functools.partial(jax.jit, donate_argnames=("state",))
def set_rows(state: DecodeState, rows, last, budget, keys, lengths) -> DecodeState:
    """Starts sequences in rows ``rows`` whose caches hold ``lengths`` prefilled tokens: last
    token, budget, PRNG key; a draft model's ``prev`` is the last token too (the draft saw the
    prompt). Rows past the batch are ignored (callers pad to one shape)."""
    c = state.cache
    st = state.replace(cache=c.replace(lengths=c.lengths.at[rows].set(lengths, mode="drop")),
                       last=state.last.at[rows].set(last, mode="drop"),
                       budget=state.budget.at[rows].set(budget, mode="drop"),
                       n_out=state.n_out.at[rows].set(0, mode="drop"),
                       done=state.done.at[rows].set(budget <= 0, mode="drop"),
                       rng=state.rng.at[rows].set(keys, mode="drop"))
    if st.draft is not None:
        st = st.replace(draft=st.draft.start_rows(rows, last))
    return st


@functools.partial(jax.jit, donate_argnames=("state",))
def stop_rows(state: DecodeState, rows) -> DecodeState:
    """Rows ``rows`` stop (their sequences ended on the host: cancelled, a stop string); rows past
    the batch are ignored."""
    return state.replace(done=state.done.at[rows].set(True, mode="drop"))


@functools.partial(jax.jit, donate_argnames=("state",))
def set_block_tables(state: DecodeState, rows, tables) -> DecodeState:
    """Rows ``rows`` of a paged cache get the block tables ``tables[n, MB]`` (rows past the batch
    are ignored)."""
    c = state.cache
    return state.replace(cache=c.replace(block_table=c.block_table.at[rows].set(tables,
                                                                               mode="drop")))


# ----------------------------------------------------------------------------- row subsets
def compactable(state: DecodeState) -> bool:
    """Whether `take_rows` / `put_rows` handle ``state``: a dense target cache or a block pool
    without a shared context, and a draft model's dense cache if any (no shared prefix)."""
    c = state.cache
    target = type(c) is KVCache or (type(c) is PagedKVCache and c.shared is None)
    d = state.draft
    return target and (d is None or isinstance(d, RetrievalState)
                       or type(d.cache) is KVCache)


def _rows_of(f, state: DecodeState, other: DecodeState | None = None):
    """``state`` with each per-row array ``x`` replaced by ``f(x, axis)`` (``axis``: its row
    axis), or by ``f(x, y, axis)`` with ``y`` the same array of ``other``."""
    def g(get):
        if other is None:
            return lambda axis: f(get(state), axis)
        return lambda axis: f(get(state), get(other), axis)

    def cache(path):
        c = path(state)
        if isinstance(c, PagedKVCache):  # the pool is every row's (left out: `_apart`)
            return c.replace(block_table=g(lambda s: path(s).block_table)(0),
                             lengths=g(lambda s: path(s).lengths)(0))
        return c.replace(k=g(lambda s: path(s).k)(1), v=g(lambda s: path(s).v)(1),
                         lengths=g(lambda s: path(s).lengths)(0))
    out = state.replace(
        cache=cache(lambda s: s.cache), last=g(lambda s: s.last)(0), out=g(lambda s: s.out)(0),
        from_draft=g(lambda s: s.from_draft)(0), n_out=g(lambda s: s.n_out)(0),
        budget=g(lambda s: s.budget)(0), done=g(lambda s: s.done)(0), rng=g(lambda s: s.rng)(0))
    if state.stats is not None:
        out = out.replace(stats=state.stats.replace(**{
            k: g(lambda s, k=k: getattr(s.stats, k))(0)
            for k in ("spec_rounds", "proposed", "accepted", "committed")}))
    if isinstance(state.draft, RetrievalState):
        out = out.replace(draft=state.draft.replace(blocks=g(lambda s: s.draft.blocks)(0)))
    elif state.draft is not None:
        out = out.replace(draft=state.draft.replace(cache=cache(lambda s: s.draft.cache),
                                                    prev=g(lambda s: s.draft.prev)(0)))
    return out


def _apart(state: DecodeState):
    """``(state without its block pool, the pool)``: the pool is not per row and never goes
    through `take_rows` / `put_rows`'s programs (it would be copied whole). ``(state, None)``
    for a dense cache."""
    c = state.cache
    if not isinstance(c, PagedKVCache):
        return state, None
    return state.replace(cache=c.replace(k=None, v=None)), (c.k, c.v)


def _with_pool(state: DecodeState, pool) -> DecodeState:
    if pool is None:
        return state
    return state.replace(cache=state.cache.replace(k=pool[0], v=pool[1]))


def take_rows(state: DecodeState, rows, programs: dict | None = None) -> DecodeState:
    """The rows ``rows`` of ``state`` (`compactable`) as a state of ``len(rows)`` rows (a copy:
    ``state`` is kept). A block pool is not copied: both states hold it, and a chunk that runs
    on the rows' state (donating it) leaves ``state`` a stale pool until `put_rows`.
    ``programs``: a dict the caller keeps the compiled moves in, keyed by shapes and dtypes
    alone (one device; `jaxspec.compile_cache.by_shapes`)."""
    bare, pool = _apart(state)
    return _with_pool(compile_cache.by_shapes(programs, _take_rows, (bare, rows))(bare, rows),
                      pool)


def put_rows(state: DecodeState, rows, sub: DecodeState, programs: dict | None = None
             ) -> DecodeState:
    """``state`` (donated) with its rows ``rows`` replaced by those of ``sub`` (`take_rows`'s
    inverse); ``sub``'s step count is the state's, and so is its block pool (the one its chunk
    wrote). ``programs``: as `take_rows`'s."""
    bare, _ = _apart(state)
    sub, pool = _apart(sub)
    args = (bare, rows, sub)
    return _with_pool(compile_cache.by_shapes(programs, _put_rows, args)(*args), pool)


@jax.jit
def _take_rows(state: DecodeState, rows) -> DecodeState:
    return _rows_of(lambda x, axis: jnp.take(x, rows, axis=axis), state)


@functools.partial(jax.jit, donate_argnames=("state",))
def _put_rows(state: DecodeState, rows, sub: DecodeState) -> DecodeState:
    def put(x, y, axis):
        return x.at[rows].set(y) if axis == 0 else x.at[:, rows].set(y)
    return _rows_of(put, state, sub).replace(steps=sub.steps)


@functools.partial(jax.jit, static_argnames=("batch",))
def spread_outputs(outs: ChunkOutputs, rows, *, batch: int) -> ChunkOutputs:
    """A chunk's outputs over ``rows`` of a ``batch``-row state, as if the whole state had run
    (rows it did not run: nothing committed, done)."""
    def spread(x, fill):
        return jnp.full((batch,) + x.shape[1:], fill, x.dtype).at[rows].set(x)
    s = outs.stats
    return ChunkOutputs(
        out=spread(outs.out, 0), from_draft=spread(outs.from_draft, False),
        n_out=spread(outs.n_out, 0), done=spread(outs.done, True),
        lengths=spread(outs.lengths, 0), steps=outs.steps,
        stats=s.replace(spec_rounds=spread(s.spec_rounds, 0), proposed=spread(s.proposed, 0),
                        accepted=spread(s.accepted, 0), committed=spread(s.committed, 0)))
