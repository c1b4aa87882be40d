"""Shared-prefix attention (Hydragen): the contract, and its entry points.

When many sequences share a prefix (a system prompt, one document with many
questions, n samples of one prompt), plain decode attention reads the prefix K/V
once per sequence, as B matrix-vector products. Here the queries of all
sequences of a group meet the group's prefix once, as one matrix product.

Layout: ``q[B, T, H, D]``; ``k_prefix, v_prefix[P, L, K, D]``: P prefix groups
of up to L tokens, ``prefix_lengths[P]`` valid tokens each (default L; 0 is
allowed). The B sequences form P contiguous equal groups (``B % P == 0``):
sequence ``b`` belongs to group ``b // (B // P)``. ``H = G * K``: query head
``h`` uses KV head ``h // G``. Every query sees the whole valid prefix of its
group (no mask: the prefix lies before all of the group's tokens). Slots at or
past ``prefix_lengths[p]`` are never read unmasked, so garbage there (NaN
included) cannot leak. Optionally K/V are stacked over layers and ``layer`` picks one.

Returns ``(out[B, T, H, D] in q.dtype, lse[B, T, H] float32)`` (natural log; a
query whose group has an empty prefix gets ``out = 0``, ``lse = -inf``) so the
result merges exactly with attention over the other key segments.

Composing with a sequence's own keys (the suffix: its prompt tail and generated
tokens, in a per-sequence cache ``[B, K, S, D]``), exactly::

    o_pre, lse_pre = prefix_attention(q, k_prefix, v_prefix, prefix_lengths)
    o_suf, lse_suf = decode_attention(q, k_suffix, v_suffix, suffix_lengths,
                                      tree_mask)          # causal / tree mask here
    out, lse = merge_attention_states([o_pre, o_suf], [lse_pre, lse_suf])

RoPE positions of the suffix keys and of ``q`` continue after the prefix
(position = prefix length + suffix slot); the kernels never look at positions.
A tree of prefixes (one system prompt for all, then a document per group, ...)
is a list of levels, each with its own P: ``multi_level_prefix_attention``.
Merging is associative, so its result merges with the suffix part the same way.

Where it is implemented:
  * ``dispatch.prefix_attention`` / ``dispatch.multi_level_prefix_attention``: the entry
    points (re-exported here and by the package), which pick the kernel
    (``dispatch.prefix_route``);
  * ``triton_prefix``: the Triton-lowered kernel (GPU; interpret mode anywhere);
  * ``hopper.prefix_attention``: the Mosaic GPU wgmma kernel (Hopper GPUs, many rows);
  * ``tpu.tpu_prefix_attention``: the Mosaic TPU kernel;
  * ``reference.prefix_attention_reference``: the plain-jnp reference.
"""
from __future__ import annotations

from .dispatch import HOPPER_MIN_ROWS_PREFIX as HOPPER_MIN_ROWS
from .dispatch import multi_level_prefix_attention, prefix_attention, prefix_route
from .reference import prefix_attention_reference
from .triton_prefix import GPU_DEFAULTS, PrefixAttentionBlockSizes
from .triton_prefix import plan as _plan

_GPU_DEFAULTS = GPU_DEFAULTS  # the name older scripts import

__all__ = ["GPU_DEFAULTS", "HOPPER_MIN_ROWS", "PrefixAttentionBlockSizes",
           "multi_level_prefix_attention", "prefix_attention", "prefix_attention_reference",
           "prefix_route"]
