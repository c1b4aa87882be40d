"""Decode/verify attention: Pallas kernel (interpret mode) vs jnp reference vs numpy.

The reference is itself checked against an independent float64 numpy computation
with dense, per-key visibility written out in Python, so it cannot be silently
wrong; the kernel is checked against the reference on many shapes, including
T queries that are the last T of T_new > T new tokens (``Case.T_new``), which
are also checked against the matching rows of a call with all T_new queries.
"""
from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    DecodeAttentionBlockSizes,
    decode_attention,
    decode_attention_reference,
    merge_attention_states,
)

SMALL = DecodeAttentionBlockSizes(block_k=16, split_size=32, block_k_new=16)


@dataclasses.dataclass(frozen=True)
class Case:
  B: int
  T: int
  G: int
  K: int
  D: int
  S: int
  lengths: tuple
  dtype: str = "float32"
  mask: str = "causal"          # causal | tree | tree_b
  sink: int = 0
  window: int = 0
  layers: int = 0               # 0: [B,K,S,D]; n: [n,B,K,S,D], layer n-1 used
  bs: DecodeAttentionBlockSizes = SMALL
  T_new: int = 0                # 0: T; else the T queries are the last T of T_new new tokens

  @property
  def n_new(self) -> int:
    return self.T_new or self.T

  @property
  def num_new(self):
    """The ``num_new`` argument (None: T_new == T)."""
    return self.T_new or None

  def __str__(self):
    s = f"B{self.B}T{self.T}G{self.G}K{self.K}D{self.D}S{self.S}-{self.dtype}-{self.mask}"
    if self.T_new:
      s += f"-Tnew{self.T_new}"
    if self.sink or self.window:
      s += f"-sink{self.sink}win{self.window}"
    if self.layers:
      s += f"-L{self.layers}"
    if self.bs is not SMALL:
      s += f"-bk{self.bs.block_k}bq{self.bs.block_q}sp{self.bs.split_size}"
    return s


def make_inputs(c: Case, seed: int):
  rng = np.random.default_rng(seed)
  H = c.G * c.K
  lengths = np.asarray(c.lengths, np.int32)
  Tn = c.n_new
  assert lengths.shape == (c.B,) and (lengths + Tn <= c.S).all() and Tn >= c.T
  q = rng.standard_normal((c.B, c.T, H, c.D), dtype=np.float32)
  shape = (c.B, c.K, c.S, c.D)
  if c.layers:
    shape = (c.layers,) + shape
  k = rng.standard_normal(shape, dtype=np.float32) * 1.5
  v = rng.standard_normal(shape, dtype=np.float32)
  # Garbage past the valid slots (NaN and huge values) and in the sparse gap.
  for b in range(c.B):
    if c.sink or c.window:
      gap_end = lengths[b] - c.window
      if gap_end > c.sink:
        k[..., b, :, c.sink:gap_end, :] = np.nan
        v[..., b, :, c.sink:gap_end, :] = np.nan
    end = lengths[b] + Tn
    k[..., b, :, end:, :] = np.nan
    v[..., b, :, end:, :] = np.nan
    if end + 1 < c.S:
      k[..., b, :, end + 1, :] = 3e38
      v[..., b, :, end + 1, :] = -3e38
  if c.mask == "causal":
    tm = None
  elif c.mask == "tree":
    tm = rng.random((c.T, Tn)) < 0.5
    tm[:, 0] = True  # mostly tree-like: root visible, random rest
  elif c.mask == "tree_b":
    tm = rng.random((c.B, c.T, Tn)) < 0.4
  else:
    raise ValueError(c.mask)
  dt = jnp.dtype(c.dtype)
  return (jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray(lengths),
          None if tm is None else jnp.asarray(tm))


def numpy_attention(q, k, v, lengths, tree_mask, *, sink=0, window=0, layer=None, sm_scale=None,
                    num_new=None):
  """Independent float64 attention with the visibility rule spelled out per key."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  if layer is not None:
    k, v = k[layer], v[layer]
  B, T, H, D = q.shape
  K, S = k.shape[1], k.shape[2]
  G = H // K
  scale = 1.0 / np.sqrt(D) if sm_scale is None else sm_scale
  out = np.zeros((B, T, H, D))
  lse = np.full((B, T, H), -np.inf)
  tm = None if tree_mask is None else np.asarray(tree_mask, bool)
  T_new = tm.shape[-1] if tm is not None else (num_new or T)
  for b in range(B):
    L = int(lengths[b])
    for t in range(T):
      keys = []
      for s in range(L):
        if (sink or window) and not (s < sink or s >= L - window):
          continue
        keys.append(s)
      for j in range(T_new):   # query t is new token T_new - T + t
        if tm is None:
          ok = j <= T_new - T + t
        else:
          ok = tm[t, j] if tm.ndim == 2 else tm[b, t, j]
        if ok:
          keys.append(L + j)
      if not keys:
        continue
      for hq in range(H):
        kv = hq // G
        logits = np.array([q[b, t, hq] @ k[b, kv, s] for s in keys]) * scale
        m = logits.max()
        w = np.exp(logits - m)
        out[b, t, hq] = (w[:, None] * v[b, kv, keys]).sum(0) / w.sum()
        lse[b, t, hq] = m + np.log(w.sum())
  return out, lse


def assert_close(out, lse, ref_out, ref_lse, tol):
  out = np.asarray(out, np.float64)
  ref_out = np.asarray(ref_out, np.float64)
  lse, ref_lse = np.asarray(lse, np.float64), np.asarray(ref_lse, np.float64)
  assert not np.isnan(out).any(), "NaN in out"
  assert not np.isnan(lse).any(), "NaN in lse"
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  empty = np.isneginf(ref_lse)
  assert (out[empty] == 0).all(), "a query that saw no key must give out = 0"
  scale = max(np.abs(ref_out).max(), 1e-30)
  err = np.abs(out - ref_out).max() / scale
  assert err <= tol, f"out max rel err {err:.3g} > {tol}"
  fin = ~empty
  if fin.any():
    lerr = (np.abs(lse[fin] - ref_lse[fin]) / np.maximum(1.0, np.abs(ref_lse[fin]))).max()
    assert lerr <= tol, f"lse max rel err {lerr:.3g} > {tol}"


# --- the reference against numpy float64 -------------------------------------------

REF_CASES = [
    Case(2, 1, 1, 1, 64, 40, (0, 23)),
    Case(3, 5, 4, 2, 64, 64, (0, 17, 59), mask="tree"),
    Case(2, 4, 2, 2, 64, 48, (9, 30), mask="tree_b"),
    Case(3, 3, 2, 1, 64, 80, (2, 20, 70), sink=4, window=8),
    Case(3, 2, 2, 2, 64, 80, (5, 20, 70), sink=0, window=11, mask="tree"),
    Case(2, 2, 1, 2, 64, 80, (3, 60), sink=6, window=0),
    Case(2, 3, 2, 2, 64, 40, (7, 30), layers=3),
    # the last T of T_new new tokens
    Case(3, 3, 2, 2, 64, 64, (0, 17, 50), mask="tree", T_new=7),
    Case(2, 2, 2, 2, 64, 48, (9, 30), mask="tree_b", T_new=5),
    Case(3, 2, 2, 1, 64, 48, (0, 11, 38), T_new=6),
    Case(3, 3, 2, 1, 64, 80, (2, 20, 60), sink=4, window=8, mask="tree", T_new=9),
    Case(2, 1, 2, 2, 64, 40, (0, 21), layers=2, T_new=4),
]


@pytest.mark.parametrize("c", REF_CASES, ids=str)
def test_reference_matches_numpy(c):
  q, k, v, lengths, tm = make_inputs(c, seed=1)
  layer = c.layers - 1 if c.layers else None
  ref = decode_attention_reference(q, k, v, lengths, tm, layer=layer, sink=c.sink,
                                   window=c.window, num_new=c.num_new)
  want = numpy_attention(q, k, v, np.asarray(lengths), tm, sink=c.sink, window=c.window,
                         layer=layer, num_new=c.num_new)
  assert_close(*ref, *want, tol=1e-5)


# --- the kernel (Pallas interpret mode) against the reference ------------------------



KERNEL_CASES = [
    # plain decode, ragged lengths incl. 0 and non-multiples of every block
    Case(1, 1, 1, 1, 64, 40, (0,)),
    Case(3, 1, 4, 2, 128, 200, (0, 37, 195)),
    Case(4, 1, 8, 1, 64, 300, (291, 33, 64, 1)),
    # chain verification
    Case(2, 2, 2, 2, 64, 130, (31, 128), dtype="bfloat16"),
    Case(3, 5, 7, 2, 64, 150, (5, 0, 144), mask="tree"),
    Case(3, 17, 1, 2, 64, 160, (16, 60, 143), mask="tree_b"),
    Case(2, 5, 8, 2, 128, 300, (100, 295), dtype="bfloat16", mask="tree_b"),
    Case(2, 17, 7, 1, 128, 100, (0, 83), dtype="bfloat16"),
    # large T: query-row blocking
    Case(2, 64, 2, 1, 64, 200, (3, 136)),
    Case(1, 128, 2, 2, 64, 300, (150,),
               bs=DecodeAttentionBlockSizes(block_k=32, block_q=32, split_size=64)),
    Case(1, 128, 1, 1, 64, 260, (77,), mask="tree"),
    # sparse (StreamingLLM): sink and window crossing each other and both ends
    Case(4, 1, 4, 2, 64, 300, (10, 200, 3, 27), sink=4, window=24),
    Case(3, 5, 2, 2, 64, 300, (18, 250, 40), sink=16, window=40, mask="tree"),
    Case(3, 2, 2, 1, 64, 200, (0, 20, 190), sink=0, window=33),
    Case(2, 3, 2, 2, 64, 200, (5, 150), sink=8, window=0, mask="tree_b"),
    Case(3, 1, 1, 2, 64, 260, (55, 30, 250), sink=50, window=10),
    Case(2, 64, 4, 1, 64, 320, (100, 250), dtype="bfloat16", sink=16, window=48),
    # stacked layers, index picked inside the kernel
    Case(2, 5, 4, 2, 64, 100, (0, 70), layers=3),
    Case(2, 2, 2, 2, 64, 120, (33, 90), layers=2, sink=4, window=20, mask="tree"),
    # default (un-shrunk) block sizes: full blocks, tails, one split / many splits
    Case(2, 1, 4, 2, 64, 520, (515, 130), bs=DecodeAttentionBlockSizes()),
    Case(2, 5, 4, 1, 64, 600, (300, 590), mask="tree",
         bs=DecodeAttentionBlockSizes(target_programs=64, min_split_size=64)),
] + [
    # the last T of T_new new tokens (one token-tree level over the earlier levels' K/V)
    Case(3, 3, 2, 2, 64, 100, (0, 37, 90), mask="tree", T_new=7),
    Case(2, 4, 4, 1, 64, 150, (20, 130), dtype="bfloat16", mask="tree_b", T_new=15),
    Case(3, 2, 2, 2, 64, 120, (0, 50, 100), T_new=9),                   # causal, num_new
    Case(2, 1, 4, 2, 64, 200, (0, 150), T_new=33),               # one query, 3 key blocks
    Case(2, 1, 4, 2, 64, 200, (0, 150), mask="tree_b", T_new=33),
    Case(3, 5, 2, 2, 64, 300, (18, 250, 40), sink=16, window=40, mask="tree", T_new=21),
] + [
    # head dims that are not powers of 2 (or below 16): tiles of the next power of 2 >= 16,
    # the lanes past D masked (garbage past the valid slots is NaN in every lane)
    Case(2, 1, 4, 2, 80, 200, (0, 150)),
    Case(3, 5, 2, 2, 96, 150, (7, 60, 140), dtype="bfloat16", mask="tree"),
    Case(2, 3, 3, 1, 100, 120, (30, 110), sink=4, window=20, T_new=6),
    Case(2, 2, 2, 2, 24, 90, (0, 80), mask="tree_b", layers=2),
    Case(3, 1, 1, 3, 8, 70, (1, 33, 69)),
    Case(2, 8, 2, 1, 64, 300, (5, 200), dtype="bfloat16", sink=4, window=24,
               mask="tree_b", T_new=40),
    Case(3, 3, 2, 1, 64, 200, (0, 20, 150), sink=0, window=33, T_new=12),
    Case(1, 40, 2, 1, 64, 300, (100,), mask="tree", T_new=70),          # 5 query-row blocks
    Case(1, 40, 2, 1, 64, 300, (100,), T_new=70,
         bs=DecodeAttentionBlockSizes(block_k=32, block_q=32, split_size=64)),
    Case(2, 3, 2, 2, 64, 100, (0, 70), layers=2, mask="tree", T_new=6),
    Case(2, 5, 4, 1, 64, 600, (300, 580), mask="tree", T_new=20,
               bs=DecodeAttentionBlockSizes(target_programs=64, min_split_size=64)),
    Case(2, 2, 4, 2, 64, 520, (500, 130), dtype="bfloat16", T_new=16,
         bs=DecodeAttentionBlockSizes()),
]


@pytest.mark.parametrize("c", KERNEL_CASES, ids=str)
def test_kernel_matches_reference(c):
  q, k, v, lengths, tm = make_inputs(c, seed=zlib.crc32(str(c).encode()))
  layer = c.layers - 1 if c.layers else None
  out = decode_attention(q, k, v, lengths, tm, layer=layer, sink=c.sink, window=c.window,
                         interpret=True, block_sizes=c.bs, num_new=c.num_new)
  ref = decode_attention_reference(q, k, v, lengths, tm, layer=layer, sink=c.sink,
                                   window=c.window, num_new=c.num_new)
  assert out[0].dtype == q.dtype and out[0].shape == q.shape
  assert out[1].dtype == jnp.float32 and out[1].shape == q.shape[:3]
  tol = 1e-5 if c.dtype == "float32" else 2e-2
  assert_close(*out, *ref, tol=tol)


LAST_ROWS_CASES = [
    Case(3, 3, 2, 2, 64, 100, (0, 37, 90), mask="tree", T_new=7),
    Case(2, 4, 4, 1, 64, 150, (20, 130), dtype="bfloat16", mask="tree_b", T_new=15),
    Case(3, 2, 2, 2, 64, 120, (0, 50, 100), T_new=9),
    Case(3, 5, 2, 2, 64, 300, (18, 250, 40), sink=16, window=40, mask="tree_b",
               T_new=21),
    Case(2, 1, 4, 2, 64, 200, (0, 150), sink=4, window=24, T_new=33),
]


@pytest.mark.parametrize("c", LAST_ROWS_CASES, ids=str)
def test_last_queries_equal_rows_of_full_call(c):
  """T queries over T_new new tokens == the last T rows of the call with all T_new queries
  (the full call's mask: random rows first, then the T rows of the partial call's mask)."""
  full = dataclasses.replace(c, T=c.T_new, T_new=0)
  q_full, k, v, lengths, tm_full = make_inputs(full, seed=zlib.crc32(str(c).encode()))
  first = c.T_new - c.T
  q = q_full[:, first:]
  tm = None if tm_full is None else tm_full[..., first:, :]
  for fn, kw in ((decode_attention, dict(interpret=True, block_sizes=c.bs)),
                 (decode_attention_reference, {})):
    part = fn(q, k, v, lengths, tm, sink=c.sink, window=c.window, num_new=c.num_new, **kw)
    whole = fn(q_full, k, v, lengths, tm_full, sink=c.sink, window=c.window, **kw)
    assert part[0].shape == q.shape and part[1].shape == q.shape[:3]
    assert_close(*part, whole[0][:, first:], whole[1][:, first:],
                 tol=1e-5 if c.dtype == "float32" else 2e-2)
  # and the partial call is not just the first T rows (the query offset matters)
  ref = decode_attention_reference(q, k, v, lengths, tm, sink=c.sink, window=c.window,
                                   num_new=c.num_new)
  head = decode_attention_reference(q_full, k, v, lengths, tm_full, sink=c.sink,
                                    window=c.window)
  assert np.abs(np.asarray(ref[1]) - np.asarray(head[1][:, :c.T])).max() > 1e-3


def test_num_new_errors():
  c = Case(2, 3, 2, 1, 64, 40, (0, 9), mask="tree", T_new=5)
  q, k, v, lengths, tm = make_inputs(c, seed=8)
  for fn in (decode_attention, decode_attention_reference):
    with pytest.raises(ValueError, match="differs"):
      fn(q, k, v, lengths, tm, num_new=6)
    with pytest.raises(ValueError, match="new tokens"):
      fn(q, k, v, lengths, num_new=2)             # fewer new tokens than queries
    with pytest.raises(ValueError, match="new tokens"):
      fn(q, k, v, lengths, tm[:, :2])
    with pytest.raises(ValueError, match="tree_mask must be"):
      fn(q, k, v, lengths, jnp.ones((4, 5), bool))  # rows != queries


def test_kernel_detects_wrong_window():
  """The comparison is sensitive: a window off by one must fail it."""
  c = Case(2, 1, 2, 1, 64, 120, (60, 100), sink=4, window=20)
  q, k, v, lengths, tm = make_inputs(c, seed=3)
  out = decode_attention(q, k, v, lengths, tm, sink=4, window=20, interpret=True,
                         block_sizes=SMALL)
  wrong = decode_attention_reference(q, k, v, lengths, tm, sink=4, window=21)
  with pytest.raises(AssertionError):
    assert_close(*out, *wrong, tol=1e-5)


@pytest.mark.parametrize("sparse", [False, True])
def test_splits_share_each_sequences_context(sparse, monkeypatch):
  """Automatic splits are planned over the cache's S slots but divide each sequence's own
  visible context at run time: sequences far shorter than S (a serving cache sized for the
  longest request) still keep every split busy. Split at the slot axis, all of a 256-token
  context would fall to the first of 4 splits of 256 slots. The partials are caught on their
  way to the merge; the merged result must still match the reference."""
  from pallas_kernels import triton_core
  seen = {}
  merge = triton_core.merge_stacked

  def spy(o, lse, **kw):  # inside the kernel's jit: read the partials by a callback
    jax.debug.callback(lambda x: seen.__setitem__("lse", np.asarray(x)), lse)
    return merge(o, lse, **kw)
  monkeypatch.setattr(triton_core, "merge_stacked", spy)
  bs = DecodeAttentionBlockSizes(block_k=32, target_programs=8, min_split_size=64)
  c = Case(2, 1, 2, 1, 32, 1024, (256, 100), sink=8 if sparse else 0,
           window=120 if sparse else 0, bs=bs)
  q, k, v, lengths, tm = make_inputs(c, seed=21)
  out = decode_attention(q, k, v, lengths, tm, sink=c.sink, window=c.window, interpret=True,
                         block_sizes=bs)
  lse = seen["lse"]                      # [B, K, splits, rows]
  assert lse.shape[2] == (2 if sparse else 4)  # sparse: planned over sink + window slots
  assert np.isfinite(lse[:, 0, :, 0]).all()  # every split of both sequences saw keys
  ref = decode_attention_reference(q, k, v, lengths, tm, sink=c.sink, window=c.window)
  assert_close(*out, *ref, tol=1e-5)


def test_empty_queries_give_zero_and_neg_inf():
  """Length 0 and a tree row seeing nothing: out = 0, lse = -inf, no NaN."""
  c = Case(2, 4, 2, 1, 64, 64, (0, 9), mask="tree_b")
  q, k, v, lengths, _ = make_inputs(c, seed=4)
  tm = np.ones((2, 4, 4), bool)
  tm[0, 1] = False                    # batch 0 (length 0): query 1 sees nothing
  tm[1, 2] = False                    # batch 1: query 2 sees only context
  tm = jnp.asarray(tm)
  for fn in (decode_attention, decode_attention_reference):
    out, lse = fn(q, k, v, lengths, tm, interpret=True, block_sizes=SMALL)
    out, lse = np.asarray(out), np.asarray(lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.isneginf(lse[0, 1]).all() and (out[0, 1] == 0).all()
    assert np.isfinite(lse[1, 2]).all()
    assert np.isfinite(np.delete(lse, 1, axis=1)[0]).all()


def test_layer_traced_inside_scan():
  """`layer` as a traced loop index with the whole stacked cache as the carry."""
  c = Case(2, 3, 2, 2, 64, 96, (10, 80), layers=3)
  q, k, v, lengths, tm = make_inputs(c, seed=5)

  @jax.jit
  def run(q, k, v, lengths):
    def body(carry, layer):
      k, v = carry
      o, l = decode_attention(q, k, v, lengths, layer=layer, interpret=True,
                              block_sizes=SMALL)
      return (k, v), (o, l)
    _, (o, l) = jax.lax.scan(body, (k, v), jnp.arange(c.layers, dtype=jnp.int32))
    return o, l

  o, l = run(q, k, v, lengths)
  for layer in range(c.layers):
    ref = decode_attention_reference(q, k, v, lengths, layer=layer)
    assert_close(o[layer], l[layer], *ref, tol=1e-5)


def test_cpu_dispatch_uses_reference():
  c = Case(1, 2, 2, 1, 64, 32, (7,))
  q, k, v, lengths, tm = make_inputs(c, seed=6)
  out = decode_attention(q, k, v, lengths)          # interpret=None on CPU
  ref = decode_attention_reference(q, k, v, lengths)
  np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))


# --- merging partial attentions ----------------------------------------------------

def _split_attention(q, k, v, cuts):
  """Attention of q [N, D] over k/v [S, D] split at `cuts`: per-segment (out, lse)."""
  outs, lses = [], []
  bounds = [0, *cuts, k.shape[0]]
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    s = q @ k[lo:hi].T
    if hi == lo:
      outs.append(np.zeros_like(q))
      lses.append(np.full(q.shape[0], -np.inf))
      continue
    m = s.max(-1, keepdims=True)
    w = np.exp(s - m)
    outs.append(w @ v[lo:hi] / w.sum(-1, keepdims=True))
    lses.append(m[:, 0] + np.log(w.sum(-1)))
  return outs, lses


@pytest.mark.parametrize("cuts", [(5,), (0, 7), (3, 3, 12), (20,)])
def test_merge_matches_concatenated_keys(cuts):
  rng = np.random.default_rng(7)
  q = rng.standard_normal((6, 16))
  k, v = rng.standard_normal((20, 16)), rng.standard_normal((20, 16))
  outs, lses = _split_attention(q, k, v, cuts)
  out, lse = merge_attention_states([jnp.asarray(o, jnp.float32) for o in outs],
                                    [jnp.asarray(l, jnp.float32) for l in lses])
  (want_out,), (want_lse,) = _split_attention(q, k, v, ())
  np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6)


def test_merge_empty_and_extreme():
  o1 = jnp.asarray([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
  o2 = jnp.asarray([[9.0, 9.0], [-1.0, -1.0], [jnp.nan, jnp.nan], [0.0, 0.0]])
  l1 = jnp.asarray([0.0, 1e4, 3.0, -jnp.inf])
  l2 = jnp.asarray([-jnp.inf, 0.0, -jnp.inf, -jnp.inf])  # row 2: empty segment holding NaN
  out, lse = merge_attention_states([o1, o2], [l1, l2])
  out, lse = np.asarray(out), np.asarray(lse)
  assert not np.isnan(out).any() and not np.isnan(lse).any()
  np.testing.assert_array_equal(out[0], [1.0, 2.0])        # other segment empty
  np.testing.assert_array_equal(out[1], [3.0, 4.0])        # lse gap 1e4: exp(-1e4) = 0
  np.testing.assert_array_equal(lse[:3], [0.0, 1e4, 3.0])
  np.testing.assert_array_equal(out[2], [5.0, 6.0])
  np.testing.assert_array_equal(out[3], [0.0, 0.0])        # all empty: 0, -inf
  assert np.isneginf(lse[3])
  # Equal weights: a plain average; lse grows by log 2.
  out, lse = merge_attention_states([o1[:1], o1[:1] + 2], [l1[:1], l1[:1]])
  np.testing.assert_allclose(np.asarray(out), [[2.0, 3.0]])
  np.testing.assert_allclose(np.asarray(lse), [np.log(2.0)], rtol=1e-6)
  # Single state passes through; dtype of outs[0] is kept.
  out, lse = merge_attention_states([o1.astype(jnp.bfloat16)] * 2, [l1] * 2)
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32


# --- compiled kernel on a GPU (run on the GPU machine: scripts/gpu_kernels_check.sh) ---

def _need_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("c", KERNEL_CASES, ids=str)
def test_kernel_compiled_gpu(c):
  _need_gpu()
  q, k, v, lengths, tm = make_inputs(c, seed=zlib.crc32(str(c).encode()))
  layer = c.layers - 1 if c.layers else None
  out = decode_attention(q, k, v, lengths, tm, layer=layer, sink=c.sink, window=c.window,
                         interpret=False, block_sizes=c.bs, num_new=c.num_new)
  ref = decode_attention_reference(q, k, v, lengths, tm, layer=layer, sink=c.sink,
                                   window=c.window, num_new=c.num_new)
  assert_close(*out, *ref, tol=1e-5 if c.dtype == "float32" else 2e-2)


GPU_DEFAULT_CASES = [
    Case(8, 1, 4, 4, 128, 4096, (4000, 17, 2049, 0, 4095, 1000, 3333, 64), dtype="bfloat16"),
    Case(8, 5, 4, 4, 128, 4096, (4000, 17, 2049, 0, 4091, 1000, 3333, 64), dtype="bfloat16",
         mask="tree_b"),
    Case(4, 64, 4, 2, 128, 4096, (4000, 17, 2049, 0), dtype="bfloat16"),
    Case(4, 16, 7, 2, 64, 4096, (4000, 17, 2049, 0), dtype="bfloat16", mask="tree"),
    Case(8, 1, 4, 4, 128, 4096, (4000, 17, 2049, 0, 4095, 1000, 3333, 600), dtype="bfloat16",
         sink=16, window=496),
    Case(4, 5, 8, 2, 128, 2048, (2000, 17, 1000, 600), sink=4, window=100),
    Case(2, 512, 4, 2, 128, 2048, (1000, 0), dtype="bfloat16"),
    # >= 128 rows per KV head in bf16: the Hopper kernel on an H100/H200 (tree, T_new > T)
    Case(4, 40, 4, 2, 128, 4096, (4000, 17, 2049, 0), dtype="bfloat16", mask="tree_b",
         T_new=48),
    # token-tree levels: the last T of T_new new tokens
    Case(8, 4, 6, 2, 128, 4096, (4000, 17, 2049, 0, 4000, 1000, 3333, 64), dtype="bfloat16",
         mask="tree_b", T_new=7),
    Case(8, 8, 6, 2, 128, 4096, (4000, 17, 2049, 0, 4000, 1000, 3333, 600), dtype="bfloat16",
         sink=16, window=496, mask="tree", T_new=15),
    Case(4, 16, 4, 2, 128, 2048, (1900, 17, 1000, 0), dtype="bfloat16", T_new=100),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_DEFAULT_CASES, ids=str)
def test_kernel_compiled_gpu_default_blocks(c):
  _need_gpu()
  q, k, v, lengths, tm = make_inputs(c, seed=zlib.crc32(str(c).encode()))
  out = decode_attention(q, k, v, lengths, tm, sink=c.sink, window=c.window, num_new=c.num_new)
  ref = decode_attention_reference(q, k, v, lengths, tm, sink=c.sink, window=c.window,
                                   num_new=c.num_new)
  assert_close(*out, *ref, tol=1e-5 if c.dtype == "float32" else 2e-2)


@pytest.mark.gpu
def test_layer_traced_inside_scan_gpu():
  _need_gpu()
  c = Case(4, 5, 4, 2, 128, 1024, (10, 800, 0, 1019), layers=3, dtype="bfloat16")
  q, k, v, lengths, _ = make_inputs(c, seed=5)

  @jax.jit
  def run(q, k, v, lengths):
    def body(carry, layer):
      k, v = carry
      return (k, v), decode_attention(q, k, v, lengths, layer=layer)
    return jax.lax.scan(body, (k, v), jnp.arange(c.layers, dtype=jnp.int32))[1]

  o, l = run(q, k, v, lengths)
  for layer in range(c.layers):
    assert_close(o[layer], l[layer], *decode_attention_reference(q, k, v, lengths, layer=layer),
                 tol=2e-2)


# --- Triton lowering checked on the CPU (no GPU needed) -------------------------------

LOWERING_CASES = [
    Case(2, 1, 4, 2, 128, 300, (5, 290), dtype="bfloat16"),
    Case(2, 5, 7, 2, 64, 150, (5, 140), mask="tree_b"),
    Case(2, 5, 2, 2, 64, 300, (18, 250), sink=16, window=40, mask="tree", layers=2),
    Case(2, 64, 4, 1, 128, 4096, (100, 2500), dtype="bfloat16", bs=DecodeAttentionBlockSizes()),
    Case(2, 5, 8, 2, 128, 2048, (2000, 17), sink=4, window=100, bs=DecodeAttentionBlockSizes()),
    Case(2, 4, 6, 2, 128, 2048, (2000, 17), dtype="bfloat16", sink=16, window=496, mask="tree_b",
         T_new=11, bs=DecodeAttentionBlockSizes()),
    Case(2, 3, 4, 2, 64, 300, (5, 250), T_new=40),
]


@pytest.mark.parametrize("c", LOWERING_CASES, ids=str)
def test_kernel_lowers_to_valid_triton_ir(c, monkeypatch):
  """Lowers the compiled-GPU kernel to Triton IR on the CPU and runs the MLIR verifier.

  Catches lowering bugs (e.g. an ill-typed select) without a GPU; needs a jax whose
  Triton lowering falls back to a default GPU arch when no GPU is present (0.10.x).
  """
  from pallas_kernels import common, triton_decode
  try:
    from jax._src.pallas.triton import lowering as triton_lowering
    from jax._src.pallas.triton import pallas_call_registration as registration
  except ImportError:
    pytest.skip("no Pallas Triton lowering in this jax")
  original = triton_lowering.lower_jaxpr_to_triton_module

  def lower_and_verify(*args, **kwargs):
    result = original(*args, **kwargs)
    assert result.module.operation.verify()
    return result
  monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
  monkeypatch.setattr(common, "is_nvidia", lambda: True)   # exercise the ex2.approx path
  q, k, v, lengths, tm = make_inputs(c, seed=0)
  layer = jnp.int32(c.layers - 1) if c.layers else None

  def f(q, k, v, lengths, tm, layer):
    return triton_decode.triton_decode_attention(
        q, k, v, lengths, tm, layer, sink=c.sink, window=c.window, sm_scale=0.125,
        interpret=False, block_sizes=c.bs, on_gpu=True, num_new=c.num_new)
  try:
    lowered = jax.jit(f).trace(q, k, v, lengths, tm, layer).lower(lowering_platforms=("cuda",))
  except RuntimeError as e:
    if "GPU" in str(e):
      pytest.skip(f"this jax cannot lower for CUDA without a GPU: {e}")
    raise
  assert "jaxspec_decode_attention" in lowered.as_text()
