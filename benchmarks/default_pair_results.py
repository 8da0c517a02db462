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
<build>/results<phase>) and prints the markdown tables.
"""

from __future__ import annotations

import argparse
import datetime
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


def run(argv: list[str], log: Path, commands: list[dict], output: Path) -> None:
    """Runs one command (output to `log`) unless its `output` exists from an earlier call,
    recording it and its duration in `commands`."""
    shown = " ".join(argv)
    if output.exists():
        commands.append({"command": shown, "seconds": None, "log": str(log)})
        return
    print(f"$ {shown}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        status = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT).returncode
    if status:
        raise SystemExit(f"failed ({status}), see {log}: {shown}")
    seconds = round(time.perf_counter() - start, 1)
    commands.append({"command": shown, "seconds": seconds, "log": str(log)})


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
        "| T | drafter | tau | 95% CI | conditional acceptance k = 1..7 |",
        "|---|---|---:|---|---|",
    ]
    for label, entry in results["acceptance"].items():
        for d, name in (("dspark", "DSpark"), ("dflash", "DFlash")):
            e = entry[d]
            cells = " ".join("-" if v is None else f"{v:.2f}" for v in e["conditional"])
            lo, hi = e["tau_ci95"]
            lines.append(
                f"| {label[2:]} | {name} | {e['tau']:.3f} | [{lo:.3f}, {hi:.3f}] | {cells} |"
            )
    lines += [
        "",
        "| T | DSpark - DFlash | 95% CI (paired) | resamples > 0 |",
        "|---|---:|---|---:|",
    ]
    for label, entry in results["acceptance"].items():
        diff = entry["tau_difference"]
        lo, hi = diff["ci95"]
        lines.append(
            f"| {label[2:]} | {diff['dspark_minus_dflash']:+.3f} | [{lo:+.3f}, {hi:+.3f}] | "
            f"{diff['share_of_resamples_above_zero']:.3f} |"
        )
    cal = results["calibration"]
    lines += [
        "",
        "| k | n (held-out) | survival | ECE raw | ECE STS | STS temperature |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for k, n in enumerate(cal["n_survival"]):

        def f(v, digits=4):
            return "-" if v is None else f"{v:.{digits}f}"

        lines.append(
            f"| {k + 1} | {n} | {f(cal['survival_rate'][k], 3)} | {f(cal['ece_before'][k])} | "
            f"{f(cal['ece_after'][k])} | {cal['temperatures'][k]:.3f} |"
        )
    lines.append(f"| mean | | | {cal['mean_ece'][0]:.4f} | {cal['mean_ece'][1]:.4f} | |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--build", type=Path, required=True, help="scripts/build_default_pair.py --out"
    )
    parser.add_argument("--out", type=Path, help="results folder (default <build>/results<phase>)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=16, help="engine slots")
    parser.add_argument("--concurrency", default="1,8", help="throughput benchmark levels")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument(
        "--phase",
        default="-distilled",
        help="drafter folder suffix: '-distilled' (final) or '' (after the corpus phase)",
    )
    parser.add_argument(
        "--drafters",
        default=",".join(DRAFTERS),
        help="generate for these only and stop (to start on one while the other trains)",
    )
    args = parser.parse_args()
    build = args.build
    out = args.out or build / f"results{args.phase}"
    out.mkdir(parents=True, exist_ok=True)
    cli = str(Path(sys.executable).with_name("dspark-jax"))
    target = str(build / "target")
    drafts = {d: str(build / "drafters" / f"{d}{args.phase}") for d in DRAFTERS}
    heldout, calibration = (
        build / "corpus" / "heldout.jsonl",
        build / "corpus" / "calibration.jsonl",
    )
    common = ["--target", target, "--max-new-tokens", str(args.new_tokens)]
    common += ["--max-num-seqs", str(args.max_num_seqs)]
    commands: list[dict] = []

    for t in TEMPERATURES:
        for d in args.drafters.split(","):
            path = out / f"generate-{d}-t{t:g}.json"
            argv = [cli, "generate", "--prompts-file", str(heldout), "--draft", drafts[d]]
            argv += [*common, "--temperature", f"{t:g}", "--json", str(path)]
            run(argv, out / f"generate-{d}-t{t:g}.log", commands, path)
    if set(args.drafters.split(",")) != set(DRAFTERS):
        print("generated for the drafters asked for; run with both for the rest")
        return 0

    records = {}
    for name, prompts in (("calibration", calibration), ("heldout", heldout)):
        folder = out / f"eval-dspark-{name}-t1"
        records[name] = folder / "calibration_records.npz"
        argv = [cli, "eval", str(prompts), "--draft", drafts["dspark"], *common]
        # Acceptance only: speed is what the throughput benchmark measures.
        argv += ["--temperature", "1", "--no-plain", "--out", str(folder)]
        run(argv, out / f"eval-dspark-{name}-t1.log", commands, records[name])
    sts_path = out / "sts.json"
    argv = [cli, "calibrate", "--records", str(records["calibration"]), str(records["heldout"])]
    argv += ["--drafter", drafts["dspark"], "--temperature", "1", "--out", str(sts_path)]
    argv += ["--plot", str(out / "reliability.png")]
    run(argv, out / "calibrate.log", commands, sts_path)

    if not args.skip_throughput:
        argv = [sys.executable, str(Path(__file__).with_name("throughput.py")), "--target", target]
        argv += ["--draft", drafts["dspark"], "--prompts", str(heldout), "--sts", str(sts_path)]
        argv += ["--concurrency", args.concurrency, "--temperature", "1"]
        argv += ["--out", str(out / "throughput.json"), "--plot", str(out / "throughput.png")]
        run(argv, out / "throughput.log", commands, out / "throughput.json")

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
    if (out / "throughput.json").exists():
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
