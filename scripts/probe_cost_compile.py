"""First-call time of `gamma="auto"`'s step-cost measurement (`speculative.measure_costs`) with
its kinds of forward compiled one after another or all at once (GPU probe).

    python scripts/probe_cost_compile.py --mode concurrent|sequential [--model random-qwen15]
"""
import argparse, sys, time
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
import jax, numpy as np
import jaxspec
from jaxspec import speculative as S
from benchmark import load_model

ap = argparse.ArgumentParser()
ap.add_argument("--mode", default="concurrent")
ap.add_argument("--model", default="random-qwen15")
ap.add_argument("--batch", type=int, default=64)
a = ap.parse_args()
if a.mode == "sequential":
    S._compile_concurrently = lambda lowered: [low.compile() for low in lowered]
model = load_model(a.model)
rng = np.random.default_rng(0)
prompts = [rng.integers(0, min(1000, model.config.vocab_size), 256).tolist() for _ in range(a.batch)]
spec = jaxspec.Speculation(draft="self", gamma="auto", sink=16, window=1008)
prep = jaxspec.engine.prepare(model, prompts, max_new_tokens=8, speculation=spec)
st = prep.state
ds = prep.spec.draft_state(model, st, "auto")
jax.block_until_ready(st.cache.k)
t = time.perf_counter()
costs, st, ds = S.measure_costs(model, spec, None, st, ds, "auto", S.GAMMA_CANDIDATES)
print(f"{a.mode}: measure_costs first call {time.perf_counter() - t:.2f} s; "
      f"plain {costs['plain'] * 1e3:.3f} ms, draft {costs['draft'] * 1e3:.3f} ms", flush=True)
