"""Prefill: writing prompts' K/V into a cache, chunk by chunk, for every caller.

Prompts of a batch are ragged and right-padded; keys sit at their original positions. A chunk of
``C`` tokens per row is one forward at positions ``start .. start + C - 1`` (after a shared prefix:
plus the row's prefix offset) attending to everything before it, so prefill never materializes a
``[T, S]`` score matrix for a long prompt; only one row of logits is computed (the LM head is skipped
for the rest). The chunk start is a traced value: every chunk of a prefill runs one compiled
program. `prefill_row` fills one row of a large cache (a server slot) through a small cache whose
size is a power-of-two bucket of the prompt length, so the number of compiled shapes stays small.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import compile_cache
from jaxspec.attention import AttentionPlan
from jaxspec.cache import SLOT_ALIGN, KVCache, round_up
from jaxspec.config import ModelConfig
from jaxspec.model import forward

DEFAULT_PREFILL_CHUNK = 512


def chunk_of(n: int, chunk: int) -> tuple[int, int]:
    """(chunk size, slots written) for prefilling ``n`` tokens in chunks of at most ``chunk``."""
    if n <= 0:
        return 16, 0
    C = min(chunk, round_up(n, 16))
    return C, round_up(n, C)


@functools.partial(jax.jit, static_argnames=("config", "impl", "prompt"),
                   donate_argnames=("cache",))
def _prefill_chunk(params, cache: KVCache, prefix, tokens_BC, start, *, config: ModelConfig,
                   impl: str, prompt: bool = True):
    """One chunk into ``cache`` (donated), attending also to ``prefix`` (a `SharedPrefix` or
    None; read only, so it is not donated). ``prompt``: the tokens are prompt tokens
    (`jaxspec.attention.AttentionPlan.prompt`); False for tokens a decode step computed before
    (a preempted sequence's generated tokens, computed again as its decode steps did)."""
    B, C = tokens_BC.shape
    offset = jnp.zeros((B,), jnp.int32) if prefix is None else prefix.offset
    positions = offset[:, None] + start + jnp.arange(C, dtype=jnp.int32)[None]
    plan = AttentionPlan(lengths=jnp.full((B,), start, jnp.int32), impl=impl, prefix=prefix,
                         block_table=getattr(cache, "block_table", None), prompt=prompt)
    _, cache = forward(config, params, tokens_BC, positions, cache, plan,
                       logits_at=jnp.zeros((B, 1), jnp.int32))
    return cache


def _split_prefix(cache):
    """(the plain `KVCache` part, the shared prefix or None) of a cache."""
    prefix = getattr(cache, "prefix", None)
    if prefix is None:
        return cache, None
    return KVCache(k=cache.k, v=cache.v, lengths=cache.lengths), prefix


def prefill(config: ModelConfig, params, cache: KVCache, rows: list[list[int]], *,
            impl: str = "auto", chunk: int = DEFAULT_PREFILL_CHUNK, width: int | None = None,
            progress=None) -> KVCache:
    """Writes the K/V of each row's tokens into ``cache`` from slot 0 (ragged) and sets
    ``cache.lengths``. ``width``: prefill with the chunk shapes of rows this long (at least the
    longest), so batches of different lengths share one compiled program. ``progress(done,
    total)`` is called after each chunk."""
    B = len(rows)
    lens = np.array([len(r) for r in rows], np.int32)
    n_real = int(lens.max()) if B else 0
    n = n_real if width is None else max(n_real, int(width))
    if n_real == 0:
        return cache.replace(lengths=jnp.asarray(lens))
    C, total = chunk_of(n, chunk)
    if total > cache.max_len:
        raise ValueError(f"a prefill of {n} tokens in chunks of {C} writes {total} slots; the "
                         f"cache holds {cache.max_len}")
    buf = np.zeros((B, total), np.int32)
    for i, r in enumerate(rows):
        buf[i, :len(r)] = r
    n_chunks = -(-n_real // C)
    whole = cache
    cache, prefix = _split_prefix(cache)
    for j in range(n_chunks):
        start = j * C
        cache = compile_cache.call(_prefill_chunk, params, cache, prefix,
                                   jnp.asarray(buf[:, start:start + C]), jnp.int32(start),
                                   config=config, impl=impl)
        if progress is not None:
            progress(j + 1, n_chunks)
    return whole.replace(k=cache.k, v=cache.v, lengths=jnp.asarray(lens))


def bucket(n: int, chunk: int) -> tuple[int, int]:
    """(chunk size, padded length) for prefilling ``n`` tokens of one row: powers of two up to
    ``chunk``, then whole chunks rounded to a power-of-two count (a bounded number of shapes)."""
    p = 16
    while p < n:
        p *= 2
    C = min(chunk, p)
    return C, round_up(p, C)


@functools.partial(jax.jit, donate_argnames=("cache",))
def write_row(cache: KVCache, k1, v1, row, length):
    """Writes a B=1 cache (``[L, 1, K, S1, D]``, S1 <= S) into row ``row`` of ``cache``."""
    k = jax.lax.dynamic_update_slice(cache.k, k1.astype(cache.k.dtype), (0, row, 0, 0, 0))
    v = jax.lax.dynamic_update_slice(cache.v, v1.astype(cache.v.dtype), (0, row, 0, 0, 0))
    return cache.replace(k=k, v=v, lengths=cache.lengths.at[row].set(length))


def _roles(n: int, prompt_end: int | None, start: int = 0) -> list[tuple[int, int, bool]]:
    """``[(lo, hi, prompt), ...]``: the tokens ``[0, n)`` (logical slots ``start + i``) cut where
    the prompt tokens end (``prompt_end``, a slot; None: all are prompt tokens) into the part a
    prefill computes as prompt tokens and the part it computes as decode steps did."""
    cut = n if prompt_end is None else min(max(int(prompt_end) - start, 0), n)
    return [(lo, hi, p) for lo, hi, p in ((0, cut, True), (cut, n, False)) if hi > lo]


def prefill_row(config: ModelConfig, params, cache: KVCache, row: int, tokens: list[int], *,
                impl: str = "auto", chunk: int = DEFAULT_PREFILL_CHUNK,
                prompt_end: int | None = None) -> KVCache:
    """Prefills ``tokens`` into row ``row`` of ``cache`` (other rows untouched): through a B=1 cache
    of a power-of-two bucket of the length (`bucket`), then written into the row.
    ``prompt_end``: the tokens from this one on are not prompt tokens but tokens decode steps
    computed before (`jaxspec.attention.AttentionPlan.prompt`: a preempted sequence's); None:
    all are prompt tokens."""
    n = len(tokens)
    if n == 0:
        return cache.replace(lengths=cache.lengths.at[row].set(0))
    C, total = bucket(n, chunk)
    S1 = min(round_up(total, SLOT_ALIGN), cache.max_len)
    small = KVCache.create(config, 1, S1, dtype=cache.k.dtype)
    buf = np.zeros((1, round_up(n, C) + C), np.int32)
    buf[0, :n] = tokens
    for lo, hi, prompt in _roles(n, prompt_end):
        for start in range(lo, hi, C):
            size = min(C, S1 - start)  # (after a cut, a last chunk within the small cache)
            small = _prefill_chunk(params, small, None, jnp.asarray(buf[:, start:start + size]),
                                   jnp.int32(start), config=config, impl=impl, prompt=prompt)
    return write_row(cache, small.k, small.v, jnp.int32(row), jnp.int32(n))


def prefill_paged_row(config: ModelConfig, params, cache, row: int, tokens: list[int],
                      start: int, *, impl: str = "auto", chunk: int = DEFAULT_PREFILL_CHUNK,
                      programs: dict | None = None, prompt_end: int | None = None):
    """Prefills ``tokens`` into row ``row`` of a paged cache (`jaxspec.paged.PagedKVCache`) from
    logical slot ``start`` on (the slots before it already hold the row's first ``start``
    tokens, e.g. blocks shared from the prefix cache), through the row's block table, in chunks
    of ``chunk`` tokens (the last one padded to a power of two of at least 16: its padding writes
    past the tokens, into the row's own blocks or nowhere). Other rows are untouched;
    ``cache.lengths[row]`` becomes ``start + len(tokens)``. One compiled call per chunk and
    nothing eager: a server calls this between decode chunks, on the thread that feeds them.
    ``programs``: a dict the caller keeps the compiled chunks in, keyed by shapes and dtypes
    alone (one device): a pool that went through other programs (a decode chunk, a smaller
    batch's) carries equivalent shardings of other kinds, which jit's own cache tells apart (on
    an H100 a 2048-token chunk compiled again for 5.9 s, mid-serving). ``prompt_end``: the
    logical slot from which on the tokens are ones decode steps computed before, as in
    `prefill_row`."""
    n = len(tokens)
    if n == 0:
        return _set_length(cache, np.int32(row), np.int32(start))
    C = int(chunk)
    buf = np.zeros((1, round_up(n, C) + C), np.int32)
    buf[0, :n] = tokens
    for lo, hi, prompt in _roles(n, prompt_end, start):
        for off in range(lo, hi, C):
            size = bucket(min(C, hi - off), C)[0]  # a short rest: a power-of-two chunk, not C
            args = (params, cache, np.int32(row), buf[:, off:off + size], np.int32(start + off),
                    np.int32(start + min(hi, off + C)))
            kw = {"config": config, "impl": impl, "prompt": prompt}
            # (the weights, args[0]: one model per dict)
            cache = compile_cache.by_shapes(programs, _prefill_paged_chunk, args, kw,
                                            skip=1)(*args)
    return cache


@functools.partial(jax.jit, static_argnames=("config", "impl", "prompt"),
                   donate_argnames=("cache",))
def _prefill_paged_chunk(params, cache, row, tokens_1C, start, end, *, config: ModelConfig,
                         impl: str, prompt: bool = True):
    """One chunk of `prefill_paged_row` (``cache`` donated): row ``row``'s table as a one-row
    view, ``tokens`` from slot ``start`` on; the row's length becomes ``end``."""
    table = jax.lax.dynamic_slice_in_dim(cache.block_table, row, 1, axis=0)
    # (a shared context is not the prefill's: it passes through untouched)
    view = cache.replace(lengths=jnp.zeros((1,), jnp.int32), block_table=table, shared=None)
    view = _prefill_chunk(params, view, None, tokens_1C, start, config=config, impl=impl,
                          prompt=prompt)
    return cache.replace(k=view.k, v=view.v, lengths=cache.lengths.at[row].set(end))


@functools.partial(jax.jit, donate_argnames=("cache",))
def _set_length(cache, row, value):
    return cache.replace(lengths=cache.lengths.at[row].set(value))
