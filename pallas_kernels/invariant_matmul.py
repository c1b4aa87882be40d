"""A batch-invariant matrix product ``x[M, K] @ w[K, N]`` (Pallas, Triton lowering on GPUs).

Each output row is computed by the same sequence of floating-point operations whatever M is and
whatever the other rows hold: the rows are padded to whole tiles of ``block_m`` rows, and an
output tile ``[block_m, block_n]`` reduces over K in fixed parts (`k_parts`: from K, N and the
block sizes only, never from M), each part from a zero float32 accumulator over its blocks of
``block_k`` in increasing order, each block one ``[block_m, block_k] @ [block_k, block_n]``
product of fixed shape; the parts' sums are then added in increasing order, ``((p0 + p1) + p2)
+ ...``. So a row gives the same bits in a decode step (M = batch), a verification (M = batch x
(gamma + 1)) or a prefill chunk. XLA's own dot picks its algorithm from all three dimensions (on
the CPU M = 1 is a matrix-vector product with another summation order; on GPUs cuBLAS changes
tiles and split-K with M), which is what this kernel avoids.

Two ways to run the same arithmetic: ``"fold"``, a program per output tile that adds its parts
itself (prefill: many tiles), and ``"split"``, a program per (tile, part) writing float32
partials that XLA then adds in the same order (decode: few tiles, too few programs to stream
the weights at full bandwidth otherwise). The additions are plain float32 adds of the same
values in the same order, so both give the same bits; ``"auto"`` splits while the tiles are
fewer than `SPLIT_BELOW`. The programs run in groups of `GROUP_M` row tiles that take each
column tile in turn, so a weight tile is read from HBM once for the group.

`invariant_matmul_reference` is the plain-`jnp` statement of the same contract (tiles of
``block_m`` rows, one fixed-shape dot each, through `lax.map`), used on the CPU: XLA's CPU dot of
a fixed shape computes each row the same way whatever the row's place in the tile
(``tests/test_batch_invariant.py`` checks both).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Triton-specific compiler parameters
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - a jax without the Triton backend
    pltriton = None


@dataclasses.dataclass(frozen=True)
class InvariantMatmulBlocks:
    """Tile sizes of `invariant_matmul` (``block_n``/``block_k``: the largest power of two at
    most this large dividing N / K, at least 16; otherwise the operand is padded).
    ``split_programs``: K is cut into fixed parts (`k_parts`, from K and N only) so that the
    ``N / block_n`` column tiles times the parts make at least this many programs (0: one part),
    each part at least ``min_part`` blocks long."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    split_programs: int = 264
    min_part: int = 8  # blocks of block_k per K part, at least (short parts slow a prefill)


DEFAULT_BLOCKS = InvariantMatmulBlocks()
CPU_TILE_ROWS = 16  # rows per fixed-shape dot of `invariant_matmul_reference`
SPLIT_BELOW = 132  # `invariant_matmul` mode "auto": parts as programs below this many tiles
GROUP_M = 8  # row tiles that take each column tile in turn (weights from L2, rows too)


def _fit(n: int, most: int) -> int:
    """The largest power of two <= ``most`` (and >= 16) dividing ``n``; ``most`` if none does
    (the operand is then padded)."""
    b = most
    while b > 16 and n % b:
        b //= 2
    return b


def _pad_to(x, axis: int, multiple: int):
    n = x.shape[axis]
    r = (-n) % multiple
    if not r:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, r)
    return jnp.pad(x, pad)


def k_parts(K: int, N: int, bs: InvariantMatmulBlocks = None) -> tuple[int, int, int, int]:
    """``(block_n, block_k, parts, blocks per part)`` for a ``[.., K] @ [K, N]`` product: the
    reduction over K runs in ``parts`` fixed parts of ``blocks per part`` blocks of ``block_k``
    (the last one shorter), from K, N and the block sizes only. Each part has at least two
    blocks when there are several."""
    bs = DEFAULT_BLOCKS if bs is None else bs
    bn, bk = _fit(N, bs.block_n), _fit(K, bs.block_k)
    n_k = -(-K // bk)
    tiles = -(-N // bn)
    parts = 1
    if bs.split_programs > 0:
        parts = max(1, min(-(-bs.split_programs // tiles), n_k // max(bs.min_part, 2)))
    per = -(-n_k // parts)
    return bn, bk, -(-n_k // per), per


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, n_k: int, per: int, parts: int, w_nk: bool,
            split: bool):
    bm, bn = o_ref.shape[-2:]

    def body(i, acc):
        xk = x_ref[:, pl.ds(i * block_k, block_k)]
        if w_nk:  # w stored [N, K] (a tied embedding): contract both on their last dim
            wk = w_ref[:, pl.ds(i * block_k, block_k)]
            return acc + lax.dot_general(xk, wk, (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)
        wk = w_ref[pl.ds(i * block_k, block_k), :]
        return acc + jnp.dot(xk, wk, preferred_element_type=jnp.float32)

    def part(s):  # blocks [s * per, min((s + 1) * per, n_k)) from a zero accumulator
        return lax.fori_loop(s * per, jnp.minimum((s + 1) * per, n_k), body,
                             jnp.zeros((bm, bn), jnp.float32))

    if split:  # this program's part, a float32 partial: the caller adds the parts in order
        o_ref[...] = part(pl.program_id(1))
        return
    total = part(0)  # the parts added in increasing order: ((p0 + p1) + p2) + ...
    if parts > 1:
        total = lax.fori_loop(1, parts, lambda s, t: t + part(s), total)
    o_ref[...] = total.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "interpret",
                                             "transpose_w", "mode"))
def invariant_matmul(x_MK, w_KN, *, out_dtype=None, block_sizes: InvariantMatmulBlocks | None = None,
                     interpret: bool = False, transpose_w: bool = False, mode: str = "auto"):
    """``x @ w`` (``[M, K] @ [K, N] -> [M, N]`` in ``out_dtype``, default x's dtype), each row by
    one fixed sequence of operations (module docstring). ``transpose_w``: ``w`` is stored
    ``[N, K]`` (``x @ w.T``, read in place: a tied embedding as the LM head). Runs compiled on a
    GPU (Triton) or in the Pallas interpreter with ``interpret=True``. ``mode``: ``"fold"`` (a
    program adds its tile's K parts itself), ``"split"`` (a program per part, float32 partials
    added in order afterwards) or ``"auto"`` (split while the tiles are too few to fill the GPU);
    the two give the same bits."""
    bs = DEFAULT_BLOCKS if block_sizes is None else block_sizes
    M, K = x_MK.shape
    K2, N = w_KN.shape[::-1] if transpose_w else w_KN.shape
    if K != K2:
        raise ValueError(f"invariant_matmul: x is [{M}, {K}] but w is {list(w_KN.shape)}"
                         f"{' (transposed)' if transpose_w else ''}")
    if mode not in ("auto", "fold", "split"):
        raise ValueError(f"invariant_matmul: mode {mode!r}")
    out_dtype = x_MK.dtype if out_dtype is None else jnp.dtype(out_dtype)
    bm = bs.block_m
    bn, bk, parts, per = k_parts(K, N, bs)
    x = _pad_to(_pad_to(x_MK, 0, bm), 1, bk)  # zero rows / columns: they add exact zeros
    kd, nd = (1, 0) if transpose_w else (0, 1)
    w = _pad_to(_pad_to(w_KN.astype(x_MK.dtype), kd, bk), nd, bn)  # (a copy only on a misfit)
    Mp, Kp = x.shape
    Np = w.shape[nd]
    n_m, n_n = Mp // bm, Np // bn
    split = parts > 1 and (mode == "split" or (mode == "auto" and n_m * n_n < SPLIT_BELOW))

    def tile(t):  # program t -> (row tile, column tile): groups of GROUP_M row tiles, row-fastest
        per_group = GROUP_M * n_n
        first = (t // per_group) * GROUP_M
        rows = jnp.minimum(n_m - first, GROUP_M)
        r = t % per_group
        return first + r % rows, r // rows

    w_spec = (pl.BlockSpec((bn, Kp), lambda t, *_: (tile(t)[1], 0)) if transpose_w
              else pl.BlockSpec((Kp, bn), lambda t, *_: (0, tile(t)[1])))
    x_spec = pl.BlockSpec((bm, Kp), lambda t, *_: (tile(t)[0], 0))
    compiler_params = None
    if not interpret and pltriton is not None:
        compiler_params = pltriton.CompilerParams(num_warps=bs.num_warps,
                                                  num_stages=bs.num_stages)
    if split:
        grid = (n_m * n_n, parts)
        out_spec = pl.BlockSpec((None, bm, bn), lambda t, s: (s, *tile(t)))
        out_shape = jax.ShapeDtypeStruct((parts, Mp, Np), jnp.float32)
    else:
        grid = (n_m * n_n,)
        out_spec = pl.BlockSpec((bm, bn), lambda t: tile(t))
        out_shape = jax.ShapeDtypeStruct((Mp, Np), out_dtype)
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=bk, n_k=Kp // bk, per=per, parts=parts,
                          w_nk=transpose_w, split=split),
        grid=grid,
        in_specs=[x_spec, w_spec],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=compiler_params,
        interpret=interpret,
        name="invariant_matmul",
    )(x, w)
    if split:  # the same additions as the fold: ((p0 + p1) + p2) + ..., in float32
        total = out[0]
        for s in range(1, parts):
            total = total + out[s]
        out = total.astype(out_dtype)
    return out[:M, :N]


@functools.partial(jax.jit, static_argnames=("out_dtype", "tile", "transpose_w"))
def invariant_matmul_reference(x_MK, w_KN, *, out_dtype=None, tile: int = CPU_TILE_ROWS,
                               transpose_w: bool = False):
    """`invariant_matmul`'s contract in `jnp`: the rows padded to whole tiles of ``tile`` rows,
    one ``[tile, K] @ [K, N]`` dot (float32 accumulation) per tile through `lax.map`, so every
    row goes through a dot of one fixed shape whatever M is (``transpose_w``: w is ``[N, K]``)."""
    M, K = x_MK.shape
    N = w_KN.shape[0 if transpose_w else 1]
    out_dtype = x_MK.dtype if out_dtype is None else jnp.dtype(out_dtype)
    x = _pad_to(x_MK, 0, tile)
    n = x.shape[0] // tile
    w = w_KN.astype(x_MK.dtype)
    dims = (((1,), (1 if transpose_w else 0,)), ((), ()))

    def one(t):
        return lax.dot_general(t, w, dims, preferred_element_type=jnp.float32).astype(out_dtype)

    y = lax.map(one, x.reshape(n, tile, K))
    return y.reshape(n * tile, N)[:M]
