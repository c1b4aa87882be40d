"""Batch invariance through the public API: a prompt's greedy tokens alone, in a smaller batch,
in another order, and with every speculation kind, against the same prompts in one batch, with
and without ``batch_invariant=True``; and what the invariant numerics cost.

``--part plain``: invariant plain decoding at the full batch (timed after a warm-up call) against
the first half, one row alone and the batch in another order (rows 32..63 first, then 31..0
reversed: other neighbours and positions for every row); then default plain decoding at the full
batch (timed) and the first half. ``--part speculation``: invariant plain decoding against an
invariant token tree, with ``--draft`` an invariant chain of that draft model, and invariant
`Speculation()` (a chain with adaptive rounds, timed after a warm-up call); then default
`Speculation()` (timed). Rows run to the full budget (``ignore_eos``). The equality runs come
first, the default-path ones (contrast and cost) last.

Prints one JSON line per call and the row counts that match, and writes
``--out``/invariance_<part>.json after every call, with a hash of each prompt's tokens; rows are
compared by those hashes. ``--resume`` keeps the runs already in that file (same settings) and
does only the rest, so a run cut short (a time limit) goes on where it stopped.

    python scripts/bench_batch_invariance.py --model checkpoints/qwen2.5-coder-1.5b-instruct \\
        --batch 64 --prompt 16384 --new 256 --part plain
"""
import argparse
import hashlib
import json
import os
import time

import jax

import jaxspec
from jaxspec import textdata


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=64, help="rows of the full batch (even, >= 2)")
    p.add_argument("--prompt", type=int, default=16384, help="prompt length in tokens")
    p.add_argument("--new", type=int, default=256, help="new tokens per row")
    p.add_argument("--source", default="shakespeare", help="a jaxspec.textdata source")
    p.add_argument("--seed", type=int, default=7, help="prompt seed")
    p.add_argument("--tree", default="2,2,1,1", help="the tree's expansion config")
    p.add_argument("--draft", default=None,
                   help="a draft model checkpoint (same tokenizer) for --part speculation")
    p.add_argument("--part", choices=("plain", "speculation"), default="plain")
    p.add_argument("--out", default=".")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already in --out/invariance_<part>.json; do the rest")
    a = p.parse_args()
    if a.batch < 2 or a.batch % 2:
        p.error("--batch must be even and at least 2")
    model = jaxspec.load(a.model)
    draft = jaxspec.load(a.draft) if a.draft else None
    prompts = textdata.make_prompts(model.tokenizer, n=a.batch, length=a.prompt, seed=a.seed,
                                    source=a.source)
    settings = {"model": os.path.basename(os.path.normpath(a.model)), "batch": a.batch,
                "prompt": a.prompt, "new": a.new, "source": a.source,
                "seed": a.seed, "part": a.part, "tree": a.tree,
                "draft": os.path.basename(os.path.normpath(a.draft)) if a.draft else None}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"invariance_{a.part}.json")
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, **settings,
           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "runs": {}}
    if a.resume and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        differ = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if differ:
            p.error(f"--resume: {path} was written with other settings: {differ}")
        out["runs"] = old.get("runs", {})
        print("resuming; kept", ", ".join(out["runs"]) or "nothing", flush=True)

    def save():
        with open(path, "w") as f:
            json.dump(out, f, indent=1)

    def run(name, rows, spec=None, invariant=False, timed=True):
        """Per-row token hashes of ``rows``' prompts; with ``timed`` a warm-up call first."""
        if name not in out["runs"]:
            ps = [prompts[i] for i in rows]
            kw = dict(max_new_tokens=a.new, speculation=spec, ignore_eos=True,
                      batch_invariant=invariant)
            if timed:
                jaxspec.generate(model, ps, **kw)
            t = time.perf_counter()
            res = jaxspec.generate(model, ps, **kw)
            rec = {k: res.stats.get(k) for k in (
                "decode_seconds", "seconds", "prefill_seconds", "compile_seconds",
                "acceptance_rate", "tokens_per_step", "plain_steps", "target_steps")}
            out["runs"][name] = rec | {
                "wall": time.perf_counter() - t, "rows": len(ps), "timed_after_warmup": timed,
                # each prompt's tokens, hashed: rows are compared by these
                "row_sha1": {str(i): hashlib.sha1(
                    json.dumps(list(map(int, tk))).encode()).hexdigest()[:16]
                    for i, tk in zip(rows, res.tokens)}}
            print(name, json.dumps(out["runs"][name]), flush=True)
            save()
        return out["runs"][name]["row_sha1"]

    def equal(a_, b_):
        return sum(a_[i] == b_[i] for i in a_)

    full, half = list(range(a.batch)), list(range(a.batch // 2))
    if a.part == "plain":
        ref = run("invariant_plain", full, invariant=True)
        inv_half = run("invariant_plain_half", half, invariant=True, timed=False)
        one = [min(5, a.batch - 1)]
        inv_one = run("invariant_plain_one", one, invariant=True, timed=False)
        perm = list(range(a.batch // 2, a.batch)) + half[::-1]
        inv_perm = run("invariant_plain_reordered", perm, invariant=True, timed=False)
        plain = run("plain", full)
        plain_half = run("plain_half", half, timed=False)
        out["rows_equal"] = {
            "invariant_half_vs_invariant": [equal(inv_half, ref), len(half)],
            "invariant_one_vs_invariant": [equal(inv_one, ref), 1],
            "invariant_reordered_vs_invariant": [equal(inv_perm, ref), a.batch],
            "plain_half_vs_plain": [equal(plain_half, plain), len(half)],
            "plain_vs_invariant": [equal(plain, ref), a.batch]}
    else:
        tree = tuple(int(x) for x in a.tree.split(","))
        ref = run("invariant_plain", full, invariant=True, timed=False)
        eq = {}
        inv_tree = run("invariant_tree", full, spec=jaxspec.Speculation(tree=tree),
                       invariant=True, timed=False)
        eq["invariant_tree_vs_invariant_plain"] = [equal(inv_tree, ref), a.batch]
        if draft is not None:
            inv_draft = run("invariant_draft_model", full, spec=jaxspec.Speculation(draft=draft),
                            invariant=True, timed=False)
            eq["invariant_draft_model_vs_invariant_plain"] = [equal(inv_draft, ref), a.batch]
        inv_default = run("invariant_speculation", full, spec=jaxspec.Speculation(),
                          invariant=True)
        eq["invariant_speculation_vs_invariant_plain"] = [equal(inv_default, ref), a.batch]
        default = run("speculation", full, spec=jaxspec.Speculation())
        eq["speculation_vs_invariant_plain"] = [equal(default, ref), a.batch]
        out["rows_equal"] = eq
    print("rows equal", json.dumps(out["rows_equal"]), flush=True)
    save()


if __name__ == "__main__":
    main()
