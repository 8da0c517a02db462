"""Where a compiled GPU program hands control back to the host: its loops and conditionals left
outside XLA's CUDA graphs, read from XLA's dump of the program's thunks.

XLA:GPU runs a program as a sequence of thunks and records runs of kernels into CUDA graphs
(command buffers) launched as one. A conditional whose branches hold only graph-able work
becomes a conditional node inside the graph, decided on the device. One it cannot record -- by
default every while loop, and any conditional that has one anywhere inside it -- runs on the
host: the host copies the predicate back from the device, waits for it, and only then launches
what comes next, so the GPU drains and idles for the round trip (a loop: once per trip).

This reports, for the rounds loop's body (the decode round) and for the whole program, the
conditionals and loops outside any graph and the graphs themselves. What it reads is written by
XLA when asked (`XLA_FLAGS=--xla_dump_to=DIR`; the GPU compiler on this machine's CPU will do,
see deviceless.py, whose device description reports the driver version XLA checks before it
puts conditionals in graphs):

    XLA_FLAGS="--xla_dump_to=dump/ --xla_dump_hlo_pass_re=NONE" python \\
        benchmarks/lowering_time.py --platform h200 --compile --slots 1 --programs decode_chunk
    python benchmarks/host_syncs.py dump/

Reads text only: no JAX, no GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from provenance import Parser, run_main, write_json

from dspark_jax.errors import UserError

SUFFIX = ".thunk_sequence_after_thunk_passes.txt"
_THUNK = re.compile(r"^(\s*)\d+: (k\w+)")
# A branch's or a loop's part: "branch_0:", "true_branch:", "body:", "condition:" (XLA writes the
# last one unindented, right after its loop; a label may follow "No thunks." on its line).
_LABEL = re.compile(r"(\w*branch\w*|body|condition):\s*$")


@dataclass
class Thunk:
    kind: str
    indent: int
    parts: dict[str, list[Thunk]] = field(default_factory=dict)  # branches, body, condition
    part: str = ""  # the part the next nested thunk belongs to

    def add(self, child: Thunk) -> None:
        self.parts.setdefault(self.part, []).append(child)


def parse(text: str) -> list[Thunk]:
    """The thunk tree of one dump: nesting follows the indentation of the "NNN: kKind" lines,
    the labels between them name the part (branch, body, condition) of the thunk they follow."""
    roots: list[Thunk] = []
    stack: list[Thunk] = []
    last: Thunk | None = None
    for line in text.splitlines():
        label = _LABEL.search(line)
        if label is not None:
            name = label.group(1)
            indent = len(line) - len(line.lstrip())
            if name == "condition" and last is not None:
                owner = last
            else:
                owners = [t for t in stack if t.indent < indent]
                owner = owners[-1] if owners else None
            if owner is not None:
                owner.part = name
            continue
        match = _THUNK.match(line)
        if match is None:
            continue
        thunk = Thunk(match.group(2), len(match.group(1)))
        while stack and stack[-1].indent >= thunk.indent:
            stack.pop()
        if stack:
            stack[-1].add(thunk)
        else:
            roots.append(thunk)
        stack.append(thunk)
        last = thunk
    return roots


@dataclass
class Counts:
    conditionals: int = 0  # outside any graph: each run is a host round trip
    loops: int = 0  # outside any graph: a host round trip every trip
    graphs: int = 0  # command buffers launched from the host

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.conditionals + other.conditionals, self.loops + other.loops,
                      self.graphs + other.graphs)

    @property
    def host_decisions(self) -> int:
        return self.conditionals + self.loops


def host_counts(thunks: list[Thunk]) -> Counts:
    """Control flow decided on the host and graphs launched from it, everywhere in `thunks`,
    every branch counted; nothing inside a graph counts."""
    counts = Counts()
    for thunk in thunks:
        if thunk.kind == "kCommandBuffer":
            counts.graphs += 1
            continue
        counts.conditionals += thunk.kind == "kConditional"
        counts.loops += thunk.kind == "kWhile"
        for part in thunk.parts.values():
            counts = counts + host_counts(part)
    return counts


def fewest(thunks: list[Thunk]) -> Counts:
    """The same for one run of `thunks` where every conditional outside a graph takes its
    branch with the fewest host decisions (then graphs) and every loop one trip: the least a
    run hands to the host."""
    counts = Counts()
    for thunk in thunks:
        if thunk.kind == "kCommandBuffer":
            counts.graphs += 1
        elif thunk.kind == "kConditional":
            branches = [fewest(part) for part in thunk.parts.values()] or [Counts()]
            least = min(branches, key=lambda c: (c.host_decisions, c.graphs))
            counts = counts + Counts(1, 0, 0) + least
        elif thunk.kind == "kWhile":
            counts = counts + Counts(0, 1, 0)
            for part in thunk.parts.values():
                counts = counts + fewest(part)
    return counts


def rounds_loop(roots: list[Thunk]) -> Thunk | None:
    """The program's outermost loop outside any graph (a decode program's rounds), if any."""
    return next((t for t in roots if t.kind == "kWhile"), None)


def report(roots: list[Thunk]) -> dict:
    """Counts for the whole program and for one round (the rounds loop's body): everywhere,
    and on the path with the fewest host decisions."""
    loop = rounds_loop(roots)
    body = loop.parts.get("body", []) if loop is not None else None
    out = {"whole": vars(host_counts(roots)), "whole_fewest": vars(fewest(roots))}
    if body is not None:
        out["round"] = vars(host_counts(body))
        out["round_fewest"] = vars(fewest(body))
    return out


def dump_file(path: Path) -> Path:
    """`path` itself, or the one program's thunk dump in a dump folder."""
    if path.is_file():
        return path
    found = sorted(path.glob(f"*{SUFFIX}")) if path.is_dir() else []
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise UserError(
            f"{path}: {what} {SUFFIX} files; point at one, or at a folder XLA dumped one program"
            " into (XLA_FLAGS=--xla_dump_to=DIR)"
        )
    return found[0]


def main() -> int:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump", type=Path, help=f"an XLA dump folder, or its *{SUFFIX} file")
    parser.add_argument("--json", type=Path, help="also write the counts here")
    args = parser.parse_args()
    path = dump_file(args.dump)
    roots = parse(path.read_text())
    if not roots:
        raise UserError(f"{path}: no thunks in it (not an XLA thunk-sequence dump?)")
    counts = report(roots)
    print(f"{path.name}: outside CUDA graphs (each a host round trip; a loop's, every trip)")
    print("                                   conditionals  loops  graphs")
    rows = [("whole program, every branch", "whole"), ("whole program, fewest", "whole_fewest"),
            ("one round, every branch", "round"), ("one round, fewest", "round_fewest")]
    for title, key in rows:
        if key in counts:
            c = counts[key]
            print(f"{title:34s} {c['conditionals']:12d} {c['loops']:6d} {c['graphs']:7d}")
    if "round" in counts:
        print("(a round: the rounds loop's body; its own test is one more round trip per round)")
    if args.json is not None:
        write_json(args.json, {"file": str(path), **counts})
    return 0


if __name__ == "__main__":
    run_main(main)
