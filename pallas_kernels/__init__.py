"""Attention kernels of jaxspec (Pallas: Triton and Mosaic GPU, Mosaic TPU) and their
plain-jnp references.

Layout:
  * entry points (``dispatch``): ``decode_attention``, ``paged_decode_attention`` (the same
    contract over a paged cache: a block pool and block tables), ``prefix_attention``,
    ``multi_level_prefix_attention``; the contracts are described in ``decode_attention.py``,
    ``triton_paged.py`` and ``prefix_attention.py``;
  * kernels: ``triton_decode``, ``triton_paged``, ``triton_prefix`` (all built from
    ``triton_core``),
    ``hopper`` (Mosaic GPU), ``tpu`` (Mosaic TPU);
  * ``reference``: one plain-jnp reference per contract; ``merge``: the exact
    log-sum-exp merge of partial attentions; ``splits``: flash-decoding key ranges;
  * ``contracts``: argument checks and query-row layouts; ``common``: constants and
    hardware probes.
"""
# The modules decode_attention and prefix_attention share their names with the entry-point
# functions. Importing a submodule binds it as an attribute of the package the first time it
# is loaded; loading these two here, before the functions are bound below, keeps
# `pallas_kernels.decode_attention` the function however the modules are imported later.
from . import decode_attention as _decode_attention_module  # noqa: F401
from . import prefix_attention as _prefix_attention_module  # noqa: F401
from .dispatch import (Route, decode_attention, decode_route, dispatch_platform,
                       multi_level_prefix_attention, paged_decode_attention,
                       paged_decode_route, prefix_attention, prefix_route, target_platform)
from .hopper import HopperBlockSizes
from .merge import merge_attention_states, merge_partials, merge_stacked
from .reference import (decode_attention_reference, paged_decode_attention_reference,
                        prefix_attention_reference)
from .tpu import (TPUDecodeBlockSizes, TPUPrefixBlockSizes, tpu_decode_attention,
                  tpu_prefix_attention, tpu_prefix_attention_pkld)
from .triton_decode import DecodeAttentionBlockSizes
from .triton_prefix import PrefixAttentionBlockSizes

__all__ = [
    "DecodeAttentionBlockSizes",
    "HopperBlockSizes",
    "PrefixAttentionBlockSizes",
    "Route",
    "TPUDecodeBlockSizes",
    "TPUPrefixBlockSizes",
    "decode_attention",
    "decode_attention_reference",
    "decode_route",
    "dispatch_platform",
    "merge_attention_states",
    "merge_partials",
    "merge_stacked",
    "multi_level_prefix_attention",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_decode_route",
    "prefix_attention",
    "prefix_attention_reference",
    "prefix_route",
    "target_platform",
    "tpu_decode_attention",
    "tpu_prefix_attention",
    "tpu_prefix_attention_pkld",
]
