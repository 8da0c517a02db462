"""What a verification moves over the vocabulary, read from the compiled program: the [rows, V]
arrays the lm head, the sampling filter and the verifier write and read.

A speculative round at Qwen3's vocabulary (151936) verifies up to 512 tokens at 64 slots, and
every [512, V] float32 array it writes is 311 MB: on a GPU the vocabulary side of a round costs
memory traffic comparable to the target's weights (8 GB at 4B), more when rows filter. This
compiles that side alone -- the lm head over the packed tokens (float32 logits, as
`layers.Embed.attend` makes them), `filtered_logprobs` under per-token settings,
`verify_packed`, the committed tokens' `token_logprobs` -- and reports, from XLA's optimised
program:

- every [rows, V] array the round writes, every round (greedy and temperature-only rounds
  included) or only inside a conditional, and at most how much of them is read back;
- for each halving loop of the top-k / top-p cutoff search (`sampling._row_cutoffs`, one per
  block of 8, 64 or all rows), the [rows, V] bytes each pass carries and reads, times its passes
  (on the CPU; for a GPU the search is written out, no loop);
- the reductions over [rows, V] arrays outside loops, by rows, and the bytes of [rows, V]
  operands they read: for a GPU, where the search's 32 halvings per filter are among them.

By default it compiles for an H100 without one (benchmarks/deviceless.py; needs
`pip install "jax[cuda12]"`, no GPU); `--platform here` compiles for this machine's backend.

    python benchmarks/vocab_traffic.py                         # 64 slots, gamma 7, Qwen3-4B
    python benchmarks/vocab_traffic.py --platform here --vocab 4096 --slots 4 --hidden 64
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*?)\)(.*)$")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_KIND = re.compile(r"kind=(k\w+)")


def vocab_bytes(shape_text: str, vocab: int) -> int:
    """Bytes of the arrays in `shape_text` (a shape or a tuple of shapes) that have a dimension
    of `vocab`."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        sizes = [int(d) for d in dims.split(",") if d]
        if vocab in sizes:
            n = 1
            for d in sizes:
                n *= d
            total += n * _BYTES[dtype]
    return total


@dataclass
class Write:
    op: str
    shape: str
    mb: float
    branch: bool  # inside a conditional's branch (not every round)


@dataclass
class Loop:
    rows: int  # the block the loop searches
    passes: int
    carried: str  # the [rows, V] arrays each pass reads
    mb_per_pass: float
    mb: float


@dataclass
class Reductions:
    rows: int  # the rows they reduce (their output's first dimension)
    count: int  # reduction kernels (XLA's input fusions) reading [*, V] arrays, outside loops
    mb_each: float  # the most [*, V] bytes one of them reads (a gathering one: all it gathers from)
    mb: float  # all of them together


@dataclass
class Traffic:
    writes: list[Write]
    read_back_mb: float  # of the arrays written, by the passes outside the search's loops
    loops: list[Loop]
    reductions: list[Reductions]


def analyse(hlo: str, vocab: int) -> Traffic:
    """The vocabulary-sized traffic of an optimised HLO module's text (`Compiled.as_text()`).

    Reads are counted for arrays the program writes (the logits and what is made from them),
    each time a fusion, reduction or copy takes one whole: an upper bound, since a fusion that
    gathers a few rows of one counts it all. The program's inputs are not counted."""
    fused = set(re.findall(r"calls=%?([\w.\-]+)", hlo))
    branches = set()
    for group in re.findall(r"branch_computations=\{([^}]*)\}", hlo):
        branches.update(b.strip().lstrip("%") for b in group.split(","))
    for key in ("true_computation", "false_computation"):
        branches.update(re.findall(key + r"=%?([\w.\-]+)", hlo))
    params = {}  # computation -> its parameters' shapes (its header's text)
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head and " = " not in line:
            params[head.group(1)] = line[line.find("(") : line.rfind("->")]
    reductions: dict[int, list[int]] = {}  # rows -> bytes each reduction reads
    bodies = {}  # while body computation -> (carried shape text, trip count)
    written: dict[str, int] = {}
    writes, loops, read_back = [], [], 0
    current = None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head and " = " not in line:
            current = head.group(1)
            continue
        inst = _INSTRUCTION.match(line)
        if inst is None or current is None or current in fused:
            continue
        name, shape, op, operands, rest = inst.groups()
        if op == "while":
            body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
            trips = _TRIPS.search(rest)
            bodies[body] = (shape, int(trips.group(1)) if trips else 1)
            continue
        if op not in ("fusion", "custom-call", "dot", "reduce", "sort", "copy"):
            continue
        kind = _KIND.search(rest)
        if op == "fusion" and kind and kind.group(1) == "kInput" and current not in bodies:
            called = re.search(r"calls=%?([\w.\-]+)", rest).group(1)
            read = vocab_bytes(params.get(called, ""), vocab)
            out = _ARRAY.findall(shape)
            if read and out and out[0][1]:
                # The rows it reduces: its output's first dimension (an operand may be a
                # larger array it gathers rows of, counted whole).
                reductions.setdefault(int(out[0][1].split(",")[0]), []).append(read)
        if current not in bodies:
            for operand in operands.split(","):
                read_back += written.get(operand.strip().lstrip("%"), 0)
        size = vocab_bytes(shape, vocab)
        if size and current not in bodies:
            written[name] = size
            label = kind.group(1) if op == "fusion" and kind else op
            writes.append(Write(label, shape, size / 1e6, current in branches))
    for shape, trips in bodies.values():
        carried = vocab_bytes(shape, vocab)
        if carried:
            arrays = [f"{t}[{d}]" for t, d in _ARRAY.findall(shape) if str(vocab) in d.split(",")]
            rows = int(_ARRAY.findall(arrays[0])[0][1].split(",")[0])
            loops.append(Loop(rows, trips, " ".join(arrays), carried / 1e6, carried * trips / 1e6))
    loops.sort(key=lambda loop: (loop.rows, loop.mb))
    reduced = [Reductions(rows, len(b), max(b) / 1e6, sum(b) / 1e6)
               for rows, b in sorted(reductions.items())]
    return Traffic(writes, read_back / 1e6, loops, reduced)


def verification(slots: int, gamma: int, hidden: int, vocab: int, dtype, device):
    """The jitted vocabulary side of one round and its argument shapes, on `device`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from dspark_jax.decoding.engine import _scores
    from dspark_jax.decoding.verify import verify_packed
    from dspark_jax.sampling import RowSampling, logprobs_and_argmax

    tokens = slots * (gamma + 1)

    def round_(hidden_td, head_vd, slot_t, temperature, top_k, top_p, drafts, draft_logp, rows,
               lengths, keys, positions, stops, level):
        # The lm head as `layers.Embed.attend` computes it: inputs in the model's dtype,
        # float32 accumulated and returned.
        logits_tv = jnp.einsum("td,vd->tv", hidden_td, head_vd, preferred_element_type=jnp.float32)
        settings = RowSampling(temperature, top_k, top_p, jnp.zeros_like(top_p))
        logp_tv, argmax_t = logprobs_and_argmax(logits_tv, settings.take(slot_t))
        result = verify_packed(drafts, draft_logp, logp_tv, rows, lengths, keys, positions,
                               settings, stops)
        # The committed tokens' own log-probabilities (and alternatives), as the engine reports
        # them: in a switch, run only when a live request asked (`engine._scores`).
        return result, _scores(level, logits_tv, rows, result.tokens_bj, argmax_t)

    place = SingleDeviceSharding(device)
    shape = lambda dims, t: jax.ShapeDtypeStruct(dims, t, sharding=place)  # noqa: E731
    args = (
        shape((tokens, hidden), dtype), shape((vocab, hidden), dtype), shape((tokens,), jnp.int32),
        shape((slots,), jnp.float32), shape((slots,), jnp.int32), shape((slots,), jnp.float32),
        shape((slots, gamma), jnp.int32), shape((slots, gamma, vocab), jnp.float32),
        shape((slots, gamma + 1), jnp.int32), shape((slots,), jnp.int32),
        shape((slots, 2), jnp.uint32), shape((slots,), jnp.int32), shape((slots, 4), jnp.int32),
        shape((), jnp.int32),
    )
    from dspark_jax.models.layers import compiler_options

    return jax.jit(round_, compiler_options=compiler_options(device)), args


def main() -> int:
    from deviceless import GPUS
    from provenance import Parser, git_commit, output_file, positive_int, write_json

    parser = Parser(description=__doc__.split("\n")[0])
    parser.add_argument("--slots", type=positive_int, default=64, help="slots verified (64)")
    parser.add_argument("--gamma", type=positive_int, default=7, help="drafts per slot (7)")
    parser.add_argument("--hidden", type=positive_int, default=2560, help="hidden size (4B's)")
    parser.add_argument("--vocab", type=positive_int, default=151_936, help="V (Qwen3's)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--platform",
        default="h100",
        choices=("here", *sorted(GPUS)),
        help="compile for that GPU without one (h100, the default; h200) or for this backend",
    )
    parser.add_argument("--json", help="write the tables here too")
    args = parser.parse_args()
    if args.json:
        output_file(args.json, "--json")
    if args.platform in GPUS:
        from deviceless import gpu_devices

        device = gpu_devices(args.platform)[0]
    import jax
    import jax.numpy as jnp

    if args.platform == "here":
        device = jax.devices()[0]
    fn, shapes = verification(
        args.slots,
        args.gamma,
        args.hidden,
        args.vocab,
        jnp.dtype(args.dtype),
        device,
    )
    # Traced as for a GPU when compiling for one (`absent_gpu_target`): the library makes some
    # choices for the backend it traces for (whether the cutoff search is a loop, for one).
    from dspark_jax.decoding.engine import absent_gpu_target

    platforms = ("cuda",) if args.platform in GPUS else None
    with absent_gpu_target(platforms, device.device_kind):
        lowered = fn.trace(*shapes).lower(lowering_platforms=platforms)
    traffic = analyse(lowered.compile().as_text(), args.vocab)
    rows = args.slots * (args.gamma + 1)
    print(f"{device.device_kind}, {rows} verified rows x V {args.vocab}, {args.dtype} lm head "
          f"(float32 logits), commit {git_commit()}")
    every = [w for w in traffic.writes if not w.branch]
    print("[rows, V] arrays written, every round:")
    for w in every:
        print(f"  {w.op:12s} {w.shape[:56]:56s} {w.mb:9.1f} MB")
    print("  ... and inside conditionals (the search's gathered blocks, categorical draws):")
    for w in traffic.writes:
        if w.branch:
            print(f"  {w.op:12s} {w.shape[:56]:56s} {w.mb:9.1f} MB")
    print(f"  written every round {sum(w.mb for w in every):.1f} MB; read back at most "
          f"{traffic.read_back_mb:.1f} MB")
    print("cutoff search, per halving loop (top-k, top-p) of each block of filtering rows:")
    for loop in traffic.loops:
        print(f"  block {loop.rows:4d}: {loop.passes} passes x {loop.mb_per_pass:7.1f} MB "
              f"({loop.carried}) = {loop.mb:8.1f} MB")
    if not traffic.loops:
        print("  none (written out: its halvings are among the reductions below)")
    print("reductions of [rows, V] outside loops (kernels; the [*, V] operands' bytes, whole even "
          "where a few rows are gathered):")
    for r in traffic.reductions:
        print(f"  rows {r.rows:4d}: {r.count:4d} reductions, at most {r.mb_each:7.1f} MB each, "
              f"{r.mb:8.1f} MB in all")
    if args.json:
        write_json(args.json, {
            "device": device.device_kind, "commit": git_commit(), "rows": rows,
            "vocab": args.vocab, "dtype": args.dtype, **asdict(traffic),
        })
    return 0


if __name__ == "__main__":
    from provenance import run_main

    run_main(main)
