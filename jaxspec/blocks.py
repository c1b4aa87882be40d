"""Blocks of a paged K/V pool on the host: allocation, reference counts and the prefix cache.

A block holds ``block_size`` consecutive slots of one or more sequences' caches
(`jaxspec.paged`). A *full* block whose tokens are known is keyed by a hash chain over its
tokens and all tokens before it (``h_j = blake2b(h_{j-1} + tokens of block j)``), so two sequences
with the same first ``j`` blocks of tokens map to the same keys and can share those blocks: a new
request reuses the cached blocks of its longest cached prefix and prefills only the rest
(automatic prefix caching). Blocks are reference-counted; a cached block nobody references stays
cached until its room is needed, and the least recently used one goes first.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` slots (see module docstring)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.ref = [0] * self.num_blocks
        self._free = collections.deque(range(self.num_blocks))  # hold nothing worth keeping
        self._key_of: dict[int, bytes] = {}  # block -> its prefix key
        self._block_of: dict[bytes, int] = {}  # prefix key -> block
        self._idle = collections.OrderedDict()  # cached blocks no one references, oldest first
        self.hit_tokens = 0  # prompt tokens found in the cache
        self.query_tokens = 0  # prompt tokens looked up

    # ------------------------------------------------------------------ counts
    @property
    def free(self) -> int:
        """Blocks that can be allocated now (empty, or cached and unreferenced)."""
        return len(self._free) + len(self._idle)

    @property
    def used(self) -> int:
        return self.num_blocks - self.free

    @property
    def cached(self) -> int:
        """Blocks holding a cached prefix (referenced or not)."""
        return len(self._key_of)

    # ------------------------------------------------------------------ prefix keys
    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The prefix keys of the full blocks of ``tokens``."""
        bs = self.block_size
        n = len(tokens) // bs
        data = np.asarray(tokens[:n * bs], np.int64).reshape(n, bs)
        out, h = [], b""
        for j in range(n):  # 128-bit digests: a collision would silently mix two prompts
            h = hashlib.blake2b(h + data[j].tobytes(), digest_size=16).digest()
            out.append(h)
        return out

    def lookup(self, tokens: Sequence[int], keys: Sequence[bytes] | None = None) -> list[int]:
        """The cached blocks of the longest cached prefix of ``tokens`` (whole blocks; they are
        not acquired). ``keys``: ``keys(tokens)`` computed before (a caller that looks the same
        tokens up again hashes them once)."""
        found = []
        for k in self.keys(tokens) if keys is None else keys:
            b = self._block_of.get(k)
            if b is None:
                break
            found.append(b)
        return found

    def holds(self, key: bytes) -> bool:
        """Whether a block is cached under the prefix key ``key`` (one of `keys`)."""
        return key in self._block_of

    # ------------------------------------------------------------------ references
    def acquire(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self._idle.pop(b, None)
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks (referenced once each), taking empty ones first, then evicting the least
        recently used cached ones; None (nothing taken) when fewer than ``n`` can be had."""
        if n > self.free:
            return None
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._idle.popitem(last=False)
                del self._block_of[self._key_of.pop(b)]
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drops one reference to each of ``blocks`` (a sequence's blocks, in table order). They
        are released last to first, so a prefix's later blocks are evicted before its earlier
        ones: evicting an earlier block first would leave the later ones cached but unreachable
        (a lookup stops at the first missing block) and re-prefilled by the next request."""
        for b in reversed(list(blocks)):
            self.ref[b] -= 1
            if self.ref[b] < 0:
                raise RuntimeError(f"block {b} released more often than acquired")
            if self.ref[b] == 0:
                if b in self._key_of:
                    self._idle[b] = None  # most recently used last
                else:
                    self._free.append(b)

    def register(self, tokens: Sequence[int], blocks: Sequence[int],
                 keys: Sequence[bytes] | None = None) -> None:
        """Keys the full blocks of ``tokens`` (held in ``blocks``, in order) as cached; a key
        already cached elsewhere keeps its block. ``keys``: as `lookup` (at most the full blocks
        of ``tokens`` are used)."""
        keys = self.keys(tokens) if keys is None else keys[:len(tokens) // self.block_size]
        for k, b in zip(keys, blocks):
            if k in self._block_of or b in self._key_of:
                continue
            self._block_of[k] = b
            self._key_of[b] = k

    def count_lookup(self, query: int, hit: int) -> None:
        self.query_tokens += int(query)
        self.hit_tokens += int(hit)
