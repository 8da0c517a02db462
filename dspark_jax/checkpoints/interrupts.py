"""Ctrl-C while an output is written: always honoured, never mid-way through a step that must end.

Python raises KeyboardInterrupt wherever the main thread happens to be, and some of those places
swallow it (a library's broad `except`, a wait inside a thread pool) or must not be left half
done (Orbax's background writer still filling the folder we are about to delete). `guarded()`
records every SIGINT, so a swallowed one still stops the commit; `deferred()` holds it back
until a step has finished, then raises it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class _Guard:
    def __init__(self) -> None:
        self.seen = False
        self.deferring = 0

    def handle(self, signum, frame) -> None:
        self.seen = True
        if not self.deferring:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Records SIGINTs without raising while the block runs."""
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1

    def check(self) -> None:
        """Raises the KeyboardInterrupt of a SIGINT that arrived but got lost or deferred."""
        if self.seen:
            raise KeyboardInterrupt


_active: list[_Guard] = []


@contextlib.contextmanager
def guarded() -> Iterator[_Guard]:
    """Records SIGINT while active (raising KeyboardInterrupt as usual); `check()` re-raises one
    that was swallowed. Signals reach only the main thread, so elsewhere nothing is installed."""
    guard = _Guard()
    if threading.current_thread() is not threading.main_thread():
        yield guard
        return
    previous = signal.signal(signal.SIGINT, guard.handle)
    _active.append(guard)
    try:
        yield guard
    finally:
        _active.remove(guard)
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Runs the block to its end whatever SIGINTs arrive, then raises KeyboardInterrupt if any
    did (or one arrived earlier under the same guard)."""
    with contextlib.ExitStack() as stack:
        in_main = threading.current_thread() is threading.main_thread()
        guard = _active[-1] if _active and in_main else stack.enter_context(guarded())
        with guard.holding():
            yield
        guard.check()
