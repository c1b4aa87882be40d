"""Tests of jaxspec.tree: topology tables, KV compaction, tree-shape optimizer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.tree import (
    TokenTree,
    as_tree,
    compact_path,
    expected_accepted,
    optimize_tree,
    rank_acceptance_counts,
    search_tree,
)

SHAPES = [(), (1,), (4,), (1, 1, 3, 1, 1, 1, 1, 1), (2, 2, 2), (8,) + (1,) * 15, (4, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1)]


def brute_ancestors(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@pytest.mark.parametrize("expansion", SHAPES)
def test_tables_are_consistent(expansion):
    t = TokenTree.from_expansion(expansion)
    N = t.num_nodes
    sizes = [1]
    for k in expansion:
        sizes.append(sizes[-1] * k)
    assert N == sum(sizes)
    par, dep = t.parents, t.depths
    assert par[0] == -1 and all(par[i] < i for i in range(1, N))
    assert np.all(np.diff(dep) >= 0)  # level by level
    assert t.max_depth == (len(expansion) if sizes[-1] else 0)
    for i in range(N):
        anc = brute_ancestors(par, i)
        assert set(np.nonzero(t.ancestor_mask[i])[0].tolist()) == anc  # ancestors incl. self
        assert dep[i] == len(anc) - 1  # position offset = depth
        path = t.ancestor_at_depth[i]
        assert set(path[path >= 0].tolist()) == anc and np.all(dep[path[: dep[i] + 1]] == np.arange(dep[i] + 1))
    for d, (a, b) in enumerate(t.levels):
        assert np.all(dep[a:b] == d) and b - a == sizes[d]
    for i, ch in enumerate(t.children):
        assert all(par[c] == i for c in ch) and list(ch) == sorted(ch)
        assert list(t.sibling_rank[list(ch)]) == list(range(len(ch)))
        row = t.children_padded[i]
        assert list(row[row >= 0]) == list(ch) and np.all(row[len(ch):] == -1)
    assert int(t.num_children.sum()) == N - 1
    if expansion == (1, 1, 3, 1, 1, 1, 1, 1):
        assert N == 21


def test_chain_hash_and_static_jit_argument():
    c = TokenTree.chain(5)
    assert c == TokenTree.from_parents([-1, 0, 1, 2, 3, 4]) and c.max_depth == 5 and c.max_children == 1
    assert hash(c) == hash(TokenTree.from_expansion((1,) * 5))
    assert as_tree([-1, 0, 0]) == TokenTree.from_expansion((2,))
    big = TokenTree.from_expansion((8,) + (1,) * 15)
    assert big.num_nodes == 129 and big.max_depth == 16 and big.max_children == 8

    @functools.partial(jax.jit, static_argnums=0)
    def f(tree, x):
        return x + jnp.asarray(tree.depths).sum()

    assert int(f(big, 0)) == int(big.depths.sum())
    with pytest.raises(AttributeError):
        big.parents_tuple = (-1,)  # frozen
    assert not big.parents.flags.writeable


def test_parents_must_be_ints():
    """A float or bool parent was truncated (1.7 -> 1, False -> 0): a tree file's typo changed
    the tree silently."""
    for bad in ([-1, 0, 1.7], [-1, 0, False]):
        with pytest.raises(ValueError, match="ints"):
            TokenTree.from_parents(bad)
    assert TokenTree.from_parents(np.array([-1, 0, 1])).parents_tuple == (-1, 0, 1)


@pytest.mark.parametrize(
    "parents", [[0], [-1, 1], [-1, 0, 3, 0], [-1, 0, 1, 0]]  # bad root, self-parent, child first, not level order
)
def test_invalid_parents_raise(parents):
    with pytest.raises(ValueError):
        TokenTree.from_parents(parents)


def _random_paths(rng, tree, B):
    node = rng.integers(0, tree.num_nodes, B)
    acc = tree.ancestor_at_depth[node, 1:]
    return tree.depths[node], acc


def test_compact_path_matches_numpy_loop():
    rng = np.random.default_rng(0)
    tree = TokenTree.from_expansion((3, 2, 2, 1))
    L, B, K, S, D = 2, 5, 2, 64, 3
    cache = rng.normal(size=(L, B, K, S, D)).astype(np.float32)
    n, acc = _random_paths(rng, tree, B)
    base = rng.integers(0, S - tree.num_nodes, B)
    base[0] = S - 3  # destinations/sources past the end must not crash (dropped / clamped)
    want = cache.copy()
    for b in range(B):
        for j in range(n[b]):
            if base[b] + 1 + j < S:
                want[:, b, :, base[b] + 1 + j] = cache[:, b, :, min(base[b] + acc[b, j], S - 1)]
    f = jax.jit(functools.partial(compact_path, slot_axis=3, batch_axis=1))
    got = np.asarray(f(jnp.asarray(cache), jnp.asarray(acc), jnp.asarray(base)))
    np.testing.assert_array_equal(got[:, 1:], want[:, 1:])
    # rows in bounds are exact; the first row only where defined
    np.testing.assert_array_equal(got[:, 0, :, : S - 2], want[:, 0, :, : S - 2])

    # [B, S, H, D] pytree, path given with the root (dst_offset=0)
    kv = {"k": rng.normal(size=(B, S, 2, 4)).astype(np.float32), "v": rng.normal(size=(B, S, 2, 4)).astype(np.float32)}
    base = rng.integers(0, S - tree.num_nodes, B)
    path = np.concatenate([np.zeros((B, 1), np.int32), acc], 1)
    out = compact_path(jax.tree.map(jnp.asarray, kv), jnp.asarray(path), jnp.asarray(base), slot_axis=1, batch_axis=0, dst_offset=0)
    for name in kv:
        w = kv[name].copy()
        for b in range(B):
            for j in range(n[b] + 1):
                w[b, base[b] + j] = kv[name][b, base[b] + path[b, j]]
        np.testing.assert_array_equal(np.asarray(out[name]), w)


def test_rank_acceptance_counts():
    rng = np.random.default_rng(1)
    tree = TokenTree.from_expansion((3, 2, 1))
    B = 40
    n, acc = _random_paths(rng, tree, B)
    active = rng.random(B) < 0.8
    tries, accepts = jax.jit(rank_acceptance_counts, static_argnums=0)(tree, jnp.asarray(n), jnp.asarray(acc), jnp.asarray(active))
    want_t, want_a = np.zeros(3, int), np.zeros(3, int)
    for b in range(B):
        if not active[b]:
            continue
        stop = 0
        for j in range(n[b]):
            r = tree.sibling_rank[acc[b, j]]
            want_t[: r + 1] += 1
            want_a[r] += 1
            stop = acc[b, j]
        want_t[: len(tree.children[stop])] += 1
    np.testing.assert_array_equal(tries, want_t)
    np.testing.assert_array_equal(accepts, want_a)


# --------------------------------------------------------------------------- optimizer


def simulate_accepted(tree, a, n_walks, rng):
    """Monte Carlo of the positional acceptance model: children tried in rank order, the
    rank-r child accepted with probability a[r]."""
    a = np.concatenate([np.asarray(a, float), np.zeros(max(0, tree.max_children - len(a)))])
    ch = tree.children_padded
    W = ch.shape[1]
    cur = np.zeros(n_walks, int)
    total = np.zeros(n_walks)
    alive = np.ones(n_walks, bool)
    for _ in range(tree.max_depth):
        kids = ch[cur]
        hit = (rng.random((n_walks, W)) < a[:W]) & (kids >= 0) & alive[:, None]
        any_hit = hit.any(1)
        alive = any_hit
        first = np.argmax(hit, 1)
        cur = np.where(any_hit, kids[np.arange(n_walks), first], cur)
        total += any_hit
        if not any_hit.any():
            break
    return total


@pytest.mark.parametrize("expansion", [(1, 1, 1), (3, 2, 1, 1), (4, 2, 2)])
def test_expected_accepted_matches_monte_carlo(expansion):
    tree = TokenTree.from_expansion(expansion)
    a = [0.6, 0.35, 0.2, 0.1]
    rng = np.random.default_rng(2)
    sim = simulate_accepted(tree, a, 200_000, rng)
    e = expected_accepted(tree, a)
    assert abs(sim.mean() - e) < 5 * sim.std() / np.sqrt(len(sim)) + 1e-9
    if expansion == (1, 1, 1):
        assert e == pytest.approx(0.6 + 0.36 + 0.216)


def test_optimizer_tree_from_its_dp_is_also_correct_under_simulation():
    a = [0.55, 0.3, 0.2, 0.15]
    res = search_tree(a, 40, lambda n: 1.0 + 0.002 * n, draft_cost_per_level=0.03)
    tree = res.tree
    sim = simulate_accepted(tree, a, 200_000, np.random.default_rng(3))
    assert abs(1 + sim.mean() - res.expected_tokens_per_step) < 5 * sim.std() / np.sqrt(len(sim))
    assert tree.num_nodes <= 40
    assert res.tokens_per_second == pytest.approx(res.expected_tokens_per_step / res.seconds_per_step)


def test_optimizer_returns_chain_when_lower_ranks_never_accept():
    parents = optimize_tree([0.8, 1e-6, 1e-6], 24, lambda n: 1.0 + 0.01 * n, draft_cost_per_level=0.02)
    t = TokenTree.from_parents(parents)
    assert t.max_children == 1 and t.num_nodes > 3
    assert t == TokenTree.chain(t.max_depth)


def test_optimizer_goes_wide_when_siblings_accept_often():
    parents = optimize_tree([0.5, 0.5, 0.5, 0.5], 32, [1.0] * 33)
    t = TokenTree.from_parents(parents)
    assert t.max_children >= 3 and t.num_nodes == 32
    # wider beats the chain of the same budget under the model
    assert expected_accepted(t, [0.5] * 4) > expected_accepted(TokenTree.chain(31), [0.5] * 4)


def _ordered_trees(n, width):
    """All ordered rooted trees with exactly n nodes (children lists), width-limited."""

    @functools.lru_cache(None)
    def forests(m, w):
        if m == 0:
            return [()]
        if w == 0:
            return []
        out = []
        for s in range(1, m + 1):
            for first in trees(s):
                for rest in forests(m - s, w - 1):
                    out.append((first,) + rest)
        return out

    @functools.lru_cache(None)
    def trees(k):
        return [f for f in forests(k - 1, width)]

    return trees(n)


def _to_parents(t):
    parents, frontier = [-1], [(0, t)]
    while frontier:
        nxt = []
        for idx, kids in frontier:
            for k in kids:
                parents.append(idx)
                nxt.append((len(parents) - 1, k))
        frontier = nxt
    return parents


# (a rank that never accepts: its zero times an infeasible -inf was NaN, which argmax picked)
@pytest.mark.parametrize("a,dcost", [([0.7, 0.4, 0.3], 0.05), ([0.9, 0.05], 0.0), ([0.3, 0.3, 0.3], 0.2),
                                     ([0.5, 0.0, 0.8], 0.1)])
def test_optimizer_is_optimal_against_brute_force(a, dcost):
    budget = 8
    cost = lambda n: 1.0 + 0.04 * n  # noqa: E731
    best = 0.0
    for n in range(1, budget + 1):
        for t in _ordered_trees(n, len(a)):
            tree = TokenTree.from_parents(_to_parents(t))
            v = (1 + expected_accepted(tree, a)) / (cost(n) + dcost * tree.max_depth)
            best = max(best, v)
    res = search_tree(a, budget, cost, dcost)
    assert res.tokens_per_second == pytest.approx(best, rel=1e-9)
