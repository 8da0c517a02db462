#!/usr/bin/env bash
# Every benchmark on the device at hand, in one call; tables on stdout, JSON/PNG under $OUT.
#
#   bash benchmarks/run_all.sh tiny        # fixture-sized models (CPU)
#   bash benchmarks/run_all.sh qwen3-4b    # real shapes, random bf16 weights (GPU/TPU)
#
# The throughput benchmark needs trained weights to mean anything (random weights accept
# nothing), so at real size it runs only when DRAFT and TARGET point at checkpoints.
set -euo pipefail
size=${1:-tiny}
out=${OUT:-bench_out}
mkdir -p "$out"
echo "== $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo n/a) size $size"
python -c "import jax; print('devices:', jax.devices())"

echo "== decode speed: plain step vs speculative round"
python benchmarks/decode_speed.py --config "$size" --json "$out/decode_speed.json"

echo "== train step throughput"
if [ "$size" = tiny ]; then
  python benchmarks/train_throughput.py --json "$out/train_throughput.json"
else
  python benchmarks/train_throughput.py --target "$size" --drafter "dspark-$size" \
    --dtype bfloat16 --batch 8 --seq-len 4096 --anchors 512 --chunk 64 \
    --json "$out/train_throughput.json"
fi

echo "== SPS profile of whole rounds"
dspark-jax profile --config "$size" --mode round --out "$out/sps.json" --plot "$out/sps.png"

echo "== throughput by verification policy"
if [ "$size" = tiny ]; then
  python benchmarks/throughput.py --sps-table "$out/sps.json" \
    --out "$out/throughput.json" --plot "$out/throughput.png"
elif [ -n "${TARGET:-}" ] && [ -n "${DRAFT:-}" ]; then
  python benchmarks/throughput.py --target "$TARGET" --draft "$DRAFT" \
    --prompts "${PROMPTS:-../shared/eval_datasets/mt-bench.jsonl}" --sps-table "$out/sps.json" \
    --out "$out/throughput.json" --plot "$out/throughput.png"
else
  echo "skipped: set TARGET and DRAFT to trained checkpoints"
fi
