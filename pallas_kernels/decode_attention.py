"""Decode / verify attention over ragged KV caches: Pallas kernel + jnp reference.

One kernel serves plain decode (T = 1), chain verification (T = gamma + 1), tree
verification (T = tree nodes, ancestor mask), token-tree drafting one level at a
time (T = the level's nodes, T_new = the nodes up to that level), the
StreamingLLM sparse draft (sink + window context) and chunked prefill (large T,
causal).

Layout (per layer): ``q[B, T, H, D]``, ``k_cache, v_cache[B, K, S, D]`` with
``H = G * K`` (query head ``h`` uses KV head ``h // G``); optionally layers are
stacked, ``[L, B, K, S, D]``, and ``layer`` picks one *inside* the kernel (no copy
of the layer's cache is made; the index is read from a 1-element int32 array).

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
included) cannot leak into results.

Kernel structure (Triton-lowered ``pallas_call``; interpret mode on CPU):
  grid ``(q_blocks, splits, B, K)``. One program owns one KV head of one
  sequence, a block of ``block_q`` query rows (rows are ``(t, g)`` pairs, all G
  query heads of the KV head times all T tokens: each K/V byte is read once per
  row block), and one split of the (virtual, i.e. sink+window-compacted) context
  (flash-decoding). It streams K/V in ``block_k`` slot blocks with an online
  softmax in base 2; interior blocks run unmasked, only the tail block of a range
  is masked. The last split also attends to the T_new new tokens under the
  causal/tree mask (``block_k_new`` keys per step; mask rows are query rows). Splits
  are merged by log-sum-exp (``merge.merge_stacked``). Any head dim D: the tiles hold
  ``head_tile(D)`` lanes (the next power of 2, at least 16), those past D masked.

On a Hopper GPU, from ``HOPPER_MIN_ROWS`` query rows per KV head (long verification blocks,
token trees) in bf16/f16, ``hopper.verify_attention`` (a Mosaic GPU wgmma kernel) serves
the same contract instead.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Triton-specific helpers (masked loads, compiler params).
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - a jax without the Triton backend
    plgpu = None

from . import hopper as _hopper
from .merge import merge_stacked
from .splits import split_range

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def head_tile(D: int) -> int:
    """The kernels' head-dim tile: D itself when a power of 2 >= 16 (Triton's tiles and its
    matrix products need that), else the next one; the lanes past D are masked (loaded as 0,
    never stored), so any head dim (80, 96, 100, ...) runs the kernel."""
    return max(16, _next_pow2(D))


def load_rows(ref, idx, rows_ok, head_ok):
    """``ref[idx]`` (``idx`` None: the whole ref) with rows (``rows_ok[n]``) and head lanes
    (``head_ok[Dp]``) outside the valid ranges read as 0 (None: all valid): no NaN garbage, no
    lanes past D. Unmasked, a plain load."""
    if rows_ok is None and head_ok is None:
        return ref[...] if idx is None else ref[idx]
    if idx is not None:
        ref = ref.at[idx]
    if head_ok is None:
        mask = rows_ok[:, None]
    elif rows_ok is None:
        mask = head_ok[None, :]
    else:
        mask = rows_ok[:, None] & head_ok[None, :]
    return plgpu.load(ref, mask=mask, other=0)


def store_rows(ref, x, head_ok):
    """``ref[...] = x`` for the lanes below the head dim only (``head_ok`` None: all)."""
    if head_ok is None:
        ref[...] = x
    else:
        plgpu.store(ref, x, mask=head_ok[None, :])


@dataclasses.dataclass(frozen=True)
class DecodeAttentionBlockSizes:
    """Static tiling of the decode/verify kernel (None = chosen from the shapes).

    block_k: context slots per inner step (power of 2, >= 16); None: 128 for
      few query rows (block_q <= 32) over a long context (> 4096 visible slots),
      else 64 (measured on H200: see benchmarks/attention.md). On GPU it is halved
      while the K/V pipeline buffers would not fit in shared memory.
    block_q: query rows ((t, g) pairs of one KV head) per program (power of 2,
      >= 16); None: next power of 2 of G*T, clamped to [16, max_block_q].
    max_block_q: cap for the automatic block_q (query-row blocking for large T).
    block_k_new: new-token keys per inner step; None: next power of 2 of T_new in
      [16, block_k].
    split_size: context slots per program (flash-decoding split); None: enough
      splits to give about ``target_programs`` programs, each at least
      ``min_split_size`` of the cache's slots, and at run time the splits share each
      sequence's visible context in whole blocks (a short sequence in a long cache
      still spreads over every split).
    num_warps / num_stages: Triton compiler parameters (ignored in interpret mode);
      num_warps None: 4 for block_q <= 64, else 8.
    fast_exp: on NVIDIA GPUs compute exp2 with one ``ex2.approx.ftz.f32``
      instruction (what Triton's own ``exp2`` emits) instead of libdevice's
      ``exp2f``; ignored elsewhere.
    """
    block_k: int | None = None
    block_q: int | None = None
    max_block_q: int = 128
    block_k_new: int | None = None
    split_size: int | None = None
    target_programs: int | None = None
    min_split_size: int = 512
    num_warps: int | None = None
    num_stages: int = 3
    fast_exp: bool = True


# Tuned on an H200 (jax 0.11.2, Triton backend); see
# benchmarks/attention.md. Other GPUs use the same until tuned.
_GPU_DEFAULTS = DecodeAttentionBlockSizes()
_SMEM_BYTES = 220 * 1024  # H100/H200 allow 227 KiB per block; keep a margin.


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernel body needs to know statically."""
    T: int          # queries (the last T of the T_new new tokens)
    T_new: int      # new tokens (keys at slots length + [0, T_new))
    G: int
    S: int
    block_q: int
    block_k: int
    block_k_new: int
    split_size: int
    num_splits: int
    dynamic_split: bool  # splits share each sequence's visible context (else: static split_size)
    sink: int
    window: int
    sparse: bool
    causal: bool
    mask_per_batch: bool
    has_layer: bool
    scale_log2: float
    fast_exp: bool
    D: int          # the head dim (the tiles hold head_tile(D) lanes; those past D masked)


def _exp2(x, fast: bool):
    if not fast:
        return jnp.exp2(x)
    [y] = plgpu.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
    return y


def _decode_kernel(layer_ref, lengths_ref, q_ref, k_ref, v_ref, *rest, c: _Static):
    if c.causal:
        mask_ref = None
        o_ref, lse_ref = rest
    else:
        mask_ref, o_ref, lse_ref = rest
    qi, si, b, h = (pl.program_id(i) for i in range(4))
    bq, bk, bkn = c.block_q, c.block_k, c.block_k_new

    length = jnp.clip(lengths_ref[b], 0, c.S)
    lead = (layer_ref[0], b, h) if c.has_layer else (b, h)

    head_dim = q_ref.shape[-1]                       # head_tile(D) lanes
    head_ok = None if head_dim == c.D else jnp.arange(head_dim, dtype=jnp.int32) < c.D
    q = load_rows(q_ref, None, None, head_ok)        # [bq, Dp]
    if q.dtype != k_ref.dtype:
        q = q.astype(k_ref.dtype)

    def kv_index(start, size):
        return (*lead, pl.ds(start, size), slice(None))

    def step(carry, start, size, load_ok, score_ok):
        """One online-softmax step over slots [start, start + size)."""
        acc, m, l = carry
        idx = kv_index(start, size)
        # masked where needed: rows outside the range come back as 0 (no NaN), as do lanes past D
        k = load_rows(k_ref, idx, load_ok, head_ok)
        v = load_rows(v_ref, idx, load_ok, head_ok)
        # HIGHEST: float32 inputs use full-precision (not tf32) products on GPU;
        # for bf16 inputs it changes nothing.
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                            preferred_element_type=jnp.float32)
        s = s * c.scale_log2                           # base-2 logits
        if score_ok is not None:
            s = jnp.where(score_ok, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # A row that has seen no key yet keeps m = -inf; shift by 0 there so that
        # exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = NaN.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = _exp2(s - m_safe[:, None], c.fast_exp)
        l = l * alpha + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=_HIGHEST, preferred_element_type=jnp.float32)
        acc = acc * alpha[:, None] + pv
        return acc, m_new, l

    def context_range(carry, lo, hi):
        """Attends to context slots [lo, hi): unmasked full blocks + a masked tail."""
        n = jnp.maximum(hi - lo, 0)
        n_full = lax.div(n, bk)
        carry = lax.fori_loop(0, n_full,
                              lambda i, cr: step(cr, lo + i * bk, bk, None, None), carry)
        tail = lo + n_full * bk

        def tail_body(i, cr):
            ok = tail + jnp.arange(bk, dtype=jnp.int32) < hi
            return step(cr, tail, bk, ok, ok[None, :])
        has_tail = (n - n_full * bk > 0).astype(jnp.int32)
        return lax.fori_loop(0, has_tail, tail_body, carry)

    carry = (jnp.zeros((bq, head_dim), jnp.float32),
             jnp.full((bq,), -jnp.inf, jnp.float32),
             jnp.zeros((bq,), jnp.float32))

    # Context visible to this sequence, as two slot ranges laid end to end in a
    # "virtual" index space: A = [0, a_end), B = [b_start, length).
    if c.sparse:
        a_end = jnp.minimum(c.sink, length)
        b_start = jnp.maximum(length - c.window, a_end)
    else:
        a_end = length
        b_start = length
    v_len = a_end + (length - b_start)
    v0, v1 = split_range(si, v_len, c)  # this split's share of the visible context
    carry = context_range(carry, jnp.minimum(v0, a_end), jnp.minimum(v1, a_end))
    if c.sparse:
        shift = b_start - a_end
        carry = context_range(carry, jnp.maximum(v0, a_end) + shift,
                              jnp.maximum(v1, a_end) + shift)

    # New tokens (slots length + j, j < T_new): attended by the last split only.
    # Query row r is query t = r // G, i.e. new token t + (T_new - T).
    off = c.T_new - c.T
    r0 = qi * bq
    t_row = lax.div(r0 + jnp.arange(bq, dtype=jnp.int32), c.G)      # [bq]
    is_last = (si == c.num_splits - 1).astype(jnp.int32)
    if c.causal:
        j_max = jnp.minimum(lax.div(r0 + bq - 1, c.G) + 1 + off, c.T_new)
        n_new = is_last * lax.div(j_max + bkn - 1, bkn)
    else:
        n_new = is_last * _cdiv(c.T_new, bkn)
    bm = b if c.mask_per_batch else 0

    def new_body(i, cr):
        j0 = i * bkn
        j = j0 + jnp.arange(bkn, dtype=jnp.int32)
        ok = (j < c.T_new) & (length + j < c.S)
        if c.causal:
            vis = j[None, :] <= t_row[:, None] + off
        else:
            vis = mask_ref[bm, pl.ds(r0, bq), pl.ds(j0, bkn)] != 0
        return step(cr, length + j0, bkn, ok, vis & ok[None, :])
    carry = lax.fori_loop(0, n_new, new_body, carry)

    acc, m, l = carry
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    store_rows(o_ref, (acc / l_safe[:, None]).astype(o_ref.dtype), head_ok)
    lse_ref[...] = jnp.where(seen, m * _LN2 + jnp.log(l_safe), -jnp.inf)


def _is_nvidia() -> bool:
    try:
        return "nvidia" in jax.devices()[0].device_kind.lower()
    except Exception:  # pragma: no cover
        return False


def _num_sms() -> int:
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or 132
    except Exception:  # pragma: no cover
        return 132


def _plan(B, K, T, G, S, D, *, sink, window, bs: DecodeAttentionBlockSizes, on_gpu: bool,
          itemsize: int = 2, T_new: int | None = None):
    """Resolves automatic block sizes into concrete static numbers (T: queries, T_new: new keys)."""
    T_new = T if T_new is None else T_new
    rows = T * G
    sparse = bool(sink) or bool(window)
    v_max = min(S, (sink or 0) + (window or 0)) if sparse else S
    v_max = max(v_max, 1)
    block_q = bs.block_q or min(max(16, _next_pow2(rows)), max(16, bs.max_block_q))
    block_k = bs.block_k or (128 if block_q <= 32 and v_max > 4096 else 64)
    if on_gpu:  # K and V tiles for every pipeline stage, plus the q tile, in shared memory
        Dp = head_tile(D)
        while block_k > 16 and (2 * block_k * bs.num_stages + block_q) * Dp * itemsize > _SMEM_BYTES:
            block_k //= 2
    block_k_new = bs.block_k_new or min(max(16, _next_pow2(T_new)), max(16, block_k))
    for name, val in (("block_k", block_k), ("block_q", block_q), ("block_k_new", block_k_new)):
        if val < 16 or val != _next_pow2(val):
            raise ValueError(f"{name}={val} must be a power of 2 >= 16")
    num_q_blocks = _cdiv(rows, block_q)
    if bs.split_size is not None:
        split = bs.split_size
    else:
        target = bs.target_programs or (2 * _num_sms() if on_gpu else 1)
        base = B * K * num_q_blocks
        n = max(1, min(_cdiv(target, base), _cdiv(v_max, bs.min_split_size)))
        split = _cdiv(_cdiv(v_max, n), block_k) * block_k
    num_splits = max(1, _cdiv(v_max, split))
    return block_q, block_k, block_k_new, split, num_splits, num_q_blocks


@functools.partial(
    jax.jit,
    static_argnames=("sink", "window", "sm_scale", "interpret", "block_sizes", "on_gpu",
                     "num_new"))
def _decode_attention_kernel(q, k_cache, v_cache, lengths, tree_mask, layer, *,
                             sink, window, sm_scale, interpret, block_sizes, on_gpu,
                             num_new=None):
    B, T, H, D = q.shape
    T_new = resolve_num_new(T, tree_mask, num_new)
    has_layer = layer is not None
    K, S = k_cache.shape[-3], k_cache.shape[-2]
    G = H // K
    rows = T * G
    block_q, block_k, block_k_new, split, num_splits, nq = _plan(
        B, K, T, G, S, D, sink=sink, window=window, bs=block_sizes, on_gpu=on_gpu,
        itemsize=jnp.dtype(k_cache.dtype).itemsize, T_new=T_new)
    rows_pad = nq * block_q

    # Rows of one KV head: r = t * G + g.
    q_BKRD = q.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, rows, D)
    if rows_pad != rows:
        q_BKRD = jnp.pad(q_BKRD, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))

    causal = tree_mask is None
    inputs = [jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1),
              lengths.astype(jnp.int32), q_BKRD, k_cache, v_cache]
    full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    # Tiles of head_tile(D) lanes; past D (a head dim that is not a power of 2) they are masked.
    Dp = head_tile(D)
    kv_block = (*k_cache.shape[:-1], Dp)
    in_specs = [full((1,)), full((B,)),
                pl.BlockSpec((None, None, block_q, Dp), lambda qi, si, b, h: (b, h, qi, 0)),
                full(kv_block), full(kv_block)]
    mask_per_batch = False
    if not causal:
        tm = jnp.asarray(tree_mask)
        if tm.ndim == 2:
            tm = tm[None]
        mask_per_batch = tm.shape[0] != 1
        tm_rows = jnp.repeat(tm.astype(jnp.int8), G, axis=1)           # [Bm, T*G, T_new]
        cols_pad = _cdiv(T_new, block_k_new) * block_k_new
        tm_rows = jnp.pad(tm_rows, ((0, 0), (0, rows_pad - rows), (0, cols_pad - T_new)))
        inputs.append(tm_rows)
        in_specs.append(full(tm_rows.shape))

    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((B, K, rows_pad, D), q.dtype),
                     jax.ShapeDtypeStruct((B, K, rows_pad), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, block_q, Dp), lambda qi, si, b, h: (b, h, qi, 0)),
                     pl.BlockSpec((None, None, block_q), lambda qi, si, b, h: (b, h, qi))]
    else:
        out_shape = [jax.ShapeDtypeStruct((B, K, num_splits, rows_pad, D), jnp.float32),
                     jax.ShapeDtypeStruct((B, K, num_splits, rows_pad), jnp.float32)]
        out_specs = [
            pl.BlockSpec((None, None, None, block_q, Dp), lambda qi, si, b, h: (b, h, si, qi, 0)),
            pl.BlockSpec((None, None, None, block_q), lambda qi, si, b, h: (b, h, si, qi))]

    static = _Static(
        T=T, T_new=T_new, G=G, S=S, block_q=block_q, block_k=block_k, block_k_new=block_k_new,
        split_size=split, num_splits=num_splits,
        dynamic_split=block_sizes.split_size is None, sink=int(sink or 0),
        window=int(window or 0), sparse=bool(sink) or bool(window), causal=causal,
        mask_per_batch=mask_per_batch, has_layer=has_layer,
        scale_log2=float(sm_scale) * _LOG2E,
        fast_exp=bool(block_sizes.fast_exp and on_gpu and _is_nvidia()), D=D)
    num_warps = block_sizes.num_warps or (4 if block_q <= 64 else 8)
    compiler_params = None
    if not interpret and plgpu is not None:
        compiler_params = plgpu.CompilerParams(num_warps=num_warps,
                                               num_stages=block_sizes.num_stages)
    o, lse = pl.pallas_call(
        functools.partial(_decode_kernel, c=static),
        grid=(nq, num_splits, B, K),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params,
        interpret=interpret,
        name="jaxspec_decode_attention",
    )(*inputs)

    if num_splits > 1:
        o, lse = merge_stacked(o, lse, axis=2, out_dtype=q.dtype)
    o = o[:, :, :rows].reshape(B, K, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, H, D)
    lse = lse[:, :, :rows].reshape(B, K, T, G).transpose(0, 2, 1, 3).reshape(B, T, H)
    return o, lse


# The Hopper (Mosaic GPU) kernel takes over from the Triton one from this many query rows
# (T x G) per KV head: there attention turns bound by matrix throughput, and the Hopper
# kernel's wgmma pipeline beats Triton's (benchmarks/hopper_attention_h100_s9.md, H100,
# B=64, S=8192, G=4: 1.04x at T=32, 1.29x at T=64, 1.32x at T=128).
HOPPER_MIN_ROWS = 128


def _hopper_choice(q, k_cache, T_new, block_sizes, *, sink, window, interpret, on_gpu):
    """The Hopper kernel's block sizes where it serves this call, else None: when asked for
    (``block_sizes`` a ``hopper.HopperBlockSizes``), or by default on a Hopper GPU for dense
    attention with at least ``HOPPER_MIN_ROWS`` query rows per KV head in bf16/f16."""
    B, T, H, D = q.shape
    K, S = k_cache.shape[-3], k_cache.shape[-2]
    fits = (_hopper.supports(q.dtype, D) and k_cache.dtype == q.dtype and S % 8 == 0)
    if isinstance(block_sizes, _hopper.HopperBlockSizes):
        if sink or window:
            raise ValueError("the Hopper kernel does dense attention only (no sink / window)")
        _hopper.check_requested(fits, f"bf16/f16 q and cache of one dtype, D % 64 == 0 and "
                                f"S % 8 == 0; got {q.dtype}/{k_cache.dtype}, D={D}, S={S}",
                                interpret)
        return block_sizes
    if (block_sizes is None and on_gpu and not interpret and not sink and not window and fits
        and T * (H // K) >= HOPPER_MIN_ROWS and _hopper.default_block_sizes(D) is not None
        and _hopper.available()):
        return _hopper.default_block_sizes(D)
    return None


@functools.partial(jax.jit, static_argnames=("sm_scale", "num_new", "block_sizes", "interpret"))
def _verify_hopper(q, k_cache, v_cache, lengths, tree_mask, layer, *, sm_scale, num_new,
                   block_sizes, interpret):
    return _hopper.verify_attention(q, k_cache, v_cache, lengths, tree_mask, layer=layer,
                                    sm_scale=sm_scale, num_new=num_new, block_sizes=block_sizes,
                                    interpret=interpret)


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
        raise ValueError(f"{T} queries but only {T_new} new tokens (num_new / tree_mask columns "
                         "must be >= T: the queries are the last T new tokens)")
    return T_new


def _check_shapes(q, k_cache, v_cache, lengths, tree_mask, layer, num_new=None):
    """Validates the shapes; returns T_new (see the module docstring)."""
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
        raise ValueError(f"tree_mask must be [T, T_new] or [B, T, T_new] with T = {T} queries, "
                         f"got {tree_mask.shape}")
    return T_new


def decode_attention(q, k_cache, v_cache, lengths, tree_mask=None, *, layer=None,
                     sink=None, window=None, sm_scale=None, interpret=None,
                     block_sizes=None, num_new=None):
    """Decode / verify attention of the last T of T_new new tokens over a ragged KV cache.

    Args:
      q: ``[B, T, H, D]`` queries of the last T of the T_new new tokens (query t
        is new token ``T_new - T + t``).
      k_cache, v_cache: ``[B, K, S, D]`` (or ``[L, B, K, S, D]`` with ``layer``);
        the new tokens' K/V already written at slots ``lengths[b] + [0, T_new)``.
        Requires ``lengths[b] + T_new <= S``.
      lengths: ``[B]`` int32 context lengths (>= 0).
      tree_mask: None (causal among new tokens: query t sees new token j iff
        ``j <= t + T_new - T``), ``[T, T_new]`` or ``[B, T, T_new]`` bool: query t
        sees new token j iff ``tree_mask[t, j]``; T_new = its last dim.
      num_new: static int T_new (>= T) for the causal case; None: T (or, with a
        ``tree_mask``, its last dim, which it must then equal).
      layer: None, or a scalar int (may be traced) selecting the layer of stacked
        caches; the cache is not sliced outside the kernel.
      sink, window: static ints; if either is set, only context slots
        ``s < sink`` or ``s >= lengths[b] - window`` are visible (and read).
      sm_scale: logit scale (default ``1/sqrt(D)``).
      interpret: None: kernel on GPU, the Mosaic kernel (``tpu.py``) on TPU,
        reference on CPU; True: the portable kernel in Pallas interpret mode (any
        backend); False: as None.
      block_sizes: ``DecodeAttentionBlockSizes`` (None: tuned defaults), on TPU a
        ``TPUDecodeBlockSizes``, or a ``hopper.HopperBlockSizes`` for the Hopper (Mosaic
        GPU) kernel (dense, bf16/f16; with ``interpret=True`` its CPU interpreter). None
        on a Hopper GPU picks that kernel for >= ``HOPPER_MIN_ROWS`` rows per KV head.

    Returns:
      ``(out [B, T, H, D] in q.dtype, lse [B, T, H] float32)``; a query that saw
      no key gets ``out = 0`` and ``lse = -inf``.
    """
    T_new = _check_shapes(q, k_cache, v_cache, lengths, tree_mask, layer, num_new)
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    from . import tpu as _tpu
    backend = _tpu.dispatch_platform()   # the default backend, or tpu.target_platform's
    on_gpu = backend in ("gpu", "cuda", "rocm")
    # TPU: this Triton-shaped kernel (whole-cache refs, masked pointer loads) does
    # not map onto Mosaic TPU's VMEM blocking; TPU runs the Mosaic TPU kernel of
    # pallas_kernels/tpu.py (block_sizes: a TPUDecodeBlockSizes, else its defaults).
    if backend == "tpu" and not interpret:
        return _tpu.tpu_decode_attention(
            q, k_cache, v_cache, lengths, tree_mask, layer=layer, sink=sink, window=window,
            sm_scale=sm_scale, num_new=T_new,
            block_sizes=block_sizes if isinstance(block_sizes, _tpu.TPUDecodeBlockSizes) else None)
    hop = _hopper_choice(q, k_cache, T_new, block_sizes, sink=sink, window=window,
                         interpret=interpret, on_gpu=on_gpu)
    if hop is not None:
        return _verify_hopper(q, k_cache, v_cache, lengths, tree_mask, layer, sm_scale=sm_scale,
                              num_new=T_new, block_sizes=hop, interpret=bool(interpret))
    use_kernel = bool(interpret) or (on_gpu and plgpu is not None)
    if not use_kernel:
        return decode_attention_reference(q, k_cache, v_cache, lengths, tree_mask, layer=layer,
                                          sink=sink, window=window, sm_scale=sm_scale,
                                          num_new=T_new)
    if block_sizes is None:
        block_sizes = _GPU_DEFAULTS
    return _decode_attention_kernel(
        q, k_cache, v_cache, lengths, tree_mask, layer, sink=int(sink or 0),
        window=int(window or 0), sm_scale=sm_scale, interpret=bool(interpret),
        block_sizes=block_sizes, on_gpu=on_gpu and not interpret, num_new=T_new)


@functools.partial(jax.jit, static_argnames=("sink", "window", "sm_scale", "num_new"))
def _reference(q, k_cache, v_cache, lengths, tree_mask, layer, *, sink, window, sm_scale,
               num_new):
    if layer is not None:
        k_cache = lax.dynamic_index_in_dim(k_cache, layer, 0, keepdims=False)
        v_cache = lax.dynamic_index_in_dim(v_cache, layer, 0, keepdims=False)
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
        new_vis = j[:, None, :] <= t + (T_new - T)                       # [B, T, S]
    else:
        tm = jnp.broadcast_to(jnp.asarray(tree_mask, bool).reshape((-1, T, T_new)),
                              (B, T, T_new))
        new_vis = jnp.take_along_axis(tm, jnp.broadcast_to(jnp.clip(j, 0, T_new - 1)[:, None, :],
                                                           (B, T, S)), axis=2)
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
    T_new = _check_shapes(q, k_cache, v_cache, lengths, tree_mask, layer, num_new)
    sm_scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _reference(q, k_cache, v_cache, lengths, tree_mask, layer,
                      sink=int(sink or 0), window=int(window or 0), sm_scale=sm_scale,
                      num_new=T_new)
