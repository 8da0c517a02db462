"""The `dspark-jax` console script: one argparse subcommand per module in `COMMANDS`.

A command module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are imported
only when their command runs, so `dspark-jax --help` does not pay for importing JAX.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from dspark_jax.errors import UserError

# name -> (module, one-line help). Adding a command is one line here plus its module.
COMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("dspark_jax.commands.convert", "convert PyTorch drafter/target checkpoints to JAX"),
    "export": ("dspark_jax.commands.export", "export a JAX drafter to the PyTorch layout"),
    "generate": ("dspark_jax.commands.generate", "generate text with speculative decoding"),
    "eval": ("dspark_jax.commands.eval", "measure acceptance and speedup over prompt datasets"),
    "calibrate": ("dspark_jax.commands.calibrate", "fit STS temperatures to calibration records"),
    "profile": ("dspark_jax.commands.profile", "measure the target's verification steps/s (SPS)"),
    "train": ("train.cli", "train a DSpark/DFlash drafter with the frozen target run online"),
    "serve": ("dspark_jax.commands.serve", "serve batched speculative generation over HTTP"),
}

# Bad-input errors of modules whose classes do not derive from UserError yet, as (module, class).
# Looked up in sys.modules only: an error of a module that was never imported cannot have been
# raised, and importing these here would make `dspark-jax --help` pay for JAX.
_OTHER_USER_ERRORS = (
    ("dspark_jax.decoding.engine", "EngineError"),
    ("dspark_jax.decoding.policies", "PolicyError"),
    ("dspark_jax.decoding.policies", "SpsProfileError"),
    ("dspark_jax.decoding.profiling", "ProfileError"),
    ("dspark_jax.decoding.evaluate", "DatasetError"),
)
# Commands whose own modules still raise plain ValueError for bad arguments (calibrate.py,
# generate.py, eval.py, decode_args.py, policy_args.py); each leaves this set once they raise
# UserError instead.
_VALUE_ERROR_COMMANDS = frozenset({"calibrate", "generate", "eval"})


def _user_errors(command: str) -> tuple[type[Exception], ...]:
    """The exception types that mean bad input to `command`, not a bug.

    They are reported in one line without a traceback; anything else keeps its traceback.
    """
    errors: list[type[Exception]] = [UserError, FileExistsError]
    for module_name, class_name in _OTHER_USER_ERRORS:
        error = getattr(sys.modules.get(module_name), class_name, None)
        if error is not None:
            errors.append(error)
    if command in _VALUE_ERROR_COMMANDS:
        errors.append(ValueError)
    return tuple(errors)


def _parser(selected: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dspark-jax",
        description="DSpark speculative decoding in JAX: convert, export and more.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, (module, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            importlib.import_module(module).add_arguments(command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = _parser(selected if selected in COMMANDS else None).parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return module.run(args)
    except Exception as e:
        if not isinstance(e, _user_errors(args.command)):
            raise
        print(f"dspark-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dspark-jax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
