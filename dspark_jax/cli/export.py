"""`dspark-jax export`: a drafter -> PyTorch layouts (config.json + model.safetensors).

Formats: `reference` (DeepSpec / the released drafters; read back by `convert` and the loaders of
this package) and `speculators` (vLLM's speculators layout, `speculators_model_type: dspark`).
The drafter is a converted folder, a Hugging Face / DeepSpec folder, a hub id, or a training
run or checkpoint (`runs/x`, `runs/x/checkpoints/60`), completed with its target's frozen
embedding and head. See docs/export-formats.md.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft",
        required=True,
        help="converted folder (or its draft/), drafter folder, hub id, or a training run / "
        "checkpoint (runs/x, runs/x/checkpoints/60)",
    )
    parser.add_argument("--out", required=True, help="output folder (written atomically)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument(
        "--format",
        choices=("reference", "speculators"),
        default="reference",
        help="reference: DeepSpec / released layout (default); speculators: vLLM's layout",
    )
    parser.add_argument(
        "--target",
        help="the drafter's target (folder or hub id): completes a training checkpoint (default: "
        "the target it records) and is the verifier the speculators layout names (default: the "
        "recorded or converted target)",
    )


def run(args: argparse.Namespace) -> int:
    from dspark_jax.checkpoints.interrupts import guarded

    # SIGTERM (a scheduler, `timeout`) stops the command as Ctrl-C does: reported, and the
    # working folder of the output removed.
    with guarded():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dspark_jax.checkpoints.converted import (
        check_no_overlap,
        export_drafter,
        target_folders,
        write_drafter,
    )
    from dspark_jax.cli.paths import check_output_folder
    from dspark_jax.training.checkpointing import find_checkpoint

    check_output_folder(args.out, "--out", created=False)
    found = find_checkpoint(args.draft)
    if found is None:
        export_drafter(args.draft, args.out, args.overwrite, fmt=args.format, verifier=args.target)
    else:
        from dspark_jax.training.trainer import drafter_from_checkpoint

        directory, step = found
        out = Path(args.out)
        check_no_overlap(out, [directory / str(step), *target_folders(args.target)])
        drafter, target = drafter_from_checkpoint(args.draft, args.target)
        # The target completes the drafter (and is the verifier the speculators layout names).
        check_no_overlap(out, target_folders(target))
        write_drafter(
            drafter, None, args.out, fmt=args.format, verifier=target, overwrite=args.overwrite
        )
        print(f"step {step} of {directory}, completed with the target {target}")
    print(f"wrote {args.out} ({args.format} layout)")
    return 0
