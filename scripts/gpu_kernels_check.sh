#!/usr/bin/env bash
# GPU check of the Pallas attention kernels, run on the GPU machine from the repo root:
#   bash scripts/gpu_kernels_check.sh [bench_attention.py args, e.g. --tune --budget 200]
# 1. the GPU-marked tests (compiled kernel vs jnp reference) of $KERNEL_TESTS (default: the
# decode kernel's; e.g. KERNEL_TESTS="tests/test_decode_attention.py
# tests/test_prefix_attention.py tests/test_random_shapes.py" for every kernel), 2. the
# benchmark, which writes attention.{json,md,png} to $OUT (the device machine's result
# folder) if set, else to benchmarks/.
set -uo pipefail
export PYTHONUNBUFFERED=1
# tests/conftest.py defaults JAX_PLATFORMS to cpu for the CPU suite; here we want the GPU.
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
$PY -c "import jax; print('jax', jax.__version__, jax.devices())"
status=0
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  # shellcheck disable=SC2086 # a list of test files
  $PY -m pytest -q -m gpu ${KERNEL_TESTS:-tests/test_decode_attention.py} -p no:cacheprovider \
    -W ignore -rs \
    2>&1 | tee "${OUT:-/tmp}/gpu_tests.log" | tail -25 || status=1
fi
$PY scripts/bench_attention.py --out "${OUT:-benchmarks}/attention" "$@" 2>&1 \
  | tee "${OUT:-/tmp}/bench.log" || status=1
exit $status
