"""jaxspec.compile_cache: a second process compiling the same program loads it from the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Compiles one program of its own (a fresh constant per test run), reports jax's cache events
# through the public `jax.monitoring` listener, the directory in use and the program's result.
CHILD = """
    import json, os, sys
    import jax, jax.numpy as jnp
    events = []
    jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
    if os.environ.get("COMPILE_FIRST"):  # something compiled before the cache is turned on
        jnp.arange(3).sum().block_until_ready()
    from jaxspec import compile_cache
    used = compile_cache.enable()
    assert compile_cache.enable() == used  # idempotent
    constant = float(sys.argv[1])

    @jax.jit
    def program(x):
        for i in range(40):
            x = jnp.sin(x * constant) + jnp.cos(x) * i
        return x.sum()

    value = float(program(jnp.linspace(0, 1, 256)))
    print(json.dumps({"dir": None if used is None else str(used), "value": value,
                      "config_dir": jax.config.jax_compilation_cache_dir,
                      "min_secs": jax.config.jax_persistent_cache_min_compile_time_secs,
                      "hits": events.count("/jax/compilation_cache/cache_hits"),
                      "misses": events.count("/jax/compilation_cache/cache_misses")}))
"""


def child(tmp: Path, code: str, arg: str, *, drop: tuple = (), timeout: int = 300,
          **env: str) -> dict:
    """Runs ``code`` in a fresh process with the jaxspec cache under ``tmp`` (and none of this
    run's cache settings nor the variables in ``drop``); returns its last line's JSON."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT", "JAXSPEC_COMPILE") + drop)}
    clean.update(JAXSPEC_CACHE=str(tmp / "jaxspec-cache"), JAX_PLATFORMS="cpu",
                 PYTHONPATH=os.pathsep.join([str(REPO), clean.get("PYTHONPATH", "")]), **env)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), arg], env=clean,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(tmp: Path, constant: float, **env: str) -> dict:
    return child(tmp, CHILD, repr(constant), **env)


def cache_entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*-cache")) if folder.is_dir() else []


@pytest.fixture
def constant() -> float:
    return 1.0 + int.from_bytes(os.urandom(2), "little") / 65536


def test_second_process_hits_the_cache(tmp_path: Path, constant: float) -> None:
    # every program cached (the default keeps only those that take >= 0.2 s to compile)
    first = run(tmp_path, constant, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", COMPILE_FIRST="1")
    xla = tmp_path / "jaxspec-cache" / "xla"
    assert first["dir"] == first["config_dir"] == str(xla)
    assert first["min_secs"] == 0  # the user's setting is kept
    assert first["hits"] == 0 and first["misses"] >= 1
    entries = cache_entries(xla)
    assert entries, "nothing was written to the cache"
    second = run(tmp_path, constant, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert second["hits"] >= 1 and second["value"] == first["value"]
    assert cache_entries(xla) == entries  # nothing new compiled
    third = run(tmp_path, constant + 1.0, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert third["misses"] >= 1 and len(cache_entries(xla)) > len(entries)  # another program: compiled


def test_defaults_opt_out_and_the_users_directory(tmp_path: Path, constant: float) -> None:
    from jaxspec import compile_cache

    default = run(tmp_path, constant)
    assert default["dir"] == str(tmp_path / "jaxspec-cache" / "xla")
    assert default["min_secs"] == compile_cache.MIN_COMPILE_SECONDS
    off = run(tmp_path / "off", constant, JAXSPEC_COMPILE_CACHE="0")
    assert off["dir"] is None and not off["config_dir"] and not (tmp_path / "off" / "jaxspec-cache").exists()
    own = tmp_path / "own"
    mine = run(tmp_path / "mine", constant, JAX_COMPILATION_CACHE_DIR=str(own),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert mine["dir"] == mine["config_dir"] == str(own) and cache_entries(own)
    assert not (tmp_path / "mine" / "jaxspec-cache").exists()


def test_unwritable_directory_leaves_the_cache_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import jax

    from jaxspec import compile_cache

    monkeypatch.delenv("JAXSPEC_COMPILE_CACHE", raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    before = jax.config.jax_compilation_cache_dir
    if before:  # the test run's own cache (tests/conftest.py) is the user's directory: kept
        assert compile_cache.enable(blocker / "xla") == Path(before)
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        assert compile_cache.enable(blocker / "xla") is None
        assert not jax.config.jax_compilation_cache_dir
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_decode_loop_compiler_options_are_accepted_and_cpu_gets_none():
    """The GPU decode loops' XLA options are options this XLA knows (an unknown name fails the
    compile), and the CPU loops get none."""
    import jax
    import jax.numpy as jnp

    from jaxspec import session
    assert session.loop_compiler_options() == ({} if jax.default_backend() != "gpu"
                                               else session.GPU_LOOP_OPTIONS)
    x = jnp.arange(4.0)
    f = jax.jit(lambda a: a * 2).lower(x).compile(compiler_options=session.GPU_LOOP_OPTIONS)
    assert f(x).tolist() == [0.0, 2.0, 4.0, 6.0]
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):
        jax.jit(lambda a: a * 3).lower(x).compile(compiler_options={"xla_gpu_no_such_option": 1})


# generate on a tiny checkpoint in a fresh process; counts how often the model is traced
GENERATE = """
    import json, sys
    import jaxspec
    from jaxspec import compile_cache, model as model_module
    traced = []
    forward = model_module.Transformer.__call__
    def counting(self, *a, **kw):
        traced.append(1)
        return forward(self, *a, **kw)
    model_module.Transformer.__call__ = counting
    m = jaxspec.load(sys.argv[1])
    traced.clear()  # (loading may trace the model for its parameter shapes)
    res = jaxspec.generate(m, [[3, 5, 7, 9, 11], [2, 4]], max_new_tokens=6)
    folder = compile_cache.exec_dir()
    print(json.dumps({"tokens": res.tokens, "traced": len(traced),
                      "files": sorted(p.name for p in folder.glob("*.bin")) if folder else None}))
"""


def run_generate(tmp: Path, ckpt: Path, **env: str) -> dict:
    return child(tmp, GENERATE, str(ckpt), drop=("XLA_FLAGS",), timeout=600, **env)


def test_a_second_generate_process_runs_the_kept_executables(tmp_path: Path) -> None:
    import jaxspec
    from tiny import tiny_model
    model = tiny_model(seed=int.from_bytes(os.urandom(2), "little"))
    ckpt = jaxspec.save(model, tmp_path / "ckpt")
    off = {"tokens": jaxspec.generate(jaxspec.load(ckpt), [[3, 5, 7, 9, 11], [2, 4]],
                                      max_new_tokens=6).tokens}
    first = run_generate(tmp_path, ckpt)
    assert first["tokens"] == off["tokens"] and first["traced"] > 0
    assert len(first["files"]) >= 2  # the prefill chunk and the decode loop
    second = run_generate(tmp_path, ckpt)
    assert second["tokens"] == off["tokens"]
    assert second["traced"] == 0, "the model was traced again"
    assert second["files"] == first["files"]
    # damaged and lost files: compiled again (also when jax's own cache holds the program), the
    # same tokens, and kept again
    folder = tmp_path / "jaxspec-cache" / "executables"
    names = first["files"]
    (folder / names[0]).write_bytes(b"not an executable")
    (folder / names[1]).unlink()
    third = run_generate(tmp_path, ckpt)
    assert third["tokens"] == off["tokens"] and third["traced"] > 0
    assert set(names) <= set(third["files"])
    fourth = run_generate(tmp_path, ckpt)
    assert fourth["tokens"] == off["tokens"] and fourth["traced"] == 0


def test_kept_executables_run_in_a_process_with_several_devices(tmp_path: Path) -> None:
    """A host with several devices (a multi-GPU machine) running a single-device generate: the
    executable a first process kept loads in the second for the one device it was compiled for
    (not for every device of the host), and gives the same tokens."""
    import jaxspec
    from tiny import tiny_model
    model = tiny_model(seed=int.from_bytes(os.urandom(2), "little"))
    ckpt = jaxspec.save(model, tmp_path / "ckpt")
    ref = jaxspec.generate(jaxspec.load(ckpt), [[3, 5, 7, 9, 11], [2, 4]], max_new_tokens=6).tokens
    flags = "--xla_force_host_platform_device_count=2"
    first = run_generate(tmp_path, ckpt, XLA_FLAGS=flags)
    assert first["tokens"] == ref and first["traced"] > 0 and first["files"]
    second = run_generate(tmp_path, ckpt, XLA_FLAGS=flags)
    assert second["tokens"] == ref
    assert second["traced"] == 0, "the kept executables were not used"

