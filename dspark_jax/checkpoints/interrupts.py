"""Ctrl-C (or SIGTERM) while an output is written: always honoured, never mid-way through a step
that must end.

Python raises KeyboardInterrupt wherever the main thread happens to be, and some of those places
swallow it (a library's broad `except`, a wait inside a thread pool) or must not be left half
done (Orbax's background writer still filling the folder we are about to delete). `guarded()`
records every SIGINT, so a swallowed one still stops the commit; `deferred()` holds it back
until a step has finished, then raises it. SIGTERM (a scheduler's time limit, `timeout`, a
container stop) is taken the same way, raised as `errors.Terminated` (the KeyboardInterrupt
subclass `train` raises for it), so what cleans up after Ctrl-C cleans up after it too, where
by default it killed the process and left the working folder behind.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from dspark_jax.errors import Terminated

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def raise_for(signum: int) -> None:
    """The exception a stopping signal raises: `Terminated` for SIGTERM (a KeyboardInterrupt,
    reported as "terminated", status 143), KeyboardInterrupt for SIGINT."""
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


class _Guard:
    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal that arrived
        self.deferring = 0

    @property
    def seen(self) -> bool:
        return self.signum is not None

    def handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
        if not self.deferring:
            self._raise()

    def _raise(self) -> None:
        raise_for(self.signum)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Records SIGINTs and SIGTERMs without raising while the block runs."""
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1

    def check(self) -> None:
        """Raises the KeyboardInterrupt (`Terminated` for SIGTERM) of a signal that arrived but
        got lost or deferred."""
        if self.signum is not None:
            self._raise()


_active: list[_Guard] = []


@contextlib.contextmanager
def guarded() -> Iterator[_Guard]:
    """Records SIGINT and SIGTERM while active (raising KeyboardInterrupt as usual, `Terminated`
    for SIGTERM); `check()` re-raises one that was swallowed. Signals reach only the main thread,
    so elsewhere nothing is installed."""
    guard = _Guard()
    if threading.current_thread() is not threading.main_thread():
        yield guard
        return
    previous = {signum: signal.signal(signum, guard.handle) for signum in SIGNALS}
    _active.append(guard)
    try:
        yield guard
    finally:
        _active.remove(guard)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Runs the block to its end whatever SIGINTs (SIGTERMs) arrive, then raises
    KeyboardInterrupt (`Terminated`) if any did (or one arrived earlier under the same guard)."""
    with contextlib.ExitStack() as stack:
        in_main = threading.current_thread() is threading.main_thread()
        guard = _active[-1] if _active and in_main else stack.enter_context(guarded())
        with guard.holding():
            yield
        guard.check()
