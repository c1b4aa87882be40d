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


def test_bench_arguments_refused_before_the_model_loads(monkeypatch, capsys, tmp_path):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(bench, "load_model", refuse)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    base = ["--model", "tiny", "--points", "1x16", "--new", "2"]
    cases = {"--points": ["--points", "64x"], "--points ": ["--points", "0x16"],
             "--seeds": ["--seeds", ""], "--variants": ["--variants", "plain,g2,g2"],
             "--variants ": ["--variants", "bogus"], "--sources": ["--sources", "nope"],
             "--new": ["--new", "0"], "--time-budget-s": ["--time-budget-s", "0"],
             "--out": ["--out", str(a_file)]}
    for flag, extra in cases.items():
        with pytest.raises(SystemExit) as e:
            main(["bench", "generate", *base, *extra])
        assert e.value.code == 2 and flag.strip() in capsys.readouterr().err, extra
    for extra in (["--gammas", ""], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            main(["bench", "steps", "--model", "tiny", "--points", "1x16", *extra])
        assert extra[0] in capsys.readouterr().err


def test_bench_generate_records_failures_skips_and_interrupts(monkeypatch, tmp_path):
    """A variant that fails on a later seed: the speedups compare only the seeds every variant
    finished, and the error is in the table; points past the time budget are listed as
    skipped; a Ctrl-C leaves files that say the run was interrupted."""
    import jaxspec
    real = jaxspec.generate
    calls = []

    def flaky(model, prompts, **kw):
        calls.append(kw.get("speculation"))
        # warm-up: 2 calls, then seed 1: 2 calls; the speculative run of seed 2 fails
        if len(calls) > 4 and kw.get("speculation") is not None:
            raise RuntimeError("out of memory (test)")
        return real(model, prompts, **kw)
    monkeypatch.setattr(jaxspec, "generate", flaky)
    argv = ["bench", "generate", "--model", "tiny", "--points", "2x16", "--new", "3",
            "--seeds", "1,2", "--variants", "plain,g2-w8-fixed", "--sources", "random",
            "--ignore-eos", "--out", str(tmp_path), "--name", "f"]
    main(argv)
    out = json.loads((tmp_path / "f.json").read_text())
    p = out["points"][0]
    assert out["status"] == "complete" and "out of memory" in p["error"]
    assert p["summary_seeds"] == [1]
    plain1 = next(r for r in p["runs"]["plain"] if r["seed"] == 1)
    assert p["summary"]["plain"]["decode_seconds"] == pytest.approx(plain1["decode_seconds"])
    assert "out of memory" in (tmp_path / "f.md").read_text()
    monkeypatch.setattr(jaxspec, "generate", real)
    main([*argv[:4], "--points", "2x16,2x24", *argv[6:-1], "skip", "--time-budget-s", "1e-9"])
    out = json.loads((tmp_path / "skip.json").read_text())
    assert {(k["batch"], k["prompt"]) for k in out["skipped"]} == {(2, 16), (2, 24)}
    assert "skipped: time budget spent" in (tmp_path / "skip.md").read_text()

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(jaxspec, "generate", interrupted)
    with pytest.raises(SystemExit) as e:  # (the CLI exits 130 on a Ctrl-C)
        main([*argv[:-1], "int"])
    assert e.value.code == 130
    out = json.loads((tmp_path / "int.json").read_text())
    assert out["status"] == "interrupted"
    assert "INTERRUPTED" in (tmp_path / "int.md").read_text()
