#!/usr/bin/env python
"""Benchmark of the decode/verify attention kernel against the memory ceiling and peers.

Writes ``<out>.json`` and ``<out>.md`` (and ``<out>.png`` if matplotlib is there):
  * copy-bandwidth ceiling (and a read-only ceiling) measured in the same run;
  * dense decode/verify, B=64, S=8192 (lengths random in [S/2, S-T]), K=8, G=4,
    D=128, bf16, T in {1, 5, 16, 64}: effective KV bandwidth = bytes of valid K/V
    (slots [0, length+T) of K and V) / time, for this kernel, jax's own Pallas
    ``gqa`` (its native [B, S, K, D] layout, T*G rows per KV head, no mask among
    new tokens), the jnp reference under XLA, and cuDNN through
    ``jax.nn.dot_product_attention`` (key_value_seq_lengths only: no tree/causal
    mask among new tokens), and tokamax's ``dot_product_attention`` (each of its
    implementations, same inputs as cuDNN) when the ``tokamax`` package is importable;
  * sparse (StreamingLLM) S=32768, sink=16, window=496 vs dense over a 512 context;
  * with ``--tune``: a sweep of block sizes per T (time-budgeted).

Timing: each candidate runs ``--inner`` times inside one jitted ``fori_loop`` (the
lengths change with the loop index so nothing is hoisted; no host dispatch gaps);
median over ``--reps`` calls after a warm-up call.

Usage: python scripts/bench_attention.py [--tune] [--budget 400] [--out benchmarks/attention]
       python scripts/bench_attention.py --smoke   # tiny shapes, any backend, no output files
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import (  # noqa: E402
    DecodeAttentionBlockSizes, decode_attention, decode_attention_reference)
from pallas_kernels.triton_decode import GPU_DEFAULTS  # noqa: E402

from benchutil import T0, copy_ceiling, device_time, log, timeit  # noqa: E402,F401


def ceilings(nbytes, inner, reps):
  """Copy ceiling (read + write bytes / time; the best of three loop-carry forms) and a
  read-only ceiling (a max-reduction), by the wall clock and in GPU time. The copies run in
  loops over a donated carry (``benchutil.copy_ceiling``): without donation XLA first copies
  the input into the loop state, one extra pass per loop that would make these ceilings
  ~10% low; in GPU time all the loop's kernels count, as for the kernels timed."""
  n = nbytes // 2
  x = jax.random.normal(jax.random.key(0), (n // 1024, 1024), jnp.bfloat16)
  read_t, _, _ = timeit(lambda i, x: jnp.max(x + i.astype(x.dtype)), (x,), inner=inner,
                        reps=reps)
  dev_read = device_time(lambda i, x: jnp.max(x + i.astype(x.dtype)), (x,), inner=inner,
                         reps=reps)
  variants, dev = copy_ceiling(x.size * 2, inner=inner, reps=reps)
  out = {"bytes": int(x.size * 2), "copy_TBps": max(variants.values()),
         "copy_variants_TBps": variants, "read_s": read_t,
         "read_TBps": x.size * 2 / read_t / 1e12}
  if dev and dev_read:  # the measure the kernels' GPU times are compared with
    out.update(copy_TBps_device=max(dev.values()), copy_variants_TBps_device=dev,
               read_TBps_device=x.size * 2 / dev_read[0] / 1e12)
  return out


def make_case(B, T, K, G, D, S, lengths, dtype=jnp.bfloat16, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (B, T, K * G, D), dtype)
  k = jax.random.normal(kk, (B, K, S, D), dtype)
  v = jax.random.normal(kv, (B, K, S, D), dtype)
  return q, k, v, jnp.asarray(lengths, jnp.int32)


def kv_bytes(lengths, T, K, D, itemsize, sink=0, window=0):
  lengths = np.asarray(lengths, np.int64)
  if sink or window:
    ctx = np.minimum(lengths, sink + window)
  else:
    ctx = lengths
  return int((ctx + T).sum() * K * D * 2 * itemsize)


def ours_step(bs, sink=0, window=0):
  def step(i, q, k, v, lengths):
    o, l = decode_attention(q, k, v, lengths - (i % 2), sink=sink, window=window,
                            block_sizes=bs)
    return o[0, 0, 0, 0] + l[0, 0, 0]
  return step


def ours_step_interpret(bs, sink=0, window=0):
  def step(i, q, k, v, lengths):
    o, l = decode_attention(q, k, v, lengths - (i % 2), sink=sink, window=window,
                            block_sizes=bs, interpret=True)
    return o[0, 0, 0, 0] + l[0, 0, 0]
  return step


def ref_step(i, q, k, v, lengths):
  o, l = decode_attention_reference(q, k, v, lengths - (i % 2))
  return o[0, 0, 0, 0] + l[0, 0, 0]


def gqa_inputs(q, k, v):
  B, T, H, D = q.shape
  K = k.shape[1]
  G = H // K
  q_g = q.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K * T * G, D)
  return q_g, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def gqa_step(T, **kw):
  from jax.experimental.pallas.ops.gpu.decode_attention import gqa

  def step(i, q_g, k_s, v_s, lengths):
    o = gqa(q_g, k_s, v_s, kv_seq_len=lengths - (i % 2) + T, **kw)
    return o[0, 0, 0]
  return step


def cudnn_inputs(q, k, v):
  return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def cudnn_step(T):
  def step(i, q, k_s, v_s, lengths):
    B = q.shape[0]
    o = jax.nn.dot_product_attention(
        q, k_s, v_s, implementation="cudnn",
        query_seq_lengths=jnp.full((B,), T, jnp.int32),
        key_value_seq_lengths=lengths - (i % 2) + T)
    return o[0, 0, 0, 0]
  return step


def tokamax_step(T, impl):
  """tokamax's ``dot_product_attention`` (pip package ``tokamax``; same inputs and visibility as
  the cuDNN peer: ``[B, S, K, D]`` K/V, key_value_seq_lengths only)."""
  tokamax = _tokamax()

  def step(i, q, k_s, v_s, lengths):
    o = tokamax.dot_product_attention(q, k_s, v_s, key_value_seq_lengths=lengths - (i % 2) + T,
                                      implementation=impl)
    return o[0, 0, 0, 0]
  return step


def _tokamax():
  import tokamax
  from absl import flags
  if not flags.FLAGS.is_parsed():  # tokamax reads absl flags; this script's argv is not theirs
    flags.FLAGS.mark_as_parsed()
  return tokamax


def tokamax_version():
  try:
    return getattr(_tokamax(), "__version__", "?")
  except Exception:  # noqa: BLE001 - an optional peer
    return None


TOKAMAX_IMPLS = ("mosaic", "triton", "cudnn", "xla_chunked")


def try_time(name, step, arrays, nbytes, args, results, extra=None):
  try:
    med, best, comp = timeit(step, arrays, inner=args.inner, reps=args.reps)
    rec = {"name": name, "time_us": med * 1e6, "best_us": best * 1e6, "compile_s": comp,
           "TBps": nbytes / med / 1e12, **(extra or {})}
    dev = device_time(step, arrays, inner=args.inner, reps=args.reps)
    if dev:
      rec.update(device_us=dev[0] * 1e6, device_best_us=dev[1] * 1e6, kernels=dev[2],
                 TBps_device=nbytes / dev[0] / 1e12)
    log(f"{name:60s} {med * 1e6:9.1f} us  {nbytes / med / 1e12:6.3f} TB/s  (compile {comp:.1f}s)"
        + (f"  device {dev[0] * 1e6:9.1f} us {nbytes / dev[0] / 1e12:6.3f} TB/s" if dev else ""))
  except Exception as e:  # record and go on: a peer may not accept a shape
    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    rec = {"name": name, "error": msg, **(extra or {})}
    log(f"{name:60s} FAILED {msg}")
    if args.verbose:
      traceback.print_exc()
  results.append(rec)
  return rec


def bs_label(bs: DecodeAttentionBlockSizes):
  d = dataclasses.asdict(bs)
  default = dataclasses.asdict(GPU_DEFAULTS)
  return ",".join(f"{k}={v}" for k, v in d.items() if v != default[k]) or "default"


def tune_space(T, G):
  """Block-size deltas (relative to the GPU defaults) tried per T: the candidates of a full
  block_k x (num_warps, num_stages) x split_size sweep that came close to the defaults, plus
  the compute-bound T=64 variants."""
  rows = T * G
  if rows <= 64:
    return [dict(), dict(block_k=64), dict(fast_exp=False), dict(block_k=32, num_stages=4),
            dict(split_size=4096)]
  return [dict(), dict(fast_exp=False), dict(num_stages=2), dict(block_k=64),
          dict(block_k=64, max_block_q=256, num_stages=2),
          dict(block_k=32, max_block_q=256, num_stages=3),
          dict(block_k=64, max_block_q=64, num_warps=4)]


SPARSE_SPACE = [dict(), dict(split_size=128), dict(split_size=256), dict(block_k=64),
                dict(block_k=64, split_size=128)]


def _next_pow2(n):
  return 1 << max(0, n - 1).bit_length()


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", default="benchmarks/attention")
  p.add_argument("--tune", action="store_true")
  p.add_argument("--budget", type=float, default=400.0, help="seconds for the tuning sweep")
  p.add_argument("--inner", type=int, default=20)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--Ts", default="1,5,16,64")
  p.add_argument("--no-peers", action="store_true")
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--extra", action="store_true",
                 help="instead of the main table: small-batch long-context decode (flash-decoding "
                      "splits) and prefill chunks, vs peers")
  p.add_argument("--retrieval", action="store_true",
                 help="instead of the main table: the self-draft's retrieved blocks (sparse view + "
                      "blocks, dense and paged) against a dense read of as many keys, and the "
                      "cost of the verify kernel's block scores and of the selection")
  p.add_argument("--verbose", action="store_true")
  args = p.parse_args()

  dev = jax.devices()[0]
  env = {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
         "num_sms": getattr(dev, "core_count", None), "jax": jax.__version__,
         "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
         "python": platform.python_version(), "tokamax": tokamax_version(),
         "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
  log("env", env)
  results = {"env": env, "ceiling": None, "dense": [], "sparse": [], "tune": [], "extra": []}

  if args.smoke:
    B, K, G, D, S = 2, 2, 4, 64, 256
    bs = DecodeAttentionBlockSizes(block_k=32)
    for T in (1, 5):
      lengths = [100, 256 - T]
      q, k, v, L = make_case(B, T, K, G, D, S, lengths)
      nb = kv_bytes(lengths, T, K, D, 2)
      args.inner, args.reps = 2, 2
      try_time(f"smoke ours T={T}", ours_step_interpret(bs), (q, k, v, L), nb, args,
               results["dense"])
      try_time(f"smoke ref T={T}", ref_step, (q, k, v, L), nb, args, results["dense"])
    return

  results["ceiling"] = ceilings(2 << 30, args.inner, args.reps)
  c = results["ceiling"]
  log(f"copy ceiling {c['copy_TBps']:.3f} TB/s (read+write; best of {c['copy_variants_TBps']}),"
      f" read-only {c['read_TBps']:.3f} TB/s")

  if args.extra:
    run_extra(args, results)
    return
  if args.retrieval:
    run_retrieval(args, results)
    return

  B, K, G, D, S = 64, 8, 4, 128, 8192
  rng = np.random.default_rng(0)
  Ts = [int(t) for t in args.Ts.split(",")]
  best_bs = {}
  for T in Ts:
    tune_deadline = time.time() + args.budget / len(Ts)
    lengths = rng.integers(S // 2, S - T + 1, size=B)
    q, k, v, L = make_case(B, T, K, G, D, S, lengths, seed=T)
    nb = kv_bytes(lengths, T, K, D, 2)
    base = dict(T=T, B=B, K=K, G=G, D=D, S=S, kv_bytes=nb)
    best = GPU_DEFAULTS
    if args.tune:
      best_t = math.inf
      for delta in tune_space(T, G):
        if time.time() > tune_deadline:
          log("tuning budget spent")
          break
        bs = dataclasses.replace(GPU_DEFAULTS, **delta)
        rec = try_time(f"tune T={T} {bs_label(bs)}", ours_step(bs), (q, k, v, L), nb, args,
                       results["tune"], dict(base, block_sizes=dataclasses.asdict(bs)))
        if rec.get("time_us", math.inf) < best_t:
          best_t, best = rec["time_us"], bs
      log(f"best T={T}: {bs_label(best)} {best_t:.1f} us")
    best_bs[T] = best
    try_time(f"ours T={T} [defaults]", ours_step(None),
             (q, k, v, L), nb, args, results["dense"], dict(base, impl="ours (defaults)"))
    if args.tune:
      try_time(f"ours T={T} [{bs_label(best)}]", ours_step(best), (q, k, v, L), nb, args,
               results["dense"], dict(base, impl="ours (tuned)",
                                      block_sizes=dataclasses.asdict(best)))
    if not args.no_peers:
      qg, ks, vs = gqa_inputs(q, k, v)
      try_time(f"jax pallas gqa T={T} (defaults)", gqa_step(T), (qg, ks, vs, L), nb, args,
               results["dense"], dict(base, impl="jax gqa (defaults)"))
      if T > 1:
        bh = min(64, _next_pow2(T * G))
        try_time(f"jax pallas gqa T={T} block_h={bh}", gqa_step(T, block_h=bh),
                 (qg, ks, vs, L), nb, args, results["dense"],
                 dict(base, impl=f"jax gqa (block_h={bh})"))
      del qg, ks, vs
      qc, kc, vc = cudnn_inputs(q, k, v)
      try_time(f"cudnn T={T}", cudnn_step(T), (qc, kc, vc, L), nb, args, results["dense"],
               dict(base, impl="cudnn"))
      if tokamax_version() is not None:
        for impl in TOKAMAX_IMPLS:
          try_time(f"tokamax {impl} T={T}", tokamax_step(T, impl), (qc, kc, vc, L), nb, args,
                   results["dense"], dict(base, impl=f"tokamax {impl}"))
      del qc, kc, vc
      try_time(f"jnp reference (XLA) T={T}", ref_step, (q, k, v, L), nb, args,
               results["dense"], dict(base, impl="jnp reference"))
    del q, k, v
    write_outputs(results, args.out)

  # Sparse (StreamingLLM): S=32768, sink=16, window=496 vs dense over 512 context.
  S2, sink, window = 32768, 16, 496
  for T in (1, 5):
    lengths = rng.integers(S2 // 2, S2 - T + 1, size=B)
    q, k, v, L = make_case(B, T, K, G, D, S2, lengths, seed=100 + T)
    nb = kv_bytes(lengths, T, K, D, 2, sink, window)
    base = dict(T=T, B=B, K=K, G=G, D=D, S=S2, sink=sink, window=window, kv_bytes=nb)
    if args.tune:
      for delta in SPARSE_SPACE:
        bs = dataclasses.replace(GPU_DEFAULTS, **delta)
        try_time(f"tune sparse T={T} {bs_label(bs)}", ours_step(bs, sink, window),
                 (q, k, v, L), nb, args, results["tune"],
                 dict(base, block_sizes=dataclasses.asdict(bs)))
    try_time(f"sparse T={T} S={S2} sink={sink} window={window}", ours_step(None, sink, window),
             (q, k, v, L), nb, args, results["sparse"], dict(base, impl="ours sparse"))
    del q, k, v
    # Dense over a 512-token context: a cache just big enough (S = 512 + T).
    S3 = sink + window + T
    q, k, v, _ = make_case(B, T, K, G, D, S3, np.zeros(B), seed=200 + T)
    L512 = jnp.full((B,), sink + window, jnp.int32)
    nb512 = kv_bytes(np.full(B, sink + window), T, K, D, 2)
    try_time(f"dense T={T} S={S3} length=512", ours_step(None), (q, k, v, L512), nb512, args,
             results["sparse"], dict(base, impl="ours dense 512", S=S3, sink=0, window=0,
                                     kv_bytes=nb512))
    del q, k, v

  write_outputs(results, args.out)


def run_extra(args, results):
  K, G, D = 8, 4, 128
  H = K * G
  rng = np.random.default_rng(1)
  out = results["extra"]
  # Small batch, long context: parallelism must come from splitting the context.
  for B, S in ((1, 65536), (4, 65536), (16, 32768)):
    for T in (1, 5):
      lengths = rng.integers(S // 2, S - T + 1, size=B)
      q, k, v, L = make_case(B, T, K, G, D, S, lengths, seed=300 + B + T)
      nb = kv_bytes(lengths, T, K, D, 2)
      base = dict(section="small batch, long context", B=B, T=T, S=S, kv_bytes=nb)
      try_time(f"ours B={B} S={S} T={T}", ours_step(None), (q, k, v, L), nb, args, out,
               dict(base, impl="ours (auto splits)"))
      try_time(f"ours B={B} S={S} T={T} one split", ours_step(
          dataclasses.replace(GPU_DEFAULTS, target_programs=1)), (q, k, v, L), nb, args, out,
               dict(base, impl="ours (1 split)"))
      qg, ks, vs = gqa_inputs(q, k, v)
      try_time(f"gqa B={B} S={S} T={T}", gqa_step(T), (qg, ks, vs, L), nb, args, out,
               dict(base, impl="jax gqa (defaults)"))
      del qg, ks, vs
      qc, kc, vc = cudnn_inputs(q, k, v)
      try_time(f"cudnn B={B} S={S} T={T}", cudnn_step(T), (qc, kc, vc, L), nb, args, out,
               dict(base, impl="cudnn"))
      del qc, kc, vc, q, k, v
      write_extra(results, args.out)
  # Prefill chunks after cached context (compute-bound): causal among the chunk.
  for B, T, ctx in ((8, 512, 1536), (2, 1024, 3072), (1, 2048, 6144)):
    S = ctx + T
    lengths = np.full(B, ctx)
    q, k, v, L = make_case(B, T, K, G, D, S, lengths, seed=400 + T)
    nb = kv_bytes(lengths, T, K, D, 2)
    flops = 4 * D * H * B * T * (ctx + (T + 1) / 2)
    base = dict(section="prefill chunk", B=B, T=T, S=S, context=ctx, kv_bytes=nb)
    try_time(f"ours prefill B={B} T={T} ctx={ctx}", ours_step(None), (q, k, v, L), nb, args,
             out, dict(base, impl="ours (causal)", flops=flops))
    qc, kc, vc = cudnn_inputs(q, k, v)
    try_time(f"cudnn prefill B={B} T={T} ctx={ctx} (no mask)", cudnn_step(T), (qc, kc, vc, L),
             nb, args, out, dict(base, impl="cudnn (no causal mask: more work)",
                                 flops=4 * D * H * B * T * (ctx + T)))
    del qc, kc, vc, q, k, v
    write_extra(results, args.out)


def retrieval_step(bs=None, paged=None, **kw):
  """One sparse / scored kernel call per loop index (lengths move with it); ``paged``: a page
  size (the same K/V through a shuffled block table)."""
  from pallas_kernels import paged_decode_attention

  def step(i, q, k, v, lengths, *extra):
    if paged:
      out = paged_decode_attention(q, k, v, extra[0], lengths - (i % 2), block_sizes=bs, **kw)
    else:
      out = decode_attention(q, k, v, lengths - (i % 2), block_sizes=bs, **kw)
    return sum(jnp.ravel(x)[0].astype(jnp.float32) for x in out)
  return step


def to_pages(k, v, page, seed=0):
  B, K, S, D = k.shape
  MB = S // page
  table = np.random.default_rng(seed).permutation(B * MB).astype(np.int32).reshape(B, MB)
  order = jnp.asarray(np.argsort(table.reshape(-1)))

  def pool(c):
    return c.reshape(B, K, MB, page, D).transpose(0, 2, 1, 3, 4).reshape(B * MB, K, page,
                                                                          D)[order]
  return pool(k), pool(v), jnp.asarray(table)


def run_retrieval(args, results):
  """The self-draft's retrieval (Qwen2.5-1.5B's heads: K=2, G=6, D=128; B=64, S=32768, bf16):
  the sparse kernel over sink 16 + window 496 + 512 retrieved slots (8 blocks of 64) against the
  same 1024 keys read densely and against sink 16 + window 1008; the verify kernel with and
  without block scores; the selection (top-8 of 512 blocks per row, layer and KV head)."""
  from jaxspec.retrieval import select_blocks
  B, K, G, D, S, blk, R = 64, 2, 6, 128, 32768, 64, 8
  results["title"] = "The self-draft's retrieved blocks: kernels and selection (diagnostic)"
  results["shape"] = (f"K={K}, G={G}, D={D}, bf16, B={B}; lengths random in [S-2048, S-T]; "
                      f"retrieved: {R} blocks of {blk} per row and KV head")
  out = results["extra"]
  rng = np.random.default_rng(3)
  for T in (1, 5):
    lengths = rng.integers(S - 2048, S - T + 1, size=B)
    q, k, v, L = make_case(B, T, K, G, D, S, lengths, seed=500 + T)
    hi = (lengths - 496) // blk
    sel = np.stack([[rng.choice(np.arange(1, h), R, replace=False) for _ in range(K)]
                    for h in hi]).astype(np.int32)
    sel = jnp.asarray(sel)
    nb = kv_bytes(np.full(B, 1024), T, K, D, 2)
    base = dict(section="draft view, 1024 keys", B=B, T=T, S=S, kv_bytes=nb)
    try_time(f"sparse 16+496 + 8x64 retrieved T={T}", retrieval_step(
        sink=16, window=496, retrieved=sel, retrieve_block=blk), (q, k, v, L, sel), nb, args,
             out, dict(base, impl="sink 16 + window 496 + 512 retrieved"))
    try_time(f"sparse 16+1008 T={T}", retrieval_step(sink=16, window=1008), (q, k, v, L), nb,
             args, out, dict(base, impl="sink 16 + window 1008"))
    for page in (16, 64):
      pk, pv, table = to_pages(k, v, page)
      try_time(f"paged{page} 16+496 + retrieved T={T}", retrieval_step(
          paged=page, sink=16, window=496, retrieved=sel, retrieve_block=blk),
               (q, pk, pv, L, table), nb, args, out,
               dict(base, impl=f"paged (pages of {page}): 16 + 496 + 512 retrieved"))
      try_time(f"paged{page} 16+1008 T={T}", retrieval_step(paged=page, sink=16, window=1008),
               (q, pk, pv, L, table), nb, args, out,
               dict(base, impl=f"paged (pages of {page}): 16 + 1008"))
      del pk, pv
    del k, v
    S3 = 1024 + T
    q3, k3, v3, _ = make_case(B, T, K, G, D, S3, np.zeros(B), seed=600 + T)
    L3 = jnp.full((B,), 1024, jnp.int32)
    try_time(f"dense 1024 keys T={T}", retrieval_step(), (q3, k3, v3, L3), nb, args, out,
             dict(base, impl="dense read of 1024 keys"))
    del q3, k3, v3
    write_extra(results, args.out)
  # the verify kernel over the whole context, with and without the block scores
  T = 5
  lengths = rng.integers(S - 2048, S - T + 1, size=B)
  q, k, v, L = make_case(B, T, K, G, D, S, lengths, seed=700)
  nb = kv_bytes(lengths, T, K, D, 2)
  base = dict(section="verify, whole context", B=B, T=T, S=S, kv_bytes=nb)
  try_time("verify T=5", retrieval_step(), (q, k, v, L), nb, args, out,
           dict(base, impl="verify"))
  try_time("verify T=5 + block scores", retrieval_step(score_block=blk), (q, k, v, L), nb,
           args, out, dict(base, impl="verify + block scores (64)"))
  for page in (16, 64):
    pk, pv, table = to_pages(k, v, page)
    try_time(f"paged{page} verify T=5", retrieval_step(paged=page), (q, pk, pv, L, table), nb,
             args, out, dict(base, impl=f"paged (pages of {page}) verify"))
    try_time(f"paged{page} verify T=5 block_k=64", retrieval_step(
        DecodeAttentionBlockSizes(block_k=64), paged=page), (q, pk, pv, L, table), nb, args,
             out, dict(base, impl=f"paged (pages of {page}) verify, 64-key tiles"))
    try_time(f"paged{page} verify T=5 + scores", retrieval_step(paged=page, score_block=blk),
             (q, pk, pv, L, table), nb, args, out,
             dict(base, impl=f"paged (pages of {page}) verify + block scores"))
    del pk, pv
  del q, k, v
  # the selection of a whole round: 28 layers' scores
  Lyr, n = 28, S // blk
  sc = jax.random.normal(jax.random.key(9), (Lyr, B, K, n), jnp.float32)
  ver = jnp.asarray(lengths, jnp.int32)

  def select(i, sc, ver):
    idx = select_blocks(sc + i.astype(jnp.float32), ver, ver + 5, sink=16, window=496,
                        block=blk, count=R)
    return idx[0, 0, 0, 0]
  try_time("select_blocks (28 layers)", select, (sc, ver), 0, args, out,
           dict(section="selection per round", B=B, T=0, S=S, kv_bytes=0,
                impl="select_blocks, 28 layers, top 8 of 512"))
  write_extra(results, args.out)



def write_extra(results, out):
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  with open(out + ".json", "w") as f:
    json.dump(results, f, indent=1)
  env, c = results["env"], results["ceiling"]
  title = results.get("title", "Decode attention: small batch / long context and prefill chunks")
  lines = [f"# {title}", "",
           f"- device: {env['device']} ({env['num_sms']} SMs), jax {env['jax']}",
           f"- command: `{env['command']}`",
           f"- copy ceiling {c['copy_TBps']:.3f} TB/s, read-only {c['read_TBps']:.3f} TB/s",
           f"- {results.get('shape', 'K=8, G=4, D=128, bf16; decode lengths random in [S/2, S-T]')}", "",
           "| section | B | T | S | implementation | time (us) | KV TB/s | TFLOP/s |",
           "|---|---|---|---|---|---|---|---|"]
  for r in results["extra"]:
    head = f"| {r['section']} | {r['B']} | {r['T']} | {r['S']} | {r['impl']} |"
    if "error" in r:
      lines.append(f"{head} failed: {r['error'][:80]} | | |")
    else:
      tf = f"{r['flops'] / r['time_us'] / 1e6:.0f}" if "flops" in r else ""
      lines.append(f"{head} {r['time_us']:.1f} | {r['TBps']:.3f} | {tf} |")
  with open(out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  log("wrote", out + ".{json,md}")


def write_outputs(results, out):
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  with open(out + ".json", "w") as f:
    json.dump(results, f, indent=1)
  nan = float("nan")
  env, c = results["env"], results["ceiling"] or {"copy_TBps": nan, "read_TBps": nan}
  cd, rd = c.get("copy_TBps_device", nan), c.get("read_TBps_device", nan)
  lines = [f"# Decode/verify attention benchmark", "",
           f"- device: {env['device']} ({env['num_sms']} SMs), jax {env['jax']}, "
           f"python {env['python']}, tokamax {env.get('tokamax') or 'not installed'}",
           f"- command: `{env['command']}`",
           f"- copy ceiling (read+write bytes / time, 2 GiB bf16): wall clock "
           f"**{c['copy_TBps']:.3f} TB/s**, GPU time **{cd:.3f} TB/s**; read-only ceiling "
           f"(max-reduction): {c['read_TBps']:.3f} / {rd:.3f} TB/s",
           "- wall: a jitted loop's wall-clock time per call (its dispatch and the wait for its "
           "end included); GPU: the calls' kernel durations from a profiler trace (what the GPU "
           "spends on them); each against the copy ceiling measured the same way", "",
           "## Dense: B=64, S=8192, lengths in [S/2, S-T], K=8, G=4, D=128, bf16", "",
           "| T | implementation | wall (us) | GPU (us) | KV TB/s (GPU) | % of copy ceiling "
           "(wall / GPU) |", "|---|---|---|---|---|---|"]
  for r in results["dense"]:
    if "error" in r:
      lines.append(f"| {r['T']} | {r['impl']} | failed: {r['error'][:80]} | | | |")
    else:
      lines.append(f"| {r['T']} | {r['impl']} | {r['time_us']:.1f} | "
                   f"{r.get('device_us', nan):.1f} | {r.get('TBps_device', nan):.3f} | "
                   f"{100 * r['TBps'] / c['copy_TBps']:.0f}% / "
                   f"{100 * r.get('TBps_device', nan) / cd:.0f}% |")
  lines += ["", "## Sparse: S=32768, sink=16, window=496 vs dense over a 512 context", "",
            "| T | implementation | wall (us) | GPU (us) | KV TB/s (GPU) |", "|---|---|---|---|---|"]
  for r in results["sparse"]:
    if "error" in r:
      lines.append(f"| {r['T']} | {r['impl']} | failed: {r['error'][:80]} | | |")
    else:
      lines.append(f"| {r['T']} | {r['impl']} | {r['time_us']:.1f} | "
                   f"{r.get('device_us', nan):.1f} | {r.get('TBps_device', nan):.3f} |")
  if results["tune"]:
    lines += ["", "## Tuning sweep (ours)", "", "| T | block sizes | time (us) | KV TB/s |",
              "|---|---|---|---|"]
    for r in results["tune"]:
      if "error" not in r:
        lines.append(f"| {r['T']} | {r['name'].split(' ', 2)[2]} | {r['time_us']:.1f} | "
                     f"{r['TBps']:.3f} |")
  with open(out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    impls = sorted({r["impl"] for r in results["dense"] if "error" not in r})
    for impl in impls:
      pts = [(r["T"], r.get("TBps_device", r["TBps"])) for r in results["dense"]
             if r["impl"] == impl and "error" not in r]
      ax.plot([str(t) for t, _ in pts], [b for _, b in pts], marker="o", label=impl)
    ax.axhline(c.get("copy_TBps_device", c["copy_TBps"]), color="k", ls="--",
               label="copy ceiling")
    ax.set_xlabel("T (new tokens per sequence)")
    ax.set_ylabel("effective KV bandwidth, GPU time (TB/s)")
    ax.set_title(f"decode attention, B=64 S=8192 K=8 G=4 D=128 bf16, {env['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)
  except Exception as e:  # matplotlib missing: JSON + MD are enough
    log("no plot:", e)
  log("wrote", out + ".{json,md,png}")


if __name__ == "__main__":
  main()
