"""The four ratios this project aims at, read from one GPU session's JSON results, each stated as
met, not met or not measured (markdown, ready for docs/benchmarks.md):

- plain decode at batch 1 reaches >= 80% of the HBM floor ((weight + KV bytes) / measured copy
  bandwidth; decode_speed.json);
- one DSpark round (gamma 7) costs <= 1.25x one plain step at batch 1 (decode_speed.json);
- at concurrency 64 the better scheduler (Algorithm 1 or Section 5.2) serves >= 1.1x the
  throughput of the best other policy (no speculation, fixed gamma, best threshold;
  throughput.json);
- the training step at the released recipe's shapes reaches >= 40% MFU, counting the frozen
  target's forward and the drafter's training (train_throughput.json; the drafter-only MFU
  is shown beside it, not judged).

    python benchmarks/gpu_targets.py gpu_out/        # the folder gpu_session.sh wrote

The aims are at the released recipe's shapes (Qwen3-4B and its DSpark drafter; for training
one 4096-token sequence with 512 anchors per micro-step, as gpu_session.sh runs it). Results
at other shapes (a CPU smoke run at the tiny config) are shown with their ratio but judged
neither met nor not met: the row says which shapes they are. A folder that does not exist, or
holds none of the JSON files gpu_session.sh writes, is an error (status 2): a wrong path, not a
session whose aims' stages have not run yet.
"""

from __future__ import annotations

from pathlib import Path

from provenance import Parser, existing_folder, read_json, run_main, write_json

from dspark_jax.errors import UserError

SCHEDULERS = ("scheduler (Alg. 1)", "scheduler (5.2)")
OTHERS = ("no speculation", "fixed gamma", "best threshold")
CONCURRENCY = 64
SOURCES = ("decode_speed.json", "throughput.json", "train_throughput.json")
# What else benchmarks/gpu_session.sh writes into its results folder (shell patterns).
SESSION_FILES = (
    *SOURCES,
    "bandwidth.json",
    "throughput_c*.json",
    "cost_model.json",
    "attention_paths.json",
    "sps.json",
    "switch_cost.json",
    "preflight.json",
)
# train_throughput.py's MODEL_FLOPS_VERSION whose MFU is judged (that script imports jax; this
# one does not, so the number is repeated here and a test keeps the two equal).
MODEL_FLOPS_VERSION = 2
# The released recipe's shapes (benchmarks/gpu_session.sh at its default SIZE).
AIM_CONFIG = "qwen3-4b"
AIM_TRAINING = {
    "target": "qwen3-4b",
    "drafter": "dspark-qwen3-4b",
    "seq_len": 4096,
    "anchors": 512,
}


def _load(folder: Path, name: str) -> dict | None:
    path = folder / name
    return read_json(path, "folder") if path.is_file() else None


def _row(value: float | None, target: str, met: bool | None, detail: str, source: str) -> dict:
    return {"value": value, "target": target, "met": met, "detail": detail, "source": source}


def _off_shapes(row: dict, shapes: str | None) -> dict:
    """`row` as measured at `shapes` other than the aim's (None: at the aim's): its ratio is
    kept, but it is judged neither met nor not met, and its detail says why."""
    if shapes is None or row["value"] is None:
        return row
    would = "would meet" if row["met"] else "would not meet"
    detail = f"not at the aim's shapes ({shapes}; {would} the aim there): {row['detail']}"
    return {**row, "met": None, "detail": detail, "off_shapes": True}


def _decode_shapes(result: dict) -> str | None:
    config = result.get("config")
    if config is None or config == AIM_CONFIG:
        return None
    return f"config {config}, the aim is at {AIM_CONFIG}"


def _round_floor(row: dict) -> str:
    """What the bytes alone allow a round against a step: a round reads the drafter's weights
    and context on top of the target's, so it cannot cost less than their ratio however well
    both run ('' when the row predates the byte counts)."""
    if not row.get("spec_round_bytes") or not row.get("target_step_bytes"):
        return ""
    bound = row["spec_round_bytes"] / row["target_step_bytes"]
    text = f"; the bytes alone make a round {bound:.2f}x a step"
    if row.get("floor_ms"):
        round_floor_ms = row["floor_ms"] * bound
        text += f", this round runs at {round_floor_ms / row['spec_ms']:.0%} of its own floor"
    return text


def decode_targets(result: dict | None) -> list[dict]:
    source = "decode_speed.json"
    rows = {r["batch"]: r for r in (result or {}).get("rows", [])}
    one = rows.get(1)
    if one is None:
        missing = "no batch-1 row" if result is not None else f"no {source} in the folder"
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
        f"{result['gamma']}{_round_floor(one)} ({where})",
        source,
    )
    shapes = _decode_shapes(result)
    return [_off_shapes(floor, shapes), _off_shapes(round_row, shapes)]


def scheduler_target(report: dict | None) -> dict:
    source = "throughput.json"
    rows = [r for r in (report or {}).get("rows", []) if r["concurrency"] == CONCURRENCY]
    by_mode = {r["mode"]: r["throughput"] for r in rows}
    sched = {m: by_mode[m] for m in SCHEDULERS if m in by_mode}
    others = {m: by_mode[m] for m in OTHERS if m in by_mode}
    if report is None:
        return _row(None, ">= 1.10", None, f"no {source} in the folder", source)
    if not sched or not others:
        return _row(None, ">= 1.10", None, f"no rows at concurrency {CONCURRENCY}", source)
    best_sched = max(sched, key=sched.get)
    best_other = max(others, key=others.get)
    ratio = sched[best_sched] / others[best_other]
    detail = (
        f"{best_sched} {sched[best_sched]:.0f} tok/s vs {best_other} "
        f"{others[best_other]:.0f} tok/s ({report['device']})"
    )
    model = str(report.get("target", ""))
    shapes = f"{model}, the aim is at {AIM_CONFIG}" if "tiny" in model else None
    return _off_shapes(_row(ratio, ">= 1.10", ratio >= 1.10, detail, source), shapes)


def training_target(result: dict | None) -> dict:
    """The MFU of target forward + drafter training (the aim's), with the drafter-only MFU in
    the detail. A result counted before MODEL_FLOPS_VERSION (no `model_flops_version`: dense
    attention, the Markov head's W1 and the fc input gradient counted, ~14% high at the
    recipe's shapes) is shown but not judged."""
    source = "train_throughput.json"
    if result is None:
        return _row(None, ">= 0.40", None, f"no {source} in the folder", source)
    detail = (
        f"{result['achieved_tflops']:.1f} TFLOP/s, step {1e3 * result['step_s_median']:.0f} ms "
        f"({result['device']}, {result['target']} + {result['drafter']}, {result['dtype']})"
    )
    if result.get("mfu") is None:
        why = result.get("mfu_note") or "no peak FLOP/s known"
        return _row(None, ">= 0.40", None, f"{why}: {detail}", source)
    if result.get("drafter_mfu") is not None:
        detail = f"drafter-only MFU {result['drafter_mfu']:.2f}; {detail}"
    row = _row(result["mfu"], ">= 0.40", result["mfu"] >= 0.40, detail, source)
    differ = [
        f"{key} {result[key]}" for key, aim in AIM_TRAINING.items() if result.get(key, aim) != aim
    ]
    recipe = ", ".join(f"{key} {aim}" for key, aim in AIM_TRAINING.items())
    row = _off_shapes(row, f"{', '.join(differ)}; the recipe: {recipe}" if differ else None)
    version = result.get("model_flops_version", 1)
    if version == MODEL_FLOPS_VERSION:
        return row
    return {
        **row,
        "met": None,
        "detail": f"model FLOPs counted by formula version {version}, not "
        f"{MODEL_FLOPS_VERSION} (version 1 counts dense attention, the Markov head's W1 and "
        "the fc input gradient: about 14% high at the recipe's shapes); not judged, re-run "
        f"train_throughput.py: {row['detail']}",
        "not_judged": True,
    }


def targets(folder: Path) -> list[dict]:
    """The four rows, judged from the JSON files in `folder` (UserError when it is not a
    folder or holds none of the files gpu_session.sh writes: a wrong path)."""
    folder = existing_folder(folder, "folder")
    if not any(path.is_file() for pattern in SESSION_FILES for path in folder.glob(pattern)):
        raise UserError(
            f"folder {folder}: none of the JSON files gpu_session.sh writes "
            f"({', '.join(SESSION_FILES)}) in it"
        )
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


def preflight_note(folder: Path) -> str | None:
    """What the session's preflight (gpu_preflight.py) left its stages running with, when that
    was not the engine's defaults: the numbers then measure a fallback, and the note says so."""
    report = _load(folder, "preflight.json")
    if report is None or report.get("chosen") == {}:
        return None
    failed = "; ".join(
        f"{' '.join(f'{k}={v}' for k, v in t['env'].items()) or 'as given'} "
        f"(status {t['returncode']})"
        for t in report["tried"]
        if not t["ok"]
    )
    if report.get("chosen") is None:
        return f"No setting decoded in the preflight ({failed}): every number here ran as given."
    chosen = " ".join(f"{k}={v}" for k, v in report["chosen"].items())
    return (
        f"Measured with {chosen}: the settings as given did not decode here ({failed}; "
        "preflight.json has their errors)."
    )


def markdown(rows: list[dict]) -> str:
    lines = ["| target | measured | aim | status | from |", "|---|---:|---|---|---|"]
    for r in rows:
        value = "n/a" if r["value"] is None else f"{r['value']:.2f}"
        status = {True: "**met**", False: "**not met**", None: "not measured"}[r["met"]]
        if r.get("off_shapes") or r.get("not_judged"):
            status = "not judged"
        lines.append(
            f"| {r['name']} | {value} | {r['target']} | {status}: {r['detail']} | {r['source']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="where gpu_session.sh wrote its JSON files")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args()
    rows = targets(args.folder)
    print(markdown(rows))
    note = preflight_note(args.folder)
    if note:
        print(f"\n{note}")
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    run_main(main)
