#!/usr/bin/env python
"""Checks and times the Hopper (Mosaic GPU, wgmma) attention kernel of pallas_kernels/hopper.py.

On an NVIDIA Hopper GPU, in one run:
  * correctness against float32 jnp references, with NaN garbage past every valid slot:
    ``hopper.attention`` in both K/V layouts for each timed variant (ragged lengths incl. 0
    and a length past the last whole block, 2 splits, a starting state), and
    ``decode_attention`` / ``prefix_attention`` through the kernel (tree masks, T_new > T,
    stacked layers, ragged prefix lengths);
  * ceilings: copy bandwidth and the bf16 matmul rate (``bench_prefix.ceilings``);
  * verification (``decode_attention``'s contract, new tokens included) at B=64, S=8192
    (lengths in [S/2, S-T]), K=8, G=4, D=128, bf16, for T in {16, 32, 64, 128} (T=64 also
    with a random token-tree mask): the Triton kernel vs the Hopper kernel's variants; at
    T=64 also the kernel alone and jax's FlashAttention-3 port (``attention_mgpu``, f16, all
    sequences at the mean context, no masking) as a peer;
  * the shared-prefix shape (B=64, P=1, L=16384, T in {1, 5}): Triton vs Hopper variants.

Writes ``<out>.json`` and ``<out>.md``. Usage:
  python scripts/bench_hopper.py [--out benchmarks/hopper_attention] [--inner 10 --reps 5]
"""
import argparse
import json
import math
import os
import platform
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchutil import log, timeit  # noqa: E402

K, G, D = 8, 4, 128
# (rows_per_wg, block_kv, stages, pingpong, overlap): the default (software-pipelined
# consumers, FlashAttention-3's intra-warpgroup overlap, with ping-pong), the kernel without
# that overlap, and the default with 64-key blocks in a 4-deep ring
VARIANTS = [(64, 128, 2, True, True), (64, 128, 2, True, False), (64, 64, 4, True, True)]
OV = VARIANTS[0]


def hb_of(v, splits=None):
  from pallas_kernels import hopper
  rw, bkv, st, pp, ov = v
  return hopper.HopperBlockSizes(block_kv=bkv, stages=st, rows_per_wg=rw, pingpong=pp,
                                 overlap=ov, splits=splits)


def name(v):
  rw, bkv, st, pp, ov = v
  return f"hopper rw={rw} bkv={bkv} st={st} pp={int(pp)} ov={int(ov)}"


def _rows_reference(q, k, v, lengths, layout):
  """``hopper.rows_attention``'s contract in float32 through the shared-prefix reference:
  stream (n1, n2) is prefix group n1 with one sequence whose R "tokens" have one query head
  per KV head n2 (q[N1, N2, R, D] as [B=N1, T=R, H=N2, D], k/v as [P=N1, L, K=N2, D])."""
  from pallas_kernels import prefix_attention_reference
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  if layout == "BKSD":
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
  ro, rl = prefix_attention_reference(f32(jnp.swapaxes(q, 1, 2)), f32(k), f32(v), lengths,
                                      sm_scale=1 / math.sqrt(D))
  return jnp.swapaxes(ro, 1, 2), jnp.swapaxes(rl, 1, 2)


def check(results):
  from pallas_kernels import (decode_attention, decode_attention_reference, hopper,
                              prefix_attention, prefix_attention_reference)
  rng = np.random.default_rng(0)
  ok = True

  def note(what, o, ro, lse, rl):
    nonlocal ok
    fin = jnp.isfinite(rl)
    e_o = float(jnp.max(jnp.abs(o.astype(jnp.float32) - ro)))
    e_l = float(jnp.max(jnp.where(fin, jnp.abs(lse - rl), 0)))
    good = (e_o < 2e-2 and e_l < 1e-3 and bool(jnp.all(fin == jnp.isfinite(lse)))
            and not bool(jnp.any(jnp.isnan(o))))
    ok &= good
    results.append(dict(kind="check", what=what, max_err_out=e_o, max_err_lse=e_l, ok=good))
    log(results[-1])

  for v in VARIANTS:
    for layout in ("PLKD", "BKSD"):
      N1, N2, R, L = 4, 2, 2 * v[0] * 2, 1000
      lengths = jnp.asarray([0, 777, 1000, 960 + 3], jnp.int32)
      q = jnp.asarray(rng.standard_normal((N1, N2, R, D)), jnp.bfloat16)
      shape = (N1, L, N2, D) if layout == "PLKD" else (N1, N2, L, D)
      k = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
      vv = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
      pos = (jnp.arange(L)[None, :, None, None] if layout == "PLKD"
             else jnp.arange(L)[None, None, :, None])
      bad = pos >= lengths[:, None, None, None]
      what = f"{name(v)} {layout} splits=2"
      try:
        o, lse = hopper.attention(
            q, jnp.where(bad, jnp.nan, k).astype(jnp.bfloat16),
            jnp.where(bad, jnp.nan, vv).astype(jnp.bfloat16), lengths, kv_layout=layout,
            sm_scale=1 / math.sqrt(D), block_sizes=hb_of(v, 2), out_dtype=jnp.float32)
      except Exception as e:  # noqa: BLE001
        log(what, "FAILED", type(e).__name__, str(e)[:800])
        results.append(dict(kind="check", what=what, error=str(e)[:400], ok=False))
        ok = False
        continue
      ro, rl = _rows_reference(q, k, vv, lengths, layout)
      note(what, o, ro, lse, rl)

  for (B, T, Tn, Kc, Gc, S, tree, layered) in ((4, 64, 64, 8, 4, 1000, True, False),
                                               (3, 40, 48, 2, 8, 2056, False, True),
                                               (2, 7, 9, 4, 1, 512, True, True),
                                               (2, 40, 40, 2, 6, 640, False, False)):
    q = jnp.asarray(rng.standard_normal((B, T, Kc * Gc, D)), jnp.bfloat16)
    shp = ((2,) if layered else ()) + (B, Kc, S, D)
    k = jnp.asarray(rng.standard_normal(shp), jnp.bfloat16)
    vv = jnp.asarray(rng.standard_normal(shp), jnp.bfloat16)
    lengths = jnp.asarray(rng.integers(0, S - Tn + 1, B), jnp.int32).at[0].set(S - Tn)
    bad = jnp.arange(S)[None, None, :, None] >= (lengths + Tn)[:, None, None, None]
    kg = jnp.where(bad, jnp.nan, k).astype(jnp.bfloat16)
    vg = jnp.where(bad, jnp.nan, vv).astype(jnp.bfloat16)
    tm = None
    if tree:
      tm = jnp.asarray(rng.random((B, T, Tn)) < 0.3)
      tm = tm.at[:, jnp.arange(T), jnp.arange(T) + Tn - T].set(True)
    kw = dict(layer=jnp.int32(1)) if layered else {}
    nn = None if tree else Tn
    for v, sp in ((VARIANTS[0], None), (VARIANTS[0], 3), (VARIANTS[1], 3), (VARIANTS[2], None)):
      what = (f"decode_attention {name(v)} splits={sp} B={B} T={T} T_new={Tn} G={Gc} S={S} "
              f"tree={tree} layered={layered}")
      try:
        o, lse = decode_attention(q, kg, vg, lengths, tm, num_new=nn, block_sizes=hb_of(v, sp),
                                  **kw)
      except Exception as e:  # noqa: BLE001
        log(what, "FAILED", type(e).__name__, str(e)[:800])
        results.append(dict(kind="check", what=what, error=str(e)[:400], ok=False))
        ok = False
        continue
      ro, rl = decode_attention_reference(q.astype(jnp.float32), kg.astype(jnp.float32),
                                          vg.astype(jnp.float32), lengths, tm, num_new=nn, **kw)
      note(what, o, ro, lse, rl)

  # G in {4, 8, 1}: q / out in place; G=6: transposed rows
  for (B, T, P, L, lens, Kc, Gc) in ((64, 1, 1, 5000, [4999], K, G),
                                     (32, 5, 4, 3000, [3000, 0, 700, 129], K, G),
                                     (24, 3, 3, 1000, [999, 1, 512], 2, 8),
                                     (128, 2, 2, 640, [640, 300], 1, 1),
                                     (16, 4, 2, 1000, [1000, 77], 2, 6)):
    q = jnp.asarray(rng.standard_normal((B, T, Kc * Gc, D)), jnp.bfloat16)
    kp = jnp.asarray(rng.standard_normal((P, L, Kc, D)), jnp.bfloat16)
    vp = jnp.asarray(rng.standard_normal((P, L, Kc, D)), jnp.bfloat16)
    pl_ = jnp.asarray(lens, jnp.int32)
    bad = jnp.arange(L)[None, :, None, None] >= pl_[:, None, None, None]
    for v in VARIANTS[:3]:
      o, lse = prefix_attention(q, jnp.where(bad, jnp.nan, kp).astype(jnp.bfloat16),
                                jnp.where(bad, jnp.nan, vp).astype(jnp.bfloat16), pl_,
                                block_sizes=hb_of(v))
      ro, rl = prefix_attention_reference(q.astype(jnp.float32), kp.astype(jnp.float32),
                                          vp.astype(jnp.float32), pl_)
      note(f"prefix_attention {name(v)} B={B} T={T} P={P} L={L} K={Kc} G={Gc} lengths={lens}",
           o, ro, lse, rl)
  return ok


def bench(results, ceil, inner, reps, prefix=True, ts=None, profile="", prefix_only=False,
          prefix_shapes=None):
  from jax.experimental.pallas.ops.gpu import attention_mgpu as am
  from pallas_kernels import decode_attention, hopper, prefix_attention
  from pallas_kernels.triton_decode import GPU_DEFAULTS as DEC_DEFAULTS
  from pallas_kernels.triton_prefix import GPU_DEFAULTS as PRE_DEFAULTS
  from benchutil import device_time
  mm, bw = ceil["matmul_TFLOPs"], ceil["copy_TBps"]
  mm_d, bw_d = ceil.get("matmul_TFLOPs_device", mm), ceil.get("copy_TBps_device", bw)

  def record(shape, impl, step, arrays, flops, nbytes):
    try:
      sec = timeit(step, arrays, inner=inner, reps=reps)[0]
      dev = device_time(step, arrays, inner=inner, reps=reps)
    except Exception as e:  # noqa: BLE001
      log(f"{shape} {impl} FAILED {type(e).__name__}: {str(e)[:600]}")
      results.append(dict(kind="time", shape=shape, impl=impl, error=f"{type(e).__name__}"))
      return
    roof = max(flops / mm / 1e12, nbytes / bw / 1e12)
    rec = dict(kind="time", shape=shape, impl=impl, us=sec * 1e6, TFLOPs=flops / sec / 1e12,
               KV_TBps=nbytes / sec / 1e12, roof_us=roof * 1e6, x_roof=sec / roof)
    msg = ""
    if dev:  # GPU time against the ceilings measured the same way
      d = dev[0]
      roof_d = max(flops / mm_d / 1e12, nbytes / bw_d / 1e12)
      rec.update(dev_us=d * 1e6, dev_TFLOPs=flops / d / 1e12, dev_KV_TBps=nbytes / d / 1e12,
                 dev_roof_us=roof_d * 1e6, dev_x_roof=d / roof_d, kernels=dev[2])
      msg = (f" | GPU {d * 1e6:8.1f} us {flops / d / 1e12:5.0f} TFLOP/s {nbytes / d / 1e12:5.2f}"
             f" TB/s x roof {d / roof_d:5.2f}")
    results.append(rec)
    log(f"{shape:34s} {impl:52s} {sec * 1e6:8.1f} us {flops / sec / 1e12:5.0f} TFLOP/s "
        f"{nbytes / sec / 1e12:5.2f} TB/s x roof {sec / roof:5.2f}" + msg)

  ks = jax.random.split(jax.random.key(0), 3)
  B, S = 64, 8192
  kc = jax.random.normal(ks[1], (B, K, S, D), jnp.bfloat16)
  vc = jax.random.normal(ks[2], (B, K, S, D), jnp.bfloat16)
  rng = np.random.default_rng(1)
  for T, tree in ((1, False), (16, False), (32, False), (64, False), (64, True), (128, False)):
    if prefix_only or (ts and T not in ts):
      continue
    shape = f"verify B={B} T={T} S={S}" + (" tree" if tree else "")
    lengths = jnp.asarray(rng.integers(S // 2, S - T + 1, B), jnp.int32)
    q = jax.random.normal(ks[0], (B, T, K * G, D), jnp.bfloat16)
    tm = None
    if tree:  # a random tree: each node's parent is an earlier node
      par = np.concatenate([[-1], [rng.integers(0, i) for i in range(1, T)]])
      anc = np.eye(T, dtype=bool)
      for i in range(1, T):
        anc[i] |= anc[par[i]]
      tm = jnp.asarray(anc)
    ctx = float(jnp.sum(lengths))
    flops, nbytes = 4 * T * K * G * D * ctx, 2 * K * D * 2 * ctx

    def dec(bs):
      def step(i, q, kc, vc, lengths):
        o, l = decode_attention(q, kc, vc, lengths - (i % 2), tm, block_sizes=bs)
        return o[0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]
      return step
    record(shape, "triton decode_attention", dec(DEC_DEFAULTS), (q, kc, vc, lengths), flops,
           nbytes)
    for v in VARIANTS:
      if T * G < 2 * v[0]:
        continue
      record(shape, name(v), dec(hb_of(v)), (q, kc, vc, lengths), flops, nbytes)
    if T == 64:  # launch order and register caps; the default again last (clock drift)
      import dataclasses
      for label, kw in (("index order", dict(longest_first=False)),
                        ("registers 240/24", dict(registers=(240, 24))),
                        ("(default again)", {})):
        record(shape, name(VARIANTS[0]) + " " + label,
               dec(dataclasses.replace(hb_of(VARIANTS[0]), **kw)), (q, kc, vc, lengths),
               flops, nbytes)
    if T == 64:  # the same default kernel with q / out transposed around it
      def dec_t(i, q, kc, vc, lengths):
        o, l = hopper.verify_attention(q, kc, vc, lengths - (i % 2), tm,
                                       sm_scale=1 / math.sqrt(D), q_in_place=False)
        return o[0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]
      record(shape, name(VARIANTS[0]) + " q/out transposed", dec_t, (q, kc, vc, lengths),
             flops, nbytes)

      def mask_only(i, lengths):
        m = hopper.new_token_mask(lengths - (i % 2), tm, T=T, T_new=T, G=1, rows=T,
                                  block_kv=128, dtype=jnp.bfloat16)
        return m[0, 0, 0, 0].astype(jnp.float32) + m[-1, -1, -1, -1]
      record(shape, "new_token_mask alone (per token: trees)", mask_only, (lengths,), flops, nbytes)
    if T == 64 and not tree:
      for v in VARIANTS[:2]:
        def kern_ip(i, q, kc, vc, lengths, v=v):
          o, l2 = hopper.rows_attention(q, kc, vc, lengths - (i % 2), kv_layout="BKSD",
                                        sm_scale=1 / math.sqrt(D), q_layout="BTHD",
                                        block_sizes=hb_of(v))
          return o[0, 0, 0, 0, 0].astype(jnp.float32) + l2[-1, -1, -1, -1]
        record(shape, name(v) + " kernel only (context), q in place", kern_ip,
               (q, kc, vc, lengths), flops, nbytes)
      Sm = int(ctx / B) // 128 * 128
      qa = jax.random.normal(ks[0], (B, T * G, K, D), jnp.float16)
      ka = jax.random.normal(ks[1], (B, Sm, K, D), jnp.float16)
      va = jax.random.normal(ks[2], (B, Sm, K, D), jnp.float16)
      for bq, bkv, st in ((64, 128, 2), (128, 64, 2)):
        cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=st)

        def mg(i, q, k, v, cfg=cfg):
          o, (lse,) = am.attention(q, k, v, cfg, save_residuals=True)
          return o[0, 0, 0, 0].astype(jnp.float32) + lse[-1, -1, -1]
        record(shape, f"jax attention_mgpu f16 bq={bq} bkv={bkv} st={st} (mean S={Sm})", mg,
               (qa, ka, va), 4 * B * T * K * G * D * Sm, 2 * B * K * D * 2 * Sm)
      del qa, ka, va
  del kc, vc
  if not prefix:
    return

  L = 16384
  for B, T in ((64, 1), (64, 5), (256, 1)):
    if prefix_shapes and f"{B}x{T}" not in prefix_shapes:
      continue
    P = 1
    shape = f"prefix B={B} T={T} P={P} L={L}"
    q = jax.random.normal(ks[0], (B, T, K * G, D), jnp.bfloat16)
    kp = jax.random.normal(ks[1], (P, L, K, D), jnp.bfloat16)
    vp = jax.random.normal(ks[2], (P, L, K, D), jnp.bfloat16)
    plen = jnp.full((P,), L, jnp.int32)
    flops, nbytes = 4 * B * T * K * G * L * D, 2 * P * L * K * D * 2
    args = (q, kp, vp, plen)

    def pstep(bs):
      def step(i, q, kp, vp, plen):
        o, l = prefix_attention(q, kp, vp, plen - (i % 2), block_sizes=bs)
        return o[0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]
      return step
    def harness(i, q, kp, vp, plen):  # the loop's own kernels without the attention
      return q[0, 0, 0, 0].astype(jnp.float32) + (plen - (i % 2))[-1].astype(jnp.float32)
    record(shape, "the timing loop alone (its scalar kernels, no attention)", harness, args,
           flops, nbytes)
    record(shape, "triton prefix kernel", pstep(PRE_DEFAULTS), args, flops, nbytes)
    for v in VARIANTS:
      record(shape, name(v) + " splits=auto", pstep(hb_of(v)), args, flops, nbytes)
    for sp in (4, 16):
      record(shape, name(OV) + f" splits={sp}", pstep(hb_of(OV, sp)), args, flops, nbytes)

    def transposed(i, q, kp, vp, plen):  # q / out as transposed rows [P, K, R, D]
      Bg, rows = B // P, B // P * T * G
      pad = -rows % hb_of(OV).rows_per_program
      qr = q.reshape(P, Bg, T, K, G, D).transpose(0, 3, 1, 2, 4, 5).reshape(P, K, rows, D)
      qr = jnp.pad(qr, ((0, 0), (0, 0), (0, pad), (0, 0)))
      o, l = hopper.attention(qr, kp, vp, plen - (i % 2), kv_layout="PLKD",
                              sm_scale=1 / math.sqrt(D), block_sizes=hb_of(OV))
      o = o[:, :, :rows].reshape(P, K, Bg, T, G, D).transpose(0, 2, 3, 1, 4, 5)
      return o[0, 0, 0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]
    record(shape, name(OV) + " q/out transposed", transposed, args, flops, nbytes)

    def kern(i, q, kp, vp, plen):  # the kernel alone: splits not merged
      o, l2 = hopper.rows_attention(q.reshape(P, B // P * T, K * G, D), kp, vp,
                                    plen - (i % 2), kv_layout="PLKD", q_layout="BTHD",
                                    sm_scale=1 / math.sqrt(D), block_sizes=hb_of(OV))
      return o[0, 0, 0, 0, 0].astype(jnp.float32) + l2[-1, -1, -1, -1]
    record(shape, name(OV) + " kernel only (splits unmerged)", kern, args, flops, nbytes)

    # The engine's form: the prefix part merged with a suffix part (its out and lse given).
    # Two forms: the kernel's key splits merged, then that merged with the suffix (two
    # merges), or the splits unmerged (partials=True) joining the suffix in one merge.
    from pallas_kernels import merge_attention_states
    from pallas_kernels.merge import merge_partials
    o_suf = jax.random.normal(ks[0], q.shape, jnp.bfloat16)
    l_suf = jax.random.normal(ks[1], q.shape[:3], jnp.float32) + math.log(1024.0)
    eargs = args + (o_suf, l_suf)

    def two_merges(i, q, kp, vp, plen, o_suf, l_suf):
      o, l = prefix_attention(q, kp, vp, plen - (i % 2))
      o, l = merge_attention_states([o_suf, o], [l_suf, l])
      return o[0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]

    def one_merge(i, q, kp, vp, plen, o_suf, l_suf):
      o, l = prefix_attention(q, kp, vp, plen - (i % 2), partials=True)
      o, l = merge_partials([o_suf[None], o], [l_suf[None], l], q.dtype)
      return o[0, 0, 0, 0].astype(jnp.float32) + l[-1, -1, -1]
    record(shape, "with a suffix part: splits merged, then merged with it", two_merges,
           eargs, flops, nbytes)
    record(shape, "with a suffix part: splits and suffix in one merge (engine, partials)",
           one_merge, eargs, flops, nbytes)
    # the two forms agree on every output (bf16 out; one rounding fewer in the one-merge form)
    def full(partials):
      def f(q, kp, vp, plen, o_suf, l_suf):
        o, l = prefix_attention(q, kp, vp, plen, partials=partials)
        if partials:
          return merge_partials([o_suf[None], o], [l_suf[None], l], q.dtype)
        return merge_attention_states([o_suf, o], [l_suf, l])
      return jax.jit(f)(*eargs)
    (oa, la), (ob, lb) = full(False), full(True)
    e_o = float(jnp.max(jnp.abs(oa.astype(jnp.float32) - ob.astype(jnp.float32))))
    e_l = float(jnp.max(jnp.abs(la - lb)))
    results.append(dict(kind="check", what=f"{shape}: one merge vs two merges", max_err_out=e_o,
                        max_err_lse=e_l, ok=e_o < 2e-2 and e_l < 1e-4))
    log(f"{shape} one merge vs two: max err out {e_o:.2e}, lse {e_l:.2e}")
    if profile:  # the GPU kernels of the default call, of the kernel alone, of the merges
      from benchutil import kernel_table
      for tag, fn, fargs in (("default", pstep(None), args), ("kernel only", kern, args),
                             ("two merges", two_merges, eargs),
                             ("one merge", one_merge, eargs)):
        loop = jax.jit(lambda *a, fn=fn: jax.lax.fori_loop(
            0, inner, lambda i, acc: acc + fn(i, *a).astype(jnp.float32), jnp.float32(0)))
        jax.block_until_ready(loop(*fargs))
        d = os.path.join(profile, f"{shape.replace(' ', '_').replace('=', '')}_{tag[:7]}")
        with jax.profiler.trace(d, create_perfetto_trace=True):
          for _ in range(reps):
            jax.block_until_ready(loop(*fargs))
        kt = kernel_table(d, inner * reps, top=8, width=60)
        results.append(dict(kind="profile", shape=shape, impl=tag, **kt))
        log(f"{shape} {tag}: {kt.get('kernels', 0):.1f} kernels/call, busy "
            f"{kt.get('busy_us', 0):.1f} us, span {kt.get('span_us', 0):.1f} us")
        for r in kt.get("table", []):
          log(f"   {r['us']:8.1f} us  x{r['per_step']:.1f}  {r['name']}")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="benchmarks/hopper_attention")
  ap.add_argument("--inner", type=int, default=10)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--check-only", action="store_true")
  ap.add_argument("--skip-checks", action="store_true",
                  help="time only (the checks take about 3 minutes on an H100)")
  ap.add_argument("--no-prefix", action="store_true", help="time verification shapes only")
  ap.add_argument("--prefix-only", action="store_true", help="time the prefix shapes only")
  ap.add_argument("--prefix-shapes", nargs="*", help="prefix shapes BxT to time (64x1 64x5 "
                  "256x1: all)")
  ap.add_argument("--ts", type=int, nargs="*", help="time verification at these T only")
  ap.add_argument("--profile", default="", help="a folder for profiler traces of the prefix "
                  "calls: their GPU kernels per call")
  ap.add_argument("--variants", nargs="*", help="Hopper variants to check and time instead of "
                  "the built-in three, each rows_per_wg,block_kv,stages,pingpong,overlap (e.g. "
                  "64,192,2,1,1); the first is the reference variant, at least three")
  a = ap.parse_args()
  if a.variants:
    global VARIANTS, OV
    vs = [tuple(int(x) for x in v.split(",")) for v in a.variants]
    if len(vs) < 3 or any(len(v) != 5 for v in vs):
      ap.error("--variants takes at least three rows_per_wg,block_kv,stages,pingpong,overlap")
    VARIANTS = [(rw, bkv, st, bool(pp), bool(ov)) for rw, bkv, st, pp, ov in vs]
    OV = VARIANTS[0]
  from bench_prefix import ceilings
  dev = jax.devices()[0]
  env = dict(device=dev.device_kind, jax=jax.__version__, python=platform.python_version(),
             command="python3 " + " ".join(sys.argv))
  log(env)
  results = []
  if a.skip_checks:
    ok = None
  else:
    try:
      ok = check(results)
    except Exception:  # noqa: BLE001
      traceback.print_exc()
      ok = False
    log("checks", "pass" if ok else "FAILED")
  if a.check_only:
    sys.exit(0 if ok else 1)
  ceil = ceilings(1 << 30, 10, 3)
  log(f"copy {ceil['copy_TBps']:.3f} TB/s, matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s; GPU time "
      f"{ceil.get('copy_TBps_device')} TB/s, {ceil.get('matmul_TFLOPs_device')} TFLOP/s")
  bench(results, ceil, a.inner, a.reps, prefix=not a.no_prefix, ts=a.ts, profile=a.profile,
        prefix_only=a.prefix_only, prefix_shapes=a.prefix_shapes)
  with open(a.out + ".json", "w") as f:
    json.dump(dict(env=env, ceilings=ceil, checks_ok=ok, results=results), f, indent=1)
  nan = float("nan")
  lines = ["# Hopper (Mosaic GPU) attention kernel\n",
           f"- device: {env['device']}, jax {env['jax']}, python {env['python']}",
           f"- command: `{env['command']}`",
           f"- ceilings in this run: copy {ceil['copy_TBps']:.3f} TB/s, bf16 matmul "
           f"{ceil['matmul_TFLOPs']:.0f} TFLOP/s (wall clock); in GPU time "
           f"{ceil.get('copy_TBps_device', nan):.3f} TB/s and "
           f"{ceil.get('matmul_TFLOPs_device', nan):.0f} TFLOP/s; roofline = max(FLOPs / "
           "matmul, K/V bytes / copy), each time against the ceilings measured the same way",
           "- wall: a 10-call jitted loop's wall-clock time per call (its dispatch and the wait "
           "for its end included); GPU: the calls' kernel durations from a profiler trace",
           f"- correctness checks (float32 references, NaN garbage past the valid slots): "
           f"{'not run (--skip-checks)' if ok is None else 'all pass' if ok else 'FAILED'}\n",
           "| shape | implementation | wall (us) | x roofline | GPU (us) | TFLOP/s (GPU) | "
           "KV TB/s (GPU) | x roofline (GPU) |", "|---|---|---|---|---|---|---|---|"]
  for r in results:
    if r["kind"] == "time" and "us" in r:
      lines.append(f"| {r['shape']} | {r['impl']} | {r['us']:.1f} | {r['x_roof']:.2f} | "
                   f"{r.get('dev_us', nan):.1f} | {r.get('dev_TFLOPs', nan):.0f} | "
                   f"{r.get('dev_KV_TBps', nan):.2f} | {r.get('dev_x_roof', nan):.2f} |")
  lines += ["", "| check | max err out | max err lse | ok |", "|---|---|---|---|"]
  for r in results:
    if r["kind"] == "check":
      lines.append(f"| {r['what']} | {r.get('max_err_out', float('nan')):.2e} | "
                   f"{r.get('max_err_lse', float('nan')):.2e} | {r['ok']} |")
  prof = [r for r in results if r["kind"] == "profile" and "table" in r]
  if prof:
    lines += ["", "## GPU kernels per call (profiler, `--profile`)", ""]
    for r in prof:
      lines.append(f"- {r['shape']}, {r['impl']}: {r['kernels']:.1f} kernels per call, "
                   f"{r['busy_us']:.1f} us busy")
      lines += [f"  - {t['us']:.1f} us x{t['per_step']:.1f} `{t['name']}`" for t in r["table"]]
  with open(a.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  log("wrote", a.out)
  sys.exit(0 if ok is not False else 1)


if __name__ == "__main__":
  main()
