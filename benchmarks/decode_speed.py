"""Decode speed of plain and speculative decoding through the engine, against the bandwidth floor.

Real-size shapes with random weights (speed does not depend on weight values): by default the
Qwen3-4B target and the released 4B DSpark drafter config, in bf16, at batch 1, 8 and 32.

    python benchmarks/decode_speed.py                  # Qwen3-4B + DSpark drafter
    python benchmarks/decode_speed.py --config tiny    # fixture-sized, for CPU

Each batch size gets an engine with that many slots, every slot holding a request at --context
cached positions, then `--rounds` decode rounds run in one compiled chunk (the engine's on-device
while_loop); a cell is the median over --repeats timed chunks of chunk time / rounds (the slots
are rolled back to --context between chunks). Reported:

- plain step: one target step of autoregressive decoding (one token per request).
- spec round: one speculative round (draft a block of gamma tokens, verify gamma + 1 in one
  target forward, accept, commit) at fixed gamma = the block size. Random weights accept almost
  nothing, so throughput is projected for the acceptance lengths tau the paper reports
  (tau tokens per round per request): tok/s = batch * tau / round time, speedup over plain =
  tau * step time / round time.
- floor: (weight bytes read + KV bytes read) / HBM bandwidth for one target step. Weight bytes
  exclude lookup-only tables (an untied input embedding); KV bytes are the keys and values in
  use (batch x context positions): the paged attention reads only those, whatever the pool.
- build: every engine's programs (all batch sizes, plain and speculative) compiled at once,
  one per CPU core (--compile-workers), before any timing: programs, wall seconds, and compile
  seconds summed over threads; the timed chunks must compile nothing.

With --profile DIR, one more plain and one more speculative chunk at each --profile-batch (a
comma-separated list) run under the XLA profiler (benchmarks/xla_profile.py): device busy time
against wall time, time by op kind and the most expensive ops, printed after the table and
kept in the JSON; the traces stay in DIR for Perfetto or TensorBoard.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import xla_profile
from flax import nnx
from provenance import (
    CompileClock,
    Parser,
    add_compile_workers,
    compile_only_cache,
    measured,
    non_negative_float,
    output_file,
    positive_float,
    positive_int,
    positive_ints,
    read_json,
    run_main,
    write_json,
)

from dspark_jax import configs
from dspark_jax.cli import use_compilation_cache
from dspark_jax.decoding.engine import Engine, EngineConfig, compile_engines, warm_up_all
from dspark_jax.decoding.profiling import filled_state
from dspark_jax.errors import UserError
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.qwen3 import Qwen3

CONFIGS = {
    "qwen3-4b": ("qwen3-4b", "dspark-qwen3-4b"),
    "qwen3-8b": ("qwen3-8b", "dspark-qwen3-8b"),
    "qwen3-14b": ("qwen3-14b", "dspark-qwen3-14b"),
    "tiny": ("tiny-vanilla-target", "tiny-vanilla-dspark"),
}
# HBM bandwidth in GB/s by substring of jax's device_kind (first match wins).
BANDWIDTH_GBS = (
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM
    ("A100-SXM4-80GB", 2039.0),
    ("A100", 1555.0),
    ("TPU v5p", 2765.0),
    ("TPU v5 lite", 819.0),
    ("TPU v6 lite", 1640.0),
    ("TPU v4", 1200.0),
)
# Parameters read by row lookups only, so a decode step touches a few rows, not the table.
LOOKUP_ONLY = {"target": ("embed_tokens",), "drafter": ("embed_tokens", "markov_w1")}


def default_bandwidth_gbs(device_kind: str) -> float | None:
    for key, gbs in BANDWIDTH_GBS:
        if key in device_kind:
            return gbs
    return None


# Random values are drawn in blocks of at most this many elements, so the PRNG's 32-bit
# temporaries stay small even for a 150k x 5k embedding table.
RANDOM_BLOCK = 1 << 22


def _block_rows(rows: int, row_size: int) -> int:
    """The largest divisor of `rows` whose block fits RANDOM_BLOCK elements (at least 1)."""
    limit = max(1, RANDOM_BLOCK // max(row_size, 1))
    return max(d for d in range(1, min(rows, limit) + 1) if rows % d == 0)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _random_normalish(key, shape, dtype):
    """Uniform values with standard deviation 0.02, filled block by block along axis 0."""
    bound = 0.02 * 3**0.5
    rows = _block_rows(shape[0], int(np.prod(shape[1:])))

    def fill(i, out):
        block = jax.random.uniform(
            jax.random.fold_in(key, i), (rows, *shape[1:]), dtype, -bound, bound
        )
        return jax.lax.dynamic_update_slice_in_dim(out, block, i * rows, axis=0)

    return jax.lax.fori_loop(0, shape[0] // rows, fill, jnp.zeros(shape, dtype))


def random_model(constructor, seed: int):
    """A model with random weights, each leaf created directly in its dtype on the device.

    `nnx.eval_shape` gives the abstract parameters without allocating; each leaf is then filled
    by its own small jitted program, so no float32 copy of the model ever exists.
    """
    graphdef, abstract = nnx.split(nnx.eval_shape(constructor))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    key = jax.random.key(seed)
    filled = []
    for i, (path, leaf) in enumerate(leaves):
        name = str(getattr(path[-1], "key", path[-1]))
        shape, dtype = tuple(leaf.shape), jnp.dtype(leaf.dtype)
        if len(shape) > 1:
            filled.append(_random_normalish(jax.random.fold_in(key, i), shape, dtype))
        else:  # biases 0, norm scales 1
            filled.append(jnp.zeros(shape, dtype) if name == "bias" else jnp.ones(shape, dtype))
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, filled))


def pair_configs(config: str, dtype: str, max_position_embeddings: int | None = None):
    """(target config, drafter config) of `config` (a CONFIGS key) in `dtype`; a raised
    `max_position_embeddings` lets random-weight sweeps reach past the real model's limit."""
    target_name, drafter_name = CONFIGS[config]
    extra = (
        {}
        if max_position_embeddings is None
        else {"max_position_embeddings": max_position_embeddings}
    )
    target_cfg = dataclasses.replace(configs.get(target_name), dtype=dtype, **extra)
    drafter_cfg = configs.get(drafter_name)
    drafter_cfg = dataclasses.replace(
        drafter_cfg, model=dataclasses.replace(drafter_cfg.model, dtype=dtype, **extra)
    )
    return target_cfg, drafter_cfg


def random_pair(target_cfg, drafter_cfg, dtype: str, seed: int = 0, make_drafter=DSparkDrafter):
    """A target and a drafter (`make_drafter(cfg, rngs=, param_dtype=)`) with random weights."""
    target = random_model(lambda: Qwen3(target_cfg, rngs=nnx.Rngs(0), param_dtype=dtype), seed)
    drafter = random_model(
        lambda: make_drafter(drafter_cfg, rngs=nnx.Rngs(0), param_dtype=dtype), seed + 1
    )
    return target, drafter


def bytes_read_per_step(model, lookup_only: tuple[str, ...], tied: bool = False) -> int:
    """Parameter bytes a decode step reads; lookup tables count only when tied to the head."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]:
        names = {str(getattr(p, "key", p)) for p in path}
        if not tied and names & set(lookup_only):
            continue
        total += leaf.size * leaf.dtype.itemsize
    return total


def draft_step_bytes(drafter) -> int:
    """Parameter bytes each draft step after the first reads again: the Markov head's
    transition (its W2 over the vocabulary, its gate), applied once per block position since
    each position's bias depends on the token sampled before it (W1 is a lookup)."""
    head = getattr(drafter, "markov_head", None)
    return 0 if head is None else bytes_read_per_step(head, ("markov_w1",))


def kv_bytes_per_position(cfg) -> int:
    """Bytes of keys and values one cached position holds across all layers of `cfg`."""
    return (
        2
        * cfg.num_hidden_layers
        * cfg.num_key_value_heads
        * cfg.head_dim
        * (jnp.dtype(cfg.dtype).itemsize)
    )


def _rolled_back(state, slots: int, context: int, rep: int):
    """Every slot live again at `context` cached positions, with fresh keys for repeat `rep`."""
    return state.replace(
        live_s=jnp.ones((slots,), bool),
        lengths_s=jnp.full((slots,), context, jnp.int32),
        num_generated_s=jnp.zeros((slots,), jnp.int32),
        key_data_s=jax.random.key_data(
            jax.vmap(jax.random.key)(jnp.arange(slots, dtype=jnp.uint32) + rep * slots)
        ),
    )


def profile_chunk(engine: Engine, context: int, temperature: float, trace_dir: Path) -> dict:
    """An XLA profile of one decode chunk of a warmed-up engine, summarized by xla_profile."""
    slots = engine.cfg.num_slots
    state = filled_state(engine, context, temperature)
    state, out = engine.decode_chunk(_rolled_back(state, slots, context, 0))
    state = _rolled_back(state, slots, context, 1)
    jax.block_until_ready((out.count_s, state.lengths_s))

    def one_chunk():
        jax.block_until_ready(engine.decode_chunk(state)[1].count_s)

    wall = xla_profile.capture(one_chunk, trace_dir)
    # The same executable the chunk ran (jit's cache): its HLO names the profiled ops' shapes.
    hlo_text = engine.lower()["decode_chunk"].compile().as_text()
    (trace_dir / "decode_chunk.hlo.txt").write_text(hlo_text)
    return xla_profile.summarize(trace_dir, "jit_decode", wall, hlo_text=hlo_text)


def time_chunks(engine: Engine, context: int, repeats: int, temperature: float, prepare=None):
    """(median seconds per round, committed tokens per request-round, programs built while
    timing) with every slot live at `context` cached positions; `engine` is warmed up.
    `prepare` (state -> state), where given, sets what else the slots hold before the first
    chunk."""
    slots = engine.cfg.num_slots
    state = filled_state(engine, context, temperature)
    if prepare is not None:
        state = prepare(state)
    # An untimed chunk: it also compiles the small eager ops that roll the slots back.
    state, out = engine.decode_chunk(_rolled_back(state, slots, context, 0))
    jax.block_until_ready(out.count_s)
    per_round, tokens = [], []
    with CompileClock() as late:
        for rep in range(1, repeats + 1):
            state = _rolled_back(state, slots, context, rep)
            jax.block_until_ready(state.lengths_s)
            start = time.perf_counter()
            state, out = engine.decode_chunk(state)
            jax.block_until_ready(out.count_s)
            elapsed = time.perf_counter() - start
            rounds = int(np.sum(np.asarray(out.step_tokens_r) > 0))
            per_round.append(elapsed / rounds)
            tokens.append(float(np.sum(np.asarray(out.count_s))) / (rounds * slots))
    return statistics.median(per_round), statistics.median(tokens), late.programs


def default_context(args: argparse.Namespace) -> int:
    """--context, or its default: 128 for the tiny config, 1024 for the real ones."""
    if args.context is not None:
        return args.context
    return 128 if args.config == "tiny" else 1024


def bandwidth_from_json(path: str) -> float:
    """The GB/s that benchmarks/bandwidth.py --json wrote to `path` (UserError if it is not
    there or holds no positive number)."""
    data = read_json(path, "--bandwidth-json")
    gbs = data.get("gbs") if isinstance(data, dict) else None
    if isinstance(gbs, bool) or not isinstance(gbs, int | float) or not gbs > 0:
        raise UserError(
            f"--bandwidth-json {path}: no positive 'gbs' (write it with benchmarks/bandwidth.py "
            "--json)"
        )
    return float(gbs)


def run(args: argparse.Namespace) -> dict | None:
    """The table's rows (None with --compile-only, which times nothing)."""
    target_name, drafter_name = CONFIGS[args.config]
    target_cfg, drafter_cfg = pair_configs(args.config, args.dtype)
    context = default_context(args)
    gamma = drafter_cfg.block_size
    # Room for one chunk of rounds past the context: the slots are rolled back between chunks.
    max_len = -(-(context + (args.rounds + 1) * (gamma + 1)) // 128) * 128
    device = jax.devices()[0]
    bandwidth = args.bandwidth_gbs or default_bandwidth_gbs(device.device_kind)
    if args.bandwidth_json:
        bandwidth = bandwidth_from_json(args.bandwidth_json)

    target, drafter = random_pair(target_cfg, drafter_cfg, args.dtype, args.seed)
    target_weights = bytes_read_per_step(
        target, LOOKUP_ONLY["target"], tied=target_cfg.tie_word_embeddings
    )
    drafter_weights = bytes_read_per_step(drafter, LOOKUP_ONLY["drafter"])
    step_weights = draft_step_bytes(drafter)
    result = {
        "benchmark": "decode_speed",
        **measured(),
        "platform": device.platform,
        "jax": jax.__version__,
        "config": args.config,
        "target": target_name,
        "drafter": drafter_name,
        "dtype": args.dtype,
        "gamma": gamma,
        "context": context,
        "max_len": max_len,
        "rounds_per_chunk": args.rounds,
        "repeats": args.repeats,
        "temperature": args.temperature,
        "bandwidth_gbs": bandwidth,
        "target_weight_bytes": target_weights,
        "drafter_weight_bytes": drafter_weights,
        "draft_step_bytes": step_weights,
        "rows": [],
    }
    rows = result["rows"]
    # Every slot is live and the fixed policy verifies whole blocks, so each round packs exactly
    # `batch` (plain) or `batch * (gamma + 1)` tokens: one token bucket each. The engines'
    # default buckets would add the smaller ones, each a branch of the decode program holding a
    # whole target forward to compile (seven at 64 slots), never run here; likewise the
    # drafter's slot buckets below every slot.
    engines = {}
    for batch in args.batch_sizes:
        cfg = EngineConfig(
            num_slots=batch,
            max_model_len=max_len,
            rounds_per_chunk=args.rounds,
            prefill_chunk=16,
            prefill_buckets=(16,),
            token_buckets=(batch,),
        )
        engines[batch] = {
            "plain": Engine(target, None, cfg),
            "spec": Engine(
                target,
                drafter,
                dataclasses.replace(
                    cfg, token_buckets=(batch * (gamma + 1),), draft_buckets=(batch,)
                ),
            ),
        }
    # Every engine's programs at once, one per CPU core: the build waits for the largest
    # program, not for the sum of them all.
    all_engines = [e for pair in engines.values() for e in pair.values()]
    if args.compile_only:
        with CompileClock() as build:
            compile_engines(all_engines, args.compile_workers)
        print(
            f"compiled {build.programs} programs of {len(all_engines)} engines in "
            f"{build.wall_s:.0f} s into {jax.config.jax_compilation_cache_dir}",
            flush=True,
        )
        return None
    with CompileClock() as build:
        warm_up_all(all_engines, args.compile_workers)
    result["build"] = {
        "engines": len(all_engines),
        "programs": build.programs,
        "compile_s": build.compile_s,
        "wall_s": build.wall_s,
    }
    print(
        f"built {build.programs} programs of {len(all_engines)} engines in {build.wall_s:.0f} s",
        flush=True,
    )
    for batch in args.batch_sizes:
        row: dict = {"batch": batch}
        for mode, engine in engines[batch].items():
            seconds, tokens, late = time_chunks(engine, context, args.repeats, args.temperature)
            row[f"{mode}_ms"] = seconds * 1e3
            row[f"{mode}_tokens_per_round"] = tokens
            row[f"{mode}_compiles_while_timing"] = late
            if args.profile and batch in args.profile_batch:
                row[f"{mode}_profile"] = profile_chunk(
                    engine, context, args.temperature, Path(args.profile) / f"{mode}-b{batch}"
                )
        kv = batch * context * kv_bytes_per_position(target_cfg)
        draft_kv = batch * context * kv_bytes_per_position(drafter_cfg.model)
        row["target_step_bytes"] = target_weights + kv
        # The drafter's weights once, its Markov transition again at every later position.
        redrawn = (gamma - 1) * step_weights
        row["spec_round_bytes"] = target_weights + kv + drafter_weights + redrawn + draft_kv
        row["floor_ms"] = row["target_step_bytes"] / (bandwidth * 1e9) * 1e3 if bandwidth else None
        row["plain_tokens_per_s"] = batch / (row["plain_ms"] / 1e3)
        row["round_over_step"] = row["spec_ms"] / row["plain_ms"]
        row["projected"] = {
            f"{tau:g}": {
                "tokens_per_s": batch * tau / (row["spec_ms"] / 1e3),
                "speedup": tau * row["plain_ms"] / row["spec_ms"],
            }
            for tau in args.taus
        }
        rows.append(row)
        print(f"batch {batch} done", flush=True)
        if args.json:  # what is measured so far survives a run cut off later
            write_json(args.json, result)

    return result


def format_table(result: dict) -> str:
    taus = list(result["rows"][0]["projected"]) if result["rows"] else []

    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    head = (
        f"{'batch':>5} {'step ms':>9} {'floor ms':>9} {'step/floor':>10} {'plain tok/s':>11} "
        f"{'round ms':>9} {'round/step':>10} "
        + " ".join(f"{'tok/s@' + t:>11}" for t in taus)
        + " "
        + " ".join(f"{'x@' + t:>6}" for t in taus)
    )
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        ratio = r["plain_ms"] / r["floor_ms"] if r["floor_ms"] else None
        lines.append(
            f"{r['batch']:>5} {r['plain_ms']:>9.3f} {fmt(r['floor_ms'], '.3f'):>9} "
            f"{fmt(ratio, '.2f'):>10} {r['plain_tokens_per_s']:>11.1f} {r['spec_ms']:>9.3f} "
            f"{r['round_over_step']:>10.2f} "
            + " ".join(f"{r['projected'][t]['tokens_per_s']:>11.1f}" for t in taus)
            + " "
            + " ".join(f"{r['projected'][t]['speedup']:>6.2f}" for t in taus)
        )
    bandwidth = result["bandwidth_gbs"]
    late = sum(
        r["plain_compiles_while_timing"] + r["spec_compiles_while_timing"] for r in result["rows"]
    )
    build = result["build"]
    lines.append(
        f"compilations while timing: {late}; building the {build['programs']} programs of "
        f"{build['engines']} engines took {build['wall_s']:.0f} s ({build['compile_s']:.0f} s "
        "of compile time summed over threads)"
    )
    lines.append(
        f"{result['device']} ({result['platform']}), {result['target']} + {result['drafter']}, "
        f"{result['dtype']}, gamma {result['gamma']}, context {result['context']}, max_model_len "
        f"{result['max_len']}, bandwidth {fmt(bandwidth, '.0f')} GB/s, commit "
        f"{result['commit']}, {result['date']}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="qwen3-4b")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--context", type=positive_int, help="prompt tokens (default 1024; tiny 128)"
    )
    parser.add_argument("--rounds", type=positive_int, default=16, help="rounds per timed chunk")
    parser.add_argument(
        "--repeats", type=positive_int, default=5, help="timed chunks per cell (median)"
    )
    parser.add_argument("--taus", type=positive_float, nargs="+", default=[3.0, 5.0, 6.0])
    parser.add_argument(
        "--temperature", type=non_negative_float, default=1.0, help="0 = greedy (default 1.0)"
    )
    parser.add_argument(
        "--bandwidth-gbs",
        type=positive_float,
        help="HBM bandwidth for the floor (default: known devices; n/a on CPU)",
    )
    parser.add_argument(
        "--bandwidth-json", help="bandwidth measured by benchmarks/bandwidth.py (beats the others)"
    )
    parser.add_argument("--seed", type=int, default=0)
    add_compile_workers(parser)
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="also capture an XLA profile of one plain and one speculative chunk at each "
        "--profile-batch into DIR/<mode>-b<batch> and tabulate where its time goes",
    )
    parser.add_argument(
        "--profile-batch",
        type=positive_ints,
        help="batch sizes to profile, comma-separated (default: the first batch size)",
    )
    parser.add_argument("--json", default="decode_speed.json", help="output JSON path")
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="measure nothing: compile every engine's programs into the persistent compilation "
        "cache, for a later run with the same batch sizes, config, context and rounds to find "
        "(gpu_session.sh runs this beside the first tests)",
    )
    args = parser.parse_args()
    if min(args.batch_sizes) < 1 or args.rounds < 1 or args.repeats < 1:
        parser.error("--batch-sizes, --rounds and --repeats must be >= 1")
    if args.profile_batch is None:
        args.profile_batch = (args.batch_sizes[0],)
    elif args.profile and set(args.profile_batch) - set(args.batch_sizes):
        missing = ", ".join(map(str, sorted(set(args.profile_batch) - set(args.batch_sizes))))
        parser.error(f"--profile-batch {missing}: not among --batch-sizes")
    # Read and checked before anything is built: a bad file fails now, not after the models.
    if args.bandwidth_json:
        bandwidth_from_json(args.bandwidth_json)
    use_compilation_cache()
    if args.compile_only:
        compile_only_cache()
        run(args)
        return
    output_file(args.json, "--json")
    result = run(args)
    print(format_table(result))
    for row in result["rows"]:
        for mode in ("plain", "spec"):
            if f"{mode}_profile" in row:
                title = f"{mode} chunk, batch {row['batch']} ({args.rounds} rounds)"
                print(xla_profile.format_summary(row[f"{mode}_profile"], title))
    write_json(args.json, result)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    run_main(main)
