"""A small HTTP server over the batched engine, on the standard library only.

Endpoints:

  GET  /health       {"status": "ok", "model": {...}, "engines_cached": n}
  POST /v1/generate  {"prompt": str} | {"messages": [...]} | {"token_ids": [...]}, plus optional
                     max_new_tokens, temperature, top_k, top_p, seed, speculative, stream,
                     enable_thinking. Answers {"text", "token_ids", "finish_reason", "tau",
                     "rounds", "usage"}; with "stream": true, Server-Sent Events instead: one
                     `data: {"delta", "token_ids"}` event per chunk of decoded tokens, then
                     `data: {"done": true, ...the full answer}`.

One worker thread owns the device. HTTP handler threads parse and tokenize, then queue a job and
wait for its events. The worker takes the oldest job, gathers up to `batch_size` queued jobs with
the same sampling config and mode (speculative or plain), waiting at most `max_wait_s` after the
first, and runs them as one batch through `generate`. Jobs of another config wait for a later
batch, in arrival order. A batch runs to completion: a client that disconnects does not cancel it.

Compiled programs stay bounded: one `Engine` per distinct (sampling config, speculative) pair,
created on first use and kept in an LRU of `max_engines`; evicting an engine drops its compiled
programs with it. Each engine compiles at most one prefill program per (batch bucket, prompt
bucket) and one decode program per batch bucket, so the server holds at most
max_engines x (|batch buckets| x (|prompt buckets| + 2)) programs. Engines share the model
weights (splitting a model does not copy its arrays).

A request's output depends only on itself and its seed, not on its batch mates (the engine's
randomness is addressed per request and position), so batching is invisible to clients.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import queue
import threading
import time
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dspark_jax.checkpoints.converted import DecodingModels
from dspark_jax.decoding.engine import Engine, EngineConfig, EngineError, power_of_two_buckets
from dspark_jax.decoding.generate import Request, Result, generate
from dspark_jax.errors import UserError
from dspark_jax.sampling import SamplingConfig
from dspark_jax.serving.text_stream import TextStream
from dspark_jax.tokenizer import decode_text, encode_chat

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
_FIELDS = frozenset(
    {
        "prompt",
        "messages",
        "token_ids",
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "speculative",
        "stream",
        "enable_thinking",
    }
)


class RequestError(UserError):
    """A request body the server cannot accept (answered with 400)."""


class ServerClosedError(RuntimeError):
    """The server is shutting down and takes no more work (answered with 503)."""


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How the server batches requests; every engine it builds has the shapes of `engine`.

    `engine` None derives the engine settings from `batch_size`: batch buckets of the powers of
    two below it and itself, max_len 2048, max_new_tokens 512 (also the default of a request),
    and 8 rounds per chunk (fewer stream more often, at one host sync per chunk).
    """

    batch_size: int = 8
    max_wait_s: float = 0.005
    max_engines: int = 4
    engine: EngineConfig | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_engines < 1:
            raise UserError(f"max_engines must be >= 1, got {self.max_engines}")
        if self.max_wait_s < 0:
            raise UserError(f"max_wait_s must be >= 0, got {self.max_wait_s}")
        if self.engine is None:
            engine = EngineConfig(
                max_len=2048,
                max_new_tokens=512,
                batch_buckets=power_of_two_buckets(self.batch_size),
                rounds_per_chunk=8,
            )
            object.__setattr__(self, "engine", engine)
        if max(self.engine.batch_buckets) < self.batch_size:
            raise UserError(
                f"the largest batch bucket {max(self.engine.batch_buckets)} is below batch_size "
                f"{self.batch_size}"
            )


def model_info(models: DecodingModels) -> dict[str, Any]:
    """What /health tells about the served models."""
    return {
        "target": str(models.model_dir),
        "draft": models.drafter_path,
        "draft_fingerprint": models.drafter_fingerprint,
        "vocab_size": models.target.cfg.vocab_size,
        "block_size": models.gamma or None,
        "dtype": models.target.cfg.dtype,
    }


# -- request parsing ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GenerateParams:
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int
    sampling: SamplingConfig
    speculative: bool
    stream: bool


def _get(body: Mapping[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    # bool is an int subclass: true must not pass as a number, nor 1 as a flag.
    if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise RequestError(f"field {name!r} must be {names}, got {value!r}")
    return value


def parse_generate(body: Any, model: DecodingModels, cfg: ServerConfig) -> GenerateParams:
    """Validates a /v1/generate body and tokenizes its prompt; RequestError names the problem."""
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise RequestError(f"unknown fields {unknown}; accepted: {sorted(_FIELDS)}")
    given = [k for k in ("prompt", "messages", "token_ids") if k in body]
    if len(given) != 1:
        raise RequestError(f"give exactly one of 'prompt', 'messages', 'token_ids' (got {given})")
    tokenizer = model.tokenizer
    if "prompt" in body:
        prompt_ids = list(tokenizer.encode(_get(body, "prompt", (str,), None)))
    elif "messages" in body:
        messages = _get(body, "messages", (list,), None)
        thinking = _get(body, "enable_thinking", (bool,), False)
        prompt_ids = encode_chat(tokenizer, messages, enable_thinking=thinking)
    else:
        prompt_ids = _get(body, "token_ids", (list,), None)
        vocab = model.target.cfg.vocab_size
        bad = [
            t
            for t in prompt_ids
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
        ]
        if bad:
            raise RequestError(f"token_ids must be ints in [0, {vocab}); bad: {bad[:5]}")
    max_new = _get(body, "max_new_tokens", (int,), cfg.engine.max_new_tokens)
    if max_new < 1:
        raise RequestError(f"max_new_tokens must be >= 1, got {max_new}")
    seed = _get(body, "seed", (int,), 0)
    if not 0 <= seed < 2**32:
        raise RequestError(f"seed must be in [0, 2**32), got {seed}")
    sampling = SamplingConfig(
        temperature=float(_get(body, "temperature", (int, float), 0.0)),
        top_k=_get(body, "top_k", (int,), 0),
        top_p=float(_get(body, "top_p", (int, float), 1.0)),
    )
    if sampling.greedy:
        sampling = SamplingConfig()  # filters do not change an argmax: share one greedy engine
    speculative = _get(body, "speculative", (bool,), model.drafter is not None)
    if speculative and model.drafter is None:
        raise RequestError('this server has no drafter: send "speculative": false')
    stream = _get(body, "stream", (bool,), False)
    return GenerateParams(prompt_ids, max_new, seed, sampling, speculative, stream)


def result_json(result: Result, tokenizer: Any) -> dict[str, Any]:
    """The /v1/generate answer for one finished request."""
    return {
        "text": decode_text(tokenizer, result.tokens),
        "token_ids": result.tokens,
        "finish_reason": result.finish_reason,
        "tau": result.tau,
        "rounds": result.rounds,
        "usage": {
            "prompt_tokens": result.prompt_len,
            "completion_tokens": len(result.tokens),
            "total_tokens": result.prompt_len + len(result.tokens),
            "drafts_verified": int(result.verified.sum()),
            "drafts_accepted": int(result.accepted.sum()),
        },
    }


# -- the device worker -------------------------------------------------------------------------
EngineKey = tuple[SamplingConfig, bool]


@dataclasses.dataclass(eq=False)
class Job:
    """One queued request; its events are ("tokens", ids), then ("done", Result) or ("error", e)."""

    request: Request
    key: EngineKey
    events: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)


class BatchWorker:
    """The thread that owns the device: gathers queued jobs into batches and runs them."""

    def __init__(self, model: DecodingModels, cfg: ServerConfig):
        self.model = model
        self.cfg = cfg
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._deferred: collections.deque[Job] = collections.deque()
        self._engines: collections.OrderedDict[EngineKey, Engine] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self.batches_run = 0
        self.requests_run = 0
        self._thread = threading.Thread(target=self._loop, name="dspark-device", daemon=True)

    @property
    def engines_cached(self) -> int:
        return len(self._engines)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request, sampling: SamplingConfig, speculative: bool) -> Job:
        """Queues a request; read the returned job's events for its tokens and result."""
        job = Job(request, (sampling, speculative))
        with self._lock:
            if self._closed:
                raise ServerClosedError("the server is shutting down")
            self._queue.put(job)
        return job

    def stop(self, timeout: float | None = None) -> None:
        """Finishes the running batch, fails queued jobs with ServerClosedError, ends the thread."""
        with self._lock:
            self._closed = True
            self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def engine(self, key: EngineKey) -> Engine:
        """The engine of a (sampling, speculative) pair, built on first use (LRU-bounded)."""
        if key in self._engines:
            self._engines.move_to_end(key)
            return self._engines[key]
        sampling, speculative = key
        engine = Engine(
            self.model.target,
            self.model.drafter if speculative else None,
            self.cfg.engine,
            sampling=sampling,
            stop_tokens=self.model.stop_tokens,
        )
        self._engines[key] = engine
        while len(self._engines) > self.cfg.max_engines:
            self._engines.popitem(last=False)
        return engine

    def _loop(self) -> None:
        while not self._closed and (batch := self._gather()) is not None:
            self._run(batch)
        self._fail_waiting()

    def _gather(self) -> list[Job] | None:
        """The next batch: the oldest job and up to batch_size - 1 others with its key."""
        if self._deferred:
            first = self._deferred.popleft()
        else:
            first = self._queue.get()
            if first is None:
                return None
        batch = [first]
        for job in list(self._deferred):
            if len(batch) < self.cfg.batch_size and job.key == first.key:
                self._deferred.remove(job)
                batch.append(job)
        deadline = time.monotonic() + self.cfg.max_wait_s
        while len(batch) < self.cfg.batch_size:
            try:
                job = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)  # seen again by the next gather, after this batch runs
                break
            (batch if job.key == first.key else self._deferred).append(job)
        return batch

    def _run(self, batch: list[Job]) -> None:
        try:
            engine = self.engine(batch[0].key)
        except Exception as e:  # noqa: BLE001 - every caller must hear of the failure
            for job in batch:
                job.events.put(("error", e))
            return
        ready = []
        for job in batch:
            try:
                engine.check_fits(len(job.request.prompt_ids), job.request.max_new_tokens)
                ready.append(job)
            except EngineError as e:
                job.events.put(("error", RequestError(str(e))))
        if not ready:
            return
        self.batches_run += 1
        self.requests_run += len(ready)
        try:
            results, _ = generate(
                engine,
                [job.request for job in ready],
                batch_size=len(ready),
                on_tokens=lambda i, ids: ready[i].events.put(("tokens", ids)),
            )
        except Exception as e:  # noqa: BLE001 - every caller must hear of the failure
            log.exception("batch of %d failed", len(ready))
            for job in ready:
                job.events.put(("error", e))
            return
        for job, result in zip(ready, results, strict=True):
            job.events.put(("done", result))

    def _fail_waiting(self) -> None:
        with self._lock:
            waiting = list(self._deferred)
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    waiting.append(job)
        for job in waiting:
            job.events.put(("error", ServerClosedError("the server is shutting down")))


# -- HTTP --------------------------------------------------------------------------------------
class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    app: DSparkServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base class signature
        log.info("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send_json(HTTPStatus.OK, self.server.app.health())
        elif self.path == "/v1/generate":
            self._send_error(HTTPStatus.METHOD_NOT_ALLOWED, "use POST for /v1/generate")
        else:
            self._send_error(HTTPStatus.NOT_FOUND, f"no such path {self.path!r}")

    def do_POST(self) -> None:
        if self.path != "/v1/generate":
            self._discard_body()
            self._send_error(HTTPStatus.NOT_FOUND, f"no such path {self.path!r}")
            return
        app = self.server.app
        try:
            params = parse_generate(self._read_json(), app.model, app.cfg)
            job = app.worker.submit(
                Request(params.prompt_ids, params.max_new_tokens, params.seed),
                params.sampling,
                params.speculative,
            )
        except _BodyTooLarge as e:
            self.close_connection = True
            self._send_error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(e))
            return
        except UserError as e:
            self._send_error(HTTPStatus.BAD_REQUEST, str(e))
            return
        except ServerClosedError as e:
            self._send_error(HTTPStatus.SERVICE_UNAVAILABLE, str(e))
            return
        except Exception as e:  # noqa: BLE001 - the client still gets an answer
            log.exception("request failed before it was queued")
            self._send_error(HTTPStatus.INTERNAL_SERVER_ERROR, _message(e))
            return
        if params.stream:
            self._stream(job)
        else:
            self._answer(job)

    def _answer(self, job: Job) -> None:
        while True:
            kind, value = job.events.get()
            if kind == "done":
                self._send_json(HTTPStatus.OK, result_json(value, self.server.app.model.tokenizer))
                return
            if kind == "error":
                self._send_exception(value)
                return

    def _stream(self, job: Job) -> None:
        # Headers wait for the first event so that a request the engine rejects still gets 400.
        kind, value = job.events.get()
        if kind == "error":
            self._send_exception(value)
            return
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        tokenizer = self.server.app.model.tokenizer
        text = TextStream(tokenizer)
        try:
            while True:
                if kind == "tokens":
                    self._event({"delta": text.push(value), "token_ids": value})
                elif kind == "done":
                    rest = text.flush()
                    if rest:
                        self._event({"delta": rest, "token_ids": []})
                    self._event({"done": True, **result_json(value, tokenizer)})
                    return
                else:
                    self._event({"error": _message(value)}, event="error")
                    return
                kind, value = job.events.get()
        except (BrokenPipeError, ConnectionResetError):
            log.info("client left during streaming; its batch runs to completion")

    def _event(self, data: Mapping[str, Any], event: str | None = None) -> None:
        head = f"event: {event}\n" if event else ""
        self.wfile.write(f"{head}data: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise RequestError("a JSON body with a Content-Length header is required")
        if int(length) > MAX_BODY_BYTES:
            raise _BodyTooLarge(f"body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(f"the body is not valid JSON: {e}") from None

    def _discard_body(self) -> None:
        length = self.headers.get("Content-Length", "")
        if length.isdigit() and int(length) <= MAX_BODY_BYTES:
            self.rfile.read(int(length))
        else:
            self.close_connection = True

    def _send_exception(self, e: BaseException) -> None:
        if isinstance(e, UserError):
            status = HTTPStatus.BAD_REQUEST
        elif isinstance(e, ServerClosedError):
            status = HTTPStatus.SERVICE_UNAVAILABLE
        else:
            status = HTTPStatus.INTERNAL_SERVER_ERROR
        self._send_error(status, _message(e))

    def _send_error(self, status: HTTPStatus, message: str) -> None:
        self._send_json(status, {"error": message})

    def _send_json(self, status: HTTPStatus, data: Mapping[str, Any]) -> None:
        body = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == HTTPStatus.METHOD_NOT_ALLOWED:
            self.send_header("Allow", "POST")
        self.end_headers()
        self.wfile.write(body)


class _BodyTooLarge(Exception):
    pass


def _message(e: BaseException) -> str:
    return str(e) or type(e).__name__


class DSparkServer:
    """The HTTP front end plus the device worker. Port 0 picks a free port (see `address`)."""

    def __init__(
        self,
        model: DecodingModels,
        cfg: ServerConfig = ServerConfig(),
        host: str = "127.0.0.1",
        port: int = 8000,
    ):
        self.model = model
        self.cfg = cfg
        self.worker = BatchWorker(model, cfg)
        self.httpd = _HTTPServer((host, port), _Handler)
        self.httpd.app = self
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def health(self) -> dict[str, Any]:
        ecfg = self.cfg.engine
        return {
            "status": "ok",
            "model": {
                **model_info(self.model),
                "speculative": self.model.drafter is not None,
                "stop_tokens": list(self.model.stop_tokens),
            },
            "limits": {
                "batch_size": self.cfg.batch_size,
                "max_len": ecfg.max_len,
                "max_new_tokens": ecfg.max_new_tokens,
                "batch_buckets": list(ecfg.batch_buckets),
            },
            "engines_cached": self.worker.engines_cached,
            "batches_run": self.worker.batches_run,
            "requests_run": self.worker.requests_run,
        }

    def serve_forever(self) -> None:
        """Serves on the calling thread until `shutdown` (another thread) or KeyboardInterrupt."""
        self.worker.start()
        self.httpd.serve_forever(poll_interval=0.1)

    def start(self) -> DSparkServer:
        """Serves on a background thread; returns at once."""
        self._thread = threading.Thread(target=self.serve_forever, name="dspark-http", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops accepting connections, lets the running batch finish and fails queued jobs."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout)
        self.httpd.server_close()
        self.worker.stop(timeout)
