"""The `dspark-jax` console script: one argparse subcommand per module in `COMMANDS`.

A command module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are imported
only when their command runs, so `dspark-jax --help` does not pay for importing JAX.

Ctrl-C is reported as `dspark-jax COMMAND: interrupted` with status 130. As the console script
(`main()` with no arguments) main owns the process and ends it there and then: leaving the
interpreter the usual way while XLA still compiles on its threads can crash in teardown
(SIGSEGV). That is safe because the commands in `ENDS_AT_ONCE` write their outputs atomically,
so by the time the interrupt reaches main nothing is half written, and train has finished its
own handling of the interrupt (`INTERRUPT_ENDS_AT_ONCE`). A command that finished ends
the process the same way, with its status: nothing is left to save, and a Ctrl-C in the
teardown it skips would otherwise end it by the signal or with a traceback from JAX.
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import importlib
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

from dspark_jax.errors import Terminated, UserError

# name -> (module, one-line help). Adding a command is one line here plus its module.
COMMANDS: dict[str, tuple[str, str]] = {
    "convert": ("dspark_jax.cli.convert", "convert PyTorch drafter/target checkpoints to JAX"),
    "export": ("dspark_jax.cli.export", "export a JAX drafter to the PyTorch layout"),
    "generate": ("dspark_jax.cli.generate", "generate text with speculative decoding"),
    "eval": ("dspark_jax.cli.eval", "measure acceptance and speedup over prompt datasets"),
    "calibrate": ("dspark_jax.cli.calibrate", "fit STS temperatures to calibration records"),
    "profile": (
        "dspark_jax.cli.profile",
        "measure steps/s of speculative rounds (or of verification alone) per token bucket: SPS",
    ),
    "train": (
        "dspark_jax.cli.train",
        "train a DSpark/DFlash drafter with the frozen target run online",
    ),
    "serve": ("dspark_jax.cli.serve", "an OpenAI-compatible server with continuous batching"),
}

# Bad input, reported in one line without a traceback; any other exception keeps its traceback.
# OSError covers what the user's paths and ports can do (missing, read-only, in use, a folder
# where a file belongs); its message names the path.
USER_ERRORS = (UserError, OSError)
# Commands that compile programs, and so gain from the persistent compilation cache.
COMPILING = frozenset({"generate", "eval", "calibrate", "profile", "train", "serve"})
CACHE_ENV = "DSPARK_JAX_COMPILATION_CACHE"
# --sps-table's value that profiles the engine a command builds instead of reading a table.
SPS_AUTO = "auto"
# Commands whose outputs are renamed into place (atomic_output_dir, atomic_file), so an
# interrupt leaves nothing to finish and the process may end at once. train (an Orbax writer may
# still be saving a checkpoint) and serve (which drains requests itself) end the usual way.
ENDS_AT_ONCE = frozenset({"convert", "export", "generate", "eval", "calibrate", "profile"})
# Commands that may also end at once once an interrupt reaches main: train's own handling has
# by then saved its checkpoint (or abandoned it at a second Ctrl-C, leaving a temporary folder
# that the next run passes over), closed its logs and removed what a run stopped before its
# first step had set up, while XLA may still compile on its threads (the teardown crash).
INTERRUPT_ENDS_AT_ONCE = ENDS_AT_ONCE | {"train"}


def compilation_cache_off(setting: str) -> bool:
    """Whether a DSPARK_JAX_COMPILATION_CACHE value turns the cache off (rather than naming
    its folder)."""
    return setting.lower() in ("0", "off", "false", "no")


def use_compilation_cache() -> None:
    """Keeps compiled programs across runs (JAX's persistent cache), so that running a command
    again does not compile again. DSPARK_JAX_COMPILATION_CACHE=off disables it, a path moves it
    (default ~/.cache/dspark-jax/xla); a cache directory set through JAX's own configuration
    wins."""
    setting = os.environ.get(CACHE_ENV, "")
    if compilation_cache_off(setting):
        return
    import jax

    if jax.config.jax_compilation_cache_dir:
        return
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    jax.config.update(
        "jax_compilation_cache_dir", setting or os.path.join(base, "dspark-jax", "xla")
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dspark-jax")
    except PackageNotFoundError:
        return "(not installed)"


class _Parser(argparse.ArgumentParser):
    """Reports a bad command line in one line (the usage is one `--help` away), as the command
    it concerns: options the top level cannot place are blamed on the subcommand."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse takes "-1,1,1" for an option unless it looks like a negative number; a
        # comma-separated list of integers is a value too (`--mesh -1,1,1`).
        self._negative_number_matcher = re.compile(r"^-\d+(,-?\d+)*$|^-\d*\.\d+$")
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        args, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = self.commands.get(getattr(args, "command", None), self)
            owner.error(f"unrecognized arguments: {' '.join(extras)}")
        return args


def one_line(error: BaseException) -> str:
    """The message of `error` on one line: some (the hub client's, Orbax's) span several."""
    return " ".join(str(error).split())


def _parser(selected: str | None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dspark-jax",
        description="DSpark speculative decoding in JAX: convert, export and more.",
    )
    parser.add_argument("--version", action="version", version=f"dspark-jax {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, (module, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        parser.commands[name] = command_parser
        if name == selected:
            importlib.import_module(module).add_arguments(command_parser)
    return parser


def _end_process(status: int) -> None:
    """Ends the process now with `status`, skipping interpreter teardown (see the module)."""
    # From here on a Ctrl-C changes nothing: what was to be written is written.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


@contextlib.contextmanager
def _swallowed_interrupts_delivered() -> Iterator[None]:
    """Delivers again a Ctrl-C that Python had to drop. The KeyboardInterrupt of a SIGINT
    rises wherever the main thread is; inside a garbage-collection callback (JAX registers one)
    it cannot propagate and is reported as unraisable, and the command ran on to its end. It is
    raised again a moment later, once that callback has returned."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            timer = threading.Timer(0.05, _thread.interrupt_main)
            timer.daemon = True
            timer.start()
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _caused_by_interrupt(error: BaseException) -> bool:
    """Whether a KeyboardInterrupt lies in the chain of exceptions that led to `error`."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand; returns the process exit status.

    With `argv` None (the console script) the command line is the process's own and main ends
    the process itself (see the module docstring)."""
    own_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    name = selected if selected in COMMANDS else None
    prog = "dspark-jax" if name is None else f"dspark-jax {name}"
    ends_at_once = own_process and name in ENDS_AT_ONCE
    started = False  # whether the command itself runs (its imports and arguments done)
    try:
        # Parsing imports the command's module, and with it JAX: a Ctrl-C can come this early.
        with _swallowed_interrupts_delivered():
            try:
                args = _parser(name).parse_args(argv)
            except SystemExit as e:
                return e.code if isinstance(e.code, int) else 2
            module = importlib.import_module(COMMANDS[args.command][0])
            if args.command in COMPILING:
                use_compilation_cache()
            started = True
            status = module.run(args)
    except USER_ERRORS as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        # An import that Ctrl-C stopped halfway can surface as another error (numpy turns it
        # into an ImportError); that is still an interrupt, not a bug.
        if not _caused_by_interrupt(e):
            raise
        interrupted = signal.SIGINT
    except Terminated:
        # A command that takes SIGTERM as it takes Ctrl-C (train) raises Terminated for it.
        interrupted = signal.SIGTERM
    except KeyboardInterrupt:
        interrupted = signal.SIGINT
    else:
        interrupted = None
    if interrupted is not None:
        said = "terminated" if interrupted == signal.SIGTERM else "interrupted"
        print(f"{prog}: {said}", file=sys.stderr)
        # Stopped in its imports, no command has anything to finish (serve too).
        if own_process and (name in INTERRUPT_ENDS_AT_ONCE or not started):
            _end_process(128 + interrupted)
        return 128 + interrupted
    if ends_at_once:
        # The output is complete. Teardown has nothing left to save, and a Ctrl-C during it
        # would end the process by the signal (status 130, no message) or print a traceback
        # from JAX's exit handlers.
        _end_process(status)
    return status
