"""Where the time of one compiled program goes: tabulate the ops of an XLA profile.

`capture(run, trace_dir)` records a `jax.profiler` trace (Perfetto JSON beside the xplane, both
readable in Perfetto / TensorBoard) of `run()`; `summarize(trace_dir, module)` reads it back and
sums the device time of every HLO op of `module` (`jit_decode` is the engine's decode chunk):

- busy: the summed op time, against the wall time of the call -- the gap is time the device sat
  idle inside the call (host round trips, launch overhead);
- by kind: ops grouped by their HLO kind (the name without its `.N` suffix: `fusion`,
  `loop_fusion`, `copy`, `custom-call`, `gemm`...);
- top ops: the ops that took the most time, with their HLO instruction (from the profiler, or
  from the compiled module's text when given): shapes, so a pass over [tokens, vocab] or a copy
  of a KV pool shows itself;
- transfers: memcpy/memset events on the device timeline (host round trips show up here).

On a GPU the device's own op timeline ("XLA Ops") is used. On a CPU (no device timeline) the
host's executor events are, which name the same ops but do not time the ops inside a loop body
one by one: a CPU summary checks the pipeline, it does not profile.

The command line captures nothing: it summarizes a trace captured earlier (by `capture`, by
decode_speed.py --profile or by any `jax.profiler.trace`):

    python benchmarks/xla_profile.py TRACE_DIR --module jit_decode
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax

_SUFFIX = re.compile(r"(\.\d+|\.clone)+$")
# Control flow holds other ops; its span includes theirs ("cond" is how XLA names conditionals).
CONTAINERS = ("while", "conditional", "cond", "call")


def op_kind(name: str) -> str:
    """`fusion.12` -> `fusion`, `cond.4.clone.2` -> `cond`."""
    return _SUFFIX.sub("", name)


def capture(run: Callable[[], object], trace_dir: str | os.PathLike) -> float:
    """Runs `run()` (which must block until its results are ready) under the profiler; returns
    its wall seconds. The trace lands in `trace_dir/plugins/profile/<timestamp>/`."""
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        start = time.perf_counter()
        run()
        return time.perf_counter() - start


def _latest_trace(trace_dir: str | os.PathLike) -> Path:
    pattern = os.path.join(trace_dir, "**", "perfetto_trace.json.gz")
    found = sorted(glob.glob(pattern, recursive=True))
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
    return Path(max(found, key=os.path.getmtime))


def op_events(events: list[dict], module: str | None) -> list[dict]:
    """The complete events that time one HLO op each, from the device timeline when there is one.

    A GPU trace times each op twice (its "XLA Ops" line and the kernels on its stream lines);
    only the first is kept, so nothing is counted twice."""
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    device_pids = {pid for pid, name in processes.items() if name.startswith("/device:")}
    op_lines = {key for key, name in threads.items() if key[0] in device_pids and name == "XLA Ops"}

    def keep(e: dict) -> bool:
        if e.get("ph") != "X":
            return False
        key = (e.get("pid"), e.get("tid"))
        if device_pids:
            if key[0] not in device_pids:
                return False
            if op_lines and key not in op_lines:
                return False
        args = e.get("args") or {}
        if "hlo_op" not in args and not (device_pids and op_lines):
            return False
        if module is not None and "hlo_module" in args and module not in args["hlo_module"]:
            return False
        return True

    return [e for e in events if keep(e)]


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")


def instructions(hlo_text: str) -> dict[str, str]:
    """{instruction name: its shape, opcode and operands} of a compiled module's HLO text."""
    found = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            found.setdefault(m.group(1), m.group(2))
    return found


_COPY_EVENT = re.compile(r"memcpy|memset", re.IGNORECASE)


def transfer_events(events: list[dict]) -> list[dict]:
    """Device-side memory copies and sets (host <-> device transfers among them): inside a
    decode chunk there should be none beyond the chunk's own inputs and outputs."""
    processes = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    return [
        e
        for e in events
        if e.get("ph") == "X"
        and processes.get(e.get("pid"), "").startswith("/device:")
        and _COPY_EVENT.search(e.get("name", ""))
    ]


def summarize_events(
    events: list[dict],
    module: str | None,
    wall_s: float | None = None,
    top: int = 15,
    hlo_text: str | None = None,
) -> dict:
    """See the module docstring. `hlo_text` (the compiled module's `as_text()`) names each top
    op's shapes where the trace does not."""
    ops = op_events(events, module)
    lines = instructions(hlo_text) if hlo_text else {}
    by_op: dict[str, dict] = {}
    for e in ops:
        args = e.get("args") or {}
        name = args.get("hlo_op") or e["name"]
        row = by_op.setdefault(name, {"op": name, "us": 0.0, "calls": 0, "hlo": ""})
        row["us"] += float(e.get("dur", 0.0))
        row["calls"] += 1
        row["hlo"] = row["hlo"] or str(args.get("long_name") or lines.get(name) or "")
    # A loop or conditional is reported, but its span (which includes its ops') is not added.
    busy_us = sum(r["us"] for r in by_op.values() if op_kind(r["op"]) not in CONTAINERS)
    kinds: collections.Counter[str] = collections.Counter()
    kind_calls: collections.Counter[str] = collections.Counter()
    for r in by_op.values():
        kind = op_kind(r["op"])
        kinds[kind] += r["us"]
        kind_calls[kind] += r["calls"]
    transfers = collections.Counter()
    for e in transfer_events(events):
        transfers[e["name"]] += float(e.get("dur", 0.0))
    result = {
        "module": module,
        "transfers": [{"name": k, "ms": us / 1e3} for k, us in transfers.most_common()],
        "ops": len(by_op),
        "op_calls": sum(r["calls"] for r in by_op.values()),
        "busy_ms": busy_us / 1e3,
        "wall_ms": None if wall_s is None else wall_s * 1e3,
        "busy_share": None if not wall_s else busy_us / 1e6 / wall_s,
        "by_kind": [
            {
                "kind": k,
                "ms": us / 1e3,
                "calls": kind_calls[k],
                "share": None if k in CONTAINERS else us / busy_us,
            }
            for k, us in kinds.most_common()
        ]
        if busy_us
        else [],
        "top_ops": [
            {
                "op": r["op"],
                "ms": r["us"] / 1e3,
                "share": r["us"] / busy_us,
                "calls": r["calls"],
                "hlo": r["hlo"],
            }
            for r in sorted(by_op.values(), key=lambda r: -r["us"])
            if op_kind(r["op"]) not in CONTAINERS
        ][:top],
    }
    return result


def summarize(
    trace_dir: str | os.PathLike,
    module: str | None,
    wall_s: float | None = None,
    top: int = 15,
    hlo_text: str | None = None,
) -> dict:
    path = _latest_trace(trace_dir)
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {"trace": str(path), **summarize_events(events, module, wall_s, top, hlo_text)}


def format_summary(summary: dict, title: str) -> str:
    wall = summary["wall_ms"]
    share = summary["busy_share"]
    lines = [
        f"{title}: {summary['ops']} ops, {summary['op_calls']} op runs, busy "
        f"{summary['busy_ms']:.2f} ms"
        + ("" if wall is None else f" of {wall:.2f} ms wall ({share:.0%} busy)")
    ]
    lines.append(f"  {'kind (holds: spans ops below it)':<32} {'ms':>9} {'share':>6} {'runs':>6}")
    for k in summary["by_kind"][:10]:
        share = "holds" if k["share"] is None else f"{k['share']:.1%}"
        lines.append(f"  {k['kind'][:32]:<32} {k['ms']:>9.3f} {share:>6} {k['calls']:>6}")
    for t in summary["transfers"]:
        lines.append(f"  transfer {t['name'][:60]}: {t['ms']:.3f} ms")
    lines.append(f"  {'top ops':<32} {'ms':>9} {'share':>6} {'runs':>6}  hlo")
    for r in summary["top_ops"]:
        hlo = " ".join(r["hlo"].split())[:90]
        lines.append(
            f"  {r['op'][:32]:<32} {r['ms']:>9.3f} {r['share']:>6.1%} {r['calls']:>6}  {hlo}"
        )
    return "\n".join(lines)


def main() -> None:
    from provenance import (
        Parser,
        existing_file,
        existing_folder,
        non_negative_int,
        output_file,
        write_json,
    )

    from dspark_jax.errors import UserError

    parser = Parser(
        description="Summarize an XLA profile captured earlier (captures nothing): device time "
        "by op kind and the most expensive ops of one compiled program."
    )
    parser.add_argument("trace_dir", help="a folder jax.profiler.trace wrote into")
    parser.add_argument("--module", help="only ops of HLO modules whose name contains this")
    parser.add_argument(
        "--top", type=non_negative_int, default=15, help="most expensive ops listed (15)"
    )
    parser.add_argument("--hlo", help="the module's compiled HLO text, for the ops' shapes")
    parser.add_argument("--json", help="write the summary here too")
    args = parser.parse_args()
    existing_folder(args.trace_dir, "trace_dir")
    hlo_text = existing_file(args.hlo, "--hlo").read_text() if args.hlo else None
    if args.json:
        output_file(args.json, "--json")
    try:
        summary = summarize(args.trace_dir, args.module, top=args.top, hlo_text=hlo_text)
    except FileNotFoundError as e:
        raise UserError(f"trace_dir {args.trace_dir}: {e}") from None
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"trace_dir {args.trace_dir}: cannot read its trace ({e})") from None
    print(format_summary(summary, summary["trace"]))
    if args.json:
        write_json(args.json, summary)


if __name__ == "__main__":
    from provenance import run_main

    run_main(main)
