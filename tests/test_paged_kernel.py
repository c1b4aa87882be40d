"""Paged decode/verify attention: the Pallas kernel (interpret mode) vs the jnp reference vs
float64 numpy over the blocks.

Inputs are fresh and random: each sequence's blocks are a random sample of the pool in random
order; the pool's other blocks, a sequence's slots past ``lengths + T_new`` and the gap of a
sparse (sink + window) context hold NaN (and one huge value), and table entries past a
sequence's blocks point at NaN blocks or at no block (NB); a layer other than the one asked for
is NaN too. So a result is finite only if nothing outside the visible keys is read into it.
The numpy oracle reads the keys one by one through the table, with the visibility rule written
out per key.
"""
from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (DecodeAttentionBlockSizes, HopperBlockSizes, decode_attention,
                            paged_decode_attention, paged_decode_attention_reference,
                            paged_decode_route)
from pallas_kernels import triton_paged

SMALL = DecodeAttentionBlockSizes(block_k=16, split_size=32, block_k_new=16)


@dataclasses.dataclass(frozen=True)
class Case:
  B: int
  T: int
  G: int
  K: int
  D: int
  BS: int                       # page size
  MB: int                       # table entries per sequence
  lengths: tuple
  dtype: str = "float32"
  mask: str = "causal"          # causal | tree | tree_b
  sink: int = 0
  window: int = 0
  layers: int = 0               # 0: pool [NB, K, BS, D]; n: [n, NB, K, BS, D], layer n-1 used
  T_new: int = 0                # 0: T
  bs: DecodeAttentionBlockSizes = SMALL
  spare: int = 5                # pool blocks no sequence owns (NaN)

  @property
  def n_new(self) -> int:
    return self.T_new or self.T

  def __str__(self):
    s = (f"B{self.B}T{self.T}G{self.G}K{self.K}D{self.D}-BS{self.BS}x{self.MB}-{self.dtype}-"
         f"{self.mask}")
    if self.T_new:
      s += f"-Tnew{self.T_new}"
    if self.sink or self.window:
      s += f"-sink{self.sink}win{self.window}"
    if self.layers:
      s += f"-L{self.layers}"
    if self.bs is not SMALL:
      s += f"-bk{self.bs.block_k}sp{self.bs.split_size}"
    return s


def make_inputs(c: Case, seed: int):
  """(q, k_pages, v_pages, block_table, lengths, tree_mask, layer) as jnp arrays."""
  rng = np.random.default_rng(seed)
  H = c.G * c.K
  lengths = np.asarray(c.lengths, np.int32)
  Tn = c.n_new
  assert lengths.shape == (c.B,) and (lengths + Tn <= c.MB * c.BS).all()
  need = -(-(lengths + Tn) // c.BS)                     # blocks each sequence owns
  NB = int(need.sum()) + c.spare
  L = max(c.layers, 1)
  k = np.full((L, NB, c.K, c.BS, c.D), np.nan, np.float32)
  v = np.full((L, NB, c.K, c.BS, c.D), np.nan, np.float32)
  layer = L - 1
  owned = rng.permutation(NB)                           # shuffled: a sequence's blocks scatter
  table = np.full((c.B, c.MB), NB, np.int32)
  spare_ids = owned[int(need.sum()):]
  pos = 0
  for b in range(c.B):
    n = int(need[b])
    table[b, :n] = owned[pos:pos + n]
    pos += n
    # past its blocks: no block (NB) or a NaN block no sequence owns
    for e in range(n, c.MB):
      if len(spare_ids) and rng.random() < 0.5:
        table[b, e] = spare_ids[rng.integers(len(spare_ids))]
    end = int(lengths[b]) + Tn
    for s in range(end):                                # the valid slots, through the table
      blk, off = table[b, s // c.BS], s % c.BS
      if (c.sink or c.window) and c.sink <= s < lengths[b] - c.window:
        continue                                        # the sparse gap stays NaN
      k[layer, blk, :, off] = rng.standard_normal((c.K, c.D)) * 1.5
      v[layer, blk, :, off] = rng.standard_normal((c.K, c.D))
    if end % c.BS:                                      # a huge value right past the new tokens
      blk, off = table[b, end // c.BS], end % c.BS
      k[layer, blk, :, off] = 3e38
      v[layer, blk, :, off] = -3e38
  if not c.layers:
    k, v = k[0], v[0]
  q = rng.standard_normal((c.B, c.T, H, c.D), dtype=np.float32)
  if c.mask == "causal":
    tm = None
  elif c.mask == "tree":
    tm = rng.random((c.T, Tn)) < 0.5
    tm[:, 0] = True
  elif c.mask == "tree_b":
    tm = rng.random((c.B, c.T, Tn)) < 0.4
  else:
    raise ValueError(c.mask)
  dt = jnp.dtype(c.dtype)
  return (jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray(table),
          jnp.asarray(lengths), None if tm is None else jnp.asarray(tm),
          layer if c.layers else None)


def numpy_paged_attention(q, k, v, table, lengths, tree_mask, *, sink=0, window=0, layer=None,
                          num_new=None):
  """Float64 attention reading each visible key through the block table."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  if layer is not None:
    k, v = k[layer], v[layer]
  table = np.asarray(table)
  B, T, H, D = q.shape
  K, BS = k.shape[1], k.shape[2]
  G = H // K
  scale = 1.0 / np.sqrt(D)
  out = np.zeros((B, T, H, D))
  lse = np.full((B, T, H), -np.inf)
  tm = None if tree_mask is None else np.asarray(tree_mask, bool)
  T_new = tm.shape[-1] if tm is not None else (num_new or T)
  for b in range(B):
    Lb = int(lengths[b])
    for t in range(T):
      keys = [s for s in range(Lb) if not (sink or window) or s < sink or s >= Lb - window]
      for j in range(T_new):                            # query t is new token T_new - T + t
        if tm is None:
          ok = j <= T_new - T + t
        else:
          ok = tm[t, j] if tm.ndim == 2 else tm[b, t, j]
        if ok:
          keys.append(Lb + j)
      if not keys:
        continue
      blk = table[b, np.asarray(keys) // BS]
      off = np.asarray(keys) % BS
      for hq in range(H):
        kv = hq // G
        kk, vv = k[blk, kv, off], v[blk, kv, off]       # [keys, D]
        logits = kk @ q[b, t, hq] * scale
        m = logits.max()
        w = np.exp(logits - m)
        out[b, t, hq] = (w[:, None] * vv).sum(0) / w.sum()
        lse[b, t, hq] = m + np.log(w.sum())
  return out, lse


def assert_close(out, lse, ref_out, ref_lse, tol):
  out, ref_out = np.asarray(out, np.float64), np.asarray(ref_out, np.float64)
  lse, ref_lse = np.asarray(lse, np.float64), np.asarray(ref_lse, np.float64)
  assert np.isfinite(out).all(), "non-finite out: a key outside the visible ones was read"
  assert not np.isnan(lse).any(), "NaN in lse"
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  empty = np.isneginf(ref_lse)
  assert (out[empty] == 0).all(), "a query that saw no key must give out = 0"
  err = np.abs(out - ref_out).max() / max(np.abs(ref_out).max(), 1e-30)
  assert err <= tol, f"out max rel err {err:.3g} > {tol}"
  fin = ~empty
  if fin.any():
    lerr = (np.abs(lse[fin] - ref_lse[fin]) / np.maximum(1.0, np.abs(ref_lse[fin]))).max()
    assert lerr <= tol, f"lse max rel err {lerr:.3g} > {tol}"


def _seed(c):
  """A fresh seed per run (printed: pytest shows it with a failure)."""
  seed = zlib.crc32(str(c).encode()) ^ int(np.random.default_rng().integers(1 << 30))
  print(f"seed {seed} for {c}")
  return seed


def _run(c, fn, inputs, **kw):
  q, k, v, table, lengths, tm, layer = inputs
  return fn(q, k, v, table, lengths, tm, layer=layer, sink=c.sink, window=c.window,
            num_new=c.T_new or None, **kw)


# --- the kernel (Pallas interpret mode) and the reference against numpy -----------------

KERNEL_CASES = [
    # decode over ragged lengths (0, mid-page, page-aligned), 16-slot pages, GQA
    Case(4, 1, 4, 2, 64, 16, 12, (0, 37, 64, 180)),
    # chain verification (T = gamma + 1), 32-slot pages holding two 16-key tiles, layers
    Case(3, 5, 2, 2, 64, 32, 6, (5, 0, 150), layers=3),
    # a tree level: T = 3 queries over T_new = 9 new tokens spanning pages (one query of the
    # empty sequence sees no key)
    Case(3, 3, 2, 2, 64, 16, 10, (0, 60, 140), mask="tree_b", T_new=9),
    # sparse (sink + window): the window starting inside a page and crossing pages, the sink
    # reaching into the window (short sequences)
    Case(4, 1, 2, 2, 64, 16, 16, (10, 200, 3, 243), sink=4, window=40),
    Case(3, 5, 2, 1, 64, 32, 8, (18, 230, 50), sink=20, window=37, mask="tree", T_new=7,
         layers=2),
    # a page size that is not a power of 2 (three 16-key tiles per page), head dim 80
    Case(3, 2, 2, 2, 80, 48, 5, (0, 47, 200), sink=3, window=50, T_new=4),
    # bf16, the default tile choice on 128-slot pages (64-key tiles), several splits sharing
    # each sequence's context
    Case(2, 5, 4, 2, 128, 128, 6, (600, 77), dtype="bfloat16", mask="tree", T_new=8,
         bs=DecodeAttentionBlockSizes(target_programs=64, min_split_size=64)),
    # tiles of whole pages (a table entry per key): the default tiles on 8-slot pages (64-key
    # context tiles of eight pages, 16-key new-token tiles of two), decode over ragged lengths
    Case(3, 1, 2, 2, 64, 8, 24, (0, 37, 150), bs=DecodeAttentionBlockSizes()),
    # 4-slot pages, head dim 80 (lanes past D masked in the gathered load), sparse, a tree
    # per sequence over more new tokens than queries, a layer axis
    Case(3, 5, 2, 2, 80, 4, 40, (5, 0, 140), mask="tree_b", T_new=7, sink=3, window=50,
         layers=2),
    # both modes in one call: 64-key context tiles of two 32-slot pages, 16-key new-token
    # tiles inside a page; the sparse window starting inside a tile
    Case(2, 5, 2, 2, 64, 32, 8, (100, 33), mask="tree", T_new=9, sink=4, window=40,
         bs=DecodeAttentionBlockSizes(block_k=64, split_size=64, block_k_new=16)),
]


def _with_empty_query(c, tm):
  """A tree-mask row that sees no new token, for a sequence of length 0: that query sees no
  key at all (out = 0, lse = -inf)."""
  if tm is None or tm.ndim != 3 or 0 not in c.lengths:
    return tm
  return tm.at[c.lengths.index(0), 0].set(False)


@pytest.mark.parametrize("c", KERNEL_CASES, ids=str)
def test_kernel_and_reference_match_numpy(c):
  inputs = make_inputs(c, seed=_seed(c))
  inputs = (*inputs[:5], _with_empty_query(c, inputs[5]), inputs[6])
  want = numpy_paged_attention(*inputs[:6], sink=c.sink, window=c.window, layer=inputs[6],
                               num_new=c.T_new or None)
  tol = 1e-5 if c.dtype == "float32" else 2e-2
  out = _run(c, paged_decode_attention, inputs, interpret=True, block_sizes=c.bs)
  q = inputs[0]
  assert out[0].dtype == q.dtype and out[0].shape == q.shape
  assert out[1].dtype == jnp.float32 and out[1].shape == q.shape[:3]
  assert_close(*out, *want, tol=tol)
  ref = _run(c, paged_decode_attention_reference, inputs)
  assert_close(*ref, *want, tol=1e-5 if c.dtype == "float32" else 1e-2)


def test_paged_equals_dense_kernel():
  """The paged kernel on a shuffled pool == the dense kernel on the cache the tables
  describe (same block sizes)."""
  c = Case(3, 4, 2, 2, 64, 16, 8, (0, 33, 110), mask="tree_b", T_new=6)
  q, k, v, table, lengths, tm, _ = make_inputs(c, seed=_seed(c))
  paged = paged_decode_attention(q, k, v, table, lengths, tm, interpret=True, block_sizes=SMALL)
  slot = np.arange(c.MB * c.BS)
  blocks = np.asarray(table)[:, slot // c.BS] % k.shape[0]    # unmapped: any block (masked)
  dense_k, dense_v = (jnp.asarray(np.asarray(x)[blocks, :, slot % c.BS].transpose(0, 2, 1, 3))
                      for x in (k, v))
  dense = decode_attention(q, dense_k, dense_v, lengths, tm, interpret=True, block_sizes=SMALL)
  assert_close(*paged, *dense, tol=1e-6)


# --- argument checks and routing -------------------------------------------------------

def test_page_size_and_tile_errors():
  c = Case(2, 1, 2, 1, 32, 48, 4, (5, 40))
  q, k, v, table, lengths, _, _ = make_inputs(c, seed=0)
  with pytest.raises(ValueError, match="block_k=32 must divide the page size 48 or be a "
                                       "multiple of it"):
    paged_decode_attention(q, k, v, table, lengths, interpret=True,
                           block_sizes=DecodeAttentionBlockSizes(block_k=32))
  with pytest.raises(ValueError, match="block_k_new=64 must divide the page size 48"):
    paged_decode_attention(q, k, v, table, lengths, interpret=True,
                           block_sizes=DecodeAttentionBlockSizes(block_k=16, block_k_new=64))
  k24, v24 = k.reshape(-1, 1, 24, 32), v.reshape(-1, 1, 24, 32)
  with pytest.raises(ValueError, match="power of 2 or a multiple of 16, got 24"):
    paged_decode_attention(q, k24, v24, table, lengths, interpret=True)
  with pytest.raises(ValueError, match="block_table must be"):
    paged_decode_attention(q, k, v, table[:1], lengths, interpret=True)
  with pytest.raises(ValueError, match="block_table must be integer"):
    paged_decode_attention(q, k, v, table.astype(jnp.float32), lengths, interpret=True)
  with pytest.raises(ValueError, match=r"k_pages / v_pages must be \[L, NB, K, BS, D\]"):
    paged_decode_attention(q, k, v, table, lengths, layer=0, interpret=True)
  with pytest.raises(ValueError, match="lengths must be"):
    paged_decode_attention(q, k, v, table, lengths[:1], interpret=True)
  with pytest.raises(TypeError, match="DecodeAttentionBlockSizes"):
    paged_decode_attention(q, k, v, table, lengths, interpret=True,
                           block_sizes=HopperBlockSizes())


def test_cpu_route_is_the_reference():
  c = Case(2, 2, 2, 2, 32, 16, 4, (0, 30), sink=2, window=9)
  inputs = make_inputs(c, seed=_seed(c))
  q, k = inputs[0], inputs[1]
  if jax.default_backend() == "cpu":
    assert paged_decode_route(q, k).kernel == "reference"
  assert paged_decode_route(q, k, interpret=True).kernel == "triton"
  out = _run(c, paged_decode_attention, inputs)
  want = numpy_paged_attention(*inputs[:6], sink=c.sink, window=c.window)
  assert_close(*out, *want, tol=1e-5)


GATHERED_CASES = [
    Case(2, 40, 4, 2, 64, 16, 12, (100, 0), dtype="bfloat16", layers=2, spare=6),
    Case(3, 24, 2, 2, 128, 8, 20, (0, 75, 130), dtype="bfloat16", mask="tree_b", T_new=30),
]


@pytest.mark.parametrize("c", GATHERED_CASES, ids=str)
def test_gathered_hopper_route_in_the_interpreter(c):
  """The ``"hopper-gathered"`` route (the blocks gathered in table order, the Hopper kernel over
  them) in the Pallas interpreter against float64 attention through the table: NaN blocks no
  sequence owns, NaN / huge values past each sequence's slots, stacked layers, a tree mask."""
  from pallas_kernels import dispatch, hopper
  inputs = make_inputs(c, seed=_seed(c))
  q, k, v, table, lengths, tm, layer = inputs
  out = dispatch._gathered_hopper(
      q, k, v, table, lengths, tm, None if layer is None else jnp.int32(layer),
      sm_scale=1.0 / np.sqrt(c.D), num_new=c.T_new or c.T,
      block_sizes=hopper.default_block_sizes(c.D), interpret=True)
  want = numpy_paged_attention(*inputs[:6], layer=layer, num_new=c.T_new or None)
  assert_close(*out, *want, tol=2e-2)


def test_gpu_route_of_prompt_chunks(monkeypatch):
  """On a Hopper GPU a paged call with many query rows per KV head (a prompt chunk) gathers the
  blocks and runs the Hopper kernel; decode / verify shapes, sparse views and explicit Triton
  tiles keep the Triton paged kernel."""
  from pallas_kernels import dispatch, hopper
  monkeypatch.setattr(hopper, "available", lambda: True)
  k = jnp.zeros((3, 8, 2, 16, 128), jnp.bfloat16)
  rows = dispatch.PAGED_HOPPER_MIN_ROWS
  with dispatch.target_platform("gpu"):
    for T, G, kw, want in ((rows // 4, 4, {}, "hopper-gathered"),
                           (rows // 4 - 1, 4, {}, "triton"),
                           (5, 4, {}, "triton"),
                           (rows, 4, {"sink": 4, "window": 64}, "triton"),
                           (rows, 4, {"block_sizes": DecodeAttentionBlockSizes()}, "triton")):
      q = jnp.zeros((1, T, 2 * G, 128), jnp.bfloat16)
      assert paged_decode_route(q, k, **kw).kernel == want, (T, G, kw)
    q = jnp.zeros((1, rows, 8, 128), jnp.float32)  # float32: no Hopper kernel
    assert paged_decode_route(q, k.astype(jnp.float32)).kernel == "triton"
    # the copy is of the whole table: not for tables of many slots per query token
    T = rows // 4
    q = jnp.zeros((1, T, 8, 128), jnp.bfloat16)
    most = dispatch.PAGED_HOPPER_MAX_SLOTS_PER_TOKEN * T
    assert paged_decode_route(q, k, table_slots=most).kernel == "hopper-gathered"
    assert paged_decode_route(q, k, table_slots=most + 16).kernel == "triton"


def test_plan_page_tiles():
  """Default key tiles: the dense choice (128 keys here) on power-of-2 pages (whole pages or
  part of one), halved until it divides other pages; splits of whole tiles."""
  bs = DecodeAttentionBlockSizes()
  for page in (1, 4, 16, 48, 64, 128, 256, 96):
    bq, bk, bkn, split, ns, nq = triton_paged.plan(64, 8, 5, 4, 128, page, 8192 // page,
                                                   sink=0, window=0, bs=bs, on_gpu=False,
                                                   T_new=5)
    for tile in (bk, bkn):
      assert page % tile == 0 or tile % page == 0
    assert split % bk == 0
    assert bk == (128 if page & (page - 1) == 0 else min(128, page & -page))
    assert ns * split >= page * (8192 // page)
  _, bk, _, split, ns, _ = triton_paged.plan(2, 2, 1, 4, 64, 32, 1024, sink=16, window=496,
                                             bs=DecodeAttentionBlockSizes(split_size=64),
                                             on_gpu=False)
  assert ns * split >= 16 + 496 + 2 * bk      # every virtual tile of a sparse context


# --- the compiled kernel on a GPU -------------------------------------------------------

def _need_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("c", KERNEL_CASES, ids=str)
def test_kernel_compiled_gpu(c):
  _need_gpu()
  inputs = make_inputs(c, seed=_seed(c))
  out = _run(c, paged_decode_attention, inputs, interpret=False, block_sizes=c.bs)
  ref = _run(c, paged_decode_attention_reference, inputs)
  assert_close(*out, *ref, tol=1e-5 if c.dtype == "float32" else 2e-2)


GPU_DEFAULT_CASES = [
    Case(8, 1, 4, 4, 128, 16, 256, (4000, 17, 2049, 0, 4095, 1000, 3333, 64), dtype="bfloat16",
         spare=40),
    Case(8, 5, 4, 4, 128, 64, 64, (4000, 17, 2049, 0, 4091, 1000, 3333, 64), dtype="bfloat16",
         mask="tree_b"),
    Case(8, 1, 4, 4, 128, 128, 32, (4000, 17, 2049, 0, 4095, 1000, 3333, 600),
         dtype="bfloat16", sink=16, window=496),
    Case(4, 5, 8, 2, 128, 32, 64, (2000, 17, 1000, 600), sink=4, window=100, T_new=9,
         mask="tree"),
    Case(4, 64, 4, 2, 128, 128, 32, (4000, 17, 2049, 0), dtype="bfloat16", layers=2),
    Case(4, 16, 7, 2, 64, 256, 16, (4000, 17, 2049, 0), dtype="bfloat16", mask="tree",
         T_new=20),
    # tiles of whole pages: 8-slot pages (decode) and 1-slot pages (sparse verify)
    Case(8, 1, 4, 4, 128, 8, 512, (4000, 17, 2049, 0, 4095, 1000, 3333, 64), dtype="bfloat16"),
    Case(4, 5, 4, 2, 128, 1, 2048, (2000, 17, 1000, 600), dtype="bfloat16", sink=16,
         window=496, mask="tree_b"),
    # a prompt chunk (T x G >= PAGED_HOPPER_MIN_ROWS): the blocks gathered, the Hopper kernel
    Case(2, 512, 4, 2, 128, 16, 256, (3000, 0), dtype="bfloat16", layers=2, spare=30),
    Case(1, 384, 6, 2, 128, 16, 160, (1700,), dtype="bfloat16"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_DEFAULT_CASES, ids=str)
def test_kernel_compiled_gpu_default_blocks(c):
  _need_gpu()
  inputs = make_inputs(c, seed=_seed(c))
  out = _run(c, paged_decode_attention, inputs)
  ref = _run(c, paged_decode_attention_reference, inputs)
  assert_close(*out, *ref, tol=1e-5 if c.dtype == "float32" else 2e-2)


# --- Triton lowering on the CPU (no GPU needed) ------------------------------------------

LOWERING_CASES = [
    Case(2, 1, 4, 2, 128, 16, 64, (5, 900), dtype="bfloat16", bs=DecodeAttentionBlockSizes()),
    Case(2, 5, 2, 2, 64, 64, 40, (18, 2500), sink=16, window=40, mask="tree", layers=2,
         T_new=9, bs=DecodeAttentionBlockSizes()),
    # tiles of whole pages (the gathered load), head dim 80
    Case(2, 5, 2, 2, 80, 8, 100, (18, 700), sink=16, window=40, mask="tree", T_new=7,
         bs=DecodeAttentionBlockSizes()),
]


@pytest.mark.parametrize("c", LOWERING_CASES, ids=str)
def test_kernel_lowers_for_cuda(c):
  """The compiled-GPU variant lowers (Triton IR) on a machine without a GPU."""
  q, k, v, table, lengths, tm, layer = make_inputs(c, seed=0)
  layer = None if layer is None else jnp.int32(layer)

  def f(q, k, v, table, lengths, tm, layer):
    return triton_paged.triton_paged_decode_attention(
        q, k, v, table, lengths, tm, layer, sink=c.sink, window=c.window, sm_scale=0.125,
        interpret=False, block_sizes=c.bs, on_gpu=True, num_new=c.T_new or None)
  try:
    lowered = jax.jit(f).trace(q, k, v, table, lengths, tm, layer).lower(
        lowering_platforms=("cuda",))
  except RuntimeError as e:
    if "GPU" in str(e):
      pytest.skip(f"this jax cannot lower for CUDA without a GPU: {e}")
    raise
  assert "jaxspec_paged_decode_attention" in lowered.as_text()
