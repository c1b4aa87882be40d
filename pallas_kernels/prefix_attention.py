"""Shared-prefix attention (Hydragen): Pallas kernel + jnp reference.

When many sequences share a prefix (a system prompt, one document with many
questions, n samples of one prompt), plain decode attention reads the prefix K/V
once per sequence, as B matrix-vector products. Here the queries of all
sequences of a group meet the group's prefix once, as one matrix product:

Layout: ``q[B, T, H, D]``; ``k_prefix, v_prefix[P, L, K, D]``: P prefix groups
of up to L tokens, ``prefix_lengths[P]`` valid tokens each (default L; 0 is
allowed). The B sequences form P contiguous equal groups (``B % P == 0``):
sequence ``b`` belongs to group ``b // (B // P)``. ``H = G * K``: query head
``h`` uses KV head ``h // G``. Every query sees the whole valid prefix of its
group (no mask: the prefix lies before all of the group's tokens). Slots at or
past ``prefix_lengths[p]`` are never read unmasked, so garbage there (NaN
included) cannot leak.

Kernel structure (Triton-lowered ``pallas_call``; interpret mode on CPU):
  for each (group p, KV head k), the rows are all ``(b, t, g)`` triples of the
  group: ``R = (B/P) * T * G`` query rows (up to thousands) against one K/V
  stream. Grid ``(row_blocks, splits, P, K)``: one program owns ``block_q``
  rows and one split of the prefix (flash-decoding), streams K/V in ``block_k``
  slot blocks with an online softmax in base 2 (interior blocks unmasked, only
  the tail block masked). Row blocks are the fastest grid axis, so the
  programs that read the same K/V tile run together and share it through L2:
  each prefix byte comes from HBM about once per group. Splits are merged by
  log-sum-exp (``merge.merge_stacked``).

Defaults measured on an H200 (jax 0.11.2): benchmarks/prefix_attention.md.

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
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Triton-specific helpers (masked loads, compiler params).
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - a jax without the Triton backend
    plgpu = None

from .decode_attention import (_cdiv, _exp2, _is_nvidia, _next_pow2, _num_sms, head_tile,
                               load_rows, store_rows)
from . import hopper as _hopper
from .merge import merge_partials, merge_stacked
from .splits import split_range

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
_SMEM_BYTES = 220 * 1024  # H100/H200 allow 227 KiB per block; keep a margin.


@dataclasses.dataclass(frozen=True)
class PrefixAttentionBlockSizes:
    """Static tiling of the prefix kernel (None = chosen from the shapes).

    block_q: query rows ((b, t, g) triples of one group and KV head) per program
      (power of 2, >= 16); None: next power of 2 of the rows, clamped to
      [16, max_block_q].
    max_block_q: cap for the automatic block_q.
    block_k: prefix slots per inner step (power of 2, >= 16); None: 64 (less for
      a prefix under 64 slots). On GPU it is halved while the K/V pipeline
      buffers would not fit in shared memory.
    split_size: prefix slots per program (a multiple of block_k); None: on GPU
      the number of splits that best fills whole waves of programs over the SMs
      (each split at least ``min_split_size`` of the L slots); one split
      elsewhere. With None the splits divide each group's *valid* length
      (``prefix_lengths[p]``) evenly at run time, so a prefix cache padded past
      its prefix costs what its valid tokens cost.
    target_programs: None, or the number of programs that run at once (instead
      of the SM-count estimate) for the automatic split choice.
    num_splits: None, or this many splits (instead of the automatic choice);
      like the automatic splits they share each group's valid length at run time.
    num_warps / num_stages: Triton compiler parameters (ignored in interpret
      mode); num_warps None: 4 for block_q <= 64, else 8.
    fast_exp: on NVIDIA GPUs compute exp2 with one ``ex2.approx.ftz.f32``.
    """
    block_q: int | None = None
    max_block_q: int = 128
    block_k: int | None = None
    split_size: int | None = None
    target_programs: int | None = None
    min_split_size: int = 256
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int = 3
    fast_exp: bool = True


_GPU_DEFAULTS = PrefixAttentionBlockSizes()


@dataclasses.dataclass(frozen=True)
class _Static:
    L: int
    block_q: int
    block_k: int
    split_size: int
    num_splits: int
    dynamic_split: bool  # splits share each group's valid length (else: static split_size slots)
    has_layer: bool      # K/V stacked over layers [Lyr, P, L, K, D], the layer an input
    scale_log2: float
    fast_exp: bool
    D: int          # the head dim (the tiles hold head_tile(D) lanes; those past D masked)


def _prefix_kernel(layer_ref, lengths_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, c: _Static):
    _, si, p, h = (pl.program_id(i) for i in range(4))
    bq, bk = c.block_q, c.block_k
    lead = (layer_ref[0], p) if c.has_layer else (p,)

    head_dim = q_ref.shape[-1]                       # head_tile(D) lanes
    head_ok = None if head_dim == c.D else jnp.arange(head_dim, dtype=jnp.int32) < c.D
    q = load_rows(q_ref, None, None, head_ok)        # [bq, Dp]
    if q.dtype != k_ref.dtype:
        q = q.astype(k_ref.dtype)

    def step(carry, start, load_ok):
        """One online-softmax step over prefix slots [start, start + bk)."""
        acc, m, l = carry
        idx = (*lead, pl.ds(start, bk), h, slice(None))
        # masked where needed: slots past the prefix come back as 0 (no NaN), as do lanes past D
        k = load_rows(k_ref, idx, load_ok, head_ok)
        v = load_rows(v_ref, idx, load_ok, head_ok)
        # HIGHEST: float32 inputs use full-precision (not tf32) products on GPU;
        # for bf16 inputs it changes nothing.
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                            preferred_element_type=jnp.float32)   # raw logits
        # m is kept in base-2 units (logit * scale * log2 e). With a positive scale
        # the row max commutes with the scaling, so each score costs one fused
        # multiply-add (s * scale - m) before the exp2, not a multiply and a subtract.
        if c.scale_log2 <= 0:
            s = s * c.scale_log2
        if load_ok is not None:
            s = jnp.where(load_ok[None, :], s, -jnp.inf)
        if c.scale_log2 > 0:
            m_new = jnp.maximum(m, jnp.max(s, axis=1) * c.scale_log2)
        else:
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # A row that has seen no key keeps m = -inf; shift by 0 there so that
        # exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = NaN.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        if c.scale_log2 > 0:
            s = s * c.scale_log2 - m_safe[:, None]
        else:
            s = s - m_safe[:, None]
        prob = _exp2(s, c.fast_exp)
        l = l * alpha + jnp.sum(prob, axis=1)
        pv = lax.dot_general(prob.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=_HIGHEST, preferred_element_type=jnp.float32)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l

    length = jnp.clip(lengths_ref[p], 0, c.L)
    lo, hi = split_range(si, length, c)
    n = hi - lo
    n_full = lax.div(n, bk)
    carry = (jnp.zeros((bq, head_dim), jnp.float32),
             jnp.full((bq,), -jnp.inf, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    carry = lax.fori_loop(0, n_full, lambda i, cr: step(cr, lo + i * bk, None), carry)
    tail = lo + n_full * bk

    def tail_body(i, cr):
        return step(cr, tail, tail + jnp.arange(bk, dtype=jnp.int32) < hi)
    has_tail = (n - n_full * bk > 0).astype(jnp.int32)
    acc, m, l = lax.fori_loop(0, has_tail, tail_body, carry)

    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    store_rows(o_ref, (acc / l_safe[:, None]).astype(o_ref.dtype), head_ok)
    lse_ref[...] = jnp.where(seen, m * _LN2 + jnp.log(l_safe), -jnp.inf)


# A program's fixed cost (q load, pipeline fill, writing its partial result) in slots of key
# work of one block_q=128 row block. Fitted on an H100 (benchmarks/prefix_attention_h100_splits.md:
# Qwen2.5-1.5B shape, 22 / 44 / 66 splits of 16384 slots for 6 row blocks): about 700.
_FIXED_SLOTS = 700


def _choose_splits(base: int, max_splits: int, slots: int, L: int) -> int:
    """Splits per (row block, group, head) that best fill whole waves of programs.

    Cost model (in units of one program streaming all L slots): each wave of programs takes
    ``1 / n`` of that plus a fixed cost of ``_FIXED_SLOTS / L``, and each split adds a small
    charge for the partial results written and merged. (The first model, waves / n + 0.01 n,
    charged splits so much that a model with few KV heads ran on half the SMs: 56.5 -> 34.2 us
    for 6 row blocks over 16384 slots on an H100.)
    """
    fixed = _FIXED_SLOTS / max(L, 1)
    best, best_cost = 1, None
    for n in range(1, max(1, max_splits) + 1):
        cost = _cdiv(base * n, slots) * (1.0 / n + fixed) + 0.001 * n
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = n, cost
    return best


def _plan(P, K, rows, L, D, *, bs: PrefixAttentionBlockSizes, on_gpu: bool, itemsize: int):
    """Resolves automatic block sizes into concrete static numbers."""
    block_q = bs.block_q or min(max(16, _next_pow2(rows)), max(16, bs.max_block_q))
    block_k = bs.block_k or min(64, max(16, _next_pow2(L)))
    if on_gpu:  # K and V tiles for every pipeline stage, plus the q tile, in shared memory
        Dp = head_tile(D)
        while block_k > 16 and (2 * block_k * bs.num_stages + block_q) * Dp * itemsize > _SMEM_BYTES:
            block_k //= 2
    for name, val in (("block_k", block_k), ("block_q", block_q)):
        if val < 16 or val != _next_pow2(val):
            raise ValueError(f"{name}={val} must be a power of 2 >= 16")
    num_q_blocks = _cdiv(rows, block_q)
    L1 = max(L, 1)
    if bs.split_size is not None:
        if bs.split_size % block_k:
            raise ValueError(f"split_size={bs.split_size} must be a multiple of block_k={block_k}")
        split = bs.split_size
    elif bs.num_splits is not None:
        if bs.num_splits < 1:
            raise ValueError(f"num_splits={bs.num_splits} must be >= 1")
        split = _cdiv(_cdiv(L1, min(bs.num_splits, _cdiv(L1, block_k))), block_k) * block_k
    elif on_gpu or bs.target_programs:
        num_warps = bs.num_warps or (4 if block_q <= 64 else 8)
        slots = bs.target_programs or _num_sms() * (2 if num_warps <= 4 else 1)
        max_splits = max(1, L1 // max(bs.min_split_size, block_k))
        n = _choose_splits(num_q_blocks * P * K, max_splits, slots, L1)
        split = _cdiv(_cdiv(L1, n), block_k) * block_k
    else:
        split = _cdiv(L1, block_k) * block_k
    num_splits = max(1, _cdiv(L1, split))
    return block_q, block_k, split, num_splits, num_q_blocks


@functools.partial(jax.jit,
                   static_argnames=("sm_scale", "interpret", "block_sizes", "on_gpu"))
def _prefix_attention_kernel(q, k_prefix, v_prefix, prefix_lengths, layer, *, sm_scale,
                             interpret, block_sizes, on_gpu):
    B, T, H, D = q.shape
    P, L, K, _ = k_prefix.shape[-4:]
    has_layer = layer is not None
    G = H // K
    Bg = B // P
    rows = Bg * T * G
    block_q, block_k, split, num_splits, nq = _plan(
        P, K, rows, L, D, bs=block_sizes, on_gpu=on_gpu,
        itemsize=jnp.dtype(k_prefix.dtype).itemsize)
    rows_pad = nq * block_q
    if L < block_k:  # a tiny prefix: pad it to one block (its slots are masked anyway)
        pad = ((0, 0),) * (k_prefix.ndim - 3) + ((0, block_k - L), (0, 0), (0, 0))
        k_prefix, v_prefix = jnp.pad(k_prefix, pad), jnp.pad(v_prefix, pad)

    # Rows of one (group, KV head): r = (b_in_group * T + t) * G + g.
    q_PKRD = (q.reshape(P, Bg, T, K, G, D).transpose(0, 3, 1, 2, 4, 5)
              .reshape(P, K, rows, D))
    if rows_pad != rows:
        q_PKRD = jnp.pad(q_PKRD, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))

    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    # Tiles of head_tile(D) lanes; past D (a head dim that is not a power of 2) they are masked.
    Dp = head_tile(D)
    kv_block = (*k_prefix.shape[:-1], Dp)
    in_specs = [full((1,)), full((P,)),
                pl.BlockSpec((None, None, block_q, Dp), lambda qi, si, p, h: (p, h, qi, 0)),
                full(kv_block), full(kv_block)]
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((P, K, rows_pad, D), q.dtype),
                     jax.ShapeDtypeStruct((P, K, rows_pad), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, block_q, Dp), lambda qi, si, p, h: (p, h, qi, 0)),
                     pl.BlockSpec((None, None, block_q), lambda qi, si, p, h: (p, h, qi))]
    else:
        out_shape = [jax.ShapeDtypeStruct((P, K, num_splits, rows_pad, D), jnp.float32),
                     jax.ShapeDtypeStruct((P, K, num_splits, rows_pad), jnp.float32)]
        out_specs = [
            pl.BlockSpec((None, None, None, block_q, Dp), lambda qi, si, p, h: (p, h, si, qi, 0)),
            pl.BlockSpec((None, None, None, block_q), lambda qi, si, p, h: (p, h, si, qi))]

    static = _Static(L=L, block_q=block_q, block_k=block_k, split_size=split,
                     num_splits=num_splits, dynamic_split=block_sizes.split_size is None,
                     has_layer=has_layer, scale_log2=float(sm_scale) * _LOG2E,
                     fast_exp=bool(block_sizes.fast_exp and on_gpu and _is_nvidia()), D=D)
    compiler_params = None
    if not interpret and plgpu is not None:
        num_warps = block_sizes.num_warps or (4 if block_q <= 64 else 8)
        compiler_params = plgpu.CompilerParams(num_warps=num_warps,
                                               num_stages=block_sizes.num_stages)
    o, lse = pl.pallas_call(
        functools.partial(_prefix_kernel, c=static),
        grid=(nq, num_splits, P, K),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params,
        interpret=interpret,
        name="jaxspec_prefix_attention",
    )(jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1),
      prefix_lengths.astype(jnp.int32), q_PKRD, k_prefix, v_prefix)

    if num_splits > 1:
        o, lse = merge_stacked(o, lse, axis=2, out_dtype=q.dtype)
    o = (o[:, :, :rows].reshape(P, K, Bg, T, G, D).transpose(0, 2, 3, 1, 4, 5)
         .reshape(B, T, H, D))
    lse = (lse[:, :, :rows].reshape(P, K, Bg, T, G).transpose(0, 2, 3, 1, 4)
           .reshape(B, T, H))
    return o, lse


# The Hopper (Mosaic GPU) kernel serves a group from this many query rows (B/P x T x G) per
# KV head on a Hopper GPU (benchmarks/hopper_attention_h100_s9.md: at B=64, P=1, L=16384 it
# beats the Triton kernel 1.2x at T=1 and 1.4x at T=5; with fewer rows its 128-row tiles
# would be mostly padding).
HOPPER_MIN_ROWS = 256


def _hopper_choice(q, k_prefix, block_sizes, *, interpret, on_gpu):
    """The Hopper kernel's block sizes where it serves this call, else None: when asked for
    (``block_sizes`` a ``hopper.HopperBlockSizes``), or by default on a Hopper GPU for bf16/f16
    with at least ``HOPPER_MIN_ROWS`` rows per group and KV head."""
    B, T, H, D = q.shape
    P, L, K = k_prefix.shape[-4:-1]
    fits = (_hopper.supports(q.dtype, D) and k_prefix.dtype == q.dtype and L % 8 == 0)
    if isinstance(block_sizes, _hopper.HopperBlockSizes):
        _hopper.check_requested(fits, f"bf16/f16 q and prefix of one dtype with D % 64 == 0 and "
                                f"L % 8 == 0; got {q.dtype}/{k_prefix.dtype}, D={D}, L={L}",
                                interpret)
        return block_sizes
    if (block_sizes is None and on_gpu and not interpret and fits
        and (B // P) * T * (H // K) >= HOPPER_MIN_ROWS and _hopper.default_block_sizes(D) is not None
        and _hopper.available()):
        return _hopper.default_block_sizes(D)
    return None


@functools.partial(jax.jit, static_argnames=("sm_scale", "hopper_sizes", "interpret",
                                             "partials"))
def _prefix_attention_hopper(q, k_prefix, v_prefix, lengths, layer, *, sm_scale, hopper_sizes,
                             interpret, partials=False):
    """``prefix_attention`` through the Hopper kernel: the rows of each (group, KV head) as one
    matrix against its prefix (a stacked layer read in place), key splits merged by
    log-sum-exp (``hopper.attention``), or with ``partials`` returned unmerged on a leading
    axis. Where G allows (``hopper.q_groups_in_place``: G in {1, 2, 4, 8} at 64-row
    warpgroups, {1, 2, 4, 8, 16} at 128-row ones) the kernel reads q and writes out in place,
    q[B, T, H, D] viewed as [P, B/P x T, H, D] (no transposes); other G go through transposed
    rows."""
    B, T, H, D = q.shape
    P, L, K, _ = k_prefix.shape[-4:]
    G, Bg = H // K, B // P
    lengths = jnp.clip(lengths, 0, L)
    kw = dict(kv_layout="PLKD", sm_scale=sm_scale, block_sizes=hopper_sizes, layer=layer,
              interpret=interpret, merge=not partials)
    if _hopper.q_groups_in_place(G, hopper_sizes):
        o, lse = _hopper.attention(q.reshape(P, Bg * T, H, D), k_prefix, v_prefix, lengths,
                                   q_layout="BTHD", **kw)
        lead = o.shape[:1] if partials else ()
        return o.reshape(lead + (B, T, H, D)), lse.reshape(lead + (B, T, H))
    rows = Bg * T * G
    tile = hopper_sizes.rows_per_program
    rows_pad = _cdiv(rows, tile) * tile
    q_PKRD = (q.reshape(P, Bg, T, K, G, D).transpose(0, 3, 1, 2, 4, 5).reshape(P, K, rows, D))
    if rows_pad != rows:
        q_PKRD = jnp.pad(q_PKRD, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))
    o, lse = _hopper.attention(q_PKRD, k_prefix, v_prefix, lengths, **kw)
    if not partials:  # one "split" axis of 1 for the shared reshapes below
        o, lse = o[None], lse[None]
    S = o.shape[0]
    o = (o[:, :, :, :rows].reshape(S, P, K, Bg, T, G, D).transpose(0, 1, 3, 4, 2, 5, 6)
         .reshape(S, B, T, H, D))
    lse = (lse[:, :, :, :rows].reshape(S, P, K, Bg, T, G).transpose(0, 1, 3, 4, 2, 5)
           .reshape(S, B, T, H))
    return (o, lse) if partials else (o[0], lse[0])


def _check_shapes(q, k_prefix, v_prefix, prefix_lengths, layer=None):
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


def _lengths(prefix_lengths, P, L):
    if prefix_lengths is None:
        return jnp.full((P,), L, jnp.int32)
    return jnp.asarray(prefix_lengths).astype(jnp.int32)


def _layer_slice(k_prefix, v_prefix, layer):
    """The one layer of stacked prefix K/V (a copy: only for the paths that need one array)."""
    if layer is None:
        return k_prefix, v_prefix
    return (lax.dynamic_index_in_dim(k_prefix, layer, axis=0, keepdims=False),
            lax.dynamic_index_in_dim(v_prefix, layer, axis=0, keepdims=False))


def prefix_attention(q, k_prefix, v_prefix, prefix_lengths=None, *, sm_scale=None,
                     interpret=None, block_sizes=None, layer=None, partials=False):
    """Attention of every query over its group's shared prefix (Hydragen).

    Args:
      q: ``[B, T, H, D]`` queries; sequences ``[p * B/P, (p + 1) * B/P)`` form
        group ``p``.
      k_prefix, v_prefix: ``[P, L, K, D]`` prefix keys (after RoPE) and values of
        the P groups; ``H`` must be a multiple of ``K``.
      prefix_lengths: ``[P]`` int32 valid prefix tokens per group (default L;
        values are clipped to [0, L]).
      layer: None, or an int32 scalar (may be traced) when ``k_prefix``/``v_prefix``
        are stacked over layers, ``[layers, P, L, K, D]``: the Triton kernel then
        reads that layer in place (slicing it out first would copy it every call).
      sm_scale: logit scale (default ``1/sqrt(D)``).
      interpret: None: kernel on GPU, the Mosaic kernel (``tpu.py``) on TPU,
        reference on CPU; True: the portable kernel in Pallas interpret mode (any
        backend); False: as None.
      block_sizes: ``PrefixAttentionBlockSizes`` (None: defaults), or on TPU a
        ``TPUPrefixBlockSizes``, or a ``hopper.HopperBlockSizes`` for the Hopper (Mosaic GPU,
        wgmma) kernel (bf16/f16, D % 64 == 0, L % 8 == 0; with ``interpret=True`` it runs in
        the Mosaic GPU interpreter). None on a Hopper GPU picks that kernel for groups of at
        least ``HOPPER_MIN_ROWS`` query rows per KV head.

      partials: return the kernel's key splits unmerged, ``(out [S, B, T, H, D] in q.dtype,
        lse [S, B, T, H] float32)`` with S >= 1 (1 where the kernel has no splits), for a
        caller that merges them with the suffix part in one pass (``merge.merge_partials``
        over the concatenation): one merge instead of two. The engine does this.

    Returns:
      ``(out [B, T, H, D] in q.dtype, lse [B, T, H] float32)``; queries of a group
      with an empty prefix get ``out = 0`` and ``lse = -inf``.
    """
    # every path but the Hopper kernel's gives one partial
    one = (lambda r: (r[0][None], r[1][None])) if partials else (lambda r: r)
    _check_shapes(q, k_prefix, v_prefix, prefix_lengths, layer)
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    from . import tpu as _tpu
    backend = _tpu.dispatch_platform()   # the default backend, or tpu.target_platform's
    on_gpu = backend in ("gpu", "cuda", "rocm")
    # TPU: like decode_attention, this Triton-shaped kernel (whole-array refs,
    # masked pointer loads) gives way to the Mosaic TPU kernel of pallas_kernels/tpu.py.
    if backend == "tpu" and not interpret:
        k_prefix, v_prefix = _layer_slice(k_prefix, v_prefix, layer)
        return one(_tpu.tpu_prefix_attention(
            q, k_prefix, v_prefix, prefix_lengths, sm_scale=sm_scale,
            block_sizes=block_sizes if isinstance(block_sizes, _tpu.TPUPrefixBlockSizes) else None))
    use_kernel = bool(interpret) or (on_gpu and plgpu is not None)
    lengths = _lengths(prefix_lengths, *k_prefix.shape[-4:-2])
    if not use_kernel:
        return one(_reference(q, *_layer_slice(k_prefix, v_prefix, layer), lengths,
                              sm_scale=sm_scale))
    hop = _hopper_choice(q, k_prefix, block_sizes, interpret=bool(interpret), on_gpu=on_gpu)
    if hop is not None:
        return _prefix_attention_hopper(q, k_prefix, v_prefix, lengths, layer, sm_scale=sm_scale,
                                        hopper_sizes=hop, interpret=bool(interpret),
                                        partials=bool(partials))
    if block_sizes is None or isinstance(block_sizes, _hopper.HopperBlockSizes):
        block_sizes = _GPU_DEFAULTS
    return one(_prefix_attention_kernel(
        q, k_prefix, v_prefix, lengths, layer, sm_scale=sm_scale, interpret=bool(interpret),
        block_sizes=block_sizes, on_gpu=on_gpu and not interpret))


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def _reference(q, k_prefix, v_prefix, lengths, *, sm_scale):
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
    _check_shapes(q, k_prefix, v_prefix, prefix_lengths, layer)
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    k_prefix, v_prefix = _layer_slice(k_prefix, v_prefix, layer)
    lengths = _lengths(prefix_lengths, k_prefix.shape[0], k_prefix.shape[1])
    return _reference(q, k_prefix, v_prefix, lengths, sm_scale=sm_scale)


def multi_level_prefix_attention(q, levels: Sequence, *, sm_scale=None, interpret=None,
                                 block_sizes=None, reference: bool = False):
    """Attention over a tree of shared prefixes, as a list of levels.

    Each level is ``(k, v, lengths)`` with ``k, v[P_i, L_i, K, D]`` and its own
    group count ``P_i`` (``B % P_i == 0``; ``lengths`` may be None = full). E.g.
    level 0: one system prompt for everyone (``P = 1``); level 1: one document
    per group of questions (``P = number of documents``). A query sees every
    level's valid prefix of its group; the per-level results (each kernel's key splits
    unmerged) are merged in one pass (exact; empty levels contribute nothing).

    Merge the result with the per-sequence suffix part exactly like a single
    prefix level (see the module docstring).

    Args:
      q: ``[B, T, H, D]``.
      levels: sequence of ``(k, v, lengths)`` tuples (at least one).
      sm_scale, interpret, block_sizes: passed to every ``prefix_attention``
        call (``block_sizes`` may also be a sequence, one per level).
      reference: use ``prefix_attention_reference`` for every level.

    Returns:
      ``(out [B, T, H, D] in q.dtype, lse [B, T, H] float32)``.
    """
    levels = list(levels)
    if not levels:
        raise ValueError("need at least one prefix level")
    if block_sizes is None or isinstance(block_sizes, PrefixAttentionBlockSizes):
        block_sizes = [block_sizes] * len(levels)
    if len(block_sizes) != len(levels):
        raise ValueError(f"{len(block_sizes)} block sizes for {len(levels)} levels")
    outs, lses = [], []  # partial attentions [S, B, T, H(, D)]: each level's key splits unmerged
    for level, bs in zip(levels, block_sizes):
        if len(level) != 3:
            raise ValueError("each level must be a (k, v, lengths) tuple")
        k, v, lengths = level
        if reference:
            o, l = prefix_attention_reference(q, k, v, lengths, sm_scale=sm_scale)
            o, l = o[None], l[None]
        else:
            o, l = prefix_attention(q, k, v, lengths, sm_scale=sm_scale, interpret=interpret,
                                    block_sizes=bs, partials=True)
        outs.append(o)
        lses.append(l)
    return merge_partials(outs, lses, q.dtype)
