#!/usr/bin/env bash
# GPU check: run on the GPU machine from the repo root (no network there).
#   bash scripts/gpu_check.sh [tests|generate|server|steps|all]
# Installs nothing: the project runs from this folder through PYTHONPATH (the machine has jax,
# flax, orbax, transformers; the server benchmark also needs fastapi, uvicorn and httpx). Runs the
# GPU-marked tests and the benchmarks of the public API (`jaxspec bench generate / server /
# steps`); results go to $OUT (or benchmarks/).
#   MODEL   a converted checkpoint, or a random-weight shape (default random-qwen15)
#   SOURCE  text source of the prompts (default random: the texts of jaxspec.textdata need the
#           network once; with $JAXSPEC_CACHE holding them, e.g. SOURCE=shakespeare)
#   VARIANTS  speculation variants (plain / off is always run too; default default,auto)
#   BATCH, PROMPT, NEW  generate and steps: batch sizes and prompt lengths (comma lists)
#   SLOTS, PROMPTS, RATES, REQUESTS  server: slots, a prompt length or range LO-HI, request
#           rates, requests per rate
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-benchmarks}"
MODEL="${MODEL:-random-qwen15}"
SOURCE="${SOURCE:-random}"
tag="$(basename "$MODEL")"
what="${1:-all}"
rc=0
python3 -c "import jax, flax, orbax.checkpoint; print('jax', jax.__version__, jax.devices())" || exit 1
if [[ $what == tests || $what == all ]]; then
  python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tail -20
fi
if [[ $what == generate || $what == all ]]; then
  python3 -m jaxspec bench generate --model "$MODEL" --batch "${BATCH:-16,64}" \
    --prompt "${PROMPT:-1024,8192}" --new "${NEW:-128}" --variants "${VARIANTS:-default,auto}" \
    --sources "$SOURCE" --ignore-eos --out "$OUT" --name "generate_$tag" || rc=1
fi
if [[ $what == server || $what == all ]]; then
  python3 -m jaxspec bench server --model "$MODEL" --max-batch "${SLOTS:-64}" \
    --prompt "${PROMPTS:-1024-8192}" --new "${NEW:-128}" --variants "${VARIANTS:-default,auto}" \
    --rates "${RATES:-inf,8}" --requests "${REQUESTS:-128}" --source "$SOURCE" \
    --out "$OUT" --name "server_$tag" || rc=1
fi
if [[ $what == steps || $what == all ]]; then
  python3 -m jaxspec bench steps --model "$MODEL" --batch "${BATCH:-16,64}" \
    --prompt "${PROMPT:-1024,8192}" --out "$OUT" --name "steps_$tag" || rc=1
fi
exit $rc
