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
length of the row). `jaxspec.cache.PrefixedKVCache` carries the prefix next to the suffix cache;
the loops give the model positions with the offset (`jaxspec.cache.positions_of`) and an attention
plan with the prefix segments, so decoding and speculation run unchanged. The attention over the
segments (and the StreamingLLM self-draft's sparse view across prefix and suffix) is
`jaxspec.attention`.

A model with a sliding attention window (`jaxspec.config.sliding_window_of`) shares nothing: the
prefix attention has no window (`plan_sharing` repeats the rows instead, or refuses an explicit
prefix, and `jaxspec.attention.attend` refuses a prefix with a window).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import (SLOT_ALIGN, KVCache, PrefixedKVCache, PrefixLevel,  # noqa: F401
                           SharedPrefix, positions_of, round_up)
from jaxspec.prefill import prefill
from jaxspec.tokenizer import token_id

AUTO_MIN_TOKENS = 32  # shared_prefix="auto": share a common prefix only from this length on


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
    auto = isinstance(shared_prefix, str) and shared_prefix == "auto"
    if hasattr(shared_prefix, "__array__"):  # a numpy / jax array: its token ids (or an int)
        shared_prefix = np.asarray(shared_prefix)
        shared_prefix = shared_prefix.item() if shared_prefix.ndim == 0 else shared_prefix.tolist()
    if shared_prefix is None or auto:
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
            toks = [token_id(t) for t in shared_prefix]
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
        if n0 > 0 and not auto:
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
def _prefill_rows(config, params, rows, offset, prefix, *, S, impl, chunk, dtype, sharding=None,
                  width=None):
    """A cache of ``len(rows)`` rows with ``rows`` written from slot 0 (position
    ``offset + slot``), attending also to ``prefix`` (a SharedPrefix or None)."""
    cache = KVCache.create(config, len(rows), S, dtype=dtype, sharding=sharding)
    if prefix is not None:
        cache = PrefixedKVCache(k=cache.k, v=cache.v, lengths=cache.lengths,
                                prefix=prefix.replace(offset=jnp.asarray(offset, jnp.int32)))
    elif np.any(np.asarray(offset) != 0):
        raise ValueError("offsets need a prefix")
    cache = prefill(config, params, cache, rows, impl=impl, chunk=chunk, width=width)
    return cache


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
