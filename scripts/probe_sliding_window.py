"""Decode / verify step cost of a sliding-window model against full attention (GPU).

A Mistral-7B-v0.1-shaped model (random bf16 weights, window 4096) decodes at a long context
with its window, and the same weights without the window at that context and at a context of
the window's size: with the window a step should cost what the short full-attention step costs,
whatever the context (the kernels read only the last W - 1 keys, plus a small band for the
deeper tokens of a verify step).

    python scripts/probe_sliding_window.py [--batch 8 --ctx 32768 --out $OUT/sliding_window]

Each step kind is a device loop of --n forwards (benchutil.forward_loop), median of 5.
Writes <out>.json and <out>.md.
"""
import argparse, dataclasses, json, statistics, sys, time
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
import jax, jax.numpy as jnp, numpy as np
from benchmark import copy_bandwidth, load_model, param_bytes, random_cache
from benchutil import forward_loop
from jaxspec.cache import kv_bytes_per_token

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="random-mistral7b")
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--ctx", type=int, default=32768)
ap.add_argument("--n", type=int, default=10)
ap.add_argument("--window", type=int, default=None, help="override the model's window")
ap.add_argument("--out", default="")
a = ap.parse_args()
model = load_model(a.model)
cfg, params = model.config, model.decode_params()
W = a.window or cfg.sliding_window
assert W, "needs a model with a sliding window (or --window)"
B = a.batch
bw = copy_bandwidth(64 << 20 if jax.default_backend() == "cpu" else 4 << 30)
rows = []
for ctx, window in ((a.ctx, W), (a.ctx, None), (W, None)):
    c = dataclasses.replace(cfg, sliding_window=window)
    lengths = np.random.default_rng(0).integers(ctx - 512, ctx - 16, size=B).astype(np.int32)
    cache = random_cache(c, B, ctx + 128, lengths)
    for T in (1, 5):
        f = forward_loop(c, B, T, None, None, a.n)
        tok = jnp.zeros((B,), jnp.int32)
        t0 = time.time(); cache, tok = f(params, cache, tok); jax.block_until_ready(tok)
        comp = time.time() - t0
        ts = []
        for _ in range(5):
            cache = cache.replace(lengths=jnp.asarray(lengths))
            t0 = time.perf_counter(); cache, tok = f(params, cache, tok); jax.block_until_ready(tok)
            ts.append((time.perf_counter() - t0) / a.n)
        keys = min(float(lengths.mean()), (window or 1 << 30) - 1) + T
        floor = (param_bytes(params) + B * keys * kv_bytes_per_token(c)) / bw
        ms = statistics.median(ts) * 1e3
        rows.append(dict(context=ctx, window=window, T=T, ms=ms, floor_ms=floor * 1e3,
                         x_floor=ms / (floor * 1e3), compile_s=comp))
        print(f"ctx {ctx:6d} window {str(window):5s} T={T}: {ms:7.3f} ms/step "
              f"(floor {floor * 1e3:.3f}, x{ms / (floor * 1e3):.2f}; compile {comp:.1f} s)",
              flush=True)
    del cache
env = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "copy_TBps": bw / 1e12,
       "command": " ".join(["python3"] + sys.argv), "batch": B, "model": a.model}
if a.out:
    json.dump({"env": env, "rows": rows}, open(a.out + ".json", "w"), indent=1)
    lines = [f"# Sliding-window decode cost ({a.model}, B={B})", "",
             f"- device: {env['device']}, jax {env['jax']}; copy bandwidth in the same run "
             f"{env['copy_TBps']:.2f} TB/s", f"- command: `{env['command']}`",
             "- floor: weights + the K/V the step must read (min(context, W - 1) + T keys per "
             "row) over the copy bandwidth", "",
             "| context | window | T | ms / step | floor ms | x floor |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['window'] or 'none'} | {r['T']} | {r['ms']:.3f} | "
              f"{r['floor_ms']:.3f} | {r['x_floor']:.2f} |" for r in rows]
    open(a.out + ".md", "w").write("\n".join(lines) + "\n")
