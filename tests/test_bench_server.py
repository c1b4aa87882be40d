"""``jaxspec bench server`` (`jaxspec.bench_server`) on a tiny random model (CPU): a run of two
variants over HTTP completes, its report has every field, each variant's greedy outputs are the
tokens `jaxspec.generate` returns for the same prompts, and the numbers are sane; the statistics
are checked against hand-computed values; bad arguments are refused by name."""

import argparse
import json
import math
import sys

import numpy as np
import pytest

import jaxspec
from jaxspec import bench_server
from serverkit import served_model

pytestmark = pytest.mark.timeout(300)

ARGV = ["--variants", "off,g2-s4-w16-fixed", "--rates", "inf",
        "--requests", "6", "--max-batch", "4", "--prompt", "8-40", "--new", "12",
        "--source", "random", "--seed", "3", "--check", "6", "--warmup", "0"]


def _args(argv):
    """``jaxspec bench server ARGV`` parsed by the subcommand's own arguments."""
    p = argparse.ArgumentParser(prog="jaxspec bench")
    bench_server.add_arguments(p.add_subparsers(dest="bench_cmd", required=True))
    return p.parse_args(["server"] + argv)


def _pct_ok(d, n=None):
    assert d["n"] > 0 if n is None else d["n"] == n, d
    assert 0 < d["p50"] <= d["p90"] <= d["p99"] <= d["max"], d


def test_two_variants_over_http(tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    model = served_model(seed=5)  # a tokenizer and an EOS: completions may stop early
    argv = ARGV + ["--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", ["jaxspec", "bench", "server"] + argv)
    args = _args(argv)
    out = bench_server.bench_server(args, model=model)

    saved = json.loads((tmp_path / "server.json").read_text())
    md = (tmp_path / "server.md").read_text()
    assert saved["status"] == out["status"] == "complete" and "INTERRUPTED" not in md
    assert saved["points"] == json.loads(json.dumps(out["points"]))
    for key in ("device", "devices", "backend", "jax", "flax", "python", "date", "command"):
        assert saved["env"][key] not in (None, ""), key
    assert saved["env"]["command"] == "jaxspec bench server " + " ".join(argv)
    assert f"`{saved['env']['command']}`" in md
    assert "| variant | gamma | rate req/s |" in md and "Speedups vs `off`" in md

    # the prompts, drawn independently of the run with the same seed and lengths
    prompts = bench_server.plan_requests(model, 6, 8, 40, 3, "random")
    lengths = [len(p) for p in prompts]
    assert all(8 <= n <= 40 for n in lengths) and len(set(lengths)) > 1
    ref = jaxspec.generate(model, prompts, max_new_tokens=12)  # greedy, stops at EOS

    assert [(p["variant"], p["rate"]) for p in out["points"]] == \
        [("off", "inf"), ("g2-s4-w16-fixed", "inf")]
    assert out["servers"]["off"]["gamma"] == 0 and out["servers"]["g2-s4-w16-fixed"]["gamma"] == 2
    for p in out["points"]:
        assert p["status"] == "ok" and p["completed"] == p["requests"] == 6, p
        assert p["failed"] == p["unfinished"] == 0
        # greedy outputs: exactly generate's, for every request of every variant
        assert p["outputs"] == ref.tokens, p["variant"]
        assert p["rows_equal_generate"] == p["rows_checked"] == 6
        assert p["output_tokens"] == sum(len(t) for t in ref.tokens)
        stops = sum(bool(t) and t[-1] == 1 for t in ref.tokens)
        assert p["finish_reasons"] == {k: v for k, v in
                                       (("stop", stops), ("length", 6 - stops)) if v}
        assert p["duration_s"] > 0
        assert p["request_throughput"] == pytest.approx(6 / p["duration_s"])
        assert p["output_tok_s"] == pytest.approx(p["output_tokens"] / p["duration_s"])
        _pct_ok(p["ttft_s"], 6)
        _pct_ok(p["e2e_s"], 6)
        assert p["ttft_s"]["p99"] <= p["e2e_s"]["p99"] and p["ttft_s"]["p50"] <= p["e2e_s"]["p50"]
        assert sorted(r["prompt_tokens"] for r in p["per_request"]) == sorted(lengths)
        assert sorted(r["tokens"] for r in p["per_request"]) == \
            sorted(len(t) for t in ref.tokens)
        for r in p["per_request"]:
            assert 0 < r["ttft_s"] <= r["e2e_s"] < p["duration_s"] + 1e-9
        if p["itl_s"]["n"]:  # tokens that came after the first event, one value per token
            _pct_ok(p["itl_s"])
            assert p["itl_s"]["n"] <= p["output_tokens"] - 6
        s = p["server"]  # from the server's /metrics over the point
        assert s["generation_tokens"] == p["output_tokens"]
        assert s["decode_seconds"] > 0 and s["decode_tok_s"] > 0
        if p["variant"] == "off":
            assert s["acceptance_rate"] is None and s["draft_proposed"] == 0
            assert s["tokens_per_target_step"] == 1.0
        else:
            assert 0 <= s["acceptance_rate"] <= 1 and s["draft_proposed"] > 0
            assert 1.0 <= s["tokens_per_target_step"] <= 3.0

    r = out["reference"]
    assert r["batch"] == 4 and r["new_tokens"] == 4 * 12  # fixed length
    assert r["decode_tok_s"] == pytest.approx(r["new_tokens"] / r["decode_seconds"])
    assert 0 < r["decode_seconds"] < r["seconds"]
    off, spec = out["points"]
    (sp,) = out["speedups"]
    assert sp["variant"] == "g2-s4-w16-fixed" and sp["rate"] == "inf"
    assert sp["output_tok_s"] == pytest.approx(spec["output_tok_s"] / off["output_tok_s"])
    assert sp["e2e_p50"] == pytest.approx(off["e2e_s"]["p50"] / spec["e2e_s"]["p50"])
    v = out["verdict"]
    assert v["rate"] == "inf" and v["reference_decode_tok_s"] == r["decode_tok_s"]
    assert v["decode_ratio"] == pytest.approx(off["server"]["decode_tok_s"] / r["decode_tok_s"])
    assert v["within"] == (v["decode_ratio"] >= 0.9)
    assert ("within 10%" in md) and f"{r['decode_tok_s']:.1f} tok/s" in md


def test_statistics_by_hand():
    # two requests: (time, tokens so far) per event; a third failed, a fourth never finished
    recs = [
        {"status": "ok", "t_send": 0.0, "t_done": 1.1, "events": [[0.2, 4], [0.6, 8], [1.0, 12]],
         "finish_reason": "length", "prompt_tokens": 10, "error": None},
        {"status": "ok", "t_send": 0.5, "t_done": 2.0, "events": [[1.0, 2], [2.0, 6]],
         "finish_reason": "stop", "prompt_tokens": 20, "error": None},
        {"status": "error", "t_send": 0.5, "t_done": None, "events": [], "finish_reason": None,
         "error": "HTTP 503: full"},
        {"status": "unfinished", "t_send": 0.7, "t_done": None, "events": [[0.9, 1]],
         "finish_reason": None, "error": None},
    ]
    s = bench_server.summarize(recs)
    assert (s["requests"], s["completed"], s["failed"], s["unfinished"]) == (4, 2, 1, 1)
    assert s["errors"] == ["HTTP 503: full"]
    assert s["duration_s"] == pytest.approx(2.0) and s["output_tokens"] == 18
    assert s["output_tok_s"] == pytest.approx(9.0) and s["request_throughput"] == pytest.approx(1)
    assert sorted([s["ttft_s"]["p50"], s["ttft_s"]["max"]]) == pytest.approx([0.35, 0.5])
    assert s["e2e_s"]["mean"] == pytest.approx((1.1 + 1.5) / 2)
    # ITL: 4 tokens x 0.1, 4 x 0.1, 4 x 0.25
    itl = np.array([0.1] * 8 + [0.25] * 4)
    assert s["itl_s"]["n"] == 12 and s["itl_s"]["mean"] == pytest.approx(itl.mean())
    assert s["itl_s"]["p90"] == pytest.approx(np.percentile(itl, 90))
    assert s["chunk_gap_s"]["n"] == 3 and s["chunk_gap_s"]["max"] == pytest.approx(1.0)
    # TPOT: (1.1 - 0.2) / 11 and (1.5 - 0.5) / 5
    assert s["tpot_s"]["max"] == pytest.approx(0.2)
    assert s["tpot_s"]["mean"] == pytest.approx((0.9 / 11 + 0.2) / 2)
    assert s["finish_reasons"] == {"length": 1, "stop": 1}

    m0 = bench_server.parse_metrics(
        "# HELP x\njaxspec_generation_tokens_total 10\njaxspec_target_steps_total 10\n"
        "jaxspec_draft_tokens_proposed_total 0\njaxspec_decode_seconds_total 1.5\n"
        'jaxspec_model_info{model="m",gamma="3"} 1\n')
    m1 = dict(m0, **{"jaxspec_generation_tokens_total": 70.0,
                     "jaxspec_target_steps_total": 30.0,
                     "jaxspec_draft_tokens_proposed_total": 60.0,
                     "jaxspec_draft_tokens_accepted_total": 45.0,
                     "jaxspec_decode_seconds_total": 2.5,
                     'jaxspec_draft_position_proposed_total{position="1"}': 20.0,
                     'jaxspec_draft_position_proposed_total{position="2"}': 20.0,
                     'jaxspec_draft_position_accepted_total{position="1"}': 18.0,
                     'jaxspec_draft_position_accepted_total{position="2"}': 15.0})
    d = bench_server.server_delta(m0, m1)
    assert d["acceptance_rate"] == 0.75 and d["tokens_per_target_step"] == 3.0
    assert d["position_acceptance"] == [0.9, 0.75]
    m2 = dict(m1, **{'jaxspec_draft_position_proposed_total{position="1"}': 30.0,
                     'jaxspec_draft_position_accepted_total{position="1"}': 23.0})
    assert bench_server.server_delta(m1, m2)["position_acceptance"] == [0.5, None]
    assert d["decode_tok_s"] == 60.0 and bench_server.served_gamma(m1) == 3


def test_arrivals_and_lengths():
    assert bench_server.arrival_times(5, math.inf, 0) == [0.0] * 5
    a = np.array(bench_server.arrival_times(20000, 4.0, 1))
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    gaps = np.diff(a)  # exponential, mean 1/4 and standard deviation 1/4
    assert abs(gaps.mean() - 0.25) < 4 * 0.25 / math.sqrt(gaps.size)
    assert abs(np.median(gaps) - 0.25 * math.log(2)) < 0.01
    assert bench_server.arrival_times(50, 2.0, 7) == bench_server.arrival_times(50, 2.0, 7)
    assert bench_server.parse_rates("inf,4,0.5") == [math.inf, 4.0, 0.5]
    for twice in ("inf,inf", "8,8.0"):  # (one of the two points was dropped from the speedups)
        with pytest.raises(ValueError, match="distinct"):
            bench_server.parse_rates(twice)
    assert bench_server.parse_lengths("16384") == (16384, 16384)
    assert bench_server.parse_lengths("8192-32768") == (8192, 32768)
    assert bench_server.parse_lengths("1024~32768") == (1024, 32768)
    assert bench_server.length_spread("1024~32768") == "log"
    assert bench_server.length_spread("8192-32768") == "uniform"
    # log-uniform: as many lengths in each octave; uniform: as many in each equal interval
    seed = int(np.random.default_rng().integers(1 << 30))
    lg = bench_server.draw_lengths(20000, 1024, 32767, seed, "log")
    un = bench_server.draw_lengths(20000, 1024, 32767, seed, "uniform")
    assert lg.min() >= 1024 and lg.max() <= 32767 and un.min() >= 1024 and un.max() <= 32767
    for lo in (1024, 2048, 4096, 8192, 16384):  # 5 octaves, a fifth each
        frac = np.mean((lg >= lo) & (lg < 2 * lo))
        assert abs(frac - 0.2) < 4 * math.sqrt(0.2 * 0.8 / lg.size), (lo, frac)
    assert abs(np.mean(un < 16896) - 0.5) < 0.015
    assert np.array_equal(lg, bench_server.draw_lengths(20000, 1024, 32767, seed, "log"))
    assert bench_server.warmup_lengths(8, 40) == [8, 16, 32, 40]
    assert bench_server.warmup_lengths(100, 100) == [100]
    gap = bench_server.WARMUP_SPACING_S
    assert gap > 0
    assert bench_server.warmup_requests(10, 3, staggered=True) == [
        {"prompt": 10, "arrival": 0.0}, {"prompt": 11, "arrival": gap},
        {"prompt": 12, "arrival": 2 * gap}]
    assert bench_server.warmup_requests(4, 2, staggered=False) == [
        {"prompt": 4, "arrival": 0.0}, {"prompt": 5, "arrival": 0.0}]


def test_warmup_plan_runs_the_shortest_alone_then_all_staggered():
    """Independent prompts: the shortest warm-up prompt runs alone (the programs' first runs),
    then one per prefill length bucket arrives `WARMUP_SPACING_S` apart, shortest first (each
    later prefill finds the earlier ones decoding); shared-doc: the document once, then the rest
    at once."""
    args = _args(SHARED_ARGV)
    bench_server.check_args(args, has_draft=False)
    doc, ind = bench_server._workloads(args, served_model(seed=7, eos=False))
    lens = bench_server.warmup_lengths(8, 40)
    assert [len(p) for p in ind["warm"]] == [8] + lens and ind["warm"][0] == ind["warm"][1]
    assert ind["waves"] == [1, len(lens)] and ind["prime"] is None
    assert doc["waves"] == [1, len(doc["warm"]) - 1] and doc["prime"] is not None


@pytest.mark.parametrize("extra, flag", [
    (["--rates", "inf,0"], "--rates"), (["--rates", "fast"], "--rates"),
    (["--prompt", "40-8"], "--prompt"), (["--prompt", "x"], "--prompt"),
    (["--requests", "0"], "--requests"), (["--variants", "off,g4-bogus"], "--variants"),
    (["--variants", "off,draft"], "--variants"), (["--check", "-1"], "--check"),
    (["--servers", "dense,sparse"], "--servers"), (["--servers", "paged8-big"], "--servers"),
    (["--servers", "dense,dense"], "--servers"), (["--servers", "paged0"], "--servers"),
    (["--workload", "shared-doc", "--prompt", "8-40"], "--prompt"),
    (["--workload", "shared-doc", "--question", "0"], "--question"),
    (["--workload", "shared-doc,bogus"], "--workload"), (["--workload", ""], "--workload"),
    (["--workload", "shared-doc", "--doc", "0"], "--doc"),
    (["--seed", "5,5"], "--seed"), (["--seed", "5,x"], "--seed"), (["--short", "1"], "--short"),
])
def test_bad_arguments_named(extra, flag):
    # refused by name before the (missing) model is loaded
    with pytest.raises(ValueError, match=flag):
        bench_server.bench_server(_args(["--model", "no-such-checkpoint"] + extra))


SHARED_ARGV = ["--servers", "dense,paged8", "--workload", "shared-doc,independent",
               "--variants", "off", "--rates", "inf", "--requests", "5", "--max-batch", "4",
               "--doc", "44", "--question", "6", "--prompt", "8-40", "--new", "10",
               "--source", "random", "--seed", "3", "--check", "5", "--warmup", "0"]


@pytest.fixture(scope="module")
def shared_doc_run(tmp_path_factory):
    """One run of two server setups (dense, paged with pages of 8), each on two workloads: 5
    requests of the same 44-token document and their own 6-token questions, then 5 independent
    prompts of 8-40 tokens."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    model = served_model(seed=7, eos=False)  # no stop token: every row runs to --new
    d = tmp_path_factory.mktemp("shared-doc")
    out = bench_server.bench_server(_args(SHARED_ARGV + ["--out", str(d)]), model=model)
    return model, out, json.loads((d / "server.json").read_text()), (d / "server.md").read_text()


def test_setups_and_workloads_report_and_outputs(shared_doc_run):
    model, out, saved, md = shared_doc_run
    assert saved["points"] == json.loads(json.dumps(out["points"]))
    assert out["workloads"] == ["shared-doc", "independent"]
    assert (out["doc_tokens"], out["question_tokens"], out["max_len"]) == (44, 6, 60)
    assert [s["name"] for s in out["setups"]] == ["dense", "paged8"]
    assert out["setups"][1]["page_size"] == 8 and out["setups"][0]["page_size"] is None
    assert "| setup | workload | variant | gamma |" in md and "K/V and prefix cache" in md
    assert "Speedups vs `dense` with `off`" in md

    # the prompts, built here from the seeds. shared-doc: one random document (seed 3 + 2000)
    # and the questions (seed 3 + 2001): 5 measured + 1 that primes the document (not
    # measured); independent: 5 rows of random tokens (seed 3) cut to lengths drawn from
    # [8, 40] (seed 3)
    V = model.config.vocab_size
    doc = np.random.default_rng(2003).integers(0, V, size=(1, 44))[0].tolist()
    questions = np.random.default_rng(2004).integers(0, V, size=(6, 6)).tolist()
    rows = np.random.default_rng(3).integers(0, V, size=(5, 40)).tolist()
    cut = np.random.default_rng(3).integers(8, 41, size=5).tolist()
    prompts = {"shared-doc": [doc + q for q in questions[:5]],
               "independent": [r[:n] for r, n in zip(rows, cut)]}
    assert len(set(cut)) > 1
    ref = {w: jaxspec.generate(model, p, max_new_tokens=10).tokens for w, p in prompts.items()}
    assert out["check"]["outputs"] == ref

    assert [(p["setup"], p["workload"], p["variant"], p["rate"]) for p in out["points"]] == \
        [(s, w, "off", "inf") for s in ("dense", "paged8") for w in ("shared-doc", "independent")]
    assert set(out["servers"]) == {"dense/off", "paged8/off"}
    assert out["servers"]["paged8/off"]["page_size"] == 8
    for p in out["points"]:
        w = p["workload"]
        assert p["status"] == "ok" and p["completed"] == p["requests"] == 5, p
        assert p["outputs"] == ref[w], (p["setup"], w)  # greedy: generate's, every setup
        assert p["rows_equal_generate"] == p["rows_checked"] == 5
        assert p["output_tokens"] == 50
        assert p["request_throughput"] == pytest.approx(5 / p["duration_s"])
        assert p["output_tok_s"] == pytest.approx(50 / p["duration_s"])
        _pct_ok(p["ttft_s"], 5)
        _pct_ok(p["e2e_s"], 5)
        assert [r["prompt_tokens"] for r in p["per_request"]] == [len(x) for x in prompts[w]]
        assert (p["kv"] is None) == (p["setup"] == "dense")
        assert 1 <= p["peak_running"] <= 4  # the most sequences in the 4 slots at once
    pts = {(p["setup"], p["workload"]): p for p in out["points"]}
    kv = pts["paged8", "shared-doc"]["kv"]
    # 5 sequences of 49 cached slots (all but the last prompt token) looked up; the document's
    # 5 full blocks of 8 found (cached by the priming request)
    assert kv["prefix_query_tokens"] == 5 * 49 and kv["prefix_hit_tokens"] == 5 * 40
    assert kv["prefix_hit_rate"] == pytest.approx(40 / 49)
    assert kv["preemptions"] == 0 and kv["kv_blocks_used_after"] == 0
    assert kv["kv_blocks_total"] == out["servers"]["paged8/off"]["kv_blocks"]
    assert 5 <= kv["kv_blocks_peak"] <= kv["kv_blocks_total"]
    assert kv["kv_blocks_cached_after"] >= 5
    kv = pts["paged8", "independent"]["kv"]  # random prompts: nothing shared
    assert kv["prefix_query_tokens"] == sum(len(x) - 1 for x in prompts["independent"])
    assert kv["prefix_hit_tokens"] == 0
    assert 0 < kv["kv_blocks_peak"] <= kv["kv_blocks_total"]
    # speedups: paged8 vs dense (both off) on each workload
    assert [(s["setup"], s["workload"]) for s in out["speedups"]] == \
        [("paged8", "shared-doc"), ("paged8", "independent")]
    for s in out["speedups"]:
        d, x = pts["dense", s["workload"]], pts["paged8", s["workload"]]
        assert s["ttft_p99"] == pytest.approx(d["ttft_s"]["p99"] / x["ttft_s"]["p99"])
        assert s["output_tok_s"] == pytest.approx(x["output_tok_s"] / d["output_tok_s"])
    v = out["verdict"]
    assert (v["setup"], v["workload"]) == ("dense", "shared-doc")
    assert out["reference"]["workload"] == "shared-doc"
    assert v["server_decode_tok_s"] == pts["dense", "shared-doc"]["server"]["decode_tok_s"]


def test_shared_doc_cached_tokens_in_responses(shared_doc_run):
    _, out, _, md = shared_doc_run
    pts = {(p["setup"], p["workload"]): p for p in out["points"]}
    paged = pts["paged8", "shared-doc"]
    # usage.prompt_tokens_details.cached_tokens of every response: none on the dense server,
    # the document's full blocks on the paged one (equal to the server's own count), none for
    # independent random prompts
    for p in out["points"]:
        assert p["cached_tokens_reported"] == 5
    assert pts["dense", "shared-doc"]["cached_tokens"] == 0
    assert pts["dense", "independent"]["cached_tokens"] == 0
    assert pts["paged8", "independent"]["cached_tokens"] == 0
    assert [r["cached_tokens"] for r in paged["per_request"]] == [40] * 5
    assert paged["cached_tokens"] == paged["kv"]["prefix_hit_tokens"] == 200
    assert "| 200 (5/5) |" in md


def test_server_setups_and_kv_numbers():
    dense, paged, p8, ns = bench_server.parse_servers(
        "dense, paged, paged8-blocks300-budget64, paged-noshare")
    assert dense == {"name": "dense", "page_size": None, "kv_blocks": None,
                     "prefill_budget": None, "mixed_prefill": None, "share": True,
                     "max_batch": None, "fill_first": None, "mixed_stretch": None}
    m512, m0 = bench_server.parse_servers("paged-mixed512, paged-nomixed")
    assert (m512["mixed_prefill"], m0["mixed_prefill"]) == (512, 0)
    s8, = bench_server.parse_servers("paged-mixed2048-stretch8")
    assert (s8["mixed_prefill"], s8["mixed_stretch"], m512["mixed_stretch"]) == (2048, 8, None)
    for bad in ("paged-stretch0", "dense-stretch4", "paged-stretch"):
        with pytest.raises(ValueError, match="--servers"):
            bench_server.parse_servers(bad)
    f5, f0 = bench_server.parse_servers("paged-fillfirst5, paged-nofillfirst")
    assert (f5["fill_first"], f0["fill_first"], m0["fill_first"]) == (5, 0, None)
    with pytest.raises(ValueError, match="--servers"):
        bench_server.parse_servers("paged-mixed0")
    d16, p48 = bench_server.parse_servers("dense-slots16, paged-blocks64-slots48")
    assert (d16["max_batch"], d16["page_size"]) == (16, None)
    assert (p48["max_batch"], p48["kv_blocks"], p48["page_size"]) == \
        (48, 64, bench_server.SETUP_PAGE_SIZE)
    with pytest.raises(ValueError, match="--servers"):
        bench_server.parse_servers("dense-blocks8")
    assert paged["share"] and not ns["share"] and ns["page_size"] == bench_server.SETUP_PAGE_SIZE
    assert (paged["page_size"], paged["kv_blocks"], paged["prefill_budget"]) == \
        (bench_server.SETUP_PAGE_SIZE, None, None)
    assert (p8["name"], p8["page_size"], p8["kv_blocks"], p8["prefill_budget"]) == \
        ("paged8-blocks300-budget64", 8, 300, 64)
    # /metrics where it has a number, else the engine's own; none for a dense server
    prom = bench_server.parse_metrics("jaxspec_kv_blocks_total 40\njaxspec_preemptions_total 2\n")
    eng = {"kv_blocks_total": 99, "kv_blocks_used": 7, "prefix_hit_tokens": 16,
           "prefix_query_tokens": 20, "preemptions": 5}
    k0 = bench_server.kv_metrics(prom, eng)
    assert (k0["kv_blocks_total"], k0["preemptions"], k0["kv_blocks_used"]) == (40, 2, 7)
    assert k0["source"] == "/metrics+engine"
    assert bench_server.kv_metrics({}, {"slots_busy": 0}) is None
    k1 = dict(k0, preemptions=3, prefix_hit_tokens=64, prefix_query_tokens=100, kv_blocks_used=0)
    d = bench_server.kv_delta(k0, k1, 31)
    assert (d["preemptions"], d["prefix_hit_tokens"], d["prefix_query_tokens"]) == (1, 48, 80)
    assert d["held_sequences"] is None  # (neither source had the counter)
    held = bench_server.kv_metrics(bench_server.parse_metrics(
        "jaxspec_kv_blocks_total 40\njaxspec_held_sequences_total 5\n"), None)
    assert bench_server.kv_delta(held, dict(held, held_sequences=12), 3)["held_sequences"] == 7
    assert d["prefix_hit_rate"] == 0.6 and d["kv_blocks_peak"] == 31
    assert bench_server.kv_delta(None, None, None) is None


def test_seeds_short_baseline_and_timeline(tmp_path):
    """``--seed 3,4 --workload independent,short --timeline`` on one paged server: a point per
    seed and workload, each seed's own prompts and arrivals (generate's tokens for them), short
    prompts of ``--short`` tokens, the ITL against short computed from the points, and a
    timeline whose client stamps and engine chunks share one clock (every token event comes
    after the chunk that produced it was handed to the streams)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    model = served_model(seed=11, eos=False)
    argv = ["--servers", "paged8", "--workload", "independent,short", "--variants", "off",
            "--rates", "40", "--requests", "3", "--max-batch", "2", "--prompt", "20-36",
            "--short", "5", "--new", "20", "--source", "random", "--seed", "3,4", "--check", "3",
            "--warmup", "0", "--no-reference", "--timeline", "--out", str(tmp_path)]
    out = bench_server.bench_server(_args(argv), model=model)
    assert out["seeds"] == [3, 4] and out["short_tokens"] == 5
    assert [(p["seed"], p["workload"]) for p in out["points"]] == \
        [(3, "independent"), (3, "short"), (4, "independent"), (4, "short")]
    V = model.config.vocab_size
    for sd in (3, 4):
        rows = np.random.default_rng(sd).integers(0, V, size=(3, 36)).tolist()
        cut = np.random.default_rng(sd).integers(20, 37, size=3).tolist()
        short = np.random.default_rng(sd + 4000).integers(0, V, size=(3, 5)).tolist()
        for name, prompts in (("independent", [r[:n] for r, n in zip(rows, cut)]),
                              ("short", short)):
            ref = jaxspec.generate(model, prompts, max_new_tokens=20).tokens
            assert out["check"]["outputs"][f"{name}@{sd}"] == ref
            p = next(p for p in out["points"] if (p["seed"], p["workload"]) == (sd, name))
            assert p["status"] == "ok" and p["outputs"] == ref, (sd, name)
            assert [r["prompt_tokens"] for r in p["per_request"]] == [len(x) for x in prompts]
    pts = {(p["seed"], p["workload"]): p for p in out["points"]}
    assert [(s["seed"], s["workload"]) for s in out["itl_vs_short"]] == \
        [(3, "independent"), (4, "independent")]
    for s in out["itl_vs_short"]:
        a, b = pts[s["seed"], "independent"]["itl_s"], pts[s["seed"], "short"]["itl_s"]
        assert s["itl_p99"] == pytest.approx(a["p99"] / b["p99"])
    md = (tmp_path / "server.md").read_text()
    assert "| seed |" in md and "against the `short` workload" in md

    tl = json.loads((tmp_path / "server.timeline.json").read_text())["points"]
    assert [(t["seed"], t["workload"]) for t in tl] == list(pts)
    arrivals = {}
    for t in tl:
        chunks = [c for c in t["chunks"] if c["kind"] != "prefill"]
        assert chunks and sum(c["tokens"] for c in chunks) == 3 * 20
        for c in chunks:
            assert c["t_dispatch"] <= c["t_start"] <= c["t_end"] <= c["t_result"] \
                <= c["t_delivered"], c
            assert 1 <= c["rows"] <= c["batch"] <= 2 and 0 <= c["ran"] <= c["rounds"]
            assert c["compact"] == (c["batch"] < 2)  # (compact: a power of two <= half the slots)
            assert c["predicted_s"] is None or (c["predicted_s"] > 0) == (c["ran"] > 0)
        delivered = sorted(c["t_delivered"] for c in chunks)
        for r in t["requests"]:
            assert r["status"] == "ok" and r["events"][-1][1] == 20 and len(r["events"]) > 1
            for when, _ in r["events"]:  # (client stamps: seconds from its clock0)
                assert r["clock0"] + when >= delivered[0]
        arrivals[t["seed"], t["workload"]] = [r["t_send"] for r in t["requests"]]
    # the same arrivals for both workloads of a seed, others for the other seed
    for sd in (3, 4):
        assert np.allclose(arrivals[sd, "independent"], arrivals[sd, "short"], atol=0.05)
    plan = bench_server.arrival_times(3, 40.0, 3 + 1)
    assert np.allclose(arrivals[3, "short"], plan, atol=0.05)
    assert not np.allclose(bench_server.arrival_times(3, 40.0, 5), plan)
