#!/usr/bin/env bash
# Serve on one TPU host in bfloat16 (see `dspark-jax serve --help`). Warm-up compiles every
# program the engine has; no request compiles afterwards.
#
#   MODEL=ckpt/qwen3-8b bash serve/serve_tpu.sh
#
# A model whose parameters take more than 75% of one chip (Qwen3-8B on v5e's 16 GB) is split
# on the mesh's tensor axis over as many of the host's chips as its head counts divide; MESH=data,fsdp,tensor chooses another
# mesh (docs/engine.md, "On a mesh").
# It listens on every interface (HOST=0.0.0.0): export DSPARK_JAX_API_KEY so that clients
# need that key (docs/serving.md, "API key").
set -euo pipefail

MODEL=${MODEL:?set MODEL to a converted folder holding target/ and draft/}
HOST=${HOST:-0.0.0.0}
PORT=${PORT:-8000}
MESH=${MESH:-}

exec dspark-jax serve --target "$MODEL" --draft "$MODEL" --dtype bfloat16 ${MESH:+--mesh "$MESH"} \
    --host "$HOST" --port "$PORT" --max-num-seqs 32 --max-model-len 4096 "$@"
