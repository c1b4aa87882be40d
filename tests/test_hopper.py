"""The Hopper (Mosaic GPU) attention kernel, in the Mosaic GPU interpreter on CPU.

The interpreter simulates the kernel's warpgroups, barriers and TMA copies (the two matrix
products run as jnp dots there), so these tests check the pipeline logic: the ring of K/V
stages, the ping-pong turns of the two consumer warpgroups, splits of the key range, the
ragged last block (masked scores, value rows zeroed by the producer), the new-token mask
tiles of a verification, stacked layers, the software-pipelined consumers (overlap: the
token passing, a first block masked or not, the last PV), ragged lengths incl. 0 and below
one block, NaN garbage past every valid slot. Compared with plain-jnp float32 attention.
Interpretation is slow (seconds per program: the interpreter compiles each program's threads
on their own), so the cases keep few programs (sequences x KV heads x key splits).
"""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (decode_attention, decode_attention_reference, hopper,
                            prefix_attention, prefix_attention_reference)
from pallas_kernels.merge import merge_stacked

pytestmark = pytest.mark.skipif(not hopper.has_mosaic_gpu(), reason="jax without Mosaic GPU")


def _reference(q, k, v, lengths, layout, scale):
  """``rows_attention``'s contract in float32 through the library's shared-prefix reference:
  stream (n1, n2) is prefix group n1 with one sequence whose R "tokens" have one query head
  per KV head n2 (q[N1, N2, R, D] as [B=N1, T=R, H=N2, D], k/v as [P=N1, L, K=N2, D])."""
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  if layout == "BKSD":
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  o, lse = prefix_attention_reference(f32(jnp.swapaxes(q, 1, 2)), f32(k), f32(v), lengths,
                                      sm_scale=scale)
  return jnp.swapaxes(o, 1, 2), jnp.swapaxes(lse, 1, 2)


@pytest.mark.parametrize("layout,lengths,splits,stages,rows_per_wg,pingpong,overlap", [
    # ragged: empty, blocks + tail (2 splits: the second one 1 block + tail) (not in
    # descending order: the longest-first launch order is a real permutation)
    ("PLKD", [0, 200], 2, 2, 64, True, False),
    # whole blocks, one block, a deeper ring (5 blocks in one split wrap 3 stages)
    ("BKSD", [320, 64, 130], 1, 3, 64, False, False),
    # 128-row tiles; a tail-only sequence; a last block past L
    ("BKSD", [1, 327], 1, 2, 128, True, False),
    # software-pipelined consumers: ragged, one block only, an empty split; 2 splits and 3
    # stages
    ("PLKD", [200, 64], 2, 3, 64, True, True),
])
def test_rows_attention_matches_reference(layout, lengths, splits, stages, rows_per_wg,
                                          pingpong, overlap):
  rng = np.random.default_rng(len(lengths) + (splits or 0))
  # One KV head (each program costs seconds in the interpreter); the head index inside a
  # PLKD prefix row is exercised by the prefix-attention test (K=2).
  N2 = 1
  N1, R, D, L = len(lengths), 2 * rows_per_wg, 64, 320
  if rows_per_wg == 128:
    L = 328  # a multiple of 8 (Mosaic's TMA tiles) but not of block_kv
  lengths = jnp.asarray(lengths, jnp.int32)
  shape = (N1, L, N2, D) if layout == "PLKD" else (N1, N2, L, D)
  q = jnp.asarray(rng.standard_normal((N1, N2, R, D)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  pos = (jnp.arange(L)[None, :, None, None] if layout == "PLKD"
         else jnp.arange(L)[None, None, :, None])
  bad = pos >= lengths[:, None, None, None]
  kg = jnp.where(bad, jnp.nan, k).astype(jnp.bfloat16)
  vg = jnp.where(bad, jnp.nan, v).astype(jnp.bfloat16)
  scale = 1 / math.sqrt(D)
  o, lse = hopper.attention(
      q, kg, vg, lengths, kv_layout=layout, sm_scale=scale,
      block_sizes=hopper.HopperBlockSizes(block_kv=64, stages=stages, splits=splits,
                                          rows_per_wg=rows_per_wg, pingpong=pingpong,
                                          overlap=overlap,
                                          longest_first=stages != 3),  # index order too
      interpret=True, out_dtype=jnp.float32)
  ro, rl = _reference(q, k, v, lengths, layout, scale)
  assert not bool(jnp.any(jnp.isnan(o)))
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(rl))
  fin = np.isfinite(rl)
  # bf16 inputs, f32 accumulation; each split's output is stored in bf16 before the merge.
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(rl)[fin], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(o, ro, atol=1e-2, rtol=1e-2)
  empty = np.asarray(lengths) == 0
  assert not empty.any() or float(jnp.max(jnp.abs(o[empty]))) == 0.0


def test_splits_share_the_valid_keys_not_the_key_axis():
  """A cache padded far past its valid keys (a prefix bucket): the splits divide the valid
  length at run time, so every split gets work (split at the key axis, 128 valid keys of
  1024 slots would all land in the first of 2 splits and leave the other program idle)."""
  rng = np.random.default_rng(11)
  D, L, R = 64, 1024, 128
  lengths = jnp.asarray([128, 36], jnp.int32)  # 2 blocks of 64; one ragged block
  q = jnp.asarray(rng.standard_normal((2, 1, R, D)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((2, L, 1, D)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((2, L, 1, D)), jnp.bfloat16)
  bad = jnp.arange(L)[None, :, None, None] >= lengths[:, None, None, None]
  kg = jnp.where(bad, jnp.nan, k).astype(jnp.bfloat16)
  vg = jnp.where(bad, jnp.nan, v).astype(jnp.bfloat16)
  scale = 1 / math.sqrt(D)
  o, lse = hopper.attention(q, kg, vg, lengths, kv_layout="PLKD", sm_scale=scale,
                            block_sizes=hopper.HopperBlockSizes(block_kv=64, splits=2),
                            interpret=True, merge=False)
  assert o.shape == (2, 2, 1, R, D)
  # 128 keys: one block per split; 36 keys: one block, the second split empty
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)).all(axis=(2, 3)),
                                [[True, True], [True, False]])
  o, lse = merge_stacked(o, lse, axis=0, out_dtype=jnp.float32)
  ro, rl = _reference(q, k, v, lengths, "PLKD", scale)
  np.testing.assert_allclose(lse, rl, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(o, ro, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("B,T,K,G,P,splits,partials", [
    # G=4: q[B, T, H, D] read and out written in place (as [P, B/P x T, H, D]), 2 splits
    # returned unmerged (the engine merges them with the suffix part in one pass)
    (4, 2, 2, 4, 2, 2, True),
    (6, 3, 1, 3, 2, 2, False),   # G=3: q as transposed rows [P, K, B/P x T x G, D], merged
])
def test_prefix_attention_through_hopper_kernel(B, T, K, G, P, splits, partials):
  """Stacked layers [layers, P, L, K, D], one read in place; ragged prefix lengths."""
  rng = np.random.default_rng(7 + G)
  D, L = 64, 152
  q = jnp.asarray(rng.standard_normal((B, T, K * G, D)), jnp.bfloat16)
  kp = jnp.asarray(rng.standard_normal((P, L, K, D)), jnp.bfloat16)
  vp = jnp.asarray(rng.standard_normal((P, L, K, D)), jnp.bfloat16)
  lengths = jnp.asarray([70, 151], jnp.int32)  # ascending: longest-first reorders
  bad = jnp.arange(L)[None, :, None, None] >= lengths[:, None, None, None]
  kg = jnp.where(bad, jnp.nan, kp).astype(jnp.bfloat16)
  vg = jnp.where(bad, jnp.nan, vp).astype(jnp.bfloat16)
  other = jnp.full_like(kg, jnp.nan)  # layer 0: must not be read
  o, lse = prefix_attention(q, jnp.stack([other, kg]), jnp.stack([other, vg]), lengths,
                            interpret=True, layer=jnp.int32(1), partials=partials,
                            block_sizes=hopper.HopperBlockSizes(block_kv=64, splits=splits))
  if partials:  # one partial per key split, each over its own part of the prefix
    assert o.shape == (splits,) + q.shape and lse.shape == (splits,) + q.shape[:3]
    o, lse = merge_stacked(o, lse, axis=0)
  ro, rl = prefix_attention_reference(q.astype(jnp.float32), kp.astype(jnp.float32),
                                      vp.astype(jnp.float32), lengths)
  np.testing.assert_allclose(lse, rl, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(o.astype(jnp.float32), ro, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("tree,T,T_new,G,splits,lengths,layered,overlap", [
    # [B, T, T_new] tree, T_new > T, 2 splits (the new tokens straddle their boundary)
    (True, 9, 12, 4, 2, [60, 0], False, False),
    # a sparse tree over 2 blocks with no context: rows that see no key of a whole block
    (True, 70, 72, 1, 2, [0], False, False),
    # causal (in the kernel); 70 new tokens; splits planned by the kernel (the 2-split causal
    # case below and the kernel-planned splits of test_splits_share_the_valid_keys cover it)
    (False, 3, 70, 2, None, [130], True, False),
    # causal as mask tiles: G=3 takes q as transposed rows (not in place)
    (False, 5, 6, 3, 1, [61, 0], False, False),
    # software-pipelined consumers: a tree whose first block is masked (no context) or not
    (True, 9, 12, 4, 1, [0, 100], False, True),
    # causal in the kernel, 2 splits (the new tokens straddle their boundary)
    (False, 3, 70, 2, 2, [7], True, True),
])
def test_verification_through_hopper_kernel(tree, T, T_new, G, splits, lengths, layered,
                                            overlap):
  """decode_attention's contract (context + new tokens under a causal or tree mask) through
  the Hopper kernel's new-token mask tiles, against the float32 reference. G in {1, 2, 4, 8}
  reads q[B, T, H, D] and writes out in place (G boxes of tokens per warpgroup; T padded to
  whole programs in the interpreter), other G through transposed rows."""
  rng = np.random.default_rng(T + T_new)
  B, K, D, S = len(lengths), 1, 64, 320
  q = jnp.asarray(rng.standard_normal((B, T, K * G, D)), jnp.bfloat16)
  shape = ((2,) if layered else ()) + (B, K, S, D)
  k = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  lens = jnp.asarray(lengths, jnp.int32)
  bad = jnp.arange(S)[:, None] >= (lens + T_new)[:, None, None, None]
  kg = jnp.where(bad, jnp.nan, k).astype(jnp.bfloat16)
  vg = jnp.where(bad, jnp.nan, v).astype(jnp.bfloat16)
  tm = None
  if tree:
    tm = jnp.asarray(rng.random((B, T, T_new)) < (0.4 if T < 64 else 0.02))
    tm = tm.at[:, jnp.arange(T), jnp.arange(T) + T_new - T].set(True)  # each sees itself
  kw = dict(layer=jnp.int32(1)) if layered else {}
  nn = None if tree else T_new
  o, lse = decode_attention(q, kg, vg, lens, tm, num_new=nn, interpret=True,
                            block_sizes=hopper.HopperBlockSizes(block_kv=64, splits=splits,
                                                                overlap=overlap),
                            **kw)
  ro, rl = decode_attention_reference(q.astype(jnp.float32), kg.astype(jnp.float32),
                                      vg.astype(jnp.float32), lens, tm, num_new=nn, **kw)
  assert not bool(jnp.any(jnp.isnan(o)))
  np.testing.assert_allclose(lse, rl, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(o.astype(jnp.float32), ro, atol=2e-2, rtol=2e-2)


def test_hopper_block_sizes_and_inputs_are_checked():
  with pytest.raises(ValueError, match="rows_per_wg"):
    hopper.HopperBlockSizes(rows_per_wg=96)
  with pytest.raises(ValueError, match="sink / window"):
    decode_attention(jnp.zeros((1, 1, 4, 64), jnp.bfloat16), jnp.zeros((1, 1, 64, 64),
                     jnp.bfloat16), jnp.zeros((1, 1, 64, 64), jnp.bfloat16),
                     jnp.zeros((1,), jnp.int32), window=8, interpret=True,
                     block_sizes=hopper.HopperBlockSizes())
  with pytest.raises(ValueError, match="multiple of 64"):
    hopper.HopperBlockSizes(block_kv=96)
  with pytest.raises(ValueError, match="stages"):
    hopper.HopperBlockSizes(stages=1)
  with pytest.raises(ValueError, match="504"):  # would hang on the GPU (setmaxnreg waits)
    hopper.HopperBlockSizes(registers=(240, 32))
  with pytest.raises(ValueError, match="168"):  # setmaxnreg: consumers increase
    hopper.HopperBlockSizes(registers=(160, 24))
  with pytest.raises(ValueError, match="consumer, producer"):
    hopper.HopperBlockSizes(registers=(240,))
  assert hopper.HopperBlockSizes(registers=(240, 24)).consumer_registers == 240
  assert hopper.HopperBlockSizes(registers=[232, 40]).registers == (232, 40)
  q = jnp.zeros((1, 1, 128, 64), jnp.float32)
  with pytest.raises(ValueError, match="bf16/f16"):
    hopper.rows_attention(q, jnp.zeros((1, 1, 128, 64)), jnp.zeros((1, 1, 128, 64)),
                          jnp.ones((1,), jnp.int32), kv_layout="BKSD", sm_scale=1.0)
  qb = jnp.zeros((1, 1, 100, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of 128"):
    hopper.rows_attention(qb, qb, qb, jnp.ones((1,), jnp.int32), kv_layout="BKSD",
                          sm_scale=1.0)
  qb = jnp.zeros((1, 1, 128, 64), jnp.bfloat16)
  kb = jnp.zeros((1, 1, 100, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of 8"):
    hopper.rows_attention(qb, kb, kb, jnp.ones((1,), jnp.int32), kv_layout="BKSD",
                          sm_scale=1.0)
  qb = jnp.zeros((1, 1, 128, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="shared memory"):
    hopper.rows_attention(qb, qb, qb, jnp.ones((1,), jnp.int32), kv_layout="BKSD",
                          sm_scale=1.0, block_sizes=hopper.HopperBlockSizes(block_kv=256,
                                                                            stages=4))
  with pytest.raises(ValueError, match="shared memory"):  # Mosaic GPU needed 234640 bytes
    hopper.rows_attention(qb, qb, qb, jnp.ones((1,), jnp.int32), kv_layout="BKSD",
                          sm_scale=1.0, block_sizes=hopper.HopperBlockSizes(stages=3))
  qt = jnp.zeros((1, 16, 3, 64), jnp.bfloat16)  # [B, T, H, D], G = 3 (not in place)
  kt = jnp.zeros((1, 1, 128, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="rows_per_wg"):
    hopper.rows_attention(qt, kt, kt, jnp.ones((1,), jnp.int32), kv_layout="BKSD",
                          sm_scale=1.0, q_layout="BTHD")
  qp = jnp.zeros((1, 16, 4, 64), jnp.bfloat16)  # [B or P, T, H, D], G = 4
  with pytest.raises(ValueError, match="lengths must be"):
    hopper.rows_attention(qp, kt, kt, jnp.ones((2,), jnp.int32), kv_layout="BKSD",
                          sm_scale=1.0, q_layout="BTHD")
  kp = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)  # [P, L, K, D]
  with pytest.raises(ValueError, match="no new tokens"):
    hopper.rows_attention(qp, kp, kp, jnp.ones((1,), jnp.int32), kv_layout="PLKD",
                          sm_scale=1.0, q_layout="BTHD", num_new=2)
  with pytest.raises(ValueError, match="unknown kv_layout"):
    hopper.rows_attention(qt, kt, kt, jnp.ones((1,), jnp.int32), kv_layout="BSKD",
                          sm_scale=1.0, q_layout="BTHD")
  with pytest.raises(ValueError, match="q_layout"):
    hopper.rows_attention(qt, kt, kt, jnp.ones((1,), jnp.int32), kv_layout="BKSD",
                          sm_scale=1.0, q_layout="BHTD")
  with pytest.raises(ValueError, match="bf16/f16"):
    prefix_attention(jnp.zeros((2, 1, 4, 64)), jnp.zeros((1, 8, 2, 64)),
                     jnp.zeros((1, 8, 2, 64)), interpret=True,
                     block_sizes=hopper.HopperBlockSizes())
