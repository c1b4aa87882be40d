"""Tests for jaxspec.gguf_io: tiny GGUF files written the way llama.cpp writes them, read back.

`write_tiny_gguf` is meant for reuse by other tests (checkpoint conversion, model parity):
it takes a Hugging Face-style state dict + config (e.g. from a transformers random model) and
writes a GGUF as llama.cpp's `convert_hf_to_gguf.py` would (names, metadata, q/k permuted for
`llama`, dims reversed, optional quantization, optional byte-level BPE tokenizer).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from jaxspec import gguf_io  # noqa: E402

# ----------------------------------------------------------------------------------------------
# Helpers (reusable): writing a GGUF like llama.cpp.
# ----------------------------------------------------------------------------------------------

_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for an HF one (written independently of jaxspec.gguf_io)."""
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, i, rest
    assert parts[:2] == ["model", "layers"], hf_name
    return f"blk.{parts[2]}.{_HF_TO_GGUF_LAYER[parts[3]]}"


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row reordering, spelled out row by row (independent of gguf_io.permute_qk).

    Within a head of D rows, HF row i (first half) goes to 2i and row D/2 + i to 2i + 1.
    """
    out = np.empty_like(w)
    head_dim = w.shape[0] // n_heads
    half = head_dim // 2
    for h in range(n_heads):
        base = h * head_dim
        for i in range(half):
            out[base + 2 * i] = w[base + i]
            out[base + 2 * i + 1] = w[base + half + i]
    return out


def byte_level_vocab() -> dict[str, Any]:
    """A tiny GPT-2-style byte-level BPE vocabulary: 3 special tokens, 256 bytes, 6 merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_tokens = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġa n"]
    merged = ["Ġt", "he", "Ġthe", "in", "Ġa", "Ġan"]
    tokens = specials + byte_tokens + merged
    return {
        "model": "gpt2",
        "pre": "qwen2",
        "tokens": tokens,
        "token_type": [3] * len(specials) + [1] * (len(tokens) - len(specials)),
        "merges": merges,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "padding_token_id": 0,
        "add_bos_token": False,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
    }


def _as_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # torch tensor
        value = value.detach().cpu().float().numpy()
    return np.asarray(value, dtype=np.float32)


def _config_dict(hf_config: Any) -> dict[str, Any]:
    return hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)


def write_tiny_gguf(
    path: str | os.PathLike[str],
    hf_state_dict: dict[str, Any],
    hf_config: Any,
    arch: str | None = None,
    *,
    qtype: QT = QT.F32,
    tokenizer: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write an HF-style state dict + config as a GGUF file, the way llama.cpp's converter does.

    Args:
      path: output `.gguf` file.
      hf_state_dict: HF names -> arrays (numpy or torch), HF orientation `[out, in]`.
      hf_config: HF config (dict or `PretrainedConfig`).
      arch: GGUF architecture; defaults to the config's `model_type`.
      qtype: storage type of 2-D weights (F32, F16, BF16, Q8_0, Q4_0, ...); 1-D tensors stay F32,
        and a matrix whose rows don't fit the quantization block falls back to F32 (as llama.cpp).
      tokenizer: GGUF tokenizer fields (see `byte_level_vocab()`), or None for no tokenizer.
      metadata: extra `{key: value}` string/int/float metadata (e.g. `llama.rope.scaling.type`).
      extra_tensors: GGUF name -> float32 array written as is (e.g. `rope_freqs.weight`).
    Returns the path. `lm_head.weight` is skipped when the config ties word embeddings.
    """
    cfg = _config_dict(hf_config)
    arch = arch or cfg["model_type"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg.get("max_position_embeddings", 2048))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg["hidden_size"] // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(int(qtype) if qtype in (QT.F32, QT.F16) else 7)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))
    if tokenizer is not None:
        writer.add_tokenizer_model(tokenizer["model"])
        writer.add_tokenizer_pre(tokenizer.get("pre", "default"))
        writer.add_token_list(tokenizer["tokens"])
        writer.add_token_types(tokenizer["token_type"])
        if tokenizer.get("merges"):
            writer.add_token_merges(tokenizer["merges"])
        writer.add_bos_token_id(tokenizer["bos_token_id"])
        writer.add_eos_token_id(tokenizer["eos_token_id"])
        if "padding_token_id" in tokenizer:
            writer.add_pad_token_id(tokenizer["padding_token_id"])
        writer.add_add_bos_token(bool(tokenizer.get("add_bos_token", False)))
        if tokenizer.get("chat_template"):
            writer.add_chat_template(tokenizer["chat_template"])

    for hf_name, value in hf_state_dict.items():
        if hf_name == "lm_head.weight" and cfg.get("tie_word_embeddings", False):
            continue
        if "rotary_emb" in hf_name:
            continue
        array = _as_numpy(value)
        if arch in ("llama", "mistral"):
            if ".q_proj." in hf_name:
                array = llama_cpp_permute(array, heads)
            elif ".k_proj." in hf_name:
                array = llama_cpp_permute(array, kv_heads)
        writer.add_tensor(gguf_name(hf_name), *_encode(array, qtype))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, np.asarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _encode(array: np.ndarray, qtype: QT) -> tuple[np.ndarray, ...] | Any:
    """(data,) or (data, None, QT) for GGUFWriter.add_tensor."""
    from gguf import quants

    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if array.ndim == 1 or qtype == QT.F32 or array.shape[-1] % block:
        return (array.astype(np.float32),)
    if qtype == QT.F16:
        return (array.astype(np.float16),)
    return (quants.quantize(array, qtype), None, qtype)


def dequantized_reference(array: np.ndarray, qtype: QT) -> np.ndarray:
    """What a reader must return for `array` stored as `qtype` by `write_tiny_gguf`."""
    from gguf import quants

    encoded = _encode(array, qtype)
    if len(encoded) == 1:
        return encoded[0].astype(np.float32)
    return quants.dequantize(encoded[0], qtype)


# ----------------------------------------------------------------------------------------------
# Tiny random models.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Tiny:
    config: dict[str, Any]
    state: dict[str, np.ndarray]


def tiny_model(arch: str = "llama", *, vocab: int = 96, hidden: int = 64, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, inter: int = 128, tie: bool = True, seed: int = 0) -> Tiny:
    """Random HF-style weights for a tiny llama / qwen2 model (numpy, float32)."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    config = {
        "model_type": arch, "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "tie_word_embeddings": tie, "bos_token_id": 1, "eos_token_id": 2,
    }

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    state = {"model.embed_tokens.weight": w(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = 1 + w(hidden)
        state[p + "self_attn.q_proj.weight"] = w(heads * head_dim, hidden)
        state[p + "self_attn.k_proj.weight"] = w(kv_heads * head_dim, hidden)
        state[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
        if arch == "qwen2":
            state[p + "self_attn.q_proj.bias"] = w(heads * head_dim)
            state[p + "self_attn.k_proj.bias"] = w(kv_heads * head_dim)
            state[p + "self_attn.v_proj.bias"] = w(kv_heads * head_dim)
        state[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        state[p + "post_attention_layernorm.weight"] = 1 + w(hidden)
        state[p + "mlp.gate_proj.weight"] = w(inter, hidden)
        state[p + "mlp.up_proj.weight"] = w(inter, hidden)
        state[p + "mlp.down_proj.weight"] = w(hidden, inter)
    state["model.norm.weight"] = 1 + w(hidden)
    if not tie:
        state["lm_head.weight"] = w(vocab, hidden)
    return Tiny(config, state)


# ----------------------------------------------------------------------------------------------
# Permutation.
# ----------------------------------------------------------------------------------------------


def _rope_rotate_half(x: np.ndarray, pos: int, theta: float = 10000.0) -> np.ndarray:
    """HF RoPE on one head vector: dimension i pairs with i + D/2."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _rope_interleaved(x: np.ndarray, pos: int, theta: float = 10000.0) -> np.ndarray:
    """llama.cpp's (GPT-J style) RoPE on one head vector: dimension 2i pairs with 2i + 1."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


@pytest.mark.parametrize("n_heads,head_dim,cols", [(4, 16, 8), (1, 2, 3), (3, 64, 5), (2, 8, 0)])
def test_permute_unpermute_identity(n_heads: int, head_dim: int, cols: int) -> None:
    rng = np.random.default_rng(1)
    shape = (n_heads * head_dim, cols) if cols else (n_heads * head_dim,)
    w = rng.standard_normal(shape).astype(np.float32)
    permuted = gguf_io.permute_qk(w, n_heads)
    np.testing.assert_array_equal(permuted, llama_cpp_permute(w, n_heads))
    np.testing.assert_array_equal(gguf_io.unpermute_qk(permuted, n_heads), w)
    np.testing.assert_array_equal(gguf_io.permute_qk(gguf_io.unpermute_qk(w, n_heads), n_heads), w)
    if head_dim > 2:
        assert not np.array_equal(permuted, w)


def test_permutation_turns_rotate_half_into_interleaved_rope() -> None:
    """The meaning of the permutation: interleaved RoPE on permuted rows == rotate-half RoPE, permuted."""
    rng = np.random.default_rng(2)
    n_heads, head_dim = 3, 16
    x = rng.standard_normal(n_heads * head_dim)  # one q vector, HF layout
    for pos in (0, 1, 7, 100):
        hf = np.concatenate([_rope_rotate_half(h, pos) for h in x.reshape(n_heads, head_dim)])
        gg = np.concatenate([_rope_interleaved(h, pos) for h in gguf_io.permute_qk(x, n_heads).reshape(n_heads, head_dim)])
        np.testing.assert_allclose(gguf_io.permute_qk(hf, n_heads), gg, atol=1e-12)


def test_permute_rejects_bad_head_split() -> None:
    with pytest.raises(ValueError, match="heads"):
        gguf_io.unpermute_qk(np.zeros((10, 4)), 4)


# ----------------------------------------------------------------------------------------------
# Round trips.
# ----------------------------------------------------------------------------------------------


def _check_config(config: dict[str, Any], tiny: Tiny, arch: str) -> None:
    c = tiny.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings"):
        assert config[key] == c[key], key
    assert config["model_type"] == arch
    assert config["rms_norm_eps"] == pytest.approx(c["rms_norm_eps"])
    assert config["rope_theta"] == c["rope_theta"]
    assert config["attention_bias"] == (arch == "qwen2")
    assert "rope_scaling" not in config


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", False), ("qwen2", True)])
def test_roundtrip_f32_exact(tmp_path: Path, arch: str, tie: bool) -> None:
    tiny = tiny_model(arch, tie=tie)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny.state, tiny.config)
    model = gguf_io.read_gguf(path, progress=False)
    assert set(model.tensors) == set(tiny.state)
    for name, expected in tiny.state.items():
        got = model.tensors[name]
        assert got.dtype == np.float32 and got.shape == expected.shape, name
        np.testing.assert_array_equal(got, expected, err_msg=name)
    _check_config(model.config, tiny, arch)
    assert model.tokenizer is None
    assert model.config["bos_token_id"] is None  # no tokenizer metadata in this file


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_roundtrip_quantized(tmp_path: Path, arch: str, qtype: QT) -> None:
    tiny = tiny_model(arch, tie=arch == "llama")
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny.state, tiny.config, qtype=qtype)
    got = dict(gguf_io.iter_tensors(path, progress=False))
    assert set(got) == set(tiny.state)
    heads, kv = tiny.config["num_attention_heads"], tiny.config["num_key_value_heads"]
    for name, original in tiny.state.items():
        # exactly what the stored blocks hold, taken back to HF row order
        stored = original
        if arch == "llama" and ".q_proj." in name:
            stored = llama_cpp_permute(original, heads)
        elif arch == "llama" and ".k_proj." in name:
            stored = llama_cpp_permute(original, kv)
        expected = dequantized_reference(stored, qtype)
        if arch == "llama" and ".q_proj." in name:
            expected = gguf_io.unpermute_qk(expected, heads)
        elif arch == "llama" and ".k_proj." in name:
            expected = gguf_io.unpermute_qk(expected, kv)
        np.testing.assert_array_equal(got[name], expected, err_msg=name)
        # and close to the original weights (quantization error only)
        bound = {QT.F16: 1e-3, QT.BF16: 1e-2, QT.Q8_0: 0.02}.get(qtype, 0.15) * max(1.0, np.abs(original).max())
        np.testing.assert_allclose(got[name], original, atol=bound, err_msg=name)


def _random_k_quant_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: QT) -> np.ndarray:
    """Random but valid Q4_K / Q6_K bytes for a [rows, cols] matrix (fp16 scales set to sane values)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    if qtype == QT.Q4_K:  # d, dmin at bytes 0..3
        data[:, 0:4] = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)
    elif qtype == QT.Q6_K:  # d at bytes 208..209
        data[:, 208:210] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return data.reshape(rows, cols // block_elems * block_bytes)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K])
def test_k_quants_match_transformers_torch_dequantizer(tmp_path: Path, qtype: QT) -> None:
    """gguf's numpy can't quantize K-quants; store random blocks and compare with an independent decoder."""
    torch = pytest.importorskip("torch")
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    rng = np.random.default_rng(3)
    heads, kv, head_dim, hidden = 2, 1, 128, 256
    tiny = tiny_model("llama", vocab=8, hidden=hidden, heads=heads, kv_heads=kv, inter=256, layers=1)
    blocks = {
        "model.layers.0.self_attn.q_proj.weight": _random_k_quant_blocks(rng, heads * head_dim, hidden, qtype),
        "model.layers.0.self_attn.k_proj.weight": _random_k_quant_blocks(rng, kv * head_dim, hidden, qtype),
        "model.layers.0.mlp.down_proj.weight": _random_k_quant_blocks(rng, hidden, 256, qtype),
    }
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    cfg = tiny.config
    writer.add_block_count(1), writer.add_context_length(64), writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(256), writer.add_head_count(heads), writer.add_head_count_kv(kv)
    for name, value in tiny.state.items():
        if name in blocks:
            writer.add_tensor(gguf_name(name), blocks[name], raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), value)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()

    got = gguf_io.read_gguf(path, progress=False).tensors
    for name, raw in blocks.items():
        rows = raw.shape[0]
        ref = torch_dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(qtype)).numpy().reshape(rows, -1)
        if ".q_proj." in name:
            ref = gguf_io.unpermute_qk(ref, heads)
        elif ".k_proj." in name:
            ref = gguf_io.unpermute_qk(ref, kv)
        assert got[name].shape == ref.shape
        np.testing.assert_allclose(got[name], ref, rtol=1e-6, atol=1e-6, err_msg=name)
    assert cfg["vocab_size"] == gguf_io.read_config(path)["vocab_size"]


def test_iter_tensors_streams_same_as_read(tmp_path: Path) -> None:
    tiny = tiny_model("qwen2")
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny.state, tiny.config, qtype=QT.Q8_0)
    f = gguf_io.GGUFFile(path)
    streamed = list(f.iter_tensors(progress=False))
    assert [n for n, _ in streamed] == f.tensor_names
    whole = gguf_io.read_gguf(path, progress=False).tensors
    for name, array in streamed:
        np.testing.assert_array_equal(array, whole[name])
        assert f.tensor_shape(name) == array.shape


# ----------------------------------------------------------------------------------------------
# Config and errors.
# ----------------------------------------------------------------------------------------------


def test_rope_scaling_from_metadata(tmp_path: Path) -> None:
    tiny = tiny_model("llama")
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.original_context_length": 64}
    path = write_tiny_gguf(tmp_path / "r.gguf", tiny.state, tiny.config, metadata=meta)
    config = gguf_io.read_config(path)
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 64}


def llama_cpp_rope_factors(scaling: dict[str, Any], rope_theta: float, head_dim: int) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for a Llama-3.1-style `rope_scaling`
    (and then drops the dict), written here from that formula, independently of jaxspec."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("head_dim,theta,scaling", [
    (128, 500000.0, LLAMA31),                                                  # Llama-3.1
    (64, 500000.0, dict(LLAMA31, factor=32.0)),                                # Llama-3.2-1B
    (128, 500000.0, dict(LLAMA31, original_max_position_embeddings=4096, high_freq_factor=2.0)),
    (16, 10000.0, dict(LLAMA31, original_max_position_embeddings=64)),
])
def test_rope_freqs_tensor_becomes_llama3_rope_scaling(tmp_path: Path, head_dim: int, theta: float,
                                                       scaling: dict[str, Any]) -> None:
    """A Llama-3.1 GGUF carries its RoPE scaling only as the `rope_freqs` tensor; it was ignored
    (with a warning), so every position past the short wavelengths rotated wrongly. The reader
    now recovers HF's llama3 dict, checked against transformers' own llama3 frequencies."""
    torch = pytest.importorskip("torch")
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxspec.config import ModelConfig

    tiny = tiny_model("llama", hidden=2 * head_dim, heads=2, kv_heads=1)
    factors = llama_cpp_rope_factors(scaling, theta, head_dim)
    path = write_tiny_gguf(tmp_path / "r.gguf", tiny.state, dict(tiny.config, rope_theta=theta),
                           extra_tensors={"rope_freqs.weight": factors})
    config = gguf_io.read_config(path)
    assert "rope_freq_factors" not in config
    got = ModelConfig.from_hf_dict(config).rope_inv_freq()
    hf = transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                                  rope_theta=theta, rope_scaling=dict(scaling),
                                  max_position_embeddings=2 * scaling["original_max_position_embeddings"])
    want = ROPE_INIT_FUNCTIONS["llama3"](hf, None)[0].double().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert not np.allclose(ModelConfig.from_hf_dict(dict(config, rope_scaling=None)).rope_inv_freq(), want,
                           rtol=1e-3)
    del torch


def test_rope_freqs_of_another_form_kept_as_factors(tmp_path: Path) -> None:
    """Factors no llama3 dict reproduces are kept as they are (`rope_freq_factors`), survive the
    config round trip, and divide the frequencies like llama.cpp does."""
    from jaxspec.config import ConfigError, ModelConfig

    tiny = tiny_model("llama", hidden=64, heads=4, kv_heads=2)  # head_dim 16
    factors = np.random.default_rng(3).uniform(0.5, 4.0, size=8).astype(np.float32)
    path = write_tiny_gguf(tmp_path / "f.gguf", tiny.state, tiny.config,
                           extra_tensors={"rope_freqs.weight": factors})
    config = gguf_io.read_config(path)
    assert "rope_scaling" not in config
    cfg = ModelConfig.from_hf_dict(config)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    theta = config["rope_theta"]
    np.testing.assert_allclose(cfg.rope_inv_freq(),
                               1.0 / theta ** (np.arange(0, 16, 2) / 16) / factors.astype(np.float64),
                               rtol=1e-12)
    with pytest.raises(ConfigError, match="rope_freq_factors"):
        ModelConfig.from_hf_dict(dict(config, rope_freq_factors=[1.0] * 7))
    direct = dataclasses.replace(cfg, rope_freq_factors=list(factors))  # a list: kept hashable
    assert direct == cfg and hash(direct) == hash(cfg)
    bad = write_tiny_gguf(tmp_path / "b.gguf", tiny.state, tiny.config,
                          extra_tensors={"rope_freqs.weight": np.ones(5, np.float32)})
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_io.read_config(bad)


def test_head_dim_from_key_length(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tiny = tiny_model("qwen2", hidden=64, heads=2, kv_heads=1)
    head_dim = 48  # not 64 / 2
    for i in range(tiny.config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        tiny.state[p + "q_proj.weight"] = rng.standard_normal((2 * head_dim, 64)).astype(np.float32)
        tiny.state[p + "q_proj.bias"] = rng.standard_normal(2 * head_dim).astype(np.float32)
        tiny.state[p + "k_proj.weight"] = rng.standard_normal((head_dim, 64)).astype(np.float32)
        tiny.state[p + "k_proj.bias"] = rng.standard_normal(head_dim).astype(np.float32)
        tiny.state[p + "v_proj.weight"] = rng.standard_normal((head_dim, 64)).astype(np.float32)
        tiny.state[p + "v_proj.bias"] = rng.standard_normal(head_dim).astype(np.float32)
        tiny.state[p + "o_proj.weight"] = rng.standard_normal((64, 2 * head_dim)).astype(np.float32)
    tiny.config["head_dim"] = head_dim
    path = write_tiny_gguf(tmp_path / "h.gguf", tiny.state, tiny.config)
    model = gguf_io.read_gguf(path, progress=False)
    assert model.config["head_dim"] == head_dim
    np.testing.assert_array_equal(model.tensors["model.layers.1.self_attn.o_proj.weight"],
                                  tiny.state["model.layers.1.self_attn.o_proj.weight"])


def test_unsupported_architecture(tmp_path: Path) -> None:
    tiny = tiny_model("llama")
    path = write_tiny_gguf(tmp_path / "g.gguf", tiny.state, tiny.config, arch="gemma")
    with pytest.raises(ValueError, match=r"'gemma'.*supported: llama, mistral, qwen2"):
        gguf_io.read_gguf(path)


def test_end_of_generation_ids(tmp_path: Path) -> None:
    """Generation stops where llama.cpp's end-of-generation set does: the file's EOS, EOT and
    EOM ids and control tokens spelled as end tokens (Qwen2.5's <|endoftext|> beside <|im_end|>,
    as its generation_config lists them); a normal token of the same text is no stop."""
    vocab = byte_level_vocab()
    tiny = tiny_model("llama", vocab=len(vocab["tokens"]))
    path = write_tiny_gguf(tmp_path / "a.gguf", tiny.state, tiny.config, tokenizer=vocab,
                           metadata={"tokenizer.ggml.eot_token_id": 1})
    assert gguf_io.read_config(path)["eos_token_id"] == [2, 1, 0]
    plain = dict(vocab, token_type=[1] * len(vocab["tokens"]))  # no control tokens
    path = write_tiny_gguf(tmp_path / "b.gguf", tiny.state, tiny.config, tokenizer=plain)
    assert gguf_io.read_config(path)["eos_token_id"] == 2


def test_yarn_attention_factor_as_llama_cpp_writes_it(tmp_path: Path) -> None:
    """llama.cpp's converter stores transformers' rope_scaling.attention_factor as
    rope.scaling.yarn_attn_factor: the same factor as the Hugging Face config's."""
    from jaxspec.config import ModelConfig
    tiny = tiny_model("qwen2", tie=False)
    hf = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
          "attention_factor": 1.0}
    meta = {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 64,
            "qwen2.rope.scaling.yarn_attn_factor": 1.0}
    path = write_tiny_gguf(tmp_path / "y.gguf", tiny.state, tiny.config, metadata=meta)
    ours = ModelConfig.from_hf_dict(gguf_io.read_config(path))
    want = ModelConfig.from_hf_dict({**tiny.config, "rope_scaling": hf})
    assert ours.rope_attention_factor() == pytest.approx(want.rope_attention_factor(), abs=1e-7)
    assert want.rope_attention_factor() == 1.0


def test_non_finite_weights_are_refused(tmp_path: Path) -> None:
    """A NaN block scale (a corrupt file) made NaN weights without a word."""
    import gguf
    tiny = tiny_model("qwen2", tie=False)
    path = write_tiny_gguf(tmp_path / "n.gguf", tiny.state, tiny.config, qtype=QT.Q8_0)
    data = bytearray(path.read_bytes())
    info = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_up.weight")
    off = int(info.data_offset)
    data[off:off + 2] = np.array([np.nan], np.float16).tobytes()  # block 0's scale
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="blk.0.ffn_up.weight.*NaN or infinite"):
        gguf_io.read_gguf(path, progress=False)


def test_missing_and_corrupt_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        gguf_io.read_gguf(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        gguf_io.read_gguf(bad)


# ----------------------------------------------------------------------------------------------
# Tokenizer.
# ----------------------------------------------------------------------------------------------


def _tiny_with_tokenizer(tmp_path: Path, arch: str = "qwen2") -> tuple[Path, Tiny, dict[str, Any]]:
    vocab = byte_level_vocab()
    tiny = tiny_model(arch, vocab=len(vocab["tokens"]), tie=arch == "llama")
    tiny.config.update(bos_token_id=vocab["bos_token_id"], eos_token_id=vocab["eos_token_id"])
    path = write_tiny_gguf(tmp_path / "tok.gguf", tiny.state, tiny.config, tokenizer=vocab)
    return path, tiny, vocab


def test_tokenizer_from_metadata(tmp_path: Path) -> None:
    path, tiny, vocab = _tiny_with_tokenizer(tmp_path)
    model = gguf_io.read_gguf(path, progress=False)
    tok = model.tokenizer
    assert tok is not None
    assert len(tok) == len(vocab["tokens"]) == model.config["vocab_size"]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    # the file's EOS first, then the control tokens llama.cpp also ends generation at
    assert (model.config["bos_token_id"], model.config["eos_token_id"]) == (1, [2, 0])
    text = "the cat and the hat <|im_end|> 2024!"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert ids[:2] == [vocab["tokens"].index("t"), vocab["tokens"].index("he")]
    assert vocab["tokens"].index("Ġthe") in ids and 2 in ids  # merges applied, special kept whole
    assert tok.chat_template == vocab["chat_template"]
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n"


def test_tokenizer_saves_and_reloads(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path, _, _ = _tiny_with_tokenizer(tmp_path)
    tok = gguf_io.load_tokenizer(path)
    tok.save_pretrained(tmp_path / "tok")
    again = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "in the <|im_start|>an ant"
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.chat_template == tok.chat_template


def test_tokenizer_matches_transformers_gguf_loader(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # transformers' own GGUF reader imports torch
    from transformers import AutoTokenizer

    path, _, _ = _tiny_with_tokenizer(tmp_path)
    ours = gguf_io.load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["the hat", "  an\tin  the\n\n<|im_start|>x", "ünïcode ✓ 12345"]:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
    assert ours.eos_token_id == theirs.eos_token_id


def test_single_digit_pre_tokenizer(tmp_path: Path) -> None:
    """llama.cpp splits digits one by one for the 'smollm' pre-tokenizer; so must we."""
    vocab = byte_level_vocab()
    vocab["tokens"] = vocab["tokens"] + ["12"]
    vocab["token_type"] = vocab["token_type"] + [1]
    vocab["merges"] = vocab["merges"] + ["1 2"]
    vocab["pre"] = "smollm"
    tiny = tiny_model("llama", vocab=len(vocab["tokens"]))
    path = write_tiny_gguf(tmp_path / "s.gguf", tiny.state, tiny.config, tokenizer=vocab)
    tok = gguf_io.load_tokenizer(path)
    ids = tok("x 12")["input_ids"]
    assert vocab["tokens"].index("12") not in ids
    assert tok.decode(ids) == "x 12"


# ----------------------------------------------------------------------------------------------
# Against transformers' own GGUF loading.
# ----------------------------------------------------------------------------------------------


def _transformers_gguf_load(path: Path, cls_model: Any, hf_config: Any) -> tuple[dict[str, np.ndarray], dict]:
    """transformers' own GGUF loading: `from_pretrained(gguf_file=...)` (needs accelerate), else the
    function it calls, `load_gguf_checkpoint`."""
    import importlib.util

    import torch

    if importlib.util.find_spec("accelerate") is not None:
        loaded = cls_model.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tensors = {k: v.detach().float().numpy() for k, v in loaded.state_dict().items()}
        return tensors, loaded.config.to_dict()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=cls_model(hf_config))
    tensors = {k: v.float().numpy() for k, v in parsed["tensors"].items()}
    return tensors, parsed["config"]


@pytest.mark.parametrize("arch,kv_heads,tie", [("llama", 2, True), ("llama", 1, False), ("llama", 4, True),
                                               ("qwen2", 2, False)])
def test_matches_transformers_from_pretrained_gguf(tmp_path: Path, arch: str, kv_heads: int, tie: bool) -> None:
    """A transformers random model -> GGUF (like llama.cpp) -> our reader == its state dict ==
    transformers' own GGUF loader."""
    torch = pytest.importorskip("torch")
    import transformers

    vocab = byte_level_vocab()
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    hf_config = cls_cfg(vocab_size=len(vocab["tokens"]), hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads,
                        max_position_embeddings=128, tie_word_embeddings=tie, rms_norm_eps=1e-5,
                        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf_model = cls_model(hf_config).eval()
    reference = {k: v.detach().numpy() for k, v in hf_model.state_dict().items() if "rotary" not in k}
    path = write_tiny_gguf(tmp_path / "m.gguf", hf_model.state_dict(), hf_config, tokenizer=vocab)

    ours = gguf_io.read_gguf(path, progress=False)
    expected_names = set(reference) - ({"lm_head.weight"} if tie else set())
    assert set(ours.tensors) == expected_names
    for name in expected_names:
        np.testing.assert_array_equal(ours.tensors[name], reference[name], err_msg=name)
    assert ours.config["tie_word_embeddings"] == tie

    theirs, their_config = _transformers_gguf_load(path, cls_model, hf_config)
    for name in expected_names:
        np.testing.assert_array_equal(ours.tensors[name], theirs[name], err_msg=name)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert ours.config[key] == their_config[key], key
    # and the loaded transformers model can be built from our config dict
    rebuilt = cls_model(cls_cfg(**{k: v for k, v in ours.config.items() if k != "architectures"}))
    rebuilt.load_state_dict({k: torch.from_numpy(v) for k, v in ours.tensors.items()}, strict=False)
    tokens = torch.tensor([[5, 9, 40, 100, 7]])
    with torch.no_grad():
        np.testing.assert_allclose(rebuilt(tokens).logits.numpy(), hf_model(tokens).logits.numpy(), atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Real model (network; see jaxspec.fetch).
# ----------------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_smollm2_gguf() -> None:
    from jaxspec.fetch import fetch_gguf

    path = fetch_gguf("smollm2-135m-instruct")
    f = gguf_io.GGUFFile(path)
    c = f.config
    assert (c["model_type"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["head_dim"], c["vocab_size"], c["max_position_embeddings"], c["tie_word_embeddings"]) == (
        "llama", 30, 9, 3, 64, 49152, 8192, True)
    q = f.read_tensor("blk.0.attn_q.weight")
    assert q.shape == (576, 576) and np.isfinite(q).all()
    tok = f.tokenizer()
    assert tok.decode(tok("Hello, world!")["input_ids"]) == "Hello, world!"
