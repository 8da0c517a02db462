#!/usr/bin/env bash
# One call on a lent GPU machine: the tests that exercise the engine, the attention kernels, the
# verifier and the training step on the GPU, then every benchmark; tables on stdout, JSON, plots
# and profiles in the results folder (below). Prepare here (network) with `bash benchmarks/gpu_wheels.sh`, then run on the device
# machine, carrying .whl:
#
#   bash benchmarks/gpu_session.sh            # tests + benchmarks (about 10 minutes on an H100)
#   STAGES="bench" bash benchmarks/gpu_session.sh   # benchmarks only
#   SIZE=tiny JAX_PLATFORMS=cpu STAGES=bench bash benchmarks/gpu_session.sh   # smoke run on CPU
#
# Each stage's output goes to <results>/<stage>.log as well, beside its JSON/PNG; a failing stage
# does not stop the next ones, and the exit code says whether any failed. Results go to
# $RESULTS (default gpu_out/). On the device machine ($OUT set), which returns at most 8 files
# of 16 MiB from $OUT, two folders deep at most, they go to /tmp/dspark-gpu instead, and after
# every stage $OUT gets them packed as results.tar.gz (profiles' raw xplane files left out),
# beside session.log, this whole output; a call cut off at its time limit keeps what it had.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${OUT:-}" ]; then
  out=${RESULTS:-/tmp/dspark-gpu}; pack=$OUT
  exec > >(tee -a "$OUT/session.log") 2>&1
else
  out=${RESULTS:-gpu_out}; pack=
fi
mkdir -p "$out"
pack_results() {  # one archive under 16 MiB: without the raw traces if they would not fit
  [ -n "$pack" ] || return 0
  tar czf "$pack/results.tar.gz" -C "$out" --exclude='*.xplane.pb' \
    --exclude='vm.trace.json.gz' . || return 0
  if [ "$(stat -c %s "$pack/results.tar.gz")" -gt $((15 * 1024 * 1024)) ]; then
    echo "(results.tar.gz over 15 MiB: packed again without the profile traces)"
    tar czf "$pack/results.tar.gz" -C "$out" --exclude='plugins' . || true
  fi
}
stages=${STAGES:-"tests bench"}
size=${SIZE:-qwen3-4b}
if [ "$size" = tiny ]; then
  # Small enough for a CPU smoke run of the script itself.
  batches="1 8"; contexts="64 256"; max_lens="256 2048"; slots=8; packed=8; conc=1,8
  dtype=float32
  attn="--kv-heads 2 --groups 2 --head-dim 32 --kv-lens 64,256 --capacity 512 --capacities 256,512"
  train=(); bw_gib=0.25
else
  batches="1 8 32 64"; contexts="256 1024 4096"; max_lens="1024 8192 32768"; slots=32
  packed=64; conc=1,8,32,64,128; bw_gib=4; dtype=bfloat16
  attn="--kv-heads 8 --groups 4 --head-dim 128 --kv-lens 512,1024,2048,4096 --capacity 8192"
  attn+=" --capacities 2048,4096,8192,16384"
  # The released recipe (configs/train_qwen3.py): one 4096-token sequence per micro-step, the
  # rest of the batch by gradient accumulation; eight sequences at once would need about eight
  # times the step's temporaries (28 GiB at one, from XLA's analysis).
  train=(--target qwen3-4b --drafter dspark-qwen3-4b --dtype bfloat16 --batch 4 --microbatches 4
         --seq-len 4096 --anchors 512 --chunk 64 --steps 5 --warmup 1)
fi
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
# Benchmarks: one process, which may take 90% of the GPU's memory (JAX's default is 75%).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The package itself, installed editable from this checkout with the machine's own setuptools
# (no network, no dependencies pulled): the top-level configs/ folder is dspark_jax.configs only
# through pyproject's package-dir mapping, so a bare checkout on PYTHONPATH cannot import it.
if ! python3 -c "import dspark_jax.configs" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . ||
    { echo "could not install the package from this checkout"; exit 1; }
fi
dspark() { python3 -m dspark_jax.cli "$@"; }
failed=()
stage() {  # stage NAME COMMAND...: runs it, tees its log, remembers failures
  local name=$1; shift
  echo "=== $name: $*"
  local start=$SECONDS
  if ! "$@" 2>&1 | tee "$out/$name.log"; then failed+=("$name"); fi
  echo "=== $name took $((SECONDS - start)) s"
  pack_results
}

echo "== $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo n/a)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

if [[ " $stages " == *" tests "* ]]; then
  # Engine (paged, packed, Pallas GPU kernels natively), attention paths, verifier, exactness
  # against the reference traces and transformers, losslessness, the training step.
  # Four pytest workers (compiling is CPU work; the machine has 16 cores) share the GPU: none
  # may grab a fixed fraction of its memory up front. --maxfail, not -x: one call should show
  # every failing area, not only the first.
  stage tests env XLA_PYTHON_CLIENT_PREALLOCATE=false \
    python3 -m pytest -q -n 4 --maxfail=8 -p no:cacheprovider \
    tests/test_attention.py tests/test_engine.py tests/test_verify.py tests/test_sampling.py \
    tests/test_fixture_parity.py tests/test_transformers_parity.py tests/test_lossless.py \
    tests/test_scheduled_engine.py tests/test_train_step.py tests/test_train_loss.py
fi

if [[ " $stages " == *" bench "* ]]; then
  stage bandwidth python3 benchmarks/bandwidth.py --gib "$bw_gib" --json "$out/bandwidth.json"
  # shellcheck disable=SC2086  # the size's word lists split on purpose
  stage decode_speed python3 benchmarks/decode_speed.py --config "$size" --batch-sizes $batches \
    --bandwidth-json "$out/bandwidth.json" --profile "$out/profile" --profile-batch 8 \
    --json "$out/decode_speed.json"
  # shellcheck disable=SC2086
  stage cost_model python3 benchmarks/cost_model.py --config "$size" --dtype bfloat16 \
    --slots "$slots" --packed-slots "$packed" --contexts $contexts --max-lens $max_lens \
    --json "$out/cost_model.json"
  # shellcheck disable=SC2086
  stage attention_paths python3 benchmarks/attention_paths.py $attn --dtype bfloat16 \
    --slots "$slots" --q-len 8 --json "$out/attention_paths.json"
  stage profile dspark profile --config "$size" --dtype bfloat16 --mode verify \
    --max-num-seqs "$packed" --out "$out/sps.json"
  # Real shapes, random weights, a drafter whose per-position acceptance is chosen (tau ~4.4).
  stage throughput python3 benchmarks/throughput.py --synthetic "$size" --dtype "$dtype" \
    --concurrency "$conc" --thresholds threshold=0.5,cumulative-threshold=0.3 \
    --out "$out/throughput.json" --plot "$out/throughput.png"
  stage train_throughput python3 benchmarks/train_throughput.py "${train[@]}" \
    --json "$out/train_throughput.json"
  # The four aims (HBM floor, round/step, scheduler vs the rest, MFU): met, not met or missing.
  stage targets python3 benchmarks/gpu_targets.py "$out" --json "$out/targets.json"
fi

if [ ${#failed[@]} -gt 0 ]; then echo "FAILED stages: ${failed[*]}"; exit 1; fi
echo "all stages passed"
