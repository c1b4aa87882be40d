"""jax's persistent compilation cache, kept under the jaxspec cache directory.

Compiling the decode loop, prefill and the server's programs takes seconds to minutes; with the
cache a second process on the same shapes loads them from disk instead. The command line
(`jaxspec generate / serve / convert / fetch`), `scripts/serve.py` and `jaxspec.generate` call
`enable()` first.

    enable()            -> $JAXSPEC_CACHE/xla (default ~/.cache/jaxspec/xla), or None when off

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


def default_dir() -> Path:
    """``<jaxspec cache>/xla``: ``$JAXSPEC_CACHE/xla``, else ``~/.cache/jaxspec/xla``."""
    from jaxspec.fetch import cache_dir

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
        return target


def _has_filelock() -> bool:
    import importlib.util

    return importlib.util.find_spec("filelock") is not None
