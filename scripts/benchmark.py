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

# Before jax starts: a larger share of GPU memory for the caches (jax's default is 75%, which
# left 64 x 32000 tokens of Qwen2.5-1.5B K/V, 58.9 GiB, just out of an H100's reach).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

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
QWEN15_SHAPE = dict(model_type="qwen2", vocab_size=151936, hidden_size=1536,
                    intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                    head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                    max_position_embeddings=32768, attention_bias=True)
SMOL_SHAPE = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                  rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)
TINY_SHAPE = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  max_position_embeddings=4096)
MISTRAL7B_SHAPE = dict(model_type="mistral", vocab_size=32000, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                       head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=32768, sliding_window=4096)  # Mistral-7B-v0.1
QWEN3_8B_SHAPE = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096,
                      intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
                      head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                      max_position_embeddings=40960)  # Qwen3-8B (q/k RMSNorm per head)
RANDOM_MODELS = {"random-8b": None, "random-qwen15": QWEN15_SHAPE, "random-smol": SMOL_SHAPE,
                 "random-mistral7b": MISTRAL7B_SHAPE, "random-qwen3-8b": QWEN3_8B_SHAPE,
                 # the same shape as a llama (no q/k norm): what the per-head norms cost
                 "random-qwen3-8b-llama": dict(QWEN3_8B_SHAPE, model_type="llama"),
                 "tiny": TINY_SHAPE}


def load_model(name: str, dtype=jnp.bfloat16, seed=0) -> jaxspec.Model:
    """A checkpoint path, or a random-weight model: random-8b, random-qwen15, random-smol,
    random-mistral7b (sliding window 4096), random-qwen3-8b (and random-qwen3-8b-llama, its shape
    without the q/k norms), tiny."""
    dtype = jnp.dtype(dtype)
    if name in RANDOM_MODELS:
        cfg = llama31_8b_shape() if name == "random-8b" else ModelConfig(**RANDOM_MODELS[name])
        return jaxspec.Model(config=cfg, params=random_params(cfg, dtype=dtype, seed=seed))
    return jaxspec.load(name, dtype=dtype.name)


def token_stream(path: str | None, vocab: int, seed: int = 0) -> np.ndarray:
    """The token stream prompts are cut from: a .npy stream or a JSON list of token lists
    (concatenated), else random tokens."""
    if path:
        p = pathlib.Path(path)
        if p.suffix == ".npy":
            return np.load(p).astype(np.int32).ravel()
        data = json.loads(p.read_text())
        return np.asarray([t for doc in data for t in doc], np.int32)
    return np.random.default_rng(seed).integers(0, vocab, size=1 << 20).astype(np.int32)


def cut_prompts(stream: np.ndarray, B: int, P: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    if len(stream) <= P:
        stream = np.tile(stream, P // max(len(stream), 1) + 2)
    starts = rng.integers(0, len(stream) - P, size=B)
    return [stream[s:s + P].tolist() for s in starts]


@dataclasses.dataclass
class Variant:
    name: str
    spec: object = None  # jaxspec.Speculation, None for autoregressive
    skip_finished: bool = True  # False: finished rows still read their cache (the old loops)

    @property
    def chain_gamma(self):
        s = self.spec
        return None if s is None or s.tree is not None or s.gamma == "auto" else int(s.gamma)


def make_variants(a, draft_model) -> list[Variant]:
    out = [Variant("ar")]
    for g in _ints(a.gamma):
        out.append(Variant(f"self g{g}", jaxspec.Speculation("self", gamma=g, sink=a.sink,
                                                              window=a.window)))
        if a.noskip:
            out.append(Variant(f"self g{g} noskip", jaxspec.Speculation(
                "self", gamma=g, sink=a.sink, window=a.window), skip_finished=False))
        if a.adaptive:
            out.append(Variant(f"self g{g} adaptive", jaxspec.Speculation(
                "self", gamma=g, sink=a.sink, window=a.window, adaptive=True)))
    for t in _trees(a.trees):
        out.append(Variant(f"self tree{','.join(map(str, t))}",
                           jaxspec.Speculation("self", sink=a.sink, window=a.window, tree=t)))
    if a.auto:
        out.append(Variant("self auto", jaxspec.Speculation("self", gamma="auto", sink=a.sink,
                                                            window=a.window)))
    if draft_model is not None:
        dw = None if a.draft_window in ("none", "None", "") else int(a.draft_window)
        tag = "draft" if dw is None else f"draft-ring{dw}"
        for g in _ints(a.draft_gamma):
            out.append(Variant(f"{tag} g{g}", jaxspec.Speculation(draft_model, gamma=g,
                                                                  sink=a.sink, window=dw)))
            if a.adaptive:
                out.append(Variant(f"{tag} g{g} adaptive", jaxspec.Speculation(
                    draft_model, gamma=g, sink=a.sink, window=dw, adaptive=True)))
        for t in _trees(a.draft_trees):
            out.append(Variant(f"{tag} tree{','.join(map(str, t))}",
                               jaxspec.Speculation(draft_model, sink=a.sink, window=dw, tree=t)))
        if a.draft_auto:
            out.append(Variant(f"{tag} auto", jaxspec.Speculation(draft_model, gamma="auto",
                                                                  sink=a.sink, window=dw)))
    return out


def _ints(s):
    return [int(x) for x in str(s).split(",") if x.strip()]


def _trees(s):
    return [tuple(int(x) for x in t.split(",")) for t in str(s or "").split(";") if t.strip()]


def device_bytes() -> int:
    try:
        return int(jax.devices()[0].memory_stats()["bytes_limit"])
    except Exception:  # noqa: BLE001 - CPU: no limit reported
        return 1 << 40


def _median_run(fn, repeats, cap_s=6.0):
    """Median seconds of up to ``repeats`` calls of fn (fewer once ``cap_s`` seconds are spent:
    long runs vary little) and the last result."""
    ts, outs = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        outs = fn()
        ts.append(time.perf_counter() - t)
        if sum(ts) > cap_s:
            break
    return statistics.median(ts), outs


class SpecBench:
    """Autoregressive vs speculative decoding, side by side, one prefill per (batch, prompt).

    For every point the prompts are prefilled once; each variant then decodes from the same
    cache (`Prepared.fresh_state`: decoding writes only slots past the prompts). Two numbers per
    variant, both from one compiled loop:
      completion: every row generates ``max_new`` tokens, time until the last row is done (what
        `jaxspec.generate` returns; rows with few accepted drafts hold the whole batch);
      steady: R rounds with every row still generating (R = rounds the mean row needs for
        ``max_new``), committed tokens / time: the regime of a continuous-batching server, where
        a finished row's slot is refilled at once.
    """

    def __init__(self, model, variants, *, max_new, repeats, impl="auto", seed=0, log=print,
                 precompile: int = 0):
        self.model, self.variants, self.max_new = model, variants, max_new
        self.repeats, self.impl, self.seed, self.log = repeats, impl, seed, log
        self.params = model.decode_params()
        self.precompile = precompile  # threads compiling all loops of a shape up front (0: off)
        self._compiled = set()

    def _precompile(self, prep, width) -> float:
        """Compiles the loops of the plain and fixed-shape self-speculation variants ahead of
        time, ``self.precompile`` at once (XLA compiles in C++, so threads overlap); the jitted
        calls then find them in the compilation cache."""
        from concurrent.futures import ThreadPoolExecutor

        from jaxspec import engine, speculative
        model, impl = self.model, self.impl
        lowered = []
        for v in self.variants:
            if v.spec is None:
                st = prep.fresh_state(self._cache, extra=1, out_width=width, max_steps=1)
                loop = engine.DecodeLoop(config=model.config, stop_ids=prep.stop_ids, impl=impl,
                                         skip_finished=v.skip_finished)
                lowered.append(engine._run_loop.lower(self.params, prep.sp, st, loop=loop))
            elif v.spec.draft == "self" and v.spec.gamma != "auto":
                r = speculative.prepare_speculation(v.spec, model, prep.token_lists, self.max_new)
                st = prep.fresh_state(self._cache, extra=r.extra_slots, out_width=width,
                                      max_steps=1)
                adaptive = bool(v.spec.adaptive)
                loop = r.loop(model, stop_ids=prep.stop_ids, impl=impl, gamma=r.gamma,
                              greedy=True, adaptive=adaptive, skip_finished=v.skip_finished)
                lowered.append(speculative._run_spec.lower(
                    self.params, jnp.zeros(()), prep.sp, st, r.draft_state(model, st, impl),
                    np.zeros(8, np.float32) if adaptive else None, loop=loop))
        t = time.perf_counter()
        with ThreadPoolExecutor(self.precompile) as ex:
            list(ex.map(lambda low: low.compile(), lowered))
        return time.perf_counter() - t

    def extra_slots(self) -> int:
        """The most slots any variant's round writes past a row's budget."""
        gmax = max([v.spec.gamma if isinstance(v.spec.gamma, int) else 6
                    for v in self.variants if v.spec is not None and v.spec.tree is None] + [1])
        nodes = max([jaxspec.speculative.resolve_tree(v.spec.tree).num_nodes
                     for v in self.variants if v.spec is not None and v.spec.tree is not None]
                    + [1])
        return max(gmax + 2, nodes + 1)

    def cache_len(self, P: int) -> int:
        return round_up(P + 3 * self.max_new + 2 * self.extra_slots() + 64, 128)

    def kv_bytes(self, B, S, with_drafts=True) -> int:
        c = self.model.config
        b = 2 * c.num_layers * B * c.num_kv_heads * S * c.head_dim * jnp.dtype(self.model.dtype).itemsize
        for v in self.variants if with_drafts else ():
            d = getattr(v.spec, "draft", "self")
            if isinstance(d, jaxspec.Model):
                dc = d.config
                Sd = S if v.spec.window is None else v.spec.sink + v.spec.window + 128
                b = max(b, b + 2 * dc.num_layers * B * dc.num_kv_heads * Sd * dc.head_dim * 2)
        return b

    def point(self, B: int, P: int, prompts, S: int | None = None) -> list[dict]:
        """All variants at one (batch, prompt length); ``S``: cache slots per row (one cache
        length for all prompt lengths of a batch size keeps the compiled loops few)."""
        from jaxspec import engine
        model, impl = self.model, self.impl
        S = S or self.cache_len(P)
        t = time.perf_counter()
        prep = engine.prepare(model, prompts, max_new_tokens=self.max_new, max_len=S,
                              attn_impl=impl, seed=self.seed)
        jax.block_until_ready(prep.state.cache.k)
        prefill_s = time.perf_counter() - t
        self.log(f"  B={B} P={P}: prefill {prefill_s:.1f} s (cache {S} slots)")
        width = 3 * self.max_new + 2 * self.extra_slots() + 64  # one output shape per batch size
        # steady runs: no row may run out of budget (nor past the model's context)
        big = min(S, model.config.max_position_embeddings, P + width) - P - self.extra_slots() - 1
        self._cache = prep.state.cache  # the prefilled cache, handed from run to run
        if self.precompile and (B, S) not in self._compiled:
            self._compiled.add((B, S))
            self.log(f"    compiled {self._precompile(prep, width):.1f} s (all loops, "
                     f"{self.precompile} threads)")
        rows, ar = [], None
        costs = {}
        for v in self.variants:
            row = {"batch": B, "prompt": P, "variant": v.name, "prefill_s": prefill_s}
            try:
                res = self._variant(v, prep, width, big, ar, costs)
                row.update(res)
                if v.spec is None:
                    ar = res
                else:
                    row["speedup"] = res["tok_s"] / ar["tok_s"]
                    row["steady_speedup"] = res["steady_tok_s"] / ar["tok_s"]
            except Exception as e:  # noqa: BLE001 - an OOM is a result, not a crash
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            rows.append(row)
            self.log("    " + _fmt_row(row))
            if "error" in row and (ar is None or self._cache.k.is_deleted()):
                break  # no baseline, or the prefilled cache went with the failed call
        self._cache = None
        return rows

    def _variant(self, v, prep, width, big, ar, costs):
        from jaxspec import engine, speculative
        model, impl, B = self.model, self.impl, len(prep.token_lists)
        out = {}
        if v.spec is None:
            loop = engine.DecodeLoop(config=model.config, stop_ids=prep.stop_ids, impl=impl,
                                     skip_finished=v.skip_finished)

            def run(cache, budget=None, max_steps=1 << 30):
                st = prep.fresh_state(cache, budget=budget, extra=1, out_width=width,
                                      max_steps=max_steps)
                final = engine._run_loop(self.params, prep.sp, st, loop=loop)
                jax.block_until_ready(final.n_out)
                return final, {}
        else:
            runner = speculative.prepare_speculation(v.spec, model, prep.token_lists,
                                                     self.max_new)
            runner.skip_finished = v.skip_finished
            pristine = None
            if runner.draft is not None:  # the draft's own prefill: once, outside the timing
                t = time.perf_counter()
                pristine = runner.draft_state(
                    model, prep.fresh_state(self._cache, extra=runner.extra_slots,
                                            out_width=width), impl)
                jax.block_until_ready(pristine)
                out["draft_prefill_s"] = time.perf_counter() - t

            def run(cache, budget=None, max_steps=1 << 30):
                st = prep.fresh_state(cache, budget=budget, extra=runner.extra_slots,
                                      out_width=width, max_steps=max_steps)
                # each run consumes (donates) its draft state: start from a copy of the prefill
                ds = None if pristine is None else jax.tree.map(jnp.copy, pristine)
                final, stats = runner.run(model, prep.sp, st, stop_ids=prep.stop_ids, impl=impl,
                                          dstate=ds)
                jax.block_until_ready(final.n_out)
                return final, stats
        def timed(**kw):
            final, stats = run(self._cache, **kw)
            self._cache = final.cache
            return final, stats

        t = time.perf_counter()
        final, stats = timed()  # warm-up: compile (and gamma="auto" step costs) + one run
        if v.spec is not None and v.spec.gamma == "auto":
            final, stats = timed()  # auto: the choice made with this run's acceptance, compiled
        out["first_call_s"] = time.perf_counter() - t
        dt, (final, stats) = _median_run(timed, self.repeats)
        n_out = np.asarray(final.n_out)
        tokens = [np.asarray(final.out)[i, :n_out[i]].tolist() for i in range(prep.n_real)]
        out.update({"seconds": dt, "new_tokens": int(n_out.sum()), "tok_s": n_out.sum() / dt,
                    "ms_per_token": 1e3 * dt / max(1, int(n_out.max())),
                    "rounds": int(final.steps)})
        if v.spec is None:
            out["tokens"] = tokens
            out["steady_tok_s"] = out["tok_s"]
            return out
        out["identical_rows"] = float(np.mean([a == b for a, b in zip(tokens, ar["tokens"])]))
        for k in ("acceptance_rate", "tokens_per_step", "gamma", "tree_nodes", "auto_alpha", "plain_steps",
                  "predicted_speedup", "tokens_per_step_rows"):
            if k in stats:
                out[k] = stats[k]
        # steady state: as many rounds as the mean row needed, nobody out of budget
        tps = max(out.get("tokens_per_step", 1.0), 1.0)
        R = max(1, int(round(self.max_new / tps)))
        dt_s, (final, _) = _median_run(lambda: timed(budget=big, max_steps=R), self.repeats)
        n_s = np.asarray(final.n_out)
        out.update({"steady_rounds": R, "steady_tokens": int(n_s.sum()),
                    "steady_tok_s": n_s.sum() / dt_s,
                    "steady_rows_done": int(np.sum(np.asarray(final.done)[:prep.n_real]))})
        g = v.chain_gamma or (stats.get("gamma") if v.spec.gamma == "auto" else None)
        if g:  # MagicDec's cost model from measured step costs and the measured acceptance
            key = "self" if v.spec.draft == "self" else f"draft{v.spec.window}"
            if key not in costs:
                st = prep.fresh_state(self._cache, extra=runner.extra_slots, out_width=width)
                ds = (runner.draft_state(model, st, self.impl) if pristine is None
                      else jax.tree.map(jnp.copy, pristine))
                c, st, _ = speculative.measure_costs(model, v.spec, runner.draft, st, ds,
                                                     self.impl, speculative.GAMMA_CANDIDATES)
                self._cache = st.cache
                costs[key] = c
            c = costs[key]
            alpha = speculative.per_token_acceptance(
                out["acceptance_rate"] * g, g)  # accepted per row-step = rate * gamma
            pred = speculative.expected_tokens(alpha, g) * c["plain"] / (
                g * c["draft"] + c["verify"][g])
            out.update({"alpha": alpha, "model_speedup": pred,
                        "cost_ms": {"plain": c["plain"] * 1e3, "draft": c["draft"] * 1e3,
                                    "verify": c["verify"][g] * 1e3}})
        return out


def _fmt_row(r):
    if "error" in r:
        return f"{r['variant']}: ERROR {r['error'][:120]}"
    s = f"{r['variant']}: {r['tok_s']:.0f} tok/s ({r['seconds']:.2f} s, first call {r['first_call_s']:.1f} s)"
    if "speedup" in r:
        s += (f" speedup {r['speedup']:.2f} steady {r['steady_speedup']:.2f}"
              f" acc {r.get('acceptance_rate', 0):.2f} tps {r.get('tokens_per_step', 0):.2f}"
              f" identical {r.get('identical_rows', 0):.2f}")
        if "model_speedup" in r:
            s += f" model {r['model_speedup']:.2f}"
    return s


def bench_speculative(a, env, log=print):
    model = load_model(a.model)
    draft = load_model(a.draft) if a.draft else None
    variants = make_variants(a, draft)
    stream = token_stream(a.prompts_file, model.config.vocab_size)
    bench = SpecBench(model, variants, max_new=a.max_new, repeats=a.repeats, impl=a.impl, log=log,
                      precompile=a.precompile)
    limit = device_bytes()
    w_bytes = param_bytes(model.params) + (param_bytes(draft.params) if draft else 0)
    deadline = time.time() + a.time_budget_s
    rows = []
    out = pathlib.Path(a.out)
    if a.points:  # explicit (batch x prompt) pairs
        pts = [tuple(int(x) for x in p.split("x")) for p in a.points.split(",") if p.strip()]
    else:
        pts = [(B, P) for B in _ints(a.batch) for P in _ints(a.prompt)]
    by_batch: dict[int, list[int]] = {}
    for B, P in pts:
        by_batch.setdefault(B, []).append(P)

    def skip(B, P, why):
        rows.append({"batch": B, "prompt": P, "skipped": why})
        log(f"  B={B} P={P}: skipped ({why})")
        write_spec_results(out, a, env, rows)

    for B, Ps in by_batch.items():
        ok = []
        for P in Ps:
            need = bench.kv_bytes(B, bench.cache_len(P)) + w_bytes
            if P + a.max_new + bench.extra_slots() > model.config.max_position_embeddings:
                skip(B, P, "longer than the context")
            elif need > 0.9 * limit:
                skip(B, P, f"needs {need / 2**30:.1f} GiB of {limit / 2**30:.1f}")
            else:
                ok.append(P)
        if not ok:
            continue
        S = bench.cache_len(max(ok))  # one cache length (and compiled loops) per batch size
        for P in ok:
            if time.time() > deadline:
                skip(B, P, "time budget")
                continue
            prompts = cut_prompts(stream, B, P, seed=B * 100003 + P)
            try:
                rows += bench.point(B, P, prompts, S=S)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory in prefill
                rows.append({"batch": B, "prompt": P, "error": f"{type(e).__name__}: {e}"[:400]})
                log(f"  B={B} P={P}: {rows[-1]['error'][:200]}")
            write_spec_results(out, a, env, rows)
    return rows


def write_spec_results(out: pathlib.Path, a, env, rows):
    out.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
    (out / "speculative.json").write_text(json.dumps({"env": env, "args": vars(a), "rows": slim},
                                                     indent=1, default=str))
    lines = [f"# Autoregressive vs speculative decoding ({a.model}"
             + (f", draft {a.draft}" if a.draft else "") + ")", "",
             f"device {env['device']}, jax {env['jax']}, {env['date']}; greedy, {a.max_new} new "
             f"tokens per row; self-speculation sink {a.sink} + window {a.window}", "",
             f"command: `{env['command']}`", "",
             "speedup = completion throughput (all rows reach the budget) over autoregressive; "
             "steady = throughput over the rounds in which every row is still generating "
             "(continuous batching); model = MagicDec's cost model from measured step costs and "
             "the measured acceptance.", "",
             "| batch | prompt | variant | tok/s | speedup | steady | model | acceptance | "
             "tokens/step (slowest row) | gamma | ms/token | identical | first call s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in slim:
        if "skipped" in r:
            lines.append(f"| {r['batch']} | {r['prompt']} | skipped: {r['skipped']} |"
                         + " |" * 10)
        elif "error" in r:
            lines.append(f"| {r['batch']} | {r['prompt']} | {r.get('variant', '-')}: "
                         f"{r['error'][:80]} |" + " |" * 10)
        elif "speedup" not in r:
            lines.append(f"| {r['batch']} | {r['prompt']} | {r['variant']} | {r['tok_s']:.0f} | "
                         f"1.00 | 1.00 | | | 1.00 | | {r['ms_per_token']:.2f} | | "
                         f"{r['first_call_s']:.0f} |")
        else:
            ms = r.get("model_speedup")
            lines.append(
                f"| {r['batch']} | {r['prompt']} | {r['variant']} | {r['tok_s']:.0f} | "
                f"{r['speedup']:.2f} | {r['steady_speedup']:.2f} | "
                f"{'' if ms is None else f'{ms:.2f}'} | {r.get('acceptance_rate', 0):.2f} | "
                f"{r.get('tokens_per_step', 0):.2f} ({r.get('tokens_per_step_rows', {}).get(0, 0):.2f}) | "
                f"{str(r.get('tree_nodes', '')) + ' nodes' if 'tree_nodes' in r else r.get('gamma', '')}"
                f"{_plain_note(r)} | "
                f"{r['ms_per_token']:.2f} | {r.get('identical_rows', 0):.2f} | "
                f"{r['first_call_s']:.0f} |")
    (out / "speculative.md").write_text("\n".join(lines) + "\n")
    try:
        plot_speedups(out, slim)
    except Exception as e:  # noqa: BLE001 - plotting must not lose the numbers
        print("plot failed:", e)


def _plain_note(r) -> str:
    """How many of an adaptive run's target forwards were plain steps."""
    n = r.get("plain_steps") or 0
    return f" ({n} of {r['rounds']} steps plain)" if n else ""


def plot_speedups(out: pathlib.Path, rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in rows if "speedup" in r]
    if not ok:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, key, title in ((axes[0], "speedup", "completion (all rows reach the budget)"),
                           (axes[1], "steady_speedup", "steady state (every row generating)")):
        for P in sorted({r["prompt"] for r in ok}):
            best = {}
            for r in ok:
                if r["prompt"] == P:
                    best[r["batch"]] = max(best.get(r["batch"], 0), r[key])
            xs = sorted(best)
            ax.plot(xs, [best[x] for x in xs], marker="o", label=f"prompt {P}")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("best speculative speedup over autoregressive")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speculative_speedup.png", dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode")
    d.add_argument("--batch", type=int, default=32)
    d.add_argument("--context", type=int, default=8192)
    d.add_argument("--impls", default="auto,xla")
    d.add_argument("--out", default="benchmarks/decode_llama8b")
    s = sub.add_parser("speculative", help="autoregressive vs speculative grid")
    s.add_argument("--model", default="random-qwen15",
                   help="checkpoint path or random-8b / random-qwen15 / random-smol / "
                        "random-mistral7b / random-qwen3-8b / tiny")
    s.add_argument("--batch", default="8,32,64")
    s.add_argument("--prompt", default="1024,8192")
    s.add_argument("--points", default="", help="explicit BxP pairs instead of batch x prompt, "
                   "e.g. '1x8192,64x8192,32x32000'")
    s.add_argument("--gamma", default="2,4", help="self-speculation chain lengths")
    s.add_argument("--auto", action="store_true", help="add self-speculation with gamma='auto'")
    s.add_argument("--adaptive", action="store_true",
                   help="add each fixed gamma with adaptive=True (plain steps for stragglers)")
    s.add_argument("--noskip", action="store_true",
                   help="add each self gamma with finished rows still reading their cache")
    s.add_argument("--trees", default="", help="self-speculation trees, e.g. '2,1,1;3,2,1'")
    s.add_argument("--sink", type=int, default=16)
    s.add_argument("--window", type=int, default=496)
    s.add_argument("--draft", default=None, help="a draft model checkpoint (or random name)")
    s.add_argument("--draft-gamma", default="4")
    s.add_argument("--draft-window", default="none", help="ring-buffer window or 'none'")
    s.add_argument("--draft-trees", default="")
    s.add_argument("--draft-auto", action="store_true")
    s.add_argument("--max-new", type=int, default=128)
    s.add_argument("--repeats", type=int, default=2)
    s.add_argument("--impl", default="auto")
    s.add_argument("--time-budget-s", type=float, default=1e9)
    s.add_argument("--precompile", type=int, default=0,
                   help="compile all loops of a batch size up front in this many threads")
    s.add_argument("--prompts-file", default=None,
                   help=".npy token stream or JSON list of token lists (long text)")
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
        rows = bench_speculative(a, env)
        print((pathlib.Path(a.out) / "speculative.md").read_text())


if __name__ == "__main__":
    main()
