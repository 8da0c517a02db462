"""What presence, frequency and repetition penalties (`EngineConfig.penalties`) and a logit bias
(`EngineConfig.max_logit_bias`) cost a speculative round.

One random-weight pair (benchmarks/decode_speed.py's configs; `--vocab` overrides the
vocabulary, where the penalties' cost lies), `--slots` slots all live at `--context` cached
positions, rounds of a fixed gamma timed in compiled chunks as decode_speed.py times them. Three
cells, in one process:

- off: an engine without penalties (what every request without them ran before);
- on, unused: an engine with penalties whose requests have none (its rounds take the sampling
  as without; they add the counting of their committed tokens);
- on, used: the same engine, every request with presence_penalty 1, frequency_penalty 0.5
  and repetition_penalty 1.2 (the counts and prompt marks gathered for every verified row, the
  drafts before it added, the logits penalised, and the drafter's logits less the presence and
  frequency penalties of the counted tokens);
- with `--logit-bias K`, three more cells on an engine holding K biased tokens per slot (no
  penalties): bias_unused (no request has a bias), bias_used (every request biases K tokens)
  and allowed_used (every request may draw its K tokens alone: allowed_token_ids, which fill
  the same entries and mask the rest of the vocabulary).

Reported: each cell's median milliseconds per round and its ratio to off, the seconds each
engine's programs take to compile (no persistent cache: compiled here), and the bytes the counts
and the prompt marks hold.

    python benchmarks/penalties_cost.py --config tiny --vocab 32768 --logit-bias 16    # CPU
    python benchmarks/penalties_cost.py --slots 64 --logit-bias 16     # Qwen3-4B shapes (GPU)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from decode_speed import CONFIGS, pair_configs, random_pair, time_chunks
from provenance import (
    CompileClock,
    Parser,
    measured,
    output_file,
    positive_int,
    run_main,
    write_json,
)

from dspark_jax.decoding.engine import Engine, EngineConfig

PENALTIES = (1.0, 0.5, 1.2)  # presence, frequency, repetition (SlotState.penalties_s)


def run(args) -> dict:
    target_cfg, drafter_cfg = pair_configs(args.config, args.dtype)
    if args.vocab is not None:
        target_cfg = dataclasses.replace(target_cfg, vocab_size=args.vocab)
        drafter_cfg = dataclasses.replace(
            drafter_cfg, model=dataclasses.replace(drafter_cfg.model, vocab_size=args.vocab)
        )
    gamma = drafter_cfg.block_size
    target, drafter = random_pair(target_cfg, drafter_cfg, args.dtype, args.seed)
    max_len = -(-(args.context + (args.rounds + 1) * (gamma + 1)) // 128) * 128
    base = EngineConfig(
        num_slots=args.slots,
        max_model_len=max_len,
        rounds_per_chunk=args.rounds,
        prefill_chunk=16,
        prefill_buckets=(16,),
        token_buckets=(args.slots * (gamma + 1),),
        draft_buckets=(args.slots,),
    )
    result = {
        "benchmark": "penalties_cost",
        **measured(),
        "jax": jax.__version__,
        "config": args.config,
        "vocab": target_cfg.vocab_size,
        "dtype": args.dtype,
        "slots": args.slots,
        "gamma": gamma,
        "context": args.context,
        "rounds_per_chunk": args.rounds,
        "repeats": args.repeats,
        "temperature": args.temperature,
        "counts_bytes": args.slots * target_cfg.vocab_size * 4,  # SlotState.counts_sv, int32
        "marks_bytes": args.slots * target_cfg.vocab_size,  # SlotState.prompt_sv, bool
        "logit_bias": args.logit_bias,
    }
    builds = [("off", {}), ("on", {"penalties": True})]
    if args.logit_bias:
        builds.append(("bias", {"max_logit_bias": args.logit_bias}))
    engines = {}
    for name, changes in builds:
        engine = Engine(target, drafter, dataclasses.replace(base, **changes))
        with CompileClock() as build:
            engine.warm_up(workers=1)
        result[f"compile_s_{name}"] = build.compile_s
        engines[name] = engine
        print(f"built the engine '{name}' in {build.wall_s:.0f} s", flush=True)
    every = jnp.tile(jnp.asarray(PENALTIES, jnp.float32), (args.slots, 1))
    # Every slot biases its own K tokens, spread over the vocabulary, by alternately -1 and +1.
    k = max(args.logit_bias, 1)
    ids = (jnp.arange(args.slots * k, dtype=jnp.int32) * 7919) % target_cfg.vocab_size
    signs = jnp.where(jnp.arange(k) % 2 == 0, -1.0, 1.0)

    def penalise(state):  # every slot's request with PENALTIES
        return state.replace(penalties_s=every)

    def bias(state):  # every slot's request with its K biases
        return state.replace(
            bias_ids_sk=ids.reshape(args.slots, k), bias_sk=jnp.tile(signs, (args.slots, 1))
        )

    def allow(state):  # every slot's request allowed its K tokens alone, unbiased
        return state.replace(
            bias_ids_sk=ids.reshape(args.slots, k),
            bias_sk=jnp.zeros((args.slots, k), jnp.float32),
            allowed_s=jnp.ones((args.slots,), bool),
        )

    cells = [("off", "off", None), ("on_unused", "on", None), ("on_used", "on", penalise)]
    if args.logit_bias:
        cells += [
            ("bias_unused", "bias", None),
            ("bias_used", "bias", bias),
            ("allowed_used", "bias", allow),
        ]
    for cell, name, prepare in cells:
        seconds, _, late = time_chunks(
            engines[name], args.context, args.repeats, args.temperature, prepare
        )
        result[f"{cell}_ms"] = seconds * 1e3
        result[f"{cell}_compiles_while_timing"] = late
        if cell != "off":
            result[f"{cell}_over_off"] = result[f"{cell}_ms"] / result["off_ms"]
    return result


def format_table(r: dict) -> str:
    lines = [
        f"{r['config']} (vocabulary {r['vocab']}), {r['dtype']}, {r['slots']} slots, gamma "
        f"{r['gamma']}, context {r['context']}, T={r['temperature']:g}; counts "
        f"{r['counts_bytes'] / 2**20:.1f} MiB, prompt marks {r['marks_bytes'] / 2**20:.1f} MiB",
        f"{'cell':<12} {'ms/round':>9} {'x off':>6}",
    ]
    cells = ("off", "on_unused", "on_used", "bias_unused", "bias_used", "allowed_used")
    for cell in (c for c in cells if f"{c}_ms" in r):
        ratio = 1.0 if cell == "off" else r[f"{cell}_over_off"]
        lines.append(f"{cell:<12} {r[f'{cell}_ms']:>9.3f} {ratio:>6.3f}")
    bias = f", {r['compile_s_bias']:.1f} s with a logit bias" if "compile_s_bias" in r else ""
    lines.append(
        f"the engine's programs compile in {r['compile_s_off']:.1f} s off, "
        f"{r['compile_s_on']:.1f} s with penalties{bias}; {r['device']}, commit "
        f"{r['commit']}, {r['date']}"
    )
    return "\n".join(lines)


def main() -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="qwen3-4b")
    parser.add_argument("--vocab", type=positive_int, help="vocabulary size (default: config's)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--slots", type=positive_int, default=8)
    parser.add_argument("--context", type=positive_int, default=256)
    parser.add_argument("--rounds", type=positive_int, default=8, help="rounds per timed chunk")
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--logit-bias",
        type=int,
        default=0,
        metavar="K",
        help="also time an engine whose slots hold K biased tokens each (default 0: not)",
    )
    parser.add_argument("--json", help="write the result here too")
    args = parser.parse_args()
    if args.logit_bias < 0:
        parser.error(f"--logit-bias must be >= 0, got {args.logit_bias}")
    if args.json:
        output_file(args.json, "--json")
    result = run(args)
    print(format_table(result))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    run_main(main)
