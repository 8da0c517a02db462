#!/usr/bin/env bash
# Train a drafter on one machine (one GPU, or all GPUs of one host: the data axis takes them all).
# Copy this file and edit the variables; every option is `dspark-jax train --help`.
#
#   CONFIG=dspark-qwen3-4b DATA=answers.jsonl bash train/single_gpu.sh
#   CONFIG=tiny-dspark bash train/single_gpu.sh      # the CPU-sized recipe, no data needed
set -euo pipefail

CONFIG=${CONFIG:-dspark-qwen3-4b}   # a named config, or a .py file defining CONFIG
OUTPUT=${OUTPUT:-}                  # default runs/<config name>; the same folder resumes
DATA=${DATA:-}                      # JSONL conversations (overrides the config's data)

exec dspark-jax train --config "$CONFIG" ${OUTPUT:+--output "$OUTPUT"} --mesh=-1,1,1 \
    ${DATA:+--data $DATA} "$@"
