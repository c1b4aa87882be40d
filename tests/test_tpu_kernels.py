"""Mosaic TPU kernels (pallas_kernels/tpu.py) on the CPU under Pallas's TPU interpret mode.

Compared with the jnp references (themselves checked against float64 numpy in
test_decode_attention.py / test_prefix_attention.py) on the kinds of shapes the
GPU tests cover: ragged lengths incl. 0, T in {1, 5, 17, 64}, G in {1, 4, 7},
D in {64, 128}, causal / tree / per-batch tree masks, sink and window crossing
each other and both ends, float32 (tight) and bf16, NaN garbage past the valid
slots and in the sparse gap, stacked layers, T queries that are the last T of
T_new > T new tokens (tree mask [T, T_new] / [B, T, T_new], causal with num_new,
also against the matching rows of a full T_new-query call); prefix: groups, ragged prefix
lengths incl. 0. Also: which cache blocks the index maps stream, and that the
dispatch picks the TPU kernels for a TPU backend.
"""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import (
    TPUDecodeBlockSizes,
    TPUPrefixBlockSizes,
    decode_attention,
    decode_attention_reference,
    prefix_attention,
    prefix_attention_reference,
    target_platform,
    tpu_decode_attention,
    tpu_prefix_attention,
    tpu_prefix_attention_pkld,
)
from pallas_kernels import tpu as tpu_mod
import test_decode_attention as dec
import test_prefix_attention as pre

pltpu = pytest.importorskip("jax.experimental.pallas.tpu")

SMALL = TPUDecodeBlockSizes(block_k=16, new_align=16)        # many blocks, many boundaries
DEFAULT = TPUDecodeBlockSizes()
C = dec.Case

def _id(case_bs):
  c, bs = case_bs
  return f"{c}-bk{bs.block_k}bq{bs.block_q}hb{bs.heads_per_block}"


DECODE_CASES = [
    # plain decode, ragged lengths incl. 0 and non-multiples of every block
    (C(1, 1, 1, 1, 64, 40, (0,)), SMALL),
    (C(3, 1, 4, 2, 128, 200, (0, 37, 195)), SMALL),
    (C(4, 1, 7, 1, 64, 300, (291, 33, 64, 1), dtype="bfloat16"), SMALL),
    # chain / tree verification
    (C(3, 5, 7, 2, 64, 150, (5, 0, 144), mask="tree"), SMALL),
    (C(3, 17, 1, 2, 64, 160, (16, 60, 143), mask="tree_b"), SMALL),
    (C(2, 5, 4, 2, 128, 300, (100, 295), dtype="bfloat16", mask="tree_b"), SMALL),
    (C(2, 17, 7, 1, 128, 100, (0, 83), dtype="bfloat16"), SMALL),
    # large T: one block of 128 rows, then several row blocks
    (C(2, 64, 2, 1, 64, 200, (3, 136)), SMALL),
    (C(1, 64, 4, 2, 64, 300, (150,)), TPUDecodeBlockSizes(block_k=32, block_q=64)),
    # sparse (StreamingLLM): sink and window crossing each other and both ends
    (C(4, 1, 4, 2, 64, 300, (10, 200, 3, 27), sink=4, window=24), SMALL),
    (C(3, 5, 2, 2, 64, 300, (18, 250, 40), sink=16, window=40, mask="tree"), SMALL),
    (C(3, 2, 2, 1, 64, 200, (0, 20, 190), sink=0, window=33), SMALL),
    (C(2, 3, 2, 2, 64, 200, (5, 150), sink=8, window=0, mask="tree_b"), SMALL),
    (C(3, 1, 1, 2, 64, 260, (55, 30, 250), sink=50, window=10), SMALL),
    (C(2, 64, 4, 1, 64, 320, (100, 250), dtype="bfloat16", sink=16, window=48), SMALL),
    # stacked layers: the layer is a prefetched scalar read by the K/V index maps
    (C(2, 5, 4, 2, 64, 100, (0, 70), layers=3), SMALL),
    (C(2, 2, 2, 2, 64, 120, (33, 90), layers=2, sink=4, window=20, mask="tree"), SMALL),
    (C(2, 2, 2, 4, 64, 120, (33, 90), layers=2, sink=4, window=20, mask="tree_b"),
     TPUDecodeBlockSizes(block_k=16, new_align=16, heads_per_block=1)),
    # default blocks (512 dense / 128 sparse, new tokens padded to 128): a partial last block
    (C(2, 1, 4, 2, 128, 1100, (1090, 130), dtype="bfloat16"), DEFAULT),
    (C(2, 5, 4, 1, 64, 600, (300, 590), mask="tree"), DEFAULT),
    (C(3, 1, 4, 2, 128, 1000, (900, 5, 300), dtype="bfloat16", sink=16, window=200), DEFAULT),
    (C(2, 16, 7, 2, 128, 700, (650, 0), dtype="bfloat16", mask="tree_b", layers=2), DEFAULT),
    # the last T of T_new new tokens (one token-tree level over the earlier levels' K/V)
    (C(3, 3, 2, 2, 64, 100, (0, 37, 90), mask="tree", T_new=7), SMALL),
    (C(2, 4, 4, 1, 64, 150, (20, 130), dtype="bfloat16", mask="tree_b", T_new=15), SMALL),
    (C(3, 2, 2, 2, 64, 120, (0, 50, 100), T_new=9), SMALL),
    (C(2, 1, 4, 2, 64, 200, (0, 150), T_new=33), SMALL),                 # > new_align keys
    (C(3, 5, 2, 2, 64, 300, (18, 250, 40), sink=16, window=40, mask="tree", T_new=21), SMALL),
    (C(2, 3, 2, 2, 64, 100, (0, 70), layers=2, mask="tree_b", T_new=6), SMALL),
    (C(2, 4, 4, 2, 128, 1100, (1085, 130), dtype="bfloat16", sink=16, window=200,
       mask="tree_b", T_new=11), DEFAULT),
]


def _decode_inputs(c):
  return dec.make_inputs(c, seed=zlib.crc32(("tpu" + str(c)).encode()))


@pytest.mark.parametrize("case_bs", DECODE_CASES, ids=_id)
def test_tpu_decode_matches_reference(case_bs):
  c, bs = case_bs
  q, k, v, lengths, tm = _decode_inputs(c)
  layer = c.layers - 1 if c.layers else None
  out = tpu_decode_attention(q, k, v, lengths, tm, layer=layer, sink=c.sink, window=c.window,
                             interpret=True, block_sizes=bs, num_new=c.num_new)
  ref = decode_attention_reference(q, k, v, lengths, tm, layer=layer, sink=c.sink,
                                   window=c.window, num_new=c.num_new)
  assert out[0].dtype == q.dtype and out[0].shape == q.shape
  assert out[1].dtype == jnp.float32 and out[1].shape == q.shape[:3]
  dec.assert_close(*out, *ref, tol=1e-5 if c.dtype == "float32" else 2e-2)


@pytest.mark.parametrize("c", dec.LAST_ROWS_CASES, ids=str)
def test_tpu_last_queries_equal_rows_of_full_call(c):
  """T queries over T_new new tokens == the last T rows of the TPU call with all T_new queries."""
  import dataclasses
  full = dataclasses.replace(c, T=c.T_new, T_new=0)
  q_full, k, v, lengths, tm_full = dec.make_inputs(full, seed=zlib.crc32(str(c).encode()))
  first = c.T_new - c.T
  tm = None if tm_full is None else tm_full[..., first:, :]
  part = tpu_decode_attention(q_full[:, first:], k, v, lengths, tm, sink=c.sink,
                              window=c.window, num_new=c.num_new, interpret=True,
                              block_sizes=SMALL)
  whole = tpu_decode_attention(q_full, k, v, lengths, tm_full, sink=c.sink, window=c.window,
                               interpret=True, block_sizes=SMALL)
  dec.assert_close(*part, whole[0][:, first:], whole[1][:, first:],
                   tol=1e-5 if c.dtype == "float32" else 2e-2)


def test_tpu_decode_detects_wrong_window():
  """The comparison is sensitive: a window off by one must fail it."""
  c = C(2, 1, 2, 1, 64, 120, (60, 100), sink=4, window=20)
  q, k, v, lengths, tm = dec.make_inputs(c, seed=3)
  out = tpu_decode_attention(q, k, v, lengths, tm, sink=4, window=20, interpret=True,
                             block_sizes=SMALL)
  wrong = decode_attention_reference(q, k, v, lengths, tm, sink=4, window=21)
  with pytest.raises(AssertionError):
    dec.assert_close(*out, *wrong, tol=1e-5)


def test_tpu_decode_empty_queries():
  """Length 0 and a tree row seeing nothing: out = 0, lse = -inf, no NaN."""
  c = C(2, 4, 2, 1, 64, 64, (0, 9), mask="tree_b")
  q, k, v, lengths, _ = dec.make_inputs(c, seed=4)
  tm = np.ones((2, 4, 4), bool)
  tm[0, 1] = False                    # batch 0 (length 0): query 1 sees nothing
  tm[1, 2] = False                    # batch 1: query 2 sees only context
  out, lse = tpu_decode_attention(q, k, v, lengths, jnp.asarray(tm), interpret=True,
                                  block_sizes=SMALL)
  out, lse = np.asarray(out), np.asarray(lse)
  assert not np.isnan(out).any() and not np.isnan(lse).any()
  assert np.isneginf(lse[0, 1]).all() and (out[0, 1] == 0).all()
  assert np.isfinite(lse[1]).all() and np.isfinite(np.delete(lse, 1, axis=1)[0]).all()


def test_tpu_decode_layer_traced_inside_scan():
  c = C(2, 3, 2, 2, 64, 96, (10, 80), layers=3)
  q, k, v, lengths, _ = dec.make_inputs(c, seed=5)

  @jax.jit
  def run(q, k, v, lengths):
    def body(carry, layer):
      return carry, tpu_decode_attention(q, k, v, lengths, layer=layer, interpret=True,
                                         block_sizes=SMALL)
    return jax.lax.scan(body, 0, jnp.arange(c.layers, dtype=jnp.int32))[1]

  o, l = run(q, k, v, lengths)
  for layer in range(c.layers):
    dec.assert_close(o[layer], l[layer], *decode_attention_reference(q, k, v, lengths,
                                                                     layer=layer), tol=1e-5)


# --- which blocks the K/V index maps stream -----------------------------------------

def _streamed(length, *, S, T, G, sink, window, bk):
  """(blocks of the active steps, number of DMAs the pipeline issues) for one sequence."""
  _, block_k, sink_steps, steps = tpu_mod._decode_plan(
      T, G, S, 2, sink, window, TPUDecodeBlockSizes(block_k=bk))
  c = tpu_mod._Static(S=S, heads=1, block_q=16, block_k=block_k, num_steps=steps, sink=sink,
                      window=window, sparse=bool(sink or window), sink_steps=sink_steps,
                      has_layer=False, has_new=True, mask_per_batch=False, sm_scale=1.0,
                      precision=None)
  active, dmas, prev = [], 0, None
  for j in range(steps):
    blk, lo, hi, act = (int(x) for x in tpu_mod._context_block(jnp.int32(j),
                                                                 jnp.int32(length), c))
    dmas += blk != prev           # Pallas skips the copy when the block index repeats
    prev = blk
    if act:
      active.append((blk, lo, hi))
  return active, dmas


@pytest.mark.parametrize("sink,window", [(0, 0), (16, 496), (4, 24), (0, 33), (50, 10),
                                         (130, 0)])
def test_index_maps_stream_only_visible_blocks(sink, window):
  S, bk = 2048, 128
  for length in (0, 1, 5, 20, 127, 128, 129, 400, 511, 1000, 2047, 2048):
    active, dmas = _streamed(length, S=S, T=1, G=4, sink=sink, window=window, bk=bk)
    if sink or window:
      vis = [s for s in range(length) if s < sink or s >= length - window]
    else:
      vis = list(range(length))
    want = sorted({s // bk for s in vis})
    got = [b for b, _, _ in active]
    # every visible slot is covered exactly once by the (block, segment) pairs
    covered = sorted(s for b, lo, hi in active for s in range(b * bk, (b + 1) * bk)
                     if lo <= s < hi)
    assert covered == vis, (length, sink, window)
    assert sorted(set(got)) == want
    # DMAs: one per distinct consecutive block (a block shared by sink and window
    # segments may be fetched twice), never one per idle step.
    assert dmas <= max(len(got), 1), (length, dmas, got)


# --- shared prefix ------------------------------------------------------------------

P = pre.Case
PSMALL = TPUPrefixBlockSizes(block_k=16)
PREFIX_CASES = [
    (P(2, 2, 5, 4, 2, 64, 33, (0, 29)), PSMALL),
    (P(4, 1, 2, 7, 1, 64, 17, (17, 3, 0, 9), dtype="bfloat16"), PSMALL),
    (P(2, 3, 3, 2, 2, 128, 100, (100, 11)), PSMALL),
    (P(2, 4, 64, 4, 1, 128, 200, (0, 190)), TPUPrefixBlockSizes(block_k=64, block_q=256)),
    (P(2, 8, 17, 7, 2, 64, 300, (300, 133), dtype="bfloat16"), TPUPrefixBlockSizes()),
    (P(1, 16, 5, 4, 2, 128, 1000, (1000,)), TPUPrefixBlockSizes(heads_per_block=1)),
]


def _pid(case_bs):
  c, bs = case_bs
  return f"{c}-bk{bs.block_k}bq{bs.block_q}"


@pytest.mark.parametrize("case_bs", PREFIX_CASES, ids=_pid)
def test_tpu_prefix_matches_reference(case_bs):
  c, bs = case_bs
  q, k, v, lengths = pre.make_inputs(c, seed=zlib.crc32(("tpu" + str(c)).encode()))
  out = tpu_prefix_attention(q, k, v, lengths, interpret=True, block_sizes=bs)
  ref = prefix_attention_reference(q, k, v, lengths)
  assert out[0].dtype == q.dtype and out[1].dtype == jnp.float32
  pre.assert_close(*out, *ref, tol=1e-5 if c.dtype == "float32" else 2e-2)


def test_tpu_prefix_pkld_layout():
  c = P(2, 2, 3, 4, 2, 64, 50, (50, 7))
  q, k, v, lengths = pre.make_inputs(c, seed=11)
  out = tpu_prefix_attention_pkld(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), lengths,
                                  interpret=True, block_sizes=PSMALL)
  pre.assert_close(*out, *prefix_attention_reference(q, k, v, lengths), tol=1e-5)


# --- dispatch -----------------------------------------------------------------------

def test_dispatch_picks_tpu_kernels_for_tpu(monkeypatch):
  """On a TPU backend (here: target_platform("tpu")) both entry points call the TPU kernels."""
  calls = []
  real_dec, real_pre = tpu_mod.tpu_decode_attention, tpu_mod.tpu_prefix_attention

  def spy(name, fn):
    def wrapped(*a, **kw):
      calls.append(name)
      return fn(*a, interpret=True, **kw)
    return wrapped
  monkeypatch.setattr(tpu_mod, "tpu_decode_attention", spy("decode", real_dec))
  monkeypatch.setattr(tpu_mod, "tpu_prefix_attention", spy("prefix", real_pre))
  c = C(2, 2, 2, 1, 64, 48, (7, 30))
  q, k, v, lengths, _ = dec.make_inputs(c, seed=6)
  pc = P(1, 2, 2, 2, 1, 64, 20, (13,))
  pq, pk, pv, plen = pre.make_inputs(pc, seed=7)
  with target_platform("tpu"):
    assert pallas_kernels.dispatch_platform() == "tpu"
    out = decode_attention(q, k, v, lengths)
    pout = prefix_attention(pq, pk, pv, plen)
  assert calls == ["decode", "prefix"]
  dec.assert_close(*out, *decode_attention_reference(q, k, v, lengths), tol=1e-5)
  pre.assert_close(*pout, *prefix_attention_reference(pq, pk, pv, plen), tol=1e-5)
  # Outside the context: the CPU backend's choice (the reference), no TPU kernel.
  assert pallas_kernels.dispatch_platform() == jax.default_backend()
  decode_attention(q, k, v, lengths)
  assert calls == ["decode", "prefix"]


def test_dispatch_lowers_mosaic_for_tpu():
  """decode_attention traced for TPU lowers to a Mosaic custom call (no TPU needed)."""
  c = C(2, 5, 4, 2, 128, 512, (7, 300), dtype="bfloat16", mask="tree_b")
  q, k, v, lengths, tm = dec.make_inputs(c, seed=8)
  with target_platform("tpu"):
    lowered = jax.jit(lambda *a: pallas_kernels.decode_attention(*a, sink=4, window=64)).trace(
        q, k, v, lengths, tm).lower(lowering_platforms=("tpu",))
  text = lowered.as_text()
  assert "tpu_custom_call" in text and "jaxspec_tpu_decode_attention" in text


def test_dispatch_lowers_mosaic_for_tpu_last_queries():
  """The same with T queries over T_new > T new tokens (tree mask [B, T, T_new], causal)."""
  c = C(2, 4, 4, 2, 128, 512, (7, 300), dtype="bfloat16", mask="tree_b", T_new=11)
  q, k, v, lengths, tm = dec.make_inputs(c, seed=8)
  with target_platform("tpu"):
    for mask, kw in ((tm, {}), (None, dict(num_new=11))):
      fn = lambda *a: pallas_kernels.decode_attention(*a, sink=4, window=64, **kw)
      lowered = jax.jit(fn).trace(q, k, v, lengths, mask).lower(lowering_platforms=("tpu",))
      assert "jaxspec_tpu_decode_attention" in lowered.as_text()


def test_block_rules_rejected():
  q = jnp.zeros((1, 1, 2, 64), jnp.bfloat16)
  k = jnp.zeros((1, 1, 100, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="multiple of 16"):
    tpu_decode_attention(q, k, k, jnp.zeros((1,), jnp.int32), interpret=True,
                         block_sizes=TPUDecodeBlockSizes(block_k=24))
