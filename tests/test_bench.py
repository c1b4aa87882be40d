"""`jaxspec bench generate / steps`: the floors they price a point against, and a run of each
through the CLI on a tiny random model (the README's commands)."""

import json

import jax
import numpy as np
import pytest

from jaxspec import bench
from jaxspec.cache import kv_bytes_per_token
from jaxspec.cli import main

from tiny import tiny_model


def _nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("tied", [False, True])
def test_floors_count_what_a_step_reads(tied):
    """An untied embedding table is looked up (a few rows), not read whole nor multiplied: the
    floors leave it out; a tied one is the LM head and counts. Keys: K and V of every layer."""
    m = tiny_model(seed=1, vocab=96, layers=3, tie_word_embeddings=tied)
    if not tied:
        m.params = dict(m.params, lm_head=m.params["embed"].T * 1.0)
    rng = np.random.default_rng(0)
    bw, mm = float(rng.uniform(1e9, 1e12)), float(rng.uniform(1e15, 1e16))
    f = bench.Floors.of(m, bw, mm)
    want = _nbytes(m.params) - (0 if tied else m.params["embed"].size * m.params["embed"].dtype.itemsize)
    assert f.weight_bytes == want
    assert f.kv_bytes == kv_bytes_per_token(m.config, m.dtype)
    ctx = rng.integers(1, 500, size=5).astype(float)
    # a plain step: the weights once, every context key and the new token's
    assert f.plain_step(ctx) == pytest.approx((want + f.kv_bytes * (ctx.sum() + 5)) / bw)
    # a round: gamma drafts over at most `span` keys per row (plus the drafts so far), a verify
    span, g = 64, 3
    seen = np.minimum(ctx, span).sum()
    drafts = sum((want + f.kv_bytes * (seen + 5 * (i + 1))) / bw for i in range(g))
    verify = max((want + f.kv_bytes * (ctx.sum() + 5 * (g + 1))) / bw,
                 2 * f.params * 5 * (g + 1) / mm)
    assert f.round(ctx, g, span) == pytest.approx(drafts + verify)
    assert f.round(ctx, g, None) > f.round(ctx, g, span)


def test_read_bandwidth_is_measured():
    bw = bench.measure_read_bandwidth(slices=2)
    assert np.isfinite(bw) and bw > 1e8


def test_bench_commands_run(tmp_path):
    """`jaxspec bench generate` and `jaxspec bench steps` on a tiny random model: results
    written, floors below the measured times, speculative greedy rows equal plain ones."""
    main(["bench", "generate", "--model", "tiny", "--points", "2x24", "--new", "6", "--seeds",
          "1", "--variants", "plain,g2-w8-fixed", "--sources", "random", "--ignore-eos",
          "--out", str(tmp_path), "--name", "g"])
    out = json.loads((tmp_path / "g.json").read_text())
    p = out["points"][0]
    assert 0 < p["plain_floor_seconds"] < p["summary"]["plain"]["decode_seconds"]
    assert p["summary"]["g2-w8-fixed"]["rows_equal_plain"] == 2
    assert out["read_bandwidth"] > 0 and "floor" in (tmp_path / "g.md").read_text()
    main(["bench", "steps", "--model", "tiny", "--points", "2x48", "--gammas", "1,2",
          "--rounds", "2", "--repeats", "1", "--window", "16", "--out", str(tmp_path),
          "--name", "s"])
    s = json.loads((tmp_path / "s.json").read_text())["points"][0]
    assert 0 < s["plain_floor_ms"] < s["plain_ms"]
    assert all(0 < r["floor_ms"] < r["ms"] for r in s["rounds"].values())
    assert "draft_step_ms" in s and "| 2 x 48 |" in (tmp_path / "s.md").read_text()
