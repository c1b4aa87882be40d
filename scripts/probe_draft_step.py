"""Where a self-draft step's time goes, with and without the fused decode linears (GPU probe;
internal entry points, a diagnostic: what `generate` delivers is measured by `jaxspec bench
generate`).

    python scripts/probe_draft_step.py [--batch 64 --ctx 16384] [--parts ceil,gemm,step]

- ceil: the read-only and the copy bandwidth of a 4 GiB buffer (GPU time of device loops);
- gemm: each linear of a layer of the Qwen2.5-1.5B shape at the draft's rows (``--batch``), as
  XLA runs it today (norm, product, bias, SiLU x up, residual add: several kernels) and as one
  `pallas_kernels.decode_linear.fused_linear` per tiling; 28 weight copies (one per layer) so
  that nothing is read from L2; the fused outputs checked against the float32 reference;
- step: the draft step (sink 16 + window) and the plain step of random-qwen15 over a random
  K/V cache, each a device loop of 20 forwards (wall clock), with kernel tables at ``--ctx``
  (``--ctxs``: more contexts, without the tables); floors = weights + the K/V a step reads over
  the read ceiling.
"""
import argparse
import json
import statistics
import sys
import time

sys.path.insert(0, "scripts")
sys.path.insert(0, ".")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchutil import carry_ceiling, device_time_of, kernel_table, log  # noqa: E402
from pallas_kernels import decode_linear as DL  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--ctx", type=int, default=16384)
ap.add_argument("--parts", default="ceil,gemm,step")
ap.add_argument("--window", type=int, default=1008)
ap.add_argument("--ctxs", default="", help="also the plain and draft steps at these contexts")
ap.add_argument("--ops", default="qkv,o,gateup,down")
ap.add_argument("--variants", default="", help="name=bn:bk:splits:stages:warps,... (gemm)")
ap.add_argument("--reps", type=int, default=5)
ap.add_argument("--out", default="")
a = ap.parse_args()
B = a.batch
INTERP = jax.default_backend() == "cpu"  # a smoke run of the gemm part here
res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "batch": B,
       "ctx": a.ctx, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def save():
  if a.out:
    with open(a.out, "w") as f:
      json.dump(res, f, indent=1)


# ------------------------------------------------------------------ ceilings
read_bw = copy_bw = None
if "ceil" in a.parts:
  n = (4 << 30) // 2
  x = jax.random.normal(jax.random.key(0), (n // 4096, 4096), jnp.bfloat16)
  r = carry_ceiling(lambda i, c: (c[0], c[1] + jnp.sum(c[0], dtype=jnp.float32)),
                    (x, jnp.float32(0)), inner=10, reps=a.reps)
  read_bw = x.size * 2 / (r["gpu_s"] or r["wall_s"])
  c = carry_ceiling(lambda i, y: y + jnp.bfloat16(1), x, inner=10, reps=a.reps)
  copy_bw = 2 * x.size * 2 / (c["gpu_s"] or c["wall_s"])
  res["read_TBs"], res["copy_TBs"] = read_bw / 1e12, copy_bw / 1e12
  log(f"read {read_bw / 1e12:.2f} TB/s, copy {copy_bw / 1e12:.2f} TB/s (GPU time)")
  del x
  save()
bw = read_bw or 4.2e12

# ------------------------------------------------------------------ linears
D, F, H, K, Dh, L = (1536, 8960, 12, 2, 128, 28) if not INTERP else (256, 512, 2, 1, 128, 2)
EPS = 1e-6


def rms(x, g):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + EPS)
  return g * y.astype(x.dtype)


OPS = {  # name: (K, N stored, glu, norm, bias, residual, xla op)
    "qkv": (D, (H + 2 * K) * Dh, False, True, True, False,
            lambda x, w, g, b, r: rms(x, g) @ w + b),
    "o": (H * Dh, D, False, False, False, True, lambda x, w, g, b, r: r + x @ w),
    "gateup": (D, 2 * F, True, True, False, False,
               lambda x, w, g, b, r: (lambda gu: jax.nn.silu(gu[:, :F]) * gu[:, F:])(
                   rms(x, g) @ w)),
    "down": (F, D, False, False, False, True, lambda x, w, g, b, r: r + x @ w),
}
DEFAULT_VARIANTS = {
    "qkv": "d=64:128:0:4:4,s1=64:128:1:4:4,n32s1=32:128:1:4:4,n32k256=32:256:1:4:4,"
           "s2=64:128:2:4:4,s4=64:128:4:4:4,n128s4=128:128:4:4:4,n32s2=32:128:2:4:4,"
           "n16k256=16:256:1:4:4,st3=64:128:0:3:4",
    "o": "d=64:128:0:4:4,s1=64:128:1:4:4,n32s1=32:128:1:4:4,s2=64:128:2:4:4,"
         "s4=64:128:4:4:4,n32s2=32:128:2:4:4,n16k256=16:256:1:4:4,n128s4=128:128:4:4:4",
    "gateup": "d=64:128:0:4:4,n32=32:128:0:4:4,k64=64:64:0:4:4,n128k64=128:64:0:4:4,"
              "n32k256=32:256:0:4:4,st3=64:128:0:3:4,w8=64:128:0:4:8,n16=16:128:0:4:4,"
              "n32st3=32:128:0:3:4",
    "down": "d=64:128:0:4:4,s4=64:128:4:4:4,s8=64:128:8:4:4,n32s4=32:128:4:4:4,"
            "n128s8=128:128:8:4:4,n32s8=32:128:8:4:4,s2=64:128:2:4:4,st3=64:128:0:3:4",
}


def parse_variants(text):
  out = {}
  for item in text.split(","):
    name, spec = item.split("=")
    bn, bk, sp, st, w = (int(v) for v in spec.split(":"))
    out[name] = DL.LinearBlockSizes(block_m=64, block_n=bn, block_k=bk, splits=sp,
                                    num_stages=st, num_warps=w)
  return out


if "gemm" in a.parts:
  res["gemm"] = {}
  key = jax.random.key(1)
  for op in a.ops.split(","):
    Kd, N, glu, norm, bias, resid, xla = OPS[op]
    N_out = N // 2 if glu else N
    ks = jax.random.split(jax.random.fold_in(key, hash(op) % 1000), 5)
    ws = [jax.random.normal(jax.random.fold_in(ks[0], l), (Kd, N), jnp.bfloat16) * Kd ** -0.5
          for l in range(L)]
    x = jax.random.normal(ks[1], (B, Kd), jnp.bfloat16)
    g = 1 + 0.1 * jax.random.normal(ks[2], (Kd,), jnp.bfloat16)
    b = 0.1 * jax.random.normal(ks[3], (N,), jnp.bfloat16)
    r = jax.random.normal(ks[4], (B, N_out), jnp.bfloat16)
    wbytes = Kd * N * 2
    floor_us = wbytes / bw * 1e6
    rows = {}
    kw_of = lambda: dict(norm=g if norm else None, bias=b if bias else None,
                         residual=r if resid else None, glu=glu, eps=EPS)

    def run(fn, name):
      f = jax.jit(lambda x, *ws: [fn(x, w) for w in ws])
      try:
        dt = device_time_of(f, (x, *ws), calls=L, reps=a.reps)
        t0 = time.perf_counter()
        for _ in range(a.reps):
          jax.block_until_ready(f(x, *ws))
        wall = (time.perf_counter() - t0) / a.reps / L
      except Exception as e:  # noqa: BLE001
        log(f"{op} {name}: {type(e).__name__}: {str(e)[:300]}")
        return None
      row = {"gpu_us": dt[0] * 1e6 if dt else None, "wall_us": wall * 1e6,
             "kernels": dt[2] if dt else None}
      if row["gpu_us"]:
        row["x_floor"] = row["gpu_us"] / floor_us
      return row

    rows["xla"] = run(lambda x, w: xla(x, w, g, b, r), "xla")
    want = DL.fused_linear_reference(x, ws[0], **kw_of())
    variants = parse_variants(a.variants or DEFAULT_VARIANTS[op])
    for name, bs in variants.items():
      try:
        got = DL.fused_linear(x, ws[0], block_sizes=bs, interpret=INTERP, **kw_of())
        err = float(jnp.linalg.norm((got - want).astype(jnp.float32))
                    / jnp.linalg.norm(want.astype(jnp.float32)))
      except Exception as e:  # noqa: BLE001
        log(f"{op} {name}: {type(e).__name__}: {str(e)[:300]}")
        continue
      row = run(lambda x, w, bs=bs: DL.fused_linear(x, w, block_sizes=bs, interpret=INTERP,
                                                    **kw_of()), name)
      if row is not None:
        row["rel_err"] = err
        row["plan"] = DL.plan(B, Kd, N_out, glu=glu, block_sizes=bs)
        rows[name] = row
    res["gemm"][op] = {"floor_us": floor_us, "MB": wbytes / 1e6, "rows": rows}
    log(f"{op}: K={Kd} N={N} floor {floor_us:.1f} us")
    for name, row in rows.items():
      if row:
        log(f"   {name:10s} gpu {row['gpu_us'] or 0:7.1f} us  wall {row['wall_us']:7.1f} us  "
            f"x{row.get('x_floor', 0):.2f}  kernels {row['kernels']}  "
            f"err {row.get('rel_err', 0):.1e} {row.get('plan', '')}")
    save()
    del ws

# ------------------------------------------------------------------ steps
if "step" in a.parts:
  import functools

  import jaxspec.model as JM
  from jaxspec.attention import AttentionPlan
  from jaxspec.bench import load_model
  from jaxspec.cache import KVCache
  from jaxspec.model import forward
  from jaxspec.sharding import decode_params

  model = load_model("random-qwen15")
  cfg = model.config
  params = decode_params(model)
  wbytes = sum(v.size * v.dtype.itemsize for v in jax.tree_util.tree_leaves(params))
  kv_tok = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
  lm_lin = JM.lm_logits
  res["steps"] = {}
  for ctx in [a.ctx] + [int(c) for c in a.ctxs.split(",") if c]:
    S = ctx + 512
    rng = np.random.default_rng(0)
    lengths = jnp.asarray(rng.integers(ctx - 256, ctx, size=B).astype(np.int32))
    shape = (cfg.num_layers, B, cfg.num_kv_heads, S, cfg.head_dim)
    cache = KVCache(k=jax.random.normal(jax.random.key(2), shape, jnp.bfloat16),
                    v=jax.random.normal(jax.random.key(3), shape, jnp.bfloat16),
                    lengths=lengths)

    def loop_of(T, sink, window, fast, n=20):
      @functools.partial(jax.jit, donate_argnums=(1,))
      def run(params, cache, tok):
        def body(i, c):
          cache, tok = c
          Ln = cache.lengths
          pos = Ln[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
          plan = AttentionPlan(lengths=Ln, sink=sink, window=window)
          toks = jnp.broadcast_to(tok[:, None], (B, T))
          logits, cache = forward(cfg, params, toks, pos, cache, plan, fast_linears=fast)
          return cache, jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
        return jax.lax.fori_loop(0, n, body, (cache, tok))
      return run

    def timed(name, T, sink, window, fast, keys, profile=False, n=20):
      global cache
      f = loop_of(T, sink, window, fast, n)
      tok = jnp.zeros((B,), jnp.int32)
      t0 = time.perf_counter()
      cache, tok = f(params, cache, tok)
      jax.block_until_ready(tok)
      comp = time.perf_counter() - t0
      ts = []
      for _ in range(a.reps):
        t0 = time.perf_counter()
        cache, tok = f(params, cache, tok)
        jax.block_until_ready(tok)
        ts.append((time.perf_counter() - t0) / n)
      floor = (wbytes + kv_tok * B * keys) / bw
      row = {"ms": statistics.median(ts) * 1e3, "floor_ms": floor * 1e3,
             "compile_s": comp}
      row["x_floor"] = row["ms"] / row["floor_ms"]
      if profile:
        d = f"/tmp/trace_{name}_{ctx}"
        with jax.profiler.trace(d, create_perfetto_trace=True):
          cache, tok = f(params, cache, tok)
          jax.block_until_ready(tok)
        kt = kernel_table(d, n, top=30)
        if kt:
          row.update(kernels=kt["kernels"], busy_us=kt["busy_us"], span_us=kt["span_us"],
                     table=kt["table"])
      log(f"ctx {ctx} {name}: {row['ms']:.3f} ms (floor {row['floor_ms']:.3f}, "
          f"x{row['x_floor']:.2f}), compile {comp:.0f} s"
          + (f", {row['kernels']:.0f} kernels, busy {row['busy_us']:.0f} us"
             if 'kernels' in row else ""))
      if profile and "table" in row:
        for t in row["table"][:22]:
          log(f"     {t['us']:8.1f} us {t['per_step']:5.1f}x {t['name']}")
      return row

    W = a.window
    pt = {}
    mean_len = float(np.mean(np.asarray(lengths)))
    first = ctx == a.ctx
    pt["plain"] = timed("plain", 1, None, None, False, mean_len + 1, profile=first)
    pt["draft_xla"] = timed("draft_xla", 1, 16, W, False, 16 + W + 1, profile=first)
    pt["draft_fused"] = timed("draft_fused", 1, 16, W, True, 16 + W + 1, profile=first)
    if first:
      JM.lm_logits = functools.partial(lambda *aa, f=lm_lin, **kk: f(
          *aa, **{**kk, "fast_linears": False}))
      pt["draft_fused_xla_head"] = timed("draft_fused_xla_head", 1, 16, W, True, 16 + W + 1)
      JM.lm_logits = lm_lin
    res["steps"][ctx] = pt
    save()
    del cache
  res["weight_GB"] = wbytes / 1e9
  save()
log("done")
