"""Acceptance of the self-draft at equal draft keys: sink + window alone against sink + window +
retrieved blocks (`jaxspec.Speculation(retrieve=...)`), on text and code, through the public API.

Every variant is called on the same prompts with a fixed gamma and adaptive rounds off, so every
step is a speculative round; rows run to the full budget (``ignore_eos``). Prints one JSON line
per call and writes them all to ``--out``/acceptance.json.

    python scripts/bench_acceptance.py --model checkpoints/qwen2.5-coder-1.5b-instruct \\
        --contexts 16384,32000 --sources shakespeare,sympy --variants 1008:0,752:256,496:512
"""
import argparse
import json
import os
import time

import jax

import jaxspec
from jaxspec import textdata


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=128, help="new tokens per row")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--sink", type=int, default=16)
    p.add_argument("--contexts", default="16384,32000", help="prompt lengths")
    p.add_argument("--sources", default="shakespeare,sympy", help="jaxspec.textdata sources")
    p.add_argument("--variants", default="1008:0,752:256,496:512",
                   help="window:retrieve pairs (equal sums read equal keys per draft step)")
    p.add_argument("--seeds", default="1")
    p.add_argument("--out", default=".")
    a = p.parse_args()
    model = jaxspec.load(a.model)
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "batch": a.batch, "new": a.new, "gamma": a.gamma, "sink": a.sink,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": []}
    variants = [tuple(int(x) for x in v.split(":")) for v in a.variants.split(",")]
    for P in (int(x) for x in a.contexts.split(",")):
        for source in a.sources.split(","):
            for seed in (int(x) for x in a.seeds.split(",")):
                prompts = textdata.make_prompts(model.tokenizer, n=a.batch, length=P, seed=seed,
                                                source=source)
                for window, retrieve in variants:
                    spec = jaxspec.Speculation(gamma=a.gamma, sink=a.sink, window=window,
                                               retrieve=retrieve, adaptive=False)
                    res = jaxspec.generate(model, prompts, max_new_tokens=a.new,
                                           speculation=spec, ignore_eos=True)
                    st = res.stats
                    row = dict(P=P, source=source, seed=seed, window=window, retrieve=retrieve,
                               accept=st["acceptance_rate"], tps=st["tokens_per_step"],
                               decode_s=st["decode_seconds"])
                    out["rows"].append(row)
                    print(json.dumps(row), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "acceptance.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
