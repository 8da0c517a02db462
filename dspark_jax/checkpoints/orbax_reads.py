"""Orbax reads that leave nothing running behind them when they fail.

Orbax runs a synchronous read on a fresh event loop: every array of a restore is read by a task
gathered on that loop, and the loop is closed as soon as the gather raises. When one array file is
damaged (a truncated copy), its read fails first and the reads of the other arrays are abandoned
mid-flight: their coroutines are garbage-collected later (Orbax turns the GeneratorExit that closes
them into an exception of its own, printed as "Exception ignored in: <coroutine object
_read_array_index_and_device_put>" with the whole TensorStore spec), and tensorstore's threads hand
their results to the closed loop ("RuntimeError: Event loop is closed"). A user whose resume or
export was refused in one line then got pages of tracebacks, at the next garbage collection or at
interpreter exit.

`finished_reads()` makes the loops Orbax creates (they come from the event-loop policy) finish
what is left on them when they are closed, as `asyncio.run` does: the abandoned reads are
cancelled and awaited, the default executor's threads joined; results that arrive after that are
dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import Iterator

# Longest wait, in seconds, for abandoned reads to end once cancelled. Cancelling a tensorstore
# read ends it at its next await; this only bounds a read that ignores cancellation.
ABANDONED_READS_TIMEOUT_S = 60.0


class _FinishingLoop(asyncio.SelectorEventLoop):
    """An event loop that, when closed, first cancels and awaits the tasks still pending on it,
    and afterwards drops callbacks other threads schedule on it (nobody waits for them)."""

    def close(self) -> None:
        if not self.is_closed() and not self.is_running():
            abandoned = [t for t in asyncio.all_tasks(self) if not t.done()]
            for task in abandoned:
                task.cancel()
            if abandoned:
                done, _ = self.run_until_complete(
                    asyncio.wait(abandoned, timeout=ABANDONED_READS_TIMEOUT_S)
                )
                for task in done:
                    # Retrieved, so the loop does not log "exception was never retrieved".
                    if not task.cancelled():
                        task.exception()
            self.run_until_complete(self.shutdown_asyncgens())
            self.run_until_complete(self.shutdown_default_executor())
        super().close()

    def call_soon_threadsafe(self, callback, *args, context=None):
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        except RuntimeError:
            if self.is_closed():
                return None
            raise


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # policies: see finished_reads

    class _FinishingLoopPolicy(asyncio.DefaultEventLoopPolicy):
        def new_event_loop(self) -> asyncio.AbstractEventLoop:
            return _FinishingLoop()


@contextlib.contextmanager
def finished_reads() -> Iterator[None]:
    """Within it, the event loops Orbax opens for its reads end every read they started."""
    with warnings.catch_warnings():
        # Python 3.14 deprecates event-loop policies (removal planned for 3.16); Orbax's reads
        # take their loop from asyncio.new_event_loop(), which still asks the policy.
        warnings.simplefilter("ignore", DeprecationWarning)
        previous = asyncio.get_event_loop_policy()
        asyncio.set_event_loop_policy(_FinishingLoopPolicy())
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            asyncio.set_event_loop_policy(previous)
