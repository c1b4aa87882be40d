"""Time one round of each speculative loop at a fixed shape on random weights, and count the
whole-cache ops in each loop's compiled HLO (benchmarks/profiles.md).

Target: the Qwen2.5-1.5B shape; draft: the Qwen2.5-0.5B shape with a ring cache (sink + window).
Loops: plain decoding, self-speculation (chain), the separate draft's chain, and each speculative
loop in adaptive form with every round forced to speculate or forced to a plain step (the cost
model's inputs are set so), so the price of the `lax.cond` and of a plain step inside the loop can
be read off directly.

    python scripts/probe_draft_loop.py --batch 64 --context 8192 --rounds 20 --out /tmp/probe
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmark import load_model, random_params  # noqa: E402
from jaxspec import engine, sampling, speculative as S  # noqa: E402
from jaxspec.cache import KVCache  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random-qwen15")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--window", type=int, default=1008)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="/tmp/probe_draft_loop")
    a = ap.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tgt = load_model(a.model)
    cfg = tgt.config
    dcfg = dataclasses.replace(cfg, num_layers=24, hidden_size=896, intermediate_size=4864,
                               num_heads=14, num_kv_heads=2, head_dim=64)
    dparams_raw = random_params(dcfg, dtype=jnp.bfloat16, seed=1)
    draft = type(tgt)(config=dcfg, params=dparams_raw)
    params, dparams = tgt.decode_params(), draft.decode_params()
    B, L, g = a.batch, a.context, a.gamma
    S_ = L + 512
    R = a.rounds
    Sd = S.ring_cache_len(a.sink, a.window, g + 2, max(8, min(256, a.window // 2)))
    sp = sampling.SamplingParams.make(B, temperature=0.0)
    tshape = f"[{cfg.num_layers},{B},{cfg.num_kv_heads},{S_},{cfg.head_dim}]"
    dshape = f"[{dcfg.num_layers},{B},{dcfg.num_kv_heads},{Sd},{dcfg.head_dim}]"

    def state():
        c = KVCache.create(cfg, B, S_, jnp.bfloat16)
        return engine.DecodeState(
            cache=c.replace(lengths=jnp.full((B,), L, jnp.int32)),
            last=jnp.zeros((B,), jnp.int32), out=jnp.zeros((B, 8 * R + 16), jnp.int32),
            n_out=jnp.zeros((B,), jnp.int32), budget=jnp.full((B,), 8 * R, jnp.int32),
            done=jnp.zeros((B,), bool), rng=jax.random.PRNGKey(0),
            steps=jnp.zeros((), jnp.int32), max_steps=jnp.asarray(R, jnp.int32))

    def dstate(kind):
        if kind == "self":
            return S.DraftState(cache=KVCache.create(cfg, 1, 1, jnp.bfloat16),
                                prev=jnp.zeros((B,), jnp.int32))
        dc = KVCache.create(dcfg, B, Sd, jnp.bfloat16)
        return S.DraftState(cache=dc.replace(lengths=jnp.full((B,), L, jnp.int32)),
                            prev=jnp.zeros((B,), jnp.int32))

    span = a.sink + a.window
    always = np.asarray([1, 0, 0, 0, 0, span, 100, 1e9], np.float32)  # tokens * 1 >= n * 0
    never = np.asarray([0, 0, 1, 0, 0, span, 100, 1e9], np.float32)  # tokens * 0 < n * 1
    variants = [("plain", None, None, None)]
    for kind in ("self", "draft"):
        for mode, rc in (("", None), (" adaptive-spec", always), (" adaptive-plain", never)):
            variants.append((kind + mode, kind, rc is not None, rc))
    rows = []
    for name, kind, adaptive, rc in variants:
        if kind is None:
            loop = engine.DecodeLoop(config=cfg, stop_ids=())
            fn = engine._run_loop
            args = lambda: (params, sp, state())  # noqa: E731
            kw = {"loop": loop}
        else:
            loop = S.SpecLoop(config=cfg, stop_ids=(), gamma=g, sink=a.sink, window=a.window,
                              greedy=True, draft_config=None if kind == "self" else dcfg,
                              ring=kind == "draft", adaptive=bool(adaptive))
            fn = S._run_spec
            dp = jnp.zeros(()) if kind == "self" else dparams
            args = lambda dp=dp, kind=kind, rc=rc: (params, dp, sp, state(), dstate(kind), rc)  # noqa: E731
            kw = {"loop": loop}
        t = time.perf_counter()
        compiled = fn.lower(*args(), **kw).compile()
        compile_s = time.perf_counter() - t
        txt = compiled.as_text()
        (out / f"hlo_{name.replace(' ', '_')}.txt").write_text(txt)
        ops = {}
        for ln in txt.splitlines():
            m = re.search(r"= (\w+)(\[[^\]]*\])\{[^}]*\} ([\w-]+)\(", ln)
            if m and m.group(2) in (tshape, dshape):
                key = f"{'target' if m.group(2) == tshape else 'draft'} {m.group(1)} {m.group(3)}"
                ops[key] = ops.get(key, 0) + 1
        ts = []
        for i in range(a.repeats + 1):
            inp = args()
            jax.block_until_ready(inp)
            t = time.perf_counter()
            res = compiled(*inp)
            jax.block_until_ready(res)
            if i:
                ts.append(time.perf_counter() - t)
        final = res if kind is None else res[0]
        steps = int(final.steps)
        ms = 1e3 * statistics.median(ts) / max(steps, 1)
        row = {"variant": name, "ms_per_round": ms, "rounds": steps, "compile_s": compile_s,
               "whole_cache_ops": ops}
        rows.append(row)
        print(f"{name:24s} {ms:8.3f} ms/round ({steps} rounds, compile {compile_s:.0f} s) {ops}",
              flush=True)
        del res, inp, final, compiled  # the next loop's caches need the memory
    env = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "command": " ".join(sys.argv), "batch": B, "context": L, "gamma": g,
           "window": a.window, "sink": a.sink, "target_cache": tshape, "draft_cache": dshape}
    (out / "probe_draft_loop.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
