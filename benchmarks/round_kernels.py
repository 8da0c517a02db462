"""The kernels one decode round launches, read from a compiled decode program's optimised HLO.

At batch 1 a plain decode step of Qwen3-4B reads 202 MB of weights a layer, 42 us at an
H200's 4.8 TB/s (docs/benchmarks.md); each kernel a layer launches besides its GEMMs costs a
few microseconds on the device however little it does (launch, ramp-up, a tail at partial
occupancy). So whether a
step can reach the HBM floor depends on how many kernels a layer launches, which the compiled
program says without a GPU. This reads one (`lowering_time.py --compile --hlo DIR` writes
them) and reports:

- the kernels one round launches: every instruction of the rounds loop's body and test that
  runs on the device (fusions, custom calls such as the Triton attention and cuBLAS, copies,
  unfused ops), each conditional at its largest branch and each inner loop (body and test) at
  its known trip count: an upper bound, since the sampling filters' searches run only when a
  row filters; and the same with every conditional at its smallest branch (the token-bucket
  conditional at its smallest bucket: a single bucket's second branch never runs);
- conditionals and inner-loop trips a round takes: on a GPU each decides on the host what
  runs next, which reads a predicate back from the device unless XLA puts it in a CUDA graph;
- per target layer: the launches inside the round's largest conditional (the token-bucket
  switch around the target's forward) that belong to the layer program (`decoder_layer`),
  divided by the layers (one paged-attention kernel each, or --layers), and one layer's
  kernels in schedule order with their shapes.

    python benchmarks/lowering_time.py --platform h100 --compile --plain --slots 1 \\
        --programs decode_chunk --hlo hlo/
    python benchmarks/round_kernels.py hlo/decode_chunk.txt

Reads text only: no JAX, no GPU.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from pathlib import Path

from provenance import Parser, existing_file, positive_int, run_main, write_json

from dspark_jax.errors import UserError

_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([a-z][\w\-]*)\((.*)$")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# Instructions that launch nothing: views, tuples, constants, parameters.
_NO_KERNEL = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
}  # fmt: skip
LAYER = "decoder_layer"
ATTENTION = "paged_attention_partials"


@dataclass
class Op:
    name: str
    shape: str
    opcode: str
    rest: str

    @property
    def op_name(self) -> str:
        match = _OP_NAME.search(self.rest)
        return match.group(1) if match else ""

    def called(self, key: str) -> list[str]:
        match = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\-]+)", self.rest)
        names = match.group(1).strip("{}").split(",") if match else []
        return [n.strip().lstrip("%") for n in names]

    @property
    def kind(self) -> str:
        """The kernel's kind for the tables."""
        if self.opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', self.rest)
            target = target.group(1) if target else "?"
            if "triton" in target:
                return "Triton (attention)"
            return "cuBLAS" if "cublas" in target else f"custom call {target}"
        if self.opcode == "fusion":
            if "gemm" in self.name or "__triton_gemm" in self.rest or "cublas" in self.rest:
                return "GEMM fusion"
            return "other fusion"
        return "copy" if self.opcode == "copy" else f"unfused {self.opcode}"


@dataclass
class Count:
    kernels: collections.Counter = field(default_factory=collections.Counter)
    conditionals: int = 0
    loop_trips: int = 0
    layer_kernels: int = 0
    attention_kernels: int = 0
    loop_kernels: int = 0  # launched inside inner loops (times their trips)
    unknown_trips: int = 0

    def add(self, other: Count, times: int = 1) -> None:
        for kind, n in other.kernels.items():
            self.kernels[kind] += n * times
        self.conditionals += other.conditionals * times
        self.loop_trips += other.loop_trips * times
        self.layer_kernels += other.layer_kernels * times
        self.attention_kernels += other.attention_kernels * times
        self.loop_kernels += other.loop_kernels * times
        self.unknown_trips += other.unknown_trips * times

    @property
    def total(self) -> int:
        return sum(self.kernels.values())


def parse(hlo: str) -> tuple[dict[str, list[Op]], str]:
    """Computations by name (their instructions) and the entry computation's name."""
    computations: dict[str, list[Op]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        instruction = _INSTRUCTION.match(line) if current else None
        if instruction:
            computations[current].append(Op(*instruction.groups()))
    if entry is None:
        raise UserError("no ENTRY computation: not an optimised HLO module's text")
    return computations, entry


def count(computations: dict[str, list[Op]], name: str, pick=max) -> Count:
    """Kernels launched by one run of computation `name`, each conditional at the branch `pick`
    (max: its largest; min: its smallest) chooses, inner loops at their trip counts."""
    total = Count()
    for op in computations[name]:
        if op.opcode in _NO_KERNEL:
            continue
        if op.opcode == "while":
            trips = _TRIPS.search(op.rest)
            n = int(trips.group(1)) if trips else 1
            total.unknown_trips += trips is None
            total.loop_trips += n
            for key in ("condition", "body"):
                inner = count(computations, op.called(key)[0], pick)
                total.add(inner, n)
                total.loop_kernels += (inner.total - inner.loop_kernels) * n
        elif op.opcode == "conditional":
            total.conditionals += 1
            total.add(_branch(computations, op, pick)[1])
        elif op.opcode == "call":
            total.add(count(computations, op.called("to_apply")[0], pick))
        else:
            total.kernels[op.kind] += 1
            if LAYER in op.op_name:
                total.layer_kernels += 1
                total.attention_kernels += ATTENTION in op.op_name
    return total


def _branch(computations: dict[str, list[Op]], op: Op, pick=max) -> tuple[str, Count]:
    """The branch of conditional `op` that `pick` chooses by kernel count, and its count."""
    branches = op.called("branch_computations") or [
        *op.called("true_computation"),
        *op.called("false_computation"),
    ]
    counted = {b: count(computations, b, pick) for b in branches}
    # The target's forward runs every round: a token-bucket conditional is counted at a branch
    # that runs it. (A single bucket's conditional pairs the forward with a branch that never
    # runs and only fills the outputs' shapes with zeros.)
    forward = [b for b in branches if counted[b].layer_kernels]
    name = pick(forward or branches, key=lambda b: counted[b].total)
    return name, counted[name]


def rounds_loop(computations: dict[str, list[Op]], entry: str) -> Op:
    """The decode program's loop over rounds: the entry's while with the largest body."""
    loops = [op for op in computations[entry] if op.opcode == "while"]
    if not loops:
        raise UserError("the program's entry has no while loop: not a decode program")
    return max(loops, key=lambda op: count(computations, op.called("body")[0]).total)


def layer_window(computations: dict[str, list[Op]], branch: str) -> list[Op]:
    """One layer's kernels in schedule order: from the second attention kernel of `branch` to
    the third (or the branch's layer kernels, where it has fewer)."""
    ops = [op for op in computations[branch] if op.opcode not in _NO_KERNEL]
    marks = [i for i, op in enumerate(ops) if ATTENTION in op.op_name]
    if len(marks) >= 3:
        return ops[marks[1] : marks[2]]
    return [op for op in ops if LAYER in op.op_name]


def analyse(hlo: str, layers: int | None = None) -> dict:
    computations, entry = parse(hlo)
    loop = rounds_loop(computations, entry)
    body, condition = loop.called("body")[0], loop.called("condition")[0]
    per_round, least = count(computations, body), count(computations, body, min)
    per_round.add(count(computations, condition))  # the loop's test, once a round
    least.add(count(computations, condition, min))
    forwards = [op for op in computations[body] if op.opcode == "conditional"]
    result = {
        "kernels_per_round": per_round.total,
        "kernels_per_round_least": least.total,
        "conditionals_per_round_least": least.conditionals,
        "inner_loop_trips_per_round_least": least.loop_trips,
        "by_kind": dict(per_round.kernels.most_common()),
        "in_inner_loops": per_round.loop_kernels,
        "conditionals_per_round": per_round.conditionals,
        "inner_loop_trips_per_round": per_round.loop_trips,
        "unknown_trip_counts": per_round.unknown_trips,
    }
    if not forwards:
        return result
    branch, inside = max((_branch(computations, op) for op in forwards), key=lambda bc: bc[1].total)
    n_layers = layers or inside.attention_kernels
    if not n_layers:
        return result
    window = layer_window(computations, branch)
    result.update(
        target_layers=n_layers,
        kernels_per_layer=round(inside.layer_kernels / n_layers, 2),
        one_layer=[
            {"kernel": op.name, "kind": op.kind, "shape": op.shape,
             "op": op.op_name.rsplit(f"{LAYER})/", 1)[-1]}
            for op in window
        ],  # fmt: skip
    )
    return result


def format_report(result: dict, source: str) -> str:
    lines = [
        f"{source}: {result['kernels_per_round']} kernels a round (largest branches, inner "
        f"loops at their trip counts; {result['in_inner_loops']} of them in inner loops), "
        f"{result['conditionals_per_round']} conditionals and "
        f"{result['inner_loop_trips_per_round']} inner-loop trips",
        "  " + ", ".join(f"{kind} {n}" for kind, n in result["by_kind"].items()),
    ]
    lines.append(
        f"  every conditional at its smallest branch (no row filtering): "
        f"{result['kernels_per_round_least']} kernels, {result['conditionals_per_round_least']} "
        f"conditionals, {result['inner_loop_trips_per_round_least']} inner-loop trips"
    )
    if result["unknown_trip_counts"]:
        lines.append(f"  ({result['unknown_trip_counts']} inner loops of unknown trip count, "
                     "counted once)")  # fmt: skip
    if "kernels_per_layer" in result:
        lines.append(
            f"per target layer: {result['kernels_per_layer']} kernels "
            f"({result['target_layers']} layers); one layer's, in schedule order:"
        )
        for k in result["one_layer"]:
            lines.append(f"  {k['kind']:<20} {k['shape'][:48]:<48} {k['op'][:60]}")
    return "\n".join(lines)


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hlo", type=Path, help="a decode program's optimised HLO text")
    parser.add_argument(
        "--layers",
        type=positive_int,
        help="target layers (default: the paged-attention kernels in the forward's branch)",
    )
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args()
    path = existing_file(args.hlo, "hlo")
    result = analyse(path.read_text(), args.layers)
    print(format_report(result, str(path)))
    if args.json:
        write_json(args.json, {"hlo": str(path), **result})


if __name__ == "__main__":
    run_main(main)
