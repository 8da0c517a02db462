"""`dspark-jax convert`: PyTorch (Hugging Face / DeepSpec) checkpoints -> our JAX layout."""

from __future__ import annotations

import argparse

from dspark_jax.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft", help="drafter folder (config.json + safetensors) or hub id")
    parser.add_argument("--target", help="Qwen3 target folder (single or sharded) or hub id")
    parser.add_argument("--out", required=True, help="output folder (written atomically)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument(
        "--dtype",
        choices=("keep", "float32", "bfloat16", "float16"),
        default="keep",
        help="parameter dtype to store (default: keep the checkpoint's); float16 for GPUs "
        "without bfloat16 (e.g. a T4)",
    )


def run(args: argparse.Namespace) -> int:
    from dspark_jax.checkpoints.interrupts import guarded

    # SIGTERM (a scheduler, `timeout`) stops the command as Ctrl-C does: reported, and the
    # working folder of the output removed.
    with guarded():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from dspark_jax.checkpoints.converted import convert_checkpoints
    from dspark_jax.cli.paths import check_output_folder

    if args.draft is None and args.target is None:
        raise UserError("give --draft, --target or both")
    check_output_folder(args.out, "--out", created=False)
    manifest = convert_checkpoints(
        args.out, draft=args.draft, target=args.target, dtype=args.dtype, overwrite=args.overwrite
    )
    for part in manifest["converted"]:
        entry = manifest[part]
        line = f"{part}: {entry['num_params']:,} parameters ({entry['param_dtype']})"
        if "fingerprint" in entry:
            line += f", fingerprint {entry['fingerprint'][:16]}"
        print(line)
    print(f"wrote {args.out}")
    return 0
