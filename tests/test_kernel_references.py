"""The plain-jnp references of the attention contracts, and jaxspec's XLA path, against
independent float64 numpy on fresh random inputs.

Each contract has one reference in pallas_kernels (``reference.py``; the log-sum-exp merge is
``merge.py``): every kernel test compares a kernel with it, so it is checked here against
numpy written out per query and key (``test_decode_attention.numpy_attention``,
``test_prefix_attention.numpy_prefix_attention``), on shapes and inputs drawn afresh each run
(set ``JAXSPEC_REFERENCE_SEED`` to repeat one): ragged lengths with 0 among them, queries that
see no key at all (``out = 0``, ``lse = -inf``, no NaN), NaN garbage in every slot no query
may read. ``jaxspec.attention.attention_xla`` (the XLA path on CPUs) is held to the same
numpy reference for the decode / verify contract.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (decode_attention_reference, merge_attention_states, merge_partials,
                            merge_stacked, prefix_attention_reference)
from test_decode_attention import assert_close, numpy_attention
from test_prefix_attention import numpy_prefix_attention

SEED = int(os.environ.get("JAXSPEC_REFERENCE_SEED", np.random.SeedSequence().entropy % 2**31))


def _rng(salt: int):
    return np.random.default_rng([SEED, salt])


def _check(got, want, tol=1e-5):
    try:
        assert_close(*got, *want, tol=tol)
    except AssertionError as e:
        raise AssertionError(f"{e} (JAXSPEC_REFERENCE_SEED={SEED})") from None


# --- decode / verify, sparse ---------------------------------------------------------------

def _decode_inputs(rng, *, mask: str, extra_new: bool, sparse: bool):
    """Random decode / verify inputs: B, T, G, K, D, S drawn small; the T queries are the last
    T of T_new new tokens (T_new > T with ``extra_new``); lengths ragged with lengths[0] = 0;
    NaN in every slot past lengths + T_new and in the sparse gap. A tree mask hides every new
    token from one query of sequence 0, which then sees no key at all."""
    B, T = int(rng.integers(2, 4)), int(rng.integers(2, 5))
    G, K = int(rng.integers(1, 4)), int(rng.integers(1, 3))
    D = int(rng.choice([8, 16, 24]))
    T_new = T + (int(rng.integers(1, 4)) if extra_new else 0)
    S = int(rng.integers(T_new + 8, T_new + 40))
    lengths = rng.integers(0, S - T_new + 1, size=B)
    lengths[0] = 0
    sink = window = 0
    if sparse:
        sink, window = int(rng.integers(0, 5)), int(rng.integers(1, 12))
    H = G * K
    q = rng.standard_normal((B, T, H, D))
    k = rng.standard_normal((B, K, S, D)) * 1.5
    v = rng.standard_normal((B, K, S, D))
    for b in range(B):
        L = int(lengths[b])
        k[b, :, L + T_new:] = np.nan
        v[b, :, L + T_new:] = np.nan
        if sparse and L - window > sink:
            k[b, :, sink:L - window] = np.nan
            v[b, :, sink:L - window] = np.nan
    tm = None
    if mask == "tree":
        tm = rng.random((T, T_new)) < 0.5
        tm[int(rng.integers(0, T))] = False
    elif mask == "tree_b":
        tm = rng.random((B, T, T_new)) < 0.5
        tm[0, int(rng.integers(0, T))] = False
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return (f32(q), f32(k), f32(v), jnp.asarray(lengths, jnp.int32),
            None if tm is None else jnp.asarray(tm), sink, window, T_new)


DECODE_KINDS = [
    ("causal", False, False),      # plain verification, T_new = T
    ("tree", True, False),         # one tree mask for all sequences, T_new > T
    ("tree_b", False, True),       # a mask per sequence, sparse context
    ("causal", True, True),        # causal over T_new > T new tokens, sparse context
]


def _kind_id(kind):
    mask, extra, sparse = kind
    return f"{mask}{'-Tnew>T' if extra else ''}{'-sparse' if sparse else ''}"


@pytest.mark.parametrize("kind", DECODE_KINDS, ids=_kind_id)
def test_decode_contract_matches_float64(kind):
    """The decode / verify reference, and jaxspec's XLA path (the CPU path of the model's
    attention) on the same inputs."""
    from jaxspec.attention import attention_xla
    mask, extra_new, sparse = kind
    q, k, v, lengths, tm, sink, window, T_new = _decode_inputs(
        _rng(DECODE_KINDS.index(kind)), mask=mask, extra_new=extra_new, sparse=sparse)
    want = numpy_attention(q, k, v, np.asarray(lengths), tm, sink=sink, window=window,
                           num_new=T_new)
    if mask != "causal":  # the hidden tree row of sequence 0 (length 0) saw no key
        assert np.isneginf(want[1]).any()
    got = decode_attention_reference(q, k, v, lengths, tm, sink=sink, window=window,
                                     num_new=T_new)
    _check(got, want)
    kw = dict(sink=sink, window=window) if sparse else {}
    xla = jax.jit(functools.partial(attention_xla, num_new=T_new, **kw))
    _check(xla(q, k, v, lengths, tm), want)


def test_reference_is_sensitive():
    """A comparison that cannot fail proves nothing: one new token more, or a window one slot
    wider, must be caught."""
    q, k, v, lengths, _, _, _, T_new = _decode_inputs(_rng(10), mask="causal", extra_new=True,
                                                      sparse=False)
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)   # the extra key must be finite
    want = numpy_attention(q, k, v, np.asarray(lengths), None, num_new=T_new)
    with pytest.raises(AssertionError):
        _check(decode_attention_reference(q, k, v, lengths, num_new=T_new + 1), want)
    lengths = jnp.full_like(lengths, k.shape[2] - T_new)   # >= 8: a gap between sink and window
    want = numpy_attention(q, k, v, np.asarray(lengths), None, sink=2, window=5, num_new=T_new)
    _check(decode_attention_reference(q, k, v, lengths, sink=2, window=5, num_new=T_new), want)
    with pytest.raises(AssertionError):
        _check(decode_attention_reference(q, k, v, lengths, sink=2, window=6, num_new=T_new),
               want)


# --- shared prefix ------------------------------------------------------------------------

def test_prefix_reference_matches_float64():
    rng = _rng(20)
    P, Bg, T = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    G, K, D = int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.choice([8, 16, 24]))
    L = int(rng.integers(4, 40))
    lengths = rng.integers(0, L + 1, size=P)
    lengths[0] = 0                                           # a group with an empty prefix
    lengths[-1] = L if P > 1 else 0
    q = rng.standard_normal((P * Bg, T, G * K, D))
    k = rng.standard_normal((P, L, K, D)) * 1.5
    v = rng.standard_normal((P, L, K, D))
    for p in range(P):
        k[p, lengths[p]:] = np.nan
        v[p, lengths[p]:] = np.nan
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    want = numpy_prefix_attention(q, k, v, lengths)
    assert np.isneginf(want[1][:Bg]).all()
    got = prefix_attention_reference(q, k, v, jnp.asarray(lengths, jnp.int32))
    _check(got, want)
    scale = float(rng.uniform(-0.5, 0.5))                    # any scale, negative too
    got = prefix_attention_reference(q, k, v, jnp.asarray(lengths, jnp.int32), sm_scale=scale)
    _check(got, numpy_prefix_attention(q, k, v, lengths, sm_scale=scale))


# --- the log-sum-exp merge -------------------------------------------------------------------

def _segment_attention(q, k, v, bounds):
    """float64 attention of each query row over each key segment [bounds[i], bounds[i+1]):
    ``outs[n, N, D]`` (NaN where a segment is empty: the merge must not read it) and
    ``lses[n, N]`` (-inf where empty)."""
    n = len(bounds) - 1
    N, D = q.shape[0], v.shape[-1]
    outs, lses = np.full((n, N, D), np.nan), np.full((n, N), -np.inf)
    for i in range(n):
        for r in range(N):
            lo, hi = bounds[i][r], bounds[i + 1][r]
            if hi > lo:
                s = k[r, lo:hi] @ q[r]
                m = s.max()
                w = np.exp(s - m)
                outs[i, r] = w @ v[r, lo:hi] / w.sum()
                lses[i, r] = m + np.log(w.sum())
    return outs, lses


def test_merge_matches_float64_attention_over_all_keys():
    """Per query row, the keys cut into segments at random points (empty segments included,
    and one row with no keys at all): merging the segments' float64 partials in float32 gives
    float64 attention over all the row's keys."""
    rng = _rng(30)
    N, D, n_seg = int(rng.integers(4, 9)), int(rng.choice([8, 16])), int(rng.integers(2, 5))
    n_keys = rng.integers(0, 30, size=N)
    n_keys[0] = 0
    q = rng.standard_normal((N, D))
    k = rng.standard_normal((N, 30, D)) * 2.0
    v = rng.standard_normal((N, 30, D))
    cuts = np.sort(rng.integers(0, n_keys[:, None] + 1, size=(N, n_seg - 1)), axis=1)
    bounds = [np.zeros(N, int), *cuts.T, n_keys]
    outs, lses = _segment_attention(q, k, v, bounds)
    (want_o,), (want_l,) = _segment_attention(q, k, v, [np.zeros(N, int), n_keys])
    want_o = np.where(np.isnan(want_o), 0.0, want_o)      # no keys: out = 0
    assert np.isneginf(want_l[0])
    o32, l32 = jnp.asarray(outs, jnp.float32), jnp.asarray(lses, jnp.float32)

    @jax.jit
    def merges(o, l):
        return (merge_attention_states(list(o), list(l)),
                merge_stacked(jnp.moveaxis(o, 0, 1), l.T, axis=1),
                merge_partials([o[:1], o[1:]], [l[:1], l[1:]], jnp.float32))
    for got in merges(o32, l32):
        _check(got, (want_o, want_l))
