"""How Hugging Face configs are read: fields real checkpoints spell in ways the parity variants
do not (transformers' PyTorch models on tiny random configs are the reference)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

import jaxspec
from jaxspec.config import ConfigError, ModelConfig

from hf_models import jax_logits, make_hf_model, torch_greedy, torch_logits

torch = pytest.importorskip("torch")


def _save(model, tmp_path, edit=None):
    src = tmp_path / "hf"
    model.save_pretrained(src)
    if edit is not None:
        p = src / "config.json"
        d = json.loads(p.read_text())
        edit(d)
        p.write_text(json.dumps(d))
    return src


def _convert(src, tmp_path):
    return jaxspec.load(jaxspec.convert(src, tmp_path / "ckpt", dtype="float32", progress=False))


def test_generation_config_eos_ids_stop_generation(tmp_path):
    """transformers' generate stops at generation_config.json's EOS ids (a list in instruct
    checkpoints, longer than config.json's): so does a converted model."""
    m = make_hf_model("llama-gqa", seed=3)
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 101, size=9).tolist()
    free = torch_greedy(m, prompt, 12)
    stop = next(t for t in free[3:] if t != 2)  # a token greedy decoding emits after a few
    m.config.eos_token_id = 2
    m.generation_config.eos_token_id = [2, stop]
    src = _save(m, tmp_path)
    model = _convert(src, tmp_path)
    assert stop in model.config.eos_token_ids and 2 in model.config.eos_token_ids
    want = torch_greedy(m, prompt, 12)
    got = jaxspec.generate(model, [prompt], max_new_tokens=12).tokens[0]
    assert got == want and got[-1] == stop and len(got) < 12


def test_rope_parameters_legacy_type_key(tmp_path):
    """transformers reads ``rope_parameters: {"type": "linear", ...}`` as linear scaling."""
    m = make_hf_model("llama-gqa", seed=4, rope_scaling={"rope_type": "linear", "factor": 3.0})

    def legacy(d):
        d.pop("rope_scaling", None)
        theta = d.pop("rope_theta", 10000.0)
        d["rope_parameters"] = {"type": "linear", "factor": 3.0, "rope_theta": theta}
    src = _save(m, tmp_path, legacy)
    model = _convert(src, tmp_path)
    assert model.config.rope_scaling_dict
    toks = np.random.default_rng(4).integers(0, 101, size=(1, 40))
    np.testing.assert_allclose(jax_logits(model, toks), torch_logits(m, toks), atol=2e-4,
                               rtol=2e-4)


def test_mistral_slides_as_transformers_does():
    """transformers' Mistral has no ``use_sliding_window``: a config that says false still
    slides; a Mistral config.json without ``sliding_window`` takes its default (4096)."""
    base = dict(model_type="mistral", vocab_size=101, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=32768)
    c = ModelConfig.from_hf_dict({**base, "sliding_window": 16, "use_sliding_window": False})
    assert c.sliding_window == 16
    assert ModelConfig.from_hf_dict({**base, "sliding_window": None}).sliding_window is None
    # a jaxspec checkpoint's stored config round-trips, with and without a window
    for w in (None, 16):
        cfg = ModelConfig.from_hf_dict({**base, "sliding_window": w})
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()).sliding_window == cfg.sliding_window


def test_mistral_config_json_defaults(tmp_path):
    d = dict(model_type="mistral", vocab_size=101, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    c = ModelConfig.from_json(p)
    assert c.sliding_window == 4096 and c.max_position_embeddings == 131072
    p.write_text(json.dumps({**d, "model_type": "llama"}))
    assert ModelConfig.from_json(p).max_position_embeddings == 2048
    # null: the context length is the default, and a null window is no window (Mistral v0.2+)
    p.write_text(json.dumps({**d, "max_position_embeddings": None, "sliding_window": None}))
    c = ModelConfig.from_json(p)
    assert c.sliding_window is None and c.max_position_embeddings == 131072


def test_bos_token_id_list_and_bad_ids():
    base = dict(model_type="llama", vocab_size=101, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    c = ModelConfig.from_hf_dict({**base, "bos_token_id": [1, 5]})
    assert c.bos_token_id == 1
    hash(c)  # a static jit argument
    with pytest.raises(ConfigError, match="bos_token_id"):
        ModelConfig.from_hf_dict({**base, "bos_token_id": "<s>"})
    assert ModelConfig.from_hf_dict({**base, "eos_token_id": [2, 7]}).eos_token_ids == (2, 7)
    for bad in ([[2, 7]], "</s>", [2, -1], True):  # a clear error, not a TypeError
        with pytest.raises(ConfigError, match="eos_token_id"):
            ModelConfig.from_hf_dict({**base, "eos_token_id": bad})
    assert ModelConfig.from_hf_dict({**base, "max_position_embeddings": None}
                                    ).max_position_embeddings == 4096


def test_stray_safetensors_files_are_not_weights(tmp_path):
    """Without an index, model*.safetensors are the weights (Mistral repos also hold a
    consolidated.safetensors in their own naming, LoRA folders an adapter)."""
    from safetensors.numpy import save_file
    m = make_hf_model("llama-gqa", seed=5)
    src = _save(m, tmp_path)
    save_file({"layers.0.attention.wq.weight": np.zeros((4, 4), np.float32)},
              str(src / "consolidated.safetensors"))
    model = _convert(src, tmp_path)
    toks = np.random.default_rng(5).integers(0, 101, size=(1, 12))
    np.testing.assert_allclose(jax_logits(model, toks), torch_logits(m, toks), atol=2e-4,
                               rtol=2e-4)


def test_generation_past_the_context_warns(tmp_path):
    m = make_hf_model("llama-gqa", seed=6, max_position_embeddings=24)
    model = _convert(_save(m, tmp_path), tmp_path)
    prompt = list(range(3, 15))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res = jaxspec.generate(model, [prompt], max_new_tokens=20)
    assert len(res.tokens[0]) <= 24 - len(prompt)
    assert any("context" in str(x.message) and "max_new_tokens=20" in str(x.message) for x in w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxspec.generate(model, [prompt], max_new_tokens=4)  # fits: no warning
