"""What top-k / top-p filtering costs a step: `sampling.filtered_logprobs` over [rows, V].

Every verification and every drafting step filters the logits of all its rows in one program
(the settings are per-row data). The cutoff search covers only the rows that filter, gathered
into a block of 8, 64 or 512 rows or the whole batch, so this times the filter with 1, 8 and 64
of the rows filtering as well as every row, against plain temperature sampling in the same run,
and times a sort of the same [rows, V] logits for scale (the filter finds its cutoffs by
bisection, with no sort; a sort is what the usual implementation pays).

    python benchmarks/sampling_filters.py [--rows 64] [--vocab 151936] [--json out.json]
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from provenance import Parser, git_commit, output_file, positive_int, run_main, write_json

from dspark_jax.models.layers import compiler_options
from dspark_jax.sampling import RowSampling, filtered_logprobs

# (label, temperature, top_k, top_p, rows using them): None = every row; the other rows sample at
# temperature 1. Counts at or above --rows are left out.
MIXES = (
    ("greedy", 0.0, 0, 1.0, None),
    ("temperature 1", 1.0, 0, 1.0, None),
    ("top-p 0.9, 1 row", 1.0, 0, 0.9, 1),
    ("top-p 0.9, 8 rows", 1.0, 0, 0.9, 8),
    ("top-p 0.9, 64 rows", 1.0, 0, 0.9, 64),
    ("top-p 0.9, every row", 1.0, 0, 0.9, None),
    ("top-k 50, 1 row", 1.0, 50, 1.0, 1),
    ("top-k 50, every row", 1.0, 50, 1.0, None),
    ("top-k 50 + top-p 0.9, 1 row", 1.0, 50, 0.9, 1),
    ("top-k 50 + top-p 0.9, every row", 1.0, 50, 0.9, None),
)


def rows_for(mix, rows: int) -> RowSampling:
    """Settings [rows]: the mix's on its rows, spread evenly over the batch; T=1 on the rest."""
    _, temperature, top_k, top_p, count = mix
    t = np.ones(rows, np.float32)
    k = np.zeros(rows, np.int32)
    p = np.ones(rows, np.float32)
    chosen = np.linspace(0, rows - 1, count or rows).round().astype(int)
    t[chosen], k[chosen], p[chosen] = temperature, top_k, top_p
    return RowSampling(
        temperature=jnp.asarray(t),
        top_k=jnp.asarray(k),
        top_p=jnp.asarray(p),
        min_p=jnp.zeros(rows, jnp.float32),
    )


def median_ms(calls: list, repeats: int) -> list[float]:
    """Median milliseconds of each `(fn, *args)` call, timed in turns (one call of each a round)
    so that load drifting on a shared machine weighs on every call alike."""
    for fn, *args in calls:
        jax.block_until_ready(fn(*args))
    times = [[] for _ in calls]
    for _ in range(repeats):
        for (fn, *args), call_times in zip(calls, times, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            call_times.append(time.perf_counter() - start)
    return [statistics.median(call_times) * 1e3 for call_times in times]


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=positive_int, default=64, help="rows filtered (64)")
    parser.add_argument("--vocab", type=positive_int, default=151_936, help="V (Qwen3's)")
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed rounds (10)")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    if args.json:
        output_file(args.json, "--json")
    logits = jax.random.normal(jax.random.key(0), (args.rows, args.vocab), jnp.float32) * 3
    # Compiled as the engine compiles its programs: on an NVIDIA GPU the cutoff search's loops
    # run inside the CUDA graph (layers.compiler_options).
    filt = jax.jit(filtered_logprobs, compiler_options=compiler_options(jax.devices()[0]))
    sort = jax.jit(lambda x: jnp.sort(x, axis=-1))
    mixes = [mix for mix in MIXES if mix[-1] is None or mix[-1] < args.rows]
    calls = [(filt, logits, rows_for(mix, args.rows)) for mix in mixes] + [(sort, logits)]
    *mix_ms, sort_ms = median_ms(calls, args.repeats)
    table = [
        {"mix": mix[0], "filtering": mix[-1] or args.rows, "ms": ms}
        for mix, ms in zip(mixes, mix_ms, strict=True)
    ]
    base = next(r["ms"] for r in table if r["mix"] == "temperature 1")
    device = jax.devices()[0].device_kind
    print(f"{device}, [{args.rows}, {args.vocab}] float32 logits, commit {git_commit()}")
    print(f"{'rows sampled with':32} {'ms':>9} {'x temperature 1':>16}")
    for r in table:
        r["ratio"] = r["ms"] / base
        print(f"{r['mix']:32} {r['ms']:9.2f} {r['ratio']:16.2f}")
    print(f"{'(a sort of the same logits)':32} {sort_ms:9.2f} {sort_ms / base:16.2f}")
    if args.json:
        write_json(
            args.json,
            {
                "device": device,
                "commit": git_commit(),
                "rows": args.rows,
                "vocab": args.vocab,
                "table": table,
                "sort_ms": sort_ms,
            },
        )


if __name__ == "__main__":
    run_main(main)
