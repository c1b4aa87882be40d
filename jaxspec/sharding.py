"""Sharding over many devices: one ``("data", "model")`` mesh, one table of partition rules.

Laying out a model on a ``("data", "model")`` mesh (the mesh and the partition rules are
`jaxspec.mesh`). Tensor parallelism (Megatron-style) over ``model``: attention q/k/v by heads (output columns) and
o by rows, MLP gate/up by columns and down by rows, embedding and LM head by vocabulary; batch over
``data``. Every parameter and cache dimension has a *logical* axis name (`PARAM_AXES`,
`CACHE_AXES`) and `RULES` maps logical names to mesh axes. Arrays carry ``NamedSharding``s and XLA
(GSPMD/Shardy, ``AxisType.Auto``) inserts the collectives; attention runs per shard inside
``jax.shard_map`` (`per_shard_attention`), so a Pallas kernel sees only its own batch rows, KV
heads and their ``G * K`` query heads, with no communication.

KV heads that do not divide the model axis: when ``K < model`` and ``model % K == 0`` every KV head
is replicated ``model / K`` times, as vLLM does: the KV projections (``wk, wv, bk, bv``) are
widened to ``model`` heads (head ``j`` is a copy of original head ``j // (model / K)``) and the
config says ``num_kv_heads = model``; each device then holds exactly the one KV head its query
heads read, in weights and cache. This is exact: query head ``h`` reads widened head
``h // (H / model)``, a copy of original head ``h // (H / K)``. Checkpoints keep the original
shapes (`param_shardings` replicates ``wk/wv`` over ``model`` in that case), `shard_model`
widens after loading, and `jaxspec.save` of a widened model writes the original heads again
(``Model.kv_replicas``). Any other non-dividing count (query heads, or KV heads neither a multiple nor
a divisor of the model axis, e.g. SmolLM2's 9/3 heads on 2, 4 or 8 devices) is refused with a
`ShardingError` naming the numbers. MLP and vocabulary dimensions that do not divide are
replicated (correct, just not split).

Layer layout: the rules name a ``layers`` axis for the stacked ``[L, ...]`` leaves that the scanned
model runs, and `param_specs` also accepts per-layer leaves (``layers`` dropped). On GPU
`decode_params` splits the stacked leaves into per-layer arrays once (XLA copies slices of
stacked weights before their matmuls, tripling the weight traffic of a decode step); on a mesh
`unstack_layers` gives each per-layer array the rules' sharding, so tensor-parallel runs read the
weights the way single-GPU runs do. ``decode_params(model, layout=...)``
chooses either layout explicitly.

Multi-host: call ``jax.distributed.initialize(...)`` in every process first, then build the mesh
from the global device list (`make_mesh`) and load with ``jaxspec.load(path, mesh=mesh)``; every
process runs the same program on the same prompts (see README, "Multiple devices").
"""

from __future__ import annotations

import dataclasses
import functools
import weakref

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: F401 (re-exported)

from jaxspec.config import ModelConfig
from jaxspec.mesh import (AXES, CACHE_AXES, PARAM_AXES, RULES, ShardingError, active_mesh, leaf_name,  # noqa: F401
                          auto_axes, axis_size, batch_sharding, cache_sharding, cache_sharding_like,
                          cache_spec, check_config, fetch, logical_spec, make_mesh, mesh_of,
                          pad_batch, param_shardings, param_specs, per_shard_attention, put_batch,
                          use_mesh)
from jaxspec.model import Model, fuse_layer_params, unfuse_layer_params
from jaxspec.model import stack_layers as _stack, unstack_layers as _split

# ----------------------------------------------------------------------------- models
_KV_PARAMS = ("wk", "wv", "bk", "bv")


def _widen_array(x, K: int, Dh: int, r: int):
    """``[..., K * Dh]`` -> ``[..., K * r * Dh]``: each KV head repeated r times in place."""
    lead = x.shape[:-1]
    return jnp.repeat(x.reshape(*lead, K, Dh), r, axis=-2).reshape(*lead, K * r * Dh)


def _widen_kv(config: ModelConfig, params, r: int, mesh):
    """The params with KV projections widened from K to K * r heads (laid out on ``mesh``); the
    other leaves are the same arrays (no copy)."""
    widen = functools.partial(_widen_array, K=config.num_kv_heads, Dh=config.head_dim, r=r)
    wide = dataclasses.replace(config, num_kv_heads=config.num_kv_heads * r)
    abstract = jax.tree_util.tree_map_with_path(
        lambda p, x: jax.eval_shape(widen, x) if leaf_name(p) in _KV_PARAMS else x, params)
    shardings = param_shardings(wide, abstract, mesh)
    return wide, jax.tree_util.tree_map_with_path(
        lambda p, x, s: jax.jit(widen, out_shardings=s)(x) if leaf_name(p) in _KV_PARAMS else x,
        params, shardings)


def shard_model(model: Model, mesh) -> Model:
    """The model laid out on ``mesh`` (a new `Model` with ``.mesh`` set; ``jaxspec.generate``
    then runs sharded). KV heads fewer than the model axis are replicated vLLM-style: the
    returned config has ``num_kv_heads`` = model axis size (see the module docstring)."""
    if not isinstance(model, Model):
        raise TypeError(f"model must be a jaxspec.Model, got {type(model).__name__}")
    mesh = auto_axes(mesh)
    config = model.config
    check_config(config, mesh)
    m = axis_size(mesh, "model")
    params = unfuse_layer_params(model.params)  # fused columns would not follow the heads
    replicas = model.kv_replicas
    if config.num_kv_heads % m:  # K < m, m % K == 0: replicate KV heads
        r = m // config.num_kv_heads
        config, params = _widen_kv(config, params, r, mesh)
        replicas *= r
    shardings = param_shardings(config, params, mesh)
    if not _has_shardings(params, shardings):
        params = jax.device_put(params, shardings)
    return dataclasses.replace(model, config=config, params=params, mesh=mesh,
                               kv_replicas=replicas)


def narrow_kv(config: ModelConfig, params, r: int):
    """`shard_model`'s widening undone: ``(config, params)`` with the ``r`` copies of each KV
    head back to one (the shapes of the checkpoint the model came from)."""
    if r == 1:
        return config, params
    K, Dh = config.num_kv_heads, config.head_dim

    def narrow(x):
        lead = x.shape[:-1]
        return x.reshape(*lead, K, Dh)[..., ::r, :].reshape(*lead, (K // r) * Dh)
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: narrow(x) if leaf_name(p) in _KV_PARAMS else x, params)
    return dataclasses.replace(config, num_kv_heads=K // r), params


def _has_shardings(params, shardings) -> bool:
    ok = jax.tree_util.tree_map(
        lambda x, s: isinstance(getattr(x, "sharding", None), NamedSharding)
        and x.sharding.is_equivalent_to(s, x.ndim), params, shardings)
    return all(jax.tree_util.tree_leaves(ok))


# ----------------------------------------------------------------------------- layer layout
def unstack_layers(config: ModelConfig, params, mesh=None):
    """Stacked ``layers`` (``[L, ...]`` leaves) -> a list of per-layer dicts (the layout
    `jaxspec.model` runs with per-layer params; see `decode_params`), sliced in one jit. On a
    ``mesh`` the per-layer arrays carry the ``NamedSharding``s of the partition rules (with the
    rules' replicated ``layers`` axis every device slices its own shards: no communication);
    without one they stay where the stacked arrays are. The other leaves are returned as they
    are."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    L = jax.tree_util.tree_leaves(layers)[0].shape[0]
    out_shardings = None
    if mesh is not None:
        abstract = {n: jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for n, x in layers.items()}
        per_layer = param_shardings(config, {"layers": abstract}, mesh)["layers"]
        out_shardings = [dict(per_layer) for _ in range(L)]
    return {**params, "layers": jax.jit(lambda stacked: _split({"layers": stacked})["layers"],
                                        out_shardings=out_shardings)(dict(layers))}


def stack_layers(config: ModelConfig, params, mesh=None):
    """Inverse of `unstack_layers`: stacked ``[L, ...]`` leaves (on a ``mesh``: with the rules'
    shardings), in one jit."""
    params = unfuse_layer_params(params)
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)):
        return params
    L = len(layers)
    out_shardings = None
    if mesh is not None:
        abstract = {n: jax.ShapeDtypeStruct((L, *x.shape), x.dtype) for n, x in layers[0].items()}
        out_shardings = dict(param_shardings(config, {"layers": abstract}, mesh)["layers"])
    return {**params, "layers": jax.jit(lambda per_layer: _stack({"layers": per_layer})["layers"],
                                        out_shardings=out_shardings)([dict(l) for l in layers])}


_PREPARED: dict = {}  # id(model) -> (weakref(model), its weight arrays, mesh, prepared model)


def _same_arrays(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def prepare(model: Model, mesh=None) -> Model:
    """`shard_model` of ``model`` on ``mesh`` (default ``model.mesh``), cached per model object
    while its weights are the same arrays (a replaced array, or a replaced ``params``, lays it
    out again); the model itself when it is already laid out."""
    mesh = mesh if mesh is not None else model.mesh
    if mesh is None:
        return model
    mesh = auto_axes(mesh)
    leaves = tuple(jax.tree_util.tree_leaves(model.params))
    hit = _PREPARED.get(id(model))
    if (hit is not None and hit[0]() is model and _same_arrays(hit[1], leaves)
            and hit[2] == mesh):
        return hit[3]
    m = axis_size(mesh, "model")
    if (model.mesh == mesh and model.config.num_kv_heads % m == 0
            and _has_shardings(model.params, param_shardings(model.config, model.params, mesh))):
        return model
    out = shard_model(model, mesh)
    for k in [k for k, v in _PREPARED.items() if v[0]() is None]:
        del _PREPARED[k]
    _PREPARED[id(model)] = (weakref.ref(model), leaves, mesh, out)
    return out


LAYOUTS = ("auto", "scan", "unrolled")
DEFAULT_LAYOUT = "auto"  # the layout `decode_params` picks when none is given


def decode_params(model: Model, *, layout: str | None = None, fuse: bool = True):
    """The parameters of ``model`` in the layout decoding runs fastest with on this backend
    (``model.params`` is replaced by them, so no second copy is kept).

    ``layout="auto"``: on GPU the stacked layer weights are split once into per-layer arrays
    (XLA copies slices of stacked weights before each matmul, which triples the weight traffic
    of a decode step); elsewhere (CPU, TPU) the layers stay as they are (stacked and scanned
    unless already split). ``"unrolled"`` / ``"scan"`` force either layout on any backend and
    mesh. On a mesh the per-layer arrays keep the shardings of the partition rules
    (`unstack_layers`). On a single device the per-layer weights are also fused with ``fuse``
    (`jaxspec.model.fuse_layer_params`: wq|wk|wv and w_gate|w_up, three fewer matmuls per
    layer); a tensor-parallel split of fused columns would not follow the heads."""
    layout = DEFAULT_LAYOUT if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    per_layer = isinstance(model.params["layers"], (list, tuple))
    want = layout == "unrolled" or (layout == "auto" and (per_layer or jax.default_backend() == "gpu"))
    if want and not per_layer:
        model.params = unstack_layers(model.config, model.params, model.mesh)
    elif layout == "scan" and per_layer:
        model.params = stack_layers(model.config, model.params, model.mesh)
    if want and fuse and model.mesh is None and "wqkv" not in model.params["layers"][0]:
        model.params = fuse_layer_params(model.params, in_place=True)
    return model.params
