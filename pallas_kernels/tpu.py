"""Mosaic TPU versions of the decode/verify and shared-prefix attention kernels.

Same contracts as ``decode_attention`` and ``prefix_attention`` (their references,
``reference.py``, are the oracles in the tests); the portable Triton-shaped kernels
(whole-cache refs, masked pointer loads) do not map onto Mosaic TPU's VMEM blocking, so
the TPU path is its own ``pallas_call`` written for Mosaic:

* **Grid** ``(B, K / heads_per_block, q_blocks, kv_steps)``: one program per
  group of KV heads of one sequence and per block of query rows (rows are
  ``(t, g)`` pairs: all G query heads of a KV head times all T new tokens, so
  each K/V byte is read once per row block); the last axis walks the context in
  ``block_k``-slot blocks and is the reduction ("arbitrary"), the others are
  "parallel" (megacore split). Several KV heads per program (default: all 8 of
  a Llama-style model at block_k=512, D=128, bf16: 4 MiB of K/V buffers) cut
  the grid steps, each of which costs fixed overhead, 8-fold.
* **Scalar prefetch** (``pltpu.PrefetchScalarGridSpec``): ``layer`` (stacked
  caches ``[L, B, K, S, D]``: the layer is picked by the K/V index maps, no copy
  of the layer is made) and ``lengths`` land in SMEM before the grid runs. The
  K/V BlockSpecs' index maps read them to compute which cache block step ``j``
  streams: for a dense context block ``min(j, last valid block)``; for the
  StreamingLLM sparse context first the sink blocks, then the window blocks
  (``_context_block``). Steps past the valid blocks repeat the previous block
  index, so the pipeline issues no DMA for them and the body skips them
  (``pl.when``): a sequence of length n costs ``ceil(n / block_k)`` block reads,
  and the sparse draft reads only its sink and window blocks.
* K/V blocks are **pipelined HBM -> VMEM** by those BlockSpecs (Pallas double
  buffers them); the online softmax state (row max ``m``, sum ``l``, ``acc``)
  lives in **VMEM scratch** across the kv steps; the output block is written
  at the last step. Only boundary blocks are masked (select, never multiply:
  slots outside the valid range may hold NaN; their V rows are zeroed).
* **New tokens** (slots ``lengths[b] + [0, T_new)``, not block aligned; the T
  queries are the last T of them, see ``decode_attention``): gathered by XLA
  into a small ``[B, K, Tn, D]`` array (``Tn`` = T_new rounded up to
  ``new_align``; one gather of T_new slots per sequence and head, ~1.6% of the
  bytes at T=1, S=8k) and attended at the last kv step under the causal or
  tree mask, passed as an int32 ``[rows, Tn]`` array per (batch of the) mask
  (rows: the T queries' ``(t, g)`` pairs).

TPU block-shape rule: the last two dims of every block are multiples of
(8, 128) or equal the array's dims; ``_plan`` keeps to it (K/V blocks are
``(block_k, D)`` with ``block_k`` a multiple of 16 or the whole S, D whole).

Shared prefix (Hydragen): the same kernel with per-group lengths, no new tokens
and rows ``(b_in_group, t, g)``; the prefix is taken as ``[P, K, L, D]``
(``tpu_prefix_attention_pkld``): ``tpu_prefix_attention`` accepts the
library's ``[P, L, K, D]`` layout and transposes it first (one XLA copy of the
prefix per call: keep the prefix in ``[P, K, L, D]`` on TPU to avoid it).

On a CPU the kernels run under Pallas's TPU interpret mode
(``interpret=True`` or a ``pltpu.InterpretParams``); ``dispatch.target_platform("tpu")``
makes the library's dispatch pick them while tracing on another backend (e.g.
to ``jax.export`` for TPU on this machine).

Not done (see benchmarks/tpu_note.md): flash-decoding splits of the context
(TPU v5e/v6e have one TensorCore per chip, and B*K programs keep it busy at
serving batch sizes; a v5p megacore with B*K < 2 would idle one core), and
lowering through the Mosaic compiler proper (needs libtpu: only the Pallas ->
Mosaic MLIR lowering is checked here, by exporting).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .common import cdiv, round_up
from .contracts import (check_decode_args, check_prefix_args, layer_operand, pad_rows,
                        prefix_lengths_or_full, resolve_sm_scale, rows_to_tokens,
                        tokens_to_rows)

# Names differ across jax versions (0.10.x / 0.11.x and older ones).
_CompilerParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
_InterpretParams = (getattr(pltpu, "InterpretParams", None)
                    or getattr(pltpu, "TPUInterpretParams", None))
_VMEM = getattr(pltpu, "VMEM", None) or pltpu.MemorySpace.VMEM

_NEG_INF = -math.inf


# --- interpret mode ------------------------------------------------------------------

def interpret_params(interpret):
    """``interpret`` argument -> what ``pallas_call`` takes (TPU interpret mode on True)."""
    if interpret is None or interpret is False:
        return False
    if interpret is True:
        if _InterpretParams is None:  # pragma: no cover - a jax without TPU interpret mode
            return True
        return _InterpretParams()
    return interpret


# --- block sizes -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TPUDecodeBlockSizes:
    """Static tiling of the TPU decode/verify kernel (None = chosen from the shapes).

    block_k: context slots per kv step (multiple of 16, or >= S: the whole
      cache); None: 512 for a dense context (a 128 KiB bf16 K block at D=128:
      long DMAs, 16 steps at S=8k), 128 for a sparse one (sink + window: a sink of
      16 then costs one 128-slot block, not 512).
    block_q: query rows per program (multiple of 16); None: T*G rounded up to
      16, capped at ``max_block_q``.
    max_block_q: cap of the automatic block_q (more rows: several row blocks,
      each re-reading K/V).
    new_align: the T_new new tokens are padded to a multiple of this (the lane dim
      of their scores and mask); 128 keeps those tiles lane-dense.
    heads_per_block: KV heads one program streams together (a divisor of K);
      None: ``_heads_per_block`` (as many as keep the double-buffered K/V blocks
      within ``kv_vmem_budget`` bytes while leaving >= 2 parallel programs).
      More heads per step: fewer grid steps (each costs ~0.35 us of fixed
      overhead on TPU) and longer DMAs.
    kv_vmem_budget: bytes of VMEM for the K/V pipeline buffers (2 x 2 blocks).
    vmem_limit_bytes: passed to Mosaic (None: its default scoped limit).
    """
    block_k: int | None = None
    block_q: int | None = None
    max_block_q: int = 256
    new_align: int = 128
    heads_per_block: int | None = None
    kv_vmem_budget: int = 4 << 20
    vmem_limit_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class TPUPrefixBlockSizes:
    """Static tiling of the TPU shared-prefix kernel (None = chosen from the shapes).

    block_k: prefix slots per kv step (multiple of 16 or >= L); None: 512.
    block_q: query rows ((b, t, g) of one group and KV head) per program
      (multiple of 16); None: the rows rounded up to 16, capped at
      ``max_block_q`` (512: each prefix block is read once per 512 rows, which
      is past the v5e/v6e ridge point of ~240-680 FLOP/byte for bf16).
    heads_per_block, kv_vmem_budget: as in ``TPUDecodeBlockSizes``.
    vmem_limit_bytes: passed to Mosaic (None: its default scoped limit).
    """
    block_k: int | None = None
    block_q: int | None = None
    max_block_q: int = 512
    heads_per_block: int | None = None
    kv_vmem_budget: int = 4 << 20
    vmem_limit_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class _Static:
    S: int                # cache slots (or prefix length L)
    heads: int            # KV heads per program
    block_q: int
    block_k: int
    num_steps: int        # kv grid steps
    sink: int
    window: int
    sparse: bool
    sink_steps: int       # kv steps reserved for the sink blocks (sparse)
    has_layer: bool
    has_new: bool
    mask_per_batch: bool
    sm_scale: float
    precision: object


def _context_block(j, length, c: _Static):
    """For kv step ``j`` of a sequence with ``length`` context slots.

    Returns ``(block, lo, hi, active)``: the cache block the step reads, the slot
    range ``[lo, hi)`` of the segment it serves, and whether it has any work.
    Inactive steps repeat the previous step's block (no DMA is issued for them).
    Scalar int32 arithmetic only: runs in the index maps (scalar core) and in the
    kernel body alike.
    """
    bk = c.block_k
    last_block = max(cdiv(c.S, bk) - 1, 0)
    # lax.div (truncating; every operand is >= 0), not //: floor division lowers
    # through sign(), which Mosaic lowers per TPU generation.
    def blocks(n):  # ceil(n / bk) of a traced int
        return lax.div(n + (bk - 1), bk)
    if not c.sparse:
        n = blocks(length)
        blk = jnp.minimum(j, jnp.maximum(n - 1, 0))
        return blk, jnp.int32(0), length, j < n
    a_end = jnp.minimum(c.sink, length)
    b_start = jnp.maximum(length - c.window, a_end)
    n_a = blocks(a_end)
    b_first = jnp.minimum(lax.div(b_start, bk), last_block)
    n_b = jnp.where(length > b_start, blocks(length) - lax.div(b_start, bk), 0)
    in_a = j < c.sink_steps
    jb = j - c.sink_steps
    blk_a = jnp.minimum(j, jnp.maximum(n_a - 1, 0))
    blk_b = jnp.minimum(b_first + jnp.maximum(jb, 0), b_first + jnp.maximum(n_b - 1, 0))
    # Before its first window step a sequence with no sink keeps block b_first, so
    # the first window block is fetched once.
    blk_a = jnp.where(n_a > 0, blk_a, b_first)
    blk = jnp.where(in_a, blk_a, blk_b)
    lo = jnp.where(in_a, 0, b_start)
    hi = jnp.where(in_a, a_end, length)
    active = jnp.where(in_a, j < n_a, jb < n_b)
    return jnp.minimum(blk, last_block), lo, hi, active


def _attention_kernel(layer_ref, lengths_ref, q_ref, k_ref, v_ref, *rest, c: _Static):
    if c.has_new:
        kn_ref, vn_ref, mask_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc = rest
    else:
        o_ref, lse_ref, m_sc, l_sc, acc_sc = rest
    b, j = pl.program_id(0), pl.program_id(3)
    bq, bk = c.block_q, c.block_k
    del layer_ref  # only the index maps read it
    # Refs are [heads, ...]: a static loop over the KV heads of this program, each
    # with 2-D tiles (rows x D, slots x D) on the MXU.

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, _NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    def update(i, k, v, score_ok):
        """One online-softmax step of head i's row block over the keys k, v [n, D]."""
        q = q_ref[i]
        if q.dtype != k.dtype:
            q = q.astype(k.dtype)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=c.precision,
                            preferred_element_type=jnp.float32) * c.sm_scale     # [bq, n]
        if score_ok is not None:
            s = jnp.where(score_ok, s, _NEG_INF)
        m_prev = m_sc[i]                                                         # [bq, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # Rows that have seen no key keep m = -inf: shift by 0 so exp(-inf) = 0, not NaN.
        m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe)
        l_sc[i] = alpha * l_sc[i] + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=c.precision, preferred_element_type=jnp.float32)
        acc_sc[i] = alpha * acc_sc[i] + pv
        m_sc[i] = m_new

    length = lengths_ref[b]
    blk, lo, hi, active = _context_block(j, length, c)
    start = blk * bk
    full = (start >= lo) & (start + bk <= hi)

    @pl.when(active & full)
    def _interior():                      # all slots valid: no masking work
        for i in range(c.heads):
            update(i, k_ref[i], v_ref[i], None)

    @pl.when(active & jnp.logical_not(full))
    def _boundary():
        slot_cols = start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        slot_rows = start + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        ok_cols = (slot_cols >= lo) & (slot_cols < hi)
        ok_rows = (slot_rows >= lo) & (slot_rows < hi)
        for i in range(c.heads):
            v = v_ref[i]
            update(i, k_ref[i], jnp.where(ok_rows, v, jnp.zeros((), v.dtype)), ok_cols)

    @pl.when(j == c.num_steps - 1)
    def _finish():
        if c.has_new:
            # New tokens: gathered K/V (zero past T and past the cache end), causal or
            # tree mask per (row, new token); slot length + i must exist in the cache.
            tn = kn_ref.shape[-2]
            col = lax.broadcasted_iota(jnp.int32, (bq, tn), 1)
            ok = (mask_ref[...] != 0) & (length + col < c.S)
            for i in range(c.heads):
                update(i, kn_ref[i], vn_ref[i], ok)
        l = l_sc[...]
        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        o_ref[...] = (acc_sc[...] / l_safe).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m_sc[...] + jnp.log(l_safe), _NEG_INF)


def _check_block(name, block, array_shape):
    """The Mosaic TPU rule for the last two block dims (checked before lowering, too)."""
    b1, b0 = block[-2:]
    a1, a0 = array_shape[-2:]
    if not ((b0 == a0 or b0 % 128 == 0) and (b1 == a1 or b1 % 8 == 0)):
        raise ValueError(f"{name}: block {block} of array {array_shape} breaks the TPU (8, 128) "
                         "tiling rule")


def _attention_call(q_NKRD, k_cache, v_cache, lengths, layer, new, *, c: _Static,
                    interpret, vmem_limit_bytes, name):
    """The shared pallas_call: q rows [N, K, R, D] over caches [(L,) N, K, S, D]."""
    N, K, R, D = q_NKRD.shape
    bq, bk = c.block_q, c.block_k
    hb = c.heads
    grid = (N, K // hb, R // bq, c.num_steps)

    def kv_index(b, h, qi, j, layer_ref, lengths_ref):
        blk = _context_block(j, lengths_ref[b], c)[0]
        if c.has_layer:
            return (layer_ref[0], b, h, blk, 0)
        return (b, h, blk, 0)
    kv_block = ((None,) if c.has_layer else ()) + (None, hb, bk, D)
    row_block = (None, hb, bq, D)
    in_specs = [pl.BlockSpec(row_block, lambda b, h, qi, j, *_: (b, h, qi, 0)),
                pl.BlockSpec(kv_block, kv_index),
                pl.BlockSpec(kv_block, kv_index)]
    inputs = [q_NKRD, k_cache, v_cache]
    _check_block("q", (bq, D), q_NKRD.shape)
    _check_block("k/v", (bk, D), k_cache.shape)
    if c.has_new:
        kn, vn, mask = new
        tn = kn.shape[-2]
        new_block = (None, hb, tn, D)
        mask_index = ((lambda b, h, qi, j, *_: (b, qi, 0)) if c.mask_per_batch
                      else (lambda b, h, qi, j, *_: (0, qi, 0)))
        in_specs += [pl.BlockSpec(new_block, lambda b, h, qi, j, *_: (b, h, 0, 0)),
                     pl.BlockSpec(new_block, lambda b, h, qi, j, *_: (b, h, 0, 0)),
                     pl.BlockSpec((None, bq, tn), mask_index)]
        inputs += [kn, vn, mask]
        _check_block("new k/v", (tn, D), kn.shape)
        _check_block("mask", (bq, tn), mask.shape)
    out_specs = [pl.BlockSpec(row_block, lambda b, h, qi, j, *_: (b, h, qi, 0)),
                 pl.BlockSpec((None, hb, bq, 1), lambda b, h, qi, j, *_: (b, h, qi, 0))]
    out_shape = [jax.ShapeDtypeStruct((N, K, R, D), q_NKRD.dtype),
                 jax.ShapeDtypeStruct((N, K, R, 1), jnp.float32)]
    layer_arr = layer_operand(layer)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[_VMEM((hb, bq, 1), jnp.float32),     # running max m
                        _VMEM((hb, bq, 1), jnp.float32),     # running sum l
                        _VMEM((hb, bq, D), jnp.float32)],    # acc
    )
    params = dict(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
    if vmem_limit_bytes is not None:
        params["vmem_limit_bytes"] = int(vmem_limit_bytes)
    o, lse = pl.pallas_call(
        functools.partial(_attention_kernel, c=c),
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=_CompilerParams(**params),
        interpret=interpret_params(interpret),
        name=name,
    )(layer_arr, lengths, *inputs)
    return o, lse[..., 0]


def _precision(dtype):
    # float32 caches: full-precision MXU passes (TPU's default would round to bf16).
    return (lax.Precision.HIGHEST, lax.Precision.HIGHEST) if dtype == jnp.float32 else None


def _block_k(requested, default, S, itemsize):
    bk = requested or default
    if bk >= S:
        return S                              # the whole cache: always a legal block
    align = 16 if itemsize < 4 else 8       # sublane packing of 2-byte dtypes
    if bk % align:
        raise ValueError(f"block_k={bk} must be a multiple of {align} (or >= S={S})")
    return bk


def _block_q(requested, rows, cap):
    bq = requested or min(round_up(rows, 16), max(16, cap))
    if bq % 16:
        raise ValueError(f"block_q={bq} must be a multiple of 16")
    return bq


def _heads_per_block(requested, K, programs, block_k, D, itemsize, budget):
    """KV heads per program: the most (a divisor of K) whose double-buffered K and V
    blocks fit ``budget`` bytes, keeping >= 2 parallel programs (megacore) when possible."""
    if requested is not None:
        if K % requested:
            raise ValueError(f"heads_per_block={requested} must divide the {K} KV heads")
        return requested
    best = 1
    for hb in range(1, K + 1):
        if K % hb:
            continue
        fits = 4 * hb * block_k * D * itemsize <= budget
        parallel = programs * (K // hb) >= 2 or programs * K < 2
        if fits and parallel:
            best = hb
    return best


# --- decode / verify ---------------------------------------------------------------

def _decode_plan(T, G, S, itemsize, sink, window, bs: TPUDecodeBlockSizes):
    sparse = bool(sink) or bool(window)
    block_k = _block_k(bs.block_k, 128 if sparse else 512, S, itemsize)
    block_q = _block_q(bs.block_q, T * G, bs.max_block_q)
    if sparse:
        sink_steps = cdiv(sink, block_k) if sink else 0
        # An unaligned window of w slots touches at most ceil(w / bk) + 1 blocks.
        window_steps = cdiv(window, block_k) + 1 if window else 0
        num_steps = min(sink_steps + window_steps, cdiv(S, block_k) + sink_steps)
    else:
        sink_steps = 0
        num_steps = cdiv(S, block_k)
    return block_q, block_k, sink_steps, max(num_steps, 1)


def _gather_new(cache, layer, lengths, T):
    """K or V of the T new tokens, ``[B, K, T, D]``, zero where ``lengths + t >= S``."""
    S = cache.shape[-2]
    B = lengths.shape[0]
    slot = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]          # [B, T]
    valid = slot < S
    slot = jnp.minimum(slot, S - 1)
    b_idx = jnp.arange(B, dtype=jnp.int32)[:, None]
    if layer is None:
        x = cache[b_idx, :, slot]                                                # [B, T, K, D]
    else:  # one gather straight from the stacked cache (no copy of the layer)
        x = cache[jnp.asarray(layer, jnp.int32), b_idx, :, slot]
    x = jnp.where(valid[:, :, None, None], x, jnp.zeros((), x.dtype))
    return x.transpose(0, 2, 1, 3)


@functools.partial(jax.jit, static_argnames=("sink", "window", "sm_scale", "interpret",
                                             "block_sizes", "num_new"))
def _tpu_decode(q, k_cache, v_cache, lengths, tree_mask, layer, *, sink, window, sm_scale,
                interpret, block_sizes, num_new):
    B, T, H, D = q.shape
    T_new = num_new                     # new tokens (keys); the T queries are the last T
    K, S = k_cache.shape[-3], k_cache.shape[-2]
    G = H // K
    rows = T * G
    itemsize = jnp.dtype(k_cache.dtype).itemsize
    block_q, block_k, sink_steps, num_steps = _decode_plan(
        T, G, S, itemsize, sink, window, block_sizes)
    rows_pad = round_up(rows, block_q)
    heads = _heads_per_block(block_sizes.heads_per_block, K, B * (rows_pad // block_q), block_k,
                             D, itemsize, block_sizes.kv_vmem_budget)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, S)

    q_BKRD = pad_rows(tokens_to_rows(q, K), rows_pad)                # rows r = t * G + g

    tn = round_up(T_new, block_sizes.new_align)
    pad_new = ((0, 0), (0, 0), (0, tn - T_new), (0, 0))
    kn = jnp.pad(_gather_new(k_cache, layer, lengths, T_new), pad_new)
    vn = jnp.pad(_gather_new(v_cache, layer, lengths, T_new), pad_new)
    if tree_mask is None:  # query t is new token t + T_new - T
        tm = jnp.tri(T, T_new, T_new - T, dtype=jnp.int32)[None]
    else:
        tm = jnp.asarray(tree_mask).reshape(-1, T, T_new).astype(jnp.int32)
    mask_per_batch = tm.shape[0] != 1
    tm = jnp.repeat(tm, G, axis=1)                                             # [Bm, T*G, T_new]
    tm = jnp.pad(tm, ((0, 0), (0, rows_pad - rows), (0, tn - T_new)))

    c = _Static(S=S, heads=heads, block_q=block_q, block_k=block_k, num_steps=num_steps,
                sink=int(sink), window=int(window), sparse=bool(sink) or bool(window),
                sink_steps=sink_steps, has_layer=layer is not None, has_new=True,
                mask_per_batch=mask_per_batch, sm_scale=float(sm_scale),
                precision=_precision(k_cache.dtype))
    o, lse = _attention_call(q_BKRD, k_cache, v_cache, lengths, layer, (kn, vn, tm), c=c,
                             interpret=interpret, vmem_limit_bytes=block_sizes.vmem_limit_bytes,
                             name="jaxspec_tpu_decode_attention")
    return rows_to_tokens(o, lse, B, T, G)


def tpu_decode_attention(q, k_cache, v_cache, lengths, tree_mask=None, *, layer=None,
                         sink=None, window=None, sm_scale=None, interpret=None,
                         block_sizes=None, num_new=None):
    """Mosaic TPU decode / verify attention; the contract of ``decode_attention``
    (including T_new > T: ``tree_mask`` ``[T, T_new]`` / ``[B, T, T_new]`` or ``num_new``).

    ``interpret``: None/False compile through Mosaic (a TPU backend, or lowering
    for one); True (or a ``pltpu.InterpretParams``) runs Pallas's TPU interpret
    mode on any backend. ``block_sizes``: ``TPUDecodeBlockSizes`` (None:
    defaults). Returns ``(out [B, T, H, D] in q.dtype, lse [B, T, H] float32)``.
    """
    T_new = check_decode_args(q, k_cache, v_cache, lengths, tree_mask, layer, num_new)
    sm_scale = resolve_sm_scale(sm_scale, q.shape[-1])
    if interpret is True and _InterpretParams is not None:
        interpret = _InterpretParams()
    return _tpu_decode(q, k_cache, v_cache, lengths, tree_mask, layer, sink=int(sink or 0),
                       window=int(window or 0), sm_scale=sm_scale,
                       interpret=interpret if interpret else False,
                       block_sizes=block_sizes or TPUDecodeBlockSizes(), num_new=T_new)


# --- shared prefix (Hydragen) ------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "block_sizes"))
def _tpu_prefix(q, k_PKLD, v_PKLD, lengths, *, sm_scale, interpret, block_sizes):
    B, T, H, D = q.shape
    P, K, L, _ = k_PKLD.shape
    G, Bg = H // K, B // P
    rows = Bg * T * G
    itemsize = jnp.dtype(k_PKLD.dtype).itemsize
    block_k = _block_k(block_sizes.block_k, 512, L, itemsize)
    block_q = _block_q(block_sizes.block_q, rows, block_sizes.max_block_q)
    rows_pad = round_up(rows, block_q)
    heads = _heads_per_block(block_sizes.heads_per_block, K, P * (rows_pad // block_q), block_k,
                             D, itemsize, block_sizes.kv_vmem_budget)
    lengths = jnp.clip(lengths.astype(jnp.int32), 0, L)
    # Rows of one (group, KV head): r = (b_in_group * T + t) * G + g.
    q_PKRD = pad_rows(tokens_to_rows(q, K, groups=P), rows_pad)
    c = _Static(S=L, heads=heads, block_q=block_q, block_k=block_k,
                num_steps=max(cdiv(L, block_k), 1), sink=0, window=0, sparse=False,
                sink_steps=0, has_layer=False, has_new=False, mask_per_batch=False,
                sm_scale=float(sm_scale), precision=_precision(k_PKLD.dtype))
    o, lse = _attention_call(q_PKRD, k_PKLD, v_PKLD, lengths, None, None, c=c,
                             interpret=interpret, vmem_limit_bytes=block_sizes.vmem_limit_bytes,
                             name="jaxspec_tpu_prefix_attention")
    return rows_to_tokens(o, lse, B, T, G, grouped=True)


def tpu_prefix_attention_pkld(q, k_PKLD, v_PKLD, prefix_lengths=None, *, sm_scale=None,
                              interpret=None, block_sizes=None):
    """Shared-prefix attention with the prefix laid out ``[P, K, L, D]`` (TPU-native).

    Same contract as ``prefix_attention`` except the prefix layout: each (group,
    KV head) is a contiguous ``L x D`` stream, which is what the K/V BlockSpecs
    tile. Returns ``(out [B, T, H, D] in q.dtype, lse [B, T, H] float32)``.
    """
    kt = jax.ShapeDtypeStruct(tuple(k_PKLD.shape[i] for i in (0, 2, 1, 3)), k_PKLD.dtype)
    check_prefix_args(q, kt, kt, prefix_lengths)
    if v_PKLD.shape != k_PKLD.shape:
        raise ValueError(f"k/v prefix shapes differ: {k_PKLD.shape} / {v_PKLD.shape}")
    sm_scale = resolve_sm_scale(sm_scale, q.shape[-1])
    if interpret is True and _InterpretParams is not None:
        interpret = _InterpretParams()
    lengths = prefix_lengths_or_full(prefix_lengths, k_PKLD.shape[0], k_PKLD.shape[2])
    return _tpu_prefix(q, k_PKLD, v_PKLD, lengths, sm_scale=sm_scale,
                       interpret=interpret if interpret else False,
                       block_sizes=block_sizes or TPUPrefixBlockSizes())


def tpu_prefix_attention(q, k_prefix, v_prefix, prefix_lengths=None, *, sm_scale=None,
                         interpret=None, block_sizes=None):
    """Mosaic TPU shared-prefix attention; the contract of ``prefix_attention``.

    Takes the library's ``[P, L, K, D]`` prefix and transposes it to
    ``[P, K, L, D]`` first (see ``tpu_prefix_attention_pkld`` to skip that copy).
    """
    check_prefix_args(q, k_prefix, v_prefix, prefix_lengths)
    return tpu_prefix_attention_pkld(q, jnp.swapaxes(k_prefix, 1, 2),
                                     jnp.swapaxes(v_prefix, 1, 2), prefix_lengths,
                                     sm_scale=sm_scale, interpret=interpret,
                                     block_sizes=block_sizes)
