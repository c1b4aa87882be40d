"""Exact merging of partial attention results by their log-sum-exp.

Attention of a query over a key set that is the disjoint union of segments
(shared prefix / own suffix, context / new tokens, flash-decoding splits) is a
convex combination of the attentions over each segment, weighted by each
segment's softmax mass ``exp(lse_i)``:

    m   = max_i lse_i
    w_i = exp(lse_i - m)
    out = sum_i w_i * out_i / sum_i w_i
    lse = m + log(sum_i w_i)

A segment a query saw no key of has ``lse = -inf`` and contributes nothing; if
every segment is empty the result is ``out = 0``, ``lse = -inf``. No NaN is ever
produced, also not for lse gaps far beyond float range (``exp(-1e4) == 0``), nor
when an empty segment's ``out`` holds NaN.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def merge_stacked(out_N, lse_N, axis: int = 0, out_dtype=None):
    """Merges partial attentions stacked along ``axis``.

    Args:
      out_N: ``[..., N, ..., D]`` partial outputs (each normalised over its own
        segment); the merge axis is ``axis`` and the last axis is the head dim.
      lse_N: the matching log-sum-exps, ``out_N.shape[:-1]``, any float dtype.
      axis: the stacking axis (in ``lse_N``'s numbering; must not be the last
        axis of ``out_N``).
      out_dtype: dtype of the merged output (default: ``out_N.dtype``).

    Returns:
      ``(out, lse)`` with the stacking axis removed; ``lse`` is float32.
    """
    out_dtype = out_N.dtype if out_dtype is None else out_dtype
    axis = axis % lse_N.ndim
    lse_N = lse_N.astype(jnp.float32)
    m = jnp.max(lse_N, axis=axis, keepdims=True)
    # All segments empty (m = -inf): shift by 0 so exp(-inf - 0) = 0, not NaN.
    m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
    w = jnp.exp(lse_N - m_safe)                       # 0 for empty segments
    den = jnp.sum(w, axis=axis)
    # where, not multiply: an empty segment's out may be NaN and 0 * NaN = NaN.
    contrib = jnp.where(w[..., None] > 0, w[..., None] * out_N.astype(jnp.float32), 0.0)
    num = jnp.sum(contrib, axis=axis)
    out = num / jnp.where(den > 0, den, 1.0)[..., None]
    lse = jnp.squeeze(m_safe, axis) + jnp.log(den)    # log(0) = -inf for empty
    return out.astype(out_dtype), lse


def merge_partials(outs: Sequence[jax.Array], lses: Sequence[jax.Array], out_dtype):
    """``merge_stacked`` over several stacks of partial attentions, each ``[S_i, ..., D]`` with
    its ``lses[i]`` ``[S_i, ...]`` (e.g. a kernel's unmerged key splits beside a suffix part
    given as ``out[None]``): one merge of all of them."""
    out_N = jnp.concatenate([o.astype(jnp.float32) for o in outs], axis=0)
    lse_N = jnp.concatenate([l.astype(jnp.float32) for l in lses], axis=0)
    return merge_stacked(out_N, lse_N, axis=0, out_dtype=out_dtype)


def merge_attention_states(outs: Sequence[jax.Array], lses: Sequence[jax.Array]):
    """Merges partial attentions over disjoint key segments, exactly.

    Args:
      outs: sequence of ``[..., D]`` arrays (e.g. ``[B, T, H, D]``), each the
        attention output over one key segment (0 where the segment was empty).
      lses: sequence of the matching ``[...]`` log-sum-exps (natural log,
        ``-inf`` for a query that saw no key of that segment).

    Returns:
      ``(out, lse)``: ``out`` in ``outs[0].dtype``, ``lse`` float32.
    """
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"need as many outs as lses, at least one: {len(outs)} vs {len(lses)}")
    if len(outs) == 1:
        return outs[0], lses[0].astype(jnp.float32)
    out_dtype = outs[0].dtype
    out_N = jnp.stack([o.astype(jnp.float32) for o in outs], axis=0)
    lse_N = jnp.stack([l.astype(jnp.float32) for l in lses], axis=0)
    return merge_stacked(out_N, lse_N, axis=0, out_dtype=out_dtype)
