"""The Triton-lowered shared-prefix kernel (``prefix_attention``'s contract, see
``prefix_attention.py``); interpret mode runs it on any backend.

Kernel structure: for each (group p, KV head k), the rows are all ``(b, t, g)`` triples of
the group: ``R = (B/P) * T * G`` query rows (up to thousands) against one K/V stream. Grid
``(row_blocks, splits, P, K)``: one program owns ``block_q`` rows and one split of the
prefix (flash-decoding) and streams K/V in ``block_k`` slot blocks through the online
softmax of ``triton_core`` (interior blocks unmasked, only the tail block masked). Row blocks
are the fastest grid axis, so the programs that read the same K/V tile run together and
share it through L2: each prefix byte comes from HBM about once per group. Splits are merged
by log-sum-exp.

Layers: with K/V stacked ``[layers, P, L, K, D]`` the kernel reads layer ``layer`` in place.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import triton_core as core
from .common import LOG2E, cdiv, next_pow2, num_sms
from .contracts import layer_operand, pad_rows, rows_to_tokens, tokens_to_rows
from .splits import split_range


@dataclasses.dataclass(frozen=True)
class PrefixAttentionBlockSizes:
    """Static tiling of the prefix kernel (None = chosen from the shapes).

    block_q: query rows ((b, t, g) triples of one group and KV head) per program
      (power of 2, >= 16); None: next power of 2 of the rows, clamped to
      [16, max_block_q].
    max_block_q: cap for the automatic block_q.
    block_k: prefix slots per inner step (power of 2, >= 16); None: 64 (less for
      a prefix under 64 slots). On GPU it is halved while the K/V pipeline
      buffers would not fit in shared memory.
    split_size: prefix slots per program (a multiple of block_k); None: on GPU
      the number of splits that best fills whole waves of programs over the SMs
      (each split at least ``min_split_size`` of the L slots); one split
      elsewhere. With None the splits divide each group's *valid* length
      (``prefix_lengths[p]``) evenly at run time, so a prefix cache padded past
      its prefix costs what its valid tokens cost.
    target_programs: None, or the number of programs that run at once (instead
      of the SM-count estimate) for the automatic split choice.
    num_splits: None, or this many splits (instead of the automatic choice);
      like the automatic splits they share each group's valid length at run time.
    num_warps / num_stages: Triton compiler parameters (ignored in interpret
      mode); num_warps None: 4 for block_q <= 64, else 8.
    fast_exp: on NVIDIA GPUs compute exp2 with one ``ex2.approx.ftz.f32``.
    """
    block_q: int | None = None
    max_block_q: int = 128
    block_k: int | None = None
    split_size: int | None = None
    target_programs: int | None = None
    min_split_size: int = 256
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int = 3
    fast_exp: bool = True


GPU_DEFAULTS = PrefixAttentionBlockSizes()


@dataclasses.dataclass(frozen=True)
class PrefixStatic:
    """Everything the kernel body needs to know statically."""
    L: int
    block_q: int
    block_k: int
    split_size: int
    num_splits: int
    dynamic_split: bool  # splits share each group's valid length (else: static split_size slots)
    has_layer: bool      # K/V stacked over layers [Lyr, P, L, K, D], the layer an input
    scale_log2: float
    fast_exp: bool
    D: int          # the head dim (the tiles hold head_tile(D) lanes; those past D masked)


def _prefix_kernel(layer_ref, lengths_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                   c: PrefixStatic):
    _, si, p, h = (pl.program_id(i) for i in range(4))
    bk = c.block_k
    lead = (layer_ref[0], p) if c.has_layer else (p,)
    q, head_ok = core.load_queries(q_ref, k_ref.dtype, c.D)      # [bq, Dp]

    def step(state, start, ok):
        """One online-softmax step over prefix slots [start, start + bk)."""
        idx = (*lead, pl.ds(start, bk), h, slice(None))
        # masked where needed: slots past the prefix come back as 0 (no NaN), as do lanes
        # past D
        k = core.load_rows(k_ref, idx, ok, head_ok)
        v = core.load_rows(v_ref, idx, ok, head_ok)
        # m is kept in base-2 units (logit * scale * log2 e). With a positive scale the row
        # max commutes with the scaling, so each score costs one fused multiply-add
        # (s * scale - m) before the exp2, not a multiply and a subtract.
        return core.update(state, q, k, v, scale_log2=c.scale_log2,
                           score_ok=None if ok is None else ok[None, :],
                           fast_exp=c.fast_exp, fold_scale=True)

    length = jnp.clip(lengths_ref[p], 0, c.L)
    lo, hi = split_range(si, length, c)
    state = core.init_state(c.block_q, q_ref.shape[-1])
    state = core.stream_keys(step, state, lo, hi, bk)
    core.finalize(state, o_ref, lse_ref, head_ok)


# A program's fixed cost (q load, pipeline fill, writing its partial result) in slots of key
# work of one block_q=128 row block, fitted on an H100 to the split sweep of the Qwen2.5-1.5B
# shape (benchmarks/prefix_attention_h100.md).
_FIXED_SLOTS = 700


def choose_splits(base: int, max_splits: int, slots: int, L: int) -> int:
    """Splits per (row block, group, head) that best fill whole waves of programs.

    Cost model (in units of one program streaming all L slots): each wave of programs takes
    ``1 / n`` of that plus a fixed cost of ``_FIXED_SLOTS / L``, and each split adds a small
    charge for the partial results written and merged. The charge per split stays small: a
    larger one leaves a model with few KV heads on a fraction of the SMs.
    """
    fixed = _FIXED_SLOTS / max(L, 1)
    best, best_cost = 1, None
    for n in range(1, max(1, max_splits) + 1):
        cost = cdiv(base * n, slots) * (1.0 / n + fixed) + 0.001 * n
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = n, cost
    return best


def plan(P, K, rows, L, D, *, bs: PrefixAttentionBlockSizes, on_gpu: bool, itemsize: int):
    """Resolves automatic block sizes into concrete static numbers:
    ``(block_q, block_k, split_size, num_splits, num_q_blocks)``."""
    block_q = core.auto_block_q(bs, rows)
    block_k = bs.block_k or min(64, max(16, next_pow2(L)))
    if on_gpu:
        block_k = core.fit_block_k(block_k, block_q, D, itemsize, bs.num_stages)
    core.check_blocks(block_k=block_k, block_q=block_q)
    num_q_blocks = cdiv(rows, block_q)
    L1 = max(L, 1)
    if bs.split_size is not None:
        if bs.split_size % block_k:
            raise ValueError(f"split_size={bs.split_size} must be a multiple of "
                             f"block_k={block_k}")
        split = bs.split_size
    elif bs.num_splits is not None:
        if bs.num_splits < 1:
            raise ValueError(f"num_splits={bs.num_splits} must be >= 1")
        split = cdiv(cdiv(L1, min(bs.num_splits, cdiv(L1, block_k))), block_k) * block_k
    elif on_gpu or bs.target_programs:
        num_warps = core.default_num_warps(bs, block_q)
        slots = bs.target_programs or num_sms() * (2 if num_warps <= 4 else 1)
        max_splits = max(1, L1 // max(bs.min_split_size, block_k))
        n = choose_splits(num_q_blocks * P * K, max_splits, slots, L1)
        split = cdiv(cdiv(L1, n), block_k) * block_k
    else:
        split = cdiv(L1, block_k) * block_k
    num_splits = max(1, cdiv(L1, split))
    return block_q, block_k, split, num_splits, num_q_blocks


@functools.partial(jax.jit,
                   static_argnames=("sm_scale", "interpret", "block_sizes", "on_gpu"))
def triton_prefix_attention(q, k_prefix, v_prefix, prefix_lengths, layer, *, sm_scale,
                            interpret, block_sizes, on_gpu):
    """The kernel on checked arguments (``dispatch.prefix_attention`` checks them):
    ``prefix_lengths[P]`` int32, ``sm_scale`` a float, ``on_gpu``: compiled for a GPU
    (shared-memory fitting, split planning over the SMs, fast exp2) rather than interpreted."""
    B, T, H, D = q.shape
    P, L, K, _ = k_prefix.shape[-4:]
    has_layer = layer is not None
    G = H // K
    Bg = B // P
    rows = Bg * T * G
    block_q, block_k, split, num_splits, nq = plan(
        P, K, rows, L, D, bs=block_sizes, on_gpu=on_gpu,
        itemsize=jnp.dtype(k_prefix.dtype).itemsize)
    rows_pad = nq * block_q
    if L < block_k:  # a tiny prefix: pad it to one block (its slots are masked anyway)
        pad = ((0, 0),) * (k_prefix.ndim - 3) + ((0, block_k - L), (0, 0), (0, 0))
        k_prefix, v_prefix = jnp.pad(k_prefix, pad), jnp.pad(v_prefix, pad)

    q_PKRD = tokens_to_rows(q, K, groups=P)             # rows r = (b_in_group * T + t) * G + g
    if rows_pad != rows:
        q_PKRD = pad_rows(q_PKRD, rows_pad)

    static = PrefixStatic(L=L, block_q=block_q, block_k=block_k, split_size=split,
                          num_splits=num_splits, dynamic_split=block_sizes.split_size is None,
                          has_layer=has_layer, scale_log2=float(sm_scale) * LOG2E,
                          fast_exp=core.use_fast_exp(block_sizes, on_gpu), D=D)
    inputs = [layer_operand(layer), prefix_lengths.astype(jnp.int32), q_PKRD, k_prefix,
              v_prefix]
    o, lse = core.attention_call(
        functools.partial(_prefix_kernel, c=static), inputs, [],
        kv_shape=k_prefix.shape, num_splits=num_splits, block_q=block_q, rows_pad=rows_pad,
        D=D, out_dtype=q.dtype, block_sizes=block_sizes, interpret=interpret,
        name="jaxspec_prefix_attention")
    return rows_to_tokens(o, lse, B, T, G, grouped=True)

