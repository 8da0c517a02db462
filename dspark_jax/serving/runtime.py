"""The thread that owns the device: warms the engine up, then drives the continuous-batching loop.

One thread does everything that touches device state: `Engine.warm_up()` (every program is
compiled before the server reports ready), then `Batcher.step()` in a loop that sleeps while
idle and wakes on a submission. The HTTP side only calls `submit` and `cancel`, which are
thread-safe; the Batcher calls each request's `on_event` on this thread.

The runner adds three things the Batcher leaves to its driver:
- a life cycle the HTTP layer can report: warming up -> ok -> draining -> stopped (or failed);
- refusal of new work while warming up, draining or after a failure (`ServiceUnavailable`);
- a failure path: if a step raises (a bug, or the device running out of memory), every request
  in flight hears ("error", EngineFailed) instead of waiting forever, and health reports it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from dspark_jax.decoding.batching import Batcher, EventCallback, Handle, Observer, Request
from dspark_jax.decoding.engine import Engine

log = logging.getLogger(__name__)

WARMING_UP = "warming up"
READY = "ok"
DRAINING = "draining"
STOPPED = "stopped"
FAILED = "failed"


class ServiceUnavailable(RuntimeError):
    """The engine cannot take requests now (warming up, draining, failed); answered with 503."""


class EngineFailed(RuntimeError):
    """The engine loop raised; the requests it held cannot finish."""


class EngineRunner:
    """Warm-up and the Batcher loop on one background thread; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_waiting: int,
        observer: Observer | None = None,
        prefix_caching: bool = True,
    ):
        self.engine = engine
        self.max_waiting = max_waiting
        self.prefix_caching = prefix_caching
        self.observer = observer or Observer()
        self.batcher: Batcher | None = None
        self.warmup_s: float | None = None
        self.error: BaseException | None = None
        self._status = WARMING_UP
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._live: dict[int, tuple[Handle, EventCallback]] = {}
        self._ready = threading.Event()
        # Called on the engine thread when it ends (drained, or failed).
        self.on_stop: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)

    # -- any thread ----------------------------------------------------------------------------
    @property
    def status(self) -> str:
        return self._status

    def start(self) -> EngineRunner:
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Blocks until warm-up has finished (or failed); returns whether the engine is ready."""
        self._ready.wait(timeout)
        return self._status == READY

    def submit(self, request: Request, on_event: EventCallback) -> Handle:
        """Queues a request. Raises ServiceUnavailable unless ready, and whatever
        `Batcher.submit` raises (EngineError for a request that can never run, QueueFullError)."""
        with self._lock:
            if self._status != READY:
                raise ServiceUnavailable(_UNAVAILABLE[self._status])
            cell: list[Handle] = []
            handle = self.batcher.submit(request, lambda k, p: self._relay(cell, k, p))
            cell.append(handle)
            self._live[handle.id] = (handle, on_event)
        self._wake.set()
        return handle

    def cancel(self, handle: Handle) -> None:
        """Ends a request early; its slot and pages are freed on the next loop step."""
        if self.batcher is not None:
            self.batcher.cancel(handle)
            self._wake.set()

    @property
    def alive(self) -> bool:
        """Whether the engine thread still runs."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Takes no more requests; those in flight run on."""
        with self._lock:
            self._closing = True
            if self._status in (WARMING_UP, READY):
                self._status = DRAINING
        self._wake.set()

    def stop(self, timeout: float | None = None) -> bool:
        """Closes, cancels whatever still runs, and ends the thread; returns whether it ended
        within `timeout` (a warm-up in progress cannot be interrupted)."""
        self.close()
        with self._lock:
            handles = [h for h, _ in self._live.values()]
        for handle in handles:
            self.cancel(handle)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the engine thread ---------------------------------------------------------------------
    def _relay(self, cell: list[Handle], kind: str, payload: Any) -> None:
        # The lock orders this after `submit` has registered the handle, even when the request
        # finishes before submit returns.
        with self._lock:
            handle = cell[0]
            on_event = self._live[handle.id][1]
            if kind != "tokens":
                del self._live[handle.id]
        try:
            on_event(kind, payload)
        except Exception:  # noqa: BLE001 - one listener's bug must not stop the loop for all
            log.exception("event callback of request %d failed", handle.id)

    def _run(self) -> None:
        try:
            t0 = time.perf_counter()
            self.engine.warm_up()
            batcher = Batcher(
                self.engine,
                max_waiting=self.max_waiting,
                observer=self.observer,
                prefix_caching=self.prefix_caching,
            )
            self.warmup_s = time.perf_counter() - t0
            with self._lock:
                self.batcher = batcher
                ready = self._status == WARMING_UP
                if ready:
                    self._status = READY
            self._ready.set()
            if ready:  # not when a drain began during warm-up: the server is stopping
                log.info(
                    "ready: warm-up compiled %d programs in %.1f s",
                    self.engine.compiled_programs(),
                    self.warmup_s,
                )
            self._loop(batcher)
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request
            self._fail(e)
        finally:
            self._ready.set()
            if self.on_stop is not None:
                self.on_stop()

    def _loop(self, batcher: Batcher) -> None:
        while True:
            busy = batcher.step()
            if not busy:
                if self._closing:
                    with self._lock:
                        self._status = STOPPED
                    return
                self._wake.wait(0.05)
                self._wake.clear()

    def _fail(self, error: BaseException) -> None:
        log.error("the engine loop failed", exc_info=error)
        with self._lock:
            self.error = error
            self._status = FAILED
            live = list(self._live.values())
            self._live.clear()
        failure = EngineFailed(f"the engine failed: {type(error).__name__}: {error}")
        for handle, on_event in live:
            try:
                on_event("error", failure)
            except Exception:  # noqa: BLE001 - tell the others anyway
                log.exception("event callback of request %d failed", handle.id)


_UNAVAILABLE = {
    WARMING_UP: "the server is warming up (compiling); retry shortly",
    DRAINING: "the server is shutting down",
    STOPPED: "the server is shut down",
    FAILED: "the engine failed; see the server log",
}
