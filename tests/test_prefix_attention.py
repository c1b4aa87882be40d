"""Shared-prefix attention (Hydragen): kernel (interpret mode) vs reference vs numpy.

The reference is checked against an independent float64 numpy computation that
spells out, per query, which keys it sees; the kernel is checked against the
reference on many random shapes (groups, ragged prefix lengths incl. 0, GQA,
bf16/f32, NaN garbage past the valid prefix). Composition is checked against
attention over the concatenated keys: prefix part + suffix part (decode
attention over a per-sequence cache) merged by log-sum-exp, including empty
segments and extreme lse gaps, and multi-level prefixes (a tree of prefixes).
"""
from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    PrefixAttentionBlockSizes,
    decode_attention_reference,
    merge_attention_states,
    multi_level_prefix_attention,
    prefix_attention,
    prefix_attention_reference,
)
from pallas_kernels.merge import merge_stacked

SMALL = PrefixAttentionBlockSizes(block_k=16, split_size=32)


@dataclasses.dataclass(frozen=True)
class Case:
  P: int
  Bg: int           # sequences per group
  T: int
  G: int
  K: int
  D: int
  L: int
  lengths: tuple | None   # [P] valid prefix tokens; None: all L
  dtype: str = "float32"
  bs: PrefixAttentionBlockSizes = SMALL

  @property
  def B(self):
    return self.P * self.Bg

  def __str__(self):
    s = (f"P{self.P}x{self.Bg}T{self.T}G{self.G}K{self.K}D{self.D}L{self.L}"
         f"-{self.dtype}-len{'full' if self.lengths is None else '_'.join(map(str, self.lengths))}")
    if self.bs is not SMALL:
      s += f"-bq{self.bs.block_q}bk{self.bs.block_k}sp{self.bs.split_size}"
    return s


def make_inputs(c: Case, seed: int):
  rng = np.random.default_rng(seed)
  H = c.G * c.K
  q = rng.standard_normal((c.B, c.T, H, c.D), dtype=np.float32)
  k = rng.standard_normal((c.P, c.L, c.K, c.D), dtype=np.float32) * 1.5
  v = rng.standard_normal((c.P, c.L, c.K, c.D), dtype=np.float32)
  if c.lengths is not None:
    lengths = np.asarray(c.lengths, np.int32)
    assert lengths.shape == (c.P,) and (lengths <= c.L).all()
    # Garbage past the valid prefix: NaN and huge values.
    for p in range(c.P):
      n = lengths[p]
      k[p, n:] = np.nan
      v[p, n:] = np.nan
      if n + 1 < c.L:
        k[p, n + 1] = 3e38
        v[p, n + 1] = -3e38
  dt = jnp.dtype(c.dtype)
  return (jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt),
          None if c.lengths is None else jnp.asarray(lengths))


def softmax_attend(qv, keys, vals, scale):
  """float64 attention of one query vector over explicit key/value rows."""
  if len(keys) == 0:
    return np.zeros(vals.shape[-1]), -np.inf
  logits = keys @ qv * scale
  m = logits.max()
  w = np.exp(logits - m)
  return (w[:, None] * vals).sum(0) / w.sum(), m + np.log(w.sum())


def numpy_prefix_attention(q, k, v, lengths, sm_scale=None):
  """Independent float64 prefix attention, one query at a time."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, H, D = q.shape
  P, L, K, _ = k.shape
  G = H // K
  lengths = np.full(P, L) if lengths is None else np.asarray(lengths)
  scale = 1.0 / np.sqrt(D) if sm_scale is None else sm_scale
  out = np.zeros((B, T, H, D))
  lse = np.full((B, T, H), -np.inf)
  for b in range(B):
    p = b // (B // P)               # contiguous equal groups
    n = int(lengths[p])
    for t in range(T):
      for h in range(H):
        kv = h // G
        out[b, t, h], lse[b, t, h] = softmax_attend(q[b, t, h], k[p, :n, kv], v[p, :n, kv],
                                                    scale)
  return out, lse


def assert_close(out, lse, ref_out, ref_lse, tol):
  out = np.asarray(out, np.float64)
  ref_out = np.asarray(ref_out, np.float64)
  lse, ref_lse = np.asarray(lse, np.float64), np.asarray(ref_lse, np.float64)
  assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
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
    Case(1, 3, 1, 1, 1, 64, 20, None),
    Case(2, 2, 5, 4, 2, 64, 33, (0, 29)),
    Case(4, 1, 2, 7, 1, 64, 17, (17, 3, 0, 9)),
    Case(2, 3, 3, 2, 2, 128, 24, (24, 11)),
]


@pytest.mark.parametrize("c", REF_CASES, ids=str)
def test_reference_matches_numpy(c):
  q, k, v, lengths = make_inputs(c, seed=1)
  ref = prefix_attention_reference(q, k, v, lengths)
  want = numpy_prefix_attention(q, k, v, None if lengths is None else np.asarray(lengths))
  assert_close(*ref, *want, tol=1e-5)


@pytest.mark.parametrize("sm_scale", [0.3, -0.2])
def test_sm_scale(sm_scale):
  """Reference vs numpy and kernel vs reference with an explicit (also negative) scale."""
  c = Case(2, 2, 2, 2, 2, 64, 40, (13, 40))
  q, k, v, lengths = make_inputs(c, seed=2)
  ref = prefix_attention_reference(q, k, v, lengths, sm_scale=sm_scale)
  assert_close(*ref, *numpy_prefix_attention(q, k, v, np.asarray(lengths), sm_scale=sm_scale),
               tol=1e-5)
  out = prefix_attention(q, k, v, lengths, sm_scale=sm_scale, interpret=True,
                         block_sizes=SMALL)
  assert_close(*out, *ref, tol=1e-5)


# --- the kernel (Pallas interpret mode) against the reference ------------------------

def _random_cases(n, seed):
  """Random shapes over the contract's ranges (deterministic)."""
  rng = np.random.default_rng(seed)
  cases = []
  for i in range(n):
    P = int(rng.choice([1, 2, 4]))
    Bg = int(rng.integers(1, 17))
    T = int(rng.choice([1, 5, 17]))
    G = int(rng.choice([1, 4, 7]))
    K = int(rng.choice([1, 2]))
    D = int(rng.choice([64, 128]))
    L = int(rng.integers(1, 120))
    lengths = rng.integers(0, L + 1, size=P)
    lengths[rng.integers(0, P)] = int(rng.choice([0, L]))      # an edge every time
    dtype = "bfloat16" if i % 3 == 2 else "float32"
    cases.append(Case(P, Bg, T, G, K, D, L, tuple(int(x) for x in lengths), dtype))
  return cases


KERNEL_CASES = [
    # one group, full prefix, plain decode
    Case(1, 1, 1, 1, 1, 64, 40, None),
    Case(1, 16, 1, 4, 2, 128, 100, None),
    # several groups, ragged lengths incl. 0 and L, non-multiples of every block
    Case(2, 3, 5, 4, 2, 64, 70, (0, 70)),
    Case(4, 2, 1, 7, 1, 64, 50, (49, 1, 0, 32)),
    Case(4, 16, 17, 7, 1, 64, 90, (3, 90, 0, 47), dtype="bfloat16"),
    Case(2, 16, 17, 4, 2, 128, 64, (64, 17)),      # 1088 rows per (group, head)
    Case(1, 5, 5, 1, 3, 128, 33, (0,)),            # everything empty
    # more query rows than block_q: row blocking; big splits / one split
    Case(2, 9, 17, 1, 1, 64, 100, (99, 50),
         bs=PrefixAttentionBlockSizes(block_q=32, block_k=32, split_size=64)),
    Case(1, 4, 5, 4, 2, 64, 130, (129,),
         bs=PrefixAttentionBlockSizes(block_q=16, block_k=16)),
    # default block sizes (one split in interpret mode) and an explicit program target
    Case(2, 2, 5, 4, 2, 64, 300, (300, 131), bs=PrefixAttentionBlockSizes()),
    Case(2, 4, 1, 4, 2, 64, 600, (600, 257),
         bs=PrefixAttentionBlockSizes(target_programs=64, min_split_size=64)),
    *_random_cases(9, seed=6),
    # head dims that are not powers of 2 (or below 16): lanes past D masked
    Case(2, 3, 5, 4, 2, 80, 70, (0, 70)),
    Case(1, 4, 2, 3, 1, 100, 90, (61,), dtype="bfloat16"),
    Case(2, 2, 1, 2, 2, 24, 40, (40, 13)),
    Case(1, 2, 3, 1, 2, 8, 33, None),
]


@pytest.mark.parametrize("c", KERNEL_CASES, ids=str)
def test_kernel_matches_reference(c):
  q, k, v, lengths = make_inputs(c, seed=zlib.crc32(str(c).encode()))
  out = prefix_attention(q, k, v, lengths, interpret=True, block_sizes=c.bs)
  ref = prefix_attention_reference(q, k, v, lengths)
  assert out[0].dtype == q.dtype and out[0].shape == q.shape
  assert out[1].dtype == jnp.float32 and out[1].shape == q.shape[:3]
  tol = 1e-5 if c.dtype == "float32" else 2e-2
  assert_close(*out, *ref, tol=tol)


def test_kernel_detects_wrong_length():
  """The comparison is sensitive: a prefix length off by one must fail it."""
  c = Case(2, 2, 1, 2, 1, 64, 60, (40, 60))
  q, k, v, lengths = make_inputs(c, seed=3)
  k = jnp.nan_to_num(k)                # keep the off-by-one key finite
  v = jnp.nan_to_num(v, posinf=0.0, neginf=0.0)
  out = prefix_attention(q, k, v, lengths, interpret=True, block_sizes=SMALL)
  wrong = prefix_attention_reference(q, k, v, lengths + jnp.asarray([1, 0], jnp.int32))
  with pytest.raises(AssertionError):
    assert_close(*out, *wrong, tol=1e-5)


def test_groups_are_contiguous():
  """Sequence b uses prefix b // (B/P): swapping the prefixes changes the result."""
  c = Case(2, 3, 1, 2, 1, 64, 30, None)
  q, k, v, lengths = make_inputs(c, seed=4)
  out, lse = prefix_attention(q, k, v, interpret=True, block_sizes=SMALL)
  for b in range(c.B):
    p = b // c.Bg
    o1, l1 = prefix_attention_reference(q[b:b + 1], k[p:p + 1], v[p:p + 1])
    assert_close(out[b:b + 1], lse[b:b + 1], o1, l1, tol=1e-5)


def test_bad_shapes_raise():
  q = jnp.zeros((6, 1, 4, 64))
  k = jnp.zeros((4, 10, 2, 64))
  with pytest.raises(ValueError, match="B % P"):
    prefix_attention(q, k, k, interpret=True)
  with pytest.raises(ValueError, match="B % P"):
    prefix_attention_reference(q, k, k)
  with pytest.raises(ValueError, match="multiple of K"):
    prefix_attention(q, jnp.zeros((2, 10, 3, 64)), jnp.zeros((2, 10, 3, 64)), interpret=True)
  with pytest.raises(ValueError, match="prefix_lengths"):
    prefix_attention(q, k[:2], k[:2], jnp.zeros((3,), jnp.int32), interpret=True)
  with pytest.raises(ValueError, match="k/v prefix"):
    prefix_attention(q, k[:2], k[:2, :5], interpret=True)


def test_jit_with_traced_lengths_and_cpu_dispatch():
  c = Case(2, 2, 3, 2, 2, 64, 48, (20, 48))
  q, k, v, lengths = make_inputs(c, seed=5)
  f = jax.jit(lambda q, k, v, n: prefix_attention(q, k, v, n, interpret=True,
                                                  block_sizes=SMALL))
  ref = prefix_attention_reference(q, k, v, lengths)
  assert_close(*f(q, k, v, lengths), *ref, tol=1e-5)
  out = prefix_attention(q, k, v, lengths)            # interpret=None on CPU: reference
  np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))


# --- composition: prefix + suffix, multi-level, vs attention over the concatenation -----

def _suffix_inputs(rng, B, T, K, D, S, ctx_lengths):
  """Per-sequence suffix caches [B, K, S, D]: context, then the T new tokens' K/V."""
  k = rng.standard_normal((B, K, S, D)) * 1.5
  v = rng.standard_normal((B, K, S, D))
  for b in range(B):
    k[b, :, ctx_lengths[b] + T:] = np.nan           # garbage past the used slots
    v[b, :, ctx_lengths[b] + T:] = np.nan
  return k, v


def numpy_concat_attention(q, segments, sm_scale=None):
  """float64 attention of each query over the concatenation of its key segments.

  ``segments(b, t, kv) -> list of (keys [n, D], values [n, D])``.
  """
  q = np.asarray(q, np.float64)
  B, T, H, D = q.shape
  scale = 1.0 / np.sqrt(D) if sm_scale is None else sm_scale
  out = np.zeros((B, T, H, D))
  lse = np.full((B, T, H), -np.inf)
  for b in range(B):
    for t in range(T):
      for h in range(H):
        segs = segments(b, t, h)
        keys = np.concatenate([s[0] for s in segs], 0)
        vals = np.concatenate([s[1] for s in segs], 0)
        out[b, t, h], lse[b, t, h] = softmax_attend(q[b, t, h], keys, vals, scale)
  return out, lse


@pytest.mark.parametrize("mode", ["random", "empty_segments", "extreme_gap"])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "reference"])
def test_prefix_plus_suffix_equals_concatenated(mode, kernel):
  rng = np.random.default_rng(zlib.crc32(mode.encode()))
  P, Bg, T, G, K, D, L, S = 2, 3, 4, 2, 2, 64, 40, 24
  B, H = P * Bg, G * K
  q = rng.standard_normal((B, T, H, D))
  kp = rng.standard_normal((P, L, K, D)) * 1.5
  vp = rng.standard_normal((P, L, K, D))
  plen = np.array([L, 23])
  ctx = np.array([0, 5, 20, 3, 0, 11])
  tree = np.tril(np.ones((T, T), bool))
  if mode == "empty_segments":
    plen = np.array([0, 23])                       # group 0: no prefix at all
    tree = np.tril(np.ones((B, T, T), bool))
    tree[3, 2] = False                            # seq 3, query 2: sees only context
    tree[0, 1] = False                            # seq 0 (ctx 0, group 0), query 1: nothing
    tree[4, 1] = False                            # seq 4 (ctx 0, group 1), query 1: prefix only
  if mode == "extreme_gap":
    # Prefix logits ~ +1250 above the suffix's for group 0 (exp(-1250) == 0 even in
    # float64), ~ -1250 for group 1: one segment's weight underflows to exactly 0.
    q[..., 0] = 100.0
    kp[0, :, :, 0] = 100.0
    kp[1, :, :, 0] = -100.0
  for p in range(P):
    kp[p, plen[p]:] = np.nan
    vp[p, plen[p]:] = np.nan
  ks, vs = _suffix_inputs(rng, B, T, K, D, S, ctx)

  f32 = lambda x: jnp.asarray(x, jnp.float32)
  fn = prefix_attention if kernel else prefix_attention_reference
  o_pre, l_pre = fn(f32(q), f32(kp), f32(vp), jnp.asarray(plen, jnp.int32), interpret=True,
                    block_sizes=SMALL)
  o_suf, l_suf = decode_attention_reference(f32(q), f32(ks), f32(vs),
                                            jnp.asarray(ctx, jnp.int32),
                                            jnp.asarray(tree))
  out, lse = merge_attention_states([o_pre, o_suf], [l_pre, l_suf])

  def segments(b, t, h):
    p, kv = b // Bg, h // G
    tm = tree if tree.ndim == 2 else tree[b]
    new = [ctx[b] + j for j in range(T) if tm[t, j]]
    idx = list(range(ctx[b])) + new
    return [(kp[p, :plen[p], kv], vp[p, :plen[p], kv]), (ks[b, kv, idx], vs[b, kv, idx])]
  want = numpy_concat_attention(q, segments)
  # |logits| ~ 1250 carry float32 rounding ~ 1250 * 6e-8 into every softmax weight.
  assert_close(out, lse, *want, tol=5e-4 if mode == "extreme_gap" else 1e-5)
  if mode == "empty_segments":
    l_suf, l_pre, lse = np.asarray(l_suf), np.asarray(l_pre), np.asarray(lse)
    assert np.isneginf(l_suf[[0, 4], 1]).all() and np.isneginf(l_pre[:Bg]).all()
    assert np.isneginf(lse[0, 1]).all()           # no prefix (group 0) and no suffix
    assert np.isfinite(np.delete(lse[0], 1, axis=0)).all()
    assert np.isfinite(lse[1:]).all()             # seq 4 query 1: the prefix alone
  if mode == "extreme_gap":
    gap = np.abs(np.asarray(l_pre) - np.asarray(l_suf))
    assert gap.min() > 500
    # The losing segment's weight is exactly 0: the merge returns the winner exactly.
    np.testing.assert_array_equal(np.asarray(out)[:Bg], np.asarray(o_pre)[:Bg])
    np.testing.assert_array_equal(np.asarray(lse)[:Bg], np.asarray(l_pre)[:Bg])
    np.testing.assert_array_equal(np.asarray(out)[Bg:], np.asarray(o_suf)[Bg:])
    np.testing.assert_array_equal(np.asarray(lse)[Bg:], np.asarray(l_suf)[Bg:])


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "reference"])
def test_multi_level_equals_concatenated(kernel):
  """System prompt (P=1) + a document per group (P=2) + a sub-document (P=4) + suffix."""
  rng = np.random.default_rng(9)
  Bg4, T, G, K, D = 2, 3, 2, 2, 64
  B, H = 4 * Bg4, G * K
  q = rng.standard_normal((B, T, H, D))
  spec = [(1, 37, [37]), (2, 50, [50, 0]), (4, 20, [3, 20, 0, 17])]   # (P, L, lengths)
  levels, raw = [], []
  for P, L, lens in spec:
    k = rng.standard_normal((P, L, K, D)) * 1.5
    v = rng.standard_normal((P, L, K, D))
    for p in range(P):
      k[p, lens[p]:] = np.nan
      v[p, lens[p]:] = np.nan
    raw.append((P, k, v, lens))
    levels.append((jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
                   jnp.asarray(lens, jnp.int32)))
  ctx = rng.integers(0, 9, size=B)
  ks, vs = _suffix_inputs(rng, B, T, K, D, 16, ctx)
  qf = jnp.asarray(q, jnp.float32)
  o_pre, l_pre = multi_level_prefix_attention(qf, levels, interpret=True, block_sizes=SMALL,
                                              reference=not kernel)
  o_suf, l_suf = decode_attention_reference(qf, jnp.asarray(ks, jnp.float32),
                                            jnp.asarray(vs, jnp.float32),
                                            jnp.asarray(ctx, jnp.int32))
  out, lse = merge_attention_states([o_pre, o_suf], [l_pre, l_suf])

  def prefix_segments(b, h):
    return [(k[b // (B // P), :lens[b // (B // P)], h // G],
             v[b // (B // P), :lens[b // (B // P)], h // G]) for P, k, v, lens in raw]

  def segments(b, t, h):
    idx = list(range(ctx[b])) + [ctx[b] + j for j in range(t + 1)]
    return prefix_segments(b, h) + [(ks[b, h // G, idx], vs[b, h // G, idx])]
  assert_close(out, lse, *numpy_concat_attention(q, segments), tol=1e-5)
  # The prefix levels alone, too.
  assert_close(o_pre, l_pre, *numpy_concat_attention(q, lambda b, t, h: prefix_segments(b, h)),
               tol=1e-5)


def test_multi_level_rejects_bad_levels():
  q = jnp.zeros((2, 1, 2, 64))
  with pytest.raises(ValueError):
    multi_level_prefix_attention(q, [])
  with pytest.raises(ValueError):
    multi_level_prefix_attention(q, [(jnp.zeros((1, 4, 1, 64)),) * 2])


# --- compiled kernel on a GPU (run on the GPU machine) ------------------------------

def _need_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("c", KERNEL_CASES, ids=str)
def test_kernel_compiled_gpu(c):
  _need_gpu()
  q, k, v, lengths = make_inputs(c, seed=zlib.crc32(str(c).encode()))
  out = prefix_attention(q, k, v, lengths, interpret=False, block_sizes=c.bs)
  ref = prefix_attention_reference(q, k, v, lengths)
  assert_close(*out, *ref, tol=1e-5 if c.dtype == "float32" else 2e-2)


GPU_DEFAULT_CASES = [
    Case(1, 64, 1, 4, 8, 128, 4096, None, dtype="bfloat16", bs=PrefixAttentionBlockSizes()),
    Case(1, 64, 5, 4, 8, 128, 4096, (4000,), dtype="bfloat16", bs=PrefixAttentionBlockSizes()),
    Case(4, 16, 5, 4, 2, 128, 2048, (2048, 17, 0, 1999), dtype="bfloat16",
         bs=PrefixAttentionBlockSizes()),
    Case(2, 8, 17, 7, 2, 64, 1000, (1000, 333), dtype="bfloat16",
         bs=PrefixAttentionBlockSizes()),
    Case(2, 8, 5, 4, 2, 128, 1000, (1000, 333), bs=PrefixAttentionBlockSizes()),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_DEFAULT_CASES, ids=str)
def test_kernel_compiled_gpu_default_blocks(c):
  _need_gpu()
  q, k, v, lengths = make_inputs(c, seed=zlib.crc32(str(c).encode()))
  out = prefix_attention(q, k, v, lengths)
  ref = prefix_attention_reference(q, k, v, lengths)
  tol = 1e-5 if c.dtype == "float32" else 2e-2
  assert_close(*out, *ref, tol=tol)
  # the key splits unmerged (the engine merges them with the suffix part in one pass)
  o_S, lse_S = prefix_attention(q, k, v, lengths, partials=True)
  assert o_S.shape[1:] == q.shape and lse_S.shape == o_S.shape[:-1]
  assert_close(*merge_stacked(o_S, lse_S, axis=0), *ref, tol=tol)


def test_partials_merge_to_the_whole():
  """``partials=True``: [S, B, T, H, D] partial attentions (S = 1 on the paths without key
  splits: the portable kernel in interpret mode, the reference on CPU); merged with a suffix
  part in one pass they equal attention over prefix + suffix keys."""
  c = Case(2, 4, 3, 2, 2, 16, 40, (40, 0), dtype="float32")
  q, k, v, lengths = make_inputs(c, seed=11)
  rng = np.random.default_rng(12)
  ks = jnp.asarray(rng.standard_normal((c.B, 5, c.K, c.D)), jnp.float32)  # a 5-key suffix
  vs = jnp.asarray(rng.standard_normal((c.B, 5, c.K, c.D)), jnp.float32)
  G = c.G
  s = jnp.einsum("bthd,bshd->bths", q, jnp.repeat(ks, G, axis=2)) / np.sqrt(c.D)
  o_suf = jnp.einsum("bths,bshd->bthd", jax.nn.softmax(s, -1), jnp.repeat(vs, G, axis=2))
  l_suf = jax.nn.logsumexp(s, -1)
  # reference: softmax over the concatenated keys of each sequence (its group's prefix + own)
  grp = jnp.arange(c.B) // (c.B // c.P)
  valid = jnp.concatenate([jnp.arange(c.L)[None] < lengths[grp][:, None],
                           jnp.ones((c.B, 5), bool)], axis=1)
  kk = jnp.where(valid[..., None, None], jnp.concatenate([k[grp], ks], axis=1), 0.0)
  vv = jnp.where(valid[..., None, None], jnp.concatenate([v[grp], vs], axis=1), 0.0)
  s2 = jnp.einsum("bthd,bshd->bths", q, jnp.repeat(kk, G, axis=2)) / np.sqrt(c.D)
  s2 = jnp.where(valid[:, None, None], s2, -jnp.inf)
  want = jnp.einsum("bths,bshd->bthd", jax.nn.softmax(s2, -1), jnp.repeat(vv, G, axis=2))
  for interpret in (True, None):
    o_S, lse_S = prefix_attention(q, k, v, lengths, partials=True, interpret=interpret)
    assert o_S.shape == (1,) + q.shape and lse_S.shape == (1,) + q.shape[:3]
    o, lse = merge_stacked(jnp.concatenate([o_suf[None], o_S]),
                           jnp.concatenate([l_suf[None], lse_S]), axis=0)
    np.testing.assert_allclose(o, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(s2, -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dynamic", [True, False])
def test_splits_share_the_valid_length(dynamic):
  """With automatic splits the valid prefix is spread over all splits, so a cache padded far
  past its prefix costs what the valid tokens cost: the ranges partition [0, length) and none
  is longer than an even share (in whole blocks). Static splits (an explicit split_size) keep
  their fixed slots, and the evenness check fails for them."""
  from pallas_kernels.common import cdiv
  from pallas_kernels.splits import split_range
  from pallas_kernels.triton_prefix import PrefixStatic
  rng = np.random.default_rng(3)
  for _ in range(200):
    n, bk = int(rng.integers(1, 9)), int(2 ** rng.integers(4, 7))
    split = int(rng.integers(1, 40)) * bk
    L = n * split
    c = PrefixStatic(L=L, block_q=16, block_k=bk, split_size=split, num_splits=n,
                     dynamic_split=dynamic, has_layer=False, scale_log2=1.0, fast_exp=False,
                     D=64)
    length = int(rng.integers(0, L + 1))
    ranges = [tuple(int(x) for x in split_range(jnp.int32(si), jnp.int32(length), c))
              for si in range(n)]
    covered = [i for lo, hi in ranges for i in range(lo, hi)]
    assert covered == list(range(length))   # a partition, in order
    share = cdiv(cdiv(length, n), bk) * bk   # an even share, rounded up to whole blocks
    even = max(hi - lo for lo, hi in ranges) <= share
    if dynamic:
      assert even
    elif length < split and n > 1 and length > bk:
      assert not even    # one split does all the work


@pytest.mark.parametrize("num_splits", [None, 3])
def test_layer_of_stacked_prefix(num_splits):
  """``layer=`` reads one layer of K/V stacked over layers in place (the engine passes its
  prefix cache this way instead of slicing a copy per layer), with a traced layer under
  ``lax.scan``; ``num_splits`` forces the split count. Each layer must give that layer's
  attention: with the layer index ignored, the layers would all match layer 0."""
  c = Case(2, 2, 3, 3, 2, 64, 40, (37, 5))
  layers = []
  for i in range(3):
    q, k, v, lengths = make_inputs(c, seed=100 + i)
    layers.append((k, v))
  k_all = jnp.stack([kv[0] for kv in layers])
  v_all = jnp.stack([kv[1] for kv in layers])
  bs = dataclasses.replace(SMALL, split_size=None, num_splits=num_splits)

  @jax.jit
  def run(q, k_all, v_all, lengths):
    def body(carry, layer):
      return carry, prefix_attention(q, k_all, v_all, lengths, interpret=True, block_sizes=bs,
                                     layer=layer)
    return jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))[1]

  outs, lses = run(q, k_all, v_all, lengths)
  for i, (k, v) in enumerate(layers):
    ref = numpy_prefix_attention(q, k, v, lengths)
    assert_close(outs[i], lses[i], *ref, tol=1e-5)
    ref2 = prefix_attention_reference(q, k_all, v_all, lengths, layer=jnp.int32(i))
    assert_close(*ref2, *ref, tol=1e-5)
  with pytest.raises(ValueError, match="layers, P, L, K, D"):
    prefix_attention(q, k_all[0], v_all[0], lengths, layer=0, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 22])
def test_layer_of_stacked_prefix_gpu(num_splits):
  """The compiled kernel reads a traced layer of a stacked prefix in place (bf16, the engine's
  shapes: 6 query heads per KV head, 2 KV heads)."""
  _need_gpu()
  c = Case(1, 16, 1, 6, 2, 128, 2048, (1999,), dtype="bfloat16")
  per_layer = [make_inputs(c, seed=200 + i) for i in range(3)]
  q, lengths = per_layer[0][0], per_layer[0][3]
  k_all = jnp.stack([x[1] for x in per_layer])
  v_all = jnp.stack([x[2] for x in per_layer])
  bs = PrefixAttentionBlockSizes(num_splits=num_splits)
  f = jax.jit(lambda layer: prefix_attention(q, k_all, v_all, lengths, block_sizes=bs,
                                             layer=layer))
  for i in range(3):
    ref = prefix_attention_reference(q, per_layer[i][1], per_layer[i][2], lengths)
    assert_close(*f(jnp.int32(i)), *ref, tol=2e-2)
