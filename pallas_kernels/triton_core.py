"""The core both Triton-lowered kernels (decode / verify and shared prefix) are built from.

The online softmax. A program owns ``rows`` query rows (all query heads of one KV head) and
streams K/V blocks through an online softmax in base 2: the state is ``(acc[rows, Dp]
float32, m[rows], l[rows])`` with ``m`` the running row max of the base-2 logits and ``l``
the running sum of ``exp2(logit - m)``. The pieces:

* ``load_queries``: the program's query tile (head lanes past D masked);
* ``init_state``, ``update`` (one block of keys), ``stream_keys`` (a key range: whole blocks
  unmasked, then one masked tail block), ``finalize`` (normalise, store ``out`` and the
  natural-log ``lse``; a row that saw no key gets ``out = 0``, ``lse = -inf``);
* ``load_rows`` / ``store_rows``: masked loads and stores (rows outside a valid range and
  lanes past the head dim read as 0: no NaN garbage enters a product);
* ``exp2``: one ``ex2.approx.ftz.f32`` instruction on NVIDIA GPUs (what Triton's own exp2
  emits) instead of libdevice's ``exp2f``.

Two address modes for the K/V a kernel streams: dense (a tile is ``pl.ds(start, size)`` of a
sequence's slot axis) and paged (``page_tile_index``: a block pool ``[(L,) NB, K, BS, D]`` and a
block table; a tile starts on a multiple of its size and is part of one page or whole pages,
``check_page_tiles``). ``stream_keys_from`` streams an aligned key
range whose first keys are hidden (a paged kernel's sparse window starting inside a tile).
The self-draft's retrieval (``jaxspec.retrieval``) adds two pieces both kernels share:
``scored_step`` (a context block that also writes its largest logit; ``block_max_output`` /
``block_max_result`` around it) and ``stream_retrieved`` (a split's share of per-row block
indices, each block read whole, in place).

These are plain Python functions called while the kernel body is traced: they emit the ops
in place, so sharing them costs nothing at run time.

The launch. Both kernels plan their tiles the same way (``auto_block_q``, ``fit_block_k``,
``check_blocks``) and run one ``pallas_call`` of the same shape (``attention_call``): grid
``(row blocks, key splits, N, K)`` over query rows ``[N, K, R, D]``
(``contracts.tokens_to_rows``) and whole-array K/V refs, one partial result per key split,
merged by log-sum-exp.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import common
from .common import HIGHEST, LN2, TRITON_SMEM_BYTES, head_tile, next_pow2
from .merge import merge_stacked

try:  # Triton-specific helpers (masked loads, inline asm, compiler params).
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - a jax without the Triton backend
    pltriton = None


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
    return pltriton.load(ref, mask=mask, other=0)


def store_rows(ref, x, head_ok):
    """``ref[...] = x`` for the lanes below the head dim only (``head_ok`` None: all)."""
    if head_ok is None:
        ref[...] = x
    else:
        pltriton.store(ref, x, mask=head_ok[None, :])


def exp2(x, fast: bool):
    """``2 ** x``; ``fast``: one ``ex2.approx.ftz.f32`` (NVIDIA GPUs only)."""
    if not fast:
        return jnp.exp2(x)
    [y] = pltriton.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
    return y


def load_queries(q_ref, kv_dtype, D: int):
    """The program's query tile ``[rows, Dp]`` in the K/V dtype, and the head-lane mask
    (None where the tile is exactly D lanes wide, else ``lane < D``)."""
    head_dim = q_ref.shape[-1]                       # head_tile(D) lanes
    head_ok = None if head_dim == D else jnp.arange(head_dim, dtype=jnp.int32) < D
    q = load_rows(q_ref, None, None, head_ok)        # [rows, Dp]
    if q.dtype != kv_dtype:
        q = q.astype(kv_dtype)
    return q, head_ok


def init_state(rows: int, head_dim: int):
    """``(acc, m, l)`` of rows that have seen no key yet."""
    return (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def update(state, q, k, v, *, scale_log2: float, score_ok=None, fast_exp: bool,
           fold_scale: bool = False, row_max: int = 0):
    """One online-softmax step of the rows over the keys ``k, v[n, Dp]``.

    ``score_ok``: None, or a bool mask broadcastable to ``[rows, n]`` (hidden scores are -inf).
    ``fold_scale``: keep the raw logits and fold the scale into the max and into one
    multiply-add per score before the exp2 (valid for a positive scale, where the row max
    commutes with the scaling); otherwise the logits are scaled first.
    ``row_max`` (m > 0): also return, for each of m equal parts of these keys, each row's
    largest base-2 logit over that part (-inf where none is visible): ``(state, [row_max[rows]]
    * m)``.
    """
    acc, m, l = state
    fold = fold_scale and scale_log2 > 0
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=HIGHEST,
                        preferred_element_type=jnp.float32)
    if not fold:
        s = s * scale_log2                           # base-2 logits
    if score_ok is not None:
        s = jnp.where(score_ok, s, -jnp.inf)
    s_max = s
    blk_max = jnp.max(s, axis=1) * scale_log2 if fold else jnp.max(s, axis=1)
    m_new = jnp.maximum(m, blk_max)
    # A row that has seen no key yet keeps m = -inf; shift by 0 there so that
    # exp2(-inf - 0) = 0 instead of exp2(-inf + inf) = NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    if fold:
        s = s * scale_log2 - m_safe[:, None]
    else:
        s = s - m_safe[:, None]
    p = exp2(s, fast_exp)
    l = l * alpha + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         precision=HIGHEST, preferred_element_type=jnp.float32)
    acc = acc * alpha[:, None] + pv
    if row_max == 1:
        return (acc, m_new, l), [blk_max]
    if row_max:
        n = s.shape[1]
        part = lax.div(jnp.arange(n, dtype=jnp.int32), n // row_max)
        parts = [jnp.max(jnp.where((part == j)[None, :], s_max, -jnp.inf), axis=1)
                 for j in range(row_max)]
        if fold:
            parts = [x * scale_log2 for x in parts]
        return (acc, m_new, l), parts
    return acc, m_new, l


def stream_keys(step, state, lo, hi, block: int):
    """Runs ``step`` over the keys ``[lo, hi)`` (traced ints) in blocks of ``block``: the whole
    blocks with ``step(state, start, None)`` (no masking work), then a ragged tail block, if
    any, with ``step(state, start, ok)``, ``ok[block]`` marking the keys below ``hi``."""
    n = jnp.maximum(hi - lo, 0)
    n_full = lax.div(n, block)
    state = lax.fori_loop(0, n_full, lambda i, st: step(st, lo + i * block, None), state)
    tail = lo + n_full * block

    def tail_body(i, st):
        return step(st, tail, tail + jnp.arange(block, dtype=jnp.int32) < hi)
    has_tail = (n - n_full * block > 0).astype(jnp.int32)
    return lax.fori_loop(0, has_tail, tail_body, state)


def scored_step(step, blk_ref, state, start, ok, *, block: int, tile: int, real_rows):
    """``step`` over the context keys ``[start, start + tile)`` (``ok``: None, or the keys
    visible) that also writes the largest base-2 logit over the ``real_rows`` of the program's
    query tile of each of its ``tile / block`` blocks into ``blk_ref[start / block + j]``.
    ``step(state, start, size, load_ok, score_ok, row_max=m)`` returns ``(state, [row_max] *
    m)``. Splits own whole tiles, so every block is written by one program."""
    m = tile // block
    state, mx = step(state, start, tile, ok, None if ok is None else ok[None, :], row_max=m)
    first = lax.div(start, block)
    for j in range(m):
        blk_ref[pl.ds(first + j, 1)] = jnp.max(jnp.where(real_rows, mx[j], -jnp.inf),
                                               keepdims=True)
    return state


def block_options(block_sizes, *, sink, window, score_block, retrieved, retrieve_block):
    """``(block_sizes, retrieved blocks per row and head)`` for a kernel call: block scores (a
    dense read) need key tiles of a multiple of their block (each tile writes the maxima of the
    blocks it holds; with a split size of the caller's, tiles of exactly one block, so that
    splits own whole blocks), retrieved blocks (a sparse read) tiles of exactly their block."""
    if score_block is not None:
        if sink or window:
            raise ValueError("block scores come from a dense read (no sink / window)")
        if block_sizes.split_size is not None:
            block_sizes = dataclasses.replace(block_sizes, block_k=int(score_block))
    n_ret = 0 if retrieved is None else int(retrieved.shape[-1])
    if n_ret:
        if not (sink or window):
            raise ValueError("retrieved blocks go with a sparse read (sink / window)")
        block_sizes = dataclasses.replace(block_sizes, block_k=int(retrieve_block))
    return block_sizes, n_ret


class BlockTileError(ValueError):
    """The key tile a kernel plans is not the size that block scores / retrieved blocks need."""


def check_block_tile(block_k: int, *, score_block, n_retrieved: int, retrieve_block):
    """Raises `BlockTileError` where the planned key tile is not the scores' / retrieved blocks'
    size (shared memory made the plan halve it: large head dims)."""
    if score_block is not None and block_k % score_block:
        raise BlockTileError(f"block scores of {score_block} slots need key tiles of a multiple "
                             f"of that size; the kernel reads {block_k} (shared memory)")
    if score_block is None and n_retrieved and block_k != retrieve_block:
        raise BlockTileError(f"retrieved blocks of {retrieve_block} slots need key tiles of "
                             f"that size; the kernel reads {block_k} (shared memory)")


def block_max_output(nq: int, N: int, K: int, S: int, block: int, tile: int):
    """The ``extra_out`` entry of ``attention_call`` for block maxima: ``[nq, N, K, n]``
    float32 (n: the next power of 2 of the blocks in ``cdiv(S, tile)`` key tiles), one row of
    blocks per program."""
    n = next_pow2(-(-S // tile) * (tile // block))
    return (jax.ShapeDtypeStruct((nq, N, K, n), jnp.float32),
            pl.BlockSpec((None, None, None, n), lambda qi, si, b, h: (qi, b, h, 0)))


def block_max_result(blk, lengths, S: int, block: int):
    """``[N, K, cdiv(S, block)]`` natural-log logits from the kernel's base-2 block maxima
    (``block_max_output``): the max over row blocks, -inf for a block past a row's context
    (never written)."""
    n = -(-S // block)
    sc = jnp.max(blk, axis=0)[..., :n] * LN2
    seen = jnp.arange(n, dtype=jnp.int32)[None, :] * block < jnp.clip(lengths, 0, S)[:, None]
    return jnp.where(seen[:, None, :], sc, -jnp.inf)


def stream_retrieved(step, state, blocks_ref, b, h, si, *, count: int, num_splits: int,
                     block: int, lo, hi):
    """Split ``si``'s share of ``count`` retrieved blocks of row ``b`` and KV head ``h``
    (``blocks_ref[b, h, i]``: a block index, -1 for none), each the ``block`` slots
    ``[j * block, (j + 1) * block)`` read whole by ``step(state, start, size, load_ok,
    score_ok)``, of which the slots in ``[lo, hi)`` count (between the sink and the window: a
    block may reach into either, whose keys are read there)."""
    per = -(-count // num_splits)
    first = jnp.minimum(si * per, count)
    last = jnp.minimum(first + per, count)
    lanes = jnp.arange(block, dtype=jnp.int32)

    def body(i, st):
        j = blocks_ref[b, h, i]
        start = jnp.maximum(j, 0) * block
        ok = (j >= 0) & (start + lanes >= lo) & (start + lanes < hi)
        return step(st, start, block, ok, ok[None, :])
    return lax.fori_loop(first, last, body, state)


def stream_keys_from(step, state, lo, hi, first, block: int):
    """``stream_keys`` over ``[lo, hi)`` with the keys below ``first`` hidden, where ``lo`` is
    a tile boundary at most one ``block`` below ``first`` (or at / past it): a head block that
    holds hidden keys runs masked (``ok`` marks keys in ``[first, hi)``), the rest as
    ``stream_keys``. Every load stays at ``lo + i * block``."""
    head = ((lo < first) & (lo < hi)).astype(jnp.int32)

    def head_body(i, st):
        key = lo + jnp.arange(block, dtype=jnp.int32)
        return step(st, lo, (key >= first) & (key < hi))
    state = lax.fori_loop(0, head, head_body, state)
    return stream_keys(step, state, lo + head * block, hi, block)


def page_tile_index(table_ref, row, start, size: int, *, page_size: int, max_blocks: int,
                    num_blocks: int, head, head_lanes: int, layer=None):
    """The index of the K/V tile of logical slots ``[start, start + size)`` of sequence ``row``
    in a block pool ``[(L,) NB, K, BS, D]`` (``layer`` None: no layer axis): logical slot ``s``
    is in block ``table_ref[row, s // BS]`` at offset ``s % BS``. ``start`` must be a multiple
    of ``size``, and ``size`` a divisor or a multiple of ``page_size`` (``check_page_tiles``):

    * ``size <= page_size``: the tile lies in one page; one table read, a contiguous
      ``pl.ds`` of that page;
    * ``size > page_size``: the tile is ``size / page_size`` whole pages; key ``r`` of the tile
      is read from its page's block (a table entry per key; integer arrays index every axis,
      ``head_lanes`` lanes: the load gathers the pages' rows).

    Table columns and blocks are clamped into the table and the pool, so a tile past a
    sequence's blocks (unmapped entries, any value) addresses blocks of the pool, never memory
    outside it: callers mask its keys."""
    if size <= page_size:
        j = lax.div(start, page_size)
        blk = jnp.minimum(jnp.maximum(table_ref[row, jnp.minimum(j, max_blocks - 1)], 0),
                          num_blocks - 1)
        lead = (blk, head) if layer is None else (layer, blk, head)
        return (*lead, pl.ds(start - j * page_size, size), slice(None))
    # whole pages: integer arrays index every axis (blocks and offsets [size, 1], lanes
    # [1, head lanes]), so the tile's rows come from their own pages
    r = jnp.arange(size, dtype=jnp.int32)[:, None]
    page_of_key = lax.div(r, page_size)
    j = lax.div(start, page_size) + page_of_key
    blk = jnp.minimum(jnp.maximum(table_ref[row, jnp.minimum(j, max_blocks - 1)], 0),
                      num_blocks - 1)                                  # [size, 1]
    lanes = jnp.arange(head_lanes, dtype=jnp.int32)[None, :]
    lead = (blk, head) if layer is None else (layer, blk, head)
    return (*lead, r - page_of_key * page_size, lanes)


def check_page_tiles(page_size: int, **sizes) -> None:
    """Every key tile of a paged kernel must divide the page size (a tile inside one page) or
    be a multiple of it (a tile of whole pages)."""
    for name, val in sizes.items():
        if page_size % val and val % page_size:
            raise ValueError(
                f"{name}={val} must divide the page size {page_size} or be a multiple of it "
                f"(a key tile of the paged kernel is part of one page or whole pages)")


def finalize(state, o_ref, lse_ref, head_ok):
    """Writes ``out = acc / l`` (lanes below the head dim) and the natural-log
    ``lse = m ln 2 + log l``; rows that saw no key get ``out = 0``, ``lse = -inf``."""
    acc, m, l = state
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    store_rows(o_ref, (acc / l_safe[:, None]).astype(o_ref.dtype), head_ok)
    lse_ref[...] = jnp.where(seen, m * LN2 + jnp.log(l_safe), -jnp.inf)


# --- planning and launch -------------------------------------------------------------

def auto_block_q(block_sizes, rows: int) -> int:
    """Query rows per program: ``block_sizes.block_q``, else the next power of 2 of the rows
    clamped to ``[16, block_sizes.max_block_q]``."""
    cap = max(16, block_sizes.max_block_q)
    return block_sizes.block_q or min(max(16, next_pow2(rows)), cap)


def fit_block_k(block_k: int, block_q: int, D: int, itemsize: int, num_stages: int) -> int:
    """``block_k`` halved (down to 16) while the K and V tiles of every pipeline stage plus the
    q tile would not fit in ``TRITON_SMEM_BYTES`` of shared memory."""
    Dp = head_tile(D)
    while block_k > 16 and (2 * block_k * num_stages + block_q) * Dp * itemsize > (
            TRITON_SMEM_BYTES):
        block_k //= 2
    return block_k


def check_blocks(**sizes) -> None:
    """Every tile size must be a power of 2 >= 16 (Triton's tiles)."""
    for name, val in sizes.items():
        if val < 16 or val != next_pow2(val):
            raise ValueError(f"{name}={val} must be a power of 2 >= 16")


def default_num_warps(block_sizes, block_q: int) -> int:
    """``block_sizes.num_warps``, else 4 for up to 64 rows per program and 8 above."""
    return block_sizes.num_warps or (4 if block_q <= 64 else 8)


def use_fast_exp(block_sizes, on_gpu: bool) -> bool:
    """Whether the kernel computes exp2 with ``ex2.approx`` (asked for, compiled for a GPU, and
    that GPU is NVIDIA's)."""
    return bool(block_sizes.fast_exp and on_gpu and common.is_nvidia())


def attention_call(kernel, inputs, extra_shapes, *, kv_shape, num_splits: int, block_q: int,
                   rows_pad: int, D: int, out_dtype, block_sizes, interpret: bool, name: str,
                   extra_out=()):
    """The kernels' ``pallas_call``: grid ``(rows_pad / block_q, num_splits, N, K)``.

    ``inputs``: ``[layer[1], lengths[N], q_rows[N, K, rows_pad, Dp], k, v, *extra]`` (k/v
    ``kv_shape``, read through whole-array refs of ``head_tile(D)`` lanes; ``extra_shapes``: the
    shapes of the extra inputs, read whole too). Returns ``(o[N, K, rows_pad, D] in out_dtype,
    lse[N, K, rows_pad] float32)``, the key splits merged, and after them one array per
    ``extra_out`` entry ``(jax.ShapeDtypeStruct, BlockSpec)``: further outputs the kernel writes
    after its ``o`` and ``lse`` refs.
    """
    N, K = inputs[2].shape[:2]

    def full(shape):
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
    # Tiles of head_tile(D) lanes; past D (a head dim that is not a power of 2) they are masked.
    Dp = head_tile(D)
    kv_block = (*kv_shape[:-1], Dp)
    in_specs = [full((1,)), full((N,)),
                pl.BlockSpec((None, None, block_q, Dp), lambda qi, si, n, h: (n, h, qi, 0)),
                full(kv_block), full(kv_block), *(full(shape) for shape in extra_shapes)]
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((N, K, rows_pad, D), out_dtype),
                     jax.ShapeDtypeStruct((N, K, rows_pad), jnp.float32)]
        out_specs = [
            pl.BlockSpec((None, None, block_q, Dp), lambda qi, si, n, h: (n, h, qi, 0)),
            pl.BlockSpec((None, None, block_q), lambda qi, si, n, h: (n, h, qi))]
    else:
        out_shape = [jax.ShapeDtypeStruct((N, K, num_splits, rows_pad, D), jnp.float32),
                     jax.ShapeDtypeStruct((N, K, num_splits, rows_pad), jnp.float32)]
        out_specs = [
            pl.BlockSpec((None, None, None, block_q, Dp),
                         lambda qi, si, n, h: (n, h, si, qi, 0)),
            pl.BlockSpec((None, None, None, block_q), lambda qi, si, n, h: (n, h, si, qi))]
    compiler_params = None
    if not interpret and pltriton is not None:
        compiler_params = pltriton.CompilerParams(
            num_warps=default_num_warps(block_sizes, block_q),
            num_stages=block_sizes.num_stages)
    o, lse, *extra = pl.pallas_call(
        kernel,
        grid=(rows_pad // block_q, num_splits, N, K),
        in_specs=in_specs,
        out_specs=[*out_specs, *(spec for _, spec in extra_out)],
        out_shape=[*out_shape, *(shape for shape, _ in extra_out)],
        compiler_params=compiler_params,
        interpret=interpret,
        name=name,
    )(*inputs)
    if num_splits > 1:
        o, lse = merge_stacked(o, lse, axis=2, out_dtype=out_dtype)
    return (o, lse, *extra) if extra_out else (o, lse)
