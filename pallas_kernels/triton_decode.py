"""The Triton-lowered decode / verify kernel (``decode_attention``'s contract, see
``decode_attention.py``); interpret mode runs it on any backend.

Kernel structure: grid ``(q_blocks, splits, B, K)``. One program owns one KV head of one
sequence, a block of ``block_q`` query rows (rows are ``(t, g)`` pairs, all G query heads of
the KV head times all T tokens: each K/V byte is read once per row block), and one split of
the (virtual, i.e. sink+window-compacted) context (flash-decoding). It streams K/V in
``block_k`` slot blocks through the online softmax of ``triton_core``; interior blocks run
unmasked, only the tail block of a range is masked. The last split also attends to the
T_new new tokens under the causal/tree mask (``block_k_new`` keys per step; mask rows are
query rows). Splits are merged by log-sum-exp. Any head dim D: the tiles hold
``head_tile(D)`` lanes (the next power of 2, at least 16), those past D masked.

Layers: with stacked caches ``[L, B, K, S, D]`` the kernel reads layer ``layer`` in place
(the index is a 1-element int32 input; no copy of the layer's cache is made).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import triton_core as core
from .common import LOG2E, cdiv, next_pow2, num_sms
from .contracts import (layer_operand, pad_rows, resolve_num_new, rows_to_tokens,
                        tokens_to_rows)
from .splits import split_range


@dataclasses.dataclass(frozen=True)
class DecodeAttentionBlockSizes:
    """Static tiling of the decode/verify kernel (None = chosen from the shapes).

    block_k: context slots per inner step (power of 2, >= 16); None: 128 for
      few query rows (block_q <= 32) over a long context (> 4096 visible slots),
      else 64 (the fastest in the block-size sweep of ``scripts/bench_attention.py
      --tune``). On GPU it is halved while the K/V pipeline buffers would not fit in shared
      memory.
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


# The defaults every GPU uses (the block-size sweep of scripts/bench_attention.py --tune;
# results in benchmarks/attention_h100.md).
GPU_DEFAULTS = DecodeAttentionBlockSizes()


@dataclasses.dataclass(frozen=True)
class DecodeStatic:
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
    rows: int = 0   # query rows T * G (those of a row block past it are padding)
    block_max: bool = False  # also write each context block's largest logit (dense only)
    score_block: int = 0  # ... per block of this many slots (block_k: a multiple)
    n_retrieved: int = 0  # sparse: blocks of block_k slots per row and KV head read besides


def _decode_kernel(layer_ref, lengths_ref, q_ref, k_ref, v_ref, *rest, c: DecodeStatic):
    rest = list(rest)
    mask_ref = None if c.causal else rest.pop(0)
    blocks_ref = rest.pop(0) if c.n_retrieved else None
    o_ref, lse_ref, *blk_ref = rest
    qi, si, b, h = (pl.program_id(i) for i in range(4))
    bq, bk, bkn = c.block_q, c.block_k, c.block_k_new

    length = jnp.clip(lengths_ref[b], 0, c.S)
    lead = (layer_ref[0], b, h) if c.has_layer else (b, h)
    q, head_ok = core.load_queries(q_ref, k_ref.dtype, c.D)      # [bq, Dp]

    def step(state, start, size, load_ok, score_ok, row_max=False):
        """One online-softmax step over slots [start, start + size)."""
        idx = (*lead, pl.ds(start, size), slice(None))
        # masked where needed: rows outside the range come back as 0 (no NaN), as do lanes
        # past D
        k = core.load_rows(k_ref, idx, load_ok, head_ok)
        v = core.load_rows(v_ref, idx, load_ok, head_ok)
        return core.update(state, q, k, v, scale_log2=c.scale_log2, score_ok=score_ok,
                           fast_exp=c.fast_exp, row_max=row_max)

    real_rows = qi * bq + jnp.arange(bq, dtype=jnp.int32) < c.rows

    def context_step(state, start, ok):
        if c.block_max:  # and the block's largest logit (its real query rows)
            return core.scored_step(step, blk_ref[0], state, start, ok,
                                    block=c.score_block, tile=bk, real_rows=real_rows)
        return step(state, start, bk, ok, None if ok is None else ok[None, :])

    state = core.init_state(bq, q_ref.shape[-1])

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
    state = core.stream_keys(context_step, state, jnp.minimum(v0, a_end),
                             jnp.minimum(v1, a_end), bk)
    if c.sparse:
        shift = b_start - a_end
        state = core.stream_keys(context_step, state, jnp.maximum(v0, a_end) + shift,
                                 jnp.maximum(v1, a_end) + shift, bk)
    if c.n_retrieved:  # retrieved blocks (between the sink and the window), read in place
        state = core.stream_retrieved(step, state, blocks_ref, b, h, si, count=c.n_retrieved,
                                      num_splits=c.num_splits, block=bk, lo=a_end, hi=b_start)

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
        n_new = is_last * cdiv(c.T_new, bkn)
    bm = b if c.mask_per_batch else 0

    def new_body(i, st):
        j0 = i * bkn
        j = j0 + jnp.arange(bkn, dtype=jnp.int32)
        ok = (j < c.T_new) & (length + j < c.S)
        if c.causal:
            vis = j[None, :] <= t_row[:, None] + off
        else:
            vis = mask_ref[bm, pl.ds(r0, bq), pl.ds(j0, bkn)] != 0
        return step(st, length + j0, bkn, ok, vis & ok[None, :])
    state = lax.fori_loop(0, n_new, new_body, state)
    core.finalize(state, o_ref, lse_ref, head_ok)


def plan(B, K, T, G, S, D, *, sink, window, bs: DecodeAttentionBlockSizes, on_gpu: bool,
         itemsize: int = 2, T_new: int | None = None, extra_keys: int = 0):
    """Resolves automatic block sizes into concrete static numbers (T: queries, T_new: new
    keys; ``extra_keys``: keys a sparse read takes besides sink and window): ``(block_q,
    block_k, block_k_new, split_size, num_splits, num_q_blocks)``."""
    T_new = T if T_new is None else T_new
    rows = T * G
    sparse = bool(sink) or bool(window)
    v_max = min(S, (sink or 0) + (window or 0) + extra_keys) if sparse else S
    v_max = max(v_max, 1)
    block_q = core.auto_block_q(bs, rows)
    block_k = bs.block_k or (128 if block_q <= 32 and v_max > 4096 else 64)
    if on_gpu:
        block_k = core.fit_block_k(block_k, block_q, D, itemsize, bs.num_stages)
    block_k_new = bs.block_k_new or min(max(16, next_pow2(T_new)), max(16, block_k))
    core.check_blocks(block_k=block_k, block_q=block_q, block_k_new=block_k_new)
    num_q_blocks = cdiv(rows, block_q)
    if bs.split_size is not None:
        split = bs.split_size
    else:
        target = bs.target_programs or (2 * num_sms() if on_gpu else 1)
        base = B * K * num_q_blocks
        n = max(1, min(cdiv(target, base), cdiv(v_max, bs.min_split_size)))
        split = cdiv(cdiv(v_max, n), block_k) * block_k
    num_splits = max(1, cdiv(v_max, split))
    return block_q, block_k, block_k_new, split, num_splits, num_q_blocks


@functools.partial(
    jax.jit,
    static_argnames=("sink", "window", "sm_scale", "interpret", "block_sizes", "on_gpu",
                     "num_new", "score_block", "retrieve_block"))
def triton_decode_attention(q, k_cache, v_cache, lengths, tree_mask, layer, *, sink, window,
                            sm_scale, interpret, block_sizes, on_gpu, num_new=None,
                            score_block=None, retrieved=None, retrieve_block=None):
    """The kernel on checked arguments (``dispatch.decode_attention`` checks them): static
    ``sink``/``window`` ints (0: none), ``sm_scale`` a float, ``on_gpu``: compiled for a GPU
    (shared-memory fitting, fast exp2) rather than interpreted. ``score_block`` (dense only):
    the context is read in blocks of that many slots and the kernel also returns each row's
    and KV head's largest logit (``q . k * sm_scale``) per block, ``[B, K, cdiv(S,
    score_block)]`` float32 (-inf for a block past the row's context): ``(out, lse, scores)``.
    ``retrieved`` ``[B, K, R]`` int32 (sparse only): per row and KV head R blocks of
    ``retrieve_block`` slots (block indices, -1: none) read besides the sink and window; they
    must lie between the two (`jaxspec.retrieval` selects them so)."""
    block_sizes, n_ret = core.block_options(block_sizes, sink=sink, window=window,
                                            score_block=score_block, retrieved=retrieved,
                                            retrieve_block=retrieve_block)
    B, T, H, D = q.shape
    T_new = resolve_num_new(T, tree_mask, num_new)
    has_layer = layer is not None
    K, S = k_cache.shape[-3], k_cache.shape[-2]
    G = H // K
    rows = T * G
    block_q, block_k, block_k_new, split, num_splits, nq = plan(
        B, K, T, G, S, D, sink=sink, window=window, bs=block_sizes, on_gpu=on_gpu,
        itemsize=jnp.dtype(k_cache.dtype).itemsize, T_new=T_new,
        extra_keys=n_ret * (retrieve_block or 0))
    core.check_block_tile(block_k, score_block=score_block, n_retrieved=n_ret,
                          retrieve_block=retrieve_block)
    rows_pad = nq * block_q

    q_BKRD = tokens_to_rows(q, K)                                      # rows r = t * G + g
    if rows_pad != rows:
        q_BKRD = pad_rows(q_BKRD, rows_pad)

    causal = tree_mask is None
    inputs = [layer_operand(layer), lengths.astype(jnp.int32), q_BKRD, k_cache, v_cache]
    extra_shapes = []
    mask_per_batch = False
    if not causal:
        tm = jnp.asarray(tree_mask)
        if tm.ndim == 2:
            tm = tm[None]
        mask_per_batch = tm.shape[0] != 1
        tm_rows = jnp.repeat(tm.astype(jnp.int8), G, axis=1)           # [Bm, T*G, T_new]
        cols_pad = cdiv(T_new, block_k_new) * block_k_new
        tm_rows = jnp.pad(tm_rows, ((0, 0), (0, rows_pad - rows), (0, cols_pad - T_new)))
        inputs.append(tm_rows)
        extra_shapes.append(tm_rows.shape)
    if n_ret:
        inputs.append(retrieved.astype(jnp.int32))
        extra_shapes.append(retrieved.shape)

    static = DecodeStatic(
        T=T, T_new=T_new, G=G, S=S, block_q=block_q, block_k=block_k, block_k_new=block_k_new,
        split_size=split, num_splits=num_splits,
        dynamic_split=block_sizes.split_size is None, sink=int(sink or 0),
        window=int(window or 0), sparse=bool(sink) or bool(window), causal=causal,
        mask_per_batch=mask_per_batch, has_layer=has_layer,
        scale_log2=float(sm_scale) * LOG2E,
        fast_exp=core.use_fast_exp(block_sizes, on_gpu), D=D, rows=rows,
        block_max=score_block is not None, score_block=int(score_block or 0), n_retrieved=n_ret)
    extra_out = ()
    if score_block is not None:
        extra_out = (core.block_max_output(nq, B, K, S, score_block, block_k),)
    o, lse, *blk = core.attention_call(
        functools.partial(_decode_kernel, c=static), inputs, extra_shapes,
        kv_shape=k_cache.shape, num_splits=num_splits, block_q=block_q, rows_pad=rows_pad, D=D,
        out_dtype=q.dtype, block_sizes=block_sizes, interpret=interpret,
        name="jaxspec_decode_attention", extra_out=extra_out)
    o, lse = rows_to_tokens(o, lse, B, T, G)
    if score_block is None:
        return o, lse
    return o, lse, core.block_max_result(blk[0], lengths, S, score_block)
