"""Read GGUF files (llama.cpp's format) into Hugging Face-shaped config, tensors and tokenizer.

The checkpoint converter (`jaxspec.checkpoint`) calls this module; it knows nothing of JAX.
What comes out looks exactly like a Hugging Face `LlamaForCausalLM` / `Qwen2ForCausalLM`
checkpoint would: a `config.json`-style dict, float32 numpy arrays named as in HF's safetensors
files (`model.layers.0.self_attn.q_proj.weight`, ...) in HF's `[out_features, in_features]`
orientation, and a `transformers.PreTrainedTokenizerFast`.

Three things llama.cpp's converter does that are undone here:

* **Dimension order.** GGUF lists a tensor's dimensions fastest-moving first (`[in, out]` for a
  linear layer); numpy lists them slowest first. `gguf.GGUFReader` already hands back data in
  numpy order, so a GGUF `[in, out]` matrix reads as numpy `[out, in]`: HF orientation as it is.
* **Quantization.** Weights are stored in blocks (Q4_0, Q4_K, Q6_K, ...); `gguf.quants.dequantize`
  turns them back into float32, one tensor at a time (`GGUFFile.iter_tensors` streams them).
* **Interleaved RoPE.** For the `llama` architecture (and `mistral`), llama.cpp rotates pairs of
  *adjacent* dimensions `(2i, 2i+1)` of each head, while Hugging Face rotates dimension `i` with
  `i + head_dim/2` ("rotate half"). So the converter reorders the output rows of `q_proj` and
  `k_proj` within each head; `unpermute_qk` reorders them back. `qwen2` files are not permuted
  (llama.cpp's qwen2 graph uses the rotate-half ("NEOX") RoPE itself).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import gguf
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

#: GGUF `general.architecture` values this reader understands, and the HF model class of each.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

#: Architectures whose q/k weights llama.cpp stores permuted for interleaved RoPE.
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama", "mistral"})

# GGUF tensor name -> HF tensor name. `{i}` is the layer index.
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
# Tensors llama.cpp writes that carry no weights of an HF checkpoint.
_IGNORED_TENSORS = re.compile(r"^(blk\.\d+\.attn_rot_embd|rope_freqs)\.weight$")

# llama.cpp's pre-tokenizer regexes that transformers' GGUF tokenizer builder does not know.
# SmolLM / StarCoder style: every digit on its own, then GPT-2's split.
_SINGLE_DIGIT_PRE_TYPES = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"})


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`).

    Returns None for a name this module does not know.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


# ----------------------------------------------------------------------------------------------
# The q/k row permutation of llama.cpp's converter.
# ----------------------------------------------------------------------------------------------


def _split_heads(w: np.ndarray, n_heads: int) -> tuple[int, tuple[int, ...]]:
    if w.shape[0] % n_heads or (w.shape[0] // n_heads) % 2:
        raise ValueError(
            f"cannot split {w.shape[0]} rows into {n_heads} heads of even size (shape {w.shape})"
        )
    return w.shape[0] // n_heads, tuple(w.shape[1:])


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp interleaved row order (what llama.cpp's converter does).

    Within each head of `head_dim = rows / n_heads` rows, row `i` of the first half goes to
    `2i` and row `head_dim/2 + i` of the second half to `2i + 1`. Works for weights
    `[rows, in]` and biases `[rows]`. For k, pass the number of KV heads.
    """
    head_dim, rest = _split_heads(w, n_heads)
    # [heads, half (which half), i] -> [heads, i, half]: new row index is 2*i + half.
    return w.reshape(n_heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of `permute_qk`: llama.cpp interleaved row order -> HF rotate-half row order."""
    head_dim, rest = _split_heads(w, n_heads)
    # rows are indexed 2*i + half within a head: [heads, i, half] -> [heads, half, i].
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------------------------
# Reading.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GGUFModel:
    """Everything `read_gguf` returns.

    Attributes:
      config: HF `config.json`-style dict (`model_type`, `hidden_size`, ...).
      tensors: HF safetensors name -> float32 array in HF orientation `[out, in]`.
      tokenizer: a `transformers.PreTrainedTokenizerFast` (with `chat_template` when the file
        has one), or None when the file carries no tokenizer.
      metadata: the file's scalar metadata (`general.name`, `qwen2.context_length`, ...); big
        arrays (the vocabulary) are summarised as `"<array of N>"`.
    """

    config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    tokenizer: PreTrainedTokenizerFast | None
    metadata: dict[str, Any]


def llama3_scaling_from_factors(factors: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any] | None:
    """HF's ``rope_scaling`` of type ``llama3`` that yields exactly these per-frequency divisors
    (llama.cpp's ``rope_freqs`` tensor, which its converter computes from that dict and stores
    without the dict), or None when no usual setting does (the caller then keeps the raw factors).

    Only the factors survive conversion, so the dict is found by trying the settings Meta ships
    and their neighbours; any dict that reproduces every factor gives the same model."""
    from jaxspec.config import ModelConfig

    factors = np.asarray(factors, dtype=np.float64)
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    base = dict(model_type="llama", vocab_size=1, hidden_size=head_dim, intermediate_size=1, num_layers=1,
                num_heads=1, num_kv_heads=1, head_dim=head_dim, rope_theta=float(rope_theta))
    plain = ModelConfig(**base).rope_inv_freq()
    for original in (8192, *(2**i for i in range(4, 21) if i != 13)):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0), (2.0, 8.0), (0.5, 4.0), (4.0, 8.0)):
            scaling = {"factor": _clean_float(factor), "high_freq_factor": high, "low_freq_factor": low,
                       "original_max_position_embeddings": original, "rope_type": "llama3"}
            scaled = ModelConfig(**base, rope_scaling=tuple(sorted(scaling.items()))).rope_inv_freq()
            if np.allclose(plain / scaled, factors, rtol=1e-5, atol=0):
                return scaling
    return None


def _clean_float(value: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


class GGUFFile:
    """One open GGUF file: metadata, config, tensors streamed one at a time, tokenizer.

    >>> f = GGUFFile("model.gguf")
    >>> f.config["num_hidden_layers"]
    >>> for name, array in f.iter_tensors(): ...
    """

    def __init__(self, path: str | os.PathLike[str]):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as e:  # gguf raises bare ValueError/struct errors on junk
            raise ValueError(f"{self.path} is not a readable GGUF file: {e}") from None
        arch = self._scalar("general.architecture")
        if arch is None:
            raise ValueError(f"{self.path} has no general.architecture in its metadata")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{self.path}: GGUF architecture {arch!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.architecture: str = arch
        self._tensor_infos = {t.name: t for t in self.reader.tensors}
        self._check_tensor_names()
        self.config: dict[str, Any] = self._build_config()

    # -- metadata -------------------------------------------------------------------------

    def _field(self, key: str) -> Any:
        return self.reader.fields.get(key)

    def _scalar(self, key: str, default: Any = None) -> Any:
        """A metadata value (str / int / float / bool, or a list for arrays), or `default`."""
        field = self._field(key)
        if field is None:
            return default
        return field.contents()

    def _arch_key(self, key: str, default: Any = None) -> Any:
        return self._scalar(f"{self.architecture}.{key}", default)

    @property
    def metadata(self) -> dict[str, Any]:
        """Scalar metadata; arrays longer than 64 entries are summarised as `"<array of N>"`."""
        import gguf

        out: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF."):
                continue
            if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data) > 64:
                out[key] = f"<array of {len(field.data)}>"
            else:
                out[key] = field.contents()
        return out

    def _require(self, key: str) -> Any:
        value = self._arch_key(key)
        if value is None:
            raise ValueError(f"{self.path}: metadata key {self.architecture}.{key} is missing")
        return value

    def _uniform(self, key: str, value: Any) -> int:
        """Per-layer arrays (some files store head counts per layer) must all be equal here."""
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"{self.path}: {self.architecture}.{key} varies by layer ({value}); not supported")
            value = value[0]
        return int(value)

    def _check_tensor_names(self) -> None:
        unknown = [n for n in self._tensor_infos if hf_tensor_name(n) is None and not _IGNORED_TENSORS.match(n)]
        if unknown:
            raise ValueError(
                f"{self.path}: tensors this {self.architecture} reader does not know: {unknown[:8]}"
                + (" ..." if len(unknown) > 8 else "")
            )

    def _build_config(self) -> dict[str, Any]:
        arch = self.architecture
        hidden = int(self._require("embedding_length"))
        heads = self._uniform("attention.head_count", self._require("attention.head_count"))
        kv_heads = self._uniform("attention.head_count_kv", self._arch_key("attention.head_count_kv", heads))
        head_dim = int(self._arch_key("attention.key_length", hidden // heads))
        tokens = self._field("tokenizer.ggml.tokens")
        embed = self._tensor_infos.get("token_embd.weight")
        if embed is None:
            raise ValueError(f"{self.path}: no token_embd.weight tensor")
        vocab = self._arch_key("vocab_size") or (len(tokens.data) if tokens else None) or int(embed.shape[1])
        config: dict[str, Any] = {
            "architectures": [SUPPORTED_ARCHITECTURES[arch]],
            "model_type": arch,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": self._uniform("feed_forward_length", self._require("feed_forward_length")),
            "num_hidden_layers": int(self._require("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": _clean_float(self._arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": _clean_float(self._arch_key("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._arch_key("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self._tensor_infos,
            "bos_token_id": self._scalar("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._scalar("tokenizer.ggml.eos_token_id"),
            "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in self._tensor_infos,
            "mlp_bias": arch == "llama" and "blk.0.ffn_up.bias" in self._tensor_infos,
        }
        pad = self._scalar("tokenizer.ggml.padding_token_id")
        if pad is not None:
            config["pad_token_id"] = pad
        rope_dims = self._arch_key("rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != head_dim:
            raise ValueError(
                f"{self.path}: partial rotary embedding (rope.dimension_count={rope_dims}, head_dim={head_dim}) "
                "is not supported"
            )
        rope_scaling = self._rope_scaling()
        if rope_scaling is not None:
            config["rope_scaling"] = rope_scaling
        if "rope_freqs.weight" in self._tensor_infos:
            factors = self._dequantize(self._tensor_infos["rope_freqs.weight"]).reshape(-1)
            if factors.shape != (head_dim // 2,) or not np.all(np.isfinite(factors)) or np.any(factors <= 0):
                raise ValueError(
                    f"{self.path}: rope_freqs must hold {head_dim // 2} (head_dim / 2) positive factors, "
                    f"got shape {factors.shape}"
                )
            llama3 = None if rope_scaling is not None else llama3_scaling_from_factors(
                factors, config["rope_theta"], head_dim)
            if llama3 is not None:
                config["rope_scaling"] = llama3
            elif not np.all(factors == 1.0):
                config["rope_freq_factors"] = [float(f) for f in factors]
        window = self._arch_key("attention.sliding_window")
        if window:
            config["sliding_window"] = int(window)
        return config

    def _rope_scaling(self) -> dict[str, Any] | None:
        """HF-style `rope_scaling` from `{arch}.rope.scaling.*` (or the older `rope.scale_linear`)."""
        kind = self._arch_key("rope.scaling.type")
        factor = self._arch_key("rope.scaling.factor")
        if kind is None and self._arch_key("rope.scale_linear") is not None:
            kind, factor = "linear", self._arch_key("rope.scale_linear")
        if kind in (None, "none") or factor is None or float(factor) == 1.0 and kind == "linear":
            return None
        scaling: dict[str, Any] = {"rope_type": kind, "factor": _clean_float(factor)}
        original = self._arch_key("rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        attn_factor = self._arch_key("rope.scaling.attn_factor")
        if kind == "yarn":
            for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
                value = self._arch_key(f"rope.scaling.{theirs}")
                if value is not None:
                    scaling[ours] = _clean_float(value)
            if attn_factor is not None:
                # llama.cpp multiplies its own YaRN magnitude 1 + 0.1 ln(factor) by attn_factor;
                # transformers' attention_factor is the whole product
                factor = float(factor)
                mscale = 1.0 if factor <= 1 else 1.0 + 0.1 * math.log(factor)
                scaling["attention_factor"] = float(attn_factor) * mscale
        elif attn_factor is not None:
            scaling["attention_factor"] = _clean_float(attn_factor)
        return scaling

    # -- tensors --------------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        """HF names of the tensors `iter_tensors` yields, in file order."""
        return [hf for n in self._tensor_infos if (hf := hf_tensor_name(n)) is not None]

    def tensor_shape(self, hf_name: str) -> tuple[int, ...]:
        """Numpy (HF) shape of a tensor without reading it."""
        for name, info in self._tensor_infos.items():
            if hf_tensor_name(name) == hf_name:
                return tuple(int(d) for d in reversed(info.shape.tolist()))
        raise KeyError(hf_name)

    def _dequantize(self, info: gguf.ReaderTensor) -> np.ndarray:
        from gguf import quants

        try:
            array = quants.dequantize(info.data, info.tensor_type)
        except NotImplementedError:
            raise ValueError(
                f"{self.path}: tensor {info.name} uses GGML type {info.tensor_type.name}, which the installed "
                "gguf package cannot dequantize"
            ) from None
        shape = tuple(int(d) for d in reversed(info.shape.tolist()))
        # F32 comes back as a view into the memory-mapped file: copy so the array owns its data.
        return np.array(array, dtype=np.float32, copy=True).reshape(shape)

    def read_tensor(self, gguf_name: str) -> np.ndarray:
        """One tensor, by its GGUF name, dequantized to float32, in HF orientation and row order."""
        info = self._tensor_infos[gguf_name]
        array = self._dequantize(info)
        if self.architecture in _PERMUTED_QK_ARCHITECTURES:
            match = _LAYER_RE.match(gguf_name)
            part = match.group(2) if match else ""
            if part.startswith("attn_q."):
                array = unpermute_qk(array, self.config["num_attention_heads"])
            elif part.startswith("attn_k."):
                array = unpermute_qk(array, self.config["num_key_value_heads"])
        return array

    def iter_tensors(self, *, progress: bool = True) -> Iterator[tuple[str, np.ndarray]]:
        """Yield `(hf_name, float32 array)` one tensor at a time (peak memory: one tensor)."""
        names = [n for n in self._tensor_infos if hf_tensor_name(n) is not None]
        bar = _progress(total=sum(int(self._tensor_infos[n].n_bytes) for n in names), enabled=progress,
                        desc=f"dequantize {self.path.name}", unit="B", unit_scale=True)
        try:
            for name in names:
                yield hf_tensor_name(name), self.read_tensor(name)  # type: ignore[misc]
                bar.update(int(self._tensor_infos[name].n_bytes))
        finally:
            bar.close()

    # -- tokenizer ------------------------------------------------------------------------

    def tokenizer_dict(self) -> dict[str, Any] | None:
        """The tokenizer metadata under the names transformers' GGUF tokenizer builder expects."""
        if self._field("tokenizer.ggml.tokens") is None:
            return None
        keys = {
            "tokenizer_type": "tokenizer.ggml.model",
            "pre_tokenizer_type": "tokenizer.ggml.pre",
            "tokens": "tokenizer.ggml.tokens",
            "scores": "tokenizer.ggml.scores",
            "token_type": "tokenizer.ggml.token_type",
            "merges": "tokenizer.ggml.merges",
            "bos_token_id": "tokenizer.ggml.bos_token_id",
            "eos_token_id": "tokenizer.ggml.eos_token_id",
            "unk_token_id": "tokenizer.ggml.unknown_token_id",
            "pad_token_id": "tokenizer.ggml.padding_token_id",
            "add_prefix_space": "tokenizer.ggml.add_space_prefix",
        }
        return {name: value for name, key in keys.items() if (value := self._scalar(key)) is not None}

    def tokenizer(self) -> PreTrainedTokenizerFast | None:
        """A `PreTrainedTokenizerFast` built from the file's tokenizer metadata, or None if it has none.

        Uses transformers' GGUF vocabulary builders (`convert_gguf_tokenizer`) on metadata read
        here, so it needs neither torch nor network, and fixes the pre-tokenizer for
        SmolLM/StarCoder-style vocabularies (digits split one by one, as llama.cpp does).
        """
        spec = self.tokenizer_dict()
        if spec is None:
            return None
        return build_tokenizer(
            spec,
            self.architecture,
            chat_template=self._scalar("tokenizer.chat_template"),
            add_bos_token=self._scalar("tokenizer.ggml.add_bos_token"),
            add_eos_token=self._scalar("tokenizer.ggml.add_eos_token"),
        )

    def read(self, *, progress: bool = True) -> GGUFModel:
        """Everything at once: config, all tensors (float32), tokenizer, metadata."""
        tensors = dict(self.iter_tensors(progress=progress))
        return GGUFModel(config=dict(self.config), tensors=tensors, tokenizer=self.tokenizer(), metadata=self.metadata)


def build_tokenizer(
    spec: dict[str, Any],
    architecture: str,
    *,
    chat_template: str | None = None,
    add_bos_token: bool | None = None,
    add_eos_token: bool | None = None,
) -> PreTrainedTokenizerFast:
    """A `PreTrainedTokenizerFast` from GGUF tokenizer metadata (`GGUFFile.tokenizer_dict()`)."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    try:
        backend, extra = convert_gguf_tokenizer(architecture, spec)
    except (ValueError, KeyError) as e:
        raise ValueError(f"cannot build a tokenizer from this GGUF's metadata: {e}") from None
    if spec.get("tokenizer_type") == "gpt2" and spec.get("pre_tokenizer_type") in _SINGLE_DIGIT_PRE_TYPES:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    tokens = spec["tokens"]

    def token(key: str) -> str | None:
        index = spec.get(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    kwargs: dict[str, Any] = dict(extra)
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unk_token_id"), ("pad_token", "pad_token_id")):
        if (value := token(key)) is not None:
            kwargs[name] = value
    if add_bos_token is None and spec.get("tokenizer_type") == "llama":
        add_bos_token = True  # sentencepiece vocabularies without the flag: llama.cpp adds BOS
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    _set_special_flags(tokenizer, bool(add_bos_token), bool(add_eos_token))
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def _set_special_flags(tokenizer: PreTrainedTokenizerFast, add_bos: bool, add_eos: bool) -> None:
    """Make `tokenizer(text)` add BOS / EOS as the GGUF says (through the backend's post-processor)."""
    from tokenizers import processors

    if not add_bos and not add_eos:
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
        return
    specials, single, pair = [], ["$A"], ["$A", "$B"]
    if add_bos and tokenizer.bos_token is not None:
        specials.append((tokenizer.bos_token, tokenizer.bos_token_id))
        single, pair = [tokenizer.bos_token, *single], [tokenizer.bos_token, "$A", tokenizer.bos_token, "$B"]
    if add_eos and tokenizer.eos_token is not None:
        specials.append((tokenizer.eos_token, tokenizer.eos_token_id))
        single.append(tokenizer.eos_token)
        pair = [*pair[: pair.index("$A") + 1], tokenizer.eos_token, *pair[pair.index("$A") + 1:], tokenizer.eos_token]
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=specials
    )


def _progress(*, total: int, enabled: bool, **kwargs: Any):  # noqa: ANN202
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, leave=False, **kwargs)


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Only the HF-style config dict of a GGUF file (no tensor data is read)."""
    return dict(GGUFFile(path).config)


def iter_tensors(path: str | os.PathLike[str], *, progress: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """Stream `(hf_name, float32 array)` from a GGUF file, one tensor at a time."""
    yield from GGUFFile(path).iter_tensors(progress=progress)


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerFast | None:
    """The tokenizer of a GGUF file (chat template attached), or None if it has none."""
    return GGUFFile(path).tokenizer()


def read_gguf(path: str | os.PathLike[str], *, progress: bool = True) -> GGUFModel:
    """Read a whole GGUF file: HF-style config, float32 tensors with HF names, tokenizer.

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a GGUF file, unsupported architecture, unknown tensors or quantization.
    """
    return GGUFFile(path).read(progress=progress)
