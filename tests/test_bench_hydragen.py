"""The Hydragen sweep (scripts/bench_hydragen.py) and the prefix hooks it uses: prefix levels
padded to a fixed slot count, suffix prefill in row blocks, and un-sharing a prefixed cache give
the same K/V (and tokens) as the plain paths; the --tiny sweep runs end to end on CPU, writes its
files, and sharing does not change greedy tokens (float32)."""

import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.cache import KVCache
from jaxspec.engine import prefill
from jaxspec.model import param_shapes
from jaxspec.prefix import build_prefix, plan_sharing, prefill_shared, unshare_cache

from tiny import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model():
    """A tiny random model drawn on the host (no compiled init)."""
    cfg = tiny_config()
    rng = np.random.default_rng(0)

    def draw(sd):
        return jnp.asarray(rng.standard_normal(sd.shape).astype(np.float32) / 3.0)

    params = jax.tree_util.tree_map(draw, param_shapes(cfg, jnp.float32))
    return jaxspec.Model(config=cfg, params=params)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 64, size=40).tolist()
    return [doc + rng.integers(0, 64, size=k).tolist() for k in (3, 6, 2, 5, 4)]


def _valid(x_LBKSD, lengths):
    return [np.asarray(x_LBKSD[:, b, :, :int(n)]) for b, n in enumerate(np.asarray(lengths))]


def test_prefix_hooks_match_plain_paths(model, prompts):
    cfg, params = model.config, model.params
    rows, share = plan_sharing(prompts, 40)
    plain = build_prefix(cfg, params, share, chunk=16)
    padded = build_prefix(cfg, params, share, chunk=16, slots=64)
    assert padded[0].k.shape[2] == 64 and plain[0].k.shape[2] == 48
    np.testing.assert_array_equal(np.asarray(padded[0].k[:, :, :40]),
                                  np.asarray(plain[0].k[:, :, :40]))
    np.testing.assert_array_equal(np.asarray(padded[0].lengths), [40])
    with pytest.raises(ValueError, match="slots"):
        build_prefix(cfg, params, share, chunk=16, slots=32)

    # suffixes prefilled in blocks of rows [0,2), [2,4), [3,5), then un-shared: each row holds
    # prefix + suffix, the K/V a plain prefill of the whole prompts writes
    blocks = prefill_shared(cfg, params, rows, share, S=128, chunk=16, prefix_levels=padded,
                            row_block=2)
    np.testing.assert_array_equal(np.asarray(blocks.lengths), [len(r) - 41 for r in rows])
    flat = unshare_cache(blocks, 128)
    assert isinstance(flat, KVCache) and not hasattr(flat, "prefix") and flat.max_len == 128
    ref = prefill(cfg, params, KVCache.create(cfg, len(rows), 128, dtype=jnp.float32),
                  [r[:-1] for r in rows], chunk=16)
    np.testing.assert_array_equal(np.asarray(flat.lengths), np.asarray(ref.lengths))
    for a, b in zip(_valid(flat.k, flat.lengths), _valid(ref.k, ref.lengths)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    for a, b in zip(_valid(flat.v, flat.lengths), _valid(ref.v, ref.lengths)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _bench():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_hydragen
    return bench_hydragen


def test_tiny_sweep_end_to_end(tmp_path, monkeypatch):
    out = tmp_path / "hyd"
    # imported long before this call: the time budget counts from main(), not from the import
    monkeypatch.setattr(_bench(), "T_START", _bench().T_START - 10_000)
    # the --tiny grid at one batch size (two compiles fewer), plus a prefix past the context
    _bench().main(["--tiny", "--batch", "4", "--prefix", "48,96,4096", "--out", str(out)])
    res = json.loads((out / "hydragen.json").read_text())
    md = (out / "hydragen.md").read_text()
    assert (out / "hydragen_random-tiny.png").stat().st_size > 1000
    for key in ("device", "jax", "jaxlib", "flax", "python", "date", "command", "copy_Bps"):
        assert key in res["env"], key
    skipped = [r for r in res["rows"] if r["prefix"] == 4096]
    assert skipped and all(r["status"] == "skipped" and "context" in r["error"] for r in skipped)
    rows = [r for r in res["rows"] if r["prefix"] != 4096]
    assert rows and all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    modes = {r["mode"] for r in rows}
    assert modes == {"shared", "nonshared", "spec-g2"}
    assert {(r["batch"], r["prefix"]) for r in rows if r["mode"] == "nonshared"} == \
        {(4, 48), (4, 96)}
    assert any(r.get("exact_slots") for r in rows)
    for r in rows:
        assert r["tok_s"] > 0 and r["ms_per_step"] > 0 and r["steps"] >= 1
        if r["mode"] != "shared":  # sharing (and speculation) keep greedy tokens, float32
            assert r["identical"] is True, r
    goals = res["goals"]["random-tiny"]
    assert "loss" in goals["loss"] and "speedup" in goals["speedup"]
    assert goals["spec"]["spec-g2"]["identical"] is True
    assert "| goal | target | measured | met |" in md and "Decode tokens/s, shared" in md


def test_no_point_starts_after_the_time_budget(tmp_path):
    """Once the time budget is spent every remaining point is a row that says so."""
    sw = _bench().main(["--tiny", "--prefix", "48", "--batch", "2", "--time-budget-s", "0",
                        "--no-plots", "--out", str(tmp_path)])
    assert sw.rows and all(r["status"] == "skipped" and "time budget" in r["error"]
                           for r in sw.rows)
    assert (tmp_path / "hydragen.md").exists()


def test_out_of_memory_points_are_rows(tmp_path, monkeypatch):
    """Out of memory (in the set-up or while un-sharing) is recorded per point and the sweep goes
    on; a non-shared point at a larger batch than one that ran out is predicted out of memory.
    (Run after the end-to-end test it compiles nothing new: the same shapes.)"""
    bh = _bench()
    real = bh.prefill_shared

    def prefill_shared(config, params, rows, *a, **k):
        if len(rows) == 8:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9GiB")
        return real(config, params, rows, *a, **k)

    def unshare_cache(cache, S=None):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 99GiB")

    monkeypatch.setattr(bh, "prefill_shared", prefill_shared)
    monkeypatch.setattr(bh, "unshare_cache", unshare_cache)
    sw = bh.main(["--tiny", "--batch", "4,8", "--prefix", "48,96", "--no-plots",
                  "--out", str(tmp_path)])
    got = {(r["mode"], r["batch"], r["prefix"], bool(r.get("exact_slots"))): r for r in sw.rows}
    assert len(got) == len(sw.rows) == 10
    status = {k: r["status"] for k, r in got.items()}
    for P in (48, 96):
        assert status[("shared", 4, P, False)] == "ok"
        assert status[("nonshared", 4, P, False)] == "oom"
        assert status[("shared", 8, P, False)] == "oom"
        assert got[("shared", 8, P, False)]["error"].startswith("set-up: RuntimeError")
        assert status[("nonshared", 8, P, False)] == "oom"
        assert "predicted" in got[("nonshared", 8, P, False)]["error"]
    assert status[("spec-g2", 4, 96, False)] == "ok" and status[("shared", 4, 48, True)] == "ok"
    saved = json.loads((tmp_path / "hydragen.json").read_text())
    assert len(saved["rows"]) == 10
    assert saved["goals"]["random-tiny"]["speedup"]["nonshared_status"] == "oom"
