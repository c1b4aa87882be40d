"""The ``("data", "model")`` mesh and the one table of partition rules.

Tensor parallelism (Megatron-style) over ``model``: attention q/k/v by heads (output columns) and
o by rows, MLP gate/up by columns and down by rows, embedding and LM head by vocabulary; batch over
``data``. Every parameter and cache dimension has a *logical* axis name (`PARAM_AXES`,
`CACHE_AXES`) and `RULES` maps logical names to mesh axes. Arrays carry ``NamedSharding``s and XLA
(GSPMD/Shardy, ``AxisType.Auto``) inserts the collectives; attention runs per shard inside
``jax.shard_map`` (`per_shard`), so a Pallas kernel sees only its own batch rows, KV heads and
their ``G * K`` query heads, with no communication.

This module knows meshes, specs and arrays only; laying out a whole model (KV-head replication,
the per-layer layout) is `jaxspec.sharding`.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxspec.config import ModelConfig

AXES = ("data", "model")

# Logical axis names of every parameter dimension (see the tree in jaxspec/model.py).
PARAM_AXES = {
    "embed": ("vocab", "hidden"),
    "lm_head": ("hidden", "vocab"),
    "final_norm": ("hidden",),
    "attn_norm": ("layers", "hidden"),
    "mlp_norm": ("layers", "hidden"),
    "wq": ("layers", "hidden", "heads"),
    "wk": ("layers", "hidden", "kv_heads"),
    "wv": ("layers", "hidden", "kv_heads"),
    "bq": ("layers", "heads"),
    "bk": ("layers", "kv_heads"),
    "bv": ("layers", "kv_heads"),
    "wo": ("layers", "heads", "hidden"),
    "bo": ("layers", "hidden"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "w_gate": ("layers", "hidden", "mlp"),
    "w_up": ("layers", "hidden", "mlp"),
    "w_down": ("layers", "mlp", "hidden"),
    "b_gate": ("layers", "mlp"),
    "b_up": ("layers", "mlp"),
    "b_down": ("layers", "hidden"),
}
CACHE_AXES = ("layers", "batch", "kv_heads", "seq", "head_dim")  # KVCache.k / .v [L, B, K, S, D]

# The one table: logical axis -> mesh axis (None: replicated).
RULES = {
    "batch": "data",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "vocab": "model",
    "hidden": None,
    "layers": None,
    "seq": None,
    "head_dim": None,
}


class ShardingError(ValueError):
    """A model / batch that cannot be laid out on the requested mesh."""


# ----------------------------------------------------------------------------- mesh
def make_mesh(data: int = 1, model: int | None = None, *, devices=None) -> Mesh:
    """A ``Mesh`` with axes ``("data", "model")`` over ``devices`` (default: all, of every
    process); ``model=None`` takes all devices the data axis leaves. Axes are ``AxisType.Auto``:
    the compiler propagates shardings from the arrays'."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if not isinstance(data, (int, np.integer)) or data < 1:
        raise ShardingError(f"data must be an int >= 1, got {data!r}")
    if model is None:
        if n % data:
            raise ShardingError(f"data={data} does not divide the {n} devices")
        model = n // data
    if not isinstance(model, (int, np.integer)) or model < 1:
        raise ShardingError(f"model must be an int >= 1, got {model!r}")
    if data * model > n:
        raise ShardingError(f"a {data} x {model} (data x model) mesh needs {data * model} devices; "
                            f"{n} are available")
    return jax.make_mesh((data, model), AXES, axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=devices[:data * model])


def auto_axes(mesh):
    """``mesh`` with ``AxisType.Auto`` axes (the compiler propagates the arrays' shardings,
    which jaxspec's layers rely on): ``jax.make_mesh`` gives Explicit axes by default, on which
    a decode step fails to trace; the same devices and axis names otherwise."""
    types = getattr(mesh, "axis_types", None)
    if not types or all(t == AxisType.Auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def axis_size(mesh, name) -> int:
    return int(dict(mesh.shape).get(name, 1)) if name is not None else 1


def check_config(config: ModelConfig, mesh) -> None:
    """Raises `ShardingError` when the query heads or KV heads of ``config`` cannot be split over
    the model axis (see the module docstring)."""
    m = axis_size(mesh, "model")
    H, K = config.num_heads, config.num_kv_heads
    if H % m:
        raise ShardingError(f"{H} attention heads do not divide over a model axis of {m} devices; "
                            f"use a model axis size that divides {H} (and put the remaining "
                            f"devices on the data axis)")
    if K % m and m % K:
        raise ShardingError(f"{K} KV heads cannot be split over a model axis of {m} devices: "
                            f"{K} is neither a multiple nor a divisor of {m} (KV heads are "
                            f"replicated only when {m} is a multiple of {K})")


def _mesh_axis(logical: str, size: int, mesh, config: ModelConfig | None):
    axis = RULES[logical]
    n = axis_size(mesh, axis)
    if axis is None or n == 1:
        return None
    if logical == "heads":
        return axis  # checked by check_config: num_heads % n == 0
    if logical == "kv_heads":
        return axis if config.num_kv_heads % n == 0 else None  # else replicated (then widened)
    if logical == "batch":
        if size % n:
            raise ShardingError(f"batch {size} does not divide over the data axis of {n} devices")
        return axis
    return axis if size % n == 0 else None  # mlp / vocab: replicate when it does not divide


def logical_spec(logical_axes, shape, mesh, config=None) -> P:
    return P(*(_mesh_axis(a, s, mesh, config) for a, s in zip(logical_axes, shape)))


def leaf_name(path) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))


def param_specs(config: ModelConfig, abstract_params, mesh):
    """``PartitionSpec`` of every parameter (same tree as ``abstract_params``)."""
    check_config(config, mesh)

    def spec(path, x):
        name = leaf_name(path)
        if name not in PARAM_AXES:
            raise ShardingError(f"no partition rule for parameter {jax.tree_util.keystr(path)}")
        axes = PARAM_AXES[name]
        if len(axes) == len(x.shape) + 1 and axes[0] == "layers":
            axes = axes[1:]  # per-layer arrays (the per-layer layout, `jaxspec.sharding.decode_params`)
        if len(axes) != len(x.shape):
            raise ShardingError(f"parameter {jax.tree_util.keystr(path)} has shape {x.shape}, "
                                f"expected axes {axes}")
        return logical_spec(axes, x.shape, mesh, config)
    return jax.tree_util.tree_map_with_path(spec, abstract_params)


def param_shardings(config: ModelConfig, abstract_params, mesh):
    """``NamedSharding`` of every parameter (used by `jaxspec.load` to restore sharded)."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s),
                                  param_specs(config, abstract_params, mesh),
                                  is_leaf=lambda x: isinstance(x, P))


def cache_spec(config: ModelConfig, mesh, batch: int | None = None) -> P:
    """Spec of ``KVCache.k`` / ``.v`` ``[L, B, K, S, D]``: batch over data, KV heads over model."""
    check_config(config, mesh)
    B = batch if batch is not None else axis_size(mesh, "data")
    shape = (config.num_layers, B, config.num_kv_heads, 1, config.head_dim)
    return logical_spec(CACHE_AXES, shape, mesh, config)


def cache_sharding(config: ModelConfig, mesh, batch: int | None = None) -> NamedSharding:
    return NamedSharding(mesh, cache_spec(config, mesh, batch))


def pool_sharding(config: ModelConfig, mesh) -> NamedSharding:
    """Sharding of a paged block pool ``[L, NB, K, BS, D]``: KV heads over model as a dense
    cache's, blocks replicated over data (any row's table may name any block)."""
    kv = cache_spec(config, mesh)[2]
    return NamedSharding(mesh, P(None, None, kv, None, None))


def mesh_of(params):
    """The ``("data", "model")`` mesh the params are sharded on, or None."""
    for leaf in jax.tree_util.tree_leaves(params):
        s = getattr(leaf, "sharding", None)
        if isinstance(s, NamedSharding) and set(AXES) <= set(s.mesh.axis_names):
            return s.mesh
        return None
    return None


def cache_sharding_like(config: ModelConfig, params, batch: int | None = None):
    """Cache sharding for a model whose params are ``params`` (None when they are not sharded)."""
    mesh = mesh_of(params)
    return None if mesh is None else cache_sharding(config, mesh, batch)


def batch_sharding(mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P("data", *([None] * (ndim - 1))))


def put_batch(tree, mesh, batch: int):
    """Puts every leaf with leading dimension ``batch`` batch-sharded over data (leaves that are
    already sharded, e.g. caches, keep their sharding), everything else replicated."""
    rep = NamedSharding(mesh, P())

    def put(x):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh == mesh:
            return x
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if x.ndim >= 1 and x.shape[0] == batch:
            return jax.device_put(x, batch_sharding(mesh, x.ndim))
        return jax.device_put(x, rep)
    return jax.tree_util.tree_map(put, tree)


def pad_batch(token_lists: list, mesh) -> list:
    """Pads the batch to a multiple of the data axis with one-token dummy prompts (the engine
    gives them no budget and drops them from the results)."""
    d = axis_size(mesh, "data")
    n = -len(token_lists) % d
    return list(token_lists) + [[0] for _ in range(n)]



def use_mesh(mesh):
    """Context in which ``mesh`` is the active mesh (`per_shard_attention` reads it)."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


def fetch(x) -> np.ndarray:
    """A (possibly multi-process) array as a host numpy array on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# ----------------------------------------------------------------------------- attention
def active_mesh():
    am = jax.sharding.get_abstract_mesh()
    if am is None or am.empty or not set(AXES) <= set(am.axis_names):
        return None
    if any(t == AxisType.Manual for t in am.axis_types):
        return None  # already inside a shard_map
    if am.size == 1:
        return None
    return am


def batch_axis(mesh, batch: int):
    """The mesh axis a batch of ``batch`` rows is split over inside attention's ``shard_map``:
    ``"data"``, or None (every data shard computes all the rows) when they do not divide over it,
    as one request prefilled alone into a server's slot."""
    return "data" if batch % axis_size(mesh, "data") == 0 else None


def mask_spec(mask, b):
    """Spec of an attention mask inside attention's ``shard_map``: a per-row ``[B, T, N]`` mask
    follows the rows (``b``, `batch_axis`), a mask shared by every row is replicated."""
    return P(b, None, None) if mask.ndim == 3 and mask.shape[0] != 1 else P()


def per_shard_attention(fn, q_BTHD, k_LBKSD, v_LBKSD, lengths, mask, layer, extra=(),
                        outs: str = "tokens"):
    """``fn(q, k, v, lengths, mask, layer, *extra) -> out[B, T, H, D]``, run per shard inside
    ``jax.shard_map`` when a ``("data", "model")`` mesh is active (batch over data unless it does
    not divide (`batch_axis`), KV heads and their query heads over model), else called
    directly. ``extra``: arrays laid out ``[B, K, ...]`` (per row and KV head). ``outs``: what
    ``fn`` returns: ``"tokens"`` (the output), ``"heads"`` (an array ``[B, K, N]`` instead) or
    ``"both"`` (the two)."""
    mesh = active_mesh()
    if mesh is None:
        return fn(q_BTHD, k_LBKSD, v_LBKSD, lengths, mask, layer, *extra)
    layer = jnp.asarray(layer, jnp.int32)
    b = batch_axis(mesh, q_BTHD.shape[0])
    kv = P(None, b, "model", None, None)
    args = [q_BTHD, k_LBKSD, v_LBKSD, lengths, layer, *extra]
    specs = [P(b, None, "model", None), kv, kv, P(b), P()]
    specs += [P(b, "model", *([None] * (x.ndim - 2))) for x in extra]
    n = len(extra)
    if mask is not None:
        mask = jnp.asarray(mask)
        args.append(mask)
        specs.append(mask_spec(mask, b))

    def body(q, k, v, ln, lay, *rest):
        return fn(q, k, v, ln, rest[n] if len(rest) > n else None, lay, *rest[:n])

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=_out_specs(outs, b),
                         check_vma=False)(*args)


def _out_specs(outs: str, b):
    """Specs of what a per-shard attention returns: its output ``[B, T, H, D]``, an array
    ``[B, K, N]`` per row and KV head, or both."""
    tok, heads = P(b, None, "model", None), P(b, "model", None)
    return {"tokens": tok, "heads": heads, "both": (tok, heads)}[outs]


def per_shard_paged_attention(fn, q_BTHD, k_pages, v_pages, block_table, lengths, mask, layer,
                              extra=(), outs: str = "tokens"):
    """`per_shard_attention` for a paged pool ``[L, NB, K, BS, D]`` read through
    ``block_table[B, MB]``: rows over data (`batch_axis`), KV heads over model, every block on
    every data shard (`pool_sharding`); ``extra`` and ``outs`` as there."""
    mesh = active_mesh()
    if mesh is None:
        return fn(q_BTHD, k_pages, v_pages, block_table, lengths, mask, layer, *extra)
    layer = jnp.asarray(layer, jnp.int32)
    b = batch_axis(mesh, q_BTHD.shape[0])
    pool = P(None, None, "model", None, None)
    args = [q_BTHD, k_pages, v_pages, block_table, lengths, layer, *extra]
    specs = [P(b, None, "model", None), pool, pool, P(b, None), P(b), P()]
    specs += [P(b, "model", *([None] * (x.ndim - 2))) for x in extra]
    n = len(extra)
    if mask is not None:
        mask = jnp.asarray(mask)
        args.append(mask)
        specs.append(mask_spec(mask, b))

    def body(q, k, v, table, ln, lay, *rest):
        return fn(q, k, v, table, ln, rest[n] if len(rest) > n else None, lay, *rest[:n])

    return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs),
                         out_specs=_out_specs(outs, b), check_vma=False)(*args)
