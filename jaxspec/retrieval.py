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
  those reaching into ``[sink, min(verified, lengths - window))``: the context that both the
  verification scored and the sink and window do not cover. Fewer eligible blocks than asked (a
  short context): the rest are -1 and read nothing. Before a row's first verification (a new
  sequence) nothing is selected: its drafts then read the blocks just before the window
  (`with_recent`), i.e. the StreamingLLM view of ``window + R`` recent slots.
- **Attention** (`retrieved_attention`, and the kernels in place): every query of a draft
  forward sees the keys of its row's selected blocks that lie between the sink and the window
  of that forward (a block may reach into either, whose keys are counted there, and the window
  moves right as the row grows), so the three segments stay disjoint and merge exactly by
  log-sum-exp.

The draft is a proposal: whatever it reads, verification keeps the output exactly the target's
(greedy tokens, or the target's distribution when sampling).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

# the scores: per row, KV head and block, the largest logit of the queries over the block
from pallas_kernels.reference import block_max_reference as block_scores
# the draft's attention over the retrieved blocks alone (the kernels read them in place)
from pallas_kernels.reference import retrieved_attention_reference as retrieved_attention

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
    among those reaching into ``[sink, min(verified, lengths - window))`` (``verified``: the
    context the scores cover, ``lengths``: the context the next drafts start from; both [B]); -1
    where fewer are eligible."""
    L, B, K, n = scores_LBKN.shape
    j = jnp.arange(n, dtype=jnp.int32)
    lo = int(sink) // block  # the first block reaching past the sink
    hi = jnp.minimum(verified.astype(jnp.int32), lengths.astype(jnp.int32) - int(window))
    hi = -jnp.floor_divide(-jnp.maximum(hi, 0), block)  # [B]: blocks j < hi start before it
    ok = (j[None, :] >= lo) & (j[None, :] < hi[:, None])  # [B, n]
    s = jnp.where(ok[None, :, None, :], scores_LBKN.astype(jnp.float32), -jnp.inf)
    c = min(int(count), n)
    vals, idx = jax.lax.top_k(s, c)  # [L, B, K, c]
    idx = jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)
    if c < count:
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, 0), (0, count - c)), constant_values=-1)
    return jnp.transpose(idx, (1, 0, 2, 3))


def with_recent(blocks_BLKR, lengths, *, sink: int, window: int, block: int):
    """``blocks_BLKR`` [B, L, K, R] where a row, layer and KV head has something selected; where
    nothing is (all -1: no verification has scored the row yet), the R blocks just before the
    window of context ``lengths`` [B] (newest first; -1 past the sink), so that a new row's first
    drafts read a window of about ``window + R * block`` recent slots rather than ``window``."""
    R = blocks_BLKR.shape[-1]
    hi = -jnp.floor_divide(-jnp.maximum(lengths.astype(jnp.int32) - int(window), 0), block)
    j = hi[:, None] - 1 - jnp.arange(R, dtype=jnp.int32)[None, :]  # [B, R]
    recent = jnp.where(j >= int(sink) // block, j, -1)
    empty = jnp.all(blocks_BLKR < 0, axis=-1, keepdims=True)  # [B, L, K, 1]
    return jnp.where(empty, recent[:, None, None, :], blocks_BLKR)
