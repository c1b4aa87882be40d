"""Diagnostic (internal entry points, labelled so): where a batch-invariant prefill chunk's time
goes. One prefill chunk (`jaxspec.prefill._prefill_chunk`'s forward) of C tokens for B rows after
START tokens, random weights of the Qwen2.5-1.5B shape, timed with:

- ``default``: the default numerics;
- ``invariant``: `batch_invariant=True`'s numerics;
- ``inv-no-attn``: invariant, but the default attention (the attention's share);
- ``inv-no-mm``: invariant, but the default matrix products (the products' share);
- ``inv-no-norm``: invariant, but the default RMS norm;
- ``inv-attnI``: invariant, the decode attention with the I-th tiling of ``--attn``
  (`InvariantAttentionBlocks`' fields, comma-separated; tilings separated by ``;``).

The cache is donated and fed back (one chunk's K/V written in place, as in `generate`).

Each variant is traced with its patch in place (this process only; no library file changes).

GPU: python scripts/probe_invariant_prefill.py [--batch 64 --chunk 512 --start 8192]
"""
import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxspec
import jaxspec.invariant as inv
import jaxspec.model as M
from jaxspec.attention import AttentionPlan, attend
from jaxspec.bench import RANDOM_SHAPES
from jaxspec.cache import KVCache
from jaxspec.session import Decoder

T0 = time.time()


def log(d):
    d["t"] = round(time.time() - T0, 1)
    print(json.dumps(d), flush=True)


def profile(fn, args, folder, top=40):
    """Total device time per kernel name over one call (from the trace's complete events)."""
    import glob
    import gzip
    import os
    with jax.profiler.trace(folder):
        jax.block_until_ready(fn(*args))
    files = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return {"err": "no trace file"}
    ev = json.load(gzip.open(sorted(files)[-1]))["traceEvents"]
    pids = {e["pid"]: e["args"]["name"] for e in ev
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    tot, cnt = {}, {}
    for e in ev:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        pname = pids.get(e.get("pid"), "")
        if "GPU" not in pname and "gpu" not in pname and "/device" not in pname:
            continue
        n = e["name"][:90]
        tot[n] = tot.get(n, 0.0) + e["dur"] / 1e3
        cnt[n] = cnt.get(n, 0) + 1
    best = sorted(tot.items(), key=lambda kv: -kv[1])[:top]
    return {"total": round(sum(tot.values()), 2),
            "top": [[n, round(t, 2), cnt[n]] for n, t in best]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--start", type=int, default=8192)
    ap.add_argument("--shape", default="random-qwen15")
    ap.add_argument("--layers", type=int, default=0, help="0: the shape's")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated variants")
    ap.add_argument("--attn", default="", help="decode attention tilings to try: "
                    "InvariantAttentionBlocks fields, e.g. '16,128,2048,4,3;16,64,4096,4,2'")
    ap.add_argument("--verify", action="store_true", help="the chunk's tokens as decode rows "
                    "(a verification of C tokens), not prompt rows")
    ap.add_argument("--hlo", action="store_true", help="print the optimized HLO's lines that "
                    "call the invariant attention kernel or copy/transposes the cache")
    ap.add_argument("--profile", default="", help="a folder: a jax.profiler trace of one call per "
                    "variant, and its kernels' total times printed")
    a = ap.parse_args()
    shape = dict(RANDOM_SHAPES[a.shape])
    if a.layers:
        shape["num_layers"] = a.layers
    cfg = jaxspec.ModelConfig(**shape)
    dt = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    model = jaxspec.Model(config=cfg, params=M.init_params(cfg, jax.random.PRNGKey(0), dt))
    variants = {}
    for name, bi in (("default", False), ("invariant", True)):
        dec = Decoder(model, batch_invariant=bi)
        variants[name] = (dec.params, dec.impl)
    B, C, S0 = a.batch, a.chunk, a.start
    S = S0 + C + 256
    cache = KVCache.create(cfg, B, S, dtype=dt)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (B, C)), jnp.int32)
    pos = S0 + jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C))
    log({"device": str(jax.devices()[0]), "jax": jax.__version__, "B": B, "C": C,
         "start": S0, "layers": cfg.num_layers, "impls": {k: v[1] for k, v in variants.items()}})

    orig = dict(attention=inv.attention, prompt_attention=inv.prompt_attention,
                matmul_for=inv.matmul_for, rms_norm=inv.rms_norm)
    prompt = C > 1 and not a.verify  # a prefill chunk's prompt tokens; C = 1: a decode step

    def default_attention(q, k, v, layer, lengths, mask=None, **kw):
        return attend(q, k, v, layer, AttentionPlan(lengths=lengths, impl="auto"))

    patches = {
        "default": ("default", {}),
        "invariant": ("invariant", {}),
        "inv-no-attn": ("invariant", {"attention": default_attention,
                                      "prompt_attention": default_attention}),
        "inv-no-mm": ("invariant", {"matmul_for": lambda impl, prompt=False: jnp.matmul}),
        "inv-no-norm": ("invariant", {"rms_norm": M.rms_norm}),
    }
    from pallas_kernels import invariant_attention as ia
    orig["blocks"] = ia.DEFAULT_BLOCKS
    attn_cfgs = [ia.InvariantAttentionBlocks(*(int(v) for v in t.split(",")))
                 for t in a.attn.split(";") if t.strip()]
    for i, c in enumerate(attn_cfgs):
        patches[f"inv-attn{i}"] = ("invariant", {"blocks": c})
    if a.only:
        patches = {k: v for k, v in patches.items() if k in a.only.split(",")}
    res = {}
    for name, (base, patch) in patches.items():
        params, impl = variants[base]
        for k, f in patch.items():
            if k == "blocks":
                ia.DEFAULT_BLOCKS = f
                log({"variant": name, "blocks": str(f)})
            else:
                setattr(inv, k, f)

        @functools.partial(jax.jit, donate_argnums=1)
        def run(params, cache, toks, pos):
            plan = AttentionPlan(lengths=jnp.full((B,), S0, jnp.int32), impl=impl, prompt=prompt)
            _, c = M.forward(cfg, params, toks, pos, cache, plan,
                             logits_at=jnp.zeros((B, 1), jnp.int32))
            return c

        box = [cache]

        def call(params, toks, pos):  # the step on the cache the previous one returned
            box[0] = run(params, box[0], toks, pos)
            return box[0]

        try:
            if a.hlo:
                txt = run.lower(params, box[0], toks, pos).compile().as_text()
                dims = f"{B},{cfg.num_kv_heads},{S},{cfg.head_dim}"
                keep = [ln.strip()[:400] for ln in txt.splitlines()
                        if "invariant_attention" in ln or (dims in ln and any(
                            w in ln for w in ("copy", "transpose", "bitcast", "custom-call",
                                              "while", "dynamic-slice", "fusion")))]
                log({"variant": name, "hlo_lines": keep[:40], "n": len(keep)})
            jax.block_until_ready(call(params, toks, pos))
            ts = []
            for _ in range(a.reps):
                t = time.perf_counter()
                jax.block_until_ready(call(params, toks, pos))
                ts.append(time.perf_counter() - t)
            res[name] = statistics.median(ts) * 1e3
            log({"variant": name, "ms": round(res[name], 2)})
            if a.profile:
                log({"variant": name, "kernels_ms": profile(call, (params, toks, pos),
                                                            f"{a.profile}/{name}")})
        except Exception as e:  # noqa: BLE001
            log({"variant": name, "err": repr(e)[:400]})
        for k in patch:
            if k == "blocks":
                ia.DEFAULT_BLOCKS = orig[k]
            else:
                setattr(inv, k, orig[k])
        cache = box[0]
    log({"summary_ms": {k: round(v, 2) for k, v in res.items()}})


if __name__ == "__main__":
    main()
