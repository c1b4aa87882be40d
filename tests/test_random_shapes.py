"""Fresh random shapes for the kernels, through the default dispatch: compiled and checked on
a GPU (marked ``gpu``), and lowered for CUDA and TPU on any machine (in ``make test``).

The fixed GPU cases in test_decode_attention / test_prefix_attention were chosen by us; these
are drawn at random (head dims 16..256, odd G and K, T up to ~200 with T_new > T, ragged
lengths incl. 0, sink/window, trees, bf16/f16/f32, NaN garbage past the valid slots; every
other case shaped to fit the Hopper kernel) and run through ``decode_attention`` /
``prefix_attention`` with no block sizes given, i.e. whichever kernel (Triton, or the Hopper
one on an H100/H200) the library picks for that shape, against the plain-jnp references in
float32.

    JAX_PLATFORMS=cuda python3 -m pytest -q -m gpu tests/test_random_shapes.py
    JAXSPEC_GPU_SWEEP_SEED=7 JAXSPEC_GPU_SWEEP_CASES=60 ...   (another draw, more cases)
"""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest

import test_decode_attention as tda
import test_prefix_attention as tpa
from pallas_kernels import (
    decode_attention,
    decode_attention_reference,
    prefix_attention,
    prefix_attention_reference,
)

SEED = int(os.environ.get("JAXSPEC_GPU_SWEEP_SEED", "2026"))
CASES = int(os.environ.get("JAXSPEC_GPU_SWEEP_CASES", "24"))
DTYPES = ("bfloat16", "float16", "float32")
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 1e-2}


def _decode_cases(seed: int, n: int) -> list:
  """Every other case is drawn to fit the Hopper kernel's default (bf16/f16, D % 64 == 0,
  S % 8 == 0, dense, >= 128 rows per KV head): on an H100/H200 those run it, elsewhere Triton."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    hopper = i % 2 == 1
    # head dims that are not powers of 2 (Triton's tiles are: the lanes past D are masked)
    D = int(rng.choice([64, 128, 256] if hopper else [24, 32, 64, 80, 96, 128, 256]))
    G = int(rng.choice([1, 2, 3, 4, 5, 7, 8]))
    K = int(rng.choice([1, 2, 3, 4]))
    if hopper:
      T = int(-(-128 // G) + rng.integers(0, 90))
    else:
      T = int(rng.choice([1, 2, 5, 17, 40, 64, 130]))
    T_new = int(T + rng.choice([0, 0, 0, 3, 11])) if T > 1 else 0
    n_new = T_new or T
    S = int(rng.integers(n_new + 8, 6000))
    if hopper or rng.random() < 0.5:
      S = -(-S // 8) * 8
    B = int(rng.integers(1, 9))
    lengths = rng.integers(0, S - n_new + 1, size=B)
    lengths[rng.random(B) < 0.2] = 0
    if rng.random() < 0.5:
      lengths[0] = S - n_new  # a full cache
    mask = str(rng.choice(["causal", "tree", "tree_b"])) if n_new > 1 else "causal"
    sink = window = 0
    if not hopper and rng.random() < 0.4:
      sink, window = int(rng.integers(0, 33)), int(rng.integers(1, 600))
    dtype = str(rng.choice(DTYPES[:2] if hopper else DTYPES))
    out.append(tda.Case(B, T, G, K, D, S, tuple(int(x) for x in lengths), dtype=dtype, mask=mask,
                        sink=sink, window=window, T_new=T_new, bs=None))
  return out


def _prefix_cases(seed: int, n: int) -> list:
  """Every other case fits the Hopper prefix default (bf16/f16, D % 64 == 0, L % 8 == 0,
  >= 256 rows per group and KV head)."""
  rng = np.random.default_rng(seed + 1)
  out = []
  for i in range(n):
    hopper = i % 2 == 1
    P = int(rng.integers(1, 4))
    T = int(rng.choice([1, 2, 5, 16]))
    G = int(rng.choice([1, 2, 3, 4, 6, 8]))
    if hopper:
      Bg = int(-(-256 // (T * G)) + rng.integers(0, 64))
    else:
      Bg = int(rng.choice([1, 2, 3, 8, 16, 64]))
    L = int(rng.integers(1, 5000))
    if hopper or rng.random() < 0.5:
      L = -(-L // 8) * 8
    lengths = None
    if rng.random() < 0.6:
      lengths = rng.integers(0, L + 1, size=P)
      lengths[rng.random(P) < 0.3] = 0
      lengths = tuple(int(x) for x in lengths)
    D = int(rng.choice([64, 128, 256] if hopper else [16, 32, 64, 80, 100, 128, 256]))
    dtype = str(rng.choice(DTYPES[:2] if hopper else DTYPES))
    out.append(tpa.Case(P, Bg, T, G, int(rng.choice([1, 2, 4])), D, L, lengths, dtype=dtype,
                        bs=None))
  return out


def _need_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")


def _id(c):  # Case.__str__ names interpret-mode block sizes; these run the defaults
  return str(dataclasses.replace(c, bs=type(c).__dataclass_fields__["bs"].default))


@pytest.mark.gpu
@pytest.mark.parametrize("c", _decode_cases(SEED, CASES), ids=_id)
def test_decode_attention_random_shape_gpu(c):
  _need_gpu()
  q, k, v, lengths, tm = tda.make_inputs(c, seed=SEED)
  sparse = dict(sink=c.sink, window=c.window) if c.sink or c.window else {}
  out = decode_attention(q, k, v, lengths, tm, num_new=c.num_new, **sparse)
  ref = decode_attention_reference(q.astype("float32"), k.astype("float32"),
                                   v.astype("float32"), lengths, tm, num_new=c.num_new, **sparse)
  tda.assert_close(*out, *ref, tol=TOL[c.dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("c", _prefix_cases(SEED, CASES), ids=_id)
def test_prefix_attention_random_shape_gpu(c):
  _need_gpu()
  q, k, v, lengths = tpa.make_inputs(c, seed=SEED)
  out = prefix_attention(q, k, v, lengths)
  ref = prefix_attention_reference(q.astype("float32"), k.astype("float32"),
                                   v.astype("float32"), lengths)
  tda.assert_close(*out, *ref, tol=TOL[c.dtype])


# --- the same draws lowered for CUDA and TPU on any machine -------------------------------

LOWER_CASES = int(os.environ.get("JAXSPEC_LOWER_CASES", "10"))
PLATFORMS = ["cuda", "tpu"]


def _lower(platform, fn, *args):
  """Traces ``fn`` as on that accelerator (for CUDA, the dispatch sees a Hopper GPU) and lowers
  it: Mosaic GPU, Triton and Mosaic TPU lower in Python, so shape bugs of every kernel show
  up without the accelerator (only compiling and running need one)."""
  from pallas_kernels import hopper, target_platform
  orig = hopper.available
  hopper.available = lambda: True
  try:
    with target_platform("gpu" if platform == "cuda" else platform):
      return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
  except RuntimeError as e:
    if platform in str(e).lower() or "gpu" in str(e).lower():
      pytest.skip(f"this jax cannot lower for {platform} here: {e}")
    raise
  finally:
    hopper.available = orig


def _spec(shape, dtype):
  return jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("c", _decode_cases(SEED, LOWER_CASES), ids=_id)
def test_decode_attention_random_shape_lowers(c, platform):
  """Random draws catch shapes a kernel cannot lower, e.g. the Hopper kernel at T % 8 != 0
  (T=97) or D=256 with tiles that overflow shared memory."""
  H = c.G * c.K
  q = _spec((c.B, c.T, H, c.D), c.dtype)
  kv = _spec((c.B, c.K, c.S, c.D), c.dtype)
  lengths = jax.ShapeDtypeStruct((c.B,), np.int32)
  tm = {"causal": None, "tree": (c.T, c.n_new), "tree_b": (c.B, c.T, c.n_new)}[c.mask]
  sparse = dict(sink=c.sink, window=c.window) if c.sink or c.window else {}
  fn = lambda q, k, v, lengths, tm: decode_attention(q, k, v, lengths, tm, num_new=c.num_new,
                                                     **sparse)
  lowered = _lower(platform, fn, q, kv, kv, lengths,
                   None if tm is None else jax.ShapeDtypeStruct(tm, np.bool_))
  assert lowered.as_text()


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("c", _prefix_cases(SEED, LOWER_CASES), ids=_id)
def test_prefix_attention_random_shape_lowers(c, platform):
  H = c.G * c.K
  q = _spec((c.B, c.T, H, c.D), c.dtype)
  kv = _spec((c.P, c.L, c.K, c.D), c.dtype)
  lengths = None if c.lengths is None else jax.ShapeDtypeStruct((c.P,), np.int32)
  lowered = _lower(platform, lambda q, k, v, n: prefix_attention(q, k, v, n, partials=True),
                   q, kv, kv, lengths)
  assert lowered.as_text()
