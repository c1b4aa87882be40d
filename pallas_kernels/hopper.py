"""Hopper (sm_90) fast path: a Mosaic GPU flash-attention kernel for many query rows per
K/V stream.

Where one K/V stream meets many query rows (a shared prefix read by a whole group of
sequences, or a long verification block of T x G rows per KV head) attention is bound
by matrix throughput, not by reading K/V. This kernel feeds Hopper's tensor cores the way
they want:
  * K/V tiles arrive by TMA into a ring of shared-memory stages (one producer warpgroup);
  * two consumer warpgroups of 64 (or 128) rows each run ``wgmma`` for QK^T and PV out of
    shared memory with the online softmax in registers;
  * software pipelining (``overlap``, the default for 64-row warpgroups): a consumer issues
    QK^T of block i+1 and PV of block i together, waits for the first only and runs block
    i+1's softmax while PV is on the tensor cores (P is converted to bf16 only after PV is
    done: writing the registers of an in-flight wgmma operand makes ptxas serialize them all);
  * ping-pong: the two consumers take turns issuing their products (with ``overlap`` they
    pass a token after issuing; without, they meet at a shared barrier twice per block,
    warpgroup 1 one meeting behind warpgroup 0), so one's softmax runs under the other's
    matrix products; the wait for the next K tile sits under the PV product;
  * the row tiles of one stream are launched side by side (Mosaic GPU launches the last
    grid axis fastest) so that they share its K/V through L2, and the streams of the longest
    sequences first (``longest_first``): with ragged lengths the programs that start last
    are then the short ones, so fewer SMs idle at the end.

Problem solved here (``rows_attention``): ``N`` streams (e.g. (group, KV head) or
(sequence, KV head)); stream ``n`` has query rows ``q[n, :R]`` and keys/values in a
layout given by ``kv_layout``; stream ``n`` sees keys ``[0, lengths[n // N2])``. Those valid
keys (not the whole key axis: a cache padded to a bucket may hold far fewer) are cut at run
time into ``splits`` equal ranges of whole blocks (flash-decoding) so that short problems
still fill every SM; each split returns a partial ``(out, lse)`` that ``merge.merge_stacked``
combines exactly (``attention`` does both).

Ragged lengths inside the kernel: blocks that every row sees whole run unmasked. The last,
ragged block is loaded whole (TMA starts stay multiples of the tile, as Mosaic GPU's tiled
copies need; a block running past the key axis is zero-filled by TMA); its scores past the
length are masked to -inf, and the producer zeroes its value rows past the length in
shared memory before handing it over, since 0 x NaN garbage would still be NaN in PV.

Verification (``verify_attention``, ``decode_attention``'s contract): the T_new new tokens
sit right after the context; the blocks holding them run masked with a per-block tile of the
causal / tree mask (``new_token_mask``, 0 or -inf per row and slot), so one kernel pass
covers context and new tokens.

Layouts of K/V (``kv_layout``), optionally stacked over layers (``layer=``, read in place):
  * ``"PLKD"``: ``k[P, L, K, D]`` (the shared-prefix layout); stream ``n = p * K + k``.
  * ``"BKSD"``: ``k[B, K, S, D]`` (a per-sequence cache); stream ``n = b * K + k``.

Numerics: products in bf16/f16 with float32 accumulation (wgmma), softmax in float32 in
base 2 with ``sm_scale * log2(e)`` folded into one multiply-add per score; the partial
outputs are stored in the input dtype, the log-sum-exps in float32.

Runs on an NVIDIA Hopper GPU, and on CPU through the Mosaic GPU interpreter
(``interpret=True``) for tests (there the two matrix products run as jnp dots: the
interpreter takes no transposed or register wgmma operands).

A verification reads q[B, T, H, D] and writes out[B, T, H, D] in place where G allows
(``q_layout="BTHD"``: a warpgroup's rows are G strided boxes of ``rows_per_wg // G`` tokens,
rows ordered (g, t)); causal new tokens are then masked from indices in the kernel, and a
tree's mask has one row per token. Other G take q as transposed rows [B, K, T x G, D].
A shared prefix does the same with q[B, T, H, D] viewed as [P, B/P x T, H, D] (a free
reshape): the queries of a group are its "tokens".

Where it serves: ``dispatch`` picks it by default on a Hopper GPU for bf16/f16 verification
from ``HOPPER_MIN_ROWS_VERIFY`` query rows per KV head and for a shared prefix from
``HOPPER_MIN_ROWS_PREFIX`` rows per group and KV head: there it beats the Triton kernels
(benchmarks/hopper_attention_h100.md, which also lists the alternatives measured and not
kept: 2-CTA K/V multicast, deeper K/V rings, persistent programs, 192-key tiles, 3 stages).
With batch-invariant numerics a prefill's prompt rows (`jaxspec.invariant.prompt_attention`)
take it with one key range (``splits=1``): each row then reduces its keys from slot 0 in
blocks of absolute positions with one running state, and blocks past its keys (the causal
tail of its tile) are exact no-ops, so its bits do not depend on the chunking, its place in a
tile, the batch or the cache capacity (checked on an H200 by
``scripts/probe_prompt_attention.py`` and ``tests/test_batch_invariant.py``'s GPU tests).
Head dims 64 and 128 take the default tiles; 256 takes 64-key blocks (``default_block_sizes``:
128 keys x 2 stages would not fit in shared memory). 64-row warpgroups are the default: with
128 rows the S and O accumulators alone need 256 registers per thread at D=128, over the
240 cap.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import common
from .common import HOPPER_SMEM_BYTES as SMEM_BYTES
from .common import LN2, LOG2E, cdiv, round_up
from .contracts import layer_operand, pad_rows, rows_to_tokens, tokens_to_rows
from .merge import merge_stacked
from .splits import split_bounds



class _MosaicGPU:
    """``jax.experimental.pallas.mosaic_gpu``, imported on first use (0.35 s of importing
    jaxspec on a CPU machine, where the kernel never runs)."""

    _module = None

    def __getattr__(self, name):
        if _MosaicGPU._module is None:
            from jax.experimental.pallas import mosaic_gpu
            _MosaicGPU._module = mosaic_gpu
        return getattr(_MosaicGPU._module, name)


def has_mosaic_gpu() -> bool:
    """Whether this jax has Mosaic GPU (Pallas' Hopper backend)."""
    import importlib.util
    try:
        return importlib.util.find_spec("jax.experimental.pallas.mosaic_gpu") is not None
    except ImportError:  # pragma: no cover
        return False


plgpu = _MosaicGPU()


def load_runtime() -> None:
    """Imports Mosaic GPU where this kernel can run: a compiled program that calls it (an
    executable loaded from disk, `jaxspec.compile_cache`) needs the runtime symbols that the
    import loads, and a process that has not traced the kernel yet has not imported it."""
    if available():
        plgpu.kernel  # noqa: B018 - the attribute access imports the module

CONSUMERS = 2


@dataclasses.dataclass(frozen=True)
class HopperBlockSizes:
    """Tiling of the Hopper kernel.

    block_kv: keys per stage (multiple of 64). stages: shared-memory ring depth (>= 2).
    splits: key ranges per stream (None: enough to give every SM a program).
    rows_per_wg: query rows per consumer warpgroup, 64 (one wgmma M tile) or 128 (two); a
      program holds ``2 * rows_per_wg`` rows, so 128 lets 256 rows of one stream share each
      K/V tile read.
    pingpong: schedule the two consumer warpgroups in turn on the tensor cores (one's
      softmax runs under the other's matrix products).
    overlap: software-pipeline each consumer (FlashAttention-3's intra-warpgroup overlap):
      QK^T of block i+1 and PV of block i are issued together, and the softmax of block i+1
      runs while PV of block i is still on the tensor cores; with ``pingpong`` the consumers
      then pass a token to take turns issuing. None (default): on for 64-row warpgroups (a
      128-row one has no registers to spare for a second score tile).
    longest_first: launch the streams of the longest sequences first (ragged lengths: the
      programs that start last are then the short ones, so fewer SMs idle at the end).
    registers: (per consumer thread, per producer thread) register caps (``setmaxnreg``);
      None: (232, 40) for 64-row warpgroups, (240, 24) for 128-row ones. 2 x consumer +
      producer must stay within 504 (the block's launch allocation of 168 per thread), with
      producer <= 168 <= consumer (the producer gives registers back, the consumers take them).
    """
    block_kv: int = 128
    stages: int = 2
    splits: int | None = None
    rows_per_wg: int = 64
    pingpong: bool = True
    overlap: bool | None = None
    longest_first: bool = True
    registers: tuple[int, int] | None = None

    def __post_init__(self):
        if self.block_kv % 64 or self.block_kv <= 0:
            raise ValueError(f"block_kv must be a positive multiple of 64, got {self.block_kv}")
        if self.stages < 2:
            raise ValueError(f"stages must be >= 2, got {self.stages}")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"splits must be >= 1, got {self.splits}")
        if self.rows_per_wg not in (64, 128):
            raise ValueError(f"rows_per_wg must be 64 or 128, got {self.rows_per_wg}")
        if self.registers is not None:
            regs = tuple(self.registers)
            if len(regs) != 2:
                raise ValueError(f"registers must be (consumer, producer), got {self.registers}")
            object.__setattr__(self, "registers", regs)  # a list would make the sizes unhashable
            c, p = regs
            # The consumers' setmaxnreg.inc waits for registers the producer gave back, out of the
            # block's launch allocation: 384 threads get at most 168 each (64K / 384 rounded down
            # to 8), so more than 3 x 168 in all would wait for ever (a hang on the GPU, e.g.
            # with (240, 32)); and the producer's cap is a decrease, the consumers' an increase
            # from that launch allocation.
            if c % 8 or p % 8 or not 24 <= p <= 168 <= c <= 256 or 2 * c + p > 3 * 168:
                raise ValueError(f"registers (consumer, producer) must be multiples of 8 with "
                                 f"24 <= producer <= 168 <= consumer <= 256 and 2 x consumer + "
                                 f"producer <= 504, got {self.registers}")

    @property
    def consumer_registers(self) -> int:
        return self.registers[0] if self.registers else (240 if self.rows_per_wg == 128 else 232)

    @property
    def producer_registers(self) -> int:
        return self.registers[1] if self.registers else (24 if self.rows_per_wg == 128 else 40)

    @property
    def use_overlap(self) -> bool:
        return self.rows_per_wg == 64 if self.overlap is None else self.overlap

    @property
    def rows_per_program(self) -> int:
        return CONSUMERS * self.rows_per_wg


@dataclasses.dataclass(frozen=True)
class HopperStatic:
    """Everything the kernel body needs to know statically (resolved from the inputs and a
    ``HopperBlockSizes`` by ``rows_attention``)."""
    kv_layout: str        # "PLKD" (shared prefix) or "BKSD" (per-sequence cache)
    layered: bool         # K/V stacked over layers, the layer an input
    N2: int               # streams per N1 (KV heads)
    splits: int           # key ranges per stream
    block_kv: int
    stages: int
    scale_log2: float     # sm_scale * log2(e)
    dtype: object         # q / k / v dtype (bf16 or f16)
    D: int
    rows_per_wg: int      # query rows per consumer warpgroup (64 or 128)
    pingpong: bool
    overlap: bool
    num_new: int          # new-token keys after each length (0: none)
    q_groups: int         # G when q is read in place ([B, T, H, D]); 0: transposed rows
    q_tokens: int         # T of the in-place layout (its causal offset)
    mask_tiles: bool      # a new-token mask input (else causal from indices, or no new tokens)
    compiled: bool        # lowered by Mosaic GPU (False: the CPU interpreter)
    consumer_regs: int
    producer_regs: int


def available() -> bool:
    """True on an NVIDIA Hopper GPU (compute capability 9.x) with Mosaic GPU importable."""
    return has_mosaic_gpu() and common.is_hopper_gpu()


def supports(dtype, D: int) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and D % 64 == 0


def default_block_sizes(D: int) -> HopperBlockSizes | None:
    """The dispatchers' tiling for head dim D, or None where this kernel is not their default.
    D=256 takes 64-key blocks (128 x 2 stages would need 333 KB of shared memory), where it
    beats the Triton kernel (benchmarks/hopper_attention_h100.md). Other multiples of 64 are
    untested on a GPU and stay with Triton."""
    if D in (64, 128):
        return HopperBlockSizes()
    if D == 256:
        return HopperBlockSizes(block_kv=64)
    return None


def check_requested(fits: bool, need: str, interpret) -> None:
    """For a caller that asked for this kernel by passing ``HopperBlockSizes``: raises unless
    the inputs fit it (``fits``; ``need`` says what it takes) and it can run here."""
    if not fits:
        raise ValueError(f"the Hopper kernel takes {need}")
    if not (interpret or available()):
        raise ValueError("HopperBlockSizes need an NVIDIA Hopper GPU (or interpret=True)")


def _kernel(lengths_ref, order_ref, layer_ref, q_ref, k_ref, v_ref, *refs, c: HopperStatic):
    block_kv, stages, RW, dtype, D = c.block_kv, c.stages, c.rows_per_wg, c.dtype, c.D
    if c.mask_tiles:
        mask_ref, *refs = refs
    out_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem, *refs = refs
    if c.mask_tiles:
        mask_smem, *refs = refs
    k_ready, v_ready, q_ready, k_free, v_free, turn, v_tail, *refs = refs
    if c.mask_tiles:
        mask_ready, *refs = refs
    token, = refs
    r_tile = lax.axis_index("r")
    split = lax.axis_index("s")
    n = lax.axis_index("n")
    # Streams are launched in ``order`` (longest first where the lengths are ragged: the
    # programs that start last are then the short ones, and fewer SMs idle at the end).
    n1 = order_ref[lax.div(n, jnp.int32(c.N2))]
    n2 = lax.rem(n, jnp.int32(c.N2))
    wg = lax.axis_index("wg")

    length = lengths_ref[n1]  # context keys; then num_new new-token keys under the mask
    # The key splits share this stream's valid keys at run time (not the L slots of the
    # cache): a prefix cache padded to a bucket, or a short sequence in a long cache, still
    # spreads its keys over every split. Ranges start at whole blocks (TMA tiles).
    lo, hi = split_bounds(split, length + c.num_new, c.splits, block_kv)
    nkeys = jnp.maximum(hi - lo, 0)
    nblocks = lax.div(nkeys + (block_kv - 1), jnp.int32(block_kv))
    # Blocks every row sees whole run unmasked; the rest (a ragged last block, the blocks
    # holding new tokens) run masked.
    nfull = jnp.clip(lax.div(jnp.minimum(hi, length) - lo, jnp.int32(block_kv)), 0, nblocks)
    first_new_block = lax.div(length, jnp.int32(block_kv))

    # lo is a whole number of blocks (or the end of an empty split): its key offsets are
    # written as (block index) x block_kv, so that Mosaic GPU's layout inference sees TMA
    # starts that are multiples of the tile (a start through min() fails to lower in jax 0.11).
    lo_blk = lax.div(lo, jnp.int32(block_kv))

    def block_start(i):
        return (lo_blk + i) * block_kv

    def kv_slice(ref, start):
        if c.layered:  # stacked caches [layers, ...]: the layer is a (possibly traced) input
            ref = ref.at[layer_ref[0]]
        if c.kv_layout == "PLKD":
            return ref.at[n1, pl.ds(start, block_kv), n2]
        return ref.at[n1, n2, pl.ds(start, block_kv)]

    def rendezvous():
        """Both consumers meet here. Warpgroup 1 starts one meeting behind warpgroup 0, so
        while one issues its matrix products the other runs its softmax (ping-pong)."""
        if c.pingpong:
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

    def my_turn():
        """Overlapped consumers take turns issuing their products: wait for the token."""
        if c.pingpong:
            plgpu.barrier_wait(token.at[wg])

    def pass_turn(last=False):
        """Hand the token to the other consumer right after issuing (no waiting on it, unlike
        ``rendezvous``: a consumer never waits for the other's softmax, only for its turn).
        Warpgroup 1 keeps it after its last issue (warpgroup 0 holds it first)."""
        if c.pingpong:
            if last:
                pl.when(wg == 0)(lambda: plgpu.barrier_arrive(token.at[1]))
            else:
                plgpu.barrier_arrive(token.at[1 - wg])

    # Register layouts matter to Mosaic GPU only; its CPU interpreter has no layout_cast.
    lay = plgpu.layout_cast if c.compiled else (lambda x, _: x)

    def iota(shape, dim):
        if c.compiled:
            return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)
        return lax.broadcasted_iota(jnp.int32, shape, dim)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(c.consumer_regs, action="increase")
        row0 = (r_tile * CONSUMERS + wg) * RW
        qo = q_smem.at[wg]
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        m0 = lay(jnp.full((RW,), -jnp.inf, jnp.float32), row_layout)
        l0 = lay(jnp.full((RW,), 0.0, jnp.float32), row_layout)
        acc0 = lay(jnp.zeros((RW, D), jnp.float32), plgpu.Layout.WGMMA)
        if c.q_groups:  # q[B, T, H, D] read in place: G strided boxes of Tt tokens, rows (g, t)
            Tt = RW // c.q_groups
            t0 = (r_tile * CONSUMERS + wg) * Tt
            for g in range(c.q_groups):
                plgpu.copy_gmem_to_smem(q_ref.at[n1, pl.ds(t0, Tt), n2 * c.q_groups + g],
                                        qo.at[pl.ds(g * Tt, Tt)], q_ready.at[wg])
        else:
            plgpu.copy_gmem_to_smem(q_ref.at[n1, n2, pl.ds(row0, RW)], qo, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])

        def softmax(s, i, m, l, masked):
            """The online softmax of block i's scores s: (m, l, alpha, p), p in float32."""
            if masked:
                if c.mask_tiles:  # this block's tile of the new-token mask (0 seen, -inf hidden)
                    rel = lax.div(block_start(i), jnp.int32(block_kv)) - first_new_block
                    if c.q_groups:  # a tile per token: the G heads of a token share its row
                        for g in range(c.q_groups):
                            plgpu.copy_gmem_to_smem(mask_ref.at[n1, rel, pl.ds(t0, Tt)],
                                                    mask_smem.at[wg, pl.ds(g * Tt, Tt)],
                                                    mask_ready.at[wg])
                    else:
                        plgpu.copy_gmem_to_smem(mask_ref.at[n1, rel, pl.ds(row0, RW)],
                                                mask_smem.at[wg], mask_ready.at[wg])
                    plgpu.barrier_wait(mask_ready.at[wg])
                    bias = mask_smem.at[wg][...].astype(jnp.float32)
                    if c.compiled:
                        bias = lay(bias, plgpu.Layout.WGMMA)
                    s = s + bias
                elif c.num_new:  # causal over the new tokens, from indices: token t is new token
                    # num_new - q_tokens + t and sees new token j <= that (and all context, j < 0)
                    t = t0 + lax.rem(iota((RW, block_kv), 0), jnp.int32(Tt))
                    j = iota((RW, block_kv), 1) + (block_start(i) - length)
                    s = jnp.where((j < 0) | (j <= t + (c.num_new - c.q_tokens)), s, -jnp.inf)
                # keys at or past hi are nobody's (garbage, NaN included)
                s = jnp.where(iota((RW, block_kv), 1) < hi - block_start(i), s, -jnp.inf)
            # m is kept in scaled base-2 units, so p is one fused multiply-add and an exp2.
            m_new = jnp.maximum(m, s.max(axis=1) * c.scale_log2)
            # In a masked block a row may have seen no key yet (m_new = -inf: e.g. a split of
            # new tokens it does not see); shift by 0 then, so that exp2 gives 0, not NaN.
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
            alpha = jnp.exp2(m - m_use)
            p = jnp.exp2(s * c.scale_log2 - lax.broadcast_in_dim(m_use, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            return m_new, l, alpha, p

        def scale_rows(x, alpha):
            return x * lax.broadcast_in_dim(alpha, x.shape, [0])

        def step(i, carry, masked):
            acc, m, l = carry
            slot = lax.rem(i, jnp.int32(stages))

            def qk_scope(ref):
                plgpu.wgmma(ref, qo, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                rendezvous()  # hand the tensor cores over while this product runs
                return ref[...]
            if c.compiled:
                s = pl.run_scoped(qk_scope, plgpu.ACC((RW, block_kv), jnp.float32))
            else:  # the CPU interpreter cannot transpose a wgmma operand: the same product via jnp
                s = lax.dot_general(qo[...], k_smem[slot], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
                rendezvous()
            plgpu.barrier_arrive(k_free.at[slot])
            m_new, l, alpha, p = softmax(s, i, m, l, masked)
            p16 = p.astype(dtype)
            acc = scale_rows(acc, alpha)
            if c.compiled:
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
            if c.pingpong:
                plgpu.barrier_arrive(turn)  # softmax done
            plgpu.barrier_wait(v_ready.at[slot])
            if c.pingpong:
                plgpu.barrier_wait(turn)  # the tensor cores are ours again

            def wait_next_k():  # under this block's PV product
                @pl.when(i + 1 < nblocks)
                def _():
                    plgpu.barrier_wait(k_ready.at[lax.rem(i + 1, jnp.int32(stages))])

            def pv(ref):
                plgpu.wgmma(ref, p16, v_smem.at[slot])
                wait_next_k()
            if c.compiled:  # accumulate in place into the running output
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            else:  # the CPU interpreter takes no register operand in wgmma: the same product
                acc = acc + jnp.dot(p16, v_smem[slot], preferred_element_type=jnp.float32)
                wait_next_k()
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        def qk_dot(slot):  # the interpreter's QK^T (it cannot transpose a wgmma operand)
            return lax.dot_general(qo[...], k_smem[slot], (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)

        def pv_dot(p16, slot):  # the interpreter's PV (it takes no register operand in wgmma)
            return jnp.dot(p16, v_smem[slot], preferred_element_type=jnp.float32)

        # Overlapped (FlashAttention-3's intra-warpgroup pipelining): the carry holds block
        # i-1's probabilities; step i issues QK^T of block i and PV of block i-1 in one turn on
        # the tensor cores, waits for the first only, and runs block i's softmax under PV.
        def ov_first(masked):  # block 0: QK^T and softmax, no PV yet
            plgpu.barrier_wait(k_ready.at[0])
            my_turn()
            if c.compiled:
                def scope(ref):
                    plgpu.wgmma(ref, qo, plgpu.transpose_ref(k_smem.at[0], (1, 0)))
                    pass_turn()
                    return ref[...]
                s = pl.run_scoped(scope, plgpu.ACC((RW, block_kv), jnp.float32))
            else:
                s = qk_dot(0)
                pass_turn()
            plgpu.barrier_arrive(k_free.at[0])
            m_new, l_new, _, p = softmax(s, 0, m0, l0, masked)
            return acc0, m_new, l_new, p.astype(dtype)

        def ov_step(i, carry, masked):
            acc, m, l, p16 = carry
            slot = lax.rem(i, jnp.int32(stages))
            pslot = lax.rem(i - 1, jnp.int32(stages))
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[pslot])
            my_turn()
            if c.compiled:
                def scope(s_ref, o_ref):
                    o_ref[...] = acc
                    plgpu.wgmma(s_ref, qo, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    plgpu.wgmma(o_ref, p16, v_smem.at[pslot])
                    pass_turn()  # both products run on while the other consumer issues its own
                    s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # QK^T only
                    plgpu.barrier_arrive(k_free.at[slot])
                    m_new, l_new, alpha, p = softmax(s, i, m, l, masked)
                    o = plgpu.wgmma_accumulator_load(o_ref, wait_n=0)
                    # Only now (PV done) write the registers of the next PV's operand: a write while
                    # a product that reads them is in flight makes ptxas serialize every wgmma.
                    return lax.optimization_barrier((scale_rows(o, alpha), m_new, l_new,
                                                     p.astype(dtype)))
                out = pl.run_scoped(scope, plgpu.ACC((RW, block_kv), jnp.float32),
                                    plgpu.ACC((RW, D), jnp.float32))
            else:
                s = qk_dot(slot)
                o = acc + pv_dot(p16, pslot)
                pass_turn()
                plgpu.barrier_arrive(k_free.at[slot])
                m_new, l_new, alpha, p = softmax(s, i, m, l, masked)
                out = scale_rows(o, alpha), m_new, l_new, p.astype(dtype)
            plgpu.barrier_arrive(v_free.at[pslot])
            return out

        def ov_last(carry):  # PV of the last block
            acc, m, l, p16 = carry
            pslot = lax.rem(nblocks - 1, jnp.int32(stages))
            plgpu.barrier_wait(v_ready.at[pslot])
            my_turn()
            if c.compiled:
                def pv(ref):
                    plgpu.wgmma(ref, p16, v_smem.at[pslot])
                    pass_turn(last=True)
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            else:
                acc = acc + pv_dot(p16, pslot)
                pass_turn(last=True)
            plgpu.barrier_arrive(v_free.at[pslot])
            return acc, m, l

        def ov_run():
            if c.pingpong:  # warpgroup 0 issues first
                pl.when(wg == 1)(lambda: plgpu.barrier_arrive(token.at[0]))
            carry = lax.cond(nfull > 0, functools.partial(ov_first, masked=False),
                             functools.partial(ov_first, masked=True))
            start = jnp.maximum(nfull, 1)
            carry = lax.fori_loop(1, start, functools.partial(ov_step, masked=False), carry)
            carry = lax.fori_loop(start, nblocks, functools.partial(ov_step, masked=True), carry)
            return ov_last(carry)

        if c.overlap:
            acc, m, l = lax.cond(nblocks > 0, ov_run, lambda: (acc0, m0, l0))
        else:
            @pl.when(nblocks > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[0])
            pl.when(wg == 1)(rendezvous)
            carry = lax.fori_loop(0, nfull, functools.partial(step, masked=False), (acc0, m0, l0))
            acc, m, l = lax.fori_loop(nfull, nblocks, functools.partial(step, masked=True), carry)
            pl.when(wg == 0)(rendezvous)

        empty = l == 0.0
        inv = 1.0 / jnp.where(empty, 1.0, l)
        qo[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
        lse_smem.at[wg][...] = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))
        plgpu.commit_smem()
        if c.q_groups:  # out[splits, B, T, H, D] written in place (rows past T are clipped by TMA)
            for g in range(c.q_groups):
                plgpu.copy_smem_to_gmem(qo.at[pl.ds(g * Tt, Tt)],
                                        out_ref.at[split, n1, pl.ds(t0, Tt), n2 * c.q_groups + g])
        else:
            plgpu.copy_smem_to_gmem(qo, out_ref.at[split, n1, n2, pl.ds(row0, RW)])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[split, n1, n2, pl.ds(row0, RW)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(c.producer_regs, action="decrease")

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

            @pl.when(i < nfull)
            def _():
                plgpu.copy_gmem_to_smem(kv_slice(v_ref, start), v_smem.at[slot], v_ready.at[slot])

            @pl.when(i >= nfull)
            def _():
                # A masked block (the ragged last one, those holding new tokens): its value rows at
                # or past hi may hold anything (NaN included), and a probability of 0 times NaN is
                # NaN in the PV product. So those rows are zeroed here before the consumers are told
                # the block is ready.
                plgpu.copy_gmem_to_smem(kv_slice(v_ref, start), v_smem.at[slot], v_tail)
                plgpu.barrier_wait(v_tail)
                nvalid = hi - start
                for part in range(block_kv // 64):  # in WGMMA-shaped chunks of 64 rows
                    chunk = v_smem.at[slot, pl.ds(part * 64, 64)]
                    x = chunk[...]
                    if c.compiled:
                        x = lay(x, plgpu.Layout.WGMMA)
                    chunk[...] = jnp.where(iota((64, D), 0) + part * 64 < nvalid, x,
                                           jnp.zeros_like(x))
                plgpu.commit_smem()
                plgpu.barrier_arrive(v_ready.at[slot])

        # Observe the consumers' last hand-backs too, so that every barrier phase is consumed
        # when the kernel ends (the interpreter checks it; the hardware does not care).
        @pl.loop(jnp.maximum(nblocks - stages, 0), nblocks)
        def _(i):
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


_PROGRAM_OVERHEAD_BLOCKS = 3


def plan_splits(programs: int, max_len: int, bs: HopperBlockSizes) -> int:
    """Key ranges per stream. One program fills an SM (its shared memory), so the kernel runs
    in waves of ``SMs`` programs; its time goes as (waves) x (key blocks per program + a fixed
    cost of about ``_PROGRAM_OVERHEAD_BLOCKS`` blocks: pipeline fill, q load, output store,
    merge). Picks the fewest splits that minimise that, with ranges of at least two blocks
    (e.g. 8 splits for a B=64, P=1, L=16384 prefix at T=1 on 132 SMs, one for a 64 x 8k
    verification at T=64)."""
    if bs.splits is not None:
        return bs.splits
    sms = common.num_sms()
    blocks = cdiv(max_len, bs.block_kv)
    best, best_cost = 1, None
    for sp in range(1, max(1, blocks // 2) + 1):
        cost = cdiv(programs * sp, sms) * (cdiv(blocks, sp) + _PROGRAM_OVERHEAD_BLOCKS)
        if best_cost is None or cost < best_cost:
            best, best_cost = sp, cost
        if sp >= 32:
            break
    return best


def smem_bytes(bs: HopperBlockSizes, D: int, itemsize: int, has_mask: bool) -> int:
    """Estimated shared memory of the kernel (bytes). Each buffer is 1 KiB aligned; Mosaic GPU
    adds about 2 KiB of its own (barriers and the like). 192-key blocks or 3 stages of 128 at
    D=128 are just over the limit."""
    def kib(n):
        return round_up(n, 1024)
    rw = bs.rows_per_wg
    return (kib(CONSUMERS * rw * D * itemsize) + 2 * kib(bs.stages * bs.block_kv * D * itemsize)
            + kib(CONSUMERS * rw * 4) + 2304
            + (kib(CONSUMERS * rw * bs.block_kv * itemsize) if has_mask else 0))


def q_groups_in_place(G: int, bs: HopperBlockSizes) -> bool:
    """Whether ``rows_attention`` can read q[B, T, H, D] in place for G query heads per KV
    head: a warpgroup's rows are G boxes of ``rows_per_wg // G`` tokens, whole 8-row tiles."""
    return bs.rows_per_wg % G == 0 and (bs.rows_per_wg // G) % 8 == 0


def _bthd_tokens(T: int, G: int, bs: HopperBlockSizes) -> int:
    """T rounded up to whole programs of the BTHD layout (``2 * rows_per_wg // G`` tokens)."""
    per_program = CONSUMERS * (bs.rows_per_wg // G)
    return round_up(T, per_program)


def rows_attention(q_N1N2RD, k, v, lengths, *, kv_layout: str, sm_scale: float,
                   block_sizes: HopperBlockSizes | None = None, new_mask=None,
                   layer=None, num_new: int = 0, q_layout: str = "rows",
                   interpret: bool = False):
    """Partial attentions of the rows of each stream over each split of its keys.

    ``q_N1N2RD[N1, N2, R, D]`` (R a multiple of ``block_sizes.rows_per_program``), ``k``/``v``
    in ``kv_layout`` with the same N1, N2 (see module doc), ``lengths[N1]`` int32 in
    ``[0, L]``: stream ``n`` sees keys ``[0, lengths[n // N2])``.
    ``q_layout="BTHD"`` (G query heads per KV head such that ``q_groups_in_place``): q is
    ``[N1, T, H = N2 * G, D]`` and is read in place, as is the output written: a warpgroup's
    ``RW`` rows are the G heads x ``Tt = RW // G`` tokens ``(g, t)`` (row ``r`` of stream
    ``(n1, k)`` in tile ``i = r // RW`` is token ``i * Tt + r % Tt`` and head
    ``k * G + (r % RW) // Tt``), R rounds ``T * G`` up to whole programs, and the output is
    ``out[splits, N1, T, H, D]`` (``lse2`` stays per row). With ``kv_layout="BKSD"`` N1 is
    the batch (a verification's q[B, T, H, D]); with ``"PLKD"`` it is the prefix group and
    the "tokens" are all queries of the group (a shared prefix's q[B, T, H, D] viewed as
    ``[P, B/P x T, H, D]``, a free reshape).
    ``num_new = T_new > 0`` adds T_new keys after each length (the new tokens of a
    verification) under ``new_mask``, ``[N1, nb, R, block_kv]`` in q's dtype
    (``nb = ceil((block_kv - 1 + T_new) / block_kv)``): row ``r`` of stream ``n`` sees slot
    ``s >= lengths[n1] // block_kv * block_kv`` iff ``new_mask[n1, s // block_kv -
    lengths[n1] // block_kv, r, s % block_kv] == 0`` (it is ``-inf`` elsewhere) and
    ``s < lengths[n1] + T_new``. With ``q_layout="BTHD"`` the mask is per token,
    ``[N1, nb, T_run, block_kv]`` (T_run: T rounded up to whole programs), or None: causal,
    token t sees new token ``j <= T_new - T + t`` (computed in the kernel, no mask array).
    ``layer``, optional (an int or a traced int32 scalar): k/v are stacked ``[layers, ...]``
    caches and the kernel reads layer ``layer`` of them in place.
    Returns ``out[splits, N1, N2, R, D]`` (q's dtype) and ``lse2[splits, N1, N2, R]`` float32
    in base 2 (``-inf`` for an empty split); ``merge.merge_stacked`` combines the splits.
    """
    bs = block_sizes or HopperBlockSizes()
    RW = bs.rows_per_wg
    layered = layer is not None
    q_groups, T_q, pad_t = 0, 0, 0
    if q_layout == "BTHD":
        if kv_layout not in ("BKSD", "PLKD"):
            raise ValueError(f"unknown kv_layout {kv_layout!r}")
        B_q, T_q, H_q, D = q_N1N2RD.shape
        N1, N2 = B_q, k.shape[-3 if kv_layout == "BKSD" else -2]
        q_groups = H_q // N2
        if H_q % N2 or not q_groups_in_place(q_groups, bs):
            raise ValueError(f"q_layout='BTHD' needs H ({H_q}) = G x K ({N2}) with rows_per_wg "
                             f"({RW}) / G a multiple of 8")
        T_run = _bthd_tokens(T_q, q_groups, bs)
        R = T_run * q_groups
        # On the GPU, TMA zero-fills loads and clips stores past T; the interpreter refuses an
        # out-of-bounds copy (and a box must fit the array), so pad T there. Mosaic GPU's tiled
        # copies also need the token axis in whole 8-row tiles (T = 97 failed to lower).
        if interpret or T_q < RW // q_groups:
            pad_t = T_run - T_q
        elif T_q % 8:
            pad_t = -T_q % 8
        if pad_t:
            q_N1N2RD = jnp.pad(q_N1N2RD, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
    elif q_layout == "rows":
        N1, N2, R, D = q_N1N2RD.shape
    else:
        raise ValueError(f"unknown q_layout {q_layout!r}")
    kshape = k.shape[1:] if layered else k.shape
    if layered and k.ndim != 5:
        raise ValueError(f"with a layer, k/v must be stacked [layers, ...] caches, got {k.shape}")
    if R % bs.rows_per_program:
        raise ValueError(f"rows per stream must be a multiple of {bs.rows_per_program}, got {R}")
    if kv_layout == "PLKD":
        L = kshape[1]
        if kshape != (N1, L, N2, D):
            raise ValueError(f"k {k.shape} does not match q {q_N1N2RD.shape} in layout PLKD")
    elif kv_layout == "BKSD":
        L = kshape[2]
        if kshape != (N1, N2, L, D):
            raise ValueError(f"k {k.shape} does not match q {q_N1N2RD.shape} in layout BKSD")
    else:
        raise ValueError(f"unknown kv_layout {kv_layout!r}")
    if L % 8:  # Mosaic GPU's tiled TMA copies need the key axis in whole 8-row tiles
        raise ValueError(f"the key axis of k/v must be a multiple of 8 for the Hopper kernel, "
                         f"got {L}")
    if v.shape != k.shape or k.dtype != q_N1N2RD.dtype or v.dtype != k.dtype:
        raise ValueError("q, k and v must share one dtype and k, v one shape")
    if not supports(k.dtype, D):
        raise ValueError(f"the Hopper kernel takes bf16/f16 with D % 64 == 0, got {k.dtype}, D={D}")
    if lengths.shape != (N1,):
        per = "prefix group" if kv_layout == "PLKD" else "sequence"
        raise ValueError(f"lengths must be [{N1}] (one per {per}), got {lengths.shape}")
    num_new = int(num_new or 0)
    if kv_layout == "PLKD" and (num_new or new_mask is not None):
        raise ValueError("the shared-prefix layout PLKD has no new tokens (num_new / new_mask)")
    if new_mask is not None and not num_new:
        raise ValueError("a new_mask needs num_new > 0")
    if num_new and new_mask is None and not q_groups:
        raise ValueError("the rows layout needs a new_mask for num_new > 0 (causal without one "
                         "is for q_layout='BTHD')")
    if num_new and T_q > num_new:
        raise ValueError(f"{T_q} query tokens but only num_new={num_new} new tokens")
    if new_mask is not None:
        nb = cdiv(bs.block_kv - 1 + num_new, bs.block_kv)
        want = (N1, nb, R // q_groups if q_groups else R, bs.block_kv)
        if new_mask.shape != want or new_mask.dtype != q_N1N2RD.dtype:
            raise ValueError(f"new_mask must be {want} {q_N1N2RD.dtype}, got "
                             f"{new_mask.shape} {new_mask.dtype}")
    smem = smem_bytes(bs, D, jnp.dtype(k.dtype).itemsize, new_mask is not None)
    if smem > SMEM_BYTES:
        raise ValueError(f"block_kv={bs.block_kv} x stages={bs.stages} at D={D} needs about "
                         f"{smem} bytes of shared memory; an H100/H200 block has {SMEM_BYTES}")
    r_tiles = R // bs.rows_per_program
    splits = plan_splits(r_tiles * N1 * N2, L, bs)
    stages = bs.stages
    dtype = q_N1N2RD.dtype
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    has_mask = new_mask is not None
    scratch = (
        plgpu.SMEM((CONSUMERS, RW, D), dtype, transforms=tiled),
        plgpu.SMEM((stages, bs.block_kv, D), dtype, transforms=tiled),
        plgpu.SMEM((stages, bs.block_kv, D), dtype, transforms=tiled),
        plgpu.SMEM((CONSUMERS, RW), jnp.float32),
        *((plgpu.SMEM((CONSUMERS, RW, bs.block_kv), dtype, transforms=tiled),)  # mask tiles
          if has_mask else ()),
        plgpu.Barrier(num_barriers=stages),                          # k_ready
        plgpu.Barrier(num_barriers=stages),                          # v_ready
        plgpu.Barrier(num_arrivals=max(q_groups, 1), num_barriers=CONSUMERS),  # q_ready
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # k_free
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # v_free
        plgpu.Barrier(num_arrivals=CONSUMERS),  # turn: the consumers' turn on the tensor cores
        plgpu.Barrier(),                                             # v_tail
        *((plgpu.Barrier(num_arrivals=max(q_groups, 1), num_barriers=CONSUMERS),)  # mask_ready
          if has_mask else ()),
        plgpu.Barrier(num_barriers=CONSUMERS),  # token: whose turn to issue (overlap)
    )
    static = HopperStatic(
        kv_layout=kv_layout, layered=layered, N2=N2, splits=splits, block_kv=bs.block_kv,
        stages=stages, scale_log2=float(sm_scale) * LOG2E, dtype=dtype, D=D, rows_per_wg=RW,
        pingpong=bs.pingpong, overlap=bs.use_overlap, num_new=num_new, q_groups=q_groups,
        q_tokens=T_q, mask_tiles=has_mask, compiled=not interpret,
        consumer_regs=bs.consumer_registers, producer_regs=bs.producer_registers)
    body = functools.partial(_kernel, c=static)
    kw = {}
    if interpret:  # the Mosaic GPU interpreter (threads, barriers, TMA and wgmma simulated on CPU)
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        kw["interpret"] = InterpretGPUParams()
    if interpret and L % bs.block_kv:
        # A ragged last block may run past the key axis: TMA fills those rows with zeros on the
        # GPU, but the interpreter refuses an out-of-bounds copy, so pad the axis here.
        ax = (1 if kv_layout == "PLKD" else 2) + int(layered)
        widths = [(0, 0)] * k.ndim
        widths[ax] = (0, round_up(L, bs.block_kv) - L)
        k, v = jnp.pad(k, widths), jnp.pad(v, widths)
    layer_arr = layer_operand(layer)
    lengths = lengths.astype(jnp.int32)
    if bs.longest_first and N1 > 1:
        order = jnp.argsort(-lengths, stable=True).astype(jnp.int32)
    else:
        order = jnp.arange(N1, dtype=jnp.int32)
    args = (lengths, order, layer_arr, q_N1N2RD, k, v)
    if new_mask is not None:
        args += (new_mask,)
    out_shape = ((splits, N1, T_q + pad_t, N2 * q_groups, D) if q_groups
                 else (splits, N1, N2, R, D))
    out, lse2 = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(out_shape, dtype),
                  jax.ShapeDtypeStruct((splits, N1, N2, R), jnp.float32)),
        scratch_types=scratch,
        # Mosaic GPU launches the last grid axis fastest: the row tiles of one stream run
        # side by side and share its K/V through L2.
        grid=(N1 * N2, splits, r_tiles),
        grid_names=("n", "s", "r"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **kw,
    )(*args)
    if pad_t:
        out = out[:, :, :T_q]
    return out, lse2


def _bthd_lse(lse2, T: int, G: int, Tt: int):
    """``rows_attention``'s per-row ``lse2[S, B, K, R]`` of the BTHD layout (rows ``(tile, g,
    t)``) as ``[S, B, T, K * G]``."""
    S, B, K, R = lse2.shape
    x = lse2.reshape(S, B, K, R // (G * Tt), G, Tt).transpose(0, 1, 3, 5, 2, 4)
    return x.reshape(S, B, R // G, K * G)[:, :, :T]


def attention(q_N1N2RD, k, v, lengths, *, kv_layout: str, sm_scale: float,
              block_sizes: HopperBlockSizes | None = None, new_mask=None, num_new: int = 0,
              layer=None, q_layout: str = "rows", interpret: bool = False, out_dtype=None,
              merge: bool = True):
    """Attention of each stream's rows over all of ``[0, length)`` (and the new tokens, see
    ``rows_attention``): the splits merged by log-sum-exp. Returns ``(out[N1, N2, R, D],
    lse[N1, N2, R] float32, natural log)``; with ``q_layout="BTHD"``, ``(out[N1, T, H, D],
    lse[N1, T, H])``: for ``kv_layout="BKSD"`` N1 = B, and for ``"PLKD"`` N1 = P with the
    group's queries as tokens (q viewed as ``[P, B/P x T, H, D]``). With ``merge=False`` the
    key splits come back unmerged, stacked on a leading axis (``out[splits, ...]`` in q's
    dtype, ``lse[splits, ...]`` natural log), for a caller that merges them together with
    other partial attentions in one pass (``merge.merge_stacked``)."""
    o, lse2 = rows_attention(q_N1N2RD, k, v, lengths, kv_layout=kv_layout, sm_scale=sm_scale,
                             block_sizes=block_sizes, new_mask=new_mask, num_new=num_new,
                             layer=layer, q_layout=q_layout, interpret=interpret)
    if q_layout == "BTHD":
        G = q_N1N2RD.shape[2] // k.shape[-3 if kv_layout == "BKSD" else -2]
        RW = (block_sizes or HopperBlockSizes()).rows_per_wg
        lse2 = _bthd_lse(lse2, q_N1N2RD.shape[1], G, RW // G)
    if not merge:
        return o, lse2 * LN2
    out_dtype = out_dtype or q_N1N2RD.dtype
    if o.shape[0] == 1:
        return o[0].astype(out_dtype), lse2[0] * LN2
    return merge_stacked(o, lse2 * LN2, axis=0, out_dtype=out_dtype)


def new_token_mask(lengths, tree_mask, *, T: int, T_new: int, G: int, rows: int,
                   block_kv: int, dtype):
    """The new-token mask tiles of ``rows_attention`` for a verification: ``[B, nb, rows,
    block_kv]``, 0 where a row sees a slot and -inf where not. Rows are ``(t, g)`` pairs
    (``t * G + g``; rows past ``T * G`` are padding and see the context only); ``G=1`` gives
    the per-token mask of ``q_layout="BTHD"``. Query ``t`` is new token ``T_new - T + t``; it
    sees new token ``j`` iff ``tree_mask[(b,) t, j]`` (None: causal, ``j <= T_new - T + t``),
    and every context slot."""
    B = lengths.shape[0]
    nb = cdiv(block_kv - 1 + T_new, block_kv)
    base = lengths // block_kv * block_kv                                    # [B]
    j = (base[:, None] + jnp.arange(nb * block_kv, dtype=jnp.int32)[None]
         - lengths[:, None])                                                 # [B, nb*bkv]
    if tree_mask is None:
        tq = jnp.arange(T)[:, None] + (T_new - T)
        tm = (jnp.arange(T_new)[None, :] <= tq)[None]                          # [1, T, T_new]
    else:
        tm = jnp.asarray(tree_mask, bool).reshape((-1, T, T_new))
    jj = jnp.clip(j, 0, T_new - 1)
    new_vis = jnp.take_along_axis(jnp.broadcast_to(tm, (B, T, T_new)),
                                  jnp.broadcast_to(jj[:, None, :], (B, T, jj.shape[1])), axis=2)
    vis = (j[:, None, :] < 0) | ((j[:, None, :] < T_new) & new_vis)          # [B, T, nb*bkv]
    vis = jnp.repeat(vis, G, axis=1)                                         # rows (t, g)
    vis = jnp.pad(vis, ((0, 0), (0, rows - T * G), (0, 0)))
    vis = vis | ((jnp.arange(rows) >= T * G)[None, :, None] & (j[:, None, :] < 0))
    bias = jnp.where(vis, 0.0, -jnp.inf).astype(dtype)
    return bias.reshape(B, rows, nb, block_kv).transpose(0, 2, 1, 3)


def verify_attention(q, k_cache, v_cache, lengths, tree_mask=None, *, layer=None,
                     sm_scale: float, num_new: int | None = None,
                     block_sizes: HopperBlockSizes | None = None,
                     q_in_place: bool | None = None, interpret: bool = False):
    """``decode_attention``'s contract (see decode_attention.py) through the Hopper kernel, for
    many query rows per KV head (long verification blocks, token trees).

    One kernel pass per (sequence, KV head, row tile): the T x G query rows as one matrix
    against the context in whole blocks, then the few blocks holding the T_new new tokens
    (slots ``lengths[b] + [0, T_new)``) under the causal or tree mask, given as per-block
    mask tiles (``new_token_mask``). Where G allows (``q_groups_in_place``: G in {1, 2, 4, 8}
    at 64-row warpgroups) the kernel reads q and writes out in place (``q_layout="BTHD"``);
    otherwise, or with ``q_in_place=False``, q goes in as transposed rows [B, K, T x G, D]
    and out comes back the same way (two transposes of q's size). Returns
    ``(out[B, T, H, D], lse[B, T, H])``.
    """
    bs = block_sizes or HopperBlockSizes()
    B, T, H, D = q.shape
    K = k_cache.shape[-3]
    G = H // K
    T_new = T if num_new is None else int(num_new)
    if tree_mask is not None:
        T_new = tree_mask.shape[-1]
    lengths = lengths.astype(jnp.int32)
    if q_in_place is None:
        q_in_place = q_groups_in_place(G, bs)
    if q_in_place:  # q and out read and written in place, no transposes
        # causal: computed in the kernel; a tree: one mask row per token (its G heads share it)
        mask = None if tree_mask is None else new_token_mask(
            lengths, tree_mask, T=T, T_new=T_new, G=1, rows=_bthd_tokens(T, G, bs),
            block_kv=bs.block_kv, dtype=q.dtype)
        return attention(q, k_cache, v_cache, lengths, kv_layout="BKSD", sm_scale=sm_scale,
                         block_sizes=bs, new_mask=mask, num_new=T_new, layer=layer,
                         q_layout="BTHD", interpret=interpret)
    rows_pad = round_up(T * G, bs.rows_per_program)
    qr = pad_rows(tokens_to_rows(q, K), rows_pad)                 # rows r = t * G + g
    mask = new_token_mask(lengths, tree_mask, T=T, T_new=T_new, G=G, rows=rows_pad,
                          block_kv=bs.block_kv, dtype=q.dtype)
    o, lse = attention(qr, k_cache, v_cache, lengths, kv_layout="BKSD", sm_scale=sm_scale,
                       block_sizes=bs, new_mask=mask, num_new=T_new, layer=layer,
                       interpret=interpret)
    return rows_to_tokens(o, lse, B, T, G)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret",
                                             "partials"))
def prefix_attention(q, k_prefix, v_prefix, lengths, layer, *, sm_scale, block_sizes,
                     interpret, partials=False):
    """``prefix_attention``'s contract (see prefix_attention.py) through the Hopper kernel, on
    checked arguments (``lengths[P]`` int32): the rows of each (group, KV head) as one matrix
    against its prefix (a stacked layer read in place), key splits merged by log-sum-exp
    (``attention``), or with ``partials`` returned unmerged on a leading axis. Where G allows
    (``q_groups_in_place``: G in {1, 2, 4, 8} at 64-row warpgroups, {1, 2, 4, 8, 16} at
    128-row ones) the kernel reads q and writes out in place, q[B, T, H, D] viewed as
    [P, B/P x T, H, D] (no transposes); other G go through transposed rows."""
    B, T, H, D = q.shape
    P, L, K, _ = k_prefix.shape[-4:]
    G, Bg = H // K, B // P
    lengths = jnp.clip(lengths, 0, L)
    kw = dict(kv_layout="PLKD", sm_scale=sm_scale, block_sizes=block_sizes, layer=layer,
              interpret=interpret, merge=not partials)
    if q_groups_in_place(G, block_sizes):
        o, lse = attention(q.reshape(P, Bg * T, H, D), k_prefix, v_prefix, lengths,
                           q_layout="BTHD", **kw)
        lead = o.shape[:1] if partials else ()
        return o.reshape(lead + (B, T, H, D)), lse.reshape(lead + (B, T, H))
    rows = Bg * T * G
    rows_pad = round_up(rows, block_sizes.rows_per_program)
    q_PKRD = tokens_to_rows(q, K, groups=P)
    if rows_pad != rows:
        q_PKRD = pad_rows(q_PKRD, rows_pad)
    o, lse = attention(q_PKRD, k_prefix, v_prefix, lengths, **kw)
    if not partials:  # one "split" axis of 1 for the shared reshapes below
        o, lse = o[None], lse[None]
    o, lse = rows_to_tokens(o, lse, B, T, G, grouped=True)
    return (o, lse) if partials else (o[0], lse[0])
