"""The one attention function the model calls, and the plan that says which keys each query sees.

A model step appends T_new new tokens per sequence at slots ``plan.lengths[b] + j`` (j < T_new) and
computes the LAST T of them (the forward's T input tokens): input token t is new token
``T_new - T + t``, its keys/values are written at slot ``plan.lengths[b] + T_new - T + t``, and the
first ``T_new - T`` new tokens' K/V must already be in the cache (written by an earlier forward, e.g.
the previous levels of a token tree). ``T_new`` is `AttentionPlan.new_tokens`: ``plan.num_new``,
else ``mask.shape[-1]``, else T (the usual case: every new token is computed). The context of
sequence b is slots ``[0, plan.lengths[b])``. Query t sees every context slot (or only the
StreamingLLM sink + window slots when ``plan.sink``/``plan.window`` are set) and new-token slot j iff
``mask[t, j]`` (``mask`` ``[T, T_new]`` or ``[B, T, T_new]``; causal when None:
``j <= t + T_new - T``). Positions (for RoPE) are passed to the model separately, so a token-tree node
at slot ``length + i`` may sit at position ``length + depth(i)``.

`attend` dispatches to the Pallas kernel (`pallas_kernels.decode_attention`) on GPU/TPU and to the
plain-`jnp` path here on CPU (or when asked). The `jnp` sparse path gathers only the sink and window
slots, so it reads ``sink + window + T_new`` keys per sequence no matter how long the context is.
Every path supports ``T_new > T``: the Triton kernel, the Mosaic TPU kernel (`pallas_kernels.tpu`),
the `jnp` paths here, and the shared-prefix paths (`jaxspec.prefix`), per shard on a mesh too.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

IMPLEMENTATIONS = ("auto", "xla", "pallas", "interpret", "none")  # none: profiling only


@struct.dataclass
class AttentionPlan:
    """Which keys each of the T queries (the last T of the T_new new tokens) sees (see module
    docstring)."""

    lengths: jax.Array  # [B] int32: context slots per sequence; new K/V go to lengths + j
    # [T, T_new] or [B, T, T_new] bool: query t (new token T_new - T + t) sees new token j;
    # None = causal
    mask: jax.Array | None = None
    sink: int | None = struct.field(pytree_node=False, default=None)
    window: int | None = struct.field(pytree_node=False, default=None)
    impl: str = struct.field(pytree_node=False, default="auto")
    # shared-prefix segments before the context (`jaxspec.prefix.SharedPrefix`); None: none
    prefix: Any = None
    # [B] bool or None: rows whose attention output is used. An inactive row (a finished
    # sequence, an idle server slot) attends to no context, so the kernel reads none of its
    # cache; its K/V are still written at their slots and its output is garbage (finite).
    active: jax.Array | None = None
    # T_new, the new tokens (static): None = mask.shape[-1] with a mask, else the T computed
    num_new: int | None = struct.field(pytree_node=False, default=None)

    @property
    def sparse(self) -> bool:
        return self.sink is not None or self.window is not None

    def new_tokens(self, T: int) -> int:
        """T_new for a forward computing T tokens (the last T of the T_new new ones)."""
        return _num_new(T, self.mask, self.num_new)


def _num_new(T: int, mask, num_new) -> int:
    """T_new: ``mask.shape[-1]`` with a mask (``num_new`` must then agree), else ``num_new``,
    else T; at least T (the kernels' own rule)."""
    from pallas_kernels.decode_attention import resolve_num_new
    return resolve_num_new(T, mask, num_new)


def _new_token_mask(mask, B: int, T: int, T_new: int | None = None) -> jax.Array:
    """[B, T, T_new] bool visibility of the new tokens for the T queries (the last T of them)."""
    T_new = T if T_new is None else T_new
    if mask is None:
        m = jnp.tri(T, T_new, T_new - T, dtype=bool)
    else:
        m = jnp.asarray(mask, dtype=bool)
    if m.ndim == 2:
        m = m[None]
    return jnp.broadcast_to(m, (B, T, T_new))


def _softmax_attend(q_BTHD, k_BKND, v_BKND, visible_BTN, sm_scale):
    """Masked softmax attention of q over n gathered keys per sequence; returns (out, lse)."""
    B, T, H, D = q_BTHD.shape
    K = k_BKND.shape[1]
    G = H // K
    q = q_BTHD.reshape(B, T, K, G, D)
    s = jnp.einsum("btkgd,bknd->bkgtn", q, k_BKND, preferred_element_type=jnp.float32) * sm_scale
    vis = visible_BTN[:, None, None, :, :]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(s - m_safe), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    # Garbage (even NaN) in invisible slots must not leak through p @ v (0 * NaN = NaN).
    vis_kn = jnp.any(visible_BTN, axis=1)[:, None, :, None]  # [B, 1, N, 1]
    v = jnp.where(vis_kn, v_BKND, jnp.zeros((), v_BKND.dtype))
    o = jnp.einsum("bkgtn,bknd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o / jnp.where(denom > 0, denom, 1.0)
    lse = jnp.where(denom[..., 0] > 0, m_safe[..., 0] + jnp.log(jnp.maximum(denom[..., 0], 1e-30)),
                    -jnp.inf)
    out = o.transpose(0, 3, 1, 2, 4).reshape(B, T, H, D).astype(q_BTHD.dtype)
    lse = lse.transpose(0, 3, 1, 2).reshape(B, T, H)
    return out, lse


def attention_xla(q_BTHD, k_BKSD, v_BKSD, lengths, mask=None, *, sink=None, window=None,
                  sm_scale=None, num_new=None):
    """Plain-`jnp` attention over a cache laid out ``[B, K, S, D]``; returns ``(out, lse)``.

    The T queries are the last T of ``num_new`` new tokens (default: ``mask.shape[-1]``, else T);
    see the module docstring. Dense: one pass over all S slots with a visibility mask. Sparse
    (sink/window): gathers only ``sink`` + ``window`` context slots and the T_new new slots per
    sequence.
    """
    B, T, H, D = q_BTHD.shape
    S = k_BKSD.shape[2]
    out_dtype = q_BTHD.dtype
    if _backend() == "cpu" and q_BTHD.dtype != jnp.float32:
        # XLA's CPU backend has no fast 16-bit matmuls: attend in float32 there.
        out, lse = attention_xla(q_BTHD.astype(jnp.float32), k_BKSD.astype(jnp.float32),
                                 v_BKSD.astype(jnp.float32), lengths, mask, sink=sink,
                                 window=window, sm_scale=sm_scale, num_new=num_new)
        return out.astype(out_dtype), lse
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    lengths = lengths.astype(jnp.int32)
    T_new = _num_new(T, mask, num_new)
    new_mask = _new_token_mask(mask, B, T, T_new)  # [B, T, T_new]
    if sink is None and window is None:
        s_idx = jnp.arange(S, dtype=jnp.int32)
        rel = s_idx[None, :] - lengths[:, None]  # [B, S]
        in_ctx = rel < 0
        in_new = (rel >= 0) & (rel < T_new)
        relc = jnp.clip(rel, 0, T_new - 1)
        new_vis = jnp.take_along_axis(new_mask, jnp.broadcast_to(relc[:, None, :], (B, T, S)), axis=2)
        visible = in_ctx[:, None, :] | (in_new[:, None, :] & new_vis)  # [B, T, S]
        return _softmax_attend(q_BTHD, k_BKSD, v_BKSD, visible, sm_scale)
    sink = int(sink or 0)
    window = int(window or 0)
    sink_idx = jnp.broadcast_to(jnp.arange(sink, dtype=jnp.int32)[None], (B, sink))
    win_idx = lengths[:, None] - window + jnp.arange(window, dtype=jnp.int32)[None]
    new_idx = lengths[:, None] + jnp.arange(T_new, dtype=jnp.int32)[None]
    idx = jnp.concatenate([sink_idx, win_idx, new_idx], axis=1)  # [B, N]
    sink_ok = sink_idx < lengths[:, None]
    win_ok = (win_idx >= sink) & (win_idx >= 0)
    ctx_ok = jnp.concatenate([sink_ok, win_ok], axis=1)  # [B, sink + window]
    visible = jnp.concatenate(
        [jnp.broadcast_to(ctx_ok[:, None, :], (B, T, sink + window)), new_mask], axis=2)
    idx_c = jnp.clip(idx, 0, S - 1)
    gather = lambda c: jnp.take_along_axis(c, idx_c[:, None, :, None], axis=2)
    return _softmax_attend(q_BTHD, gather(k_BKSD), gather(v_BKSD), visible, sm_scale)


def _backend() -> str:
    return jax.default_backend()


def attend(q_BTHD, k_LBKSD, v_LBKSD, layer, plan: AttentionPlan, *, sm_scale=None):
    """Attention of the T queries (the last T of ``plan.new_tokens(T)`` new tokens) of one layer
    over the stacked cache ``[L, B, K, S, D]``."""
    impl = plan.impl
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {impl!r}; choose from {IMPLEMENTATIONS}")
    if impl == "none":  # profiling: the step without attention (not a model!)
        return jnp.zeros_like(q_BTHD)
    if plan.active is not None:  # finished rows: no context read (their output is discarded)
        plan = plan.replace(lengths=jnp.where(plan.active, plan.lengths, 0), active=None)
    num_new = plan.new_tokens(q_BTHD.shape[1])
    if plan.prefix is not None:  # shared prefix (Hydragen): prefix part + suffix part, merged
        from jaxspec.prefix import attend_with_prefix
        return attend_with_prefix(q_BTHD, k_LBKSD, v_LBKSD, layer, plan, sm_scale=sm_scale)
    use_kernel = impl in ("pallas", "interpret") or (impl == "auto" and _backend() in ("gpu", "tpu"))
    if use_kernel:
        kernel = _kernel()
        if kernel is not None:
            def run_kernel(q, k, v, lengths, mask, layer):
                return kernel(q, k, v, lengths, mask, layer=layer, sink=plan.sink,
                              window=plan.window, sm_scale=sm_scale, num_new=num_new,
                              interpret=True if impl == "interpret" else None)[0]
            return _per_shard(run_kernel, q_BTHD, k_LBKSD, v_LBKSD, plan.lengths, plan.mask, layer)
        if impl != "auto":
            raise RuntimeError("attention implementation 'pallas' requested but pallas_kernels "
                               "is not available")
    def run_xla(q, k_all, v_all, lengths, mask, layer):
        k = jax.lax.dynamic_index_in_dim(k_all, layer, axis=0, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(v_all, layer, axis=0, keepdims=False)
        return attention_xla(q, k, v, lengths, mask, sink=plan.sink, window=plan.window,
                             sm_scale=sm_scale, num_new=num_new)[0]
    return _per_shard(run_xla, q_BTHD, k_LBKSD, v_LBKSD, plan.lengths, plan.mask, layer)


def _per_shard(fn, *args):
    """fn(*args) per shard inside `jax.shard_map` when a ("data", "model") mesh is active
    (`jaxspec.sharding.per_shard_attention`), else directly."""
    from jaxspec.sharding import per_shard_attention
    return per_shard_attention(fn, *args)


@functools.cache
def _kernel():
    try:
        from pallas_kernels import decode_attention
    except Exception:  # noqa: BLE001 - kernels are optional until they land
        return None
    return decode_attention
