"""Hopper (sm_90) fast path: a Mosaic GPU flash-attention kernel for many query rows per K/V stream.

Where one K/V stream meets many query rows (a shared prefix read by a whole group of
sequences, or a long verification block of T x G rows per KV head) attention is bound
by matrix throughput, not by reading K/V. The portable Triton-lowered kernels reach about
270-420 TFLOP/s there on an H100; this kernel feeds Hopper's tensor cores the way they
want: K/V tiles arrive by TMA into a ring of shared-memory stages (one producer
warpgroup), two consumer warpgroups of 64 rows each run ``wgmma`` for QK^T and PV out of
shared memory with the online softmax in registers, and a stage is handed back to the
producer as soon as both consumers are done with it.

Problem solved here (``rows_attention``): ``N`` streams (e.g. (group, KV head) or
(sequence, KV head)); stream ``n`` has query rows ``q[n, :R]`` and keys/values in a
layout given by ``kv_layout``; stream ``n`` sees keys ``[0, lengths[n // N2])``. The key
axis is cut into ``splits`` equal ranges (flash-decoding) so that short problems still
fill every SM; each split returns a partial ``(out, lse)`` that ``merge.merge_stacked``
combines exactly.

Ragged lengths without reading garbage: the kernel covers only the whole, aligned key blocks
of each stream, ``[0, floor(length / block_kv) * block_kv)``, so it never reads a slot past a
length and needs no mask (Mosaic GPU's tiled TMA also wants block starts that are provably
multiples of the tile). ``tail_attention`` does the last ``length % block_kv`` keys of each
stream in plain jnp (a gather of one block, masked), and its partial merges with the
kernel's splits like one more split.

Layouts of K/V (``kv_layout``):
  * ``"PLKD"``: ``k[P, L, K, D]`` (the shared-prefix layout); stream ``n = p * K + k``.
  * ``"BKSD"``: ``k[B, K, S, D]`` (a per-sequence cache); stream ``n = b * K + k``.

Numerics: products in bf16/f16 with float32 accumulation (wgmma), softmax in float32 in
base 2 with ``sm_scale * log2(e)`` folded into one multiply-add per score; the partial
outputs are stored in the input dtype, the log-sum-exps in float32.

Runs on an NVIDIA Hopper GPU, and on CPU through the Mosaic GPU interpreter
(``interpret=True``) for tests (there the two matrix products run as jnp dots: the
interpreter takes no transposed or register wgmma operands).

Status: correct on an H100, but slower than the portable Triton kernels at every measured
shape (``benchmarks/hopper_attention_h100.md``: 247 vs 228 us at the T=5 prefix shape,
1410 vs 1002 us at T=64 verification), while jax's own FlashAttention-3 port reaches
477 TFLOP/s on the prefix shape. What this kernel lacks against it: the two consumer
warpgroups are not scheduled ping-pong (one's softmax under the other's wgmma), a wgmma is
waited for right after it is issued, and the last partial block and the split merge run as
separate XLA ops. So it is opt-in only (``prefix_attention(..., block_sizes=
HopperBlockSizes())``), never a default.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - a jax without Mosaic GPU
  plgpu = None

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
ROWS_PER_WG = 64  # one wgmma M tile per consumer warpgroup
CONSUMERS = 2
SMEM_BYTES = 232448  # shared memory of one thread block on an H100 / H200


@dataclasses.dataclass(frozen=True)
class HopperBlockSizes:
  """Tiling of the Hopper kernel.

  block_kv: keys per stage (multiple of 64). stages: shared-memory ring depth (>= 2).
  splits: key ranges per stream (None: enough to give every SM a program).
  """
  block_kv: int = 128
  stages: int = 2
  splits: int | None = None

  def __post_init__(self):
    if self.block_kv % 64 or self.block_kv <= 0:
      raise ValueError(f"block_kv must be a positive multiple of 64, got {self.block_kv}")
    if self.stages < 2:
      raise ValueError(f"stages must be >= 2, got {self.stages}")
    if self.splits is not None and self.splits < 1:
      raise ValueError(f"splits must be >= 1, got {self.splits}")


def available() -> bool:
  """True on an NVIDIA Hopper GPU (compute capability 9.x) with Mosaic GPU importable."""
  if plgpu is None or jax.default_backend() != "gpu":
    return False
  cc = getattr(jax.devices()[0], "compute_capability", "")
  return str(cc).startswith("9")


def supports(dtype, D: int) -> bool:
  return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and D % 64 == 0


def _kernel(lengths_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, *scratch, kv_layout, N2,
            R_tiles, split_size, block_kv, stages, scale_log2, dtype, D, fused_acc):
  del R_tiles
  (q_smem, k_smem, v_smem, lse_smem, k_ready, v_ready, q_ready, k_free, v_free) = scratch
  r_tile = lax.axis_index("r")
  split = lax.axis_index("s")
  n = lax.axis_index("n")
  n1 = lax.div(n, jnp.int32(N2))
  n2 = lax.rem(n, jnp.int32(N2))
  wg = lax.axis_index("wg")

  length = lengths_ref[n1]
  lo = split * split_size
  full = lax.div(length, jnp.int32(block_kv)) * block_kv  # whole blocks only (see module doc)
  hi = jnp.minimum(lo + split_size, full)
  nblocks = jnp.where(hi > lo, lax.div(hi - lo, jnp.int32(block_kv)), 0)

  def block_start(i):
    return lo + i * block_kv

  def kv_slice(ref, start):
    if kv_layout == "PLKD":
      return ref.at[n1, pl.ds(start, block_kv), n2]
    return ref.at[n1, n2, pl.ds(start, block_kv)]

  @pl.when(wg < CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(232, action="increase")
    row0 = (r_tile * CONSUMERS + wg) * ROWS_PER_WG
    qo = q_smem.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[n1, n2, pl.ds(row0, ROWS_PER_WG)], qo, q_ready.at[wg])
    plgpu.barrier_wait(q_ready.at[wg])

    # Register layouts matter to Mosaic GPU only; its CPU interpreter has no layout_cast.
    lay = (lambda x, _: x) if not fused_acc else plgpu.layout_cast
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m = lay(jnp.full((ROWS_PER_WG,), -jnp.inf, jnp.float32), row_layout)
    l = lay(jnp.full((ROWS_PER_WG,), 0.0, jnp.float32), row_layout)
    acc = lay(jnp.zeros((ROWS_PER_WG, D), jnp.float32), plgpu.Layout.WGMMA)

    def step(i, carry):
      acc, m, l = carry
      slot = lax.rem(i, jnp.int32(stages))
      plgpu.barrier_wait(k_ready.at[slot])

      def qk_scope(ref):
        plgpu.wgmma(ref, qo, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
        return ref[...]
      if fused_acc:
        s = pl.run_scoped(qk_scope, plgpu.ACC((ROWS_PER_WG, block_kv), jnp.float32))
      else:  # the CPU interpreter cannot transpose a wgmma operand: the same product via jnp
        s = lax.dot_general(qo[...], k_smem[slot], (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
      plgpu.barrier_arrive(k_free.at[slot])
      s = s * scale_log2
      m_new = jnp.maximum(m, s.max(axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
      l = l * alpha + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      plgpu.barrier_wait(v_ready.at[slot])

      def pv(ref):
        plgpu.wgmma(ref, p.astype(dtype), v_smem.at[slot])
      if fused_acc:  # accumulate in place into the running output
        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      else:  # the CPU interpreter takes no register operand in wgmma: the same product via jnp
        acc = acc + jnp.dot(p.astype(dtype), v_smem[slot], preferred_element_type=jnp.float32)
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l

    acc, m, l = lax.fori_loop(0, nblocks, step, (acc, m, l))

    empty = l == 0.0
    inv = 1.0 / jnp.where(empty, 1.0, l)
    qo[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
    lse_smem.at[wg][...] = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo, out_ref.at[split, n1, n2, pl.ds(row0, ROWS_PER_WG)])
    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[split, n1, n2, pl.ds(row0, ROWS_PER_WG)])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == CONSUMERS)
  def _producer():
    plgpu.set_max_registers(40, action="decrease")

    @pl.loop(0, nblocks)
    def _(i):
      slot = lax.rem(i, jnp.int32(stages))
      start = block_start(i)

      @pl.when(i >= stages)
      def _():
        plgpu.barrier_wait(k_free.at[slot])
      plgpu.copy_gmem_to_smem(kv_slice(k_ref, start), k_smem.at[slot], k_ready.at[slot])

      @pl.when(i >= stages)
      def _():
        plgpu.barrier_wait(v_free.at[slot])
      plgpu.copy_gmem_to_smem(kv_slice(v_ref, start), v_smem.at[slot], v_ready.at[slot])

    # Observe the consumers' last hand-backs too, so that every barrier phase is consumed
    # when the kernel ends (the interpreter checks it; the hardware does not care).
    @pl.loop(jnp.maximum(nblocks - stages, 0), nblocks)
    def _(i):
      slot = lax.rem(i, jnp.int32(stages))
      plgpu.barrier_wait(k_free.at[slot])
      plgpu.barrier_wait(v_free.at[slot])


def _num_sms() -> int:
  try:
    return int(getattr(jax.devices()[0], "core_count", 0)) or 132
  except Exception:  # noqa: BLE001
    return 132


def plan_splits(programs: int, max_len: int, bs: HopperBlockSizes) -> int:
  """Key ranges per stream: enough programs to cover every SM about once (one program per SM
  fits in shared memory), never ranges shorter than two blocks."""
  if bs.splits is not None:
    return bs.splits
  want = max(1, round(_num_sms() / max(programs, 1)))
  return int(max(1, min(want, max_len // (2 * bs.block_kv))))


def rows_attention(q_N1N2RD, k, v, lengths, *, kv_layout: str, sm_scale: float,
                   block_sizes: HopperBlockSizes | None = None, interpret: bool = False):
  """Partial attentions of the rows of each stream over each split of its keys.

  ``q_N1N2RD[N1, N2, R, D]`` (R a multiple of 128), ``k``/``v`` in ``kv_layout`` with the
  same N1, N2 (see module doc), ``lengths[N1]`` int32 in ``[0, L]``. Covers the keys
  ``[0, floor(length / block_kv) * block_kv)`` only; add ``tail_attention`` for the rest.
  Returns ``out[splits, N1, N2, R, D]`` (q's dtype) and ``lse2[splits, N1, N2, R]`` float32
  in base 2 (``-inf`` for an empty split).
  """
  bs = block_sizes or HopperBlockSizes()
  N1, N2, R, D = q_N1N2RD.shape
  if R % (CONSUMERS * ROWS_PER_WG):
    raise ValueError(f"rows per stream must be a multiple of {CONSUMERS * ROWS_PER_WG}, got {R}")
  if kv_layout == "PLKD":
    L = k.shape[1]
    if k.shape != (N1, L, N2, D):
      raise ValueError(f"k {k.shape} does not match q {q_N1N2RD.shape} in layout PLKD")
  elif kv_layout == "BKSD":
    L = k.shape[2]
    if k.shape != (N1, N2, L, D):
      raise ValueError(f"k {k.shape} does not match q {q_N1N2RD.shape} in layout BKSD")
  else:
    raise ValueError(f"unknown kv_layout {kv_layout!r}")
  if L % 8:  # Mosaic GPU's tiled TMA copies need the key axis in whole 8-row tiles
    raise ValueError(f"the key axis of k/v must be a multiple of 8 for the Hopper kernel, got {L}")
  if v.shape != k.shape or k.dtype != q_N1N2RD.dtype or v.dtype != k.dtype:
    raise ValueError("q, k and v must share one dtype and k, v one shape")
  if not supports(k.dtype, D):
    raise ValueError(f"the Hopper kernel takes bf16/f16 with D % 64 == 0, got {k.dtype}, D={D}")
  itemsize = jnp.dtype(k.dtype).itemsize
  smem = ((CONSUMERS * ROWS_PER_WG + 2 * bs.stages * bs.block_kv) * D * itemsize
          + CONSUMERS * ROWS_PER_WG * 4 + 1024)
  if smem > SMEM_BYTES:
    raise ValueError(f"block_kv={bs.block_kv} x stages={bs.stages} at D={D} needs about "
                     f"{smem} bytes of shared memory; an H100/H200 block has {SMEM_BYTES}")
  r_tiles = R // (CONSUMERS * ROWS_PER_WG)
  splits = plan_splits(r_tiles * N1 * N2, L, bs)
  per_split = -(-L // splits)
  split_size = -(-per_split // bs.block_kv) * bs.block_kv
  stages = bs.stages
  dtype = q_N1N2RD.dtype
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  scratch = (
      plgpu.SMEM((CONSUMERS, ROWS_PER_WG, D), dtype, transforms=tiled),
      plgpu.SMEM((stages, bs.block_kv, D), dtype, transforms=tiled),
      plgpu.SMEM((stages, bs.block_kv, D), dtype, transforms=tiled),
      plgpu.SMEM((CONSUMERS, ROWS_PER_WG), jnp.float32),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=CONSUMERS),
      plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
  )
  body = functools.partial(
      _kernel, kv_layout=kv_layout, N2=N2, R_tiles=r_tiles, split_size=split_size,
      block_kv=bs.block_kv, stages=stages, scale_log2=float(sm_scale) * _LOG2E, dtype=dtype, D=D,
      fused_acc=not interpret)
  kw = {}
  if interpret:  # the Mosaic GPU interpreter (threads, barriers, TMA and wgmma simulated on CPU)
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    kw["interpret"] = InterpretGPUParams()
  out, lse2 = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((splits, N1, N2, R, D), dtype),
                jax.ShapeDtypeStruct((splits, N1, N2, R), jnp.float32)),
      scratch_types=scratch,
      grid=(r_tiles, splits, N1 * N2),
      grid_names=("r", "s", "n"),
      num_threads=CONSUMERS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **kw,
  )(lengths.astype(jnp.int32), q_N1N2RD, k, v)
  return out, lse2


def tail_attention(q_N1N2RD, k, v, lengths, *, kv_layout: str, sm_scale: float, block_kv: int):
  """The keys ``[floor(length / block_kv) * block_kv, length)`` of each stream (fewer than
  ``block_kv``), in plain jnp: one gathered block per stream, masked by length (values too,
  so garbage past a length cannot leak). Returns ``(out[N1, N2, R, D] float32,
  lse2[N1, N2, R] float32 base 2)``, ``-inf`` / 0 where a stream has no tail."""
  N1, N2, R, D = q_N1N2RD.shape
  L = k.shape[1] if kv_layout == "PLKD" else k.shape[2]
  lengths = lengths.astype(jnp.int32)
  pos = (lengths // block_kv * block_kv)[:, None] + jnp.arange(block_kv, dtype=jnp.int32)[None]
  valid = pos < lengths[:, None]                                     # [N1, bkv]
  idx = jnp.clip(pos, 0, L - 1)
  if kv_layout == "PLKD":  # [N1, L, N2, D] -> [N1, N2, bkv, D]
    take = lambda a: jnp.swapaxes(jnp.take_along_axis(a, idx[:, :, None, None], axis=1), 1, 2)
  else:
    take = lambda a: jnp.take_along_axis(a, idx[:, None, :, None], axis=2)
  kt = take(k).astype(jnp.float32)
  vt = jnp.where(valid[:, None, :, None], take(v).astype(jnp.float32), 0.0)
  s = jnp.einsum("abrd,absd->abrs", q_N1N2RD.astype(jnp.float32), kt,
                 precision=lax.Precision.HIGHEST) * (float(sm_scale) * _LOG2E)
  s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
  p = jnp.exp2(s - m_safe)
  l = jnp.sum(p, axis=-1)
  o = jnp.einsum("abrs,absd->abrd", p, vt, precision=lax.Precision.HIGHEST)
  o = o / jnp.where(l > 0, l, 1.0)[..., None]
  return o, jnp.squeeze(m_safe, -1) + jnp.log2(l)


def attention_with_tail(q_N1N2RD, k, v, lengths, *, kv_layout: str, sm_scale: float,
                        block_sizes: HopperBlockSizes | None = None, interpret: bool = False,
                        out_dtype=None):
  """``rows_attention`` + ``tail_attention`` merged: attention of each stream's rows over all
  of ``[0, length)``. Returns ``(out[N1, N2, R, D], lse[N1, N2, R] float32, natural log)``."""
  from .merge import merge_stacked
  bs = block_sizes or HopperBlockSizes()
  o, lse2 = rows_attention(q_N1N2RD, k, v, lengths, kv_layout=kv_layout, sm_scale=sm_scale,
                           block_sizes=bs, interpret=interpret)
  ot, lt = tail_attention(q_N1N2RD, k, v, lengths, kv_layout=kv_layout, sm_scale=sm_scale,
                          block_kv=bs.block_kv)
  o = jnp.concatenate([o.astype(jnp.float32), ot[None]], axis=0)
  lse2 = jnp.concatenate([lse2, lt[None]], axis=0)
  out, lse = merge_stacked(o, lse2 * _LN2, axis=0, out_dtype=out_dtype or q_N1N2RD.dtype)
  return out, lse
