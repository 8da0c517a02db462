"""Where a benchmark number came from (the commit it was measured at) and what it cost to get
there (the programs compiled on the way)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

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
