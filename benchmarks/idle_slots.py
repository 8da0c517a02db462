"""What idle slots cost: one live request on an engine of 1 slot against one of `--slots`.

A round's work should follow the requests in it, not the engine's size. This decodes the same
greedy request alone on engines that differ only in their slot count, for plain decoding and
for speculative decoding (fixed gamma, the whole block verified), alternating the engines
`--repeats` times, and prints the median decode time per token of each and their ratio (1.0:
idle slots cost nothing). The target's forward follows the tokens (token buckets), and so do
plain decoding's lm head, the attention's folds and the drafter's block (slot buckets,
docs/engine.md, "One speculative round"); a third row drafts every slot (`draft_buckets` of
the slot count alone), the engine as it was before the slot buckets, measured in the same run.

    python benchmarks/idle_slots.py                 # the embedded pair, 1 vs 16 slots
    python benchmarks/idle_slots.py --slots 64 --json idle.json
"""

from __future__ import annotations

import dataclasses
import statistics

from provenance import Parser, measured, output_file, positive_int, run_main, write_json

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
    modes = ("plain", "speculative", "every slot drafted")
    for mode in modes:
        for slots in (1, args.slots):
            # One slot has one slot bucket: the "every slot drafted" row shares its engine.
            cfg = dataclasses.replace(
                base,
                num_slots=slots,
                draft_buckets=(slots,) if mode == "every slot drafted" else None,
            )
            drafter = models.drafter if mode != "plain" else None
            engines[mode, slots] = (
                engines["speculative", 1]
                if mode == "every slot drafted" and slots == 1
                else Engine(models.target, drafter, cfg, stop_tokens=models.stop_tokens)
            )
    distinct = list({id(e): e for e in engines.values()}.values())
    warm_up_all(distinct)
    request = Request(list(range(40, 72)), args.new_tokens, seed=0, ignore_eos=True)
    times: dict[int, list[float]] = {id(e): [] for e in distinct}
    for _ in range(args.repeats):
        for engine in distinct:
            times[id(engine)].append(_per_token_s(engine, request))
    rows = []
    print(f"one live greedy request, {args.new_tokens} tokens; median of {args.repeats}")
    print(f"| decoding | 1 slot (ms/token) | {args.slots} slots (ms/token) | ratio |")
    print("|---|---:|---:|---:|")
    labels = {
        "plain": "plain",
        "speculative": f"speculative (fixed gamma {gamma})",
        "every slot drafted": f"speculative, every slot drafted (draft_buckets ({args.slots},))",
    }
    for mode in modes:
        one = statistics.median(times[id(engines[mode, 1])])
        many = statistics.median(times[id(engines[mode, args.slots])])
        rows.append(
            dict(mode=mode, slots=args.slots, one_slot_s=one, many_slots_s=many, ratio=many / one)
        )
        label = labels[mode]
        print(f"| {label} | {one * 1e3:.3f} | {many * 1e3:.3f} | {many / one:.2f} |")
    if json_path is not None:
        write_json(
            json_path,
            dict(
                **measured(day=True),
                new_tokens=args.new_tokens,
                repeats=args.repeats,
                rows=rows,
            ),
        )
    return 0


if __name__ == "__main__":
    run_main(main)
