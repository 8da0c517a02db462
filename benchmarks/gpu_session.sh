#!/usr/bin/env bash
# One call on a lent GPU machine: the tests that exercise the engine, the attention kernels, the
# verifier and the training step on the GPU, then every benchmark; tables on stdout, JSON, plots
# and profiles in the results folder (below). Prepare here (network) with
# `bash benchmarks/gpu_wheels.sh`, then run on the device machine, carrying .whl:
#
#   DSPARK_JAX_COMMIT=<hash> DEADLINE=560 bash benchmarks/gpu_session.sh   # a 600 s device call
#   STAGES="bench" bash benchmarks/gpu_session.sh   # benchmarks only
#   STAGES="throughput_c1 throughput_c8" bash benchmarks/gpu_session.sh   # just these stages
#   SIZE=tiny JAX_PLATFORMS=cpu STAGES=bench bash benchmarks/gpu_session.sh   # smoke run on CPU
#
# STAGES names "tests" (both test stages), "bench" (every benchmark stage) or single stages;
# they run in one fixed order, that of what the project's aims need: preflight (with either
# group: does the engine decode here as configured, else which fallback), tests_core (the kernels,
# the engine's exact traces, parity, the verifier, the train step; decode_speed's and
# throughput_c64's programs compile beside it, into the compilation cache: "precompile"),
# bandwidth and decode_speed (HBM floor, round/step), train_throughput (MFU), throughput_c64
# (the scheduler at concurrency 64), then tests_rest (the other GPU tests), the other tables,
# throughput (the levels measured so far combined) and targets. So one call cut off at its
# DEADLINE has the GPU's verdict on correctness and the aims first, and a later call names what
# is left.
#
# Each stage's output goes to <results>/<stage>.log as well, beside its JSON/PNG; a failing stage
# does not stop the next ones, and the exit code says whether any failed. Results go to
# $RESULTS (default gpu_out/). On the device machine ($OUT set), which returns at most 8 files
# of 16 MiB from $OUT, two folders deep at most, they go to /tmp/dspark-gpu instead, and after
# every stage $OUT gets them packed as results.tar.gz (profiles' raw xplane files left out),
# beside session.log, this whole output; a call cut off at its time limit keeps what it had.
# The device gets the working tree without git: pass the commit it is, DSPARK_JAX_COMMIT=<hash>,
# for the results to name it.
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
  batches="1 8"; contexts="64 256"; max_lens="256 2048"; slots=8; packed=8; levels="8 1"
  dtype=float32
  attn="--kv-heads 2 --groups 2 --head-dim 32 --kv-lens 64,256 --capacity 512 --capacities 256,512"
  train=(); bw_gib=0.25; vocab=4096; filter_rows=64
else
  batches="1 8 32 64"; contexts="256 1024 4096"; max_lens="512 2048 8192"; slots=32
  packed=64; levels="64 1 8 32 128 256"; bw_gib=4; dtype=bfloat16; vocab=151936; filter_rows=512
  attn="--kv-heads 8 --groups 4 --head-dim 128 --kv-lens 512,1024,2048,4096 --capacity 8192"
  attn+=" --capacities 2048,4096,8192,16384"
  # The released recipe (configs/train_qwen3.py): one 4096-token sequence per micro-step, the
  # rest of the batch by gradient accumulation; eight sequences at once would need about eight
  # times the step's temporaries (28 GiB at one, from XLA's analysis).
  train=(--target qwen3-4b --drafter dspark-qwen3-4b --dtype bfloat16 --batch 4 --microbatches 4
         --seq-len 4096 --anchors 512 --chunk 64 --steps 5 --warmup 1)
fi
# decode_speed profiles a chunk at the aims' batch (1) and at a batch of several slots.
profile_batches=1,8
# The serving-load benchmark runs one concurrency level per stage: the aim's level (the first
# of $levels) among the aims' stages, the others after the remaining tables.
bench_stages="bandwidth decode_speed train_throughput throughput_c${levels%% *} cost_model"
bench_stages+=" attention_paths profile"
for c in ${levels#* }; do bench_stages+=" throughput_c$c"; done
bench_stages+=" switch_cost sampling throughput targets penalties"
test_stages="tests_core tests_rest"
for name in $stages; do
  if [[ " tests bench preflight $test_stages $bench_stages " != *" $name "* ]]; then
    echo "STAGES: no stage named $name (tests, bench, preflight, $test_stages, $bench_stages)"
    exit 2
  fi
done
want() {
  [[ " $stages " == *" $1 "* ]] && return 0
  # The preflight comes with the tests and with the benchmarks alike.
  if [ "$1" = preflight ]; then [[ " $stages " == *" tests "* || " $stages " == *" bench "* ]]; return; fi
  if [[ $1 == tests_* ]]; then [[ " $stages " == *" tests "* ]]; else [[ " $stages " == *" bench "* ]]; fi
}
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
# Programs two stages or two engines share (a profile compiling the decode chunk again to read
# its HLO, the switch-cost stage's engines) compile once per machine.
export DSPARK_JAX_COMPILATION_CACHE=${DSPARK_JAX_COMPILATION_CACHE:-/tmp/dspark-gpu-xla}
# Benchmarks: one process, which may take 90% of the GPU's memory (JAX's default is 75%).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The package itself, installed editable from this checkout with the setuptools first on the
# path (the one among the wheels when they came, else the machine's; no network, no
# dependencies pulled): the top-level configs/ folder is dspark_jax.configs only
# through pyproject's package-dir mapping, so a bare checkout on PYTHONPATH cannot import it.
if ! python3 -c "import dspark_jax.configs" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . ||
    { echo "could not install the package from this checkout"; exit 1; }
fi
failed=()
summary=()
# DEADLINE (seconds from the start, optional): a stage gets only the time left before it, and
# none starts once it has passed. Set it under the device call's limit (DEADLINE=560 with a
# 600 s call): a stage stopped there still has its partial JSON packed and the summary printed,
# which a call killed at its limit would not. STAGE_CAP=S before `stage` stops that stage after
# S seconds as well (the test stages', below, so they cannot eat the aims' time).
stage() {  # [STAGE_CAP=S] stage NAME COMMAND...: runs it, tees its log, remembers failures and times
  local name=$1; shift
  local start=$SECONDS result=ok limit=() why=
  local cap=${STAGE_CAP:-0}
  if [ -n "${DEADLINE:-}" ]; then
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -le 5 ]; then
      echo "=== $name: not started, DEADLINE=$DEADLINE s passed"
      summary+=("$(printf '%-18s %8s  %s' "$name" - "not started")"); failed+=("$name")
      return
    fi
    limit=(timeout --kill-after=15 "$left"); why="DEADLINE=$DEADLINE s"
  fi
  if [ "$cap" -gt 0 ] && { [ ${#limit[@]} -eq 0 ] || [ "$cap" -lt "$left" ]; }; then
    limit=(timeout --kill-after=15 "$cap"); why="its cap of $cap s"
  fi
  echo "=== $name: $*"
  "${limit[@]}" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    failed+=("$name"); result=FAILED
    if [ ${#limit[@]} -gt 0 ] && { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }; then
      result="stopped at $why"
    fi
  fi
  echo "=== $name took $((SECONDS - start)) s"
  summary+=("$(printf '%-18s %6d s  %s' "$name" $((SECONDS - start)) "$result")")
  pack_results
}

commit=$(git rev-parse --short HEAD 2>/dev/null || echo "${DSPARK_JAX_COMMIT:-unknown}")
export DSPARK_JAX_COMMIT=$commit  # benchmarks/provenance.py reads it where git is missing
echo "== $(date -u +%FT%TZ) commit $commit, stages: $stages"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

# First, well under a minute where the defaults work: does the engine decode here as configured
# (Triton attention, loops inside CUDA graphs)? If not, the first documented fallback that does
# (DSPARK_JAX_GRAPH_LOOPS=0, DSPARK_JAX_ATTENTION=jax, both) holds for every stage after it, so
# one failing path costs the session that path's verdict, not every test and table
# (benchmarks/gpu_preflight.py).
if want preflight; then
  stage preflight python3 benchmarks/gpu_preflight.py --timeout 90 --env "$out/preflight.env" \
    --json "$out/preflight.json"
  if [ -s "$out/preflight.env" ]; then
    # shellcheck disable=SC1091
    . "$out/preflight.env"
    echo "(from here on: $(tr '\n' ' ' < "$out/preflight.env"))"
  fi
fi

# The tests that exercise the engine, the kernels and the training step on the GPU: the first
# part (Pallas kernels natively against the dense reference, the engine's exact greedy traces,
# the models' parity with the reference, the verifier, the train step) before the benchmarks,
# whose numbers mean nothing if these fail; the rest after the aims' stages. Each is capped
# (TESTS_CORE_S, TESTS_REST_S seconds; 0: no cap): a stopped stage's log still shows every test
# that ran, and the aims keep their time. Four pytest workers (compiling is CPU work; the
# machine has 16 cores) share the GPU: none may grab a fixed fraction of its memory up front.
# --maxfail, not -x: one call should show every failing area.
gpu_tests() {  # gpu_tests NAME CAP TEST_FILE...
  STAGE_CAP=$2 stage "$1" env XLA_PYTHON_CLIENT_PREALLOCATE=false \
    python3 -m pytest -q -n 4 --maxfail=8 -p no:cacheprovider "${@:3}"
}
# The arguments that decide decode_speed's and the serving-load benchmark's programs, shared by
# their stages and by the compile ahead below.
aim=${levels%% *}
# shellcheck disable=SC2206  # the batch sizes split on purpose
decoding=(benchmarks/decode_speed.py --config "$size" --batch-sizes $batches)
serving=(benchmarks/throughput.py --synthetic "$size" --dtype "$dtype"
         --thresholds threshold=0.5,cumulative-threshold=0.3 --prefill-buckets 64,256)
# While the first tests run (they time nothing), decode_speed and the aim's serving-load level
# compile what they compile before timing anything -- the largest programs of the session, the
# serving level's profiled round and engines above all -- into the persistent compilation
# cache, each in a process of its own that takes GPU memory only as it needs it; their stages
# then load them instead. Both are waited for (PRECOMPILE_S seconds at most from their start)
# before the first timed stage, so that XLA's autotuning of their kernels on the GPU never runs
# beside a measurement. Each compiles PRECOMPILE_WORKERS programs at once (4: half the device
# machine's cores for the two, the tests' four workers on the rest).
precompile_pids=()
precompile_logs=()
precompile() {  # precompile LOG COMMAND...: in the background, logged to <results>/LOG
  local log=$1; shift
  echo "=== precompile (background): $* --compile-only"
  XLA_PYTHON_CLIENT_PREALLOCATE=false DSPARK_JAX_COMPILE_WORKERS=${PRECOMPILE_WORKERS:-4} \
    python3 "$@" --compile-only > "$out/$log" 2>&1 &
  precompile_pids+=($!); precompile_logs+=("$log")
}
precompile_start=$SECONDS
if want tests_core; then
  want decode_speed && precompile precompile_decode_speed.log "${decoding[@]}"
  want "throughput_c$aim" &&
    precompile precompile_throughput.log "${serving[@]}" --concurrency "$aim" --plot ""
fi
want tests_core &&
  gpu_tests tests_core "${TESTS_CORE_S:-180}" tests/test_attention.py tests/test_engine.py \
    tests/test_fixture_parity.py tests/test_verify.py tests/test_train_step.py
if [ ${#precompile_pids[@]} -gt 0 ]; then
  cap=$((precompile_start + ${PRECOMPILE_S:-300}))
  if [ -n "${DEADLINE:-}" ] && [ "$DEADLINE" -lt "$cap" ]; then cap=$DEADLINE; fi
  results=()
  for i in "${!precompile_pids[@]}"; do
    pid=${precompile_pids[$i]}
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$cap" ]; do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
      results+=("stopped at $((SECONDS - precompile_start)) s (its stage compiles the rest)")
    elif wait "$pid"; then
      results+=(ok)
    else
      results+=(FAILED); failed+=("precompile (${precompile_logs[$i]})")
    fi
    echo "=== precompile ${precompile_logs[$i]}: ${results[-1]}"
    tail -n 3 "$out/${precompile_logs[$i]}"
  done
  # One line for the summary: ok only if every part was.
  result=ok
  for r in "${results[@]}"; do [ "$r" = ok ] || result=$r; done
  echo "=== precompile: waited $((SECONDS - precompile_start)) s from its start"
  summary+=("$(printf '%-18s %6d s  %s' precompile $((SECONDS - precompile_start)) "$result")")
  pack_results
fi

want bandwidth &&
  stage bandwidth python3 benchmarks/bandwidth.py --gib "$bw_gib" --json "$out/bandwidth.json"
want decode_speed &&
  stage decode_speed python3 "${decoding[@]}" \
    --bandwidth-json "$out/bandwidth.json" --profile "$out/profile" --profile-batch "$profile_batches" \
    --json "$out/decode_speed.json"
want train_throughput &&
  stage train_throughput python3 benchmarks/train_throughput.py "${train[@]}" \
    --json "$out/train_throughput.json"
for c in $levels; do
  # Real shapes, random weights, a drafter whose per-position acceptance is chosen (tau ~4.4);
  # the prompts are 48 tokens, so two prefill buckets serve every packing of them.
  want "throughput_c$c" &&
    stage "throughput_c$c" python3 "${serving[@]}" --concurrency "$c" \
      --out "$out/throughput_c$c.json" --plot ""
  if [ "$c" = "$aim" ]; then  # the tests and tables that come after the aim's level
    want tests_rest &&
      gpu_tests tests_rest "${TESTS_REST_S:-180}" tests/test_sampling.py \
        tests/test_transformers_parity.py \
        tests/test_lossless.py tests/test_scheduled_engine.py tests/test_policy_switch.py \
        tests/test_train_loss.py
    # shellcheck disable=SC2086
    want cost_model &&
      stage cost_model python3 benchmarks/cost_model.py --config "$size" --dtype bfloat16 \
        --slots "$slots" --packed-slots "$packed" --contexts $contexts --max-lens $max_lens \
        --json "$out/cost_model.json"
    # shellcheck disable=SC2086
    want attention_paths &&
      stage attention_paths python3 benchmarks/attention_paths.py $attn --dtype bfloat16 \
        --slots "$slots" --q-len 8 --json "$out/attention_paths.json"
    want profile &&
      stage profile python3 -m dspark_jax.cli profile --config "$size" --dtype bfloat16 \
        --mode verify --max-num-seqs "$packed" --out "$out/sps.json"
  fi
done
# What the serving-load tables' one-engine-for-all-policies costs a round (ratio ~1 expected):
# the scheduler under the switch against its own engine, at the aim's level.
want switch_cost &&
  stage switch_cost python3 benchmarks/policy_switch_cost.py --synthetic "$size" \
    --dtype "$dtype" --concurrency "$aim" --members 5 --json "$out/switch_cost.json"
# What top-k / top-p filtering costs a round over Qwen3's vocabulary (512 rows: the verification
# of 64 slots at gamma 7) with 1, 8, 64 or every row filtering, against temperature sampling and
# a sort of the same logits.
want sampling &&
  stage sampling python3 benchmarks/sampling_filters.py --rows "$filter_rows" --vocab "$vocab" \
    --json "$out/sampling.json"
if want throughput; then
  parts=("$out"/throughput_c*.json)
  if [ -e "${parts[0]}" ]; then
    stage throughput python3 benchmarks/throughput.py --combine "${parts[@]}" \
      --out "$out/throughput.json" --plot "$out/throughput.png"
  else
    echo "=== throughput: no throughput_c*.json in $out to combine"; failed+=(throughput)
  fi
fi
# The four aims (HBM floor, round/step, scheduler vs the rest, MFU): met, not met or missing.
want targets && stage targets python3 benchmarks/gpu_targets.py "$out" --json "$out/targets.json"
# What presence / frequency penalties and a logit bias of 16 tokens cost a speculative round at
# the aim's level (off; each on but unused, and used), after the aims' judge: the session's least
# urgent table.
want penalties &&
  stage penalties python3 benchmarks/penalties_cost.py --config "$size" --dtype "$dtype" \
    --slots "$aim" --logit-bias 16 --json "$out/penalties.json"

# Last, where a reply that keeps only the end of the output still shows it: what ran, how long
# each stage took (to plan the next call within the device's limit), and what failed.
echo "== stages (total $SECONDS s):"
printf '   %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then echo "FAILED stages: ${failed[*]}"; exit 1; fi
echo "all stages passed"
