"""The one attention function the model calls, and the plan that says which keys each query sees.

A model step appends T_new new tokens per sequence at slots ``plan.lengths[b] + j`` (j < T_new) and
computes the LAST T of them (the forward's T input tokens): input token t is new token
``T_new - T + t``, its keys/values are written at slot ``plan.lengths[b] + T_new - T + t``, and the
first ``T_new - T`` new tokens' K/V must already be in the cache (written by an earlier forward, e.g.
the previous levels of a token tree). ``T_new`` is `AttentionPlan.new_tokens`: ``plan.num_new``,
else ``mask.shape[-1]``, else T (the usual case: every new token is computed). The context of
sequence b is slots ``[0, plan.lengths[b])``. Query t sees every context slot (or only the
StreamingLLM sink + window slots when ``plan.sink``/``plan.window`` are set) and new-token slot j iff
``mask[t, j]`` (``mask`` ``[T, T_new]`` or ``[B, T, T_new]``; causal when None:
``j <= t + T_new - T``). Positions (for RoPE) are passed to the model separately, so a token-tree node
at slot ``length + i`` may sit at position ``length + depth(i)``.

`attend` dispatches to the Pallas kernel (`pallas_kernels.decode_attention`) on GPU/TPU and to the
plain-`jnp` path here on CPU (or when asked). The `jnp` sparse path gathers only the sink and window
slots, so it reads ``sink + window + T_new`` keys per sequence no matter how long the context is.
Every path supports ``T_new > T``: the Triton kernel, the Mosaic TPU kernel (`pallas_kernels.tpu`),
the `jnp` paths here, and the shared-prefix paths (`jaxspec.prefix`), per shard on a mesh too.

Sliding-window attention (``plan.sliding_window = W``, Mistral-style; `jaxspec.model.forward` sets
it from the model's config): the token at position p sees the keys at positions ``p - W < j <= p``
(W keys, itself included). Context slot s holds position s and new token j sits at position
``lengths + depth(j)``, where the depth of query t is its number of visible new tokens minus one
(``T_new - T + t`` for the causal mask; a token-tree node's ancestors-and-itself row sum minus one).
So query t sees context slot s iff ``s > lengths + d_t - W``, and new token j iff ``mask[t, j]`` and
``d_t - d_j < W`` (only when ``T_new > W`` can that bite). Every query sees the context slots
``s >= lengths + D - W + 1`` (``D = T_new - 1`` bounds the depths), so the kernel path runs the
sparse kernel with ``window = W - 1 - D`` over those and attends in `jnp` to the band of at most
``D`` slots below them with the per-query bound, merging both by log-sum-exp (exact); when
``W - 1 - D < 1`` (``T_new >= W``: a long prefill chunk, a small window) everything runs in `jnp`
over the gathered ``W - 1 + T_new`` slots. The `jnp` path gathers those slots too (or masks the
dense pass when that reads fewer), so a step reads O(W + T_new) keys whatever the context length.
A sparse plan (``sink``/``window``: the StreamingLLM self-draft, a proposal only) keeps its own
view when ``sink + window < W - 1`` (the new tokens windowed) and becomes the exact sliding window
otherwise (which then reads no more). Shared prefixes do not combine with a sliding window
(`jaxspec.prefix` is not used for such models).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels import (decode_attention as decode_kernel, merge_attention_states,
                            paged_decode_attention, prefix_attention, prefix_attention_reference)
from pallas_kernels.decode_attention import resolve_num_new
from pallas_kernels.merge import merge_partials

from jaxspec import invariant
from jaxspec.cache import PrefixLevel, SharedPrefix
from jaxspec.mesh import (active_mesh, batch_axis, mask_spec, per_shard_attention,
                          per_shard_paged_attention)
from jaxspec.paged import gather_view, shift_tables
from jaxspec.retrieval import block_scores, layer_view, retrieved_attention

IMPLEMENTATIONS = ("auto", "xla", "pallas", "interpret", *invariant.IMPLS)


@struct.dataclass
class AttentionPlan:
    """Which keys each of the T queries (the last T of the T_new new tokens) sees (see module
    docstring)."""

    lengths: jax.Array  # [B] int32: context slots per sequence; new K/V go to lengths + j
    # [T, T_new] or [B, T, T_new] bool: query t (new token T_new - T + t) sees new token j;
    # None = causal
    mask: jax.Array | None = None
    sink: int | None = struct.field(pytree_node=False, default=None)
    window: int | None = struct.field(pytree_node=False, default=None)
    impl: str = struct.field(pytree_node=False, default="auto")
    # shared-prefix segments before the context (`jaxspec.cache.SharedPrefix`); None: none
    prefix: Any = None
    # [B] bool or None: rows whose attention output is used. An inactive row (a finished
    # sequence, an idle server slot) attends to no context, so the kernel reads none of its
    # cache; its K/V are still written at their slots and its output is garbage (finite).
    active: jax.Array | None = None
    # T_new, the new tokens (static): None = mask.shape[-1] with a mask, else the T computed
    num_new: int | None = struct.field(pytree_node=False, default=None)
    # sliding attention window W (static; module docstring): the token at position p sees the keys
    # at positions p - W < j <= p. None: every earlier key. The caller sets it from the model's
    # config (`jaxspec.config.ModelConfig.attention_window`); a ring-buffer draft cache, whose
    # slots are not positions, leaves it None.
    sliding_window: int | None = struct.field(pytree_node=False, default=None)
    # [B, MB] int32 or None: the cache is a block pool (`jaxspec.paged`) and row b's logical slot
    # s lives in block block_table[b, s // BS]
    block_table: Any = None
    # with a block table: a `jaxspec.paged.SharedContext` (the first slots of some rows, copied
    # dense) that a dense attention reads once for all those rows; None: none
    shared: Any = None
    # a sparse plan's retrieved blocks (`jaxspec.retrieval`): [B, L, K, R] int32 block indices
    # per row, layer and KV head (-1: none) of ``retrieve_block`` slots each, read besides the
    # sink and window; None: none
    retrieved: Any = None
    retrieve_block: int | None = struct.field(pytree_node=False, default=None)
    # the forward also returns, per layer, each row's and KV head's largest logit per block of
    # this many context slots (`jaxspec.retrieval.block_scores`); None: not
    score_block: int | None = struct.field(pytree_node=False, default=None)
    # the numerics of those scores (None: ``impl``'s): they only steer the drafts, so a greedy
    # batch-invariant round computes them as its drafts run (`jaxspec.drafter.draft_impl`)
    score_impl: str | None = struct.field(pytree_node=False, default=None)
    # the queries are prompt tokens of a prefill (causal, no mask): tokens whose K/V no decode
    # step computes (all of a prompt but its last token). Batch-invariant attention then takes
    # `jaxspec.invariant.prompt_attention`, the same in any chunking but not a decode step's
    # bits; other implementations ignore it
    prompt: bool = struct.field(pytree_node=False, default=False)

    @property
    def sparse(self) -> bool:
        return self.sink is not None or self.window is not None

    def new_tokens(self, T: int) -> int:
        """T_new for a forward computing T tokens (the last T of the T_new new ones)."""
        return _num_new(T, self.mask, self.num_new)


def _num_new(T: int, mask, num_new) -> int:
    """T_new: ``mask.shape[-1]`` with a mask (``num_new`` must then agree), else ``num_new``,
    else T; at least T (the kernels' own rule)."""
    return resolve_num_new(T, mask, num_new)


def _new_token_mask(mask, B: int, T: int, T_new: int | None = None) -> jax.Array:
    """[B, T, T_new] bool visibility of the new tokens for the T queries (the last T of them)."""
    T_new = T if T_new is None else T_new
    if mask is None:
        m = jnp.tri(T, T_new, T_new - T, dtype=bool)
    else:
        m = jnp.asarray(mask, dtype=bool)
    if m.ndim == 2:
        m = m[None]
    return jnp.broadcast_to(m, (B, T, T_new))


def _windowed_new_mask(mask, B: int, T: int, T_new: int, W: int | None) -> jax.Array:
    """`_new_token_mask` where query t sees only the new tokens less than W deeper than itself
    (``d_t - d_j < W``; module docstring): its last W visible new tokens. Differs only when
    ``T_new > W``."""
    m = _new_token_mask(mask, B, T, T_new)
    if W is None or T_new <= W:
        return m
    if mask is None:
        t = jnp.arange(T, dtype=jnp.int32)[:, None] + (T_new - T)
        j = jnp.arange(T_new, dtype=jnp.int32)[None, :]
        return m & (t - j < W)[None]
    c = jnp.cumsum(m.astype(jnp.int32), axis=-1)  # visible new tokens up to j: d_j + 1
    return m & (c[..., -1:] - c < W)


def _query_depths(mask, B: int, T: int, T_new: int) -> jax.Array:
    """[B, T] int32 depth of each query (its position minus ``lengths``): ``T_new - T + t`` for
    the causal mask, else the number of new tokens it sees minus one (a tree node's ancestors)."""
    if mask is None:
        return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + (T_new - T), (B, T))
    return jnp.sum(_new_token_mask(mask, B, T, T_new).astype(jnp.int32), axis=-1) - 1


def _min_depth(mask, T: int, T_new: int) -> int:
    """A static lower bound of the query depths (`_query_depths`)."""
    return T_new - T if mask is None else 0


def resolve_sparse(sink, window, sliding_window):
    """The (sink, window) a sparse plan runs with on a model of sliding window W: its own view
    while ``sink + window < W - 1``, else none (the exact sliding window, which reads no more)."""
    if sliding_window is None or (sink is None and window is None):
        return sink, window
    if int(sink or 0) + int(window or 0) >= sliding_window - 1:
        return None, None
    return sink, window


def _gather_slots(c, layer, idx_BN):
    """``c[layer, b, :, idx[b, n]]`` -> [B, K, N, D] (``c`` [L, B, K, S, D], or [B, K, S, D] with
    ``layer=None``); only the N slots of each row are read."""
    b = jnp.arange(idx_BN.shape[0], dtype=jnp.int32)[:, None]
    g = c[b, :, idx_BN] if layer is None else c[layer, b, :, idx_BN]  # [B, N, K, D]
    return jnp.swapaxes(g, 1, 2)


def sliding_window_band(q_BTHD, k_cache, v_cache, lengths, mask=None, *, layer=None,
                        sliding_window: int, lo: int, n_ctx: int, with_new: bool,
                        sm_scale=None, num_new=None):
    """Sliding-window attention over a gathered part of the keys; returns ``(out, lse)``.

    Reads the context slots ``lengths + lo + i`` (i < n_ctx), each visible to query t iff
    ``0 <= s < lengths`` and ``s > lengths + d_t - W`` (module docstring), and with ``with_new``
    also the T_new new tokens under the windowed causal/tree mask. ``k_cache``/``v_cache``:
    ``[L, B, K, S, D]`` with a (traced) ``layer``, or ``[B, K, S, D]``."""
    B, T, H, D = q_BTHD.shape
    S = k_cache.shape[-2]
    W = int(sliding_window)
    T_new = _num_new(T, mask, num_new)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    L = lengths.astype(jnp.int32)[:, None]  # [B, 1]
    slots = L + lo + jnp.arange(max(n_ctx, 0), dtype=jnp.int32)[None]  # [B, n_ctx]
    bound = L + _query_depths(mask, B, T, T_new) - W  # [B, T]: visible iff s > bound
    ok = ((slots >= 0) & (slots < L))[:, None, :] & (slots[:, None, :] > bound[:, :, None])
    idx = slots
    if with_new:
        idx = jnp.concatenate([slots, L + jnp.arange(T_new, dtype=jnp.int32)[None]], axis=1)
        ok = jnp.concatenate([ok, _windowed_new_mask(mask, B, T, T_new, W)], axis=2)
    idx = jnp.clip(idx, 0, S - 1)
    k = _gather_slots(k_cache, layer, idx)
    v = _gather_slots(v_cache, layer, idx)
    q = q_BTHD
    if _backend() == "cpu" and q.dtype != jnp.float32:  # see attention_xla
        q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    out, lse = _softmax_attend(q, k, v, ok, sm_scale)
    return out.astype(q_BTHD.dtype), lse


def _gathered_window(q_BTHD, k_cache, v_cache, lengths, mask, *, layer, sliding_window: int,
                     sm_scale, num_new: int):
    """The `jnp` sliding-window attention over the gathered ``W - 1 - d_min + T_new`` slots, or
    None when the dense masked pass over all S slots reads no more."""
    W, T = int(sliding_window), q_BTHD.shape[1]
    d_min = _min_depth(mask, T, num_new)
    if W - 1 - d_min + num_new >= k_cache.shape[-2]:
        return None
    return sliding_window_band(q_BTHD, k_cache, v_cache, lengths, mask, layer=layer,
                               sliding_window=W, lo=d_min - W + 1, n_ctx=W - 1 - d_min,
                               with_new=True, sm_scale=sm_scale, num_new=num_new)


def sliding_window_attention(q_BTHD, k_cache, v_cache, lengths, mask=None, *, layer=None,
                             sliding_window: int, kernel=None, sm_scale=None, num_new=None,
                             interpret=None):
    """Exact sliding-window attention (dense plan) of the last T of T_new new tokens; returns
    ``(out, lse)``. ``kernel`` (`pallas_kernels.decode_attention`): the sparse kernel over the
    context slots every query sees plus a `jnp` band (module docstring); None: all in `jnp`
    over the gathered ``W - 1 + T_new`` slots at most."""
    T = q_BTHD.shape[1]
    W = int(sliding_window)
    T_new = _num_new(T, mask, num_new)
    d_min, d_max = _min_depth(mask, T, T_new), T_new - 1
    wk = W - 1 - d_max  # context slots [lengths - wk, lengths): seen by every query
    kw = dict(layer=layer, sliding_window=W, sm_scale=sm_scale, num_new=T_new)
    if kernel is None or wk < 1:
        return sliding_window_band(q_BTHD, k_cache, v_cache, lengths, mask, lo=d_min - W + 1,
                                   n_ctx=W - 1 - d_min, with_new=True, **kw)
    # T_new <= W - 1 here: the new tokens need no windowing
    o, lse = kernel(q_BTHD, k_cache, v_cache, lengths, mask, layer=layer, sink=None, window=wk,
                    sm_scale=sm_scale, num_new=T_new, interpret=interpret)
    if d_max == d_min:  # every query at one depth (a decode step): no band
        return o, lse
    o2, lse2 = sliding_window_band(q_BTHD, k_cache, v_cache, lengths, mask, lo=d_min - W + 1,
                                   n_ctx=d_max - d_min, with_new=False, **kw)
    return merge_attention_states([o, o2], [lse, lse2])


def _softmax_attend(q_BTHD, k_BKND, v_BKND, visible_BTN, sm_scale):
    """Masked softmax attention of q over n gathered keys per sequence; returns (out, lse)."""
    B, T, H, D = q_BTHD.shape
    K = k_BKND.shape[1]
    G = H // K
    q = q_BTHD.reshape(B, T, K, G, D)
    s = jnp.einsum("btkgd,bknd->bkgtn", q, k_BKND, preferred_element_type=jnp.float32) * sm_scale
    vis = visible_BTN[:, None, None, :, :]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(s - m_safe), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    # Garbage (even NaN) in invisible slots must not leak through p @ v (0 * NaN = NaN).
    vis_kn = jnp.any(visible_BTN, axis=1)[:, None, :, None]  # [B, 1, N, 1]
    v = jnp.where(vis_kn, v_BKND, jnp.zeros((), v_BKND.dtype))
    o = jnp.einsum("bkgtn,bknd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o / jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom[..., 0] > 0, m_safe[..., 0] + jnp.log(jnp.maximum(denom[..., 0], 1e-30)),
                    -jnp.inf)
    out = o.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q_BTHD.dtype)
    lse = lse.transpose(0, 3, 1, 2).reshape(B, T, H)
    return out, lse


def attention_xla(q_BTHD, k_BKSD, v_BKSD, lengths, mask=None, *, sink=None, window=None,
                  sm_scale=None, num_new=None, sliding_window=None):
    """Plain-`jnp` attention over a cache laid out ``[B, K, S, D]``; returns ``(out, lse)``.

    The T queries are the last T of ``num_new`` new tokens (default: ``mask.shape[-1]``, else T);
    see the module docstring. Dense: one pass over all S slots with a visibility mask. Sparse
    (sink/window): gathers only ``sink`` + ``window`` context slots and the T_new new slots per
    sequence. ``sliding_window`` W: see the module docstring (gathers at most ``W - 1 + T_new``
    slots, or masks the dense pass when that is not more).
    """
    B, T, H, D = q_BTHD.shape
    S = k_BKSD.shape[2]
    out_dtype = q_BTHD.dtype
    if _backend() == "cpu" and q_BTHD.dtype != jnp.float32:
        # XLA's CPU backend has no fast 16-bit matmuls: attend in float32 there.
        out, lse = attention_xla(q_BTHD.astype(jnp.float32), k_BKSD.astype(jnp.float32),
                                 v_BKSD.astype(jnp.float32), lengths, mask, sink=sink,
                                 window=window, sm_scale=sm_scale, num_new=num_new,
                                 sliding_window=sliding_window)
        return out.astype(out_dtype), lse
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    lengths = lengths.astype(jnp.int32)
    T_new = _num_new(T, mask, num_new)
    W = None if sliding_window is None else int(sliding_window)
    sink, window = resolve_sparse(sink, window, W)
    new_mask = _windowed_new_mask(mask, B, T, T_new, W)  # [B, T, T_new]
    if sink is None and window is None:
        if W is not None:  # gather the window when that reads fewer slots
            res = _gathered_window(q_BTHD, k_BKSD, v_BKSD, lengths, mask, layer=None,
                                   sliding_window=W, sm_scale=sm_scale, num_new=T_new)
            if res is not None:
                return res
        s_idx = jnp.arange(S, dtype=jnp.int32)
        rel = s_idx[None, :] - lengths[:, None]  # [B, S]
        in_ctx = rel < 0
        in_new = (rel >= 0) & (rel < T_new)
        relc = jnp.clip(rel, 0, T_new - 1)
        new_vis = jnp.take_along_axis(new_mask, jnp.broadcast_to(relc[:, None, :], (B, T, S)), axis=2)
        ctx_vis = in_ctx[:, None, :]
        if W is not None:  # context slot s visible to query t iff s > lengths + d_t - W
            bound = lengths[:, None] + _query_depths(mask, B, T, T_new) - W  # [B, T]
            ctx_vis = ctx_vis & (s_idx[None, None, :] > bound[:, :, None])
        visible = ctx_vis | (in_new[:, None, :] & new_vis)  # [B, T, S]
        return _softmax_attend(q_BTHD, k_BKSD, v_BKSD, visible, sm_scale)
    sink = int(sink or 0)
    window = int(window or 0)
    sink_idx = jnp.broadcast_to(jnp.arange(sink, dtype=jnp.int32)[None], (B, sink))
    win_idx = lengths[:, None] - window + jnp.arange(window, dtype=jnp.int32)[None]
    new_idx = lengths[:, None] + jnp.arange(T_new, dtype=jnp.int32)[None]
    idx = jnp.concatenate([sink_idx, win_idx, new_idx], axis=1)  # [B, N]
    sink_ok = sink_idx < lengths[:, None]
    win_ok = (win_idx >= sink) & (win_idx >= 0)
    ctx_ok = jnp.concatenate([sink_ok, win_ok], axis=1)  # [B, sink + window]
    visible = jnp.concatenate(
        [jnp.broadcast_to(ctx_ok[:, None, :], (B, T, sink + window)), new_mask], axis=2)
    idx_c = jnp.clip(idx, 0, S - 1)
    gather = lambda c: jnp.take_along_axis(c, idx_c[:, None, :, None], axis=2)
    return _softmax_attend(q_BTHD, gather(k_BKSD), gather(v_BKSD), visible, sm_scale)


def _backend() -> str:
    return jax.default_backend()


def _with_retrieved(q, k_all, v_all, layer, o, lse, blocks, *, block, sm_scale, lo, hi):
    """``o`` (the sparse view's attention, with its ``lse``) merged with the attention over the
    retrieved blocks (``blocks``: empty, or one [B, K, R] array), of whose slots those in
    ``[lo, hi)`` count (between the sink and the window, [B] each)."""
    if not blocks:
        return o
    o2, lse2 = retrieved_attention(q, k_all, v_all, layer, blocks[0], block=block,
                                   sm_scale=sm_scale, lo=lo, hi=hi)
    return merge_attention_states([o, o2.astype(o.dtype)], [lse, lse2])[0]


def _paged_kernel(q, k_pages, v_pages, table, lengths, mask, layer, *blocks, block=None, **kw):
    # retrieved blocks, if any, are read by the kernel through the table
    return paged_decode_attention(q, k_pages, v_pages, table, lengths, mask, layer=layer,
                                  retrieved=blocks[0] if blocks else None,
                                  retrieve_block=block, **kw)[0]


def attend(q_BTHD, k_LBKSD, v_LBKSD, layer, plan: AttentionPlan, *, sm_scale=None):
    """Attention of the T queries (the last T of ``plan.new_tokens(T)`` new tokens) of one layer
    over the stacked cache ``[L, B, K, S, D]``; with ``plan.score_block`` ``(out, scores)``
    (`context_scores`)."""
    impl = plan.impl
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {impl!r}; choose from {IMPLEMENTATIONS}")
    if plan.score_block is not None:
        return _attend_scored(q_BTHD, k_LBKSD, v_LBKSD, layer, plan, sm_scale=sm_scale)
    blocks = ()  # this layer's retrieved blocks [B, K, R] (a sparse plan's), if any
    if plan.retrieved is not None:
        if plan.sparse:
            r = jax.lax.dynamic_index_in_dim(plan.retrieved, jnp.asarray(layer, jnp.int32),
                                             axis=1, keepdims=False)
            if plan.active is not None:
                r = jnp.where(plan.active[:, None, None], r, -1)
            blocks = (r,)
        plan = plan.replace(retrieved=None)
    if plan.active is not None:  # finished rows: no context read (their output is discarded)
        plan = plan.replace(lengths=jnp.where(plan.active, plan.lengths, 0), active=None)
    rb = plan.retrieve_block
    inv = invariant.is_invariant(impl)
    if plan.block_table is not None:  # a block pool: this layer's blocks of each row, in order
        if plan.prefix is not None:
            raise ValueError("paged caches do not combine with shared-prefix levels")
        if inv:  # each row reads its whole context through its table, in key order
            plan = plan.replace(shared=None)
            BS = k_LBKSD.shape[3]
            plan = plan.replace(block_table=_whole_key_blocks(plan.block_table, q_BTHD.shape[-1],
                                                              k_LBKSD.dtype, BS))
            if (not plan.sparse and not plan.prompt and plan.prefix is None
                    and invariant.reads_pages(impl, BS, q_BTHD.shape[-1], k_LBKSD.dtype)):
                # the target's decode / verification: the kernel reads the pool through the
                # table (no gathered copy of the context)
                return invariant.attention(q_BTHD, k_LBKSD, v_LBKSD, layer, plan.lengths,
                                           plan.mask, num_new=plan.new_tokens(q_BTHD.shape[1]),
                                           sm_scale=sm_scale, sliding_window=plan.sliding_window,
                                           impl=impl, block_table=plan.block_table)
        if plan.shared is not None:
            if not plan.sparse and plan.sliding_window is None:
                return _attend_shared(q_BTHD, k_LBKSD, v_LBKSD, layer, plan, sm_scale=sm_scale)
            plan = plan.replace(shared=None)  # a sparse view reads few keys: no split
        if _use_kernel(impl) and plan.sliding_window is None:  # the paged kernel reads the pool
            sink, window = resolve_sparse(plan.sink, plan.window, None)
            fn = functools.partial(_paged_kernel, sink=sink, window=window, sm_scale=sm_scale,
                                   num_new=plan.new_tokens(q_BTHD.shape[1]), block=rb,
                                   interpret=True if impl == "interpret" else None)
            return per_shard_paged_attention(fn, q_BTHD, k_LBKSD, v_LBKSD, plan.block_table,
                                             plan.lengths, plan.mask, layer, extra=blocks)
        k_view = gather_view(k_LBKSD, layer, plan.block_table)[None]
        v_view = gather_view(v_LBKSD, layer, plan.block_table)[None]
        retrieved = blocks[0][:, None] if blocks else None
        return attend(q_BTHD, k_view, v_view, jnp.int32(0),
                      plan.replace(block_table=None, retrieved=retrieved), sm_scale=sm_scale)
    T = q_BTHD.shape[1]
    num_new = plan.new_tokens(T)
    W = plan.sliding_window
    if inv:
        if plan.prefix is not None:
            raise NotImplementedError(
                "batch-invariant attention does not read shared-prefix (Hydragen) segments: "
                "decode without shared_prefix (generate does so itself with batch_invariant)")
        if plan.prompt and not plan.sparse and plan.mask is None and plan.score_block is None:
            return invariant.prompt_attention(q_BTHD, k_LBKSD, v_LBKSD, layer, plan.lengths,
                                              num_new=num_new, sm_scale=sm_scale,
                                              sliding_window=W, impl=impl)
        if not plan.sparse:  # the target's attention: fixed order in absolute key positions
            out = invariant.attention(q_BTHD, k_LBKSD, v_LBKSD, layer, plan.lengths, plan.mask,
                                      num_new=num_new, sm_scale=sm_scale, sliding_window=W,
                                      impl=impl)
            if plan.score_block is None:
                return out
            # a retrieving self-draft's verification: the block scores too
            return out, context_scores(q_BTHD, k_LBKSD, layer, plan, block=plan.score_block)
        # a sparse view is the self-draft's: its proposals (and the distributions they are
        # drawn from) decide sampled tokens, so it is invariant too
        sink, window = resolve_sparse(plan.sink, plan.window, W)
        if sink is None and window is None:  # resolved to the model's exact sliding window
            return invariant.attention(q_BTHD, k_LBKSD, v_LBKSD, layer, plan.lengths, plan.mask,
                                       num_new=num_new, sm_scale=sm_scale, sliding_window=W,
                                       impl=impl)
        return invariant.sparse_attention(q_BTHD, k_LBKSD, v_LBKSD, layer, plan.lengths,
                                          plan.mask, num_new=num_new, sink=sink, window=window,
                                          blocks=blocks[0] if blocks else None, block=rb,
                                          sm_scale=sm_scale, sliding_window=W)
    if plan.prefix is not None:  # shared prefix (Hydragen): prefix part + suffix part, merged
        if W is not None:
            raise ValueError("shared prefixes (Hydragen) do not support sliding-window attention: "
                             "generate without shared_prefix for this model")
        return attend_with_prefix(q_BTHD, k_LBKSD, v_LBKSD, layer, plan, sm_scale=sm_scale,
                                  blocks=blocks)
    sink, window = resolve_sparse(plan.sink, plan.window, W)
    sparse = sink is not None or window is not None
    if _use_kernel(impl):
        interpret = True if impl == "interpret" else None

        def run_kernel(q, k, v, lengths, mask, layer, *blk):
            if W is not None and not sparse:
                return sliding_window_attention(
                    q, k, v, lengths, mask, layer=layer, sliding_window=W, kernel=decode_kernel,
                    sm_scale=sm_scale, num_new=num_new, interpret=interpret)[0]
            if W is not None and num_new > W:  # a sparse draft: window its new tokens
                mask = _windowed_new_mask(mask, q.shape[0], T, num_new, W)
            # retrieved blocks, if any, are read by the kernel in place
            return decode_kernel(q, k, v, lengths, mask, layer=layer, sink=sink, window=window,
                                 sm_scale=sm_scale, num_new=num_new, interpret=interpret,
                                 retrieved=blk[0] if blk else None, retrieve_block=rb)[0]
        return per_shard_attention(run_kernel, q_BTHD, k_LBKSD, v_LBKSD, plan.lengths,
                                   plan.mask, layer, extra=blocks if sparse else ())

    def run_xla(q, k_all, v_all, lengths, mask, layer, *blk):
        if W is not None and not sparse:  # gathers only the window's slots of this layer
            res = _gathered_window(q, k_all, v_all, lengths, mask, layer=layer, sliding_window=W,
                                   sm_scale=sm_scale, num_new=num_new)
            if res is not None:
                return res[0]
        if W is None and not sparse and _backend() == "cpu":
            return blocked_attention(q, k_all, v_all, lengths, mask, layer=layer,
                                     sm_scale=sm_scale, num_new=num_new)[0]
        k = jax.lax.dynamic_index_in_dim(k_all, layer, axis=0, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(v_all, layer, axis=0, keepdims=False)
        o, lse = attention_xla(q, k, v, lengths, mask, sink=sink, window=window,
                               sm_scale=sm_scale, num_new=num_new, sliding_window=W)
        lo = jnp.minimum(int(sink or 0), lengths)
        return _with_retrieved(q, k_all, v_all, layer, o, lse, blk, block=rb, sm_scale=sm_scale,
                               lo=lo, hi=jnp.maximum(lengths - int(window or 0), lo))
    return per_shard_attention(run_xla, q_BTHD, k_LBKSD, v_LBKSD, plan.lengths, plan.mask, layer,
                               extra=blocks if sparse else ())


def _whole_key_blocks(table, head_dim, dtype, page_size):
    """A block table padded with unmapped entries (past every length) to whole key blocks of
    the invariant decode kernel (`invariant.view_slots`), whose loads are then contiguous."""
    unit = invariant.view_slots(head_dim, dtype)
    unit //= math.gcd(unit, page_size)  # table entries per whole number of kernel blocks
    MB = table.shape[1]
    return table if MB % unit == 0 else jnp.pad(table, ((0, 0), (0, -MB % unit)),
                                                constant_values=-1)


def _invariant_scored(q_BTHD, k_LBKSD, v_LBKSD, layer, plan: AttentionPlan, block: int, sm_scale):
    """``(out, scores)`` of a batch-invariant verification from the invariant kernel in one pass
    over the keys (it writes each group of keys' largest logit as it reads them), or None where
    that kernel does not run (then the scores are a pass of their own)."""
    D = q_BTHD.shape[-1]
    if (plan.prefix is not None or plan.sparse or plan.prompt or plan.sliding_window is not None
            or not invariant.uses_kernel(plan.impl, D)):
        return None
    lengths = plan.lengths if plan.active is None else jnp.where(plan.active, plan.lengths, 0)
    table = plan.block_table
    if table is None:
        n = -(-k_LBKSD.shape[3] // block)
    else:
        BS = k_LBKSD.shape[3]
        if not invariant.reads_pages(plan.impl, BS, D, k_LBKSD.dtype):
            return None
        n = -(-table.shape[1] * BS // block)
        table = _whole_key_blocks(table, D, k_LBKSD.dtype, BS)
    out, scores = invariant.attention(q_BTHD, k_LBKSD, v_LBKSD, layer, lengths, plan.mask,
                                      num_new=plan.new_tokens(q_BTHD.shape[1]),
                                      sm_scale=sm_scale, impl=plan.impl, block_table=table,
                                      score_block=block)
    return out, scores[:, :, :n]


def _attend_scored(q_BTHD, k_LBKSD, v_LBKSD, layer, plan: AttentionPlan, *, sm_scale=None):
    """``(out, scores)``: `attend` and `context_scores`. A dense attention on the kernel path
    (a dense cache or a block pool) computes both in one kernel (it writes each key block's
    largest logit as it reads the keys), and so does the batch-invariant kernel
    (`_invariant_scored`); over a block pool's shared context every score is -inf (nothing
    selected); elsewhere the scores are a pass of their own over the keys."""
    block = int(plan.score_block)
    plan = plan.replace(score_block=None)
    if invariant.is_invariant(plan.impl):
        both = _invariant_scored(q_BTHD, k_LBKSD, v_LBKSD, layer, plan, block, sm_scale)
        if both is not None:
            return both
    if (plan.shared is not None and plan.block_table is not None
            and not invariant.is_invariant(plan.impl)):
        # rows over a shared context (a block pool): a pass of its own would gather every row's
        # copy of the shared keys, which the attention reads once for all of them. No block is
        # scored then, so nothing is selected and the next drafts read the blocks just before
        # their window (`jaxspec.retrieval.with_recent`): as many keys, the most recent ones.
        out = attend(q_BTHD, k_LBKSD, v_LBKSD, layer, plan, sm_scale=sm_scale)
        n = -(-plan.block_table.shape[1] * k_LBKSD.shape[3] // block)
        return out, jnp.full((q_BTHD.shape[0], k_LBKSD.shape[2], n), -jnp.inf, jnp.float32)
    if (_use_kernel(plan.impl) and plan.prefix is None and plan.shared is None
            and not plan.sparse and plan.sliding_window is None):
        lengths = plan.lengths if plan.active is None else jnp.where(plan.active, plan.lengths, 0)
        kw = dict(sm_scale=sm_scale, num_new=plan.new_tokens(q_BTHD.shape[1]),
                  interpret=True if plan.impl == "interpret" else None, score_block=block)
        if plan.block_table is not None:  # through the block tables
            def paged(q, k, v, table, ln, mask, lay):
                o, _, sc = paged_decode_attention(q, k, v, table, ln, mask, layer=lay, **kw)
                return o, sc
            return per_shard_paged_attention(paged, q_BTHD, k_LBKSD, v_LBKSD, plan.block_table,
                                             lengths, plan.mask, layer, outs="both")

        def fn(q, k, v, ln, mask, lay):
            o, _, sc = decode_kernel(q, k, v, ln, mask, layer=lay, **kw)
            return o, sc
        return per_shard_attention(fn, q_BTHD, k_LBKSD, v_LBKSD, lengths, plan.mask, layer,
                                   outs="both")
    out = attend(q_BTHD, k_LBKSD, v_LBKSD, layer, plan, sm_scale=sm_scale)
    return out, context_scores(q_BTHD, k_LBKSD, layer, plan, block=block)


def context_scores(q_BTHD, k_LBKSD, layer, plan: AttentionPlan, *, block: int):
    """``[B, K, NB]`` float32: `jaxspec.retrieval.block_scores` of the T queries over each row's
    context (own cache: a dense stack or a block pool through its tables) in blocks of
    ``block`` slots; per shard under a mesh."""
    lengths = plan.lengths
    if plan.active is not None:
        lengths = jnp.where(plan.active, lengths, 0)
    table = plan.block_table

    scores = (invariant.block_scores if invariant.is_invariant(plan.score_impl or plan.impl)
              else block_scores)

    def fn(q, k_all, _v, ln, _mask, lay, *tab):
        k = layer_view(k_all, lay, tab[0] if tab else None)
        return scores(q, k, ln, block=block)

    if table is None:
        return per_shard_attention(fn, q_BTHD, k_LBKSD, k_LBKSD, lengths, None, layer,
                                   outs="heads")
    mesh = active_mesh()
    if mesh is None:
        return fn(q_BTHD, k_LBKSD, None, lengths, None, layer, table)
    from jax.sharding import PartitionSpec as P
    b = batch_axis(mesh, q_BTHD.shape[0])
    pool = P(None, None, "model", None, None)
    return jax.shard_map(lambda q, k, ln, lay, tab: fn(q, k, None, ln, None, lay, tab),
                         mesh=mesh, in_specs=(P(b, None, "model", None), pool, P(b), P(),
                                              P(b, None)),
                         out_specs=P(b, "model", None), check_vma=False)(
        q_BTHD, k_LBKSD, lengths, jnp.asarray(layer, jnp.int32), table)


CPU_KEY_BLOCK = 128  # keys per block of `blocked_attention`


def blocked_attention(q_BTHD, k_LBKSD, v_LBKSD, lengths, mask=None, *, layer, sm_scale=None,
                      num_new=None, block: int = CPU_KEY_BLOCK):
    """Dense attention (the contract of `attention_xla`) whose cost follows the context, not the
    cache's size: the context is read in blocks of ``block`` keys by a loop whose trip count is
    the longest context of the batch (an online softmax in float32), the T_new new tokens are
    gathered, and the two parts merge by log-sum-exp. What XLA's CPU backend runs, where a pass
    over every slot of a cache sized for the longest request would cost that much per step.
    Returns ``(out[B, T, H, D], lse[B, T, H])``."""
    B, T, H, D = q_BTHD.shape
    L_, _, K, S, _ = k_LBKSD.shape
    G = H // K
    T_new = _num_new(T, mask, num_new)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    lengths = lengths.astype(jnp.int32)
    block = int(min(block, S))
    n_blocks = (jnp.max(lengths) + block - 1) // block
    q = (q_BTHD.astype(jnp.float32) * sm_scale).reshape(B, T, K, G, D)
    layer = jnp.asarray(layer, jnp.int32)
    zero = jnp.int32(0)

    def body(i, carry):
        m, l, acc = carry
        s0 = jnp.minimum(i * block, S - block)  # the last block may overlap the one before
        k = jax.lax.dynamic_slice(k_LBKSD, (layer, zero, zero, s0, zero), (1, B, K, block, D))
        v = jax.lax.dynamic_slice(v_LBKSD, (layer, zero, zero, s0, zero), (1, B, K, block, D))
        k, v = k[0].astype(jnp.float32), v[0].astype(jnp.float32)
        slot = s0 + jnp.arange(block, dtype=jnp.int32)
        # each slot counted once: a slot of an overlapping last block already seen is masked
        ok = (slot[None, :] < lengths[:, None]) & (slot[None, :] >= i * block)  # [B, blk]
        s = jnp.einsum("btkgd,bknd->bkgtn", q, k)
        s = jnp.where(ok[:, None, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(ok[:, None, None, None, :], jnp.exp(s - m_safe[..., None]), 0.0)
        scale = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        l = l * scale + jnp.sum(p, axis=-1)
        v = jnp.where(ok[:, None, :, None], v, 0.0)
        acc = acc * scale[..., None] + jnp.einsum("bkgtn,bknd->bkgtd", p, v)
        return m_new, l, acc

    init = (jnp.full((B, K, G, T), -jnp.inf, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, D), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    o_ctx = acc / jnp.where(l > 0, l, 1.0)[..., None]
    lse_ctx = jnp.where(l > 0, m + jnp.log(jnp.maximum(l, 1e-30)), -jnp.inf)
    o_ctx = o_ctx.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)
    lse_ctx = lse_ctx.transpose(0, 3, 1, 2).reshape(B, T, H)
    # the new tokens: T_new slots per row past its context
    idx = lengths[:, None] + jnp.arange(T_new, dtype=jnp.int32)[None]
    idx = jnp.clip(idx, 0, S - 1)
    k_new = _gather_slots(k_LBKSD, layer, idx).astype(jnp.float32)
    v_new = _gather_slots(v_LBKSD, layer, idx).astype(jnp.float32)
    o_new, lse_new = _softmax_attend(q_BTHD.astype(jnp.float32), k_new, v_new,
                                     _new_token_mask(mask, B, T, T_new), sm_scale)
    out, lse = merge_attention_states([o_ctx, o_new.astype(jnp.float32)], [lse_ctx, lse_new])
    return out.astype(q_BTHD.dtype), lse


# ----------------------------------------------------------------------------- prefix segments
def attend_with_prefix(q_BTHD, k_LBKSD, v_LBKSD, layer, plan: AttentionPlan, *, sm_scale=None,
                       blocks=()):
    """`attend` when ``plan.prefix`` is set: the own-cache segment plus one segment per prefix
    level, merged once (per shard under a mesh). ``blocks``: a sparse plan's retrieved blocks of
    the own cache for this layer (empty, or one [B, K, R] array)."""
    pre: SharedPrefix = plan.prefix
    B = q_BTHD.shape[0]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q_BTHD.shape[-1])
    fn = functools.partial(_sparse if plan.sparse else _dense, plan=plan, sm_scale=sm_scale,
                           batch=B, num_new=plan.new_tokens(q_BTHD.shape[1]))
    mesh = active_mesh()
    mask = plan.mask
    layer = jnp.asarray(layer, jnp.int32)
    if mesh is None:
        rows = jnp.arange(B, dtype=jnp.int32)
        return fn(q_BTHD, k_LBKSD, v_LBKSD, plan.lengths, mask, layer, pre, rows, *blocks,
                  sharded=False)
    from jax.sharding import PartitionSpec as P
    b = batch_axis(mesh, B)
    kv = P(None, b, "model", None, None)
    lvl = P(None, None, None, "model", None)
    pre_spec = SharedPrefix(levels=tuple(PrefixLevel(k=lvl, v=lvl, lengths=P(), start=P())
                                         for _ in pre.levels), offset=P(b))
    args = [q_BTHD, k_LBKSD, v_LBKSD, plan.lengths, layer, pre,
            jnp.arange(B, dtype=jnp.int32), *blocks]
    specs = [P(b, None, "model", None), kv, kv, P(b), P(), pre_spec, P(b)]
    specs += [P(b, "model", None)] * len(blocks)
    n = len(blocks)
    if mask is not None:
        mask = jnp.asarray(mask)
        args.append(mask)
        specs.append(mask_spec(mask, b))

    def body(q, k, v, ln, lay, pr, rows, *rest):
        return fn(q, k, v, ln, rest[n] if len(rest) > n else None, lay, pr, rows, *rest[:n],
                  sharded=True)

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs),
                         out_specs=P(b, None, "model", None), check_vma=False)(*args)


def _use_kernel(impl: str) -> bool:
    return impl in ("pallas", "interpret") or (
        impl == "auto" and jax.default_backend() in ("gpu", "tpu"))


def _dense(q, k_all, v_all, lengths, mask, layer, pre: SharedPrefix, rows, *blocks, plan,
           sm_scale, batch, sharded, num_new):
    """Suffix part (decode kernel / jnp, ragged, causal or tree mask) + one `prefix_attention`
    per level, merged by log-sum-exp in one pass: the prefix kernels' key splits come back
    unmerged (``partials=True``) and join the suffix part in the same merge."""
    impl = plan.impl
    interpret = True if impl == "interpret" else None
    kernel = decode_kernel if _use_kernel(impl) else None
    if kernel is not None:
        o, lse = kernel(q, k_all, v_all, lengths, mask, layer=layer, sm_scale=sm_scale,
                        interpret=interpret, num_new=num_new)
    else:
        k = jax.lax.dynamic_index_in_dim(k_all, layer, axis=0, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(v_all, layer, axis=0, keepdims=False)
        o, lse = attention_xla(q, k, v, lengths, mask, sm_scale=sm_scale, num_new=num_new)
    outs, lses = [o[None]], [lse[None]]  # partial attentions, each [S, B, T, H(, D)]
    Bl = q.shape[0]
    if kernel is None:
        def fn(*a, **kw):
            o, lse = prefix_attention_reference(*a, **kw)
            return o[None], lse[None]
    else:
        fn = functools.partial(prefix_attention, partials=True)
    for lv in pre.levels:
        n, ln = lv.groups, lv.lengths
        n_loc, straddle = n, False
        if sharded:  # this shard's rows: the groups they belong to (contiguous rows)
            gs = batch // n
            straddle = bool(Bl % gs and gs % Bl)  # groups that cross the shards' edges
            n_loc = Bl if straddle else max(1, Bl // gs)
        if n_loc == n and not straddle:  # every group: the kernel reads the stack in place
            o, lse = fn(q, lv.k, lv.v, ln, sm_scale=sm_scale, interpret=interpret, layer=layer)
        else:  # this shard's groups of this layer (a copy of them)
            kp = jax.lax.dynamic_index_in_dim(lv.k, layer, axis=0, keepdims=False)  # [P, Lp, K, D]
            vp = jax.lax.dynamic_index_in_dim(lv.v, layer, axis=0, keepdims=False)
            if straddle:  # each row its own group (its group's prefix copied)
                g = rows // gs
                kp, vp, ln = kp[g], vp[g], ln[g]
            else:
                g0 = rows[0] // gs
                kp = jax.lax.dynamic_slice_in_dim(kp, g0, n_loc, axis=0)
                vp = jax.lax.dynamic_slice_in_dim(vp, g0, n_loc, axis=0)
                ln = jax.lax.dynamic_slice_in_dim(ln, g0, n_loc, axis=0)
            o, lse = fn(q, kp, vp, ln, sm_scale=sm_scale, interpret=interpret)
        outs.append(o)
        lses.append(lse)
    return merge_partials(outs, lses, q.dtype)[0]


def _sparse(q, k_all, v_all, lengths, mask, layer, pre: SharedPrefix, rows, *blocks, plan,
            sm_scale, batch, sharded, num_new):
    """The StreamingLLM view over [prefix levels | suffix]: positions ``< sink`` and the last
    ``window`` context positions, plus the new tokens. Gathers at most ``sink + window`` slots
    per level and ``sink + window + T_new`` from the suffix, then one masked softmax; the
    retrieved blocks of the suffix (``blocks``), if any, merge with it by log-sum-exp."""
    del sharded
    B, T, H, D = q.shape
    sink, window = int(plan.sink or 0), int(plan.window or 0)
    lengths = lengths.astype(jnp.int32)
    off = pre.offset.astype(jnp.int32)
    ctx = off + lengths  # [B] context positions before the new tokens
    ar_s = jnp.arange(sink, dtype=jnp.int32)[None]
    ar_w = jnp.arange(window, dtype=jnp.int32)[None]
    keys, vals, oks = [], [], []
    for lv in pre.levels:
        g = rows // (batch // lv.groups)  # [B] group of each row
        n_len, st = lv.lengths[g][:, None], lv.start[g][:, None]
        j_s = jnp.broadcast_to(ar_s, (B, sink))
        ok_s = (j_s < n_len) & (st + j_s < sink)
        j_w = (ctx[:, None] - window - st) + ar_w
        ok_w = (j_w >= 0) & (j_w < n_len) & (st + j_w >= sink)
        idx = jnp.clip(jnp.concatenate([j_s, j_w], 1), 0, lv.k.shape[2] - 1)  # [B, n]
        keys.append(lv.k[layer, g[:, None], idx])  # [B, n, K, D]
        vals.append(lv.v[layer, g[:, None], idx])
        oks.append(jnp.concatenate([ok_s, ok_w], 1))
    s_s = jnp.broadcast_to(ar_s, (B, sink))
    ok_s = (off[:, None] + s_s < sink) & (s_s < lengths[:, None])
    s_w = lengths[:, None] - window + ar_w
    ok_w = (s_w >= 0) & (off[:, None] + s_w >= sink)
    s_new = lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None]
    idx = jnp.clip(jnp.concatenate([s_s, s_w, s_new], 1), 0, k_all.shape[3] - 1)
    b_idx = jnp.arange(B, dtype=jnp.int32)[:, None]
    keys.append(k_all[layer, b_idx, :, idx])  # [B, n, K, D]
    vals.append(v_all[layer, b_idx, :, idx])
    ctx_ok = jnp.concatenate(oks + [ok_s, ok_w], 1)  # [B, n_ctx]
    visible = jnp.concatenate([jnp.broadcast_to(ctx_ok[:, None], (B, T, ctx_ok.shape[1])),
                               _new_token_mask(mask, B, T, num_new)], 2)
    k = jnp.concatenate(keys, 1).transpose(0, 2, 1, 3)  # [B, K, N, D]
    v = jnp.concatenate(vals, 1).transpose(0, 2, 1, 3)
    o, lse = _softmax_attend(q, k, v, visible, sm_scale)
    lo = jnp.clip(sink - off, 0, lengths)  # the suffix's sink slots (a short prefix's)
    return _with_retrieved(q, k_all, v_all, layer, o, lse, blocks, block=plan.retrieve_block,
                           sm_scale=sm_scale, lo=lo, hi=jnp.maximum(lengths - window, lo))




def _attend_shared(q_BTHD, k_pages, v_pages, layer, plan: AttentionPlan, *, sm_scale=None):
    """Dense attention over a block pool whose rows ``plan.shared.rows`` begin with the shared
    context (`jaxspec.paged.SharedContext`): its copy read once for all of them (the shared-prefix
    kernel, one group) and each row's own slots after it through its shifted table, merged by
    log-sum-exp (per shard under a mesh: rows over data, KV heads over model). A row holding
    fewer context slots than the shared ones (an idle one) reads its own blocks only."""
    sh = plan.shared
    NB, BS = k_pages.shape[1], k_pages.shape[3]
    n_sh = sh.length[0]
    member = sh.rows & (plan.lengths >= n_sh)
    skip = jnp.where(member, n_sh, 0).astype(jnp.int32)  # [B] slots read from the copy
    table = shift_tables(plan.block_table, skip // BS, NB)
    lengths = plan.lengths - skip
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q_BTHD.shape[-1])
    fn = functools.partial(_shared_segments, impl=plan.impl, sm_scale=sm_scale,
                           num_new=plan.new_tokens(q_BTHD.shape[1]))
    mask = None if plan.mask is None else jnp.asarray(plan.mask)
    layer = jnp.asarray(layer, jnp.int32)
    args = (q_BTHD, k_pages, v_pages, table, lengths, layer, sh.k, sh.v, sh.length, member, mask)
    mesh = active_mesh()
    if mesh is None:
        return fn(*args)
    from jax.sharding import PartitionSpec as P
    b = batch_axis(mesh, q_BTHD.shape[0])
    pool, copy = P(None, None, "model", None, None), P(None, None, None, "model", None)
    specs = (P(b, None, "model", None), pool, pool, P(b, None), P(b), P(), copy, copy, P(),
             P(b), None if mask is None else mask_spec(mask, b))
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(b, None, "model", None),
                         check_vma=False)(*args)


def _shared_segments(q_BTHD, k_pages, v_pages, table, lengths, layer, sh_k, sh_v, sh_length,
                     member, mask, *, impl, sm_scale, num_new):
    """`_attend_shared`'s two segments (each row's own slots; the shared copy for its member
    rows) and their merge."""
    interpret = True if impl == "interpret" else None
    if _use_kernel(impl):
        o_own, lse_own = paged_decode_attention(
            q_BTHD, k_pages, v_pages, table, lengths, mask, layer=layer, sm_scale=sm_scale,
            num_new=num_new, interpret=interpret)
        o_sh, lse_sh = prefix_attention(q_BTHD, sh_k, sh_v, sh_length, sm_scale=sm_scale,
                                        interpret=interpret, layer=layer, partials=True)
    else:
        k = gather_view(k_pages, layer, table)
        v = gather_view(v_pages, layer, table)
        o_own, lse_own = attention_xla(q_BTHD, k, v, lengths, mask, sm_scale=sm_scale,
                                       num_new=num_new)
        o_sh, lse_sh = prefix_attention_reference(q_BTHD, sh_k, sh_v, sh_length,
                                                  sm_scale=sm_scale, layer=layer)
        o_sh, lse_sh = o_sh[None], lse_sh[None]
    lse_sh = jnp.where(member[None, :, None, None], lse_sh, -jnp.inf)
    return merge_partials([o_own[None], o_sh], [lse_own[None], lse_sh], q_BTHD.dtype)[0]


def plan_for(cache, lengths, **kw) -> AttentionPlan:
    """An `AttentionPlan` over ``cache`` with context ``lengths``: its shared-prefix segments and
    its block table (a paged cache, with its shared context) come with it."""
    return AttentionPlan(lengths=lengths, prefix=getattr(cache, "prefix", None),
                         block_table=getattr(cache, "block_table", None),
                         shared=getattr(cache, "shared", None), **kw)
