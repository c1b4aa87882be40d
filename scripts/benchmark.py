"""End-to-end decode benchmarks (GPU): autoregressive decode step vs its bytes/bandwidth floor,
and autoregressive vs speculative generation side by side.

    python scripts/benchmark.py decode [--batch 32 --context 8192 --out benchmarks/decode]
    python scripts/benchmark.py speculative --model PATH|random-8b [--batch 8,32,64 --prompt 1024,8192]

Every number is a median over repeats after warm-up, measured in one run next to its baseline; the
copy bandwidth ceiling is measured in the same run. Results: JSON + Markdown (+ PNG for grids).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jaxspec  # noqa: E402
from jaxspec import sampling  # noqa: E402
from jaxspec.attention import AttentionPlan  # noqa: E402
from jaxspec.cache import KVCache, round_up  # noqa: E402
from jaxspec.config import ModelConfig, llama31_8b_shape  # noqa: E402
from jaxspec.engine import DecodeLoop, DecodeState  # noqa: E402
from jaxspec.model import forward, init_params  # noqa: E402


def environment() -> dict:
    dev = jax.devices()[0]
    return {"device": getattr(dev, "device_kind", str(dev)), "backend": jax.default_backend(),
            "jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(jax, "lib") else "",
            "python": platform.python_version(), "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def timeit(fn, *args, warmup=2, repeats=7):
    """Median seconds of fn(*args) (blocking), after warm-up."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def copy_bandwidth(nbytes=4 << 30) -> float:
    """Bytes read + written per second of a large device copy (XLA)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    t = timeit(f, x, warmup=3, repeats=10)
    del x
    return 2 * nbytes / t


def random_params(config: ModelConfig, dtype=jnp.bfloat16, seed=0):
    return init_params(config, jax.random.PRNGKey(seed), dtype=dtype)


def random_cache(config, B, S, lengths, dtype=jnp.bfloat16, seed=1):
    shape = (config.num_layers, B, config.num_kv_heads, S, config.head_dim)
    mk = jax.jit(lambda r: (jax.random.normal(r, shape, dtype) * 0.5),
                 out_shardings=None)
    k = mk(jax.random.PRNGKey(seed))
    v = mk(jax.random.PRNGKey(seed + 1))
    return KVCache(k=k, v=v, lengths=jnp.asarray(lengths, jnp.int32))


def param_bytes(params) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))


# ----------------------------------------------------------------------------- decode
def bench_decode(config: ModelConfig, B: int, ctx: int, impls=("auto", "xla"), steps=16,
                 bw=None) -> dict:
    bw = bw or copy_bandwidth()
    model = jaxspec.Model(config=config, params=random_params(config))
    params = model.decode_params()  # per-layer arrays on GPU unless JAXSPEC_LAYERS=scan
    layout = "unrolled" if isinstance(params["layers"], list) else "scan"
    S = round_up(ctx + steps + 8, 128)
    lengths = np.full((B,), ctx, np.int32)
    cache = random_cache(config, B, S, lengths)
    w_bytes = param_bytes(params)
    kv_bytes = 2 * config.num_layers * B * ctx * config.num_kv_heads * config.head_dim * 2
    floor = (w_bytes + kv_bytes) / bw
    rows = []
    for impl in impls:
        @functools.partial(jax.jit, donate_argnums=(1,))
        def step(params, cache, tok):
            plan = AttentionPlan(lengths=cache.lengths, impl=impl)
            logits, cache = forward(config, params, tok[:, None], cache.lengths[:, None], cache,
                                    plan)
            return cache, jnp.argmax(logits[:, 0], -1).astype(jnp.int32)

        tok = jnp.zeros((B,), jnp.int32)
        t0 = time.perf_counter()
        cache, tok = step(params, cache, tok)
        jax.block_until_ready(tok)
        compile_s = time.perf_counter() - t0
        ts = []
        for _ in range(steps):
            t = time.perf_counter()
            cache, tok = step(params, cache, tok)
            jax.block_until_ready(tok)
            ts.append(time.perf_counter() - t)
        med = statistics.median(ts[2:])
        # where the time goes: the same step with an empty context (weights only)
        c0 = cache.replace(lengths=jnp.zeros((B,), jnp.int32))
        c0, _ = step(params, c0, tok)
        ts0 = []
        for _ in range(6):
            t = time.perf_counter()
            c0, tok0 = step(params, c0.replace(lengths=jnp.zeros((B,), jnp.int32)), tok)
            jax.block_until_ready(tok0)
            ts0.append(time.perf_counter() - t)
        cache = c0.replace(lengths=jnp.asarray(lengths))
        rows.append({"impl": impl, "layers": layout, "step_ms": med * 1e3, "floor_ms": floor * 1e3,
                     "over_floor": med / floor, "weights_only_step_ms": statistics.median(ts0) * 1e3,
                     "weights_floor_ms": w_bytes / bw * 1e3, "kv_floor_ms": kv_bytes / bw * 1e3,
                     "first_call_s": compile_s})
        print(json.dumps(rows[-1]), flush=True)
    # compile time of the whole generate loop
    t0 = time.perf_counter()
    jaxspec.generate(model, [[1] * 16] * B, max_new_tokens=4)
    gen_compile = time.perf_counter() - t0
    return {"config": dataclasses.asdict(config), "batch": B, "context": ctx,
            "weight_bytes": w_bytes, "kv_bytes": kv_bytes, "copy_bw": bw, "rows": rows,
            "generate_first_call_s": gen_compile}


# ----------------------------------------------------------------------------- speculative
def bench_generate(model, prompts, max_new, spec=None, repeats=2):
    res = jaxspec.generate(model, prompts, max_new_tokens=max_new, speculation=spec)  # warm-up
    runs = []
    for _ in range(repeats):
        r = jaxspec.generate(model, prompts, max_new_tokens=max_new, speculation=spec)
        runs.append(r)
    best = sorted(runs, key=lambda r: r.stats["decode_seconds"])[len(runs) // 2]
    return best, res


def bench_speculative(model, batches, prompt_lens, gammas, sink, window, max_new, prompts_fn,
                      out_rows, trees=()):
    for P in prompt_lens:
        for B in batches:
            prompts = prompts_fn(B, P)
            try:
                ar, _ = bench_generate(model, prompts, max_new)
            except Exception as e:  # noqa: BLE001 - OOM etc. is a result, not a crash
                out_rows.append({"batch": B, "prompt": P, "error": f"{type(e).__name__}: {e}"[:300]})
                print(out_rows[-1], flush=True)
                continue
            ar_tps = ar.stats["tokens_per_second"]
            variants = [(g, jaxspec.Speculation(draft="self", gamma=g, sink=sink, window=window))
                        for g in gammas]
            variants += [(f"tree{t}", jaxspec.Speculation(draft="self", sink=sink, window=window,
                                                         tree=t)) for t in trees]
            for g, spec in variants:
                try:
                    sp, _ = bench_generate(model, prompts, max_new, spec)
                except Exception as e:  # noqa: BLE001
                    out_rows.append({"batch": B, "prompt": P, "gamma": g,
                                     "error": f"{type(e).__name__}: {e}"[:300]})
                    continue
                same = sp.tokens == ar.tokens
                row = {"batch": B, "prompt": P, "gamma": g, "ar_tok_s": ar_tps,
                       "spec_tok_s": sp.stats["tokens_per_second"],
                       "speedup": sp.stats["tokens_per_second"] / ar_tps,
                       "acceptance": sp.stats["acceptance_rate"],
                       "tokens_per_step": sp.stats["tokens_per_step"],
                       "ar_ms_per_token": 1e3 * ar.stats["decode_seconds"] / max_new,
                       "spec_ms_per_token": 1e3 * sp.stats["decode_seconds"] / max_new,
                       "greedy_identical": same}
                out_rows.append(row)
                print(json.dumps(row), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode")
    d.add_argument("--batch", type=int, default=32)
    d.add_argument("--context", type=int, default=8192)
    d.add_argument("--impls", default="auto,xla")
    d.add_argument("--out", default="benchmarks/decode_llama8b")
    s = sub.add_parser("speculative")
    s.add_argument("--model", default="random-8b")
    s.add_argument("--batch", default="8,32,64")
    s.add_argument("--prompt", default="1024,8192")
    s.add_argument("--gamma", default="2,4")
    s.add_argument("--sink", type=int, default=16)
    s.add_argument("--window", type=int, default=496)
    s.add_argument("--max-new", type=int, default=64)
    s.add_argument("--trees", default="", help="token trees to add, e.g. '2,1,1;3,2,1'")
    s.add_argument("--prompts-file", default=None, help="JSON list of token lists (long text)")
    s.add_argument("--out", default="benchmarks/speculative")
    a = ap.parse_args(argv)
    env = environment()
    print(json.dumps(env), flush=True)
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if a.cmd == "decode":
        r = bench_decode(llama31_8b_shape(), a.batch, a.context, impls=a.impls.split(","))
        r["env"] = env
        out.with_suffix(".json").write_text(json.dumps(r, indent=1))
        lines = [f"# Decode step, Llama-3.1-8B shape (random bf16 weights), B={a.batch}, "
                 f"context {a.context}", "", f"device {env['device']}, jax {env['jax']}, "
                 f"copy bandwidth {r['copy_bw'] / 1e12:.2f} TB/s (measured in the same run)", "",
                 f"command: `{env['command']}`", "",
                 "| attention | layers | step ms | floor ms (weights+KV / copy bw) | x floor | weights-only step ms | weights floor ms | KV floor ms |",
                 "|---|---|---|---|---|---|---|---|"]
        for row in r["rows"]:
            lines.append(f"| {row['impl']} | {row['layers']} | {row['step_ms']:.2f} | {row['floor_ms']:.2f} | "
                         f"{row['over_floor']:.2f} | {row['weights_only_step_ms']:.2f} | "
                         f"{row['weights_floor_ms']:.2f} | {row['kv_floor_ms']:.2f} |")
        lines.append("")
        lines.append(f"First call of `generate` (compile + run, 4 tokens): "
                     f"{r['generate_first_call_s']:.1f} s")
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    else:
        if a.model == "random-8b":
            cfg = llama31_8b_shape()
            model = jaxspec.Model(config=cfg, params=random_params(cfg))
        else:
            model = jaxspec.load(a.model)
        rng = np.random.default_rng(0)
        texts = json.loads(pathlib.Path(a.prompts_file).read_text()) if a.prompts_file else None

        def prompts_fn(B, P):
            if texts:
                flat = [t for doc in texts for t in doc]
                starts = rng.integers(0, max(1, len(flat) - P), size=B)
                return [flat[s:s + P] for s in starts]
            return rng.integers(0, model.config.vocab_size, size=(B, P)).tolist()

        rows = []
        bench_speculative(model, [int(x) for x in a.batch.split(",")],
                          [int(x) for x in a.prompt.split(",")], [int(x) for x in a.gamma.split(",")],
                          a.sink, a.window, a.max_new, prompts_fn, rows,
                          trees=[tuple(int(x) for x in t.split(",")) for t in a.trees.split(";") if t])
        res = {"env": env, "model": a.model, "rows": rows}
        out.with_suffix(".json").write_text(json.dumps(res, indent=1))
        lines = [f"# Autoregressive vs self-speculation ({a.model})", "",
                 f"device {env['device']}, jax {env['jax']}; sink {a.sink}, window {a.window}, "
                 f"{a.max_new} new tokens, greedy", "", f"command: `{env['command']}`", "",
                 "| batch | prompt | gamma | AR tok/s | spec tok/s | speedup | acceptance | tokens/step | identical |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['batch']} | {r['prompt']} | {r.get('gamma', '-')} | "
                             f"{r['error'][:60]} | | | | | |")
            else:
                lines.append(f"| {r['batch']} | {r['prompt']} | {r['gamma']} | {r['ar_tok_s']:.0f} | "
                             f"{r['spec_tok_s']:.0f} | {r['speedup']:.2f} | {r['acceptance']:.2f} | "
                             f"{r['tokens_per_step']:.2f} | {r['greedy_identical']} |")
        out.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
