"""Tiny random Hugging Face models (PyTorch, float32) for parity tests, and their conversion."""

from __future__ import annotations

import pathlib

import numpy as np

TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5,
            initializer_range=0.15)

VARIANTS = {
    "llama-mha": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-gqa": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mqa-tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "llama3-rope": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True,
                                  rope_theta=500000.0,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64})),
    "qwen2-bias": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "mistral": ("mistral", dict(num_key_value_heads=2, tie_word_embeddings=False,
                                sliding_window=None)),
    # Llama's biases on q/k/v/o and on the MLP, and a head_dim that is not hidden / heads
    "llama-bias": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False,
                                 attention_bias=True, mlp_bias=True, head_dim=24)),
    # YaRN (Qwen2.5's long-context setting, scaled down): interpolated low frequencies, a ramp,
    # and cos/sin scaled by 0.1 ln(factor) + 1
    "qwen2-yarn": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True,
                                 rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 64})),
    # Qwen3: RMSNorm of each query / key head before RoPE; head_dim apart from hidden / heads
    "qwen3": ("qwen3", dict(num_key_value_heads=2, tie_word_embeddings=True, head_dim=32)),
    "qwen3-bias": ("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=False,
                                 attention_bias=True)),
    # YaRN with explicit betas and DeepSeek-style mscales (attention factor from their ratio)
    "llama-yarn-mscale": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=False,
                                        rope_theta=50000.0,
                                        rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                                      "original_max_position_embeddings": 32,
                                                      "beta_fast": 16.0, "beta_slow": 2.0,
                                                      "mscale": 1.5, "mscale_all_dim": 0.5})),
}


def make_hf_model(variant: str, seed: int = 0, **overrides):
    import torch
    import transformers
    arch, extra = VARIANTS[variant]
    kw = dict(TINY)
    kw.update(extra)
    kw.update(overrides)
    cls_cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}[arch]
    cls_model = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM,
                 "mistral": transformers.MistralForCausalLM}[arch]
    torch.manual_seed(seed)
    cfg = cls_cfg(**kw)
    model = cls_model(cfg).to(torch.float32).eval()
    # Random norm weights (HF initialises them to ones, which would hide a wrong norm).
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            if name.endswith("bias"):
                p.normal_(0, 0.3, generator=g)
    return model


def convert_hf(model, tmp_path: pathlib.Path, dtype="float32"):
    import jaxspec
    src = tmp_path / "hf"
    model.save_pretrained(src)
    dst = jaxspec.convert(src, tmp_path / "ckpt", dtype=dtype, progress=False)
    return jaxspec.load(dst)


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def torch_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    import torch
    with torch.no_grad():
        ids = torch.as_tensor([prompt])
        # explicit all-ones mask: otherwise transformers masks prompt tokens equal to the pad id
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def jax_logits(model, tokens: np.ndarray) -> np.ndarray:
    """A converted model's logits of a whole prompt, one forward from an empty cache."""
    import jax.numpy as jnp

    from jaxspec.attention import AttentionPlan
    from jaxspec.cache import KVCache
    from jaxspec.model import forward
    B, T = tokens.shape
    cache = KVCache.create(model.config, B, T + 8, dtype=model.dtype)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    plan = AttentionPlan(lengths=jnp.zeros((B,), jnp.int32), impl="xla")
    logits, _ = forward(model.config, model.params, jnp.asarray(tokens), pos, cache, plan)
    return np.asarray(logits)
