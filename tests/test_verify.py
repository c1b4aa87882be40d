"""Tests of jaxspec.verify: greedy walks, and exact-distribution tests of speculative sampling
(chains and trees, all child-selection modes) with deliberately wrong verifiers shown to fail.

The distribution tests use a toy "language model": a next-token table indexed by the
whole context (V = 4, contexts up to length 3), one table for the target (P) and a clearly
different one for the draft (Q), with some zero entries (as top-k leaves). Many rows (one
batched call) each run one speculative round from the same root; the committed tokens are
extended to K tokens by sampling the target table directly (what later rounds do, by
induction), and the empirical distribution of the K-token prefix is compared with the
target's exact joint distribution (enumerated) by a chi-square test at ALPHA.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.sampling import SamplingParams, draft_children, probs_from_logits
from jaxspec.tree import TokenTree
from jaxspec.verify import verify_chain, verify_greedy, verify_tree, verify_tree_greedy
from jaxspec import verify as verify_mod

ALPHA = 1e-3
V = 4
K = 4  # committed-prefix length compared
MAXLEN = 3  # contexts up to this many tokens
ROWS = 200_000

jit_chain = jax.jit(verify_chain)
jit_tree = jax.jit(verify_tree, static_argnames=("tree", "mode"))
jit_tree_greedy = jax.jit(verify_tree_greedy, static_argnums=0)


def chi2_pvalue(counts, probs):
    counts = np.asarray(counts, np.float64).ravel()
    exp = np.asarray(probs, np.float64).ravel() * counts.sum()
    if np.any(counts[exp == 0] > 0):
        return 0.0  # an impossible outcome
    keep = exp > 0
    counts, exp = counts[keep], exp[keep]
    small = exp < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    return stats.chisquare(counts, exp * counts.sum() / exp.sum()).pvalue


# --------------------------------------------------------------------------- toy model


def n_contexts(max_len=MAXLEN):
    return sum(V**l for l in range(max_len + 1))


def child_code(code, tok):
    """Bijective base-V code of a context extended by one token (root context = 0)."""
    return code * V + tok + 1


def make_table(rng, scale, zero_frac):
    logits = rng.normal(0, scale, (n_contexts(), V))
    zero = rng.random((n_contexts(), V)) < zero_frac
    zero[np.arange(n_contexts()), rng.integers(0, V, n_contexts())] = False  # keep >= 1 token
    p = np.where(zero, 0.0, np.exp(logits))
    return (p / p.sum(1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def tables():
    rng = np.random.default_rng(1234)
    return make_table(rng, 1.2, 0.25), make_table(rng, 1.2, 0.25)  # target P, draft Q


def draw(rng, probs):
    """One inverse-CDF draw per row of probs [B, V] (numpy, float64)."""
    cdf = np.cumsum(probs.astype(np.float64), 1)
    u = rng.random(len(probs)) * cdf[:, -1]
    return np.minimum((cdf <= u[:, None]).sum(1), V - 1)


def exact_joint(P):
    """Target probability of every K-token sequence, [V] * K."""
    out = np.ones([V] * K)
    for seq in np.ndindex(*[V] * K):
        code, pr = 0, 1.0
        for t in seq:
            pr *= P[code, t]
            code = child_code(code, t)
        out[seq] = pr
    return out


def prefix_counts(rng, P, path_tokens, n, nxt):
    """Counts of the first K committed tokens: the round's path[:n] + next, completed by
    ancestral sampling from the target table."""
    B = len(n)
    seq = np.zeros((B, K), np.int64)
    code = np.zeros(B, np.int64)
    for j in range(K):
        from_round = np.where(j < n, path_tokens[:, min(j, path_tokens.shape[1] - 1)] if path_tokens.shape[1] else 0, nxt)
        fresh = draw(rng, P[code])
        tok = np.where(j <= n, from_round, fresh)
        seq[:, j] = tok
        code = child_code(code, tok)
    idx = np.ravel_multi_index(tuple(seq.T), [V] * K)
    return np.bincount(idx, minlength=V**K)


# --------------------------------------------------------------------------- greedy


def test_verify_greedy_hand_made():
    # target argmax per position: rows of one-hots
    tgt = np.array([[2, 1, 3, 0], [2, 1, 3, 0], [2, 1, 3, 0]])
    logits = jax.nn.one_hot(tgt, 5) * 3.0
    drafts = np.array([[2, 1, 3], [2, 0, 3], [1, 1, 3]])
    n, nxt = verify_greedy(jnp.asarray(drafts), logits)
    np.testing.assert_array_equal(n, [3, 1, 0])
    np.testing.assert_array_equal(nxt, [0, 1, 2])


def test_verify_greedy_random_against_loop_and_one_hot_sampling():
    rng = np.random.default_rng(0)
    B, g, Vb = 300, 5, 11
    logits = rng.normal(size=(B, g + 1, Vb)).astype(np.float32)
    am = logits.argmax(-1)
    drafts = np.where(rng.random((B, g)) < 0.75, am[:, :g], rng.integers(0, Vb, (B, g)))
    n, nxt = jax.jit(verify_greedy)(jnp.asarray(drafts), jnp.asarray(logits))
    for b in range(B):
        k = 0
        while k < g and drafts[b, k] == am[b, k]:
            k += 1
        assert n[b] == k and nxt[b] == am[b, k]
    # the sampling verifier with one-hot p (temperature 0) and one-hot q == greedy exactly
    sp = SamplingParams.greedy(B)
    p = probs_from_logits(jnp.asarray(logits), sp)
    q = jax.nn.one_hot(drafts, Vb)
    for key in range(3):
        n2, nxt2 = jit_chain(jax.random.key(key), jnp.asarray(drafts), q, p)
        np.testing.assert_array_equal(n2, n)
        np.testing.assert_array_equal(nxt2, nxt)
    # ... also when q is an arbitrary distribution, or the drafts are declared deterministic
    q_rand = jax.nn.softmax(jnp.asarray(rng.normal(size=(B, g, Vb)), jnp.float32))
    for qq in (q_rand, None):
        n3, nxt3 = jit_chain(jax.random.key(7), jnp.asarray(drafts), qq, p)
        np.testing.assert_array_equal(n3, n)
        np.testing.assert_array_equal(nxt3, nxt)


def greedy_walk(tree, tokens, am):
    cur, path = 0, []
    while True:
        nxt = [c for c in tree.children[cur] if tokens[c] == am[cur]]
        if not nxt:
            return path, am[cur]
        cur = nxt[0]
        path.append(cur)


def test_verify_tree_greedy_hand_made():
    tree = TokenTree.from_expansion((2, 2))  # 0 -> 1, 2; 1 -> 3, 4; 2 -> 5, 6
    am = np.array([7, 3, 5, 1, 1, 2, 2])  # target argmax at each node
    logits = jax.nn.one_hot(am, 9)[None]
    toks = np.array([[0, 8, 7, 1, 1, 2, 5]])  # node 2 (tok 7) matches am[0]; then node 6 (tok 5) = am[2]
    n, acc, nxt = verify_tree_greedy(tree, jnp.asarray(toks), logits)
    assert int(n[0]) == 2 and list(acc[0]) == [2, 6] and int(nxt[0]) == am[6]
    toks2 = np.array([[0, 1, 2, 3, 4, 5, 6]])  # nothing matches at the root
    n, acc, nxt = verify_tree_greedy(tree, jnp.asarray(toks2), logits)
    assert int(n[0]) == 0 and list(acc[0]) == [-1, -1] and int(nxt[0]) == 7


def random_greedy_case(rng, tree, B, Vb, hit=0.6):
    """Random target logits and distinct sibling tokens; with probability `hit` one sibling
    is the target argmax at its parent."""
    N = tree.num_nodes
    logits = rng.normal(size=(B, N, Vb)).astype(np.float32)
    am = logits.argmax(-1)
    toks = np.zeros((B, N), np.int64)
    toks[:, 0] = rng.integers(0, Vb, B)
    for i, ch in enumerate(tree.children):
        if not ch:
            continue
        perm = np.argsort(rng.random((B, Vb)), 1)[:, : len(ch)]
        # drop the argmax unless chosen, then maybe place it at a random slot
        for b in range(B):
            row = [t for t in perm[b] if t != am[b, i]]
            extra = [t for t in range(Vb) if t != am[b, i] and t not in row]
            row = (row + extra)[: len(ch)]
            if rng.random() < hit:
                row[rng.integers(0, len(ch))] = am[b, i]
            toks[b, list(ch)] = row
    return toks, logits, am


@pytest.mark.parametrize("expansion", [(3, 2, 1), (1, 4, 1, 2)])
def test_tree_greedy_and_one_hot_sampling_modes_match_walk(expansion):
    rng = np.random.default_rng(sum(expansion))
    tree = TokenTree.from_expansion(expansion)
    B, Vb = 128, 12
    toks, logits, am = random_greedy_case(rng, tree, B, Vb)
    n, acc, nxt = jit_tree_greedy(tree, jnp.asarray(toks), jnp.asarray(logits))
    for b in range(B):
        path, last = greedy_walk(tree, toks[b], am[b])
        assert int(n[b]) == len(path) and list(acc[b, : len(path)]) == path and np.all(acc[b, len(path):] == -1)
        assert int(nxt[b]) == last
    p = probs_from_logits(jnp.asarray(logits), SamplingParams.greedy(B))
    q_rand = jax.nn.softmax(jnp.asarray(rng.normal(size=(B, tree.num_nodes, Vb)) * 2, jnp.float32))
    q_hot = jax.nn.one_hot(jnp.asarray(toks)[:, tree.children_padded[:, 0].clip(0)], Vb)  # q = first child
    for mode in ("iid", "without_replacement", "deterministic"):
        for q in (q_rand, q_hot):
            n2, acc2, nxt2 = jit_tree(jax.random.key(3), tree, jnp.asarray(toks), q, p, mode=mode)
            np.testing.assert_array_equal(n2, n)
            np.testing.assert_array_equal(acc2, acc)
            np.testing.assert_array_equal(nxt2, nxt)


def test_big_tree_compiles_and_walks():
    """129 nodes, width 8, depth 16: compiles once (lax loops), valid paths, greedy-exact
    with one-hot rows."""
    import time

    tree = TokenTree.from_expansion((8,) + (1,) * 15)
    assert tree.num_nodes == 129 and tree.max_depth == 16
    rng = np.random.default_rng(5)
    B, Vb = 16, 32
    toks, logits, am = random_greedy_case(rng, tree, B, Vb, hit=0.9)
    # make long accepted paths likely in the greedy case
    for b in range(B):
        for i in range(1, tree.num_nodes):
            if tree.depths[i] >= 2 and rng.random() < 0.9:
                toks[b, i] = am[b, tree.parents[i]]
    n, acc, nxt = jit_tree_greedy(tree, jnp.asarray(toks), jnp.asarray(logits))
    for b in range(B):
        path, last = greedy_walk(tree, toks[b], am[b])
        assert int(n[b]) == len(path) and int(nxt[b]) == last
    assert int(n.max()) >= 8
    p_hot = probs_from_logits(jnp.asarray(logits), SamplingParams.greedy(B))
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(B, tree.num_nodes, Vb)), jnp.float32))
    t0 = time.perf_counter()
    n2, acc2, nxt2 = jit_tree(jax.random.key(0), tree, jnp.asarray(toks), q, p_hot, mode="without_replacement")
    assert time.perf_counter() - t0 < 30
    np.testing.assert_array_equal(n2, n)
    np.testing.assert_array_equal(acc2, acc)
    np.testing.assert_array_equal(nxt2, nxt)
    # sampling rows: paths are valid root paths
    p = jax.nn.softmax(jnp.asarray(rng.normal(size=(B, tree.num_nodes, Vb)), jnp.float32))
    n3, acc3, _ = jit_tree(jax.random.key(1), tree, jnp.asarray(toks), q, p, mode="iid")
    for b in range(B):
        path = [0] + [int(x) for x in acc3[b, : int(n3[b])]]
        assert all(tree.parents[path[j + 1]] == path[j] for j in range(len(path) - 1))
        assert np.all(np.asarray(acc3[b, int(n3[b]):]) == -1)


# --------------------------------------------------------------------------- chain sampling


def chain_round(tables, rng, g, deterministic=False, ablate=None, seed=0, verifier=None):
    """One round of chain verification of drafts drawn from ``Q`` against ``P`` (counts of the
    committed prefixes). ``ablate``: a wrong verifier, to show the test has power:
    ``"always_accept"`` verifies against the draft's own distribution (the target ignored),
    ``"no_residual"`` needs ``verifier`` compiled with the residual step removed."""
    P, Q = tables
    code = np.zeros(ROWS, np.int64)
    drafts, dprobs, tprobs = [], [], []
    for _ in range(g):
        q = Q[code]
        d = q.argmax(1) if deterministic else draw(rng, q)
        drafts.append(d)
        dprobs.append(q)
        tprobs.append(P[code])
        code = child_code(code, d)
    tprobs.append(P[code])
    drafts = np.stack(drafts, 1)
    if ablate == "always_accept":
        tprobs = dprobs + [tprobs[-1]]
    n, nxt = (verifier or jit_chain)(
        jax.random.key(seed),
        jnp.asarray(drafts),
        None if deterministic else jnp.asarray(np.stack(dprobs, 1)),
        jnp.asarray(np.stack(tprobs, 1)),
    )
    n, nxt = np.asarray(n), np.asarray(nxt)
    return prefix_counts(rng, P, drafts, n, nxt), n


@pytest.mark.parametrize("g,deterministic", [(3, False), (1, False), (3, True)])
def test_chain_sampling_matches_target_distribution(tables, g, deterministic):
    rng = np.random.default_rng(10 + g)
    counts, n = chain_round(tables, rng, g, deterministic)
    pv = chi2_pvalue(counts, exact_joint(tables[0]))
    assert pv > ALPHA, pv
    assert 0 < n.mean() < g  # the test exercises both acceptance and rejection


@pytest.mark.parametrize("ablate", ["always_accept", "no_residual"])
def test_chain_wrong_verifiers_fail(tables, ablate, monkeypatch):
    rng = np.random.default_rng(20)
    verifier = None
    if ablate == "no_residual":  # a rejection resamples from p, not from norm(max(0, p - q))
        monkeypatch.setattr(verify_mod, "_residual", lambda p, q, invariant=False: p)
        # a new function object: jit's trace cache is keyed on it, and would serve the real one
        verifier = jax.jit(lambda *a: verify_mod.verify_chain(*a))
    counts, _ = chain_round(tables, rng, 3, ablate=ablate, verifier=verifier)
    assert chi2_pvalue(counts, exact_joint(tables[0])) < ALPHA


# --------------------------------------------------------------------------- tree sampling


def draft_tree(rng, tree, Q, mode):
    """Children of every node drawn by the engine's rule for `mode` (numpy reference)."""
    N = tree.num_nodes
    toks = np.zeros((ROWS, N), np.int64)
    code = np.zeros((ROWS, N), np.int64)
    for i, ch in enumerate(tree.children):
        if not ch:
            continue
        q = Q[code[:, i]].astype(np.float64)
        if mode == "deterministic":
            kids = np.argsort(-q, axis=1, kind="stable")[:, : len(ch)]
        elif mode == "iid":
            kids = np.stack([draw(rng, q) for _ in ch], 1)
        else:  # without replacement, sequentially; zero-probability fillers once q is exhausted
            used = np.zeros_like(q, bool)
            kids = []
            for _ in ch:
                qq = np.where(used, 0.0, q)
                empty = qq.sum(1) <= 0
                x = np.where(empty, np.argmax(~used, 1), draw(rng, np.where(empty[:, None], 1.0, qq)))
                used[np.arange(ROWS), x] = True
                kids.append(x)
            kids = np.stack(kids, 1)
        for j, c in enumerate(ch):
            toks[:, c] = kids[:, j]
            code[:, c] = child_code(code[:, i], kids[:, j])
    return toks, code


def tree_round(tables, tree, mode, ablate=None, seed=0, verifier=None):
    """One round of tree verification; ``ablate`` as in `chain_round`."""
    P, Q = tables
    rng = np.random.default_rng(seed)
    toks, code = draft_tree(rng, tree, Q, mode)
    n, acc, nxt = (verifier or jit_tree)(
        jax.random.key(seed),
        tree,
        jnp.asarray(toks),
        None if mode == "deterministic" else jnp.asarray(Q[code]),
        jnp.asarray((Q if ablate == "always_accept" else P)[code]),
        mode=mode,
    )
    n, acc, nxt = map(np.asarray, (n, acc, nxt))
    path_toks = np.take_along_axis(toks, np.maximum(acc, 0), 1)
    return prefix_counts(rng, P, path_toks, n, nxt), n


TREES = {"wide": (3, 2, 1), "bushy": (2, 2, 2), "chainlike": (1, 3, 1)}


@pytest.mark.parametrize("mode", ["iid", "without_replacement", "deterministic"])
@pytest.mark.parametrize("shape", ["wide", "bushy"])
def test_tree_sampling_matches_target_distribution(tables, mode, shape):
    tree = TokenTree.from_expansion(TREES[shape])
    counts, n = tree_round(tables, tree, mode, seed=31 * len(mode) + len(shape))
    pv = chi2_pvalue(counts, exact_joint(tables[0]))
    assert pv > ALPHA, pv
    assert 0.3 < n.mean() < tree.max_depth - 0.3


@pytest.mark.parametrize(
    "mode,ablate",
    [
        ("iid", "keep_p"),  # MSS without updating p to the residual
        ("iid", "always_accept"),
        ("deterministic", "keep_p"),
        # forgetting to remove x from q: test_without_replacement_drafts_verified_as_iid_fail
    ],
)
def test_tree_wrong_verifiers_fail(tables, mode, ablate, monkeypatch):
    tree = TokenTree.from_expansion(TREES["wide"])
    verifier = None
    if ablate == "keep_p":
        monkeypatch.setattr(verify_mod, "_residual", lambda p, q, invariant=False: p)

        def wrong(rng, tree, *a, mode):  # a new function object (see the chain test)
            return verify_mod.verify_tree(rng, tree, *a, mode=mode)

        verifier = jax.jit(wrong, static_argnames=("tree", "mode"))
    counts, _ = tree_round(tables, tree, mode, ablate=ablate, seed=5, verifier=verifier)
    assert chi2_pvalue(counts, exact_joint(tables[0])) < ALPHA


def test_without_replacement_drafts_verified_as_iid_fail(tables):
    """Verifying children drawn without replacement with the iid rule is biased."""
    P, Q = tables
    tree = TokenTree.from_expansion(TREES["wide"])
    rng = np.random.default_rng(6)
    toks, code = draft_tree(rng, tree, Q, "without_replacement")
    n, acc, nxt = map(
        np.asarray, jit_tree(jax.random.key(6), tree, jnp.asarray(toks), jnp.asarray(Q[code]), jnp.asarray(P[code]), mode="iid")
    )
    counts = prefix_counts(rng, P, np.take_along_axis(toks, np.maximum(acc, 0), 1), n, nxt)
    assert chi2_pvalue(counts, exact_joint(P)) < ALPHA


@pytest.mark.parametrize("mode", ["iid", "without_replacement"])
def test_engine_path_draft_children_then_verify_tree(tables, mode):
    """Children drawn level by level with jaxspec.sampling.draft_children (what the engine
    calls), then verify_tree: still the target's distribution."""
    P, Q = tables
    tree = TokenTree.from_expansion((3, 2, 1))
    rng = np.random.default_rng(77)
    sp = SamplingParams.make(ROWS, 1.0)
    draft = jax.jit(draft_children, static_argnums=(3, 4))
    toks = np.zeros((ROWS, tree.num_nodes), np.int64)
    code = np.zeros((ROWS, tree.num_nodes), np.int64)
    key = jax.random.key(8)
    for a, b in tree.levels[:-1]:
        k = len(tree.children[a])
        with np.errstate(divide="ignore"):
            logits = np.log(Q[code[:, a:b]])
        key, sub = jax.random.split(key)
        kids, _ = draft(sub, jnp.asarray(logits, jnp.float32), sp, k, mode)
        kids = np.asarray(kids)
        for i in range(a, b):
            for j, c in enumerate(tree.children[i]):
                toks[:, c] = kids[:, i - a, j]
                code[:, c] = child_code(code[:, i], toks[:, c])
    n, acc, nxt = map(
        np.asarray, jit_tree(jax.random.key(9), tree, jnp.asarray(toks), jnp.asarray(Q[code]), jnp.asarray(P[code]), mode=mode)
    )
    counts = prefix_counts(rng, P, np.take_along_axis(toks, np.maximum(acc, 0), 1), n, nxt)
    assert chi2_pvalue(counts, exact_joint(P)) > ALPHA
