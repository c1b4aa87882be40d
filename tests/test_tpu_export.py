"""The jitted decode / verify step of a small model, exported for TPU on this CPU machine.

``jax.export`` with ``platforms=["tpu"]`` runs the whole lowering for TPU
(StableHLO for the model, and Pallas -> Mosaic MLIR for the attention kernels,
serialized into ``tpu_custom_call``s) without a TPU: it proves that the TPU
kernels lower inside a real model step (stacked caches, the layer index traced
in the layer scan, tree masks, the sparse draft, the shared prefix). The Mosaic
compiler itself (libtpu) does not run here.

``target_platform("tpu")`` makes the library's dispatch pick the TPU kernels
while tracing on the CPU backend; ``impl="pallas"`` makes the model's attention
call the kernels at all (``impl="auto"`` picks them only on a GPU/TPU backend).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

from jaxspec.attention import AttentionPlan
from jaxspec.cache import KVCache
from jaxspec.model import forward, unstack_layers
from pallas_kernels import prefix_attention, target_platform
from tiny import tiny_model

B, S = 4, 256


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _model(dtype=jnp.bfloat16):
  return tiny_model(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=64, vocab=128,
                    dtype=dtype)


def _export_step(model, T, *, mask=None, sink=None, window=None, unrolled=False,
                 cache_dtype=jnp.bfloat16):
  cfg = model.config
  params = unstack_layers(model.params) if unrolled else model.params

  def step(params, tokens, cache, mask):
    plan = AttentionPlan(lengths=cache.lengths, mask=mask, sink=sink, window=window,
                         impl="pallas")
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    return forward(cfg, params, tokens, positions, cache, plan)

  args = (_abstract(params), jax.ShapeDtypeStruct((B, T), jnp.int32),
          KVCache.create(cfg, B, S, dtype=cache_dtype, abstract=True), mask)
  with target_platform("tpu"):
    return export.export(jax.jit(step), platforms=["tpu"])(*args)


def _custom_calls(exported):
  return sorted(set(re.findall(r"custom_call @(\w+)", exported.mlir_module())))


def _check(exported, kernel_name, size_range):
  assert exported.platforms == ("tpu",)
  text = exported.mlir_module()
  # Only Mosaic kernels: the attention is the TPU kernel, not XLA or Triton.
  assert _custom_calls(exported) == ["tpu_custom_call"]
  assert re.search(rf'kernel_name = "{kernel_name}"', text) or kernel_name in text
  assert "__gpu$xla.gpu.triton" not in text and "triton_kernel_call" not in text
  size = len(exported.mlir_module_serialized)
  lo, hi = size_range
  assert lo <= size <= hi, f"serialized StableHLO of {size} bytes, expected [{lo}, {hi}]"
  return size


STEP_CASES = {
    # name: (T, mask, sink, window, unrolled, cache dtype)
    "decode": (1, None, None, None, False, jnp.bfloat16),
    "decode_unrolled_layers": (1, None, None, None, True, jnp.bfloat16),
    "decode_f32_cache": (1, None, None, None, False, jnp.float32),
    "verify_chain": (5, None, None, None, False, jnp.bfloat16),
    "verify_tree": (5, "tree", None, None, False, jnp.bfloat16),
    "verify_tree_per_batch": (17, "tree_b", None, None, False, jnp.bfloat16),
    "sparse_draft": (1, None, 16, 96, False, jnp.bfloat16),
}


@pytest.mark.parametrize("name", list(STEP_CASES))
def test_model_step_exports_for_tpu(name):
  T, mask, sink, window, unrolled, cache_dtype = STEP_CASES[name]
  model = _model()
  mask_arg = None
  if mask == "tree":
    mask_arg = jax.ShapeDtypeStruct((T, T), jnp.bool_)
  elif mask == "tree_b":
    mask_arg = jax.ShapeDtypeStruct((B, T, T), jnp.bool_)
  exported = _export_step(model, T, mask=mask_arg, sink=sink, window=window,
                          unrolled=unrolled, cache_dtype=cache_dtype)
  # About 30 KB for this 2-layer model (the Mosaic kernel body is ~6 KB of it);
  # the bounds catch a kernel that vanished (falls to XLA) or a blown-up program.
  _check(exported, "jaxspec_tpu_decode_attention", (15_000, 120_000))
  # Round trip through the exported artifact, where this jax can (needs flatbuffers).
  try:
    blob = exported.serialize()
  except ImportError:
    return
  again = export.deserialize(blob)
  assert again.platforms == ("tpu",) and _custom_calls(again) == ["tpu_custom_call"]
  assert 15_000 <= len(blob) <= 200_000


def test_kernel_dots_full_precision_for_f32_only():
  """float32 caches: the kernel asks Mosaic for full-precision (not bf16-pass) matmuls;
  bf16 caches: default precision (one MXU pass)."""
  from pallas_kernels import tpu_decode_attention

  def precisions(dtype):
    q = jnp.zeros((1, 1, 2, 64), dtype)
    k = jnp.zeros((1, 1, 128, 64), dtype)
    jaxpr = jax.make_jaxpr(lambda q, k: tpu_decode_attention(
        q, k, k, jnp.zeros((1,), jnp.int32)))(q, k)
    return set(re.findall(r"precision=\(?(\w+\.\w+|None)", str(jaxpr)))
  assert precisions(jnp.float32) == {"Precision.HIGHEST"}
  assert "Precision.HIGHEST" not in precisions(jnp.bfloat16)


def test_prefix_attention_exports_for_tpu():
  P, Bg, T, H, K, D, L = 2, 4, 5, 8, 2, 128, 700

  def f(q, k, v, lengths):
    return prefix_attention(q, k, v, lengths)

  args = (jax.ShapeDtypeStruct((P * Bg, T, H, D), jnp.bfloat16),
          jax.ShapeDtypeStruct((P, L, K, D), jnp.bfloat16),
          jax.ShapeDtypeStruct((P, L, K, D), jnp.bfloat16),
          jax.ShapeDtypeStruct((P,), jnp.int32))
  with target_platform("tpu"):
    exported = export.export(jax.jit(f), platforms=["tpu"])(*args)
  _check(exported, "jaxspec_tpu_prefix_attention", (5_000, 60_000))
