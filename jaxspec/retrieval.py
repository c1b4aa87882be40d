"""Retrieval for the self-draft: K/V blocks chosen by the target's own attention.

A StreamingLLM self-draft reads the first ``sink`` and the last ``window`` context slots of each
row. With ``retrieve = R`` it also reads ``R / block`` whole blocks of ``block`` slots per row,
layer and KV head: the blocks on which the target's queries of the latest verification put the
largest logits (after SparseSpec / TriForce). The selection is refreshed after every
verification and holds for the next round's draft steps.

- **Scores** (`block_scores`): for each row, KV head and block of ``block`` context slots, the
  largest logit ``q . k * sm_scale`` of any query head of the group and any of the verified
  tokens over the block's context slots. The verification forward returns them per layer
  (`jaxspec.model.forward` with ``plan.score_block``).
- **Selection** (`select_blocks`): per row, layer and KV head the ``R / block`` best blocks among
  those lying wholly in ``[sink, min(verified, lengths - window))``: the context that both the
  verification scored and the sink and window do not cover. The window moves right as a row
  grows and the sink stays, so a selected block never overlaps either later: the three segments
  stay disjoint and merge exactly by log-sum-exp. Fewer eligible blocks than asked (a short
  context): the rest are -1 and read nothing.
- **Attention** (`retrieved_attention`): every query of a draft forward sees every key of its
  row's selected blocks (they lie before its window); the result merges with the sink + window
  part by log-sum-exp.

The draft is a proposal: whatever it reads, verification keeps the output exactly the target's
(greedy tokens, or the target's distribution when sampling).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# the scores: per row, KV head and block, the largest logit of the queries over the block
from pallas_kernels.reference import block_max_reference as block_scores

from jaxspec.paged import gather_view

RETRIEVE_BLOCK = 64  # context slots per retrieved block (the attention kernels' key block)


def layer_view(k_LBKSD, layer, block_table=None):
    """One layer's keys as ``[B, K, S, D]``: a slice of a stacked dense cache, or a block pool's
    rows gathered through their tables (``block_table`` [B, MB])."""
    if block_table is None:
        return jax.lax.dynamic_index_in_dim(k_LBKSD, layer, axis=0, keepdims=False)
    return gather_view(k_LBKSD, layer, block_table)


def select_blocks(scores_LBKN, verified, lengths, *, sink: int, window: int, block: int,
                  count: int):
    """``[B, L, K, count]`` int32: the ``count`` highest-scoring blocks per row, layer and KV head
    among those wholly in ``[sink, min(verified, lengths - window))`` (``verified``: the context
    the scores cover, ``lengths``: the context the next drafts start from; both [B]); -1 where
    fewer are eligible."""
    L, B, K, n = scores_LBKN.shape
    j = jnp.arange(n, dtype=jnp.int32)
    lo = -(-int(sink) // block)
    hi = jnp.minimum(verified.astype(jnp.int32), lengths.astype(jnp.int32) - int(window))
    hi = jnp.floor_divide(jnp.maximum(hi, 0), block)  # [B]: blocks j < hi end by then
    ok = (j[None, :] >= lo) & (j[None, :] < hi[:, None])  # [B, n]
    s = jnp.where(ok[None, :, None, :], scores_LBKN.astype(jnp.float32), -jnp.inf)
    c = min(int(count), n)
    vals, idx = jax.lax.top_k(s, c)  # [L, B, K, c]
    idx = jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)
    if c < count:
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, 0), (0, count - c)), constant_values=-1)
    return jnp.transpose(idx, (1, 0, 2, 3))


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


def retrieved_attention(q_BTHD, k_LBKSD, v_LBKSD, layer, blocks_BKR, *, block: int,
                        sm_scale=None, block_table=None):
    """``(out [B, T, H, D], lse [B, T, H] float32)`` of the T queries over the keys of their
    row's selected blocks (``blocks_BKR`` [B, K, R], -1: none), each visible to every query."""
    B, T, H, D = q_BTHD.shape
    K = blocks_BKR.shape[1]
    G = H // K
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    k = gather_blocks(k_LBKSD, layer, blocks_BKR, block, block_table).astype(jnp.float32)
    v = gather_blocks(v_LBKSD, layer, blocks_BKR, block, block_table).astype(jnp.float32)
    ok = jnp.repeat(blocks_BKR >= 0, block, axis=-1)  # [B, K, N]
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
