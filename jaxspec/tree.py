"""Static token trees (SpecInfer), KV compaction of an accepted path, and a Sequoia-style
tree-shape optimizer.

A :class:`TokenTree` is a frozen, hashable description of the tree topology, so it can be
a static argument of ``jax.jit``; its numpy tables are compile-time constants.

Layout rules (checked on construction):

* node 0 is the root: the last committed token, whose K/V is written in the same verify
  forward as the drafted nodes 1..N-1;
* ``parents[0] == -1`` and ``parents[i] < i`` (parents precede children);
* nodes are laid out level by level (depths non-decreasing), so each level is a contiguous
  index range and one draft forward per level works on a slice;
* the children of a node, in increasing index order, are its siblings of rank 0, 1, ...:
  the verifier tries them in that order.

During verification node ``i`` sits at RoPE position ``length + depths[i]`` and cache slot
``length + i``; query ``i`` may see key ``j`` of the new tokens iff
``ancestor_mask[i, j]`` (j is an ancestor of i or i itself).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache import set_bits

Array = jax.Array

__all__ = [
    "TokenTree",
    "as_tree",
    "compact_path",
    "rank_acceptance_counts",
    "expected_accepted",
    "TreeSearchResult",
    "search_tree",
    "optimize_tree",
]


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@dataclasses.dataclass(frozen=True)
class TokenTree:
    """Static tree topology. Build with :meth:`from_expansion`, :meth:`from_parents` or
    :meth:`chain`. Hash / equality depend only on ``parents``."""

    parents_tuple: tuple[int, ...]

    def __post_init__(self):
        bad = [p for p in self.parents_tuple
               if not isinstance(p, (int, np.integer)) or isinstance(p, (bool, np.bool_))]
        if bad:
            raise ValueError(f"parents must be ints, got {bad[0]!r}")
        par = tuple(int(p) for p in self.parents_tuple)
        object.__setattr__(self, "parents_tuple", par)
        if not par or par[0] != -1:
            raise ValueError("parents[0] must be -1 (node 0 is the root)")
        depth = [0]
        for i, p in enumerate(par[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"parents must precede children: parents[{i}] = {p}")
            depth.append(depth[p] + 1)
            if depth[i] < depth[i - 1]:
                raise ValueError(
                    f"nodes must be laid out level by level: node {i} (depth {depth[i]}) "
                    f"follows a node of depth {depth[i - 1]}"
                )

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_parents(cls, parents: Sequence[int]) -> "TokenTree":
        return cls(tuple(parents))

    @classmethod
    def from_expansion(cls, expansion: Sequence[int]) -> "TokenTree":
        """SpecInfer's expansion config ``(k1, ..., km)``: every node at depth i gets
        ``k_{i+1}`` children. ``(1,) * g`` is a chain of g drafts."""
        parents = [-1]
        level = [0]
        for k in expansion:
            k = int(k)
            if k < 0:
                raise ValueError(f"expansion widths must be >= 0, got {tuple(expansion)}")
            nxt = []
            for node in level:
                for _ in range(k):
                    parents.append(node)
                    nxt.append(len(parents) - 1)
            level = nxt
        return cls(tuple(parents))

    @classmethod
    def chain(cls, gamma: int) -> "TokenTree":
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        return cls.from_expansion((1,) * gamma)

    # ------------------------------------------------------------------ tables
    @property
    def num_nodes(self) -> int:
        return len(self.parents_tuple)

    @functools.cached_property
    def parents(self) -> np.ndarray:
        """``[N] int32``; ``parents[0] == -1``."""
        return _readonly(np.asarray(self.parents_tuple, np.int32))

    @functools.cached_property
    def depths(self) -> np.ndarray:
        """``[N] int32``; root 0. RoPE position offsets of the nodes."""
        d = np.zeros(self.num_nodes, np.int32)
        for i in range(1, self.num_nodes):
            d[i] = d[self.parents_tuple[i]] + 1
        return _readonly(d)

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node = most drafts one round can accept."""
        return int(self.depths[-1])

    @functools.cached_property
    def levels(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` node-index range of each depth 0..max_depth."""
        d = self.depths
        return tuple(
            (int(np.searchsorted(d, k, "left")), int(np.searchsorted(d, k, "right")))
            for k in range(self.max_depth + 1)
        )

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of each node in sibling-rank order."""
        ch: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):
            ch[self.parents_tuple[i]].append(i)
        return tuple(tuple(c) for c in ch)

    @functools.cached_property
    def num_children(self) -> np.ndarray:
        return _readonly(np.asarray([len(c) for c in self.children], np.int32))

    @property
    def max_children(self) -> int:
        return int(self.num_children.max())

    @functools.cached_property
    def children_padded(self) -> np.ndarray:
        """``[N, max(1, max_children)] int32``, -1 padded."""
        w = max(1, self.max_children)
        out = np.full((self.num_nodes, w), -1, np.int32)
        for i, c in enumerate(self.children):
            out[i, : len(c)] = c
        return _readonly(out)

    @functools.cached_property
    def sibling_rank(self) -> np.ndarray:
        """``[N] int32``: index of each node among its parent's children (root: 0)."""
        r = np.zeros(self.num_nodes, np.int32)
        for c in self.children:
            r[list(c)] = np.arange(len(c))
        return _readonly(r)

    @functools.cached_property
    def ancestor_mask(self) -> np.ndarray:
        """``[N, N] bool``: ``mask[i, j]`` iff j is an ancestor of i or j == i."""
        n = self.num_nodes
        m = np.zeros((n, n), bool)
        m[0, 0] = True
        for i in range(1, n):
            m[i] = m[self.parents_tuple[i]]
            m[i, i] = True
        return _readonly(m)

    @functools.cached_property
    def ancestor_at_depth(self) -> np.ndarray:
        """``[N, max_depth + 1] int32``: the node on the root->i path at each depth, -1 below i."""
        out = np.full((self.num_nodes, self.max_depth + 1), -1, np.int32)
        for i in range(self.num_nodes):
            j = i
            while j >= 0:
                out[i, self.depths[j]] = j
                j = self.parents_tuple[j]
        return _readonly(out)

    def __repr__(self) -> str:
        widths = [b - a for a, b in self.levels]
        return f"TokenTree(num_nodes={self.num_nodes}, max_depth={self.max_depth}, level_sizes={widths})"


def as_tree(tree: Any) -> TokenTree:
    """A :class:`TokenTree` from a tree or a parents sequence."""
    if isinstance(tree, TokenTree):
        return tree
    return TokenTree.from_parents(list(np.asarray(tree).tolist()))


# --------------------------------------------------------------------------- KV compaction


def compact_path(
    cache: Any,
    accepted_nodes: Array,
    base: Array,
    *,
    slot_axis: int,
    batch_axis: int = 0,
    dst_offset: int = 1,
) -> Any:
    """Moves the accepted path's K/V into consecutive cache slots, per row (ragged).

    For every row b and every j with ``accepted_nodes[b, j] >= 0``:
    ``slot base[b] + dst_offset + j  <-  slot base[b] + accepted_nodes[b, j]``.

    With ``accepted_nodes`` as returned by :func:`jaxspec.verify.verify_tree` (depth-1..n
    nodes, root excluded, -1 padded) and ``base = length`` (the root's slot), the default
    ``dst_offset=1`` leaves the path root..leaf at slots ``length + 0..n``. For a path that
    starts with the root pass ``dst_offset=0``.

    ``cache`` is an array or a pytree of arrays that share the batch and slot axes, e.g.
    ``[L, B, K, S, D]`` with ``batch_axis=1, slot_axis=3``. All sources are gathered
    before anything is written (a node's source slot may be another node's destination),
    with no transpose of the cache: one gather and one scatter per leaf, so under ``jit``
    with donation the update is in place. Destinations past the end are dropped.
    """
    accepted_nodes = jnp.asarray(accepted_nodes, jnp.int32)
    base = jnp.asarray(base, jnp.int32)
    B, P = accepted_nodes.shape
    valid = accepted_nodes >= 0
    src = base[:, None] + jnp.maximum(accepted_nodes, 0)
    dst_ok = base[:, None] + dst_offset + jnp.arange(P, dtype=jnp.int32)[None, :]
    rows = jnp.arange(B, dtype=jnp.int32)[:, None]

    def one(x):
        nd = x.ndim
        ba, sa = batch_axis % nd, slot_axis % nd
        S = x.shape[sa]
        dst = jnp.where(valid, dst_ok, S)  # out of range -> dropped
        idx = [slice(None)] * nd
        idx[ba] = rows
        idx[sa] = jnp.minimum(src, S - 1)
        vals = x[tuple(idx)]
        idx[sa] = dst
        return set_bits(x, tuple(idx), vals)

    return jax.tree.map(one, cache)


def rank_acceptance_counts(
    tree: TokenTree, n_accepted: Array, accepted_nodes: Array, active: Array | None = None
) -> tuple[Array, Array]:
    """Per sibling rank r: how many times a child of rank r was tried, and accepted.

    The verifier tries the children of a node in rank order and stops at the first
    accepted one, so a path node of rank r means ranks 0..r were tried and r accepted,
    and at the node where the walk stopped all its children were tried and rejected.
    ``accepts / tries`` estimates the ``acceptance_by_rank`` of :func:`search_tree`.
    Returns two ``[max_children] int32`` totals over the (active) rows.
    """
    tree = as_tree(tree)
    R = max(1, tree.max_children)
    rank_tbl = jnp.asarray(tree.sibling_rank)
    nch_tbl = jnp.asarray(tree.num_children)
    valid = accepted_nodes >= 0
    r = rank_tbl[jnp.maximum(accepted_nodes, 0)]  # [B, D]
    ar = jnp.arange(R, dtype=jnp.int32)
    tries = jnp.sum((ar <= r[..., None]) & valid[..., None], axis=1)
    accepts = jnp.sum((ar == r[..., None]) & valid[..., None], axis=1)
    if accepted_nodes.shape[1] > 0:
        last = jnp.take_along_axis(accepted_nodes, jnp.maximum(n_accepted - 1, 0)[:, None], axis=1)[:, 0]
        stop = jnp.where(n_accepted > 0, last, 0)
    else:
        stop = jnp.zeros_like(n_accepted)
    tries = tries + (ar < nch_tbl[stop][:, None])
    if active is not None:
        tries = tries * active[:, None]
        accepts = accepts * active[:, None]
    return jnp.sum(tries, 0).astype(jnp.int32), jnp.sum(accepts, 0).astype(jnp.int32)


# --------------------------------------------------------------------------- tree-shape search


def _rank_probs(acceptance_by_rank: Sequence[float]) -> np.ndarray:
    """P_r = a_r * prod_{s<r} (1 - a_s): probability that the child of rank r is the
    accepted one (given that its parent was accepted)."""
    a = np.clip(np.asarray(acceptance_by_rank, np.float64), 0.0, 1.0)
    surv = np.concatenate([[1.0], np.cumprod(1.0 - a)[:-1]])
    return a * surv


def expected_accepted(tree: Any, acceptance_by_rank: Sequence[float]) -> float:
    """Expected number of accepted drafted nodes per round (the bonus token not counted)
    under the positional acceptance model of :func:`search_tree`:
    ``sum over non-root nodes v of prod_{edges e on root->v} P_{rank(e)}``."""
    tree = as_tree(tree)
    P = _rank_probs(acceptance_by_rank)
    reach = np.zeros(tree.num_nodes)
    reach[0] = 1.0
    for i in range(1, tree.num_nodes):
        r = int(tree.sibling_rank[i])
        reach[i] = reach[tree.parents_tuple[i]] * (P[r] if r < len(P) else 0.0)
    return float(reach[1:].sum())


@dataclasses.dataclass(frozen=True)
class TreeSearchResult:
    parents: tuple[int, ...]
    expected_tokens_per_step: float  # accepted drafts + 1 (the bonus / correction token)
    seconds_per_step: float  # verify step + drafting
    tokens_per_second: float

    @property
    def tree(self) -> TokenTree:
        return TokenTree(self.parents)


def _cost_fn(step_cost: Callable[[int], float] | Sequence[float]) -> Callable[[int], float]:
    if callable(step_cost):
        return lambda n: float(step_cost(n))
    table = list(step_cost)
    return lambda n: float(table[n])


def search_tree(
    acceptance_by_rank: Sequence[float],
    node_budget: int,
    step_cost: Callable[[int], float] | Sequence[float],
    draft_cost_per_level: float | Callable[[int], float] = 0.0,
    max_depth: int | None = None,
) -> TreeSearchResult:
    """Sequoia-style dynamic program for the tree with the most expected tokens/second.

    Model (positional acceptance, as in Sequoia):

    * ``acceptance_by_rank[r] = a_r`` is the probability that the child of sibling rank r
      is accepted, given that its parent was accepted and the siblings of ranks 0..r-1
      were tried and rejected (the verifier tries children in rank order). It depends on
      nothing else (not on depth, not on the tokens). Nodes get at most ``len(a)``
      children. Measure it with :func:`rank_acceptance_counts`.
    * So the rank-r child is *the* accepted child with probability
      ``P_r = a_r prod_{s<r}(1 - a_s)``, and a node is on the accepted path with
      probability ``prod P_rank`` over its root path; expected tokens per step is
      ``1 + sum_{v != root} prod P``.
    * One round costs ``step_cost(n)`` (verifying an n-node tree, root included; a
      callable or a table indexed by n) plus drafting: ``draft_cost_per_level * depth``
      (one draft forward per level; or a callable of the depth).

    DP: ``T[d][n]`` = max expected accepted nodes of a subtree with exactly n nodes and
    depth <= d. A node's children form ranks 0..k-1 (contiguous); ``G(r, m)`` = best
    value of the children of ranks >= r using m nodes in total:
    ``G(r, m) = max(0 if m == 0, max_{1<=s<=m} P_r (1 + T[d-1][s]) + G(r+1, m-s))`` and
    ``T[d][n] = G(0, n-1)``. Then maximize ``(1 + T[d][n]) / cost(n, d)`` over
    ``n <= node_budget``, ``d <= max_depth``. O(max_depth * R * budget^2), numpy.
    """
    if node_budget < 1:
        raise ValueError("node_budget must be >= 1")
    P = _rank_probs(acceptance_by_rank)
    R = len(P)
    n_max = int(node_budget)
    D = n_max - 1 if max_depth is None else min(int(max_depth), n_max - 1)
    cost = _cost_fn(step_cost)
    dcost = draft_cost_per_level if callable(draft_cost_per_level) else (lambda d: float(draft_cost_per_level) * d)

    NEG = -np.inf
    m_idx = np.arange(n_max)  # m = total nodes given to children (0..n_max-1)
    s_idx = np.arange(1, n_max)  # subtree size of one child
    T_prev = np.full(n_max + 1, NEG)
    T_prev[1] = 0.0  # depth 0: only the single-node subtree
    T_by_depth = [T_prev]
    choices = [None]  # choices[d][r][m] = size of the rank-r child (0 = no more children)
    best = (1.0 / (cost(1) + dcost(0)), 0, 1)
    for d in range(1, D + 1):
        G_next = np.where(m_idx == 0, 0.0, NEG)  # G(R, m)
        ch_d = [None] * R
        for r in range(R - 1, -1, -1):
            # value of a rank-r child of size s, [n_max-1] (an infeasible size stays -inf: a
            # zero acceptance times -inf would be NaN, which argmax would pick)
            T_s = T_prev[1:n_max]
            with np.errstate(invalid="ignore"):
                A = np.where(T_s > NEG, P[r] * (1.0 + T_s), NEG)
            # cand[m, s] = A[s] + G_next[m - s] for 1 <= s <= m
            diff = m_idx[:, None] - s_idx[None, :]
            ok = diff >= 0
            cand = np.where(ok, A[None, :] + G_next[np.clip(diff, 0, None)], NEG)
            with np.errstate(invalid="ignore"):
                arg = np.argmax(cand, axis=1) if cand.shape[1] else np.zeros(n_max, int)
            val = cand[m_idx, arg] if cand.shape[1] else np.full(n_max, NEG)
            stop = m_idx == 0  # G(r, 0) = 0: no child of rank r
            use = ~stop & (val > NEG)
            G = np.where(stop, 0.0, np.where(use, val, NEG))
            ch_d[r] = np.where(use, s_idx[arg] if len(s_idx) else 0, 0)
            G_next = G
        T = np.full(n_max + 1, NEG)
        T[1:] = G_next  # T[n] = G(0, n-1)
        T_by_depth.append(T)
        choices.append(ch_d)
        for n in range(1, n_max + 1):
            if T[n] > NEG:
                tps = (1.0 + T[n]) / (cost(n) + dcost(d))
                if tps > best[0] * (1 + 1e-12):
                    best = (tps, d, n)
        T_prev = T

    _, d_best, n_best = best
    # Rebuild the tree: children sizes per node, then a level-order layout.
    def build(d: int, n: int):  # -> list of child subtrees, each (d-1, size)
        out = []
        m, r = n - 1, 0
        while m > 0:
            s = int(choices[d][r][m])
            out.append((d - 1, s))
            m -= s
            r += 1
        return out

    parents = [-1]
    frontier = [(0, d_best, n_best)]  # (node index, depth budget, size)
    while frontier:
        nxt = []
        for node, d, n in frontier:
            if n > 1:
                for dd, s in build(d, n):
                    parents.append(node)
                    nxt.append((len(parents) - 1, dd, s))
        frontier = nxt
    tree = TokenTree(tuple(parents))
    e = expected_accepted(tree, acceptance_by_rank)
    secs = cost(tree.num_nodes) + dcost(tree.max_depth)
    return TreeSearchResult(tuple(parents), 1.0 + e, secs, (1.0 + e) / secs)


def optimize_tree(
    acceptance_by_rank: Sequence[float],
    node_budget: int,
    step_cost: Callable[[int], float] | Sequence[float],
    draft_cost_per_level: float | Callable[[int], float] = 0.0,
    max_depth: int | None = None,
) -> list[int]:
    """The parents list of :func:`search_tree`'s best tree."""
    return list(search_tree(acceptance_by_rank, node_budget, step_cost, draft_cost_per_level, max_depth).parents)
