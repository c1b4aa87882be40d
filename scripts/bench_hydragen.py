#!/usr/bin/env python
"""End-to-end shared-prefix (Hydragen) decode throughput sweep (issue 6).

Measures new tokens per second of the *decode loop* (not prefill) for B questions that share one
document of P tokens, with sharing (`jaxspec.prefix`: the document prefilled once into a prefix
cache, attended to once per step for all rows) and without (every row holds the whole document in
its own KV cache), over a grid of batch sizes and prefix lengths, for a random Llama-3.1-8B-shaped
model and/or converted checkpoints; plus self-speculation vs autoregressive decoding with sharing
on in both.

How one point is measured (the same internals `jaxspec.generate` runs, without its re-prefill):
  * the document is prefilled once per prefix length into a prefix level (`build_prefix`, padded to
    one slot count for all prefix lengths: one compiled prefill and one compiled decode loop per
    batch size), each row's question (suffix) is prefilled `--prefill-rows` rows at a time
    (`prefill_shared(row_block=...)`: one compiled prefill for all batch sizes);
  * the non-shared cache is the same K/V materialized per row (`unshare_cache`), so both modes
    decode from bit-identical caches and only the attention path differs;
  * the jitted decode loop (`engine.DecodeLoop` / `speculative.SpecLoop`) is compiled ahead of time
    (compile time reported apart), run once as warm-up, then `--repeats` times; the median is
    reported. Decoding writes only slots past the prompts, so the loop's final cache is rewound
    (lengths, last token, outputs, budget) and decoded from again: no prefill between repeats;
  * greedy, stop tokens off: every row makes exactly `--new-tokens` tokens;
  * `identical`: the non-shared (and speculative) greedy tokens equal the shared autoregressive
    ones (exact in float32; in bf16 recorded, not required);
  * floor: max(bytes / copy bandwidth, flops / matmul rate) per step, both ceilings measured in the
    same run; bytes = weights + prefix K/V once per group (shared) or per row (non-shared) + the
    rows' suffix K/V at the run's mean length.
A point that runs out of memory (at allocation, compile or run) is a result row (status "oom"),
never a crash; points that would not finish inside `--time-budget-s` are recorded as skipped.

Outputs in --out: hydragen.json (rows + environment), hydragen.md (tables, goals met / not met),
hydragen_<model>.png (throughput vs batch, one line per prefix, shared solid, non-shared dashed).

GPU:  python scripts/bench_hydragen.py --model random-8b --out $OUT
      python scripts/bench_hydragen.py --model /tmp/ck/qwen15,/tmp/ck/smol --out $OUT
CPU smoke test (tiny random float32 model, tiny grid, < 1 min):
      python scripts/bench_hydragen.py --tiny --out /tmp/hyd
"""

from __future__ import annotations

import time

T_START = time.time()

import os  # noqa: E402
import sys  # noqa: E402

# Before jax starts: a larger share of GPU memory for the caches (jax's default is 75%).
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import traceback  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxspec  # noqa: E402
from jaxspec import sampling  # noqa: E402
from jaxspec.cache import SLOT_ALIGN, KVCache, kv_bytes_per_token, round_up  # noqa: E402
from jaxspec.config import ModelConfig, llama31_8b_shape  # noqa: E402
from jaxspec.engine import DecodeLoop, DecodeState, _run_loop  # noqa: E402
from jaxspec.model import init_params  # noqa: E402
from jaxspec.prefix import (SharingPlan, build_prefix, prefill_shared, prefill_slots,  # noqa: E402
                            unshare_cache)
from jaxspec.speculative import DraftState, SpecLoop, _run_spec  # noqa: E402

GPU_DEFAULTS = dict(model=["random-8b"], batch="16,32,64,128,256,512,1024",
                    prefix="1024,2048,4096,8192,16384", suffix=32, new_tokens=64, repeats=2,
                    gamma="3", sink=16, window=496, spec_batch=64, goal_loss_batch=256,
                    goal_speedup_batch=64, dtype="bfloat16", time_budget_s=540.0,
                    prefill_rows=16)
TINY_DEFAULTS = dict(model=["random-tiny"], batch="2,4", prefix="48,96", suffix=6, new_tokens=6,
                     repeats=1, prefill_rows=2, gamma="2", sink=4, window=16, spec_batch=4,
                     goal_loss_batch=4, goal_speedup_batch=4, dtype="float32",
                     time_budget_s=300.0)
GOAL_LOSS = 0.10  # throughput loss from the shortest to the longest prefix at the goal batch
GOAL_SPEEDUP = 10.0  # shared over non-shared at the goal batch and the longest prefix


def log(*a):
    print(f"[{time.time() - T_START:7.1f}s]", *a, flush=True)


def is_oom(msg: str) -> bool:
    return bool(re.search(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|OOM|Resource exhausted|"
                          r"[Ff]ailed to allocate|Allocator .* ran out", msg))


def short_error(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}"
    return " ".join(msg.split())[:400]


# ----------------------------------------------------------------------------- ceilings
def _time_loop(body, init, inner, reps, *consts):
    """Median seconds per iteration of ``body(i, carry, *consts)`` looped on the device (the
    arrays are arguments, never constants baked into the program)."""
    f = jax.jit(lambda x, *c: jax.lax.fori_loop(0, inner, lambda i, y: body(i, y, *c), x))
    jax.block_until_ready(f(init, *consts))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(init, *consts))
        ts.append((time.perf_counter() - t) / inner)
    return statistics.median(ts)


def measure_ceilings(small: bool) -> dict:
    """Copy bandwidth (bytes read + written per second of a large device copy), read-only
    bandwidth (a reduction) and bf16 matmul rate, measured now on the default device."""
    out = {}
    nbytes = (16 << 20) if small else (2 << 30)
    inner, reps = (1, 1) if small else (10, 3)
    try:
        x = jnp.ones((nbytes // 2 // 1024, 1024), jnp.bfloat16)
        t = _time_loop(lambda i, y: y + jnp.bfloat16(1), x, inner, reps)
        out["copy_bytes"] = nbytes
        out["copy_Bps"] = 2 * nbytes / t
        t = _time_loop(lambda i, c, y: c + jnp.sum(y * i.astype(y.dtype), dtype=jnp.float32),
                       jnp.float32(0), inner, reps, x)
        out["read_Bps"] = nbytes / t
        del x
    except Exception as e:  # noqa: BLE001 - a ceiling we cannot measure is reported missing
        out["copy_error"] = short_error(e)
    try:
        n = 128 if small else 8192
        a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
        w = (jax.random.normal(jax.random.key(2), (n, n), jnp.float32) / math.sqrt(n)).astype(
            jnp.bfloat16)
        t = _time_loop(lambda i, c: (jnp.dot(c[0], c[1]), c[1]), (a, w), inner, reps)
        out["matmul_flops"] = 2 * n ** 3 / t
        del a, w
    except Exception as e:  # noqa: BLE001
        out["matmul_error"] = short_error(e)
    gc.collect()
    return out


# ----------------------------------------------------------------------------- models, prompts
def tiny_config() -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       max_position_embeddings=2048)


def load_model(name: str, dtype) -> jaxspec.Model:
    if name == "random-8b":
        cfg = llama31_8b_shape()
        params = init_params(cfg, jax.random.PRNGKey(0), dtype=dtype)
        return jaxspec.Model(config=cfg, params=params)
    if name == "random-qwen15":  # the Qwen2.5-1.5B shape (scripts/benchmark.py)
        sys.path.insert(0, str(ROOT / "scripts"))
        from benchmark import RANDOM_MODELS
        cfg = ModelConfig(**RANDOM_MODELS[name])
        return jaxspec.Model(config=cfg, params=init_params(cfg, jax.random.PRNGKey(0), dtype=dtype))
    if name == "random-tiny":
        cfg = tiny_config()
        return jaxspec.Model(config=cfg, params=numpy_random_params(cfg, dtype))
    return jaxspec.load(name, dtype=dtype)


def numpy_random_params(cfg: ModelConfig, dtype, seed: int = 0):
    """Random parameters drawn on the host (no compiled init: fast on CPU). Scaled like
    `init_params`, with a sharper embedding (fewer near-ties between greedy candidates)."""
    from jaxspec.model import param_shapes
    rng = np.random.default_rng(seed)

    def leaf(path, sd):
        name = str(getattr(path[-1], "key", path[-1]))
        x = rng.standard_normal(sd.shape).astype(np.float32)
        if name.endswith("norm"):
            x = 1.0 + 0.1 * x
        elif name in ("bq", "bk", "bv"):
            x = 0.02 * x
        elif name == "embed":
            x = 3.0 * x
        else:
            x = x / math.sqrt(sd.shape[-2])
        return jnp.asarray(x, dtype)

    return jax.tree_util.tree_map_with_path(leaf, param_shapes(cfg, dtype))


def model_label(name: str) -> str:
    return name if name.startswith("random-") else pathlib.Path(name).name


def stdlib_text(min_chars: int) -> str:
    """Python standard-library sources: natural (code) text present on every machine."""
    d = pathlib.Path(os.__file__).parent
    parts, n = [], 0
    for f in sorted(d.glob("*.py")):
        try:
            t = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(t)
        n += len(t)
        if n >= min_chars:
            break
    return "\n\n".join(parts)


def token_supply(model: jaxspec.Model, text: str, need: int, seed: int):
    """(ids, description): at least ``need`` token ids of natural text (random ids without a
    tokenizer or with ``--text random``)."""
    V = model.config.vocab_size
    tok = model.tokenizer
    if tok is None or text == "random":
        rng = np.random.default_rng(seed)
        return rng.integers(0, V, size=need).astype(np.int32), "random token ids"
    from jaxspec.textdata import token_stream
    if text == "stdlib":
        body, what = stdlib_text(8 * need), f"Python {platform.python_version()} stdlib sources"
    else:
        paths = [pathlib.Path(p) for p in text.split(",")]
        body = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in paths)
        what = "text files " + ", ".join(p.name for p in paths)
    ids = np.asarray(token_stream(tok, [body]), np.int32)
    if len(ids) < 1000:
        raise ValueError(f"only {len(ids)} tokens in the text ({what})")
    if len(ids) < need:
        what += f" (repeated: {len(ids)} tokens)"
        ids = np.tile(ids, -(-need // len(ids)))
    return ids[:need], what


def param_bytes(params) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))


def matmul_params(params, cfg: ModelConfig) -> int:
    """Parameters that take part in matmuls per token (the embedding is a gather unless tied)."""
    n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    if not cfg.tie_word_embeddings:
        n -= cfg.vocab_size * cfg.hidden_size
    return n


# ----------------------------------------------------------------------------- the sweep
@dataclasses.dataclass
class Task:
    batch: int
    prefix: int
    modes: tuple  # "shared", "nonshared", "spec"
    exact: bool = False  # prefix slots = the prefix length (else the model's bucket)


_EXES: dict = {}  # compiled loops by function, static loop and argument shapes (per process)


class Sweep:
    def __init__(self, args, env):
        self.a = args
        self.env = env
        self.rows: list[dict] = []
        self.models: dict[str, dict] = {}
        self.out = pathlib.Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.deadline = T_START + args.time_budget_s
        self.model_deadline = self.deadline  # the budget is split evenly over the models
        self.exes = _EXES
        self.compile_times: list[float] = []
        self.done: set = set()

    # ------------------------------------------------------------------ bookkeeping
    def time_left(self) -> float:
        return min(self.deadline, self.model_deadline) - time.time()

    def add(self, row: dict):
        self.rows.append(row)
        keys = ("model", "mode", "batch", "prefix", "status", "tok_s", "ms_per_step", "floor_ms",
                "x_floor", "compile_s", "identical", "acceptance", "error")
        log("ROW", json.dumps({k: _round(row.get(k)) for k in keys if row.get(k) is not None}))
        self.save()

    def compile(self, fn, args: tuple, static: dict):
        """AOT-compiled ``fn`` for these argument shapes (cached); (exe, seconds compiling)."""
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (fn, tuple(sorted(static.items())), tree,
               tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
        if key in self.exes:
            return self.exes[key], 0.0
        t = time.perf_counter()
        exe = fn.lower(*args, **static).compile()
        dt = time.perf_counter() - t
        self.exes[key] = exe
        self.compile_times.append(dt)
        return exe, dt

    def compile_estimate(self) -> float:
        if self.compile_times:
            return float(np.median(self.compile_times))
        return 20.0 if jax.default_backend() != "cpu" else 3.0

    # ------------------------------------------------------------------ per model
    def run_model(self, name: str):
        a = self.a
        label = model_label(name)
        log(f"== model {label}: loading")
        t0 = time.perf_counter()
        dtype = jnp.dtype(a.dtype)
        model = load_model(name, dtype)
        params = model.decode_params()  # per-layer arrays on one GPU, as generate runs
        jax.block_until_ready(params)
        cfg = model.config
        load_s = time.perf_counter() - t0
        batches = [int(x) for x in a.batch.split(",") if x]
        prefixes = sorted({int(x) for x in a.prefix.split(",") if x}, reverse=True)
        gammas = [int(g) for g in a.gamma.split(",") if g and g != "none"]
        extra = (max(gammas) + 2) if gammas else 1
        ctx = cfg.max_position_embeddings
        need_ctx = lambda P: P + a.suffix + a.new_tokens + extra  # noqa: E731
        valid = [P for P in prefixes if need_ctx(P) <= ctx]
        info = {"name": name, "config": dataclasses.asdict(cfg), "dtype": str(dtype),
                "weight_bytes": param_bytes(params), "matmul_params": matmul_params(params, cfg),
                "kv_bytes_per_token": kv_bytes_per_token(cfg, dtype), "load_s": load_s,
                "layers_layout": "per-layer" if isinstance(params["layers"], list) else "scan",
                "prefix_prefill_s": {}}
        self.models[label] = info
        for P in prefixes:
            if P not in valid:
                for B in batches:
                    for mode in self.modes_for(()):
                        self.add(self.base_row(label, mode, B, P) | {
                            "status": "skipped",
                            "error": f"prefix + suffix + new tokens ({need_ctx(P)}) exceed the "
                                     f"model's context ({ctx})"})
        if not valid:
            log(f"model {label}: no prefix fits its context ({ctx}); skipped")
            return
        # prompts: the document (the first P tokens of the supply) + one question per row
        Bmax = max(batches + [a.spec_batch])
        s_max = a.suffix
        rng = np.random.default_rng(a.seed + 1)
        q_lens = rng.integers(max(2, s_max // 2), s_max + 1, size=Bmax)
        need = max(valid) + Bmax * s_max
        try:
            ids, source = token_supply(model, a.text, need, a.seed)
        except Exception as e:  # noqa: BLE001 - no text: random ids still measure throughput
            ids = np.random.default_rng(a.seed).integers(0, cfg.vocab_size, size=need)
            ids, source = ids.astype(np.int32), f"random token ids (text failed: {short_error(e)})"
        info["prompt_source"] = source
        doc = ids[:max(valid)]
        questions = [ids[max(valid) + b * s_max: max(valid) + b * s_max + int(q_lens[b])]
                     for b in range(Bmax)]
        ctxm = ModelCtx(self, label, model, params, doc, questions, extra, gammas,
                        bucket=round_up(max(valid), 16))
        log(f"model {label}: {cfg.num_layers} layers, {info['weight_bytes'] / 1e9:.2f} GB weights, "
            f"{info['kv_bytes_per_token']} KV bytes/token, loaded in {load_s:.1f}s; "
            f"prompts: {source}")
        for task in self.tasks(batches, valid, gammas):
            ctxm.run_task(task)
        ctxm.close()
        del ctxm, model, params
        gc.collect()
        self.plot(label)

    def modes_for(self, gammas):
        modes = [m for m in self.a.modes.split(",") if m]
        return modes + [f"spec-g{g}" for g in gammas]

    def tasks(self, batches, prefixes, gammas):
        """Points in priority order: the goals first, then the grid (prefixes longest first,
        batches in the given order). Non-shared points of one batch size reuse one cache length
        (the longest prefix that fits), so longest prefixes go first."""
        a = self.a
        base = tuple(m for m in ("shared", "nonshared") if m in a.modes.split(","))
        Pmin, Pmax = min(prefixes), max(prefixes)
        spec_P = a.spec_prefix or Pmax
        if spec_P not in prefixes:
            spec_P = max([P for P in prefixes if P <= spec_P], default=Pmin)
        spec = ("shared", "spec") if gammas else ()
        out = []
        gl, gs = a.goal_loss_batch, a.goal_speedup_batch
        if gl in batches:
            if a.slots == "bucket" and Pmin != Pmax:
                out.append(Task(gl, Pmin, ("shared",), exact=True))
            out.append(Task(gl, Pmax, base))
        if spec and a.spec_batch == gs and spec_P == Pmax:
            out.append(Task(gs, Pmax, tuple(dict.fromkeys(base + spec))))
        else:
            if gs in batches:
                out.append(Task(gs, Pmax, base))
            if spec:
                out.append(Task(a.spec_batch, spec_P, spec))
        if "nonshared" in base and gs in batches:
            for B in sorted((b for b in batches if b < gs), reverse=True):
                out.append(Task(B, Pmax, base))
        for P in prefixes:
            for B in batches:
                out.append(Task(B, P, base))
        merged: dict = {}  # one task per point (its set-up is shared by its modes)
        for t in out:
            k = (t.batch, t.prefix, t.exact)
            if k in merged:
                merged[k].modes = tuple(dict.fromkeys(merged[k].modes + t.modes))
            else:
                merged[k] = dataclasses.replace(t)
        return list(merged.values())

    def base_row(self, label, mode, B, P) -> dict:
        return {"model": label, "mode": mode, "batch": B, "prefix": P,
                "suffix_max": self.a.suffix, "new_tokens": self.a.new_tokens}

    # ------------------------------------------------------------------ outputs
    def save(self):
        res = {"env": self.env, "settings": vars(self.a), "models": self.models,
               "rows": self.rows, "goals": self.goals()}
        (self.out / "hydragen.json").write_text(json.dumps(res, indent=1, default=str))
        (self.out / "hydragen.md").write_text(self.markdown(res["goals"]))

    def ok_rows(self, label, mode, exact=None):
        return [r for r in self.rows if r["model"] == label and r["mode"] == mode
                and r["status"] == "ok" and (exact is None or r.get("exact_slots") == exact)]

    def pick(self, label, mode, B, P, prefer_exact=True):
        rs = [r for r in self.ok_rows(label, mode) if r["batch"] == B and r["prefix"] == P]
        if not rs:
            return None
        rs.sort(key=lambda r: r.get("exact_slots", False) != prefer_exact)
        return rs[0]

    def goals(self) -> dict:
        a = self.a
        out = {}
        for label in self.models:
            rows = [r for r in self.rows if r["model"] == label]
            Ps = sorted({r["prefix"] for r in rows if r["status"] != "skipped"
                         or "context" not in (r.get("error") or "")})
            if not Ps:
                continue
            Pmin, Pmax = Ps[0], Ps[-1]
            g = {}
            gl = a.goal_loss_batch
            r1, r2 = self.pick(label, "shared", gl, Pmin), self.pick(label, "shared", gl, Pmax)
            g["loss"] = {"batch": gl, "prefix_from": Pmin, "prefix_to": Pmax, "target": GOAL_LOSS}
            if r1 and r2:
                loss = 1 - r2["tok_s"] / r1["tok_s"]
                g["loss"].update(tok_s_from=r1["tok_s"], tok_s_to=r2["tok_s"], loss=loss,
                                 met=loss < GOAL_LOSS,
                                 exact_slots=[r1.get("exact_slots"), r2.get("exact_slots")])
            gs = a.goal_speedup_batch
            sh = self.pick(label, "shared", gs, Pmax)
            ns_rows = [r for r in rows if r["mode"] == "nonshared" and r["batch"] == gs
                       and r["prefix"] == Pmax]
            g["speedup"] = {"batch": gs, "prefix": Pmax, "target": GOAL_SPEEDUP}
            if sh:
                g["speedup"]["shared_tok_s"] = sh["tok_s"]
                ns = next((r for r in ns_rows if r["status"] == "ok"), None)
                if ns:
                    sp = sh["tok_s"] / ns["tok_s"]
                    g["speedup"].update(nonshared_tok_s=ns["tok_s"], speedup=sp,
                                        met=sp >= GOAL_SPEEDUP, basis="same batch")
                else:
                    if ns_rows:
                        g["speedup"]["nonshared_status"] = ns_rows[0]["status"]
                        fl = ns_rows[0].get("floor_ms")
                        if fl:  # best a non-shared decode could do with memory to spare
                            g["speedup"]["vs_nonshared_floor"] = sh["tok_s"] / (gs / (fl / 1e3))
                    best = max((r for r in self.ok_rows(label, "nonshared") if r["prefix"] == Pmax),
                               key=lambda r: r["tok_s"], default=None)
                    if best:
                        sp = sh["tok_s"] / best["tok_s"]
                        g["speedup"].update(nonshared_tok_s=best["tok_s"],
                                            nonshared_batch=best["batch"], speedup=sp,
                                            met=sp >= GOAL_SPEEDUP,
                                            basis=f"best non-shared that fits (batch "
                                                  f"{best['batch']})")
            specs = {}
            for r in rows:
                if r["mode"].startswith("spec") and r["status"] == "ok":
                    ar = self.pick(label, "shared", r["batch"], r["prefix"], prefer_exact=False)
                    if ar:
                        specs[r["mode"]] = {"batch": r["batch"], "prefix": r["prefix"],
                                            "ar_tok_s": ar["tok_s"], "spec_tok_s": r["tok_s"],
                                            "speedup": r["tok_s"] / ar["tok_s"],
                                            "acceptance": r.get("acceptance"),
                                            "tokens_per_step": r.get("tokens_per_step"),
                                            "identical": r.get("identical")}
            g["spec"] = specs
            out[label] = g
        return out

    def markdown(self, goals) -> str:
        e, a = self.env, self.a
        bw = e.get("copy_Bps")
        L = ["# Shared-prefix (Hydragen) decode throughput, end to end", "",
             f"- device: {e['device']} ({e['backend']}), jax {e['jax']}, jaxlib {e['jaxlib']}, "
             f"flax {e['flax']}, python {e['python']}, {e['date']}",
             f"- command: `{e['command']}`",
             "- ceilings measured in this run: copy "
             + (f"{bw / 1e12:.3f} TB/s (read + write)" if bw else "n/a")
             + (f", read-only {e['read_Bps'] / 1e12:.3f} TB/s" if e.get("read_Bps") else "")
             + (f", bf16 matmul {e['matmul_flops'] / 1e12:.0f} TFLOP/s"
                if e.get("matmul_flops") else ""),
             f"- {a.dtype}, greedy, stop tokens off: every row makes {a.new_tokens} new tokens; "
             f"questions (suffixes) of {max(2, a.suffix // 2)}-{a.suffix} tokens after one shared "
             f"document of `prefix` tokens; median of {a.repeats} decode runs after a warm-up run, "
             "prefill not timed",
             "- shared: prefix prefilled once into a prefix cache (Hydragen attention); "
             "non-shared: "
             "every row holds the whole prefix in its own cache (the same K/V, so both decode from "
             "identical caches); `identical`: same greedy tokens as shared",
             "- floor = max(bytes / copy bandwidth, flops / matmul rate) per step; bytes = weights "
             "+ prefix K/V (once for shared, per row for non-shared) + suffix K/V at the mean "
             "length of the run",
             f"- prefix slots: `{a.slots}` (bucket: every prefix cache padded to the model's "
             "longest prefix, one compiled loop per batch size; exact: prefix slots = prefix "
             "length; the goal's short-prefix point always runs exact); `slots prefix/cache`: "
             "prefix slots / cache slots per row",
             ""]
        for label, info in self.models.items():
            cfg = info["config"]
            if not cfg:
                L += [f"## {label}", "", f"failed: {info.get('error')}", ""]
                continue
            L += [f"## {label}", "",
                  f"{cfg['num_layers']} layers, hidden {cfg['hidden_size']}, heads "
                  f"{cfg['num_heads']}/{cfg['num_kv_heads']} x {cfg['head_dim']}, weights "
                  f"{info['weight_bytes'] / 1e9:.2f} GB, KV "
                  f"{info['kv_bytes_per_token'] / 1024:.0f} "
                  f"KiB/token; prompts: {info.get('prompt_source', '-')}", ""]
            g = goals.get(label)
            if g:
                L += ["| goal | target | measured | met |", "|---|---|---|---|"]
                gl = g["loss"]
                if "loss" in gl:
                    L.append(f"| throughput loss, prefix {gl['prefix_from']} -> {gl['prefix_to']}, "
                             f"batch {gl['batch']} (shared) | < {GOAL_LOSS:.0%} | "
                             f"{gl['loss']:.1%} ({gl['tok_s_from']:.0f} -> {gl['tok_s_to']:.0f} "
                             f"tok/s) | {'yes' if gl['met'] else 'no'} |")
                else:
                    L.append(f"| throughput loss, prefix {gl['prefix_from']} -> {gl['prefix_to']}, "
                             f"batch {gl['batch']} (shared) | < {GOAL_LOSS:.0%} | not measured "
                             "| - |")
                gs = g["speedup"]
                what = f"shared / non-shared, batch {gs['batch']}, prefix {gs['prefix']}"
                if "speedup" in gs:
                    extra = ""
                    if gs.get("basis", "").startswith("best"):
                        extra = (f"; non-shared batch {gs['batch']}: {gs.get('nonshared_status')}")
                        if gs.get("vs_nonshared_floor"):
                            extra += (f"; vs the non-shared batch-{gs['batch']} floor (memory to "
                                      f"spare): {gs['vs_nonshared_floor']:.1f}x")
                    L.append(f"| {what} | >= {GOAL_SPEEDUP:.0f}x | {gs['speedup']:.1f}x "
                             f"({gs['shared_tok_s']:.0f} vs {gs['nonshared_tok_s']:.0f} tok/s, "
                             f"{gs['basis']}{extra}) | {'yes' if gs['met'] else 'no'} |")
                elif "shared_tok_s" in gs:
                    more = f"non-shared: {gs.get('nonshared_status', 'not run')}"
                    if gs.get("vs_nonshared_floor"):
                        more += (f"; vs the non-shared floor (memory to spare): "
                                 f"{gs['vs_nonshared_floor']:.1f}x")
                    L.append(f"| {what} | >= {GOAL_SPEEDUP:.0f}x | shared "
                             f"{gs['shared_tok_s']:.0f} tok/s; {more} | - |")
                else:
                    L.append(f"| {what} | >= {GOAL_SPEEDUP:.0f}x | not measured | - |")
                for mode, s in g["spec"].items():
                    L.append(f"| {mode} / autoregressive, both shared, batch {s['batch']}, prefix "
                             f"{s['prefix']} | > 1x | {s['speedup']:.2f}x ({s['spec_tok_s']:.0f} "
                             f"vs {s['ar_tok_s']:.0f} tok/s; acceptance "
                             f"{_fmt(s['acceptance'], 2)}, "
                             f"{_fmt(s['tokens_per_step'], 2)} tokens/step, identical "
                             f"{s['identical']}) | {'yes' if s['speedup'] > 1 else 'no'} |")
                if not g["spec"]:
                    L.append("| speculative / autoregressive (shared) | > 1x | not measured | - |")
                L.append("")
            rows = [r for r in self.rows if r["model"] == label]
            Bs = sorted({r["batch"] for r in rows})
            Ps = sorted({r["prefix"] for r in rows})
            for mode in ("shared", "nonshared"):
                rs = [r for r in rows if r["mode"] == mode]
                if not rs:
                    continue
                L += [f"Decode tokens/s, {mode} (batch down, prefix across; oom = out of memory):",
                      "", "| batch | " + " | ".join(str(P) for P in Ps) + " |",
                      "|---" * (len(Ps) + 1) + "|"]
                for B in Bs:
                    cells = []
                    for P in Ps:
                        cand = [r for r in rs if r["batch"] == B and r["prefix"] == P
                                and not r.get("exact_slots")] or \
                               [r for r in rs if r["batch"] == B and r["prefix"] == P]
                        if not cand:
                            cells.append("")
                        elif cand[0]["status"] == "ok":
                            cells.append(f"{cand[0]['tok_s']:.0f}")
                        else:
                            cells.append(cand[0]["status"])
                    L.append(f"| {B} | " + " | ".join(cells) + " |")
                L.append("")
            L += ["All rows:", "",
                  "| mode | batch | prefix | slots prefix/cache | suffix (mean) | new | tok/s | "
                  "ms/step | "
                  "floor ms | x floor | steps | compile s | prefill s | identical | acceptance | "
                  "status |", "|---" * 16 + "|"]
            for r in rows:
                L.append(
                    f"| {r['mode']} | {r['batch']} | {r['prefix']} | "
                    f"{r.get('prefix_slots', '-')}/{r.get('cache_slots', '-')} | "
                    f"{_fmt(r.get('suffix_mean'), 1)} | {r['new_tokens']} | "
                    f"{_fmt(r.get('tok_s'), 0)} | "
                    f"{_fmt(r.get('ms_per_step'), 2)} | {_fmt(r.get('floor_ms'), 2)} | "
                    f"{_fmt(r.get('x_floor'), 2)} | {r.get('steps', '')} | "
                    f"{_fmt(r.get('compile_s'), 1)} | {_fmt(r.get('prefill_s'), 2)} | "
                    f"{_fmt(r.get('identical'))} | {_fmt(r.get('acceptance'), 2)} | "
                    f"{r['status']}{': ' + r['error'][:90] if r.get('error') else ''} |")
            L.append("")
        return "\n".join(L) + "\n"

    def plot(self, label):
        if self.a.no_plots:
            return
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except Exception as e:  # noqa: BLE001
            log(f"no plot (matplotlib: {short_error(e)})")
            return
        try:
            rows = [r for r in self.rows if r["model"] == label and r["status"] == "ok"
                    and r["mode"] in ("shared", "nonshared")]
            if not rows:
                return
            Ps = sorted({r["prefix"] for r in rows})
            cmap = plt.get_cmap("viridis")
            fig, ax = plt.subplots(figsize=(8, 5.5))
            for i, P in enumerate(Ps):
                color = cmap(i / max(1, len(Ps) - 1) * 0.9)
                for mode, style, mk in (("shared", "-", "o"), ("nonshared", "--", "s")):
                    pts = {}
                    for r in rows:
                        if r["mode"] == mode and r["prefix"] == P:
                            if r["batch"] not in pts or not r.get("exact_slots"):
                                pts[r["batch"]] = r["tok_s"]
                    if pts:
                        xs = sorted(pts)
                        ax.plot(xs, [pts[x] for x in xs], style, marker=mk, color=color,
                                label=f"prefix {P}, "
                                      f"{'shared' if mode == 'shared' else 'non-shared'}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            Bs = sorted({r["batch"] for r in rows})
            ax.set_xticks(Bs)
            ax.set_xticklabels([str(b) for b in Bs])
            ax.set_xlabel("batch size (questions sharing one document)")
            ax.set_ylabel("decode throughput (new tokens/s)")
            ax.set_title(f"{label}: shared (solid) vs non-shared (dashed)\n"
                         f"{self.env['device']}, {self.a.dtype}, {self.a.new_tokens} new tokens; "
                         "missing points: out of memory or skipped (see the table)", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7, ncol=2)
            fig.tight_layout()
            path = self.out / f"hydragen_{re.sub(r'[^A-Za-z0-9_.-]', '_', label)}.png"
            fig.savefig(path, dpi=120)
            plt.close(fig)
            log(f"wrote {path}")
        except Exception as e:  # noqa: BLE001 - a plot never sinks the results
            log(f"plot failed: {short_error(e)}")


class ModelCtx:
    """One model's points: prefix levels per prefix length, suffix caches per point."""

    def __init__(self, sweep: Sweep, label, model, params, doc, questions, extra, gammas, bucket):
        self.sw, self.a = sweep, sweep.a
        self.label, self.model, self.params = label, model, params
        self.cfg = model.config
        self.doc, self.questions = doc, questions
        self.extra, self.gammas = extra, gammas
        self.bucket = int(bucket)
        self.levels = None  # (P, levels) of the last prefix prefilled
        self.ns_slots: dict[int, int] = {}  # batch -> non-shared cache slots in use
        self.ns_oom: list[tuple[int, int]] = []  # (batch, prefix) of non-shared OOMs
        self.ref_tokens: dict = {}
        self.shapes: set = set()
        info = sweep.models[label]
        self.W = info["weight_bytes"]
        self.N = info["matmul_params"]
        self.kvpt = info["kv_bytes_per_token"]

    def close(self):
        self.levels = None
        self.ref_tokens.clear()
        gc.collect()

    # ------------------------------------------------------------------ set-up
    def prefix_levels(self, P):
        if self.levels is not None and self.levels[0] == P:
            return self.levels[1]
        self.levels = None
        gc.collect()
        a = self.a
        t = time.perf_counter()
        share = SharingPlan(levels=[(1, [self.doc[:P].tolist()])], offsets=np.array([P]))
        lv = build_prefix(self.cfg, self.params, share, impl=a.attn_impl, chunk=a.prefill_chunk,
                          dtype=self.model.dtype, slots=self.bucket)
        jax.block_until_ready(lv)
        dt = time.perf_counter() - t
        self.sw.models[self.label]["prefix_prefill_s"][str(P)] = dt
        log(f"  prefix {P}: prefilled in {dt:.2f}s (first call compiles), "
            f"{self.bucket} prefix slots")
        self.levels = (P, lv)
        return lv

    def setup(self, B, P, exact):
        """The shared suffix cache of B rows after prefix P (prefilled), and its rewind data.
        ``exact``: its prefix level cut to the prefix length (else the model's bucket)."""
        a = self.a
        lv = self.prefix_levels(P)
        rows = [np.concatenate([self.doc[:P], q]) for q in self.questions[:B]]
        share = SharingPlan(levels=[(1, [self.doc[:P].tolist()])], offsets=np.full((B,), P))
        s_lens = np.array([len(r) - P for r in rows], np.int32)
        n_pre = a.suffix - 1  # the longest a question can be: the same shapes for every batch
        S = round_up(max(a.suffix - 1 + a.new_tokens + self.extra,
                         prefill_slots(n_pre, a.prefill_chunk)), SLOT_ALIGN)
        t = time.perf_counter()
        cache = prefill_shared(self.cfg, self.params, rows, share, S=S, impl=a.attn_impl,
                               chunk=a.prefill_chunk, dtype=self.model.dtype, prefix_levels=lv,
                               row_block=min(a.prefill_rows, B), width=n_pre)
        if exact:  # a copy: the bucket levels stay (runs donate the cache's prefix)
            Lp = round_up(P, 16)
            cache = cache.replace(prefix=cache.prefix.replace(levels=tuple(
                x.replace(k=x.k[:, :, :Lp], v=x.v[:, :, :Lp]) for x in cache.prefix.levels)))
        jax.block_until_ready(cache)
        dt = time.perf_counter() - t
        return {"cache": cache, "lengths0": s_lens - 1, "P": P, "s_lens": s_lens, "exact": exact,
                "last0": np.array([int(r[-1]) for r in rows], np.int32), "prefill_s": dt, "S": S}

    # ------------------------------------------------------------------ floors
    def floor(self, mode, B, P, s_mean):
        e = self.sw.env
        ctx_suf = s_mean - 1 + self.a.new_tokens / 2
        if mode == "shared":
            nbytes = self.W + P * self.kvpt + B * ctx_suf * self.kvpt
        else:
            nbytes = self.W + B * (P + ctx_suf) * self.kvpt
        c = self.cfg
        flops = 2 * self.N * B + 4 * B * c.num_heads * c.head_dim * (P + ctx_suf) * c.num_layers
        out = {"bytes_per_step": nbytes, "flops_per_step": flops}
        fl = []
        if e.get("copy_Bps"):
            out["bytes_floor_ms"] = nbytes / e["copy_Bps"] * 1e3
            fl.append(out["bytes_floor_ms"])
        if e.get("matmul_flops"):
            out["flops_floor_ms"] = flops / e["matmul_flops"] * 1e3
            fl.append(out["flops_floor_ms"])
        if fl:
            out["floor_ms"] = max(fl)
        return out

    def estimate_s(self, mode, B, P, new_shape: bool) -> float:
        a = self.a
        est = 1.0 + (self.sw.compile_estimate() if new_shape else 0.0)
        f = self.floor("shared" if mode.startswith("spec") else mode, B, P, a.suffix * 0.75)
        step = max(2.0 * f.get("floor_ms", 0.0) / 1e3, 1e-3)
        return est + (1 + a.repeats) * a.new_tokens * step * (2 if mode.startswith("spec") else 1)

    # ------------------------------------------------------------------ one task
    def run_task(self, t: Task):
        sw, a = self.sw, self.a
        B, P = t.batch, t.prefix
        exact = t.exact or a.slots == "exact"
        modes = []
        for m in t.modes:
            for name in ([f"spec-g{g}" for g in self.gammas] if m == "spec" else [m]):
                if (self.label, name, B, P, t.exact) not in sw.done:
                    modes.append(name)
        st, setup_error = None, None
        for mode in modes:
            sw.done.add((self.label, mode, B, P, t.exact))
            row = sw.base_row(self.label, mode, B, P)
            if exact:
                row["exact_slots"] = True
            if mode == "nonshared":
                pred = [(b, p) for b, p in self.ns_oom if b <= B and p <= P]
                if pred:
                    sw.add(row | self.floor(mode, B, P, a.suffix * 0.75) | {
                        "status": "oom", "error": f"predicted: non-shared batch {pred[0][0]}, "
                                                  f"prefix {pred[0][1]} was already out of memory"})
                    continue
            if setup_error is not None:
                sw.add(row | setup_error)
                continue
            too_big = self.memory_check(mode, B, P)
            if too_big:
                if mode == "nonshared":
                    self.ns_oom.append((B, P))
                sw.add(row | self.floor("shared" if mode.startswith("spec") else mode, B, P,
                                        a.suffix * 0.75) | {"status": "oom", "error": too_big})
                continue
            shape = self.shape_key(mode, B, P, exact)
            est = self.estimate_s(mode, B, P, shape not in self.shapes)
            if sw.time_left() < est:
                sw.add(row | {"status": "skipped", "error": f"time budget ({sw.time_left():.0f}s "
                              f"left, point needs about {est:.0f}s)"})
                continue
            self.shapes.add(shape)
            log(f"-- {self.label} {mode} B={B} P={P}{' (exact prefix slots)' if exact else ''}")
            in_setup = st is None
            try:
                if st is None:
                    st = self.setup(B, P, exact)
                    log(f"  suffix prefill of {B} rows: {st['prefill_s']:.2f}s, {st['S']} slots")
                in_setup = False
                row["prefill_s"] = st["prefill_s"]
                row["suffix_mean"] = float(st["s_lens"].mean())
                if mode == "shared":
                    res = self.run_shared(st, B, P)
                elif mode == "nonshared":
                    res = self.run_nonshared(st, B, P)
                else:
                    res = self.run_spec(st, B, P, int(mode.split("-g")[1]))
                row.update(res)
                if getattr(self, "profile", None):
                    kt, self.profile = self.profile, None
                    row["profile"] = kt
                    log(f"  profile: {kt['kernels']:.0f} kernels/step, busy {kt['busy_us']:.0f} "
                        f"us/step, span {kt['span_us']:.0f} us/step")
                    for r in kt["table"]:
                        log(f"    {r['us']:8.1f} us/step {r['per_step']:6.1f}x  {r['name']}")
                row["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - OOM and the like are results
                msg = ("set-up: " if in_setup else "") + short_error(e)
                oom = is_oom(msg)
                row.update(status="oom" if oom else "error", error=msg)
                if not oom:
                    log("  " + traceback.format_exc().replace("\n", "\n  ")[-3000:])
                if mode == "nonshared" and oom:
                    self.ns_oom.append((B, P))
                if in_setup:  # the suffix prefill itself failed: every mode of the point fails
                    setup_error = {"status": row["status"], "error": msg}
                    st = None
                elif mode != "nonshared":
                    # a run donated the suffix cache and the prefix levels, which may be gone now:
                    # the next mode sets up again (non-shared runs donate only their own copy)
                    st, self.levels = None, None
                del e
                gc.collect()
            if "floor_ms" not in row and mode in ("shared", "nonshared"):
                row.update(self.floor(mode, B, P, row.get("suffix_mean", a.suffix * 0.75)))
            sw.add(row)
        st = None
        gc.collect()

    def ns_cache_slots(self, B, P, s_max):
        """Slots per row of the non-shared cache: what the point needs, or (bucket mode) the
        larger cache this batch size already runs with."""
        need = round_up(P + s_max - 1 + self.a.new_tokens + self.extra, SLOT_ALIGN)
        if self.a.slots == "bucket" and self.ns_slots.get(B, 0) >= need:
            return self.ns_slots[B]
        return need

    def memory_check(self, mode, B, P):
        """A reason when the caches alone cannot fit in the device's memory (no attempt then)."""
        limit = self.sw.env.get("memory_bytes_limit")
        if not limit:
            return None
        S_suf = round_up(self.a.suffix - 1 + self.a.new_tokens + self.extra, SLOT_ALIGN)
        nbytes = (B * S_suf + self.bucket) * self.kvpt  # the shared caches (alive in both modes)
        if mode == "nonshared":
            nbytes += B * self.ns_cache_slots(B, P, self.a.suffix) * self.kvpt
        if self.W + nbytes > limit:
            return (f"predicted: weights {_gb(self.W)} + caches {_gb(nbytes)} > {_gb(limit)} of "
                    f"device memory")
        return None

    def shape_key(self, mode, B, P, exact):
        """What decides whether a point compiles a new loop (for the time estimate)."""
        exact = exact or self.a.slots == "exact"
        if mode == "nonshared":
            s = self.ns_slots.get(B)
            return (mode, B, s if self.a.slots == "bucket" and s else P)
        return (mode, B, P if exact else None)

    def adopt(self, st, cache):
        """After a run: its final cache holds the live buffers (the inputs were donated), the
        prefix levels included."""
        st["cache"] = cache
        if not st["exact"] and self.levels is not None and self.levels[0] == st["P"]:
            self.levels = (st["P"], tuple(cache.prefix.levels))

    # ------------------------------------------------------------------ decode runs
    def _state(self, st, cache, B):
        a = self.a
        return DecodeState(
            cache=cache.replace(lengths=jnp.asarray(st["lengths0"], jnp.int32)),
            last=jnp.asarray(st["last0"]),
            out=jnp.zeros((B, a.new_tokens + self.extra), jnp.int32),
            n_out=jnp.zeros((B,), jnp.int32),
            budget=jnp.full((B,), a.new_tokens, jnp.int32),
            done=jnp.zeros((B,), bool),
            rng=jax.random.PRNGKey(a.seed),
            steps=jnp.zeros((), jnp.int32))

    def _timed_runs(self, run, state_fn, cache):
        """Warm-up run + repeats of ``run(state) -> (final_state, extra)``; the final cache is
        rewound for the next run. Returns (final cache, tokens, times, first, final, extra,
        whether every repeat made the warm-up's tokens)."""
        t = time.perf_counter()
        final, extra = run(state_fn(cache))
        jax.block_until_ready(final)
        first = time.perf_counter() - t
        n_out = np.asarray(final.n_out)
        tokens = np.asarray(final.out)[:, :self.a.new_tokens]
        if not np.all(n_out == self.a.new_tokens):
            raise RuntimeError(f"rows made {sorted(set(n_out.tolist()))} tokens, expected "
                               f"{self.a.new_tokens}")
        times, same = [], True
        for _ in range(self.a.repeats):
            state = state_fn(final.cache)
            t = time.perf_counter()
            final, extra = run(state)
            jax.block_until_ready(final)
            times.append(time.perf_counter() - t)
            same &= bool(np.array_equal(np.asarray(final.out)[:, :self.a.new_tokens], tokens))
        if self.a.profile:  # one more run under the profiler: the kernels of a decode step
            sys.path.insert(0, str(ROOT / "scripts"))
            from benchutil import kernel_table
            d = os.path.join(self.a.profile, f"trace{len(self.sw.rows)}")
            state = state_fn(final.cache)
            with jax.profiler.trace(d, create_perfetto_trace=True):
                final, extra = run(state)
                jax.block_until_ready(final)
            self.profile = kernel_table(d, max(int(final.steps), 1), top=25, width=70)
        return final.cache, tokens, times, first, final, extra, same

    def _result(self, tokens_total, times, first, steps, compile_s, same):
        med = statistics.median(times) if times else first
        return {"tok_s": tokens_total / med, "ms_per_step": med / steps * 1e3, "steps": steps,
                "seconds": med, "run_s": times, "first_run_s": first, "compile_s": compile_s,
                "repeats_identical": same}

    def _sp(self, B):
        return sampling.SamplingParams.make(B, temperature=0.0, top_k=0, top_p=1.0)

    def _loop_exe(self, state, B):
        loop = DecodeLoop(config=self.cfg, stop_ids=(), impl=self.a.attn_impl)
        sp = self._sp(B)
        exe, c = self.sw.compile(_run_loop, (self.params, sp, state), {"loop": loop})
        return exe, sp, c

    def run_shared(self, st, B, P):
        cache = st["cache"]
        state_fn = lambda c: self._state(st, c, B)  # noqa: E731
        exe, sp, compile_s = self._loop_exe(state_fn(cache), B)
        run = lambda s: (exe(self.params, sp, s), None)  # noqa: E731
        st["cache"] = None  # donated below
        cache, tokens, times, first, final, _, same = self._timed_runs(run, state_fn, cache)
        self.adopt(st, cache)
        st["ref"] = tokens
        self.ref_tokens.setdefault((B, P), tokens)
        steps = int(final.steps)
        out = self._result(B * self.a.new_tokens, times, first, steps, compile_s, same)
        out.update(self.floor("shared", B, P, float(st["s_lens"].mean())))
        out["cache_slots"] = int(cache.max_len)
        out["prefix_slots"] = int(cache.prefix.levels[0].k.shape[2])
        if "floor_ms" in out:
            out["x_floor"] = out["ms_per_step"] / out["floor_ms"]
        return out

    def run_nonshared(self, st, B, P):
        a = self.a
        S = self.ns_cache_slots(B, P, int(st["s_lens"].max()))
        cache = unshare_cache(st["cache"], S)
        jax.block_until_ready(cache)
        state_fn = lambda c: DecodeState(  # noqa: E731
            cache=c.replace(lengths=jnp.asarray(st["lengths0"] + P, jnp.int32)),
            last=jnp.asarray(st["last0"]), out=jnp.zeros((B, a.new_tokens + self.extra), jnp.int32),
            n_out=jnp.zeros((B,), jnp.int32), budget=jnp.full((B,), a.new_tokens, jnp.int32),
            done=jnp.zeros((B,), bool), rng=jax.random.PRNGKey(a.seed),
            steps=jnp.zeros((), jnp.int32))
        exe, sp, compile_s = self._loop_exe(state_fn(cache), B)
        run = lambda s: (exe(self.params, sp, s), None)  # noqa: E731
        cache, tokens, times, first, final, _, same = self._timed_runs(run, state_fn, cache)
        self.ns_slots.setdefault(B, S)
        steps = int(final.steps)
        out = self._result(B * a.new_tokens, times, first, steps, compile_s, same)
        out.update(self.floor("nonshared", B, P, float(st["s_lens"].mean())))
        out["cache_slots"] = int(S)
        if "floor_ms" in out:
            out["x_floor"] = out["ms_per_step"] / out["floor_ms"]
        ref = st.get("ref", self.ref_tokens.get((B, P)))
        out["identical"] = None if ref is None else bool(np.array_equal(ref, tokens))
        if ref is not None and not out["identical"]:
            out["first_difference"] = _first_diff(ref, tokens)
        del cache, final
        return out

    def run_spec(self, st, B, P, gamma):
        a = self.a
        loop = SpecLoop(config=self.cfg, stop_ids=(), gamma=gamma, sink=a.sink, window=a.window,
                        greedy=True, impl=a.attn_impl)
        sp = self._sp(B)
        dparams = jnp.zeros(())
        dstate_fn = lambda: DraftState(  # noqa: E731
            cache=KVCache.create(self.cfg, 1, 1, dtype=self.model.dtype),
            prev=jnp.asarray(st["last0"]))
        state_fn = lambda c: self._state(st, c, B)  # noqa: E731
        cache = st["cache"]
        exe, compile_s = self.sw.compile(
            _run_spec, (self.params, dparams, sp, state_fn(cache), dstate_fn()), {"loop": loop})

        def run(s):
            final, _, acc = exe(self.params, dparams, sp, s, dstate_fn())
            return final, acc

        st["cache"] = None  # donated below
        cache, tokens, times, first, final, acc, same = self._timed_runs(run, state_fn, cache)
        self.adopt(st, cache)
        acc = {k: int(v) for k, v in acc.items() if not k.startswith("rows_")}
        steps = int(final.steps)
        out = self._result(B * a.new_tokens, times, first, steps, compile_s, same)
        out.update(gamma=gamma, sink=a.sink, window=a.window,
                   acceptance=acc["accepted"] / max(acc["proposed"], 1),
                   tokens_per_step=acc["committed"] / max(acc["row_steps"], 1),
                   cache_slots=int(cache.max_len),
                   prefix_slots=int(cache.prefix.levels[0].k.shape[2]))
        ref = st.get("ref", self.ref_tokens.get((B, P)))
        out["identical"] = None if ref is None else bool(np.array_equal(ref, tokens))
        if ref is not None and not out["identical"]:
            out["first_difference"] = _first_diff(ref, tokens)
        return out


def _first_diff(a, b):
    rows = np.nonzero(np.any(a != b, axis=1))[0]
    r = int(rows[0])
    c = int(np.nonzero(a[r] != b[r])[0][0])
    return {"rows_differing": int(len(rows)), "row": r, "token_index": c}


def _gb(n) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _round(x):
    if isinstance(x, float):
        return round(x, 4)
    return x


def _fmt(x, nd=None):
    if x is None:
        return ""
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if nd is not None and isinstance(x, (int, float)):
        return f"{x:.{nd}f}"
    return str(x)


# ----------------------------------------------------------------------------- main
def _jaxlib_version() -> str:
    try:
        import jaxlib
        return jaxlib.__version__
    except Exception:  # noqa: BLE001
        return getattr(jax.lib, "__version__", "?")


def environment(argv) -> dict:
    import flax
    dev = jax.devices()[0]
    env = {"device": getattr(dev, "device_kind", str(dev)), "backend": jax.default_backend(),
           "device_count": jax.device_count(), "jax": jax.__version__,
           "jaxlib": _jaxlib_version(),
           "flax": flax.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "command": " ".join([os.path.basename(sys.executable), *sys.argv[:1], *argv]),
           "env_vars": {k: v for k, v in os.environ.items()
                        if k.startswith(("XLA_", "JAXSPEC_", "JAX_"))}}
    try:
        env["memory_bytes_limit"] = int(dev.memory_stats().get("bytes_limit", 0))
    except Exception:  # noqa: BLE001 - not every backend has memory stats
        pass
    return env


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", "--models", action="append", default=None,
                   help="random-8b, random-qwen15, random-tiny or a converted checkpoint path; repeatable or "
                        "comma-separated")
    p.add_argument("--batch", help="batch sizes, run in this order (default 16,...,1024)")
    p.add_argument("--prefix", help="shared prefix lengths (default 1024,...,16384)")
    p.add_argument("--suffix", type=int, help="longest question (suffix) in tokens; questions "
                   "have suffix/2 .. suffix tokens (default 32)")
    p.add_argument("--new-tokens", type=int, help="tokens generated per row (default 64)")
    p.add_argument("--repeats", type=int, help="timed runs after the warm-up (default 2)")
    p.add_argument("--gamma", help="self-speculation gammas ('' or none: no speculation; "
                   "default 3)")
    p.add_argument("--sink", type=int)
    p.add_argument("--window", type=int)
    p.add_argument("--spec-batch", type=int, help="batch of the speculation points (default 64)")
    p.add_argument("--spec-prefix", type=int, default=None,
                   help="prefix of the speculation points (default: the longest)")
    p.add_argument("--goal-loss-batch", type=int, help="batch of the 1k->16k loss goal (256)")
    p.add_argument("--goal-speedup-batch", type=int,
                   help="batch of the shared/non-shared goal (64)")
    p.add_argument("--modes", default="shared,nonshared")
    p.add_argument("--slots", choices=("bucket", "exact"), default="bucket",
                   help="bucket: prefix caches padded to the longest prefix (one compiled loop "
                        "per batch; the goal's short-prefix point also runs exact); exact: every "
                        "prefix length compiles its own loops")
    p.add_argument("--dtype", help="bfloat16 (default) or float32")
    p.add_argument("--attn-impl", default="auto")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--prefill-rows", type=int,
                   help="suffix prefill batch (one compiled prefill for every batch size; 16)")
    p.add_argument("--text", default="stdlib",
                   help="prompt text for models with a tokenizer: stdlib (Python sources), "
                        "random, or text file paths (comma-separated)")
    p.add_argument("--time-budget-s", type=float,
                   help="seconds from start after which points are skipped (default 540)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/hydragen")
    p.add_argument("--tiny", action="store_true",
                   help="tiny random float32 model and grid (CPU smoke test)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--profile", default="",
                   help="a folder for profiler traces: each point runs once more under "
                        "jax.profiler and its row gets the decode step's kernel table")
    a = p.parse_args(argv)
    defaults = TINY_DEFAULTS if a.tiny else GPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    a.model = [m.strip() for ms in a.model for m in ms.split(",") if m.strip()]
    if a.gamma == "none":
        a.gamma = ""
    for name in ("suffix", "new_tokens", "prefill_rows", "prefill_chunk"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.suffix < 2:
        p.error("--suffix must be >= 2")
    if a.repeats < 0:
        p.error("--repeats must be >= 0")
    return a


def main(argv=None):
    global T_START
    if __name__ != "__main__":  # called in-process: the budget and the log clock count from
        T_START = time.time()  # this call, not from the module's import
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    env = environment(argv)
    log("env", json.dumps(env))
    log("settings", json.dumps(vars(a)))
    small = a.tiny or jax.default_backend() == "cpu"
    env.update(measure_ceilings(small))
    log("ceilings: " + ", ".join(f"{k} {v / 1e12:.3f}T" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in env.items()
                                 if k in ("copy_Bps", "read_Bps", "matmul_flops", "copy_error",
                                          "matmul_error")))
    sw = Sweep(a, env)
    sw.save()
    for i, name in enumerate(a.model):
        # each model gets an equal share of the time left (a model that ends early leaves its
        # rest to the next)
        sw.model_deadline = time.time() + (sw.deadline - time.time()) / (len(a.model) - i)
        try:
            sw.run_model(name)
        except Exception as e:  # noqa: BLE001 - a model that cannot load is a result too
            msg = short_error(e)
            log(f"model {name} failed: {msg}\n" + traceback.format_exc()[-3000:])
            sw.models.setdefault(model_label(name), {"name": name, "config": {}, "error": msg})
            sw.add({"model": model_label(name), "mode": "-", "batch": 0, "prefix": 0,
                    "new_tokens": a.new_tokens, "status": "oom" if is_oom(msg) else "error",
                    "error": msg})
            gc.collect()
    sw.save()
    log(f"done in {time.time() - T_START:.0f}s; wrote {sw.out}/hydragen.json, hydragen.md"
        + ("" if a.no_plots else ", hydragen_*.png"))
    print((sw.out / "hydragen.md").read_text(), flush=True)
    return sw


if __name__ == "__main__":
    main()
