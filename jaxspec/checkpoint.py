"""Checkpoints: Hugging Face folders and GGUF files -> Orbax, and loading them back.

A converted checkpoint is a folder::

    jaxspec_config.json   {"format": 1, "config": <HF-style config>, "dtype": ..., "source": ...}
    params/               Orbax (StandardCheckpointer) tree, layout of `jaxspec.model`
    tokenizer.json ...    tokenizer files (when the source has a tokenizer)

`convert` writes into a temporary sibling folder and renames it into place only when everything
is written, so a failure or Ctrl-C leaves no half checkpoint behind (and an existing checkpoint
at ``dst`` is only replaced with ``overwrite=True``, after the new one is complete).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ConfigError, ModelConfig
from jaxspec.mesh import auto_axes, param_shardings
from jaxspec.model import Model, param_shapes, stack_layers

FORMAT_VERSION = 1
CONFIG_FILE = "jaxspec_config.json"
PARAMS_DIR = "params"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or corrupt."""


# ------------------------------------------------------------------------- HF name mapping
_LAYER_MAP = {  # HF suffix -> (our name, transpose)
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "self_attn.o_proj.bias": ("bo", False),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.bias": ("b_gate", False),
    "mlp.up_proj.bias": ("b_up", False),
    "mlp.down_proj.bias": ("b_down", False),
}
_TOP_MAP = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}


def _expected_layer_names(config: ModelConfig) -> list[str]:
    """The per-layer parameters the model of ``config`` has (its optional biases and norms
    included): the model's own parameter tree decides."""
    return list(param_shapes(config)["layers"])


def params_from_hf_tensors(config: ModelConfig, tensors: Iterator[tuple[str, np.ndarray]],
                           dtype=jnp.bfloat16, progress: bool = True) -> dict:
    """Builds our parameter tree (numpy, ``dtype``) from ``(hf_name, array)`` pairs."""
    np_dtype = jnp.dtype(dtype)
    L = config.num_layers
    layer_names = _expected_layer_names(config)
    stacked: dict[str, list] = {n: [None] * L for n in layer_names}
    top: dict[str, np.ndarray] = {}
    for name, arr in tensors:
        arr = np.asarray(arr)
        if name.startswith("model.layers."):
            rest = name[len("model.layers."):]
            idx, _, suffix = rest.partition(".")
            if suffix not in _LAYER_MAP:
                if suffix.endswith("rotary_emb.inv_freq"):
                    continue
                raise CheckpointError(f"unexpected tensor {name!r} for a {config.model_type} model")
            ours, transpose = _LAYER_MAP[suffix]
            if ours not in stacked:
                continue  # e.g. zero biases of a llama checkpoint with attention_bias=False
            i = int(idx)
            if not 0 <= i < L:
                raise CheckpointError(f"tensor {name!r} names layer {i} but the config has {L}")
            stacked[ours][i] = (arr.T if transpose else arr).astype(np_dtype)
        elif name in _TOP_MAP:
            ours, transpose = _TOP_MAP[name]
            top[ours] = (arr.T if transpose else arr).astype(np_dtype)
        else:
            raise CheckpointError(f"unexpected tensor {name!r} for a {config.model_type} model")
    missing = [f"model.layers.{i}.{n}" for n, lst in stacked.items() for i, a in enumerate(lst)
               if a is None]
    for need in ("embed", "final_norm"):
        if need not in top:
            missing.append(need)
    if missing:
        raise CheckpointError(f"checkpoint is missing tensors: {', '.join(missing[:8])}"
                              + (" ..." if len(missing) > 8 else ""))
    params = {"embed": top["embed"], "final_norm": top["final_norm"],
              "layers": {n: np.stack(lst) for n, lst in stacked.items()}}
    if not config.tie_word_embeddings:
        if "lm_head" not in top:
            raise CheckpointError("config says untied embeddings but there is no lm_head.weight")
        params["lm_head"] = top["lm_head"]
    _check_shapes(config, params)
    return params


def _check_shapes(config: ModelConfig, params):
    want = param_shapes(config)
    want_flat = {jax.tree_util.keystr(k): v.shape
                 for k, v in jax.tree_util.tree_flatten_with_path(want)[0]}
    got_flat = {jax.tree_util.keystr(k): v.shape
                for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    if set(want_flat) != set(got_flat):
        raise CheckpointError(f"parameter names differ from the model's: "
                              f"missing {sorted(set(want_flat) - set(got_flat))}, "
                              f"unexpected {sorted(set(got_flat) - set(want_flat))}")
    for k, shape in want_flat.items():
        if tuple(got_flat[k]) != tuple(shape):
            raise CheckpointError(f"parameter {k} has shape {tuple(got_flat[k])}, the config "
                                  f"implies {tuple(shape)}")


def _iter_safetensors(folder: pathlib.Path, progress: bool) -> Iterator[tuple[str, np.ndarray]]:
    from safetensors import safe_open
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted(set(weight_map.values()))
    else:
        # as transformers: model*.safetensors only (Mistral repos also ship consolidated.safetensors
        # in their own naming; a LoRA folder adapter_model.safetensors)
        files = sorted(p.name for p in folder.glob("model*.safetensors")) or sorted(
            p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {folder}")
    names = []
    for f in files:
        if not (folder / f).exists():
            raise CheckpointError(f"safetensors shard {f} listed in the index is missing")
        try:
            with safe_open(folder / f, framework="np") as sf:
                names += [(f, n) for n in sf.keys()]
        except Exception as e:  # noqa: BLE001 - safetensors raises several types
            raise CheckpointError(f"cannot read {folder / f}: {e}") from None
    bar = _progress(len(names), "reading safetensors", progress)
    handles = {}
    try:
        for f, n in names:
            if f not in handles:
                handles[f] = safe_open(folder / f, framework="np")
            try:
                arr = handles[f].get_tensor(n)
            except TypeError:  # bf16 without numpy support in this safetensors: go through torch-free path
                arr = _read_bf16_tensor(folder / f, n)
            bar.update(1)
            yield n, arr
    finally:
        bar.close()


def _read_bf16_tensor(path: pathlib.Path, name: str) -> np.ndarray:
    import struct as _struct
    with open(path, "rb") as fh:
        n = _struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(n))
        info = header[name]
        start, end = info["data_offsets"]
        fh.seek(8 + n + start)
        raw = np.frombuffer(fh.read(end - start), dtype=np.uint16)
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])


class _NoBar:
    def update(self, n=1):
        pass

    def close(self):
        pass


def _progress(total, desc, enabled):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="tensor", leave=False)


#: Files whose presence means a folder has a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether a model folder or checkpoint has tokenizer files (without loading them)."""
    folder = pathlib.Path(folder)
    return any((folder / f).exists() for f in TOKENIZER_FILES)


def has_chat_template(folder: str | os.PathLike) -> bool:
    """Whether a folder's tokenizer files carry a chat template (without loading them)."""
    folder = pathlib.Path(folder)
    if (folder / "chat_template.jinja").exists() or (folder / "chat_template.json").exists():
        return True
    config = folder / "tokenizer_config.json"
    try:
        return bool(config.exists() and json.loads(config.read_text()).get("chat_template"))
    except (json.JSONDecodeError, OSError):
        return False


def _load_hf_tokenizer(folder: pathlib.Path, *, strict: bool = False):
    """The tokenizer of a Hugging Face folder or a checkpoint, or None when it has no tokenizer files.

    A tokenizer class this transformers does not know (a checkpoint written under another major
    version) is read as the generic `PreTrainedTokenizerFast` from its tokenizer.json. A tokenizer
    that still cannot be read raises `CheckpointError` with ``strict`` (conversion), else warns and
    gives None (loading a checkpoint: its weights stay usable with token-id prompts).
    """
    folder = pathlib.Path(folder)
    if not has_tokenizer(folder):
        return None
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - transformers raises many types for unreadable files
        error = e
    if (folder / "tokenizer.json").exists():
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(folder))
        except Exception:  # noqa: BLE001
            pass
    message = f"cannot load the tokenizer in {folder}: {type(error).__name__}: {str(error)[:300]}"
    if strict:
        raise CheckpointError(f"{message}; fix or remove its tokenizer files, or convert without a "
                              f"tokenizer (`jaxspec convert --no-tokenizer`; prompts are then token ids)")
    import warnings
    warnings.warn(f"{message}; string prompts will not work with this model", stacklevel=3)
    return None


def save_tokenizer(tokenizer, folder: str | os.PathLike) -> None:
    """``tokenizer.save_pretrained(folder)``, readable by every transformers ``pyproject.toml`` allows.

    transformers 5 names the generic fast tokenizer class ``TokenizersBackend`` in
    tokenizer_config.json, which transformers 4 cannot load; both read ``PreTrainedTokenizerFast``
    (5 as an alias of ``TokenizersBackend``) as "the tokenizer in tokenizer.json".
    """
    folder = pathlib.Path(folder)
    tokenizer.save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text())
        if config.get("tokenizer_class") == "TokenizersBackend":
            config["tokenizer_class"] = "PreTrainedTokenizerFast"
            config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _with_generation_eos(config: ModelConfig, path: pathlib.Path) -> ModelConfig:
    """``config`` with the EOS ids of a folder's generation_config.json added: transformers'
    generate stops at those (Llama-3.x-Instruct, Qwen2.5 / Qwen3 list more there than config.json)."""
    if not path.exists():
        return config
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, OSError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a valid generation config: {e}") from None
    eos = eos if isinstance(eos, (list, tuple)) else [eos]
    ids = tuple(dict.fromkeys([*config.eos_token_ids, *(int(e) for e in eos if e is not None)]))
    return dataclasses.replace(config, eos_token_ids=ids)


# ------------------------------------------------------------------------- convert
def convert(src: str | os.PathLike, dst: str | os.PathLike, *, dtype: str = "bfloat16",
            overwrite: bool = False, progress: bool = True, tokenizer: bool = True) -> pathlib.Path:
    """Converts a Hugging Face folder (config.json + safetensors) or a ``.gguf`` file to Orbax.

    The source's tokenizer (the folder's tokenizer files, or the one a GGUF's metadata describes,
    chat template included) is saved with the weights. A tokenizer that cannot be read or rebuilt
    is an error that names the remedy, raised before any weight is read; ``tokenizer=False``
    converts the weights alone (prompts are then token ids). A source without any tokenizer gives
    a checkpoint without one, with a warning.

    Returns the checkpoint folder ``dst``. Atomic: on any error (or Ctrl-C) nothing is left at
    ``dst`` and an existing checkpoint there is untouched.
    """
    src = pathlib.Path(src)
    dst = pathlib.Path(dst)
    try:
        np_dtype = jnp.dtype(dtype)
    except TypeError:
        np_dtype = None
    if np_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise ValueError(f"unknown dtype {dtype!r} (use bfloat16, float16 or float32)")
    if not src.exists():
        raise FileNotFoundError(f"conversion source {src} does not exist")
    dst = check_destination(dst, overwrite, src=src)  # before the weights are read
    want_tokenizer, tokenizer = tokenizer, None
    if src.is_file():
        if src.suffix != ".gguf":
            raise ValueError(f"{src} is a file but not a .gguf file; give a Hugging Face folder "
                             f"or a .gguf file")
        from jaxspec.gguf_io import GGUFFile
        g = GGUFFile(src)  # streams one dequantized tensor at a time
        config = ModelConfig.from_hf_dict(g.config)
        if want_tokenizer:
            tokenizer = g.tokenizer()  # TokenizerError (a ValueError) names the remedy
        tensors = g.iter_tensors(progress=progress)
        source = {"kind": "gguf", "path": str(src.resolve())}
    else:
        cfg_path = src / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"{src} has no config.json: not a Hugging Face model folder")
        config = ModelConfig.from_json(cfg_path)
        config = _with_generation_eos(config, src / "generation_config.json")
        if want_tokenizer:
            tokenizer = _load_hf_tokenizer(src, strict=True)
        tensors = _iter_safetensors(src, progress)
        source = {"kind": "huggingface", "path": str(src.resolve())}
    if want_tokenizer and tokenizer is None:
        import warnings
        warnings.warn(f"{src} has no tokenizer: the checkpoint takes token-id prompts only", stacklevel=2)
    params = params_from_hf_tensors(config, tensors, dtype=np_dtype, progress=progress)

    meta = {"format": FORMAT_VERSION, "config": config.to_hf_dict(), "dtype": np_dtype.name,
            "source": source}
    return _write(dst, params, tokenizer, meta)


def check_destination(dst, overwrite: bool, *, src=None) -> pathlib.Path:
    """Where a checkpoint may be written (returned as an absolute path), checked before any work:
    a new or empty folder; with ``overwrite`` an existing jaxspec checkpoint too (replaced), never
    another folder (its files would be deleted), nor the source ``src`` or a folder holding it;
    a folder this process can create and write into."""
    dst = pathlib.Path(dst).absolute()
    if src is not None:
        s, d = pathlib.Path(src).resolve(), dst.resolve()
        if d == s or d in s.parents:
            raise ValueError(f"{dst} is the conversion source {src} or holds it: write the "
                             f"checkpoint to another folder")
    if dst.exists():
        if not dst.is_dir():
            raise FileExistsError(f"{dst} is a file")
        if any(dst.iterdir()):
            if not overwrite:
                raise FileExistsError(f"{dst} exists and is not empty; pass overwrite=True "
                                      f"(--overwrite) to replace the checkpoint there")
            if not (dst / CONFIG_FILE).is_file():
                raise FileExistsError(f"{dst} is not empty and not a jaxspec checkpoint (no "
                                      f"{CONFIG_FILE}): overwrite replaces only a checkpoint; "
                                      f"choose a new or empty folder")
    parent = dst.parent
    while not parent.exists():
        parent = parent.parent
    try:  # a real write (permissions alone do not tell for root, read-only mounts, ...)
        os.rmdir(tempfile.mkdtemp(prefix=".jaxspec-probe-", dir=parent))
    except OSError as e:
        raise PermissionError(f"cannot write a checkpoint under {parent}: {e.strerror}") from None
    return dst


def _write(dst: pathlib.Path, params, tokenizer, meta) -> pathlib.Path:
    """Writes a checkpoint into a temporary folder beside ``dst`` and moves it into place:
    on any error (or Ctrl-C) nothing is left at ``dst`` and a checkpoint there is untouched."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # (mkdtemp makes it 0700)
        _save_params(tmp / PARAMS_DIR, params)
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
        if dst.exists():
            old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        # Orbax's background writes can outlive an interrupt and create files in ``tmp`` again;
        # the process's exit joins their threads before it runs atexit hooks: remove it then too
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        raise
    return dst


def _save_params(path: pathlib.Path, params):
    import orbax.checkpoint as ocp
    tree = jax.tree_util.tree_map(jnp.asarray, params)
    ckptr = ocp.StandardCheckpointer()
    try:
        ckptr.save(path.resolve(), tree)
        ckptr.wait_until_finished()
    finally:
        # after an interrupt in the wait above Orbax's threads are still writing: they must end
        # before the caller removes the folder, or they would create it again
        while True:
            try:
                ckptr.wait_until_finished()
                ckptr.close()
                break
            except KeyboardInterrupt:  # a second Ctrl-C: the writes still end first
                continue
            except Exception:  # noqa: BLE001 - a failed write: the caller's error is the one
                break


def save(model_or_params, dst, config: ModelConfig | None = None, tokenizer=None,
         overwrite: bool = False) -> pathlib.Path:
    """Saves an in-memory model (e.g. random weights) as a jaxspec checkpoint (atomically)."""
    if isinstance(model_or_params, Model):
        params, config, tokenizer = (model_or_params.params, model_or_params.config,
                                     tokenizer or model_or_params.tokenizer)
        if model_or_params.kv_replicas > 1:  # widened by shard_model: the original KV heads
            from jaxspec.model import unfuse_layer_params
            from jaxspec.sharding import narrow_kv
            config, params = narrow_kv(config, unfuse_layer_params(params),
                                       model_or_params.kv_replicas)
    else:
        params = model_or_params
    params = stack_layers(params)
    if config is None:
        raise ValueError("save() needs the ModelConfig")
    _check_shapes(config, params)  # (a checkpoint that `load` could not read is refused here)
    dst = check_destination(dst, overwrite)
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    meta = {"format": FORMAT_VERSION, "config": config.to_hf_dict(),
            "dtype": jnp.dtype(dtype).name, "source": {"kind": "memory"}}
    return _write(dst, params, tokenizer, meta)


# ------------------------------------------------------------------------- load
def load(path: str | os.PathLike, *, dtype=None, mesh=None) -> Model:
    """Loads a converted checkpoint. ``dtype`` casts the weights; ``mesh`` restores them sharded."""
    path = pathlib.Path(path)
    if mesh is not None:
        mesh = auto_axes(mesh)  # (`jax.make_mesh`'s Explicit axes do not trace a decode step)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path} (convert one with `jaxspec convert` "
                                f"or fetch one with `jaxspec fetch`)")
    meta_path = path / CONFIG_FILE
    if not meta_path.exists():
        hint = " (it looks like a Hugging Face folder: run `jaxspec convert` first)" \
            if (path / "config.json").exists() else ""
        raise CheckpointError(f"{path} is not a jaxspec checkpoint: {CONFIG_FILE} is missing{hint}")
    try:
        meta = json.loads(meta_path.read_text())
        config = ModelConfig.from_hf_dict(meta["config"])
        stored_dtype = jnp.dtype(meta["dtype"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_path} is corrupt: {e}") from None
    except ConfigError as e:
        raise CheckpointError(f"{meta_path}: {e}") from None
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format {meta.get('format')}, this jaxspec "
                              f"reads format {FORMAT_VERSION}")
    params_dir = path / PARAMS_DIR
    if not params_dir.exists():
        raise CheckpointError(f"{path} is incomplete: {PARAMS_DIR}/ is missing")
    target_dtype = stored_dtype
    if dtype is not None:
        try:
            target_dtype = jnp.dtype(dtype)
        except TypeError:
            target_dtype = None
        if target_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                jnp.dtype(jnp.float32)):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
    from jaxspec import compile_cache
    abstract = compile_cache.cached("param_shapes", (config, str(stored_dtype)),
                                    lambda: param_shapes(config, stored_dtype))
    shardings = None
    if mesh is not None:
        shardings = param_shardings(config, abstract, mesh)
        abstract = jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    import orbax.checkpoint as ocp
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(params_dir.resolve(), abstract)
    except Exception as e:  # noqa: BLE001 - orbax raises many types for damaged files
        raise CheckpointError(f"cannot restore parameters from {params_dir}: "
                              f"{type(e).__name__}: {str(e)[:300]}") from None
    if target_dtype != stored_dtype:
        params = jax.tree_util.tree_map(lambda x: x.astype(target_dtype), params)
    from jaxspec.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(path) or _load_hf_tokenizer(path)
    return Model(config=config, params=params, tokenizer=tokenizer, path=path, mesh=mesh)
