"""The Triton-lowered paged decode / verify kernel: ``decode_attention``'s contract (see
``decode_attention.py``) over a paged K/V cache; interpret mode runs it on any backend.

The paged cache. K and V are block pools ``[L, NB, K, BS, D]`` (or ``[NB, K, BS, D]`` without
``layer``): NB blocks ("pages") of BS slots. Sequence b's logical slot ``s`` lives in block
``block_table[b, s // BS]`` at offset ``s % BS``; ``block_table[B, MB]`` gives each sequence up
to MB blocks, so a sequence addresses ``MB * BS`` slots (the dense contract's S). The blocks
must hold slots ``[0, lengths[b] + T_new)`` (the new tokens' K/V are written through the table
before the call); entries past them may hold anything (e.g. NB for "no block"): the kernel
clamps every entry into the pool, so no address outside it is formed, and masks the keys of
such tiles, so whatever those blocks hold (NaN included) never reaches a result.

Kernel structure: as ``triton_decode`` (grid ``(q_blocks, splits, B, K)``, one program per
block of query rows, key split, sequence and KV head; ``triton_core``'s online softmax; splits
merged by log-sum-exp), with every K/V tile addressed through the block table
(``triton_core.page_tile_index``). A tile is part of one page (one table read, a contiguous
load) or whole pages (a table entry per key: the load gathers the pages' rows): every tile
starts on a multiple of its size, and its size divides BS or is a multiple of it (the
constraint below). For that the visible context is laid out in tile-aligned pieces:

* the sink part ``[0, a_end)`` and the window part ``[b_start, length)`` of a sparse context
  sit in a virtual key space as ``[0, a_end)`` padded up to a whole tile, then the window from
  the tile holding ``b_start`` (its keys below ``b_start`` masked), so the splits' tile
  boundaries are slot tile boundaries in both parts (the dense kernel lays the window right
  after ``a_end``, unaligned);
* the new tokens (slots ``length + [0, T_new)``) are read in ``block_k_new`` tiles from the
  one holding slot ``length``; keys before ``length`` are masked, and a tree mask is read at
  the matching (unaligned) column offset of a padded copy.

Constraint: ``block_k`` and ``block_k_new`` (powers of 2 >= 16) must each divide the page size
BS or be a multiple of it. Any power-of-2 BS (1, 8, 16, ..., 256, ...) works with every tile;
for other page sizes (48, 96, ...) the tiles must divide BS, so BS must be a multiple of 16
(any other page size raises a ValueError). By default ``block_k`` is the dense kernel's
choice (halved while it fits neither way: on power-of-2 pages it is kept, e.g. 64-key tiles
of four 16-slot pages), and ``block_k_new`` is at most ``block_k``; explicit sizes that fit
neither way raise a ValueError.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import triton_core as core
from .common import LOG2E, cdiv, next_pow2, num_sms, round_up
from .contracts import (layer_operand, pad_rows, resolve_num_new, rows_to_tokens,
                        tokens_to_rows)
from .splits import split_range
from .triton_decode import DecodeAttentionBlockSizes


@dataclasses.dataclass(frozen=True)
class PagedStatic:
    """Everything the paged kernel body needs to know statically."""
    T: int          # queries (the last T of the T_new new tokens)
    T_new: int      # new tokens (keys at logical slots length + [0, T_new))
    G: int
    page_size: int  # BS
    max_blocks: int  # MB: table entries per sequence
    num_blocks: int  # NB: blocks in the pool
    block_q: int
    block_k: int
    block_k_new: int
    split_size: int
    num_splits: int
    dynamic_split: bool
    sink: int
    window: int
    sparse: bool
    causal: bool
    mask_per_batch: bool
    mask_pad: int   # tree-mask columns padded in front (block_k_new): column j is at j + pad
    has_layer: bool
    scale_log2: float
    fast_exp: bool
    D: int
    rows: int = 0   # query rows T * G (those of a row block past it are padding)
    block_max: bool = False  # also write each context block's largest logit (dense only)
    score_block: int = 0  # ... per block of this many slots (block_k: a multiple)
    n_retrieved: int = 0  # sparse: blocks of block_k slots per row and KV head read besides

    @property
    def S(self) -> int:
        """Logical slots a sequence addresses."""
        return self.max_blocks * self.page_size


def _paged_kernel(layer_ref, lengths_ref, q_ref, k_ref, v_ref, table_ref, *rest,
                  c: PagedStatic):
    rest = list(rest)
    mask_ref = None if c.causal else rest.pop(0)
    blocks_ref = rest.pop(0) if c.n_retrieved else None
    o_ref, lse_ref, *blk_ref = rest
    qi, si, b, h = (pl.program_id(i) for i in range(4))
    bq, bk, bkn = c.block_q, c.block_k, c.block_k_new

    length = jnp.clip(lengths_ref[b], 0, c.S)
    layer = layer_ref[0] if c.has_layer else None
    q, head_ok = core.load_queries(q_ref, k_ref.dtype, c.D)      # [bq, Dp]

    def step(state, start, size, load_ok, score_ok, row_max=False):
        """One online-softmax step over logical slots [start, start + size) (part of one
        page or whole pages)."""
        idx = core.page_tile_index(table_ref, b, start, size, page_size=c.page_size,
                                   max_blocks=c.max_blocks, num_blocks=c.num_blocks, head=h,
                                   head_lanes=k_ref.shape[-1], layer=layer)
        # masked where needed: keys outside the range come back as 0 (no NaN), as do lanes
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

    # The visible context in a virtual key space of whole tiles: A = [0, a_end) at virtual
    # [0, a_end), then (sparse) the window [b_start, length) from its tile's start b_tile at
    # virtual a_pad = a_end rounded up to a tile, so that virtual tile boundaries are slot tile
    # boundaries in both parts.
    a_end = jnp.minimum(c.sink, length) if c.sparse else length
    if c.sparse:
        b_start = jnp.maximum(length - c.window, a_end)
        a_pad = lax.div(a_end + (bk - 1), bk) * bk
        b_tile = lax.div(b_start, bk) * bk
        v_len = jnp.where(length > b_start, a_pad + (length - b_tile), a_end)
    else:
        v_len = length
    v0, v1 = split_range(si, v_len, c)  # this split's share (whole tiles) of the virtual keys
    state = core.stream_keys(context_step, state, jnp.minimum(v0, a_end),
                             jnp.minimum(v1, a_end), bk)
    if c.sparse:
        shift = b_tile - a_pad
        state = core.stream_keys_from(context_step, state, jnp.maximum(v0, a_pad) + shift,
                                      jnp.maximum(v1, a_pad) + shift, b_start, bk)
    if c.n_retrieved:  # retrieved blocks (between the sink and the window), read in place
        state = core.stream_retrieved(step, state, blocks_ref, b, h, si, count=c.n_retrieved,
                                      num_splits=c.num_splits, block=bk, lo=a_end, hi=b_start)

    # New tokens (slots length + j, j < T_new): attended by the last split only, in tiles of
    # bkn slots from the one holding slot `length`. Query row r is query t = r // G, i.e. new
    # token t + (T_new - T).
    off = c.T_new - c.T
    r0 = qi * bq
    t_row = lax.div(r0 + jnp.arange(bq, dtype=jnp.int32), c.G)      # [bq]
    is_last = (si == c.num_splits - 1).astype(jnp.int32)
    if c.causal:  # the rows of this block see new tokens j < j_max
        j_max = jnp.minimum(lax.div(r0 + bq - 1, c.G) + 1 + off, c.T_new)
    else:
        j_max = c.T_new
    first = lax.div(length, bkn) * bkn
    n_new = is_last * (lax.div(length + j_max + (bkn - 1), bkn) - lax.div(length, bkn))
    bm = b if c.mask_per_batch else 0

    def new_body(i, st):
        start = first + i * bkn
        j = start - length + jnp.arange(bkn, dtype=jnp.int32)        # new-token index
        ok = (j >= 0) & (j < c.T_new) & (start + jnp.arange(bkn, dtype=jnp.int32) < c.S)
        if c.causal:
            vis = j[None, :] <= t_row[:, None] + off
        else:
            vis = mask_ref[bm, pl.ds(r0, bq), pl.ds(start - length + c.mask_pad, bkn)] != 0
        return step(st, start, bkn, ok, vis & ok[None, :])
    state = lax.fori_loop(0, n_new, new_body, state)
    core.finalize(state, o_ref, lse_ref, head_ok)


def plan(B, K, T, G, D, page_size, max_blocks, *, sink, window,
         bs: DecodeAttentionBlockSizes, on_gpu: bool, itemsize: int = 2,
         T_new: int | None = None, extra_keys: int = 0):
    """Concrete static tiling of the paged kernel (T: queries, T_new: new keys; ``extra_keys``:
    keys a sparse read takes besides sink and window):
    ``(block_q, block_k, block_k_new, split_size, num_splits, num_q_blocks)``. Raises a
    ValueError for a page size that is neither a power of 2 nor a multiple of 16 (no key tile
    fits it) and where a key tile neither divides the page size nor is a multiple of it (see
    the module doc)."""
    T_new = T if T_new is None else T_new
    if page_size % 16 and page_size != next_pow2(page_size):
        raise ValueError(f"the paged kernel needs a page size (k_pages.shape[-2]) that is a "
                         f"power of 2 or a multiple of 16, got {page_size}")
    S = max_blocks * page_size
    rows = T * G
    sparse = bool(sink) or bool(window)
    block_q = core.auto_block_q(bs, rows)
    if bs.block_k is not None:
        block_k = bs.block_k
    else:
        v_dense = min(S, (sink or 0) + (window or 0)) if sparse else S
        block_k = 128 if block_q <= 32 and v_dense > 4096 else 64
        while block_k > 16 and page_size % block_k and block_k % page_size:
            block_k //= 2
    if on_gpu:
        block_k = core.fit_block_k(block_k, block_q, D, itemsize, bs.num_stages)
    block_k_new = bs.block_k_new or min(max(16, next_pow2(T_new)), max(16, block_k))
    core.check_blocks(block_k=block_k, block_q=block_q, block_k_new=block_k_new)
    core.check_page_tiles(page_size, block_k=block_k, block_k_new=block_k_new)
    num_q_blocks = cdiv(rows, block_q)
    # the longest virtual context (sink padded to a tile, window from its tile's start)
    v_max = min(S + 2 * block_k, round_up(sink or 0, block_k) + (window or 0) + block_k
                + extra_keys) if sparse else S
    v_max = max(v_max, 1)
    if bs.split_size is not None:
        split = bs.split_size
        if split % block_k:
            raise ValueError(f"block_sizes.split_size={split} must be a multiple of "
                             f"block_k={block_k} for the paged kernel")
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
def triton_paged_decode_attention(q, k_pages, v_pages, block_table, lengths, tree_mask, layer,
                                  *, sink, window, sm_scale, interpret, block_sizes, on_gpu,
                                  num_new=None, score_block=None, retrieved=None,
                                  retrieve_block=None):
    """The kernel on checked arguments (``dispatch.paged_decode_attention`` checks them):
    static ``sink``/``window`` ints (0: none), ``sm_scale`` a float, ``on_gpu``: compiled for
    a GPU (shared-memory fitting, fast exp2) rather than interpreted. ``score_block`` and
    ``retrieved`` / ``retrieve_block``: as ``triton_decode_attention``'s (block scores of a
    dense read; retrieved blocks of a sparse one, read through the table)."""
    block_sizes, n_ret = core.block_options(block_sizes, sink=sink, window=window,
                                            score_block=score_block, retrieved=retrieved,
                                            retrieve_block=retrieve_block)
    B, T, H, D = q.shape
    T_new = resolve_num_new(T, tree_mask, num_new)
    has_layer = layer is not None
    NB, K, BS = k_pages.shape[-4:-1]
    MB = block_table.shape[1]
    G = H // K
    rows = T * G
    block_q, block_k, block_k_new, split, num_splits, nq = plan(
        B, K, T, G, D, BS, MB, sink=sink, window=window, bs=block_sizes, on_gpu=on_gpu,
        itemsize=jnp.dtype(k_pages.dtype).itemsize, T_new=T_new,
        extra_keys=n_ret * (retrieve_block or 0))
    core.check_block_tile(block_k, score_block=score_block, n_retrieved=n_ret,
                          retrieve_block=retrieve_block)
    rows_pad = nq * block_q

    q_BKRD = tokens_to_rows(q, K)                                      # rows r = t * G + g
    if rows_pad != rows:
        q_BKRD = pad_rows(q_BKRD, rows_pad)

    causal = tree_mask is None
    table = block_table.astype(jnp.int32)
    inputs = [layer_operand(layer), lengths.astype(jnp.int32), q_BKRD, k_pages, v_pages, table]
    extra_shapes = [table.shape]
    mask_per_batch = False
    if not causal:
        tm = jnp.asarray(tree_mask)
        if tm.ndim == 2:
            tm = tm[None]
        mask_per_batch = tm.shape[0] != 1
        tm_rows = jnp.repeat(tm.astype(jnp.int8), G, axis=1)           # [Bm, T*G, T_new]
        # column j at j + block_k_new: the new-token tiles start up to block_k_new - 1 slots
        # before the first new token and end up to 2 tiles past the last
        cols = 2 * block_k_new + round_up(T_new, block_k_new)
        tm_rows = jnp.pad(tm_rows, ((0, 0), (0, rows_pad - rows),
                                    (block_k_new, cols - block_k_new - T_new)))
        inputs.append(tm_rows)
        extra_shapes.append(tm_rows.shape)
    if n_ret:
        inputs.append(retrieved.astype(jnp.int32))
        extra_shapes.append(retrieved.shape)

    static = PagedStatic(
        T=T, T_new=T_new, G=G, page_size=BS, max_blocks=MB, num_blocks=NB, block_q=block_q,
        block_k=block_k, block_k_new=block_k_new, split_size=split, num_splits=num_splits,
        dynamic_split=block_sizes.split_size is None, sink=int(sink or 0),
        window=int(window or 0), sparse=bool(sink) or bool(window), causal=causal,
        mask_per_batch=mask_per_batch, mask_pad=block_k_new, has_layer=has_layer,
        scale_log2=float(sm_scale) * LOG2E,
        fast_exp=core.use_fast_exp(block_sizes, on_gpu), D=D, rows=rows,
        block_max=score_block is not None, score_block=int(score_block or 0), n_retrieved=n_ret)
    S = MB * BS
    extra_out = () if score_block is None else (
        core.block_max_output(nq, B, K, S, score_block, block_k),)
    o, lse, *blk = core.attention_call(
        functools.partial(_paged_kernel, c=static), inputs, extra_shapes,
        kv_shape=k_pages.shape, num_splits=num_splits, block_q=block_q, rows_pad=rows_pad, D=D,
        out_dtype=q.dtype, block_sizes=block_sizes, interpret=interpret,
        name="jaxspec_paged_decode_attention", extra_out=extra_out)
    o, lse = rows_to_tokens(o, lse, B, T, G)
    if score_block is None:
        return o, lse
    return o, lse, core.block_max_result(blk[0], lengths, S, score_block)
