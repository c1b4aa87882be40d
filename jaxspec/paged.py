"""Paged K/V: a pool of fixed-size blocks of cache slots, each sequence's slots mapped by its block
table (as PagedAttention): memory follows the actual lengths, and blocks holding a common prefix can
be shared by several sequences (automatic prefix caching, `jaxspec.blocks`).

`PagedKVCache` has the `KVCache` interface with ``k``/``v`` as the block pool
``[L, NB, K, BS, D]`` (NB blocks of BS slots) and ``block_table[B, MB]``: logical slot ``s`` of row b
lives in block ``block_table[b, s // BS]`` at offset ``s % BS``; entries past a row's blocks hold
``NB`` (no block: writes there are dropped, reads masked by the row's length). A step writes its
new K/V through the table (`write_pages`) and attends through it (`gather_view` for the plain-jnp
path: the row's blocks gathered in order into a dense view; kernels read the pool directly).
The model sees only an `AttentionPlan` whose ``block_table`` is set.

Shared context (Hydragen over the pool): when several rows' tables start with the same blocks (a
document or system prompt that the prefix cache gave them all), `SharedContext` holds a dense copy
of those blocks' K/V and which rows start with them. Attention then reads the shared part once for
all those rows (`pallas_kernels.prefix_attention`) and each row's own blocks after it through its
table, merged by log-sum-exp (`jaxspec.attention`), instead of every row reading the shared blocks
again. The rows' tables and lengths are unchanged: the copy is an extra view of the same tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxspec.cache import KVCache, set_bits
from jaxspec.config import ModelConfig


@struct.dataclass
class SharedContext:
    """The first ``length`` context slots common to the rows ``rows`` (their tables' first
    ``length / BS`` blocks are the same blocks), copied dense: ``k``/``v``
    ``[L, 1, S, K, D]`` (slots past ``length`` hold anything)."""

    k: jax.Array
    v: jax.Array
    length: jax.Array  # [1] int32, a multiple of the block size
    rows: jax.Array  # [B] bool


@struct.dataclass
class PagedKVCache(KVCache):
    """Block pool ``k``/``v`` ``[L, NB, K, BS, D]``, ``lengths[B]``, ``block_table[B, MB]``;
    ``shared``: a `SharedContext` of some rows, or None."""

    block_table: jax.Array = None
    shared: SharedContext | None = None

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        """Slots a row can address (its table's width x the block size)."""
        return self.block_table.shape[1] * self.page_size

    @classmethod
    def create(cls, config: ModelConfig, batch: int, num_blocks: int, block_size: int,
               max_blocks: int, dtype=jnp.bfloat16, sharding=None) -> "PagedKVCache":
        """An empty pool of ``num_blocks`` blocks and ``batch`` rows of ``max_blocks`` table
        entries each, all unmapped."""
        shape = (config.num_layers, num_blocks, config.num_kv_heads, block_size, config.head_dim)
        if sharding is not None:
            zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
            k, v = zeros(), zeros()
        else:
            k, v = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
        return cls(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32),
                   block_table=jnp.full((batch, max_blocks), num_blocks, jnp.int32))

    def nbytes(self) -> int:
        return int(self.k.size * self.k.dtype.itemsize * 2)


def physical(block_table, slots, page_size: int, num_blocks: int):
    """(block, offset) of logical ``slots[B, T]``; slots past the table map to block
    ``num_blocks`` (out of range: dropped on write)."""
    MB = block_table.shape[1]
    j = slots // page_size
    blk = jnp.take_along_axis(block_table, jnp.clip(j, 0, MB - 1), axis=1)
    blk = jnp.where((j >= 0) & (j < MB), blk, num_blocks)
    return blk, slots % page_size


def write_pages(pages, layer, block_table, slots_BT, new_BTKD):
    """Writes ``new[b, t]`` at logical slot ``slots[b, t]`` of row b through the table (pool
    ``[L, NB, K, BS, D]``); slots without a block are dropped."""
    L, NB, K, BS, D = pages.shape
    blk, off = physical(block_table, slots_BT, BS, NB)
    new = new_BTKD.astype(pages.dtype)  # [B, T, K, D]
    return set_bits(pages, (layer, blk, slice(None), off), new)


def gather_view(pages, layer, block_table):
    """Row b's blocks of one layer in table order: a dense ``[B, K, MB * BS, D]`` view (unmapped
    entries read block 0: callers mask by length)."""
    L, NB, K, BS, D = pages.shape
    B, MB = block_table.shape
    idx = jnp.clip(block_table, 0, NB - 1)
    layer_pages = jax.lax.dynamic_index_in_dim(pages, layer, axis=0, keepdims=False)
    g = layer_pages[idx]  # [B, MB, K, BS, D]
    return jnp.transpose(g, (0, 2, 1, 3, 4)).reshape(B, K, MB * BS, D)


def compact_pages(pages, block_table, accepted_nodes, base, *, dst_offset: int = 1):
    """`jaxspec.tree.compact_path` through the block table: for every row b and ``j`` with
    ``accepted_nodes[b, j] >= 0``, logical slot ``base[b] + dst_offset + j`` gets the K/V of slot
    ``base[b] + accepted_nodes[b, j]`` (all layers; every source read before any write)."""
    L, NB, K, BS, D = pages.shape
    acc = jnp.asarray(accepted_nodes, jnp.int32)
    valid = acc >= 0
    src = base[:, None] + jnp.maximum(acc, 0)
    dst = base[:, None] + dst_offset + jnp.arange(acc.shape[1], dtype=jnp.int32)[None]
    s_blk, s_off = physical(block_table, src, BS, NB)
    d_blk, d_off = physical(block_table, dst, BS, NB)
    d_blk = jnp.where(valid, d_blk, NB)
    vals = pages[:, jnp.clip(s_blk, 0, NB - 1), :, s_off]  # [B, P, L, K, D]
    vals = jax.lax.optimization_barrier(vals)
    return set_bits(pages, (slice(None), d_blk, slice(None), d_off), vals)


def shift_tables(block_table, blocks, num_blocks: int):
    """Each row's table without its first ``blocks[b]`` entries (later entries move to the front,
    the freed end holds ``num_blocks``, no block): the row's slots from ``blocks[b] * BS`` on."""
    MB = block_table.shape[1]
    j = jnp.arange(MB, dtype=jnp.int32)[None] + blocks[:, None]
    return jnp.where(j < MB, jnp.take_along_axis(block_table, jnp.minimum(j, MB - 1), axis=1),
                     num_blocks)


@jax.jit
def shared_context(k_pages, v_pages, table_row, length, rows) -> SharedContext:
    """A `SharedContext` of the blocks ``table_row[MB]`` (in order; ``length`` of their slots are
    the shared context) of both pools, for the rows ``rows[B]``: a copy of every table entry's
    block (entries past the shared ones copy whatever they name; unmapped ones, block 0)."""
    L, NB, K, BS, D = k_pages.shape
    idx = jnp.clip(table_row, 0, NB - 1)

    def dense(pages):  # [L, MB, K, BS, D] -> [L, 1, MB * BS, K, D]
        g = pages[:, idx]
        return jnp.transpose(g, (0, 1, 3, 2, 4)).reshape(L, 1, idx.shape[0] * BS, K, D)

    return SharedContext(k=dense(k_pages), v=dense(v_pages),
                         length=jnp.reshape(length, (1,)).astype(jnp.int32),
                         rows=jnp.asarray(rows, bool))
