"""Where a self-speculation draft step's time goes, and what would make it cheaper (GPU probe;
benchmarks/probe_draft_step_h100.md).

    python scripts/probe_draft_step.py [--batch 64 --ctx 8192] [--parts kernel,step,matmul]

- kernel: the sparse (sink + window) decode-attention kernel alone over a 28-layer cache, per
  block-size variant (splits, key block, pipeline stages), next to the dense T=1 kernel over the
  same number of keys (what the splits of the sparse context could reach).
- step: the draft step of the Qwen2.5-1.5B shape (random weights) as a device loop of forwards,
  per kernel variant, next to the plain step and a 5-token verify; a kernel table (perfetto) of
  the draft and plain steps.
- matmul: the MLP weight stream of 28 layers at the draft's rows (B) and a verify's (5B), with
  bf16 weights and with int8 / fp8 weights widened inside the dot (what a quantized copy of the
  weights for drafting would cost).
"""
import argparse, json, statistics, sys, time
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
import jax, jax.numpy as jnp, numpy as np
from benchmark import copy_bandwidth
from benchutil import forward_loop, kernel_table, log, timeit
import importlib
DA = importlib.import_module("pallas_kernels.decode_attention")  # the module, not the function

ap = argparse.ArgumentParser()
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--ctx", type=int, default=8192)
ap.add_argument("--parts", default="kernel,step,matmul")
ap.add_argument("--model", default="random-qwen15", help="for the step part")
ap.add_argument("--windows", default="1008,496")
ap.add_argument("--out", default="")
a = ap.parse_args()
B, ctx = a.batch, a.ctx
res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "batch": B, "ctx": ctx,
       "command": " ".join(sys.argv)}
rng = np.random.default_rng(0)
lengths = jnp.asarray(rng.integers(ctx - 512, ctx, size=B).astype(np.int32))
windows = [int(w) for w in a.windows.split(",")]
BS = DA.DecodeAttentionBlockSizes
VARIANTS = {"default": BS()}
for ms in (128, 256, 1024):
  VARIANTS[f"split{ms}"] = BS(min_split_size=ms)
for bk in (32, 128):
  VARIANTS[f"bk{bk}"] = BS(block_k=bk)
VARIANTS["split256_bk32"] = BS(min_split_size=256, block_k=32)
VARIANTS["split128_bk32"] = BS(min_split_size=128, block_k=32)
VARIANTS["split256_st2"] = BS(min_split_size=256, num_stages=2)
VARIANTS["split256_st4"] = BS(min_split_size=256, num_stages=4)


bw = copy_bandwidth(2 << 30)
res["copy_bw"] = bw
log(f"copy bw {bw / 1e12:.2f} TB/s")

if "kernel" in a.parts:
  L, K, G, D = 28, 2, 6, 128
  S = ctx + 512
  kc = jax.random.normal(jax.random.PRNGKey(1), (L, B, K, S, D), jnp.bfloat16)
  vc = jax.random.normal(jax.random.PRNGKey(2), (L, B, K, S, D), jnp.bfloat16)
  q = jax.random.normal(jax.random.PRNGKey(3), (B, 1, K * G, D), jnp.bfloat16)
  rows = []
  for w in windows:
    keys = 16 + w
    byts = B * K * (keys + 1) * D * 2 * 2
    for name, bs in VARIANTS.items():
      def step(i, q, kc, vc, lengths, bs=bs, w=w):
        o, _ = DA.decode_attention(q, kc, vc, lengths, layer=i % L, sink=16, window=w,
                                   block_sizes=bs)
        return o[0, 0, 0, 0]
      try:
        med, best, comp = timeit(step, (q, kc, vc, lengths), inner=56, reps=5)
      except Exception as e:  # noqa: BLE001
        log(f"w{w} {name}: {type(e).__name__}: {str(e)[:200]}"); continue
      plan = DA._plan(B, K, 1, G, S, D, sink=16, window=w, bs=bs, on_gpu=True)
      rows.append({"window": w, "variant": name, "us": med * 1e6, "splits": plan[4],
                   "block_k": plan[1], "TB_s": byts / med / 1e12})
      log(json.dumps(rows[-1]))
    # dense over the same number of keys (lengths = keys): what the kernel does without sparsity
    dl = jnp.full((B,), keys, jnp.int32)
    def dstep(i, q, kc, vc, dl):
      o, _ = DA.decode_attention(q, kc, vc, dl, layer=i % L)
      return o[0, 0, 0, 0]
    med, best, comp = timeit(dstep, (q, kc, vc, dl), inner=56, reps=5)
    rows.append({"window": w, "variant": "dense same keys", "us": med * 1e6,
                 "TB_s": byts / med / 1e12})
    log(json.dumps(rows[-1]))
  res["kernel"] = rows
  del kc, vc

if "step" in a.parts:
  from benchmark import load_model, random_cache
  model = load_model(a.model)
  cfg = model.config
  params = model.decode_params()
  S = ctx + 512
  cache = random_cache(cfg, B, S, np.asarray(lengths))

  def time_step(T, sink, window, n=20):
    global cache
    f = forward_loop(cfg, B, T, sink, window, n)
    tok = jnp.zeros((B,), jnp.int32)
    cache, tok = f(params, cache, tok); jax.block_until_ready(tok)
    ts = []
    for _ in range(5):
      t = time.perf_counter(); cache, tok = f(params, cache, tok); jax.block_until_ready(tok)
      ts.append((time.perf_counter() - t) / n)
    return statistics.median(ts), f

  def profile(f, tag, n=20):
    global cache
    d = f"/tmp/trace_{tag}"
    tok = jnp.zeros((B,), jnp.int32)
    with jax.profiler.trace(d, create_perfetto_trace=True):
      cache, tok = f(params, cache, tok); jax.block_until_ready(tok)
    kt = kernel_table(d, n)
    if kt:
      log(f"profile {tag}: {kt['kernels']:.0f} kernels/step, busy {kt['busy_us']:.0f} us, "
          f"span {kt['span_us']:.0f} us")
      for r in kt["table"][:25]:
        log(f"   {r['us']:8.1f} us {r['per_step']:5.1f}x {r['name']}")
    return kt

  steps = {}
  wbytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
  kvtok = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
  L_mean = float(np.mean(np.asarray(lengths)))
  for name, (T, sink, window) in {"plain": (1, None, None), "verify5": (5, None, None)}.items():
    t, f = time_step(T, sink, window)
    floor = (wbytes + kvtok * B * L_mean) / bw
    steps[name] = {"ms": t * 1e3, "floor_ms": floor * 1e3}
    log(name, json.dumps(steps[name]))
    if name == "plain":
      steps[name]["profile"] = profile(f, name)
  for w in windows:
    floor = (wbytes + kvtok * B * (16 + w)) / bw
    for vname in ("default", "split256", "split128", "split256_bk32"):
      DA._GPU_DEFAULTS = VARIANTS[vname]
      t, f = time_step(1, 16, w)
      key = f"draft_w{w}_{vname}"
      steps[key] = {"ms": t * 1e3, "floor_ms": floor * 1e3}
      log(key, json.dumps(steps[key]))
      if vname == "default" and w == windows[0]:
        steps[key]["profile"] = profile(f, key)
    DA._GPU_DEFAULTS = VARIANTS["default"]
  res["steps"] = steps
  res["weight_bytes"] = wbytes
  del cache

if "matmul" in a.parts:
  Dm, F, L = 1536, 8960, 28
  key = jax.random.PRNGKey(5)
  wg = [jax.random.normal(jax.random.fold_in(key, i), (Dm, 2 * F), jnp.bfloat16) * 0.02
        for i in range(L)]
  wd = [jax.random.normal(jax.random.fold_in(key, 100 + i), (F, Dm), jnp.bfloat16) * 0.02
        for i in range(L)]

  def quant(w, dt):
    s = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=0) / (127.0 if dt == jnp.int8 else 448.0)
    q = w.astype(jnp.float32) / s
    q = jnp.round(q).astype(dt) if dt == jnp.int8 else q.astype(dt)
    return q, s.astype(jnp.bfloat16)

  mm = {}
  for M in (B, 5 * B):
    x = jax.random.normal(jax.random.PRNGKey(9), (M, Dm), jnp.bfloat16)
    for kind in ("bf16", "int8", "fp8"):
      if kind == "bf16":
        ws = [(g, None, d, None) for g, d in zip(wg, wd)]
      else:
        dt = jnp.int8 if kind == "int8" else jnp.float8_e4m3fn
        ws = [(*quant(g, dt), *quant(d, dt)) for g, d in zip(wg, wd)]
      nbytes = sum(t.size * t.dtype.itemsize for w4 in ws for t in w4 if t is not None)

      def mlp(i, x, ws):
        y = x * (1 + i.astype(x.dtype) * 1e-3)
        for g, gs, d, ds in ws:
          h = jnp.dot(y, g.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
          if gs is not None:
            h = h * gs.astype(jnp.float32)
          h = h.astype(jnp.bfloat16)
          u, v = jnp.split(h, 2, axis=-1)
          z = jnp.dot(jax.nn.silu(u) * v, d.astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32)
          if ds is not None:
            z = z * ds.astype(jnp.float32)
          y = (y + z.astype(jnp.bfloat16) * 0.01)
        return y[0, 0]
      try:
        med, best, comp = timeit(mlp, (x, ws), inner=10, reps=5)
      except Exception as e:  # noqa: BLE001
        log(f"matmul M={M} {kind}: {type(e).__name__}: {str(e)[:300]}"); continue
      mm[f"M{M}_{kind}"] = {"ms": med * 1e3, "bytes": nbytes, "floor_ms": nbytes / bw * 1e3,
                            "TB_s": nbytes / med / 1e12}
      log(f"M{M}_{kind}", json.dumps(mm[f"M{M}_{kind}"]))
  res["matmul"] = mm

print(json.dumps({k: v for k, v in res.items()}, default=str)[:3000])
if a.out:
  with open(a.out, "w") as f:
    json.dump(res, f, indent=1, default=str)
