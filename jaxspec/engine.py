"""`jaxspec.generate`: a list of prompts in, their completions out.

Everything is set up by `jaxspec.session.Decoder` (the same layer the server uses): the prompts and
settings are validated on the host first (so bad input never reaches the compiler), all prompts of
the batch are prefilled in chunks (ragged lengths, right-padded: keys sit at their original
positions), and decoding runs in jitted loops in which every sequence advances, stops on its own
stop token or budget, and finished rows stop changing. With speculation, stretches of speculative
rounds alternate with plain steps as the cost model decides (`jaxspec.costs`).

The decoder (its compiled loops and what its cost model has measured) is kept with the model, so
later calls with the same settings pay neither compilation nor measurement again.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxspec import compile_cache
from jaxspec.model import Model
from jaxspec.prefill import DEFAULT_PREFILL_CHUNK
from jaxspec.session import (Decoder, GenerationResult, check_attn_impl,  # noqa: F401
                             check_prefill_chunk, stop_token_ids)
from jaxspec.speculation import Speculation, validate


def _tree_key(tree):
    if tree is None:
        return None
    if hasattr(tree, "parents"):
        return ("parents", tuple(int(p) for p in tree.parents))
    if isinstance(tree, (list, tuple)):
        return tuple(int(x) for x in tree)
    return str(tree)


def _weights(model: Model | None) -> tuple:
    """The arrays of a model's weights as they are now (a decoder keeps a copy of them in its
    own layout and dtype: it serves the model only while these are the same arrays)."""
    return () if model is None else tuple(jax.tree_util.tree_leaves(model.params))


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def decoder_for(model: Model, speculation: Speculation | None = None, *,
                attn_impl: str = "auto", prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                batch_invariant: bool = False) -> Decoder:
    """The `Decoder` of ``model`` for these settings, made on first use and kept with the model
    (``model.decoders``), so compiled loops and measured costs carry over between calls. A kept
    decoder serves only while the model's (and the draft's) weights are the arrays it was made
    from: after ``model.params`` (or one of its arrays) is replaced, a new one is made."""
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {batch_invariant!r}")
    if not isinstance(model, Model):
        raise TypeError(f"model must be a jaxspec.Model (from jaxspec.load), got {type(model).__name__}")
    check_attn_impl(attn_impl)
    check_prefill_chunk(prefill_chunk)
    spec_key = None
    draft = None
    if speculation is not None:
        if not isinstance(speculation, Speculation):
            raise TypeError(f"speculation must be a jaxspec.Speculation, "
                            f"got {type(speculation).__name__}")
        s = speculation
        tree = validate(s, model)  # every setting checked (and a tree file read) first
        draft = None if s.is_self else s.draft
        spec_key = ("self" if s.is_self else id(s.draft), _tree_key(tree),
                    *((f.name, getattr(s, f.name)) for f in dataclasses.fields(s)
                      if f.name not in ("draft", "tree")))
    key = (spec_key, attn_impl, int(prefill_chunk), batch_invariant)
    weights = (_weights(model), _weights(draft))
    hit = model.decoders.get(key)
    if hit is not None and (draft is None or hit.speculation.draft is draft) and all(
            _same(a, b) for a, b in zip(hit.source_weights, weights)):
        return hit
    compile_cache.enable()  # compiled loops outlive the process (JAXSPEC_COMPILE_CACHE=0: off)
    model.decoders.pop(key, None)  # a stale one's copy of the weights goes first
    dec = Decoder(model, speculation, attn_impl=attn_impl, prefill_chunk=prefill_chunk,
                  batch_invariant=batch_invariant)
    # (the decoder may have laid the model's weights out anew: `jaxspec.sharding.decode_params`)
    dec.source_weights = (_weights(model), _weights(draft))
    model.decoders[key] = dec
    return dec


def generate(model: Model, prompts, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | list[int] = 0, stop_tokens=None,
             speculation: Speculation | None = None, chat: bool = False,
             max_len: int | None = None, attn_impl: str = "auto",
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, shared_prefix=None, n: int = 1,
             ignore_eos: bool = False, batch_invariant: bool = False,
             progress=None) -> GenerationResult:
    """Generates up to ``max_new_tokens`` new tokens for each prompt.

    ``prompts``: a list of strings (needs a tokenizer; ``chat=True`` applies the chat template)
    or of token-id lists, of any lengths. ``temperature=0`` is greedy. Each row samples with its
    own key: ``seed`` an int gives row i the key ``fold_in(PRNGKey(seed), i)`` (its row index);
    ``seed`` a list of ints, one per prompt, gives prompt i's j-th sample the key
    ``fold_in(PRNGKey(seed[i]), j)``, so a prompt's keys are its own wherever it sits in the
    batch (and ``seed=[s]`` for one prompt is ``seed=s``). ``stop_tokens``: extra stop token ids (or
    single-token strings) besides the model's EOS; ``ignore_eos=True`` does not stop at the EOS
    (fixed-length runs, e.g. benchmarks). ``speculation``: a `jaxspec.Speculation` for
    speculative decoding (lossless: same tokens as greedy, same distribution when sampling; in
    bfloat16 the rounding of a step depends on its shapes, so tokens may part where two logits
    are within rounding of each other: exact equality holds in float32, or with
    ``batch_invariant=True``).

    ``n``: samples per prompt (results are prompt-major: prompt i's samples at ``i*n .. i*n+n-1``).
    ``shared_prefix`` (Hydragen, `jaxspec.prefix`): ``"auto"`` shares the longest prefix common
    to all prompts once it is long enough, an int shares that many leading tokens, a list of
    token ids shares exactly those (at most the shortest prompt's length - 1: each prompt keeps
    its last token outside the prefix); with ``n > 1`` each prompt is also shared by its samples.
    The prefix is prefilled once and attended to once per group; tokens are the same as without
    sharing (greedy) and the distribution is the same (sampling). A model with a sliding attention
    window shares nothing (``"auto"`` and ``n`` then just repeat rows; an explicit prefix raises).

    ``batch_invariant=True`` (`jaxspec.invariant`): every matrix product, norm and attention
    reduction runs in one fixed order per token, so a prompt's greedy tokens are bitwise the
    same whatever the other prompts of the batch are, the batch size and padding, the cache
    capacity, ``prefill_chunk``, and with or without speculation (self-draft, draft model or
    tree: a verification computes each token's logits exactly as a one-token step would), in
    bfloat16 too. Sampling too (temperature > 0, top-k, top-p), with a per-prompt ``seed``
    list: the softmax, top-p's cumulative mass, the inverse CDF of a draw and speculative
    sampling's accept / residual sums run in fixed orders, and each draw's key is the row's key
    folded with the token's position (not split round by round), so a prompt's sampled tokens
    are bitwise the same in any batch, padding, cache capacity and chunking. With speculation a
    sampled run equals the same speculation's run (speculative sampling keeps the target's
    distribution, not plain sampling's tokens), and only where the rounds a row runs do not
    depend on the batch: ``adaptive=False`` and an int ``gamma`` (or a tree); adaptive plain
    stretches and ``gamma="auto"`` are chosen from the whole batch. It keeps the model's dtype
    on the CPU (no float32 copy) and decodes a ``shared_prefix`` unshared (same tokens, no
    saving). Not for sharded models (NotImplementedError).

    ``progress``: ``True`` for a progress bar on stderr, or a callable ``(tokens so far, total
    budget)`` called between stretches of decoding.

    ``stats``: ``new_tokens``, ``seconds`` (end to end), ``prefill_seconds``, ``compile_seconds``
    (compiling loops this call needed: zero on later calls with the same shapes),
    ``decode_seconds`` (decoding only), ``tokens_per_second`` (new tokens / decode seconds),
    ``target_steps``; with speculation ``gamma``, ``acceptance_rate``, ``tokens_per_step`` and
    ``plain_steps``, and with self-speculation ``draft_view`` (the sink, window and retrieved
    slots each draft step reads: what ``retrieve="auto"`` resolved to).
    """
    dec = decoder_for(model, speculation, attn_impl=attn_impl, prefill_chunk=prefill_chunk,
                      batch_invariant=batch_invariant)
    batch = dec.prepare(prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seed, stop_tokens=stop_tokens, chat=chat,
                        max_len=max_len, shared_prefix=shared_prefix, n=n,
                        ignore_eos=ignore_eos)
    if batch.state is None:  # nothing to generate
        return dec.result(batch)
    bar = None
    if progress is True:
        from tqdm.auto import tqdm
        bar = tqdm(total=int(batch.budget.sum()), unit="tok", desc="generate", leave=False)

        def progress(done, total, _bar=bar):
            _bar.update(done - _bar.n)
    try:
        dec.decode(batch, progress=progress or None)
    finally:
        if bar is not None:
            bar.close()
    return dec.result(batch)
