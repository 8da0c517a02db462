"""Command-line options shared by the commands: models, sampling, verification policy, STS.

`generate` and `eval` take every group; the benchmarks reuse the policy group
(`add_policy_arguments(parser)` then `build_policy(args, gamma)` and `load_sts(args)`).
Model options default to the tiny byte-level pair embedded in the package, so the commands run
offline on a laptop; `--target` / `--draft` take any form `load_target` / `load_drafter` read.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from dspark_jax.calibration.sts import StsArtifact
from dspark_jax.decoding.engine import Engine, EngineConfig
from dspark_jax.decoding.policies import (
    POLICY_NAMES,
    Policy,
    PolicyError,
    SpsProfile,
    make_policy,
)
from dspark_jax.embedded import EMBEDDED_DRAFT, EMBEDDED_NAME, EMBEDDED_TARGET
from dspark_jax.errors import UserError
from dspark_jax.sampling import SamplingConfig

if TYPE_CHECKING:
    from dspark_jax.checkpoints.converted import DecodingModels


def add_model_arguments(parser: argparse.ArgumentParser, allow_no_draft: bool = True) -> None:
    group = parser.add_argument_group("models")
    group.add_argument(
        "--target",
        default=None,
        help=f"target: converted folder, safetensors folder or hub id (default: the embedded "
        f"{EMBEDDED_NAME} model)",
    )
    group.add_argument(
        "--draft",
        default=None,
        help=f"drafter, same forms (default: the embedded {EMBEDDED_NAME} drafter)",
    )
    if allow_no_draft:
        group.add_argument(
            "--no-draft",
            action="store_true",
            help="plain autoregressive decoding with the target alone",
        )
    group.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="compute / parameter dtype (default: as stored)",
    )
    add_policy_arguments(parser)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="0 = greedy (default 1.0, as in the paper's evaluation)",
    )
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1 = off)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0 = off)")
    group.add_argument("--seed", type=int, default=0, help="base seed of the requests (default 0)")
    group.add_argument("--max-new-tokens", type=int, default=256, help="per answer (default 256)")
    group.add_argument("--batch-size", type=int, default=8, help="requests per batch (default 8)")
    group.add_argument(
        "--thinking",
        action="store_true",
        help="render prompts with enable_thinking (off by default, as the drafters were trained)",
    )


def sampling_from_args(args: argparse.Namespace) -> SamplingConfig:
    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def check_sizes(args: argparse.Namespace) -> None:
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.seed < 0:
        raise UserError(f"--seed must be >= 0, got {args.seed}")


def load_models(args: argparse.Namespace, with_drafter: bool = True) -> DecodingModels:
    """Target, tokenizer, stop tokens and (unless `with_drafter` is false) the drafter; both
    default to the embedded tiny pair."""
    from dspark_jax.checkpoints.converted import load_decoding_models

    draft = (args.draft or EMBEDDED_DRAFT) if with_drafter else None
    return load_decoding_models(args.target or EMBEDDED_TARGET, draft, dtype=args.dtype)


def build_engine(
    models: DecodingModels,
    args: argparse.Namespace,
    cfg: EngineConfig,
    sampling: SamplingConfig,
    speculative: bool = True,
) -> Engine:
    """The speculative engine (policy and STS from the command line) or the plain one."""
    if not speculative or models.drafter is None:
        return Engine(models.target, None, cfg, sampling=sampling, stop_tokens=models.stop_tokens)
    return Engine(
        models.target,
        models.drafter,
        cfg,
        sampling=sampling,
        policy=build_policy(args, models.gamma),
        stop_tokens=models.stop_tokens,
        sts=load_sts(args),
        drafter_fingerprint=models.drafter_fingerprint,
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


def load_sts(args: argparse.Namespace) -> StsArtifact | None:
    """The --sts artifact (the engine refuses it for another drafter or sampling temperature)."""
    return StsArtifact.load(args.sts) if args.sts else None
