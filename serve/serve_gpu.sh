#!/usr/bin/env bash
# Serve a converted target + drafter pair on one GPU (see `dspark-jax serve --help`):
#
#   dspark-jax convert --draft deepseek-ai/dspark_qwen3_4b_block7 --target Qwen/Qwen3-4B \
#       --out ckpt/qwen3-4b --dtype bfloat16
#   MODEL=ckpt/qwen3-4b bash serve/serve_gpu.sh
#
# With no MODEL it serves the small pair embedded in the package (a smoke test), at its own
# context; a MODEL gets 4096-token requests (MAX_MODEL_LEN overrides).
# It listens on every interface (HOST=0.0.0.0): export DSPARK_JAX_API_KEY so that clients
# need that key (docs/serving.md, "API key").
set -euo pipefail

MODEL=${MODEL:-}                 # a converted folder holding target/ and draft/
HOST=${HOST:-0.0.0.0}
PORT=${PORT:-8000}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-${MODEL:+4096}}

exec dspark-jax serve ${MODEL:+--target "$MODEL" --draft "$MODEL"} --host "$HOST" \
    --port "$PORT" --max-num-seqs 16 ${MAX_MODEL_LEN:+--max-model-len "$MAX_MODEL_LEN"} "$@"
