"""An OpenAI-compatible HTTP server over the continuous-batching engine (`jaxspec.serving`).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true``:
server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text) and ``GET /`` (a small demo page).

Bad input never reaches the engine: malformed JSON or wrong types give 400 with an OpenAI-style
error body, a prompt that does not fit gives 400 naming the limits, a full queue 503 with
``Retry-After``. A client that disconnects frees its slots; an exception while serving one request
fails that request only.

Hostile clients (see `ServerLimits` and ``--help``): with an API key (``--api-key`` or
``JAXSPEC_API_KEY``) every path but ``/health`` (and ``/metrics`` with ``--metrics-public``, ``/``
with ``--page-public``) answers 401 without ``Authorization: Bearer KEY``; request bodies are
capped in bytes (413, counted as they arrive, never buffered past the cap); a request must arrive
whole (headers and body) within ``--request-read-timeout`` seconds of its first byte, or the
connection is closed (408 where a response can still be sent); prompts, messages, stop strings and
``n x max_tokens`` are capped per request. On SIGTERM (or Ctrl-C) the server stops admitting (503),
lets running requests finish for up to ``--shutdown-timeout`` seconds, then ends the rest with an
error (a final error chunk for streams) and exits.

Extensions (ignored by OpenAI clients): every streamed choice carries ``"jaxspec": {"segments":
[[text, from_draft], ...], "n_tokens", "accepted", "proposed"}`` (which text came from accepted
draft tokens); ``"return_token_ids": true`` in a request adds ``"token_ids"`` to each choice.

Run it with ``python scripts/serve.py`` or ``jaxspec serve`` (see `add_arguments`).
"""


import argparse
import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import hashlib
import hmac
import html
import inspect
import json
import logging
import math
import os
import time
import uuid
from importlib import resources
from typing import Any

from jaxspec.args import (int_or_none_arg, merge_model_path, mesh_from_args, nonneg_float,
                          nonneg_int, parse_gamma, parse_tree, positive_int, retrieve_arg,
                          window_arg)
from jaxspec.serving import (FILL_FIRST_SECONDS, GROWTH_RESERVE_TOKENS, MIXED_STRETCH,
                             SHARE_MIN_TOKENS, EngineStopped, PromptTooLong, QueueFull,
                             SamplingOptions, Sequence, ServingEngine)
from jaxspec.speculation import Speculation

log = logging.getLogger("jaxspec.server")

API_KEY_ENV = "JAXSPEC_API_KEY"
# a non-streamed request looks this often whether its client is still there (a client that
# hung up has its sequences cancelled)
DISCONNECT_CHECK_SECONDS = 0.25


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one client may ask of the server; every field has a ``serve`` flag of the same name
    (``max_body_bytes`` is ``--max-body-bytes``), documented in ``--help``.

    max_body_bytes: request body size; past it 413 (a larger Content-Length is refused before a
        byte of the body is read, a chunked body as soon as its bytes pass the cap).
    request_read_timeout: seconds a client has to send a whole request (headers and body), from
        its first byte (or from the end of the previous response on a kept-alive connection);
        then 408 and the connection is closed. Slow senders hold no worker.
    keep_alive_timeout: seconds an idle kept-alive connection stays open (uvicorn's).
    max_generation_tokens: completion tokens one request may ask for, prompts x n x max_tokens
        (a chat request without max_tokens counts the room its prompt leaves in the context).
    max_prompts: prompts in one completions request (a list of strings or of token-id lists).
    max_messages: messages in one chat request.
    max_stop: stop strings per request (OpenAI's limit is 4).
    max_stop_chars: characters of one stop string.
    """

    max_body_bytes: int = 8 * 1024 * 1024
    request_read_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    max_generation_tokens: int = 65536
    max_prompts: int = 64
    max_messages: int = 1024
    max_stop: int = 4
    max_stop_chars: int = 256

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 \
                    or not math.isfinite(v):
                raise ValueError(f"ServerLimits.{f.name} must be a positive number, got {v!r}")

    @classmethod
    def from_args(cls, a) -> "ServerLimits":
        return cls(**{f.name: getattr(a, f.name) for f in dataclasses.fields(cls)})


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def json_bytes(self) -> bytes:
        # ASCII-escaped: a message may quote client input (lone surrogates included)
        return json.dumps(self.body(), separators=(",", ":")).encode()


# ----------------------------------------------------------------------------- validation
def _bad(message, param=None, code=None):
    return APIError(400, message, param=param, code=code)


def _preview(v) -> str:
    """A short description of a JSON value for an error message (bounded, whatever its size or
    depth)."""
    if isinstance(v, dict):
        return f"an object with {len(v)} keys"
    if isinstance(v, list):
        return f"a list of {len(v)} items"
    if isinstance(v, str):
        return json.dumps(v[:40] + ("..." if len(v) > 40 else ""))
    text = json.dumps(v) if isinstance(v, (bool, float)) or v is None else str(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _opt(body: dict, name: str, kind: str, default=None, *, lo=None, hi=None, lo_open=False,
         where: str | None = None):
    """A typed optional field: kind in {"int", "number", "bool", "str"}; null means default.
    ``where``: the field's name in errors (a field inside an object: ``"a.b"``)."""
    v = body.get(name, None)
    if v is None:
        return default
    name = where or name
    ok = {"int": isinstance(v, int) and not isinstance(v, bool),
          "number": isinstance(v, (int, float)) and not isinstance(v, bool),
          "bool": isinstance(v, bool),
          "str": isinstance(v, str)}[kind]
    if not ok:
        want = {"int": "an integer", "number": "a number", "bool": "a boolean",
                "str": "a string"}[kind]
        raise _bad(f"'{name}' must be {want}, got {_preview(v)}", name, "invalid_type")
    if kind == "number" and isinstance(v, float) and not math.isfinite(v):  # ints: any size
        raise _bad(f"'{name}' must be finite", name, "invalid_value")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise _bad(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {_preview(v)}", name,
                   "invalid_value")
    if hi is not None and v > hi:
        raise _bad(f"'{name}' must be <= {hi}, got {_preview(v)}", name, "invalid_value")
    return v


# sampling fields of vLLM's and SGLang's OpenAI servers (clients switching from them send these)
# with their no-op values: any other value is refused, as OpenAI's own unimplemented fields are
_EXTENSION_NO_OPS = {
    "ignore_eos": (False,), "min_tokens": (0,), "stop_token_ids": ([],),
    "repetition_penalty": (1, 1.0), "min_p": (0, 0.0), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "allowed_token_ids": ([],),
    "bad_words": ([],), "prompt_logprobs": (), "truncate_prompt_tokens": (),
    "guided_json": (), "guided_regex": (), "guided_choice": ([],), "guided_grammar": (),
    "structural_tag": (), "regex": (), "json_schema": (), "ebnf": (), "min_new_tokens": (0,),
    "no_stop_trim": (False,), "continue_final_message": (False,),
    "add_generation_prompt": (True,), "chat_template": (), "chat_template_kwargs": ({},),
}


def _unsupported(body: dict, *, chat: bool) -> None:
    """A 400 for a field of the OpenAI API that this server does not implement, unless it is
    at its no-op value: answering as if it were honoured would give a client that relies on it
    (banned tokens, JSON mode, tool calls) a plausible but wrong result."""
    def refuse(name):
        raise _bad(f"'{name}' is not supported by this server", name, "unsupported")
    for name in ("presence_penalty", "frequency_penalty"):
        if _opt(body, name, "number", 0.0, lo=-2.0, hi=2.0):
            refuse(name)
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise _bad("'logit_bias' must be an object", "logit_bias", "invalid_type")
    if bias:
        refuse("logit_bias")
    if not chat and _opt(body, "suffix", "str", ""):
        refuse("suffix")
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise _bad("'response_format' must be an object", "response_format", "invalid_type")
        if fmt.get("type", "text") != "text":
            refuse("response_format")
    for name, no_ops in _EXTENSION_NO_OPS.items():
        v = body.get(name)
        if v is not None and not any(type(v) is type(x) and v == x for x in no_ops):
            refuse(name)
    if chat:
        # output this server cannot produce: answering with plain text would look like success
        mods = body.get("modalities")
        if mods is not None and (not isinstance(mods, list) or
                                 not all(isinstance(x, str) for x in mods)):
            raise _bad("'modalities' must be a list of strings", "modalities", "invalid_type")
        if mods and any(x != "text" for x in mods):
            raise _bad("'modalities' other than [\"text\"] are not supported by this server "
                       "(it generates text only)", "modalities", "unsupported")
        for name in ("audio", "web_search_options"):
            if body.get(name) is not None:
                refuse(name)
        for name in ("tools", "functions"):
            v = body.get(name)
            if v is not None and not isinstance(v, list):
                raise _bad(f"'{name}' must be a list", name, "invalid_type")
            if v:
                refuse(name)
        for name in ("tool_choice", "function_call"):
            if body.get(name) not in (None, "none"):
                refuse(name)


def _options(body: dict, engine: ServingEngine, limits: ServerLimits, *,
             chat: bool) -> tuple[SamplingOptions, int]:
    max_tokens = _opt(body, "max_tokens", "int", None, lo=1)
    if chat:
        max_tokens = _opt(body, "max_completion_tokens", "int", max_tokens, lo=1)
    elif max_tokens is None:
        max_tokens = 16  # OpenAI's default for completions
    temperature = _opt(body, "temperature", "number", 1.0, lo=0.0, hi=2.0)
    top_p = _opt(body, "top_p", "number", 1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k = _opt(body, "top_k", "int", 0, lo=-1)
    seed = _opt(body, "seed", "int", None)
    # (OpenAI's limit; more samples than slots wait in the queue, as a list of prompts does,
    # and `handle` refuses more sequences than the queue holds, naming --max-queue)
    n = _opt(body, "n", "int", 1, lo=1, hi=128)
    stop = body.get("stop", None)
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        if len(stop) > limits.max_stop:
            raise _bad(f"'stop' has {len(stop)} strings; at most {limits.max_stop}", "stop",
                       "invalid_value")
        stop = tuple(stop)
    else:
        raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if any(s == "" for s in stop):
        raise _bad("'stop' strings must not be empty", "stop", "invalid_value")
    for i, s in enumerate(stop):
        _check_text(s, "stop", f"stop[{i}]")
    longest = max((len(s) for s in stop), default=0)
    if longest > limits.max_stop_chars:
        raise _bad(f"a 'stop' string has {longest} characters; at most "
                   f"{limits.max_stop_chars}", "stop", "invalid_value")
    # log-probabilities: chat's 'logprobs' is a boolean; a completion's an int, where 0 already
    # asks for the sampled tokens' own
    if chat and _opt(body, "logprobs", "bool", False):
        raise _bad("'logprobs' is not supported by this server", "logprobs", "unsupported")
    if not chat and body.get("logprobs") is not False and \
            _opt(body, "logprobs", "int", None) is not None:  # (false: as null)
        raise _bad("'logprobs' is not supported by this server", "logprobs", "unsupported")
    if _opt(body, "top_logprobs", "int", 0, lo=0):
        raise _bad("'top_logprobs' is not supported by this server", "top_logprobs",
                   "unsupported")
    _unsupported(body, chat=chat)
    if body.get("echo"):
        raise _bad("'echo' is not supported by this server", "echo", "unsupported")
    if body.get("best_of") not in (None, 1, n):
        raise _bad("'best_of' is not supported by this server", "best_of", "unsupported")
    # top_k >= the vocabulary keeps every token: the same as off (and fits the engine's int32)
    top_k = 0 if top_k < 0 or top_k >= engine.config.vocab_size else int(top_k)
    opts = SamplingOptions(max_tokens=max_tokens, temperature=float(temperature),
                           top_k=top_k, top_p=float(top_p), stop=stop, seed=seed)
    return opts, n


def _check_text(s: str, param: str, what: str):
    """Strings from JSON may hold lone surrogates (``"\\ud800"``), which no tokenizer takes."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad(f"{what} is not valid Unicode: it holds the lone surrogate "
                   f"U+{ord(s[e.start]):04X} at character {e.start}", param,
                   "invalid_value") from None


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _completion_items(body: dict, limits: ServerLimits) -> list:
    """The prompts of a completions request, checked for shape and count (not yet encoded)."""
    p = body.get("prompt", None)
    if p is None:
        raise _bad("'prompt' is required", "prompt", "missing")
    if isinstance(p, str):
        _check_text(p, "prompt", "'prompt'")
        return [p]
    if isinstance(p, list) and p and _is_ids(p):
        return [p]
    if isinstance(p, list) and p and (all(isinstance(x, str) for x in p)
                                      or all(_is_ids(x) for x in p)):
        if len(p) > limits.max_prompts:
            raise _bad(f"'prompt' is a list of {len(p)} prompts; at most {limits.max_prompts} "
                       f"per request", "prompt", "invalid_value")
        for i, x in enumerate(p):
            if isinstance(x, str):
                _check_text(x, "prompt", f"prompt[{i}]")
        return p
    raise _bad("'prompt' must be a string, a list of strings, a list of token ids or a list "
               "of token-id lists (non-empty)", "prompt", "invalid_type")


def _encode_completion(items: list, engine: ServingEngine) -> list[list[int]]:
    out = []
    for x in items:
        try:
            out.append(engine.encode_prompt(x))
        except (ValueError, TypeError) as e:  # what the tokenizer refuses
            raise _bad(str(e), "prompt", "invalid_value") from None
    return out


_ROLES = ("system", "user", "assistant", "developer", "tool")


def _chat_messages(body: dict, limits: ServerLimits) -> list[dict]:
    """The messages of a chat request, checked and flattened to text (not yet encoded)."""
    msgs = body.get("messages", None)
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list of messages", "messages",
                   "invalid_type" if msgs is not None else "missing")
    if len(msgs) > limits.max_messages:
        raise _bad(f"'messages' has {len(msgs)} messages; at most {limits.max_messages} per "
                   f"request", "messages", "invalid_value")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages",
                       "invalid_type")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            parts = []
            for j, part in enumerate(c):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif kind == "refusal" and m.get("role") == "assistant" \
                        and isinstance(part.get("refusal"), str):
                    parts.append(part["refusal"])  # (OpenAI: an assistant's refusal part)
                else:
                    got = f"a {_preview(kind)} part" if isinstance(kind, str) else \
                        _preview(part)
                    raise _bad(f"messages[{i}].content[{j}]: only text parts are supported by "
                               f"this server (no images, audio or files), got {got}",
                               "messages", "unsupported" if isinstance(kind, str)
                               else "invalid_type")
            # (as vLLM joins them: parts are separate pieces of text, not one word split)
            c = "\n".join(parts)
        elif c is None:
            c = ""
        elif not isinstance(c, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts",
                       "messages", "invalid_type")
        for name in ("tool_calls", "function_call"):
            if m.get(name):
                raise _bad(f"messages[{i}].{name}: tool calls are not supported by this server",
                           "messages", "unsupported")
        if m["role"] not in _ROLES:
            raise _bad(f"messages[{i}].role {_preview(m['role'])} is not one of system, user, "
                       f"assistant, developer, tool", "messages", "invalid_value")
        _check_text(c, "messages", f"messages[{i}].content")
        # OpenAI's "developer" role is its "system" role under a new name (for newer models);
        # chat templates know only "system" (SmolLM2's, Llama 3's, Qwen's add their own default
        # system prompt when the first message is not "system", and render "developer" as an
        # unknown role the model was never trained on)
        role = "system" if m["role"] == "developer" else m["role"]
        clean.append({"role": role, "content": c})
    return clean


def _encode_chat(clean: list[dict], engine: ServingEngine) -> list[int]:
    try:
        return engine.encode_chat(clean)
    except ValueError as e:
        raise _bad(str(e), "messages", "invalid_value") from None
    except Exception as e:  # noqa: BLE001 - a template that fails on this input
        raise _bad(f"the chat template failed on these messages: {e}", "messages",
                   "invalid_value") from None


# ----------------------------------------------------------------------------- metrics
class HTTPStats:
    def __init__(self):
        self.requests: dict[tuple[str, int], int] = {}
        self.in_flight = 0
        self.streams_disconnected = 0


def _label(value) -> str:
    """A Prometheus label value, escaped as its text format requires."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(engine: ServingEngine, http: HTTPStats, model_name: str,
                    shutdown: "Shutdown | None" = None) -> str:
    m = engine.metrics()
    lines = []

    def metric(name, kind, help_, samples):
        lines.append(f"# HELP jaxspec_{name} {help_}")
        lines.append(f"# TYPE jaxspec_{name} {kind}")
        for labels, v in samples:
            lab = ",".join(f'{k}="{_label(val)}"' for k, val in labels.items())
            lines.append(f"jaxspec_{name}{{{lab}}} {float(v):.17g}" if lab else
                         f"jaxspec_{name} {float(v):.17g}")

    metric("http_requests_total", "counter", "HTTP requests by path and status code.",
           [({"path": p, "code": str(c)}, n) for (p, c), n in sorted(http.requests.items())])
    metric("http_requests_in_flight", "gauge", "HTTP requests being served.",
           [({}, http.in_flight)])
    metric("sequences_submitted_total", "counter", "Sequences (completions) queued.",
           [({}, m.get("sequences_submitted", 0))])
    metric("sequences_finished_total", "counter", "Sequences finished, by reason.",
           [({"reason": r}, m.get(f"finished_{r}", 0))
            for r in ("stop", "length", "cancelled", "error")])
    metric("prompt_tokens_total", "counter", "Prompt tokens admitted.",
           [({}, m.get("prompt_tokens", 0))])
    metric("generation_tokens_total", "counter", "Tokens generated.",
           [({}, m.get("generation_tokens", 0))])
    metric("queue_depth", "gauge", "Sequences waiting for a slot.", [({}, m["waiting"])])
    metric("slots_busy", "gauge", "Slots holding a sequence.", [({}, m["slots_busy"])])
    metric("slots_total", "gauge", "Slots (batch rows of the KV cache).", [({}, m["slots_total"])])
    metric("batch_occupancy", "gauge", "Fraction of slot-rounds that decoded a sequence.",
           [({}, m["batch_occupancy"])])
    metric("decode_rounds_total", "counter", "Target forward passes over the batch.",
           [({}, m.get("rounds", 0))])
    metric("decode_chunks_total", "counter", "Jitted chunk calls.", [({}, m.get("chunks", 0))])
    metric("decode_seconds_total", "counter", "Seconds spent in chunk calls.",
           [({}, m.get("chunk_seconds", 0.0))])
    metric("decode_compact_chunks_total", "counter", "Chunks that ran only the busy rows "
           "(compact_rows).", [({}, m.get("compact_chunks", 0))])
    metric("mixed_chunks_total", "counter", "Chunks whose plain rounds also prefilled prompt "
           "pieces (mixed_prefill).", [({}, m.get("mixed_chunks", 0))])
    metric("mixed_prefill_tokens_total", "counter", "Prompt tokens prefilled inside decode "
           "rounds (mixed_prefill).", [({}, m.get("mixed_prefill_tokens", 0))])
    metric("pieces_deferred_total", "counter", "Chunks that left their prompt pieces to the next "
           "chunk because a stream's token budget ended within them.",
           [({}, m.get("pieces_deferred", 0))])
    metric("held_sequences_total", "counter", "Sequences whose prompt was in but which waited "
           "for others' prompts to fill before decoding (fill_first).",
           [({}, m.get("held_sequences", 0))])
    metric("target_steps_total", "counter", "Per-sequence target steps (rounds a sequence "
           "took part in).", [({}, m.get("target_row_steps", 0))])
    metric("draft_tokens_proposed_total", "counter", "Draft tokens proposed.",
           [({}, m.get("draft_proposed", 0))])
    metric("draft_tokens_accepted_total", "counter", "Draft tokens accepted.",
           [({}, m.get("draft_accepted", 0))])
    metric("acceptance_rate", "gauge", "Accepted / proposed draft tokens (since start).",
           [({}, m["acceptance_rate"])])
    P = len(m.get("position_acceptance", ()))
    metric("draft_position_proposed_total", "counter", "Speculative rounds (of one sequence, "
           "completed) that proposed a draft at this position (1: the first draft; a tree's "
           "depth).", [({"position": str(i)}, m[f"position_proposed_{i}"])
                       for i in range(1, P + 1)])
    metric("draft_position_accepted_total", "counter", "Those rounds that accepted the draft at "
           "this position.", [({"position": str(i)}, m[f"position_accepted_{i}"])
                              for i in range(1, P + 1)])
    metric("draft_position_acceptance_rate", "gauge", "Accepted / proposed at each draft "
           "position (since start).",
           [({"position": str(i)}, r) for i, r in enumerate(m.get("position_acceptance", ()), 1)])
    metric("tokens_per_target_step", "gauge", "Generated tokens per per-sequence target step.",
           [({}, m["tokens_per_target_step"])])
    metric("queue_full_rejections_total", "counter", "Requests refused with 503.",
           [({}, m.get("rejected_queue_full", 0))])
    if "kv_blocks_total" in m:  # a paged K/V pool
        for k, help_ in (("total", "Blocks in the paged K/V pool."),
                         ("used", "Blocks referenced by sequences."),
                         ("free", "Blocks that can be allocated (empty or cached and idle)."),
                         ("cached", "Blocks holding a cached prompt prefix.")):
            metric(f"kv_blocks_{k}", "gauge", help_, [({}, m[f"kv_blocks_{k}"])])
        metric("prefix_cache_hit_rate", "gauge", "Prompt tokens found in the prefix cache / "
               "prompt tokens looked up (since start).", [({}, m["prefix_cache_hit_rate"])])
        metric("prefix_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.",
               [({}, m.get("prefix_hit_tokens", 0))])
        metric("prefix_query_tokens_total", "counter", "Prompt tokens looked up in the prefix "
               "cache.", [({}, m.get("prefix_query_tokens", 0))])
        metric("preemptions_total", "counter", "Running sequences preempted for blocks (their "
               "caches recomputed later).", [({}, m.get("preemptions", 0))])
        metric("shared_context_rows", "gauge", "Running sequences whose shared leading blocks "
               "are attended to once for all of them.", [({}, m.get("shared_context_rows", 0))])
        metric("shared_context_tokens", "gauge", "Tokens of that shared context.",
               [({}, m.get("shared_context_tokens", 0))])
        metric("shared_context_copies_total", "counter", "Shared contexts copied out of the "
               "pool (each time the shared blocks change).",
               [({}, m.get("shared_context_copies", 0))])
        metric("shared_context_row_chunks_total", "counter", "Sequences that read the shared "
               "context, summed over decode chunks.",
               [({}, m.get("shared_context_row_chunks", 0))])
    if shutdown is not None:
        metric("draining", "gauge", "1 while the server shuts down (refusing new requests).",
               [({}, float(shutdown.draining))])
        metric("shutdown_cut_off_total", "counter", "Requests ended by the shutdown deadline.",
               [({}, shutdown.cut_off)])
    lines.append(f'# HELP jaxspec_model_info The served model.\n# TYPE jaxspec_model_info gauge\n'
                 f'jaxspec_model_info{{model="{_label(model_name)}",gamma="{engine.gamma}"}} 1')
    return "\n".join(lines) + "\n"


class _CountRequests:
    """ASGI middleware: counts HTTP requests by path and status code."""

    def __init__(self, app, stats: HTTPStats):
        self.app, self.stats = app, stats

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status = {"code": 500}

        async def send2(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        self.stats.in_flight += 1
        try:
            await self.app(scope, receive, send2)
        finally:
            self.stats.in_flight -= 1
            key = (path if path in _KNOWN_PATHS else "other", status["code"])
            self.stats.requests[key] = self.stats.requests.get(key, 0) + 1


_KNOWN_PATHS = {"/", "/health", "/metrics", "/v1/models", "/v1/completions",
                "/v1/chat/completions"}


# ----------------------------------------------------------------------------- hostile clients
def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return v
    return None


async def _send_error(send, e: APIError, *, close: bool = True):
    """An OpenAI-style error response straight from a middleware (``close``: end the connection
    after it, as the request body may be left unread)."""
    body = e.json_bytes()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), str(v).encode("latin-1"))
                for k, v in e.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _timeout_error(seconds: float) -> APIError:
    return APIError(408, f"the request was not received in full within {seconds:g} seconds",
                    code="request_timeout")


# The connection's `_ReadGuard`, seen by the tasks the HTTP protocol starts for its requests
# (asyncio tasks copy the context they are created in).
_GUARD: contextvars.ContextVar = contextvars.ContextVar("jaxspec_read_guard", default=None)


class _ReadGuard:
    """One connection's read deadline. While no request of the connection is being served, a
    timer runs: a connection that sends nothing, or only part of a request's headers, for
    ``timeout`` seconds (counted from its first byte once it sends one) gets a 408 (if it sent
    anything) and is closed. Once the headers are in, `_Gate` reads the body under the same
    deadline. uvicorn itself times out only idle kept-alive connections."""

    def __init__(self, transport, timeout: float):
        self.transport, self.timeout = transport, float(timeout)
        self.loop = asyncio.get_running_loop()
        self.timer = None
        self.serving = 0  # requests of this connection inside the app
        self.received = False  # bytes of a new request arrived since the last arm()
        self.deadline = 0.0
        self.arm()

    def _schedule(self):
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_at(self.deadline, self._expire)

    def arm(self):
        self.received = False
        self.deadline = self.loop.time() + self.timeout
        self._schedule()

    def data(self):
        if not self.received and self.serving == 0:  # a new request starts: its own deadline
            self.received = True
            self.deadline = self.loop.time() + self.timeout
            self._schedule()

    def request_started(self) -> float:
        """The headers are in: stops the timer; returns the deadline for the body."""
        first = self.serving == 0
        self.serving += 1
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        return self.deadline if first else self.loop.time() + self.timeout

    def request_finished(self):
        self.serving -= 1
        if self.serving == 0 and not self.transport.is_closing():
            self.arm()

    def _expire(self):
        self.timer = None
        if self.serving or self.transport.is_closing():
            return
        if self.received:  # part of a request: say why before closing
            body = _timeout_error(self.timeout).json_bytes()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
                + body)
        self.transport.close()

    def close(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def guarded_protocol(read_timeout: float):
    """uvicorn's HTTP protocol class with a `_ReadGuard` on every connection (pass it as
    ``uvicorn.Config(http=...)``)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTPProtocol(AutoHTTPProtocol):
        def connection_made(self, transport):
            self.jaxspec_guard = _ReadGuard(transport, read_timeout)
            super().connection_made(transport)

        def data_received(self, data):
            guard = self.jaxspec_guard
            guard.data()
            token = _GUARD.set(guard)
            try:
                super().data_received(data)
            finally:
                _GUARD.reset(token)

        def connection_lost(self, exc):
            self.jaxspec_guard.close()
            super().connection_lost(exc)

    return GuardedHTTPProtocol


class _Gate:
    """ASGI middleware in front of the routes: the API key, refusal while shutting down, and the
    request body, read here under the size cap and the read deadline and replayed to the app
    (at most ``max_body_bytes`` are ever held)."""

    def __init__(self, app, *, api_key: str | None, public: set[str], limits: ServerLimits,
                 shutdown: "Shutdown"):
        self.app = app
        self.key_digest = None if api_key is None else hashlib.sha256(api_key.encode()).digest()
        self.public = frozenset(public)
        self.limits, self.shutdown = limits, shutdown

    def authorized(self, scope) -> bool:
        if self.key_digest is None or scope.get("path") in self.public:
            return True
        value = _header(scope, b"authorization")
        if value is None:
            return False
        scheme, _, token = value.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        # digests of equal length, compared in constant time: neither the key nor its length
        # leaks through timing
        return hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self.key_digest)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.shutdown.attach()
        guard = _GUARD.get()
        deadline = guard.request_started() if guard is not None else None
        try:
            await self.serve(scope, receive, send, deadline)
        finally:
            if guard is not None:
                guard.request_finished()

    async def serve(self, scope, receive, send, deadline):
        if not self.authorized(scope):
            return await _send_error(send, APIError(
                401, "missing or incorrect API key: send the header 'Authorization: Bearer "
                     "<key>'", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
        if self.shutdown.draining and scope.get("path") != "/metrics":
            return await _send_error(send, APIError(
                503, "the server is shutting down; retry on another server",
                type="unavailable", code="shutting_down"))
        limit = self.limits.max_body_bytes
        cl = _header(scope, b"content-length")
        if cl is not None:
            try:
                declared = int(cl)
            except ValueError:
                return await _send_error(send, _bad("the Content-Length header is not a number",
                                                    None, "invalid_header"))
            if declared > limit:
                return await _send_error(send, APIError(
                    413, f"the request body has {declared} bytes; at most {limit}",
                    code="request_too_large"))
        loop = asyncio.get_running_loop()
        timeout = self.limits.request_read_timeout
        if deadline is None:
            deadline = loop.time() + timeout
        chunks, size = [], 0
        while True:
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(receive(), left)
            except (TimeoutError, asyncio.TimeoutError):
                return await _send_error(send, _timeout_error(timeout))
            if message["type"] == "http.disconnect":
                return  # the client left before sending its request
            part = message.get("body", b"")
            size += len(part)
            if size > limit:
                return await _send_error(send, APIError(
                    413, f"the request body has more than {limit} bytes", code="request_too_large"))
            chunks.append(part)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# ----------------------------------------------------------------------------- shutting down
class _InFlight:
    """One admitted request: its queue and sequences, while a handler serves it."""

    __slots__ = ("queue", "seqs", "started", "closed")

    def __init__(self, queue, seqs):
        self.queue, self.seqs = queue, seqs
        self.started = False  # its handler began reading the queue
        self.closed = False

    def live(self) -> bool:
        return not self.closed and (self.started or not all(s.finished_flag for s in self.seqs))


class Shutdown:
    """Graceful shutdown of one app. `request()` (from a signal handler or any thread; only sets a
    counter, which a task on the server's loop polls) stops admission: every new request but
    ``/metrics`` gets 503. Requests already admitted get ``timeout`` seconds to finish; then each
    is ended (a final error chunk for a stream, 503 otherwise) and its sequences cancelled. A
    second `request()` cuts the wait short. ``on_done`` runs when the drain is over (the HTTP
    server then closes its connections and exits)."""

    POLL = 0.05

    def __init__(self, engine: ServingEngine, timeout: float = 30.0):
        if not (isinstance(timeout, (int, float)) and timeout >= 0 and math.isfinite(timeout)):
            raise ValueError(f"shutdown_timeout must be a finite number >= 0, got {timeout!r}")
        self.engine, self.timeout = engine, float(timeout)
        self.draining = False
        self.requested = 0
        self.cut_off = 0  # requests ended by the deadline
        self.finished_in_time = 0  # requests in flight at the start that finished normally
        self.on_done = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.inflight: set[_InFlight] = set()
        self._watch: asyncio.Task | None = None

    def request(self):
        self.requested += 1

    def attach(self):
        """Starts the watcher on the running loop (the app's lifespan does; idempotent)."""
        if self._watch is None:
            self.loop = asyncio.get_running_loop()
            self._watch = self.loop.create_task(self._run())

    async def close(self):
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None

    def track(self, queue, seqs) -> _InFlight:
        self.inflight = {e for e in self.inflight if e.live()}
        e = _InFlight(queue, seqs)
        self.inflight.add(e)
        return e

    def untrack(self, e: _InFlight):
        e.closed = True
        self.inflight.discard(e)

    def live(self) -> list[_InFlight]:
        return [e for e in self.inflight if e.live()]

    async def _run(self):
        while not self.requested:
            await asyncio.sleep(self.POLL)
        self.draining = True
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        start = self.live()
        log.info("shutting down: refusing new requests; %d in flight get up to %g s",
                 len(start), self.timeout)
        try:
            while self.live() and loop.time() - t0 < self.timeout and self.requested < 2:
                await asyncio.sleep(self.POLL)
            left = self.live()
            self.finished_in_time = len(start) - len([e for e in start if e in left])
            if left:
                log.warning("shutting down: ending %d requests still in flight", len(left))
                self.cut_off += len(left)
                for e in left:
                    e.queue.put_nowait({"type": "shutdown", "tag": None})
                    for s in e.seqs:
                        if not s.finished_flag:
                            self.engine.cancel(s)
                t1 = loop.time()  # their handlers send the error and return
                while self.live() and loop.time() - t1 < 5.0:
                    await asyncio.sleep(self.POLL)
        finally:
            log.info("shutting down: drained after %.1f s", loop.time() - t0)
            if self.on_done is not None:
                self.on_done()


def _shutdown_error(timeout: float) -> APIError:
    return APIError(503, f"the server shut down before this request finished (it gives running "
                         f"requests {timeout:g} seconds)", type="unavailable",
                    code="shutting_down")


# ----------------------------------------------------------------------------- the app
def create_app(engine: ServingEngine, model_name: str = "jaxspec", *, api_key: str | None = None,
               limits: ServerLimits | None = None, metrics_public: bool = False,
               page_public: bool = False, shutdown_timeout: float = 30.0):
    """The FastAPI app over a started `ServingEngine`.

    api_key: None (no authentication) or the key every request but ``/health`` must send as
        ``Authorization: Bearer KEY``; ``metrics_public`` / ``page_public`` exempt ``/metrics``
        and the demo page ``/``.
    limits: a `ServerLimits` (default: its defaults).
    shutdown_timeout: seconds running requests get once a shutdown starts (``app.state.shutdown``,
        a `Shutdown`; `serve` wires SIGTERM / SIGINT to it).
    """
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from fastapi.responses import Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ValueError("api_key must be a non-empty string, or None for no authentication")
    limits = limits or ServerLimits()
    if not isinstance(limits, ServerLimits):
        raise TypeError(f"limits must be a ServerLimits, got {type(limits).__name__}")
    shutdown = Shutdown(engine, shutdown_timeout)
    pool: dict[str, concurrent.futures.ThreadPoolExecutor] = {}

    def tokenizer_pool():
        # one thread: tokenizing a long prompt does not stall the event loop, and the tokenizer
        # is never called from two request threads at once
        if "p" not in pool:
            pool["p"] = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="jaxspec-tokenize")
        return pool["p"]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        shutdown.attach()
        try:
            yield
        finally:
            await shutdown.close()
            if "p" in pool:
                pool.pop("p").shutdown(wait=False)

    app = FastAPI(title="jaxspec", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    http = HTTPStats()
    app.state.http_stats = http
    app.state.engine = engine
    app.state.limits = limits
    app.state.shutdown = shutdown

    def error_response(e: APIError):
        return Response(e.json_bytes(), status_code=e.status, headers=e.headers,
                        media_type="application/json")

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e):
        return error_response(_bad(f"invalid request: {e.errors()[:3]}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, str(e.detail), type=kind,
                                       headers=dict(getattr(e, "headers", None) or {})))

    @app.exception_handler(Exception)
    async def _internal(request, e):
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                       type="internal_error"))

    async def read_json(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError as e:  # not JSON, not UTF-8/16/32, or an integer past Python's digits
            raise _bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
        except RecursionError:
            raise _bad("the request body is nested too deeply", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", None, "invalid_json")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("'model' must be a string", "model", "invalid_type")
        if model not in (None, model_name):
            raise APIError(404, f"the model {_preview(model)} does not exist; this server serves "
                                f"'{model_name}'", type="not_found_error", param="model",
                           code="model_not_found")
        return body

    @app.get("/", response_class=HTMLResponse)
    async def index():
        page = resources.files("jaxspec").joinpath("static/index.html").read_text("utf-8")
        return HTMLResponse(page.replace("{{MODEL}}", html.escape(model_name))
                            .replace("{{MODE}}", html.escape(engine.describe())))

    @app.get("/health")
    async def health():
        if not engine.alive:
            raise APIError(503, "the engine is not running", type="unavailable")
        m = engine.metrics()
        return {"status": "ok", "model": model_name, "slots_busy": m["slots_busy"],
                "slots_total": m["slots_total"], "queue_depth": m["waiting"]}

    def model_card():
        return {"id": model_name, "object": "model", "created": int(engine.started_at),
                "owned_by": "jaxspec", "max_model_len": engine.max_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != model_name:
            raise APIError(404, f"the model {_preview(model)} does not exist; this server "
                                f"serves '{model_name}'", type="not_found_error",
                           param="model", code="model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine, http, model_name, shutdown),
                                 media_type="text/plain; version=0.0.4")

    def too_many_tokens(total, detail, param="max_tokens"):
        return _bad(f"this request asks for up to {total} completion tokens ({detail}); this "
                    f"server allows at most {limits.max_generation_tokens} per request",
                    param, "invalid_value")

    async def handle(request: Request, chat: bool):
        body = await read_json(request)
        stream = _opt(body, "stream", "bool", False)
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
        if so is not None and not stream:  # (as OpenAI's API answers it)
            raise _bad("'stream_options' is only allowed with 'stream': true", "stream_options",
                       "invalid_value")
        include_usage = bool(so and _opt(so, "include_usage", "bool", False,
                                         where="stream_options.include_usage"))
        return_ids = _opt(body, "return_token_ids", "bool", False)
        opts, n = _options(body, engine, limits, chat=chat)
        what = _chat_messages(body, limits) if chat else _completion_items(body, limits)
        k = 1 if chat else len(what)
        # the field the client sent (chat: max_completion_tokens wins over max_tokens)
        mt = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
            else "max_tokens"
        if opts.max_tokens is not None and k * n * opts.max_tokens > limits.max_generation_tokens:
            raise too_many_tokens(k * n * opts.max_tokens,
                                  f"{k} prompts x n={n} x {mt}={opts.max_tokens}", mt)
        max_queue = getattr(engine, "max_queue", None)
        if max_queue is not None and k * n > max_queue:
            raise _bad(f"this request makes {k * n} sequences ({k} prompts x n={n}); this "
                       f"server queues at most {max_queue}", "n", "invalid_value")
        loop = asyncio.get_running_loop()
        if chat:
            prompts = [await loop.run_in_executor(tokenizer_pool(), _encode_chat, what, engine)]
        else:
            prompts = await loop.run_in_executor(tokenizer_pool(), _encode_completion, what,
                                                 engine)
        param = "messages" if chat else "prompt"
        try:
            budget = n * sum(engine.check(len(ids), opts.max_tokens) for ids in prompts)
        except PromptTooLong as e:
            raise _bad(str(e).replace("max_tokens", mt), param,
                       "context_length_exceeded") from None
        if budget > limits.max_generation_tokens:
            raise too_many_tokens(budget, f"{k} prompts x n={n}, each up to the room its prompt "
                                          f"leaves in the context")
        queue: asyncio.Queue = asyncio.Queue()
        seqs = [Sequence(ids, opts, index=j, loop=loop, queue=queue, tag=i * n + j)
                for i, ids in enumerate(prompts) for j in range(n)]
        if not chat and engine.tokenizer is not None:
            # a completion continues its prompt's text: its first token is decoded after the
            # prompt's last ones, so that SentencePiece's leading space is kept (as in vLLM)
            for s in seqs:
                tail = s.prompt_ids[-4:]
                if not engine._decode(tail).endswith("\ufffd"):  # (not inside a character)
                    s.text_context = tail
        try:
            engine.submit(seqs)
        except PromptTooLong as e:
            raise _bad(str(e), param, "context_length_exceeded") from None
        except QueueFull as e:
            raise APIError(503, str(e), type="overloaded", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except EngineStopped as e:
            raise APIError(503, str(e), type="unavailable") from None
        entry = shutdown.track(queue, seqs)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        # (OpenAI's responses and chunks always carry system_fingerprint, null where unknown;
        # vLLM sends null too)
        base = {"id": rid, "created": created, "model": model_name, "system_fingerprint": None}
        if stream:
            return StreamingResponse(
                _stream(engine, shutdown, entry, base, chat, include_usage, return_ids),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _collect(engine, shutdown, entry, request, base, chat, return_ids,
                              JSONResponse)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    public = {"/health"} | ({"/metrics"} if metrics_public else set()) | \
        ({"/"} if page_public else set())
    app.add_middleware(_Gate, api_key=api_key, public=public, limits=limits, shutdown=shutdown)
    app.add_middleware(_CountRequests, stats=http)
    return app


def _prompt_tokens(seqs) -> int:
    """Prompt tokens, counted once per prompt (the n samples of a prompt share it)."""
    return sum(len(s.prompt_ids) for s in seqs if s.index == 0)


def _cached_tokens(seqs) -> int:
    """Prompt tokens found in the prefix cache (paged servers), once per prompt as above."""
    return sum(s.cached_tokens for s in seqs if s.index == 0)


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def _collect(engine, shutdown, entry, request, base, chat, return_ids, JSONResponse):
    seqs, queue = entry.seqs, entry.queue
    entry.started = True
    texts = {s.tag: [] for s in seqs}
    finished: dict[int, dict] = {}
    gone = False
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_CHECK_SECONDS
    try:
        while len(finished) < len(seqs):
            try:
                ev = await asyncio.wait_for(queue.get(),
                                            timeout=max(0.01, check_at - loop.time()))
            except asyncio.TimeoutError:
                ev = None
            # on a clock, not only when no token came: tokens flow while it decodes, and a
            # client that hung up must not keep its rows decoding up to max_tokens
            if loop.time() >= check_at:
                check_at = loop.time() + DISCONNECT_CHECK_SECONDS
                if await request.is_disconnected():  # the client hung up: not a server error
                    gone = True
                    break
            if ev is None:
                continue
            if ev["type"] == "delta":
                texts[ev["tag"]].append(ev["text"])
            elif ev["type"] == "error":
                raise APIError(500, f"generation failed: {ev['message']}", type="internal_error")
            elif ev["type"] == "shutdown":
                raise _shutdown_error(shutdown.timeout)
            else:
                finished[ev["tag"]] = ev
    finally:
        for s in seqs:
            if not s.finished_flag:
                engine.cancel(s)
        shutdown.untrack(entry)
    if gone:  # nobody reads this; 499 (nginx's "client closed request") for the logs
        return JSONResponse({"error": {"message": "the client closed the request",
                                       "type": "client_closed_request", "param": None,
                                       "code": None}}, status_code=499)
    choices = []
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for s in sorted(seqs, key=lambda s: s.tag):
        ev = finished[s.tag]
        text = "".join(texts[s.tag])
        reason = ev["finish_reason"]
        c: dict[str, Any] = {"index": s.tag, "finish_reason": reason, "logprobs": None}
        if chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        c["jaxspec"] = ev["stats"]
        if return_ids:
            c["token_ids"] = ev["token_ids"]
        choices.append(c)
        usage["completion_tokens"] += ev["usage"]["completion_tokens"]
    usage["prompt_tokens"] = _prompt_tokens(seqs)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    usage["prompt_tokens_details"] = {"cached_tokens": _cached_tokens(seqs)}
    obj = {**base, "object": "chat.completion" if chat else "text_completion",
           "choices": choices, "usage": usage}
    return JSONResponse(obj)


async def _stream(engine, shutdown, entry, base, chat, include_usage, return_ids):
    seqs, queue = entry.seqs, entry.queue
    entry.started = True
    obj_name = "chat.completion.chunk" if chat else "text_completion"
    n_done = 0
    failed = False
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}

    def chunk(choice):
        # (with include_usage, OpenAI's other chunks carry "usage": null)
        return _sse({**base, "object": obj_name, "choices": [choice],
                     **({"usage": None} if include_usage else {})})

    try:
        if chat:  # the role first, as OpenAI does
            for s in seqs:
                yield chunk({"index": s.tag, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
        while n_done < len(seqs):
            ev = await queue.get()
            tag = ev["tag"]
            if ev["type"] == "delta":
                ext = {k: ev[k] for k in ("segments", "n_tokens", "accepted", "proposed",
                                          "rounds")}
                if chat:
                    c = {"index": tag, "delta": {"content": ev["text"]}, "logprobs": None,
                         "finish_reason": None}
                else:
                    c = {"index": tag, "text": ev["text"], "logprobs": None,
                         "finish_reason": None}
                c["jaxspec"] = ext
                yield chunk(c)
            elif ev["type"] == "error":
                yield _sse({"error": {"message": f"generation failed: {ev['message']}",
                                      "type": "internal_error", "param": None, "code": None}})
                failed = True
                break
            elif ev["type"] == "shutdown":
                yield _sse(_shutdown_error(shutdown.timeout).body())
                failed = True
                break
            else:
                n_done += 1
                if chat:
                    c = {"index": tag, "delta": {}, "logprobs": None,
                         "finish_reason": ev["finish_reason"]}
                else:
                    c = {"index": tag, "text": "", "logprobs": None,
                         "finish_reason": ev["finish_reason"]}
                c["jaxspec"] = ev["stats"]
                if return_ids:
                    c["token_ids"] = ev["token_ids"]
                yield chunk(c)
                usage["completion_tokens"] += ev["usage"]["completion_tokens"]
        if include_usage and not failed:
            usage["prompt_tokens"] = _prompt_tokens(seqs)
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            usage["prompt_tokens_details"] = {"cached_tokens": _cached_tokens(seqs)}
            yield _sse({**base, "object": obj_name, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"
    finally:  # also on client disconnect (the generator is cancelled/closed)
        for s in seqs:
            if not s.finished_flag:
                engine.cancel(s)
        shutdown.untrack(entry)


# ----------------------------------------------------------------------------- running it
def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {s!r}")
    return v


def _seconds(s: str, *, zero_ok=False) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {s!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds {'>= 0' if zero_ok else '> 0'}, got {s!r}")
    return v


def _api_key_arg(s: str) -> str:
    if not s or s != s.strip():
        raise argparse.ArgumentTypeError("must be a non-empty key without surrounding spaces")
    return s


def resolve_api_key(flag: str | None, env=None) -> str | None:
    """``--api-key`` if given, else ``$JAXSPEC_API_KEY`` (unset or empty: no authentication)."""
    if flag is not None:
        return flag
    value = (os.environ if env is None else env).get(API_KEY_ENV, "")
    if value and value != value.strip():
        raise ValueError(f"${API_KEY_ENV}: the key must not start or end with spaces")
    return value or None


def add_arguments(p: argparse.ArgumentParser):
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint folder (the same as --model)")
    p.add_argument("--model", default=None,
                   help="checkpoint folder (default: fetch and serve smollm2-135m-instruct)")
    p.add_argument("--checkpoints", default="checkpoints", help="where --model=None fetches to")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--draft", default=None, help="'self' or a draft checkpoint path (speculation)")
    p.add_argument("--gamma", type=parse_gamma, default=Speculation.gamma, help="drafts per round, or 'auto'")
    p.add_argument("--sink", type=int, default=Speculation.sink)
    p.add_argument("--window", type=window_arg, default=Speculation.window,
                   help="draft window (StreamingLLM; default %(default)s); 'none': a draft model "
                        "with a full cache")
    p.add_argument("--retrieve", type=retrieve_arg, default=Speculation.retrieve,
                   help="--draft self: context slots per draft step read in retrieved blocks "
                        "chosen by the verification's attention, or 'auto' (default: half "
                        "of --window; none for a sliding-window model); 0: the window alone")
    p.add_argument("--tree", default=None, help="token-tree expansion config, e.g. 1,1,3,1")
    p.add_argument("--tp", type=positive_int, default=None,
                   help="tensor-parallel devices (model axis; default: all the --dp leaves)")
    p.add_argument("--dp", type=positive_int, default=None,
                   help="data-parallel groups: the slots are split over them (--max-batch must "
                        "be a multiple)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="slots (concurrent sequences); default 64 on GPU/TPU, 4 on CPU")
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens per sequence (prompt + completion), capped by the model's "
                        "context; default 8192 on GPU/TPU, 1024 on CPU")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="waiting sequences before 503 with Retry-After (default: %(default)s)")
    p.add_argument("--rounds-per-chunk", type=int, default=8)
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill forward (default: 2048 with --page-size on "
                        "GPU/TPU, else 512)")
    p.add_argument("--warmup-prefill", type=int, default=1024,
                   help="compile prefill for prompts up to this many tokens at start-up")
    p.add_argument("--page-size", type=int, default=None,
                   help="paged K/V cache (experimental): blocks of this many slots shared by all "
                        "slots, with automatic prefix caching, chunked prefill and preemption; "
                        "default: one dense cache row of --max-len slots per slot")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="blocks in the paged pool (default: what the dense cache would hold)")
    p.add_argument("--prefill-budget", type=int, default=None,
                   help="paged: prompt tokens prefilled between two decode chunks "
                        "(default, at the measured prefill rate: half a second's worth while "
                        "fewer requests decode than wait for their prefill, then as many as "
                        "take half a decode chunk's time; at least 2048 tokens, whole "
                        "--prefill-chunk chunks)")
    p.add_argument("--mixed-prefill", type=int, default=None,
                   help="paged: while some requests decode and others wait for their prefill, "
                        "the first rounds of a decode chunk (as many as add at most 0.4 of its "
                        "time) also prefill this many prompt tokens each in the same forward "
                        "(running streams keep going; smaller: less added per round, slower "
                        "prefill); 0: off, whole prefill steps between decode "
                        "chunks (default: --prefill-chunk with --page-size, unless "
                        "--prefill-budget is given)")
    p.add_argument("--mixed-stretch", type=int, default=None,
                   help="paged, with mixed prefill: a decode chunk whose one prompt piece adds "
                        "more than 0.4 of its time (a piece at a long offset) runs up to this "
                        "many times --rounds-per-chunk rounds to keep that share (more: running "
                        "streams keep their inter-token latency for longer prompts, whose first "
                        f"token comes later; 1: never; default {MIXED_STRETCH})")
    p.add_argument("--fill-first", type=nonneg_float, default=None,
                   help="paged: while no request decodes, a request whose prompt is in waits "
                        "(at most this many seconds) for the others being prefilled or queued "
                        "for a free slot, and they "
                        "start together: a burst of prompts fills at the full prefill rate and "
                        "no stream is slowed by another's prefill, at the cost of the early "
                        "prompts' time to first token (default: %s with --page-size); 0: off"
                        % FILL_FIRST_SECONDS)
    p.add_argument("--growth-reserve", type=nonneg_int, default=GROWTH_RESERVE_TOKENS,
                   help="paged: a request is admitted only if the pool keeps room for it and "
                        "every running request to grow by this many more tokens of their "
                        "max_tokens (and two decode chunks), so that requests are not preempted "
                        "later (default: %(default)s; 0: the two chunks only)")
    p.add_argument("--share-min-tokens", type=int_or_none_arg, default=SHARE_MIN_TOKENS,
                   help="paged: running requests that begin with the same cached blocks (one "
                        "document, a long system prompt) attend to them once, together, when "
                        "that saves at least this many key reads per step ((requests - 1) x "
                        "shared tokens; default: %(default)s); 'none': never")
    p.add_argument("--compact-rows", choices=("auto", "on", "off"), default="auto",
                   help="while at most half the slots decode, chunks run only their rows (a "
                        "smaller batch, compiled in the background); auto (default): on a CPU, "
                        "where a step costs more with more rows, and with --page-size on a GPU "
                        "(the rows move without their K/V)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant numerics: a request's tokens (greedy, or sampled with a "
                        "seed) do not depend on the other requests in the batch, the slots or the "
                        "prefill chunking, greedy ones not on the speculation either (bitwise, "
                        "bf16 too; see README); not with --tp/--dp")
    p.add_argument("--shared-rng", action="store_true",
                   help="one PRNG key for the whole batch (no per-request seeds; no vmap)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s; another address without "
                        "--api-key serves anyone who can reach it)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")

    g = p.add_argument_group(
        "authentication", f"With a key (--api-key or ${API_KEY_ENV}), every request must send "
        "'Authorization: Bearer KEY'; others get 401. /health never needs it.")
    g.add_argument("--api-key", type=_api_key_arg, default=None, metavar="KEY",
                   help=f"the API key (default: ${API_KEY_ENV}; unset: no authentication)")
    g.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key (e.g. to a Prometheus scraper)")
    g.add_argument("--page-public", action="store_true",
                   help="serve the demo page / without the API key (the page asks for the key "
                        "to send with its requests)")

    d = ServerLimits()
    g = p.add_argument_group(
        "limits", "What one client may ask for. Past a limit the request gets an OpenAI-style "
        "error (400, or 408 / 413 as noted) and the server carries on.")
    g.add_argument("--max-body-bytes", type=_positive_int, default=d.max_body_bytes,
                   metavar="BYTES",
                   help="request body size; larger bodies get 413 (a larger Content-Length "
                        "before a byte is read, a chunked body once it passes the limit) "
                        "(default: %(default)s)")
    g.add_argument("--request-read-timeout", type=_seconds, default=d.request_read_timeout,
                   metavar="SECONDS",
                   help="seconds a client has to send a whole request, headers and body, from "
                        "its first byte; then 408 and the connection is closed, so slow senders "
                        "hold nothing for long (default: %(default)s)")
    g.add_argument("--keep-alive-timeout", type=_seconds, default=d.keep_alive_timeout,
                   metavar="SECONDS",
                   help="seconds an idle kept-alive connection stays open (default: "
                        "%(default)s)")
    g.add_argument("--max-generation-tokens", type=_positive_int,
                   default=d.max_generation_tokens, metavar="N",
                   help="completion tokens one request may ask for: prompts x n x max_tokens (a "
                        "chat request without max_tokens counts the room its prompt leaves) "
                        "(default: %(default)s)")
    g.add_argument("--max-prompts", type=_positive_int, default=d.max_prompts, metavar="N",
                   help="prompts in one /v1/completions request (default: %(default)s)")
    g.add_argument("--max-messages", type=_positive_int, default=d.max_messages, metavar="N",
                   help="messages in one /v1/chat/completions request (default: %(default)s)")
    g.add_argument("--max-stop", type=_positive_int, default=d.max_stop, metavar="N",
                   help="stop strings per request (default: %(default)s)")
    g.add_argument("--max-stop-chars", type=_positive_int, default=d.max_stop_chars, metavar="N",
                   help="characters of one stop string (default: %(default)s)")
    g.add_argument("--shutdown-timeout", type=lambda s: _seconds(s, zero_ok=True), default=30.0,
                   metavar="SECONDS",
                   help="on SIGTERM / Ctrl-C: new requests get 503, running ones get this many "
                        "seconds to finish, then end with an error (streams: a final error "
                        "chunk); a second signal ends them at once (default: %(default)s)")
    return p


def build_engine(a) -> tuple[ServingEngine, str]:
    import pathlib

    import jaxspec
    merge_model_path(a)
    path = a.model
    if path is None:
        from jaxspec.fetch import fetch
        path = fetch("smollm2-135m-instruct", a.checkpoints)
    mesh = getattr(a, "mesh", None)
    if mesh is None and (getattr(a, "tp", None) or getattr(a, "dp", None)):
        mesh = mesh_from_args(a)
    model = jaxspec.load(path, dtype=a.dtype, mesh=mesh)
    spec = None
    if a.draft is not None:
        draft = a.draft if a.draft == "self" else jaxspec.load(a.draft, dtype=a.dtype, mesh=mesh)
        spec = jaxspec.Speculation(draft=draft, gamma=a.gamma, sink=a.sink,
                                   window=a.window, retrieve=a.retrieve,
                                   tree=parse_tree(a.tree))
    import jax
    cpu = jax.default_backend() == "cpu"
    max_batch = a.max_batch or (4 if cpu else 64)
    if mesh is not None:  # whole groups of slots per data shard
        d = int(mesh.shape["data"])
        max_batch = max_batch if a.max_batch else -(-max_batch // d) * d
    max_len = a.max_len or (1024 if cpu else 8192)
    engine = ServingEngine(model, max_batch=max_batch, max_len=max_len, speculation=spec,
                           rounds_per_chunk=a.rounds_per_chunk, max_queue=a.max_queue,
                           prefill_chunk=a.prefill_chunk, per_row=not a.shared_rng,
                           warmup_prefill=a.warmup_prefill,
                           page_size=getattr(a, "page_size", None),
                           kv_blocks=getattr(a, "kv_blocks", None),
                           prefill_budget=getattr(a, "prefill_budget", None),
                           mixed_prefill=getattr(a, "mixed_prefill", None),
                           mixed_stretch=getattr(a, "mixed_stretch", None),
                           fill_first=getattr(a, "fill_first", None),
                           growth_reserve=getattr(a, "growth_reserve", GROWTH_RESERVE_TOKENS),
                           share_min_tokens=getattr(a, "share_min_tokens", SHARE_MIN_TOKENS),
                           compact_rows={"auto": None, "on": True, "off": False}[
                               getattr(a, "compact_rows", "auto")],
                           batch_invariant=getattr(a, "batch_invariant", False))
    name = a.served_model_name or pathlib.Path(path).name
    return engine, name


def uvicorn_config(app, *, limits: ServerLimits, log_level: str = "info",
                   timeout_graceful_shutdown: float = 5.0, **kw):
    """uvicorn's Config for an app of `create_app`: the read guard on every connection, the
    keep-alive timeout of ``limits``, the app's lifespan (its shutdown watcher) on."""
    import uvicorn
    opts = dict(log_level=log_level, http=guarded_protocol(limits.request_read_timeout),
                timeout_keep_alive=limits.keep_alive_timeout, lifespan="on",
                timeout_graceful_shutdown=timeout_graceful_shutdown)
    if "reset_contextvars" in inspect.signature(uvicorn.Config).parameters:
        opts["reset_contextvars"] = False  # the read guard travels in a context variable
    opts.update(kw)
    return uvicorn.Config(app, **opts)


def uvicorn_server(config, shutdown: Shutdown):
    """A uvicorn Server whose SIGTERM / SIGINT start ``shutdown`` (the app's graceful drain)
    instead of closing connections at once; it exits when the drain is over."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            shutdown.request()

    server = _Server(config)
    shutdown.on_done = lambda: setattr(server, "should_exit", True)
    return server


class BackgroundServer:
    """uvicorn serving `create_app(engine, name, **app_options)` from a daemon thread on a socket
    bound before it starts (``port=0``: a free port), for benchmarks and tests. The engine must be
    started; ``close()`` stops the HTTP server at once, ``shutdown()`` drains it as SIGTERM does;
    neither stops the engine (the caller owns it)."""

    def __init__(self, engine: ServingEngine, name: str = "jaxspec", host: str = "127.0.0.1",
                 port: int = 0, log_level: str = "warning", start_timeout: float = 30.0,
                 **app_options):
        import socket
        import threading
        self.app = create_app(engine, name, **app_options)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        cfg = uvicorn_config(self.app, limits=self.app.state.limits, log_level=log_level,
                             access_log=False, timeout_graceful_shutdown=2, backlog=4096)
        self.server = uvicorn_server(cfg, self.app.state.shutdown)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="jaxspec-http", daemon=True)
        self.thread.start()
        deadline = time.time() + start_timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.time() > deadline:
                self.close()
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)

    def shutdown(self, wait: float | None = None) -> bool:
        """Starts the graceful shutdown (as SIGTERM does); with ``wait``, waits up to that many
        seconds for the server to exit and says whether it did."""
        self.app.state.shutdown.request()
        if wait is None:
            return False
        self.thread.join(timeout=wait)
        if not self.thread.is_alive():
            self.sock.close()
        return not self.thread.is_alive()

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def _listen_socket(host: str, port: int, backlog: int = 2048):
    """The server's socket, bound and listening before the model loads: a port in use fails at
    once, not after minutes of loading and compiling. The address family is uvicorn's own
    choice (IPv6 for an address with a ':', else IPv4), so that ``--host localhost`` binds
    127.0.0.1 as it did, whatever getaddrinfo lists first (``::1`` where /etc/hosts maps
    ``localhost`` to it). It listens at once: with SO_REUSEADDR, Linux lets a second socket
    bind a port that no socket listens on yet, so a server still loading would not hold its
    port (connections made during the load wait in the backlog until the app serves)."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise OSError(f"--host {host}: cannot open a socket for it: {e.strerror}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise OSError(f"--host {host} --port {port}: cannot listen there: "
                      f"{e.strerror or e}") from None
    return sock


def run_from_args(a):
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    api_key = resolve_api_key(a.api_key)
    limits = ServerLimits.from_args(a)
    sock = _listen_socket(a.host, a.port)
    engine = None
    try:
        engine, name = build_engine(a)
        log.info("compiling (warm-up) ...")
        engine.start()
        app = create_app(engine, name, api_key=api_key, limits=limits,
                         metrics_public=a.metrics_public, page_public=a.page_public,
                         shutdown_timeout=a.shutdown_timeout)
        if api_key is None and a.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("serving on %s without an API key: anyone who can reach it can use it "
                        "(--api-key or $%s)", a.host, API_KEY_ENV)
        shown = f"[{a.host}]" if ":" in a.host else a.host  # (an IPv6 address in a URL)
        log.info("serving %s on http://%s:%d (slots=%d, max_len=%d, gamma=%d, auth=%s)", name,
                 shown, sock.getsockname()[1], engine.B, engine.max_len, engine.gamma,
                 "on" if api_key else "off")
        server = uvicorn_server(uvicorn_config(app, limits=limits, host=a.host, port=a.port,
                                               log_level=a.log_level), app.state.shutdown)
        server.run(sockets=[sock])
    finally:  # (also when the load or the warm-up fails: the port is given back at once)
        if engine is not None:
            engine.stop()
        sock.close()


def main(argv=None):
    p = add_arguments(argparse.ArgumentParser(prog="jaxspec serve", description=__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    main()
