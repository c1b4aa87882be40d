"""What every kernel module shares: constants, small integer helpers and hardware probes.

Nothing here imports another module of the package, so every module may import it.
"""
from __future__ import annotations

import jax
from jax import lax

LOG2E = 1.4426950408889634          # log2(e): natural-log logits -> base-2 logits
LN2 = 0.6931471805599453            # ln(2): base-2 log-sum-exp -> natural log
# Matrix products of float32 inputs at full precision (not tf32 / one bf16 pass); for
# 16-bit inputs it changes nothing.
HIGHEST = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
# Shared memory the Triton kernels may plan for: H100/H200 allow 227 KiB per block; keep a
# margin.
TRITON_SMEM_BYTES = 220 * 1024
# Shared memory of one thread block on an H100 / H200 (the Hopper kernel's limit).
HOPPER_SMEM_BYTES = 232448
# Streaming multiprocessors assumed where the device does not say (an H100 SXM).
DEFAULT_NUM_SMS = 132


def cdiv(a: int, b: int) -> int:
    """Ceiling division of Python ints."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """``a`` rounded up to a multiple of ``b``."""
    return cdiv(a, b) * b


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def head_tile(D: int) -> int:
    """The Triton kernels' head-dim tile: D itself when a power of 2 >= 16 (Triton's tiles and
    its matrix products need that), else the next one; the lanes past D are masked (loaded as
    0, never stored), so any head dim (80, 96, 100, ...) runs the kernel."""
    return max(16, next_pow2(D))


def is_nvidia() -> bool:
    """Whether the default device is an NVIDIA GPU."""
    try:
        return "nvidia" in jax.devices()[0].device_kind.lower()
    except Exception:  # pragma: no cover
        return False


def is_hopper_gpu() -> bool:
    """Whether the default backend is a GPU of compute capability 9.x (H100, H200)."""
    if jax.default_backend() != "gpu":
        return False
    cc = getattr(jax.devices()[0], "compute_capability", "")
    return str(cc).startswith("9")


def num_sms() -> int:
    """Streaming multiprocessors of the default device (``DEFAULT_NUM_SMS`` if unknown)."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or DEFAULT_NUM_SMS
    except Exception:  # pragma: no cover
        return DEFAULT_NUM_SMS
