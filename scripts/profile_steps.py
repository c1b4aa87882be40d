"""Per-step costs of the decode / draft / verify forwards (a device loop of n steps), per weight
layout, and a kernel-level profile (perfetto trace) of chosen steps (GPU; benchmarks/profiles.md).

    python scripts/profile_steps.py [--model random-qwen15 --batch 64 --ctx 8192]
        [--layouts per-layer,fused --steps plain,draft,verify4,verify8 --profile fused:draft]
"""
import argparse, json, statistics, sys, time
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
import jax, jax.numpy as jnp, numpy as np
from benchmark import load_model, random_cache
from benchutil import forward_loop, kernel_table
from jaxspec.model import unstack_layers, fuse_layer_params

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="random-qwen15")
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--ctx", type=int, default=8192)
ap.add_argument("--layouts", default="per-layer,fused")
ap.add_argument("--steps", default="plain,draft,verify4,verify8")
ap.add_argument("--profile", default="", help="layout:step,... to trace")
ap.add_argument("--n", type=int, default=20)
ap.add_argument("--tag", default="")
a = ap.parse_args()
model = load_model(a.model); cfg = model.config
B, ctx = a.batch, a.ctx
S = ctx + 512
rng = np.random.default_rng(0)
lengths = rng.integers(ctx // 2, ctx, size=B).astype(np.int32)


def get_layout(lay):  # built when asked for: an 8B model's weights do not fit three times
    if lay == "scan":
        return model.params
    base = unstack_layers(model.params)
    return base if lay == "per-layer" else fuse_layer_params(base, in_place=True)

STEPS = {"plain": (1, None, None), "draft": (1, 16, 496), "verify4": (4, None, None),
         "verify8": (8, None, None), "verify16": (16, None, None), "empty": (1, 0, 0)}
cache = random_cache(cfg, B, S, lengths)

res = {}
tok = jnp.zeros((B,), jnp.int32)
for lay in a.layouts.split(","):
    params = get_layout(lay)
    for st in a.steps.split(","):
        T, sink, window = STEPS[st]
        f = forward_loop(cfg, B, T, sink, window, a.n)
        t = time.time(); cache, tok = f(params, cache, tok); jax.block_until_ready(tok); comp = time.time() - t
        ts = []
        for _ in range(5):
            t = time.perf_counter(); cache, tok = f(params, cache, tok); jax.block_until_ready(tok)
            ts.append((time.perf_counter() - t) / a.n)
        res[f"{lay}:{st}"] = statistics.median(ts) * 1e3
        print(f"{a.tag} {lay:9s} {st:8s} {res[f'{lay}:{st}']:.3f} ms/step (compile {comp:.1f} s)", flush=True)
        if f"{lay}:{st}" in a.profile.split(","):
            d = f"/tmp/trace_{lay}_{st}"
            with jax.profiler.trace(d, create_perfetto_trace=True):
                cache, tok = f(params, cache, tok); jax.block_until_ready(tok)
            kt = kernel_table(d, a.n, top=22, width=60)
            if not kt:
                continue
            print(f"  profile {lay}:{st}: {kt['kernels']:.0f} GPU events/step, busy "
                  f"{kt['busy_us']:.0f} us/step, span {kt['span_us']:.0f} us/step; "
                  f"processes {kt['processes']}")
            for r in kt["table"]:
                print(f"    {r['us']:8.1f} us/step {r['per_step']:6.1f}x  {r['name']}")
print(json.dumps(res))
