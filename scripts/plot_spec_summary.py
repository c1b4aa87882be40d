"""One plot of `gamma="auto"` against autoregressive decoding over several benchmark runs
(`scripts/benchmark.py speculative` JSON files): steady and completion speedup vs batch size, one
line per prompt length. A point measured in several files is taken from the last file given.

    python scripts/plot_spec_summary.py OUT.png RUN1.json RUN2.json ... [--variant "self auto"]
"""
import argparse
import json
import pathlib


def collect(paths, variant):
    pts = {}
    for p in paths:
        for r in json.loads(pathlib.Path(p).read_text())["rows"]:
            if r.get("variant") == variant and "speedup" in r:
                pts[(r["batch"], r["prompt"])] = (r["steady_speedup"], r["speedup"],
                                                  pathlib.Path(p).name)
    return pts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--variant", default="self auto")
    a = ap.parse_args()
    pts = collect(a.runs, a.variant)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, idx, title in ((axes[0], 0, "steady (continuous batching)"),
                           (axes[1], 1, "completion (every row 128 tokens)")):
        for P in sorted({p for _, p in pts}):
            bs = sorted(b for b, p in pts if p == P)
            ax.plot(bs, [pts[(b, P)][idx] for b in bs], "o-", label=f"prompt {P}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(2.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title)
    axes[0].set_ylabel(f"speedup of '{a.variant}' over autoregressive")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("| batch | prompt | steady | completion | file |\n|---|---|---|---|---|")
    for (b, p), (s, c, f) in sorted(pts.items()):
        print(f"| {b} | {p} | {s:.2f} | {c:.2f} | `{f}` |")


if __name__ == "__main__":
    main()
