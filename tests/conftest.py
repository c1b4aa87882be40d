import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

# One on-disk XLA compile cache per test run, shared by the pytest-xdist workers (they inherit
# this process's environment) and by the CLI subprocesses some tests start: many tests compile
# programs another module compiled already (and the fixture below drops the in-memory cache
# after each module). Made here in the controlling process, removed in pytest_unconfigure; a
# run-wide JAX_COMPILATION_CACHE_DIR of your own is used as is, JAXSPEC_TEST_XLA_CACHE=0 turns
# it off. A cold cache made one run of four heavy files 11% faster (628 -> 557 s).
_RUN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and os.environ.get("JAXSPEC_TEST_XLA_CACHE") != "0":
    import tempfile
    _RUN_CACHE = tempfile.mkdtemp(prefix="jaxspec-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


# A cheaper XLA CPU compile pipeline for the tests: most of a run is compiling many small
# programs once each (jit per shape, Pallas kernels in interpret mode), not running them.
# Measured side by side: 505 -> 377 s on three heavy files, 79 -> 59 s on
# interpreter-heavy kernel tests. Only the CPU backend's LLVM work is cut; results are checked
# against the same references. JAXSPEC_TEST_FAST_COMPILE=0 turns it off.
#
# Also the CPU backend's older code generators (loop emitters instead of the fusion emitters, one
# compiled module instead of the thunk runtime): side by side on four files (batch-invariant,
# invariant kernels, sharding, mixed batches; 2 workers), 323 -> 167 s, every test passing
# either way. Set only where this jaxlib takes them (a flag it does not know would abort every
# process): a subprocess tries them once, in the process that starts the workers.
_LEGACY_CODEGEN = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_use_thunk_runtime=false")


def _takes_flags(flags: str) -> bool:
    import subprocess
    try:
        return subprocess.run(
            [sys.executable, "-c", "import jax, jax.numpy as jnp; "
             "print(jax.jit(lambda x: jnp.exp(x).sum())(jnp.ones(8)))"],
            env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"},
            capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


if os.environ.get("JAXSPEC_TEST_FAST_COMPILE") != "0":
    _flags = os.environ.get("XLA_FLAGS", "")
    for _f in ("--xla_llvm_disable_expensive_passes=true", "--xla_backend_optimization_level=0"):
        if _f.split("=")[0] not in _flags:
            _flags = (_flags + " " + _f).strip()
    _more = [f for f in _LEGACY_CODEGEN if f.split("=")[0] not in _flags]
    # (xdist workers inherit the controller's flags: they find them set and do not probe)
    if _more and "PYTEST_XDIST_WORKER" not in os.environ:
        _tried = (_flags + " " + " ".join(_more)).strip()
        if _takes_flags(_tried):
            _flags = _tried
    os.environ["XLA_FLAGS"] = _flags


import gc  # noqa: E402

import pytest  # noqa: E402


#: Memory mappings of a test process past which compiled programs are dropped after a test. Each
#: XLA CPU executable holds tens to thousands of mappings (its kernels' code) while it is alive;
#: the kernel's limit is vm.max_map_count (65530 by default), and a worker that reached it
#: crashed with a segmentation fault inside XLA (compiling, or writing an executable to the
#: compile cache): one server test file alone took a process to 62,000.
MAX_MAPPINGS = 32768


def _mappings() -> int:
    """The memory mappings of this process (0 where /proc is not there)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def _drop_compiled():
    """Drops this process's compiled programs (with the objects that held them)."""
    import jax
    gc.collect()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _bounded_mappings():
    """After a test, the compiled programs are dropped if the process holds more than
    `MAX_MAPPINGS` memory mappings (an engine's own programs go with it)."""
    yield
    if _mappings() > MAX_MAPPINGS:
        _drop_compiled()


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Each test module compiles many programs; drop them afterwards so a full run's memory stays
    flat (a full run on a 2-core / 24 GiB CI machine once aborted inside the XLA CPU compiler)."""
    yield
    _drop_compiled()


# Worker-seconds per test file in the default run (2 pytest-xdist workers on the 2-core CI
# machine). `make test` runs each file whole on one worker (--dist loadfile
# --no-loadscope-reorder); handing out the longest files first keeps one long file from
# starting last while the other worker sits idle. A stale or missing entry only costs balance.
_FILE_SECONDS = {
    "test_tree_speculation.py": 224, "test_server_paged.py": 204, "test_batch_invariant.py": 148,
    "test_retrieval.py": 148, "test_batch_invariant_sampling.py": 121,
    "test_serving_compact.py": 94, "test_model_parity.py": 94, "test_chunk_end.py": 86,
    "test_sharding.py": 81, "test_random_engine.py": 79, "test_hopper.py": 78,
    "test_speculative.py": 74, "test_tpu_kernels.py": 72, "test_sharding_layers.py": 71,
    "test_bench_server.py": 67, "test_adaptive.py": 67, "test_robustness.py": 67,
    "test_shared_prefix.py": 60, "test_sliding_window.py": 57, "test_compile_cache.py": 56,
    "test_paged.py": 52, "test_paged_kernel.py": 47, "test_server.py": 47,
    "test_checkpoint.py": 46, "test_mixed_batch.py": 43, "test_decode_attention.py": 42,
    "test_invariant_kernels.py": 40, "test_verify.py": 38, "test_server_soak.py": 37,
    "test_prefix_attention.py": 29, "test_cpu_attention.py": 28, "test_transformers_range.py": 25,
    "test_bench.py": 24, "test_server_shutdown.py": 23,
}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda it: -_FILE_SECONDS.get(os.path.basename(str(it.fspath)), 0))


def pytest_unconfigure(config):
    if _RUN_CACHE is not None:
        import shutil
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)
