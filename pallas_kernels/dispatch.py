"""The router: which kernel serves an attention call, chosen in one place.

Entry points (contracts in ``decode_attention.py`` and ``prefix_attention.py``):
``decode_attention``, ``paged_decode_attention`` (the decode contract over a paged cache,
``triton_paged``), ``prefix_attention``, ``multi_level_prefix_attention``. Each checks its
arguments (``contracts``), asks ``decode_route`` / ``prefix_route`` for a kernel and calls it.

The platform is ``jax.default_backend()``, or the one ``target_platform`` names while
tracing (e.g. to export a TPU program on a CPU machine). The routes, in order:

decode / verify (``decode_route``):
  1. ``"tpu"``: a TPU platform and ``interpret`` not set: the Mosaic TPU kernel
     (``tpu.tpu_decode_attention``; ``block_sizes`` used if a ``TPUDecodeBlockSizes``);
  2. ``"hopper"``: ``block_sizes`` a ``hopper.HopperBlockSizes`` (dense bf16/f16 only; raises
     where the inputs do not fit or no Hopper GPU is there and ``interpret`` is not set), or
     by default on a Hopper GPU for dense bf16/f16 attention with at least
     ``HOPPER_MIN_ROWS_VERIFY`` query rows (T x G) per KV head (``hopper.verify_attention``);
  3. ``"triton"``: ``interpret=True`` (the Pallas interpreter, any backend) or a GPU with the
     Triton backend (``triton_decode``);
  4. ``"reference"``: elsewhere (CPU): ``reference.decode_attention_reference``.

paged decode / verify (``paged_decode_route``; K/V in a block pool read through block tables):
  1. ``"hopper-gathered"``: on a Hopper GPU, without ``block_sizes``, for dense bf16/f16
     attention (no sink / window, no block scores or retrieved blocks) with a head dim the Hopper
     kernel supports, pages of a multiple of 8 slots, at least ``PAGED_HOPPER_MIN_ROWS`` query
     rows (T x G) per KV head (a prompt chunk's prefill) and tables of at most
     ``PAGED_HOPPER_MAX_SLOTS_PER_TOKEN`` x T slots: the sequences' blocks of the layer gathered
     into a dense cache (``reference.gather_pages``) and the Hopper kernel over it
     (``_gathered_hopper``). With that many rows per key the attention is bound by matrix
     throughput, where the Hopper kernel's wgmma pipeline beats the Triton one's; the copy is
     of the whole table whatever the lengths, which the second bound keeps small against the
     chunk's own work;
  2. ``"triton"``: ``interpret=True`` (the Pallas interpreter, any backend) or a GPU with the
     Triton backend (``triton_paged``);
  3. ``"reference"``: elsewhere (CPU, TPU): ``reference.paged_decode_attention_reference``
     (the sequences' blocks gathered into a dense cache).

shared prefix (``prefix_route``):
  1. ``"tpu"``: as for decode (``tpu.tpu_prefix_attention``; a stacked layer is sliced out);
  2. ``"reference"``: neither ``interpret=True`` nor a GPU with Triton;
  3. ``"hopper"``: asked for by ``block_sizes``, or by default on a Hopper GPU for bf16/f16
     with at least ``HOPPER_MIN_ROWS_PREFIX`` rows (B/P x T x G) per group and KV head
     (``hopper.prefix_attention``);
  4. ``"triton"``: ``triton_prefix``.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Sequence
from typing import NamedTuple

import jax

from . import hopper, tpu
from .contracts import (check_decode_args, check_prefix_args, layer_slice,
                        prefix_lengths_or_full, resolve_sm_scale)
from .merge import merge_partials
from .reference import (block_max_reference, check_paged_decode_args,
                        decode_attention_reference, gather_pages, retrieved_attention_reference,
                        paged_decode_reference_impl, prefix_attention_reference,
                        prefix_reference_impl)
from .triton_core import BlockTileError, pltriton
from .triton_decode import DecodeAttentionBlockSizes, triton_decode_attention
from .triton_decode import GPU_DEFAULTS as DECODE_GPU_DEFAULTS
from .triton_paged import triton_paged_decode_attention
from .triton_prefix import PrefixAttentionBlockSizes, triton_prefix_attention
from .triton_prefix import GPU_DEFAULTS as PREFIX_GPU_DEFAULTS

# The Hopper (Mosaic GPU) kernel takes over from the Triton one from this many query rows
# (T x G) per KV head: there verification turns bound by matrix throughput, and the Hopper
# kernel's wgmma pipeline beats Triton's (benchmarks/hopper_attention_h100.md).
HOPPER_MIN_ROWS_VERIFY = 128
# ... and serves a paged cache from this many (its blocks gathered into a dense copy first: with
# fewer rows per key that copy would cost more than the faster products save), where the table
# holds at most this many slots per query token (the copy is of the whole table: on an H100 a
# 2048-token chunk over a 32k-slot table lost ~10% with no context and won 1.55x at 30k;
# benchmarks/server_mixed_qwen15_h100.md)
PAGED_HOPPER_MIN_ROWS = 2048
PAGED_HOPPER_MAX_SLOTS_PER_TOKEN = 16
# ... and serves a shared prefix from this many query rows (B/P x T x G) per group and KV
# head; with fewer, its 128-row tiles would be mostly padding.
HOPPER_MIN_ROWS_PREFIX = 256

GPU_PLATFORMS = ("gpu", "cuda", "rocm")


# --- the platform the routes are chosen for ------------------------------------------

_STATE = threading.local()


@contextlib.contextmanager
def target_platform(platform: str):
    """Trace the library's attention for ``platform`` instead of the default backend.

    ``decode_attention`` / ``prefix_attention`` choose their kernel when traced,
    by ``jax.default_backend()``. Inside this context they choose for
    ``platform`` ("tpu", "gpu", "cpu") instead, e.g. to export a TPU program on a
    CPU machine::

        with target_platform("tpu"):
            exported = jax.export.export(jax.jit(step), platforms=["tpu"])(*args)

    Functions jitted and traced inside the context keep the choice in their
    cache: trace them afresh outside it.
    """
    prev = getattr(_STATE, "platform", None)
    _STATE.platform = platform
    try:
        yield
    finally:
        _STATE.platform = prev


def dispatch_platform() -> str:
    """The platform the kernels dispatch for: ``target_platform``'s, else the default backend."""
    forced = getattr(_STATE, "platform", None)
    return forced if forced is not None else jax.default_backend()


# --- routes ----------------------------------------------------------------------------

class Route(NamedTuple):
    """A routing decision: ``kernel`` is "tpu", "hopper", "hopper-gathered" (paged: the Hopper
    kernel over a dense copy of the blocks), "triton" or "reference";
    ``block_sizes`` what that kernel is called with (None: its defaults); ``on_gpu``: the
    platform is a GPU and the kernel is compiled, not interpreted."""
    kernel: str
    block_sizes: object
    on_gpu: bool


def _triton_sizes(block_sizes, cls, defaults):
    if block_sizes is None:
        return defaults
    if not isinstance(block_sizes, cls):
        raise TypeError(f"block_sizes must be a {cls.__name__} for the Triton kernel (or "
                        f"None), got {type(block_sizes).__name__}")
    return block_sizes


def decode_route(q, k_cache, *, block_sizes=None, sink=None, window=None,
                 interpret=None) -> Route:
    """Which kernel ``decode_attention`` runs for these arguments (see the module doc)."""
    platform = dispatch_platform()
    on_gpu = platform in GPU_PLATFORMS
    if platform == "tpu" and not interpret:
        tpu_sizes = block_sizes if isinstance(block_sizes, tpu.TPUDecodeBlockSizes) else None
        return Route("tpu", tpu_sizes, False)
    B, T, H, D = q.shape
    K, S = k_cache.shape[-3], k_cache.shape[-2]
    fits = hopper.supports(q.dtype, D) and k_cache.dtype == q.dtype and S % 8 == 0
    if isinstance(block_sizes, hopper.HopperBlockSizes):
        if sink or window:
            raise ValueError("the Hopper kernel does dense attention only (no sink / window)")
        hopper.check_requested(fits, f"bf16/f16 q and cache of one dtype, D % 64 == 0 and "
                               f"S % 8 == 0; got {q.dtype}/{k_cache.dtype}, D={D}, S={S}",
                               interpret)
        return Route("hopper", block_sizes, on_gpu and not interpret)
    if (block_sizes is None and on_gpu and not interpret and not sink and not window and fits
            and T * (H // K) >= HOPPER_MIN_ROWS_VERIFY
            and hopper.default_block_sizes(D) is not None and hopper.available()):
        return Route("hopper", hopper.default_block_sizes(D), True)
    if not (bool(interpret) or (on_gpu and pltriton is not None)):
        return Route("reference", None, False)
    return Route("triton", _triton_sizes(block_sizes, DecodeAttentionBlockSizes,
                                         DECODE_GPU_DEFAULTS), on_gpu and not interpret)


def paged_decode_route(q, k_pages, *, block_sizes=None, sink=None, window=None,
                       interpret=None, table_slots=None) -> Route:
    """Which kernel ``paged_decode_attention`` runs for these arguments (see the module doc);
    ``table_slots``: MB x BS of the block tables (None: no bound)."""
    on_gpu = dispatch_platform() in GPU_PLATFORMS
    B, T, H, D = q.shape
    K, BS = k_pages.shape[-3], k_pages.shape[-2]
    if (block_sizes is None and on_gpu and not interpret and not sink and not window
            and BS % 8 == 0
            and hopper.supports(q.dtype, D) and k_pages.dtype == q.dtype
            and T * (H // K) >= PAGED_HOPPER_MIN_ROWS
            and (table_slots is None or table_slots <= PAGED_HOPPER_MAX_SLOTS_PER_TOKEN * T)
            and hopper.default_block_sizes(D) is not None and hopper.available()):
        return Route("hopper-gathered", hopper.default_block_sizes(D), True)
    if not (bool(interpret) or (on_gpu and pltriton is not None)):
        return Route("reference", None, False)
    return Route("triton", _triton_sizes(block_sizes, DecodeAttentionBlockSizes,
                                         DECODE_GPU_DEFAULTS), on_gpu and not interpret)


def prefix_route(q, k_prefix, *, block_sizes=None, interpret=None) -> Route:
    """Which kernel ``prefix_attention`` runs for these arguments (see the module doc)."""
    platform = dispatch_platform()
    on_gpu = platform in GPU_PLATFORMS
    if platform == "tpu" and not interpret:
        tpu_sizes = block_sizes if isinstance(block_sizes, tpu.TPUPrefixBlockSizes) else None
        return Route("tpu", tpu_sizes, False)
    if not (bool(interpret) or (on_gpu and pltriton is not None)):
        return Route("reference", None, False)
    B, T, H, D = q.shape
    P, L, K = k_prefix.shape[-4:-1]
    fits = hopper.supports(q.dtype, D) and k_prefix.dtype == q.dtype and L % 8 == 0
    if isinstance(block_sizes, hopper.HopperBlockSizes):
        hopper.check_requested(fits, f"bf16/f16 q and prefix of one dtype with D % 64 == 0 "
                               f"and L % 8 == 0; got {q.dtype}/{k_prefix.dtype}, D={D}, L={L}",
                               bool(interpret))
        return Route("hopper", block_sizes, on_gpu and not interpret)
    if (block_sizes is None and on_gpu and not interpret and fits
            and (B // P) * T * (H // K) >= HOPPER_MIN_ROWS_PREFIX
            and hopper.default_block_sizes(D) is not None and hopper.available()):
        return Route("hopper", hopper.default_block_sizes(D), True)
    return Route("triton", _triton_sizes(block_sizes, PrefixAttentionBlockSizes,
                                         PREFIX_GPU_DEFAULTS), on_gpu and not interpret)


# --- entry points ---------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("sm_scale", "num_new", "block_sizes", "interpret"))
def _verify_hopper(q, k_cache, v_cache, lengths, tree_mask, layer, *, sm_scale, num_new,
                   block_sizes, interpret):
    return hopper.verify_attention(q, k_cache, v_cache, lengths, tree_mask, layer=layer,
                                   sm_scale=sm_scale, num_new=num_new, block_sizes=block_sizes,
                                   interpret=interpret)


def _gathered_hopper(q, k_pages, v_pages, block_table, lengths, tree_mask, layer, *, sm_scale,
                     num_new, block_sizes, interpret):
    """The ``"hopper-gathered"`` route: each sequence's blocks of the layer in table order as a
    dense ``[B, K, MB * BS, D]`` cache, and the Hopper kernel over it (``interpret``: in the
    Pallas interpreter, for tests on any backend)."""
    lay = layer if k_pages.ndim == 5 else None
    return _verify_hopper(q, gather_pages(k_pages, block_table, lay),
                          gather_pages(v_pages, block_table, lay), lengths, tree_mask, None,
                          sm_scale=sm_scale, num_new=num_new, block_sizes=block_sizes,
                          interpret=interpret)


def _between(lengths, sink, window):
    """Per row, the context slots ``[lo, hi)`` between a sparse view's sink and its window."""
    lo = jax.numpy.minimum(int(sink or 0), lengths)
    return lo, jax.numpy.maximum(lengths - int(window or 0), lo)


def decode_attention(q, k_cache, v_cache, lengths, tree_mask=None, *, layer=None,
                     sink=None, window=None, sm_scale=None, interpret=None,
                     block_sizes=None, num_new=None, score_block=None, retrieved=None,
                     retrieve_block=None):
    """Decode / verify attention of the last T of T_new new tokens over a ragged KV cache.

    Args:
      q: ``[B, T, H, D]`` queries of the last T of the T_new new tokens (query t
        is new token ``T_new - T + t``).
      k_cache, v_cache: ``[B, K, S, D]`` (or ``[L, B, K, S, D]`` with ``layer``);
        the new tokens' K/V already written at slots ``lengths[b] + [0, T_new)``.
        Requires ``lengths[b] + T_new <= S``.
      lengths: ``[B]`` int32 context lengths (>= 0).
      tree_mask: None (causal among new tokens: query t sees new token j iff
        ``j <= t + T_new - T``), ``[T, T_new]`` or ``[B, T, T_new]`` bool: query t
        sees new token j iff ``tree_mask[t, j]``; T_new = its last dim.
      num_new: static int T_new (>= T) for the causal case; None: T (or, with a
        ``tree_mask``, its last dim, which it must then equal).
      layer: None, or a scalar int (may be traced) selecting the layer of stacked
        caches; the cache is not sliced outside the kernel.
      sink, window: static ints; if either is set, only context slots
        ``s < sink`` or ``s >= lengths[b] - window`` are visible (and read).
      sm_scale: logit scale (default ``1/sqrt(D)``).
      interpret: None: kernel on GPU, the Mosaic kernel (``tpu.py``) on TPU,
        reference on CPU; True: the portable kernel in Pallas interpret mode (any
        backend); False: as None.
      block_sizes: ``DecodeAttentionBlockSizes`` (None: tuned defaults), on TPU a
        ``TPUDecodeBlockSizes``, or a ``hopper.HopperBlockSizes`` for the Hopper (Mosaic
        GPU) kernel (dense, bf16/f16; with ``interpret=True`` its CPU interpreter). None
        on a Hopper GPU picks that kernel for >= ``HOPPER_MIN_ROWS_VERIFY`` rows per KV head.
      score_block: None, or a static int (dense attention only): also return each row's and
        KV head's largest logit ``q . k * sm_scale`` over the T queries and the G query heads
        of the group per block of ``score_block`` context slots, ``[B, K, cdiv(S,
        score_block)]`` float32, -inf for a block without a context slot (the self-draft's
        retrieval, ``jaxspec.retrieval``). The Triton kernel writes them while it reads the
        keys; elsewhere ``reference.block_max_reference`` computes them.
      retrieved, retrieve_block: with a sparse view (sink / window) only: ``[B, K, R]`` int32
        block indices (-1: none) per row and KV head, each naming the ``retrieve_block``
        context slots ``[j * retrieve_block, (j + 1) * retrieve_block)``, visible to every
        query besides the sink and window; they must lie between the two (disjoint from both).
        The Triton kernel reads them in place; elsewhere
        ``reference.retrieved_attention_reference`` attends to them and the parts merge.

    Returns:
      ``(out [B, T, H, D] in q.dtype, lse [B, T, H] float32)``, and the scores last with
      ``score_block``; a query that saw no key gets ``out = 0`` and ``lse = -inf``.
    """
    T_new = check_decode_args(q, k_cache, v_cache, lengths, tree_mask, layer, num_new)
    sm_scale = resolve_sm_scale(sm_scale, q.shape[-1])
    route = decode_route(q, k_cache, block_sizes=block_sizes, sink=sink, window=window,
                         interpret=interpret)
    if retrieved is not None:
        if not (sink or window):
            raise ValueError("retrieved blocks go with a sparse view (sink / window)")
        if route.kernel == "triton":
            try:
                return triton_decode_attention(
                    q, k_cache, v_cache, lengths, tree_mask, layer, sink=int(sink or 0),
                    window=int(window or 0), sm_scale=sm_scale, interpret=bool(interpret),
                    block_sizes=route.block_sizes, on_gpu=route.on_gpu, num_new=T_new,
                    retrieved=retrieved, retrieve_block=int(retrieve_block))
            except BlockTileError:  # the tile does not fit: the sparse kernel + the reference
                pass
        o, lse = decode_attention(q, k_cache, v_cache, lengths, tree_mask, layer=layer,
                                  sink=sink, window=window, sm_scale=sm_scale,
                                  interpret=interpret, block_sizes=block_sizes, num_new=T_new)
        stack = k_cache.ndim == 5
        lo, hi = _between(lengths, sink, window)
        o2, lse2 = retrieved_attention_reference(
            q, k_cache if stack else k_cache[None], v_cache if stack else v_cache[None],
            layer if stack else 0, retrieved, block=int(retrieve_block), sm_scale=sm_scale,
            lo=lo, hi=hi)
        return merge_partials([o[None], o2[None]], [lse[None], lse2[None]], o.dtype)
    if score_block is not None:
        if sink or window:
            raise ValueError("score_block needs dense attention (no sink / window)")
        if route.kernel == "triton":
            try:
                return triton_decode_attention(
                    q, k_cache, v_cache, lengths, tree_mask, layer, sink=0, window=0,
                    sm_scale=sm_scale, interpret=bool(interpret), block_sizes=route.block_sizes,
                    on_gpu=route.on_gpu, num_new=T_new, score_block=int(score_block))
            except BlockTileError:  # the tile does not fit: the kernel + the reference's scores
                pass
        o, lse = decode_attention(q, k_cache, v_cache, lengths, tree_mask, layer=layer,
                                  sm_scale=sm_scale, interpret=interpret,
                                  block_sizes=block_sizes, num_new=T_new)
        k = k_cache if layer is None else jax.lax.dynamic_index_in_dim(k_cache, layer, 0, False)
        return o, lse, block_max_reference(q, k, lengths, block=int(score_block),
                                           sm_scale=sm_scale)
    if route.kernel == "tpu":
        return tpu.tpu_decode_attention(
            q, k_cache, v_cache, lengths, tree_mask, layer=layer, sink=sink, window=window,
            sm_scale=sm_scale, num_new=T_new, block_sizes=route.block_sizes)
    if route.kernel == "hopper":
        return _verify_hopper(q, k_cache, v_cache, lengths, tree_mask, layer,
                              sm_scale=sm_scale, num_new=T_new, block_sizes=route.block_sizes,
                              interpret=bool(interpret))
    if route.kernel == "reference":
        return decode_attention_reference(q, k_cache, v_cache, lengths, tree_mask, layer=layer,
                                          sink=sink, window=window, sm_scale=sm_scale,
                                          num_new=T_new)
    return triton_decode_attention(
        q, k_cache, v_cache, lengths, tree_mask, layer, sink=int(sink or 0),
        window=int(window or 0), sm_scale=sm_scale, interpret=bool(interpret),
        block_sizes=route.block_sizes, on_gpu=route.on_gpu, num_new=T_new)


def paged_decode_attention(q, k_pages, v_pages, block_table, lengths, tree_mask=None, *,
                           layer=None, sink=None, window=None, sm_scale=None, num_new=None,
                           interpret=None, block_sizes=None, score_block=None, retrieved=None,
                           retrieve_block=None):
    """``decode_attention`` over a paged K/V cache: a block pool read through block tables.

    Args:
      q: ``[B, T, H, D]`` queries of the last T of the T_new new tokens.
      k_pages, v_pages: block pools ``[L, NB, K, BS, D]`` (with ``layer``) or
        ``[NB, K, BS, D]``: NB blocks of BS slots (for the kernel: BS a power of 2, or a
        multiple of 16).
      block_table: ``[B, MB]`` int: sequence b's logical slot ``s`` is in block
        ``block_table[b, s // BS]`` at offset ``s % BS``. The blocks must hold slots
        ``[0, lengths[b] + T_new)`` (the new tokens' K/V already written there), so
        ``lengths[b] + T_new <= MB * BS``; later entries may hold anything (e.g. NB for
        "no block"): they are never read into a result.
      lengths, tree_mask, num_new, layer, sink, window, sm_scale: as ``decode_attention``.
      interpret: None: a kernel on a GPU (the Triton one, or for a prompt chunk on a Hopper
        GPU the Hopper one over a gathered copy: the module doc's ``"hopper-gathered"``), the
        reference elsewhere (CPU, TPU); True: the Triton kernel in Pallas interpret mode (any
        backend); False: as None.
      block_sizes: ``DecodeAttentionBlockSizes`` for the Triton kernel (None: defaults; a given
        value keeps the Triton kernel); ``block_k`` and ``block_k_new`` must each divide BS or
        be a multiple of it (by default they are chosen so).

    Returns:
      ``(out [B, T, H, D] in q.dtype, lse [B, T, H] float32)`` exactly as
      ``decode_attention`` over the dense cache the tables describe; a query that saw no key
      gets ``out = 0`` and ``lse = -inf``. ``score_block`` and ``retrieved`` /
      ``retrieve_block``: as ``decode_attention``'s (slots are logical slots); the scores come
      last.
    """
    T_new = check_paged_decode_args(q, k_pages, v_pages, block_table, lengths, tree_mask, layer,
                                    num_new)
    sm_scale = resolve_sm_scale(sm_scale, q.shape[-1])
    route = paged_decode_route(q, k_pages, block_sizes=block_sizes, sink=sink, window=window,
                               interpret=interpret,
                               table_slots=block_table.shape[1] * k_pages.shape[-2])
    if route.kernel == "hopper-gathered" and retrieved is None and score_block is None:
        return _gathered_hopper(q, k_pages, v_pages, block_table, lengths, tree_mask, layer,
                                sm_scale=sm_scale, num_new=T_new, block_sizes=route.block_sizes,
                                interpret=False)
    if route.kernel == "hopper-gathered":  # (block scores / retrieved blocks: the Triton kernel)
        route = Route("triton", DECODE_GPU_DEFAULTS, True)
    if retrieved is not None or score_block is not None:
        if (retrieved is not None) != bool(sink or window):
            raise ValueError("retrieved blocks go with a sparse view (sink / window), block "
                             "scores with a dense one")
        if route.kernel == "triton":
            try:
                return triton_paged_decode_attention(
                    q, k_pages, v_pages, block_table, lengths, tree_mask, layer,
                    sink=int(sink or 0), window=int(window or 0), sm_scale=sm_scale,
                    interpret=bool(interpret), block_sizes=route.block_sizes,
                    on_gpu=route.on_gpu, num_new=T_new, score_block=score_block,
                    retrieved=retrieved, retrieve_block=retrieve_block)
            except BlockTileError:  # the tile does not fit: the kernel + the references
                pass
        o, lse = paged_decode_attention(q, k_pages, v_pages, block_table, lengths, tree_mask,
                                        layer=layer, sink=sink, window=window,
                                        sm_scale=sm_scale, num_new=T_new, interpret=interpret,
                                        block_sizes=block_sizes)
        pool = k_pages if k_pages.ndim == 5 else k_pages[None]
        lay = layer if k_pages.ndim == 5 else 0
        if score_block is not None:
            return o, lse, block_max_reference(q, gather_pages(pool, block_table, lay), lengths,
                                               block=int(score_block), sm_scale=sm_scale)
        lo, hi = _between(lengths, sink, window)
        o2, lse2 = retrieved_attention_reference(
            q, pool, v_pages if v_pages.ndim == 5 else v_pages[None], lay, retrieved,
            block=int(retrieve_block), sm_scale=sm_scale, block_table=block_table, lo=lo, hi=hi)
        return merge_partials([o[None], o2[None]], [lse[None], lse2[None]], o.dtype)
    if route.kernel == "reference":
        return paged_decode_reference_impl(q, k_pages, v_pages, block_table, lengths, tree_mask,
                                           layer, sink=int(sink or 0), window=int(window or 0),
                                           sm_scale=sm_scale, num_new=T_new)
    return triton_paged_decode_attention(
        q, k_pages, v_pages, block_table, lengths, tree_mask, layer, sink=int(sink or 0),
        window=int(window or 0), sm_scale=sm_scale, interpret=bool(interpret),
        block_sizes=route.block_sizes, on_gpu=route.on_gpu, num_new=T_new)


def prefix_attention(q, k_prefix, v_prefix, prefix_lengths=None, *, sm_scale=None,
                     interpret=None, block_sizes=None, layer=None, partials=False):
    """Attention of every query over its group's shared prefix (Hydragen).

    Args:
      q: ``[B, T, H, D]`` queries; sequences ``[p * B/P, (p + 1) * B/P)`` form
        group ``p``.
      k_prefix, v_prefix: ``[P, L, K, D]`` prefix keys (after RoPE) and values of
        the P groups; ``H`` must be a multiple of ``K``.
      prefix_lengths: ``[P]`` int32 valid prefix tokens per group (default L;
        values are clipped to [0, L]).
      layer: None, or an int32 scalar (may be traced) when ``k_prefix``/``v_prefix``
        are stacked over layers, ``[layers, P, L, K, D]``: the GPU kernels then read
        that layer in place (slicing it out first would copy it every call).
      sm_scale: logit scale (default ``1/sqrt(D)``).
      interpret: None: kernel on GPU, the Mosaic kernel (``tpu.py``) on TPU,
        reference on CPU; True: the portable kernel in Pallas interpret mode (any
        backend); False: as None.
      block_sizes: ``PrefixAttentionBlockSizes`` (None: defaults), or on TPU a
        ``TPUPrefixBlockSizes``, or a ``hopper.HopperBlockSizes`` for the Hopper (Mosaic
        GPU, wgmma) kernel (bf16/f16, D % 64 == 0, L % 8 == 0; with ``interpret=True`` it
        runs in the Mosaic GPU interpreter). None on a Hopper GPU picks that kernel for
        groups of at least ``HOPPER_MIN_ROWS_PREFIX`` query rows per KV head.
      partials: return the kernel's key splits unmerged, ``(out [S, B, T, H, D] in q.dtype,
        lse [S, B, T, H] float32)`` with S >= 1 (1 where the kernel has no splits), for a
        caller that merges them with the suffix part in one pass (``merge.merge_partials``
        over the concatenation): one merge instead of two. The engine does this.

    Returns:
      ``(out [B, T, H, D] in q.dtype, lse [B, T, H] float32)``; queries of a group
      with an empty prefix get ``out = 0`` and ``lse = -inf``.
    """
    # every path but the Hopper kernel's gives one partial
    one = (lambda r: (r[0][None], r[1][None])) if partials else (lambda r: r)
    check_prefix_args(q, k_prefix, v_prefix, prefix_lengths, layer)
    sm_scale = resolve_sm_scale(sm_scale, q.shape[-1])
    route = prefix_route(q, k_prefix, block_sizes=block_sizes, interpret=interpret)
    if route.kernel == "tpu":
        k_prefix, v_prefix = layer_slice(k_prefix, v_prefix, layer)
        return one(tpu.tpu_prefix_attention(q, k_prefix, v_prefix, prefix_lengths,
                                            sm_scale=sm_scale, block_sizes=route.block_sizes))
    lengths = prefix_lengths_or_full(prefix_lengths, *k_prefix.shape[-4:-2])
    if route.kernel == "reference":
        return one(prefix_reference_impl(q, *layer_slice(k_prefix, v_prefix, layer), lengths,
                                         sm_scale=sm_scale))
    if route.kernel == "hopper":
        return hopper.prefix_attention(q, k_prefix, v_prefix, lengths, layer, sm_scale=sm_scale,
                                       block_sizes=route.block_sizes, interpret=bool(interpret),
                                       partials=bool(partials))
    return one(triton_prefix_attention(
        q, k_prefix, v_prefix, lengths, layer, sm_scale=sm_scale, interpret=bool(interpret),
        block_sizes=route.block_sizes, on_gpu=route.on_gpu))


def multi_level_prefix_attention(q, levels: Sequence, *, sm_scale=None, interpret=None,
                                 block_sizes=None, reference: bool = False):
    """Attention over a tree of shared prefixes, as a list of levels.

    Each level is ``(k, v, lengths)`` with ``k, v[P_i, L_i, K, D]`` and its own
    group count ``P_i`` (``B % P_i == 0``; ``lengths`` may be None = full). E.g.
    level 0: one system prompt for everyone (``P = 1``); level 1: one document
    per group of questions (``P = number of documents``). A query sees every
    level's valid prefix of its group; the per-level results (each kernel's key splits
    unmerged) are merged in one pass (exact; empty levels contribute nothing).

    Merge the result with the per-sequence suffix part exactly like a single
    prefix level (see ``prefix_attention.py``).

    Args:
      q: ``[B, T, H, D]``.
      levels: sequence of ``(k, v, lengths)`` tuples (at least one).
      sm_scale, interpret, block_sizes: passed to every ``prefix_attention``
        call (``block_sizes`` may also be a sequence, one per level).
      reference: use ``prefix_attention_reference`` for every level.

    Returns:
      ``(out [B, T, H, D] in q.dtype, lse [B, T, H] float32)``.
    """
    levels = list(levels)
    if not levels:
        raise ValueError("need at least one prefix level")
    if not isinstance(block_sizes, Sequence):
        block_sizes = [block_sizes] * len(levels)
    if len(block_sizes) != len(levels):
        raise ValueError(f"{len(block_sizes)} block sizes for {len(levels)} levels")
    outs, lses = [], []  # partial attentions [S, B, T, H(, D)]: each level's key splits unmerged
    for level, bs in zip(levels, block_sizes):
        if len(level) != 3:
            raise ValueError("each level must be a (k, v, lengths) tuple")
        k, v, lengths = level
        if reference:
            o, l = prefix_attention_reference(q, k, v, lengths, sm_scale=sm_scale)
            o, l = o[None], l[None]
        else:
            o, l = prefix_attention(q, k, v, lengths, sm_scale=sm_scale, interpret=interpret,
                                    block_sizes=bs, partials=True)
        outs.append(o)
        lses.append(l)
    return merge_partials(outs, lses, q.dtype)
