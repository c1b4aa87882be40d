"""The plain-`jnp` references of the attention contracts: one per contract.

* ``decode_attention_reference``: decode / verify (causal or tree mask over the new tokens,
  the last T of ``T_new >= T`` new tokens as queries) and the sparse StreamingLLM context
  (sink + window);
* ``paged_decode_attention_reference``: the decode / verify contract over a paged cache (a
  block pool and per-sequence block tables): each sequence's blocks gathered into a dense
  cache (``gather_pages``), then ``decode_attention_reference``;
* ``prefix_attention_reference``: shared-prefix attention (Hydragen);
* ``block_max_reference``: the largest logit per block of context slots (what the decode
  kernel writes with ``score_block``; the self-draft's retrieval chooses blocks by it);
* ``retrieved_attention_reference``: attention over whole blocks of slots chosen per row and
  KV head (the retrieved part of a sparse decode with ``retrieved``), in a dense cache or a
  block pool;
* the log-sum-exp merge of partial attentions has one implementation for every path,
  ``merge.merge_stacked``, which is its own reference.

Each computes dense float32 logits with a per-key visibility mask (memory heavy for long
caches and many queries): the oracle of the kernel tests, the CPU path of the dispatch, and
a benchmark peer. ``tests/test_kernel_references.py`` checks them against float64 numpy.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .contracts import (check_decode_args, check_prefix_args, layer_slice,
                        prefix_lengths_or_full, resolve_num_new, resolve_sm_scale)


@functools.partial(jax.jit, static_argnames=("sink", "window", "sm_scale", "num_new"))
def decode_reference_impl(q, k_cache, v_cache, lengths, tree_mask, layer, *, sink, window,
                          sm_scale, num_new):
    """``decode_attention_reference`` on checked arguments (``num_new``: T_new, an int)."""
    k_cache, v_cache = layer_slice(k_cache, v_cache, layer)
    B, T, H, D = q.shape
    T_new = num_new                                                    # keys; T: queries
    K, S = k_cache.shape[1], k_cache.shape[2]
    G = H // K
    hi = lax.Precision.HIGHEST
    q5 = q.reshape(B, T, K, G, D).astype(jnp.float32)
    s = jnp.einsum("btkgd,bksd->bkgts", q5, k_cache.astype(jnp.float32), precision=hi)
    s = s * sm_scale                                                   # [B, K, G, T, S]
    slot = jnp.arange(S, dtype=jnp.int32)[None, :]                     # [1, S]
    L = lengths.astype(jnp.int32)[:, None]                             # [B, 1]
    ctx = slot < L
    if sink or window:
        ctx &= (slot < (sink or 0)) | (slot >= L - (window or 0))
    j = slot - L                                                       # new-token index
    is_new = (j >= 0) & (j < T_new)
    t = jnp.arange(T, dtype=jnp.int32)[None, :, None]                  # query t = new T_new-T+t
    if tree_mask is None:
        new_vis = j[:, None, :] <= t + (T_new - T)                     # [B, T, S]
    else:
        tm = jnp.broadcast_to(jnp.asarray(tree_mask, bool).reshape((-1, T, T_new)),
                              (B, T, T_new))
        new_vis = jnp.take_along_axis(
            tm, jnp.broadcast_to(jnp.clip(j, 0, T_new - 1)[:, None, :], (B, T, S)), axis=2)
    vis = ctx[:, None, :] | (is_new[:, None, :] & new_vis)             # [B, T, S]
    vis = vis[:, None, None]                                           # [B, 1, 1, T, S]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m_safe)
    l = jnp.sum(p, axis=-1)
    # Zero V rows no query may see (past length + T_new, or in the sparse gap), which may
    # hold garbage: 0 * NaN would be NaN. Scores were masked by select, not multiply.
    seen_slot = (ctx | is_new)[:, None, :, None]                       # [B, 1, S, 1]
    v = jnp.where(seen_slot, v_cache.astype(jnp.float32), 0.0)
    o = jnp.einsum("bkgts,bksd->bkgtd", p, v, precision=hi)
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.squeeze(m_safe, -1) + jnp.log(l)                         # -inf when l == 0
    o = o.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q.dtype)
    lse = lse.transpose(0, 3, 1, 2).reshape(B, T, H)
    return o, lse


def decode_attention_reference(q, k_cache, v_cache, lengths, tree_mask=None, *, layer=None,
                               sink=None, window=None, sm_scale=None, interpret=None,
                               block_sizes=None, num_new=None):
    """Plain-jnp decode attention; same contract as ``decode_attention``.

    Computes dense ``[B, K, G, T, S]`` float32 logits (memory heavy for long S and
    large T: for tests, CPU, and as a benchmark peer). ``interpret`` and
    ``block_sizes`` are accepted for signature compatibility and ignored.
    """
    del interpret, block_sizes
    T_new = check_decode_args(q, k_cache, v_cache, lengths, tree_mask, layer, num_new)
    sm_scale = resolve_sm_scale(sm_scale, q.shape[-1])
    return decode_reference_impl(q, k_cache, v_cache, lengths, tree_mask, layer,
                                 sink=int(sink or 0), window=int(window or 0),
                                 sm_scale=sm_scale, num_new=T_new)


def check_paged_decode_args(q, k_pages, v_pages, block_table, lengths, tree_mask, layer,
                            num_new=None):
    """Validates the shapes of a paged decode / verify call (``paged_decode_attention``);
    returns T_new."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, D], got {q.shape}")
    B, T, H, D = q.shape
    want_nd = 4 if layer is None else 5
    if k_pages.ndim != want_nd or v_pages.shape != k_pages.shape:
        want = "[NB, K, BS, D]" if layer is None else "[L, NB, K, BS, D] (with layer=)"
        raise ValueError(f"k_pages / v_pages must be {want}, got {k_pages.shape} / "
                         f"{v_pages.shape} (layer={layer!r})")
    if layer is not None and jnp.ndim(layer) != 0:
        raise ValueError(f"layer must be a scalar, got shape {jnp.shape(layer)}")
    NB, K, BS, Dk = k_pages.shape[-4:]
    if Dk != D or K == 0 or H % K:
        raise ValueError(f"shape mismatch: q {q.shape} (H must be a multiple of K), "
                         f"k_pages {k_pages.shape}")
    if NB == 0 or BS == 0:
        raise ValueError(f"k_pages needs at least one block of at least one slot, got "
                         f"{k_pages.shape}")
    if block_table.ndim != 2 or block_table.shape[0] != B or block_table.shape[1] == 0:
        raise ValueError(f"block_table must be [B, MB] = [{B}, MB >= 1], got "
                         f"{block_table.shape}")
    if not jnp.issubdtype(block_table.dtype, jnp.integer):
        raise ValueError(f"block_table must be integer, got {block_table.dtype}")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B]={B}, got {lengths.shape}")
    T_new = resolve_num_new(T, tree_mask, num_new)
    if tree_mask is not None and tree_mask.shape not in ((T, T_new), (B, T, T_new),
                                                         (1, T, T_new)):
        raise ValueError(f"tree_mask must be [T, T_new] or [B, T, T_new] with T = {T} "
                         f"queries, got {tree_mask.shape}")
    return T_new


def gather_pages(pages, block_table, layer=None):
    """Each sequence's blocks of a pool ``[(L,) NB, K, BS, D]`` in table order: a dense
    ``[B, K, MB * BS, D]`` cache (entries outside ``[0, NB)`` read a clamped block: callers
    mask those slots by length)."""
    if layer is not None:
        pages = lax.dynamic_index_in_dim(pages, layer, axis=0, keepdims=False)
    NB, K, BS, D = pages.shape
    B, MB = block_table.shape
    g = pages[jnp.clip(block_table.astype(jnp.int32), 0, NB - 1)]     # [B, MB, K, BS, D]
    return g.transpose(0, 2, 1, 3, 4).reshape(B, K, MB * BS, D)


@functools.partial(jax.jit, static_argnames=("sink", "window", "sm_scale", "num_new"))
def paged_decode_reference_impl(q, k_pages, v_pages, block_table, lengths, tree_mask, layer, *,
                                sink, window, sm_scale, num_new):
    """``paged_decode_attention_reference`` on checked arguments."""
    k = gather_pages(k_pages, block_table, layer)
    v = gather_pages(v_pages, block_table, layer)
    return decode_reference_impl(q, k, v, lengths, tree_mask, None, sink=sink, window=window,
                                 sm_scale=sm_scale, num_new=num_new)


def paged_decode_attention_reference(q, k_pages, v_pages, block_table, lengths, tree_mask=None,
                                     *, layer=None, sink=None, window=None, sm_scale=None,
                                     num_new=None, interpret=None, block_sizes=None):
    """Plain-jnp paged decode attention; same contract as ``paged_decode_attention``: the
    sequences' blocks gathered into a dense ``[B, K, MB * BS, D]`` cache (a copy of every
    block a table names), then ``decode_attention_reference``. ``interpret`` and
    ``block_sizes`` are accepted for signature compatibility and ignored."""
    del interpret, block_sizes
    T_new = check_paged_decode_args(q, k_pages, v_pages, block_table, lengths, tree_mask, layer,
                                    num_new)
    sm_scale = resolve_sm_scale(sm_scale, q.shape[-1])
    return paged_decode_reference_impl(q, k_pages, v_pages, block_table, lengths, tree_mask,
                                       layer, sink=int(sink or 0), window=int(window or 0),
                                       sm_scale=sm_scale, num_new=T_new)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def prefix_reference_impl(q, k_prefix, v_prefix, lengths, *, sm_scale):
    """``prefix_attention_reference`` on checked arguments: one layer ``[P, L, K, D]``,
    ``lengths[P]`` int32."""
    B, T, H, D = q.shape
    P, L, K, _ = k_prefix.shape
    G = H // K
    hi = lax.Precision.HIGHEST
    q6 = q.reshape(P, B // P, T, K, G, D).astype(jnp.float32)
    s = jnp.einsum("pbtkgd,plkd->pbtkgl", q6, k_prefix.astype(jnp.float32), precision=hi)
    s = s * sm_scale                                                   # [P, Bg, T, K, G, L]
    valid = jnp.arange(L, dtype=jnp.int32)[None, :] < lengths[:, None]  # [P, L]
    s = jnp.where(valid[:, None, None, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    p = jnp.exp(s - m_safe)
    l = jnp.sum(p, axis=-1)
    v = jnp.where(valid[:, :, None, None], v_prefix.astype(jnp.float32), 0.0)  # no 0 * NaN
    o = jnp.einsum("pbtkgl,plkd->pbtkgd", p, v, precision=hi)
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    lse = jnp.squeeze(m_safe, -1) + jnp.log(l)                         # -inf when l == 0
    return o.reshape(B, T, H, D).astype(q.dtype), lse.reshape(B, T, H)


def prefix_attention_reference(q, k_prefix, v_prefix, prefix_lengths=None, *, sm_scale=None,
                               interpret=None, block_sizes=None, layer=None):
    """Plain-jnp shared-prefix attention; same contract as ``prefix_attention``.

    Computes dense ``[P, B/P, T, K, G, L]`` float32 logits (for tests, CPU, and as
    a benchmark peer). ``interpret`` and ``block_sizes`` are accepted for
    signature compatibility and ignored.
    """
    del interpret, block_sizes
    check_prefix_args(q, k_prefix, v_prefix, prefix_lengths, layer)
    sm_scale = resolve_sm_scale(sm_scale, q.shape[-1])
    k_prefix, v_prefix = layer_slice(k_prefix, v_prefix, layer)
    lengths = prefix_lengths_or_full(prefix_lengths, k_prefix.shape[0], k_prefix.shape[1])
    return prefix_reference_impl(q, k_prefix, v_prefix, lengths, sm_scale=sm_scale)


def block_max_reference(q, k_cache, lengths, *, block: int, sm_scale=None, mask_queries=None):
    """``[B, K, cdiv(S, block)]`` float32: per row, KV head and block of ``block`` slots of
    ``k_cache`` ``[B, K, S, D]``, the largest logit ``q . k * sm_scale`` of any of the G query
    heads of the group and any of the T queries of ``q`` ``[B, T, H, D]`` over the block's
    context slots (``< lengths``); -inf for a block holding none. ``mask_queries`` [B, T]
    bool: the queries taken into account (default: all)."""
    B, T, H, D = q.shape
    K, S = k_cache.shape[1], k_cache.shape[2]
    G = H // K
    sm_scale = resolve_sm_scale(sm_scale, D)
    n = -(-S // block)
    qf = q.astype(jnp.float32).reshape(B, T, K, G, D)
    s = jnp.einsum("btkgd,bksd->bkgts", qf, k_cache.astype(jnp.float32)) * sm_scale
    if mask_queries is not None:
        s = jnp.where(mask_queries[:, None, None, :, None], s, -jnp.inf)
    s = jnp.max(s, axis=(2, 3))  # [B, K, S]
    slot = jnp.arange(S, dtype=jnp.int32)
    s = jnp.where(slot[None, None, :] < lengths.astype(jnp.int32)[:, None, None], s, -jnp.inf)
    if n * block != S:
        s = jnp.pad(s, ((0, 0), (0, 0), (0, n * block - S)), constant_values=-jnp.inf)
    return jnp.max(s.reshape(B, K, n, block), axis=-1)


def gather_blocks(c_LBKSD, layer, blocks_BKR, block: int, block_table=None):
    """``[B, K, R * block, D]``: the slots of each row's and KV head's blocks (a -1 block reads
    slot 0 of the row: masked by the caller). ``c_LBKSD``: a stacked dense cache, or a block
    pool ``[L, NB, K, BS, D]`` read through ``block_table`` [B, MB]."""
    B, K, R = blocks_BKR.shape
    slots = (jnp.maximum(blocks_BKR, 0)[..., None] * block
             + jnp.arange(block, dtype=jnp.int32)).reshape(B, K, R * block)
    b = jnp.arange(B, dtype=jnp.int32)[:, None, None]
    h = jnp.arange(K, dtype=jnp.int32)[None, :, None]
    if block_table is None:
        S = c_LBKSD.shape[3]
        return c_LBKSD[layer, b, h, jnp.minimum(slots, S - 1)]
    BS = c_LBKSD.shape[3]
    page = jnp.take_along_axis(block_table, (slots // BS).reshape(B, -1), axis=1)
    return c_LBKSD[layer, page.reshape(B, K, -1), h, slots % BS]


def retrieved_attention_reference(q_BTHD, k_LBKSD, v_LBKSD, layer, blocks_BKR, *, block: int,
                                  sm_scale=None, block_table=None, lo=None, hi=None):
    """``(out [B, T, H, D], lse [B, T, H] float32)`` of the T queries over the keys of their
    row's selected blocks (``blocks_BKR`` [B, K, R], -1: none), each visible to every query.
    ``lo`` / ``hi`` ([B] or scalars, None: no bound): only a block's slots in ``[lo, hi)`` count
    (what lies between a sparse view's sink and its window)."""
    B, T, H, D = q_BTHD.shape
    K, R = blocks_BKR.shape[1:]
    G = H // K
    sm_scale = resolve_sm_scale(sm_scale, D)
    k = gather_blocks(k_LBKSD, layer, blocks_BKR, block, block_table).astype(jnp.float32)
    v = gather_blocks(v_LBKSD, layer, blocks_BKR, block, block_table).astype(jnp.float32)
    ok = jnp.repeat(blocks_BKR >= 0, block, axis=-1)  # [B, K, N]
    slot = (blocks_BKR[..., None] * block + jnp.arange(block, dtype=jnp.int32)).reshape(B, K, -1)
    if lo is not None:
        ok &= slot >= jnp.reshape(jnp.asarray(lo, jnp.int32), (-1, 1, 1))
    if hi is not None:
        ok &= slot < jnp.reshape(jnp.asarray(hi, jnp.int32), (-1, 1, 1))
    q = q_BTHD.astype(jnp.float32).reshape(B, T, K, G, D)
    s = jnp.einsum("btkgd,bknd->bkgtn", q, k) * sm_scale
    s = jnp.where(ok[:, :, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe)  # 0 where masked
    den = jnp.sum(p, axis=-1, keepdims=True)
    v = jnp.where(ok[..., None], v, 0.0)
    o = jnp.einsum("bkgtn,bknd->bkgtd", p, v) / jnp.where(den > 0, den, 1.0)
    lse = jnp.where(den[..., 0] > 0, m_safe[..., 0] + jnp.log(jnp.maximum(den[..., 0], 1e-30)),
                    -jnp.inf)
    out = o.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q_BTHD.dtype)
    return out, lse.transpose(0, 3, 1, 2).reshape(B, T, H)
