"""The measurements of docs/results.md: DSpark vs DFlash drafters of the default target.

    python benchmarks/default_pair_results.py --build runs/default-pair

Reads the folder written by scripts/build_default_pair.py (target/, the final drafters
drafters/dspark-distilled and drafters/dflash-distilled, or with --phase '' those of the corpus
phase; corpus/heldout.jsonl and corpus/calibration.jsonl, held out from training) and runs, each
as a `dspark-jax` command recorded with its duration:

1. `generate` over the held-out prompts for both drafters at T = 0 and T = 1 (the same prompts,
   seeds and lengths): tau with 95% percentile-bootstrap intervals over prompts (prompts are
   resampled, tau is the pooled committed / rounds of the resample), the paired DSpark - DFlash
   difference on the same resamples, and per-position conditional acceptance with intervals.
2. `eval` of DSpark at T = 1 on the calibration prompts (fit split) and the held-out prompts,
   then `calibrate` on the two record files: ECE of the survival product before and after STS.
3. benchmarks/throughput.py: closed-loop throughput of each verification policy (no
   speculation, fixed, the best static threshold, the two schedulers on round timings profiled
   here, with the STS temperatures of step 2) on this device.

Writes results.json, acceptance.png and the command logs under --out (default
<build>/results<phase>) and prints the markdown tables. A step whose output is there from an
earlier call with the same arguments and inputs (recorded beside it in <output>.args.json) is
not run again; one made with other settings is made again.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from provenance import git_commit

DRAFTERS = ("dspark", "dflash")
TEMPERATURES = (0.0, 1.0)
BOOTSTRAP_SAMPLES = 10_000


def run(
    program: list[str],
    args: list[str],
    log: Path,
    commands: list[dict],
    output: Path,
    inputs: tuple[Path, ...] = (),
) -> None:
    """Runs `program + args` (output to `log`) and records it with its duration in `commands`.

    A step is skipped when its `output` exists from an earlier call made with the same `args`
    and the same `inputs` (files hashed: the models, the prompts and the outputs of earlier
    steps). What made an output is recorded beside it (`<output>.args.json`: the arguments, the
    inputs' digests, the commit and the date); an output without that record, or made with
    other arguments or inputs, is made again, and the reason is printed. So results.json never
    lists a command line that did not produce the numbers it holds.
    """
    argv = [*program, *args]
    shown = " ".join(argv)
    record_path = args_record(output)
    record = {"args": args, "inputs": {str(p): file_digest(p) for p in inputs}}
    if output.exists():
        reason = stale_reason(output, record_path, record)
        if reason is None:
            made = json.loads(record_path.read_text())
            commands.append(
                {
                    "command": shown,
                    "seconds": None,
                    "log": str(log),
                    "reused": {"commit": made.get("commit"), "date": made.get("date")},
                }
            )
            return
        print(f"running again: {reason}", flush=True)
    # Removed first: an interrupted run leaves an output without a record, which is redone.
    record_path.unlink(missing_ok=True)
    print(f"$ {shown}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        status = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT).returncode
    if status:
        raise SystemExit(f"failed ({status}), see {log}: {shown}")
    seconds = round(time.perf_counter() - start, 1)
    record["commit"] = git_commit()
    record["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    commands.append({"command": shown, "seconds": seconds, "log": str(log)})


def args_record(output: Path) -> Path:
    """Where the arguments that made `output` are recorded."""
    return output.with_name(output.name + ".args.json")


def file_digest(path: Path) -> str:
    """sha256 of a file, or of a folder's files (names and contents)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(f.relative_to(path).as_posix().encode() if path.is_dir() else b"")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def options(args: list[str]) -> dict[str, str | None]:
    """`args` as {option: value} ("--flag": None for a bare flag; positionals by position)."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
            out[a] = args[i + 1] if has_value else None
            i += 2 if has_value else 1
        else:
            out[f"argument {sum(not k.startswith('--') for k in out) + 1}"] = a
            i += 1
    return out


def stale_reason(output: Path, record_path: Path, record: dict) -> str | None:
    """Why the existing `output` was not made by `record` (None when it was)."""
    if not record_path.exists():
        return f"{output} has no record of the arguments that made it ({record_path})"
    made = json.loads(record_path.read_text())
    if made.get("args") != record["args"]:
        before, now = options(made.get("args", [])), options(record["args"])

        def shown(opts: dict, key: str) -> str:
            if key not in opts:
                return "not given"
            return "given" if opts[key] is None else str(opts[key])

        diffs = [
            f"{k}: {shown(before, k)} then, {shown(now, k)} now"
            for k in sorted(set(before) | set(now))
            if shown(before, k) != shown(now, k)
        ]
        return f"{output} was made with other settings ({'; '.join(diffs) or 'order'})"
    changed = [p for p, d in record["inputs"].items() if made.get("inputs", {}).get(p) != d]
    if changed:
        return f"{output} was made from other inputs: {', '.join(changed)} changed since"
    return None


def per_prompt_rounds(generate_json: Path) -> list[dict[str, np.ndarray]]:
    """Per prompt: the verified, accepted and committed counts of each speculative round."""
    results = json.loads(generate_json.read_text())["results"]
    return [
        {k: np.asarray(r[k], np.int64) for k in ("verified", "accepted", "committed")}
        for r in results
    ]


def bootstrap_indices(num_prompts: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, num_prompts, (BOOTSTRAP_SAMPLES, num_prompts))


def tau_per_resample(prompts: list[dict[str, np.ndarray]], idx: np.ndarray) -> np.ndarray:
    committed = np.array([p["committed"].sum() for p in prompts], np.float64)
    rounds = np.array([len(p["committed"]) for p in prompts], np.float64)
    return committed[idx].sum(axis=1) / rounds[idx].sum(axis=1)


def conditional_counts(prompts: list[dict[str, np.ndarray]], gamma: int) -> np.ndarray:
    """[prompts, 2, gamma]: rounds where draft k was accepted, and rounds where it was observed
    (verified with drafts 1..k-1 accepted), as in dspark_jax.calibration.sts."""
    k = np.arange(1, gamma + 1)[None, :]
    out = np.zeros((len(prompts), 2, gamma), np.int64)
    for i, p in enumerate(prompts):
        verified, accepted = p["verified"][:, None], p["accepted"][:, None]
        observed = (accepted >= k - 1) & (verified >= k)
        out[i, 0] = (observed & (accepted >= k)).sum(axis=0)
        out[i, 1] = observed.sum(axis=0)
    return out


def interval(samples: np.ndarray) -> list[float]:
    return [float(v) for v in np.percentile(samples, [2.5, 97.5], axis=0)]


def acceptance_analysis(out: Path, gamma: int) -> dict:
    """tau and conditional acceptance with bootstrap intervals, per drafter and temperature."""
    analysis: dict = {}
    for t in TEMPERATURES:
        runs = {d: per_prompt_rounds(out / f"generate-{d}-t{t:g}.json") for d in DRAFTERS}
        n = len(runs[DRAFTERS[0]])
        idx = bootstrap_indices(n)
        taus = {d: tau_per_resample(runs[d], idx) for d in DRAFTERS}
        entry: dict = {"prompts": n}
        for d in DRAFTERS:
            counts = conditional_counts(runs[d], gamma)
            pooled = counts.sum(axis=0)
            resampled = counts[idx].sum(axis=1)  # [samples, 2, gamma]
            with np.errstate(invalid="ignore", divide="ignore"):
                rate = pooled[0] / pooled[1]
                rates = resampled[:, 0] / resampled[:, 1]
            committed = sum(int(p["committed"].sum()) for p in runs[d])
            rounds = sum(len(p["committed"]) for p in runs[d])
            entry[d] = {
                "tau": committed / rounds,
                "tau_ci95": interval(taus[d]),
                "rounds": rounds,
                "conditional": [None if np.isnan(v) else float(v) for v in rate],
                "conditional_observations": pooled[1].tolist(),
                "conditional_ci95": [
                    None if np.isnan(lo) else [float(lo), float(hi)]
                    for lo, hi in zip(*np.nanpercentile(rates, [2.5, 97.5], axis=0), strict=True)
                ],
            }
        diff = taus["dspark"] - taus["dflash"]
        entry["tau_difference"] = {
            "dspark_minus_dflash": entry["dspark"]["tau"] - entry["dflash"]["tau"],
            "ci95": interval(diff),
            "share_of_resamples_above_zero": float(np.mean(diff > 0)),
        }
        analysis[f"T={t:g}"] = entry
    return analysis


def plot_acceptance(analysis: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(analysis), figsize=(5.5 * len(analysis), 4), sharey=True)
    for ax, (label, entry) in zip(np.atleast_1d(axes), analysis.items(), strict=True):
        for offset, d, name in ((-0.06, "dspark", "DSpark"), (0.06, "dflash", "DFlash")):
            rate = np.array([np.nan if v is None else v for v in entry[d]["conditional"]])
            ci = np.array(
                [[np.nan, np.nan] if c is None else c for c in entry[d]["conditional_ci95"]]
            )
            k = np.arange(1, len(rate) + 1) + offset
            ax.errorbar(
                k,
                rate,
                yerr=[rate - ci[:, 0], ci[:, 1] - rate],
                marker="o",
                capsize=3,
                label=f"{name} (tau {entry[d]['tau']:.2f})",
            )
        ax.set_title(f"{label}, {entry['prompts']} held-out prompts")
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    np.atleast_1d(axes)[0].set_ylabel("P(accept k | drafts 1..k-1 accepted)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(results: dict) -> str:
    lines = [
        "| T | drafter | tau | 95% CI | rounds | conditional acceptance, k = 1..7 |",
        "|---|---|---:|---|---:|---|",
    ]
    for label, entry in results["acceptance"].items():
        for d, name in (("dspark", "DSpark"), ("dflash", "DFlash")):
            e = entry[d]
            cells = " ".join("-" if v is None else f"{v:.2f}" for v in e["conditional"])
            lo, hi = e["tau_ci95"]
            lines.append(
                f"| {label[2:]} | {name} | {e['tau']:.3f} | [{lo:.3f}, {hi:.3f}] | "
                f"{e['rounds']} | {cells} |"
            )
    lines += [
        "",
        "| T | DSpark - DFlash | 95% CI (paired) | resamples with DSpark ahead |",
        "|---|---:|---|---:|",
    ]
    for label, entry in results["acceptance"].items():
        diff = entry["tau_difference"]
        lo, hi = diff["ci95"]
        lines.append(
            f"| {label[2:]} | {diff['dspark_minus_dflash']:+.3f} | [{lo:+.3f}, {hi:+.3f}] | "
            f"{diff['share_of_resamples_above_zero']:.0%} |"
        )
    cal = results["calibration"]
    lines += [
        "",
        "| k | n | survival | ECE raw | ECE STS | AUC raw | STS temperature |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, n in enumerate(cal["n_survival"]):

        def f(v, digits=4):
            return "-" if v is None else f"{v:.{digits}f}"

        lines.append(
            f"| {k + 1} | {n} | {f(cal['survival_rate'][k], 3)} | {f(cal['ece_before'][k])} | "
            f"{f(cal['ece_after'][k])} | {f(cal['auc_before'][k], 3)} | "
            f"{cal['temperatures'][k]:#.3g} |"
        )
    lines.append(f"| mean | | | {cal['mean_ece'][0]:.4f} | {cal['mean_ece'][1]:.4f} | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--build", type=Path, required=True, help="scripts/build_default_pair.py --out"
    )
    parser.add_argument("--out", type=Path, help="results folder (default <build>/results<phase>)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=16, help="engine slots")
    parser.add_argument("--concurrency", default="1,8", help="throughput benchmark levels")
    parser.add_argument(
        "--thresholds",
        help="throughput.py's static-threshold grid, POLICY=VALUE,... (default: its own)",
    )
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument(
        "--phase",
        default="-distilled",
        help="drafter folder suffix: '-distilled' (final) or '' (after the corpus phase); "
        "give it as --phase=-distilled, argparse reads a bare -distilled as an option",
    )
    parser.add_argument(
        "--drafters",
        default=",".join(DRAFTERS),
        help="generate for these only and stop (to start on one while the other trains); "
        f"of {', '.join(DRAFTERS)}",
    )
    args = parser.parse_args(argv)
    build = args.build
    asked = list(dict.fromkeys(d.strip() for d in args.drafters.split(",")))
    unknown = [d for d in asked if d not in DRAFTERS]
    if unknown or not asked:
        parser.error(f"--drafters {args.drafters!r}: choose among {', '.join(DRAFTERS)}")
    everything = set(asked) == set(DRAFTERS)
    target = build / "target"
    drafts = {d: build / "drafters" / f"{d}{args.phase}" for d in DRAFTERS}
    heldout, calibration = (
        build / "corpus" / "heldout.jsonl",
        build / "corpus" / "calibration.jsonl",
    )
    # Checked before the results folder is made: a typo in --build or --phase must not leave
    # folders behind and fail only at the first command.
    needed = [target / "config.json", heldout]
    needed += [drafts[d] / "config.json" for d in (DRAFTERS if everything else asked)]
    if everything:
        needed.append(calibration)
    missing = [str(p) for p in needed if not p.is_file()]
    if missing:
        parser.error(
            f"--build {build} lacks {', '.join(missing)} "
            "(a folder written by scripts/build_default_pair.py; check --build and --phase)"
        )
    out = args.out or build / f"results{args.phase}"
    out.mkdir(parents=True, exist_ok=True)
    cli = [str(Path(sys.executable).with_name("dspark-jax"))]
    common = ["--target", str(target), "--max-new-tokens", str(args.new_tokens)]
    common += ["--max-num-seqs", str(args.max_num_seqs)]
    models = {d: (target, drafts[d]) for d in DRAFTERS}
    commands: list[dict] = []

    for t in TEMPERATURES:
        for d in asked:
            path = out / f"generate-{d}-t{t:g}.json"
            step = ["generate", "--prompts-file", str(heldout), "--draft", str(drafts[d])]
            step += [*common, "--temperature", f"{t:g}", "--json", str(path)]
            log = out / f"generate-{d}-t{t:g}.log"
            run(cli, step, log, commands, path, (*models[d], heldout))
    if not everything:
        print("generated for the drafters asked for; run with both for the rest")
        return 0

    records = {}
    for name, prompts in (("calibration", calibration), ("heldout", heldout)):
        folder = out / f"eval-dspark-{name}-t1"
        records[name] = folder / "calibration_records.npz"
        step = ["eval", str(prompts), "--draft", str(drafts["dspark"]), *common]
        # Acceptance only: speed is what the throughput benchmark measures.
        # --overwrite: a step made again replaces its own folder (eval refuses a non-empty one).
        step += ["--temperature", "1", "--no-plain", "--out", str(folder), "--overwrite"]
        log = out / f"eval-dspark-{name}-t1.log"
        run(cli, step, log, commands, records[name], (*models["dspark"], prompts))
    sts_path = out / "sts.json"
    step = ["calibrate", "--records", str(records["calibration"]), str(records["heldout"])]
    step += ["--drafter", str(drafts["dspark"]), "--temperature", "1", "--out", str(sts_path)]
    step += ["--plot", str(out / "reliability.png")]
    inputs = (records["calibration"], records["heldout"], drafts["dspark"])
    run(cli, step, out / "calibrate.log", commands, sts_path, inputs)

    if not args.skip_throughput:
        program = [sys.executable, str(Path(__file__).with_name("throughput.py"))]
        step = ["--target", str(target), "--draft", str(drafts["dspark"])]
        step += ["--prompts", str(heldout), "--sts", str(sts_path)]
        step += ["--concurrency", args.concurrency, "--temperature", "1"]
        step += [] if args.thresholds is None else ["--thresholds", args.thresholds]
        step += ["--out", str(out / "throughput.json"), "--plot", str(out / "throughput.png")]
        inputs = (*models["dspark"], heldout, sts_path)
        run(program, step, out / "throughput.log", commands, out / "throughput.json", inputs)

    gamma = json.loads((Path(drafts["dspark"]) / "config.json").read_text())["block_size"]
    acceptance = acceptance_analysis(out, gamma)
    plot_acceptance(acceptance, out / "acceptance.png")
    sts = json.loads(sts_path.read_text())
    held = sts["metrics"]["holdout"]
    observed = [(b, a) for b, a in zip(held["ece_before"], held["ece_after"], strict=True) if b]
    calibration = {
        "temperatures": sts["temperatures"],
        "n_survival": held["n_survival"],
        "survival_rate": held["survival_rate"],
        "ece_before": held["ece_before"],
        "ece_after": held["ece_after"],
        # How well the raw survival product ranks rounds (None where a class is too rare).
        "auc_before": held["auc_before"],
        # Averaged over positions with observations, as the paper reports it.
        "mean_ece": [
            float(np.mean([b for b, _ in observed])),
            float(np.mean([a for _, a in observed])),
        ],
    }
    import jax

    results = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "machine": f"{platform.machine()}, {jax.devices()[0].device_kind}, "
        f"{len(jax.devices())} device(s), {_cpu_count()} CPU cores",
        "build": str(build),
        "commands": commands,
        "acceptance": acceptance,
        "calibration": calibration,
    }
    if not args.skip_throughput:
        results["throughput"] = json.loads((out / "throughput.json").read_text())["rows"]
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))
    print(f"wrote {out / 'results.json'} and {out / 'acceptance.png'}")
    return 0


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    sys.exit(main())
