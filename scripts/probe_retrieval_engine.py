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
import argparse, json, os, time
import jax
import jaxspec
from jaxspec import textdata
from jaxspec.serving import ServingEngine, Sequence, SamplingOptions
ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--model"); ap.add_argument("--P", type=int, default=7680); ap.add_argument("--B", type=int, default=64)
ap.add_argument("--new", type=int, default=128); ap.add_argument("--runs", default="gen:r512,srv:r512")
ap.add_argument("--dtype", default="bfloat16"); ap.add_argument("--stagger", type=float, default=0.02)
ap.add_argument("--out", default=os.environ.get("OUT", "/tmp") + "/retr_gap.json")
a = ap.parse_args()
T0 = time.time()
def log(*x): print(f"[{time.time()-T0:6.1f}]", *x, flush=True)
m = jaxspec.load(a.model, dtype=a.dtype)
prompts = textdata.make_prompts(m.tokenizer, n=a.B, length=a.P, seed=7)
warm = textdata.make_prompts(m.tokenizer, n=a.B, length=a.P, seed=99)
log("loaded", jax.devices()[0].device_kind)
def spec(tag):
    kw = dict(gamma=4, adaptive=False)
    for part in tag.split("-"):
        if part.startswith("r"): R = int(part[1:]); kw.update(retrieve=R, window=496 if R else 1008)
        elif part == "ad": kw["adaptive"] = True
    return jaxspec.Speculation(**kw)
res = []
for run in a.runs.split(","):
    kind, tag = run.split(":")
    opts = dict(p.split("=") for p in tag.split("-") if "=" in p)
    t = time.time()
    if kind == "gen":
        r = jaxspec.generate(m, prompts, max_new_tokens=a.new, speculation=spec(tag), ignore_eos=True)
        st = r.stats
        out = {"run": run, "acc": st.get("acceptance_rate"), "tps": st.get("tokens_per_step"), "rows": str(st.get("tokens_per_step_rows"))}
    else:
        kw = {}
        if "impl" in opts: kw["attn_impl"] = opts["impl"]
        if "rpc" in opts: kw["rounds_per_chunk"] = int(opts["rpc"])
        if "page" in opts: kw.update(page_size=16, kv_blocks=a.B * (a.P + a.new + 64) // 16 + 64)
        eng = ServingEngine(m, max_batch=a.B, max_len=a.P + a.new + 64, speculation=spec(tag.split("-")[0] + ("-ad" if "-ad" in tag else "")), **kw)
        eng.start(variants=[(True, False)])
        m0 = eng.metrics()
        if "nowarm" not in tag:
            ws = [Sequence(p, SamplingOptions(max_tokens=a.new, temperature=0.0)) for p in warm]
            eng.submit(ws)
            for s in ws: s.finished.wait(900)
            m0 = eng.metrics()
        seqs = [Sequence(p, SamplingOptions(max_tokens=a.new, temperature=0.0)) for p in prompts]
        if "burst" in tag: eng.submit(seqs)
        else:
            for s in seqs: eng.submit([s]); time.sleep(a.stagger)
        for s in seqs: s.finished.wait(900)
        m1 = eng.metrics()
        d = lambda k: m1.get(k, 0) - m0.get(k, 0)
        out = {"run": run, "acc": d("draft_accepted") / max(1, d("draft_proposed")),
               "tps": d("generation_tokens") / max(1, d("target_row_steps")),
               "warm_acc": m0.get("acceptance_rate"), "pos_acc": m1.get("position_acceptance")}
        eng.stop(); del eng
    out["seconds"] = time.time() - t
    log(json.dumps(out)); res.append(out)
    json.dump(res, open(a.out, "w"), indent=1)
    jax.clear_caches()
