"""Command-line options that choose the engine's verification policy and STS artifact.

Shared by the commands that build an engine (generate, eval, benchmarks):
`add_policy_arguments(parser)` then `build_policy(args, gamma)` and `load_sts(args, ...)`.
"""

from __future__ import annotations

import argparse

from dspark_jax.calibration.sts import StsArtifact
from dspark_jax.decoding.policies import (
    POLICY_NAMES,
    Policy,
    PolicyError,
    SpsProfile,
    make_policy,
)


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("verification policy")
    group.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default="fixed",
        help="how many drafts each request verifies per round (default fixed)",
    )
    group.add_argument(
        "--gamma", type=int, help="drafts verified by the fixed policy (default: the block size)"
    )
    group.add_argument(
        "--threshold",
        type=float,
        help="confidence threshold of the (cumulative-)threshold policies",
    )
    group.add_argument("--sps-table", help="SPS table JSON from dspark-jax profile (schedulers)")
    group.add_argument("--sts", help="STS artifact JSON from dspark-jax calibrate")


def build_policy(args: argparse.Namespace, block_size: int) -> Policy:
    """The policy named by --policy for a drafter with `block_size` drafts per block."""
    sps = SpsProfile.load(args.sps_table) if args.sps_table else None
    gamma = block_size if args.gamma is None else args.gamma
    if not 0 <= gamma <= block_size:
        raise PolicyError(f"--gamma must lie in 0..{block_size} (the block size), got {gamma}")
    return make_policy(args.policy, gamma, threshold=args.threshold, sps=sps)


def load_sts(
    args: argparse.Namespace, drafter_fingerprint: str, temperature: float
) -> StsArtifact | None:
    """The --sts artifact, refused unless it belongs to this drafter and sampling temperature."""
    if not args.sts:
        return None
    return StsArtifact.load(
        args.sts, expected_fingerprint=drafter_fingerprint, expected_temperature=temperature
    )
