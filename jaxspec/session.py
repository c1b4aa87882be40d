"""The one setup layer: everything between "a model and some prompts" and a decode loop running.

A `Decoder` holds one model (laid out for decoding, on its mesh if it has one), optionally a
`jaxspec.Speculation` (validated, its drafter and tree resolved), the cost model that decides when
speculation pays (`jaxspec.costs.CostModel`, learning across calls), and the compiled loops.
`jaxspec.generate`, the serving engine and the benchmarks all decode through it:

- `Decoder.prepare`: encode and validate prompts and settings, size the cache, prefill once
  (shared prefixes and ``n`` samples per prompt included), build the `DecodeState` -> a `Batch`;
- `Decoder.run`: N rounds of a `jaxspec.decoding.Round` on a state (one jitted loop; compile time
  is measured apart from decode time);
- `Decoder.decode`: a batch to the end, choosing between speculative rounds and plain steps
  between stretches of rounds from the cost model (`Speculation.adaptive`), and gamma itself
  with ``gamma="auto"``;
- `Decoder.result`: tokens, texts and statistics.

The serving engine uses the same pieces on a batch of slots (`empty_state`, `prefill_row`,
`next_round`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import time
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import compile_cache, sampling
from jaxspec.cache import SLOT_ALIGN, KVCache, compute_dtype, round_up
from jaxspec.config import sliding_window_of
from jaxspec.costs import EXPLORE_ACCEPTANCE, CostModel
from jaxspec.decoding import (DecodeState, Pieces, Round, RoundStats, run_chunk, run_mixed_chunk,
                              run_rounds)
from jaxspec.drafter import (DraftState, ModelDrafter, RetrievalState, SelfDrafter, ring_cache_len,
                             ring_prefill)
from jaxspec.invariant import invariant_impl, is_invariant
from jaxspec.mesh import (ShardingError, auto_axes, cache_sharding, fetch, pad_batch, pool_sharding, put_batch,
                          use_mesh)
from jaxspec.model import Model
from jaxspec.paged import PagedKVCache
from jaxspec.prefill import (DEFAULT_PREFILL_CHUNK, chunk_of, prefill, prefill_paged_row, prefill_row,
                             write_row)
from jaxspec.prefix import plan_sharing, prefill_shared
from jaxspec.sharding import decode_params, prepare as lay_out
from jaxspec.speculation import GAMMA_CANDIDATES, Speculation, validate
from jaxspec.tokenizer import token_id
from jaxspec.tree import TokenTree

CHUNK_SECONDS = 0.25  # a stretch of speculative rounds between two decisions takes about this
MAX_CHUNK_ROUNDS = 256
EXPLORE_ROUNDS = 4  # speculative rounds that measure an unknown acceptance (`CostModel.explored`)
# XLA options of the compiled decode loops on GPUs. XLA's rematerialization pass overestimates a
# decode loop's memory (on an H100 at 64 x 16k: 75.5 GiB estimated, 33.7 GiB assigned: it counts
# the integer views of the K/V cache that the in-place writes use, `jaxspec.cache.set_bits`, as
# buffers of their own) and then recomputes small values per layer to save memory that is not in
# use: the RoPE tables, the masked lengths and a cache write, about 100 extra kernels per draft
# step. A memory limit 3x the device's keeps it from running; a loop's real memory is its
# caches, which rematerialization cannot shrink.
GPU_LOOP_OPTIONS = {"xla_gpu_memory_limit_slop_factor": 300}


def loop_compiler_options() -> dict:
    """The compiler options of the decode loops on this backend (`GPU_LOOP_OPTIONS` on GPUs)."""
    return dict(GPU_LOOP_OPTIONS) if jax.default_backend() == "gpu" else {}


@dataclasses.dataclass
class GenerationResult:
    """``tokens``: new tokens per prompt (a final stop token included, nothing after it);
    ``texts``: their decoded text without the stop token (when the model has a tokenizer);
    ``stats``: timings and counters."""

    tokens: list[list[int]]
    texts: list[str] | None
    stats: dict[str, Any]


# ----------------------------------------------------------------------------- validation
def _is_real(x) -> bool:
    """A real number, numpy scalars included (np.float32 is not a Python float)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_attn_impl(attn_impl) -> None:
    """Raises ValueError unless ``attn_impl`` names an attention implementation."""
    from jaxspec.attention import IMPLEMENTATIONS
    if not isinstance(attn_impl, str) or attn_impl not in IMPLEMENTATIONS:
        raise ValueError(f"attn_impl must be one of {IMPLEMENTATIONS}, got {attn_impl!r}")


def check_prefill_chunk(prefill_chunk) -> None:
    """Raises ValueError unless ``prefill_chunk`` is an int >= 1."""
    if (not isinstance(prefill_chunk, (int, np.integer)) or isinstance(prefill_chunk, bool)
            or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")


# the largest top_k the device's int32 setting holds
_INT32_MAX = 2 ** 31 - 1


def check_sampling_args(max_new_tokens, temperature, top_k, top_p, seed=0,
                        prefill_chunk=1) -> None:
    """Raises TypeError / ValueError naming the first bad setting."""
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not (_is_real(temperature) and math.isfinite(temperature)) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if (not isinstance(top_k, (int, np.integer)) or isinstance(top_k, bool) or top_k < 0
            or top_k > _INT32_MAX):
        raise ValueError(f"top_k must be an int in [0, 2**31) (0 = off), got {top_k!r}")
    if not _is_real(top_p) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    seeds = seed if isinstance(seed, (list, tuple)) else [seed]
    for x in seeds:
        if not isinstance(x, (int, np.integer)) or isinstance(x, bool):
            raise TypeError(f"seed must be an int or a list of ints (one per prompt), "
                            f"got {seed!r}")
    check_prefill_chunk(prefill_chunk)


def encode_prompts(model: Model, prompts, chat: bool = False) -> list[list[int]]:
    """Token-id lists from a list of prompts (strings through the model's tokenizer, with its
    chat template when ``chat``; or token-id lists), checked against the vocabulary."""
    if isinstance(prompts, (str, bytes)) or getattr(prompts, "ndim", None) == 1 or (
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
        elif isinstance(p, (bytes, bytearray)):
            raise TypeError(f"prompt {i} is bytes: decode it to a str, or give its token ids")
        else:
            if hasattr(p, "__array__") and not isinstance(p, (list, tuple)):
                p = np.asarray(p)  # a numpy or jax array of token ids
                if p.ndim != 1:
                    raise TypeError(f"prompt {i} is an array of shape {p.shape}: a prompt's "
                                    f"token ids are one row")
            try:
                ids = [token_id(t) for t in p]
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


def stop_token_ids(model: Model, stop_tokens, *, eos: bool = True) -> tuple[int, ...]:
    """The model's EOS ids (unless ``eos=False``) plus ``stop_tokens`` (ids or single-token
    strings)."""
    ids = set(model.config.eos_token_ids) if eos else set()
    tok = model.tokenizer
    if eos and tok is not None and getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    if stop_tokens is None:
        stop_tokens = ()
    elif isinstance(stop_tokens, (str, bytes, numbers.Number)):  # one stop token
        stop_tokens = [stop_tokens]
    elif hasattr(stop_tokens, "__array__"):
        stop_tokens = np.asarray(stop_tokens).reshape(-1).tolist()
    V = model.config.vocab_size
    for s in stop_tokens:
        if isinstance(s, str):
            if tok is None:
                raise ValueError("string stop tokens need a tokenizer")
            unk = getattr(tok, "unk_token_id", None)
            t = tok.convert_tokens_to_ids(s)
            if t is None or (unk is not None and t == unk):
                enc = tok(s, add_special_tokens=False)["input_ids"]
                if len(enc) != 1:
                    raise ValueError(f"stop token {s!r} is not a single token")
                t = enc[0]
                if unk is not None and t == unk and s != getattr(tok, "unk_token", None):
                    raise ValueError(f"stop token {s!r} is not in the vocabulary (it encodes to "
                                     f"the unknown token)")
            ids.add(int(t))
        else:
            try:
                t = token_id(s)
            except TypeError:
                raise TypeError(f"stop tokens must be token ids or single-token strings, "
                                f"got {s!r}") from None
            if not 0 <= t < V:
                raise ValueError(f"stop token id {t} is outside the vocabulary [0, {V})")
            ids.add(t)
    return tuple(sorted(ids))


# ----------------------------------------------------------------------------- a batch
@dataclasses.dataclass
class Batch:
    """A prepared generation: its rows, state and settings (`Decoder.prepare`)."""

    token_lists: list[list[int]]
    n_real: int  # real rows (the rest pad the batch to the data axis)
    state: DecodeState
    sp: sampling.SamplingParams
    stop_ids: tuple[int, ...]
    stats: dict[str, Any]
    slot_lens: np.ndarray  # cache slots the prompt of each row holds (after a shared prefix)
    budget: np.ndarray
    prefix_tokens: int = 0
    greedy: bool = True
    t0: float = 0.0
    compile_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0


def _host(tree):
    """Host copies of the arrays of ``tree`` (gathered from every process on a multi-host mesh)."""
    return jax.tree_util.tree_map(fetch, tree)


def _avals(tree):
    """A hashable description of the shapes, dtypes, shardings and pytree structure of ``tree``
    (what a compiled program is specialized on)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in leaves)


# ----------------------------------------------------------------------------- the decoder
def _as_dtype(params, dtype):
    """``params`` with every floating-point leaf in ``dtype`` (the same tree when they are), cast
    by one compiled program (casting leaf by leaf compiled one program per shape: 0.55 s of a
    CPU start-up for a 30-layer model)."""
    dtype = jnp.dtype(dtype)
    if all(not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype
           for x in jax.tree.leaves(params)):
        return params
    return _cast_floats(params, dtype)


@functools.partial(jax.jit, static_argnums=1)
def _cast_floats(params, dtype):
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


class Decoder:
    """One model (and optionally a speculation) ready to decode; see the module docstring.

    ``attn_impl``: attention implementation (``"auto"``: the Pallas kernels on GPU/TPU, plain
    XLA on CPU). ``prefill_chunk``: tokens per prefill forward. ``batch_invariant``: compute
    with the batch-invariant primitives (`jaxspec.invariant`): a row's tokens do not depend on
    the other rows, the batch size, padding or prefill chunking (sampled ones given per-prompt
    seeds), and greedy ones not on speculation either; the model's own dtype is kept on the CPU
    too (no float32 copy)."""

    def __init__(self, model: Model, speculation: Speculation | None = None, *,
                 attn_impl: str = "auto", prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 batch_invariant: bool = False):
        if not isinstance(model, Model):
            raise TypeError(f"model must be a jaxspec.Model (from jaxspec.load), "
                            f"got {type(model).__name__}")
        check_attn_impl(attn_impl)
        check_prefill_chunk(prefill_chunk)
        mesh = None if model.mesh is None else auto_axes(model.mesh)
        self.batch_invariant = bool(batch_invariant) or is_invariant(attn_impl)
        if self.batch_invariant:
            if mesh is not None:
                raise NotImplementedError(
                    "batch_invariant=True does not support sharded models yet (a tensor-parallel "
                    "product reduces across devices in an order of its own): load the model "
                    "without a mesh")
            attn_impl = invariant_impl(attn_impl)
        draft = None
        self.tree: TokenTree | None = None
        if speculation is not None:
            self.tree = validate(speculation, model)
            if not speculation.is_self:
                draft = speculation.draft
                if mesh is None and draft.mesh is not None:
                    raise ShardingError("the draft model is sharded but the target is not: "
                                        "load both with the same mesh")
                if (mesh is not None and draft.mesh is not None
                        and auto_axes(draft.mesh) != mesh):
                    raise ShardingError("the draft model is sharded on a different mesh than "
                                        "the target")
        if mesh is not None:
            model = lay_out(model, mesh)
            if draft is not None:
                try:
                    draft = lay_out(draft, mesh)
                except ShardingError as e:
                    raise ShardingError(f"the draft model: {e}") from None
        self.model = model
        self.mesh = mesh
        self.config = model.config
        self.speculation = speculation
        self.draft = draft
        self.impl = attn_impl
        # weights, activations and K/V caches: the model's dtype, float32 for 16-bit models on
        # the CPU (`compute_dtype`; a float32 copy of the weights, the model is left as it is)
        self.cache_dtype = compute_dtype(model.dtype, attn_impl)
        self.draft_cache_dtype = None if draft is None else compute_dtype(draft.dtype, attn_impl)
        self.prefill_chunk = int(prefill_chunk)
        self.params = _as_dtype(decode_params(model), self.cache_dtype)
        self.dparams = (_as_dtype(decode_params(draft), self.draft_cache_dtype)
                        if draft is not None else jnp.zeros(()))
        self.drafter = None
        span = None
        if speculation is not None:
            if draft is None:
                window, retrieve = speculation.resolved(
                    sliding=sliding_window_of(model.config) is not None)
                self.drafter = SelfDrafter(sink=int(speculation.sink),
                                           window=None if window is None else int(window),
                                           retrieve=retrieve)
                span = self.drafter.span
            else:
                ring = speculation.window is not None
                cfg = draft.config
                if ring:  # ring slots are not positions: no sliding window there
                    cfg = dataclasses.replace(cfg, sliding_window=None)
                self.drafter = ModelDrafter(config=cfg, ring=ring, sink=int(speculation.sink),
                                            window=None if not ring else int(speculation.window))
                span = self.drafter.span
        self.costs = CostModel(model, draft, span=span)
        if speculation is not None:
            self.costs.rates  # the device benchmark now, not inside a timed decode
        self._compiled: dict = {}
        self._weights_key = None  # ((params, draft params), their tree, their `_avals`)
        # the arrays of the model's (and draft's) weights this decoder copied (`decoder_for`)
        self.source_weights: tuple = ((), ())

    # ------------------------------------------------------------------ properties
    @property
    def max_depth(self) -> int:
        """Most drafts a round may accept (cache slots a round may write: this + 2)."""
        if self.speculation is None:
            return 0
        if self.tree is not None:
            return self.tree.max_depth
        g = self.speculation.gamma
        return max(GAMMA_CANDIDATES) if g == "auto" else int(g)

    @property
    def extra_slots(self) -> int:
        """Cache slots past a row's budget that a round may write."""
        if self.speculation is None:
            return 1
        if self.tree is not None:
            return self.tree.num_nodes + 1
        return self.max_depth + 2

    def round(self, gamma: int | None = None, *, greedy: bool = True, stop_ids=()) -> Round:
        """The speculative round at ``gamma`` (chains; the tree otherwise), or the plain step
        when there is no speculation or ``gamma == 0``."""
        if self.speculation is None or gamma == 0:
            return Round(config=self.config, stop_ids=tuple(stop_ids), impl=self.impl,
                         greedy=greedy)
        tree = self.tree if self.tree is not None else TokenTree.chain(int(gamma))
        return Round(config=self.config, stop_ids=tuple(stop_ids), impl=self.impl,
                     drafter=self.drafter, tree=tree, greedy=greedy,
                     tree_mode=self.speculation.tree_sampling)

    # ------------------------------------------------------------------ running rounds
    @staticmethod
    def _loop_state(rd: Round, state: DecodeState):
        """``(the state rd's loop runs on, the draft state kept aside)``: a plain step reads no
        self-draft selection, so plain decoding's program runs it without one."""
        if not rd.speculative and isinstance(state.draft, RetrievalState):
            return state.replace(draft=None), state.draft
        return state, None

    def compiled_gammas(self, gammas, batch: Batch, state: DecodeState) -> set:
        """The ``gammas`` (0: plain) whose loops `run` has compiled for ``batch`` on ``state``."""
        out = set()
        for g in gammas:
            rd = self.round(g, greedy=batch.greedy, stop_ids=batch.stop_ids)
            st, _ = self._loop_state(rd, state)
            if (rd, self._key(batch.sp, st)) in self._compiled:
                out.add(g)
        return out

    def run(self, rd: Round, sp, state: DecodeState, max_rounds: int) -> tuple[DecodeState, float]:
        """At most ``max_rounds`` rounds of ``rd`` on ``state`` (donated). Returns the new state and
        the seconds spent compiling (0 when the loop was compiled before). Make ``rd`` with the
        batch's settings: ``round(gamma, greedy=batch.greedy, stop_ids=batch.stop_ids)``."""
        if rd.speculative and rd.greedy and sp.stochastic:
            raise ValueError("a greedy speculative round on a batch that samples would decode "
                             "greedily: make the round with round(gamma, greedy=batch.greedy, "
                             "stop_ids=batch.stop_ids)")
        if rd.speculative and isinstance(self.drafter, ModelDrafter) and state.draft is None:
            raise ValueError("a draft model's round needs its draft state (decode() builds it): "
                             "state = state.replace(draft=decoder.draft_state("
                             "batch.token_lists, state)) first")
        state, kept = self._loop_state(rd, state)
        args = (self.params, self.dparams, sp, state)
        key = (rd, self._key(sp, state))
        compiled = self._compiled.get(key)
        t_compile = 0.0
        with use_mesh(self.mesh):
            if compiled is None:
                t = time.perf_counter()
                compiled = compile_cache.executable(
                    run_rounds, (*args, jnp.int32(max_rounds)), {"rd": rd},
                    loop_compiler_options())
                t_compile = time.perf_counter() - t
                self._compiled[key] = compiled
            out = compiled(*args, jnp.int32(max_rounds))
        if kept is not None:
            out = out.replace(draft=kept)
        return out, t_compile

    def _key(self, sp, state: DecodeState):
        """What a compiled loop or chunk is specialized on, for these sampling settings and
        state: the weights' description is computed once (a server looks its programs up
        before every chunk, and describing ~300 weight arrays cost ~1.4 ms of it on an H100
        host, while the device waited)."""
        weights = (self.params, self.dparams)
        tree = jax.tree_util.tree_structure(weights)  # (a tree changed in place, e.g. fused)
        memo = self._weights_key
        if (memo is None or memo[0][0] is not weights[0] or memo[0][1] is not weights[1]
                or memo[1] != tree):
            memo = self._weights_key = (weights, tree, _avals(weights))
        return memo[2], _avals((sp, state))

    def chunk_program(self, rd: Round, sp, state: DecodeState, *, compile: bool = True):
        """The compiled serving chunk of ``rd`` for these shapes (compiled now unless it was
        before; with ``compile=False`` None then): ``(program, seconds compiling)``. The program
        takes ``(params, draft params, sp, state, max_rounds, end_after)`` and donates the state."""
        args = (self.params, self.dparams, sp, state)
        key = ("chunk", rd, self._key(sp, state))
        compiled = self._compiled.get(key)
        if compiled is not None or not compile:
            return compiled, 0.0
        with use_mesh(self.mesh):
            t = time.perf_counter()
            compiled = run_chunk.lower(*args, jnp.int32(0), jnp.int32(0), rd=rd).compile(
                compiler_options=loop_compiler_options())
        self._compiled[key] = compiled
        return compiled, time.perf_counter() - t

    def run_chunk(self, rd: Round, sp, state: DecodeState, max_rounds: int):
        """A serving chunk (`jaxspec.decoding.run_chunk`) of at most ``max_rounds`` rounds of
        ``rd``: returns ``(state, outputs, seconds compiling)``; the outputs are copies, so the
        host can read them while the next chunk runs on the state."""
        compiled, t_compile = self.chunk_program(rd, sp, state)
        state, outs = self.call_chunk(compiled, sp, state, jnp.int32(max_rounds))
        return state, outs, t_compile

    def call_chunk(self, program, sp, state: DecodeState, max_rounds, pieces=None,
                   end_after=0, num_pieces=0):
        """Runs a `chunk_program` (with ``pieces``: a `mixed_program`, whose first
        ``num_pieces`` rounds each prefill a piece) of at most ``max_rounds`` rounds on ``state``
        (donated): ``(state, outputs)``. ``end_after``: the chunk ends after the first round
        that a row finished in, if it is at most this round (0: never)."""
        with use_mesh(self.mesh):
            if pieces is not None:
                return program(self.params, self.dparams, sp, state, jnp.int32(num_pieces),
                               pieces, max_rounds, jnp.int32(end_after))
            return program(self.params, self.dparams, sp, state, max_rounds,
                           jnp.int32(end_after))

    def mixed_program(self, rd: Round, sp, state: DecodeState, pieces: Pieces, *,
                      compile: bool = True):
        """The compiled serving chunk of rounds ``rd`` (plain or speculative) that prefill prompt
        ``pieces`` as they run (`jaxspec.decoding.run_mixed_chunk`), for these shapes (compiled
        now unless it was before; with ``compile=False`` None then): ``(program, seconds
        compiling)``. The program takes ``(params, draft params, sp, state, pieces to prefill,
        pieces, max_rounds, end_after)``."""
        args = (self.params, self.dparams, sp, state)
        key = ("mixed", rd, self._key(sp, state), _avals(pieces))
        compiled = self._compiled.get(key)
        if compiled is not None or not compile:
            return compiled, 0.0
        with use_mesh(self.mesh):
            t = time.perf_counter()
            compiled = run_mixed_chunk.lower(*args, jnp.int32(0), pieces, jnp.int32(0),
                                             jnp.int32(0), rd=rd).compile(
                compiler_options=loop_compiler_options())
        self._compiled[key] = compiled
        return compiled, time.perf_counter() - t

    # ------------------------------------------------------------------ a static batch
    def prepare(self, prompts, *, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, seed: int = 0, stop_tokens=None, chat: bool = False,
                max_len: int | None = None, shared_prefix=None, n: int = 1,
                ignore_eos: bool = False) -> Batch:
        """Validation, cache sizing and prefill of a generation (`jaxspec.generate`'s
        arguments)."""
        model = self.model
        config = self.config
        check_sampling_args(max_new_tokens, temperature, top_k, top_p, seed, self.prefill_chunk)
        if max_len is not None and (not isinstance(max_len, (int, np.integer))
                                    or isinstance(max_len, bool) or max_len < 1):
            raise ValueError(f"max_len must be an int >= 1 or None, got {max_len!r}")
        token_lists = encode_prompts(model, prompts, chat)
        spec = self.speculation
        if (self.batch_invariant and temperature > 0 and spec is not None
                and (spec.adaptive or spec.gamma == "auto")):
            warnings.warn(
                "batch_invariant=True with sampling and adaptive speculation: the adaptive "
                "rounds (plain stretches, gamma='auto') are chosen for the whole batch, so a "
                "prompt's sampled tokens depend on the other rows; pass Speculation(..., "
                "adaptive=False) with an int gamma (or a tree) for invariant sampled tokens",
                stacklevel=3)
        if isinstance(seed, (list, tuple)) and len(seed) != len(token_lists):
            raise ValueError(f"seed has {len(seed)} values for {len(token_lists)} prompts: give "
                             f"one int, or one per prompt")
        window = sliding_window_of(config)  # shared prefixes do not combine with it
        share = None
        if shared_prefix is not None or n != 1:
            token_lists, share = plan_sharing(token_lists, shared_prefix, n, sliding_window=window)
            if self.batch_invariant:  # invariant attention reads no prefix segments: unshared
                share = None
            if share is not None and self.mesh is not None:
                d = self.mesh.shape["data"]
                if len(token_lists) % d:
                    raise ValueError(f"with a shared prefix on a mesh the batch "
                                     f"({len(token_lists)} rows) must be a multiple of the data "
                                     f"axis ({d})")
        n_real = len(token_lists)
        if self.mesh is not None:  # batch over the data axis: pad with dummy rows (no budget)
            token_lists = pad_batch(token_lists, self.mesh)
        ctx = config.max_position_embeddings
        for i, ids in enumerate(token_lists):
            if len(ids) >= ctx:
                raise ValueError(f"prompt {i} has {len(ids)} tokens but the model's context is "
                                 f"{ctx} tokens (max_position_embeddings); shorten it")
        if self.draft is not None and self.speculation.window is None:
            dctx = self.draft.config.max_position_embeddings
            longest = max(len(t) + max(0, min(max_new_tokens, ctx - len(t))) for t in token_lists)
            if longest > dctx:
                raise ValueError(f"the draft model's context is {dctx} tokens but prompts + new "
                                 f"tokens reach {longest}; use a ring-buffer draft (window=...) "
                                 f"instead")
        stop_ids = stop_token_ids(model, stop_tokens, eos=not ignore_eos)
        B = len(token_lists)
        lens = np.array([len(t) for t in token_lists])
        extra = self.extra_slots
        # never past the model's context (nor past what an int64 holds)
        budget = np.minimum(min(int(max_new_tokens), ctx), ctx - lens)
        budget[n_real:] = 0
        short = [i for i in range(n_real) if budget[i] < max_new_tokens]
        if short:
            warnings.warn(
                f"prompt {short[0]} ({len(token_lists[short[0]])} tokens) gets only "
                f"{int(budget[short[0]])} of max_new_tokens={max_new_tokens} new tokens: "
                f"generation stops at the model's context of {ctx} tokens "
                f"(max_position_embeddings){f'; {len(short)} prompts in all' if len(short) > 1 else ''}",
                stacklevel=3)
        slot_lens = lens if share is None else lens - share.offsets  # suffix slots per row
        need = int((slot_lens + budget).max()) + extra
        why = (f"prompts of up to {int(slot_lens.max())} tokens"
               f"{' (after the shared prefix)' if share else ''} plus {int(budget.max())} new "
               f"tokens and {extra} slot{'s' if extra > 1 else ''} for "
               f"{'the tokens of a speculation round' if self.speculation else 'the last token'}")
        n_pre = int(slot_lens.max()) - 1  # prefill writes whole chunks: the cache must hold them
        if n_pre > 0:
            C, total = chunk_of(n_pre, self.prefill_chunk)
            if total > need:
                need = total
                why = (f"the prefill of prompts of up to {int(slot_lens.max())} tokens writes "
                       f"whole chunks of {C} slots (prefill_chunk)")
        S = int(max_len or round_up(need, SLOT_ALIGN))
        if S < need:
            raise ValueError(f"max_len={S} is too small: {why} need {need} cache slots")
        t0 = time.perf_counter()
        stats: dict[str, Any] = {"batch": n_real, "prompt_tokens": int(lens[:n_real].sum()),
                                 "max_len": S}
        if share is not None:
            stats["shared_prefix_tokens"] = share.prefix_tokens
        c_shd = None if self.mesh is None else cache_sharding(config, self.mesh, B)
        with use_mesh(self.mesh):
            if max_new_tokens == 0:
                cache = None
            elif share is None:
                cache = KVCache.create(config, B, S, dtype=self.cache_dtype, sharding=c_shd)
                # everything but each prompt's last token; the loop starts from that token
                cache = prefill(config, self.params, cache, [t[:-1] for t in token_lists],
                                impl=self.impl, chunk=self.prefill_chunk)
            else:  # the shared prefix once, then each row's suffix
                cache = prefill_shared(config, self.params, token_lists, share, S=S,
                                       impl=self.impl, chunk=self.prefill_chunk,
                                       dtype=self.cache_dtype, sharding=c_shd, mesh=self.mesh)
            if cache is not None:
                jax.block_until_ready(cache.k)
        t_prefill = time.perf_counter() - t0
        sp = sampling.SamplingParams.make(B, temperature=temperature, top_k=top_k, top_p=top_p,
                                          invariant=self.batch_invariant)
        state = None
        if cache is not None:
            if isinstance(seed, (list, tuple)):  # each prompt's rows: keys of its own seed
                keys = sampling.seeded_row_keys(seed, n)
                if B > len(keys):  # rows padding the batch to a mesh (no budget)
                    keys = jnp.concatenate([keys, sampling.row_keys(0, B - len(keys))], 0)
            else:
                keys = sampling.row_keys(seed, B)
            state = self._state(cache, [t[-1] for t in token_lists], budget,
                                int(budget.max()) + extra, keys)
            if self.mesh is not None:
                state, sp = put_batch((state, sp), self.mesh, B)
        return Batch(token_lists=token_lists, n_real=n_real, state=state, sp=sp,
                     stop_ids=stop_ids, stats=stats, slot_lens=np.asarray(slot_lens),
                     budget=np.asarray(budget),
                     prefix_tokens=0 if share is None else share.prefix_tokens,
                     greedy=float(temperature) <= 0, t0=t0, prefill_seconds=t_prefill)

    def _state(self, cache, last, budget, width, keys) -> DecodeState:
        B = len(budget)
        return DecodeState(
            cache=cache, last=jnp.asarray(last, jnp.int32),
            out=jnp.zeros((B, width), jnp.int32), from_draft=jnp.zeros((B, width), bool),
            n_out=jnp.zeros((B,), jnp.int32), budget=jnp.asarray(budget, jnp.int32),
            done=jnp.asarray(np.asarray(budget) <= 0), rng=jnp.asarray(keys),
            steps=jnp.zeros((), jnp.int32), stats=RoundStats.zeros(B),
            draft=None if self.drafter is None else self.drafter.init_state(B, self.config))

    # ------------------------------------------------------------------ draft state
    def draft_state(self, token_lists, state: DecodeState) -> DraftState | None:
        """A draft model's state for prompts ``token_lists`` (its cache prefilled with all but
        each prompt's last token); None for self-speculation."""
        if not isinstance(self.drafter, ModelDrafter):
            return None
        d = self.draft
        B = len(token_lists)
        rows = [t[:-1] for t in token_lists]
        shd = None if self.mesh is None else cache_sharding(d.config, self.mesh, B)
        with use_mesh(self.mesh):
            if self.drafter.ring:
                S = ring_cache_len(self.drafter.sink, self.drafter.window, self.extra_slots)
                dc = KVCache.create(d.config, B, S, dtype=self.draft_cache_dtype, sharding=shd)
                dc = ring_prefill(self.drafter, self.dparams, dc, rows, impl=self.impl)
            else:  # every position of the whole rows (the target's cache may hold suffixes only)
                longest = max(len(t) for t in token_lists)
                need = longest + int(np.max(_host(state.budget))) + self.extra_slots
                if longest > 1:  # prefill writes whole chunks
                    need = max(need, chunk_of(longest - 1, self.prefill_chunk)[1])
                S = max(state.cache.max_len, round_up(need, SLOT_ALIGN))
                dc = KVCache.create(d.config, B, S, dtype=self.draft_cache_dtype, sharding=shd)
                dc = prefill(d.config, self.dparams, dc, rows, impl=self.impl,
                             chunk=self.prefill_chunk)
        prev = jnp.array(state.last, copy=True)
        return DraftState(cache=dc, prev=prev)

    # ------------------------------------------------------------------ decisions
    def _host_view(self, state: DecodeState, prefix_per_row: float = 0.0):
        """What the decisions read: running rows' contexts and speculative statistics."""
        done, lengths, st = _host((state.done, state.cache.lengths, state.stats))
        act = ~np.asarray(done)
        ctx = np.asarray(lengths, np.float64)[act] + prefix_per_row
        W = sliding_window_of(self.config)
        if W is not None:  # a target step reads at most its window
            ctx = np.minimum(ctx, W)
        return act, ctx, st

    def _levels(self, rd: Round):
        tree = rd.tree
        if rd.is_chain:
            return (1,) * tree.max_depth, tree.num_nodes
        return tuple(b - a for a, b in tree.levels[:tree.max_depth]), tree.num_nodes

    def next_round(self, spec_rd: Round, view, rounds_left: int) -> tuple[Round, int]:
        """The next stretch of decoding: ``spec_rd`` or its plain step, and how many rounds.

        ``view``: (running rows mask, their contexts, `RoundStats` with each row's speculative
        rounds and tokens committed so far). Speculative stretches last about `CHUNK_SECONDS`
        (then the rows that finished and the acceptance seen are taken into account); once plain
        steps pay better, they run to the end (``rounds_left``): acceptance estimates do not
        change during plain steps and contexts hardly do."""
        act, ctx, st = view
        levels, nodes = self._levels(spec_rd)
        t_round = self.costs.round_time(ctx, levels, nodes) if len(ctx) else 0.0
        rounds = int(np.clip(CHUNK_SECONDS / max(t_round, 1e-9), 2, MAX_CHUNK_ROUNDS))
        if not self.speculation.adaptive:
            return spec_rd, rounds
        tokens = self.costs.expected_row_tokens(
            np.asarray(st.committed, np.float64)[act], np.asarray(st.spec_rounds, np.float64)[act],
            spec_rd.tree.max_depth)
        if self.costs.speculation_pays(ctx, tokens, levels, nodes):
            return spec_rd, rounds
        return spec_rd.plain(), int(rounds_left)

    def _observe(self, rd: Round, ctx_before, ctx_after, rounds: int, seconds: float):
        if rounds <= 0 or len(ctx_before) == 0:
            return
        if rd.speculative:
            levels, nodes = self._levels(rd)
            kind = ("round", levels, nodes)

            def roof(c):
                return self.costs.round_roofline(c, levels, nodes) if len(c) else 0.0
        else:
            kind = "plain"

            def roof(c):
                return self.costs.plain_roofline(c) if len(c) else 0.0
        pred = rounds * 0.5 * (roof(ctx_before) + roof(ctx_after))
        self.costs.observe(kind, seconds, pred, rounds)

    # ------------------------------------------------------------------ a batch to the end
    def decode(self, batch: Batch, *, progress=None) -> Batch:
        """Runs ``batch`` until every row is done (see the module docstring). ``progress(new
        tokens so far, total budget)`` is called between stretches of rounds."""
        state = batch.state
        if state is None:  # nothing to generate (max_new_tokens=0)
            return batch
        stats = batch.stats
        prefix_per_row = batch.prefix_tokens / max(len(batch.token_lists), 1)
        total = int(batch.budget.sum())
        t_start = time.perf_counter()
        compile_s = 0.0
        spec = self.speculation
        gamma = 0
        explore = False
        view = self._host_view(state, prefix_per_row)

        def rounds_left(st):
            return int(np.max(batch.budget - np.asarray(_host(st.n_out)))) + 1

        if spec is not None:
            if self.tree is not None:
                gamma = self.tree.max_depth
                stats.update({"tree_nodes": self.tree.num_nodes,
                              "tree_depth": self.tree.max_depth})
            elif spec.gamma == "auto":
                if self.costs.explored:
                    ready = self.compiled_gammas((0, *GAMMA_CANDIDATES), batch, state)
                    gamma, predicted = self.costs.choose_gamma(
                        view[1], GAMMA_CANDIDATES, compiled=ready, steps=rounds_left(state))
                else:
                    # nothing known of the acceptance: the gamma that pays for a good draft, and
                    # a first stretch that measures it. (The prior would pick a short chain that
                    # later calls keep, as a longer one needs its own compilation: measured on
                    # an H200, gamma 2 where the drafts' 0.9-0.95 acceptance wants 4.)
                    gamma, predicted = self.costs.choose_gamma(
                        view[1], GAMMA_CANDIDATES, alpha=EXPLORE_ACCEPTANCE)
                    explore = gamma > 0
                stats.update({"auto_alpha": self.costs.alpha, "predicted_speedup": predicted})
            else:
                gamma = int(spec.gamma)
            stats["gamma"] = gamma

        plain_rd = self.round(0, greedy=batch.greedy, stop_ids=batch.stop_ids)
        rd, rounds = plain_rd, rounds_left(state)
        if gamma:
            spec_rd = self.round(gamma, greedy=batch.greedy, stop_ids=batch.stop_ids)
            rd, rounds = self.next_round(spec_rd, view, rounds)
            levels, nodes = self._levels(spec_rd)
            if not rd.speculative and spec_rd.is_chain and (
                    explore or self.costs.worth_exploring(view[1], levels, nodes)):
                rd, rounds = spec_rd, EXPLORE_ROUNDS  # measure the acceptance first
            if rd.speculative or rounds < rounds_left(state):
                # speculation will run: a draft model's cache is needed from now on
                if isinstance(self.drafter, ModelDrafter):
                    state = state.replace(draft=self.draft_state(batch.token_lists, state))
            else:
                rd = plain_rd  # plain to the end: the drafter is never needed
        while view[0].any():
            steps0 = int(_host(state.steps))
            t = time.perf_counter()
            state, c = self.run(rd, batch.sp, state, rounds)
            new_view = self._host_view(state, prefix_per_row)
            compile_s += c
            if c > 0:
                self.costs.observe_compile(c)
            ran = int(_host(state.steps)) - steps0
            if spec is not None:  # what the cost model learns from
                self._observe(rd, view[1], new_view[1], ran, time.perf_counter() - t - c)
            view = new_view
            if progress is not None:
                progress(int(np.asarray(_host(state.n_out)).sum()), total)
            if not view[0].any():
                break
            if not gamma:
                rd, rounds = plain_rd, rounds_left(state)
            else:
                rd, rounds = self.next_round(spec_rd, view, rounds_left(state))
        if gamma and self.tree is None:  # what this call saw of the acceptance
            rs = _host(state.stats)
            self.costs.observe_acceptance(float(np.sum(rs.accepted)), float(np.sum(rs.spec_rounds)),
                                          gamma)
        batch.state = state
        batch.compile_seconds += compile_s
        batch.decode_seconds += time.perf_counter() - t_start - compile_s
        return batch

    # ------------------------------------------------------------------ results
    def result(self, batch: Batch) -> GenerationResult:
        stats = dict(batch.stats)
        st = batch.state
        if st is None:  # nothing to generate (max_new_tokens=0)
            stats.update({"new_tokens": 0, "seconds": time.perf_counter() - batch.t0,
                          "prefill_seconds": 0.0, "compile_seconds": 0.0, "decode_seconds": 0.0,
                          "tokens_per_second": 0.0, "target_steps": 0})
            spec = self.speculation
            if spec is not None:  # no round ran (an "auto" gamma was never chosen: 0)
                gamma = (self.tree.max_depth if self.tree is not None
                         else 0 if spec.gamma == "auto" else int(spec.gamma))
                stats.update({"gamma": gamma, "acceptance_rate": 0.0, "tokens_per_step": 0.0,
                              "plain_steps": 0})
            return GenerationResult(tokens=[[] for _ in range(batch.n_real)],
                                    texts=None if self.model.tokenizer is None else
                                    ["" for _ in range(batch.n_real)], stats=stats)
        out, n_out = fetch(st.out), fetch(st.n_out)
        rs, steps = _host(st.stats), int(_host(st.steps))
        tokens = [out[i, :n_out[i]].tolist() for i in range(batch.n_real)]
        new = int(np.asarray(n_out)[:batch.n_real].sum())
        t_end = time.perf_counter()
        decode_s = batch.decode_seconds
        stats.update({
            "new_tokens": new,
            "seconds": t_end - batch.t0,
            "prefill_seconds": batch.prefill_seconds,
            "compile_seconds": batch.compile_seconds,
            "decode_seconds": decode_s,
            "tokens_per_second": new / decode_s if decode_s > 0 else 0.0,
            "target_steps": steps,
        })
        if self.speculation is not None:
            n_real = batch.n_real
            rows_steps = np.asarray(rs.spec_rounds)[:n_real]  # speculative rounds of each row
            rows_tok = np.asarray(rs.committed)[:n_real]  # tokens they committed
            proposed, accepted = int(np.asarray(rs.proposed).sum()), int(np.asarray(rs.accepted).sum())
            row_steps = int(rows_steps.sum())
            stats["plain_steps"] = int(rs.plain_steps)
            if isinstance(self.drafter, SelfDrafter):  # what the self-draft reads
                stats["draft_view"] = {"sink": self.drafter.sink, "window": self.drafter.window,
                                       "retrieve": self.drafter.retrieve}
            stats["acceptance_rate"] = accepted / proposed if proposed else 0.0
            # tokens per target step a row took part in (a plain step commits one token)
            plain_tokens = new - int(rows_tok.sum())
            stats["tokens_per_step"] = new / max(row_steps + plain_tokens, 1)
            per_row = (rows_tok / np.maximum(rows_steps, 1))[rows_steps > 0]
            stats["tokens_per_step_rows"] = {
                q: float(np.percentile(per_row, q)) if per_row.size else 0.0
                for q in (0, 10, 50, 90, 100)}
        texts = None
        tok = self.model.tokenizer
        if tok is not None:
            texts = [tok.decode(t[:-1] if t and t[-1] in batch.stop_ids else t,
                                skip_special_tokens=True) for t in tokens]
        return GenerationResult(tokens=tokens, texts=texts, stats=stats)

    # ------------------------------------------------------------------ slots (serving)
    def empty_state(self, batch: int, max_len: int, width: int) -> DecodeState:
        """A state of ``batch`` idle rows (every row done) with caches of ``max_len`` slots and an
        output buffer of ``width`` tokens per row: the serving engine's slots."""
        c_shd = None if self.mesh is None else cache_sharding(self.config, self.mesh, batch)
        with use_mesh(self.mesh):
            cache = KVCache.create(self.config, batch, max_len, dtype=self.cache_dtype,
                                   sharding=c_shd)
        state = self._state(cache, np.zeros(batch, np.int32), np.zeros(batch, np.int32), width,
                            np.zeros((batch, 2), np.uint32))
        if isinstance(self.drafter, ModelDrafter):
            d = self.draft
            S = (ring_cache_len(self.drafter.sink, self.drafter.window, self.extra_slots)
                 if self.drafter.ring else max_len)
            shd = None if self.mesh is None else cache_sharding(d.config, self.mesh, batch)
            with use_mesh(self.mesh):
                dc = KVCache.create(d.config, batch, S, dtype=self.draft_cache_dtype,
                                    sharding=shd)
            state = state.replace(draft=DraftState(cache=dc, prev=jnp.zeros((batch,), jnp.int32)))
        return state

    def prefill_row(self, state: DecodeState, row: int, tokens: list[int]) -> DecodeState:
        """Prefills ``tokens`` (all but the prompt's last token) into row ``row`` of a slot state's
        caches (the draft model's too); the row's other fields are the caller's."""
        with use_mesh(self.mesh):
            cache = prefill_row(self.config, self.params, state.cache, row, tokens,
                                impl=self.impl, chunk=self.prefill_chunk)
        return self.prefill_draft_row(state.replace(cache=cache), row, tokens)

    def prefill_paged_row(self, state: DecodeState, row: int, tokens: list[int],
                          start: int, prompt_end: int | None = None) -> DecodeState:
        """`jaxspec.prefill.prefill_paged_row` on a slot state with a paged cache: ``tokens``
        from logical slot ``start`` on (a chunk of a prompt; the slots before it are filled).
        ``prompt_end``: the slot from which on the tokens are ones decode steps computed before
        (a preempted sequence's; None: all are prompt tokens)."""
        with use_mesh(self.mesh):
            cache = prefill_paged_row(self.config, self.params, state.cache, row, tokens, start,
                                      impl=self.impl, chunk=self.prefill_chunk,
                                      programs=self._compiled if self.mesh is None else None,
                                      prompt_end=prompt_end)
        return state.replace(cache=cache)

    def paged_state(self, batch: int, num_blocks: int, block_size: int, max_blocks: int,
                    width: int) -> DecodeState:
        """`empty_state` with a paged target cache: a pool of ``num_blocks`` blocks of
        ``block_size`` slots, rows of ``max_blocks`` table entries (all unmapped)."""
        state = self.empty_state(batch, SLOT_ALIGN, width)
        shd = None if self.mesh is None else pool_sharding(self.config, self.mesh)
        with use_mesh(self.mesh):
            cache = PagedKVCache.create(self.config, batch, num_blocks, block_size, max_blocks,
                                        dtype=self.cache_dtype, sharding=shd)
        return state.replace(cache=cache)

    def prefill_draft_row(self, state: DecodeState, row: int, tokens: list[int],
                          prompt_end: int | None = None) -> DecodeState:
        """A draft model's cache (full or ring) of row ``row`` prefilled with ``tokens``; the
        state as it is for self-speculation and plain decoding. ``prompt_end``: as in
        `prefill_paged_row`."""
        draft = state.draft
        with use_mesh(self.mesh):
            if isinstance(self.drafter, ModelDrafter):
                dc = draft.cache
                if self.drafter.ring:
                    one = KVCache.create(self.draft.config, 1, dc.max_len, dtype=dc.k.dtype)
                    one = ring_prefill(self.drafter, self.dparams, one, [tokens], impl=self.impl)
                    dc = write_row(dc, one.k, one.v, jnp.int32(row), jnp.int32(len(tokens)))
                else:
                    dc = prefill_row(self.draft.config, self.dparams, dc, row, tokens,
                                     impl=self.impl, chunk=self.prefill_chunk,
                                     prompt_end=prompt_end)
                draft = draft.replace(cache=dc)
        return state.replace(draft=draft)
