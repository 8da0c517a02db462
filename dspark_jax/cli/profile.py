"""`dspark-jax profile`: steps/s of the engine per token bucket -> the SPS table of the
hardware-aware scheduler (`--sps-table` of generate / eval / serve / the throughput benchmark).

`--mode round` (default) times whole speculative rounds (drafting included), which is what the
scheduler trades against; `--mode verify` times the target's packed forward alone (see
`dspark_jax.decoding.profiling`). Without `--target` / `--config` it profiles the embedded pair,
like every other command; `--config NAME` measures a named architecture with random weights
(speed does not depend on the weights), e.g. `--config qwen3-4b` on a GPU."""

from __future__ import annotations

import argparse
import sys

from dspark_jax.cli.argtypes import positive_ints

# Short names for the configs one profiles most.
ALIASES = {"tiny": "tiny-vanilla-target"}
# The drafter config measured with a named target.
DRAFTER_OF = {
    "tiny-vanilla-target": "tiny-vanilla-dspark",
    "tiny-gated-target": "tiny-gated-dspark",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--config",
        help="named target config measured with random weights (e.g. qwen3-4b; 'tiny' is the "
        "byte-level test model); default: the embedded pair",
    )
    source.add_argument("--target", help="a target checkpoint (converted folder, HF folder or id)")
    parser.add_argument(
        "--draft",
        help="drafter checkpoint (with --target; default with neither: the embedded drafter). "
        "Round mode runs it; verify mode takes its block size for the token buckets",
    )
    parser.add_argument(
        "--mode",
        choices=("round", "verify"),
        default="round",
        help="time whole speculative rounds (default) or the target's packed forward alone",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        help="sampling temperature of round-mode timings (default 0; verify mode samples "
        "nothing and takes none)",
    )
    parser.add_argument("--dtype", help="parameter/compute dtype (default: as stored)")
    from dspark_jax.cli.args import add_mesh_argument

    add_mesh_argument(parser)
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=8,
        help="engine slots the table is for (default 8; profile each slot count you serve with)",
    )
    parser.add_argument(
        "--buckets",
        type=positive_ints,
        help="comma-separated token buckets, anchors included (default: the engine's, derived "
        "from the slots and the drafter's block size)",
    )
    parser.add_argument(
        "--context-len",
        type=int,
        default=1024,
        help="cached positions each verified token attends to (default 1024)",
    )
    parser.add_argument("--steps", type=int, default=10, help="steps per timing (default 10)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per bucket (median; 5)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights of --config (default 0)"
    )
    parser.add_argument("--out", required=True, help="SPS table JSON to write")
    parser.add_argument("--plot", help="PNG of steps/s and tokens/s against verified tokens")


def _build_models(args: argparse.Namespace):
    """(target, drafter or None, description, mesh) from checkpoints or from random weights,
    placed straight onto the `--mesh` (or default) mesh."""
    import dataclasses

    import jax
    from flax import nnx

    from dspark_jax.cli.args import SEED_LIMIT, check_mesh_slots, decoding_mesh_for
    from dspark_jax.config import ConfigError, Qwen3Config
    from dspark_jax.configs import get as named_config
    from dspark_jax.models.drafter import DSparkDrafter
    from dspark_jax.models.qwen3 import Qwen3
    from dspark_jax.sharding import (
        check_model_split,
        decoding_mesh,
        init_sharded,
        models_split_sizes,
    )

    if args.config is None:
        from dspark_jax.checkpoints.converted import load_drafter, load_target
        from dspark_jax.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET

        if args.target is None and args.draft is not None:
            raise ConfigError("--draft needs its --target")
        target_path = args.target or EMBEDDED_TARGET
        draft_path = args.draft or (EMBEDDED_DRAFT if args.target is None else None)
        if args.mode == "round" and draft_path is None:
            raise ConfigError("--mode round times speculative rounds: give --draft too")
        mesh = decoding_mesh_for(args, target_path, draft_path)
        check_mesh_slots(args.max_num_seqs, mesh)
        _, target, _ = load_target(target_path, dtype=args.dtype, progress=False, mesh=mesh)
        drafter = None
        if draft_path is not None:
            drafter = load_drafter(draft_path, dtype=args.dtype, progress=False, mesh=mesh)[1]
            drafter.cfg.check_target(target.cfg)
        names = str(target_path) + ("" if draft_path is None else f" + {draft_path}")
        return target, drafter, names, mesh
    if args.draft is not None:
        raise ConfigError("--draft goes with --target, not with --config")
    name = ALIASES.get(args.config, args.config)
    cfg = named_config(name)
    if not isinstance(cfg, Qwen3Config):
        raise ConfigError(f"config {name!r} is not a Qwen3 target config")
    if args.dtype:
        cfg = dataclasses.replace(cfg, dtype=args.dtype)
    drafter_name = DRAFTER_OF.get(name, f"dspark-{name}")
    drafter_cfg = named_config(drafter_name)
    drafter_cfg = dataclasses.replace(
        drafter_cfg, model=dataclasses.replace(drafter_cfg.model, dtype=cfg.dtype)
    )

    def param_bytes() -> int:
        shapes = (
            nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))),
            nnx.eval_shape(lambda: DSparkDrafter(drafter_cfg, rngs=nnx.Rngs(0))),
        )
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(nnx.state(shapes)))

    split_sizes = lambda: models_split_sizes(cfg, drafter_cfg.model)  # noqa: E731
    mesh = decoding_mesh(args.mesh, param_bytes, split_sizes=split_sizes)
    check_mesh_slots(args.max_num_seqs, mesh)
    if mesh is not None:
        check_model_split(f"--config {name}", cfg, mesh)
        check_model_split(f"drafter {drafter_name}", drafter_cfg.model, mesh)
    target = init_sharded(lambda: Qwen3(cfg, rngs=nnx.Rngs(args.seed)), mesh)
    # Random weights take uint32 seeds: the drafter's is the next one, wrapping at 2**32.
    drafter_seed = (args.seed + 1) % SEED_LIMIT
    drafter = init_sharded(lambda: DSparkDrafter(drafter_cfg, rngs=nnx.Rngs(drafter_seed)), mesh)
    return target, drafter, f"{name} + {drafter_name} (random weights)", mesh


def run(args: argparse.Namespace) -> int:
    from dspark_jax.cli.args import check_seed
    from dspark_jax.cli.paths import (
        atomic_file,
        check_not_same_file,
        check_output_file,
        check_plot_file,
    )
    from dspark_jax.cli.report import plot_profile
    from dspark_jax.decoding.engine import EngineConfig
    from dspark_jax.decoding.profiling import profile_engine
    from dspark_jax.errors import UserError
    from dspark_jax.sampling import SamplingConfig
    from dspark_jax.sharding import describe_mesh

    for name in ("max_num_seqs", "context_len", "steps", "repeats"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_seed(args.seed)
    if args.temperature is not None and args.mode == "verify":
        raise UserError(
            "--temperature is read by --mode round only; --mode verify times the target's "
            "forward alone and samples nothing, so it would ignore it: drop --temperature or "
            "use --mode round"
        )
    temperature = 0.0 if args.temperature is None else args.temperature
    SamplingConfig(temperature=temperature)  # generate's rules: finite and >= 0
    if args.plot:
        consequence = "the plot would replace the SPS table written there"
        check_not_same_file(args.plot, "--plot", args.out, "--out", consequence)
    check_output_file(args.out, "--out")
    if args.plot:
        check_plot_file(args.plot)
    target, drafter, description, mesh = _build_models(args)
    print(
        f"profiling {args.mode} steps of {description}, {target.dtype}, {args.max_num_seqs} "
        f"slot{'s' if args.max_num_seqs != 1 else ''}, context {args.context_len}, on "
        f"{describe_mesh(mesh)}",
        flush=True,
    )
    cfg = EngineConfig(num_slots=args.max_num_seqs, token_buckets=args.buckets)
    profile = profile_engine(
        target,
        drafter,
        cfg,
        mode=args.mode,
        temperature=temperature,
        context_len=args.context_len,
        steps=args.steps,
        repeats=args.repeats,
        log=lambda line: print(line, flush=True),
        mesh=mesh,
        config=description,
    )
    with atomic_file(args.out) as tmp:
        profile.save(tmp)
    print(f"wrote {args.out} ({profile.meta['device']}, {profile.meta['date']})")
    warning = non_monotonic_warning(profile.buckets, profile.sps)
    if warning:
        print(warning, file=sys.stderr)
    if args.plot:
        with atomic_file(args.plot) as tmp:
            plot_profile(profile, tmp)
        print(f"wrote {args.plot}")
    return 0


def non_monotonic_warning(buckets, sps) -> str | None:
    """A warning when a bigger step measured faster than a smaller one: the scheduler reads that
    as 'verifying more is free' up to the bump and may then stop short after it (timing noise on
    a busy machine, or a bucket padded to a faster shape)."""
    bumps = [
        f"{b} tokens ({s:.1f}/s) > {prev_b} ({prev_s:.1f}/s)"
        for prev_b, prev_s, b, s in zip(buckets, sps, buckets[1:], sps[1:], strict=False)
        if s > prev_s
    ]
    if not bumps:
        return None
    return (
        "warning: the SPS table is not monotonic -- larger steps measured faster at "
        + "; ".join(bumps)
        + ". The scheduler trusts these numbers; re-profile on a quiet machine or with more "
        "--repeats before serving with it"
    )
