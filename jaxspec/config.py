"""ModelConfig: one configuration for the LLaMA family, spelled the way Hugging Face spells it.

Supported `model_type`s: ``llama`` (Llama-2, Llama-3.x, SmolLM2; ``attention_bias`` and
``mlp_bias`` as transformers reads them), ``qwen2`` (bias on q/k/v), ``qwen3`` (RMSNorm of each
query and key head before RoPE; ``attention_bias`` as Llama's) and ``mistral``. GQA / MQA
follow from ``num_key_value_heads``; embeddings may be tied or untied; ``head_dim`` may differ from
hidden / heads. RoPE scaling (``rope_scaling`` / transformers 5's ``rope_parameters``): ``linear``,
``llama3`` and ``yarn`` (with its attention factor); ``dynamic`` and ``longrope`` are refused,
as are activations other than SiLU and partial rotary embeddings.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import math
import pathlib
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
_ROPE_TYPES = ("default", None, "linear", "llama3", "yarn")
_REFUSED_ROPE_TYPES = {
    "dynamic": ": dynamic NTK scaling changes every frequency with the batch's longest sequence, "
               "so one cached key would need different rotations at different steps",
    "longrope": ": LongRoPE's per-frequency factors switch at the original context (Phi-3)",
}
_ACTIVATIONS = ("silu", "swish")
# transformers' defaults (its config classes) for fields that change what jaxspec computes
_HF_DEFAULTS = {"llama": {"max_position_embeddings": 2048},
                "qwen2": {"max_position_embeddings": 32768},
                "qwen3": {"max_position_embeddings": 32768},
                "mistral": {"max_position_embeddings": 131072, "sliding_window": 4096}}


def _token_id(v, name: str) -> int:
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 0:
        raise ConfigError(f"config field {name!r} must be a token id or a list of them, got "
                          f"{v!r}")
    return int(v)


def _first_id(v):
    if isinstance(v, (list, tuple)):
        v = v[0] if v else None
    return None if v is None else _token_id(v, "bos_token_id")


class ConfigError(ValueError):
    """A model configuration that jaxspec cannot run."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a LLaMA-family decoder. Frozen and hashable (a static jit argument)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Hashable form of HF's rope_scaling dict: tuple of sorted (key, value) pairs, or None.
    rope_scaling: tuple | None = None
    # Per-frequency divisors [head_dim / 2] of the inverse frequencies, applied after
    # rope_scaling (llama.cpp's `rope_freqs` tensor, e.g. from a Llama-3.1 GGUF whose factors are
    # not of the llama3 form); None: none. Not an HF field: config.json keeps it as
    # "rope_freq_factors".
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # bias on q/k/v (Qwen2 always; Llama's `attention_bias`, which also puts one on o_proj:
    # `attention_out_bias`)
    attention_bias: bool = False
    mlp_bias: bool = False  # Llama's `mlp_bias`: bias on gate/up/down
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None

    def __post_init__(self):
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.model_type!r}; jaxspec supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.mlp_bias and self.model_type != "llama":
            raise ConfigError(f"mlp_bias is a llama option; a {self.model_type} MLP has no bias")
        if self.rope_scaling is not None:
            rs = self.rope_scaling_dict
            rtype = rs.get("rope_type", rs.get("type"))
            if rtype not in _ROPE_TYPES:
                why = _REFUSED_ROPE_TYPES.get(rtype, "")
                raise ConfigError(f"unsupported rope_scaling type {rtype!r}{why} (supported: "
                                  f"{', '.join(t for t in _ROPE_TYPES if t)})")
            if rtype in ("linear", "llama3", "yarn") and rs.get("factor") is None and not (
                    rtype == "yarn" and rs.get("original_max_position_embeddings")):
                raise ConfigError(f"rope_scaling of type {rtype!r} needs a 'factor'")
            if float(rs.get("partial_rotary_factor", 1.0)) != 1.0:
                raise ConfigError("partial rotary embeddings (partial_rotary_factor < 1) are not "
                                  "supported")
        if self.rope_freq_factors is not None:
            # a tuple of floats: the config is hashable (a static jit argument)
            object.__setattr__(self, "rope_freq_factors",
                               tuple(float(x) for x in np.ravel(self.rope_freq_factors)))
            f = np.asarray(self.rope_freq_factors, dtype=np.float64)
            if f.shape != (self.head_dim // 2,) or not np.all(np.isfinite(f)) or np.any(f <= 0):
                raise ConfigError(
                    f"rope_freq_factors must be {self.head_dim // 2} (head_dim / 2) positive finite "
                    f"numbers, got shape {f.shape}")

    # ---------------------------------------------------------------- derived
    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_out_bias(self) -> bool:
        """Whether o_proj has a bias: Llama's ``attention_bias`` puts one on q, k, v and o; Qwen2's
        q/k/v biases come without one."""
        return self.attention_bias and self.model_type in ("llama", "qwen3")

    @property
    def qk_norm(self) -> bool:
        """Whether each query and key head is RMS-normalized (own weights [head_dim]) before RoPE."""
        return self.model_type == "qwen3"

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling) if self.rope_scaling else {}

    def _yarn(self) -> tuple[float, float, float]:
        """YaRN's (factor, original context, attention factor), as transformers derives them."""
        rs = self.rope_scaling_dict
        original = float(rs.get("original_max_position_embeddings") or self.max_position_embeddings)
        factor = rs.get("factor")
        factor = float(factor) if factor is not None else self.max_position_embeddings / original

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn = rs.get("attention_factor")
        if attn is None:
            m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
            attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        return factor, original, float(attn)

    def rope_attention_factor(self) -> float:
        """The factor that scales RoPE's cos and sin (YaRN's attention temperature; else 1)."""
        rs = self.rope_scaling_dict
        return self._yarn()[2] if rs.get("rope_type", rs.get("type")) == "yarn" else 1.0

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies [head_dim/2] (float64 numpy), with linear / llama3 / yarn scaling
        and then `rope_freq_factors` applied."""
        d = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        rs = self.rope_scaling_dict
        rtype = rs.get("rope_type", rs.get("type"))
        if rtype == "yarn":
            # Frequencies that turn fewer than beta_slow times over the original context are
            # interpolated (divided by factor), those that turn more than beta_fast times kept,
            # with a linear ramp over the dimensions between.
            factor, original, _ = self._yarn()
            fast = float(rs.get("beta_fast") or 32)
            slow = float(rs.get("beta_slow") or 1)

            def dim_of(turns):  # the dimension index whose frequency turns `turns` times
                return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(self.rope_theta))

            lo, hi = dim_of(fast), dim_of(slow)
            if rs.get("truncate", True):
                lo, hi = math.floor(lo), math.ceil(hi)
            lo, hi = max(lo, 0), min(hi, d - 1)
            if lo == hi:
                hi += 0.001
            ramp = np.clip((np.arange(d // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
            keep = 1.0 - ramp  # 1: extrapolate (unchanged), 0: interpolate
            inv_freq = inv_freq / factor * (1.0 - keep) + inv_freq * keep
        elif rtype == "linear":
            inv_freq = inv_freq / float(rs["factor"])
        elif rtype == "llama3":
            factor = float(rs["factor"])
            low = float(rs.get("low_freq_factor", 1.0))
            high = float(rs.get("high_freq_factor", 4.0))
            old_ctx = float(rs.get("original_max_position_embeddings")
                            or self.max_position_embeddings)  # transformers' default
            low_wavelen = old_ctx / low
            high_wavelen = old_ctx / high
            wavelen = 2 * math.pi / inv_freq
            scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
            smooth = (old_ctx / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv_freq = np.where(is_medium, smoothed, scaled)
        if self.rope_freq_factors is not None:
            inv_freq = inv_freq / np.asarray(self.rope_freq_factors, dtype=np.float64)
        return inv_freq

    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = d * self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
        o = self.num_heads * self.head_dim * d
        per_layer = qkv + o + 3 * d * f + 2 * d
        if self.attention_bias:
            per_layer += self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
        if self.attention_out_bias:
            per_layer += d
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.mlp_bias:
            per_layer += 2 * f + d
        return self.num_layers * per_layer + v * d * (1 if self.tie_word_embeddings else 2) + d

    # ---------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict."""
        if not isinstance(d, dict):
            raise ConfigError(f"a model config is a JSON object of fields, got a "
                              f"{type(d).__name__}")
        model_type = d.get("model_type")
        if model_type is None:
            archs = d.get("architectures") or []
            raise ConfigError(f"config has no model_type (architectures={archs})")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {model_type!r}; jaxspec supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        act = d.get("hidden_act", d.get("hidden_activation", "silu"))
        if act not in _ACTIVATIONS:
            raise ConfigError(f"unsupported hidden_act {act!r}: jaxspec runs the SiLU-gated MLP of "
                              "the LLaMA family")
        if float(d.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ConfigError("partial rotary embeddings (partial_rotary_factor < 1) are not "
                              "supported")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            v = d.get(name)
            if name in d and v is not None and (not isinstance(v, numbers.Integral)
                                                or isinstance(v, bool) or v < 1):
                raise ConfigError(f"config field {name!r} must be a positive int, got {v!r}")
        for name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                     "intermediate_size"):
            if name in d and d[name] is None:
                raise ConfigError(f"config field {name!r} is null")
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            kv_heads = int(d.get("num_key_value_heads") or heads)
            # transformers' default where a config leaves it out: 128 for Qwen3, else hidden/heads
            head_dim = int(d.get("head_dim") or (128 if model_type == "qwen3" else
                                                 hidden // heads))
            eos = d.get("eos_token_id")
            eos_ids = tuple(_token_id(e, "eos_token_id")
                            for e in (eos if isinstance(eos, (list, tuple)) else [eos])
                            if e is not None)
            rope_scaling = d.get("rope_scaling")
            rope_theta = d.get("rope_theta")
            rope_params = d.get("rope_parameters")  # transformers >= 5 spelling
            if isinstance(rope_params, dict):
                rope_theta = rope_params.get("rope_theta", rope_theta)
                # transformers reads the legacy "type" key here too (standardize_rope_params)
                if rope_params.get("rope_type", rope_params.get("type", "default")) not in (
                        "default", None):
                    rope_scaling = rope_params
            if isinstance(rope_scaling, dict):
                rtype = rope_scaling.get("rope_type", rope_scaling.get("type"))
                if rtype in ("default", None):
                    rope_scaling = None
                else:
                    if rtype in ("llama3", "yarn") and d.get("original_max_position_embeddings"):
                        # a top-level pretraining length wins, as in transformers (Phi-3 style)
                        rope_scaling = {**rope_scaling, "original_max_position_embeddings":
                                        d["original_max_position_embeddings"]}
                    rope_scaling = tuple(sorted(
                        (k, v) for k, v in rope_scaling.items() if k != "rope_theta"))
            else:
                rope_scaling = None
            factors = d.get("rope_freq_factors")
            sliding = None
            # transformers' Mistral has no use_sliding_window field: it always slides
            if ((model_type == "mistral" or d.get("use_sliding_window", False))
                    and d.get("sliding_window")
                    and int(d["sliding_window"]) < int(d.get("max_position_embeddings") or 4096)):
                # (a window as long as the context never hides a key: full attention)
                sliding = int(d["sliding_window"])
                # Qwen2 slides only in the layers from max_window_layers on (transformers 5:
                # those `layer_types` names); transformers' Mistral slides in every layer.
                types = d.get("layer_types") if model_type != "mistral" else None
                if types is None and model_type in ("qwen2", "qwen3"):
                    first = int(d.get("max_window_layers", 28))
                    types = ["sliding_attention" if i >= first else "full_attention"
                             for i in range(int(d["num_hidden_layers"]))]
                if types is not None:
                    n_sliding = sum(t == "sliding_attention" for t in types)
                    if n_sliding == 0:
                        sliding = None
                    elif n_sliding != len(types):
                        raise ConfigError(
                            f"this {model_type} config slides its attention window ({sliding}) in "
                            f"{n_sliding} of {len(types)} layers (max_window_layers / layer_types); "
                            "jaxspec runs one window in every layer or none")
            return cls(
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                rope_freq_factors=tuple(float(f) for f in factors) if factors is not None else None,
                max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                # as transformers builds them: Qwen2 always has q/k/v biases, Mistral never
                attention_bias=(model_type == "qwen2" or model_type in ("llama", "qwen3")
                                and bool(d.get("attention_bias", False))),
                mlp_bias=model_type == "llama" and bool(d.get("mlp_bias", False)),
                # a list (a few configs) would make the config unhashable: keep its first id
                bos_token_id=_first_id(d.get("bos_token_id")),
                eos_token_ids=eos_ids,
                sliding_window=int(sliding) if sliding else None,
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing the field {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        d = {
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict or None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
        }
        if self.model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
        if self.rope_freq_factors is not None:
            d["rope_freq_factors"] = list(self.rope_freq_factors)
        if self.sliding_window:
            d["sliding_window"] = self.sliding_window
            d["use_sliding_window"] = True
            d["max_window_layers"] = 0  # every layer slides (Qwen2 spelling)
            d["layer_types"] = ["sliding_attention"] * self.num_layers
        return d

    @classmethod
    def from_json(cls, path: str | pathlib.Path) -> "ModelConfig":
        path = pathlib.Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no config file at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if isinstance(d, dict) and d.get("model_type") in _HF_DEFAULTS:
            # a Hugging Face config.json: the fields it leaves out take transformers' defaults
            # (a Mistral without "sliding_window" slides over 4096 tokens there). Not in
            # from_hf_dict: a jaxspec checkpoint's config writes no window when it has none.
            # A null context length is read as a missing one; a null window is no window.
            d = {**_HF_DEFAULTS[d["model_type"]],
                 **{k: v for k, v in d.items()
                    if v is not None or k != "max_position_embeddings"}}
        return cls.from_hf_dict(d)


def llama31_8b_shape(**overrides) -> ModelConfig:
    """The shape of Llama-3.1-8B (for random-weight benchmarks)."""
    kw = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
              num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
              rope_theta=500000.0,
              rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                            ("original_max_position_embeddings", 8192), ("rope_type", "llama3")),
              max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
              eos_token_ids=(128001, 128008, 128009))
    kw.update(overrides)
    return ModelConfig(**kw)


def sliding_window_of(config: ModelConfig) -> int | None:
    """The model's sliding attention window W (`jaxspec.attention.AttentionPlan.sliding_window`),
    or None when it has none or when W >= its context (``max_position_embeddings``: no two
    positions are W apart, the window never hides a key)."""
    W = config.sliding_window
    if W is None or W >= config.max_position_embeddings:
        return None
    return int(W)
