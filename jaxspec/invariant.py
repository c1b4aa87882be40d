"""Batch-invariant numerics: the same bits for a token whatever else is computed with it.

In bfloat16 a decode step, a speculative verification, a tree and a prefill chunk round
differently when their matrix products and reductions pick their tiling from the shapes (batch
size, T = 1 or gamma + 1, number of key splits, cache capacity): near-ties of the logits then flip
and texts part (greedy or sampled). With ``batch_invariant=True`` (`jaxspec.generate`, the serving engine's
``--batch-invariant``) the model runs on the primitives of this module, each of which computes a
row (a token) with one fixed sequence of floating-point operations:

- `matmul`: ``x[..., K] @ w[K, N]`` through `pallas_kernels.invariant_matmul` (GPU: the Triton
  kernel; CPU: the same contract as fixed-shape dots over tiles of rows; ``"invariant-interpret"``:
  the Pallas kernel in the interpreter). The LM head too.
- `rms_norm`, `fixed_sum`, `fixed_max`: sums (maxima) as a fixed binary tree of elementwise adds
  (maxima), halving the axis, independent of every other dimension and of the backend's
  reduction emitter (`rms_norm` on GPUs: `pallas_kernels.invariant_norm`, a fixed order of its
  own); `fixed_cumsum`: a fixed scan of elementwise adds (shifts by 1, 2, 4, ...).
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
  positions (`InvariantAttentionBlocks.chunk`: 4096 keys), each reduced from a fresh state and
  folded into the row's result in increasing order, whether one program folds them or a
  program per part runs and a merge folds them (decode: enough programs to stream the cache at
  full bandwidth). So a verification of gamma + 1 tokens computes each token's logits exactly
  as a one-token decode step would, and a prefill gives the same K/V in any chunking. The
  kernel reads a block pool through its block table (`reads_pages`: no gathered copy of the
  row's context) with the bits of a dense cache, and writes a retrieving self-draft's block
  scores as it reads the keys (``score_block``: each a maximum of the row's own logits).
- `prompt_attention`: the attention of prompt tokens in a prefill
  (`jaxspec.attention.AttentionPlan.prompt`). A token's K/V come either from a prefill (every
  prompt token but the last) or from the decode step that fed it (the last prompt token and
  every generated one), never from both, so prompt rows need the same bits in any chunking,
  batch and cache, not a decode step's bits. On a Hopper GPU they take the Mosaic GPU kernel of
  `pallas_kernels.hopper` with one key range per row (wgmma tiles of 64 rows, key blocks of
  128 absolute positions, one running softmax state per row from key 0 up, blocks past a row's
  keys exact no-ops): 7x cheaper than the decode tiles over a long prefill chunk. Elsewhere
  the `jnp` form in blocks of `PROMPT_BLOCK` keys (CPU: other bits than the decode step's, so
  the tests see a token computed by the wrong one), or the decode step's attention (other
  GPUs, float32, sliding windows). A preempted sequence's cache is filled again the same way:
  its prompt as a prefill, its last prompt token and generated tokens as its decode steps
  computed them (`jaxspec.prefill.prefill_row`'s ``prompt_end``); and the serving engine's
  prefix cache keeps only blocks of prompt tokens.
- `prompt_matmul`: the products of those prompt rows, for the same reason a kernel of their own:
  on a Hopper GPU `pallas_kernels.prompt_matmul` (warpgroup MMAs over 128 x 256 output tiles,
  K in blocks of 64 added in increasing order, the tiling from K and N only: 1.03-1.15x
  cuBLAS's time at 32k rows, against 1.25-1.8x for the decode rows' Triton tiles); on the CPU
  a `jnp` form with K in blocks of `PROMPT_K_BLOCK` (other bits than `matmul`'s); elsewhere
  `matmul`. A forward over segments of both roles (a decode round with a piece of a prompt in
  it: `jaxspec.model.forward_mixed`) runs each product once per role.

- `sparse_attention`: the StreamingLLM self-draft's view (sink, window, retrieved blocks and the
  new tokens) gathered into a fixed number of slots and reduced by `fixed_max` / `fixed_sum`;
  `block_scores`: the retrieval's block scores (`jaxspec.retrieval`) as `fixed_sum` dot products
  per block, where the verification's attention is not the kernel (which writes its own). When
  sampling, the drafts and the distributions they are drawn from decide tokens
  too, so the draft's numbers are invariant as well; a greedy round's self-draft and block
  scores run the default numerics instead (`jaxspec.drafter.draft_impl`: its drafts only
  propose).
- Sampling (`jaxspec.sampling.SamplingParams.invariant`, set by every round of a batch-invariant
  decoding): the softmax and log-softmax over the vocabulary (`fixed_softmax`,
  `fixed_logsumexp`), top-p's cumulative mass and the inverse CDF of a draw (`fixed_cumsum`, and
  `fixed_sum` for its block sums), and speculative sampling's residual and renormalised-q sums
  (`jaxspec.verify`). The maxima are trees too: a maximum is exact in any order, but XLA's CPU
  backend hands ``exp(x - max(x))`` fused with its reduction to a kernel library for some
  batch sizes and not for others (one row), and that library's ``exp`` rounds differently
  (tested). Draws use per-row keys folded with the token's position
  (`jaxspec.sampling.position_keys`), so a token's draws depend on its row's key and position
  only, not on the batch or on how many rounds ran before it.

RoPE, the embedding lookup, SiLU, argmaxes, sorts, top-k selections, the PRNG and the
elementwise parts of sampling (temperature, the accept test ``u * q(x) < p(x)``, Gumbel keys) are
elementwise or exact and stay as they are.

Implementations (`jaxspec.attention.AttentionPlan.impl`): ``"invariant"`` (the Triton kernels
on GPUs, the tiled XLA dot and the `jnp` attention elsewhere) and ``"invariant-interpret"`` (the
Pallas kernels in the interpreter: CPU tests of the GPU kernels). The two give different bits
from each other; each is invariant on its own, and every forward of a decoding uses one (the
self-draft's `sparse_attention` and `block_scores` are the `jnp` forms on every backend). Not
there: shared-prefix (Hydragen) segments and sharded models (`jaxspec.session.Decoder` refuses
the latter, and decodes shared prefixes unshared). The GPU kernels are tested in the
interpreter and lowered for CUDA here (``tests/test_invariant_kernels.py`` too); on an H200
(jax 0.11.2) ``tests/test_batch_invariant.py::test_on_the_gpu`` passes and
``scripts/bench_invariant.py`` checks every tiling's bits. Speed there (random Qwen2.5-1.5B
weights, 64 rows x 16384 prompt tokens, 128 new tokens through `jaxspec.generate`): decode
1.169 s against 1.133 s by default (1.03x), prefill 7.70 s against 7.37 s (1.05x); per kernel,
``benchmarks/invariant_h200.md``. The tile of 16 query rows is part of the decode step's bits:
on an H200, tiles of 32 rows gave other bits in float32 and at head dim 32, and 64-row tiles
(warpgroup MMAs) in about one row in a hundred, so verifications keep the decode step's tiles
and only prompt rows (`prompt_attention`) take the 64-row kernel.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import invariant_attention as attention_kernel
from pallas_kernels import invariant_norm as norm_kernel
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


def matmul_for(impl: str, prompt: bool = False):
    """``(x, w) -> x @ w``: `matmul` (``prompt``: `prompt_matmul`) for an invariant ``impl``,
    else the plain operator."""
    if is_invariant(impl):
        return (lambda x, w: prompt_matmul(x, w, impl)) if prompt else (
            lambda x, w: matmul(x, w, impl))
    return jnp.matmul


PROMPT_K_BLOCK = 64  # K per block of `prompt_matmul`'s `jnp` form (the GPU kernel's too)


def prompt_product(impl: str, dtype, K: int, N: int) -> str:
    """Which form `prompt_matmul` takes for a ``[.., K] @ [K, N]`` product of ``dtype``:
    ``"hopper"`` (`pallas_kernels.prompt_matmul`'s warpgroup MMAs: bf16/f16, K and N multiples
    of 64, on an NVIDIA Hopper GPU), ``"jnp"`` (tiles of 16 rows, K in blocks of
    `PROMPT_K_BLOCK` added in increasing order: CPU backends and the interpreter) or
    ``"decode"`` (`matmul` itself: other GPUs and shapes). The choice depends on the weights'
    shape and the backend only, never on the rows."""
    if not is_invariant(impl):
        return "decode"
    if jax.default_backend() != "gpu":
        return "jnp"
    from pallas_kernels import prompt_matmul as pm
    if impl == "invariant" and pm.available() and pm.supports(dtype, K, N):
        return "hopper"
    return "decode"


def prompt_matmul(x, w, impl: str = "invariant", out_dtype=None):
    """``x[..., K] @ w[K, N]`` for the rows of prompt tokens (a prefill chunk's, a mixed round's
    piece: `jaxspec.attention.AttentionPlan.prompt`). Like `prompt_attention`, these rows need
    the same bits in every chunking and batch but not a decode step's (a prompt token's K/V are
    computed by a prefill only), so the product is one built for many rows, each row still one
    fixed sequence of operations whatever M is (`prompt_product` picks the form)."""
    lead, K = x.shape[:-1], x.shape[-1]
    N = w.shape[-1]
    form = prompt_product(impl, x.dtype, K, N)
    if form == "decode":
        return matmul(x, w, impl, out_dtype=out_dtype)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    x2 = x.reshape(-1, K)
    if form == "hopper":
        from pallas_kernels import prompt_matmul as pm
        y = pm.prompt_matmul(x2, w, out_dtype=out_dtype)
    else:
        y = _prompt_matmul_jnp(x2, w.astype(x.dtype), out_dtype=out_dtype)
    return y.reshape(*lead, N)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def _prompt_matmul_jnp(x_MK, w_KN, *, out_dtype):
    """`prompt_matmul`'s CPU form: rows in tiles of 16 (`lax.map`: one fixed shape whatever M
    is), each tile's product over K in blocks of `PROMPT_K_BLOCK` (the last one zero-padded),
    added in increasing order in float32: other bits than `matmul`'s one dot over all of K, as
    the GPU kernel's are, so a test sees a row computed by the wrong one."""
    M, K = x_MK.shape
    N = w_KN.shape[1]
    tile, kb = 16, PROMPT_K_BLOCK
    n_k = -(-K // kb)
    x = jnp.pad(x_MK, ((0, -M % tile), (0, n_k * kb - K)))
    w = jnp.pad(w_KN, ((0, n_k * kb - K), (0, 0))).reshape(n_k, kb, N)
    n = x.shape[0] // tile

    def one(t):  # t [tile, n_k * kb]
        tb = t.reshape(tile, n_k, kb)

        def body(i, acc):
            xi = jax.lax.dynamic_index_in_dim(tb, i, axis=1, keepdims=False)
            wi = jax.lax.dynamic_index_in_dim(w, i, axis=0, keepdims=False)
            return acc + jnp.dot(xi, wi, preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, n_k, body, jnp.zeros((tile, N), jnp.float32))
        return acc.astype(out_dtype)

    y = jax.lax.map(one, x.reshape(n, tile, n_k * kb))
    return y.reshape(n * tile, N)[:M]


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


def fixed_cumsum(x, axis: int = -1):
    """Inclusive ``cumsum(x, axis)`` as a fixed scan of elementwise adds (Hillis-Steele: add the
    axis shifted by 1, 2, 4, ... places, zeros shifted in). Each output element's additions
    depend only on its index and the axis length, never on the other dimensions."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    d = 1
    while d < n:
        x = x + jnp.pad(x[..., :n - d], [(0, 0)] * (x.ndim - 1) + [(d, 0)])
        d *= 2
    return jnp.moveaxis(x, -1, axis)


def fixed_max(x, axis: int = -1, keepdims: bool = False):
    """``max(x, axis)`` as a fixed binary tree of elementwise maxima (as `fixed_sum`). A maximum
    is exact in any order, but XLA's CPU backend hands a reduction fused with the elementwise
    ops that use it (``exp(x - max(x))``) to a library kernel of its own for some shapes and
    not for others (a row alone), whose ``exp`` rounds differently: elementwise trees keep every
    op in XLA's own elementwise code whatever the shape."""
    x = jnp.moveaxis(x, axis, -1)
    n = x.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    if p != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, p - n)], constant_values=-jnp.inf)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = jnp.maximum(x[..., :h], x[..., h:])
    out = x[..., 0]
    if keepdims:
        out = jnp.expand_dims(out, axis if axis >= 0 else out.ndim + 1 + axis)
    return out


def fixed_logsumexp(x, axis: int = -1, keepdims: bool = False):
    """``log(sum(exp(x)))`` over ``axis`` with `fixed_max` and `fixed_sum`."""
    m = fixed_max(x, axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    out = jnp.log(fixed_sum(jnp.exp(x - m), axis, keepdims=True)) + m
    return out if keepdims else jnp.squeeze(out, axis)


def fixed_softmax(x, axis: int = -1):
    """``softmax(x, axis)`` with `fixed_max` and `fixed_sum` (rows of -inf but one finite value are
    fine; a row of all -inf gives NaN, as `jax.nn.softmax` does)."""
    e = jnp.exp(x - fixed_max(x, axis, keepdims=True))
    return e / fixed_sum(e, axis, keepdims=True)


def rms_norm(x, w, eps):
    """`jaxspec.model.rms_norm` with the mean of squares summed in a fixed order: on GPUs by
    `pallas_kernels.invariant_norm` (chunks of the row added elementwise, then one fixed-shape
    row reduction: XLA runs the tree below as one thread per row), elsewhere by `fixed_sum`."""
    if jax.default_backend() == "gpu" and norm_kernel.supports(x.shape[-1]):
        return norm_kernel.invariant_rms_norm(x, w, eps=float(eps))
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


def view_slots(head_dim: int, dtype) -> int:
    """The slot count a gathered view of a block pool is rounded up to (its table padded with
    unmapped entries, past every length): the decode kernel's key block (`blocks_for`), whose
    loads are contiguous only over a cache of whole blocks. The bits are the same either way;
    the per-key loads of a ragged view are several times slower."""
    return attention_kernel.blocks_for(head_dim, dtype).block_k


def reads_pages(impl: str, page_size: int, head_dim: int, dtype) -> bool:
    """Whether `attention` reads a block pool of this page size through its table (the kernel,
    `uses_kernel`, whose key block divides the page size or is a multiple of it); else callers
    gather a dense view of the row's blocks first (a copy of its context per call)."""
    return (uses_kernel(impl, head_dim)
            and attention_kernel.reads_pages(page_size, head_dim, dtype))


def _layer_inputs(k_LBKSD, v_LBKSD, layer, sm_scale, D):
    """``(sm_scale, k [B, K, S, D], v)``: the softmax scale (1 / sqrt(D) by default) and one
    layer's keys and values of a stacked cache."""
    layer = jnp.asarray(layer, jnp.int32)
    k = jax.lax.dynamic_index_in_dim(k_LBKSD, layer, axis=0, keepdims=False)
    v = jax.lax.dynamic_index_in_dim(v_LBKSD, layer, axis=0, keepdims=False)
    return (1.0 / math.sqrt(D) if sm_scale is None else sm_scale), k, v

def attention(q_BTHD, k_LBKSD, v_LBKSD, layer, lengths, mask=None, *, num_new: int,
              sm_scale=None, sliding_window=None, block: int = ATTENTION_BLOCK,
              impl: str = "invariant", block_table=None, score_block: int | None = None):
    """Batch-invariant attention of the T queries (the last T of ``num_new`` new tokens, whose
    K/V are already in the cache at slots ``lengths + j``) over the stacked cache
    ``[L, B, K, S, D]``; module docstring for the order. ``mask``: None (causal) or the
    ``[T, T_new]`` / ``[B, T, T_new]`` ancestor mask of a token tree. Returns ``[B, T, H, D]``
    in q's dtype. The Pallas kernel where `uses_kernel`, else `jnp` (``impl="invariant-jnp"``:
    the `jnp` form on every backend). ``block_table [B, MB]``: K/V are block pools
    ``[L, NB, K, BS, D]`` read through it (where `reads_pages`), with the bits of a dense cache
    holding the same slots. ``score_block`` (the kernel only, `uses_kernel`): ``(out, scores)``,
    the block scores of `jaxspec.retrieval.block_scores` (``[B, K, cdiv(S, block)]``, S the
    slots the cache or table addresses) written by the kernel as it reads the keys: each a
    maximum of the row's own logits, so independent of the batch, but not `block_scores`'
    bits."""
    kernel = impl != "invariant-jnp" and uses_kernel(impl, q_BTHD.shape[-1])
    if score_block is not None and not kernel:
        raise ValueError(f"invariant attention writes block scores in the kernel only; impl "
                         f"{impl!r}: use `block_scores`")
    if block_table is not None and not (
            kernel and attention_kernel.reads_pages(k_LBKSD.shape[3], q_BTHD.shape[-1],
                                                    k_LBKSD.dtype)):
        raise ValueError(f"invariant attention reads a block pool of page size "
                         f"{k_LBKSD.shape[3]} through its table only in the kernel "
                         f"(`reads_pages`); impl {impl!r}: gather a dense view instead")
    if kernel:
        return _attention_tiles(q_BTHD, k_LBKSD, v_LBKSD, layer, lengths, mask, num_new=num_new,
                                sm_scale=sm_scale, sliding_window=sliding_window,
                                interpret=impl == "invariant-interpret", block_table=block_table,
                                score_block=score_block)
    B, T, H, D = q_BTHD.shape
    K, S = k_LBKSD.shape[2], k_LBKSD.shape[3]
    G = H // K
    T_new = int(num_new)
    sm_scale, k_all, v_all = _layer_inputs(k_LBKSD, v_LBKSD, layer, sm_scale, D)  # [B, K, S, D]
    lengths = lengths.astype(jnp.int32)
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


PROMPT_BLOCK = 128  # keys per block of `prompt_attention`'s own forms


def prompt_kernel(impl: str, dtype, head_dim: int, sliding_window=None) -> str:
    """Which form `prompt_attention` takes: ``"hopper"`` (the Mosaic GPU kernel, one key range
    per row: bf16/f16, head dims 64 and 128, no sliding window, on an NVIDIA Hopper GPU),
    ``"jnp"`` (the `jnp` form in blocks of `PROMPT_BLOCK` keys: CPU backends and the
    interpreter) or ``"decode"`` (the decode step's own attention: other GPUs, float32, sliding
    windows). The choice depends on the model and the backend only."""
    if sliding_window is not None or not is_invariant(impl):
        return "decode"
    if jax.default_backend() != "gpu":
        return "jnp"
    from pallas_kernels import hopper
    # (head dims checked bitwise on an H200: 64 and 128; 256 takes other tiles there)
    if (impl == "invariant" and hopper.available() and hopper.supports(dtype, head_dim)
            and head_dim in (64, 128)):
        return "hopper"
    return "decode"


def prompt_attention(q_BTHD, k_LBKSD, v_LBKSD, layer, lengths, *, num_new: int, sm_scale=None,
                     sliding_window=None, impl: str = "invariant"):
    """Batch-invariant attention of prompt tokens (a prefill chunk: causal, the T queries the
    last T of ``num_new`` new tokens after ``lengths``). A prompt token's K/V are always
    computed by a prefill, never by a decode step (`jaxspec.attention.AttentionPlan.prompt`:
    all of a prompt but its last token, which the first decode step takes), so its attention
    needs only be the same in every chunking, batch and cache, not the same as a decode step's:
    each row reduces over its keys ``0..p`` in blocks of fixed absolute positions, in
    increasing order, from one running state, whatever rows share its tile. On a Hopper GPU
    that is the Mosaic GPU kernel of `pallas_kernels.hopper` with one key range (wgmma tiles
    of 64 rows, blocks of 128 keys: about 7x cheaper than the decode step's 16-row tiles on a
    long prefill chunk); elsewhere (`prompt_kernel`) the `jnp` form in blocks of `PROMPT_BLOCK`
    keys, or the decode step's attention itself."""
    B, T, H, D = q_BTHD.shape
    form = prompt_kernel(impl, k_LBKSD.dtype, D, sliding_window)
    if form == "decode":
        return attention(q_BTHD, k_LBKSD, v_LBKSD, layer, lengths, num_new=num_new,
                         sm_scale=sm_scale, sliding_window=sliding_window, impl=impl)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    if form == "hopper":
        from pallas_kernels import hopper
        S = k_LBKSD.shape[3]
        if S % 8:  # (a block pool's view of an odd page size) the kernel's tiles want 8k keys
            _, k1, v1 = _layer_inputs(k_LBKSD, v_LBKSD, layer, sm_scale, D)
            pad = ((0, 0), (0, 0), (0, -S % 8), (0, 0))
            k_LBKSD, v_LBKSD, layer = jnp.pad(k1, pad)[None], jnp.pad(v1, pad)[None], 0
        out, _ = hopper.verify_attention(q_BTHD.astype(k_LBKSD.dtype), k_LBKSD, v_LBKSD,
                                         lengths.astype(jnp.int32), layer=layer,
                                         sm_scale=float(sm_scale), num_new=int(num_new),
                                         block_sizes=hopper.HopperBlockSizes(splits=1))
        return out.astype(q_BTHD.dtype)
    return attention(q_BTHD, k_LBKSD, v_LBKSD, layer, lengths, num_new=num_new,
                     sm_scale=sm_scale, sliding_window=sliding_window, block=PROMPT_BLOCK,
                     impl="invariant-jnp")


def _attention_tiles(q_BTHD, k_LBKSD, v_LBKSD, layer, lengths, mask, *, num_new: int, sm_scale,
                     sliding_window, interpret: bool, blocks=None, mode: str = "auto",
                     block_table=None, score_block: int | None = None):
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
    kernel_blocks = attention_kernel.blocks_for(D, k_LBKSD.dtype, blocks)
    # the kernel's score groups: the largest that divides both its key block and score_block
    part = 0 if score_block is None else math.gcd(int(score_block), kernel_blocks.block_k)
    o = attention_kernel.invariant_attention(rows, pos, lo, anc, lengths, k_LBKSD, v_LBKSD, layer,
                                             sm_scale=float(sm_scale), interpret=interpret,
                                             block_sizes=blocks, mode=mode,
                                             same_slots=mask is None, block_table=block_table,
                                             key_scores=part)
    scores = None
    if score_block is not None:  # the kernel's maxima of key groups -> block maxima in logits
        o, part_max = o
        part_max = jnp.max(part_max, axis=2)  # [B, K, m] (over groups of tiles: exact)
        if kernel_blocks.fast_exp:  # (a positive scale: the maximum of the scaled is the same)
            part_max = part_max / attention_kernel.LOG2E
        g = int(score_block) // part  # kernel groups per score block
        m = part_max.shape[-1]
        n = -(-m // g)
        if g > 1:
            part_max = jnp.pad(part_max, ((0, 0), (0, 0), (0, n * g - m)),
                               constant_values=-jnp.inf)
            part_max = jnp.max(part_max.reshape(B, K, n, g), axis=-1)
        scores = part_max
    if mask is None:
        o = o.reshape(B, K, NT * R, D)[:, :, :T * G].reshape(B, K, T, G, D)
    else:
        o = o.reshape(B, K, T, nG * R, D)[:, :, :, :G]
    o = o.transpose(0, 2, 1, 3, 4).reshape(B, T, H, D).astype(q_BTHD.dtype)
    return o if scores is None else (o, scores)


# ----------------------------------------------------------------------------- the self-draft
def sparse_attention(q_BTHD, k_LBKSD, v_LBKSD, layer, lengths, mask=None, *, num_new: int,
                     sink: int, window: int, blocks=None, block: int | None = None,
                     sm_scale=None, sliding_window=None):
    """The StreamingLLM self-draft's attention (`jaxspec.attention.attention_xla`'s sparse view:
    the first ``sink`` and the last ``window`` context slots, the retrieved ``blocks`` [B, K, R]
    of ``block`` slots between them, and the new tokens under ``mask``), batch-invariant: the
    view's ``sink + window + R * block + num_new`` slots are gathered in that order and reduced
    by `fixed_max` / `fixed_sum` over that fixed count (masked slots are exact zeros), so a row's
    output depends on its own view only, never on B, the cache capacity or the other rows.
    ``sliding_window``: the model's, bounding the new tokens a query sees (``d_t - d_j < W``).
    Returns ``[B, T, H, D]`` in q's dtype."""
    B, T, H, D = q_BTHD.shape
    K, S = k_LBKSD.shape[2], k_LBKSD.shape[3]
    G = H // K
    T_new = int(num_new)
    sink, window = int(sink or 0), int(window or 0)
    sm_scale, k_all, v_all = _layer_inputs(k_LBKSD, v_LBKSD, layer, sm_scale, D)  # [B, K, S, D]
    L = lengths.astype(jnp.int32)
    # new-token visibility [B, T, T_new]: causal or the tree mask, windowed by W
    if mask is None:
        t = jnp.arange(T, dtype=jnp.int32)[:, None] + (T_new - T)
        j = jnp.arange(T_new, dtype=jnp.int32)[None, :]
        new_vis = jnp.broadcast_to(j <= t, (B, T, T_new))
        if sliding_window is not None:
            new_vis = new_vis & (t - j < int(sliding_window))[None]
    else:
        m = jnp.asarray(mask, bool)
        new_vis = jnp.broadcast_to(m if m.ndim == 3 else m[None], (B, T, T_new))
        if sliding_window is not None:
            c = jnp.cumsum(new_vis.astype(jnp.int32), axis=-1)  # (integers: exact)
            new_vis = new_vis & (c[..., -1:] - c < int(sliding_window))
    sink_idx = jnp.broadcast_to(jnp.arange(sink, dtype=jnp.int32)[None], (B, sink))
    win_idx = L[:, None] - window + jnp.arange(window, dtype=jnp.int32)[None]
    new_idx = L[:, None] + jnp.arange(T_new, dtype=jnp.int32)[None]
    ctx_ok = jnp.concatenate([sink_idx < L[:, None], (win_idx >= sink) & (win_idx >= 0)], 1)
    idx = jnp.broadcast_to(jnp.concatenate([sink_idx, win_idx], 1)[:, None], (B, K, sink + window))
    ok = jnp.broadcast_to(ctx_ok[:, None, None], (B, K, T, sink + window))
    if blocks is not None:  # retrieved slots between the sink and the window
        R = blocks.shape[-1]
        slot = (jnp.maximum(blocks, 0)[..., None] * int(block)
                + jnp.arange(int(block), dtype=jnp.int32)).reshape(B, K, R * int(block))
        lo = jnp.minimum(sink, L)
        hi = jnp.maximum(L - window, lo)
        r_ok = (jnp.repeat(blocks >= 0, int(block), axis=-1) & (slot >= lo[:, None, None])
                & (slot < hi[:, None, None]))
        idx = jnp.concatenate([idx, slot], -1)
        ok = jnp.concatenate([ok, jnp.broadcast_to(r_ok[:, :, None], (B, K, T, slot.shape[-1]))],
                             -1)
    idx = jnp.concatenate([idx, jnp.broadcast_to(new_idx[:, None], (B, K, T_new))], -1)
    ok = jnp.concatenate([ok, jnp.broadcast_to(new_vis[:, None], (B, K, T, T_new))], -1)
    idx = jnp.clip(idx, 0, S - 1)  # [B, K, N]
    kg = jnp.take_along_axis(k_all, idx[..., None], axis=2).astype(jnp.float32)  # [B, K, N, D]
    vg = jnp.take_along_axis(v_all, idx[..., None], axis=2).astype(jnp.float32)
    q = (q_BTHD.astype(jnp.float32) * sm_scale).reshape(B, T, K, G, D)
    q = q.transpose(0, 2, 3, 1, 4)[:, :, :, :, None, :]  # [B, K, G, T, 1, D]
    ok = ok[:, :, None]  # [B, K, 1, T, N]
    s = fixed_sum(q * kg[:, :, None, None], -1)  # [B, K, G, T, N]
    s = jnp.where(ok, s, -jnp.inf)
    mx = fixed_max(s, -1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.where(ok, jnp.exp(s - mx), 0.0)
    den = fixed_sum(p, -1)
    vg = jnp.where(ok[..., None], vg[:, :, None, None], 0.0)  # garbage in masked slots stays out
    o = fixed_sum(p[..., None] * vg, -2) / jnp.where(den > 0, den, 1.0)[..., None]
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q_BTHD.dtype)


def block_scores(q_BTHD, k_BKSD, lengths, *, block: int, sm_scale=None):
    """`jaxspec.retrieval.block_scores` (the largest logit ``q . k * sm_scale`` of the queries
    over each block of ``block`` context slots: ``[B, K, cdiv(S, block)]``, -inf for a block
    without context) with each logit a `fixed_sum` over the head dim, block by block: a block's
    score depends on its row's queries and keys only (a maximum is exact in any order), so the
    blocks a retrieving self-draft selects do not depend on the batch."""
    B, T, H, D = q_BTHD.shape
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    G = H // K
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    n = -(-S // block)
    k = jnp.pad(k_BKSD, ((0, 0), (0, 0), (0, n * block - S), (0, 0)))
    q = q_BTHD.astype(jnp.float32).reshape(B, T, K, G, D).transpose(0, 2, 3, 1, 4)
    q = q[:, :, :, :, None, :]  # [B, K, G, T, 1, D]
    L = lengths.astype(jnp.int32)

    def one(i):
        kb = jax.lax.dynamic_slice_in_dim(k, i * block, block, axis=2).astype(jnp.float32)
        s = fixed_sum(q * kb[:, :, None, None], -1) * sm_scale  # [B, K, G, T, block]
        slot = i * block + jnp.arange(block, dtype=jnp.int32)
        s = jnp.where(slot < L[:, None, None, None, None], s, -jnp.inf)
        return jnp.max(s, axis=(2, 3, 4))  # [B, K]

    return jax.lax.map(one, jnp.arange(n, dtype=jnp.int32)).transpose(1, 2, 0)
