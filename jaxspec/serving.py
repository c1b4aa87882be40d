"""Continuous batching: many requests share one batch of slots and one compiled decode loop.

The engine owns a fixed number of *slots*, the rows of one `jaxspec.decoding.DecodeState` made by
the same `jaxspec.session.Decoder` that `jaxspec.generate` uses (so the server runs what `generate`
runs: the same rounds, speculation, cost model and mesh). A request (one `Sequence` per completion;
``n > 1`` or several prompts make several) is tokenized and validated on the caller's thread,
queued, and then, on the engine's background thread:

1. admitted into a free slot: its prompt (all but the last token) is prefilled into the slot's row
   (`Decoder.prefill_row`: through a small cache of a power-of-two bucket of the prompt length, so
   the number of compilations stays bounded; a draft model's cache too). With a block pool
   (``page_size``) the prompt goes in pieces: while other slots decode, the first rounds of a
   decode chunk (as many as add at most `PIECE_SHARE` of its time) also prefill a piece each in
   their forward (``mixed_prefill``, `jaxspec.decoding.run_mixed_chunk`); while nothing decodes,
   in whole prefill steps;
2. decoded together with every other active slot in *chunks*: one jitted call of
   `jaxspec.decoding.run_rounds` runs as many rounds as fit in about `chunk_seconds` (the cost
   model predicts a round's time and learns it from every chunk), so tokens reach clients at that
   pace on any device (while few streams run, a chunk ends where one of them ends:
   `END_EARLY_MAX_ROWS`); with speculation each chunk is either speculative rounds or plain steps,
   as the cost model decides for the rows running and their own acceptance;
3. while the next chunk runs (on a device thread of its own: the call of a data-dependent decode
   loop holds its thread until the loop ends), the last chunk's tokens are detokenized and pushed
   to the request's asyncio queue (streaming), stop strings and cancellations are handled (a
   cancelled or disconnected request frees its slot at the next chunk boundary), finished
   sequences leave and waiting ones enter. The cost model learns a round's time from the
   chunks' device time.

Per-request temperature / top-k / top-p live in per-slot arrays, so one compiled loop serves them
all; the only static switches are "every active row is greedy" and "some row uses top-k / top-p".
Every slot draws with its own PRNG key (from the request's ``seed`` and its choice index), and a
sequence preempted for blocks resumes with its row's key, so a request's draws never depend on
which other requests share the batch (with adaptive speculation, which rounds it takes part in
does: speculative or plain chunks are chosen for all the slots; its bits do only with
``batch_invariant``, where the arithmetic does not depend on them either).

Token provenance: a speculative round commits accepted drafts and then one token of the target's
own; the decode state marks each committed token, and every streamed piece says which kind it is
(the demo page shows draft tokens differently).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import math
import os
import threading
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import compile_cache, sampling
from jaxspec.cache import SLOT_ALIGN, round_up
from jaxspec.blocks import BlockManager
from jaxspec.decoding import (Pieces, RoundStats, compactable, put_rows, set_block_tables, set_rows,
                              spread_outputs, stop_rows, take_rows)
from jaxspec.model import Model
from jaxspec.prefill import DEFAULT_PREFILL_CHUNK
from jaxspec.mesh import put_batch, use_mesh
from jaxspec.paged import shared_context
from jaxspec.session import Decoder, stop_token_ids

log = logging.getLogger("jaxspec.serving")

CHUNK_SECONDS = 0.08  # a decode chunk (the streaming granularity) takes about this long
# paged: a shared context is attended to once when it saves at least this many key reads per step
# ((sharing rows - 1) x shared tokens): below it, the extra kernel and merge per layer cost about
# what they save
SHARE_MIN_TOKENS = 32768
# Paged prefill between decode chunks (without mixed chunks, or with a fixed ``prefill_budget``,
# see `ServingEngine._prefill_tokens`): once most admitted sequences decode, as many prompt tokens
# as take this share of a decode chunk's time (their inter-token latency grows by about this
# share); while fewer decode than wait for their prefill, as many as take this long (the engine
# comes back between them to admit and cancel).
PREFILL_SHARE = 0.5
PREFILL_IDLE_SECONDS = 0.5
PREFILL_MIN_TOKENS = 2048  # (in whole prefill chunks, at least one)
# Tokens per prefill forward of one prompt into a block pool on a GPU or TPU (`prefill_chunk=None`):
# a server prefills one sequence at a time, and a 512-token chunk leaves the GEMMs small (H100,
# Qwen2.5-1.5B, one 32k prompt: 37k tokens/s paged in chunks of 512, 62k in chunks of 2048, 69k in
# chunks of 4096; a decode chunk then waits ~25 ms for one prefill chunk at most). Dense slots keep
# the library's 512: their rows are sized in whole prefill chunks (`ServingEngine.S`), 18% more
# memory per slot at the default 8192 tokens with 2048.
SERVE_PREFILL_CHUNK = 2048
# Mixed chunks (paged, ``mixed_prefill``): at most this many of a chunk's rounds carry a prompt
# piece each in their forward (the first ones)
MIXED_ROUNDS = 8
# ... and only as many pieces as add at most this share to the chunk's time without them (as
# `PieceCost` predicts them; one piece while none was measured), the chunk's other rounds plain;
# pieces that add more (the first one always goes in) make the chunk run more plain rounds, up to
# `MIXED_STRETCH` times ``rounds_per_chunk``, to keep the share. The clients of the running
# streams get a chunk's tokens at once, so their inter-token latency grows by about this share
# while prompts fill, whatever the piece size (more in the chunks that take longer than
# predicted: the prediction is the fit's 90th percentile, `PieceCost`); the price is the
# filling prompts' time to first token (at most a share of 0.4 / 1.4 of the device's time goes to
# prefill while streams decode)
PIECE_SHARE = 0.4
MIXED_STRETCH = 4
# A mixed chunk that took less than its rounds' predicted time by more than this share of it
# teaches the piece cost nothing (the rounds' prediction is off: early on, before it has learned)
MIXED_NOISE = 0.1
# ... and after this many mixed chunks in a row, a short plain chunk (at most MIXED_ROUNDS rounds)
# times a plain round again: the cost model's chunk sizes and the piece cost both need it
MIXED_CALIBRATE_EVERY = 16
MIX_NONE, MIX_PIECES, MIX_CALIBRATE = 0, 1, 2  # `ServingEngine._mixing`
# While at most this many streams decode, a chunk ends after the round in which one of them ends
# (`jaxspec.decoding.run_chunk`'s ``end_after``): that stream's last tokens then reach the client
# at once instead of after the chunk's remaining rounds (a client sees its last tokens arrive one
# chunk late: with sequences starting at different times, about 1% of all tokens, which set the
# ITL p99). Each early end costs the other streams one host turn between chunks (a few ms), so with
# many streams, which end every few rounds, chunks run their full length.
END_EARLY_MAX_ROWS = 8
# `ServingEngine.chunk_timeline` keeps this many of the last decode chunks
TIMELINE_CHUNKS = 8192
# Paged (``fill_first``): while no sequence decodes, one whose prompt is in waits for the others
# still filling or queued for a free slot, at most this long; then they start together. A burst
# of long prompts fills at the full prefill rate and no stream sees another's prefill; the price
# is the early prompts' time to first token (H100, Qwen2.5-1.5B shape: 64 prompts of 1k-32k sent
# at once fill in ~5.3 s at ~95k tokens/s, and their TTFT p99 is 0.96-0.97x that of 16 dense
# slots in the same memory, their TTFT p50 1.4-1.7x; `benchmarks/server_mixed_qwen15_h100.md`).
FILL_FIRST_SECONDS = 10.0
# Paged (``growth_reserve``): admission keeps free the blocks that each sequence in a slot (and
# the one admitted) needs for this many more tokens of its budget (at least the chunks in flight
# and the next). A preempted sequence's cache is computed again (a 32k prompt: ~0.3 s of an H100,
# while the streams wait or slow down), so in a burst it is cheaper for the last requests to wait
# for blocks than to be admitted and preempt one another.
GROWTH_RESERVE_TOKENS = 512


class PieceCost:
    """The time prompt pieces add to a mixed chunk beyond its rounds' own, learned from measured
    chunks: ``fixed + per_key * keys`` per piece, where ``keys`` is the piece's mean attended
    context (its start plus half its length). A piece's GEMMs are those of the compiled piece
    size whatever its length, its attention grows with its offset (Qwen2.5-1.5B shape, H200: a
    2048-token piece adds ~12 ms at offset 0 and ~45 ms at 30k), so one number per piece would
    let pieces at long offsets overrun the chunk's share. A least-squares fit of the chunks'
    added times to their pieces' count and summed keys, the older chunks' weight decaying by
    `DECAY` per chunk, coefficients kept non-negative (one of them dropped while the pieces
    seen do not tell them apart, e.g. all at one offset).

    The fit is a mean, and pieces of one shape scatter around it (H200, Qwen2.5-1.5B, Poisson
    arrivals: measured / fitted 0.5-0.95 at the 10th-50th percentile, 1.5-1.6 at the 90th), so
    the chunks the fit under-predicts were the ones whose tokens set the streams' ITL p99.
    `predict` therefore scales the fit by the `TAIL` quantile of the last `TAIL_WINDOW` chunks'
    measured / fitted times (by the fit as it is now; at least 1, at most `TAIL_MAX`; 1 until
    `TAIL_MIN` were seen): a chunk keeps its share for that quantile of pieces, not only on
    average."""

    DECAY = 0.8
    KEYS = 1e4  # (the keys' unit: the two features of one scale)
    TAIL = 0.9
    TAIL_WINDOW = 32
    TAIL_MIN = 8
    TAIL_MAX = 3.0

    def __init__(self):
        self._xx = np.zeros((2, 2))
        self._xy = np.zeros(2)
        self.coef = None  # (seconds per piece, seconds per `KEYS` keys per piece)
        self._seen = collections.deque(maxlen=self.TAIL_WINDOW)  # (keys, seconds) of chunks
        self.margin = 1.0  # what `predict` scales the fit by

    def mean(self, keys: float) -> float | None:
        """The fit's seconds for a piece of ``keys`` mean attended keys (None before a chunk)."""
        if self.coef is None:
            return None
        return float(self.coef[0] + self.coef[1] * keys / self.KEYS)

    def observe(self, keys, seconds: float):
        """A chunk whose pieces (mean attended keys each) added ``seconds`` to its rounds."""
        self._seen.append((np.asarray(keys, np.float64), max(float(seconds), 0.0)))
        x = np.array([len(keys), float(np.sum(keys)) / self.KEYS])
        self._xx = self.DECAY * self._xx + np.outer(x, x)
        self._xy = self.DECAY * self._xy + x * max(float(seconds), 0.0)
        xx, xy = self._xx, self._xy
        fits = []  # the non-negative least squares of two unknowns: its candidates
        det = xx[0, 0] * xx[1, 1] - xx[0, 1] ** 2
        if det > 1e-3 * xx[0, 0] * xx[1, 1]:  # (the pieces seen tell the two parts apart)
            c = np.linalg.solve(xx, xy)
            if np.all(c >= 0):
                fits.append(c)
        for i in (0, 1):  # one part alone: the fixed one first (it wins a tie: pieces all at
            if xx[i, i] > 0:  # one offset fit both alike, and a piece's GEMMs are a fixed cost)
                c = np.zeros(2)
                c[i] = xy[i] / xx[i, i]
                fits.append(c)
        loss = [float(c @ xx @ c - 2 * c @ xy) for c in fits]
        best = min(loss)
        tie = 1e-9 * (abs(best) + float(xy @ xy) + 1e-30)
        self.coef = next(c for c, v in zip(fits, loss) if v <= best + tie)
        ratios = [t / f for k, t in self._seen
                  if (f := len(k) * self.coef[0] + self.coef[1] * k.sum() / self.KEYS) > 0]
        self.margin = 1.0 if len(ratios) < self.TAIL_MIN else float(
            np.clip(np.quantile(ratios, self.TAIL), 1.0, self.TAIL_MAX))

    def predict(self, keys: float) -> float | None:
        """Seconds a piece of ``keys`` mean attended keys adds at the `TAIL` quantile (the fit
        times ``margin``; None until a chunk was seen)."""
        if self.coef is None:
            return None
        return self.mean(keys) * self.margin


def default_prefill_chunk(paged: bool) -> int:
    """A server's tokens per prefill forward: `SERVE_PREFILL_CHUNK` for a block pool on a GPU or
    TPU, else the library's default (512)."""
    if paged and jax.default_backend() != "cpu":
        return SERVE_PREFILL_CHUNK
    return DEFAULT_PREFILL_CHUNK


class _ChunkFailed(Exception):
    """A decode chunk that failed on the device thread, raised where the engine thread next
    takes the slots' state (its cause: the chunk's error). Admission and prefill, which catch
    their own errors per request, let it through: it belongs to the sequences that were in the
    chunk, not to the one being admitted."""


def _clear_frames(e: BaseException):
    """Clears the locals of the finished frames in ``e``'s traceback and in those of the
    exceptions it was raised from (JAX keeps its own frames in the cause)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


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
        self._piece_at = 0  # the first of _pieces not wholly emitted
        self._po = 0  # detokenizer: prefix offset
        self._ro = 0  # detokenizer: read offset
        # tokens decoded before the first generated ones (a completion's prompt tail), so that
        # a first token's leading space (SentencePiece's "\u2581") is kept, as vLLM keeps it
        self.text_context: list[int] = []
        self.slot: int | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cancelled = False
        self.rounds = 0  # target verification steps this sequence took part in
        self.accepted = 0  # accepted draft tokens
        self.proposed = 0
        self.t_submit = time.perf_counter()
        self.blocks: list[int] = []  # its blocks of a paged pool (in table order)
        self.cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.fill: list[int] = []  # the tokens its row's cache must hold before decoding
        self.fill_keys: list[bytes] = []  # the prefix keys of its full blocks (`BlockManager.keys`)
        self.filled = 0  # of which are in the cache
        self.preemptions = 0
        self.counted = False  # its prompt is in the metrics (admission may be retried)
        self.retried = False  # it started over after a failed chunk (it does so once)
        self.held = False  # its prompt is in, and it waits for others' (fill_first)
        self.resume_key = None  # its row's PRNG key when it was preempted (it resumes with it)
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
                "total_tokens": len(self.prompt_ids) + len(self.tokens),
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def stats(self) -> dict:
        out = {"rounds": self.rounds, "accepted": self.accepted, "proposed": self.proposed,
               "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
               "tokens_per_step": len(self.tokens) / self.rounds if self.rounds else None}
        if self.t_first is not None:
            out["ttft_s"] = self.t_first - self.t_submit
        return out


# ---------------------------------------------------------------------------- the engine
class ServingEngine:
    """Continuous-batching engine over one model (see module docstring).

    model: a `jaxspec.Model` (with a tokenizer for text prompts; on a mesh when it has one: the
        slots are split over the data axis, so ``max_batch`` must be a multiple of it).
    max_batch: slots (batch rows of the decode state).
    max_len: tokens per sequence (prompt + completion); default: the model's context, at most 4096;
        never more than the model's context, nor than a full-cache draft model's.
    speculation: a `jaxspec.Speculation` (or None for plain decoding).
    chunk_seconds: the time a decode chunk aims at (the streaming granularity).
    rounds_per_chunk: the most rounds a chunk runs (a mixed chunk with a costly prompt piece:
        up to ``mixed_stretch`` times it, see ``mixed_prefill``).
    max_queue: waiting sequences beyond which `submit` raises `QueueFull`.
    page_size: paged K/V (`jaxspec.paged`): blocks of this many slots shared by all slots, so
        memory follows the sequences' actual lengths; a request reuses the cached blocks of its
        longest cached prefix (automatic prefix caching, `jaxspec.blocks`); prompts are prefilled
        in chunks between decode chunks (``prefill_budget`` tokens each time if given, else
        half a second's worth at the measured prefill rate while fewer sequences decode than
        wait for their prefill, then as many as take half a decode chunk's time, at least
        `PREFILL_MIN_TOKENS` (2048) tokens in whole prefill chunks); when
        blocks run out, the most recently admitted sequence is preempted (its cache recomputed
        later, from its prompt and the tokens it has generated: nothing is lost). None: one dense
        cache row of ``max_len`` slots per slot.
    kv_blocks: blocks in the pool (default: what a dense cache of the same slots would hold).
    share_min_tokens: paged: when running sequences begin with the same cached blocks (one
        document asked many questions, a long system prompt), a dense copy of those blocks is
        attended to once for all of them (shared-prefix attention, `jaxspec.paged.SharedContext`)
        instead of by each one, if that saves at least this many key reads per step ((sharing
        rows - 1) x shared tokens); None: never.
    ignore_eos: sequences do not stop at the model's EOS (benchmarks of fixed length).
    compact_rows: while at most half the slots decode, a chunk runs only their rows (taken out
        of the slots' state and put back: a smaller batch). It pays where a step's cost grows with
        its rows, as on a CPU (SmolLM2-135M on 2 cores: ~70 ms per step for one row, ~140 ms for
        four), and for a block pool on a GPU, whose rows move without their K/V: the attention
        kernel spreads a few rows' keys over the whole GPU only when it is planned for few rows
        (Qwen2.5-1.5B on an H100, 4 rows of 8k among 64 slots: 3.55 ms per step, 2.57 ms as a
        batch of 4). A mixed chunk (``mixed_prefill``) runs over its pieces' rows as well (H200,
        Qwen2.5-1.5B, Poisson arrivals of 1k-32k prompts: the streams' ITL p99 4.8-5.3 ms
        against 5.9-6.8 ms over all 64 slots). Each smaller batch compiles in the background
        (at warm-up on a GPU) and is used once ready; no chunk is compacted while a shared
        context is in use, nor on a mesh.
        Default: on a CPU; on a GPU for a block pool, unless a draft model keeps a full cache
        per row (its rows would be copied).
    batch_invariant: batch-invariant numerics (`jaxspec.invariant`): a request's greedy tokens are
        bitwise the ones it gets alone, whatever the other slots hold, its slot, the prefill
        chunking, prefix-cache hits, preemption and speculation. Sampled tokens too: a request
        with ``seed`` s (choice j) gets the tokens ``jaxspec.generate([prompt], seed=s,
        batch_invariant=True, ...)`` gives (sample j with ``n``), with the same speculation
        when it is not adaptive (``adaptive=False``: adaptive chunks choose plain steps or
        speculation from all the slots); draws are keyed by token position, so a preempted
        sequence resumes with the draws it would have made. No shared-context attention then
        (``share_min_tokens`` is ignored); not on a mesh.
    mixed_prefill: paged: while some sequences decode and others wait for their prefill, decode
        rounds (a plain step or a speculative round's verification) also prefill a piece of this
        many prompt tokens each in the same forward (oldest admission first;
        `jaxspec.model.forward_mixed`: the weights are read once for both), so running streams
        keep going while long prompts fill, instead of waiting for whole prefill steps between
        decode chunks. A chunk carries pieces in as many of its first rounds as add at most
        `PIECE_SHARE` of its rounds' time (`PieceCost` predicts them from the measured chunks),
        then plain rounds, more of them (up to ``mixed_stretch`` x ``rounds_per_chunk``) where
        its one piece adds more (the streams get a chunk's tokens per host turn); a chunk in
        which a stream's token budget would end carries none (plain rounds up to that end, the
        piece next). Smaller pieces: less added per round, slower prefill (Qwen2.5-1.5B shape,
        H200: a 2048-token piece at a 30k offset adds ~45 ms to its round, a 128-token one ~3
        ms; `benchmarks/server_poisson_random_h200.md`). Default:
        ``prefill_chunk`` (at most ``max_len``) for a block pool (unless ``prefill_budget`` is
        given); 0: off. Not on a mesh.
    fill_first: paged: while no sequence decodes, a sequence whose prompt is in waits (at most
        this many seconds since the first one did, and only while the prompt tokens left take
        no longer than the time left at the measured prefill rate, a prefix they share or the
        prefix cache holds counted once; never one resumed after a preemption) for the others
        being prefilled or queued for the free slots (a burst's requests arrive over a while),
        and they start decoding together: a burst of prompts fills at the full prefill rate,
        with no stream slowed by another's prefill
        (with mixed pieces, a round that carries a piece takes several times a plain round;
        without them, whole prefill steps stall the streams). The early prompts' first tokens
        wait for it. Default `FILL_FIRST_SECONDS` for a block pool; 0: a sequence starts as
        soon as its prompt is in.
    growth_reserve: paged: a sequence is admitted only if the pool keeps, beyond its prompt's
        blocks, the blocks that it and every sequence in a slot need for this many more tokens
        of their budgets (at most what each budget allows) and the next two chunks, so that
        sequences whose budgets fit are not preempted later (a preempted sequence's cache is
        computed again); 0: the next two chunks' only. A decoding sequence that needs a block
        takes this room at once while the pool holds every slot's (its block table is written
        again only when it is used up).
    mixed_stretch: paged, with ``mixed_prefill``: a mixed chunk whose one piece adds more than
        `PIECE_SHARE` of its ``rounds_per_chunk`` rounds' time runs up to this many times as many
        rounds, to keep that share (a piece at a long offset attends to all the keys before it:
        the longest prompts' last pieces cost the most). More: the running streams' inter-token
        latency stays near its share for longer prompts, and those prompts take longer to fill
        (their time to first token) while streams decode, and every chunk's output buffer holds
        ``rounds_per_chunk`` x this many rounds' tokens per row; 1: chunks never stretch.
        Default `MIXED_STRETCH`.
    """

    def __init__(self, model: Model, *, max_batch: int = 8, max_len: int | None = None,
                 speculation=None, rounds_per_chunk: int = 64, max_queue: int = 256,
                 prefill_chunk: int | None = None, attn_impl: str = "auto",
                 stop_tokens=None, warmup_prefill: int = 0,
                 chunk_seconds: float = CHUNK_SECONDS, per_row: bool = True,
                 page_size: int | None = None, kv_blocks: int | None = None,
                 prefill_budget: int | None = None,
                 share_min_tokens: int | None = SHARE_MIN_TOKENS, ignore_eos: bool = False,
                 compact_rows: bool | None = None, batch_invariant: bool = False,
                 mixed_prefill: int | None = None, fill_first: float | None = None,
                 growth_reserve: int = GROWTH_RESERVE_TOKENS,
                 mixed_stretch: int | None = None):
        if not isinstance(model, Model):
            raise TypeError(f"model must be a jaxspec.Model, got {type(model).__name__}")
        compile_cache.enable()  # as generate: compiled chunks outlive the process
        if max_batch < 1 or rounds_per_chunk < 1 or max_queue < 1:
            # (a queue of 0 would refuse every request: each one waits in it, if only briefly)
            raise ValueError("max_batch, rounds_per_chunk and max_queue must be >= 1")
        if not chunk_seconds > 0:
            raise ValueError(f"chunk_seconds must be > 0, got {chunk_seconds!r}")
        del per_row  # every slot has its own key (kept for callers of the old signature)
        if prefill_chunk is None:
            prefill_chunk = default_prefill_chunk(page_size is not None)
        self.decoder = dec = Decoder(model, speculation, attn_impl=attn_impl,
                                     prefill_chunk=prefill_chunk,
                                     batch_invariant=batch_invariant)
        self.batch_invariant = dec.batch_invariant
        if self.batch_invariant and speculation is not None and (
                speculation.adaptive or speculation.gamma == "auto"):
            log.warning("batch-invariant serving with adaptive speculation: greedy requests are "
                        "invariant; sampled ones are not (adaptive chunks are chosen from all "
                        "the slots): use a fixed gamma with adaptive=False for those")
        self.model = dec.model
        self.config = cfg = dec.config
        self.tokenizer = model.tokenizer
        self.B = int(max_batch)
        if dec.mesh is not None and self.B % dec.mesh.shape["data"]:
            d = dec.mesh.shape["data"]
            raise ValueError(f"max_batch={self.B}: the mesh's data axis splits the slots over {d} "
                             f"devices; give a multiple of {d}")
        self.rounds = int(rounds_per_chunk)
        self.chunk_seconds = float(chunk_seconds)
        self.max_queue = int(max_queue)
        self.prefill_chunk = int(prefill_chunk)
        self.impl = dec.impl
        self.warmup_prefill = int(warmup_prefill)
        self.stop_ids = stop_token_ids(model, stop_tokens, eos=not ignore_eos)
        ctx = cfg.max_position_embeddings
        if max_len is not None and (isinstance(max_len, bool) or int(max_len) != max_len
                                    or max_len < 2):
            raise ValueError(f"max_len must be an int >= 2 (prompt + completion) or None, got "
                             f"{max_len!r}")
        self.max_len = int(min(max_len or min(ctx, 4096), ctx))
        self.speculation = speculation
        self.draft = dec.draft
        self.tree = dec.tree
        if self.draft is not None and speculation.window is None:  # a full-cache draft model
            # like the target's context above: a sequence never outgrows the draft's cache
            self.max_len = min(self.max_len, self.draft.config.max_position_embeddings)
        self.extra = dec.extra_slots
        self.gamma = 0
        if speculation is not None:
            self.gamma = dec.max_depth if speculation.gamma != "auto" or self.tree is not None \
                else 0  # "auto": chosen at warm-up
        self._auto_gamma = speculation is not None and speculation.gamma == "auto"
        # whole prefill chunks must fit (see `jaxspec.prefill.prefill_row`)
        self.S = round_up(self.max_len + self.extra, max(SLOT_ALIGN, self.prefill_chunk))
        self.tokens_per_round = (dec.max_depth + 1) if speculation is not None else 1
        self.paged = page_size is not None
        asked = mixed_prefill is not None
        if mixed_prefill is None:  # on for a pool, unless a fixed budget between chunks is asked
            mixed_prefill = min(self.prefill_chunk, self.max_len) \
                if self.paged and prefill_budget is None else 0
        if int(mixed_prefill) < 0:
            raise ValueError(f"mixed_prefill must be >= 0, got {mixed_prefill!r}")
        if mixed_prefill and not self.paged:
            raise ValueError("mixed_prefill needs a block pool (page_size)")
        if asked and int(mixed_prefill) > self.max_len:  # (MIXED_ROUNDS x that many tokens)
            raise ValueError(f"mixed_prefill={mixed_prefill} is more than max_len={self.max_len} "
                             f"tokens: a piece is at most one prompt")
        if mixed_prefill and asked and dec.mesh is not None:
            log.warning("mixed_prefill is off on a mesh: prompts fill between decode chunks")
        # (a mesh splits the slots over its data axis: a prompt piece is one row's)
        self.mixed_prefill = int(mixed_prefill) if dec.mesh is None else 0
        if mixed_stretch is None:
            mixed_stretch = MIXED_STRETCH
        if isinstance(mixed_stretch, bool) or int(mixed_stretch) != mixed_stretch \
                or mixed_stretch < 1:
            raise ValueError(f"mixed_stretch must be an int >= 1 or None (default "
                             f"{MIXED_STRETCH}), got {mixed_stretch!r}")
        self.mixed_stretch = int(mixed_stretch)
        # the most rounds a chunk runs: a mixed chunk with a costly piece up to ``mixed_stretch``
        # times ``rounds_per_chunk``
        self.max_chunk_rounds = self.rounds * (self.mixed_stretch if self.mixed_prefill else 1)
        self.out_len = self.max_chunk_rounds * self.tokens_per_round
        self.blocks = None
        if self.paged:
            if isinstance(page_size, bool) or int(page_size) != page_size or page_size < 1:
                raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
            if kv_blocks is not None and (isinstance(kv_blocks, bool) or kv_blocks < 1):
                raise ValueError(f"kv_blocks must be >= 1 or None (default), got {kv_blocks!r}")
            if prefill_budget is not None and int(prefill_budget) < 1:
                # (0 or less: `_prefill_step` would never prefill a prompt token: every request
                # with a prompt of 2 or more tokens would wait for ever)
                raise ValueError(f"prefill_budget must be >= 1 tokens or None, got "
                                 f"{prefill_budget!r}")
            if speculation is not None and not speculation.is_self and speculation.window is None:
                raise ValueError("a paged server speculates with draft='self' or a ring-buffer "
                                 "draft model (window=...), not a full-cache draft")
            self.page_size = int(page_size)
            # a sequence of max_len, the writes of one chunk ahead and the slot after them
            self.max_blocks = -(-(self.max_len + self.extra + self.out_len + 1) // self.page_size)
            n_blocks = int(kv_blocks) if kv_blocks is not None else self.B * self.max_blocks
            if n_blocks < self.max_blocks:
                raise ValueError(f"kv_blocks={n_blocks} cannot hold one sequence of max_len "
                                 f"{self.max_len} ({self.max_blocks} blocks of "
                                 f"{self.page_size})")
            self.n_blocks = n_blocks
            # None: chosen each time from the measured prefill rate (`_prefill_tokens`)
            self.prefill_budget = None if prefill_budget is None else int(prefill_budget)
            self._prefill_rate = None  # prompt tokens / s, measured
            self._chunk_s = 0.0  # device seconds of the last decode chunk
        self._mixed_run = 0  # mixed chunks dispatched since the last plain one
        self._piece_skipped = False  # the last chunk that had pieces to carry went without
        self._piece_cost = PieceCost()  # the time pieces add to their chunk (`PIECE_SHARE`)
        self._programs_run = set()  # ids of the chunk programs run (`_run_chunk`'s first_run)
        if fill_first is None:
            fill_first = FILL_FIRST_SECONDS if self.paged else 0.0
        if not float(fill_first) >= 0:
            raise ValueError(f"fill_first must be >= 0 seconds, got {fill_first!r}")
        if float(fill_first) and not self.paged:
            raise ValueError("fill_first needs a block pool (page_size): dense slots prefill a "
                             "whole prompt at admission")
        self.fill_first = float(fill_first)
        if int(growth_reserve) < 0:
            raise ValueError(f"growth_reserve must be >= 0 tokens, got {growth_reserve!r}")
        self.growth_reserve = int(growth_reserve)
        self._held_since = None  # when a sequence whose prompt is in first waited (fill_first)
        self._admit_short = False  # the last admission left a sequence waiting for blocks
        if share_min_tokens is not None and int(share_min_tokens) < 0:
            raise ValueError(f"share_min_tokens must be >= 0 or None, got {share_min_tokens!r}")
        # (batch-invariant attention reads every row's keys through its own table: no sharing)
        self.share_min_tokens = None if share_min_tokens is None or not self.paged \
            or self.batch_invariant else int(share_min_tokens)
        self._shared = None  # (shared blocks, sharing rows) of `_shared_ctx`
        self._shared_want = None  # the same, as `_share` last chose it for the next chunks
        # the shared context itself (`jaxspec.paged.SharedContext`): kept out of the state, which
        # prefills and row updates see; a decode chunk gets it attached and hands it back
        self._shared_ctx = None
        self._shared_dirty = True  # block tables or running rows changed since it was chosen
        self._pending = None  # the chunk running on the device thread (see `state`)
        self._rows = None  # (rows, their state) after compact chunks (see `_compact`)
        self._moves: dict = {}  # the compiled row moves of compact chunks, by shapes
        # the most sequences in slots at once since a caller last set it (benchmarks sample it)
        self.running_peak = 0
        self._device: concurrent.futures.ThreadPoolExecutor | None = None
        self.state = self._fresh_state()
        if compact_rows is None:
            full_draft = self.draft is not None and speculation.window is None
            compact_rows = jax.devices()[0].platform == "cpu" or (self.paged and not full_draft)
        self.compact_rows = bool(compact_rows) and dec.mesh is None and compactable(self.state)
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None  # smaller batches
        self._compiling: set = set()  # (round, rows) whose program compiles in the background
        self._compile_futures: list = []
        # host mirrors of the per-slot state
        self.done = np.ones(self.B, bool)  # no running sequence, or the device said done
        self.lengths = np.zeros(self.B, np.int64)  # cache lengths after the last chunk seen
        self.temperature = np.zeros(self.B, np.float32)
        self.top_k = np.zeros(self.B, np.int32)
        self.top_p = np.ones(self.B, np.float32)
        self._inflight = collections.deque()  # chunks dispatched, tokens not yet handled
        self._stop_rows: set[int] = set()  # rows to stop on the device before the next chunk
        self._started: set[int] = set()  # paged rows whose prefill is done (they decode)
        self.row_rounds = np.zeros(self.B, np.int64)  # speculative rounds of the slot's sequence
        self.row_committed = np.zeros(self.B, np.int64)  # tokens those rounds committed
        self.slots: list[Sequence | None] = [None] * self.B
        self.waiting: collections.deque[Sequence] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self._paused = False
        self.fault_hook = None  # tests: called with each Sequence at admission (may raise)
        self.step_fault_hook = None  # tests: called before each decode chunk (may raise)
        # the last decode chunks, as `chunk_timeline` gives them
        self._timeline = collections.deque(maxlen=TIMELINE_CHUNKS)
        # metrics counters; every key exists from the start (other threads read them while the
        # engine thread updates them)
        self.m = collections.Counter({k: 0 for k in (
            "sequences_submitted", "sequences_admitted", "prompt_tokens", "prefill_tokens",
            "generation_tokens", "chunks", "rounds", "chunk_seconds", "busy_slot_rounds",
            "slot_rounds", "draft_proposed", "draft_accepted", "target_row_steps",
            "speculative_chunks", "plain_chunks", "rejected_queue_full", "finished_stop",
            "finished_length", "finished_cancelled", "finished_error", "preemptions",
            "prefix_hit_tokens", "prefix_query_tokens", "shared_context_rows",
            "shared_context_tokens", "shared_context_copies", "shared_context_row_chunks",
            "compact_chunks", "mixed_chunks", "mixed_prefill_tokens", "held_sequences",
            "pieces_deferred")})
        # acceptance per draft position i (a chain's i-th draft, a tree's depth i), over the
        # speculative rounds a sequence completed: rounds that proposed a draft there, rounds
        # that accepted it (`_count_positions`)
        self.positions = dec.max_depth
        self.m.update({f"{k}_{i}": 0 for i in range(1, self.positions + 1)
                       for k in ("position_proposed", "position_accepted")})
        self.started_at = time.time()
        self.warm = False  # set once the programs are compiled (`warmup`)

    # ------------------------------------------------------------------ properties
    @property
    def state(self):
        """The slots' `DecodeState`. While a decode chunk runs on the device thread (see
        `_run_chunk`) reading it waits for that chunk and takes the state it returned (a chunk
        that failed raises here), so every device call on the state runs in order."""
        self._resolve()
        if self._rows is not None:  # compact rows back into the slots' state
            rows, sub = self._rows
            self._rows = None
            self._state = put_rows(self._state, jnp.asarray(rows), sub, self._moves)
        return self._state

    def _resolve(self):
        """Takes the running chunk's result (waiting for it): the slots' state, or the state of
        the rows a compact chunk ran (`_rows`; the slots' state holds stale copies of them)."""
        if self._pending is not None:
            fut, self._pending = self._pending, None
            try:
                state, _, _, _, self._shared_ctx, rows = fut.result()
            except Exception as e:  # noqa: BLE001 - raised again, as the chunk's
                raise _ChunkFailed(e) from e
            if rows is None:
                self._state = state
            else:
                self._rows = (rows, state)

    @state.setter
    def state(self, value):
        if self._pending is not None:  # replaced: the running chunk's state is not needed
            fut, self._pending = self._pending, None
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - its failure was or will be reported by _process
                pass
            # its shared context goes with it (a state replaced unread is a new pool, or none)
            self._shared_ctx = self._shared = self._shared_want = None
            self._shared_dirty = True
        self._rows = None
        self._state = value

    @property
    def alive(self) -> bool:
        return self._running and self._thread is not None and self._thread.is_alive()

    @property
    def speculative(self) -> bool:
        return self.speculation is not None and self.gamma > 0

    def describe(self) -> str:
        """One line on how this engine decodes (the page's subtitle, the start-up log)."""
        if self.speculation is None:
            how = "plain decoding (no draft)"
        else:
            sp = self.speculation
            if self.tree is not None:
                kind = "token-tree speculation"
            else:
                kind = "speculative decoding"
            draft = "self-draft" if sp.is_self else "draft model"
            if sp.window is not None:
                draft += f" reading {sp.sink} sink + {sp.window} recent keys"
            g = "gamma auto" if self._auto_gamma and not self.gamma else f"gamma {self.gamma}"
            how = f"{kind} ({draft}, {g})"
        kv = (f"paged K/V (pages of {self.page_size}, prefix caching)" if self.paged
              else "one K/V row per slot")
        return f"continuous batching over {self.B} slots, {kv}, {how}"

    def _round(self, greedy: bool):
        return self.decoder.round(self.gamma if self.speculative else 0, greedy=greedy,
                                  stop_ids=self.stop_ids)

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
        self._check_ids(ids)
        return ids

    def _check_ids(self, ids: list[int]) -> None:
        V = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {V}): {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")

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

    def check_sequence(self, s: Sequence) -> None:
        """Raises ValueError for a sequence the engine cannot run (checked before it is queued: on
        the engine thread it would fail the rows decoding beside it): an empty prompt, token ids
        outside the vocabulary, sampling options of the wrong type or out of range."""
        self._check_ids(s.prompt_ids)
        o = s.options

        def number(name, ok):
            v = getattr(o, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(v) or not ok(v):
                raise ValueError(f"SamplingOptions.{name}={v!r} is out of range")
        number("temperature", lambda v: v >= 0)
        number("top_p", lambda v: 0 < v <= 1)
        if isinstance(o.top_k, bool) or not isinstance(o.top_k, (int, np.integer)) \
                or not 0 <= o.top_k < 2 ** 31:
            raise ValueError(f"SamplingOptions.top_k={o.top_k!r} must be an int in [0, 2**31) "
                             f"(0: off)")
        for name in ("max_tokens", "seed"):
            v = getattr(o, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
                raise ValueError(f"SamplingOptions.{name}={v!r} must be an int or None")
        if o.max_tokens is not None and o.max_tokens < 0:
            raise ValueError(f"SamplingOptions.max_tokens={o.max_tokens!r} must be >= 0")
        if isinstance(o.stop, str) or not all(isinstance(x, str) and x for x in o.stop):
            raise ValueError(f"SamplingOptions.stop={o.stop!r} must be a tuple of non-empty "
                             f"strings")

    def submit(self, seqs: list[Sequence]):
        """Queues sequences (all or none). Raises QueueFull, PromptTooLong, EngineStopped, and
        ValueError for a sequence it cannot run (`check_sequence`)."""
        for s in seqs:
            self.check_sequence(s)
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
        if self._state is None:  # stopped before (`stop` let the slots' state go): start empty
            self.state = self._fresh_state()
            self.done[:] = True
            self._started.clear()
            self._stop_rows.clear()
        if warmup:
            self.warmup(variants)
        else:
            self.warm = True
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
        self._inflight.clear()
        self.state = None  # the device memory of the slots goes now, whoever still holds us
        if self._device is not None:
            self._device.shutdown(wait=True)
            self._device = None
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
            self._compiler = None

    def warmup(self, variants=None):
        """Compiles the chunk variants with every slot idle: ``variants`` is a list of
        ``(greedy, filtering)`` pairs (default: greedy, sampling, sampling with top-k / top-p; a
        benchmark that only sends greedy requests passes ``[(True, False)]``), then prefill."""
        self.decoder.costs.rates  # the device benchmark of the cost model, before serving
        if self._auto_gamma:
            self._choose_gamma()
        if variants is None:
            variants = ((True, False), (False, False), (False, True))
        # with a shared context the chunks are other programs: compiled here too, on an empty one
        for shared in (False, True) if self.share_min_tokens is not None else (False,):
            self._shared_want = ((), ()) if shared else None
            for greedy, filtering in variants:
                for r in self._round_kinds(bool(greedy)):
                    self._run_chunk(r, bool(greedy), bool(filtering), rounds=0, compile_only=True)
                for r in self._round_kinds(bool(greedy)) if self.mixed_prefill else ():
                    self._compile_mixed(r, bool(greedy), bool(filtering))
        self._shared_want = None
        self._apply_shared()
        if self.compact_rows and jax.devices()[0].platform != "cpu":
            self._compile_compact(variants)  # (on a CPU as a small batch first runs)
        n = 16  # paged prefill shapes (power-of-two chunks up to prefill_chunk) in row 0, which
        # maps no block yet (its writes go nowhere); batch-invariant: also as decode steps
        # compute tokens (a resumed sequence's generated ones, `_prompt_end`)
        ends = (None, 0) if self.batch_invariant else (None,)
        while self.paged:
            for pe in ends:
                self.state = self.decoder.prefill_paged_row(self.state, 0, [0] * n, 0,
                                                            prompt_end=pe)
            if n >= min(max(self.warmup_prefill, 16), self.prefill_chunk):
                if n < self.prefill_chunk:  # and the whole chunk, every long prompt's shape
                    for pe in ends:
                        self.state = self.decoder.prefill_paged_row(
                            self.state, 0, [0] * self.prefill_chunk, 0, prompt_end=pe)
                break
            n *= 2
        n = 16  # prefill shapes (power-of-two buckets) up to warmup_prefill tokens, in free row 0
        while not self.paged and n <= min(self.warmup_prefill, self.max_len - 1):
            self.state = self.decoder.prefill_row(self.state, 0, [0] * n)
            n *= 2
        sampling.start_keys([0], [0], size=self.B)  # the keys of starting rows, compiled once
        B = self.B  # the row updates, compiled once (rows past the batch are no-ops)
        nowhere = jnp.full((B,), B, jnp.int32)
        zeros = jnp.zeros((B,), jnp.int32)
        self.state = stop_rows(set_rows(self.state, nowhere, zeros, zeros,
                                        jnp.zeros((B, 2), jnp.uint32), zeros), nowhere)
        self.warm = True

    def _compile_mixed(self, rd, greedy: bool, filtering: bool):
        """Compiles the mixed chunk (`mixed_prefill`) of rounds ``rd`` of this sampling variant
        and runs it once with no piece and no round (warm-up: a program's first run on a GPU
        loads its kernels, which the first mixed chunk would otherwise wait for)."""
        sp = self._sampling(greedy, filtering)
        state = self._with_shared(self.state)
        try:
            pieces = self._piece_arrays([])
            program, _ = self.decoder.mixed_program(rd, sp, state, pieces)
            state, _ = self.decoder.call_chunk(program, sp, state, jnp.int32(0), pieces)
            self._programs_run.add(id(program))
        finally:
            self.state = self._without_shared(state)

    def _choose_gamma(self):
        """gamma='auto': the cost model at full slots, each at half the context."""
        ctx = np.full(self.B, self.max_len / 2.0)
        from jaxspec.speculation import GAMMA_CANDIDATES
        g, predicted = self.decoder.costs.choose_gamma(ctx, GAMMA_CANDIDATES)
        log.info("gamma=auto chose gamma=%d (predicted %.2fx at %d slots x %d tokens)", g,
                 predicted, self.B, self.max_len // 2)
        self.gamma = g
        self.tokens_per_round = g + 1

    # ------------------------------------------------------------------ engine thread
    def _sampling(self, greedy: bool, filtering: bool, rows=None):
        pick = slice(None) if rows is None else rows
        return sampling.SamplingParams(temperature=jnp.asarray(self.temperature[pick]),
                                       top_k=jnp.asarray(self.top_k[pick]),
                                       top_p=jnp.asarray(self.top_p[pick]), filtering=filtering,
                                       stochastic=not greedy)

    def _compact(self, rd, greedy, filtering, active, pieces: Pieces | None = None,
                 num_pieces: int = 0):
        """``((rows, sampling, state of those rows, program, pieces), compiling)``: a chunk over
        the ``active`` rows alone (padded with idle rows to a power of two; ``pieces`` with their
        rows renumbered into them), or ``(None, compiling)``: compaction is off, more than half
        the slots run, or (``compiling``) that batch's program is not compiled yet (it then
        compiles in the background). A mixed chunk (its first ``num_pieces`` ``pieces``, rows as
        slots) runs over the rows of its pieces' sequences too (idle rows, whose pieces go
        through their block tables), so that its rounds cost what a small batch's do: a decode
        kernel planned for all the slots spreads a few rows' keys over few programs (H200,
        Qwen2.5-1.5B, 1-2 rows decoding at 10k-30k keys among 64 slots: ~1 ms more per round). The rows' state
        stays apart from the slots' between chunks over the same rows (`_rows`); anything else
        that reads the slots' state puts it back first."""
        if not self.compact_rows or not active or self._shared_want is not None:
            return None, False
        need = list(active)
        if pieces is not None:
            need += sorted({int(r) for r in np.asarray(pieces.rows)[:num_pieces]} - set(need))
        n = 1 << (len(need) - 1).bit_length()
        if 2 * n > self.B:
            return None, False
        self._resolve()  # (waits for the chunk before: in order)
        if self._rows is not None and set(need) <= set(self._rows[0].tolist()):
            rows, sub = self._rows  # the same rows (an idle one among them may have been active)
        else:
            idle = [b for b in range(self.B) if b not in set(need)]
            rows = np.asarray(need + idle[:n - len(need)], np.int32)
            sub = take_rows(self.state, jnp.asarray(rows), self._moves)
        sp = self._sampling(greedy, filtering, rows)
        if pieces is None:
            program, _ = self.decoder.chunk_program(rd, sp, sub, compile=False)
        else:
            program, _ = self.decoder.mixed_program(rd, sp, sub, pieces, compile=False)
        if program is None:
            self._compile_later(rd, greedy, filtering, sp, sub, mixed=pieces is not None)
            return None, True
        self._rows = None  # (the chunk has them now)
        if pieces is not None:  # the pieces' rows among the compact ones (padding: row 0)
            where = {int(r): i for i, r in enumerate(rows)}
            at = np.zeros_like(np.asarray(pieces.rows))
            at[:num_pieces] = [where[int(r)] for r in np.asarray(pieces.rows)[:num_pieces]]
            pieces = pieces.replace(rows=at)
        return (rows, sp, sub, program, pieces), False

    def _compile_later(self, rd, greedy, filtering, sp, sub, mixed: bool = False):
        """Queues the program of a compact chunk over ``sub`` (a state of some rows, or its
        abstract shapes; ``mixed``: the mixed chunk's) for the background compiler, once."""
        key = (rd, sub.last.shape[0], greedy, filtering, mixed)
        if key in self._compiling:
            return
        self._compiling.add(key)
        if self._compiler is None:
            self._compiler = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="jaxspec-compile")
        self._compile_futures.append(self._compiler.submit(self._compile_quietly, rd, sp, sub,
                                                           mixed))

    def _compile_compact(self, variants):
        """Queues every compact chunk's program (each power-of-two batch up to half the slots,
        each warmed round kind and variant, and its mixed chunk's with ``mixed_prefill``):
        compiled in the background while the engine serves, instead of when a small batch first
        runs; the row moves (`take_rows` / `put_rows`) of each size are compiled here (they
        would stall the engine ~0.1 s each when first used)."""
        like = self.state.last.sharding
        n = 1
        while 2 * n <= self.B:
            rows = np.arange(n, dtype=np.int32)
            taken = take_rows(self.state, jnp.asarray(rows), self._moves)
            # (the same rows back)
            self.state = put_rows(self.state, jnp.asarray(rows), taken, self._moves)
            sub = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=like),
                               taken)
            del taken
            for greedy, filtering in variants:
                for rd in self._round_kinds(bool(greedy)):
                    # (a mixed batch holds a decoding row and a piece's: two at least)
                    for mixed in (False, True) if self.mixed_prefill and n > 1 else (False,):
                        self._compile_later(rd, bool(greedy), bool(filtering),
                                            self._sampling(bool(greedy), bool(filtering), rows),
                                            sub, mixed)
            n *= 2

    def _round_kinds(self, greedy: bool):
        """The rounds a chunk may run: the speculative one and, adaptive, its plain round."""
        rd = self._round(greedy)
        return [rd, rd.plain()] if rd.speculative and self.speculation.adaptive else [rd]

    def _compile_quietly(self, rd, sp, state, mixed=False):
        try:
            if mixed:
                self.decoder.mixed_program(rd, sp, state, self._piece_arrays([]))
            else:
                self.decoder.chunk_program(rd, sp, state)
        except Exception:  # noqa: BLE001 - the full batch keeps serving
            log.exception("compiling a chunk of %d rows failed", state.last.shape[0])

    def _run_chunk(self, rd, greedy, filtering, rounds, compile_only=False, active=(),
                   pieces=None, num_pieces=0):
        """Dispatches a decode chunk. It runs on a device thread of its own: a decode loop with a
        data-dependent trip count holds the calling thread until the loop is done (XLA reads the
        loop's condition on the host), so the engine thread detokenizes and streams the last
        chunk's tokens meanwhile (measured on an H100: a plain 8-step chunk held its caller
        63 ms, and the device idled for the host's 4-5 ms between chunks). Returns a future of
        ``(state, outputs, seconds compiling, seconds on the device)``; ``compile_only`` runs a
        zero-round chunk on this thread (warm-up). With ``pieces`` (a `Pieces`) a mixed chunk
        (`jaxspec.decoding.run_mixed_chunk`): ``rounds`` rounds of ``rd`` over every slot (or
        over the ``active`` rows and the pieces' rows alone, `_compact`), the first
        ``num_pieces`` each prefilling a piece. The future's ``first_run`` says whether its
        program ran for the first time (a first run's time is not learned from)."""
        t_dispatch = time.perf_counter()
        sp = self._sampling(greedy, filtering)
        if self.decoder.mesh is not None:
            sp = put_batch(sp, self.decoder.mesh, self.B)
        if compile_only:
            state, _, _ = self.decoder.run_chunk(rd, sp, self._with_shared(self.state), 0)
            self.state = self._without_shared(state)
            return None
        compact, compiling = self._compact(rd, greedy, filtering, active, pieces, num_pieces)
        rows = None
        if compact is not None:
            rows, sp, state, program, pieces = compact
            t_compile = 0.0
            self.m["compact_chunks"] += 1
        elif pieces is not None:
            state = self._with_shared(self.state)
            program, t_compile = self.decoder.mixed_program(rd, sp, state, pieces)
        else:
            state = self._with_shared(self.state)  # waits for the chunk before (in order)
            program, t_compile = self.decoder.chunk_program(rd, sp, state)  # compiled here
        if self._device is None:
            self._device = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="jaxspec-device")
        started = threading.Event()
        end_after = rounds - 1 if len(active) <= END_EARLY_MAX_ROWS else 0
        rec = {"t_dispatch": t_dispatch, "kind": "speculative" if rd.speculative else "plain",
               "rows": len(active), "batch": self.B if rows is None else len(rows),
               "compact": rows is not None,
               "rounds": int(rounds), "pieces": int(num_pieces),
               "first_run": id(program) not in self._programs_run}
        fut = self._device.submit(self._chunk_on_device, program, sp, state, rounds, t_compile,
                                  started, rows, pieces, end_after, num_pieces, rec)
        fut.first_run = rec["first_run"]
        # (a chunk over all the slots while its compact program compiles: its rounds cost more
        # than the cost model's, learned from compact chunks, and the pieces would be charged)
        fut.full_for_now = compiling
        fut.rec = rec
        self._programs_run.add(id(program))
        del compact
        del state  # donated to the chunk
        self._pending = fut
        # the device thread's Python work first: this thread would otherwise hold the GIL for a
        # whole switch interval (5 ms) while it streams the last chunk's tokens
        while not started.wait(timeout=0.05) and not fut.done():
            pass
        return fut

    def _chunk_on_device(self, program, sp, state, rounds, t_compile, started, rows=None,
                         pieces=None, end_after=0, num_pieces=0, rec=None):
        """Runs a chunk on ``state`` (the slots', or with ``rows`` the state of those rows alone,
        whose outputs are spread over the slots; with ``pieces`` a mixed chunk; ``end_after`` as
        `Decoder.call_chunk`'s); its start and end times go to ``rec`` (`chunk_timeline`)."""
        try:
            try:
                max_rounds = jnp.int32(rounds)
                jax.block_until_ready(state)  # what was dispatched before (prefills, row updates)
            finally:
                started.set()
            t = time.perf_counter()
            state, outs = self.decoder.call_chunk(program, sp, state, max_rounds, pieces,
                                                  end_after, num_pieces)
            if rows is not None:
                outs = spread_outputs(outs, jnp.asarray(rows), batch=self.B)
            jax.block_until_ready(outs)
            if rec is not None:
                rec["t_start"], rec["t_end"] = t, time.perf_counter()
        except BaseException as e:
            # the error's traceback keeps the frames it passed: not the pool with them (an engine
            # that recovers makes a fresh pool, and a second one may not fit in the device)
            state = None
            _clear_frames(e)
            raise
        shared = getattr(state.cache, "shared", None)
        if shared is not None:
            state = state.replace(cache=state.cache.replace(shared=None))
        return state, outs, t_compile, time.perf_counter() - t, shared, rows

    def _with_shared(self, state):
        """``state`` (resolved: no chunk running) with the shared context `_share` chose attached
        (it goes to the chunk: donated)."""
        self._apply_shared()
        if self._shared_ctx is None:
            return state
        sh, self._shared_ctx = self._shared_ctx, None
        return state.replace(cache=state.cache.replace(shared=sh))

    def _without_shared(self, state):
        """``state`` without its shared context, which goes back to the engine."""
        sh = getattr(state.cache, "shared", None)
        if sh is None:
            return state
        self._shared_ctx = sh
        return state.replace(cache=state.cache.replace(shared=None))

    def _choose_chunk(self, greedy: bool):
        """The next chunk's round kind and its number of rounds (from what the host knows: the
        contexts after the last processed chunk)."""
        dec = self.decoder
        act = ~self.done
        ctx = self.lengths[act].astype(np.float64)
        rd = self._round(greedy)
        if rd.speculative:
            zeros = np.zeros(self.B, np.int32)
            stats = RoundStats(spec_rounds=self.row_rounds.astype(np.int32), proposed=zeros,
                               accepted=zeros, committed=self.row_committed.astype(np.int32),
                               plain_steps=np.int32(0))
            spec_rd = rd
            rd, _ = dec.next_round(rd, (act, ctx, stats), self.rounds)
            levels, nodes = dec._levels(spec_rd)
            if not rd.speculative and spec_rd.is_chain and dec.costs.worth_exploring(
                    ctx, levels, nodes):
                rd = spec_rd  # one chunk that measures the acceptance
        t_round = self._round_seconds(rd, ctx)
        rounds = int(np.clip(self.chunk_seconds / max(t_round, 1e-9), 1, self.rounds))
        return rd, rounds, ctx

    def _round_seconds(self, rd, ctx) -> float:
        """The cost model's time of one round of ``rd`` at contexts ``ctx`` (the running rows')."""
        dec = self.decoder
        if rd.speculative:
            levels, nodes = dec._levels(rd)
            return dec.costs.round_time(ctx, levels, nodes)
        return dec.costs.plain_time(ctx)

    def _main(self):
        try:
            while self._tick():
                pass
        except BaseException as e:  # noqa: BLE001 - the loop itself broke (not one chunk)
            # nothing would ever finish what is queued or running: the engine stops (submit
            # raises EngineStopped, /health answers 503) and every sequence fails now
            log.critical("the engine loop stopped", exc_info=e)
            with self._cv:
                self._running = False
                seqs = list(self.waiting) + [s for s in self.slots if s is not None]
                self.waiting.clear()
            message = f"the engine stopped: {type(e).__name__}: {e}"
            for s in seqs:
                try:
                    self._fail(s, message)
                except Exception:  # noqa: BLE001 - the pool's books may be what broke
                    if not s.finished_flag:
                        s.error = message
                        s._emit({"type": "error", "message": message})
                        s.finished.set()

    def _tick(self) -> bool:
        """One pass of the engine loop (False: the engine stopped). A method of its own so that
        nothing of a pass (a cancelled sequence, the admitted ones) stays referenced while the
        loop waits for work."""
        with self._cv:
            while self._running and not self._has_work():
                self._cv.wait(timeout=0.5)
            if not self._running:
                self._drain()
                return False
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
        try:
            mix = MIX_NONE
            if self.paged:
                self._admit_paged(admits)
                mix = self._mixing()
                if mix == MIX_NONE:
                    self._prefill_step()
            else:
                self._admit_all(admits)
            if any(s is not None for s in self.slots):
                self._step(mix)
            else:
                self._drain()
                self._share([])  # nothing runs: no shared context is held
                self._apply_shared()
                self.state  # noqa: B018 - the last chunk's state taken: its outputs let go
        except Exception as e:  # noqa: BLE001 - fail the streaming requests, keep serving
            cause = e.__cause__ if isinstance(e, _ChunkFailed) else e
            log.error("decode chunk failed", exc_info=cause)
            failed = f"decoding failed: {type(cause).__name__}: {cause}"
            del cause
        else:
            return True
        # (out of the except block: the error and its frames let go of the old pool first)
        self._inflight.clear()
        again = []
        for s in [s for s in self.slots if s is not None]:
            if s.tokens or s.retried or s.slot in self._started:
                self._fail(s, failed)
            else:  # its prompt still filled (no row of it decoded): it starts over, once
                self._release(s)
                s.retried, s.held, s.resume_key = True, False, None
                s.fill, s.fill_keys, s.filled = [], [], 0
                s.cached_tokens = 0
                again.append(s)
        self._requeue(sorted(again, key=lambda s: s.t_submit))
        self._stop_rows.clear()
        self._started.clear()
        self._mixed_run = 0
        self.state = None  # (the old pool goes before a new one is made)
        self.state = self._fresh_state()
        return True

    def _fresh_state(self):
        """The slots' device state with nothing in it (and, paged, an empty block pool whose
        prefix cache starts over: the pool's contents are gone)."""
        self._shared = self._shared_want = self._shared_ctx = None
        self._shared_dirty = True
        self._held_since = None
        if not self.paged:
            return self.decoder.empty_state(self.B, self.S, self.out_len)
        self.blocks = BlockManager(self.n_blocks, self.page_size)
        return self.decoder.paged_state(self.B, self.n_blocks, self.page_size, self.max_blocks,
                                        self.out_len)

    def _has_work(self) -> bool:
        if any(s is not None for s in self.slots) or self._inflight:
            return True
        return bool(self.waiting) and not self._paused or any(s.cancelled for s in self.waiting)

    def _admit_all(self, admits):
        """Prefills the admitted sequences into their slots and starts their rows (one update of
        the device state for all of them); a sequence whose admission fails fails alone."""
        rows, last, budget, seeds, firsts = [], [], [], [], []
        for i, (b, s) in enumerate(admits):
            try:
                if self.fault_hook is not None:
                    self.fault_hook(s)
                ids = s.prompt_ids
                self.state = self.decoder.prefill_row(self.state, b, ids[:-1])
            except _ChunkFailed:  # the chunk before failed: this one and the rest wait
                self._requeue([t for _, t in admits[i:]])
                raise
            except Exception as e:  # noqa: BLE001 - fail this request only
                log.exception("admitting sequence %d failed", s.id)
                self._fail(s, f"prefill failed: {type(e).__name__}: {e}")
                continue
            o = s.options
            self.temperature[b] = o.temperature
            self.top_k[b] = o.top_k
            self.top_p[b] = o.top_p
            rows.append(b)
            last.append(ids[-1])
            budget.append(s.budget)
            seeds.append(o.seed if o.seed is not None else int.from_bytes(os.urandom(4), "little"))
            firsts.append(s.index)
            self.done[b] = s.budget <= 0
            self.lengths[b] = len(ids) - 1
            self.row_rounds[b] = 0
            self.row_committed[b] = 0
            self.slots[b] = s
            s.slot = b
            self._stop_rows.discard(b)  # that stop was the row's last sequence's
            self.m["sequences_admitted"] += 1
            if not s.counted:  # (admitted again after a failed chunk: counted once)
                s.counted = True
                self.m["prompt_tokens"] += len(ids)
                self.m["prefill_tokens"] += len(ids) - 1
        self._note_running()
        if rows:
            pad = self.B - len(rows)  # one shape for any number of admissions
            keys = sampling.start_keys(seeds, firsts, size=self.B)
            self.state = set_rows(self.state, np.asarray(rows + [self.B] * pad, jnp.int32),
                                  np.asarray(last + [0] * pad, jnp.int32),
                                  np.asarray(budget + [0] * pad, jnp.int32),
                                  np.concatenate([keys, np.zeros((pad, 2), np.uint32)]),
                                  np.asarray([int(self.lengths[b]) for b in rows] + [0] * pad,
                                              jnp.int32))
            for b in rows:
                if self.slots[b].budget <= 0:
                    self._finish(self.slots[b], "length")

    # ------------------------------------------------------------------ paged K/V
    def _admit_paged(self, admits):
        """Maps blocks for the admitted sequences (their longest cached prefix shared, the rest
        new) and queues their prefill; a sequence for which blocks are short waits (first in
        line) until blocks free up."""
        back = []
        for i, (b, s) in enumerate(admits):
            if back:  # keep the order: nothing is admitted past a sequence that waits
                back.append(s)
                continue
            try:
                if self.fault_hook is not None:
                    self.fault_hook(s)
                ok = self._map_blocks(b, s)
            except _ChunkFailed:  # the chunk before failed: this one and the rest wait
                self._requeue([t for _, t in admits[i:]])
                raise
            except Exception as e:  # noqa: BLE001 - fail this request only
                log.exception("admitting sequence %d failed", s.id)
                self._fail(s, f"prefill failed: {type(e).__name__}: {e}")
                continue
            if not ok:
                back.append(s)
                continue
            o = s.options
            self.temperature[b] = o.temperature
            self.top_k[b] = o.top_k
            self.top_p[b] = o.top_p
            self.done[b] = True  # decodes once its prefill is done
            self.row_rounds[b] = 0
            self.row_committed[b] = 0
            self.slots[b] = s
            s.slot = b
            # (a stop the slot's last sequence left stays: its row may still run on the device,
            # now through this sequence's block table, until `_start_filled` sets the row)
            self.m["sequences_admitted"] += 1
        self._note_running()
        self._admit_short = bool(back)
        self._requeue(back)

    def _requeue(self, seqs):
        """Puts ``seqs`` back at the head of the queue, in their order."""
        if seqs:
            with self._cv:
                self.waiting.extendleft(reversed(seqs))

    def _note_running(self):
        self.running_peak = max(self.running_peak, sum(s is not None for s in self.slots))

    def _map_blocks(self, b: int, s: Sequence) -> bool:
        """Blocks for what ``s`` must hold before decoding (its prompt, or after a preemption
        its prompt and the tokens it generated): cached prefix blocks acquired, new ones
        allocated; False (nothing taken) when the pool is short."""
        bm = self.blocks
        first = s.preemptions == 0 and not s.counted
        self._fill_of(s)
        hit = self._lookup(s)
        need = -(-(len(s.fill) + 1) // self.page_size)
        bm.acquire(hit)
        n_new = max(need - len(hit), 0)
        # the sequences already in slots, and this one, keep room to grow (`growth_reserve`, at
        # least for the chunks in flight and the next one): admitting into that room would only
        # preempt someone (and, readmitted at once, preempt again, for ever)
        own = self._growth_blocks(s, len(s.fill), need)
        if bm.free - n_new < self._growth_reserve() + own:
            bm.release(hit)
            return False
        new = bm.allocate(n_new)
        if new is None:
            bm.release(hit)
            return False
        s.blocks = hit + new
        s.filled = len(hit) * self.page_size
        try:  # (first: a failed chunk surfaces here, before anything is counted)
            self._tables({b: s.blocks})
        except BaseException:
            bm.release(s.blocks)
            s.blocks = []
            raise
        if s.preemptions == 0:
            s.cached_tokens = s.filled
        if first:
            s.counted = True
            bm.count_lookup(len(s.fill), s.filled)
            self.m["prefix_query_tokens"] += len(s.fill)
            self.m["prefix_hit_tokens"] += s.filled
            self.m["prompt_tokens"] += len(s.prompt_ids)
            self.m["prefill_tokens"] += len(s.fill) - s.filled
        return True

    def _fill_of(self, s: Sequence) -> None:
        """``s.fill`` (the tokens its row's cache must hold before decoding: all but the last,
        which is fed to the next step) and ``s.fill_keys`` for its current tokens, hashed once
        (a sequence waiting for blocks tries again every pass of the loop; its tokens only grow,
        so the same length is the same tokens)."""
        fill = (s.prompt_ids + s.tokens)[:-1]
        if len(fill) != len(s.fill) or not s.fill_keys and len(fill) >= self.page_size:
            s.fill_keys = self.blocks.keys(fill)
        s.fill = fill

    def _late_hits(self, s: Sequence):
        """Blocks of ``s``'s prefix cached since its admission (by a sequence prefilled before
        it) replace its own unfilled ones: it prefills only what is still missing."""
        bm = self.blocks
        hit = self._lookup(s)
        first = s.filled // self.page_size  # blocks before it are complete and its own
        if len(hit) * self.page_size <= s.filled:
            return
        for j in range(first, len(hit)):
            if s.blocks[j] != hit[j]:
                bm.acquire([hit[j]])
                bm.release([s.blocks[j]])
                s.blocks[j] = hit[j]
        gained = len(hit) * self.page_size - s.filled
        s.filled = len(hit) * self.page_size
        if s.preemptions == 0:
            s.cached_tokens += gained
        if s.preemptions == 0 and not s.retried:
            bm.count_lookup(0, gained)
            self.m["prefix_hit_tokens"] += gained
            self.m["prefill_tokens"] -= gained
        self._tables({s.slot: s.blocks})

    def _growth_blocks(self, s: Sequence, length: int, have: int) -> int:
        """Blocks beyond its ``have`` that ``s``, with ``length`` tokens in its cache, may need to
        grow: for min(its budget left, `growth_reserve`) tokens and, past them, what `_grow`
        maps ahead of a row's length for the chunk in flight and the next one (two chunks of
        ``rounds_per_chunk`` rounds, each a token tree's nodes: a chunk stretched for a costly
        prompt piece runs only where the pool maps it, `_grow`; also near the end of its
        budget: with the budget left reserved, what it maps stays within the reserve however
        the sequence advances)."""
        nodes = self.tree.num_nodes if self.tree is not None else self.tokens_per_round
        ahead = min(max(s.budget - len(s.tokens), 0), self.growth_reserve) + \
            2 * self.rounds * nodes
        want = -(-(length + ahead + self.extra + 1) // self.page_size)
        return max(min(want, self.max_blocks) - have, 0)

    def _growth_reserve(self) -> int:
        """Blocks the sequences in slots may need to grow (`_growth_blocks`)."""
        return sum(self._growth_blocks(x, int(self.lengths[b]) if b in self._started
                                       else len(x.fill), len(x.blocks))
                   for b, x in enumerate(self.slots) if x is not None and x.blocks)

    def _tables(self, rows: dict):
        """Writes the block tables of ``rows`` ({row: blocks}) to the device state."""
        self._shared_dirty = True
        NB, MB = self.blocks.num_blocks, self.max_blocks
        idx = sorted(rows)
        tab = np.full((self.B, MB), NB, np.int32)
        for i, r in enumerate(idx):
            tab[i, :len(rows[r])] = rows[r]
        pad = self.B - len(idx)
        self.state = set_block_tables(self.state, np.asarray(idx + [self.B] * pad, jnp.int32),
                                      np.asarray(tab))

    def _share(self, active):
        """Chooses the shared context of the next chunk (paged, ``share_min_tokens`` set): among
        the running rows whose tables begin with the same block, the leading blocks common to
        the set of them that saves the most key reads per step ((rows - 1) x shared slots), if
        that reaches ``share_min_tokens``. Host work only: the next chunk gets it
        (`_apply_shared`). Shared blocks are full cached prompt blocks: no row writes into them."""
        if self.share_min_tokens is None or not self._shared_dirty or not self.paged:
            return
        self._shared_dirty = False
        BS = self.page_size
        rows = [b for b in active if b in self._started and self.slots[b].blocks]
        best = None
        heads = collections.Counter(self.slots[b].blocks[0] for b in rows)
        if heads and heads.most_common(1)[0][1] >= 2:
            head = heads.most_common(1)[0][0]
            members = [b for b in rows if self.slots[b].blocks[0] == head]
            # blocks wholly inside each row's context (the host's lengths lag the device's)
            cap = [min(len(self.slots[b].blocks), int(self.lengths[b]) // BS) for b in members]
            ref = np.asarray(self.slots[members[int(np.argmax(cap))]].blocks[:max(cap)])
            common = []
            for b, c in zip(members, cap):
                eq = np.asarray(self.slots[b].blocks[:c]) == ref[:c]
                common.append(int(np.argmin(eq)) if not eq.all() else c)
            order = np.argsort(common)[::-1]
            for i in range(2, len(order) + 1):  # the i rows sharing the most
                n = common[order[i - 1]]
                saved = (i - 1) * n * BS
                if n > 0 and saved >= self.share_min_tokens and (
                        best is None or saved > best[0]):
                    best = (saved, tuple(int(x) for x in ref[:n]),
                            tuple(sorted(members[j] for j in order[:i])))
        self._shared_want = None if best is None else best[1:]

    def _apply_shared(self):
        """Makes the shared context the one `_share` chose: a copy of the blocks when they
        changed, only the row mask when the rows did, none when none was chosen. Called where no
        chunk runs (the running chunk holds the context until the state is read back)."""
        group = self._shared_want
        if group == self._shared:
            return
        cache = self.state.cache  # (a chunk still held hands the context back first)
        if group is None:
            self._shared_ctx = None
            self.m["shared_context_rows"] = self.m["shared_context_tokens"] = 0
        else:
            blocks, rows = group
            mask = np.zeros(self.B, bool)
            mask[list(rows)] = True
            if self._shared is not None and self._shared[0] == blocks and \
                    self._shared_ctx is not None:
                self._shared_ctx = self._shared_ctx.replace(rows=jnp.asarray(mask))
            else:
                table = np.full(self.max_blocks, self.n_blocks, np.int32)
                table[:len(blocks)] = blocks
                self._shared_ctx = None  # (its memory goes before the copy is made)
                with use_mesh(self.decoder.mesh):
                    self._shared_ctx = shared_context(
                        cache.k, cache.v, table, np.int32(len(blocks) * self.page_size), mask)
                self.m["shared_context_copies"] += bool(blocks)
            self.m["shared_context_rows"] = len(rows)
            self.m["shared_context_tokens"] = len(blocks) * self.page_size
        self._shared = group

    def _prefill_tokens(self) -> int:
        """Prompt tokens to prefill before the next decode chunk: ``prefill_budget`` if given,
        else, at the measured prefill rate, `PREFILL_IDLE_SECONDS` worth while fewer sequences
        decode than wait for their prefill (the batch fills first: a decode round costs the
        weights and a fixed part whatever its rows, so rounds over a few rows waste the device
        while prompts wait), and `PREFILL_SHARE` of the last decode chunk's time once most of
        them decode (their inter-token latency then grows by about that share); whole prefill
        chunks, never fewer than `PREFILL_MIN_TOKENS` (and one chunk)."""
        if self.prefill_budget is not None:
            return self.prefill_budget
        C = self.prefill_chunk
        if self._prefill_rate is None:
            return self._min_prefill_chunks() * C
        decoding = sum(self.slots[b] is not None for b in self._started)
        filling = sum(s is not None and s.fill is not None and s.filled < len(s.fill)
                      for s in self.slots)
        seconds = PREFILL_IDLE_SECONDS if decoding < filling else PREFILL_SHARE * self._chunk_s
        return max(self._min_prefill_chunks(), int(self._prefill_rate * seconds) // C) * C

    def _min_prefill_chunks(self) -> int:
        return max(1, -(-PREFILL_MIN_TOKENS // self.prefill_chunk))

    def _prefill_step(self):
        """At most `_prefill_tokens` prompt tokens prefilled, oldest admission first; a sequence
        whose prompt is in starts decoding."""
        budget = self._prefill_tokens()
        filling = sorted((s for s in self.slots if s is not None and s.filled < len(s.fill)),
                         key=lambda s: s.t_submit)
        if filling:
            self.state  # noqa: B018 - the running chunk first: the rate times prefill alone
        t0, done = time.perf_counter(), 0
        for s in filling:
            if budget <= 0:
                break
            b = s.slot
            self._late_hits(s)
            n = min(len(s.fill) - s.filled, budget)
            if n <= 0:
                continue
            try:
                self.state = self.decoder.prefill_paged_row(
                    self.state, b, s.fill[s.filled:s.filled + n], s.filled,
                    prompt_end=self._prompt_end(s))
            except Exception as e:  # noqa: BLE001 - fail this request only
                log.exception("prefill of sequence %d failed", s.id)
                self._fail(s, f"prefill failed: {type(e).__name__}: {e}")
                continue
            s.filled += n
            budget -= n
            done += n
            # its full blocks are cached at once: sequences admitted with it that share the
            # prefix (a document many requests ask about) find them before their own prefill
            self._register(s, s.filled)
        if done >= self.prefill_chunk:  # the rate that sizes the next steps (an EMA)
            jax.block_until_ready(self.state.cache.lengths)
            rate = done / max(time.perf_counter() - t0, 1e-6)
            self._prefill_rate = rate if self._prefill_rate is None else \
                0.5 * self._prefill_rate + 0.5 * rate
        if done:  # (dispatched: the device may still run it)
            self._timeline.append({"t_dispatch": t0, "kind": "prefill", "prompt_tokens": done,
                                   "t_delivered": time.perf_counter()})
        self._start_filled()

    def _prompt_end(self, s: Sequence) -> int:
        """How many of ``s.fill``'s tokens a prefill computes as prompt tokens
        (`jaxspec.attention.AttentionPlan.prompt`). With batch-invariant numerics the prompt's
        (all but its last token): a resumed sequence's later fill tokens (its last prompt token
        and the tokens it generated) were computed by decode steps, so they are computed again
        as decode steps compute them (the same bits; a prompt's kernel would round otherwise),
        by whole prefill steps, never in a mixed chunk's pieces. Otherwise all of them."""
        if not self.batch_invariant:
            return len(s.fill)
        return min(len(s.fill), max(len(s.prompt_ids) - 1, 0))

    def _lookup(self, s: Sequence) -> list[int]:
        """The cached blocks of ``s.fill``'s longest cached prefix (not acquired): with
        batch-invariant numerics only blocks of its prompt tokens (`_prompt_end`): cached blocks
        hold prompt tokens' K/V, and its later tokens' must be its decode steps'."""
        hit = self.blocks.lookup(s.fill, s.fill_keys)
        if self.batch_invariant:
            hit = hit[:self._prompt_end(s) // self.page_size]
        return hit

    def _register(self, s: Sequence, n: int):
        """The full blocks of ``s.fill[:n]`` into the prefix cache: with batch-invariant
        numerics only those of prompt tokens (`_prompt_end`): a block computed by decode steps
        would give a later prompt that finds it other bits than its own prefill gives."""
        self.blocks.register(s.fill[:min(n, self._prompt_end(s))], s.blocks, s.fill_keys)

    def _filling(self):
        """Sequences in slots whose prompt is not all in, oldest admission first."""
        return sorted((s for s in self.slots if s is not None and s.fill is not None
                       and s.filled < len(s.fill)), key=lambda s: s.t_submit)

    def _mixing(self) -> int:
        """How the next chunk prefills (`mixed_prefill`): `MIX_PIECES` while some sequences decode
        and some wait for their prefill, but `MIX_CALIBRATE` (a short chunk without pieces, and
        no prefill step) when the cost model has timed no round yet, and after
        `MIXED_CALIBRATE_EVERY` mixed chunks in a row (it learns only from chunks without
        pieces); `MIX_NONE` otherwise (whole prefill steps, if any)."""
        if not self.mixed_prefill or not self._filling():
            return MIX_NONE
        if not any(self.slots[b] is not None and not self.done[b] for b in range(self.B)):
            return MIX_NONE  # nothing decodes: whole prefill steps
        if any(s.filled >= self._prompt_end(s) for s in self._filling()):
            return MIX_NONE  # a resumed sequence's generated tokens: a prefill step (`_prompt_end`)
        if self._mixed_run >= MIXED_CALIBRATE_EVERY or not self.decoder.costs.fits:
            return MIX_CALIBRATE
        return MIX_PIECES

    def _pieces(self, budget: float):
        """The next mixed chunk's prompt pieces of ``mixed_prefill`` tokens (the last one of a
        prompt may be shorter), oldest admission first, as many as `PieceCost` predicts to add
        at most ``budget`` seconds (at least one; one while no piece was measured), at most
        `MIXED_ROUNDS`: ``([(sequence, start, tokens), ...], predicted seconds or None)``."""
        C, out, spent = self.mixed_prefill, [], 0.0
        P = min(MIXED_ROUNDS, self.rounds)
        for s in self._filling():
            self._late_hits(s)
            pos, end = s.filled, self._prompt_end(s)
            while pos < end and len(out) < P:
                n = min(C, end - pos)
                cost = self._piece_cost.predict(pos + n / 2)
                if out and (spent is None or spent + cost > budget):
                    return out, spent
                out.append((s, pos, s.fill[pos:pos + n]))
                spent = None if cost is None else spent + cost
                pos += n
            if len(out) >= P:
                break
        return out, spent

    def _pieces_done(self, pieces):
        """The host's side of pieces a mixed chunk prefills (dispatched: the device runs them in
        order before anything later): the sequences' filled counts, their full blocks cached
        (later admissions find them), and the sequences whose prompt is in start decoding."""
        for s, pos, toks in pieces:
            if s.slot is None or s.finished_flag:
                continue
            s.filled = pos + len(toks)
            self.m["mixed_prefill_tokens"] += len(toks)
            self._register(s, s.filled)

    def _piece_arrays(self, pieces) -> Pieces:
        P, C = min(MIXED_ROUNDS, self.rounds), self.mixed_prefill
        tokens = np.zeros((P, C), np.int32)
        rows, starts, ends = (np.zeros(P, np.int32) for _ in range(3))
        for i, (s, pos, toks) in enumerate(pieces):
            tokens[i, :len(toks)] = toks
            rows[i], starts[i], ends[i] = s.slot, pos, pos + len(toks)
        return Pieces(tokens=tokens, rows=rows, starts=starts, ends=ends)

    def _start_filled(self):
        """Sequences whose prompt is in start decoding (their rows set on the device), unless
        they wait for others still filling (`fill_first`)."""
        starts = [s for s in self.slots if s is not None and s.filled >= len(s.fill)
                  and self.done[s.slot] and not s.finished_flag and s.fill is not None
                  and s.slot not in self._started]
        if starts and self._hold(starts):
            return
        self._held_since = None
        self.m["held_sequences"] += sum(s.held for s in starts)
        for s in starts:
            s.held = False
        rows, last, budgets, seeds, firsts, refolds = [], [], [], [], [], []
        for s in starts:
            b = s.slot
            self._register(s, len(s.fill))
            self.state = self.decoder.prefill_draft_row(self.state, b, s.fill,
                                                        prompt_end=self._prompt_end(s))
            seeds.append(s.options.seed if s.options.seed is not None else
                         int.from_bytes(os.urandom(4), "little"))
            firsts.append(s.index)
            # a resumed sequence: the key its row had when it was preempted (below; folded
            # with its length where there is none), not the first one again (batch-invariant
            # rounds draw with the key folded with each token's position: the same key
            # continues where the sequence left off)
            refolds.append(len(s.tokens) if s.tokens and not self.batch_invariant else None)
            toks = s.prompt_ids + s.tokens
            rows.append(b)
            last.append(toks[-1])
            budgets.append(s.budget - len(s.tokens))
            self.done[b] = budgets[-1] <= 0
            self.lengths[b] = len(s.fill)
            self._started.add(b)
            self._stop_rows.discard(b)  # the row is set below: a stop left for it is the last's
            self._shared_dirty = True
        if rows:
            pad = self.B - len(rows)
            keys = sampling.start_keys(seeds, firsts, refolds, size=self.B)
            for i, s in enumerate(starts):
                if s.tokens and s.resume_key is not None and not self.batch_invariant:
                    keys[i] = s.resume_key
            self.state = set_rows(self.state, np.asarray(rows + [self.B] * pad, jnp.int32),
                                  np.asarray(last + [0] * pad, jnp.int32),
                                  np.asarray(budgets + [0] * pad, jnp.int32),
                                  np.concatenate([keys, np.zeros((pad, 2), np.uint32)]),
                                  np.asarray([int(self.lengths[b]) for b in rows] + [0] * pad,
                                              jnp.int32))
            for b in rows:
                if self.slots[b].budget - len(self.slots[b].tokens) <= 0:
                    self._finish(self.slots[b], "length")

    def _hold(self, starts) -> bool:
        """Whether ``starts`` (sequences whose prompt is in) wait for the sequences still filling
        and those queued that the next pass admits (`fill_first`, `_coming`): while nothing
        decodes, for at most ``fill_first`` seconds since the first waited, and only while the
        prompt tokens left to fill take no longer than the time left at the measured prefill
        rate (a burst that cannot be in by then starts now, not at the deadline). A sequence
        that was decoding before a preemption never waits: its stream has begun."""
        if not self.fill_first or any(s.tokens for s in starts):
            return False
        filling, coming = self._filling(), self._coming()
        if not filling and not coming:
            return False
        if any(self.slots[b] is not None and not self.done[b] for b in range(self.B)):
            return False  # streams run: waiting would not keep a prefill from them
        now = time.perf_counter()
        if self._held_since is None:
            self._held_since = now
        left = self.fill_first - (now - self._held_since)
        if left <= 0:
            return False
        rate = self._prefill_rate
        if rate is not None:
            todo = self._fill_work(filling, coming, rate * left)
            if todo / rate > left:
                log.info("fill-first: %d prompt tokens left at %.0f tokens/s take longer than "
                         "the %.1f s left: %d sequences start now", todo, rate, left,
                         len(starts))
                return False
        for s in starts:
            s.held = True
        return True

    def _fill_work(self, filling, coming, limit=None) -> int:
        """Prompt tokens left to prefill for the sequences ``filling`` (in slots, oldest first)
        and ``coming`` (queued): a full block that the prefix cache holds, or that one of them
        before it fills, is not counted again (a document or system prompt that a burst of
        requests shares is prefilled once; the others take its blocks when their turn comes).
        Counting stops past ``limit`` tokens (then any count past it says the same)."""
        bm, P = self.blocks, self.page_size
        seen: set[bytes] = set()
        todo = 0
        for s in list(filling) + list(coming):
            filled = s.filled if s.blocks else 0
            if not s.blocks:  # queued: its keys now, kept for its admission
                self._fill_of(s)
            keys = s.fill_keys
            for j in range(filled // P, len(keys)):
                k = keys[j]
                if k not in seen and not bm.holds(k):
                    seen.add(k)
                    todo += P - (filled - j * P if j * P < filled else 0)  # (a block half in)
            todo += max(len(s.fill) - max(len(keys) * P, filled), 0)  # its last, partial block
            if limit is not None and todo > limit:
                break
        return todo

    def _coming(self) -> list:
        """The waiting sequences that the next pass admits into the free slots (a burst's
        requests arrive over a while: the first ones may be admitted, even prefilled, before the
        rest are queued), none while admission is paused or the last one left a sequence
        waiting for blocks (until blocks free up, nothing after it is admitted)."""
        free = sum(s is None for s in self.slots)
        if not free or self._admit_short:
            return []
        with self._cv:
            if self._paused:
                return []
            return [s for s in self.waiting if not s.cancelled][:free]

    def _grow(self, active, rounds: int, rd, unstretched: int | None = None) -> int:
        """Blocks for what the next chunk may write (and the chunks in flight): each running row
        is mapped up to ``lengths + what the chunks in flight may advance + rounds x slots per
        round + extra`` slots (each chunk at its own kind: a speculative chunk in flight may
        advance a round's nodes per round, a plain one that follows it one); when the pool is
        short the most recently admitted sequence is preempted, unless the chunk was stretched
        for a costly piece (``mixed_stretch``) and its ``unstretched`` rounds fit. A row that grows
        takes at once the blocks admission keeps for its growth while the pool holds every
        slot's (`_growth_blocks`). Returns the rounds to run (0: the running rows changed)."""
        def per_round(r):  # slots a round of ``r`` may write ahead of a row's length
            return r.tree.num_nodes if r.speculative else 1
        tpr = per_round(rd)
        flight = sum(f[4] * per_round(f[2]) for f in self._inflight)
        want, ahead = {}, {}
        for b in active:
            s = self.slots[b]
            slots = int(self.lengths[b]) + flight + rounds * tpr + self.extra + 1
            need = min(-(-slots // self.page_size), self.max_blocks) - len(s.blocks)
            if need > 0:
                want[b] = need
                # a row that grows takes at once the blocks admission keeps for its growth
                # (`_growth_blocks`): its table is written again only when they are used up, not
                # every few chunks (a table write waits for the running chunk: ~1 ms of host
                # turn per chunk, H200)
                ahead[b] = max(need, self._growth_blocks(s, int(self.lengths[b]), len(s.blocks)))
        if not want:
            return rounds
        free = self.blocks.free
        if sum(ahead.values()) <= free and free >= self._growth_reserve():
            want = ahead  # (no other slot's room taken)
        elif sum(want.values()) > free:
            if unstretched is not None and unstretched < rounds:
                return self._grow(active, unstretched, rd)
            holders = sorted((s for s in self.slots if s is not None and s.blocks),
                             key=lambda s: s.t_submit)
            if len(holders) > 1:  # the most recently admitted one gives its blocks back
                self._preempt(holders[-1])
                return 0
        grown = {}
        for b, need in want.items():
            new = self.blocks.allocate(need)
            if new is None:
                continue
            self.slots[b].blocks += new
            grown[b] = self.slots[b].blocks
        if grown:
            self._tables(grown)
        for b in active:  # no row may write past its mapped slots
            room = len(self.slots[b].blocks) * self.page_size - int(self.lengths[b]) \
                - self.extra - 1
            rounds = min(rounds, (room - flight) // tpr)
        return max(rounds, 0)

    def _rounds_to_an_end(self, active, rd) -> int | None:
        """The fewest rounds after which a decoding row may reach its token budget (counting what
        the chunks in flight may have added, at most a round's tokens each round), when a chunk
        ends where a stream ends (at most `END_EARLY_MAX_ROWS` decoding) and that is within
        `max_chunk_rounds`; else None. Rows that may be done already are left out."""
        if len(active) > END_EARLY_MAX_ROWS:
            return None
        def most(r):  # tokens a round of ``r`` may commit per row
            return r.gamma + 1 if r.speculative else 1
        flight = sum(f[4] * most(f[2]) for f in self._inflight)
        soonest = None
        for b in active:
            s = self.slots[b]
            left = s.budget - len(s.tokens) - flight
            if left <= 0:
                continue
            k = -(-left // most(rd))
            soonest = k if soonest is None else min(soonest, k)
        return soonest if soonest is not None and soonest < self.max_chunk_rounds else None

    def _preempt(self, s: Sequence):
        """Gives back the blocks of a running sequence (its full prompt blocks stay cached) and
        puts it first in line: on readmission its cache is recomputed from its prompt and the
        tokens it generated, so nothing is lost."""
        self._drain()
        if s.finished_flag or s.slot is None:
            return
        b = s.slot
        if s.tokens and not self.batch_invariant and b in self._started:
            # the key its next round would draw with (every chunk that ran is processed): it
            # resumes with it, so its draws are those it would have made without the preemption
            # (batch-invariant rounds key each draw by its position instead); one preempted
            # again before its row restarted keeps the key it has (the row's is not its own)
            s.resume_key = np.asarray(jax.device_get(self.state.rng), np.uint32)[b]
        self.slots[b] = None
        s.slot = None
        self._stop_rows.add(b)
        self._started.discard(b)
        self.done[b] = True
        self.blocks.release(s.blocks)
        s.blocks = []
        s.fill = []
        s.fill_keys = []
        s.filled = 0
        s.preemptions += 1
        self.m["preemptions"] += 1
        self._requeue([s])  # (first: a failure writing the table below must not lose it)
        self._tables({b: []})

    def _step(self, mix: int = 0):
        """Dispatches the next chunk, then handles the previous chunk's tokens while it runs (the
        device never waits for detokenization and streaming). ``mix`` (`_mixing`):
        `MIX_PIECES`: a mixed chunk, its first rounds each prefilling a prompt piece, the rest
        plain (a chunk's rounds in all, as the cost model sizes them, more where its pieces add
        more than `PIECE_SHARE`: ``mixed_stretch``); `MIX_CALIBRATE`: at most `MIXED_ROUNDS`
        rounds."""
        pieces, base = None, None
        if self._stop_rows:
            rows = sorted(self._stop_rows)
            self.state = stop_rows(self.state, np.asarray(rows + [self.B] * (self.B - len(rows)),
                                                           jnp.int32))
            self._stop_rows.clear()
        active = [b for b in range(self.B) if self.slots[b] is not None and not self.done[b]]
        if active:
            if self.step_fault_hook is not None:
                self.step_fault_hook([self.slots[b] for b in active])
            greedy = bool(np.all(self.temperature[active] <= 0))
            filtering = bool(np.any((self.top_k[active] > 0) | (self.top_p[active] < 1.0)))
            rd, rounds, ctx = self._choose_chunk(greedy)
            if mix == MIX_CALIBRATE:
                rounds = min(rounds, MIXED_ROUNDS)
            if mix == MIX_PIECES:  # pieces in the first rounds, then plain ones (`PIECE_SHARE`)
                t_round = max(self._round_seconds(rd, ctx), 1e-9)
                pieces, extra = self._pieces(PIECE_SHARE * rounds * t_round)
                pieces = pieces or None  # (none: cached blocks came in meanwhile)
                if pieces:
                    # a first piece that adds more than the chunk's share: more plain rounds
                    need = 0 if extra is None else int(np.ceil(extra / (PIECE_SHARE * t_round)))
                    base = max(rounds, len(pieces))
                    planned = max(base, min(need, self.max_chunk_rounds))
                    cut = self._rounds_to_an_end(active, rd)
                    if cut is not None and cut < planned and not self._piece_skipped and (
                            extra is None or extra > PIECE_SHARE * cut * t_round):
                        # a stream's budget ends within the chunk, which then ends there: the
                        # pieces would weigh on those few rounds' tokens (the ending stream's
                        # last ones), so this chunk runs plain rounds up to that end and the next
                        # one carries them (never two in a row without)
                        pieces, base = None, None
                        rounds = max(rounds, cut)
                        self._piece_skipped = True
                        self.m["pieces_deferred"] += 1
                    else:
                        rounds = planned
                        self._piece_skipped = False
            if self.paged:
                rounds = self._grow(active, rounds, rd, base)
                if rounds <= 0:  # rows changed (a preemption) or wait for blocks: next time
                    self._drain()
                    return
                self._share(active)
                if self._shared_want is not None:
                    self.m["shared_context_row_chunks"] += len(self._shared_want[1])
            if pieces is not None:
                pieces = pieces[:rounds]
                self.m["mixed_chunks"] += 1
                self._mixed_run += 1
            else:
                self._mixed_run = 0
            chunk = self._run_chunk(rd, greedy, filtering, rounds, active=active,
                                    pieces=None if pieces is None else
                                    self._piece_arrays(pieces),
                                    num_pieces=0 if pieces is None else len(pieces))
            # the rows this chunk decodes: a slot whose sequence is still being prefilled (paged)
            # is idle on the device, and its "done" must not end the sequence
            owners = [self.slots[b] if b in active else None for b in range(self.B)]
            keys = tuple(pos + len(toks) / 2 for _, pos, toks in pieces or ())
            self._inflight.append((chunk, owners, rd, ctx, rounds, keys))
            if pieces:
                self._pieces_done(pieces)
        while self._inflight and (len(self._inflight) > 1 or not active):
            self._process(*self._inflight.popleft())
        if mix != MIX_NONE:  # sequences whose prompt is in (pieces, or the prefix cache) start:
            self._start_filled()  # (after the last chunk's tokens: this waits for the new one)
        if not active:  # nothing runs now: let go of a context whose rows are gone
            self._share([])
            self._apply_shared()

    def _drain(self):
        while self._inflight:
            self._process(*self._inflight.popleft())

    def _process(self, chunk, owners, rd, ctx, rounds=0, mixed=()):
        """The tokens of a finished chunk: to their sequences (if they still own their slots).
        A ``mixed`` chunk's time (its pieces' mean attended keys) is not its rounds' alone: the
        cost model does not learn from it, but what beyond its rounds' predicted time the pieces
        took does (`PieceCost`)."""
        _, outs, _, dt, _, _ = chunk.result()
        host = jax.device_get(outs)
        out, flags, n_out, done, lengths = (np.asarray(x) for x in (
            host.out, host.from_draft, host.n_out, host.done, host.lengths))
        stats = host.stats
        n = int(host.steps)
        ran = [b for b in range(self.B) if owners[b] is not None]
        # only the rows this chunk decoded: another row may have started (or been prefilled)
        # on the host since it was dispatched, and its length here is stale
        # (and still own their slots: a slot that changed hands since holds another sequence)
        mine = [b for b in ran if self.slots[b] is owners[b]]
        self.lengths[mine] = np.asarray(lengths, np.int64)[mine]
        # the rounds' predicted time (what the chunk was planned by)
        alone = n * self._round_seconds(rd, ctx) if self.decoder.costs.fits else None
        rec = getattr(chunk, "rec", None)
        if rec is not None:
            cost = [self._piece_cost.predict(k) for k in mixed]
            rec.update(ran=n, tokens=int(n_out.sum()), device_s=float(dt),
                       t_result=time.perf_counter(), piece_keys=[float(k) for k in mixed],
                       predicted_s=alone, predicted_pieces_s=float(sum(cost))
                       if mixed and alone is not None and None not in cost else None)
        if dt > 0:
            still = [b for b in ran if not done[b]]
            if not mixed:  # (a mixed chunk's time includes its prefill)
                self.decoder._observe(rd, ctx, self.lengths[still].astype(np.float64), n, dt)
                if n == rounds:  # (a chunk that ended early is not a chunk's time)
                    self._chunk_s = dt
            elif alone is not None and n == rounds and not getattr(chunk, "first_run", False) \
                    and not getattr(chunk, "full_for_now", False):
                # what the pieces added to the rounds' predicted time (only from chunks that ran
                # all their rounds: in a cut one the host turn's share would land on the pieces)
                extra = dt - alone
                # (a chunk well under its rounds' predicted time: that prediction is off, and
                # the pieces' time unknown; within the noise it counts, as at least nothing,
                # once something was learned: a first zero would let every piece in)
                if extra > 0 or (self._piece_cost.coef is not None
                                 and extra > -MIXED_NOISE * alone):
                    self._piece_cost.observe(mixed, max(extra, 0.0))
            self.m["chunk_seconds"] += dt
        self.m["chunks"] += 1
        self.m["speculative_chunks" if rd.speculative else "plain_chunks"] += 1
        self.m["rounds"] += n
        busy = int(np.asarray(stats.spec_rounds).sum()) if rd.speculative else int(n_out.sum())
        self.m["busy_slot_rounds"] += busy
        self.m["slot_rounds"] += n * self.B
        self.m["target_row_steps"] += busy
        self.m["generation_tokens"] += int(n_out.sum())
        if rd.speculative:
            self.m["draft_proposed"] += int(np.asarray(stats.proposed).sum())
            self.m["draft_accepted"] += int(np.asarray(stats.accepted).sum())
            # (only the rows whose sequence ran them: a slot taken over since had its counts
            # set for its new sequence)
            self.row_rounds[mine] += np.asarray(stats.spec_rounds)[mine]
            self.row_committed[mine] += np.asarray(stats.committed)[mine]
            if rd.is_chain:
                self.decoder.costs.observe_acceptance(float(np.sum(stats.accepted)),
                                                      float(np.sum(stats.spec_rounds)), rd.gamma)
        for b in ran:
            s = owners[b]
            if self.slots[b] is not s or s.finished_flag:
                continue  # the sequence ended on the host meanwhile: its tokens are dropped
            k = int(n_out[b])
            if done[b]:
                self.done[b] = True
            if rd.speculative:
                s.rounds += int(stats.spec_rounds[b])
                s.accepted += int(stats.accepted[b])
                s.proposed += int(stats.proposed[b])
                self._count_positions(flags[b, :k], rd.gamma)
            else:
                s.rounds += k
            try:
                self._deliver(s, out[b, :k].tolist(), [bool(f) for f in flags[b, :k]],
                              bool(done[b]))
            except Exception as e:  # noqa: BLE001 - fail this request only
                log.exception("delivering tokens of sequence %d failed", s.id)
                self._fail(s, f"{type(e).__name__}: {e}")
        if rec is not None:
            rec["t_delivered"] = time.perf_counter()
            self._timeline.append(rec)

    def _count_positions(self, flags, depth: int):
        """Per draft position, a row's speculative rounds in a chunk and the ones that accepted
        it, from its committed tokens' ``flags`` (from a draft or not): each round commits its
        accepted drafts, then one token of the target's that ends it. A last round cut short by
        the row's budget or a stop token (drafts with no target token after them) is left out:
        what it would have accepted after the cut is unknown."""
        ends = np.flatnonzero(~np.asarray(flags, bool))
        if not len(ends):
            return
        runs = np.diff(ends, prepend=-1) - 1  # accepted drafts of each complete round
        at_least = np.cumsum(np.bincount(runs, minlength=depth + 1)[::-1])[::-1]
        for i in range(1, min(depth, self.positions) + 1):
            self.m[f"position_proposed_{i}"] += len(runs)
            self.m[f"position_accepted_{i}"] += int(at_least[i])

    # ------------------------------------------------------------------ output
    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def _deliver(self, s: Sequence, new: list[int], flags: list[bool], device_done: bool):
        if not new and not device_done:
            return
        if s.t_first is None and new:
            s.t_first = time.perf_counter()
        finish, cut_here = None, False  # (cut_here: a stop string ended the text)
        if device_done:
            finish = "stop" if (new and new[-1] in self.stop_ids) else "length"
        run = len(s.tokens)  # where the run of tokens of one source (draft or not) began
        for i, (t, f) in enumerate(zip(new, flags)):
            s.tokens.append(t)
            s.draft_flags.append(f)
            if t in self.stop_ids:
                break
            # (no tokenizer: token ids only, no text; no stop token in s.tokens here)
            if self.tokenizer is None:
                continue
            # a run's text is decoded once at its end (two decodes per run, not per token),
            # unless stop strings must be looked for token by token (a run that a stop token
            # ends is decoded below, as a finished sequence's last text)
            if s.options.stop or i + 1 == len(new) or flags[i + 1] != f:
                if self._run_text(s, run, f):
                    finish, cut_here = "stop", True
                    break
                run = len(s.tokens)
        if finish is not None and not cut_here and self.tokenizer is not None:
            # the text of its last tokens held back because it ended in the middle of a
            # character (bytes of a byte-level tokenizer) ends the text as the tokenizer decodes
            # it (with its replacement character), as `jaxspec.generate`'s text does, rather
            # than being dropped while its tokens are counted
            toks = s.tokens[:-1] if s.tokens and s.tokens[-1] in self.stop_ids else s.tokens
            if len(toks) > s._ro and self._next_piece(s, toks, bool(s.draft_flags[len(toks) - 1]),
                                                      final=True):
                finish = "stop"
        if finish is not None:
            self._flush(s, final=True)
            self._finish(s, finish)
        else:
            self._flush(s, final=False)

    def _run_text(self, s: Sequence, run: int, from_draft: bool) -> bool:
        """Adds the text of ``s.tokens[run:]`` (tokens of one source) as decoding them one by one
        would (`_next_piece` after each): at once, or where that ends in the middle of a
        character, token by token (each whole character as soon as its last byte came). True
        when a stop string ended the text."""
        n = len(s.tokens)
        if self._next_piece(s, s.tokens, from_draft):
            return True
        if s._ro == n or n - run <= 1:  # all of it added (or one token: as one by one)
            return False
        for k in range(run + 1, n + 1):
            if self._next_piece(s, s.tokens[:k], from_draft):
                return True
        return False

    def _next_piece(self, s: Sequence, toks: list[int], from_draft: bool,
                    final: bool = False) -> bool:
        """Adds to ``s.text`` what ``toks`` past ``s._ro`` add to it (decoded from ``s._po`` on,
        so that the tokenizer joins them as it joins the whole), unless that ends in the middle of
        a character and it is not the ``final`` piece (then it waits for the next token). True
        when a stop string in it ends the text there."""
        ctx = s.text_context if s._po == 0 else []
        prefix = self._decode(ctx + toks[s._po:s._ro])
        full = self._decode(ctx + toks[s._po:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return False
        piece = full[len(prefix):]
        s._po, s._ro = s._ro, len(toks)
        s.text += piece
        s._pieces.append((len(s.text), from_draft))
        if s.options.stop:
            cut = _find_stop(s.text, s.options.stop, len(s.text) - len(piece))
            if cut is not None:
                s.text = s.text[:cut]
                return True
        return False

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
        i = s._piece_at  # (the pieces before it were emitted: a long stream's flush reads few)
        while i < len(s._pieces):
            e, f = s._pieces[i]
            if e > start:
                seg_end = min(e, end)
                if seg_end > start:
                    if segs and segs[-1][1] == f:
                        segs[-1][0] += s.text[start:seg_end]
                    else:
                        segs.append([s.text[start:seg_end], f])
                start = seg_end
                if start >= end:
                    break
            i += 1
        s._piece_at = i
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
            if not self.done[b]:  # still running on the device: it stops before the next chunk
                self._stop_rows.add(b)
            self.done[b] = True
            self._started.discard(b)
        s.slot = None
        self._shared_dirty = True
        if self.paged and s.blocks:
            self.blocks.release(s.blocks)
            s.blocks = []

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
            "programs_compiling": sum(not f.done() for f in self._compile_futures),
            "acceptance_rate": (m.get("draft_accepted", 0) / m["draft_proposed"]
                                if m.get("draft_proposed") else 0.0),
            "tokens_per_target_step": (m.get("generation_tokens", 0) / m["target_row_steps"]
                                       if m.get("target_row_steps") else 0.0),
            "batch_occupancy": (m.get("busy_slot_rounds", 0) / m["slot_rounds"]
                                if m.get("slot_rounds") else 0.0),
            # accepted / proposed at each draft position (1: the first draft)
            "position_acceptance": [
                m[f"position_accepted_{i}"] / m[f"position_proposed_{i}"]
                if m[f"position_proposed_{i}"] else 0.0 for i in range(1, self.positions + 1)],
            **({} if not self.paged else {
                "kv_blocks_total": self.blocks.num_blocks, "kv_blocks_used": self.blocks.used,
                "kv_blocks_free": self.blocks.free, "kv_blocks_cached": self.blocks.cached,
                "prefix_cache_hit_rate": (m["prefix_hit_tokens"] / m["prefix_query_tokens"]
                                          if m["prefix_query_tokens"] else 0.0)}),
        }

    def chunk_timeline(self, since: float | None = None) -> list[dict]:
        """The last decode chunks (at most `TIMELINE_CHUNKS`), oldest first, each a dict of
        `time.perf_counter` times (on Linux a clock all processes of the machine share):
        ``t_dispatch`` (the engine thread began dispatching it), ``t_start`` / ``t_end`` (its run
        on the device thread, after what was dispatched before it had finished), ``t_result``
        (the engine thread took its outputs), ``t_delivered`` (its tokens were handed to the
        streams); and ``kind`` (``plain`` / ``speculative``), ``rows`` (decoding rows),
        ``batch`` (rows of the program), ``compact`` (over those rows alone), ``rounds``
        (at most) and ``ran``, ``pieces`` (prompt pieces prefilled in its rounds) and
        ``piece_keys`` (their mean attended keys), ``tokens`` (generated), ``device_s``,
        ``first_run`` (its program's first run), ``predicted_s`` (the cost model's time of the
        rounds it ran, None before it has measured) and ``predicted_pieces_s`` (what its pieces
        were predicted to add). Prefill steps between chunks are there too, as ``kind`` ``prefill``
        with ``t_dispatch`` / ``t_delivered`` (the host's call) and ``prompt_tokens``.
        ``since``: only what was dispatched at or after that time."""
        out = [dict(r) for r in list(self._timeline)]
        if since is not None:
            out = [r for r in out if r["t_dispatch"] >= since]
        return out

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
