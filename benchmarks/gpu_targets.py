"""The four ratios this project aims at, read from one GPU session's JSON results, each stated as
met, not met or not measured (markdown, ready for docs/benchmarks.md):

- plain decode at batch 1 reaches >= 80% of the HBM floor ((weight + KV bytes) / measured copy
  bandwidth; decode_speed.json);
- one DSpark round (gamma 7) costs <= 1.25x one plain step at batch 1 (decode_speed.json);
- at concurrency 64 the better scheduler (Algorithm 1 or Section 5.2) serves >= 1.1x the
  throughput of the best other policy (no speculation, fixed gamma, best threshold;
  throughput.json);
- the training step at the released recipe's shapes reaches >= 40% MFU (train_throughput.json).

    python benchmarks/gpu_targets.py gpu_out/        # the folder gpu_session.sh wrote
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SCHEDULERS = ("scheduler (Alg. 1)", "scheduler (5.2)")
OTHERS = ("no speculation", "fixed gamma", "best threshold")
CONCURRENCY = 64


def _load(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


def _row(value: float | None, target: str, met: bool | None, detail: str, source: str) -> dict:
    return {"value": value, "target": target, "met": met, "detail": detail, "source": source}


def decode_targets(result: dict | None) -> list[dict]:
    source = "decode_speed.json"
    rows = {r["batch"]: r for r in (result or {}).get("rows", [])}
    one = rows.get(1)
    if one is None:
        missing = "no batch-1 row"
        return [
            _row(None, ">= 0.80", None, missing, source),
            _row(None, "<= 1.25", None, missing, source),
        ]
    where = f"{result['device']}, {result['dtype']}, context {result['context']}"
    if one.get("floor_ms"):
        share = one["floor_ms"] / one["plain_ms"]
        floor = _row(
            share,
            ">= 0.80",
            share >= 0.80,
            f"step {one['plain_ms']:.3f} ms vs floor {one['floor_ms']:.3f} ms ({where})",
            source,
        )
    else:
        floor = _row(None, ">= 0.80", None, f"no bandwidth figure for {result['device']}", source)
    ratio = one["round_over_step"]
    round_row = _row(
        ratio,
        "<= 1.25",
        ratio <= 1.25,
        f"round {one['spec_ms']:.3f} ms vs step {one['plain_ms']:.3f} ms, gamma "
        f"{result['gamma']} ({where})",
        source,
    )
    return [floor, round_row]


def scheduler_target(report: dict | None) -> dict:
    source = "throughput.json"
    rows = [r for r in (report or {}).get("rows", []) if r["concurrency"] == CONCURRENCY]
    by_mode = {r["mode"]: r["throughput"] for r in rows}
    sched = {m: by_mode[m] for m in SCHEDULERS if m in by_mode}
    others = {m: by_mode[m] for m in OTHERS if m in by_mode}
    if not sched or not others:
        return _row(None, ">= 1.10", None, f"no rows at concurrency {CONCURRENCY}", source)
    best_sched = max(sched, key=sched.get)
    best_other = max(others, key=others.get)
    ratio = sched[best_sched] / others[best_other]
    detail = (
        f"{best_sched} {sched[best_sched]:.0f} tok/s vs {best_other} "
        f"{others[best_other]:.0f} tok/s ({report['device']})"
    )
    return _row(ratio, ">= 1.10", ratio >= 1.10, detail, source)


def training_target(result: dict | None) -> dict:
    source = "train_throughput.json"
    if result is None:
        return _row(None, ">= 0.40", None, "no result", source)
    detail = (
        f"{result['achieved_tflops']:.1f} TFLOP/s, step {1e3 * result['step_s_median']:.0f} ms "
        f"({result['device']}, {result['target']} + {result['drafter']}, {result['dtype']})"
    )
    if result.get("mfu") is None:
        return _row(None, ">= 0.40", None, f"no peak FLOP/s known: {detail}", source)
    return _row(result["mfu"], ">= 0.40", result["mfu"] >= 0.40, detail, source)


def targets(folder: Path) -> list[dict]:
    decode = decode_targets(_load(folder, "decode_speed.json"))
    names = (
        "plain decode / HBM floor, batch 1",
        "DSpark round / plain step, batch 1",
        f"best scheduler / best other policy, concurrency {CONCURRENCY}",
        "training MFU, released recipe's shapes",
    )
    rows = [
        *decode,
        scheduler_target(_load(folder, "throughput.json")),
        training_target(_load(folder, "train_throughput.json")),
    ]
    return [{"name": n, **r} for n, r in zip(names, rows, strict=True)]


def markdown(rows: list[dict]) -> str:
    lines = ["| target | measured | aim | status | from |", "|---|---:|---|---|---|"]
    for r in rows:
        value = "n/a" if r["value"] is None else f"{r['value']:.2f}"
        status = {True: "**met**", False: "**not met**", None: "not measured"}[r["met"]]
        lines.append(
            f"| {r['name']} | {value} | {r['target']} | {status}: {r['detail']} | {r['source']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="where gpu_session.sh wrote its JSON files")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    rows = targets(args.folder)
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
