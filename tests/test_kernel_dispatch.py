"""The router (pallas_kernels.dispatch): which kernel serves a call, for each platform.

Routes are decided from shapes, dtypes, block sizes and the platform alone, so they are
checked here without running a kernel: the platform is set with ``target_platform`` and a
Hopper GPU is simulated by patching ``hopper.available``. That the chosen kernels compute the
contract is the business of the kernel tests (test_decode_attention, test_prefix_attention,
test_tpu_kernels, test_hopper, test_random_shapes).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import (DecodeAttentionBlockSizes, HopperBlockSizes,
                            PrefixAttentionBlockSizes, TPUDecodeBlockSizes, TPUPrefixBlockSizes,
                            decode_attention, decode_route, hopper, prefix_attention,
                            prefix_route, target_platform)
from pallas_kernels import dispatch
from pallas_kernels.triton_core import pltriton

S = jax.ShapeDtypeStruct


def _dec(B=2, T=1, G=4, K=2, D=128, Sn=256, dtype=jnp.bfloat16):
    return S((B, T, G * K, D), dtype), S((B, K, Sn, D), dtype)


def _pre(P=1, Bg=8, T=1, G=4, K=2, D=128, L=256, dtype=jnp.bfloat16):
    return S((P * Bg, T, G * K, D), dtype), S((P, L, K, D), dtype)


@pytest.fixture
def hopper_gpu(monkeypatch):
    """The dispatch sees a Hopper GPU."""
    monkeypatch.setattr(hopper, "available", lambda: True)


def test_cpu_routes():
    q, k = _dec()
    with target_platform("cpu"):
        assert decode_route(q, k) == ("reference", None, False)
        assert decode_route(q, k, interpret=True) == ("triton", dispatch.DECODE_GPU_DEFAULTS,
                                                      False)
        bs = DecodeAttentionBlockSizes(block_k=16)
        assert decode_route(q, k, interpret=True, block_sizes=bs).block_sizes is bs
        qp, kp = _pre()
        assert prefix_route(qp, kp) == ("reference", None, False)
        assert prefix_route(qp, kp, interpret=True).kernel == "triton"


@pytest.mark.skipif(pltriton is None, reason="jax without the Triton backend")
def test_gpu_routes_without_hopper(monkeypatch):
    monkeypatch.setattr(hopper, "available", lambda: False)
    q, k = _dec(T=64)
    with target_platform("gpu"):
        route = decode_route(q, k)
        assert route == ("triton", dispatch.DECODE_GPU_DEFAULTS, True)
        assert decode_route(q, k, interpret=True).on_gpu is False
        qp, kp = _pre(Bg=64)
        assert prefix_route(qp, kp) == ("triton", dispatch.PREFIX_GPU_DEFAULTS, True)


@pytest.mark.skipif(pltriton is None, reason="jax without the Triton backend")
def test_gpu_routes_on_hopper(hopper_gpu):
    rows = dispatch.HOPPER_MIN_ROWS_VERIFY
    with target_platform("gpu"):
        # enough query rows per KV head (T x G), dense, bf16/f16: the Hopper kernel
        for T, G in ((rows // 4, 4), (rows, 1), (rows // 8 + 3, 8)):
            q, k = _dec(T=T, G=G)
            route = decode_route(q, k)
            assert route.kernel == "hopper" and route.on_gpu, (T, G)
            assert route.block_sizes == hopper.default_block_sizes(128)
        q, k = _dec(T=rows // 4 - 1, G=4)             # one row short
        assert decode_route(q, k).kernel == "triton"
        q, k = _dec(T=rows // 4, G=4)
        assert decode_route(q, k, window=64).kernel == "triton"                # sparse
        assert decode_route(q, k, interpret=True).kernel == "triton"
        assert decode_route(q, k, block_sizes=DecodeAttentionBlockSizes()).kernel == "triton"
        for dtype in (jnp.float32,):
            assert decode_route(*_dec(T=64, dtype=dtype)).kernel == "triton"
        assert decode_route(*_dec(T=64, D=80)).kernel == "triton"             # D % 64
        assert decode_route(*_dec(T=64, D=192)).kernel == "triton"            # no default tiles
        assert decode_route(*_dec(T=64, D=256)).block_sizes == HopperBlockSizes(block_kv=64)
        assert decode_route(*_dec(T=64, Sn=260)).kernel == "triton"           # S % 8
        # shared prefix: rows per group and KV head are B/P x T x G
        prow = dispatch.HOPPER_MIN_ROWS_PREFIX
        assert prefix_route(*_pre(P=2, Bg=prow // 4, G=4)).kernel == "hopper"
        assert prefix_route(*_pre(P=2, Bg=prow // 4 - 1, G=4)).kernel == "triton"
        assert prefix_route(*_pre(Bg=64, L=100)).kernel == "triton"          # L % 8
        assert prefix_route(*_pre(Bg=64, dtype=jnp.float32)).kernel == "triton"


def test_tpu_routes():
    q, k = _dec(T=64)
    qp, kp = _pre()
    tb, pb = TPUDecodeBlockSizes(block_k=64), TPUPrefixBlockSizes(block_k=64)
    with target_platform("tpu"):
        assert decode_route(q, k) == ("tpu", None, False)
        assert decode_route(q, k, block_sizes=tb).block_sizes is tb
        # block sizes of another kernel: the TPU kernel's defaults
        assert decode_route(q, k, block_sizes=DecodeAttentionBlockSizes()).block_sizes is None
        assert prefix_route(qp, kp, block_sizes=pb) == ("tpu", pb, False)
        assert prefix_route(qp, kp, block_sizes=PrefixAttentionBlockSizes()).block_sizes is None
        assert decode_route(q, k, interpret=True).kernel == "triton"      # the portable kernel


def test_requested_hopper_kernel():
    q, k = _dec(T=4)
    hb = HopperBlockSizes()
    with target_platform("cpu"):
        assert decode_route(q, k, block_sizes=hb, interpret=True) == ("hopper", hb, False)
        with pytest.raises(ValueError, match="Hopper GPU"):
            decode_route(q, k, block_sizes=hb)
        with pytest.raises(ValueError, match="sink / window"):
            decode_route(q, k, block_sizes=hb, sink=4, interpret=True)
        with pytest.raises(ValueError, match="bf16/f16"):
            decode_route(*_dec(dtype=jnp.float32), block_sizes=hb, interpret=True)
        qp, kp = _pre()
        assert prefix_route(qp, kp, block_sizes=hb, interpret=True) == ("hopper", hb, False)
        with pytest.raises(ValueError, match="L % 8"):
            prefix_route(*_pre(L=100), block_sizes=hb, interpret=True)


def test_wrong_block_sizes_name_the_argument():
    q = jnp.zeros((1, 1, 2, 64), jnp.float32)
    k = jnp.zeros((1, 1, 32, 64), jnp.float32)
    with pytest.raises(TypeError, match="block_sizes must be a DecodeAttentionBlockSizes"):
        decode_attention(q, k, k, jnp.zeros((1,), jnp.int32), interpret=True,
                         block_sizes=TPUDecodeBlockSizes())
    kp = jnp.zeros((1, 32, 1, 64), jnp.float32)
    with pytest.raises(TypeError, match="block_sizes must be a PrefixAttentionBlockSizes"):
        prefix_attention(q, kp, kp, interpret=True, block_sizes=DecodeAttentionBlockSizes())


def test_target_platform_nests_and_restores():
    base = jax.default_backend()
    assert dispatch.dispatch_platform() == base
    with target_platform("tpu"):
        with target_platform("gpu"):
            assert dispatch.dispatch_platform() == "gpu"
        assert dispatch.dispatch_platform() == "tpu"
    assert dispatch.dispatch_platform() == base
