"""The speculative benchmark decodes every variant from one prefilled cache (`Prepared.fresh_state`
rewinds it): that must give exactly the tokens of `jaxspec.generate` (float32), in both the
completion runs and the steady-state runs, and it must fail when the rewind is wrong."""

import pathlib
import sys

import numpy as np
import pytest

import jaxspec
from jaxspec import engine
from tiny import tiny_model

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
from benchmark import SpecBench, Variant, cut_prompts  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=2, scale=3.0)


def test_every_variant_from_one_prefill_equals_generate(model, monkeypatch):
    from jaxspec import speculative
    prefills = []
    orig = speculative._Runner._draft_prefill
    monkeypatch.setattr(speculative._Runner, "_draft_prefill",
                        lambda self, *a, **k: prefills.append(1) or orig(self, *a, **k))
    rng = np.random.default_rng(3)
    stream = rng.integers(0, model.config.vocab_size, size=4000).astype(np.int32)
    prompts = cut_prompts(stream, 3, 40, seed=1)
    ref = jaxspec.generate(model, prompts, max_new_tokens=12).tokens
    variants = [Variant("ar"),
                Variant("self g2", jaxspec.Speculation("self", gamma=2, sink=2, window=6)),
                Variant("self tree", jaxspec.Speculation("self", sink=2, window=6, tree=(2, 1))),
                Variant("self auto", jaxspec.Speculation("self", gamma="auto", sink=2, window=6)),
                # the target as its own draft: every draft is accepted in every run only if each
                # run starts from the draft's own prefill (runs consume their draft state)
                Variant("draft", jaxspec.Speculation(model, gamma=2, window=None)),
                Variant("draft ring", jaxspec.Speculation(model, gamma=2, sink=2, window=96))]
    bench = SpecBench(model, variants, max_new=12, repeats=2, log=lambda *a: None)
    rows = bench.point(3, 40, prompts)
    assert [r["variant"] for r in rows] == ["ar", "self g2", "self tree", "self auto", "draft",
                                            "draft ring"]
    assert not [r for r in rows if "error" in r]
    assert rows[0]["tokens"] == ref  # the plain loop from the rewound cache
    for r in rows[1:]:
        assert r["identical_rows"] == 1.0, r["variant"]  # lossless, from the same cache
        assert r["new_tokens"] == 36 and r["steady_rows_done"] == 0
        assert r["steady_tokens"] >= 3 * r["steady_rounds"]  # every row commits each round
    for r in rows[4:]:
        assert r["acceptance_rate"] == 1.0 and r["draft_prefill_s"] > 0, r["variant"]
    assert len(prefills) == 2  # one draft prefill per draft variant, none inside the timed runs
    g2 = rows[1]
    assert g2["speedup"] > 0 and "model_speedup" in g2 and g2["cost_ms"]["plain"] > 0


def test_rewinding_to_the_wrong_lengths_changes_the_tokens():
    """The check above can fail: decoding from a cache rewound to half the prompt differs (a
    model whose next token depends on the context, not the sharpened one above)."""
    model = tiny_model(seed=5)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, model.config.vocab_size, size=30).tolist() for _ in range(2)]
    prep = engine.prepare(model, prompts, max_new_tokens=10, max_len=128)
    good = engine.decode(model, prep, prep.fresh_state(extra=1))[0]
    ref = [np.asarray(good.out)[i, :10].tolist() for i in range(2)]
    assert ref == jaxspec.generate(model, prompts, max_new_tokens=10).tokens
    bad_prep = engine.Prepared(**{**prep.__dict__, "slot_lens": prep.slot_lens // 2})
    bad = engine.decode(model, bad_prep, bad_prep.fresh_state(good.cache, extra=1))[0]
    assert [np.asarray(bad.out)[i, :10].tolist() for i in range(2)] != ref
