"""Verification of speculated tokens: greedy, speculative sampling (chains), and token trees.

All functions are pure and jit-able, batched over ``B`` rows, with static shapes (the tree
topology is a static :class:`~jaxspec.tree.TokenTree`). Each returns the number of accepted
drafts per row and the next token (the target's correction at the first rejection, or the
bonus token after the last accepted one); a round therefore commits ``n_accepted + 1``
tokens per row.

Probability conventions
-----------------------
``p`` / ``target_probs`` and ``q`` / ``draft_probs`` are next-token distributions *after*
temperature / top-k / top-p (:func:`jaxspec.sampling.probs_from_logits`), float32, rows
summing to 1. Greedy rows (temperature 0) are one-hots of the argmax; with one-hot ``p``
every sampling verifier here returns exactly what the greedy verifier returns, whatever the
drafts and ``q`` are, so one compiled loop serves mixed greedy / sampling batches.

Proposals are of two kinds, decided per proposal:

* *stochastic*: the token x was drawn from the current ``q`` (``q(x) > 0``): accept with
  probability ``min(1, p(x) / q(x))`` (test ``u * q(x) < p(x)``, u ~ U[0, 1)); on rejection
  ``p <- norm(max(0, p - q))``.
* *deterministic*: the token was fixed regardless of chance (greedy / top-k drafting), which
  is a draw from the point mass ``delta_x``; this is what a proposal with ``q(x) == 0`` is
  taken to be. Accept with probability ``p(x)``; on rejection ``p <- norm(p with x removed)``
  (= ``norm(max(0, p - delta_x))``).

If a residual has zero mass (only possible when ``p <= q`` everywhere, i.e. ``p == q``, when
rejection has probability 0 and can only come from float rounding) ``p`` is kept: no NaN.
Acceptance uses an independent uniform per proposal; the final token is drawn with
:func:`jaxspec.sampling.categorical` from the current ``p``.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from jaxspec.sampling import categorical, row_sum
from jaxspec.tree import TokenTree, as_tree

Array = jax.Array
TreeMode = Literal["iid", "without_replacement", "deterministic"]

__all__ = ["verify_greedy", "verify_chain", "verify_tree_greedy", "verify_tree", "TreeMode"]


# --------------------------------------------------------------------------- chains


def _leading_true(ok: Array) -> Array:
    """``[B, g] bool -> [B] int32``: length of the all-True prefix of each row."""
    g = ok.shape[1]
    if g == 0:
        return jnp.zeros(ok.shape[:1], jnp.int32)
    return jnp.where(jnp.all(ok, axis=1), g, jnp.argmin(ok, axis=1)).astype(jnp.int32)


def verify_greedy(draft_tokens: Array, target_logits: Array) -> tuple[Array, Array]:
    """Greedy chain verification.

    Args:
      draft_tokens: ``[B, g]`` drafted tokens d_0..d_{g-1}.
      target_logits: ``[B, g+1, V]`` target outputs for inputs [last committed, d_0, ...,
        d_{g-1}] (probabilities work too: only the argmax is used).

    Returns:
      ``n_accepted[B]``: length of the longest prefix of drafts equal to the target argmax;
      ``next_token[B]``: the target argmax at position ``n_accepted`` (the bonus token when
      all g drafts are accepted).
    """
    tgt = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, g+1]
    match = draft_tokens.astype(jnp.int32) == tgt[:, :-1]
    n = _leading_true(match)
    nxt = jnp.take_along_axis(tgt, n[:, None], axis=1)[:, 0]
    return n, nxt


def _residual(p: Array, q_eff: Array, invariant: bool = False) -> Array:
    """``norm(max(0, p - q))``, or ``p`` where that has zero mass."""
    r = jnp.maximum(p - q_eff, 0.0)
    z = row_sum(r, keepdims=True, invariant=invariant)
    return jnp.where(z > 0, r / jnp.where(z > 0, z, 1.0), p)


def verify_chain(
    rng: Array,
    draft_tokens: Array,
    draft_probs: Array | None,
    target_probs: Array,
    *,
    invariant: bool = False,
) -> tuple[Array, Array]:
    """Speculative sampling of a chain (Leviathan et al. / Chen et al.).

    Args:
      rng: PRNG key.
      draft_tokens: ``[B, g]``; d_i must have been drawn from ``draft_probs[:, i]``.
      draft_probs: ``[B, g, V]``, row i = the draft distribution d_i was drawn from (draft
        output at input position i, i.e. after [..., d_{i-1}]), with the same temperature /
        top-k / top-p as the target. ``None`` means the drafts were chosen deterministically
        (e.g. draft argmax at temperature > 0): each is then a point-mass proposal.
      target_probs: ``[B, g+1, V]``, row i = target distribution after [last committed,
        d_0, ..., d_{i-1}].

    Accept d_i with probability min(1, p_i(d_i)/q_i(d_i)) in order; at the first rejection
    i = n sample from norm(max(0, p_n - q_n)); if all are accepted sample the bonus from
    p_g. The committed tokens then have exactly the target's distribution: for one
    position, P(out = y) = min(p, q)(y) [accepted] + (1 - sum min(p, q)) * max(0, p - q)(y)
    / sum max(0, p - q) [rejected] = p(y), since sum max(0, p - q) = 1 - sum min(p, q);
    after an acceptance the next position is verified against the target's conditional
    given the accepted token, with independent randomness.

    ``invariant``: the residual's normalisation and the final draw sum with fixed trees and
    scans of adds (`jaxspec.sampling.SamplingParams.invariant`): a row's result is bitwise the
    same whatever the other rows are.

    Returns ``(n_accepted[B], next_token[B])`` (int32).
    """
    B, g = draft_tokens.shape
    V = target_probs.shape[-1]
    p_all = target_probs.astype(jnp.float32)
    d = draft_tokens.astype(jnp.int32)
    k_u, k_s = jax.random.split(rng)
    u = jax.random.uniform(k_u, (B, g), jnp.float32)

    px = jnp.take_along_axis(p_all[:, :g], d[..., None], axis=-1)[..., 0]  # [B, g]
    if draft_probs is None:
        qx = jnp.zeros_like(px)
    else:
        qx = jnp.take_along_axis(draft_probs[:, :g].astype(jnp.float32), d[..., None], axis=-1)[..., 0]
    stoch = qx > 0
    accept = jnp.where(stoch, u * qx < px, u < px)
    n = _leading_true(accept)

    rejected = n < g
    i = jnp.minimum(n, g - 1) if g > 0 else n
    p_n = jnp.take_along_axis(p_all, n[:, None, None], axis=1)[:, 0]  # [B, V]
    if g > 0:
        d_n = jnp.take_along_axis(d, i[:, None], axis=1)[:, 0]
        onehot = jax.nn.one_hot(d_n, V, dtype=jnp.float32)
        if draft_probs is None:
            q_n = onehot
        else:
            q_raw = jnp.take_along_axis(draft_probs, i[:, None, None], axis=1)[:, 0].astype(jnp.float32)
            s_n = jnp.take_along_axis(stoch, i[:, None], axis=1)
            q_n = jnp.where(s_n, q_raw, onehot)
        dist = jnp.where(rejected[:, None], _residual(p_n, q_n, invariant), p_n)
    else:
        dist = p_n
    nxt = categorical(k_s, dist, invariant=invariant)
    return n, nxt


# --------------------------------------------------------------------------- trees


def verify_tree_greedy(tree: TokenTree, node_tokens: Array, target_logits: Array) -> tuple[Array, Array, Array]:
    """Greedy tree verification: walk down from the root while a child's token equals the
    target's argmax at the current node.

    Args:
      tree: static topology (or a parents sequence).
      node_tokens: ``[B, N]``; node 0 is the root (last committed token).
      target_logits: ``[B, N, V]`` target outputs at each node (or probabilities).

    Returns ``(n_accepted[B], accepted_nodes[B, max_depth], next_token[B])``:
    ``accepted_nodes[b, :n]`` are the accepted nodes at depths 1..n, -1 padded;
    ``next_token`` is the target argmax at the last accepted node (or the root). If
    several sibling paths match (duplicate sibling tokens), the deepest wins, lowest
    index on ties; all of them are the greedy continuation.
    """
    tree = as_tree(tree)
    N, D = tree.num_nodes, tree.max_depth
    tgt = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, N]
    par = jnp.asarray(tree.parents)
    match = node_tokens.astype(jnp.int32) == tgt[:, jnp.maximum(par, 0)]  # [B, N]
    match = match.at[:, 0].set(True)
    anc = jnp.asarray(tree.ancestor_mask)  # [N, N]
    # node ok iff every node on its root path matches
    ok = ~jnp.any(anc[None] & ~match[:, None, :], axis=-1)  # [B, N]
    depths = jnp.asarray(tree.depths)
    score = jnp.where(ok, depths * (N + 1) + (N - jnp.arange(N)), -1)
    best = jnp.argmax(score, axis=-1).astype(jnp.int32)
    n = depths[best]
    acc_nodes = jnp.asarray(tree.ancestor_at_depth)[best, 1:]
    nxt = jnp.take_along_axis(tgt, best[:, None], axis=1)[:, 0]
    return n, acc_nodes.reshape(n.shape[0], D), nxt


def verify_tree(
    rng: Array,
    tree: TokenTree,
    node_tokens: Array,
    draft_probs: Array | None,
    target_probs: Array,
    *,
    mode: TreeMode = "iid",
    invariant: bool = False,
) -> tuple[Array, Array, Array]:
    """Token-tree speculative sampling (SpecInfer's multi-step speculative sampling and
    its without-replacement variant).

    Args:
      rng: PRNG key.
      tree: static topology (hashable; pass as a static jit argument) or parents sequence.
      node_tokens: ``[B, N]``; node 0 = root = last committed token, nodes 1..N-1 drafted.
      draft_probs: ``[B, N, V]``; row i = the draft distribution q_i at node i (draft output
        at node i's context = root path up to and including i) from which the children of i
        were drawn. Rows of leaves are never read. Ignored (may be ``None``) for
        ``mode="deterministic"``.
      target_probs: ``[B, N, V]``; row i = target distribution p_i at node i (the target's
        next-token distribution given the root path up to and including node i).
      mode: how the engine chose the children of a node (siblings tried in rank order):

        * ``"iid"``: children drawn independently, with replacement, from q_i
          (:func:`jaxspec.sampling.sample_children` with ``replacement=True``).
        * ``"without_replacement"``: sibling r drawn from q_i with siblings 0..r-1 removed
          and renormalized (``replacement=False``: Gumbel-top-k, in key order).
        * ``"deterministic"``: children are a deterministic function of the context, e.g.
          the draft's top-k by probability (the usual "greedy" tree drafter) at any
          temperature. ``draft_probs`` is not used.

    Walk: at the current node (p = p_i, q = q_i) try the children in rank order; accept
    child x with probability min(1, p(x)/q(x)) and continue at x; on rejecting x set
    p <- norm(max(0, p - q)) and, for ``"without_replacement"``, q <- norm(q with x
    removed). A child with q(x) = 0 (always so in ``"deterministic"`` mode, and for the
    zero-probability fillers when q has fewer positive tokens than there are siblings) is a
    point-mass proposal: accepted with probability p(x), and on rejection p <- norm(p with
    x removed), q unchanged. When all children are rejected (or the node is a leaf) the
    next token is drawn from the current p.

    Why the output has exactly the target's distribution. Claim: at a node with current
    target p and k remaining children proposed by the mode's rule from the current q,
    the token the procedure emits (accepted child or final draw) is distributed as p, for
    every (p, q). Induction on k. k = 0: a draw from p. k >= 1, first child x:

    * stochastic (x ~ q): P(accept and x = y) = q(y) min(1, p(y)/q(y)) = min(p, q)(y);
      P(reject) = 1 - sum min(p, q) = sum max(0, p - q) =: Z, and given a rejection the
      rest is the same procedure with k-1 children and target p' = max(0, p - q)/Z. The
      remaining children are, given what happened so far, proposals from the current q
      under the mode's rule: for "iid" fresh independent draws from q (unchanged); for
      "without_replacement", given that the first draw was x, draws without replacement
      from q with x removed and renormalized: exactly the updated q. By induction (which
      holds for every q) they emit p'. Total: min(p, q)(y) + Z p'(y) = min(p, q)(y) +
      max(0, p - q)(y) = p(y). Not removing x in "without_replacement" mode (or not
      updating p) breaks this step; the tests show the difference is detectable.
    * point mass (x fixed): P(accept) = p(x); else the remaining procedure emits
      p' = p without x, renormalized: total p(x) 1[y = x] + (1 - p(x)) p'(y) = p(y).
      "deterministic" mode is the limit of "without_replacement" for a q that puts
      almost all mass on child 0, almost all of the rest on child 1, ...: then
      max(0, p - q) -> p without x, and q without x -> the point mass of the next child.

    An accepted child c carries on at c with target p_c (the target's conditional given
    the accepted path) and c's own children, which were drafted from q_c independently of
    the decisions taken at c's ancestors (fresh uniforms per node). Chaining these
    conditionals, the committed path plus the next token is distributed exactly as the
    target would generate it. With one-hot p (greedy rows) a child is accepted iff it is
    the argmax and the residuals leave p unchanged, so the result equals
    :func:`verify_tree_greedy`'s up to which of several duplicate matching siblings wins.

    ``invariant``: as in `verify_chain` (the residuals', the renormalised q's and the final
    draw's sums are fixed trees and scans of adds).

    Returns ``(n_accepted[B], accepted_nodes[B, max_depth], next_token[B])`` (int32):
    ``accepted_nodes[b, :n]`` are the accepted nodes at depths 1..n, -1 padded.

    Cost: a ``lax.while_loop`` over depth (stops when every row is done) around a
    ``lax.while_loop`` over siblings (as many steps as the widest current node has
    children, or fewer), each step O(B V); compile time does not grow with the tree size.
    """
    tree = as_tree(tree)
    if mode not in ("iid", "without_replacement", "deterministic"):
        raise ValueError(f"unknown tree verification mode {mode!r}")
    B, N = node_tokens.shape
    if N != tree.num_nodes:
        raise ValueError(f"node_tokens has {N} nodes, tree has {tree.num_nodes}")
    V = target_probs.shape[-1]
    D = tree.max_depth
    use_q = mode != "deterministic"
    if use_q and draft_probs is None:
        raise ValueError(f"mode={mode!r} needs draft_probs")

    children = jnp.asarray(tree.children_padded)
    nchild = jnp.asarray(tree.num_children)
    tokens = node_tokens.astype(jnp.int32)
    rows = jnp.arange(B)
    vocab = jnp.arange(V, dtype=jnp.int32)
    k_u, k_s = jax.random.split(rng)
    u_all = jax.random.uniform(k_u, (B, N), jnp.float32)

    def load(cur):
        p = target_probs[rows, cur].astype(jnp.float32)
        q = draft_probs[rows, cur].astype(jnp.float32) if use_q else jnp.zeros((B, V), jnp.float32)
        return p, q

    def sibling(w, carry):
        cur, active, p, q, moved = carry
        child = children[cur, w]  # [B]
        valid = active & (child >= 0) & (moved < 0)
        c = jnp.maximum(child, 0)
        x = tokens[rows, c]
        u = u_all[rows, c]
        px = p[rows, x]
        qx = q[rows, x]
        stoch = qx > 0
        accept = jnp.where(stoch, u * qx < px, u < px)
        acc = valid & accept
        rej = valid & ~accept
        onehot = vocab[None, :] == x[:, None]
        q_eff = jnp.where(stoch[:, None], q, onehot.astype(jnp.float32))
        p = jnp.where(rej[:, None], _residual(p, q_eff, invariant), p)
        if mode == "without_replacement":
            q_rm = jnp.where(onehot, 0.0, q)
            zq = row_sum(q_rm, keepdims=True, invariant=invariant)
            q_rm = jnp.where(zq > 0, q_rm / jnp.where(zq > 0, zq, 1.0), 0.0)
            q = jnp.where(rej[:, None], q_rm, q)
        moved = jnp.where(acc, c, moved)
        return cur, active, p, q, moved

    def level(carry):
        d, cur, active, p, q = carry
        p_new, q_new = load(cur)
        p = jnp.where(active[:, None], p_new, p)
        q = jnp.where(active[:, None], q_new, q)
        moved0 = jnp.full((B,), -1, jnp.int32)
        # only as many sibling steps as the widest current node has children
        width = jnp.max(jnp.where(active, nchild[cur], 0))

        def sib_cond(c):
            w, (_, act, _, _, moved) = c
            return (w < width) & jnp.any(act & (moved < 0))

        def sib_body(c):
            w, st = c
            return w + 1, sibling(w, st)

        _, (_, _, p, q, moved) = jax.lax.while_loop(sib_cond, sib_body, (jnp.int32(0), (cur, active, p, q, moved0)))
        accepted = moved >= 0
        cur = jnp.where(accepted, moved, cur)
        return d + 1, cur, active & accepted, p, q

    def cond(carry):
        d, _, active, _, _ = carry
        return (d <= D) & jnp.any(active)

    zeros = jnp.zeros((B, V), jnp.float32)
    init = (jnp.int32(0), jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool), zeros, zeros)
    _, cur, _, p, _ = jax.lax.while_loop(cond, level, init)
    n = jnp.asarray(tree.depths)[cur]
    acc_nodes = jnp.asarray(tree.ancestor_at_depth)[cur, 1:].reshape(B, D)
    nxt = categorical(k_s, p, invariant=invariant)
    return n, acc_nodes, nxt
