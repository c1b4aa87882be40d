"""Batch-invariant numerics: the same bits for a token whatever else is computed with it.

In bfloat16 a decode step, a speculative verification, a tree and a prefill chunk round
differently when their matrix products and reductions pick their tiling from the shapes (batch
size, T = 1 or gamma + 1, number of key splits, cache capacity): near-ties of the logits then flip
and greedy texts part. With ``batch_invariant=True`` (`jaxspec.generate`, the serving engine's
``--batch-invariant``) the model runs on the primitives of this module, each of which computes a
row (a token) with one fixed sequence of floating-point operations:

- `matmul`: ``x[..., K] @ w[K, N]`` through `pallas_kernels.invariant_matmul` (GPU: the Triton
  kernel; CPU: the same contract as fixed-shape dots over tiles of rows; ``"invariant-interpret"``:
  the Pallas kernel in the interpreter). The LM head too.
- `rms_norm`, `fixed_sum`: sums as a fixed binary tree of elementwise adds (halving the axis),
  independent of every other dimension and of the backend's reduction emitter.
- `attention`: `pallas_kernels.invariant_attention` on GPUs and in the interpreter (head dims a
  power of two >= 16), a `jnp` form elsewhere. An online softmax over blocks of
  ``ATTENTION_BLOCK`` keys in *absolute key positions*: the query at position p reduces over
  positions ``0..p`` (its window's part with a sliding window) in blocks
  ``[i * block, (i + 1) * block)``, in increasing order; a token-tree node reads its ancestors
  as if they sat at consecutive slots (where a plain step finds them once they are committed);
  masked keys contribute exact zeros and blocks past a row's keys are exact no-ops. Scores and
  the weighted sum of values are elementwise products summed by `fixed_sum` in the `jnp` form
  (fixed-shape products of tiles of 16 rows in the kernel), so nothing depends on T, B, the
  cache capacity or the other rows. The kernel also cuts the keys into parts of fixed absolute
  positions (2048 keys), each reduced from a fresh state and folded into the row's result in
  increasing order, whether one program folds them or a program per part runs and a merge
  folds them (decode: enough programs to stream the cache at full bandwidth). So a
  verification of gamma + 1 tokens computes each token's logits exactly as a one-token decode
  step would, and a prefill gives the same K/V in any chunking.

RoPE, the embedding lookup, SiLU and greedy sampling (an argmax) are elementwise or exact and
stay as they are. The attention of the StreamingLLM self-draft (a sparse view: proposals only)
keeps the default path: only the target's numbers decide the tokens.

Implementations (`jaxspec.attention.AttentionPlan.impl`): ``"invariant"`` (the Triton kernels
on GPUs, the tiled XLA dot and the `jnp` attention elsewhere) and ``"invariant-interpret"`` (the
Pallas kernels in the interpreter: CPU tests of the GPU kernels). The two give different bits
from each other; each is invariant on its own, and every forward of a decoding uses one. Not
there: shared-prefix (Hydragen) segments and sharded models (`jaxspec.session.Decoder` refuses
the latter, and decodes shared prefixes unshared). The GPU kernels are tested in the
interpreter and lowered for CUDA here (``tests/test_invariant_kernels.py`` too); on an H200
(jax 0.11.2) ``tests/test_batch_invariant.py::test_on_the_gpu`` passes and
``scripts/bench_invariant.py`` checks every tiling's bits. Speed there (random Qwen2.5-1.5B
weights, 64 rows x 16384 prompt tokens, 128 new tokens through `jaxspec.generate`): decode
1.34 s against 1.12 s by default (1.20x), prefill 23.3 s against 7.3 s (3.2x); per kernel,
``benchmarks/invariant_h200.md``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import invariant_attention as attention_kernel
from pallas_kernels.invariant_matmul import invariant_matmul, invariant_matmul_reference

IMPLS = ("invariant", "invariant-interpret")
ATTENTION_BLOCK = 64  # keys per block of `attention` (absolute positions [i*64, (i+1)*64))


def is_invariant(impl: str) -> bool:
    """Whether attention implementation ``impl`` is a batch-invariant one."""
    return impl in IMPLS


def invariant_impl(attn_impl: str) -> str:
    """The invariant implementation for a requested ``attn_impl``: ``"interpret"`` runs the
    Pallas kernels in the interpreter, anything else picks by backend."""
    if attn_impl in IMPLS:
        return attn_impl
    if attn_impl == "interpret":
        return "invariant-interpret"
    if attn_impl in ("auto", "xla", "pallas"):
        return "invariant"
    raise ValueError(f"unknown attention implementation {attn_impl!r}")


# ----------------------------------------------------------------------------- matmul
def matmul(x, w, impl: str = "invariant", out_dtype=None, transpose_w: bool = False):
    """``x[..., K] @ w[K, N]`` (``transpose_w``: ``x @ w.T`` for ``w[N, K]``, read in place) with
    every row computed by one fixed sequence of operations (`pallas_kernels.invariant_matmul`);
    float32 accumulation, result in ``out_dtype`` (default: x's dtype)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    kw = dict(out_dtype=out_dtype, transpose_w=transpose_w)
    if impl == "invariant-interpret":
        y = invariant_matmul(x2, w, interpret=True, **kw)
    elif jax.default_backend() == "gpu":
        y = invariant_matmul(x2, w, **kw)
    else:
        y = invariant_matmul_reference(x2, w, **kw)
    return y.reshape(*lead, w.shape[0 if transpose_w else -1])


def matmul_for(impl: str):
    """``(x, w) -> x @ w``: `matmul` for an invariant ``impl``, else the plain operator."""
    if is_invariant(impl):
        return lambda x, w: matmul(x, w, impl)
    return jnp.matmul


# ----------------------------------------------------------------------------- reductions
def fixed_sum(x, axis: int = -1, keepdims: bool = False):
    """``sum(x, axis)`` as a fixed binary tree of elementwise adds: the axis is zero-padded to a
    power of two and halved (``x[:n/2] + x[n/2:]``) until one element is left. Each output
    element's additions are the same whatever the other dimensions are."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, p - n)])
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    out = x[..., 0]
    if keepdims:
        out = jnp.expand_dims(out, axis if axis >= 0 else out.ndim + 1 + axis)
    return out


def rms_norm(x, w, eps):
    """`jaxspec.model.rms_norm` with the mean of squares summed by `fixed_sum`."""
    x32 = x.astype(jnp.float32)
    ms = fixed_sum(x32 * x32, -1, keepdims=True) / x.shape[-1]
    y = x32 * jax.lax.rsqrt(ms + eps)
    return w * y.astype(x.dtype)


# ----------------------------------------------------------------------------- attention
def _ancestors(mask_BTN):
    """``[B, T, T_new]`` int32: for each query the index of its visible new token of depth d
    (the d-th visible one: a tree node's ancestors are visible in increasing depth), 0 past its
    depth."""
    m = mask_BTN.astype(jnp.int32)
    d = jnp.cumsum(m, axis=-1) - 1  # depth of visible new token j (when visible)
    T_new = m.shape[-1]
    hit = (m[..., None, :] > 0) & (d[..., None, :] == jnp.arange(T_new)[:, None])  # [B,T,d,j]
    return jnp.sum(jnp.where(hit, jnp.arange(T_new, dtype=jnp.int32), 0), axis=-1)


def uses_kernel(impl: str, head_dim: int) -> bool:
    """Whether `attention` runs the Pallas kernel (`pallas_kernels.invariant_attention`): on GPUs
    and in the interpreter (``"invariant-interpret"``), for head dims it takes. The choice
    depends on the model and the backend only, so every forward of a decoding makes the same."""
    return (attention_kernel.supports(head_dim)
            and (impl == "invariant-interpret" or jax.default_backend() == "gpu"))


def attention(q_BTHD, k_LBKSD, v_LBKSD, layer, lengths, mask=None, *, num_new: int,
              sm_scale=None, sliding_window=None, block: int = ATTENTION_BLOCK,
              impl: str = "invariant"):
    """Batch-invariant attention of the T queries (the last T of ``num_new`` new tokens, whose
    K/V are already in the cache at slots ``lengths + j``) over the stacked cache
    ``[L, B, K, S, D]``; module docstring for the order. ``mask``: None (causal) or the
    ``[T, T_new]`` / ``[B, T, T_new]`` ancestor mask of a token tree. Returns ``[B, T, H, D]``
    in q's dtype. The Pallas kernel where `uses_kernel`, else `jnp`."""
    if uses_kernel(impl, q_BTHD.shape[-1]):
        return _attention_tiles(q_BTHD, k_LBKSD, v_LBKSD, layer, lengths, mask, num_new=num_new,
                                sm_scale=sm_scale, sliding_window=sliding_window,
                                interpret=impl == "invariant-interpret")
    B, T, H, D = q_BTHD.shape
    K, S = k_LBKSD.shape[2], k_LBKSD.shape[3]
    G = H // K
    T_new = int(num_new)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    lengths = lengths.astype(jnp.int32)
    layer = jnp.asarray(layer, jnp.int32)
    k_all = jax.lax.dynamic_index_in_dim(k_LBKSD, layer, axis=0, keepdims=False)  # [B, K, S, D]
    v_all = jax.lax.dynamic_index_in_dim(v_LBKSD, layer, axis=0, keepdims=False)
    if mask is None:
        depth = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + (T_new - T), (B, T))
        anc = None
    else:
        m = jnp.asarray(mask, bool)
        m = jnp.broadcast_to(m if m.ndim == 3 else m[None], (B, T, T_new))
        depth = jnp.sum(m.astype(jnp.int32), axis=-1) - 1
        anc = _ancestors(m)  # [B, T, T_new]
    pos = lengths[:, None] + depth  # [B, T]: each query's position (its last visible key)
    lo = jnp.zeros_like(pos) if sliding_window is None else pos - int(sliding_window) + 1
    q = (q_BTHD.astype(jnp.float32) * sm_scale).reshape(B, T, K, G, D)
    q = q.transpose(0, 2, 3, 1, 4)[:, :, :, :, None, :]  # [B, K, G, T, 1, D]
    b_idx = jnp.arange(B, dtype=jnp.int32)
    first = jnp.maximum(jnp.min(lo), 0) // block
    last = (jnp.max(pos) + block) // block  # blocks [first, last) hold every visible key

    def body(i, carry):
        m_run, l_run, acc = carry
        s_abs = i * block + jnp.arange(block, dtype=jnp.int32)  # [N] absolute positions
        vis = (s_abs[None, None] <= pos[..., None]) & (s_abs[None, None] >= lo[..., None])
        if anc is None:  # position s is cache slot s for every query
            slot = jnp.clip(s_abs, 0, S - 1)
            kb = k_all[:, :, slot].astype(jnp.float32)[:, :, None, None]  # [B, K, 1, 1, N, D]
            vb = v_all[:, :, slot].astype(jnp.float32)[:, :, None, None]
        else:  # a tree node's ancestor of depth d sits at slot lengths + anc[d]
            rel = s_abs[None, None] - lengths[:, None, None]  # [B, 1, N]
            a = jnp.take_along_axis(anc, jnp.clip(rel, 0, T_new - 1).repeat(T, 1), axis=2)
            slot = jnp.where(rel < 0, s_abs[None, None], lengths[:, None, None] + a)
            slot = jnp.clip(slot, 0, S - 1)  # [B, T, N]
            kb = k_all[b_idx[:, None, None], :, slot]  # [B, T, N, K, D]
            vb = v_all[b_idx[:, None, None], :, slot]
            kb = kb.astype(jnp.float32).transpose(0, 3, 1, 2, 4)[:, :, None]  # [B, K, 1, T, N, D]
            vb = vb.astype(jnp.float32).transpose(0, 3, 1, 2, 4)[:, :, None]
        ok = vis[:, None, None]  # [B, 1, 1, T, N]
        s = fixed_sum(q * kb, -1)  # [B, K, G, T, N]
        s = jnp.where(ok, s, -jnp.inf)
        m_new = jnp.maximum(m_run, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(ok, jnp.exp(s - m_safe[..., None]), 0.0)
        scale = jnp.where(jnp.isfinite(m_run), jnp.exp(m_run - m_safe), 0.0)
        vb = jnp.where(ok[..., None], vb, 0.0)  # garbage (even NaN) in masked slots stays out
        l_run = l_run * scale + fixed_sum(p, -1)
        acc = acc * scale[..., None] + fixed_sum(p[..., None] * vb, -2)
        return m_new, l_run, acc

    init = (jnp.full((B, K, G, T), -jnp.inf, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, D), jnp.float32))
    _, l_run, acc = jax.lax.fori_loop(first, last, body, init)
    o = acc / jnp.where(l_run > 0, l_run, 1.0)[..., None]
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q_BTHD.dtype)


def _attention_tiles(q_BTHD, k_LBKSD, v_LBKSD, layer, lengths, mask, *, num_new: int, sm_scale,
                     sliding_window, interpret: bool, blocks=None, mode: str = "auto"):
    """`attention` through `pallas_kernels.invariant_attention`: causal queries in tiles of
    (token, head) rows that share their key slots; a tree's queries one node per tile (its
    ancestors' slots)."""
    B, T, H, D = q_BTHD.shape
    K = k_LBKSD.shape[2]
    G = H // K
    blocks = attention_kernel.DEFAULT_BLOCKS if blocks is None else blocks
    R = blocks.block_rows
    T_new = int(num_new)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    lengths = lengths.astype(jnp.int32)
    q = q_BTHD.astype(k_LBKSD.dtype).reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4)
    if mask is None:  # rows (t, g) t-major, in tiles of R
        n = T * G
        NT = -(-n // R)
        rows = jnp.pad(q.reshape(B, K, n, D), ((0, 0), (0, 0), (0, NT * R - n), (0, 0)))
        t_of = jnp.arange(NT * R, dtype=jnp.int32) // G
        depth = jnp.broadcast_to(t_of + (T_new - T), (B, NT * R))
        real = jnp.arange(NT * R) < n
        anc = jnp.broadcast_to(jnp.arange(T_new, dtype=jnp.int32), (B, NT, T_new))
    else:  # one node per tile: its G heads, padded to whole tiles
        m = jnp.asarray(mask, bool)
        m = jnp.broadcast_to(m if m.ndim == 3 else m[None], (B, T, T_new))
        nG = -(-G // R)
        NT = T * nG
        rows = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, nG * R - G), (0, 0)))
        d_t = jnp.sum(m.astype(jnp.int32), axis=-1) - 1  # [B, T]
        depth = jnp.repeat(d_t, nG * R, axis=1)  # [B, T * nG * R]
        real = (jnp.arange(nG * R) < G)[None, :].repeat(T, 0).reshape(-1)
        anc = jnp.repeat(_ancestors(m), nG, axis=1)  # [B, NT, T_new]
    rows = rows.reshape(B, K, NT, R, D)
    pos = lengths[:, None] + depth
    lo = jnp.zeros_like(pos) if sliding_window is None else pos - int(sliding_window) + 1
    pos = jnp.where(real[None], pos, -1).reshape(B, NT, R)
    lo = jnp.where(real[None], lo, attention_kernel.FAR).reshape(B, NT, R)
    o = attention_kernel.invariant_attention(rows, pos, lo, anc, lengths, k_LBKSD, v_LBKSD, layer,
                                             sm_scale=float(sm_scale), interpret=interpret,
                                             block_sizes=blocks, mode=mode,
                                             same_slots=mask is None)
    if mask is None:
        o = o.reshape(B, K, NT * R, D)[:, :, :T * G].reshape(B, K, T, G, D)
    else:
        o = o.reshape(B, K, T, nG * R, D)[:, :, :, :G]
    return o.transpose(0, 2, 1, 3, 4).reshape(B, T, H, D).astype(q_BTHD.dtype)
