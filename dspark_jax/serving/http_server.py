"""uvicorn under the app: a socket bound up front, deadlines on slow clients, drain on signals.

- The listening socket is bound before the models load (`bind_socket`), so a port in use is a
  one-line error at once, and port 0 resolves to the real port before anything is printed.
- Connections are asyncio protocol objects, not threads, so a slow client holds no thread; it
  still holds a socket and a buffer, so every read has a deadline. uvicorn bounds the request
  head's size (h11's incomplete-event limit, 16 KiB) and closes idle keep-alive connections
  (`timeout_keep_alive`), but a client that sends its head one byte at a time (slow loris) is
  never timed out: `_HeadDeadline` answers 408 (an OpenAI error object, counted in the
  metrics and written to the access log like the app's answers) and closes when a request head
  is not complete `read_timeout_s` after the connection opened (or after its first bytes, on a
  kept-alive connection). Bodies have their own deadline in the app
  (`HttpLimits.read_timeout_s`).
- Past `max_connections` open connections a request gets 503 from the app (an OpenAI error with
  Retry-After, counted), not from uvicorn's limit_concurrency (text/plain, uncounted);
  `/health` and `/metrics` are still answered.
- With `api_key`, every request but `/health` and `/metrics` must carry
  `Authorization: Bearer <key>`; others get 401 before their body is read.
- SIGTERM and SIGINT (Ctrl-C) drain: uvicorn closes the listening socket and the app stops
  taking requests and sheds those not started (503). Running requests get `drain_timeout_s` to
  finish; then the app aborts them itself, so each ends with a whole answer (503, or a last
  chunk with finish reason "abort" and [DONE]) and the process exits 0 with nothing cancelled
  mid-write. A second Ctrl-C aborts them at once. uvicorn's own deadline, which cancels
  connection tasks (tracebacks, a bare 500, a stream cut mid-chunk), is set
  `_ABORT_GRACE_S` past ours: only a client that stops reading its answer meets it, or a third
  Ctrl-C.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import re
import signal
import socket
import threading
import urllib.parse

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from dspark_jax.decoding.engine import Engine
from dspark_jax.errors import UserError
from dspark_jax.serving.app import ApiError, HttpLimits, OpenAIServer, ServedModel, create_app
from dspark_jax.serving.metrics import ServingMetrics
from dspark_jax.serving.runtime import FAILED, EngineRunner

log = logging.getLogger(__name__)

# Time the requests aborted at the drain deadline get to write their last bytes.
_ABORT_GRACE_S = 5.0


def _timeout_answer(read_timeout_s: float) -> bytes:
    error = ApiError(
        408, f"the request head did not arrive within {read_timeout_s:g} s", kind="timeout"
    )
    body = json.dumps(error.body.model_dump()).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class ServerStartError(UserError):
    """The server cannot listen where it was asked to."""


def bind_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one."""
    if not 0 <= port <= 65535:
        raise ServerStartError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ServerStartError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServerStartError(f"port {port} on {host} is already in use") from None
        raise ServerStartError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.setblocking(False)
    return sock


def build_app_server(
    engine: Engine,
    model: ServedModel,
    *,
    max_waiting: int,
    limits: HttpLimits | None = None,
    prefix_caching: bool = True,
    priority_scheduling: bool = False,
) -> OpenAIServer:
    """The app's handlers over a runner for `engine` (not started) and its metrics.
    `priority_scheduling`: requests' `priority` orders the queue (else only 0 is taken)."""
    limits = limits or HttpLimits()
    metrics = ServingMetrics(engine.cfg.num_slots, engine.cfg.pool_pages, engine.gamma)
    runner = EngineRunner(
        engine, max_waiting=max_waiting, observer=metrics, prefix_caching=prefix_caching
    )
    return OpenAIServer(runner, model, metrics, limits, priority_scheduling=priority_scheduling)


class _HeadDeadline(H11Protocol):
    """h11 with a deadline on each request head; see the module docstring.

    The clock starts when a connection opens or when the first bytes of a later request head
    arrive; bytes that follow do not reset it. An idle keep-alive connection is left to uvicorn's
    keep-alive timeout, which closes it silently (answering it could race a new request)."""

    read_timeout_s: float = 30.0
    timeout_answer: bytes = b""
    timeouts = None  # the metrics' counter of 408 answers
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined head already partly buffered starts its clock now.
        pending = self.conn.trailing_data[0]
        if pending and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.read_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expired(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(self.timeout_answer)
            self.transport.close()
            self.timeouts.inc()
            if self.access_log:  # as uvicorn logs every answer that went through the app
                self.access_logger.info(
                    '%s - "%s %s HTTP/%s" %d',
                    f"{self.client[0]}:{self.client[1]}" if self.client else "",
                    *_request_line(self.conn.trailing_data[0]),
                    408,
                )


_REQUEST_LINE = re.compile(rb"([A-Z]+) (\S+) HTTP/(\d\.\d)\r?\n")


def _request_line(head: bytes) -> tuple[str, str, str]:
    """(method, path, HTTP version) of a partly received request head for the access log, each
    "-" unless its whole request line arrived."""
    match = _REQUEST_LINE.match(head)
    if match is None:
        return "-", "-", "-"
    method, target, version = (part.decode("latin-1") for part in match.groups())
    return method, urllib.parse.quote(target, safe="/?=&%:@+,;!$'()*~"), version


def _protocol(read_timeout_s: float, metrics: ServingMetrics) -> type[H11Protocol]:
    attributes = {
        "read_timeout_s": read_timeout_s,
        "timeout_answer": _timeout_answer(read_timeout_s),
        "timeouts": metrics.http_responses.labels("408"),
    }
    return type("HeadDeadlineProtocol", (_HeadDeadline,), attributes)


class _DrainWording(logging.Filter):
    """uvicorn says "Waiting for connections to close. (CTRL+C to force quit)" when the drain
    starts; here a second Ctrl-C ends the running requests (each with whole tokens and a proper
    end) and only a third forces the exit (`_Uvicorn.handle_exit`), so say that instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Waiting for connections to close."):
            record.msg = (
                "Waiting for running requests to finish (at most --drain-timeout); Ctrl+C "
                "again ends them at once, a third Ctrl+C quits"
            )
            record.args = ()
        return True


def _reword_drain_notice() -> None:
    uvicorn_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _DrainWording) for f in uvicorn_log.filters):
        uvicorn_log.addFilter(_DrainWording())


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_drain, on_abort):
        super().__init__(config)
        self._on_drain = on_drain
        self._on_abort = on_abort
        self._aborted = False

    def handle_exit(self, sig: int, frame) -> None:
        # Not uvicorn's own: once shut down it raises the signal again, so SIGTERM would end the
        # process with the signal's status instead of the drain's exit 0. And its second Ctrl-C
        # (force_exit) leaves requests and the lifespan to be cancelled mid-await, each with a
        # traceback; ours aborts the requests, which end at once, and leaves force_exit to a
        # third.
        if not self.should_exit:
            self.should_exit = True
            self._on_drain()
        elif sig == signal.SIGINT and not self._aborted:
            self._aborted = True
            self._on_abort()
        elif sig == signal.SIGINT:
            self.force_exit = True


def open_connections(state: uvicorn.server.ServerState) -> int:
    """Connections uvicorn holds, less those closing: a connection answered 503 (Connection:
    close) stays in `state.connections` until its socket is gone, and counting it made a burst
    of N requests past a limit of M refuse all N, not the N - M past it."""
    return sum(
        1
        for conn in state.connections
        if (transport := getattr(conn, "transport", None)) is None or not transport.is_closing()
    )


class HttpServer:
    """Serves `app_server` on `sock` with uvicorn until a signal or `shutdown()`."""

    def __init__(
        self,
        app_server: OpenAIServer,
        sock: socket.socket,
        *,
        read_timeout_s: float = 30.0,
        drain_timeout_s: float = 30.0,
        max_connections: int = 2048,
        log_level: str = "info",
        access_log: bool = True,
        api_key: str | None = None,
    ):
        self.app_server = app_server
        self.sock = sock
        self.drain_timeout_s = drain_timeout_s
        app = create_app(
            app_server,
            max_connections,
            lambda: open_connections(self._server.server_state),
            api_key=api_key,
        )
        config = uvicorn.Config(
            app,
            http=_protocol(read_timeout_s, app_server.metrics),
            lifespan="on",
            log_level=log_level,
            access_log=access_log,
            timeout_keep_alive=5,
            timeout_graceful_shutdown=drain_timeout_s + _ABORT_GRACE_S,
        )
        self._server = _Uvicorn(
            config, lambda: app_server.request_drain(drain_timeout_s), app_server.request_abort
        )
        _reword_drain_notice()
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return str(host), int(port)

    def serve(self) -> int:
        """Serves on this thread until drained; returns the exit status (1: the engine failed).
        On the main thread, SIGTERM and SIGINT start the drain."""
        runner = self.app_server.runner
        runner.on_stop = self._engine_stopped
        runner.start()
        self._server.run(sockets=[self.sock])
        runner.stop(timeout=self.drain_timeout_s)
        return 1 if runner.status == FAILED else 0

    def start(self) -> HttpServer:
        """Serves on a background thread (tests); `shutdown()` drains and ends it."""
        self._thread = threading.Thread(target=self.serve, name="dspark-http", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float | None = None) -> None:
        """What a signal does, from any thread; with `start()`, also waits for the end."""
        self._server.handle_exit(signal.SIGTERM, None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def started(self) -> bool:
        return self._server.started

    def _engine_stopped(self) -> None:
        if self.app_server.runner.status == FAILED:
            log.error("the engine failed; shutting down")
            self._server.handle_exit(signal.SIGTERM, None)
