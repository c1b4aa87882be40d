"""Continuous batching: many requests share one KV cache and one compiled decode loop.

The engine owns a fixed number of *slots*, the batch rows of one KV cache ``[L, B_slots, K, S, D]``.
A request (one `Sequence` per completion; ``n > 1`` or several prompts make several) is tokenized and
validated on the caller's thread, queued, and then, on the engine's background thread:

1. admitted into a free slot: its prompt (all but the last token) is prefilled into a small B=1
   cache whose size is a power-of-two bucket of the prompt length (so the number of compilations
   stays bounded), and that cache is written into the slot's row of the big cache;
2. decoded together with every other active slot in *chunks*: one jitted call runs at most
   ``rounds_per_chunk`` rounds of the engine's own loop body (`DecodeLoop.body`, or
   `SpecLoop.body` for speculative decoding) inside a `lax.while_loop` whose condition also bounds
   the rounds, and returns;
3. between chunks, new tokens are detokenized and pushed to the request's asyncio queue (streaming),
   stop strings and cancellations are handled, finished sequences leave and waiting ones enter.

Per-request sampling settings (temperature / top-k / top-p) live in per-slot arrays, so one compiled
chunk serves them all; the only static switches are "every active row is greedy" and "some row uses
top-k / top-p", so at most four variants of the chunk function are ever compiled.

Per-slot randomness (``per_row=True``, the default): the loop body is `jax.vmap`-ed over the slots
(each row sees a batch of one, with its own PRNG key), so a request's samples depend only on its own
seed, never on which other requests share the batch, and speculative statistics come back per row.
``per_row=False`` runs the body on the whole batch with one shared key (``seed`` is then ignored).

Token provenance: in a speculative round a row commits ``n_accepted`` accepted drafts and then one
token of the target's own (unless a stop token or the budget cuts the round short); every streamed
piece says which kind it is, so the demo page can show draft tokens differently.

TODO(shared-prefix issue): sequences of one request with ``n > 1`` (and requests whose prompt starts
with a cached prefix) should share the prefix K/V (Hydragen); today every slot is prefilled and
stores its own copy.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sampling
from jaxspec.cache import SLOT_ALIGN, KVCache, round_up
from jaxspec.checkpoint import Model
from jaxspec.engine import DecodeLoop, DecodeState, _prefill_chunk, stop_token_ids

log = logging.getLogger("jaxspec.serving")

_ACC_KEYS = ("proposed", "accepted", "committed", "row_steps")


class QueueFull(RuntimeError):
    """The waiting queue has no room for the request; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class PromptTooLong(ValueError):
    """The prompt (plus the requested tokens) does not fit the context."""


class EngineStopped(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """Per-sequence settings. ``max_tokens=None``: as many as the context allows."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None


# ---------------------------------------------------------------------------- one sequence
class Sequence:
    """One completion: a prompt in one slot. Events go to ``queue`` on the submitter's event loop
    (``{"type": "delta", "text", "segments", "n_tokens"}``, then one ``"done"`` or ``"error"``)."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], options: SamplingOptions, *, index: int = 0,
                 loop: asyncio.AbstractEventLoop | None = None,
                 queue: asyncio.Queue | None = None, tag: Any = None):
        self.id = next(self._ids)
        self.index = index
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.options = options
        self.budget = 0  # set by the engine's check
        self.loop = loop
        if queue is None and loop is not None:
            queue = asyncio.Queue()
        self.queue = queue  # several sequences of one request may share one queue
        self.tag = tag  # the submitter's label (events carry it), e.g. the choice index
        self.tokens: list[int] = []
        self.draft_flags: list[bool] = []
        self.text = ""  # text so far (stop strings cut it)
        self._sent = 0  # chars of text already emitted
        self._sent_tokens = 0  # tokens already reported in a delta's n_tokens
        self._pieces: list[tuple[int, bool]] = []  # (end char, from draft) of each decoded piece
        self._po = 0  # detokenizer: prefix offset
        self._ro = 0  # detokenizer: read offset
        self.slot: int | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cancelled = False
        self.rounds = 0  # target verification steps this sequence took part in
        self.accepted = 0  # accepted draft tokens
        self.proposed = 0
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.t_done: float | None = None
        self.finished = threading.Event()

    @property
    def finished_flag(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def _emit(self, event: dict):
        if self.queue is None or self.loop is None:
            return
        event["tag"] = self.tag
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.tokens),
                "total_tokens": len(self.prompt_ids) + len(self.tokens)}

    def stats(self) -> dict:
        out = {"rounds": self.rounds, "accepted": self.accepted, "proposed": self.proposed,
               "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
               "tokens_per_step": len(self.tokens) / self.rounds if self.rounds else None}
        if self.t_first is not None:
            out["ttft_s"] = self.t_first - self.t_submit
        return out


# ---------------------------------------------------------------------------- jitted pieces
def _bucket(n: int, chunk: int) -> tuple[int, int]:
    """(chunk size, padded length) for prefilling ``n`` tokens: powers of two up to ``chunk``,
    then whole chunks rounded to a power-of-two count (bounded number of shapes)."""
    p = 16
    while p < n:
        p *= 2
    C = min(chunk, p)
    return C, round_up(p, C)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _write_row(cache: KVCache, k1, v1, row, length):
    """Writes a B=1 cache (``[L, 1, K, S1, D]``, S1 <= S) into row ``row`` of ``cache``."""
    k = jax.lax.dynamic_update_slice(cache.k, k1.astype(cache.k.dtype), (0, row, 0, 0, 0))
    v = jax.lax.dynamic_update_slice(cache.v, v1.astype(cache.v.dtype), (0, row, 0, 0, 0))
    return cache.replace(k=k, v=v, lengths=cache.lengths.at[row].set(length))


def _rows_in(tree, axes):
    """Gives each row of a batched pytree its own leading batch of one: leaves ``[.., B, ..]``
    (batch at axis ``a >= 0``) become ``[.., B, 1, ..]`` so `jax.vmap` over B hands the body B=1
    rows; leaves with ``a < 0`` stay as they are."""
    return jax.tree_util.tree_map(lambda x, a: x if a < 0 else jnp.expand_dims(x, a + 1), tree, axes)


def _rows_out(tree, axes):
    return jax.tree_util.tree_map(lambda x, a: x if a < 0 else jnp.squeeze(x, a + 1), tree, axes)


@functools.partial(jax.jit, static_argnames=("loop", "rounds", "per_row"),
                   donate_argnames=("state", "dstate"))
def _run_chunk(params, dparams, sp, state: DecodeState, dstate, *, loop, rounds: int,
               per_row: bool):
    """At most ``rounds`` rounds of ``loop.body`` (stops early when every row is done). Returns the
    new state and draft state, the number of rounds run, and per-round records: tokens committed
    per row ``[R, B]``, accepted drafts per row ``[R, B]`` (per_row) or summed over rows
    ``[R, 1]``, and proposed drafts summed over rows ``[R]``."""
    B = state.last.shape[0]
    spec = not isinstance(loop, DecodeLoop)

    def batch_round(state, dstate, sp):
        if spec:
            acc0 = {k: jnp.zeros((), jnp.int32) for k in _ACC_KEYS}
            st, ds, acc = loop.body(params, dparams, sp, (state, dstate, acc0))
            return st, ds, acc["accepted"], acc["proposed"]
        st = loop.body(params, sp, state)
        return st, dstate, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)

    if per_row:
        # expand: where each leaf's batch axis is (-1: none); vmap: the axes vmap maps over
        s_exp = DecodeState(cache=KVCache(k=1, v=1, lengths=0), last=0, out=0, n_out=0,
                            budget=0, done=0, rng=-1, steps=-1)
        s_map = DecodeState(cache=KVCache(k=1, v=1, lengths=0), last=0, out=0, n_out=0,
                            budget=0, done=0, rng=0, steps=None)  # rng: one [2] key per row
        d_exp = jax.tree_util.tree_map(lambda x: 0, dstate).replace(
            cache=KVCache(k=1, v=1, lengths=0))
        sp_exp = jax.tree_util.tree_map(lambda x: 0, sp)
        vm = jax.vmap(batch_round, in_axes=(s_map, d_exp, sp_exp),
                      out_axes=(s_map, d_exp, 0, 0))

        def one_round(state, dstate):
            st, ds, acc, prop = vm(_rows_in(state, s_exp), _rows_in(dstate, d_exp),
                                   _rows_in(sp, sp_exp))
            st = _rows_out(st, s_exp).replace(steps=state.steps + 1)
            return st, _rows_out(ds, d_exp), acc, jnp.sum(prop)
    else:
        def one_round(state, dstate):
            st, ds, acc, prop = batch_round(state, dstate, sp)
            return st, ds, acc[None], prop

    n_acc_cols = B if per_row else 1

    def cond(c):
        i, st = c[0], c[1]
        return (i < rounds) & jnp.any(~st.done)

    def body(c):
        i, st, ds, keep_RB, acc_RB, prop_R = c
        st2, ds2, acc, prop = one_round(st, ds)
        keep_RB = keep_RB.at[i].set(st2.n_out - st.n_out)
        acc_RB = acc_RB.at[i].set(acc.astype(jnp.int32))
        prop_R = prop_R.at[i].set(prop.astype(jnp.int32))
        return i + 1, st2, ds2, keep_RB, acc_RB, prop_R

    init = (jnp.zeros((), jnp.int32), state, dstate, jnp.zeros((rounds, B), jnp.int32),
            jnp.zeros((rounds, n_acc_cols), jnp.int32), jnp.zeros((rounds,), jnp.int32))
    n, st, ds, keep_RB, acc_RB, prop_R = jax.lax.while_loop(cond, body, init)
    return st, ds, n, keep_RB, acc_RB, prop_R


def provenance(keep_RB: np.ndarray, acc_RB: np.ndarray, done_after: np.ndarray,
               speculative: bool) -> tuple[list[list[bool]], np.ndarray]:
    """Which committed tokens of a chunk were accepted drafts, per row, and the accepted count
    per row. ``acc_RB`` is per row ``[R, B]``, or per round summed over rows ``[R, 1]``: then the
    split is inferred (a row that did not finish in a round committed ``n_acc + 1`` tokens, the
    last one the target's; the rest of the round's sum belongs to the rows that finished)."""
    R, B = keep_RB.shape
    flags: list[list[bool]] = [[] for _ in range(B)]
    accepted = np.zeros(B, np.int64)
    if not speculative:
        for b in range(B):
            flags[b] = [False] * int(keep_RB[:, b].sum())
        return flags, accepted
    last_round = np.full(B, -1)
    for b in range(B):
        nz = np.nonzero(keep_RB[:, b])[0]
        if len(nz):
            last_round[b] = nz[-1]
    for r in range(R):
        n_r = keep_RB[r]
        if acc_RB.shape[1] == B:
            a_r = acc_RB[r].astype(np.int64)
        else:
            finishing = [b for b in range(B) if n_r[b] > 0 and done_after[b] and last_round[b] == r]
            a_r = np.maximum(n_r.astype(np.int64) - 1, 0)
            rest = int(acc_RB[r, 0]) - int(sum(a_r[b] for b in range(B) if b not in finishing))
            if len(finishing) == 1:
                a_r[finishing[0]] = rest
            # several rows finished in one round: the split of `rest` is unknown; their last
            # token is labelled the target's (n_acc = n - 1), the others are exact.
        for b in range(B):
            n = int(n_r[b])
            if n:
                a = int(a_r[b])
                flags[b].extend(i < a for i in range(n))
                accepted[b] += min(a, n)
    return flags, accepted


# ---------------------------------------------------------------------------- the engine
class ServingEngine:
    """Continuous-batching engine over one model (see module docstring).

    model: a `jaxspec.Model` (with a tokenizer for text prompts).
    max_batch: slots (batch rows of the KV cache).
    max_len: tokens per sequence (prompt + completion); default: the model's context, at most 4096;
        never more than the model's context, nor than a full-cache draft model's.
    speculation: a `jaxspec.Speculation` (or None for plain decoding).
    rounds_per_chunk: loop rounds per jitted call (streaming granularity vs. host overhead).
    max_queue: waiting sequences beyond which `submit` raises `QueueFull`.
    """

    def __init__(self, model: Model, *, max_batch: int = 8, max_len: int | None = None,
                 speculation=None, rounds_per_chunk: int = 8, max_queue: int = 256,
                 prefill_chunk: int = 512, attn_impl: str = "auto", per_row: bool = True,
                 stop_tokens=None, warmup_prefill: int = 0):
        if not isinstance(model, Model):
            raise TypeError(f"model must be a jaxspec.Model, got {type(model).__name__}")
        if max_batch < 1 or rounds_per_chunk < 1 or max_queue < 0:
            raise ValueError("max_batch and rounds_per_chunk must be >= 1, max_queue >= 0")
        self.model = model
        # the layout decoding runs fastest with (per-layer arrays on one GPU), as `generate` uses;
        # decode_params() switches model.params once, so every chunk and prefill sees one layout
        # (before, gamma="auto" switched it half-way, through its cost measurement)
        model.decode_params()
        self.config = cfg = model.config
        self.tokenizer = model.tokenizer
        self.B = int(max_batch)
        self.rounds = int(rounds_per_chunk)
        self.max_queue = int(max_queue)
        self.prefill_chunk = int(prefill_chunk)
        self.impl = attn_impl
        self.per_row = bool(per_row)
        self.warmup_prefill = int(warmup_prefill)
        self.stop_ids = stop_token_ids(model, stop_tokens)
        ctx = cfg.max_position_embeddings
        self.max_len = int(min(max_len or min(ctx, 4096), ctx))
        self.speculation = speculation
        self._setup_speculation()
        if self.draft is not None and speculation.window is None:  # a full-cache draft model
            # like the target's context above: a sequence never outgrows the draft's cache
            self.max_len = min(self.max_len, self.draft.config.max_position_embeddings)
        # whole prefill chunks must fit (see _prefill_row)
        S = round_up(self.max_len + self.extra, max(SLOT_ALIGN, self.prefill_chunk))
        self.S = S
        dtype = model.dtype
        self.cache = KVCache.create(cfg, self.B, S, dtype=dtype)
        self.dstate = self._empty_draft_state()
        self.out_len = self.rounds * (self.tokens_per_round)
        # host mirrors of the per-slot state
        self.last = np.zeros(self.B, np.int32)
        self.remaining = np.zeros(self.B, np.int32)
        self.done = np.ones(self.B, bool)
        self.temperature = np.zeros(self.B, np.float32)
        self.top_k = np.zeros(self.B, np.int32)
        self.top_p = np.ones(self.B, np.float32)
        self.rng_rows = np.zeros((self.B, 2), np.uint32)
        self.rng = jax.random.PRNGKey(int.from_bytes(os.urandom(4), "little"))
        self.slots: list[Sequence | None] = [None] * self.B
        self.waiting: collections.deque[Sequence] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self._paused = False
        self.fault_hook = None  # tests: called with each Sequence at admission (may raise)
        # metrics counters; every key exists from the start (other threads read them while the
        # engine thread updates them)
        self.m = collections.Counter({k: 0 for k in (
            "sequences_submitted", "sequences_admitted", "prompt_tokens", "prefill_tokens",
            "generation_tokens", "chunks", "rounds", "chunk_seconds", "busy_slot_rounds",
            "slot_rounds", "draft_proposed", "draft_accepted", "target_row_steps",
            "rejected_queue_full", "finished_stop", "finished_length", "finished_cancelled",
            "finished_error")})
        self.started_at = time.time()

    # ------------------------------------------------------------------ set-up
    def _setup_speculation(self):
        spec = self.speculation
        self.gamma = 0
        self.draft = None
        self.tree = None
        self.extra = 1
        self.tokens_per_round = 1
        if spec is None:
            return
        from jaxspec.speculative import prepare_speculation
        runner = prepare_speculation(spec, self.model, [[0]], 1)
        self.draft = runner.draft
        if self.draft is not None:
            self.draft.decode_params()
        self.tree = getattr(runner, "tree", None)
        self.gamma = runner.gamma
        self.extra = runner.extra_slots
        if self.tree is not None:
            self.tokens_per_round = self.tree.max_depth + 1
        else:
            self.tokens_per_round = self.gamma + 1
        self._auto_gamma = spec.gamma == "auto"

    def _empty_draft_state(self):
        from jaxspec.speculative import DraftState
        cfg = self.config
        if self.draft is None:
            dc = KVCache.create(cfg, self.B, 1, self.model.dtype)
        elif self.speculation.window is None:
            dc = KVCache.create(self.draft.config, self.B, self.S, self.draft.dtype)
        else:
            from jaxspec.speculative import ring_cache_len
            C = max(8, min(256, self.speculation.window // 2))
            Sd = ring_cache_len(self.speculation.sink, self.speculation.window, self.extra, C)
            dc = KVCache.create(self.draft.config, self.B, Sd, self.draft.dtype)
        return DraftState(cache=dc, prev=jnp.zeros((self.B,), jnp.int32))

    def _loop(self, greedy: bool):
        if self.speculation is None or self.gamma == 0:
            return DecodeLoop(config=self.config, stop_ids=self.stop_ids, impl=self.impl)
        from jaxspec.speculative import SpecLoop
        spec = self.speculation
        kw = dict(config=self.config, stop_ids=self.stop_ids, gamma=self.gamma, sink=spec.sink,
                  window=spec.window, greedy=greedy, impl=self.impl,
                  draft_config=None if self.draft is None else self.draft.config,
                  ring=self.draft is not None and spec.window is not None)
        if self.tree is not None:
            kw["tree"] = self.tree
            kw["tree_mode"] = getattr(spec, "tree_sampling", "without_replacement")
        return SpecLoop(**kw)

    @property
    def alive(self) -> bool:
        return self._running and self._thread is not None and self._thread.is_alive()

    @property
    def speculative(self) -> bool:
        return self.speculation is not None and self.gamma > 0

    # ------------------------------------------------------------------ requests (any thread)
    def encode_prompt(self, prompt) -> list[int]:
        """A string (tokenized) or a list of token ids (checked against the vocabulary)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: send token ids")
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
        ids = [int(t) for t in ids]
        V = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {V}): {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        return ids

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return self.encode_prompt([int(t) for t in ids])

    def check(self, n_prompt: int, max_tokens: int | None) -> int:
        """The token budget of a sequence; raises PromptTooLong naming the limits."""
        room = self.max_len - n_prompt
        if room < 1:
            raise PromptTooLong(
                f"the prompt has {n_prompt} tokens but this server's maximum context length is "
                f"{self.max_len} tokens (prompt + completion), leaving no room to generate; "
                f"shorten the prompt")
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise PromptTooLong(
                f"this server's maximum context length is {self.max_len} tokens, but "
                f"{n_prompt + max_tokens} were requested ({n_prompt} in the prompt, {max_tokens} "
                f"for the completion); lower max_tokens or shorten the prompt")
        return int(max_tokens)

    def submit(self, seqs: list[Sequence]):
        """Queues sequences (all or none). Raises QueueFull, PromptTooLong, EngineStopped."""
        for s in seqs:
            s.budget = self.check(len(s.prompt_ids), s.options.max_tokens)
        with self._cv:
            if not self._running:
                raise EngineStopped("the engine is not running")
            if len(self.waiting) + len(seqs) > self.max_queue:
                self.m["rejected_queue_full"] += 1
                raise QueueFull(f"the request queue is full ({len(self.waiting)} of "
                                f"{self.max_queue} waiting); retry later", retry_after=1)
            for s in seqs:
                s.t_submit = time.perf_counter()
                self.waiting.append(s)
            self.m["sequences_submitted"] += len(seqs)
            self._cv.notify()

    def cancel(self, seq: Sequence):
        """Frees the sequence's slot (or drops it from the queue) at the next chunk boundary."""
        with self._cv:
            seq.cancelled = True
            self._cv.notify()

    def pause_admission(self):
        with self._cv:
            self._paused = True

    def resume_admission(self):
        with self._cv:
            self._paused = False
            self._cv.notify()

    # ------------------------------------------------------------------ lifecycle
    def start(self, warmup: bool = True, variants=None):
        """Starts the engine thread, after compiling (``warmup``) the chunk ``variants`` (see
        `warmup`)."""
        if self._thread is not None:
            return self
        if warmup:
            self.warmup(variants)
        self._running = True
        self._thread = threading.Thread(target=self._main, name="jaxspec-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self):
        with self._cv:
            self._running = False
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        for s in list(self.waiting) + [s for s in self.slots if s is not None]:
            self._fail(s, "the server is shutting down")
        self.waiting.clear()

    def warmup(self, variants=None):
        """Compiles the chunk variants with every slot idle: ``variants`` is a list of
        ``(greedy, filtering)`` pairs (default: greedy, sampling, sampling with top-k / top-p; a
        benchmark that only sends greedy requests passes ``[(True, False)]``), then prefill."""
        if self.speculation is not None and getattr(self, "_auto_gamma", False):
            self._choose_gamma()
        if variants is None:
            variants = ((True, False), (False, False), (False, True))
        for greedy, filtering in variants:
            self._chunk(bool(greedy), bool(filtering))
        n = 16  # prefill shapes (power-of-two buckets) up to warmup_prefill tokens, in free row 0
        while n <= min(self.warmup_prefill, self.max_len - 1):
            self.cache = self._prefill_row(self.config, self.model.params, self.cache, 0, [0] * n)
            if self.draft is not None:
                self._prefill_draft_row(0, [0] * n)
            n *= 2

    def _choose_gamma(self):
        """gamma='auto': the MagicDec cost model over step times measured on the slot cache."""
        from jaxspec import speculative as spc
        state = self._state()
        costs, state, self.dstate = spc.measure_costs(
            self.model, self.speculation, self.draft, state, self.dstate, self.impl,
            spc.GAMMA_CANDIDATES)
        self.cache = state.cache
        g, _ = spc.choose_gamma(costs, spc.PRIOR_ACCEPTANCE)
        log.info("gamma=auto chose gamma=%d from step costs %s", g, costs)
        self.gamma = g
        self.tokens_per_round = g + 1
        self.out_len = self.rounds * self.tokens_per_round

    # ------------------------------------------------------------------ engine thread
    def _state(self) -> DecodeState:
        rng = jnp.asarray(self.rng_rows) if self.per_row else self.rng
        return DecodeState(cache=self.cache, last=jnp.asarray(self.last),
                           out=jnp.zeros((self.B, self.out_len), jnp.int32),
                           n_out=jnp.zeros((self.B,), jnp.int32),
                           budget=jnp.asarray(np.where(self.done, 0, self.remaining), jnp.int32),
                           done=jnp.asarray(self.done), rng=rng,
                           steps=jnp.zeros((), jnp.int32))

    def _chunk(self, greedy: bool, filtering: bool):
        sp = sampling.SamplingParams(temperature=jnp.asarray(self.temperature),
                                     top_k=jnp.asarray(self.top_k),
                                     top_p=jnp.asarray(self.top_p), filtering=filtering,
                                     stochastic=not greedy)
        loop = self._loop(greedy)
        dparams = self.draft.params if self.draft is not None else jnp.zeros(())
        st, ds, n, keep_RB, acc_RB, prop_R = _run_chunk(
            self.model.params, dparams, sp, self._state(), self.dstate, loop=loop,
            rounds=self.rounds, per_row=self.per_row)
        self.cache = st.cache
        self.dstate = ds
        host = jax.device_get((st.out, st.n_out, st.done, st.last, st.rng, n, keep_RB, acc_RB,
                               prop_R))
        out, n_out, done, last, rng, n, keep_RB, acc_RB, prop_R = host
        if self.per_row:
            self.rng_rows = np.array(rng, np.uint32)
        else:
            self.rng = st.rng
        self.last = np.array(last, np.int32)
        return out, n_out, done, int(n), keep_RB[:int(n)], acc_RB[:int(n)], prop_R[:int(n)]

    def _main(self):
        while True:
            with self._cv:
                while self._running and not self._has_work():
                    self._cv.wait(timeout=0.5)
                if not self._running:
                    return
                cancelled = [s for s in self.slots if s is not None and s.cancelled]
                dropped = [s for s in self.waiting if s.cancelled]
                for s in dropped:
                    self.waiting.remove(s)
                admits = []
                if not self._paused:
                    free = [b for b in range(self.B) if self.slots[b] is None]
                    while free and self.waiting:
                        admits.append((free.pop(0), self.waiting.popleft()))
            for s in cancelled + dropped:
                self._finish(s, "cancelled")
            for b, s in admits:
                try:
                    self._admit(b, s)
                except Exception as e:  # noqa: BLE001 - fail this request only
                    log.exception("admitting sequence %d failed", s.id)
                    self._fail(s, f"prefill failed: {type(e).__name__}: {e}")
            if not any(s is not None for s in self.slots):
                continue
            try:
                self._step()
            except Exception as e:  # noqa: BLE001 - fail the active requests, keep serving
                log.exception("decode chunk failed")
                for s in [s for s in self.slots if s is not None]:
                    self._fail(s, f"decoding failed: {type(e).__name__}: {e}")
                self.cache = KVCache.create(self.config, self.B, self.S, dtype=self.model.dtype)
                self.dstate = self._empty_draft_state()

    def _has_work(self) -> bool:
        if any(s is not None for s in self.slots):
            return True
        return bool(self.waiting) and not self._paused or any(s.cancelled for s in self.waiting)

    def _admit(self, b: int, s: Sequence):
        if self.fault_hook is not None:
            self.fault_hook(s)
        ids = s.prompt_ids
        n = len(ids) - 1
        self.cache = self._prefill_row(self.config, self.model.params, self.cache, b, ids[:-1])
        if self.draft is not None:
            self._prefill_draft_row(b, ids[:-1])
        o = s.options
        self.last[b] = ids[-1]
        self.remaining[b] = s.budget
        self.done[b] = s.budget <= 0
        self.temperature[b] = o.temperature
        self.top_k[b] = o.top_k
        self.top_p[b] = o.top_p
        seed = o.seed if o.seed is not None else int.from_bytes(os.urandom(4), "little")
        self.rng_rows[b] = np.asarray(jax.random.fold_in(sampling.key_from_seed(seed), s.index),
                                      np.uint32)
        self.slots[b] = s
        s.slot = b
        self.m["prompt_tokens"] += len(ids)
        self.m["sequences_admitted"] += 1
        self.m["prefill_tokens"] += n
        if s.budget <= 0:
            self._finish(s, "length")

    def _prefill_row(self, cfg, params, cache, b, ids):
        n = len(ids)
        if n == 0:
            return cache.replace(lengths=cache.lengths.at[b].set(0))
        C, total = _bucket(n, self.prefill_chunk)
        S1 = min(round_up(total, SLOT_ALIGN), cache.max_len)
        small = KVCache.create(cfg, 1, S1, dtype=cache.k.dtype)
        buf = np.zeros((1, round_up(n, C)), np.int32)
        buf[0, :n] = ids
        for start in range(0, n, C):
            small = _prefill_chunk(params, small, jnp.asarray(buf[:, start:start + C]),
                                   jnp.int32(start), config=cfg, impl=self.impl)
        return _write_row(cache, small.k, small.v, jnp.int32(b), jnp.int32(n))

    def _prefill_draft_row(self, b, ids):
        d = self.draft
        dc = self.dstate.cache
        if self.speculation.window is None:
            dc = self._prefill_row(d.config, d.params, dc, b, ids)
        else:
            from jaxspec.speculative import ring_prefill
            one = ring_prefill(d.config, d.params, [ids], sink=self.speculation.sink,
                               window=self.speculation.window, scratch=self.extra,
                               impl=self.impl, dtype=dc.k.dtype)
            dc = _write_row(dc, one.k, one.v, jnp.int32(b), jnp.int32(len(ids)))
        self.dstate = self.dstate.replace(cache=dc, prev=self.dstate.prev.at[b].set(
            int(self.last[b])))

    def _step(self):
        active = [b for b in range(self.B) if self.slots[b] is not None and not self.done[b]]
        if not active:
            return
        greedy = bool(np.all(self.temperature[active] <= 0))
        filtering = bool(np.any((self.top_k[active] > 0) | (self.top_p[active] < 1.0)))
        t0 = time.perf_counter()
        out, n_out, done, n, keep_RB, acc_RB, prop_R = self._chunk(greedy, filtering)
        dt = time.perf_counter() - t0
        self.m["chunks"] += 1
        self.m["rounds"] += n
        self.m["chunk_seconds"] += dt
        self.m["busy_slot_rounds"] += int((keep_RB > 0).sum())
        self.m["slot_rounds"] += n * self.B
        flags, accepted = provenance(keep_RB, acc_RB, done, self.speculative)
        self.m["draft_proposed"] += int(prop_R.sum())
        self.m["draft_accepted"] += int(accepted.sum())
        self.m["target_row_steps"] += int((keep_RB > 0).sum())
        for b in active:
            s = self.slots[b]
            k = int(n_out[b])
            self.remaining[b] -= k
            self.done[b] = bool(done[b])
            if s is None:
                continue
            s.rounds += int((keep_RB[:, b] > 0).sum())
            s.accepted += int(accepted[b])
            if self.speculative:
                s.proposed += int((keep_RB[:, b] > 0).sum()) * max(self.tokens_per_round - 1, 0)
            try:
                self._deliver(s, out[b, :k].tolist(), flags[b][:k], bool(done[b]))
            except Exception as e:  # noqa: BLE001 - fail this request only
                log.exception("delivering tokens of sequence %d failed", s.id)
                self._fail(s, f"{type(e).__name__}: {e}")

    # ------------------------------------------------------------------ output
    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def _deliver(self, s: Sequence, new: list[int], flags: list[bool], device_done: bool):
        if not new and not device_done:
            return
        if s.t_first is None and new:
            s.t_first = time.perf_counter()
        finish = None
        if device_done:
            finish = "stop" if (new and new[-1] in self.stop_ids) else "length"
        for t, f in zip(new, flags):
            s.tokens.append(t)
            s.draft_flags.append(f)
            if t in self.stop_ids:
                self.m["generation_tokens"] += 1
                break
            self.m["generation_tokens"] += 1
            if self.tokenizer is None:  # no text: token ids only
                piece = ""
            else:
                toks = s.tokens  # no stop token in it (a stop token ends the sequence)
                prefix = self._decode(toks[s._po:s._ro])
                full = self._decode(toks[s._po:])
                if len(full) > len(prefix) and not full.endswith("\ufffd"):
                    piece = full[len(prefix):]
                    s._po, s._ro = s._ro, len(toks)
                else:
                    piece = ""
            if piece:
                s.text += piece
                s._pieces.append((len(s.text), f))
                if s.options.stop:
                    cut = _find_stop(s.text, s.options.stop, len(s.text) - len(piece))
                    if cut is not None:
                        s.text = s.text[:cut]
                        finish = "stop"
                        break
        if finish is not None:
            self._flush(s, final=True)
            self._finish(s, finish)
        else:
            self._flush(s, final=False)

    def _flush(self, s: Sequence, final: bool):
        end = len(s.text)
        if not final and s.options.stop:
            end -= _stop_holdback(s.text, s.options.stop)
        if end <= s._sent:
            if self.tokenizer is None and len(s.tokens) > s._sent_tokens:
                # no tokenizer, so no text: a delta still tells the client how far it got
                self._emit_delta(s, "", [])
            return
        segs = []
        start = s._sent
        for e, f in s._pieces:
            if e <= start:
                continue
            seg_end = min(e, end)
            if seg_end > start:
                if segs and segs[-1][1] == f:
                    segs[-1][0] += s.text[start:seg_end]
                else:
                    segs.append([s.text[start:seg_end], f])
            start = seg_end
            if start >= end:
                break
        text = s.text[s._sent:end]
        s._sent = end
        self._emit_delta(s, text, segs)

    @staticmethod
    def _emit_delta(s: Sequence, text: str, segs: list):
        s._sent_tokens = len(s.tokens)
        s._emit({"type": "delta", "text": text, "segments": segs, "n_tokens": len(s.tokens),
                 "accepted": s.accepted, "proposed": s.proposed, "rounds": s.rounds})

    def _release(self, s: Sequence):
        b = s.slot
        if b is not None and self.slots[b] is s:
            self.slots[b] = None
            self.done[b] = True
            self.remaining[b] = 0
        s.slot = None

    def _finish(self, s: Sequence, reason: str):
        if s.finished_flag:
            return
        self._release(s)
        s.finish_reason = reason
        s.t_done = time.perf_counter()
        self.m[f"finished_{reason}"] += 1
        s._emit({"type": "done", "finish_reason": reason, "usage": s.usage(), "stats": s.stats(),
                 "token_ids": list(s.tokens)})
        s.finished.set()

    def _fail(self, s: Sequence, message: str):
        if s.finished_flag:
            return
        self._release(s)
        s.error = message
        s.t_done = time.perf_counter()
        self.m["finished_error"] += 1
        s._emit({"type": "error", "message": message})
        s.finished.set()

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, Any]:
        with self._cv:
            waiting = len(self.waiting)
        busy = sum(s is not None for s in self.slots)
        m = dict(self.m)
        return {
            **m,
            "waiting": waiting,
            "slots_busy": busy,
            "slots_total": self.B,
            "acceptance_rate": (m.get("draft_accepted", 0) / m["draft_proposed"]
                                if m.get("draft_proposed") else 0.0),
            "tokens_per_target_step": (m.get("generation_tokens", 0) / m["target_row_steps"]
                                       if m.get("target_row_steps") else 0.0),
            "batch_occupancy": (m.get("busy_slot_rounds", 0) / m["slot_rounds"]
                                if m.get("slot_rounds") else 0.0),
        }

    # ------------------------------------------------------------------ blocking helper
    def generate(self, prompt_ids: list[int], options: SamplingOptions,
                 timeout: float | None = None) -> Sequence:
        """Blocking convenience (tests, scripts): submits one sequence and waits for it."""
        s = Sequence(prompt_ids, options)
        self.submit([s])
        if not s.finished.wait(timeout):
            raise TimeoutError("generation did not finish in time")
        return s


def _find_stop(text: str, stops, new_from: int) -> int | None:
    best = None
    for st in stops:
        if not st:
            continue
        i = text.find(st, max(0, new_from - len(st) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _stop_holdback(text: str, stops) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    h = 0
    for st in stops:
        for k in range(min(len(st) - 1, len(text)), h, -1):
            if text.endswith(st[:k]):
                h = k
                break
    return h
