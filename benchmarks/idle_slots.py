"""What idle slots cost: one live request on an engine of 1 slot against one of `--slots`.

A round's work should follow the requests in it, not the engine's size. This decodes the same
greedy request alone on two engines that differ only in their slot count, for plain decoding
and for speculative decoding (fixed gamma, the whole block verified), alternating the engines
`--repeats` times, and prints the median decode time per token of each and their ratio (1.0:
idle slots cost nothing). The target's forward follows the tokens (token buckets) and so do
plain decoding's lm head and the attention's folds; the drafter's block still runs for every
slot (docs/engine.md, "One speculative round"), which this ratio measures.

    python benchmarks/idle_slots.py                 # the embedded pair, 1 vs 16 slots
    python benchmarks/idle_slots.py --slots 64 --json idle.json
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics

import jax
from provenance import Parser, git_commit, output_file, positive_int, run_main, write_json

from dspark_jax.checkpoints.converted import load_decoding_models
from dspark_jax.cli import use_compilation_cache
from dspark_jax.decoding.batching import Request, generate
from dspark_jax.decoding.engine import Engine, EngineConfig, warm_up_all
from dspark_jax.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET


def _per_token_s(engine: Engine, request: Request) -> float:
    (result,), timing = generate(engine, [request])
    return timing.decode_s / max(timing.decoded_tokens, 1)


def main() -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=positive_int, default=16, help="the larger engine's slots")
    parser.add_argument("--new-tokens", type=positive_int, default=200)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    if args.slots < 2:
        parser.error("--slots must be at least 2 (it is compared with one slot)")
    json_path = output_file(args.json, "--json") if args.json else None
    use_compilation_cache()
    models = load_decoding_models(EMBEDDED_TARGET, EMBEDDED_DRAFT, progress=False)
    gamma = models.drafter.cfg.block_size
    base = EngineConfig(max_model_len=512, page_size=16, rounds_per_chunk=8, prefill_chunk=64)
    engines = {}
    for mode in ("plain", "speculative"):
        for slots in (1, args.slots):
            cfg = dataclasses.replace(base, num_slots=slots)
            drafter = models.drafter if mode == "speculative" else None
            engines[mode, slots] = Engine(
                models.target, drafter, cfg, stop_tokens=models.stop_tokens
            )
    warm_up_all(list(engines.values()))
    request = Request(list(range(40, 72)), args.new_tokens, seed=0, ignore_eos=True)
    times: dict[tuple[str, int], list[float]] = {key: [] for key in engines}
    for _ in range(args.repeats):
        for key, engine in engines.items():
            times[key].append(_per_token_s(engine, request))
    rows = []
    print(f"one live greedy request, {args.new_tokens} tokens; median of {args.repeats}")
    print(f"| decoding | 1 slot (ms/token) | {args.slots} slots (ms/token) | ratio |")
    print("|---|---:|---:|---:|")
    for mode in ("plain", "speculative"):
        one = statistics.median(times[mode, 1])
        many = statistics.median(times[mode, args.slots])
        rows.append(
            dict(mode=mode, slots=args.slots, one_slot_s=one, many_slots_s=many, ratio=many / one)
        )
        label = mode if mode == "plain" else f"speculative (fixed gamma {gamma})"
        print(f"| {label} | {one * 1e3:.3f} | {many * 1e3:.3f} | {many / one:.2f} |")
    if json_path is not None:
        write_json(
            json_path,
            dict(
                date=datetime.date.today().isoformat(),
                commit=git_commit(),
                device=str(jax.devices()[0].device_kind),
                new_tokens=args.new_tokens,
                repeats=args.repeats,
                rows=rows,
            ),
        )
    return 0


if __name__ == "__main__":
    run_main(main)
