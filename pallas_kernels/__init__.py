"""Attention kernels of jaxspec, each beside its plain-jnp reference."""
from .decode_attention import (
    DecodeAttentionBlockSizes,
    decode_attention,
    decode_attention_reference,
)
from .hopper import HopperBlockSizes
from .merge import merge_attention_states, merge_stacked
from .prefix_attention import (
    PrefixAttentionBlockSizes,
    multi_level_prefix_attention,
    prefix_attention,
    prefix_attention_reference,
)
from .tpu import (
    TPUDecodeBlockSizes,
    TPUPrefixBlockSizes,
    target_platform,
    tpu_decode_attention,
    tpu_prefix_attention,
    tpu_prefix_attention_pkld,
)

__all__ = [
    "DecodeAttentionBlockSizes",
    "decode_attention",
    "decode_attention_reference",
    "HopperBlockSizes",
    "merge_attention_states",
    "merge_stacked",
    "PrefixAttentionBlockSizes",
    "multi_level_prefix_attention",
    "prefix_attention",
    "prefix_attention_reference",
    "TPUDecodeBlockSizes",
    "TPUPrefixBlockSizes",
    "target_platform",
    "tpu_decode_attention",
    "tpu_prefix_attention",
    "tpu_prefix_attention_pkld",
]
