"""The attention contracts' argument rules and the query-row layout every kernel uses.

Two contracts (``decode_attention.py`` and ``prefix_attention.py`` describe them in full):

* **decode / verify**: ``q[B, T, H, D]`` over a ragged cache ``[(L,) B, K, S, D]`` with
  ``lengths[B]``; the T queries are the last T of ``T_new >= T`` new tokens, under a causal or
  a tree mask (``[T, T_new]`` or ``[B, T, T_new]``), optionally over a sparse context (sink +
  window);
* **shared prefix**: ``q[B, T, H, D]`` over ``[(L,) P, L, K, D]`` prefixes of P contiguous
  equal groups of sequences, with ``prefix_lengths[P]``.

Every implementation (the references, the Triton, Mosaic TPU and Hopper kernels) checks its
arguments here, so they all reject the same inputs with the same messages.

Query rows: a kernel program works on all query heads of one KV head at once. For decode the
rows of ``(sequence b, KV head k)`` are ``r = t * G + g``; for a shared prefix the rows of
``(group p, KV head k)`` are ``r = (b_in_group * T + t) * G + g``. ``tokens_to_rows`` and
``rows_to_tokens`` convert between ``[B, T, H, D]`` and those rows.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax


def resolve_sm_scale(sm_scale, D: int) -> float:
    """The logit scale: ``sm_scale`` as a float, default ``1 / sqrt(D)``."""
    return float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(D)


def resolve_num_new(T, tree_mask, num_new):
    """T_new: the mask's last dim, else ``num_new``, else T (checked >= T). Shared with the
    plain-`jnp` paths of `jaxspec.attention`."""
    if tree_mask is not None:
        T_new = int(tree_mask.shape[-1])
        if num_new is not None and int(num_new) != T_new:
            raise ValueError(f"num_new={num_new} differs from tree_mask's {T_new} columns")
    else:
        T_new = T if num_new is None else int(num_new)
    if T_new < T:
        raise ValueError(f"{T} queries but only {T_new} new tokens (num_new / tree_mask "
                         "columns must be >= T: the queries are the last T new tokens)")
    return T_new


def check_decode_args(q, k_cache, v_cache, lengths, tree_mask, layer, num_new=None):
    """Validates the shapes of a decode / verify call; returns T_new."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, D], got {q.shape}")
    B, T, H, D = q.shape
    want_nd = 4 if layer is None else 5
    if k_cache.ndim != want_nd or v_cache.shape != k_cache.shape:
        raise ValueError(f"k/v cache must be {'[L, ' if layer is not None else '['}B, K, S, D], "
                         f"got {k_cache.shape} / {v_cache.shape} (layer={layer!r})")
    _, Bk, K, S, Dk = k_cache.shape[-5:] if layer is not None else (None, *k_cache.shape)
    if Bk != B or Dk != D or H % K:
        raise ValueError(f"shape mismatch: q {q.shape}, cache {k_cache.shape}")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B]={B}, got {lengths.shape}")
    T_new = resolve_num_new(T, tree_mask, num_new)
    if tree_mask is not None and tree_mask.shape not in ((T, T_new), (B, T, T_new),
                                                         (1, T, T_new)):
        raise ValueError(f"tree_mask must be [T, T_new] or [B, T, T_new] with T = {T} "
                         f"queries, got {tree_mask.shape}")
    return T_new


def check_prefix_args(q, k_prefix, v_prefix, prefix_lengths, layer=None):
    """Validates the shapes of a shared-prefix call."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, D], got {q.shape}")
    nd = 4 if layer is None else 5
    if k_prefix.ndim != nd or v_prefix.shape != k_prefix.shape:
        want = "[P, L, K, D]" if layer is None else "[layers, P, L, K, D] (with layer=)"
        raise ValueError(f"k/v prefix must be {want}, got {k_prefix.shape} / {v_prefix.shape}")
    if layer is not None and jnp.ndim(layer) != 0:
        raise ValueError(f"layer must be a scalar, got shape {jnp.shape(layer)}")
    B, T, H, D = q.shape
    P, L, K, Dk = k_prefix.shape[-4:]
    if Dk != D or K == 0 or H % K:
        raise ValueError(f"shape mismatch: q {q.shape} (H must be a multiple of K), "
                         f"prefix {k_prefix.shape}")
    if P == 0 or B % P:
        raise ValueError(f"batch {B} must split into P={P} equal groups (B % P == 0): "
                         f"q {q.shape}, prefix {k_prefix.shape}")
    if prefix_lengths is not None and tuple(prefix_lengths.shape) != (P,):
        raise ValueError(f"prefix_lengths must be [P]={P}, got {prefix_lengths.shape}")


def prefix_lengths_or_full(prefix_lengths, P: int, L: int):
    """``prefix_lengths`` as int32, or ``[L] * P`` (every prefix full) for None."""
    if prefix_lengths is None:
        return jnp.full((P,), L, jnp.int32)
    return jnp.asarray(prefix_lengths).astype(jnp.int32)


def layer_slice(k, v, layer):
    """The one layer of K/V stacked over layers (a copy: only for the paths that need one
    array); ``layer`` None: k, v as they are."""
    if layer is None:
        return k, v
    return (lax.dynamic_index_in_dim(k, layer, axis=0, keepdims=False),
            lax.dynamic_index_in_dim(v, layer, axis=0, keepdims=False))


def layer_operand(layer):
    """The layer index as the kernels take it: a 1-element int32 array (0 without layers);
    ``layer`` may be traced."""
    return jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)


def tokens_to_rows(q, K: int, groups: int | None = None):
    """``q[B, T, H, D]`` as query rows ``[N, K, R, D]``: per sequence (``groups`` None: N = B,
    R = T * G, row ``t * G + g``) or per prefix group (N = ``groups`` = P, R = B/P * T * G,
    row ``(b_in_group * T + t) * G + g``)."""
    B, T, H, D = q.shape
    G = H // K
    if groups is None:
        return q.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, D)
    P = groups
    Bg = B // P
    return (q.reshape(P, Bg, T, K, G, D).transpose(0, 3, 1, 2, 4, 5)
            .reshape(P, K, Bg * T * G, D))


def pad_rows(x, rows_pad: int):
    """``x[..., R, D]`` with zero rows appended up to ``rows_pad``."""
    widths = ((0, 0),) * (x.ndim - 2) + ((0, rows_pad - x.shape[-2]), (0, 0))
    return jnp.pad(x, widths)


def rows_to_tokens(o, lse, B: int, T: int, G: int, grouped: bool = False):
    """The inverse of ``tokens_to_rows`` for a kernel's results ``o[..., N, K, R_pad, D]`` and
    ``lse[..., N, K, R_pad]`` (any leading axes, e.g. key splits; padding rows dropped):
    ``(o[..., B, T, H, D], lse[..., B, T, H])``. ``grouped``: the rows are per prefix group."""
    n = o.ndim - 4
    lead = o.shape[:n]
    ax = tuple(range(n))
    N, K, D = o.shape[n], o.shape[n + 1], o.shape[-1]
    H = K * G
    if not grouped:
        rows = T * G
        o = (o[..., :rows, :].reshape(lead + (B, K, T, G, D))
             .transpose(ax + tuple(n + i for i in (0, 2, 1, 3, 4))).reshape(lead + (B, T, H, D)))
        lse = (lse[..., :rows].reshape(lead + (B, K, T, G))
               .transpose(ax + tuple(n + i for i in (0, 2, 1, 3))).reshape(lead + (B, T, H)))
        return o, lse
    P, Bg = N, B // N
    rows = Bg * T * G
    o = (o[..., :rows, :].reshape(lead + (P, K, Bg, T, G, D))
         .transpose(ax + tuple(n + i for i in (0, 2, 3, 1, 4, 5))).reshape(lead + (B, T, H, D)))
    lse = (lse[..., :rows].reshape(lead + (P, K, Bg, T, G))
           .transpose(ax + tuple(n + i for i in (0, 2, 3, 1, 4))).reshape(lead + (B, T, H)))
    return o, lse
