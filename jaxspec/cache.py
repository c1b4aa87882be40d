"""KV cache pytrees.

``KVCache``: K and V stacked over layers, ``[L, B, K, S, D]`` (contiguous ``S x D`` per sequence and
KV head: what a decode kernel streams), and ``lengths[B]``: how many slots of each sequence hold
committed tokens. Keys are stored after RoPE at their original positions. The model writes the K/V of
the T tokens of a step at slots ``lengths + t`` but never changes ``lengths``: committing (how many
of those tokens are kept) is the engine's job, so rejected speculative tokens are simply overwritten
next round.

Shared prefixes (Hydragen, `jaxspec.prefix`): a `PrefixedKVCache` is a per-row suffix cache plus the
`SharedPrefix` its rows continue: levels of prefix K/V that groups of rows share (level ``i`` has
``P_i`` groups of ``B / P_i`` contiguous rows). A row's suffix slot ``s`` holds position
``offset[b] + s``; `positions_of` gives each row's next position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.config import ModelConfig

SLOT_ALIGN = 128  # cache lengths are rounded up to this (kernel block sizes divide it)


def round_up(n: int, m: int) -> int:
    return -(-int(n) // m) * m


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, K, S, D]
    v: jax.Array  # [L, B, K, S, D]
    lengths: jax.Array  # [B] int32

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @classmethod
    def create(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16,
               abstract: bool = False, sharding=None) -> "KVCache":
        shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
        if abstract:
            kv = jax.ShapeDtypeStruct(shape, dtype)
            return cls(k=kv, v=kv, lengths=jax.ShapeDtypeStruct((batch,), jnp.int32))
        if sharding is not None:
            zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
            return cls(k=zeros(), v=zeros(), lengths=jnp.zeros((batch,), jnp.int32))
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    def nbytes(self) -> int:
        return int(self.k.size * self.k.dtype.itemsize * 2)


@struct.dataclass
class PrefixLevel:
    """One level of shared prefixes: ``P`` groups of up to ``Lp`` tokens, stacked over layers."""

    k: jax.Array  # [L, P, Lp, K, D] (the layout `pallas_kernels.prefix_attention` reads)
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


def positions_of(cache) -> jax.Array:
    """Position of each row's next slot: ``cache.lengths`` (+ the prefix offset of a prefixed
    cache)."""
    prefix = getattr(cache, "prefix", None)
    return cache.lengths if prefix is None else cache.lengths + prefix.offset


def compute_dtype(dtype, impl: str = "auto"):
    """The dtype a model stored in ``dtype`` decodes in (its weights, activations and K/V cache):
    its own, except on XLA's CPU backend with XLA attention (``impl`` "auto" or "xla"), where a
    16-bit model computes in float32. That backend has no native 16-bit matmul: it converts each
    16-bit weight (and a 16-bit cache, whole, around every in-place update) to float32 on every
    call. Measured on SmolLM2-135M, 2 cores: a server stream at 2.5 tokens/s in bfloat16, 6.5 in
    float32; a decode step at batch 4 with 1,024 cache slots 1.7 s with a bfloat16 cache. Every
    bfloat16 weight is exact in float32: the model is the same, computed with more precision."""
    dtype = jnp.dtype(dtype)
    if (jax.default_backend() == "cpu" and impl in ("auto", "xla")
            and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4):
        return jnp.dtype(jnp.float32)
    return dtype


def set_bits(x, idx, values):
    """``x.at[idx].set(values, mode="drop")`` done on the raw bits (an unsigned int view of the same
    width) for floating-point ``x``. XLA's GPU float normalization turns a 16-bit float scatter
    into a float32 scatter with a conversion of the *whole* operand there and back: on a KV cache
    that is two full-cache passes per call. An integer scatter is native and stays in place."""
    dt = x.dtype
    values = jnp.asarray(values).astype(dt)
    if not jnp.issubdtype(dt, jnp.floating):
        return x.at[idx].set(values, mode="drop")
    ut = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(dt).itemsize]
    bits = jax.lax.bitcast_convert_type(x, ut)
    bits = bits.at[idx].set(jax.lax.bitcast_convert_type(values, ut), mode="drop")
    return jax.lax.bitcast_convert_type(bits, dt)


def kv_bytes_per_token(config: ModelConfig, dtype=jnp.bfloat16) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(dtype).itemsize
