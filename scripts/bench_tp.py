"""Tensor parallelism: decode and self-speculation at TP=1 (one device) vs TP=2 (two devices).

    python scripts/bench_tp.py --out benchmarks/tp                      # GPU: Qwen-1.5B + Llama-8B shapes
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python scripts/bench_tp.py --tiny --out /tmp/tp                 # CPU smoke test (~30-50 s)

For every model x (batch, context) point and every TP degree, at a fixed *global* batch:

- **decode**: the engine's plain decode loop (`engine.DecodeLoop`, greedy) for ``--new-tokens``
  steps: time per step and tokens/s;
- **self-speculation** (sparse StreamingLLM draft over the target's own cache, ``--gamma`` drafts):
  one draft step (T=1, sink + window), one verify step (T=gamma+1, dense), each a forward + arg-max
  timed in a device loop of ``--step-calls`` steps; and the engine's speculative loop (`speculative.SpecLoop`) end to end: time
  per round, acceptance, tokens/s;
- **communication**: the collectives of the compiled TP=2 programs (read from the HLO: kind,
  bytes, count per step), each priced with an all-reduce / all-gather micro-benchmark on the same
  devices, giving an estimated communication time per step and its share of the measured step.

The cache is filled once per point (random K/V for random weights; for a real checkpoint a prefill
of real text, once per (batch, context) and resharded for the other TP degree) and reused: decoding
only writes slots past the prompt, so every repeat resets the lengths. Numbers are medians of
``--repeats`` after ``--warmup`` runs. Every point is compiled ahead of time (its four programs in
``--compile-threads`` threads), catches its own errors (an OOM is recorded, the next point runs),
and results are written after every point, so an interrupted run keeps what it measured. Points
run in priority order and are skipped once ``--time-budget-s`` would be exceeded.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import json
import math
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for tp.json and tp.md")
    p.add_argument("--tiny", action="store_true",
                   help="tiny random models and shapes (CPU smoke test, well under a minute)")
    p.add_argument("--models", default="qwen1.5b,llama8b",
                   help="comma list of qwen1.5b, llama8b (order = priority)")
    p.add_argument("--qwen-path", default=None,
                   help="a converted jaxspec checkpoint of Qwen2.5-Coder-1.5B (default "
                        "/tmp/ck/qwen15; --tiny: none); random weights of its shape when absent. "
                        "With a tokenizer the cache is prefilled with real code (Python sources "
                        "of the installed jax) and acceptance means something")
    p.add_argument("--points", default=None,
                   help="comma list of BATCHxCONTEXT (global batch), in priority order "
                        "(default 32x8192,128x4096; --tiny: 8x64)")
    p.add_argument("--tp", default="1,2", help="comma list of model-axis sizes (data axis 1)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="tokens per row of each decode / speculative run (default 32; tiny 8)")
    p.add_argument("--gamma", type=int, default=None, help="drafts per round (default 4; tiny 2)")
    p.add_argument("--sink", type=int, default=None, help="draft sink tokens (default 16; tiny 4)")
    p.add_argument("--window", type=int, default=None,
                   help="draft window tokens (default 496; tiny 28)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--step-calls", type=int, default=16,
                   help="draft / verify steps per timing sample (one device loop)")
    p.add_argument("--impl", default="auto", help="attention implementation (auto: Pallas on GPU)")
    p.add_argument("--layers", default=None, choices=["auto", "scan", "unrolled"],
                   help="sets JAXSPEC_LAYERS (default: as in the environment, --tiny: unrolled; "
                        "auto = per-layer arrays on GPU, scanned elsewhere)")
    p.add_argument("--time-budget-s", type=float, default=280.0,
                   help="stop starting new points once this much wall time would be exceeded")
    p.add_argument("--compile-threads", type=int, default=4,
                   help="compile a point's programs concurrently (1: one after the other)")
    p.add_argument("--compile-cache", default="/tmp/jaxspec_bench_tp_cache",
                   help="JAX persistent compilation cache dir (a re-run compiles nothing); "
                        "'' disables it")
    p.add_argument("--no-microbench", action="store_true", help="skip the collective timings")
    p.add_argument("--mem-fraction", default="0.90",
                   help="XLA_PYTHON_CLIENT_MEM_FRACTION when not set in the environment")
    return p.parse_args(argv)


ARGS = parse_args()
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", ARGS.mem_fraction)
if ARGS.layers:
    os.environ["JAXSPEC_LAYERS"] = ARGS.layers
elif ARGS.tiny:  # the smoke test runs the GPU layout: per-layer arrays, sharded on the mesh
    os.environ.setdefault("JAXSPEC_LAYERS", "unrolled")
if ARGS.tiny and os.environ.get("JAX_PLATFORMS") == "cpu":
    # a smoke test on CPU: compile fast (these CPU timings mean nothing anyway)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true").strip()
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxspec  # noqa: E402
from jaxspec import engine, sampling, speculative  # noqa: E402
from jaxspec import sharding as shd  # noqa: E402
from jaxspec.attention import AttentionPlan  # noqa: E402
from jaxspec.cache import KVCache, round_up  # noqa: E402
from jaxspec.config import ModelConfig, llama31_8b_shape  # noqa: E402
from jaxspec.model import forward, param_shapes  # noqa: E402

if ARGS.compile_cache:
    try:
        jax.config.update("jax_compilation_cache_dir", ARGS.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    except Exception as e:  # noqa: BLE001 - an optional speed-up
        log(f"compilation cache not enabled: {e}")


# ----------------------------------------------------------------------------- configs
def qwen15_shape() -> ModelConfig:
    """Qwen2.5-Coder-1.5B: 28 layers, hidden 1536, 12 / 2 heads of 128, MLP 8960, q/k/v bias."""
    return ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=1536,
                       intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                       head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       max_position_embeddings=32768, tie_word_embeddings=False,
                       attention_bias=True, eos_token_ids=(151643, 151645))


def tiny_shape(name: str) -> ModelConfig:
    if name == "qwen1.5b":  # same structure: qwen2, bias, 2 KV heads, untied
        return ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=64,
                           intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=16, max_position_embeddings=1024, attention_bias=True)
    return ModelConfig(model_type="llama", vocab_size=384, hidden_size=64, intermediate_size=160,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       max_position_embeddings=1024)


def shape_of(name: str) -> ModelConfig:
    if ARGS.tiny:
        return tiny_shape(name)
    return qwen15_shape() if name == "qwen1.5b" else llama31_8b_shape()


def defaults():
    tiny = ARGS.tiny
    return dict(
        points=ARGS.points or ("8x64" if tiny else "32x8192,128x4096"),
        new=ARGS.new_tokens or (8 if tiny else 32),
        gamma=ARGS.gamma or (2 if tiny else 4),
        sink=ARGS.sink if ARGS.sink is not None else (4 if tiny else 16),
        window=ARGS.window if ARGS.window is not None else (28 if tiny else 496),
    )


# ----------------------------------------------------------------------------- environment
def environment() -> dict:
    devs = jax.devices()

    def ver(mod):
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001
            return None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        commit, dirty = None, None
    return {
        "device": getattr(devs[0], "device_kind", str(devs[0])), "device_count": len(devs),
        "backend": jax.default_backend(), "jax": jax.__version__, "jaxlib": ver("jaxlib"),
        "flax": ver("flax"), "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "git_commit": commit, "git_dirty": bool(dirty) if dirty is not None else None,
        "env": {k: os.environ.get(k) for k in ("JAXSPEC_LAYERS", "XLA_FLAGS", "NCCL_NVLS_ENABLE",
                                               "XLA_PYTHON_CLIENT_MEM_FRACTION", "JAX_PLATFORMS")},
    }


# ----------------------------------------------------------------------------- timing helpers
def conform(tree, shardings):
    """``tree`` with every array leaf on the sharding the compiled program expects (a no-op for
    leaves already there)."""
    def put(x, s):
        if not isinstance(s, jax.sharding.Sharding) or not isinstance(x, jax.Array):
            return x
        if x.sharding.is_equivalent_to(s, x.ndim):
            return x
        return jax.device_put(x, s)
    return jax.tree_util.tree_map(put, tree, shardings)


def compile_all(lowered: dict, threads: int) -> tuple[dict, dict]:
    """Compiles ``{name: Lowered}`` (concurrently when threads > 1); returns executables and
    seconds per program."""
    out, secs = {}, {}

    def one(name):
        t = time.perf_counter()
        exe = lowered[name].compile()
        return name, exe, time.perf_counter() - t
    if threads > 1 and len(lowered) > 1:
        with concurrent.futures.ThreadPoolExecutor(min(threads, len(lowered))) as ex:
            for name, exe, s in ex.map(one, list(lowered)):
                out[name], secs[name] = exe, s
    else:
        for name in lowered:
            _, out[name], secs[name] = one(name)
    return out, secs


def is_oom(e: BaseException) -> bool:
    s = f"{type(e).__name__}: {e}"
    return any(k in s for k in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM"))


# ----------------------------------------------------------------------------- HLO collectives
_COLL = re.compile(r"=\s*(?P<res>.*?)\s(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|"
                   r"collective-permute|collective-broadcast)(?P<start>-start)?\(")
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def collectives(hlo_text: str, group: int) -> list[dict]:
    """Collectives of a compiled (per-device) HLO: kind, bytes of the full (unsharded) tensor,
    count. Async pairs count once (the ``-start``); in a while loop the body's collectives count
    once, i.e. per iteration."""
    counts: dict = {}
    for line in hlo_text.splitlines():
        m = _COLL.search(line)
        if not m or "-done" in line.split("=")[0]:
            continue
        shapes = [(d, [int(x) for x in dims.split(",") if x]) for d, dims in
                  _SHAPE.findall(m.group("res"))]
        if not shapes:
            continue
        sizes = [_BYTES[d] * (int(np.prod(s)) if s else 1) for d, s in shapes]
        kind = m.group("op")
        nbytes = sum(sizes)  # a combined collective has a tuple of results
        if kind == "all-gather" and m.group("start"):
            nbytes = nbytes * group // (group + 1)  # (operands, outputs): outputs are g x larger
        elif kind == "reduce-scatter":
            nbytes *= group  # the result is one shard
        dtype = shapes[int(np.argmax(sizes))][0]
        key = (kind, nbytes, dtype)
        counts[key] = counts.get(key, 0) + 1
    return [{"kind": k, "bytes": b, "dtype": d, "count": c}
            for (k, b, d), c in sorted(counts.items())]


# ----------------------------------------------------------------------------- micro-benchmark
def microbench(tp: int, sizes: dict, inner: int, reps: int = 5) -> list[dict]:
    """Seconds per all-reduce / all-gather over ``tp`` devices, chained ``inner`` times inside one
    program (each waits for the previous one, as in a decode step): latency included."""
    mesh = Mesh(np.array(jax.devices()[:tp]), ("model",))
    rows = []
    for kind, byte_list in sizes.items():
        dtype = jnp.bfloat16 if kind == "all-reduce" else jnp.float32
        isz = jnp.dtype(dtype).itemsize
        for nbytes in byte_list:
            n_full = max(tp, nbytes // isz // tp * tp)
            local = n_full if kind == "all-reduce" else n_full // tp
            if kind == "all-reduce":
                op = lambda x: jax.lax.psum(x, "model")  # noqa: E731
            else:
                op = lambda x, local=local: jax.lax.all_gather(  # noqa: E731
                    x, "model", tiled=True)[:local]

            def body(x, op=op):
                return jax.lax.fori_loop(0, inner, lambda i, y: op(y), x)
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("model"),
                                      out_specs=P("model"), check_vma=False))
            x = jax.device_put(jnp.zeros((tp * local,), dtype), NamedSharding(mesh, P("model")))
            try:
                for _ in range(2):
                    x = jax.block_until_ready(f(x))
                ts = []
                for _ in range(reps):
                    t = time.perf_counter()
                    x = jax.block_until_ready(f(x))
                    ts.append((time.perf_counter() - t) / inner)
            except Exception as e:  # noqa: BLE001
                rows.append({"kind": kind, "bytes": n_full * isz, "error": str(e)[:300]})
                continue
            s = statistics.median(ts)
            nb = n_full * isz
            # bus bandwidth as NCCL reports it: 2(n-1)/n (all-reduce), (n-1)/n (all-gather)
            factor = 2 * (tp - 1) / tp if kind == "all-reduce" else (tp - 1) / tp
            rows.append({"kind": kind, "bytes": nb, "dtype": jnp.dtype(dtype).name,
                         "us": s * 1e6, "busbw_GBps": factor * nb / s / 1e9})
            log(f"  {kind:10s} {nb / 1024:10.1f} KiB  {s * 1e6:8.1f} us  "
                f"busbw {rows[-1]['busbw_GBps']:7.1f} GB/s")
            del x
    return rows


def price(coll: list[dict], table: list[dict]) -> float | None:
    """Estimated seconds of a list of collectives (serial, no overlap) from the micro-benchmark:
    log-log interpolation in bytes within a kind (all-gather prices the other kinds)."""
    if not coll:
        return 0.0
    by_kind: dict = {}
    for r in table:
        if "us" in r:
            by_kind.setdefault(r["kind"], []).append((r["bytes"], r["us"] * 1e-6))
    total = 0.0
    for c in coll:
        pts = sorted(by_kind.get(c["kind"]) or by_kind.get("all-gather") or
                     by_kind.get("all-reduce") or [])
        if not pts:
            return None
        b = max(c["bytes"], 1)
        if b <= pts[0][0]:
            t = pts[0][1]
        elif b >= pts[-1][0]:
            t = pts[-1][1] * b / pts[-1][0]  # bandwidth-bound beyond the largest size
        else:
            for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
                if b0 <= b <= b1:
                    w = (math.log(b) - math.log(b0)) / max(math.log(b1) - math.log(b0), 1e-12)
                    t = math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))
                    break
        c["est_us"] = t * 1e6
        total += t * c["count"]
    return total


# ----------------------------------------------------------------------------- models
def random_params(config: ModelConfig, mesh, seed=0, dtype=jnp.bfloat16):
    """Random stacked params made directly in their final layout (sharded on ``mesh``), in one
    program: matrices ~ N(0, 1/fan_in), biases N(0, 0.02^2), norms ~ 1, embedding N(0, 1)."""
    abstract = param_shapes(config, dtype)
    if mesh is not None:
        shardings = shd.param_shardings(config, abstract, mesh)
    else:
        dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree_util.tree_map(lambda _: dev, abstract)
    paths = [shd._leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    leaves, treedef = jax.tree_util.tree_flatten(abstract)

    def make(key):
        out = []
        for i, (name, a) in enumerate(zip(paths, leaves)):
            k = jax.random.fold_in(key, i)
            if name.endswith("norm"):
                scale, base = 0.1, 1.0
            elif name == "embed":
                scale, base = 1.0, 0.0
            elif name.startswith("b"):
                scale, base = 0.02, 0.0
            else:
                scale, base = a.shape[-2] ** -0.5, 0.0
            out.append(base + scale * jax.random.normal(k, a.shape, dtype))  # no f32 copy
        return jax.tree_util.tree_unflatten(treedef, out)
    return jax.jit(make, out_shardings=shardings)(jax.random.PRNGKey(seed))


def build_model(name: str, tp: int, mesh):
    """(Model with .mesh, source description). Params in the layout decode_params picks."""
    qpath = ARGS.qwen_path if ARGS.qwen_path is not None else (None if ARGS.tiny else
                                                                "/tmp/ck/qwen15")
    if name == "qwen1.5b" and qpath and (pathlib.Path(qpath) / "jaxspec_config.json").exists():
        model = jaxspec.load(qpath, mesh=mesh)
        src = f"checkpoint {qpath}"
    elif ARGS.tiny:
        cfg = tiny_shape(name)
        model = jaxspec.Model(config=cfg, params=random_params(cfg, mesh), mesh=mesh)
        src = "random (tiny)"
    else:
        if name == "qwen1.5b" and qpath and pathlib.Path(qpath).exists():
            log(f"  {qpath} is not a converted jaxspec checkpoint (no jaxspec_config.json; run "
                f"`jaxspec convert` first): random weights instead")
        cfg = shape_of(name)
        model = jaxspec.Model(config=cfg, params=random_params(cfg, mesh), mesh=mesh)
        src = "random"
    if mesh is not None:
        model = shd.prepare(model, mesh)  # what generate runs (KV heads widened if needed)
    model.decode_params()  # per-layer arrays on GPU (sharded by the partition rules on a mesh)
    return model, src


def text_tokens(tokenizer, n_tokens: int) -> np.ndarray:
    """Real code as prompt text for a coder model: Python sources of the installed jax package."""
    files = sorted(pathlib.Path(jax.__file__).parent.rglob("*.py"))
    ids: list[int] = []
    for f in files:
        try:
            ids += tokenizer(f.read_text(errors="ignore"))["input_ids"]
        except Exception:  # noqa: BLE001
            continue
        if len(ids) >= n_tokens:
            break
    return np.asarray(ids, np.int32)


# ----------------------------------------------------------------------------- one point
@dataclasses.dataclass
class Filled:
    """A filled cache (K/V and lengths) plus the last token of every row, reused across TP."""
    k: jax.Array
    v: jax.Array
    config: ModelConfig  # the config it was filled for (KV heads)
    lengths: np.ndarray
    last: np.ndarray
    kind: str  # "random" | "prefill"


def _steps_impl(params, cache, tok_B, *, config, T, sink, window, impl, n):
    """``n`` draft (T=1, sparse) or verify (T=gamma+1, dense) forwards, each followed by the
    arg-max over the vocabulary at every position, in one device loop (no host in between, as in
    the speculative loop). The cache's lengths are left alone: nothing is committed, every step
    writes the same uncommitted slots."""
    B = cache.batch
    L = cache.lengths
    pos = L[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    plan = AttentionPlan(lengths=L, sink=sink, window=window, impl=impl)

    def body(i, carry):
        cache, tok = carry
        toks = jnp.broadcast_to(tok[:, None], (B, T))
        logits, cache = forward(config, params, toks, pos, cache, plan)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, T]
        return cache, jnp.max(nxt, axis=1)  # every position's arg-max is used
    return jax.lax.fori_loop(0, n, body, (cache, tok_B))


_steps = jax.jit(_steps_impl, static_argnames=("config", "T", "sink", "window", "impl", "n"),
                 donate_argnames=("cache",))


def fill_cache(model, B, ctx, S, c_shd, seed=1) -> Filled:
    cfg = model.config
    shape = (cfg.num_layers, B, cfg.num_kv_heads, S, cfg.head_dim)
    tok = model.tokenizer
    if tok is not None:
        ids = text_tokens(tok, max(4 * ctx, 65536))
        if len(ids) > ctx + B:
            stride = max(1, (len(ids) - ctx) // B)
            prompts = [ids[i * stride:i * stride + ctx].tolist() for i in range(B)]
            zeros = jax.jit(lambda: jnp.zeros(shape, model.dtype), out_shardings=c_shd)
            cache = KVCache(k=zeros(), v=zeros(), lengths=jnp.zeros((B,), jnp.int32))
            t = time.perf_counter()
            with shd.use_mesh(model.mesh):
                cache = engine.prefill(cfg, model.decode_params(), cache,
                                       [p[:-1] for p in prompts], impl=ARGS.impl)
            jax.block_until_ready(cache.k)
            log(f"  prefilled {B} x {ctx - 1} tokens of real code in "
                f"{time.perf_counter() - t:.1f} s (compile included)")
            return Filled(cache.k, cache.v, cfg, np.full((B,), ctx - 1, np.int32),
                          np.asarray([p[-1] for p in prompts], np.int32), "prefill")
    mk = jax.jit(lambda r: jax.random.normal(r, shape, model.dtype), out_shardings=c_shd)
    k = mk(jax.random.PRNGKey(seed))
    v = mk(jax.random.PRNGKey(seed + 1))
    last = np.random.default_rng(seed).integers(0, cfg.vocab_size, B).astype(np.int32)
    return Filled(k, v, cfg, np.full((B,), ctx, np.int32), last, "random")


def run_point(name, B, ctx, tp, filled_box: dict, table: list, cfg_d: dict) -> dict:
    """Measures one (model, batch, context, TP) point. ``filled_box['f']``: the filled cache of this
    (model, batch, context): made here when absent, resharded when present (another TP's), and
    put back at the end for the next TP degree."""
    N, g, sink, window = cfg_d["new"], cfg_d["gamma"], cfg_d["sink"], cfg_d["window"]
    row: dict = {"model": name, "batch": B, "context": ctx, "tp": tp, "new_tokens": N,
                 "gamma": g, "sink": sink, "window": window}
    mesh = shd.make_mesh(data=1, model=tp) if tp > 1 else None
    t_point = time.perf_counter()
    S = round_up(ctx + N + g + 2, 128)

    def cache_shd(c):
        return shd.cache_sharding(c, mesh, B) if mesh is not None else \
            jax.sharding.SingleDeviceSharding(jax.devices()[0])
    f = filled_box.pop("f", None)
    if f is not None:  # the other TP degree's cache: resharded before this TP's weights exist
        s0 = cache_shd(f.config)
        f = dataclasses.replace(f, k=jax.device_put(f.k, s0), v=jax.device_put(f.v, s0))
        jax.block_until_ready((f.k, f.v))
    model, src = build_model(name, tp, mesh)
    params = model.decode_params()
    jax.block_until_ready(params)
    row["build_s"] = time.perf_counter() - t_point
    cfg = model.config
    row["weights"] = src
    row["layout"] = "unrolled" if isinstance(params["layers"], (list, tuple)) else "scan"
    lay0 = params["layers"][0] if row["layout"] == "unrolled" else params["layers"]
    if "wqkv" in lay0:  # fused q/k/v and gate/up (jaxspec.model.fuse_layer_params)
        row["layout"] += "+fused"
    wq = lay0.get("wq", lay0.get("wqkv"))
    row["wq_sharding"] = str(getattr(wq.sharding, "spec", wq.sharding))
    row["config"] = {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "num_heads",
                                                   "num_kv_heads", "head_dim",
                                                   "intermediate_size", "vocab_size")}
    w_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    c_shd = cache_shd(cfg)
    if f is None or f.k.shape != (cfg.num_layers, B, cfg.num_kv_heads, S, cfg.head_dim) or \
            not f.k.sharding.is_equivalent_to(c_shd, 5):
        f = None
        f = fill_cache(model, B, ctx, S, c_shd)
    row["cache_fill"] = f.kind
    jax.block_until_ready(f.k)
    row["fill_s"] = time.perf_counter() - t_point - row["build_s"]
    kv_tok = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(model.dtype).itemsize
    row["bytes_per_device"] = {
        "weights": w_bytes / tp, "kv_decode": B * float(np.mean(f.lengths)) * kv_tok / tp,
        "kv_draft": B * min(sink + window, ctx) * kv_tok / tp}
    log(f"  {name} B={B} ctx={ctx} TP={tp}: {src}, layout {row['layout']} (wq {row['wq_sharding']}), "
        f"weights {w_bytes / 2**30:.2f} GiB, cache {2 * f.k.size * f.k.dtype.itemsize / 2**30:.2f} GiB "
        f"(built in {row['build_s']:.1f} s, filled in {row['fill_s']:.1f} s)")

    cache = KVCache(k=f.k, v=f.v, lengths=jnp.asarray(f.lengths))
    lengths0, last0, fill_kind = f.lengths, f.last, f.kind
    del f  # donation below consumes these buffers; the cache is handed back at the end
    sp = sampling.SamplingParams.make(B, temperature=0.0, top_k=0, top_p=1.0)

    def put(tree):
        return shd.put_batch(tree, mesh, B) if mesh is not None else tree

    def fresh_state(cache, extra):
        st = engine.DecodeState(
            cache=cache.replace(lengths=jnp.asarray(lengths0)),
            last=jnp.asarray(last0), out=jnp.zeros((B, N + extra), jnp.int32),
            n_out=jnp.zeros((B,), jnp.int32), budget=jnp.full((B,), N, jnp.int32),
            done=jnp.zeros((B,), bool), rng=jax.random.PRNGKey(0),
            steps=jnp.zeros((), jnp.int32))
        return put(st)

    def fresh_dstate():
        return speculative.DraftState(cache=KVCache.create(cfg, 1, 1, model.dtype),
                                      prev=jnp.asarray(last0))

    sp = put(sp)
    dloop = engine.DecodeLoop(config=cfg, stop_ids=(), impl=ARGS.impl)
    sloop = speculative.SpecLoop(config=cfg, stop_ids=(), gamma=g, sink=sink, window=window,
                                 greedy=True, impl=ARGS.impl)
    dparams = jnp.zeros(())
    tok0 = put(jnp.asarray(last0))

    # ---- lower (traced under the mesh) and compile all four programs
    t = time.perf_counter()
    with shd.use_mesh(mesh):
        st = fresh_state(cache, g + 1)
        lowered = {
            "decode_loop": engine._run_loop.lower(params, sp, st, loop=dloop),
            "spec_loop": speculative._run_spec.lower(params, dparams, sp, st, fresh_dstate(),
                                                     loop=sloop),
            "draft_step": _steps.lower(params, cache, tok0, config=cfg, T=1, sink=sink,
                                       window=window, impl=ARGS.impl, n=ARGS.step_calls),
            "verify_step": _steps.lower(params, cache, tok0, config=cfg, T=g + 1, sink=None,
                                        window=None, impl=ARGS.impl, n=ARGS.step_calls),
        }
    del st
    lower_s = time.perf_counter() - t
    t = time.perf_counter()
    exe, comp_s = compile_all(lowered, ARGS.compile_threads)
    row["lower_s"] = lower_s
    row["compile_s"] = {k: round(v, 2) for k, v in comp_s.items()}
    row["compile_wall_s"] = time.perf_counter() - t
    log(f"  lowered in {lower_s:.1f} s, compiled in {row['compile_wall_s']:.1f} s "
        f"({', '.join(f'{k} {v:.1f}' for k, v in comp_s.items())})")
    del lowered
    if tp > 1:
        row["collectives"] = {k: collectives(e.as_text(), tp) for k, e in exe.items()
                              if k != "spec_loop"}
    # every program gets its arguments on the shardings it was compiled for (no-ops normally)
    prm = {k: conform(params, e.input_shardings[0][0]) for k, e in exe.items()}

    # ---- decode loop: N steps per run
    ins = exe["decode_loop"].input_shardings[0]
    ts = []
    for r in range(ARGS.warmup + ARGS.repeats):
        st = conform(fresh_state(cache, g + 1), ins[2])
        jax.block_until_ready(st)
        t = time.perf_counter()
        final = exe["decode_loop"](prm["decode_loop"], conform(sp, ins[1]), st)
        jax.block_until_ready(final)
        ts.append(time.perf_counter() - t)
        cache = final.cache
        steps, n_out = int(final.steps), np.asarray(final.n_out)
        tokens = shd.fetch(final.out)[:, :N]
        del final, st
    assert steps == N and (n_out == N).all(), (steps, n_out)
    # greedy tokens from the same cache: TP changes only the reduction order (bf16), so they agree
    # with TP=1 until the first near-tie
    ref = filled_box.get("tokens")
    if ref is None:
        filled_box["tokens"] = tokens
    else:
        same = tokens == ref
        first_diff = np.where(same.all(1), N, np.argmin(same, axis=1))
        row["tokens_vs_first_tp"] = {"rows_identical": float(same.all(1).mean()),
                                     "mean_tokens_before_first_difference": float(first_diff.mean())}
    t_dec = statistics.median(ts[ARGS.warmup:])
    row["decode"] = {"step_ms": t_dec / N * 1e3, "tokens_per_s": B * N / t_dec,
                     "run_s": t_dec, "steps": steps}
    log(f"  decode: {row['decode']['step_ms']:.3f} ms/step, "
        f"{row['decode']['tokens_per_s']:.0f} tok/s")

    # ---- draft and verify steps: step_calls of each in one device loop per run
    for key in ("draft_step", "verify_step"):
        e = exe[key]
        ins = e.input_shardings[0]
        ts = []
        for r in range(ARGS.warmup + ARGS.repeats):
            cache = conform(cache.replace(lengths=jnp.asarray(lengths0)), ins[1])
            tok = conform(tok0, ins[2])
            jax.block_until_ready((cache, tok))
            t = time.perf_counter()
            cache, tok = e(prm[key], cache, tok)
            jax.block_until_ready((cache, tok))
            ts.append((time.perf_counter() - t) / ARGS.step_calls)
        row[key + "_ms"] = statistics.median(ts[ARGS.warmup:]) * 1e3
    log(f"  draft step {row['draft_step_ms']:.3f} ms, verify step (T={g + 1}) "
        f"{row['verify_step_ms']:.3f} ms")

    # ---- speculative loop
    e = exe["spec_loop"]
    ins = e.input_shardings[0]
    ts, accs = [], []
    for r in range(ARGS.warmup + ARGS.repeats):
        st = conform(fresh_state(cache, g + 1), ins[3])
        ds = conform(fresh_dstate(), ins[4])
        jax.block_until_ready((st, ds))
        t = time.perf_counter()
        final, _, acc = e(prm["spec_loop"], conform(dparams, ins[1]), conform(sp, ins[2]), st, ds)
        jax.block_until_ready(final)
        ts.append(time.perf_counter() - t)
        cache = final.cache
        accs.append({k: int(v) for k, v in acc.items() if not k.startswith("rows_")})
        rounds, n_out = int(final.steps), np.asarray(final.n_out)
        del final, st, ds
    t_spec = statistics.median(ts[ARGS.warmup:])
    a = accs[-1]
    row["spec"] = {"round_ms": t_spec / rounds * 1e3, "rounds": rounds,
                   "tokens_per_s": float(n_out.sum()) / t_spec, "run_s": t_spec,
                   "acceptance_rate": a["accepted"] / max(a["proposed"], 1),
                   "tokens_per_round": a["committed"] / max(a["row_steps"], 1),
                   "speedup_vs_decode": t_dec / t_spec * float(n_out.sum()) / (B * N)}
    log(f"  spec: {row['spec']['round_ms']:.3f} ms/round x {rounds} rounds, acceptance "
        f"{row['spec']['acceptance_rate']:.2f}, {row['spec']['tokens_per_s']:.0f} tok/s "
        f"({row['spec']['speedup_vs_decode']:.2f}x decode)")

    # ---- communication estimate
    table = [r for r in table if r.get("tp") == tp]
    if tp > 1 and table:
        est = {k: price(v, table) for k, v in row["collectives"].items()}
        comm = {"decode_step_ms": est["decode_loop"] * 1e3 if est["decode_loop"] is not None
                else None,
                "draft_step_ms": est["draft_step"] * 1e3 if est["draft_step"] is not None else None,
                "verify_step_ms": est["verify_step"] * 1e3 if est["verify_step"] is not None
                else None}
        share = {}
        if comm["decode_step_ms"] is not None:
            share["decode"] = comm["decode_step_ms"] / row["decode"]["step_ms"]
        if comm["draft_step_ms"] is not None:
            share["draft"] = comm["draft_step_ms"] / row["draft_step_ms"]
        if comm["verify_step_ms"] is not None:
            share["verify"] = comm["verify_step_ms"] / row["verify_step_ms"]
        if comm["draft_step_ms"] is not None and comm["verify_step_ms"] is not None:
            comm["round_ms"] = g * comm["draft_step_ms"] + comm["verify_step_ms"]
            share["round"] = comm["round_ms"] / row["spec"]["round_ms"]
        row["comm_est"] = comm
        row["comm_share"] = share
        log("  communication (estimated, serial): " + ", ".join(
            f"{k} {v * 100:.0f}%" for k, v in share.items()))
    # hand the cache back for the next TP degree (un-donated buffers)
    filled_box["f"] = Filled(cache.k, cache.v, cfg, lengths0, last0, fill_kind)
    del cache, params, prm, exe, model
    row["point_s"] = time.perf_counter() - t_point
    row["status"] = "ok"
    return row


# ----------------------------------------------------------------------------- report
def comparisons(points: list[dict]) -> list[dict]:
    ok = {(p["model"], p["batch"], p["context"], p["tp"]): p for p in points
          if p.get("status") == "ok"}
    out = []
    for (m, B, ctx, tp), p in sorted(ok.items()):
        base = ok.get((m, B, ctx, 1))
        if tp == 1 or base is None:
            continue
        out.append({
            "model": m, "batch": B, "context": ctx, "tp": tp,
            "decode_step_speedup": base["decode"]["step_ms"] / p["decode"]["step_ms"],
            "draft_step_speedup": base["draft_step_ms"] / p["draft_step_ms"],
            "verify_step_speedup": base["verify_step_ms"] / p["verify_step_ms"],
            "spec_round_speedup": base["spec"]["round_ms"] / p["spec"]["round_ms"],
            "decode_tokens_per_s_ratio": p["decode"]["tokens_per_s"] /
            base["decode"]["tokens_per_s"],
            "spec_tokens_per_s_ratio": p["spec"]["tokens_per_s"] / base["spec"]["tokens_per_s"],
            # time above a perfect 1/tp split of the TP=1 step
            "decode_overhead_ms": p["decode"]["step_ms"] - base["decode"]["step_ms"] / tp,
            "rows_with_tp1_tokens": (p.get("tokens_vs_first_tp") or {}).get("rows_identical"),
        })
    return out


def _fmt_bytes(b: int) -> str:
    return f"{b} B" if b < 1024 else (f"{b / 1024:.0f} KiB" if b < 1 << 20 else
                                      f"{b / 2**20:.1f} MiB")


def write(out_dir: pathlib.Path, result: dict):
    out_dir.mkdir(parents=True, exist_ok=True)
    result["comparisons"] = comparisons(result["points"])
    (out_dir / "tp.json").write_text(json.dumps(result, indent=1, default=str))
    env = result["environment"]
    L = ["# Tensor parallelism: TP=1 vs TP=2, decode and self-speculation", "",
         f"Device: {env['device_count']} x {env['device']} ({env['backend']}); jax {env['jax']}, "
         f"jaxlib {env['jaxlib']}, flax {env['flax']}, Python {env['python']}; {env['date']}; "
         f"git {env['git_commit']}{' (dirty)' if env['git_dirty'] else ''}.", "",
         f"Command: `{env['command']}`", "",
         f"Environment: {', '.join(f'{k}={v}' for k, v in env['env'].items() if v is not None)}",
         "",
         "Fixed global batch; TP=1 runs on one device, TP=2 on a (data 1, model 2) mesh. Each "
         f"decode / speculative run generates {result['settings']['new']} tokens per row, greedy, "
         f"no stop tokens; self-speculation gamma={result['settings']['gamma']}, sink "
         f"{result['settings']['sink']} + window {result['settings']['window']}. Draft step = "
         "one T=1 forward over sink + window + arg-max; verify step = one T=gamma+1 dense "
         "forward + arg-max (per step, in a device loop of "
         f"{ARGS.step_calls}). Medians of "
         f"{ARGS.repeats} after {ARGS.warmup} warm-up. Random weights give meaningless "
         "acceptance: read the round and step times there.", "",
         "| model | weights | B | ctx | TP | layout | decode ms/step | decode tok/s | draft ms | "
         "verify ms | round ms | accept | spec tok/s | spec / decode | comm share decode / round |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        if p.get("status") != "ok":
            L.append(f"| {p['model']} | | {p['batch']} | {p['context']} | {p['tp']} | "
                     f"{p.get('status')}: {str(p.get('error', ''))[:80]} |" + " |" * 9)
            continue
        sh = p.get("comm_share", {})
        shs = (f"{sh['decode'] * 100:.0f}% / {sh.get('round', float('nan')) * 100:.0f}%"
               if "decode" in sh else "")
        s = p["spec"]
        L.append(f"| {p['model']} | {p['weights'].split(' ')[0]} | {p['batch']} | {p['context']} "
                 f"| {p['tp']} | {p['layout']} | {p['decode']['step_ms']:.2f} | "
                 f"{p['decode']['tokens_per_s']:.0f} | {p['draft_step_ms']:.2f} | "
                 f"{p['verify_step_ms']:.2f} | {s['round_ms']:.2f} | {s['acceptance_rate']:.2f} | "
                 f"{s['tokens_per_s']:.0f} | {s['speedup_vs_decode']:.2f}x | {shs} |")
    if result["comparisons"]:
        L += ["", "TP=2 over TP=1 (same global batch; > 1 is faster):", "",
              "| model | B | ctx | decode step | draft step | verify step | spec round | "
              "decode tok/s | spec tok/s | decode ms above TP1/2 | rows = TP1 tokens |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in result["comparisons"]:
            L.append(f"| {c['model']} | {c['batch']} | {c['context']} | "
                     f"{c['decode_step_speedup']:.2f}x | {c['draft_step_speedup']:.2f}x | "
                     f"{c['verify_step_speedup']:.2f}x | {c['spec_round_speedup']:.2f}x | "
                     f"{c['decode_tokens_per_s_ratio']:.2f}x | {c['spec_tokens_per_s_ratio']:.2f}x "
                     f"| {c['decode_overhead_ms']:.2f} | "
                     + ("" if c["rows_with_tp1_tokens"] is None
                        else f"{c['rows_with_tp1_tokens'] * 100:.0f}%") + " |")
    coll_rows = [p for p in result["points"] if p.get("status") == "ok" and p.get("collectives")]
    if coll_rows:
        L += ["", "Collectives per step in the compiled TP programs (from the HLO; est = "
              "micro-benchmark price each, serial, no overlap):", "",
              "| model | B | ctx | program | collectives (kind x count @ bytes: est us) | "
              "est total ms |", "|---|---|---|---|---|---|"]
        for p in coll_rows:
            ce = p.get("comm_est", {})
            for prog, lst in p["collectives"].items():
                desc = "; ".join(f"{c['kind']} x{c['count']} @ {_fmt_bytes(c['bytes'])}"
                                 + (f": {c['est_us']:.1f}" if "est_us" in c else "") for c in lst)
                tot = ce.get(prog.replace("_loop", "_step") + "_ms")
                L.append(f"| {p['model']} | {p['batch']} | {p['context']} | {prog} | {desc} | "
                         f"{'' if tot is None else f'{tot:.3f}'} |")
    if result.get("microbench"):
        L += ["", "Collective micro-benchmark (chained in one program, so each waits for the "
              "previous one as in a decode step: latency included; bus bandwidth as NCCL counts "
              "it):", "", "| devices | kind | bytes | us | bus GB/s |", "|---|---|---|---|---|"]
        for r in result["microbench"]:
            if "us" in r:
                L.append(f"| {r['tp']} | {r['kind']} | {_fmt_bytes(r['bytes'])} | {r['us']:.1f} | "
                         f"{r['busbw_GBps']:.1f} |")
    skipped = [p for p in result["points"] if p.get("status") not in ("ok", None)]
    if skipped:
        L += ["", "Not measured: " + "; ".join(
            f"{p['model']} B={p['batch']} ctx={p['context']} TP={p['tp']}: {p['status']}"
            + (f" ({str(p.get('error'))[:120]})" if p.get("error") else "") for p in skipped)]
    (out_dir / "tp.md").write_text("\n".join(L) + "\n")


# ----------------------------------------------------------------------------- main
def main():
    d = defaults()
    out_dir = pathlib.Path(ARGS.out)
    models = [m.strip() for m in ARGS.models.split(",") if m.strip()]
    for m in models:
        if m not in ("qwen1.5b", "llama8b"):
            raise SystemExit(f"unknown model {m!r} (qwen1.5b, llama8b)")
    points = []
    for s in d["points"].split(","):
        b, c = s.lower().split("x")
        points.append((int(b), int(c)))
    tps = [int(t) for t in ARGS.tp.split(",")]
    n_dev = len(jax.devices())
    env = environment()
    log(f"{n_dev} x {env['device']} ({env['backend']}), jax {env['jax']}, "
        f"JAXSPEC_LAYERS={os.environ.get('JAXSPEC_LAYERS', 'auto')}")
    result = {"environment": env, "settings": d, "args": vars(ARGS), "points": [],
              "microbench": []}
    deadline = T0 + ARGS.time_budget_s

    # ---- collective micro-benchmark (sizes of the activations and gathered logits involved)
    mb_tps = sorted({t for t in tps if 1 < t <= n_dev})
    if mb_tps and not ARGS.no_microbench:
        act = {B * T * shape_of(m).hidden_size * 2  # bf16 [B, T, hidden] partial sums
               for m in models for B, _ in points for T in (1, d["gamma"] + 1)}
        logits = {B * shape_of(m).vocab_size * 4 for m in models for B, _ in points}  # f32
        if ARGS.tiny:
            sizes = {"all-reduce": [4096, 65536], "all-gather": [4096, 65536]}
        else:  # a small ladder (latency, bandwidth) plus the exact sizes of this run
            sizes = {"all-reduce": sorted({4096, 65536, 16 << 20} | act),
                     "all-gather": sorted({4096, 1 << 20} | logits)}
        for tp in mb_tps:
            log(f"collective micro-benchmark on {tp} devices")
            try:
                rows = microbench(tp, sizes, inner=8 if ARGS.tiny else 20)
                result["microbench"] += [dict(r, tp=tp) for r in rows]
            except Exception as e:  # noqa: BLE001
                log(f"micro-benchmark failed: {type(e).__name__}: {str(e)[:300]}")
        write(out_dir, result)

    # A TP=1 / TP=2 pair runs whole or not at all: the comparison is the point.
    est_s: dict = {}  # (model, tp) -> seconds the last such point took
    for B, ctx in points:
        for name in models:
            box: dict = {}
            run_tps = [tp for tp in tps if tp <= n_dev]
            for tp in tps:
                if tp > n_dev:
                    result["points"].append({"model": name, "batch": B, "context": ctx, "tp": tp,
                                             "status": f"skipped: needs {tp} devices, {n_dev} "
                                                       f"present"})
            first = 5.0 if ARGS.tiny else (30.0 if name == "qwen1.5b" else 45.0)
            need = sum(est_s.get((name, tp), first) for tp in run_tps)
            left = deadline - time.time()
            if left < need:
                for tp in run_tps:
                    result["points"].append({
                        "model": name, "batch": B, "context": ctx, "tp": tp,
                        "status": f"skipped: time budget ({left:.0f} s left, ~{need:.0f} s "
                                  f"needed for the TP pair)"})
                log(f"{name} B={B} ctx={ctx}: skipped, time budget ({left:.0f} s left, "
                    f"~{need:.0f} s needed)")
                write(out_dir, result)
                continue
            for tp in run_tps:
                row = {"model": name, "batch": B, "context": ctx, "tp": tp}
                log(f"point {name} B={B} ctx={ctx} TP={tp}")
                t = time.time()
                try:
                    row = run_point(name, B, ctx, tp, box, result["microbench"], d)
                except Exception as e:  # noqa: BLE001 - one point's failure must not end the run
                    row["status"] = "oom" if is_oom(e) else "error"
                    row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                    log(f"  {row['status']}: {row['error'][:300]}")
                    if not is_oom(e):
                        traceback.print_exc()
                    box.clear()
                row["wall_s"] = time.time() - t
                if row.get("status") == "ok":
                    est_s[(name, tp)] = row["wall_s"]
                result["points"].append(row)
                gc.collect()
                write(out_dir, result)
            box.clear()
            gc.collect()
            jax.clear_caches()
    write(out_dir, result)
    log(f"wrote {out_dir / 'tp.json'} and {out_dir / 'tp.md'}")
    print((out_dir / "tp.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
