"""A row-invariant matrix product for many rows on Hopper GPUs: ``x[M, K] @ w[K, N]`` by warpgroup
MMAs (Mosaic GPU).

With batch-invariant numerics a prefill chunk's prompt rows (`jaxspec.invariant.prompt_matmul`)
need the same bits in every chunking and batch, not the bits of a decode step (a prompt token's
K/V are computed by a prefill only), so they may take a kernel built for thousands of rows
instead of `pallas_kernels.invariant_matmul`'s tiles of 64 rows in fixed K parts:

- a program computes one output tile of ``2 x 64`` rows by ``block_n`` columns: two consumer
  warpgroups of 64 rows each, and a producer warpgroup that brings the ``[128, 64]`` tile of x
  and the ``[64, block_n]`` tile of w of each K block into a ring of ``stages`` shared-memory
  stages by TMA;
- each consumer accumulates its ``[64, block_n]`` tile in float32 registers over the K blocks in
  increasing order, one ``wgmma`` of fixed shape per block (the next block's product is issued
  before the stage of the previous one is handed back), and writes the tile through shared
  memory by TMA;
- tiles are taken in groups of `GROUP_M` row tiles per column tile, so the x and w tiles of a
  wave of programs come from L2.

The tiling depends on K and N only (``block_n``: the largest of 256, 128, 64 dividing N), never
on M: a row's output is the same sequence of float32 operations (the same MMAs over the same K
blocks, in the same order) whatever M is, whatever the other rows hold and wherever the row sits
in its tile. Rows past M read zeros (TMA fills them) and are never stored. Checked bitwise on an
H200 by ``tests/test_invariant_kernels.py``'s GPU tests and ``scripts/bench_invariant.py``.

Runs on an NVIDIA Hopper GPU for bf16 / f16 with K and N multiples of 64 (`supports`), and in the
Mosaic GPU interpreter on a CPU (``interpret=True``) for tests.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import common
from .common import HOPPER_SMEM_BYTES, cdiv, round_up
from .hopper import has_mosaic_gpu, plgpu

CONSUMERS = 2
ROWS_PER_WG = 64  # one wgmma M tile
BLOCK_M = CONSUMERS * ROWS_PER_WG
BLOCK_K = 64  # one 128-byte swizzled row of bf16
GROUP_M = 8  # row tiles that take each column tile in turn


@dataclasses.dataclass(frozen=True)
class PromptMatmulBlocks:
    """Tiling of `prompt_matmul`: ``block_n`` columns per output tile at most (the largest of
    256, 128, 64 dividing N that is at most this), ``stages`` shared-memory stages of the K ring
    (None: as many as fit), ``registers`` the (consumer, producer) register caps,
    ``programs``: None for a program per output tile, else that many programs (one per SM, say),
    each taking every P-th tile with its K ring running on from one tile into the next. The
    tiles' arithmetic is the same either way."""

    block_n: int = 256
    stages: int | None = None
    registers: tuple[int, int] = (232, 40)
    programs: int | None = None  # None: a program per tile; P: P programs (e.g. one per SM)

    def __post_init__(self):
        if self.block_n not in (64, 128, 256):
            raise ValueError(f"block_n must be 64, 128 or 256, got {self.block_n}")
        if self.stages is not None and self.stages < 2:
            raise ValueError(f"stages must be >= 2, got {self.stages}")
        if self.programs is not None and self.programs < 1:
            raise ValueError(f"programs must be >= 1, got {self.programs}")


DEFAULT_BLOCKS = PromptMatmulBlocks()


def available() -> bool:
    """Whether the kernel can run compiled here: an NVIDIA Hopper GPU with Mosaic GPU."""
    return has_mosaic_gpu() and common.is_hopper_gpu()


def supports(dtype, K: int, N: int) -> bool:
    """Whether the kernel takes a ``[M, K] @ [K, N]`` product of ``dtype`` (bf16 / f16, K and N
    multiples of 64)."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and K % BLOCK_K == 0 and N % 64 == 0 and K > 0 and N > 0)


def block_n_of(N: int, most: int = 256) -> int:
    """Columns per program for N columns: the largest of 256, 128, 64 (at most ``most``) that
    divides N."""
    b = most
    while b > 64 and N % b:
        b //= 2
    return b


def smem_bytes(block_n: int, stages: int, itemsize: int = 2) -> int:
    """Shared memory of a program: the K ring of x and w tiles and the output tile (1 KiB
    aligned buffers, about 2 KiB of Mosaic GPU's own)."""
    ring = stages * (BLOCK_M * BLOCK_K + BLOCK_K * block_n) * itemsize
    return round_up(ring, 1024) + round_up(BLOCK_M * block_n * itemsize, 1024) + 2048


def stages_for(block_n: int, itemsize: int = 2, most: int = 4) -> int:
    """The deepest ring (at most ``most``) that fits a Hopper block's shared memory."""
    s = most
    while s > 2 and smem_bytes(block_n, s, itemsize) > HOPPER_SMEM_BYTES:
        s -= 1
    return s


def _kernel(x_ref, w_ref, o_ref, x_smem, w_smem, o_smem, ready, free, *, n_k: int,
            n_m: int, n_n: int, block_n: int, stages: int, regs: tuple[int, int],
            programs: int, compiled: bool):
    # Program p takes output tiles p, p + P, ... (P programs: one tile each, or one program per
    # SM that keeps its K ring running from one tile into the next).
    p = lax.axis_index("t")
    P = programs
    n_tiles = n_m * n_n
    mine = lax.div(n_tiles - p + P - 1, P)  # tiles of this program
    wg = lax.axis_index("wg")

    def tile_of(j):
        """This program's j-th tile -> (row tile, column tile): groups of GROUP_M row tiles
        that take each column tile in turn, row tiles fastest."""
        t = p + j * P
        per_group = GROUP_M * n_n
        first = lax.div(t, jnp.int32(per_group)) * GROUP_M
        rows = jnp.minimum(n_m - first, GROUP_M)
        r = lax.rem(t, jnp.int32(per_group))
        return first + lax.rem(r, rows), lax.div(r, rows)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(regs[0], action="increase")

        def x_tile(slot):
            return x_smem.at[slot, pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)]

        @pl.loop(0, mine)
        def _(j):
            m_tile, n_tile = tile_of(j)
            g0 = j * n_k  # K blocks this program consumed before this tile (the ring's count)
            if compiled:
                def body(acc_ref):
                    @pl.loop(0, n_k)
                    def _(i):
                        slot = lax.rem(g0 + i, jnp.int32(stages))
                        plgpu.barrier_wait(ready.at[slot])
                        plgpu.wgmma(acc_ref, x_tile(slot), w_smem.at[slot])
                        plgpu.wgmma_wait(1)  # block i - 1's product is done: its stage is free

                        @pl.when(i > 0)
                        def _():
                            plgpu.barrier_arrive(free.at[lax.rem(g0 + i - 1, jnp.int32(stages))])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(free.at[lax.rem(g0 + n_k - 1, jnp.int32(stages))])
                    return acc_ref[...]
                acc = pl.run_scoped(body, plgpu.ACC((ROWS_PER_WG, block_n), jnp.float32))
            else:  # the interpreter: the same blocks in the same order as jnp dots
                def istep(i, acc):
                    slot = lax.rem(g0 + i, jnp.int32(stages))
                    plgpu.barrier_wait(ready.at[slot])
                    acc = acc + jnp.dot(x_tile(slot)[...], w_smem[slot],
                                        preferred_element_type=jnp.float32)
                    plgpu.barrier_arrive(free.at[slot])
                    return acc
                acc = lax.fori_loop(0, n_k, istep,
                                    jnp.zeros((ROWS_PER_WG, block_n), jnp.float32))
            plgpu.wait_smem_to_gmem(0)  # the last tile's store has left the output buffer
            o_smem.at[wg][...] = acc.astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                o_smem.at[wg],
                o_ref.at[pl.ds((m_tile * CONSUMERS + wg) * ROWS_PER_WG, ROWS_PER_WG),
                         pl.ds(n_tile * block_n, block_n)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(regs[1], action="decrease")

        @pl.loop(0, mine)
        def _(j):
            m_tile, n_tile = tile_of(j)

            @pl.loop(0, n_k)
            def _(i):
                g = j * n_k + i
                slot = lax.rem(g, jnp.int32(stages))

                @pl.when(g >= stages)
                def _():
                    plgpu.barrier_wait(free.at[slot])
                plgpu.copy_gmem_to_smem(
                    x_ref.at[pl.ds(m_tile * BLOCK_M, BLOCK_M), pl.ds(i * BLOCK_K, BLOCK_K)],
                    x_smem.at[slot], ready.at[slot])
                plgpu.copy_gmem_to_smem(
                    w_ref.at[pl.ds(i * BLOCK_K, BLOCK_K), pl.ds(n_tile * block_n, block_n)],
                    w_smem.at[slot], ready.at[slot])

        # observe the consumers' last hand-backs too, so every barrier phase is consumed
        total = mine * n_k

        @pl.loop(jnp.maximum(total - stages, 0), total)
        def _(g):
            plgpu.barrier_wait(free.at[lax.rem(g, jnp.int32(stages))])


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_sizes", "interpret"))
def prompt_matmul(x_MK, w_KN, *, out_dtype=None, block_sizes: PromptMatmulBlocks | None = None,
                  interpret: bool = False):
    """``x @ w`` (``[M, K] @ [K, N] -> [M, N]``, float32 accumulation, ``out_dtype`` default x's
    dtype) with every row computed by one fixed sequence of operations whatever M is (module
    docstring). On a Hopper GPU, or in the Mosaic GPU interpreter with ``interpret=True``."""
    bs = DEFAULT_BLOCKS if block_sizes is None else block_sizes
    M, K = x_MK.shape
    K2, N = w_KN.shape
    if K != K2:
        raise ValueError(f"prompt_matmul: x is [{M}, {K}] but w is {list(w_KN.shape)}")
    if not supports(x_MK.dtype, K, N):
        raise ValueError(f"prompt_matmul takes bf16/f16 with K and N multiples of 64, got "
                         f"{x_MK.dtype} [{M}, {K}] @ [{K}, {N}]")
    out_dtype = x_MK.dtype if out_dtype is None else jnp.dtype(out_dtype)
    dtype = x_MK.dtype
    w = w_KN.astype(dtype)
    block_n = block_n_of(N, bs.block_n)
    itemsize = jnp.dtype(dtype).itemsize
    stages = bs.stages or stages_for(block_n, itemsize)
    if smem_bytes(block_n, stages, itemsize) > HOPPER_SMEM_BYTES:
        raise ValueError(f"block_n={block_n} x stages={stages} needs about "
                         f"{smem_bytes(block_n, stages, itemsize)} bytes of shared memory; a "
                         f"Hopper block has {HOPPER_SMEM_BYTES}")
    # TMA fills loads past M with zeros and clips stores on the GPU; Mosaic GPU's tiled copies
    # want whole 8-row tiles, and the interpreter refuses copies out of bounds: pad there.
    Mp = round_up(M, BLOCK_M) if interpret else round_up(max(M, 1), 8)
    x = x_MK if Mp == M else jnp.pad(x_MK, ((0, Mp - M), (0, 0)))
    n_m, n_n, n_k = cdiv(Mp, BLOCK_M), N // block_n, K // BLOCK_K
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    scratch = (
        plgpu.SMEM((stages, BLOCK_M, BLOCK_K), dtype, transforms=tiled),
        plgpu.SMEM((stages, BLOCK_K, block_n), dtype, transforms=tiled),
        plgpu.SMEM((CONSUMERS, ROWS_PER_WG, block_n), out_dtype,
                   transforms=tiled if jnp.dtype(out_dtype).itemsize == 2 else ()),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),          # ready: x and w tiles
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # free
    )
    programs = n_m * n_n if bs.programs is None else min(bs.programs, n_m * n_n)
    body = functools.partial(_kernel, n_k=n_k, n_m=n_m, n_n=n_n, block_n=block_n, stages=stages,
                             regs=tuple(bs.registers), programs=programs,
                             compiled=not interpret)
    kw = {}
    if interpret:  # the Mosaic GPU interpreter (threads, barriers, TMA simulated on the CPU)
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        kw["interpret"] = InterpretGPUParams()
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((Mp, N), out_dtype),
        scratch_types=scratch,
        grid=(programs,),
        grid_names=("t",),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        **kw,
    )(x, w)
    return out if Mp == M else out[:M]


def prompt_matmul_reference(x_MK, w_KN, *, out_dtype=None):
    """The product in float32 (the test's reference)."""
    out_dtype = x_MK.dtype if out_dtype is None else jnp.dtype(out_dtype)
    return jnp.dot(x_MK.astype(jnp.float32), w_KN.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST).astype(out_dtype)
