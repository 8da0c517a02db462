#!/usr/bin/env bash
# Train on a TPU pod slice: run this same script on every host of the slice at once, e.g.
#
#   gcloud compute tpus tpu-vm ssh $TPU --zone $ZONE --worker=all --command \
#       "cd dspark-jax && . .venv/bin/activate && CONFIG=dspark-qwen3-8b \
#        DATA=/mnt/shared/answers.jsonl OUTPUT=/mnt/shared/runs/8b bash train/tpu_pod.sh"
#
# --distributed starts jax.distributed, which finds the slice's hosts by itself. The mesh shards
# parameters and optimizer state over every chip (fsdp = -1) and the batch along with them. DATA
# are local paths (not gs:// URLs) that every host can read, and OUTPUT must be one folder shared
# by all hosts (NFS / Filestore, or a bucket mounted with gcsfuse): each host writes its part of
# every checkpoint. Running the same command again resumes. See docs/training.md.
set -euo pipefail

CONFIG=${CONFIG:-dspark-qwen3-8b}
OUTPUT=${OUTPUT:?set OUTPUT to a folder that every host of the slice shares}
DATA=${DATA:-}

exec dspark-jax train --distributed --config "$CONFIG" --output "$OUTPUT" --mesh=1,-1,1 \
    --no-progress ${DATA:+--data $DATA} "$@"
