"""What a decoding step costs, against what it should follow.

Three sweeps on the slot engine (random weights: speed does not depend on weight values):

1. context: a plain step of every slot at growing context lengths, the pool fixed -- the paged
   attention reads only the keys in use, so time should grow with the context;
2. preallocation: the same 48-token context with growing `max_model_len` (the per-request limit
   that sizes the page table) -- time should stay flat;
3. packed verification: one speculative round of `--slots` live slots in which no slot verifies a
   draft, one slot verifies its whole block, or every slot does -- the round packs the verified
   tokens, so one slot verifying 7 drafts should cost close to none verifying.

    python benchmarks/cost_model.py                      # tiny architecture, CPU
    python benchmarks/cost_model.py --config qwen3-4b    # real shapes (GPU/TPU)

Each cell is the median over --repeats timed chunks of --rounds rounds each (the slots are rolled
back between chunks, so every round sees the same context), after a warm-up chunk.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from decode_speed import CONFIGS, pair_configs, random_pair
from provenance import (
    CompileClock,
    Parser,
    add_compile_workers,
    measured,
    output_file,
    positive_int,
    run_main,
    write_json,
)

from dspark_jax.cli import use_compilation_cache
from dspark_jax.decoding.engine import Engine, EngineConfig, warm_up_all
from dspark_jax.decoding.profiling import CarriedLengths, filled_state


def round_ms(cases: list[tuple[Engine, int, np.ndarray]], repeats: int) -> list[float]:
    """Median ms per round for each (engine, context, lengths) case: slots `lengths >= 0` live
    at `context`, slot s verifying lengths[s] drafts (ignored by plain engines).

    The cases take turns, one timed chunk each per repeat, so load that comes and goes on a
    shared machine falls on all of them alike and their ratios stay meaningful."""
    states = [filled_state(engine, context) for engine, context, _ in cases]
    times: list[list[float]] = [[] for _ in cases]
    for rep in range(repeats + 1):
        for i, (engine, context, lengths) in enumerate(cases):
            slots = engine.cfg.num_slots
            state = states[i].replace(
                live_s=jnp.asarray(lengths >= 0),
                policy_carry=jnp.asarray(np.maximum(lengths, 0))
                if engine.speculative
                else states[i].policy_carry,
                lengths_s=jnp.full((slots,), context, jnp.int32),
                num_generated_s=jnp.zeros((slots,), jnp.int32),
            )
            jax.block_until_ready(state.lengths_s)
            start = time.perf_counter()
            state, out = engine.decode_chunk(state)
            jax.block_until_ready(out.count_s)
            rounds = int(np.sum(np.asarray(out.step_tokens_r) > 0))
            if rep:  # the first pass warms caches and allocators
                times[i].append((time.perf_counter() - start) / rounds * 1e3)
            states[i] = state
    return [statistics.median(t) for t in times]


def run(args: argparse.Namespace) -> dict:
    with CompileClock() as clock:
        result = _sweeps(args)
    print(
        f"built {clock.programs} programs, {clock.compile_s:.0f} s of compile time summed over "
        f"threads; the engines' build took {result['build_s']:.0f} s",
        flush=True,
    )
    return {**result, "programs": clock.programs, "compile_s": clock.compile_s}


# The preallocation sweep's context: every max_model_len it times must hold it.
PREALLOC_CONTEXT = 48


def chunk_room(rounds: int, gamma: int) -> int:
    """Positions one chunk of `rounds` speculative rounds (and the warm-up's one more) may add
    past the context: the slots are rolled back to it between chunks."""
    return (rounds + 1) * (gamma + 1)


def _sweeps(args: argparse.Namespace) -> dict:
    # Random weights at a raised context limit: the sweep reaches past the real model's.
    target_cfg, drafter_cfg = pair_configs(args.config, args.dtype, max_position_embeddings=1 << 16)
    target, drafter = random_pair(target_cfg, drafter_cfg, args.dtype, args.seed)
    gamma = drafter_cfg.block_size
    room = chunk_room(args.rounds, gamma)
    small = dict(prefill_chunk=16, prefill_buckets=(16,), rounds_per_chunk=args.rounds)
    # Plain steps of every slot pack exactly `slots` tokens: one token bucket, so the decode
    # program compiles one target forward rather than one per default bucket (1, 2, 4, ...).
    plain_small = dict(small, token_buckets=(args.slots,))
    all_live = np.zeros((args.slots,), np.int32)

    longest = max(args.contexts)
    cfg = EngineConfig(num_slots=args.slots, max_model_len=longest + room, **plain_small)
    plain = Engine(target, None, cfg)
    engines = [
        Engine(target, None, EngineConfig(num_slots=args.slots, max_model_len=n, **plain_small))
        for n in args.max_lens
    ]
    cfg = EngineConfig(num_slots=args.packed_slots, max_model_len=64 + room, **small)
    spec = Engine(target, drafter, cfg, policy=CarriedLengths())
    # Every engine's programs at once, one per CPU core (the states are allocated later, one
    # sweep at a time).
    with CompileClock() as build:
        warm_up_all([plain, *engines, spec], args.compile_workers)

    context_rows = []
    context_ms = round_ms([(plain, c, all_live) for c in args.contexts], args.repeats)
    for context, ms in zip(args.contexts, context_ms, strict=True):
        context_rows.append({"context": context, "ms": ms})
        print(f"context {context}: {ms:.3f} ms/step", flush=True)

    prealloc_rows = []
    prealloc_ms = round_ms([(e, PREALLOC_CONTEXT, all_live) for e in engines], args.repeats)
    for max_len, engine, ms in zip(args.max_lens, engines, prealloc_ms, strict=True):
        prealloc_rows.append(
            {"max_model_len": max_len, "pool_pages": engine.cfg.pool_pages, "ms": ms}
        )
        print(f"max_model_len {max_len}: {ms:.3f} ms/step", flush=True)

    none = np.zeros((args.packed_slots,), np.int32)
    one = none.copy()
    one[0] = gamma
    every = np.full((args.packed_slots,), gamma, np.int32)
    names = ("none", "one", "all")
    packed_ms = round_ms([(spec, 64, none), (spec, 64, one), (spec, 64, every)], args.repeats)
    packed = dict(zip(names, packed_ms, strict=True))
    print(f"packed round ms: {packed}", flush=True)

    device = jax.devices()[0]
    return {
        "benchmark": "cost_model",
        **measured(),
        "platform": device.platform,
        "config": args.config,
        "dtype": args.dtype,
        "slots": args.slots,
        "packed_slots": args.packed_slots,
        "gamma": gamma,
        "token_buckets": list(spec.token_buckets),
        "context": context_rows,
        "preallocation": prealloc_rows,
        "preallocation_ratio": prealloc_rows[0]["ms"] / prealloc_rows[-1]["ms"],
        "packed_ms": packed,
        "packed_one_over_none": packed["one"] / packed["none"],
        "packed_all_over_none": packed["all"] / packed["none"],
        "build_s": build.wall_s,
    }


def format_table(r: dict) -> str:
    lines = [f"{r['device']} ({r['platform']}), {r['config']} {r['dtype']}, commit {r['commit']}"]
    lines.append(f"1. plain step, {r['slots']} slots, by context in use (pool fixed)")
    lines += [f"   context {x['context']:>6}: {x['ms']:8.3f} ms" for x in r["context"]]
    lines.append(f"2. plain step, {r['slots']} slots at context 48, by max_model_len")
    lines += [
        f"   max_model_len {x['max_model_len']:>6} ({x['pool_pages']:>6} pages): {x['ms']:8.3f} ms"
        for x in r["preallocation"]
    ]
    lines.append(
        f"   speed at the largest / at the smallest: {r['preallocation_ratio']:.2f} (1 = flat)"
    )
    p = r["packed_ms"]
    lines.append(
        f"3. speculative round, {r['packed_slots']} live slots, token buckets {r['token_buckets']}"
    )
    lines.append(
        f"   none verifying {p['none']:.3f} ms, one verifying {r['gamma']} {p['one']:.3f} ms "
        f"({r['packed_one_over_none']:.2f}x), all verifying {p['all']:.3f} ms "
        f"({r['packed_all_over_none']:.2f}x)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    parser.add_argument("--slots", type=positive_int, default=8)
    parser.add_argument("--packed-slots", type=positive_int, default=32)
    parser.add_argument("--contexts", type=positive_int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument(
        "--max-lens",
        type=positive_int,
        nargs="+",
        default=[256, 2048, 8192],
        help=f"max_model_len of the preallocation sweep; each must hold its {PREALLOC_CONTEXT}-"
        "token context plus one chunk of rounds",
    )
    parser.add_argument("--rounds", type=positive_int, default=8)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    add_compile_workers(parser)
    parser.add_argument("--json", default="cost_model.json")
    args = parser.parse_args()
    gamma = pair_configs(args.config, args.dtype)[1].block_size
    need = PREALLOC_CONTEXT + chunk_room(args.rounds, gamma)
    short = [m for m in args.max_lens if m < need]
    if short:
        parser.error(
            f"--max-lens {' '.join(map(str, short))}: each must be at least {need}, the "
            f"{PREALLOC_CONTEXT}-token context plus room for a chunk of --rounds {args.rounds} "
            f"(({args.rounds} + 1) x {gamma + 1} tokens)"
        )
    output_file(args.json, "--json")
    use_compilation_cache()
    result = run(args)
    print(format_table(result))
    write_json(args.json, result)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    run_main(main)
