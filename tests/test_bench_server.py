"""scripts/bench_server.py on a tiny random model (CPU): the http mode end to end in a subprocess
(off / self / auto speculation, a Poisson rate and a burst), the in-process engine mode with a
prompts file, the metrics arithmetic, and the streaming progress events of a model without a
tokenizer that its TTFT / ITL numbers rest on."""

import asyncio
import gzip
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from tiny import tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_server.py"
sys.path.insert(0, str(ROOT / "scripts"))

import bench_server  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def _check_outputs(out: pathlib.Path, variants, rates):
    res = json.loads((out / "results.json").read_text())
    env = res["environment"]
    for k in ("device", "backend", "jax", "jaxlib", "python", "date", "command", "mode"):
        assert env.get(k), k
    assert [v["variant"] for v in res["variants"]] == variants
    assert all(v["status"] == "ok" and v["compile_s"] > 0 and v["warmup_s"] > 0
               for v in res["variants"]), res["variants"]
    rows = res["rows"]
    assert [(r["variant"], r["rate"]) for r in rows] == [(v, r) for v in variants for r in rates]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["completed"] == r["requests"] > 0 and r["failed"] == r["unfinished"] == 0
        assert r["output_tokens"] == r["requests"] * res["config"]["max_tokens"]  # EOS ignored
        assert r["finish_reasons"] == {"length": r["requests"]}
        assert r["output_tok_s"] > 0 and r["request_throughput"] > 0
        for m in ("ttft_s", "itl_s", "tpot_s", "e2e_s", "chunk_gap_s"):
            assert r[m]["n"] > 0 and 0 < r[m]["p50"] <= r[m]["p99"], (m, r[m])
        assert r["ttft_s"]["p50"] <= r["e2e_s"]["p50"]
        assert r["engine"]["generation_tokens"] == r["output_tokens"]
    md = (out / "results.md").read_text()
    assert "| variant | rate req/s |" in md and env["command"] in md
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "_jobs").exists()
    raw = json.loads(gzip.decompress((out / "requests.json.gz").read_bytes()))
    assert [(p["variant"], p["rate"]) for p in raw] == [(r["variant"], r["rate"]) for r in rows]
    assert all(len(p["records"]) == r["requests"] for p, r in zip(raw, rows))
    return res


def test_http_mode_end_to_end(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--mode", "http",
                        "--variants", "off,self,auto", "--rates", "16,inf", "--out", str(out)],
                       capture_output=True, text=True, timeout=200, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = _check_outputs(out, ["off", "self", "auto"], ["16", "inf"])
    assert res["environment"]["mode"] == "http"
    gammas = {v["variant"]: v["gamma"] for v in res["variants"]}
    assert gammas["off"] == 0 and gammas["self"] == 2 and gammas["auto"] >= 0
    for r in res["rows"]:
        if r["variant"] == "self":
            assert 0 < r["engine"]["acceptance_rate"] <= 1
            assert r["engine"]["tokens_per_target_step"] > 1


def test_engine_mode_with_prompts_file(tmp_path, monkeypatch):
    """In-process engine mode, reached the way a machine with a broken HTTP stack reaches it:
    --mode auto, the http warm-up fails, the variant runs again in engine mode."""
    pytest.importorskip("matplotlib")
    calls = []

    def broken_http(self, reqs, deadline_s):
        calls.append(len(reqs))
        return [], "client subprocess failed (rc=1): simulated"

    monkeypatch.setattr(bench_server.Runner, "_run_http", broken_http)
    # imported long before this call (pytest-xdist collects every module first): the budget
    # counts from main(), not from the import
    monkeypatch.setattr(bench_server, "T_START", bench_server.T_START - 10_000)
    docs = [[(7 * i + j) % 60 + 2 for j in range(50)] for i in range(3)]
    pf = tmp_path / "prompts.json.gz"
    pf.write_bytes(gzip.compress(json.dumps({"prompts": docs}).encode()))
    out = tmp_path / "bench"
    rc = bench_server.main(["--tiny", "--mode", "auto", "--variants", "off", "--rates", "32,inf",
                            "--prompts-file", str(pf), "--prompt-len", "20,30",
                            "--out", str(out)])
    assert rc == 0
    res = _check_outputs(out, ["off"], ["32", "inf"])
    assert res["environment"]["mode"] == "engine"
    if calls:  # fastapi + uvicorn here: http was tried first
        assert len(calls) == 1 and "simulated" in res["mode_note"]
    assert res["config"]["prompt_source"].startswith("file (150 tokens)")


def test_time_budget_skips_and_records():
    # a variant is skipped when too little time is left, never silently dropped
    b = bench_server.Budget(deadline=0.0, n_variants=2)  # the deadline has passed
    assert not b.can_start()


def test_summarize_arithmetic():
    # two requests; tokens arrive in chunks: (t, cumulative n)
    recs = [
        {"status": "ok", "t_send": 0.0, "t_done": 1.0, "prompt_len": 10, "arrival": 0.0,
         "events": [(0.2, 4), (0.6, 8), (1.0, 12)], "n": 12, "finish_reason": "length"},
        {"status": "ok", "t_send": 0.5, "t_done": 2.0, "prompt_len": 20, "arrival": 0.5,
         "events": [(1.0, 2), (2.0, 6)], "n": 6, "finish_reason": "length"},
        {"status": "error", "t_send": 0.5, "t_done": 0.6, "prompt_len": 5, "arrival": 0.5,
         "events": [], "n": 0, "error": "HTTP 503"},
    ]
    row = bench_server.summarize(recs, 2.0, 2.0)
    assert row["completed"] == 2 and row["failed"] == 1 and row["unfinished"] == 0
    assert row["duration_s"] == pytest.approx(2.0)
    assert row["output_tokens"] == 18 and row["output_tok_s"] == pytest.approx(9.0)
    assert sorted(row["errors"]) == ["HTTP 503"]
    assert row["ttft_s"]["mean"] == pytest.approx((0.2 + 0.5) / 2)
    assert row["e2e_s"]["max"] == pytest.approx(1.5)
    # ITL: gaps split over their tokens: 4 x 0.1, 4 x 0.1, 4 x 0.25
    assert row["itl_s"]["n"] == 12 and row["itl_s"]["p50"] == pytest.approx(0.1)
    assert row["chunk_gap_s"]["n"] == 3
    # TPOT: (1.0 - 0.2) / 11 and (2.0 - 1.0) / 5
    assert row["tpot_s"]["max"] == pytest.approx(0.2)


def test_plan_and_warmup_lengths():
    class A:
        requests_per_point, min_requests, point_seconds = 64, 8, 10.0
        prompt_range, max_tokens = (512, 2048), 128
    src = bench_server.PromptSource(None, 1000, seed=0)
    reqs = bench_server.plan_point(4.0, A, src, seed=1)
    assert len(reqs) == 40 and reqs[0]["arrival"] == 0.0
    assert all(b["arrival"] >= a["arrival"] for a, b in zip(reqs, reqs[1:]))
    assert all(512 <= len(r["prompt"]) <= 2048 for r in reqs)
    assert len(bench_server.plan_point(math.inf, A, src, seed=1)) == 64
    # one warm-up prompt per prefill bucket (512, 1024, 2048 padded tokens)
    lens = bench_server.warmup_lengths(512, 2048, 4)
    assert lens[:3] == [512, 514, 1026] and len(lens) == 4


def test_streaming_progress_without_tokenizer():
    """A model without a tokenizer streams no text; its deltas still carry n_tokens per chunk (the
    benchmark's TTFT / ITL depend on them), and the last delta has every token."""
    from jaxspec.serving import SamplingOptions, Sequence, ServingEngine
    model = tiny_model(seed=0, scale=3.0)
    assert model.tokenizer is None
    engine = ServingEngine(model, max_batch=2, max_len=64, rounds_per_chunk=2,
                           prefill_chunk=64).start(variants=[(True, False)])
    try:
        async def go():
            q = asyncio.Queue()
            s = Sequence([3, 4, 5, 6], SamplingOptions(max_tokens=9, temperature=0.0),
                         loop=asyncio.get_running_loop(), queue=q)
            engine.submit([s])
            evs = []
            while not evs or evs[-1]["type"] == "delta":
                evs.append(await q.get())
            return evs

        evs = asyncio.run(go())
    finally:
        engine.stop()
    deltas = [e for e in evs if e["type"] == "delta"]
    done = evs[-1]
    assert done["type"] == "done"
    n = [d["n_tokens"] for d in deltas]
    assert len(n) >= 2 and n == sorted(set(n)) and n[-1] == len(done["token_ids"])
    assert all(d["text"] == "" for d in deltas)
