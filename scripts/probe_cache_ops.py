"""Count whole-cache ops (copies / converts / fusions producing a cache-shaped array) in the compiled
chain and tree speculative loops on this backend (benchmarks/profiles.md).

    python scripts/probe_cache_ops.py [random-smol | random-qwen15 | tiny | CHECKPOINT]
"""
import re, sys, time, pathlib
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
import jax, jax.numpy as jnp
from jaxspec import sampling, speculative as S
from jaxspec.cache import KVCache
from jaxspec.engine import DecodeState
from jaxspec.tree import TokenTree
from benchmark import load_model
m = load_model(sys.argv[1] if len(sys.argv) > 1 else "random-smol")
cfg = m.config; B = 64; S_ = 8192
cache = KVCache.create(cfg, B, S_, jnp.bfloat16, abstract=True)
st = DecodeState(cache=cache, last=jax.ShapeDtypeStruct((B,), jnp.int32),
                 out=jax.ShapeDtypeStruct((B, 80), jnp.int32), n_out=jax.ShapeDtypeStruct((B,), jnp.int32),
                 budget=jax.ShapeDtypeStruct((B,), jnp.int32), done=jax.ShapeDtypeStruct((B,), bool),
                 rng=jax.random.PRNGKey(0), steps=jax.ShapeDtypeStruct((), jnp.int32))
ds = S.DraftState(cache=KVCache.create(cfg, 1, 1, jnp.bfloat16, abstract=True), prev=jax.ShapeDtypeStruct((B,), jnp.int32))
sp = sampling.SamplingParams.make(B, temperature=0.0)
shape = f"[{cfg.num_layers},{B},{cfg.num_kv_heads},{S_},{cfg.head_dim}]"
params = m.decode_params()
for name, tree in (("chain3", None), ("tree211", TokenTree.from_expansion((2, 1, 1)))):
    loop = S.SpecLoop(config=cfg, stop_ids=(), gamma=3, sink=16, window=496, greedy=True, tree=tree)
    t = time.time()
    txt = S._run_spec.lower(params, jnp.zeros(()), sp, st, ds, loop=loop).compile().as_text()
    pathlib.Path(f"/tmp/hlo_{name}.txt").write_text(txt)
    ops = {}
    dims = shape[1:-1]
    for ln in txt.splitlines():
        mm = re.search(r"= (\w+)\[([^\]]*)\]\{[^}]*\} ([\w-]+)\(", ln)
        if mm and mm.group(2) == dims:
            key = f"{mm.group(1)} {mm.group(3)}"
            ops[key] = ops.get(key, 0) + 1
    print(f"{name}: compile {time.time() - t:.1f} s; ops producing {shape}:", ops, flush=True)
    for ln in txt.splitlines():
        if shape in ln and re.search(r"= \S+ (copy|convert)\(", ln):
            print("   ", ln.strip()[:220])
