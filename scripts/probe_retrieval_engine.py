"""Diagnostic (the serving engine's Python API against `jaxspec.generate`): the self-draft's
acceptance with and without retrieved blocks, on the same prompts.

Each run of ``--runs`` (comma-separated ``KIND:TAG``) decodes the same ``--B`` prompts of ``--P``
tokens (`jaxspec.textdata.make_prompts`, Shakespeare, seed 7), ``--new`` tokens each, greedy, to
their budget:

- ``gen:TAG``: `jaxspec.generate` (its ``stats``: acceptance, tokens per target step);
- ``srv:TAG``: a `jaxspec.serving.ServingEngine` of ``--B`` slots. Its slots are first filled by
  ``--B`` warm-up requests of other text (seed 99), so the measured requests find slots that held
  other sequences; then the measured requests are submitted ``--stagger`` seconds apart
  (``burst``: at once) and the engine's ``/metrics`` counters over them give the acceptance.

TAG: ``r512`` (window 496 + 512 retrieved slots) or ``r0`` (window 1008 alone), gamma 4, sink
16; ``-ad``: adaptive rounds (`Speculation`'s default; off otherwise); ``-page``: a block pool
of 16-slot pages; ``-nowarm``: no warm-up requests; ``-impl=xla`` / ``-rpc=N``: the engine's
``attn_impl`` / ``rounds_per_chunk``.

    python scripts/probe_retrieval_engine.py --model checkpoints/NAME --P 16384 --B 64 --new 256 \
        --runs gen:r512-ad,srv:r512-ad,srv:r512,srv:r0-ad
"""
import argparse
import json
import os
import time

import jax

import jaxspec
from jaxspec import textdata
from jaxspec.serving import SamplingOptions, Sequence, ServingEngine

T0 = time.time()


def log(*x):
    print(f"[{time.time() - T0:6.1f}]", *x, flush=True)


def parse_tag(tag: str):
    """``(Speculation, engine keyword arguments, flags)`` of a run's TAG (module docstring)."""
    parts = tag.split("-")
    R = int(parts[0][1:])
    spec = jaxspec.Speculation(gamma=4, retrieve=R, window=496 if R else 1008,
                               adaptive="ad" in parts)
    kw, flags = {}, set()
    for part in parts[1:]:
        if part.startswith("impl="):
            kw["attn_impl"] = part[5:]
        elif part.startswith("rpc="):
            kw["rounds_per_chunk"] = int(part[4:])
        elif part in ("ad", "page", "nowarm", "burst"):
            flags.add(part)
        else:
            raise SystemExit(f"unknown part {part!r} in {tag!r}")
    return spec, kw, flags


def greedy(prompts, new):
    return [Sequence(p, SamplingOptions(max_tokens=new, temperature=0.0)) for p in prompts]


def serve(a, m, prompts, warm, spec, kw, flags):
    if "page" in flags:
        kw.update(page_size=16, kv_blocks=a.B * (a.P + a.new + 64) // 16 + 64)
    eng = ServingEngine(m, max_batch=a.B, max_len=a.P + a.new + 64, speculation=spec, **kw)
    eng.start(variants=[(True, False)])
    try:
        if "nowarm" not in flags:  # slots that held other sequences
            ws = greedy(warm, a.new)
            eng.submit(ws)
            for s in ws:
                s.finished.wait(900)
        m0 = eng.metrics()
        seqs = greedy(prompts, a.new)
        if "burst" in flags:
            eng.submit(seqs)
        else:
            for s in seqs:
                eng.submit([s])
                time.sleep(a.stagger)
        for s in seqs:
            s.finished.wait(900)
        m1 = eng.metrics()
    finally:
        eng.stop()

    def d(k):
        return m1.get(k, 0) - m0.get(k, 0)
    return {"cache": "paged" if eng.paged else "dense",
            "acc": d("draft_accepted") / max(1, d("draft_proposed")),
            "tps": d("generation_tokens") / max(1, d("target_row_steps")),
            "warm_acc": m0.get("acceptance_rate"), "pos_acc": m1.get("position_acceptance")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--P", type=int, default=7680, help="prompt tokens")
    ap.add_argument("--B", type=int, default=64, help="prompts (and engine slots)")
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--runs", default="gen:r512,srv:r512")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--stagger", type=float, default=0.02, help="seconds between submissions")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp") + "/retr_gap.json")
    a = ap.parse_args()
    runs = [(run, *run.split(":")) for run in a.runs.split(",")]
    parsed = {run: parse_tag(tag) for run, _, tag in runs}  # bad tags fail before the load
    m = jaxspec.load(a.model, dtype=a.dtype)
    prompts = textdata.make_prompts(m.tokenizer, n=a.B, length=a.P, seed=7)
    warm = textdata.make_prompts(m.tokenizer, n=a.B, length=a.P, seed=99)
    log("loaded", jax.devices()[0].device_kind)
    res = []
    for run, kind, _ in runs:
        spec, kw, flags = parsed[run]
        t = time.time()
        if kind == "gen":
            st = jaxspec.generate(m, prompts, max_new_tokens=a.new, speculation=spec,
                                  ignore_eos=True).stats
            out = {"acc": st.get("acceptance_rate"), "tps": st.get("tokens_per_step"),
                   "rows": str(st.get("tokens_per_step_rows"))}
        else:
            out = serve(a, m, prompts, warm, spec, kw, flags)
        out = {"run": run, **out, "seconds": time.time() - t}
        log(json.dumps(out))
        res.append(out)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        jax.clear_caches()


if __name__ == "__main__":
    main()
