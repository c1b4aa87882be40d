#!/usr/bin/env python
"""Benchmark of the paged decode/verify kernel against the dense kernel on the same K/V.

What it measures. For each shape, the dense kernel (``decode_attention`` over a cache
``[B, K, S, D]``) and the paged kernel (``paged_decode_attention`` over a block pool
``[NB, K, BS, D]`` that holds the same K/V, every sequence's blocks scattered by a shuffled
block table) for each page size BS:

* dense context: B=64, S=8192 (lengths random in ``[S/2, S-T]``), K=8, G=4, D=128, bf16;
* sparse view (the self-speculation draft's StreamingLLM view): S=32768, sink=16,
  window=496 (``--no-sparse`` skips it);
* T (queries = new tokens per sequence) from ``--Ts``: 1 (decode) and gamma + 1 (a chain
  verification, default gamma = 4: T = 5).

Per page size: the paged kernel with its default tiles, with each ``--block-ks`` context tile
that fits the page (tiles inside one page or of whole pages), with a few more block sizes
(``--sweep``), and the path that gathers each sequence's blocks into a dense cache and runs
the dense kernel (what a caller without a paged kernel does; ``--no-gathered`` skips it).
Every paged result is checked against the dense kernel's: the max abs difference of out
relative to max |out| must stay within ``MAX_REL_ERR`` (bf16 rounding), else the run ends
with an error after writing its results.

Timing: each variant runs ``--inner`` times inside one jitted ``fori_loop`` (the lengths change
with the loop index so nothing is hoisted), one compile per variant; wall clock per call
(median over ``--reps`` loops) and GPU time per call (the loop's kernel durations from a
profiler trace, ``benchutil.device_time_of``). Effective KV bandwidth = bytes of the visible
K/V (slots ``[0, length + T)``, or the sink + window + T of a sparse view, of K and V) / time;
the paged kernel's is also given as a fraction of the dense kernel's.

Output: ``<out>/paged_attention.json`` (environment, copy ceiling, one record per variant)
and ``<out>/paged_attention.md`` (a table), rewritten after every variant (a run cut short
keeps what it measured). The device, jax, jaxlib and Python versions are printed first.
Shapes run T by T (every section at the first T before the next T).

Needs a CUDA GPU (the kernels compiled by Triton); elsewhere it stops with an error.
``--smoke`` runs tiny shapes in Pallas interpret mode on any backend (a check of the script,
no meaningful timings).

Usage: python scripts/bench_paged.py [--out benchmarks/paged] [--pages 16,64,128] [--Ts 1,5]
                                     [--block-ks 16] [--no-sparse] [--no-gathered] [--sweep]
       python scripts/bench_paged.py --smoke --out /tmp/paged_smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import (DecodeAttentionBlockSizes, decode_attention,  # noqa: E402
                            paged_decode_attention)
from pallas_kernels.reference import gather_pages  # noqa: E402
from pallas_kernels.triton_paged import plan as paged_plan  # noqa: E402

from benchutil import copy_ceiling, device_time_of, log  # noqa: E402

NAME = "paged_attention"
# bf16 results of the same attention: rounding of out and of the softmax weights only
MAX_REL_ERR = 2e-2


# --- inputs -------------------------------------------------------------------------------

def make_case(B, T, K, G, D, S, lengths, seed):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (B, T, K * G, D), jnp.bfloat16)
  k = jax.random.normal(kk, (B, K, S, D), jnp.bfloat16)
  v = jax.random.normal(kv, (B, K, S, D), jnp.bfloat16)
  return q, k, v, jnp.asarray(lengths, jnp.int32)


def to_pages(x, BS, perm):
  """The dense cache ``x[B, K, S, D]`` as a pool ``[B * S/BS, K, BS, D]`` whose block
  ``perm[b * MB + j]`` holds sequence b's slots ``[j * BS, (j + 1) * BS)``."""
  B, K, S, D = x.shape
  MB = S // BS
  blocks = x.reshape(B, K, MB, BS, D).transpose(0, 2, 1, 3, 4).reshape(B * MB, K, BS, D)
  return jnp.zeros_like(blocks).at[perm].set(blocks)


def kv_bytes(lengths, T, K, D, itemsize, sink=0, window=0):
  """Bytes of the K and V a call must read: the visible context plus the T new tokens."""
  lengths = np.asarray(lengths, np.int64)
  ctx = np.minimum(lengths, sink + window) if (sink or window) else lengths
  return int((ctx + T).sum() * K * D * 2 * itemsize)


# --- the timed steps: step(i, *arrays) -> a scalar of the result -------------------------

def dense_step(bs, sink, window, interpret):
  def step(i, q, k, v, lengths):
    o, l = decode_attention(q, k, v, lengths - (i % 2), sink=sink, window=window,
                            block_sizes=bs, interpret=interpret)
    return o[0, 0, 0, 0] + l[0, 0, 0]
  return step


def paged_step(bs, sink, window, interpret):
  def step(i, q, kp, vp, table, lengths):
    o, l = paged_decode_attention(q, kp, vp, table, lengths - (i % 2), sink=sink, window=window,
                                  block_sizes=bs, interpret=interpret)
    return o[0, 0, 0, 0] + l[0, 0, 0]
  return step


def gathered_step(sink, window, interpret):
  """Each sequence's blocks gathered into a dense cache, then the dense kernel."""
  def step(i, q, kp, vp, table, lengths):
    k, v = gather_pages(kp, table), gather_pages(vp, table)
    o, l = decode_attention(q, k, v, lengths - (i % 2), sink=sink, window=window,
                            interpret=interpret)
    return o[0, 0, 0, 0] + l[0, 0, 0]
  return step


def time_step(step, arrays, *, inner, reps, on_gpu):
  """(median wall s, best wall s, compile s, GPU-time (median s, min s, kernels) or None) per
  call of ``step`` in a jitted ``inner``-call loop, compiled once."""
  @jax.jit
  def loop(*arrays):
    return jax.lax.fori_loop(0, inner, lambda i, acc: acc + step(i, *arrays).astype(
        jnp.float32), jnp.float32(0))
  t = time.perf_counter()
  jax.block_until_ready(loop(*arrays))
  compile_s = time.perf_counter() - t
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(loop(*arrays))
    times.append((time.perf_counter() - t) / inner)
  dev = device_time_of(loop, arrays, calls=inner, reps=reps) if on_gpu else None
  return statistics.median(times), min(times), compile_s, dev


def measure(name, step, arrays, nbytes, args, extra):
  """One variant's record (its error, if any, recorded instead of its times)."""
  rec = {"name": name, **extra}
  try:
    med, best, comp, dev = time_step(step, arrays, inner=args.inner, reps=args.reps,
                                     on_gpu=not args.smoke)
    rec.update(time_us=med * 1e6, best_us=best * 1e6, compile_s=comp, TBps=nbytes / med / 1e12)
    if dev:
      rec.update(device_us=dev[0] * 1e6, kernels=dev[2], TBps_device=nbytes / dev[0] / 1e12)
    log(f"{name:64s} {med * 1e6:9.1f} us {nbytes / med / 1e12:6.3f} TB/s"
        + (f"  GPU {dev[0] * 1e6:9.1f} us {nbytes / dev[0] / 1e12:6.3f} TB/s" if dev else ""))
  except Exception as e:  # noqa: BLE001 - record and go on (e.g. a tile that does not fit)
    rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    log(f"{name:64s} FAILED {rec['error']}")
  return rec


def vs_dense(rec, dense):
  for key in ("TBps", "TBps_device"):
    if key in rec and key in dense:
      rec[f"{key}_vs_dense"] = rec[key] / dense[key]
  return rec


def sweep_space(T, G, BS):
  """Paged-kernel block sizes tried with --sweep (deltas to the defaults)."""
  space = [dict(num_stages=2), dict(num_stages=4), dict(num_warps=8)]
  if T * G <= 32:
    space.append(dict(block_k=128, num_stages=4))
  return space


def tile_fits(block_k, BS):
  return BS % block_k == 0 or block_k % BS == 0


def run_shape(args, results, *, B, K, G, D, S, T, sink, window, pages, seed, section):
  """The dense kernel, then per page size the paged variants, on one shape."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(S // 2, S - T + 1, size=B)
  q, k, v, L = make_case(B, T, K, G, D, S, lengths, seed)
  nb = kv_bytes(lengths, T, K, D, 2, sink, window)
  base = dict(section=section, T=T, B=B, K=K, G=G, D=D, S=S, sink=sink, window=window,
              kv_bytes=nb)
  interpret = True if args.smoke else None
  dense = measure(f"dense T={T}", dense_step(None, sink, window, interpret), (q, k, v, L), nb,
                  args, dict(base, impl="dense kernel"))
  results.append(dense)
  want = decode_attention(q, k, v, L, sink=sink, window=window, interpret=interpret)

  want_scale = float(jnp.max(jnp.abs(want[0].astype(jnp.float32))))

  def check(bs, arrays):
    """Differences of the paged kernel's result from the dense kernel's: max abs of out
    (and relative to max |out|), max abs of lse."""
    got = paged_decode_attention(*arrays[:4], L, sink=sink, window=window, block_sizes=bs,
                                 interpret=interpret)
    err = float(jnp.max(jnp.abs(got[0].astype(jnp.float32) - want[0].astype(jnp.float32))))
    lerr = float(jnp.max(jnp.where(jnp.isneginf(want[1]), 0, jnp.abs(got[1] - want[1]))))
    return err, err / max(want_scale, 1e-30), lerr

  for BS in pages:
    if S % BS:
      log(f"page size {BS} does not divide S={S}: skipped")
      continue
    perm = jnp.asarray(rng.permutation(B * (S // BS)), jnp.int32)
    kp, vp = to_pages(k, BS, perm), to_pages(v, BS, perm)
    table = perm.reshape(B, S // BS)
    arrays = (q, kp, vp, table, L)
    variants = [("default tiles", None)]
    for bk in args.block_ks:
      if tile_fits(bk, BS):
        variants.append((f"block_k={bk}", DecodeAttentionBlockSizes(block_k=bk)))
    if args.sweep:
      for delta in sweep_space(T, G, BS):
        variants.append((str(delta), dataclasses.replace(DecodeAttentionBlockSizes(), **delta)))
    for label, bs in variants:
      try:
        tiles = paged_plan(B, K, T, G, D, BS, S // BS, sink=sink, window=window,
                           bs=bs or DecodeAttentionBlockSizes(), on_gpu=not args.smoke,
                           T_new=T)[:3]
        err, rel, lerr = check(bs, arrays)
      except Exception as e:  # noqa: BLE001 - a block size this page does not take
        results.append(dict(base, name=f"paged BS={BS} {label} T={T}", page_size=BS,
                            impl=f"paged BS={BS} {label}", error=f"{type(e).__name__}: {e}"))
        log(f"paged BS={BS} {label} T={T}: FAILED {type(e).__name__}: {e}")
        continue
      rec = measure(f"paged BS={BS} {label} tiles(q,k,k_new)={tiles} T={T}",
                    paged_step(bs, sink, window, interpret), arrays, nb, args,
                    dict(base, impl=f"paged BS={BS} {label}", page_size=BS, tiles=tiles,
                         max_abs_err_vs_dense=err, max_rel_err_vs_dense=rel,
                         max_abs_lse_err_vs_dense=lerr))
      results.append(vs_dense(rec, dense))
      log(f"  vs dense: out max |diff| {err:.3g} ({rel:.3g} of max |out|), lse {lerr:.3g}; "
          "bandwidth "
          + ", ".join(f"{k}: {rec[k]:.3f}" for k in ("TBps_vs_dense", "TBps_device_vs_dense")
                      if k in rec))
    if args.gathered:
      rec = measure(f"gather + dense BS={BS} T={T}", gathered_step(sink, window, interpret),
                    arrays, nb, args, dict(base, impl=f"gather to dense + dense BS={BS}",
                                           page_size=BS))
      results.append(vs_dense(rec, dense))
    del kp, vp, arrays


# --- environment and output ----------------------------------------------------------------

def _version(dist):
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def environment():
  dev = jax.devices()[0]
  return {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
          "num_sms": getattr(dev, "core_count", None), "jax": jax.__version__,
          "jaxlib": _version("jaxlib"),
          "jax_cuda_plugin": _version("jax-cuda12-plugin") or _version("jax-cuda13-plugin"),
          "numpy": np.__version__, "python": platform.python_version(),
          "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}


class Recorder:
  """The run's records: each new one is added to ``out["results"]`` and the output files are
  rewritten, so a run cut short keeps what it measured."""

  def __init__(self, out, directory):
    self.out, self.directory = out, directory

  def append(self, rec):
    self.out["results"].append(rec)
    write_outputs(self.out, self.directory)


def write_outputs(out, directory):
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, NAME)
  with open(path + ".json", "w") as f:
    json.dump(out, f, indent=1)
  env, c = out["env"], out["ceiling"] or {}
  nan = float("nan")
  lines = ["# Paged vs dense decode/verify attention", "",
           f"- device: {env['device']} ({env['num_sms']} SMs); jax {env['jax']}, jaxlib "
           f"{env['jaxlib']}, python {env['python']}",
           f"- command: `{env['command']}`",
           f"- copy ceiling (read+write): wall {c.get('copy_TBps') or nan:.3f} TB/s, GPU "
           f"{c.get('copy_TBps_device') or nan:.3f} TB/s",
           "- lengths in [S/2, S-T], bf16; paged: the same K/V in a pool of BS-slot blocks, "
           "every sequence's blocks shuffled; KV TB/s = visible K/V bytes / time; "
           "wall = jitted loop's wall clock per call, GPU = its kernels' durations per call",
           "",
           "| section | B | S | T | implementation | wall (us) | GPU (us) | KV TB/s (wall / GPU) "
           "| vs dense (wall / GPU) | diff vs dense (out: max abs / max abs out; lse: max abs) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in out["results"]:
    head = f"| {r['section']} | {r['B']} | {r['S']} | {r['T']} | {r['impl']} |"
    if "error" in r:
      lines.append(f"{head} failed: {r['error'][:100]} | | | | |")
      continue
    diff = (f"{r['max_rel_err_vs_dense']:.3g} / {r['max_abs_lse_err_vs_dense']:.3g}"
            if "max_abs_err_vs_dense" in r else "")
    lines.append(
        f"{head} {r['time_us']:.1f} | {r.get('device_us', nan):.1f} | {r['TBps']:.3f} / "
        f"{r.get('TBps_device', nan):.3f} | {r.get('TBps_vs_dense', nan):.3f} / "
        f"{r.get('TBps_device_vs_dense', nan):.3f} | {diff} |")
  with open(path + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")


def _ints(s):
  return [int(x) for x in s.split(",") if x.strip()]


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default="benchmarks/paged",
                 help="output directory (paged_attention.json and .md)")
  p.add_argument("--pages", type=_ints, default=[16, 64, 128],
                 help="page sizes BS (powers of 2 or multiples of 16 dividing S)")
  p.add_argument("--Ts", type=_ints, default=[1, 5],
                 help="queries per sequence: 1 (decode) and gamma + 1 (verification)")
  p.add_argument("--block-ks", type=_ints, default=[],
                 help="also the paged kernel with these context tiles (where they fit a page)")
  p.add_argument("--inner", type=int, default=20, help="calls per timed loop")
  p.add_argument("--reps", type=int, default=7, help="timed loops (median)")
  p.add_argument("--no-sparse", dest="sparse", action="store_false",
                 help="skip the sparse view (S=32768, sink=16, window=496)")
  p.add_argument("--sweep", action="store_true", help="a few more paged-kernel block sizes")
  p.add_argument("--no-gathered", dest="gathered", action="store_false",
                 help="skip the gather-to-dense path")
  p.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                 help="skip the copy-bandwidth ceiling")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes in interpret mode on any backend (checks the script)")
  args = p.parse_args()

  env = environment()
  log("env", env)
  if not args.smoke and env["platform"] != "gpu":
    raise SystemExit(f"bench_paged.py needs a CUDA GPU (jax sees {env['platform']}: "
                     f"{env['device']}); --smoke runs tiny shapes in interpret mode anywhere")
  out = {"env": env, "ceiling": None, "results": []}
  results = Recorder(out, args.out)

  if args.smoke:
    args.inner, args.reps = 2, 2
    for T in args.Ts:
      run_shape(args, results, B=2, K=2, G=4, D=64, S=256, T=T, sink=0, window=0,
                pages=[8, 16], seed=T, section="smoke")
      if args.sparse:
        run_shape(args, results, B=2, K=2, G=4, D=64, S=256, T=T, sink=4, window=60,
                  pages=[16], seed=T, section="smoke sparse")
    bad = [r["name"] for r in out["results"]
           if "error" in r or r.get("max_rel_err_vs_dense", 0) > MAX_REL_ERR]
    if bad:
      raise SystemExit(f"smoke failed: {bad}")
    return

  if args.ceiling:
    wall, gpu = copy_ceiling(2 << 30, inner=args.inner, reps=args.reps)
    out["ceiling"] = {"copy_TBps": max(wall.values()),
                      "copy_TBps_device": max(gpu.values()) if gpu else None}
    log("copy ceiling", out["ceiling"])
  # T outermost: a run cut short has every section at the first T
  for T in args.Ts:
    run_shape(args, results, B=64, K=8, G=4, D=128, S=8192, T=T, sink=0, window=0,
              pages=args.pages, seed=T, section="dense context")
    if args.sparse:
      run_shape(args, results, B=64, K=8, G=4, D=128, S=32768, T=T, sink=16, window=496,
                pages=args.pages, seed=100 + T, section="sparse sink=16 window=496")
  bad = [r["name"] for r in out["results"] if r.get("max_rel_err_vs_dense", 0) > MAX_REL_ERR]
  if bad:
    raise SystemExit(f"paged results differ from the dense kernel's: {bad}")


if __name__ == "__main__":
  main()
