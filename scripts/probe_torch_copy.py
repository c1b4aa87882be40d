"""An independent copy-bandwidth reference for the ceilings of scripts/bench_*.py: torch's
device-to-device copy of a 2 GiB buffer timed with CUDA events (median of 20 after warm-up),
read + write bytes / time. Usage: python3 scripts/probe_torch_copy.py [GiB]"""
import statistics
import sys

import torch


def main():
  nbytes = int(float(sys.argv[1] if len(sys.argv) > 1 else 2) * (1 << 30))
  x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
  y = torch.empty_like(x)
  for _ in range(5):
    y.copy_(x)
  ts = []
  for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    y.copy_(x)
    b.record()
    b.synchronize()
    ts.append(a.elapsed_time(b) * 1e-3)
  t = statistics.median(ts)
  print(f"torch {torch.__version__} {torch.cuda.get_device_name()}: copy of {nbytes} bytes "
        f"median {t * 1e6:.1f} us = {2 * nbytes / t / 1e12:.3f} TB/s (read + write), "
        f"best {2 * nbytes / min(ts) / 1e12:.3f}")


if __name__ == "__main__":
  main()
