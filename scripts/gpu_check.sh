#!/usr/bin/env bash
# GPU check: run on the GPU machine from the repo root (no network there).
#   bash scripts/gpu_check.sh [decode|spec|tests|all]
# Installs the project without dependencies (the machine has jax, flax, orbax, transformers),
# runs the GPU-marked tests and the end-to-end benchmarks; results go to $OUT (or benchmarks/).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks}"
what="${1:-all}"
python3 -c "import jax, flax, orbax.checkpoint; print('jax', jax.__version__, jax.devices())"
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -20
fi
if [[ $what == decode || $what == all ]]; then
  python3 scripts/benchmark.py decode --batch 32 --context 8192 --out "$OUT/decode_llama8b"
fi
if [[ $what == spec || $what == all ]]; then
  MODEL="${MODEL:?set MODEL to a converted checkpoint}"
  python3 scripts/benchmark.py speculative --model "$MODEL" --batch "${BATCH:-16,64}" \
    --prompt "${PROMPT:-1024,7680}" --gamma "${GAMMA:-3}" --max-new 64 --trees "${TREES:-}" \
    ${PROMPTS_FILE:+--prompts-file "$PROMPTS_FILE"} --out "$OUT/speculative_$(basename "$MODEL")"
fi
