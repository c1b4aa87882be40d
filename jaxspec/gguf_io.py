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
# Control-token texts llama.cpp's vocabulary loader adds to its end-of-generation set.
_EOG_TEXTS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>",
                        "<|end|>", "<end_of_turn>", "<|return|>", "<|call|>", "<EOT>", "<|end_of_turn|>"})
# Tensors llama.cpp writes that carry no weights of an HF checkpoint.
_IGNORED_TENSORS = re.compile(r"^(blk\.\d+\.attn_rot_embd|rope_freqs)\.weight$")


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
            "eos_token_id": self._eos_token_ids(),
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

    def _eos_token_ids(self) -> int | list[int] | None:
        """The ids generation stops at, as llama.cpp collects its end-of-generation set: the file's
        EOS, EOT and EOM ids, and its control tokens spelled like a known end token (Qwen2.5's
        `<|endoftext|>` beside `<|im_end|>`, Llama 3.1's `<|eom_id|>` and `<|end_of_text|>`); the
        file's EOS first. One id stays an int, as in a config.json."""
        ids = [self._scalar(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        tokens, types = self._scalar("tokenizer.ggml.tokens"), self._scalar("tokenizer.ggml.token_type")
        if tokens and types and len(tokens) == len(types):
            ids += [i for i, (t, k) in enumerate(zip(tokens, types)) if k == TOKEN_CONTROL and t in _EOG_TEXTS]
        ids = list(dict.fromkeys(int(i) for i in ids if i is not None))
        return ids[0] if len(ids) == 1 else (ids or None)

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
            yarn_attn_factor = self._arch_key("rope.scaling.yarn_attn_factor")
            if yarn_attn_factor is not None:
                # llama.cpp's converter stores transformers' attention_factor (the whole factor) here
                scaling["attention_factor"] = _clean_float(yarn_attn_factor)
            elif attn_factor is not None:
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
        bad = array.size - int(np.count_nonzero(np.isfinite(array)))
        if bad:
            raise ValueError(
                f"{self.path}: tensor {info.name} ({info.tensor_type.name}) dequantizes to {bad} NaN or "
                "infinite values: the file is corrupt"
            )
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
        """The file's tokenizer metadata (`tokenizer.ggml.*`) under short names, or None if it has none.

        Keys: `tokenizer_type` (`tokenizer.ggml.model`: "gpt2" or "llama"), `pre_tokenizer_type`
        (`tokenizer.ggml.pre`), `tokens`, `scores`, `token_type`, `merges`, `bos_token_id`,
        `eos_token_id`, `unk_token_id`, `pad_token_id`, `add_prefix_space`; absent keys are left out.
        """
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

        Built with the `tokenizers` library from the vocabulary, merges and token types the file
        stores (see `build_tokenizer`), so it needs neither torch, nor network, nor transformers'
        GGUF internals. Raises `TokenizerError` (naming the remedy) when the metadata describes a
        tokenizer this module cannot rebuild exactly.
        """
        spec = self.tokenizer_dict()
        if spec is None:
            return None
        try:
            return build_tokenizer(
                spec,
                self.architecture,
                chat_template=self._scalar("tokenizer.chat_template"),
                add_bos_token=self._scalar("tokenizer.ggml.add_bos_token"),
                add_eos_token=self._scalar("tokenizer.ggml.add_eos_token"),
            )
        except TokenizerError as e:
            raise TokenizerError(f"{self.path}: {e}") from None

    def read(self, *, progress: bool = True) -> GGUFModel:
        """Everything at once: config, all tensors (float32), tokenizer, metadata."""
        tokenizer = self.tokenizer()  # before the (slow) tensors: a bad tokenizer fails fast
        tensors = dict(self.iter_tensors(progress=progress))
        return GGUFModel(config=dict(self.config), tensors=tensors, tokenizer=tokenizer, metadata=self.metadata)


# ----------------------------------------------------------------------------------------------
# Tokenizers from GGUF metadata.
# ----------------------------------------------------------------------------------------------


class TokenizerError(ValueError):
    """GGUF tokenizer metadata that cannot be rebuilt into the model's tokenizer."""


#: What to do when a GGUF's tokenizer cannot be rebuilt (part of every `TokenizerError`).
TOKENIZER_REMEDY = (
    "convert the model's Hugging Face folder (config.json, *.safetensors and tokenizer.json) instead, "
    "or convert without a tokenizer (`jaxspec convert --no-tokenizer`; prompts are then token ids)"
)

# llama.cpp's token types (`tokenizer.ggml.token_type`); 0 (undefined) counts as normal.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Split patterns of the byte-level BPE vocabularies, as in the models' own tokenizer.json files.
# Llama 3 (tiktoken style): contractions, letters with one leading non-letter, numbers of up to
# three digits, punctuation runs, newlines, spaces.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2: the same with every digit on its own.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's tekken: words split at case changes, single digits.
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclasses.dataclass(frozen=True)
class BPEStyle:
    """How a byte-level BPE vocabulary splits and merges text (one per `tokenizer.ggml.pre` family).

    Attributes:
      split: the regex that cuts text into words, or None for GPT-2's own (`ByteLevel`'s regex).
      single_digits: cut every digit off on its own first (SmolLM, StarCoder).
      nfc: NFC-normalize text first (Qwen2's tokenizer.json does).
      ignore_merges: a word that is a token as a whole is that token (tiktoken's rule: Llama 3).
      add_bos: whether llama.cpp adds BOS when the file has no `add_bos_token` flag.
    """

    split: str | None = None
    single_digits: bool = False
    nfc: bool = False
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2 = BPEStyle()
_DIGITS = BPEStyle(single_digits=True)
_LLAMA3 = BPEStyle(split=_LLAMA3_SPLIT, ignore_merges=True, add_bos=True)
_QWEN2 = BPEStyle(split=_QWEN2_SPLIT, nfc=True)
_TEKKEN = BPEStyle(split=_TEKKEN_SPLIT, ignore_merges=True, add_bos=True)

#: `tokenizer.ggml.pre` values of byte-level ("gpt2") vocabularies this module rebuilds exactly.
BPE_STYLES: dict[str, BPEStyle] = {
    "default": _GPT2, "gpt-2": _GPT2, "gpt2": _GPT2,
    "smollm": _DIGITS, "starcoder": _DIGITS, "refact": _DIGITS,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
    "tekken": _TEKKEN,
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level vocabularies spell tokens with it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _token_types(spec: dict[str, Any], n: int) -> list[int]:
    types = spec.get("token_type")
    if types is None:
        return [TOKEN_NORMAL] * n
    if len(types) != n:
        raise TokenizerError(f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    return [int(t) or TOKEN_NORMAL for t in types]


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    duplicates = 0
    for i, token in enumerate(tokens):
        if token in vocab:
            duplicates += 1
        else:
            vocab[token] = i
    if duplicates:
        logger.warning("%d GGUF tokens repeat an earlier token; their ids are never produced by encoding", duplicates)
    return vocab


def _file_merges(spec: dict[str, Any]) -> list[tuple[str, str]]:
    merges = []
    for m in spec.get("merges") or ():
        parts = m.split(" ")
        if len(parts) != 2:
            raise TokenizerError(f"merge {m!r} is not two tokens separated by one space")
        merges.append((parts[0], parts[1]))
    return merges


def _bpe_backend(spec: dict[str, Any]):  # noqa: ANN202 - tokenizers.Tokenizer
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pre = spec.get("pre_tokenizer_type", "default")
    style = BPE_STYLES.get(pre)
    if style is None:
        raise TokenizerError(
            f"its byte-level vocabulary names the pre-tokenizer {pre!r} (tokenizer.ggml.pre), whose word "
            f"splitting this converter does not know (it knows {', '.join(sorted(BPE_STYLES))})")
    if not spec.get("merges"):
        raise TokenizerError("its byte-level (gpt2) vocabulary has no merges (tokenizer.ggml.merges)")
    tokens = list(spec["tokens"])
    backend = Tokenizer(models.BPE(vocab=_vocab(tokens), merges=_file_merges(spec), ignore_merges=style.ignore_merges))
    if style.nfc:
        backend.normalizer = normalizers.NFC()
    if style.split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(style.split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif style.single_digits:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend, style.add_bos


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging over this vocabulary.

    SentencePiece (and llama.cpp's "llama" tokenizer) repeatedly merges the adjacent pair whose
    concatenation is the highest-scoring token. As a merge list: every split `(left, right)` of a
    normal token into two normal tokens, ranked by the token's score (best first). Pairs that make
    the same token share a score; SentencePiece takes the leftmost of two such pairs when they
    overlap, a merge list the one listed first (ordered here by the left piece's id), so the two can
    differ on a token that arises from two overlapping splits at once (e.g. `[ab][a][ba]` -> `aba`).
    """
    normal = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == TOKEN_NORMAL}
    ranked = []
    for token, i in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-float(scores[i]), i, normal[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_backend(spec: dict[str, Any], types: list[int]):  # noqa: ANN202 - tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = list(spec["tokens"])
    byte_tokens = {f"<0x{b:02X}>" for b in range(256)}
    missing = byte_tokens - set(tokens)
    if missing:
        raise TokenizerError(
            f"its SentencePiece vocabulary lacks {len(missing)} of the 256 byte tokens <0x00>..<0xFF> "
            "that unknown characters fall back to")
    if spec.get("merges"):
        merges = _file_merges(spec)
    elif spec.get("scores") is not None and len(spec["scores"]) == len(tokens):
        merges = spm_merges(tokens, spec["scores"], types)
    else:
        raise TokenizerError("its SentencePiece vocabulary has neither merges nor one score per token")
    unk_id = spec.get("unk_token_id")
    if unk_id is None:
        unk_id = next((i for i, k in enumerate(types) if k == TOKEN_UNKNOWN), None)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    backend = Tokenizer(models.BPE(vocab=_vocab(tokens), merges=merges, unk_token=unk, fuse_unk=True,
                                   byte_fallback=True))
    space_prefix = bool(spec.get("add_prefix_space", True))
    # llama.cpp: a space before every text that starts the input or follows a special token, then
    # every space spelled "▁" (the normalizer runs on each text between special tokens)
    replace = normalizers.Replace(" ", "▁")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if space_prefix else replace
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend, True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise


def build_backend(spec: dict[str, Any]):  # noqa: ANN202 - (tokenizers.Tokenizer, add_bos default)
    """A `tokenizers.Tokenizer` from GGUF tokenizer metadata (`GGUFFile.tokenizer_dict()`), with the
    file's control and user-defined tokens added whole, and llama.cpp's BOS default for it.

    Byte-level BPE ("gpt2") vocabularies get the split pattern of their `tokenizer.ggml.pre` family
    (`BPE_STYLES`); SentencePiece BPE ("llama") ones get merges from their scores (`spm_merges`),
    byte fallback and the "▁" space handling. Anything else raises `TokenizerError`.
    """
    from tokenizers import AddedToken

    tokens = list(spec.get("tokens") or ())
    if not tokens:
        raise TokenizerError("its tokenizer.ggml.tokens list is empty")
    types = _token_types(spec, len(tokens))
    kind = spec.get("tokenizer_type")
    if kind == "gpt2":
        backend, add_bos = _bpe_backend(spec)
    elif kind == "llama":
        backend, add_bos = _spm_backend(spec, types)
    else:
        raise TokenizerError(
            f"its tokenizer model {kind!r} (tokenizer.ggml.model) is not one this converter rebuilds "
            "(it rebuilds 'gpt2', byte-level BPE, and 'llama', SentencePiece BPE)")
    # llama.cpp matches control and user-defined tokens whole in the text, before any splitting;
    # a user-defined one that is the file's BOS / EOS / UNK / PAD is special too (skipped when
    # decoding with skip_special_tokens, as transformers' reload of the checkpoint treats it)
    roles = {spec.get(k) for k in ("bos_token_id", "eos_token_id", "unk_token_id",
                                   "pad_token_id")}
    added = [AddedToken(t, special=k == TOKEN_CONTROL or i in roles, normalized=False)
             for i, (t, k) in enumerate(zip(tokens, types))
             if k in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    if added:
        backend.add_tokens(added)
    return backend, add_bos


def build_tokenizer(
    spec: dict[str, Any],
    architecture: str | None = None,
    *,
    chat_template: str | None = None,
    add_bos_token: bool | None = None,
    add_eos_token: bool | None = None,
) -> PreTrainedTokenizerFast:
    """A `PreTrainedTokenizerFast` from GGUF tokenizer metadata (`GGUFFile.tokenizer_dict()`).

    The backend comes from `build_backend`; transformers' public `PreTrainedTokenizerFast(
    tokenizer_object=...)` wraps it with the file's BOS / EOS / UNK / PAD tokens, its chat
    template, and whether encoding adds BOS / EOS (`add_bos_token` / `add_eos_token`, or llama.cpp's
    default for the vocabulary when the file does not say). `architecture` is accepted for the
    callers that pass it; the tokenizer depends on the metadata only.

    Raises:
      TokenizerError: metadata this module cannot rebuild exactly (the message names the remedy).
    """
    del architecture
    from transformers import PreTrainedTokenizerFast

    try:
        backend, default_bos = build_backend(spec)
    except TokenizerError as e:
        raise TokenizerError(f"cannot build its tokenizer: {e}; {TOKENIZER_REMEDY}") from None
    tokens = spec["tokens"]

    def token(key: str) -> str | None:
        index = spec.get(key)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    kwargs: dict[str, Any] = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unk_token_id"), ("pad_token", "pad_token_id")):
        if (value := token(key)) is not None:
            kwargs[name] = value
    add_bos = default_bos if add_bos_token is None else bool(add_bos_token)
    add_eos = bool(add_eos_token)
    # the flags also go to tokenizer_config.json, which transformers 5 rebuilds the post-processor from
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                        add_bos_token=add_bos, add_eos_token=add_eos, **kwargs)
    _set_special_flags(tokenizer, add_bos, add_eos)
    if chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer


def _set_special_flags(tokenizer: PreTrainedTokenizerFast, add_bos: bool, add_eos: bool) -> None:
    """Make `tokenizer(text)` add BOS / EOS as the GGUF says (through the backend's post-processor)."""
    from tokenizers import processors

    bos = tokenizer.bos_token if add_bos else None
    eos = tokenizer.eos_token if add_eos else None
    first = [t for t in (bos,) if t is not None]
    last = [t for t in (eos,) if t is not None]
    single = [*first, "$A", *last]
    pair = [*first, "$A", *last, *first, "$B:1", *last]
    specials = [(t, tokenizer.convert_tokens_to_ids(t)) for t in dict.fromkeys([*first, *last])]
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=specials)


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
