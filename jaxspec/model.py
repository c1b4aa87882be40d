"""The LLaMA-family transformer as a pure-functional Flax module.

``Transformer(config).apply({"params": params}, tokens_BT, positions_BT, cache, plan)``
returns ``(logits[B, T, V] float32, cache)``. Params are a plain pytree; the model holds no state.
Layers are scanned (``nn.scan``), so compile time does not grow with depth; the whole stacked KV
cache ``[L, B, K, S, D]`` is the scan carry and each layer writes only its T new slots, so nothing is
copied per step. Keys are stored after RoPE at their original positions.

Parameter tree (shapes for L layers, hidden D, heads H x head_dim Dh, KV heads K, MLP F, vocab V)::

    embed [V, D]
    layers/ attn_norm [L, D]  wq [L, D, H*Dh]  wk, wv [L, D, K*Dh]  (bq [L, H*Dh], bk, bv [L, K*Dh])
            wo [L, H*Dh, D]  (bo [L, D])  mlp_norm [L, D]  w_gate, w_up [L, D, F]  w_down [L, F, D]
            (b_gate, b_up [L, F], b_down [L, D])  (q_norm, k_norm [L, Dh]: Qwen3)
    final_norm [D]
    lm_head [D, V]              (absent when embeddings are tied)
"""

from __future__ import annotations

import dataclasses
import pathlib
import zlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.attention import AttentionPlan, attend
from jaxspec.cache import KVCache, set_bits
from jaxspec.config import ModelConfig, sliding_window_of  # noqa: F401 (re-exported)
from jaxspec import invariant
from jaxspec.paged import write_pages


@dataclasses.dataclass
class Model:
    """A loaded model: config, parameter pytree and (when present) tokenizer."""

    config: ModelConfig
    params: Any
    tokenizer: Any = None
    path: pathlib.Path | None = None
    mesh: Any = None
    # copies of each of the checkpoint's KV heads in ``params`` (`jaxspec.shard_model` widens
    # KV heads fewer than the model axis; `jaxspec.save` writes the original heads)
    kv_replicas: int = 1
    # the decoders `jaxspec.generate` made for this model (compiled loops, measured costs)
    decoders: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                       compare=False)

    @property
    def dtype(self):
        return self.params["embed"].dtype

    def __repr__(self):
        c = self.config
        return (f"Model({c.model_type}, layers={c.num_layers}, hidden={c.hidden_size}, "
                f"heads={c.num_heads}/{c.num_kv_heads}, vocab={c.vocab_size}, dtype={self.dtype}, "
                f"path={self.path})")



def rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def rope_tables(config: ModelConfig, positions_BT):
    """cos/sin ``[B, T, Dh]`` in float32 (HF's rotate-half convention)."""
    inv_freq = jnp.asarray(config.rope_inv_freq(), dtype=jnp.float32)
    ang = positions_BT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    ang = jnp.concatenate([ang, ang], axis=-1)
    scale = config.rope_attention_factor()  # YaRN's temperature; 1 otherwise
    if scale != 1.0:
        return jnp.cos(ang) * scale, jnp.sin(ang) * scale
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x_BTHD, cos, sin):
    half = x_BTHD.shape[-1] // 2
    x32 = x_BTHD.astype(jnp.float32)
    rot = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rot * sin[:, :, None, :]
    return out.astype(x_BTHD.dtype)




def _write_rows(cache_LBKSD, layer, start_B, new_BTKD):
    """Row-by-row dynamic-update-slice of the T contiguous new slots (CPU: the XLA CPU backend
    turns a 16-bit scatter, or a bitcast around one, into copies of the whole cache). The write
    must fit (``start + T <= S``, which generate's cache sizing guarantees)."""
    upd = jnp.swapaxes(new_BTKD, 1, 2)[:, None, :, :, :]  # [B, 1, K, T, D]

    def one(b, c):
        return jax.lax.dynamic_update_slice(
            c, upd[b][None], (layer, b, 0, start_B[b], 0))

    return jax.lax.fori_loop(0, new_BTKD.shape[0], one, cache_LBKSD)


def write_slots(cache_LBKSD, layer, b_idx, slots_BT, new_BTKD):
    """Writes ``new[b, t]`` at ``cache[layer, b, :, slots[b, t]]`` in place (slots past the end are
    dropped). The scatter runs on the raw bits (an unsigned int view of the same width): some
    backends have no native 16-bit float scatter and would otherwise convert the whole cache."""
    new = new_BTKD.astype(cache_LBKSD.dtype)
    if jax.default_backend() == "cpu":
        return _write_rows(cache_LBKSD, layer, slots_BT[:, 0], new)
    return set_bits(cache_LBKSD, (layer, b_idx, slice(None), slots_BT), new)


def _init(scale):
    return nn.initializers.normal(stddev=scale)


class Block(nn.Module):
    """One decoder layer; called under ``nn.scan`` with carry ``(x, k_cache, v_cache)``."""

    config: ModelConfig
    dtype: Any

    @nn.compact
    def __call__(self, carry, layer, rope, plan: AttentionPlan):
        c = self.config
        D = carry[0].shape[-1]
        H, K, Dh, F = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        dt = self.dtype
        names = {"attn_norm": (nn.initializers.ones, (D,)),
                 "wq": (_init(D ** -0.5), (D, H * Dh)), "wk": (_init(D ** -0.5), (D, K * Dh)),
                 "wv": (_init(D ** -0.5), (D, K * Dh)), "wo": (_init((H * Dh) ** -0.5), (H * Dh, D)),
                 "mlp_norm": (nn.initializers.ones, (D,)),
                 "w_gate": (_init(D ** -0.5), (D, F)), "w_up": (_init(D ** -0.5), (D, F)),
                 "w_down": (_init(F ** -0.5), (F, D))}
        if c.attention_bias:
            names.update({"bq": (_init(0.02), (H * Dh,)), "bk": (_init(0.02), (K * Dh,)),
                          "bv": (_init(0.02), (K * Dh,))})
        if c.attention_out_bias:
            names["bo"] = (_init(0.02), (D,))
        if c.qk_norm:
            names.update({"q_norm": (nn.initializers.ones, (Dh,)),
                          "k_norm": (nn.initializers.ones, (Dh,))})
        if c.mlp_bias:
            names.update({"b_gate": (_init(0.02), (F,)), "b_up": (_init(0.02), (F,)),
                          "b_down": (_init(0.02), (D,))})
        p = {n: self.param(n, init, shape, dt) for n, (init, shape) in names.items()}
        return layer_forward(c, p, carry, layer, rope, plan)


def layer_forward(c: ModelConfig, p: dict, carry, layer, rope, plan: AttentionPlan):
    """One decoder layer on ``carry = (x[B, T, D], k_cache, v_cache)`` -> ``(carry, scores)``.
    ``p`` holds the layer's weights, either as stored (wq, wk, wv, w_gate, w_up, ...) or fused by
    `fuse_layer_params` (wqkv / bqkv and w_gateup: one matmul each instead of three and two).
    ``scores``: with ``plan.score_block``, the layer's block scores
    (`jaxspec.attention.context_scores`, [B, K, NB]), else None."""
    x, k_cache, v_cache = carry
    (x,), k_cache, v_cache, (scores,) = _layer(c, p, (x,), k_cache, v_cache, layer, (rope,),
                                               (plan,))
    return (x, k_cache, v_cache), scores


def _join(xs):
    """Segments ``[B_i, T_i, F]`` as one ``[1, sum B_i T_i, F]`` (one segment: as it is)."""
    if len(xs) == 1:
        return xs[0]
    return jnp.concatenate([x.reshape(1, -1, x.shape[-1]) for x in xs], axis=1)


def _parts(y, shapes):
    """Inverse of `_join`: ``y`` cut back into segments of ``shapes`` ((B_i, T_i) each)."""
    if len(shapes) == 1:
        return [y]
    out, off = [], 0
    for B, T in shapes:
        out.append(y[0, off:off + B * T].reshape(B, T, y.shape[-1]))
        off += B * T
    return out


def _products(impl: str, shapes, plans):
    """``(x, w) -> x @ w`` over the joined segments (`_join`). With batch-invariant numerics a
    segment of prompt tokens (``plan.prompt``) takes `jaxspec.invariant.prompt_matmul` and the
    others `jaxspec.invariant.matmul`: a segment of each in one forward (a mixed round) is two
    products then, each row computed as its role computes it in every round."""
    if not invariant.is_invariant(impl):
        return jnp.matmul
    roles = [bool(pl.prompt) for pl in plans]
    if len(set(roles)) == 1:
        return invariant.matmul_for(impl, prompt=roles[0])
    fns = [invariant.matmul_for(impl, prompt=r) for r in roles]

    def mm(x, w):
        return _join([f(xi, w) for f, xi in zip(fns, _parts(x, shapes))])
    return mm


def _layer(c: ModelConfig, p: dict, xs, k_cache, v_cache, layer, ropes, plans):
    """One decoder layer over segments: ``xs[i]`` ``[B_i, T_i, D]`` attends by ``plans[i]`` with
    RoPE ``ropes[i]``; every projection and the MLP run once over all segments' tokens (one
    weight read), the attention (and the K/V writes, into the same cache) per segment.
    Returns ``(xs, k_cache, v_cache, scores per segment)``."""
    shapes = [x.shape[:2] for x in xs]
    H, K, Dh = c.num_heads, c.num_kv_heads, c.head_dim
    dt = xs[0].dtype
    # batch-invariant numerics (`jaxspec.invariant`) when the plans' implementation asks for them
    impl = plans[0].impl
    inv = invariant.is_invariant(impl)
    mm = _products(impl, shapes, plans)
    norm = invariant.rms_norm if inv else rms_norm
    x = _join(xs)
    h = norm(x, p["attn_norm"], c.rms_norm_eps)
    if "wqkv" in p:
        qkv = mm(h, p["wqkv"])
        if "bqkv" in p:
            qkv = qkv + p["bqkv"]
        q, k, v = jnp.split(qkv, [H * Dh, (H + K) * Dh], axis=-1)
    else:
        q, k, v = mm(h, p["wq"]), mm(h, p["wk"]), mm(h, p["wv"])
        if c.attention_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    attns, scores = [], []
    for (B, T), qi, ki, vi, (cos, sin), plan in zip(shapes, _parts(q, shapes), _parts(k, shapes),
                                                   _parts(v, shapes), ropes, plans):
        qi, ki = qi.reshape(B, T, H, Dh), ki.reshape(B, T, K, Dh)
        if "q_norm" in p:  # Qwen3: each head RMS-normalized before RoPE
            qi = norm(qi, p["q_norm"], c.rms_norm_eps)
            ki = norm(ki, p["k_norm"], c.rms_norm_eps)
        qi, ki = apply_rope(qi, cos, sin), apply_rope(ki, cos, sin)
        vi = vi.reshape(B, T, K, Dh)

        # Write the T new K/V at slots lengths + (T_new - T) + t: these T tokens are the last T
        # of the plan's T_new new tokens (T_new == T unless the plan says otherwise:
        # `AttentionPlan`). Slots past the cache are dropped.
        first = plan.new_tokens(T) - T
        slots = plan.lengths[:, None] + (first + jnp.arange(T, dtype=jnp.int32))[None, :]
        b_idx = jnp.arange(B, dtype=jnp.int32)[:, None]
        if plan.block_table is not None:  # a block pool (jaxspec.paged)
            if plan.active is not None:  # an idle row must not write into blocks it gave back
                slots = jnp.where(plan.active[:, None], slots, jnp.iinfo(jnp.int32).max // 2)
            k_cache = write_pages(k_cache, layer, plan.block_table, slots, ki)
            v_cache = write_pages(v_cache, layer, plan.block_table, slots, vi)
        else:
            k_cache = write_slots(k_cache, layer, b_idx, slots, ki)
            v_cache = write_slots(v_cache, layer, b_idx, slots, vi)
        attn = attend(qi, k_cache, v_cache, layer, plan)  # [B, T, H, Dh]
        sc = None
        if plan.score_block is not None:  # and each row's largest logit per block of its context
            attn, sc = attn
        attns.append(attn.reshape(B, T, H * Dh).astype(dt))
        scores.append(sc)
    o = mm(_join(attns), p["wo"])
    x = x + (o + p["bo"] if "bo" in p else o)
    h = norm(x, p["mlp_norm"], c.rms_norm_eps)
    if "w_gateup" in p:
        gateup = mm(h, p["w_gateup"])
        if "b_gateup" in p:
            gateup = gateup + p["b_gateup"]
        gate, up = jnp.split(gateup, 2, axis=-1)
    else:
        gate, up = mm(h, p["w_gate"]), mm(h, p["w_up"])
        if "b_gate" in p:
            gate, up = gate + p["b_gate"], up + p["b_up"]
    down = mm(nn.silu(gate) * up, p["w_down"])
    x = x + (down + p["b_down"] if "b_down" in p else down)
    return _parts(x, shapes), k_cache, v_cache, scores


def fuse_layer_params(params, *, in_place: bool = False):
    """Per-layer params (`unstack_layers`) with wq|wk|wv (and their biases) concatenated into
    ``wqkv`` and w_gate|w_up into ``w_gateup``: three fewer matmuls per layer (small ones, which
    run far below the memory bandwidth at decode batch sizes). Single device only (a
    tensor-parallel split of the fused columns would not follow the heads). ``in_place``
    replaces the entries of ``params["layers"]`` one by one, so that at most one layer's weights
    exist twice at a time (a list given by the caller is modified)."""
    layers = params["layers"]
    if not isinstance(layers, list if in_place else (list, tuple)):
        raise ValueError("fuse_layer_params needs per-layer params (unstack_layers first)")
    out = layers if in_place else list(layers)
    for i, p in enumerate(out):
        if "wqkv" in p:
            continue
        f = {k: v for k, v in p.items() if k not in ("wq", "wk", "wv", "bq", "bk", "bv",
                                                      "w_gate", "w_up", "b_gate", "b_up")}
        f["wqkv"] = jnp.concatenate([p["wq"], p["wk"], p["wv"]], axis=1)
        if "bq" in p:
            f["bqkv"] = jnp.concatenate([p["bq"], p["bk"], p["bv"]])
        f["w_gateup"] = jnp.concatenate([p["w_gate"], p["w_up"]], axis=1)
        if "b_gate" in p:
            f["b_gateup"] = jnp.concatenate([p["b_gate"], p["b_up"]])
        out[i] = f
    return {**params, "layers": out}


def unfuse_layer_params(params):
    """Inverse of `fuse_layer_params` (per-layer params as stored: wq, wk, wv, w_gate, w_up)."""
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)) or "wqkv" not in layers[0]:
        return params
    return {**params, "layers": [_unfuse(p) for p in layers]}


class Transformer(nn.Module):
    """``(tokens[B,T], positions[B,T], cache, plan) -> (logits[B,T,V] f32, cache)``.

    With ``logits_at`` (``[B, n]`` indices into T) only those rows go through the final norm and
    the LM head (prefill needs one row per sequence, not T). With ``return_hidden`` the final hidden
    states are returned instead of logits.
    """

    config: ModelConfig
    dtype: Any = jnp.bfloat16

    @nn.compact
    def __call__(self, tokens_BT, positions_BT, cache: KVCache, plan: AttentionPlan,
                 logits_at=None):
        c = self.config
        dt = self.dtype
        embed = self.param("embed", _init(1.0), (c.vocab_size, c.hidden_size), dt)
        x = jnp.take(embed, tokens_BT, axis=0)
        rope = rope_tables(c, positions_BT)
        Stack = nn.scan(
            Block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast),
            length=c.num_layers,
        )
        layers = jnp.arange(c.num_layers, dtype=jnp.int32)
        (x, k, v), scores = Stack(c, dt, name="layers")((x, cache.k, cache.v), layers, rope,
                                                        plan)
        cache = cache.replace(k=k, v=v)
        final_norm = self.param("final_norm", nn.initializers.ones, (c.hidden_size,), dt)
        lm_head = None
        if not c.tie_word_embeddings:
            lm_head = self.param("lm_head", _init(c.hidden_size ** -0.5),
                                 (c.hidden_size, c.vocab_size), dt)
        logits = lm_logits(c, x, final_norm, embed, lm_head, logits_at, impl=plan.impl)
        return (logits, cache) if scores is None else (logits, cache, scores)


def lm_logits(c: ModelConfig, x, final_norm, embed, lm_head, logits_at=None, *,
              impl: str = "auto"):
    """Final norm + LM head (tied or not) on the rows ``logits_at`` (all rows if None); an
    invariant ``impl`` (`jaxspec.invariant`) computes both with the batch-invariant primitives."""
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[..., None].astype(jnp.int32), axis=1)
    if invariant.is_invariant(impl):
        x = invariant.rms_norm(x, final_norm, c.rms_norm_eps)
        if c.tie_word_embeddings:  # the embedding [V, D] read in place
            return invariant.matmul(x, embed, impl, out_dtype=jnp.float32, transpose_w=True)
        return invariant.matmul(x, lm_head, impl, out_dtype=jnp.float32)
    x = rms_norm(x, final_norm, c.rms_norm_eps)
    if c.tie_word_embeddings:
        return jnp.einsum("btd,vd->btv", x, embed, preferred_element_type=jnp.float32)
    return jnp.einsum("btd,dv->btv", x, lm_head, preferred_element_type=jnp.float32)


def _forward_unrolled(config, params, tokens_BT, positions_BT, cache, plan, logits_at, dtype):
    """The same model with per-layer weight arrays and a Python loop over layers.

    Why: XLA on GPU copies each layer's slice of stacked weights before its matmuls, so a scanned
    decode step streams the weights ~3x (measured on an H200: 6.2 ms vs 2.5 ms for 7.5 GB of MLP
    weights at batch 32; benchmarks/decode_llama8b.md). Compile time grows with depth here."""
    x = jnp.take(params["embed"], tokens_BT, axis=0)
    rope = rope_tables(config, positions_BT)
    k, v = cache.k, cache.v
    scores = []
    for layer, p in enumerate(params["layers"]):
        (x, k, v), sc = layer_forward(config, p, (x, k, v), jnp.int32(layer), rope, plan)
        scores.append(sc)
    logits = lm_logits(config, x, params["final_norm"], params["embed"], params.get("lm_head"),
                       logits_at, impl=plan.impl)
    if plan.score_block is None:
        return logits, cache.replace(k=k, v=v)
    return logits, cache.replace(k=k, v=v), jnp.stack(scores)


def unstack_layers(params):
    """Stacked ``layers`` ([L, ...] leaves) -> a list of per-layer dicts (see `_forward_unrolled`)."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    L = jax.tree_util.tree_leaves(layers)[0].shape[0]
    out = [dict() for _ in range(L)]
    for name in list(layers):
        leaf = layers[name]
        for i in range(L):
            out[i][name] = leaf[i]
    return {**params, "layers": out}


def stack_layers(params):
    """Inverse of `unstack_layers` (and of `fuse_layer_params`)."""
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)):
        return params
    layers = unfuse_layer_params(params)["layers"]
    return {**params, "layers": {n: jnp.stack([l[n] for l in layers]) for n in layers[0]}}


def _unfuse(p):
    f = {k: v for k, v in p.items() if k not in ("wqkv", "bqkv", "w_gateup", "b_gateup")}
    q, k = p["wo"].shape[0], (p["wqkv"].shape[1] - p["wo"].shape[0]) // 2
    f["wq"], f["wk"], f["wv"] = jnp.split(p["wqkv"], [q, q + k], axis=1)
    if "bqkv" in p:
        f["bq"], f["bk"], f["bv"] = jnp.split(p["bqkv"], [q, q + k])
    f["w_gate"], f["w_up"] = jnp.split(p["w_gateup"], 2, axis=1)
    if "b_gateup" in p:
        f["b_gate"], f["b_up"] = jnp.split(p["b_gateup"], 2)
    return f


def forward(config: ModelConfig, params, tokens_BT, positions_BT, cache: KVCache,
            plan: AttentionPlan, logits_at=None, *, dtype=None):
    """Functional entry point: ``(logits, cache)`` for params of ``config``; with
    ``plan.score_block`` ``(logits, cache, scores[L, B, K, NB])`` (`jaxspec.retrieval`).

    ``positions_BT`` are the tokens' RoPE positions; ``plan`` says which keys each token sees
    (its context in ``cache``, shared-prefix segments, a sparse view) and where the new K/V go.
    The model's own sliding window (`sliding_window_of`) joins the plan."""
    if dtype is None:
        dtype = params["embed"].dtype
    if plan.sliding_window is None:
        W = sliding_window_of(config)
        if W is not None:
            plan = plan.replace(sliding_window=W)
    if isinstance(params["layers"], (list, tuple)):
        return _forward_unrolled(config, params, tokens_BT, positions_BT, cache, plan, logits_at,
                                 dtype)
    model = Transformer(config, dtype=dtype)
    return model.apply({"params": params}, tokens_BT, positions_BT, cache, plan, logits_at)


def forward_mixed(config: ModelConfig, params, segments, cache: KVCache):
    """One forward over several segments of tokens that share the weights and the cache: each
    segment ``(tokens[B_i, T_i], positions[B_i, T_i], plan, logits_at)`` attends by its own plan
    (a decode round's rows and one row's chunk of prompt, say), and every projection and MLP
    runs once over all their tokens, so the weights are read once for all of them. A segment's
    ``logits_at`` is as in `forward`, or False for no logits (a prefill chunk's). Returns
    ``([logits or None per segment], cache)``, and when a segment's plan has ``score_block``
    also ``[scores [L, B_i, K, NB] or None per segment]`` (as `forward`'s). Each segment's
    outputs equal its own `forward`'s up to the rounding of matrix products over a different
    number of rows (bitwise the same with batch-invariant numerics, whose products do not depend
    on the rows beside them)."""
    W = sliding_window_of(config)
    plans = tuple(s[2].replace(sliding_window=W) if s[2].sliding_window is None and W is not None
                  else s[2] for s in segments)
    if len({pl.impl for pl in plans}) != 1:
        raise ValueError("the segments of one forward share one attention implementation")
    scored = [pl.score_block is not None for pl in plans]
    xs = tuple(jnp.take(params["embed"], s[0], axis=0) for s in segments)
    ropes = tuple(rope_tables(config, s[1]) for s in segments)
    if isinstance(params["layers"], (list, tuple)):
        k, v = cache.k, cache.v
        per_layer = []
        for layer, p in enumerate(params["layers"]):
            xs, k, v, sc = _layer(config, p, xs, k, v, jnp.int32(layer), ropes, plans)
            per_layer.append([x for x, want in zip(sc, scored) if want])
        kept = [jnp.stack(z) for z in zip(*per_layer)] if any(scored) else []
    else:
        def body(carry, lp):
            xs_, k_, v_ = carry
            p, layer = lp
            xs_, k_, v_, sc = _layer(config, p, xs_, k_, v_, layer, ropes, plans)
            return (tuple(xs_), k_, v_), tuple(x for x, want in zip(sc, scored) if want)

        L = config.num_layers
        (xs, k, v), kept = jax.lax.scan(body, (xs, cache.k, cache.v),
                                        (params["layers"], jnp.arange(L, dtype=jnp.int32)))
        kept = list(kept)
    logits = [None if s[3] is False else
              lm_logits(config, x, params["final_norm"], params["embed"], params.get("lm_head"),
                        s[3], impl=pl.impl) for s, x, pl in zip(segments, xs, plans)]
    if not any(scored):
        return logits, cache.replace(k=k, v=v)
    it = iter(kept)
    return logits, cache.replace(k=k, v=v), [next(it) if want else None for want in scored]


def init_params(config: ModelConfig, rng, dtype=jnp.float32):
    """Random parameters of the right shapes (tests, random-weight benchmarks)."""
    model = Transformer(config, dtype=dtype)
    cache = KVCache.create(config, batch=1, max_len=8, dtype=dtype)
    plan = AttentionPlan(lengths=jnp.zeros((1,), jnp.int32), impl="xla")
    tokens = jnp.zeros((1, 1), jnp.int32)

    @jax.jit
    def _init_fn(rng):
        return model.init(rng, tokens, tokens, cache, plan)["params"]

    params = _init_fn(rng)
    # Norm weights random too, so tests notice a wrong norm.
    def jitter(path, x):
        name = path[-1].key if hasattr(path[-1], "key") else str(path[-1])
        if name in ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm"):
            # a stable hash: str hash() is salted per process (PYTHONHASHSEED), which made the
            # same rng give different weights in every run
            r = jax.random.fold_in(rng, zlib.crc32(name.encode()) % (2 ** 31))
            return (x + 0.1 * jax.random.normal(r, x.shape)).astype(x.dtype)
        return x
    return jax.tree_util.tree_map_with_path(jitter, params)


def param_shapes(config: ModelConfig, dtype=jnp.float32):
    """Abstract parameter tree (``jax.ShapeDtypeStruct`` leaves), no compute."""
    model = Transformer(config, dtype=dtype)
    cache = KVCache.create(config, batch=1, max_len=8, dtype=dtype, abstract=True)
    plan = AttentionPlan(lengths=jax.ShapeDtypeStruct((1,), jnp.int32), impl="xla")
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
    return jax.eval_shape(lambda r, t, c, pl: model.init(r, t, t, c, pl)["params"],
                          rng, tokens, cache, plan)


def num_params(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
