"""Command-line argument types and checks shared by ``jaxspec generate / serve / convert / fetch``.

Every parser and check here turns a bad value into an error that names its option, and none of
them loads a model: the commands check all their arguments (values, paths, combinations, the
server extra) before the slow model load. Heavy modules are imported inside the functions, so
importing this module stays cheap.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

#: Storage / compute dtypes a checkpoint can be converted to or loaded as.
DTYPES = ("bfloat16", "float16", "float32")
#: uvicorn's log levels (``jaxspec serve --log-level``).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
#: What to install when the server's dependencies are missing.
SERVER_EXTRA = "pip install 'jaxspec[serve]'"


# ----------------------------------------------------------------------------- value types
def int_at_least(lo: int):
    """An argparse type: an int >= ``lo``."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {s!r}")
        return v

    parse.__name__ = f"int >= {lo}"
    return parse


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)


def nonneg_float(s: str) -> float:
    """A finite number >= 0 (``--temperature``)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {s!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {s!r}")
    return v


def top_p_arg(s: str) -> float:
    """``--top-p``: a number in (0, 1]."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {s!r}") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {s!r}")
    return v


def dtype_arg(s: str) -> str:
    """``--dtype``: bfloat16, float16 or float32."""
    if s not in DTYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(DTYPES)}, got {s!r}")
    return s


def port_arg(s: str) -> int:
    """``--port``: 0..65535 (0: any free port)."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535, got {s!r}") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0..65535, got {s!r}")
    return v


def probabilities_arg(s: str) -> list[float]:
    """Comma-separated probabilities in [0, 1] (``tree-search --acceptance 0.7,0.15,0.05``)."""
    try:
        values = [float(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated probabilities in [0, 1] (e.g. 0.7,0.15,0.05), got {s!r}") from None
    if not values or any(not 0.0 <= x <= 1.0 for x in values):
        raise argparse.ArgumentTypeError(f"must be comma-separated probabilities in [0, 1], got {s!r}")
    return values


def parse_tree(s: str | None):
    """``--tree``: an expansion config (``2,2,1``), a parents list or the path of a tree file."""
    if not s:
        return None
    try:
        return tuple(int(x) for x in s.split(","))
    except ValueError:
        return s  # a tree file from `jaxspec tree-search`


def _int_or_auto(s: str, least: int):
    """'auto', or an int >= ``least``."""
    if s.lower() == "auto":
        return "auto"
    try:
        v = int(s)
    except ValueError:
        v = least - 1
    if v < least:
        raise argparse.ArgumentTypeError(f"must be an int >= {least} or 'auto', got {s!r}")
    return v


def parse_gamma(s: str):
    """``--gamma``: an int >= 1 or 'auto'."""
    return _int_or_auto(s, 1)


def retrieve_arg(s: str):
    """``--retrieve``: 'auto' or an int >= 0 (context slots of retrieved blocks per draft step;
    `jaxspec.Speculation.retrieve`)."""
    return _int_or_auto(s, 0)


def window_arg(s: str):
    """``--window``: an int >= 0, or 'none' (a draft model with a full cache instead of a ring)."""
    return int_or_none_arg(s)


def int_or_none_arg(s: str):
    """An int >= 0, or 'none' (None)."""
    if s.lower() == "none":
        return None
    try:
        w = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int or 'none', got {s!r}") from None
    if w < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 or 'none', got {s!r}")
    return w


# ----------------------------------------------------------------------------- checks
def check_tree(value: str | None, option: str = "--tree"):
    """The `jaxspec.tree.TokenTree` that ``--tree`` describes (None for none); ValueError naming
    ``option`` for a malformed config, parents list or tree file."""
    parsed = parse_tree(value)
    if parsed is None:
        return None
    from jaxspec.tree import TokenTree

    try:
        if isinstance(parsed, str):
            path = pathlib.Path(parsed)
            if not path.is_file():
                raise ValueError(f"{parsed!r} is neither an expansion config (e.g. 2,2,1), a parents list "
                                 f"(--tree=-1,0,0,1) nor a tree file")
            try:
                data = json.loads(path.read_text())
                parents = data["parents"] if isinstance(data, dict) else data
                return TokenTree.from_parents(parents)
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"tree file {parsed!r} is not a tree (a JSON list of parents or "
                                 f"{{'parents': [...]}}): {e}") from None
        if parsed[0] == -1:
            return TokenTree.from_parents(list(parsed))
        if any(k < 1 for k in parsed):
            raise ValueError(f"expansion counts must be >= 1, got {value!r}")
        return TokenTree.from_expansion(list(parsed))
    except ValueError as e:
        raise ValueError(f"{option}: {e}") from None


def check_checkpoint(path: str, option: str) -> pathlib.Path:
    """``path`` must be a converted jaxspec checkpoint (it is not loaded)."""
    from jaxspec.fetch import CHECKPOINT_MARKER

    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{option}: no checkpoint at {p} (convert one with `jaxspec convert` "
                                f"or fetch one with `jaxspec fetch`; `jaxspec fetch --list` shows them)")
    if not (p / CHECKPOINT_MARKER).is_file():
        hint = (" (it looks like a Hugging Face folder: run `jaxspec convert` first)"
                if (p / "config.json").exists() else
                " (a .gguf file: run `jaxspec convert` first)" if p.suffix == ".gguf" else "")
        raise ValueError(f"{option}: {p} is not a jaxspec checkpoint ({CHECKPOINT_MARKER} is missing){hint}")
    return p


def _checkpoint_context(path) -> int | None:
    """The context length in a jaxspec checkpoint's config (read, not loaded), or None where
    it cannot be read cheaply (no --model yet: the default checkpoint is fetched later)."""
    if path is None:
        return None
    try:
        d = json.loads((pathlib.Path(path) / "jaxspec_config.json").read_text())["config"]
        v = d.get("max_position_embeddings")
        return int(v) if v else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_speculation(a) -> None:
    """``--draft / --gamma / --sink / --window / --retrieve / --tree``: checked with a
    ``--draft``, refused without one (speculation needs ``--draft self`` or a draft model)."""
    if getattr(a, "draft", None) is None:
        from jaxspec.speculation import Speculation
        given = [f"--{name}" for name, default in (
            ("gamma", Speculation.gamma), ("sink", Speculation.sink),
            ("window", Speculation.window), ("retrieve", Speculation.retrieve), ("tree", None))
            if getattr(a, name, default) != default]
        if given:
            raise ValueError(f"{', '.join(given)}: speculation options need --draft (self: the "
                             f"model drafts for itself; or a draft checkpoint)")
        return
    if a.draft != "self":
        check_checkpoint(a.draft, "--draft")
    sink, window, gamma = getattr(a, "sink", 0), getattr(a, "window", None), getattr(a, "gamma", 1)
    if sink is None or sink < 0:
        raise ValueError(f"--sink: must be an int >= 0, got {sink!r}")
    tree = check_tree(getattr(a, "tree", None))
    if tree is not None and gamma == "auto":
        raise ValueError("--gamma auto picks a chain length; it cannot be combined with --tree")
    if a.draft == "self":
        if window is not None and window + sink == 0:
            raise ValueError("--draft self needs --sink + --window > 0 context slots")
    elif window is not None:
        depth = tree.max_depth if tree is not None else None if gamma == "auto" else int(gamma)
        if depth is not None and window < depth + 2:
            what = "the --tree depth" if tree is not None else "--gamma"
            raise ValueError(f"--window {window}: a draft model with a ring-buffer cache needs --window >= "
                             f"{what} + 2 = {depth + 2} (or --window none for a full cache)")


def _check_text_prompts(a) -> None:
    from jaxspec.checkpoint import has_chat_template, has_tokenizer

    if not has_tokenizer(a.model):
        raise ValueError(f"model: {a.model} has no tokenizer, and --prompt takes text (convert the model "
                         f"with its tokenizer, or use the Python API with token ids)")
    if getattr(a, "chat", False) and not has_chat_template(a.model):
        raise ValueError(f"--chat: the tokenizer of {a.model} has no chat template")


def check_generate(a) -> None:
    """Everything of ``jaxspec generate`` that can be checked without loading the model."""
    if not a.prompt:
        raise ValueError("--prompt: give at least one --prompt")
    check_checkpoint(a.model, "model")
    _check_text_prompts(a)
    check_speculation(a)
    a.mesh = mesh_from_args(a)
    _check_invariant_mesh(a)


def _check_invariant_mesh(a) -> None:
    if getattr(a, "batch_invariant", False) and getattr(a, "mesh", None) is not None:
        raise ValueError("--batch-invariant does not support --tp / --dp yet (a tensor-parallel "
                         "product reduces across devices in an order of its own): run on one "
                         "device")


def merge_model_path(a) -> None:
    """``jaxspec serve CKPT`` is ``jaxspec serve --model CKPT``; both at once must agree."""
    path = getattr(a, "model_path", None)
    if path is None:
        return
    if getattr(a, "model", None) not in (None, path):
        raise ValueError(f"the checkpoint is given twice: {path!r} and --model {a.model!r}")
    a.model = path


def check_serve(a) -> None:
    """Everything of ``jaxspec serve`` that can be checked without loading the model."""
    merge_model_path(a)
    if getattr(a, "model", None) is not None:
        check_checkpoint(a.model, "--model")
    dtype = getattr(a, "dtype", None)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype: must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_speculation(a)
    for attr, lo, optional in (("max_batch", 1, True), ("max_len", 2, True), ("max_queue", 1, False),
                               ("rounds_per_chunk", 1, False), ("prefill_chunk", 1, True),
                               ("warmup_prefill", 0, False), ("page_size", 1, True),
                               ("kv_blocks", 1, True), ("prefill_budget", 1, True),
                               ("mixed_prefill", 0, True), ("mixed_stretch", 1, True)):
        if not hasattr(a, attr):
            continue
        v = getattr(a, attr)
        if (v is None and not optional) or (v is not None and v < lo):
            raise ValueError(f"--{attr.replace('_', '-')}: must be an int >= {lo}, got {v!r}")
    port = getattr(a, "port", 0)
    if port is not None and not 0 <= port <= 65535:
        raise ValueError(f"--port: must be a port number 0..65535, got {port!r}")
    if hasattr(a, "tp") or hasattr(a, "dp"):
        a.mesh = mesh_from_args(argparse.Namespace(tp=getattr(a, "tp", None),
                                                   dp=getattr(a, "dp", None)))
        d = 1 if a.mesh is None else int(a.mesh.shape["data"])
        if a.mesh is not None and getattr(a, "max_batch", None) and a.max_batch % d:
            raise ValueError(f"--max-batch {a.max_batch}: with --dp {d} the slots are split over "
                             f"{d} data-parallel groups; give a multiple of {d}")
        _check_invariant_mesh(a)
    blocks, page, max_len = (getattr(a, n, None) for n in ("kv_blocks", "page_size", "max_len"))
    if blocks and page and max_len:
        # the engine clamps max_len to the model's context: compare with what it will serve
        ctx = _checkpoint_context(getattr(a, "model", None))
        max_len = max_len if ctx is None else min(max_len, ctx)
    if blocks and page and max_len and blocks * page < max_len:
        # (the engine checks the exact need after the load: max_len plus a chunk's writes)
        raise ValueError(f"--kv-blocks {blocks}: {blocks} blocks of --page-size {page} hold "
                         f"{blocks * page} tokens, less than one sequence of --max-len {max_len}; "
                         f"give at least {-(-max_len // page)} blocks")
    if getattr(a, "page_size", None) is None:  # options of a block pool, without one
        given = [f"--{name.replace('_', '-')}" for name in (
            "kv_blocks", "prefill_budget", "mixed_prefill", "mixed_stretch", "fill_first")
            if getattr(a, name, None) not in (None, 0)]
        if given:
            raise ValueError(f"{', '.join(given)}: options of a paged K/V cache, which needs "
                             f"--page-size (the default serves dense slots)")
    level = getattr(a, "log_level", "info")
    if level is not None and level.lower() not in LOG_LEVELS:
        raise ValueError(f"--log-level: must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    if not getattr(a, "host", "x"):
        raise ValueError("--host: must not be empty")


def check_convert(a) -> None:
    """``jaxspec convert SRC DST``: the source is a .gguf file or a Hugging Face folder, the
    destination is free (or ``--overwrite``)."""
    src, dst = pathlib.Path(a.src), pathlib.Path(a.dst)
    if not src.exists():
        raise FileNotFoundError(f"src: {src} does not exist")
    if src.is_file() and src.suffix != ".gguf":
        raise ValueError(f"src: {src} is a file but not a .gguf file; give a Hugging Face folder or a .gguf file")
    if src.is_dir() and not (src / "config.json").is_file():
        raise FileNotFoundError(f"src: {src} has no config.json: not a Hugging Face model folder")
    from jaxspec.checkpoint import check_destination
    try:
        check_destination(dst, a.overwrite, src=src)
    except (OSError, ValueError) as e:
        raise type(e)(f"dst: {e}") from None


def check_fetch(a) -> None:
    """``jaxspec fetch NAME``: a known model name, a usable ``--dir``."""
    from jaxspec.fetch import model_spec

    if a.name:
        try:
            model_spec(a.name)
        except ValueError as e:
            raise ValueError(f"name: {e} (`jaxspec fetch --list` describes them)") from None
    folder = pathlib.Path(a.dir)
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"--dir: {folder} is a file")


def require_server_extra(command: str = "jaxspec serve") -> None:
    """Exit 2 with a one-line remedy (no traceback) when fastapi or uvicorn is not installed."""
    import importlib

    missing = []
    for module in ("fastapi", "uvicorn"):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        print(f"{command} needs the server extra: {SERVER_EXTRA} (missing: {', '.join(missing)})",
              file=sys.stderr)
        raise SystemExit(2)


def mesh_from_args(a):
    """``--tp N --dp M``: a data x model mesh (None when both are 1 or absent)."""
    tp, dp = a.tp, a.dp
    if tp is None and dp is None:
        return None
    if (tp is not None and tp < 1) or (dp is not None and dp < 1):
        raise ValueError(f"--tp and --dp must be >= 1, got --tp {tp} --dp {dp}")
    if (tp or 1) * (dp or 1) == 1:
        return None
    from jaxspec.sharding import make_mesh
    try:
        return make_mesh(data=dp or 1, model=tp)
    except ValueError as e:
        raise ValueError(f"--tp {tp} --dp {dp}: {e}") from None
