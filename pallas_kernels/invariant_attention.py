"""Batch-invariant attention (Pallas, Triton lowering on GPUs): each query row reduces over its
keys in blocks of ``block_k`` *absolute key positions*, in increasing order, with an online
softmax in float32, so its result does not depend on T (a decode step or a verification), the
batch, the cache capacity or which other rows share its tile.

A program owns a tile of ``block_rows`` query rows of one sequence and KV head and streams the
key blocks ``[i * block_k, (i + 1) * block_k)`` that any of its rows sees. Position ``s`` of row
r's keys lives at cache slot ``s`` below the sequence's context length ``L`` and at slot
``L + anc[s - L]`` from there on, where ``anc`` is the tile's map from depth to new token: the
identity for causal tiles (decode, verification of a chain, prefill), a token-tree node's
ancestors for tree tiles (one node per tile, so all rows of a tile read the same slots). So a
tree node reads its ancestors in the order a one-token step reads them once they are committed
to consecutive slots. Keys a row does not see get probability exactly 0; blocks past a row's
keys leave its state exactly as it was. Per block: ``s = q @ k.T`` and ``acc += p @ v`` as
fixed-shape products (``[block_rows, D] x [D, block_k]``, ``[block_rows, block_k] x
[block_k, D]``), whose rows are independent of each other.

The keys are cut into parts of ``chunk`` absolute positions ``[c * chunk, (c + 1) * chunk)``;
each part's blocks run from a fresh state, and the parts' states are folded into the row's in
increasing order (`_fold`: a part the row sees nothing of leaves it exactly as it was). Two
ways run that arithmetic: ``"fold"``, a program per tile (or per group of ``fold_tiles``
causal tiles, which share their key loads: prefill) folding its parts as it goes, and
``"split"``, a program per (tile, part) writing its state and a merge kernel folding them
(decode: a program per sequence and KV head alone would stream a long cache too slowly). The
per-part code and the fold are the same functions in every kernel, so the two give the same
bits (checked in the interpreter and on an H200); ``"auto"`` splits while the tiles are few.

Two options change the speed, and one of them the bits (`InvariantAttentionBlocks`):
``unmasked_interior`` runs the key blocks that every real row of a program sees whole without
the masks (the same bits on a GPU), and ``fast_exp`` takes exponentials in base 2, with one
``ex2.approx`` each on NVIDIA GPUs (bits of their own, the same in every kernel and call). Both
are on by default, with 2 tiles per program of a split verification. The default tiling,
blocks of 128 keys in parts of 4096 (`blocks_for` halves the block where its pipeline stages
would not fit in shared memory: head dims above 128 in bf16, above 64 in float32), streams a
decode step's cache as fast as the default kernel: on an H200 (B = 64, 16k context, random
Qwen2.5-1.5B weights, 28 layers) the step's attention kernels took 6.85 ms against the default
kernel's 6.78 ms (blocks of 64 in parts of 2048: 7.38 ms), and the invariant step 1.02-1.04x
the default step at 8k-32k (`benchmarks/invariant_h200.md`).

`jaxspec.invariant.attention` prepares the tiles (`invariant_attention`) and holds the `jnp`
statement of the same order used on the CPU.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import triton_core as core
from .common import LOG2E, is_nvidia

try:  # Triton-specific compiler parameters
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - a jax without the Triton backend
    pltriton = None

FAR = 2 ** 30  # the window start of a padding row: it sees nothing


@dataclasses.dataclass(frozen=True)
class InvariantAttentionBlocks:
    """Tile sizes (fixed: never chosen from T, B or the cache size). ``chunk``: keys per part
    (absolute positions ``[c * chunk, (c + 1) * chunk)``), a multiple of ``block_k``.
    ``fold_tiles`` / ``split_tiles`` only group tiles into programs: they do not change the
    bits."""

    block_rows: int = 16
    block_k: int = 128  # halved (down to 16) where its K/V stages would not fit (`blocks_for`)
    chunk: int = 4096
    num_warps: int = 4
    num_stages: int = 2
    # tiles per program (rounded up to a power of two) when folding tiles that read the same
    # slots, and in split mode (a verification's tiles)
    fold_tiles: int = 4
    split_tiles: int = 2
    # key blocks every real row of a program sees whole skip the masking, which there selects
    # every score and value (on a GPU the same bits, `tests/test_invariant_kernels.py`'s GPU
    # test; not in the interpreter, where XLA:CPU rounds ``exp`` differently with and without
    # the select fused after it, so it masks every block there)
    unmasked_interior: bool = True
    # exponentials in base 2 (the state's maxima in base-2 units); on NVIDIA GPUs one
    # ``ex2.approx.ftz.f32`` each (libdevice's ``expf`` elsewhere and in the interpreter is
    # ``exp2``): other bits than base e, the same in every kernel and call
    fast_exp: bool = True


DEFAULT_BLOCKS = InvariantAttentionBlocks()
# tests only: the interpreter runs unmasked interior blocks too (results close, not bitwise;
# read when a call is traced, so a test sets it with blocks no other call traced)
INTERPRET_INTERIOR = False
SPLIT_BELOW = 264  # mode "auto": a program per part while there are fewer tiles than this


def supports(head_dim: int) -> bool:
    """Whether the kernel takes this head dim (a power of two, at least 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def blocks_for(head_dim: int, dtype, blocks: InvariantAttentionBlocks | None = None):
    """The tiling a kernel of this head dim and cache dtype runs: ``block_k`` halved (down to 16)
    while its K/V pipeline stages and the query tile would not fit in shared memory. It depends
    on the model only (never on T, B or the cache size), so every call of a decoding runs the same
    blocks."""
    bs = DEFAULT_BLOCKS if blocks is None else blocks
    bk = core.fit_block_k(bs.block_k, bs.block_rows, head_dim, jnp.dtype(dtype).itemsize,
                          bs.num_stages)
    return bs if bk == bs.block_k else dataclasses.replace(bs, block_k=bk)


def reads_pages(page_size: int, head_dim: int, dtype,
                blocks: InvariantAttentionBlocks | None = None) -> bool:
    """Whether the kernel reads a block pool of this page size through its table: its key block
    (`blocks_for`) divides the page size or is a multiple of it."""
    bk = blocks_for(head_dim, dtype, blocks).block_k
    return page_size % bk == 0 or bk % page_size == 0


def _tile_blocks(pos, lo, block_k: int):
    """The key blocks ``[first, last)`` holding every key some row of the tiles sees."""
    return jnp.maximum(jnp.min(lo), 0) // block_k, (jnp.max(pos) + block_k) // block_k


def _exp(base2: bool, hw: bool):
    """The kernels' exponential: ``exp``, or ``2 ** x`` (``hw``: one ``ex2.approx`` each)."""
    if not base2:
        return jnp.exp
    if hw:
        return functools.partial(core.exp2, fast=True)
    return jnp.exp2


def _part(qs, poss, los, L, anc_ref, tab_ref, k_ref, v_ref, layer, b, h, i0, i1, *, block_k: int,
          sm_scale: float, num_new: int, num_slots: int, contiguous: bool, exp, interior: bool,
          pages: tuple[int, int, int] | None, sc_ref=None, score_keys: int = 0):
    """The online softmax of each tile in ``qs`` (tiles whose rows read the same slots) over key
    blocks ``[i0, i1)`` from a fresh state: per tile ``(max [R], sum [R], acc [R, D])``, float32
    (``sm_scale`` folds log2(e) in where ``exp`` is base 2). A key block is loaded once for all
    of them; each tile's arithmetic is that of a tile alone. ``contiguous``: position ``s`` is
    slot ``s`` (causal tiles: ``anc`` is the identity), so a block is one contiguous load; else
    each key's slot is looked up (a gather: per-element addresses, 64-bit ones once the stacked
    cache passes 2**31 elements, several times slower). The values loaded are the same either
    way, and so are the bits. ``interior``: the blocks that every real row (``pos >= 0``) sees
    whole run without the masks, which there select every score and value: the same bits.
    ``pages``: ``(page_size, max_blocks, num_blocks)`` of a block pool ``[L, NB, K, BS, D]``
    read through ``tab_ref [B, MB]`` (slot ``s`` of row b: block ``tab[b, s // BS]``, offset
    ``s % BS``); the same values are loaded, so the same bits. ``sc_ref [S / score_keys]``: the
    largest logit of each group of ``score_keys`` context keys (a divisor of ``block_k``) over
    the real rows of the tiles (in the kernel's units: ``sm_scale``'s), stored as its block is
    read, one number per group (`invariant_attention`'s ``key_scores``)."""
    R, D = qs[0].shape
    f32 = qs[0].dtype == jnp.float32
    prec = lax.Precision.HIGHEST if f32 else None

    def one(q, pos, lo, s_abs, k, v, carry, masked, ctx=None):
        m_run, l_run, acc = carry
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32) * sm_scale
        if ctx is not None:  # per group of score_keys context keys: its largest logit over
            # the tile's real rows (a row's maximum first, as the softmax reduces, then the rows')
            sel = jnp.where((pos >= 0)[:, None] & ctx[None, :], s, -jnp.inf)  # [R, N]
            groups = block_k // score_keys
            if groups == 1:
                best = [jnp.max(jnp.max(sel, axis=1), keepdims=True)]
            else:
                grp = lax.div(jnp.arange(block_k, dtype=jnp.int32), score_keys)
                best = [jnp.max(jnp.max(jnp.where((grp == j)[None, :], sel, -jnp.inf), axis=1),
                                keepdims=True) for j in range(groups)]
        if masked:
            ok = (s_abs[None, :] <= pos[:, None]) & (s_abs[None, :] >= lo[:, None])  # [R, N]
            s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m_run, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new > -jnp.inf, m_new, 0.0)
        p = exp(s - m_safe[:, None])
        if masked:
            p = jnp.where(ok, p, 0.0)
            seen = jnp.max(ok.astype(jnp.int32), axis=0) > 0  # [N]: some row sees the key
            v = jnp.where(seen[:, None], v, jnp.zeros_like(v))  # no NaN garbage into p @ v
        scale = jnp.where(m_run > -jnp.inf, exp(m_run - m_safe), 0.0)
        l_run = l_run * scale + jnp.sum(p, axis=1)
        pv = jnp.dot(p.astype(v.dtype), v, precision=prec, preferred_element_type=jnp.float32)
        if ctx is not None:
            return (m_new, l_run, acc * scale[:, None] + pv), best
        return m_new, l_run, acc * scale[:, None] + pv

    def body(masked):
        def run(i, carry):
            s_abs = i * block_k + jnp.arange(block_k, dtype=jnp.int32)
            if contiguous:  # keys past a row's position are masked below, whatever slots hold
                start = pl.multiple_of(i * block_k, block_k)
                if pages is None:
                    idx = (layer, b, h, pl.ds(start, block_k), slice(None))
                else:  # part of one page (a contiguous load) or whole pages (their rows)
                    idx = core.page_tile_index(tab_ref, b, start, block_k, page_size=pages[0],
                                               max_blocks=pages[1], num_blocks=pages[2],
                                               head=h, head_lanes=D, layer=layer)
            else:
                rel = s_abs - L
                a = anc_ref[jnp.clip(rel, 0, num_new - 1)]  # [N]: the new token at each depth
                slot = jnp.clip(jnp.where(rel < 0, s_abs, L + a), 0, num_slots - 1)
                if pages is None:
                    idx = (layer, b, h, slot, slice(None))
                else:  # each key's block and offset (integer arrays index every axis)
                    BS, MB, NB = pages
                    j = jnp.minimum(lax.div(slot, BS), MB - 1)[:, None]  # [N, 1]
                    blk = jnp.clip(tab_ref[b, j], 0, NB - 1)
                    idx = (layer, blk, h, slot[:, None] - j * BS,
                           jnp.arange(D, dtype=jnp.int32)[None, :])
            k = k_ref[idx]  # [N, D]
            v = v_ref[idx]
            if sc_ref is None:
                return tuple(one(q, pos, lo, s_abs, k, v, c, masked)
                             for q, pos, lo, c in zip(qs, poss, los, carry))
            out, best = [], None
            for q, pos, lo, c in zip(qs, poss, los, carry):
                st, sc = one(q, pos, lo, s_abs, k, v, c, masked, ctx=s_abs < L)
                out.append(st)
                best = sc if best is None else [jnp.maximum(x, y) for x, y in zip(best, sc)]
            n = block_k // score_keys
            for j, x in enumerate(best):
                sc_ref[pl.ds(i * n + j, 1)] = x
            return tuple(out)
        return run

    state = tuple(_fresh(R, D) for _ in qs)
    if not interior:
        return lax.fori_loop(i0, i1, body(True), state)
    # [a, e): the blocks whose keys every real row sees (a padding row: pos -1)
    big = jnp.int32(2 ** 30)
    first_all = functools.reduce(jnp.maximum, [
        jnp.max(jnp.where(pos >= 0, jnp.maximum(lo, 0), 0)) for pos, lo in zip(poss, los)])
    last_all = functools.reduce(jnp.minimum, [
        jnp.min(jnp.where(pos >= 0, pos, big)) for pos in poss])
    a = jnp.clip((first_all + block_k - 1) // block_k, i0, i1)
    e = jnp.clip((last_all + 1) // block_k, a, i1)
    state = lax.fori_loop(i0, a, body(True), state)
    state = lax.fori_loop(a, e, body(False), state)
    return lax.fori_loop(e, i1, body(True), state)


def _fold(state, part, exp=jnp.exp):
    """``state`` followed by the next part's ``(max, sum, acc)``: the running max is kept or
    replaced, the other side scaled by ``exp(difference)``; a part a row sees nothing of leaves
    the row's state exactly as it was. Written with one product per sum, so every kernel that
    folds computes the same bits."""
    M, Ls, A = state
    m, l, a = part
    m_new = jnp.maximum(M, m)
    m_safe = jnp.where(m_new > -jnp.inf, m_new, 0.0)
    keep = M >= m
    sa = exp(M - m_safe)
    sc = exp(m - m_safe)
    L_new = jnp.where(keep, Ls + l * sc, Ls * sa + l)
    A_new = jnp.where(keep[:, None], A + a * sc[:, None], A * sa[:, None] + a)
    empty = m == -jnp.inf
    return (jnp.where(empty, M, m_new), jnp.where(empty, Ls, L_new),
            jnp.where(empty[:, None], A, A_new))


def _finish(state):
    _, Ls, A = state
    return A / jnp.where(Ls > 0, Ls, 1.0)[:, None]


def _group(q_ref, pos_ref, lo_ref):
    """A group of tiles' queries, positions and window starts, one tuple entry per tile."""
    P = q_ref.shape[0]
    return (tuple(q_ref[j] for j in range(P)), tuple(pos_ref[j] for j in range(P)),
            tuple(lo_ref[j] for j in range(P)))


def _fresh(R, D):
    return (jnp.full((R,), -jnp.inf, jnp.float32), jnp.zeros((R,), jnp.float32),
            jnp.zeros((R, D), jnp.float32))


def _fold_kernel(layer_ref, len_ref, q_ref, pos_ref, lo_ref, anc_ref, tab_ref, k_ref, v_ref, *refs,
                 block_k: int, chunk: int, scores: bool, **kw):
    """A program per group of tiles (``q_ref [P, R, D]``, rows reading the same slots): their
    parts in increasing order, each folded in as it is done."""
    o_ref, sc_ref = (refs[1], refs[2]) if scores else (refs[0], None)  # (scores: init, o, out)
    h, b = pl.program_id(1), pl.program_id(2)
    qs, poss, los = _group(q_ref, pos_ref, lo_ref)
    first, last = _tile_blocks(pos_ref[...], lo_ref[...], block_k)
    cb = chunk // block_k
    R, D = qs[0].shape

    def over(c, states):
        parts = _part(qs, poss, los, len_ref[b], anc_ref, tab_ref, k_ref, v_ref, layer_ref[0],
                      b, h, jnp.maximum(c * cb, first), jnp.minimum((c + 1) * cb, last),
                      block_k=block_k, sc_ref=sc_ref, **kw)
        return tuple(_fold(st, pt, kw["exp"]) for st, pt in zip(states, parts))

    states = lax.fori_loop(first // cb, (last + cb - 1) // cb, over,
                           tuple(_fresh(R, D) for _ in qs))
    for j, st in enumerate(states):
        o_ref[j] = _finish(st).astype(o_ref.dtype)


def _split_kernel(layer_ref, len_ref, q_ref, pos_ref, lo_ref, anc_ref, tab_ref, k_ref, v_ref,
                  *refs, block_k: int, chunk: int, scores: bool, **kw):
    """A program per (group of tiles, part): each tile's state of the part, written out for
    `_merge_kernel`."""
    m_ref, l_ref, a_ref = refs[-4:-1] if scores else refs  # (scores: init, m, l, a, out)
    sc_ref = refs[-1] if scores else None
    c, h, b = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    if q_ref.ndim == 2:  # one tile: [R, D]
        qs, poss, los = (q_ref[...],), (pos_ref[...],), (lo_ref[...],)
        first, last = _tile_blocks(poss[0], los[0], block_k)
    else:  # [P, R, D]
        qs, poss, los = _group(q_ref, pos_ref, lo_ref)
        first, last = _tile_blocks(pos_ref[...], lo_ref[...], block_k)
    cb = chunk // block_k
    parts = _part(qs, poss, los, len_ref[b], anc_ref, tab_ref, k_ref, v_ref, layer_ref[0], b, h,
                  jnp.maximum(c * cb, first), jnp.minimum((c + 1) * cb, last),
                  block_k=block_k, sc_ref=sc_ref, **kw)
    if q_ref.ndim == 2:
        m_ref[...], l_ref[...], a_ref[...] = parts[0]
    else:
        for j, (m, l, a) in enumerate(parts):
            m_ref[j], l_ref[j], a_ref[j] = m, l, a


def _merge_kernel(m_ref, l_ref, a_ref, o_ref, *, parts: int, exp):
    """A program per tile: `_split_kernel`'s parts folded in increasing order."""
    R, D = o_ref.shape

    def over(c, state):
        return _fold(state, (m_ref[c, :], l_ref[c, :], a_ref[c, :, :]), exp)

    o_ref[...] = _finish(lax.fori_loop(0, parts, over, _fresh(R, D))).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret", "mode",
                                             "same_slots", "key_scores"))
def invariant_attention(q_BKNRD, pos_BNR, lo_BNR, anc_BNJ, lengths_B, k_LBKSD, v_LBKSD, layer,
                        *, sm_scale: float, block_sizes: InvariantAttentionBlocks | None = None,
                        interpret: bool = False, mode: str = "auto", same_slots: bool = False,
                        block_table=None, key_scores: int = 0):
    """Attention of query tiles ``q[B, K, NT, R, D]`` (R = ``block_rows``) over the stacked cache
    ``[L, B, K, S, D]`` at ``layer``. ``pos``/``lo`` ``[B, NT, R]``: each row's last and first
    visible key positions (padding rows: -1 and `FAR`); ``anc[B, NT, J]``: each tile's new token
    of depth d (J = the new tokens); ``lengths[B]``: the context before the new tokens. Returns
    ``[B, K, NT, R, D]`` in q's dtype (module docstring). ``mode``: ``"fold"`` (a program per
    tile folds its parts), ``"split"`` (a program per tile and part, then a merge) or ``"auto"``
    (split while the tiles are few); the same bits either way. ``same_slots``: every tile of a
    sequence has the same ``anc`` (causal tiles), so a program may take ``fold_tiles`` /
    ``split_tiles`` of them. ``block_table [B, MB]``: K/V are block pools ``[L, NB, K, BS, D]``
    and row b's slot ``s`` lives in block ``block_table[b, s // BS]`` at offset ``s % BS``
    (entries past a row's keys may hold anything: they are clamped into the pool and their keys
    masked); the kernel reads the pool through the table, with the bits of a dense cache that
    holds the same slots. ``block_k`` must divide BS or be a multiple of it (`reads_pages`).
    ``key_scores`` (n > 0, a divisor of the tiling's ``block_k``): ``(out, scores [B, K, NG,
    cdiv(S, n)])`` (NG: the programs' groups of tiles), with ``scores[b, h, g, j]`` the largest
    logit of the context keys ``s < lengths[b]`` of ``[j * n, (j + 1) * n)`` (in the kernel's
    units: ``q . k * sm_scale``, times log2(e) with ``fast_exp``) over the real rows of group g
    of the sequence's tiles, ``-inf`` where there is none (a maximum is exact: per row
    independent of the batch), written as the attention reads the keys: the block scores of a
    retrieving self-draft without a pass of their own. The same output bits."""
    B, K, NT, R, D = q_BKNRD.shape
    bs = blocks_for(D, k_LBKSD.dtype, block_sizes)
    J = anc_BNJ.shape[-1]
    if block_table is None:
        S, pages = k_LBKSD.shape[3], None
        table = jnp.zeros((1, 1), jnp.int32)
    else:
        NB, BS = k_LBKSD.shape[1], k_LBKSD.shape[3]
        MB = block_table.shape[1]
        if block_table.shape[0] != B or not reads_pages(BS, D, k_LBKSD.dtype, block_sizes):
            raise ValueError(f"invariant_attention: a block table [{B}, MB] whose page size "
                             f"{BS} divides or is a multiple of block_k {bs.block_k}, got "
                             f"table {block_table.shape}")
        S, pages = MB * BS, (BS, MB, NB)
        table = block_table.astype(jnp.int32)
    if R != bs.block_rows or not supports(D) or bs.chunk % bs.block_k:
        raise ValueError(f"invariant_attention: tiles of {R} rows (want {bs.block_rows}), head "
                         f"dim {D} (a power of two >= 16), chunk {bs.chunk} (a multiple of "
                         f"block_k {bs.block_k})")
    if key_scores and bs.block_k % int(key_scores):
        raise ValueError(f"invariant_attention: key_scores {key_scores} must divide block_k "
                         f"{bs.block_k}")
    if mode not in ("auto", "fold", "split"):
        raise ValueError(f"invariant_attention: mode {mode!r}")
    parts = -(-S // bs.chunk)  # positions < S: every part a row can see
    split = mode == "split" or (mode == "auto" and B * K * NT < SPLIT_BELOW and parts > 1)
    compiler_params = None
    if not interpret and pltriton is not None:
        compiler_params = pltriton.CompilerParams(num_warps=bs.num_warps,
                                                  num_stages=bs.num_stages)

    def full(shape):
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    # causal tiles read slot s for position s: contiguous blocks (whole blocks inside the cache)
    exp = _exp(bs.fast_exp, bs.fast_exp and not interpret and is_nvidia())
    scale = float(sm_scale) * (LOG2E if bs.fast_exp else 1.0)
    kw = dict(block_k=bs.block_k, chunk=bs.chunk, sm_scale=scale, num_new=J, num_slots=S,
              contiguous=bool(same_slots) and S % bs.block_k == 0, exp=exp,
              interior=bool(bs.unmasked_interior) and (not interpret or INTERPRET_INTERIOR),
              pages=pages, scores=bool(key_scores), score_keys=int(key_scores))
    args = (jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), lengths_B.astype(jnp.int32),
            q_BKNRD, pos_BNR.astype(jnp.int32), lo_BNR.astype(jnp.int32),
            anc_BNJ.astype(jnp.int32), table, k_LBKSD, v_LBKSD)
    # a program takes P tiles (that read the same slots), loading each key block once for them;
    # a power of two (the Triton lowering's block sizes: 3 tiles of a verification of 6 rows
    # of G = 6 run as 4, one of them padding)
    P = max(1, min(bs.split_tiles if split else bs.fold_tiles, NT)) if same_slots else 1
    P = 1 << (P - 1).bit_length()
    NP = -(-NT // P) * P
    if NP != NT:  # padding tiles: rows that see nothing
        pad = NP - NT
        args = (*args[:2], jnp.pad(q_BKNRD, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))),
                jnp.pad(args[3], ((0, 0), (0, pad), (0, 0)), constant_values=-1),
                jnp.pad(args[4], ((0, 0), (0, pad), (0, 0)), constant_values=FAR),
                jnp.pad(args[5], ((0, 0), (0, pad), (0, 0))), *args[6:])
    NG = NP // P
    # scores: one row of maxima of key groups per (sequence, head, group of tiles), -inf where
    # no block writes (the buffer passed in is the one written: programs write disjoint blocks)
    S_sc = -(-S // bs.block_k) * (bs.block_k // max(int(key_scores), 1))  # whole key blocks
    n_sc = -(-S // max(int(key_scores), 1))
    sc_shape = jax.ShapeDtypeStruct((B, K, NG, S_sc), jnp.float32)
    sc_args = (jnp.full(sc_shape.shape, -jnp.inf, jnp.float32),) if key_scores else ()
    n_in = len(args) + len(sc_args)
    if not split:  # grid: tiles fastest, so the tiles of one sequence and head share K/V in L2
        sc_spec = pl.BlockSpec((None, None, None, S_sc), lambda n, h, b: (b, h, n, 0))
        o = pl.pallas_call(
            functools.partial(_fold_kernel, **kw),
            grid=(NG, K, B),
            in_specs=[full((1,)), full((B,)),
                      pl.BlockSpec((None, None, P, R, D), lambda n, h, b: (b, h, n, 0, 0)),
                      pl.BlockSpec((None, P, R), lambda n, h, b: (b, n, 0)),
                      pl.BlockSpec((None, P, R), lambda n, h, b: (b, n, 0)),
                      pl.BlockSpec((None, None, J), lambda n, h, b: (b, n * P, 0)),
                      full(table.shape), full(k_LBKSD.shape), full(v_LBKSD.shape),
                      *([sc_spec] if key_scores else [])],
            out_specs=[pl.BlockSpec((None, None, P, R, D), lambda n, h, b: (b, h, n, 0, 0)),
                       *([sc_spec] if key_scores else [])],
            out_shape=[jax.ShapeDtypeStruct((B, K, NP, R, D), q_BKNRD.dtype),
                       *([sc_shape] if key_scores else [])],
            input_output_aliases={n_in - 1: 1} if key_scores else {},
            compiler_params=compiler_params,
            interpret=interpret,
            name="invariant_attention",
        )(*args, *sc_args)
        o, *sc = o
        o = o[:, :, :NT] if NP != NT else o
        return (o, sc[0][..., :n_sc]) if key_scores else o
    C = parts
    Pb = None if P == 1 else P  # one tile per program: the tile's dims squeezed
    sc_spec = pl.BlockSpec((None, None, None, S_sc), lambda n, c, h, b: (b, h, n, 0))
    m, l, a, *sc = pl.pallas_call(
        functools.partial(_split_kernel, **kw),
        grid=(NG, C, K, B),
        in_specs=[full((1,)), full((B,)),
                  pl.BlockSpec((None, None, Pb, R, D), lambda n, c, h, b: (b, h, n, 0, 0)),
                  pl.BlockSpec((None, Pb, R), lambda n, c, h, b: (b, n, 0)),
                  pl.BlockSpec((None, Pb, R), lambda n, c, h, b: (b, n, 0)),
                  pl.BlockSpec((None, None, J), lambda n, c, h, b: (b, n * P, 0)),
                  full(table.shape), full(k_LBKSD.shape), full(v_LBKSD.shape),
                  *([sc_spec] if key_scores else [])],
        out_specs=[pl.BlockSpec((None, None, Pb, None, R), lambda n, c, h, b: (b, h, n, c, 0)),
                   pl.BlockSpec((None, None, Pb, None, R), lambda n, c, h, b: (b, h, n, c, 0)),
                   pl.BlockSpec((None, None, Pb, None, R, D),
                                lambda n, c, h, b: (b, h, n, c, 0, 0)),
                   *([sc_spec] if key_scores else [])],
        out_shape=[jax.ShapeDtypeStruct((B, K, NP, C, R), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, NP, C, R), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, NP, C, R, D), jnp.float32),
                   *([sc_shape] if key_scores else [])],
        input_output_aliases={n_in - 1: 3} if key_scores else {},
        compiler_params=compiler_params,
        interpret=interpret,
        name="invariant_attention_parts",
    )(*args, *sc_args)
    if NP != NT:
        m, l, a = m[:, :, :NT], l[:, :, :NT], a[:, :, :NT]
    o = pl.pallas_call(
        functools.partial(_merge_kernel, parts=C, exp=exp),
        grid=(NT, K, B),
        in_specs=[pl.BlockSpec((None, None, None, C, R), lambda n, h, b: (b, h, n, 0, 0)),
                  pl.BlockSpec((None, None, None, C, R), lambda n, h, b: (b, h, n, 0, 0)),
                  pl.BlockSpec((None, None, None, C, R, D), lambda n, h, b: (b, h, n, 0, 0, 0))],
        out_specs=pl.BlockSpec((None, None, None, R, D), lambda n, h, b: (b, h, n, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(q_BKNRD.shape, q_BKNRD.dtype),
        compiler_params=compiler_params,
        interpret=interpret,
        name="invariant_attention_merge",
    )(m, l, a)
    return (o, sc[0][..., :n_sc]) if key_scores else o
