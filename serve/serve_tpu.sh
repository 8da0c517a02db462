#!/usr/bin/env bash
# Serve on one TPU host in bfloat16 (see `dspark-jax serve --help`). The engine pads batches and
# prompts to fixed buckets, so the first request of each new shape compiles; later ones do not.
#
#   MODEL=ckpt/qwen3-8b bash serve/serve_tpu.sh
set -euo pipefail

MODEL=${MODEL:?set MODEL to a converted folder holding target/ and draft/}
HOST=${HOST:-0.0.0.0}
PORT=${PORT:-8000}

exec dspark-jax serve --target "$MODEL" --draft "$MODEL" --dtype bfloat16 \
    --host "$HOST" --port "$PORT" --batch-size 32 --max-len 4096 --max-new-tokens 1024 "$@"
