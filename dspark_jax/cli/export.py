"""`dspark-jax export`: a converted JAX drafter -> PyTorch (DeepSpec) config.json + safetensors."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft", required=True, help="converted folder (or its draft/) holding the drafter"
    )
    parser.add_argument("--out", required=True, help="output folder (written atomically)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def run(args: argparse.Namespace) -> int:
    from dspark_jax.checkpoints.converted import export_drafter

    export_drafter(args.draft, args.out, overwrite=args.overwrite)
    print(f"wrote {args.out}")
    return 0
