"""`dspark-jax profile`: steps/s per batch size x verify bucket -> an SPS table for the
hardware-aware scheduler (`--sps-table` of generate / eval / the throughput benchmark).

`--mode verify` (default) times the target's verification forward; `--mode round` times whole
speculative rounds (drafting included), which is what the scheduler trades against when the
drafter's cost is not negligible (see `dspark_jax.decoding.profiling`)."""

from __future__ import annotations

import argparse

# Short names for the configs one profiles most.
ALIASES = {"tiny": "tiny-vanilla-target"}
# The drafter config measured with a named target in round mode.
DRAFTER_OF = {
    "tiny-vanilla-target": "tiny-vanilla-dspark",
    "tiny-gated-target": "tiny-gated-dspark",
}


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--config",
        default="qwen3-4b",
        help="named target config, measured with random weights (default qwen3-4b; 'tiny' is "
        "the byte-level test model, for CPU)",
    )
    source.add_argument("--target", help="a target checkpoint (converted folder, HF folder or id)")
    parser.add_argument("--draft", help="drafter checkpoint for --mode round with --target")
    parser.add_argument(
        "--mode",
        choices=("verify", "round"),
        default="verify",
        help="time the target's verify forward (default) or whole rounds",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of round-mode timings (default 0)",
    )
    parser.add_argument("--dtype", help="parameter/compute dtype (default: the config's)")
    parser.add_argument(
        "--batch-sizes",
        type=_ints,
        default=(1, 8, 32, 64),
        help="comma-separated batch sizes (default 1,8,32,64)",
    )
    parser.add_argument(
        "--buckets",
        type=_ints,
        default=(1, 2, 4, 8),
        help="comma-separated verify widths, anchor included (default 1,2,4,8)",
    )
    parser.add_argument(
        "--context-len",
        type=int,
        default=1024,
        help="cached positions each verified token attends to (default 1024)",
    )
    parser.add_argument("--steps", type=int, default=10, help="forwards per timing (default 10)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per cell (median; 5)")
    parser.add_argument("--seed", type=int, default=0, help="random-weight seed")
    parser.add_argument("--out", required=True, help="SPS table JSON to write")
    parser.add_argument("--plot", help="PNG of steps/s and tokens/s against verified tokens")


def _build_models(args: argparse.Namespace):
    """(target, drafter or None, description) from checkpoints or from random weights."""
    import dataclasses

    from flax import nnx

    from dspark_jax.config import ConfigError, Qwen3Config
    from dspark_jax.configs import get as named_config
    from dspark_jax.models.drafter import DSparkDrafter
    from dspark_jax.models.qwen3 import Qwen3

    round_mode = args.mode == "round"
    if args.target:
        from dspark_jax.checkpoints.converted import load_drafter, load_target

        if round_mode and not args.draft:
            raise ConfigError("--mode round with --target needs --draft")
        _, target, _ = load_target(args.target, dtype=args.dtype, progress=False)
        drafter = (
            load_drafter(args.draft, dtype=args.dtype, progress=False)[1] if round_mode else None
        )
        return target, drafter, str(args.target)
    name = ALIASES.get(args.config, args.config)
    cfg = named_config(name)
    if not isinstance(cfg, Qwen3Config):
        raise ConfigError(f"config {name!r} is not a Qwen3 target config")
    if args.dtype:
        cfg = dataclasses.replace(cfg, dtype=args.dtype)
    target = Qwen3(cfg, rngs=nnx.Rngs(args.seed))
    if not round_mode:
        return target, None, f"{name} (random weights)"
    drafter_name = DRAFTER_OF.get(name, f"dspark-{name}")
    drafter_cfg = named_config(drafter_name)
    drafter_cfg = dataclasses.replace(
        drafter_cfg, model=dataclasses.replace(drafter_cfg.model, dtype=cfg.dtype)
    )
    drafter = DSparkDrafter(drafter_cfg, rngs=nnx.Rngs(args.seed + 1))
    return target, drafter, f"{name} + {drafter_name} (random weights)"


def run(args: argparse.Namespace) -> int:
    from dspark_jax.cli.report import plot_profile
    from dspark_jax.decoding.profiling import profile_target
    from dspark_jax.sampling import SamplingConfig

    target, drafter, description = _build_models(args)
    print(
        f"profiling {args.mode} steps of {description}, {target.dtype}, context {args.context_len}"
    )
    profile = profile_target(
        target,
        args.batch_sizes,
        args.buckets,
        drafter=drafter,
        sampling=SamplingConfig(temperature=args.temperature),
        context_len=args.context_len,
        steps=args.steps,
        repeats=args.repeats,
        log=print,
        config=description,
    )
    profile.save(args.out)
    print(f"wrote {args.out} ({profile.meta['device']}, {profile.meta['date']})")
    if args.plot:
        plot_profile(profile, args.plot)
        print(f"wrote {args.plot}")
    return 0
