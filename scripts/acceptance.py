"""Acceptance rates of speculative decoding on real models and long real text.

    python scripts/acceptance.py --model PATH --windows 64,128,256,512,1024 \
        --prompt 1024,2048,4096,8192 --batch 8 --gamma 4 --max-new 128 \
        --prompts-file stream.npy [--draft PATH --draft-windows none,496] --out DIR

For each prompt length the prompts (windows of a long public-domain text, like PG-19 in MagicDec)
are prefilled once; self-speculation runs for every StreamingLLM window (sink fixed), and a draft
model for every draft window (``none`` = full cache). Greedy; the reported numbers:
acceptance (accepted / proposed drafts), tokens per target step (committed / row-steps, the bonus
token included), the per-token acceptance alpha that explains them (sum_{i<=gamma} alpha^i =
accepted per row-step) and whether the tokens equal greedy autoregressive decoding.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jaxspec  # noqa: E402
from jaxspec import engine, speculative  # noqa: E402
from benchmark import cut_prompts, environment, load_model, token_stream, _ints  # noqa: E402


def run(a, log=print):
    env = environment()
    model = load_model(a.model, dtype=a.dtype)
    draft = load_model(a.draft, dtype=a.dtype) if a.draft else None
    stream = token_stream(a.prompts_file, model.config.vocab_size)
    variants = [(f"self w{w}", jaxspec.Speculation("self", gamma=a.gamma, sink=a.sink, window=w))
                for w in _ints(a.windows)]
    if draft is not None:
        for w in a.draft_windows.split(","):
            dw = None if w.strip() in ("none", "") else int(w)
            variants.append((f"draft {'full' if dw is None else f'ring{dw}'}",
                             jaxspec.Speculation(draft, gamma=a.gamma, sink=a.sink, window=dw)))
    rows = []
    out = pathlib.Path(a.out)
    deadline = time.time() + a.time_budget_s
    for P in _ints(a.prompt):
        if time.time() > deadline:
            rows.append({"prompt": P, "skipped": "time budget"})
            continue
        prompts = cut_prompts(stream, a.batch, P, seed=P)
        t = time.perf_counter()
        S = engine.round_up(max(_ints(a.prompt)) + a.max_new + a.gamma + 64, 128)  # one shape
        prep = engine.prepare(model, prompts, max_new_tokens=a.max_new, max_len=S,
                              attn_impl=a.impl)
        loop = engine.DecodeLoop(config=model.config, stop_ids=prep.stop_ids, impl=a.impl)
        final = engine._run_loop(model.decode_params(), prep.sp, prep.fresh_state(extra=1),
                                 loop=loop)
        n = np.asarray(final.n_out)
        ref = [np.asarray(final.out)[i, :n[i]].tolist() for i in range(prep.n_real)]
        cache = final.cache
        log(f"P={P}: prefill + autoregressive {time.perf_counter() - t:.1f} s")
        for name, spec in variants:
            try:
                runner = speculative.prepare_speculation(spec, model, prep.token_lists, a.max_new)
                st = prep.fresh_state(cache, extra=runner.extra_slots)
                fin, stats = runner.run(model, prep.sp, st, stop_ids=prep.stop_ids, impl=a.impl)
                cache = fin.cache
                n = np.asarray(fin.n_out)
                toks = [np.asarray(fin.out)[i, :n[i]].tolist() for i in range(prep.n_real)]
                acc = stats["acceptance_rate"]
                row = {"prompt": P, "variant": name, "window": spec.window, "sink": spec.sink,
                       "gamma": a.gamma, "acceptance": acc,
                       "tokens_per_step": stats["tokens_per_step"],
                       "alpha": speculative.per_token_acceptance(acc * a.gamma, a.gamma),
                       "identical_rows": float(np.mean([x == y for x, y in zip(toks, ref)]))}
            except Exception as e:  # noqa: BLE001 - record and go on
                row = {"prompt": P, "variant": name, "error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            log("  " + json.dumps(row))
        write(out, a, env, rows)
    return rows


def write(out: pathlib.Path, a, env, rows):
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance.json").write_text(json.dumps({"env": env, "args": vars(a), "rows": rows},
                                                    indent=1, default=str))
    ok = [r for r in rows if "acceptance" in r]
    prompts = sorted({r["prompt"] for r in ok})
    names = list(dict.fromkeys(r["variant"] for r in ok))
    cell = {(r["variant"], r["prompt"]): r for r in ok}
    lines = [f"# Acceptance: {a.model}" + (f" (draft {a.draft})" if a.draft else ""), "",
             f"device {env['device']}, jax {env['jax']}, {env['date']}; greedy, gamma {a.gamma}, "
             f"sink {a.sink}, batch {a.batch}, {a.max_new} new tokens, {a.dtype}", "",
             f"command: `{env['command']}`", "",
             "Each cell: acceptance (accepted / proposed drafts) / tokens per target step "
             "(bonus token included) / rows identical to greedy autoregressive decoding.", "",
             "| variant | " + " | ".join(f"prompt {p}" for p in prompts) + " |",
             "|---|" + "---|" * len(prompts)]
    for n in names:
        cells = []
        for p in prompts:
            r = cell.get((n, p))
            cells.append("" if r is None else
                         f"{r['acceptance']:.2f} / {r['tokens_per_step']:.2f} / "
                         f"{r['identical_rows']:.2f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"\n- prompt {r['prompt']} {r.get('variant', '')}: "
                         f"{r.get('error', r.get('skipped'))}")
    (out / "acceptance.md").write_text("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--draft-windows", default="none")
    ap.add_argument("--windows", default="64,128,256,512,1024")
    ap.add_argument("--prompt", default="1024,2048,4096,8192")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--prompts-file", default=None)
    ap.add_argument("--time-budget-s", type=float, default=1e9)
    ap.add_argument("--out", default="benchmarks/acceptance")
    a = ap.parse_args(argv)
    print(json.dumps(environment()), flush=True)
    run(a, log=lambda *x: print(*x, flush=True))
    print((pathlib.Path(a.out) / "acceptance.md").read_text())


if __name__ == "__main__":
    main()
