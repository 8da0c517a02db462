"""Where a benchmark number came from (the commit it was measured at) and what it cost to get
there (the programs compiled on the way), and the command-line pieces every benchmark script
shares (one-line errors, argument types, strict JSON written atomically).

A module the scripts import, not a script: running it does nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from dspark_jax.errors import UserError

# The device machine gets a copy of the working tree without its git history: there the
# session names the commit it sent (benchmarks/gpu_session.sh passes it on).
COMMIT_ENV = "DSPARK_JAX_COMMIT"
# jit records these around each stage of building a program; the last one also covers a
# program loaded from the persistent compilation cache instead of compiled.
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


def git_commit() -> str:
    """Short hash of HEAD, with "+dirty" when the working tree has uncommitted changes; without
    git, $DSPARK_JAX_COMMIT, else "unknown"."""
    here = Path(__file__).parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, cwd=here
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get(COMMIT_ENV) or "unknown"


def measured(*, day: bool = False) -> dict[str, str]:
    """The record a script writes beside its numbers: `date` (UTC, to the second; the local
    day alone with `day=True`), `commit` (`git_commit()`) and `device` (the first JAX device's
    kind). Spread it into the result where those keys go: `dict(benchmark=..., **measured(),
    rows=...)`."""
    import jax

    if day:
        date = datetime.date.today().isoformat()
    else:
        date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {"date": date, "commit": git_commit(), "device": str(jax.devices()[0].device_kind)}


class CompileClock:
    """Programs built and seconds spent building them (tracing, lowering, XLA compiling or
    loading from the persistent cache) while in a `with` block; also the block's wall time.

        with CompileClock() as clock:
            engine.warm_up()
        print(clock.programs, clock.compile_s, clock.wall_s)
    """

    def __init__(self):
        self.programs = 0
        self.compile_s = 0.0
        self.wall_s = 0.0

    def __call__(self, event: str, duration: float, *args, **kwargs) -> None:
        if event in _COMPILE_EVENTS:
            self.compile_s += duration
            self.programs += event == _COMPILE_EVENTS[-1]

    def __enter__(self) -> CompileClock:
        import jax

        self._start = time.perf_counter()
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc) -> None:
        import jax

        jax.monitoring.unregister_event_duration_listener(self)
        self.wall_s = time.perf_counter() - self._start


# --- Command lines ------------------------------------------------------------------------
# Every script reports bad input the way the `dspark-jax` command does: one line naming the
# input, no traceback, status 2, before anything slow runs; outputs are written whole or not at
# all, and JSON outputs are strict JSON (no NaN or Infinity: an undefined number is null).

# Bad input (dspark_jax's UserError family, and what a user's paths can do: missing, a folder
# where a file belongs, read-only), reported in one line; anything else is a bug and keeps its
# traceback.
USER_ERRORS = (UserError, OSError)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`PROG: error: ... (see PROG --help)`,
    status 2), like the `dspark-jax` command's, and which takes a comma-separated list of
    negative integers (`--mesh -1,1,1`) as a value, not as an option."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\d+(,-?\d+)*$|^-\d*\.\d+$")

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_compile_workers(parser: argparse.ArgumentParser) -> None:
    """--compile-workers: how many programs `engine.warm_up_all` compiles at once."""
    parser.add_argument(
        "--compile-workers",
        type=positive_int,
        help="programs compiled at once (default: $DSPARK_JAX_COMPILE_WORKERS, else one per CPU "
        "core; 1 compiles one at a time)",
    )


def compile_only_cache(option: str = "--compile-only") -> None:
    """Refuses `option`, a mode that only fills JAX's persistent compilation cache for a later
    run to find, when that cache is off (`dspark_jax.cli.use_compilation_cache` has run)."""
    import jax

    if not jax.config.jax_compilation_cache_dir:
        raise UserError(
            f"{option} fills the persistent compilation cache, which is off here "
            "(DSPARK_JAX_COMPILATION_CACHE): it would compile for nothing"
        )


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """Runs a script's `main()` and ends the process with its status (None: 0); bad input
    (`USER_ERRORS`) raised anywhere inside is reported as `PROG: error: MESSAGE`, status 2."""
    prog = Path(sys.argv[0]).name
    try:
        status = main()
    except USER_ERRORS as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    sys.exit(status or 0)


def _number(text: str, kind: type, minimum: float, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not math.isfinite(value) or value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def positive_int(text: str) -> int:
    """argparse `type=`: an integer >= 1."""
    return _number(text, int, 1, "an integer >= 1")


def non_negative_int(text: str) -> int:
    """argparse `type=`: an integer >= 0."""
    return _number(text, int, 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """argparse `type=`: a finite number > 0."""
    value = _number(text, float, 0.0, "a number > 0")
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
    return value


def non_negative_float(text: str) -> float:
    """argparse `type=`: a finite number >= 0."""
    return _number(text, float, 0.0, "a number >= 0")


def positive_ints(text: str) -> tuple[int, ...]:
    """argparse `type=`: a comma-separated list of integers >= 1 (`1,8,32`)."""
    items = text.split(",")
    try:
        return tuple(positive_int(item.strip()) for item in items)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers >= 1"
        ) from None


def fractions(text: str) -> tuple[float, ...]:
    """argparse `type=`: a comma-separated list of numbers in (0, 1] (`0.9,0.8`)."""
    try:
        values = tuple(float(item) for item in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers in (0, 1]"
        )
    return values


def existing_file(path: str | os.PathLike, option: str) -> Path:
    """`path` as a Path, once it is known to be a file (a UserError naming `option` if not)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{option} {path}: no such file")
    if not path.is_file():
        raise UserError(f"{option} {path}: is a folder, not a file")
    return path


def existing_folder(path: str | os.PathLike, option: str) -> Path:
    """`path` as a Path, once it is known to be a folder (a UserError naming `option` if not)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{option} {path}: no such folder")
    if not path.is_dir():
        raise UserError(f"{option} {path}: is a file, not a folder")
    return path


def output_file(path: str | os.PathLike, option: str) -> Path:
    """`path` as a Path, once a file can be written there: checked before measuring, so a typo
    in the folder fails in the first second, not after the run (dspark_jax.cli.paths)."""
    from dspark_jax.cli.paths import check_output_file

    return check_output_file(path, option)


def plot_file(path: str | os.PathLike, option: str, out: str | os.PathLike | None = None) -> Path:
    """`path` as a Path, once a plot can be written there in a format matplotlib writes (and
    it is not the `out` file, which it would replace): checked before measuring."""
    from dspark_jax.cli.paths import check_not_same_file, check_plot_file

    plot = check_plot_file(path, option)
    if out is not None:
        check_not_same_file(plot, option, out, "--out", "the plot would replace the results")
    return plot


def read_json(path: str | os.PathLike, option: str) -> object:
    """The JSON in `path`, NaN and Infinity (which earlier versions of the scripts wrote) read
    as None; a UserError naming `option` when the file is missing or not JSON."""
    path = existing_file(path, option)
    try:
        return json.loads(path.read_text(), parse_constant=lambda _: None)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{option} {path}: not a JSON file ({e})") from None


def finite_or_none(value: float | None) -> float | None:
    """`value` as a float, None where it is None, NaN or infinite (undefined: JSON null)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def write_json(path: str | os.PathLike, data: object, indent: int | None = 1) -> None:
    """Writes `data` to `path` as strict JSON (a NaN or Infinity left in it is a bug: ValueError
    before anything is written), atomically: a run stopped midway leaves the previous file."""
    from dspark_jax.cli.paths import atomic_file

    text = json.dumps(data, indent=indent, allow_nan=False) + "\n"
    with atomic_file(path) as tmp:
        tmp.write_text(text)
