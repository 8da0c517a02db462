"""`dspark-jax calibrate`: Sequential Temperature Scaling of a drafter's confidence head.

One records file is split by block into a fit and a held-out part; with two files the first is
the fit split and the second the held-out one. The artifact (JSON) carries the temperatures, the
drafter's fingerprint, the sampling temperature and the metrics; the engine refuses it for any
other drafter or temperature. Warnings name what the numbers cannot carry: temperatures pinned at
the grid bound, positions with few observations, AUCs withheld for want of outcomes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--records",
        nargs="+",
        required=True,
        metavar="NPZ",
        help="calibration_records.npz from eval: one file (split) or fit + held-out; eval "
        "records its drafter and sampling temperature, and --drafter / --temperature must match",
    )
    parser.add_argument(
        "--drafter",
        required=True,
        help="the drafter the records came from (its fingerprint goes in the artifact)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        required=True,
        help="sampling temperature the records were generated at",
    )
    parser.add_argument("--out", required=True, help="STS artifact JSON to write")
    parser.add_argument("--plot", help="reliability diagram PNG of the held-out split")
    parser.add_argument(
        "--holdout-fraction",
        type=float,
        default=0.3,
        help="held-out share of blocks with one records file (default 0.3)",
    )
    parser.add_argument("--seed", type=int, default=0, help="split seed (default 0)")
    parser.add_argument("--bins", type=int, default=15, help="ECE bins (default 15)")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from dspark_jax.calibration import sts
    from dspark_jax.checkpoints.converted import load_drafter
    from dspark_jax.cli.args import check_seed
    from dspark_jax.cli.paths import (
        atomic_file,
        check_not_same_file,
        check_output_file,
        check_plot_file,
        same_file,
    )
    from dspark_jax.cli.report import calibration_warnings, format_report, reliability_diagram
    from dspark_jax.errors import UserError
    from dspark_jax.sampling import SamplingConfig

    if len(args.records) > 2:
        raise UserError(f"give one or two records files, got {len(args.records)}")
    if len(args.records) == 2 and same_file(*args.records):
        raise UserError(
            f"--records {' '.join(args.records)}: both name the same file, but the second is "
            "the held-out split, which must hold other rounds than the fit: give one file "
            "(split by block into fit and held-out) or two different ones"
        )
    check_seed(args.seed)
    SamplingConfig(temperature=args.temperature)  # the rules the records were sampled under
    if args.bins < 1:
        raise UserError(f"--bins must be >= 1, got {args.bins}")
    # NaN fails both comparisons.
    if not 0 < args.holdout_fraction < 1:
        raise UserError(f"--holdout-fraction must lie in (0, 1), got {args.holdout_fraction}")
    outputs = {"--out": (args.out, "the STS artifact")}
    if args.plot:
        outputs["--plot"] = (args.plot, "the reliability diagram")
        consequence = "the diagram would replace the STS artifact written there"
        check_not_same_file(args.plot, "--plot", args.out, "--out", consequence)
    for option, (path, what) in outputs.items():
        for records in args.records:
            consequence = f"{what} would replace the records"
            check_not_same_file(path, option, records, "--records", consequence)
    check_output_file(args.out, "--out")
    if args.plot:
        check_plot_file(args.plot)
    parts = [sts.CalibrationRecords.load(path) for path in args.records]
    drafter_cfg, _, fingerprint = load_drafter(args.drafter, progress=False)
    for path, part in zip(args.records, parts, strict=True):
        if part.gamma != drafter_cfg.block_size:
            raise UserError(
                f"{path} has {part.gamma} positions per block, but the drafter's block size is "
                f"{drafter_cfg.block_size}: records from another drafter?"
            )
        _check_provenance(path, part, args, fingerprint)
        sts.check_observed(part, path)
    if len(parts) == 1:
        artifact, report = sts.calibrate(
            parts[0],
            args.holdout_fraction,
            args.seed,
            drafter_fingerprint=fingerprint,
            sampling_temperature=args.temperature,
            n_bins=args.bins,
        )
        _, hold_idx = sts.split_by_block(len(parts[0]), args.holdout_fraction, args.seed)
        held_out = parts[0].subset(hold_idx)
    else:
        fit, held_out = parts
        artifact, report = sts.fit_and_report(
            fit,
            held_out,
            drafter_fingerprint=fingerprint,
            sampling_temperature=args.temperature,
            n_bins=args.bins,
        )
    with atomic_file(args.out) as tmp:
        artifact.save(tmp)
    temps = ", ".join(f"{t:.3f}" for t in artifact.temperatures)
    print(f"STS temperatures: {temps}")
    names = [Path(p).name for p in args.records]
    fit_title = f"fit split ({names[0]})" if len(names) == 2 else f"fit split of {names[0]}"
    held_title = f"held-out split ({names[1]})" if len(names) == 2 else "held-out split"
    print(format_report(report["fit"], fit_title))
    print(format_report(report["holdout"], held_title))
    for line in calibration_warnings(artifact.temperatures, report):
        print(f"warning: {line}", file=sys.stderr)
    print(f"wrote {args.out}")
    if args.plot:
        with atomic_file(args.plot) as tmp:
            reliability_diagram(
                sts.reliability_series(held_out, np.asarray(artifact.temperatures)),
                tmp,
                args.bins,
                title=f"held-out prefix survival, sampling T = {args.temperature:g}",
            )
        print(f"wrote {args.plot}")
    return 0


def _check_provenance(path: str, records, args: argparse.Namespace, fingerprint: str) -> None:
    """Refuses records that eval stamped with another drafter or sampling temperature: the
    artifact would carry --drafter's fingerprint and --temperature, and the engine would then
    apply temperatures fitted to someone else's confidences. Records from before eval stamped
    them are taken on trust, with a warning."""
    import math

    from dspark_jax.calibration.sts import STS_TEMP_RTOL
    from dspark_jax.errors import UserError

    recorded = records.drafter_fingerprint
    if recorded is not None and recorded != fingerprint:
        raise UserError(
            f"{path} was recorded with drafter {recorded[:12]}..., but --drafter {args.drafter} "
            f"is {fingerprint[:12]}...: give the drafter that eval ran (eval.json names it)"
        )
    temperature = records.sampling_temperature
    if temperature is not None and not math.isclose(
        temperature, args.temperature, rel_tol=STS_TEMP_RTOL, abs_tol=1e-9
    ):
        raise UserError(
            f"{path} was recorded at sampling temperature {temperature:g}, not --temperature "
            f"{args.temperature:g}: the fit holds for the temperature the rounds were sampled "
            f"at; give --temperature {temperature:g}"
        )
    if recorded is None or temperature is None:
        print(
            f"warning: {path} does not record its drafter and sampling temperature (written "
            "before eval recorded them): make sure --drafter and --temperature are the ones "
            "eval ran with",
            file=sys.stderr,
        )
