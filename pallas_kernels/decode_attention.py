"""Decode / verify attention over ragged KV caches: the contract, and its entry point.

One contract serves plain decode (T = 1), chain verification (T = gamma + 1), tree
verification (T = tree nodes, ancestor mask), token-tree drafting one level at a
time (T = the level's nodes, T_new = the nodes up to that level), the
StreamingLLM sparse draft (sink + window context) and chunked prefill (large T,
causal).

Layout (per layer): ``q[B, T, H, D]``, ``k_cache, v_cache[B, K, S, D]`` with
``H = G * K`` (query head ``h`` uses KV head ``h // G``); optionally layers are
stacked, ``[L, B, K, S, D]``, and ``layer`` picks one *inside* the kernel (no copy
of the layer's cache is made).

New tokens: a step appends ``T_new >= T`` new tokens per sequence, whose K/V are
in the cache at slots ``lengths[b] + j`` (``j < T_new``); the ``T = q.shape[1]``
queries are the LAST T of them: query ``t`` is new token ``T_new - T + t``.
``T_new`` is ``tree_mask.shape[-1]`` (``tree_mask`` ``[T, T_new]`` or
``[B, T, T_new]``: rows are queries, columns new tokens), else ``num_new``
(default T). ``T_new == T`` is plain decode / verify; ``T_new > T`` lets a
caller compute only some new tokens (e.g. one token-tree level) while the
earlier ones' K/V are already in the cache.

Keys seen by query ``t`` of sequence ``b``:
  * context slots ``[0, lengths[b])`` (sparse: only ``s < sink`` or
    ``s >= lengths[b] - window``),
  * new-token slot ``lengths[b] + j`` (j < T_new) iff ``tree_mask[t, j]``
    (``tree_mask=None``: causal, ``j <= t + T_new - T``).
Slots past ``lengths[b] + T_new`` are never read unmasked, so garbage there (NaN
included) cannot leak into results. Results are ``(out, lse)``: a query that saw no key
gets ``out = 0``, ``lse = -inf``, so partial results merge exactly (``merge``).

Where it is implemented:
  * ``dispatch.decode_attention``: the entry point (re-exported here and by the package),
    which picks the kernel (``dispatch.decode_route``);
  * ``triton_decode``: the Triton-lowered kernel (GPU; interpret mode anywhere);
  * ``hopper.verify_attention``: the Mosaic GPU wgmma kernel (Hopper GPUs, many rows);
  * ``tpu.tpu_decode_attention``: the Mosaic TPU kernel;
  * ``reference.decode_attention_reference``: the plain-jnp reference;
  * ``contracts``: the argument checks (``resolve_num_new``: T_new).
"""
from __future__ import annotations

from .contracts import resolve_num_new
from .dispatch import HOPPER_MIN_ROWS_VERIFY as HOPPER_MIN_ROWS
from .dispatch import decode_attention, decode_route
from .reference import decode_attention_reference
from .triton_decode import GPU_DEFAULTS, DecodeAttentionBlockSizes
from .triton_decode import plan as _plan

_GPU_DEFAULTS = GPU_DEFAULTS  # the name older scripts import

__all__ = ["DecodeAttentionBlockSizes", "GPU_DEFAULTS", "HOPPER_MIN_ROWS", "decode_attention",
           "decode_attention_reference", "decode_route", "resolve_num_new"]
