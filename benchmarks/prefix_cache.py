"""What the prefix cache saves: requests sharing a long prompt prefix, with and without it.

`--requests` requests, each the shared prefix (a system prompt, few-shot examples) plus
`--tail` tokens of its own, arrive together and run through the continuously batched loop, in
three scenarios: "after a carrier" -- a first request carrying the prefix has run alone before
(the server's earlier traffic), so the prefix is cached -- "together" -- nothing is cached
and the requests share the prefix one of them is prefilling -- and "next turn" -- the requests
have each had a first turn answered (`--answer` tokens) and now send it back, answer included,
with `--tail` tokens more, as a chat client sends the next turn. Each is timed on one `Batcher`
with the prefix cache and on one without, alternated `--repeats` times: wall time, time in
prefill calls, mean time to first token and the prompt tokens prefilled. Same requests, same
engine; greedy, and each request's tokens are checked equal in both modes.

    python benchmarks/prefix_cache.py                     # the embedded pair, 448-token prefix
    python benchmarks/prefix_cache.py --prefix 960 --json prefix.json
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from provenance import Parser, measured, output_file, positive_int, run_main, write_json

from dspark_jax.checkpoints.converted import load_decoding_models
from dspark_jax.cli import use_compilation_cache
from dspark_jax.decoding.batching import Batcher, Request, Result
from dspark_jax.decoding.engine import Engine, EngineConfig
from dspark_jax.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET


def _run(batcher: Batcher, requests: list[Request]) -> list[Result]:
    results: list[Result | None] = [None] * len(requests)

    def keep(i):
        return lambda kind, payload: results.__setitem__(i, payload) if kind == "done" else None

    for i, r in enumerate(requests):
        batcher.submit(r, keep(i))
    batcher.run_until_idle()
    return results


def _phase(engine: Engine, before: list[Request], timed, caching: bool) -> dict:
    """Runs `before` (untimed), then times the requests `timed(their results)` makes."""
    batcher = Batcher(engine, timed=True, prefix_caching=caching)
    earlier = _run(batcher, before) if before else []
    rest = timed(earlier)
    prefill_s, prefill_calls = batcher.timing.prefill_s, batcher.timing.prefill_calls
    t0 = time.perf_counter()
    results = _run(batcher, rest)
    wall = time.perf_counter() - t0
    return dict(
        wall_s=wall,
        prefill_s=batcher.timing.prefill_s - prefill_s,
        prefill_calls=batcher.timing.prefill_calls - prefill_calls,
        ttft_s=statistics.mean(r.ttft_s for r in results),
        prefilled=sum(r.prompt_len - r.cached_tokens for r in results),
        tokens=[r.tokens for r in results],
    )


def main() -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=positive_int, default=448, help="shared prompt tokens")
    parser.add_argument("--tail", type=positive_int, default=16, help="each request's own tokens")
    parser.add_argument("--requests", type=positive_int, default=16)
    parser.add_argument("--slots", type=positive_int, default=8)
    parser.add_argument("--new-tokens", type=positive_int, default=16)
    parser.add_argument(
        "--answer", type=positive_int, default=128, help="first-turn answer tokens (next turn)"
    )
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument(
        "--dtype",
        choices=("stored", "float32"),
        default="stored",
        help="the pair as stored (bfloat16) or in float32, where cached K/V rounds as computed "
        "K/V does and every request draws the same tokens with and without the cache",
    )
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    json_path = output_file(args.json, "--json") if args.json else None
    use_compilation_cache()
    models = load_decoding_models(
        EMBEDDED_TARGET,
        EMBEDDED_DRAFT,
        None if args.dtype == "stored" else jnp.float32,
        progress=False,
    )
    gamma = models.drafter.cfg.block_size
    length = args.prefix + 2 * args.tail + args.answer + args.new_tokens + gamma + 1
    max_model_len = -(-length // 16) * 16
    cfg = EngineConfig(
        num_slots=args.slots,
        max_model_len=max_model_len,
        page_size=16,
        # What the slots reserve, and room beside it to keep every request's first turn cached
        # while the others run (a pool only as large as the reservations evicts idle pages as
        # soon as a request needs them).
        num_pages=(args.slots + args.requests) * max_model_len // 16,
        rounds_per_chunk=8,
        prefill_chunk=512,
    )
    engine = Engine(models.target, models.drafter, cfg, stop_tokens=models.stop_tokens)
    engine.warm_up()
    vocab = models.target.cfg.vocab_size
    prefix = [(7 * i + 11) % (vocab - 2) + 1 for i in range(args.prefix)]

    def tail(k: int) -> list[int]:
        return [(13 * k + 5 * j + 3) % (vocab - 2) + 1 for j in range(args.tail)]

    def request(k: int, new_tokens: int = args.new_tokens) -> Request:
        return Request(prefix + tail(k), new_tokens, seed=k, ignore_eos=True)

    first, rest = request(0), [request(k) for k in range(1, args.requests + 1)]
    turns = [request(k, args.answer) for k in range(1, args.requests + 1)]

    def next_turns(answered: list[Result]) -> list[Request]:
        return [
            Request(
                list(t.prompt_ids) + a.tokens + tail(-k), args.new_tokens, seed=k, ignore_eos=True
            )
            for k, (t, a) in enumerate(zip(turns, answered, strict=True), 1)
        ]

    # (requests run before, untimed; the timed requests made from their results)
    scenarios = {
        "after a carrier": ([first], lambda _: rest),
        "together": ([], lambda _: rest),
        "next turn": (turns, next_turns),
    }
    runs: dict[tuple[str, bool], list[dict]] = {
        (name, caching): [] for name in scenarios for caching in (False, True)
    }
    for _ in range(args.repeats):
        for (name, caching), cells in runs.items():
            cells.append(_phase(engine, *scenarios[name], caching))
    # Requests (of the first repeat) whose tokens differ with and without the cache.
    differing = {}
    for n in scenarios:
        cached, uncached = runs[n, True][0]["tokens"], runs[n, False][0]["tokens"]
        differing[n] = sum(a != b for a, b in zip(cached, uncached, strict=True))
    same = not any(differing.values())
    for name, count in differing.items():
        if count:
            print(
                f"note: {count} of {args.requests} requests ({name}) drew other tokens with the "
                "cache: K/V from cached pages rounds otherwise in bfloat16 (docs/serving.md)"
            )
    rows = {}
    for (name, caching), cells in runs.items():
        rows[f"{name}, {'with' if caching else 'without'}"] = {
            k: statistics.median(c[k] for c in cells)
            for k in ("wall_s", "prefill_s", "ttft_s", "prefilled", "prefill_calls")
        }
    print(
        f"{args.requests} requests of a {args.prefix}-token shared prefix + {args.tail} tokens "
        f"each, {args.new_tokens} new tokens, {args.slots} slots (next turn: after a first "
        f"turn of {args.answer} tokens, {args.tail} more); median of {args.repeats}; "
        f"{jax.devices()[0].device_kind}"
    )
    print("| scenario | prefix cache | prompt tokens prefilled | prefill calls | prefill (s) | "
          "mean TTFT (s) | wall (s) |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, row in rows.items():
        name, mode = label.split(", ")
        print(
            f"| {name} | {mode} | {row['prefilled']:.0f} | {row['prefill_calls']:.0f} | "
            f"{row['prefill_s']:.3f} | {row['ttft_s']:.3f} | {row['wall_s']:.3f} |"
        )
    for name in scenarios:
        off, on = rows[f"{name}, without"], rows[f"{name}, with"]
        print(
            f"{name}, with / without: prefill {on['prefill_s'] / off['prefill_s']:.2f}, "
            f"TTFT {on['ttft_s'] / off['ttft_s']:.2f}, wall {on['wall_s'] / off['wall_s']:.2f}"
        )
    if json_path is not None:
        write_json(
            json_path,
            dict(
                **measured(day=True),
                args=vars(args),
                rows=rows,
                same_tokens=same,
                differing_requests=differing,
            ),
        )
    return 0


if __name__ == "__main__":
    run_main(main)
