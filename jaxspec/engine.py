"""Generation: batched chunked prefill and one jitted `lax.while_loop` of decode steps.

`generate` validates everything on the host first (so bad input never reaches the compiler),
prefills all prompts of a batch in chunks (ragged lengths, right-padded: keys sit at their original
positions), then runs a single jitted loop in which every sequence advances, stops on its own stop
token or budget, and finished rows stop changing. Speculative decoding (see `jaxspec.speculative`)
replaces the loop body; everything else is shared.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec import sampling
from jaxspec.attention import AttentionPlan
from jaxspec.cache import SLOT_ALIGN, KVCache, round_up
from jaxspec.checkpoint import Model
from jaxspec.config import ModelConfig
from jaxspec.model import forward, sliding_window_of
from jaxspec.sharding import fetch as _fetch_sharded, sharded_generate

DEFAULT_PREFILL_CHUNK = 512


@dataclasses.dataclass
class GenerationResult:
    """``tokens``: new tokens per prompt (a final stop token included, nothing after it);
    ``texts``: their decoded text without the stop token (when the model has a tokenizer);
    ``stats``: timings and counters."""

    tokens: list[list[int]]
    texts: list[str] | None
    stats: dict[str, Any]


# ----------------------------------------------------------------------------- validation
def _as_token_lists(model: Model, prompts, chat: bool) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], (int, np.integer))):
        raise TypeError("prompts must be a list of prompts (strings or token-id lists), "
                        "not a single prompt; wrap it in a list")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            tok = model.tokenizer
            if tok is None:
                raise ValueError("string prompts need a tokenizer, and this model has none; "
                                 "pass token-id lists instead")
            if chat:
                ids = tok.apply_chat_template([{"role": "user", "content": p}],
                                              add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "keys"):
                    ids = ids["input_ids"]
            else:
                ids = tok(p)["input_ids"]
            ids = [int(t) for t in ids]
        else:
            try:
                ids = [_token_id(t) for t in p]
            except (TypeError, ValueError):
                raise TypeError(f"prompt {i} is neither a string nor a list of token ids") from None
        if not ids:
            raise ValueError(f"prompt {i} is empty (no tokens)")
        bad = [t for t in ids if not 0 <= t < model.config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary "
                             f"[0, {model.config.vocab_size}): {bad[:5]}")
        out.append(ids)
    return out


def _token_id(t) -> int:
    """A token id from an int-like value (a float such as 1.5 is an error, not truncated)."""
    if isinstance(t, (int, np.integer)):
        return int(t)
    if isinstance(t, (float, np.floating)) and float(t).is_integer():
        return int(t)
    raise TypeError(f"not a token id: {t!r}")


def _is_real(x) -> bool:
    """A real number, numpy scalars included (np.float32 is not a Python float)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_sampling_args(max_new_tokens, temperature, top_k, top_p, seed=0, prefill_chunk=1):
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not (_is_real(temperature) and math.isfinite(temperature)) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not _is_real(top_p) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if (not isinstance(prefill_chunk, (int, np.integer)) or isinstance(prefill_chunk, bool)
            or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")


def stop_token_ids(model: Model, stop_tokens) -> tuple[int, ...]:
    ids = set(model.config.eos_token_ids)
    tok = model.tokenizer
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    if stop_tokens is None:
        stop_tokens = ()
    elif isinstance(stop_tokens, (str, bytes, int, np.integer)):  # one stop token
        stop_tokens = [stop_tokens]
    elif isinstance(stop_tokens, np.ndarray):
        stop_tokens = stop_tokens.reshape(-1).tolist()
    for s in stop_tokens:
        if isinstance(s, str):
            if tok is None:
                raise ValueError("string stop tokens need a tokenizer")
            t = tok.convert_tokens_to_ids(s)
            if t is None or t == getattr(tok, "unk_token_id", -1):
                enc = tok(s, add_special_tokens=False)["input_ids"]
                if len(enc) != 1:
                    raise ValueError(f"stop token {s!r} is not a single token")
                t = enc[0]
            ids.add(int(t))
        else:
            try:
                ids.add(_token_id(s))
            except TypeError:
                raise TypeError(f"stop tokens must be token ids or single-token strings, "
                                f"got {s!r}") from None
    return tuple(sorted(ids))


# ----------------------------------------------------------------------------- prefill
@functools.partial(jax.jit, static_argnames=("config", "impl"), donate_argnames=("cache",))
def _prefill_chunk(params, cache: KVCache, tokens_BC, start, *, config: ModelConfig, impl: str):
    B, C = tokens_BC.shape
    positions = start + jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C))
    plan = AttentionPlan(lengths=jnp.full((B,), start, jnp.int32), impl=impl)
    # logits of one row only (unused): the LM head is skipped for the rest of the chunk.
    _, cache = forward(config, params, tokens_BC, positions, cache, plan,
                       logits_at=jnp.zeros((B, 1), jnp.int32))
    return cache


def prefill(config: ModelConfig, params, cache: KVCache, prompts: list[list[int]], *,
            impl: str = "auto", chunk: int = DEFAULT_PREFILL_CHUNK, progress=None) -> KVCache:
    """Writes the K/V of each prompt into ``cache`` (ragged) and sets ``cache.lengths``."""
    B = len(prompts)
    lens = np.array([len(p) for p in prompts], np.int32)
    n = int(lens.max()) if B else 0
    if n == 0:
        return cache.replace(lengths=jnp.asarray(lens))
    C = min(chunk, round_up(n, 16))
    total = round_up(n, C)
    buf = np.zeros((B, total), np.int32)
    for i, p in enumerate(prompts):
        buf[i, :len(p)] = p
    for j, start in enumerate(range(0, total, C)):
        cache = _prefill_chunk(params, cache, jnp.asarray(buf[:, start:start + C]),
                               jnp.int32(start), config=config, impl=impl)
        if progress is not None:
            progress(j + 1, total // C)
    return cache.replace(lengths=jnp.asarray(lens))


# ----------------------------------------------------------------------------- decode loop
@struct.dataclass
class DecodeState:
    cache: KVCache
    last: jax.Array  # [B] last committed token, its K/V not yet in the cache
    out: jax.Array  # [B, max_out] generated tokens
    n_out: jax.Array  # [B]
    budget: jax.Array  # [B] tokens this row may still produce in total
    done: jax.Array  # [B]
    rng: jax.Array
    steps: jax.Array  # target forward passes
    max_steps: jax.Array | None = None  # optional cap on loop rounds (steady-state benchmarks)

    def running(self) -> jax.Array:
        """The loop condition: some row still generating (and rounds left under ``max_steps``)."""
        go = jnp.any(~self.done)
        return go if self.max_steps is None else go & (self.steps < self.max_steps)


@dataclasses.dataclass(frozen=True)
class DecodeLoop:
    """Static description of the plain decode loop (a hashable jit static argument)."""

    config: ModelConfig
    stop_ids: tuple[int, ...]
    impl: str = "auto"
    # finished rows attend to no context (`AttentionPlan.active`): a static batch's step gets
    # cheaper as its rows finish instead of reading every finished row's cache to the end
    skip_finished: bool = True

    def cond(self, state: DecodeState):
        return state.running()

    def body(self, params, sp, state: DecodeState) -> DecodeState:
        B = state.last.shape[0]
        cache = state.cache
        plan = AttentionPlan(lengths=cache.lengths, impl=self.impl,
                             active=~state.done if self.skip_finished else None)
        logits, new_cache = forward(self.config, params, state.last[:, None],
                                    cache.lengths[:, None], cache, plan)
        rng, sub = jax.random.split(state.rng)
        nxt = sampling.sample(sub, logits[:, 0], sp).astype(jnp.int32)
        active = ~state.done
        return commit_tokens(state.replace(cache=new_cache, rng=rng, steps=state.steps + 1),
                             nxt[:, None], jnp.where(active, 1, 0), self.stop_ids)

    def run(self, params, sp, state: DecodeState) -> DecodeState:
        return jax.lax.while_loop(self.cond, functools.partial(self.body, params, sp), state)


def commit_tokens(state: DecodeState, new_BN, n_new_B, stop_ids) -> DecodeState:
    """Appends up to ``n_new[b]`` tokens of ``new[b]`` to row b's output, stopping at a stop token
    or the budget; the cache length advances by the number of tokens committed (each committed
    token but the last already has its K/V in the cache; the last becomes ``state.last``)."""
    B, N = new_BN.shape
    idx = jnp.arange(N, dtype=jnp.int32)[None, :]
    valid = idx < n_new_B[:, None]
    is_stop = jnp.isin(new_BN, jnp.asarray(stop_ids, jnp.int32)) if stop_ids else \
        jnp.zeros_like(valid)
    room = state.budget - state.n_out  # [B]
    # position of the first stop among valid tokens
    stop_here = valid & is_stop
    first_stop = jnp.where(jnp.any(stop_here, axis=1), jnp.argmax(stop_here, axis=1), N)
    n_keep = jnp.minimum(jnp.minimum(n_new_B, first_stop + 1), room)
    n_keep = jnp.where(state.done, 0, jnp.maximum(n_keep, 0))
    keep = idx < n_keep[:, None]
    b_idx = jnp.arange(B, dtype=jnp.int32)[:, None]
    pos = state.n_out[:, None] + idx
    out = state.out.at[b_idx, jnp.where(keep, pos, state.out.shape[1])].set(new_BN, mode="drop")
    n_out = state.n_out + n_keep
    last_idx = jnp.maximum(n_keep - 1, 0)
    last = jnp.where(n_keep > 0, jnp.take_along_axis(new_BN, last_idx[:, None], 1)[:, 0],
                     state.last)
    hit_stop = first_stop < n_keep
    done = state.done | hit_stop | (n_out >= state.budget)
    lengths = state.cache.lengths + n_keep
    return state.replace(cache=state.cache.replace(lengths=lengths), out=out, n_out=n_out,
                         last=last, done=done)


@functools.partial(jax.jit, static_argnames=("loop",), donate_argnames=("state",))
def _run_loop(params, sp, state, *, loop):
    return loop.run(params, sp, state)


# ----------------------------------------------------------------------------- generate
@dataclasses.dataclass
class Prepared:
    """Everything `generate` sets up before its decode loop: validated prompts, the prefilled
    cache, sampling settings and the speculation runner. ``fresh_state(cache)`` rebuilds the
    initial decode state around a cache whose prompt slots hold these prompts (decoding writes
    only slots past the prompts, so the cache a loop returns can be decoded from again:
    benchmarks prefill once and decode many times)."""

    token_lists: list[list[int]]
    n_real: int  # real rows (the rest pad the batch to the data axis)
    state: DecodeState
    sp: Any
    stop_ids: tuple[int, ...]
    spec: Any  # jaxspec.speculative._Runner or None
    stats: dict[str, Any]
    t0: float
    slot_lens: np.ndarray
    budget: np.ndarray
    seed: int

    def fresh_state(self, cache: KVCache | None = None, *, budget=None, extra: int | None = None,
                    seed: int | None = None, out_width: int | None = None,
                    max_steps: int | None = None) -> DecodeState:
        """A new initial decode state around ``cache`` (default: the prefilled one) rewound to the
        prompts (the loops donate their state: only the cache is taken over). ``budget`` (new
        tokens per row), ``extra`` (slots a round may write past the budget:
        ``_Runner.extra_slots`` for speculation, 1 for plain decoding) and ``seed`` may differ
        from the prepared ones, as long as the cache has room. ``out_width`` fixes the
        output buffer's width (default: budget + extra) and ``max_steps`` caps the loop's rounds,
        so runs with different budgets can share one compiled loop."""
        st = self.state
        cache = st.cache if cache is None else cache
        b = self.budget if budget is None else np.broadcast_to(np.asarray(budget), self.budget.shape)
        b = np.where(np.arange(len(b)) < self.n_real, b, 0).astype(np.int32)
        if extra is None:
            extra = st.out.shape[1] - int(self.budget.max())
        need = int((self.slot_lens + b).max()) + extra
        if need > cache.max_len:
            raise ValueError(f"the cache holds {cache.max_len} slots per row, {need} needed")
        B = st.out.shape[0]
        width = int(b.max()) + extra if out_width is None else int(out_width)
        if width < int(b.max()) + extra:
            raise ValueError(f"out_width={width} < budget + extra = {int(b.max()) + extra}")
        return DecodeState(
            cache=cache.replace(lengths=jnp.asarray(self.slot_lens - 1, jnp.int32)),
            last=jnp.asarray([t[-1] for t in self.token_lists], jnp.int32),
            out=jnp.zeros((B, width), jnp.int32), n_out=jnp.zeros((B,), jnp.int32),
            budget=jnp.asarray(b), done=jnp.asarray(b <= 0),
            rng=sampling.key_from_seed(self.seed if seed is None else seed),
            steps=jnp.zeros((), jnp.int32),
            max_steps=None if max_steps is None else jnp.asarray(max_steps, jnp.int32))


def prepare(model: Model, prompts, *, max_new_tokens: int, temperature: float = 0.0,
            top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_tokens=None,
            speculation=None, chat: bool = False, max_len: int | None = None,
            attn_impl: str = "auto", prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
            shared_prefix=None, n: int = 1) -> Prepared | GenerationResult:
    """Validation, cache sizing and prefill of `generate` (same arguments). Returns the finished
    (empty) result when there is nothing to generate."""
    if not isinstance(model, Model):
        raise TypeError(f"model must be a jaxspec.Model (from jaxspec.load), got {type(model).__name__}")
    _check_sampling_args(max_new_tokens, temperature, top_k, top_p, seed, prefill_chunk)
    token_lists = _as_token_lists(model, prompts, chat)
    window = sliding_window_of(model.config)  # shared prefixes do not combine with it
    share = None
    if shared_prefix is not None or n != 1:
        from jaxspec.prefix import plan_sharing
        token_lists, share = plan_sharing(token_lists, shared_prefix, n, sliding_window=window)
        if share is not None and model.mesh is not None:
            d = model.mesh.shape["data"]
            if len(token_lists) % d:
                raise ValueError(f"with a shared prefix on a mesh the batch ({len(token_lists)} "
                                 f"rows) must be a multiple of the data axis ({d})")
    n_real = len(token_lists)
    if model.mesh is not None:  # batch over the data axis: pad with dummy rows (no budget)
        from jaxspec import sharding as shd
        token_lists = shd.pad_batch(token_lists, model.mesh)
    config = model.config
    ctx = config.max_position_embeddings
    for i, ids in enumerate(token_lists):
        if len(ids) >= ctx:
            raise ValueError(f"prompt {i} has {len(ids)} tokens but the model's context is {ctx} "
                             f"tokens (max_position_embeddings); shorten it")
    stop_ids = stop_token_ids(model, stop_tokens)
    spec = None
    if speculation is not None:
        from jaxspec.speculative import prepare_speculation
        spec = prepare_speculation(speculation, model, token_lists, max_new_tokens)
    B = len(token_lists)
    lens = np.array([len(t) for t in token_lists])
    extra = spec.extra_slots if spec is not None else 1
    budget = np.minimum(max_new_tokens, ctx - lens)  # never past the model's context
    budget[n_real:] = 0
    slot_lens = lens if share is None else lens - share.offsets  # suffix slots per row
    need = int((slot_lens + budget).max()) + extra
    why = (f"prompts of up to {int(slot_lens.max())} tokens{' (after the shared prefix)' if share else ''}"
           f" plus {int(budget.max())} new tokens and {extra} slot{'s' if extra > 1 else ''} for "
           f"{'the tokens of a speculation round' if spec is not None else 'the last token'}")
    # the last prefill chunk writes whole chunks: the cache must hold them (kernels need it)
    n_pre = int(slot_lens.max()) - 1
    if n_pre > 0:
        C = min(prefill_chunk, round_up(n_pre, 16))
        if round_up(n_pre, C) > need:
            need = round_up(n_pre, C)
            why = (f"the prefill of prompts of up to {int(slot_lens.max())} tokens writes whole "
                   f"chunks of {C} slots (prefill_chunk)")
    S = int(max_len or round_up(need, SLOT_ALIGN))
    if S < need:
        raise ValueError(f"max_len={S} is too small: {why} need {need} cache slots")
    t0 = time.perf_counter()
    stats: dict[str, Any] = {"batch": n_real, "prompt_tokens": int(lens[:n_real].sum()),
                             "max_len": S}
    if share is not None:
        stats["shared_prefix_tokens"] = share.prefix_tokens
    if max_new_tokens == 0:
        return _result(model, [[] for _ in range(n_real)], stats | {"new_tokens": 0, "seconds": 0.0,
                                                                   "tokens_per_second": 0.0})
    params = model.decode_params()
    c_shd = None if model.mesh is None else shd.cache_sharding(config, model.mesh, B)
    if share is None:
        cache = KVCache.create(config, B, S, dtype=model.dtype, sharding=c_shd)
        # Prefill everything but each prompt's last token; the loop starts from that token.
        cache = prefill(config, params, cache, [t[:-1] for t in token_lists], impl=attn_impl,
                        chunk=prefill_chunk)
    else:  # the shared prefix once, then each row's suffix (jaxspec.prefix)
        from jaxspec.prefix import prefill_shared
        cache = prefill_shared(config, params, token_lists, share, S=S, impl=attn_impl,
                               chunk=prefill_chunk, dtype=model.dtype, sharding=c_shd,
                               mesh=model.mesh)
    sp = sampling.SamplingParams.make(B, temperature=temperature, top_k=top_k, top_p=top_p)
    max_out = int(budget.max()) + extra
    state = DecodeState(
        cache=cache,
        last=jnp.asarray([t[-1] for t in token_lists], jnp.int32),
        out=jnp.zeros((B, max_out), jnp.int32),
        n_out=jnp.zeros((B,), jnp.int32),
        budget=jnp.asarray(budget, jnp.int32),
        done=jnp.asarray(budget <= 0),
        rng=sampling.key_from_seed(seed),
        steps=jnp.zeros((), jnp.int32),
    )
    if model.mesh is not None:
        state, sp = shd.put_batch((state, sp), model.mesh, B)
    return Prepared(token_lists=token_lists, n_real=n_real, state=state, sp=sp,
                    stop_ids=stop_ids, spec=spec, stats=stats, t0=t0,
                    slot_lens=np.asarray(slot_lens), budget=np.asarray(budget), seed=seed)


def decode(model: Model, prep: Prepared, state: DecodeState | None = None, *,
           attn_impl: str = "auto", profile: bool = False, dstate=None):
    """Runs the decode loop (plain or speculative) of a prepared generation from ``state``
    (default: the prepared one). Returns the final state and the loop's stats."""
    state = prep.state if state is None else state
    if prep.spec is None:
        loop = DecodeLoop(config=model.config, stop_ids=prep.stop_ids, impl=attn_impl)
        return _run_loop(model.decode_params(), prep.sp, state, loop=loop), {}
    return prep.spec.run(model, prep.sp, state, stop_ids=prep.stop_ids, impl=attn_impl,
                         profile=profile, dstate=dstate)


@sharded_generate  # a model with a mesh: laid out on it, run with the mesh active
def generate(model: Model, prompts, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_tokens=None,
             speculation=None, chat: bool = False, max_len: int | None = None,
             attn_impl: str = "auto", prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
             profile: bool = False, shared_prefix=None, n: int = 1) -> GenerationResult:
    """Generates up to ``max_new_tokens`` new tokens for each prompt (see module docstring).

    ``prompts``: a list of strings (needs a tokenizer; ``chat=True`` applies the chat template)
    or of token-id lists, of any lengths. ``temperature=0`` is greedy. ``stop_tokens``: extra stop
    token ids (or single-token strings) besides the model's EOS. ``speculation``: a
    `jaxspec.Speculation` for speculative decoding (lossless: same tokens as greedy, same
    distribution when sampling).

    ``n``: samples per prompt (results are prompt-major: prompt i's samples at ``i*n .. i*n+n-1``).
    ``shared_prefix`` (Hydragen, `jaxspec.prefix`): ``"auto"`` shares the longest prefix common
    to all prompts once it is long enough, an int shares that many leading tokens, a list of
    token ids shares exactly those; with ``n > 1`` each prompt is also shared by its samples.
    The prefix is prefilled once and attended to once per group; tokens are the same as without
    sharing (greedy) and the distribution is the same (sampling). A model with a sliding attention
    window shares nothing (``"auto"`` and ``n`` then just repeat rows; an explicit prefix raises).
    """
    prep = prepare(model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_k=top_k, top_p=top_p, seed=seed, stop_tokens=stop_tokens,
                   speculation=speculation, chat=chat, max_len=max_len, attn_impl=attn_impl,
                   prefill_chunk=prefill_chunk, shared_prefix=shared_prefix, n=n)
    if isinstance(prep, GenerationResult):
        return prep
    jax.block_until_ready(prep.state)
    t_prefill = time.perf_counter()
    final, extra_stats = decode(model, prep, attn_impl=attn_impl, profile=profile)
    fetch = np.asarray if model.mesh is None else _fetch_sharded
    out = fetch(final.out)
    n_out = fetch(final.n_out)
    t_end = time.perf_counter()
    tokens = [out[i, :n_out[i]].tolist() for i in range(prep.n_real)]
    new = int(n_out.sum())
    decode_s = t_end - t_prefill
    stats = dict(prep.stats)
    stats.update({
        "new_tokens": new,
        "seconds": t_end - prep.t0,
        "prefill_seconds": t_prefill - prep.t0,
        "decode_seconds": decode_s,
        "tokens_per_second": new / decode_s if decode_s > 0 else 0.0,
        "target_steps": int(final.steps),
    })
    stats.update(extra_stats)
    return _result(model, tokens, stats, prep.stop_ids)


def _result(model, tokens, stats, stop_ids=()):
    texts = None
    if model.tokenizer is not None:
        texts = [model.tokenizer.decode(t[:-1] if t and t[-1] in stop_ids else t,
                                        skip_special_tokens=True) for t in tokens]
    return GenerationResult(tokens=tokens, texts=texts, stats=stats)
