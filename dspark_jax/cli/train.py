"""`dspark-jax train`: train a DSpark / DFlash drafter from a named config or a config file.

    dspark-jax train --config tiny-dspark
    dspark-jax train --config dspark-qwen3-4b --data answers.jsonl --output runs/dspark-4b
    dspark-jax train --config my_run.py          # a Python file defining CONFIG = TrainConfig(...)

Running again with the same --output resumes from the newest complete checkpoint; with a larger
--steps it extends a finished run. --data without --eval-data holds out a deterministic share of
the data for evaluation (and says so). Ctrl-C (single process) saves a checkpoint and exits with
status 130; SIGTERM (a scheduler's time limit, `timeout`, preemption) does the same with status 143.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import logging
import re
import sys
import traceback
from pathlib import Path

from dspark_jax.cli.argtypes import positive_int

# Modules whose TRAIN_CONFIGS dicts make up the named configs.
CONFIG_MODULES = ("dspark_jax.configs.train_tiny", "dspark_jax.configs.train_qwen3")


def _named_configs() -> dict:
    named = {}
    for module in CONFIG_MODULES:
        named.update(importlib.import_module(module).TRAIN_CONFIGS)
    return named


def train_config_names() -> tuple[str, ...]:
    """Every named train config, sorted."""
    return tuple(sorted(_named_configs()))


def _failing_line(error: BaseException, path: Path) -> str:
    """`path:line` of the line of config file `path` that raised `error` (just `path` if none)."""
    line = getattr(error, "lineno", None) if isinstance(error, SyntaxError) else None
    for frame in traceback.extract_tb(error.__traceback__):
        if Path(frame.filename).resolve() == path.resolve():
            line = frame.lineno
    return f"{path}:{line}" if line else str(path)


def load_train_config(name_or_path: str):
    """A TrainConfig by name, or the `CONFIG` of a Python file (path ending in .py)."""
    from dspark_jax.config import ConfigError
    from dspark_jax.configs import UnknownConfigError
    from dspark_jax.errors import UserError
    from dspark_jax.training.trainer import TrainConfig

    if name_or_path.endswith(".py"):
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        spec = importlib.util.spec_from_file_location(f"_train_config_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except UserError:
            raise
        except Exception as e:
            # TrainConfig(...) without its required name / data is a bare TypeError.
            where = _failing_line(e, path)
            raise ConfigError(f"config file {where}: {type(e).__name__}: {e}") from e
        config = getattr(module, "CONFIG", None)
        named = getattr(module, "TRAIN_CONFIGS", None)
        if config is None and isinstance(named, dict) and len(named) == 1:
            config = next(iter(named.values()))  # a copy of a configs/ file cut to one entry
        if not isinstance(config, TrainConfig):
            hint = ""
            if isinstance(named, dict) and named:
                hint = (
                    f"; it defines TRAIN_CONFIGS ({', '.join(named)}): add a line such as "
                    f"CONFIG = TRAIN_CONFIGS[{next(iter(named))!r}]"
                )
            raise ConfigError(f"{path} must define CONFIG = TrainConfig(...){hint}")
        return config
    named = _named_configs()
    if name_or_path not in named:
        raise UnknownConfigError(
            f"unknown train config {name_or_path!r}; known: {', '.join(sorted(named))} "
            "(or give a path to a .py file defining CONFIG)"
        )
    return named[name_or_path]


def _mesh(text: str):
    # The decoding commands' parser, imported when used: `train --help` stays light.
    from dspark_jax.cli.args import parse_mesh

    return parse_mesh(text)


# Flags that set a TrainConfig field: an error about the field (from the config or the run) names
# the flag when the flag was given. Fields whose names are plain words (target, data, mesh) are
# left alone, since the words also occur in messages as prose.
FLAG_OF_FIELD = {
    "num_steps": "--steps",
    "init_drafter": "--init-from",
    "anchors_per_chunk": "--anchors-per-chunk",
    "per_device_batch_size": "--per-device-batch-size",
    "seq_lens": "--seq-lens",
    "eval_every": "--eval-every",
    "save_every": "--save-every",
    "eval_data": "--eval-data",
    "skip_bad_records": "--skip-bad-records",
    "enable_thinking": "--thinking",
}


def _naming_flags(message: str, fields) -> str:
    """`message` with the config fields among `fields` named as their flags."""
    for field in fields:
        if field in FLAG_OF_FIELD:
            message = re.sub(rf"(?<![\w./]){field}\b", FLAG_OF_FIELD[field], message)
    return message


def _seq_lens(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seq-lens wants ascending integers like 1024,2048,4096: {text!r}"
        ) from None


@contextlib.contextmanager
def _console_log():
    """The trainer's notices (held-out split, truncation, resume, extension, Ctrl-C) on stderr,
    printed above the progress bar, once each: they do not also reach the root logger, to which
    absl (imported by Orbax) may have given a stderr handler of its own."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    package = logging.getLogger("dspark_jax")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    level, propagate = package.level, package.propagate
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    package.propagate = False
    try:
        with logging_redirect_tqdm(loggers=[package]):
            yield
    finally:
        package.removeHandler(handler)
        package.setLevel(level)
        package.propagate = propagate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        required=True,
        help="named config (tiny-dspark, tiny-dflash, dspark-qwen3-4b, ...) or a .py file "
        "defining CONFIG",
    )
    parser.add_argument("--output", help="run folder (default: runs/<config name>)")
    parser.add_argument("--target", help="target model folder or hub id (overrides the config)")
    parser.add_argument(
        "--data",
        nargs="+",
        help='training JSONL files (override the config): {"messages": [...]} records with roles; '
        "without --eval-data a deterministic share of them is held out for evaluation",
    )
    parser.add_argument(
        "--eval-data",
        nargs="*",
        help="held-out JSONL files (override); given with no file: no evaluation",
    )
    parser.add_argument(
        "--turns",
        choices=("prompts", "dialogue"),
        help='how {"turns": [...]} records are read: prompts (user turns only, the eval format: '
        "refused, nothing to train on; the default) or dialogue (alternating user, assistant)",
    )
    parser.add_argument(
        "--skip-bad-records",
        action="store_true",
        default=None,
        help="skip data lines that hold no trainable conversation, and train on conversations "
        "the target's chat template refuses as padding with no loss, instead of refusing them",
    )
    parser.add_argument(
        "--thinking",
        dest="enable_thinking",
        action="store_true",
        default=None,
        help="render the conversations through the chat template with thinking on, to train on "
        "answers holding reasoning traces (<think>...</think>); default: thinking off",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        help="total optimizer steps (override); more than a finished run's extends it",
    )
    parser.add_argument(
        "--init-from",
        metavar="PATH",
        help="start from these drafter weights: an exported or converted drafter folder, or a "
        "training run / checkpoint (runs/x, runs/x/checkpoints/60); the optimizer starts afresh",
    )
    parser.add_argument(
        "--eval-every", type=positive_int, help="held-out evaluation every N steps"
    )
    parser.add_argument(
        "--save-every", type=positive_int, help="checkpoint every N steps (override)"
    )
    parser.add_argument("--mesh", type=_mesh, help="data,fsdp,tensor sizes; -1 = the rest")
    parser.add_argument(
        "--per-device-batch-size", type=positive_int, help="micro-batch per device"
    )
    parser.add_argument("--anchors-per-chunk", type=positive_int, help="anchors per loss chunk")
    parser.add_argument(
        "--seq-lens",
        type=_seq_lens,
        help="length buckets, ascending and ending at the recipe's max_length (e.g. 128,256)",
    )
    parser.add_argument(
        "--stop-after",
        type=positive_int,
        help="stop (with a checkpoint) after this many total steps",
    )
    parser.add_argument("--no-export", action="store_true", help="skip the final export")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="multi-host: jax.distributed.initialize (cluster auto-detected unless the next "
        "three flags are given)",
    )
    parser.add_argument(
        "--coordinator-address",
        metavar="HOST:PORT",
        help="with --distributed outside a detected cluster: the address of process 0's "
        "coordination service (the same on every process)",
    )
    parser.add_argument(
        "--num-processes", type=int, help="with --distributed: how many processes the job has"
    )
    parser.add_argument(
        "--process-id", type=int, help="with --distributed: this process's rank, 0 .. N-1"
    )


def run(args: argparse.Namespace) -> int:
    from dspark_jax.errors import UserError
    from dspark_jax.sharding import initialize_distributed

    if args.distributed:
        try:
            initialize_distributed(
                args.coordinator_address, args.num_processes, args.process_id, auto_detect=True
            )
        except UserError:
            raise
        except ValueError as e:
            # JAX found no cluster to take the coordinator, process count and rank from.
            raise UserError(
                f"--distributed: no cluster environment found ({e}); JAX detects TPU pods, "
                "SLURM and Open MPI jobs, elsewhere give --coordinator-address HOST:PORT, "
                "--num-processes N and --process-id I"
            ) from None
    import jax

    from dspark_jax.cli.paths import check_output_folder
    from dspark_jax.training.trainer import TrainingInterrupted, train

    config = load_train_config(args.config)
    overrides = {
        "target": args.target,
        "data": tuple(args.data) if args.data else None,
        "eval_data": tuple(args.eval_data) if args.eval_data is not None else None,
        "num_steps": args.steps,
        "mesh": args.mesh,
        "per_device_batch_size": args.per_device_batch_size,
        "anchors_per_chunk": args.anchors_per_chunk,
        "seq_lens": args.seq_lens,
        "turns": args.turns,
        "init_drafter": args.init_from,
        "eval_every": args.eval_every,
        "save_every": args.save_every,
        "skip_bad_records": args.skip_bad_records,
        "enable_thinking": args.enable_thinking,
    }
    if args.data and args.eval_data is None:
        # The config's own held-out set belongs to its own data: evaluate on the user's instead.
        overrides.update(eval_data=(), holdout=True)
    elif args.eval_data is not None:
        overrides["holdout"] = False
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        config = dataclasses.replace(config, **given)
        output = Path(args.output or Path("runs") / config.name)
        # Process 0 alone creates the run folder; other processes probing (and removing) it at
        # the same moment on a shared filesystem could delete it from under each other's probes.
        if jax.process_index() == 0:
            check_output_folder(output, "--output")
        with _console_log():
            result = train(
                config,
                output,
                stop_after=args.stop_after,
                progress=not args.no_progress,
                export=not args.no_export,
            )
    except TrainingInterrupted as e:
        print(f"dspark-jax train: {e}", file=sys.stderr)
        return 128 + e.signum  # 130 for Ctrl-C, 143 for SIGTERM, as if ended by the signal
    except UserError as e:
        raise UserError(_naming_flags(str(e), given)) from None
    summary = {
        "output": str(result.output_dir),
        "step": result.final_step,
        "resumed_from": result.resumed_from,
        "export": None if result.export_dir is None else str(result.export_dir),
    }
    for label, ev in (("eval_start", result.eval_start), ("eval_end", result.eval_end)):
        if ev is not None:
            summary[label] = {k: ev[k] for k in ("loss", "tau", "accept_rate_k")}
    print(json.dumps(summary, indent=2))
    return 0
