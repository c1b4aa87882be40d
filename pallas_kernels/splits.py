"""Flash-decoding key splits: which range of the valid keys each split of a grid owns.

A kernel's grid has a static number of splits, chosen from the cache's slot count, but at
run time a sequence (or prefix group) may hold far fewer valid keys: a cache padded to a
bucket, a short request in a long serving cache. Splitting the *valid* keys evenly (in
whole blocks, so loads stay tile-aligned) keeps every split's program busy and the time
proportional to the keys that exist; splitting the slot axis would leave all of them to the
first split or two.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def split_bounds(si, n, num_splits: int, block: int, split_size: int | None = None):
    """``[lo, hi)`` of split ``si`` (traced or not) over ``n`` valid keys (a traced int32):
    with ``split_size=None`` the n keys are shared evenly by ``num_splits`` splits in whole
    ``block``s (the last ones may be empty); otherwise split ``si`` owns the fixed range
    ``[si, si + 1) x split_size``. The ranges partition ``[0, n)`` in order."""
    if split_size is None:
        split_size = lax.div(lax.div(n + (num_splits - 1), jnp.int32(num_splits)) + (block - 1),
                             jnp.int32(block)) * block
    lo = jnp.minimum(si * split_size, n)
    hi = jnp.minimum(lo + split_size, n)
    return lo, hi


def split_range(si, n, c):
    """``split_bounds`` from a kernel's static description ``c`` (``block_k``, ``num_splits``,
    ``split_size`` and ``dynamic_split``: an explicit split_size is static)."""
    return split_bounds(si, n, c.num_splits, c.block_k,
                        None if c.dynamic_split else c.split_size)
