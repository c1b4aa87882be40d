"""jax's persistent compilation cache, kept under the jaxspec cache directory.

Compiling the decode loop, prefill and the server's programs takes seconds to minutes; with the
cache a second process on the same shapes loads them from disk instead. The command line
(`jaxspec generate / serve / convert / fetch`), `scripts/serve.py` and `jaxspec.generate` call
`enable()` first.

    enable()            -> $JAXSPEC_CACHE/xla (default ~/.cache/jaxspec/xla), or None when off

Finding a program in jax's cache still traces and lowers it (about a second for a Flax model on a
CPU). So `jaxspec.generate`'s prefill and decode loops go through `executable` / `call`, which
keep the compiled executables themselves in ``executables/`` beside that directory, keyed by the
function, its static arguments, its arguments' shapes, dtypes and shardings, jaxspec's source,
jax and the device: a later process runs them without tracing (single-device programs; only in
the directory `enable` chose).

Settings (environment):

* ``JAXSPEC_COMPILE_CACHE=0`` turns it off (``enable`` does nothing).
* A cache directory of your own (``JAX_COMPILATION_CACHE_DIR``, or
  ``jax.config.update("jax_compilation_cache_dir", ...)`` before ``enable``) is used as is.
* jax's own ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` and ``JAX_COMPILATION_CACHE_MAX_SIZE``
  are respected; unset, programs that take at least `MIN_COMPILE_SECONDS` to compile are kept, up
  to `MAX_BYTES` in all (least recently used ones go first).

The cache is trusted code: a directory others can write to lets them run code in your process
(jax's warning); the default lives in your home directory.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from pallas_kernels import hopper

log = logging.getLogger(__name__)

#: Programs that compile faster than this are not written to the cache (jax's default is 1 s;
#: jaxspec's prefill and sampling helpers take a few tenths of a second each, and many of them
#: run before the first token).
MIN_COMPILE_SECONDS = 0.2
#: Size bound of the cache directory (least recently used entries are evicted past it).
MAX_BYTES = 4 << 30
#: Environment variable that turns the cache off when set to 0 / false / no / off.
OPT_OUT = "JAXSPEC_COMPILE_CACHE"

_lock = threading.Lock()


def cache_dir() -> Path:
    """jaxspec's cache root (downloads, text sources, compiled programs): $JAXSPEC_CACHE, else
    ~/.cache/jaxspec."""
    return Path(os.environ.get("JAXSPEC_CACHE") or Path.home() / ".cache" / "jaxspec")


def default_dir() -> Path:
    """``<jaxspec cache>/xla``: ``$JAXSPEC_CACHE/xla``, else ``~/.cache/jaxspec/xla``."""
    return cache_dir() / "xla"


def disabled() -> bool:
    """Whether ``JAXSPEC_COMPILE_CACHE`` turns the cache off."""
    return os.environ.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off")


def enable(path: str | os.PathLike[str] | None = None) -> Path | None:
    """Turn on jax's persistent compilation cache; return the directory in use (None when off).

    Idempotent and cheap: call it before compiling anything (programs compiled earlier in the
    process are not written back). ``path`` replaces the default directory, but a directory the
    user configured for jax wins over both; ``JAXSPEC_COMPILE_CACHE=0`` makes this a no-op. A
    directory that cannot be created logs a warning and leaves the cache off.
    """
    if disabled():
        return None
    import jax

    with _lock:
        current = jax.config.jax_compilation_cache_dir
        if current:  # the user's (or an earlier call's): never replaced
            return Path(current)
        target = Path(path) if path is not None else default_dir()
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.warning("compilation cache off: cannot create %s (%s)", target, e)
            return None
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
        if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ and _has_filelock():  # jax evicts under a file lock
            jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
        jax.config.update("jax_compilation_cache_dir", str(target))
        log.debug("persistent compilation cache at %s", target)
        global _exec_dir
        _exec_dir = target.parent / "executables"
        return target


def _has_filelock() -> bool:
    import importlib.util

    return importlib.util.find_spec("filelock") is not None


# ----------------------------------------------------------------------------- executables
# jax's cache above saves compiling, but finding a program in it still traces and lowers the
# function (the cache key is the lowered module): for a Flax model that is about a second per
# program on a CPU. `executable` keeps the compiled executables themselves, keyed by what the
# program is made of without tracing it (see `_exec_key`), so a second process calls them at once.
#: Size bound of the executables directory (oldest used files go first past it).
EXEC_MAX_BYTES = 2 << 30
_code_hash: str | None = None
_exec_dir: Path | None = None


def _source_hash() -> str:
    """One hash of jaxspec's and pallas_kernels' source files (a program is what its code makes
    it: any change to them is a new key). Taken when `jaxspec` is imported, so it describes the
    code this process runs even if the files change while it runs."""
    global _code_hash
    if _code_hash is None:
        import hashlib

        import pallas_kernels

        h = hashlib.sha256()
        for pkg in (Path(__file__).parent, Path(pallas_kernels.__file__).parent):
            for f in sorted(pkg.rglob("*.py")):
                h.update(str(f.relative_to(pkg.parent)).encode())
                h.update(f.read_bytes())
        _code_hash = h.hexdigest()
    return _code_hash


#: jax settings that change what a function traces to (and so belong to an executable's key)
_TRACE_CONFIG = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                 "jax_threefry_partitionable", "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion")


def _exec_key(fn, args, static: dict, compiler_options) -> str | None:
    """The key of ``fn`` compiled for ``args`` (arrays; their shapes, dtypes, weak types,
    shardings and tree structure) and ``static`` (pickled: every field counts), with this code,
    jax, device and XLA flags; None when a part cannot be keyed (the program is then compiled as
    usual)."""
    import hashlib
    import pickle
    import sys

    import jax
    import jaxlib

    try:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        avals = []
        for x in leaves:
            if not isinstance(x, jax.Array):
                return None
            avals.append((x.shape, str(x.dtype), bool(getattr(x, "weak_type", False)),
                          repr(x.sharding)))
        static_bytes = pickle.dumps(sorted(static.items()), protocol=4)
    except Exception:  # noqa: BLE001 - anything unkeyable is simply not kept
        return None
    dev = jax.devices()[0]
    h = hashlib.sha256()
    for part in (f"{fn.__module__}.{getattr(fn, '__qualname__', fn)}", str(treedef), repr(avals),
                 repr(sorted((compiler_options or {}).items())), _source_hash(), jax.__version__,
                 jaxlib.__version__, sys.version, dev.platform, getattr(dev, "device_kind", ""),
                 str(jax.device_count()), os.environ.get("XLA_FLAGS", ""),
                 *(str(getattr(jax.config, name, None)) for name in _TRACE_CONFIG)):
        h.update(part.encode())
        h.update(b"\0")
    h.update(static_bytes)
    return h.hexdigest()


def exec_dir() -> Path | None:
    """Where `executable` keeps programs: ``executables`` beside the cache directory `enable`
    chose (None before `enable`, or when jax's cache directory is the user's own)."""
    import jax

    if _exec_dir is None or disabled() or \
            jax.config.jax_compilation_cache_dir != str(_exec_dir.parent / "xla"):
        return None
    return _exec_dir


def executable(fn, args: tuple, static: dict | None = None, compiler_options: dict | None = None):
    """``fn`` (a `jax.jit` function) compiled for ``args`` and its static keyword arguments
    ``static``: loaded from the executables directory when a process compiled it before with the
    same code, jax and device (no tracing), else lowered, compiled (through jax's cache) and
    saved there. Single-device programs only (on a mesh it just compiles)."""
    import jax

    static = static or {}
    folder = exec_dir()
    key = None
    if folder is not None and _on_default_device(args):
        key = _exec_key(fn, args, static, compiler_options)
    if key is not None:
        path = folder / f"{key}.bin"
        if path.exists():
            try:
                import pickle

                from jax.experimental import serialize_executable

                if jax.devices()[0].platform == "gpu":  # kernels' runtimes before loading
                    hopper.load_runtime()
                payload, in_tree, out_tree = pickle.loads(path.read_bytes())
                # on the one device it was compiled for (by default jax loads an executable
                # for every device of the backend: a host with several fails to run it)
                compiled = serialize_executable.deserialize_and_load(
                    payload, in_tree, out_tree, execution_devices=jax.devices()[:1])
                os.utime(path)  # (recently used)
                return compiled
            except Exception as e:  # noqa: BLE001 - a stale or damaged file: compile again
                log.debug("cannot load %s (%s); compiling", path, e)
    if key is None:
        return fn.lower(*args, **static).compile(compiler_options=compiler_options)
    # An executable jax loads from its own cache does not serialize whole on the CPU (loading it
    # back fails: "Function ... not found"), so the program must compile afresh here: on the CPU
    # an option that changes nothing in the code (how many parts LLVM compiles in parallel, any
    # count above the program's functions) is set from the key, which makes jax's cache key
    # unique to it; if jax's cache answers all the same (this file was lost), once more with the
    # next count. Elsewhere an executable from jax's cache is simply not kept.
    cpu = jax.devices()[0].platform == "cpu"
    _listen()
    for attempt in range(2 if cpu else 1):
        options = dict(compiler_options or {})
        if cpu:
            options["xla_cpu_parallel_codegen_split_count"] = \
                64 + (int(key[:6], 16) + attempt) % 4096
        _thread.hits = 0
        _thread.counting = True
        try:
            compiled = fn.lower(*args, **static).compile(compiler_options=options or None)
        finally:
            _thread.counting = False
        if not _thread.hits:
            _save_executable(compiled, folder, f"{key}.bin")
            break
    return compiled


_thread = threading.local()  # counting: jax's cache hits of this thread's `executable` compile
_listening = False


def _listen() -> None:
    global _listening
    with _lock:
        if _listening:
            return
        import jax

        def on_event(event: str, **_kw) -> None:
            if event == "/jax/compilation_cache/cache_hits" and getattr(_thread, "counting", False):
                _thread.hits += 1

        jax.monitoring.register_event_listener(on_event)
        _listening = True


def cached(name: str, key, compute):
    """``compute()``, kept in the executables directory under ``name`` and ``key`` (pickled) for
    later processes running the same code (a value that costs tracing, such as a model's
    parameter shapes); just ``compute()`` while that directory is off."""
    import hashlib
    import pickle

    folder = exec_dir()
    if folder is None:
        return compute()
    try:
        h = hashlib.sha256(pickle.dumps((name, key), protocol=4))
    except Exception:  # noqa: BLE001 - an unpicklable key: not kept
        return compute()
    import jax

    h.update(_source_hash().encode() + jax.__version__.encode())
    path = folder / f"{name}-{h.hexdigest()[:40]}.pkl"
    if path.exists():
        try:
            return pickle.loads(path.read_bytes())
        except Exception as e:  # noqa: BLE001 - damaged: computed again
            log.debug("cannot read %s (%s)", path, e)
    value = compute()
    try:
        _write(folder, path.name, pickle.dumps(value, protocol=4))
    except Exception as e:  # noqa: BLE001 - not kept
        log.debug("%s not kept (%s)", path, e)
    return value


_LOADED_MAX = 64
_loaded: dict = {}  # key -> executable, this process's (most recently used last)


def call(fn, *args, **static):
    """``fn(*args, **static)`` (``fn`` a `jax.jit` function), through `executable` where one can
    be kept (the executables directory is on and the arrays are on the default device)."""
    folder = exec_dir()
    key = None if folder is None or not _on_default_device(args) else \
        _exec_key(fn, args, static, None)
    if key is None:
        return fn(*args, **static)
    with _lock:
        compiled = _loaded.pop(key, None)
    if compiled is None:
        compiled = executable(fn, args, static)
    with _lock:
        _loaded[key] = compiled
        while len(_loaded) > _LOADED_MAX:
            _loaded.pop(next(iter(_loaded)))
    return compiled(*args)


def by_shapes(programs: dict | None, fn, args: tuple, static: dict | None = None, *,
              skip: int = 0):
    """``fn`` (a `jax.jit` function) for ``args`` and its static keyword arguments ``static``:
    itself (through jit) when ``programs`` is None, else compiled once into ``programs`` (a dict
    the caller keeps; `executable`: kept on disk too) keyed by the shapes and dtypes of
    ``args[skip:]`` alone (the first ``skip`` are the same arrays on every call, e.g. one
    model's weights). One device. Arrays that came out of other programs carry equivalent
    shardings of other kinds, which jit's own cache tells apart: on an H100 a 2048-token paged
    prefill chunk compiled again mid-serving for 5.9 s, a compact chunk's row moves for ~0.2 s."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    static = static or {}
    if programs is None:
        return functools.partial(fn, **static)
    leaves, tree = jax.tree_util.tree_flatten(args[skip:])
    key = (getattr(fn, "__name__", fn), tuple(sorted(static.items())), tree,
           tuple((np.shape(x), np.result_type(x).name) for x in leaves))
    program = programs.get(key)
    if program is None:
        program = programs[key] = executable(
            fn, tuple(jnp.asarray(a) if isinstance(a, (np.ndarray, np.generic)) else a
                      for a in args), static)
    return program


def _on_default_device(args) -> bool:
    import jax

    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return all(isinstance(x, jax.Array) and x.sharding == default
               for x in jax.tree_util.tree_leaves(args))


def _write(folder: Path, name: str, blob: bytes) -> None:
    """``blob`` into ``folder / name`` atomically; then the oldest files go while the folder
    holds more than `EXEC_MAX_BYTES`."""
    import tempfile

    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, folder / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    files = sorted((p for p in folder.iterdir() if p.suffix in (".bin", ".pkl")),
                   key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in files)
    while files and total > EXEC_MAX_BYTES:
        old = files.pop(0)
        total -= old.stat().st_size
        old.unlink(missing_ok=True)


def _save_executable(compiled, folder: Path, name: str) -> None:
    import pickle

    from jax.experimental import serialize_executable

    try:
        _write(folder, name, pickle.dumps(serialize_executable.serialize(compiled)))
    except Exception as e:  # noqa: BLE001 - not kept: the next process compiles again
        log.debug("executable not kept (%s)", e)
