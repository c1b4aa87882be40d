"""Shared prefixes (Hydragen): detect a common token prefix, prefill it once, attend to it once.

When many sequences share a prefix (a system prompt, one document with many questions, ``n``
samples of one prompt), the prefix is prefilled once into a `PrefixLevel` (one copy per group of
sequences) and every sequence's own cache holds only its suffix. Attention is then

    prefix part (all queries of a group against the group's prefix, one matrix product:
                 `pallas_kernels.prefix_attention`)  +  suffix part (the ragged per-sequence cache,
                 causal / tree mask: the usual decode path)  ->  merged exactly by log-sum-exp.

Levels: a list of prefixes one after the other (level 0: shared by all rows, ``P = 1``; level 1:
one per prompt when ``n`` samples are drawn per prompt, ...). Level ``i`` has ``P_i`` groups of
``B / P_i`` contiguous rows; each level's groups nest in the previous level's (``P_{i-1} | P_i``).

Positions: a row's suffix slot ``s`` holds position ``offset[b] + s`` (``offset`` = total prefix
length of the row). `PrefixedKVCache` carries the prefix next to the suffix cache; the model's
`forward` adds ``offset`` to the positions and puts the prefix into the attention plan, so the
decode and speculative loops run unchanged.

The StreamingLLM self-draft (``plan.sink`` / ``plan.window``) sees the same sparse view as without
sharing: positions ``< sink`` (from the prefix) and the last ``window`` positions (from the suffix
and, where the suffix is shorter than the window, the prefix's tail); it gathers only those slots.

A model with a sliding attention window (`jaxspec.model.sliding_window_of`) shares nothing: the
prefix attention has no window (`plan_sharing` repeats the rows instead, or refuses an explicit
prefix, and `jaxspec.attention.attend` refuses a prefix with a window).

Both paths take the plan's ``T_new >= T`` new tokens (`AttentionPlan.new_tokens`: the T queries are
the last T of them, e.g. one token-tree level over the earlier levels' K/V) as the decode path does.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.attention import AttentionPlan, _kernel, _new_token_mask, _softmax_attend, attention_xla
from jaxspec.cache import SLOT_ALIGN, KVCache, round_up

AUTO_MIN_TOKENS = 32  # shared_prefix="auto": share a common prefix only from this length on


# ----------------------------------------------------------------------------- pytrees
@struct.dataclass
class PrefixLevel:
    """One level of shared prefixes: ``P`` groups of up to ``Lp`` tokens, stacked over layers."""

    k: jax.Array  # [L, P, Lp, K, D] (the layout `prefix_attention` reads)
    v: jax.Array  # [L, P, Lp, K, D]
    lengths: jax.Array  # [P] int32 valid tokens per group
    start: jax.Array  # [P] int32 position of the group's first token (earlier levels' length)

    @property
    def groups(self) -> int:
        return self.k.shape[1]


@struct.dataclass
class SharedPrefix:
    levels: tuple  # of PrefixLevel
    offset: jax.Array  # [B] int32: position of suffix slot 0 of each row (its total prefix length)


@struct.dataclass
class PrefixedKVCache(KVCache):
    """A suffix `KVCache` plus the shared prefix its rows continue (see module docstring)."""

    prefix: SharedPrefix = None


def positions_of(cache):
    """Position of each row's next slot: ``cache.lengths`` (+ prefix offset for a prefixed cache)."""
    prefix = getattr(cache, "prefix", None)
    return cache.lengths if prefix is None else cache.lengths + prefix.offset


# ----------------------------------------------------------------------------- attention
def attend_with_prefix(q_BTHD, k_LBKSD, v_LBKSD, layer, plan: AttentionPlan, *, sm_scale=None):
    """`jaxspec.attention.attend` when ``plan.prefix`` is set (per shard under a mesh)."""
    from jaxspec.sharding import _active_mesh
    pre: SharedPrefix = plan.prefix
    B = q_BTHD.shape[0]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q_BTHD.shape[-1])
    fn = functools.partial(_sparse if plan.sparse else _dense, plan=plan, sm_scale=sm_scale,
                           batch=B, num_new=plan.new_tokens(q_BTHD.shape[1]))
    mesh = _active_mesh()
    mask = plan.mask
    layer = jnp.asarray(layer, jnp.int32)
    if mesh is None:
        rows = jnp.arange(B, dtype=jnp.int32)
        return fn(q_BTHD, k_LBKSD, v_LBKSD, plan.lengths, mask, layer, pre, rows, sharded=False)
    from jax.sharding import PartitionSpec as P
    kv = P(None, "data", "model", None, None)
    lvl = P(None, None, None, "model", None)
    pre_spec = SharedPrefix(levels=tuple(PrefixLevel(k=lvl, v=lvl, lengths=P(), start=P())
                                         for _ in pre.levels), offset=P("data"))
    args = [q_BTHD, k_LBKSD, v_LBKSD, plan.lengths, layer, pre,
            jnp.arange(B, dtype=jnp.int32)]
    specs = [P("data", None, "model", None), kv, kv, P("data"), P(), pre_spec, P("data")]
    if mask is not None:
        mask = jnp.asarray(mask)
        args.append(mask)
        specs.append(P("data", None, None) if mask.ndim == 3 and mask.shape[0] != 1 else P())

    def body(q, k, v, ln, lay, pr, rows, *m):
        return fn(q, k, v, ln, m[0] if m else None, lay, pr, rows, sharded=True)

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs),
                         out_specs=P("data", None, "model", None), check_vma=False)(*args)


def _use_kernel(impl: str) -> bool:
    return impl in ("pallas", "interpret") or (
        impl == "auto" and jax.default_backend() in ("gpu", "tpu"))


def _dense(q, k_all, v_all, lengths, mask, layer, pre: SharedPrefix, rows, *, plan, sm_scale,
           batch, sharded, num_new):
    """Suffix part (decode kernel / jnp, ragged, causal or tree mask) + one `prefix_attention`
    per level, merged by log-sum-exp in one pass: the prefix kernels' key splits come back
    unmerged (``partials=True``) and join the suffix part in the same merge."""
    from pallas_kernels import prefix_attention, prefix_attention_reference
    from pallas_kernels.merge import merge_partials
    impl = plan.impl
    interpret = True if impl == "interpret" else None
    kernel = _kernel() if _use_kernel(impl) else None
    if kernel is not None:
        o, lse = kernel(q, k_all, v_all, lengths, mask, layer=layer, sm_scale=sm_scale,
                        interpret=interpret, num_new=num_new)
    else:
        k = jax.lax.dynamic_index_in_dim(k_all, layer, axis=0, keepdims=False)
        v = jax.lax.dynamic_index_in_dim(v_all, layer, axis=0, keepdims=False)
        o, lse = attention_xla(q, k, v, lengths, mask, sm_scale=sm_scale, num_new=num_new)
    outs, lses = [o[None]], [lse[None]]  # partial attentions, each [S, B, T, H(, D)]
    Bl = q.shape[0]
    if kernel is None:
        def fn(*a, **kw):
            o, lse = prefix_attention_reference(*a, **kw)
            return o[None], lse[None]
    else:
        fn = functools.partial(prefix_attention, partials=True)
    for lv in pre.levels:
        n, ln = lv.groups, lv.lengths
        n_loc = n
        if sharded:  # this shard's rows: the groups they belong to (contiguous rows)
            gs = batch // n
            if Bl % gs and gs % Bl:
                raise ValueError(f"shared-prefix groups of {gs} rows do not align with "
                                 f"{Bl} rows per data shard")
            n_loc = max(1, Bl // gs)
        if n_loc == n:  # every group: the kernel reads this layer of the stack in place
            o, lse = fn(q, lv.k, lv.v, ln, sm_scale=sm_scale, interpret=interpret, layer=layer)
        else:  # this shard's groups of this layer (a copy of them)
            g0 = rows[0] // gs
            kp = jax.lax.dynamic_index_in_dim(lv.k, layer, axis=0, keepdims=False)  # [P, Lp, K, D]
            vp = jax.lax.dynamic_index_in_dim(lv.v, layer, axis=0, keepdims=False)
            kp = jax.lax.dynamic_slice_in_dim(kp, g0, n_loc, axis=0)
            vp = jax.lax.dynamic_slice_in_dim(vp, g0, n_loc, axis=0)
            ln = jax.lax.dynamic_slice_in_dim(ln, g0, n_loc, axis=0)
            o, lse = fn(q, kp, vp, ln, sm_scale=sm_scale, interpret=interpret)
        outs.append(o)
        lses.append(lse)
    return merge_partials(outs, lses, q.dtype)[0]


def _sparse(q, k_all, v_all, lengths, mask, layer, pre: SharedPrefix, rows, *, plan, sm_scale,
            batch, sharded, num_new):
    """The StreamingLLM view over [prefix levels | suffix]: positions ``< sink`` and the last
    ``window`` context positions, plus the new tokens. Gathers at most ``sink + window`` slots
    per level and ``sink + window + T_new`` from the suffix, then one masked softmax."""
    del sharded
    B, T, H, D = q.shape
    sink, window = int(plan.sink or 0), int(plan.window or 0)
    lengths = lengths.astype(jnp.int32)
    off = pre.offset.astype(jnp.int32)
    ctx = off + lengths  # [B] context positions before the new tokens
    ar_s = jnp.arange(sink, dtype=jnp.int32)[None]
    ar_w = jnp.arange(window, dtype=jnp.int32)[None]
    keys, vals, oks = [], [], []
    for lv in pre.levels:
        g = rows // (batch // lv.groups)  # [B] group of each row
        n_len, st = lv.lengths[g][:, None], lv.start[g][:, None]
        j_s = jnp.broadcast_to(ar_s, (B, sink))
        ok_s = (j_s < n_len) & (st + j_s < sink)
        j_w = (ctx[:, None] - window - st) + ar_w
        ok_w = (j_w >= 0) & (j_w < n_len) & (st + j_w >= sink)
        idx = jnp.clip(jnp.concatenate([j_s, j_w], 1), 0, lv.k.shape[2] - 1)  # [B, n]
        keys.append(lv.k[layer, g[:, None], idx])  # [B, n, K, D]
        vals.append(lv.v[layer, g[:, None], idx])
        oks.append(jnp.concatenate([ok_s, ok_w], 1))
    s_s = jnp.broadcast_to(ar_s, (B, sink))
    ok_s = (off[:, None] + s_s < sink) & (s_s < lengths[:, None])
    s_w = lengths[:, None] - window + ar_w
    ok_w = (s_w >= 0) & (off[:, None] + s_w >= sink)
    s_new = lengths[:, None] + jnp.arange(num_new, dtype=jnp.int32)[None]
    idx = jnp.clip(jnp.concatenate([s_s, s_w, s_new], 1), 0, k_all.shape[3] - 1)
    b_idx = jnp.arange(B, dtype=jnp.int32)[:, None]
    keys.append(k_all[layer, b_idx, :, idx])  # [B, n, K, D]
    vals.append(v_all[layer, b_idx, :, idx])
    ctx_ok = jnp.concatenate(oks + [ok_s, ok_w], 1)  # [B, n_ctx]
    visible = jnp.concatenate([jnp.broadcast_to(ctx_ok[:, None], (B, T, ctx_ok.shape[1])),
                               _new_token_mask(mask, B, T, num_new)], 2)
    k = jnp.concatenate(keys, 1).transpose(0, 2, 1, 3)  # [B, K, N, D]
    v = jnp.concatenate(vals, 1).transpose(0, 2, 1, 3)
    return _softmax_attend(q, k, v, visible, sm_scale)[0]


# ----------------------------------------------------------------------------- detection
@dataclasses.dataclass
class SharingPlan:
    """Host-side description of the prefix levels of a batch (from `plan_sharing`)."""

    levels: list  # per level: (P, [tokens of each group])
    offsets: np.ndarray  # [B] total prefix length of each row

    @property
    def prefix_tokens(self) -> int:
        return int(sum(sum(len(t) for t in toks) for _, toks in self.levels))


def _common_prefix_len(rows) -> int:
    n = min(len(r) for r in rows)
    first = rows[0]
    for i in range(n):
        t = first[i]
        if any(r[i] != t for r in rows):
            return i
    return n


def plan_sharing(token_lists, shared_prefix, n: int = 1, *, min_tokens: int | None = None,
                 sliding_window: int | None = None):
    """Expands ``n`` samples per prompt and finds the prefix levels.

    ``shared_prefix``: None (share only the ``n`` samples' prompt when ``n > 1``), ``"auto"``
    (the longest prefix common to all prompts, if at least ``AUTO_MIN_TOKENS`` long), an int (that
    many leading tokens, which must be common to all prompts) or a list of token ids (which every
    prompt must start with). Every row keeps at least its last prompt token in its suffix.
    With ``n > 1`` each prompt's remaining tokens form a second level shared by its samples.

    ``sliding_window`` (the model's, `jaxspec.model.sliding_window_of`): the shared-prefix
    attention has no sliding window, so nothing is shared: ``"auto"`` and ``n`` just repeat the
    rows, and an explicit non-empty ``shared_prefix`` raises ValueError.

    Returns ``(rows, SharingPlan | None)``; None when nothing is shared."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    min_tokens = AUTO_MIN_TOKENS if min_tokens is None else min_tokens
    prompts = [list(t) for t in token_lists]
    rows = [p for p in prompts for _ in range(n)]
    cap = min(len(p) for p in prompts) - 1  # the last token of each prompt is decoded, not shared
    if shared_prefix is None or shared_prefix == "auto":
        n0 = min(_common_prefix_len(prompts), cap) if len(prompts) > 1 or n == 1 else 0
        if shared_prefix is None or n0 < min_tokens:
            n0 = 0
    elif isinstance(shared_prefix, (int, np.integer)) and not isinstance(shared_prefix, bool):
        n0 = int(shared_prefix)
        if not 0 <= n0 <= cap:
            raise ValueError(f"shared_prefix={n0} must be in [0, {cap}] (every prompt keeps at "
                             f"least its last token outside the shared prefix)")
        if _common_prefix_len(prompts) < n0:
            raise ValueError(f"the prompts do not share their first {n0} tokens")
    elif isinstance(shared_prefix, str):
        raise ValueError(f"shared_prefix must be None, 'auto', an int or a list of token ids, "
                         f"got {shared_prefix!r}")
    else:
        try:
            toks = [int(t) for t in shared_prefix]
        except (TypeError, ValueError):
            raise TypeError("shared_prefix must be None, 'auto', an int or a list of token "
                            "ids") from None
        n0 = len(toks)
        if n0 > cap:
            raise ValueError(f"shared_prefix has {n0} tokens but the shortest prompt has only "
                             f"{cap + 1} (it must keep at least its last token)")
        bad = [i for i, p in enumerate(prompts) if p[:n0] != toks]
        if bad:
            raise ValueError(f"prompt {bad[0]} does not start with shared_prefix")
    if sliding_window is not None:
        if n0 > 0 and shared_prefix != "auto":
            raise ValueError(
                f"shared_prefix is not supported for a model with sliding-window attention "
                f"(window {sliding_window}): the shared-prefix attention has no window; "
                f"generate without shared_prefix (or with shared_prefix='auto', which then "
                f"shares nothing)")
        return rows, None
    levels = []
    if n0 > 0:
        levels.append((1, [prompts[0][:n0]]))
    if n > 1:
        own = [p[n0:len(p) - 1] for p in prompts]
        if max(len(t) for t in own) > 0:
            levels.append((len(prompts), own))
    if not levels:
        return rows, None
    if len(levels) and levels[-1][0] == len(prompts) and n > 1:  # per-prompt level
        offsets = np.array([len(p) - 1 for p in rows], np.int64)
    else:
        offsets = np.full((len(rows),), n0, np.int64)
    return rows, SharingPlan(levels=levels, offsets=offsets)


# ----------------------------------------------------------------------------- prefill
@functools.partial(jax.jit, static_argnames=("config", "impl"), donate_argnames=("cache",))
def _prefill_chunk(params, cache: KVCache, tokens_BC, start, offset_B, prefix, *, config, impl):
    from jaxspec.model import forward
    B, C = tokens_BC.shape
    positions = offset_B[:, None] + start + jnp.arange(C, dtype=jnp.int32)[None]
    plan = AttentionPlan(lengths=jnp.full((B,), start, jnp.int32), impl=impl, prefix=prefix)
    _, cache = forward(config, params, tokens_BC, positions, cache, plan,
                       logits_at=jnp.zeros((B, 1), jnp.int32))
    return cache


def _prefill_rows(config, params, rows, offset, prefix, *, S, impl, chunk, dtype, sharding=None,
                  width=None):
    """A plain KVCache of ``len(rows)`` rows with ``rows`` written from slot 0 (position
    ``offset + slot``), attending also to ``prefix`` (a SharedPrefix or None). ``width``: prefill as
    if the longest row had that many tokens (the same chunk shapes for several calls)."""
    B = len(rows)
    lens = np.array([len(r) for r in rows], np.int32)
    cache = KVCache.create(config, B, S, dtype=dtype, sharding=sharding)
    n_real = int(lens.max()) if B else 0
    n = n_real if width is None else max(n_real, int(width))
    if n_real > 0:
        C = min(chunk, round_up(n, 16))
        total = round_up(n, C)
        assert total <= S, (total, S)
        buf = np.zeros((B, total), np.int32)
        for i, r in enumerate(rows):
            buf[i, :len(r)] = r
        off = jnp.asarray(offset, jnp.int32)
        for start in range(0, total, C):
            if start >= n_real:  # nothing left to write (width padding only)
                break
            cache = _prefill_chunk(params, cache, jnp.asarray(buf[:, start:start + C]),
                                   jnp.int32(start), off, prefix, config=config, impl=impl)
    return cache.replace(lengths=jnp.asarray(lens))


def prefill_slots(n: int, chunk: int) -> int:
    """Cache slots a prefill of ``n`` tokens writes (whole chunks)."""
    if n <= 0:
        return 1
    C = min(chunk, round_up(n, 16))
    return round_up(n, C)


def build_prefix(config, params, share: SharingPlan, *, impl="auto", chunk=512, dtype=jnp.float32,
                 mesh=None, slots: int | None = None):
    """Prefills every level once (level i attends to levels < i) -> tuple of PrefixLevel.

    On a mesh each group's row is repeated so the rows split evenly over the data axis (the copies
    are identical; one is kept).

    ``slots``: give every level exactly this many prefix slots (at least its longest group; the
    slots past a group's length are never read unmasked). Prefixes of different lengths then
    share one compiled prefill and one compiled decode loop (benchmarks sweeping prefix lengths);
    None: just enough slots for the longest group."""
    levels = []
    d = 1 if mesh is None else int(mesh.shape["data"])
    for P_i, toks in share.levels:
        r = d // math.gcd(P_i, d)  # rows per group in the prefill batch
        lens = np.array([len(t) for t in toks], np.int32)
        n_max = int(lens.max())
        # start of each group: total length of the earlier levels' groups it continues
        start = np.zeros((P_i,), np.int32)
        for lv in levels:
            Pj = lv.groups
            start += np.asarray(lv.lengths)[np.arange(P_i) // (P_i // Pj)]
        prefix = None
        if levels:
            prefix = SharedPrefix(levels=tuple(levels), offset=jnp.asarray(np.repeat(start, r)))
        S = round_up(prefill_slots(n_max, chunk), SLOT_ALIGN)  # kernel blocks divide it
        width = None
        if slots is not None:
            if slots < n_max:
                raise ValueError(f"slots={slots} is less than the longest prefix ({n_max} tokens)")
            # the chunk shapes of a prefill of `slots` tokens, whatever the real length
            width = slots
            S = max(S, round_up(prefill_slots(slots, chunk), SLOT_ALIGN))
        sharding = None
        if mesh is not None:
            from jaxspec.sharding import cache_sharding
            sharding = cache_sharding(config, mesh, P_i * r)
        c = _prefill_rows(config, params, [t for t in toks for _ in range(r)],
                          np.repeat(start, r), prefix, S=S, impl=impl, chunk=chunk,
                          dtype=dtype, sharding=sharding, width=width)
        Lp = min(S, round_up(max(n_max, 1), 16)) if slots is None else int(slots)
        k = jnp.transpose(c.k[:, ::r, :, :Lp], (0, 1, 3, 2, 4))
        v = jnp.transpose(c.v[:, ::r, :, :Lp], (0, 1, 3, 2, 4))
        if mesh is not None:  # KV heads over model, replicated over data
            from jax.sharding import NamedSharding, PartitionSpec
            lvl = NamedSharding(mesh, PartitionSpec(None, None, None, "model", None))
            k, v = jax.device_put(k, lvl), jax.device_put(v, lvl)
        levels.append(PrefixLevel(k=k, v=v, lengths=jnp.asarray(lens), start=jnp.asarray(start)))
    return tuple(levels)


@functools.partial(jax.jit, donate_argnames=("k", "v"))
def _put_rows(k, v, k_rows, v_rows, row0):
    z = jnp.zeros((), jnp.int32)
    at = (z, jnp.asarray(row0, jnp.int32), z, z, z)
    return (jax.lax.dynamic_update_slice(k, k_rows.astype(k.dtype), at),
            jax.lax.dynamic_update_slice(v, v_rows.astype(v.dtype), at))


def prefill_shared(config, params, rows, share: SharingPlan, *, S, impl="auto", chunk=512,
                   dtype=jnp.float32, sharding=None, mesh=None,
                   prefix_levels=None, row_block: int | None = None,
                   width: int | None = None) -> PrefixedKVCache:
    """Prefix levels once, then every row's suffix (all but its last token) with the prefix
    visible: a `PrefixedKVCache` of ``S`` suffix slots per row.

    ``width``: prefill with the chunk shapes of a suffix this long (at least the longest), so
    batches of different suffix lengths share one compiled prefill.

    ``row_block`` (single device, all rows in one group per level): prefill the suffixes
    ``row_block`` rows at a time with the same chunk shapes, copying each block into the batch's
    cache, so every batch size shares one compiled prefill (the last block is aligned to the end
    of the batch; rows it repeats are recomputed identically)."""
    if prefix_levels is None:
        prefix_levels = build_prefix(config, params, share, impl=impl, chunk=chunk, dtype=dtype,
                                     mesh=mesh)
    offsets = np.asarray(share.offsets, np.int32)
    pre = SharedPrefix(levels=tuple(prefix_levels), offset=jnp.asarray(offsets))
    suffixes = [r[int(o):len(r) - 1] for r, o in zip(rows, offsets)]
    B = len(rows)
    if row_block is None or row_block >= B:
        c = _prefill_rows(config, params, suffixes, offsets, pre, S=S, impl=impl, chunk=chunk,
                          dtype=dtype, sharding=sharding, width=width)
        return PrefixedKVCache(k=c.k, v=c.v, lengths=c.lengths, prefix=pre)
    if mesh is not None or sharding is not None:
        raise ValueError("row_block is for a single device (no mesh)")
    if any(lv.groups != 1 for lv in prefix_levels):
        raise ValueError("row_block needs levels of one group (one prefix shared by all rows)")
    width = max([len(t) for t in suffixes] + [int(width or 0)])
    full = KVCache.create(config, B, S, dtype=dtype)
    k, v = full.k, full.v
    del full
    for b0 in range(0, B, row_block):
        b0 = min(b0, B - row_block)
        blk = slice(b0, b0 + row_block)
        p_blk = SharedPrefix(levels=tuple(prefix_levels), offset=jnp.asarray(offsets[blk]))
        c = _prefill_rows(config, params, suffixes[blk], offsets[blk], p_blk, S=S, impl=impl,
                          chunk=chunk, dtype=dtype, width=width)
        k, v = _put_rows(k, v, c.k, c.v, b0)
        del c
    lengths = jnp.asarray(np.array([len(t) for t in suffixes], np.int32))
    return PrefixedKVCache(k=k, v=v, lengths=lengths, prefix=pre)


# ----------------------------------------------------------------------------- un-sharing
@functools.partial(jax.jit, static_argnames=("S",))
def _unshare(k_suf, v_suf, lengths, pre: SharedPrefix, *, S):
    L, B, K, Ss, D = k_suf.shape
    off = pre.offset.astype(jnp.int32)
    s = jnp.arange(S, dtype=jnp.int32)[None, :]  # [1, S]
    rows = jnp.arange(B, dtype=jnp.int32)
    j_suf = s - off[:, None]  # [B, S] suffix slot of each full slot
    ok_suf = (j_suf >= 0) & (j_suf < Ss)
    j_suf = jnp.clip(j_suf, 0, Ss - 1)
    srcs = []
    for lv in pre.levels:
        g = rows // (B // lv.groups)
        j = s - lv.start[g][:, None]
        ok = (j >= 0) & (j < lv.lengths[g][:, None])
        srcs.append((lv, g, jnp.clip(j, 0, lv.k.shape[2] - 1), ok))

    def one(x_suf, which):
        def layer(l, out):
            xs = jax.lax.dynamic_index_in_dim(x_suf, l, 0, keepdims=False)  # [B, K, Ss, D]
            x = jnp.take_along_axis(xs, j_suf[:, None, :, None], axis=2)  # [B, K, S, D]
            x = jnp.where(ok_suf[:, None, :, None], x, jnp.zeros((), x.dtype))
            for lv, g, j, ok in srcs:
                xp = jax.lax.dynamic_index_in_dim(getattr(lv, which), l, 0, keepdims=False)
                xp = xp[g[:, None], j]  # [B, S, K, D]
                x = jnp.where(ok[:, None, :, None], jnp.swapaxes(xp, 1, 2).astype(x.dtype), x)
            return jax.lax.dynamic_update_index_in_dim(out, x, l, 0)
        out = jnp.zeros((L, B, K, S, D), x_suf.dtype)
        return jax.lax.fori_loop(0, L, layer, out)

    return one(k_suf, "k"), one(v_suf, "v"), off + lengths.astype(jnp.int32)


def unshare_cache(cache: PrefixedKVCache, S: int | None = None) -> KVCache:
    """The same rows as a plain `KVCache` without sharing: each row holds its prefix levels and
    then its suffix in ``S`` slots (position = slot), bit for bit the K/V of ``cache``. Decoding
    from either gives the same tokens (the baseline of shared-prefix benchmarks). ``S`` defaults
    to the prefix offsets plus the suffix slots, rounded up to `SLOT_ALIGN`."""
    pre = cache.prefix
    if pre is None:
        return cache
    if S is None:
        S = round_up(int(np.max(np.asarray(pre.offset))) + cache.max_len, SLOT_ALIGN)
    k, v, lengths = _unshare(cache.k, cache.v, cache.lengths, pre, S=int(S))
    return KVCache(k=k, v=v, lengths=lengths)
