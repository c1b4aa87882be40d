"""Decode-sized linear layers with their neighbours fused in (Pallas; Triton lowering on GPUs).

A decode step multiplies a few rows (M = batch x new tokens: tens to a few hundred) by each
weight matrix, so each product is bound by reading the weights. XLA runs each product as a kernel
of its own and the RMS norm before it, the SiLU x up after the gate|up product and the residual
add after the output projections as further small kernels: about 17 kernels per layer of a
self-draft step, ten of them elementwise ones of 1-4 us, which is what keeps that step far above
its byte floor (``benchmarks/steps_h100.md``). `fused_linear` is one product ``x[M, K] @ w[K, N]``
with those neighbours folded into its loads and its stores:

- ``norm``: the RMS norm of the input rows with weight ``g[K]``,
  ``rmsnorm(x) * g @ w = r * ((x * g) @ w)`` with ``r = rsqrt(mean(x^2) + eps)`` per row; the
  sum of squares is taken in the same pass over K that feeds the product, so the normed rows are
  never written;
- ``bias``: ``[N]`` added to the product;
- ``glu``: ``w`` is a fused gate|up matrix ``[K, 2F]`` and the output is
  ``silu(x @ w[:, :F]) * (x @ w[:, F:])`` (``[M, F]``): each program reads the gate and the up
  columns of its tile;
- ``residual``: ``[M, N]`` added to the output.

The rounding differs from the unfused layer's (the normed rows are not rounded to the weights'
dtype before the product, the residual is added to the float32 product), so it serves the
self-draft, whose tokens are proposals the verification checks, not the target's own steps.

Programs: grid ``(row tiles, column tiles, K parts)``. A program owns ``block_m`` rows and
``block_n`` output columns and runs over its part of K in blocks of ``block_k``, the weight
tile streamed through ``num_stages`` pipeline buffers. With few column tiles (a q|k|v or an
output projection: 1536-2048 columns) K is cut into parts so that the programs fill the GPU;
each part writes a float32 partial (and the partial sums of squares, with ``norm``) and a plain
`jnp` finish adds them and applies the epilogue, which XLA fuses into the consumers of the
result (the RoPE and the cache writes after a q|k|v product, say).

`fused_linear_reference` is the same function in plain `jnp` (float32 products).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .common import cdiv, num_sms

try:  # Triton-specific compiler parameters
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - a jax without the Triton backend
    pltriton = None


@dataclasses.dataclass(frozen=True)
class LinearBlockSizes:
    """Tiling of `fused_linear`.

    ``block_m``: rows per program (a power of two >= 16; fewer rows are padded to it);
    ``block_n`` / ``block_k``: the largest power of two at most this large dividing N / K (at
    least 16; a matrix with no such divisor is refused); ``splits``: K parts (programs per
    output tile); 0: enough parts for ``target_programs`` programs (0: two per multiprocessor),
    each at least ``min_blocks`` blocks of ``block_k`` long, and none with ``glu`` (its float32
    partials would be the size of the output twice over)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    splits: int = 0
    target_programs: int = 0
    min_blocks: int = 4
    num_warps: int = 4
    num_stages: int = 4


DEFAULT_BLOCKS = LinearBlockSizes()


@dataclasses.dataclass(frozen=True)
class _Static:
    K: int            # the true reduction length (the norm's mean divides by it)
    block_k: int
    n_k: int          # blocks of block_k over K
    per: int          # blocks per K part
    splits: int
    norm: bool
    glu: bool
    bias: bool
    residual: bool
    eps: float
    transpose_w: bool


def fit(n: int, most: int) -> int | None:
    """The largest power of two <= ``most`` and >= 16 dividing ``n``; None if there is none."""
    b = most
    while b >= 16:
        if n % b == 0:
            return b
        b //= 2
    return None


def supported(K: int, N: int, *, glu: bool = False,
              block_sizes: LinearBlockSizes | None = None) -> bool:
    """Whether `fused_linear` takes a ``[K, N]`` weight (N: its stored columns, 2F for ``glu``):
    K and the output columns need a power-of-two tile of at least 16 that divides them."""
    bs = block_sizes or DEFAULT_BLOCKS
    if glu and N % 2:
        return False
    return fit(K, bs.block_k) is not None and fit(N // 2 if glu else N, bs.block_n) is not None


def plan(M: int, K: int, N_out: int, *, glu: bool, block_sizes: LinearBlockSizes | None = None,
         on_gpu: bool = True) -> tuple[int, int, int, int, int]:
    """``(block_m, block_n, block_k, splits, blocks per split)`` for ``M`` rows, a reduction of
    K and ``N_out`` output columns."""
    bs = block_sizes or DEFAULT_BLOCKS
    bn, bk = fit(N_out, bs.block_n), fit(K, bs.block_k)
    if bn is None or bk is None:
        raise ValueError(f"fused_linear: no tile of {bs.block_n} / {bs.block_k} or less divides "
                         f"N = {N_out} / K = {K}")
    bm = max(16, min(bs.block_m, 1 << max(0, M - 1).bit_length()))
    n_k = K // bk
    tiles = cdiv(M, bm) * (N_out // bn)
    if bs.splits:
        splits = bs.splits
    elif glu:
        splits = 1
    else:
        target = bs.target_programs or (2 * num_sms() if on_gpu else 1)
        splits = max(1, min(cdiv(target, tiles), n_k // max(1, bs.min_blocks)))
    splits = max(1, min(splits, n_k))
    per = cdiv(n_k, splits)
    return bm, bn, bk, cdiv(n_k, per), per


def _silu(x):
    return x / (1.0 + jnp.exp(-x))


def _epilogue(accs, ss, c: _Static, biases, residual):
    """The float32 products of a tile (``accs``: one, or gate and up) -> the output, float32."""
    if c.norm:
        r = lax.rsqrt(ss / c.K + c.eps)[:, None]
        accs = [a * r for a in accs]
    if c.bias:
        accs = [a + b.astype(jnp.float32)[None, :] for a, b in zip(accs, biases)]
    y = _silu(accs[0]) * accs[1] if c.glu else accs[0]
    if c.residual:
        y = y + residual.astype(jnp.float32)
    return y


def _kernel(*refs, c: _Static):
    it = iter(refs)
    x_ref = next(it)
    g_ref = next(it) if c.norm else None
    w_refs = [next(it) for _ in range(2 if c.glu else 1)]
    b_refs = [next(it) for _ in w_refs] if c.bias else []
    res_ref = next(it) if c.residual and c.splits == 1 else None
    outs = list(it)
    bk = c.block_k
    bm = x_ref.shape[0]
    bn = outs[0].shape[-1]
    s = pl.program_id(2)

    def body(i, carry):
        accs, ss = carry
        xk = x_ref[:, pl.ds(i * bk, bk)]
        if c.norm:
            xf = xk.astype(jnp.float32)
            ss = ss + jnp.sum(xf * xf, axis=1)
            xk = (xf * g_ref[pl.ds(i * bk, bk)].astype(jnp.float32)[None, :]).astype(xk.dtype)
        new = []
        for a, w_ref in zip(accs, w_refs):
            if c.transpose_w:  # w stored [N, K] (a tied embedding)
                wk = w_ref[:, pl.ds(i * bk, bk)]
                new.append(a + lax.dot_general(xk, wk, (((1,), (1,)), ((), ())),
                                               preferred_element_type=jnp.float32))
            else:
                wk = w_ref[pl.ds(i * bk, bk), :]
                new.append(a + jnp.dot(xk, wk, preferred_element_type=jnp.float32))
        return tuple(new), ss

    init = (tuple(jnp.zeros((bm, bn), jnp.float32) for _ in w_refs),
            jnp.zeros((bm,), jnp.float32))
    lo = s * c.per
    hi = jnp.minimum(lo + c.per, c.n_k)
    accs, ss = lax.fori_loop(lo, hi, body, init)
    if c.splits == 1:
        y = _epilogue(list(accs), ss, c, [b[...] for b in b_refs],
                      None if res_ref is None else res_ref[...])
        outs[0][...] = y.astype(outs[0].dtype)
        return
    for o_ref, a in zip(outs, accs):  # float32 partials: `_finish` adds them
        o_ref[...] = a
    if c.norm:
        outs[len(accs)][...] = ss


@functools.partial(jax.jit, static_argnames=("eps", "glu", "out_dtype", "block_sizes",
                                             "interpret", "transpose_w"))
def fused_linear(x_MK, w_KN, *, norm=None, eps: float = 1e-6, bias=None, residual=None,
                 glu: bool = False, out_dtype=None, block_sizes: LinearBlockSizes | None = None,
                 interpret: bool = False, transpose_w: bool = False):
    """``epilogue(prologue(x) @ w)`` (module docstring): ``x[M, K]``, ``w[K, N]`` (``[N, K]``
    with ``transpose_w``), ``norm`` ``[K]`` or None, ``bias`` ``[N]`` or None (``[2F]`` with
    ``glu``), ``residual`` ``[M, N_out]`` or None. Returns ``[M, N_out]`` in ``out_dtype``
    (default x's), ``N_out = N`` (``N / 2`` with ``glu``). Compiled for a GPU (Triton) or run in
    the Pallas interpreter with ``interpret=True``."""
    bs = block_sizes or DEFAULT_BLOCKS
    M, K = x_MK.shape
    N, K2 = w_KN.shape if transpose_w else w_KN.shape[::-1]
    if K != K2:
        raise ValueError(f"fused_linear: x is [{M}, {K}] but w is {list(w_KN.shape)}"
                         f"{' (transposed)' if transpose_w else ''}")
    if glu and (N % 2 or transpose_w):
        raise ValueError("fused_linear: glu needs a [K, 2F] gate|up matrix")
    N_out = N // 2 if glu else N
    for name, a, shape in (("norm", norm, (K,)), ("bias", bias, (N,)),
                           ("residual", residual, (M, N_out))):
        if a is not None and tuple(a.shape) != shape:
            raise ValueError(f"fused_linear: {name} is {list(a.shape)}, expected {list(shape)}")
    out_dtype = jnp.dtype(x_MK.dtype if out_dtype is None else out_dtype)
    bm, bn, bk, splits, per = plan(M, K, N_out, glu=glu, block_sizes=bs, on_gpu=not interpret)
    c = _Static(K=K, block_k=bk, n_k=K // bk, per=per, splits=splits, norm=norm is not None,
                glu=glu, bias=bias is not None, residual=residual is not None, eps=float(eps),
                transpose_w=transpose_w)
    Mp = cdiv(M, bm) * bm
    x = x_MK if Mp == M else jnp.pad(x_MK, ((0, Mp - M), (0, 0)))
    n_tiles = N_out // bn
    grid = (Mp // bm, n_tiles, splits)
    in_specs = [pl.BlockSpec((bm, K), lambda m, n, s: (m, 0))]
    inputs = [x]
    if norm is not None:
        in_specs.append(pl.BlockSpec((K,), lambda m, n, s: (0,)))
        inputs.append(norm)
    w = w_KN.astype(x.dtype)
    if transpose_w:
        in_specs.append(pl.BlockSpec((bn, K), lambda m, n, s: (n, 0)))
        inputs.append(w)
    else:
        in_specs.append(pl.BlockSpec((K, bn), lambda m, n, s: (0, n)))
        inputs.append(w)
        if glu:  # the up columns of the same tile
            in_specs.append(pl.BlockSpec((K, bn), lambda m, n, s: (0, n + n_tiles)))
            inputs.append(w)
    if bias is not None:
        in_specs.append(pl.BlockSpec((bn,), lambda m, n, s: (n,)))
        inputs.append(bias)
        if glu:
            in_specs.append(pl.BlockSpec((bn,), lambda m, n, s: (n + n_tiles,)))
            inputs.append(bias)
    if residual is not None and splits == 1:
        r = residual if Mp == M else jnp.pad(residual, ((0, Mp - M), (0, 0)))
        in_specs.append(pl.BlockSpec((bm, bn), lambda m, n, s: (m, n)))
        inputs.append(r)
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct((Mp, N_out), out_dtype)]
        out_specs = [pl.BlockSpec((bm, bn), lambda m, n, s: (m, n))]
    else:
        n_acc = 2 if glu else 1
        out_shape = [jax.ShapeDtypeStruct((splits, Mp, N_out), jnp.float32)] * n_acc
        out_specs = [pl.BlockSpec((None, bm, bn), lambda m, n, s: (s, m, n))] * n_acc
        if norm is not None:
            out_shape.append(jax.ShapeDtypeStruct((splits, Mp), jnp.float32))
            out_specs.append(pl.BlockSpec((None, bm), lambda m, n, s: (s, m)))
    compiler_params = None
    if not interpret and pltriton is not None:
        compiler_params = pltriton.CompilerParams(num_warps=bs.num_warps,
                                                  num_stages=bs.num_stages)
    outs = pl.pallas_call(
        functools.partial(_kernel, c=c),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params,
        interpret=interpret,
        name="jaxspec_fused_linear",
    )(*inputs)
    if splits == 1:
        return outs[0][:M]
    accs = [a.sum(axis=0)[:M] for a in outs[:2 if glu else 1]]
    ss = outs[-1].sum(axis=0)[:M] if norm is not None else None
    biases = ([bias[:N_out], bias[N_out:]] if glu else [bias]) if bias is not None else []
    return _epilogue(accs, ss, c, biases, residual).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("eps", "glu", "out_dtype", "transpose_w"))
def fused_linear_reference(x_MK, w_KN, *, norm=None, eps: float = 1e-6, bias=None,
                           residual=None, glu: bool = False, out_dtype=None,
                           transpose_w: bool = False):
    """`fused_linear` in plain `jnp`, products in float32 at full precision."""
    out_dtype = jnp.dtype(x_MK.dtype if out_dtype is None else out_dtype)
    x = x_MK.astype(jnp.float32)
    if norm is not None:
        x = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * norm.astype(
            jnp.float32)
    w = w_KN.astype(jnp.float32)
    y = jnp.dot(x, w.T if transpose_w else w, precision=lax.Precision.HIGHEST)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if glu:
        F = y.shape[-1] // 2
        y = _silu(y[:, :F]) * y[:, F:]
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(out_dtype)
