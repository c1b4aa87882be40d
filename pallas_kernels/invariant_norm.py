"""A batch-invariant RMS norm ``w * (x * rsqrt(mean(x^2) + eps))`` over the last axis (Pallas,
Triton lowering on GPUs).

Each row's mean of squares is one fixed sequence of float32 operations whatever the number of
rows and whatever the other rows hold: the rows are padded to whole tiles of `BLOCK_ROWS`, the
row of H values is read in ``H / c`` column chunks of ``c`` (the largest power of two dividing H,
at most `MAX_CHUNK`: H alone fixes it), the chunks' squares are added elementwise in increasing
order into one ``[rows, c]`` float32 vector, and that vector is summed by the kernel's one
fixed-shape row reduction. So a token gets the same bits in a decode step, a verification and a
prefill chunk. It stands in for `jaxspec.invariant.rms_norm`'s binary tree of elementwise adds
on GPUs, where XLA runs that tree as one thread per row reading the row column by column (on an
H200, 26.5 ms of a 339 ms batch-invariant prefill chunk of 64 x 512 tokens).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Triton-specific compiler parameters
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - a jax without the Triton backend
    pltriton = None

BLOCK_ROWS = 8  # rows per program
MAX_CHUNK = 512  # columns per chunk, at most
NUM_WARPS = 4


def chunk_of(H: int) -> int:
    """Columns per chunk for rows of H values: the largest power of two dividing H, at most
    `MAX_CHUNK` (H = 1536: 512; 896: 128; 576: 64)."""
    c = 1
    while c < MAX_CHUNK and H % (2 * c) == 0:
        c *= 2
    return c


def _kernel(x_ref, w_ref, o_ref, *, H: int, c: int, eps: float, x_dtype):
    n = H // c
    acc = jnp.zeros((BLOCK_ROWS, c), jnp.float32)
    for j in range(n):  # elementwise, in increasing column order
        xj = x_ref[:, pl.ds(j * c, c)].astype(jnp.float32)
        acc = acc + xj * xj
    ms = jnp.sum(acc, axis=1, keepdims=True) / H  # one fixed-shape reduction per row
    inv = lax.rsqrt(ms + eps)
    for j in range(n):
        xj = x_ref[:, pl.ds(j * c, c)].astype(jnp.float32)
        y = (xj * inv).astype(x_dtype)
        o_ref[:, pl.ds(j * c, c)] = (w_ref[:, pl.ds(j * c, c)] * y).astype(o_ref.dtype)


def supports(H: int) -> bool:
    """Whether rows of H values fit the kernel's chunks (a chunk of at least 16 columns)."""
    return chunk_of(H) >= 16


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def invariant_rms_norm(x, w, *, eps: float, interpret: bool = False):
    """``w * (x * rsqrt(mean(x^2, -1) + eps)).astype(x.dtype)`` for ``x[..., H]``, ``w[H]``
    (`jaxspec.model.rms_norm`'s arithmetic, the sum in the fixed order of the module docstring);
    the result in ``result_type(w, x)``. Runs compiled on a GPU (Triton) or in the Pallas
    interpreter with ``interpret=True``."""
    lead, H = x.shape[:-1], x.shape[-1]
    if not supports(H):
        raise ValueError(f"invariant_rms_norm: rows of {H} values (want a multiple of 16)")
    c = chunk_of(H)
    x2 = x.reshape(-1, H)
    N = x2.shape[0]
    Np = -(-max(N, 1) // BLOCK_ROWS) * BLOCK_ROWS
    if Np != N:  # zero rows: their outputs are dropped
        x2 = jnp.pad(x2, ((0, Np - N), (0, 0)))
    out_dtype = jnp.result_type(w.dtype, x.dtype)
    compiler_params = None
    if not interpret and pltriton is not None:
        compiler_params = pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
    y = pl.pallas_call(
        functools.partial(_kernel, H=H, c=c, eps=float(eps), x_dtype=x.dtype),
        grid=(Np // BLOCK_ROWS,),
        in_specs=[pl.BlockSpec((BLOCK_ROWS, H), lambda i: (i, 0)),
                  pl.BlockSpec((1, H), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((BLOCK_ROWS, H), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((Np, H), out_dtype),
        compiler_params=compiler_params,
        interpret=interpret,
        name="invariant_rms_norm",
    )(x2, w.reshape(1, H))
    return y[:N].reshape(*lead, H)
