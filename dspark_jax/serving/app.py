"""The OpenAI-compatible HTTP app (FastAPI) over one `EngineRunner`.

Endpoints: `GET /v1/models` and `GET /v1/models/{id}`, `POST /v1/completions`,
`POST /v1/chat/completions` (streaming as server-sent events in the OpenAI chunk format, ending
with `data: [DONE]`), `GET` or `HEAD /health` (503 until warm-up has compiled every program, and
again while draining), `GET /metrics` (Prometheus text), and vLLM's `POST /tokenize` and
`POST /detokenize` (the token ids a prompt or a conversation becomes, and back; no engine work)
and `GET /version`.

A request's path: the body is read with a size limit and a deadline (a body shorter than its
Content-Length gets 408 instead of holding the connection), validated by the strict schemas of
`protocol`, tokenized (chat through the target's template) off the event loop, and submitted to
the engine runner, which refuses at once what can never run (400) and what does not fit the
queue (503). The engine thread's events are moved onto the event loop; text is detokenized
incrementally and searched for stop strings there, and a matched stop string cancels the
request so its slot frees at once. A chat answer's text then goes through the server's
reasoning and tool-call parsers, if it runs them (`chat_output`). A streamed response sends its
headers with the first token, so a request refused or shed before it started still gets a
proper status code. A request for
several choices (`n`, or a completion's list of prompts) is one engine request per choice,
queued together or not at all; their pieces meet on one queue, from which the answer is built
(each choice's text in its place) or streamed (each chunk naming its choice's index).

A client that goes away cancels its request: a watcher per request waits for the ASGI
disconnect message. Draining (SIGTERM, Ctrl-C) refuses new requests, answers 503 to those that
have not produced a token yet, and lets the others finish until the drain deadline; then it
aborts them through the engine runner, so each still gets a whole answer: a 503 error object
(non-streaming) or a last chunk with finish reason "abort" and `data: [DONE]` (streaming).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import jinja2
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dspark_jax.config import read_config_json
from dspark_jax.decoding.batching import QueueFullError, Request, Tokens
from dspark_jax.decoding.engine import Engine, EngineError
from dspark_jax.errors import UserError
from dspark_jax.sampling import SamplingConfig
from dspark_jax.serving import protocol as api
from dspark_jax.serving.chat_output import (
    ChatOutput,
    Piece,
    forced_call_start,
    opens_reasoning,
)
from dspark_jax.serving.metrics import ServingMetrics
from dspark_jax.serving.runtime import EngineRunner, ServiceUnavailable
from dspark_jax.serving.text_stream import StopStrings, TextStream
from dspark_jax.tokenizer import (
    decode_all,
    encode_chat,
    encode_text,
    renders_tools,
    token_strings,
    without_length_limit,
)

log = logging.getLogger(__name__)

RequestBody = TypeVar("RequestBody", bound=BaseModel)


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    """Sampling used for fields a request leaves out: the model's generation_config.json when it
    names them (as vLLM does), else the OpenAI defaults."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # needs an engine with penalties unless 1

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> SamplingDefaults:
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return cls()
        gen = read_config_json(path)
        defaults = cls(
            temperature=float(gen.get("temperature", cls.temperature)),
            top_p=float(gen.get("top_p", cls.top_p)),
            top_k=max(int(gen.get("top_k", cls.top_k)), 0),
            min_p=float(gen.get("min_p", cls.min_p)),
            repetition_penalty=float(gen.get("repetition_penalty", cls.repetition_penalty)),
        )
        # Out-of-range values in the model's file are refused at start-up, not per request.
        SamplingConfig(
            defaults.temperature,
            defaults.top_k,
            defaults.top_p,
            defaults.min_p,
            repetition_penalty=defaults.repetition_penalty,
        )
        return defaults


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the HTTP layer needs to know about the model behind the engine."""

    name: str
    tokenizer: Any
    # Most prompt + completion tokens per request, as /v1/models advertises it: the engine's
    # max_model_len less the verification block it keeps beyond (`Engine.max_request_tokens`).
    max_model_len: int
    stop_tokens: tuple[int, ...]  # end-of-generation ids the engine stops at (unless ignore_eos)
    defaults: SamplingDefaults = SamplingDefaults()
    # How chat answers are parsed (`chat_output`): None, or one of REASONING_PARSERS /
    # TOOL_CALL_PARSERS.
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    # The target's vocabulary (its embedding rows), which /detokenize holds ids to; None: unchecked.
    vocab_size: int | None = None
    # The model the name serves, as given (a folder or a hub id), which /v1/models reports as
    # vLLM does; None: the name.
    root: str | None = None

    @classmethod
    def of_engine(
        cls,
        engine: Engine,
        name: str,
        tokenizer: Any,
        defaults: SamplingDefaults = SamplingDefaults(),
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
        root: str | None = None,
    ) -> ServedModel:
        if defaults.repetition_penalty != 1.0 and not engine.cfg.penalties:
            # Every request that leaves the field out would be refused.
            raise UserError(
                f"the model's default repetition_penalty {defaults.repetition_penalty:g} "
                "(generation_config.json) needs an engine with penalties "
                "(EngineConfig(penalties=True), `dspark-jax serve --penalties`)"
            )
        return cls(
            name,
            tokenizer,
            engine.max_request_tokens,
            engine.stop_tokens,
            defaults,
            reasoning_parser,
            tool_call_parser,
            engine.target_cfg.vocab_size,
            root,
        )


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = 8 * 1024 * 1024
    # Seconds a request body may take to arrive (its headers have their own deadline, see
    # http_server).
    read_timeout_s: float = 30.0


class ApiError(Exception):
    """Answered as an OpenAI error object with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.body = api.ErrorResponse(
            error=api.ErrorBody(message=message, type=kind, param=param, code=code)
        )
        self.headers = headers or {}


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body.model_dump(), status_code=error.status, headers=error.headers)


def _unavailable(message: str) -> ApiError:
    return ApiError(
        503, message, kind="service_unavailable", code="unavailable", headers={"Retry-After": "1"}
    )


# A client's own X-Request-Id: printable ASCII without spaces, as ids in logs and traces are.
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"[!-~]{1,256}")


def request_id(http: HttpRequest) -> str:
    """The request's id: its X-Request-Id header where it gives one (vLLM's), else a fresh
    one. The response's `id` is it behind "cmpl-" or "chatcmpl-", and the response carries it
    back in the same header, so a client or a proxy can follow one request across its logs."""
    given = http.headers.get(REQUEST_ID_HEADER)
    if given is None:
        return uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(given):
        raise ApiError(
            400,
            f"{REQUEST_ID_HEADER}: 1 to 256 printable ASCII characters without spaces, got "
            f"{given[:40]!r}",
        )
    return given


class _ClientGone(Exception):
    """The client disconnected; there is nobody to answer."""


# Status for the access log and metrics when the client left first (nginx's convention).
CLIENT_CLOSED = 499


class _Live:
    """One request in flight as the event loop sees it: the engine thread's events, moved onto
    the loop, plus interruptions (client gone, shed by a drain) that cut in ahead of them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, runner: EngineRunner):
        self.loop = loop
        self.runner = runner
        # (kind, payload, when the engine thread delivered it; None for interruptions)
        self.queue: asyncio.Queue[tuple[str, Any, float | None]] = asyncio.Queue()
        self.handle = None
        self.started = False  # a token has arrived
        self.arrived = 0  # tokens that arrived
        self.ended = False
        self.failed = False  # the engine failed

    def on_event(self, kind: str, payload: Any) -> None:
        """Called on the engine thread."""
        at = time.monotonic()
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            self.loop.call_soon_threadsafe(self._put, kind, payload, at)

    def _put(self, kind: str, payload: Any, at: float) -> None:
        if kind == "tokens":
            self.started = True
            self.arrived += len(payload)
        elif kind in ("done", "error"):
            self.ended = True
            self.failed = kind == "error"
        self.queue.put_nowait((kind, payload, at))

    def interrupt(self, kind: str) -> None:
        """Ends the request early: `kind` ("disconnected", "shed", "aborted") reaches the
        reader next."""
        self.queue.put_nowait((kind, None, None))
        self.cancel()

    def cancel(self) -> None:
        if not self.ended and self.handle is not None:
            self.ended = True
            self.runner.cancel(self.handle)


class _Choices:
    """The engine requests one HTTP request fans out to (`n` choices of each prompt), shed or
    aborted by a drain together: the request has started once any of its choices has."""

    def __init__(self, lives: list[_Live]):
        self.lives = lives

    @property
    def started(self) -> bool:
        return any(live.started for live in self.lives)

    def interrupt(self, kind: str) -> None:
        for live in self.lives:
            live.interrupt(kind)

    def cancel(self) -> None:
        for live in self.lives:
            live.cancel()


class _Generation:
    """Reads one request's events: text deltas cut at stop strings, token ids, finish reason.
    Times the tokens the answer keeps (inter-token latency)."""

    def __init__(
        self,
        live: _Live,
        tokenizer: Any,
        stop_strings,
        hidden_ids: frozenset[int],
        metrics: ServingMetrics,
        output: ChatOutput | None = None,
        min_tokens: int = 0,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ):
        self.live = live
        self.min_tokens = min_tokens  # stop strings count from the token that reaches it
        self.output = output  # a chat choice's parsers (reasoning, tool calls); None: plain text
        self.text = TextStream(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stops = StopStrings(stop_strings, include=include_stop)
        self.hidden_ids = hidden_ids  # stop token ids: they end the text, they are not text
        self.metrics = metrics
        self.token_ids: list[int] = []
        # One per token id, when asked: its log-probability and the alternatives asked for.
        self.token_scores: list[Score] = []
        self.text_offset = 0  # where the next token's text starts (completions' logprobs)
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # the engine's count, known when it is done
        self.prompt_scores: list[Score | None] = []  # echoed prompt tokens' (first: None)
        self.last_at: float | None = None  # when the previous tokens arrived

    async def next_piece(self) -> tuple[str, list[int], list[Score]] | None:
        """The next (text, token ids, their log-probabilities) piece, or None once finished.
        Raises ApiError when the engine failed or a drain shed the request, _ClientGone when the
        client left."""
        if self.finish_reason is not None:
            return None
        kind, payload, at = await self.live.queue.get()
        if kind == "tokens":
            if payload.prompt_logprobs is not None:
                self.prompt_scores = _prompt_scores(
                    payload.prompt_logprobs, payload.prompt_top_logprobs
                )
            text, kept = self._tokens(payload)
            if self.last_at is not None:  # the first token's wait is the time to first token
                self.metrics.observe_tokens(len(kept), (at - self.last_at) / len(payload))
            self.last_at = at
            scores = _scores(payload)[: len(kept)]
            self.token_scores += scores
            return text, kept, scores
        if kind == "done":
            text = self.stops.feed(self.text.flush())
            text += self.stops.finish()
            self.finish_reason = "stop" if self.stops.matched else payload.finish_reason
            self.cached_tokens = payload.cached_tokens
            if payload.prompt_logprobs is not None:
                self.prompt_scores = _prompt_scores(
                    payload.prompt_logprobs, payload.prompt_top_logprobs
                )
            return text, [], []
        if kind == "error":
            raise ApiError(500, str(payload), kind="server_error", code="engine_failed")
        if kind == "shed":
            raise _unavailable("the server is shutting down; this request did not start")
        if kind == "aborted":
            self.finish_reason = "abort"
            return None
        raise _ClientGone

    def _tokens(self, ids: list[int]) -> tuple[str, list[int]]:
        if not self.stops.active:
            self.token_ids += ids
            return self.text.push([t for t in ids if t not in self.hidden_ids]), ids
        # Token by token, so the answer ends with the token that completed the stop string (as
        # if generation had stopped there), not with the rest of its chunk.
        texts = []
        for n, token in enumerate(ids, 1):
            shown = [] if token in self.hidden_ids else [token]
            armed = len(self.token_ids) + n >= self.min_tokens
            texts.append(self.stops.feed(self.text.push(shown), armed))
            if self.stops.matched:
                self.finish_reason = "stop"
                self.live.cancel()
                ids = ids[:n]
                break
        self.token_ids += ids
        return "".join(texts), ids

    def parse(self, text: str) -> str | Piece:
        """What a piece of the answer's text adds to the message: the text itself, or its parts
        through the chat parsers."""
        return text if self.output is None else self.output.feed(text)

    def parse_end(self) -> str | Piece:
        """What the parsers still held when the answer ended."""
        return "" if self.output is None else self.output.finish()

    @property
    def reported_finish_reason(self) -> str | None:
        """The finish reason the client sees: "tool_calls" for an answer that called tools."""
        if self.output is None:
            return self.finish_reason
        return self.output.finish_reason(self.finish_reason)

    def outcome(self) -> tuple[str, int] | None:
        """(finish reason, generation tokens) as the metrics count this request: what its answer
        held, or "abort" and every token that arrived before it was cut short (client gone,
        shed or aborted by a drain); None when the engine failed."""
        if self.live.failed:
            return None
        if self.finish_reason in ("stop", "length"):
            return self.finish_reason, len(self.token_ids)
        return "abort", self.live.arrived


# A token's log-probability and the (token id, log-probability) alternatives asked for.
Score = tuple[float, list[tuple[int, float]]]


def _scores(tokens: Tokens) -> list[Score]:
    """The scores a tokens event carries (none when the request did not ask)."""
    if tokens.logprobs is None:
        return []
    alternatives = tokens.top_logprobs or [[] for _ in tokens.logprobs]
    return list(zip(tokens.logprobs, alternatives, strict=True))


def _prompt_scores(
    logprobs: list[float | None], alternatives: list[list[tuple[int, float]] | None] | None
) -> list[Score | None]:
    """The scores of a prompt's tokens (`Result.prompt_logprobs` and `prompt_top_logprobs`,
    None where the request asked for no alternatives); None for its first token."""
    alternatives = alternatives or [[]] * len(logprobs)
    return [
        None if lp is None else (lp, alts or [])
        for lp, alts in zip(logprobs, alternatives, strict=True)
    ]


def _usage(prompt_tokens: int, gens: list[_Generation], n: int) -> api.Usage:
    """Each prompt counted once, every choice's tokens (OpenAI's usage with n > 1); a prompt's
    cached tokens are those its first choice found in the prefix cache."""
    completion = sum(len(gen.token_ids) for gen in gens)
    return api.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=api.PromptTokensDetails(
            cached_tokens=sum(gen.cached_tokens for gen in gens[::n])
        ),
    )


async def _pump(index: int, gen: _Generation, merged: asyncio.Queue) -> None:
    """Moves choice `index`'s pieces onto its request's queue, then (index, None) when it has
    finished, or (index, the exception) when it ended otherwise."""
    try:
        while (piece := await gen.next_piece()) is not None:
            merged.put_nowait((index, piece))
    except Exception as e:  # noqa: BLE001 - raised again by whoever reads the queue
        merged.put_nowait((index, e))
        return
    merged.put_nowait((index, None))


async def _next_event(
    merged: asyncio.Queue,
) -> tuple[int, tuple[str, list[int], list[Score]] | None]:
    index, item = await merged.get()
    if isinstance(item, Exception):
        raise item
    return index, item


# -- response shapes ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Shape:
    """How one endpoint's results look: whole responses and stream chunks."""

    chat: bool
    id: str
    created: int
    model: str
    with_ids: bool
    # A token's text, when the request asked for log-probabilities; None: it did not.
    token_text: Callable[[int], str] | None = None
    # Completions' echo: each prompt's text and token ids, before its choices' answers.
    echo: list[tuple[str, list[int]]] | None = None
    n: int = 1
    # Log-probabilities name each token "token_id:<id>" (vLLM's return_tokens_as_token_ids),
    # not by its text; its bytes and text offsets stay its text's.
    ids_as_names: bool = False

    def _ids(self, ids: list[int]) -> list[int] | None:
        return ids if self.with_ids else None

    def _name(self, token: int) -> str:
        """How log-probabilities name a token: its text, or its id."""
        return f"token_id:{token}" if self.ids_as_names else self.token_text(token)

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        """A chat log-probability's token, its value and its text's UTF-8 bytes."""
        text = self.token_text(token)
        return dict(token=self._name(token), logprob=logprob, bytes=list(text.encode()))

    def logprobs(
        self, gen: _Generation, ids: list[int], scores: list[Score]
    ) -> api.CompletionLogprobs | api.ChatLogprobs | None:
        """The log-probabilities of a choice's tokens `ids`, in the endpoint's shape (None:
        not asked for). Every token the choice's `token_ids` holds has one, an end-of-turn
        token included, with the alternatives the request asked for."""
        if self.token_text is None:
            return None
        if self.chat:
            return api.ChatLogprobs(
                content=[
                    api.TokenLogprob(
                        **self._entry(token, lp),
                        top_logprobs=[api.TopLogprob(**self._entry(i, v)) for i, v in alternatives],
                    )
                    for token, (lp, alternatives) in zip(ids, scores, strict=True)
                ]
            )
        names = [self._name(t) for t in ids]
        return api.CompletionLogprobs(
            tokens=names,
            token_logprobs=[lp for lp, _ in scores],
            top_logprobs=[self._top(name, sc) for name, sc in zip(names, scores, strict=True)],
            text_offset=_offsets(gen, [self.token_text(t) for t in ids]),
        )

    def response(self, texts: list[str], gens: list[_Generation], usage: api.Usage) -> BaseModel:
        """The whole answer: one choice per generation, in index order."""
        choices = []
        for index, (text, gen) in enumerate(zip(texts, gens, strict=True)):
            if self.chat:
                gen.parse(text)
                gen.parse_end()
            ending = dict(
                index=index,
                finish_reason=gen.reported_finish_reason,
                token_ids=self._ids(gen.token_ids),
                logprobs=self.logprobs(gen, gen.token_ids, gen.token_scores),
            )
            if self.echo is not None:
                prompt_text, prompt_ids = self.echo[index // self.n]
                text = prompt_text + text
                ending["logprobs"] = self._echoed(gen, prompt_ids)
            choices.append(
                api.ChatChoice(message=_message(text, gen.output), **ending)
                if self.chat
                else api.CompletionChoice(text=text, **ending)
            )
        answer = api.ChatCompletion if self.chat else api.Completion
        return answer(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _echoed(self, gen: _Generation, prompt_ids: list[int]) -> api.CompletionLogprobs | None:
        """An echoed choice's log-probabilities: its prompt's tokens (the first has none), then
        its answer's, the text offsets running over both."""
        if self.token_text is None:
            return None
        prompt = self._prompt_logprobs(gen, prompt_ids)
        answer = self.logprobs(gen, gen.token_ids, gen.token_scores)
        return api.CompletionLogprobs(
            tokens=prompt.tokens + answer.tokens,
            token_logprobs=prompt.token_logprobs + answer.token_logprobs,
            top_logprobs=prompt.top_logprobs + answer.top_logprobs,
            text_offset=prompt.text_offset + answer.text_offset,
        )

    def _prompt_logprobs(self, gen: _Generation, prompt_ids: list[int]) -> api.CompletionLogprobs:
        """The log-probabilities of an echoed prompt's tokens (the first has none), their text
        offsets from 0, where the choice's text starts; the answer's run on from there."""
        gen.text_offset = 0
        names = [self._name(t) for t in prompt_ids]
        return api.CompletionLogprobs(
            tokens=names,
            token_logprobs=[None if sc is None else sc[0] for sc in gen.prompt_scores],
            top_logprobs=[
                self._top(name, score) for name, score in zip(names, gen.prompt_scores, strict=True)
            ],
            text_offset=_offsets(gen, [self.token_text(t) for t in prompt_ids]),
        )

    def echo_chunk(self, index: int, gen: _Generation) -> BaseModel | None:
        """A streamed completion's first chunk of choice `index` when it echoes: its prompt, and
        with logprobs the prompt tokens' (they come with the choice's first tokens), its text
        offsets from 0; None without echo."""
        if self.echo is None:
            return None
        prompt_text, prompt_ids = self.echo[index // self.n]
        logprobs = None
        # (Unknown only for a choice that ended before its first token: aborted by a drain.)
        if self.token_text is not None and len(gen.prompt_scores) == len(prompt_ids):
            logprobs = self._prompt_logprobs(gen, prompt_ids)
        return self.chunk(index, prompt_text, [], logprobs=logprobs)

    def _top(self, name: str, score: Score | None) -> dict[str, float] | None:
        """A legacy `top_logprobs` entry: the alternatives asked for and the token itself (as
        vLLM gives them); None for a token without a log-probability (an echoed first)."""
        if score is None:
            return None
        return {**{self._name(i): v for i, v in score[1]}, name: score[0]}

    def opening(self, index: int) -> BaseModel | None:
        """A chat stream's first chunk of each choice announces the assistant role."""
        if not self.chat:
            return None
        return self._chat_chunk(
            api.ChatChunkChoice(index=index, delta=api.ChatDelta(role="assistant"))
        )

    def chunk(
        self,
        index: int,
        text: str | Piece,
        ids: list[int],
        finish_reason: str | None = None,
        logprobs: api.CompletionLogprobs | api.ChatLogprobs | None = None,
    ) -> BaseModel:
        if self.chat:
            ending = finish_reason is not None and not text
            delta = api.ChatDelta() if ending else _delta(text)
            return self._chat_chunk(
                api.ChatChunkChoice(
                    index=index,
                    delta=delta,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    token_ids=self._ids(ids),
                )
            )
        return api.Completion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[
                api.CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    token_ids=self._ids(ids),
                )
            ],
        )

    def usage_chunk(self, usage: api.Usage) -> BaseModel:
        if self.chat:
            return api.ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, choices=[], usage=usage
            )
        return api.Completion(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def _chat_chunk(self, choice: api.ChatChunkChoice) -> api.ChatCompletionChunk:
        return api.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        )

    def dump(self, model: BaseModel) -> dict[str, Any]:
        exclude = None if self.with_ids else {"choices": {"__all__": {"token_ids"}}}
        return model.model_dump(mode="json", exclude=exclude)


def _offsets(gen: _Generation, texts: list[str]) -> list[int]:
    """Where each of `texts` starts in the choice's text, from `gen.text_offset` on (advanced
    past them)."""
    offsets = []
    for text in texts:
        offsets.append(gen.text_offset)
        gen.text_offset += len(text)
    return offsets


def _message(text: str, output: ChatOutput | None) -> api.AssistantMessage:
    """A whole chat answer: its text, or the parts its parsers found."""
    if output is None:
        return api.AssistantMessage(content=text)
    parts = output.parts()
    calls = [
        api.ToolCallOut(id=c.id, function=api.FunctionCall(name=c.name, arguments=c.arguments))
        for c in parts.calls
    ]
    return api.AssistantMessage(
        content=parts.content, reasoning=parts.reasoning, tool_calls=calls or None
    )


def _delta(part: str | Piece) -> api.ChatDelta:
    """A streamed chat delta: text, or the parts a piece of it added."""
    if isinstance(part, str):
        return api.ChatDelta(content=part)
    calls = [
        api.ToolCallDelta(
            index=part.first_call + k,
            id=c.id,
            function=api.FunctionCall(name=c.name, arguments=c.arguments),
        )
        for k, c in enumerate(part.calls)
    ]
    return api.ChatDelta(
        content=part.content or None, reasoning=part.reasoning or None, tool_calls=calls or None
    )


def _sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def _validation_message(error: ValidationError, body: bytes) -> tuple[str, str | None]:
    """The errors as one line, each after the place in the body it concerns
    (`messages.0.content`), and the first such place as the error's param."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = None
    parts, param = [], None
    for e in error.errors(include_url=False):
        loc = _body_path(data, e["loc"])
        param = param or (loc or None)
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "json_invalid" and data is not None and "escape" in msg:
            # Python's json module took it, pydantic's strict parser did not: a string escapes
            # half of a UTF-16 surrogate pair (json.dumps writes "\ud800" for a lone surrogate).
            msg = (
                f"{msg}: a string in the body escapes an unpaired UTF-16 surrogate "
                "(\\ud800-\\udfff without its partner), which is no Unicode text"
            )
        part = f"{loc}: {msg}" if loc else msg
        if part not in parts:
            parts.append(part)
    return "; ".join(parts), param


def _body_path(data: Any, loc: tuple[str | int, ...]) -> str:
    """`loc` without what is not a place in the body: pydantic puts the tag of the union member
    it tried among the field names (`stop.array.1`)."""
    if data is None:
        return ".".join(str(key) for key in loc)
    node, path = data, []
    for key in loc:
        if isinstance(node, dict):  # an absent field (missing, or its default refused) too
            node = node.get(key)
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            continue
        path.append(str(key))
    return ".".join(path)


def _param_of(req: api.GenerationRequest, field: str | None) -> str | None:
    """The body parameter that carried the engine `Request` field an EngineError names."""
    if field == "prompt_ids":
        return "messages" if isinstance(req, api.ChatCompletionRequest) else "prompt"
    if field == "max_new_tokens":
        return req.token_limit_param
    names = (
        "stop_token_ids",
        "seed",
        "cache_salt",
        "logit_bias",
        "allowed_token_ids",
        "min_tokens",
        "priority",
    )
    return field if field in names else None


class OpenAIServer:
    """The request handlers and the drain; `create_app` puts them behind FastAPI."""

    def __init__(
        self,
        runner: EngineRunner,
        model: ServedModel,
        metrics: ServingMetrics,
        limits: HttpLimits = HttpLimits(),
        priority_scheduling: bool = False,
    ):
        self.runner = runner
        self.model = model
        self.metrics = metrics
        self.limits = limits
        # Requests' priority orders the queue (`--scheduling-policy priority`); else only 0.
        self.priority_scheduling = priority_scheduling
        self.loop: asyncio.AbstractEventLoop | None = None
        self.live: set[_Choices] = set()
        self.draining = False
        self.created = int(time.time())
        metrics.ready.set_function(lambda: float(self.status == "ok"))
        # Prompts are measured against max_model_len here (a 400 for one that cannot fit), also
        # with a tokenizer that did not come from `load_tokenizer`.
        without_length_limit(model.tokenizer)
        # A token's own text, as log-probabilities name it (special tokens by their names).
        self.token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda token: model.tokenizer.decode([token])
        )

    # -- life cycle ------------------------------------------------------------------------------
    def drain(self, deadline_s: float | None = None) -> None:
        """(On the event loop.) Refuses new requests, sheds those that have not started and,
        `deadline_s` later, aborts those still running (None: lets them finish)."""
        self.draining = True
        self.runner.close()
        for choices in list(self.live):
            if not choices.started:
                choices.interrupt("shed")
        if deadline_s is not None and self.loop is not None:
            self.loop.call_later(deadline_s, self.abort_running)

    def abort_running(self) -> None:
        """(On the event loop.) Ends every request in flight now, each with a whole answer; the
        engine runner frees their slots."""
        for choices in list(self.live):
            choices.interrupt("aborted" if choices.started else "shed")

    def request_drain(self, deadline_s: float | None = None) -> None:
        """`drain` from any thread (or a signal handler)."""
        self._call_soon(self.drain, deadline_s)

    def request_abort(self) -> None:
        """`abort_running` from any thread (or a signal handler)."""
        self._call_soon(self.abort_running)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        if self.loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing runs
                self.loop.call_soon_threadsafe(fn, *args)

    @property
    def status(self) -> str:
        return "draining" if self.draining else self.runner.status

    def health(self) -> tuple[int, dict[str, Any]]:
        status = self.status
        body = {"status": status, "model": self.model.name}
        if self.runner.warmup_s is not None:
            body["warmup_s"] = round(self.runner.warmup_s, 3)
        return (200 if status == "ok" else 503), body

    def models(self) -> api.ModelList:
        return api.ModelList(data=[self.model_card(self.model.name)])

    def model_card(self, name: str) -> api.ModelCard:
        if name != self.model.name:
            raise self._unknown_model(name)
        return api.ModelCard(
            id=self.model.name,
            created=self.created,
            root=self.model.root or self.model.name,
            max_model_len=self.model.max_model_len,
        )

    def _unknown_model(self, name: str) -> ApiError:
        return ApiError(
            404,
            f"the model {name!r} does not exist; this server serves {self.model.name!r}",
            param="model",
            code="model_not_found",
        )

    # -- requests ------------------------------------------------------------------------------
    async def read_body(self, request: HttpRequest) -> bytes:
        limit = self.limits.max_body_bytes
        # The HTTP layer has already refused a malformed Content-Length.
        length = request.headers.get("content-length")
        if length is not None and int(length) > limit:
            raise _too_large(int(length), limit)
        body = bytearray()
        try:
            async with asyncio.timeout(self.limits.read_timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        raise _too_large(len(body), limit)
        except TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {self.limits.read_timeout_s:g} s "
                f"({len(body)} of {length or 'unknown'} bytes received)",
                kind="timeout",
                headers=_CLOSE,
            ) from None
        except ClientDisconnect:
            raise _ClientGone from None
        return bytes(body)

    def parse(self, schema: type[RequestBody], body: bytes) -> RequestBody:
        if not body:
            raise ApiError(400, "a JSON body is required")
        try:
            req = schema.model_validate_json(body)
        except ValidationError as e:
            message, param = _validation_message(e, body)
            raise ApiError(400, message, param=param) from None
        if req.model is not None and req.model != self.model.name:
            raise self._unknown_model(req.model)
        return req

    async def encode_prompts(self, req: api.GenerationRequest) -> list[list[int]]:
        """The token ids of each prompt: the messages rendered with the chat template, or each
        of a completion's prompts."""
        tokenizer = self.model.tokenizer
        if isinstance(req, api.ChatCompletionRequest):
            tools = None
            if req.calls_tools:
                self._check_tools()
                tools = req.tools
            ids = await self._render_chat(req, tools)
            if req.calls_tools and req.forced_call is not None:
                # The call's start, written for the model: it goes on with the rest of it.
                start = forced_call_start(req.forced_call or None)
                ids += await run_in_threadpool(encode_text, tokenizer, start, False)
            return [ids]
        return [
            await run_in_threadpool(encode_text, tokenizer, prompt, req.add_special_tokens)
            if isinstance(prompt, str)
            else list(prompt)
            for prompt in req.prompts
        ]

    async def _render_chat(
        self,
        req: api.ChatCompletionRequest | api.TokenizeChatRequest,
        tools: list[api.Tool] | None,
    ) -> list[int]:
        """The token ids of a request's messages rendered with the chat template (off the event
        loop)."""
        template_messages = [m.template_message() for m in req.messages]
        tool_specs = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None

        def render() -> list[int]:
            return encode_chat(
                self.model.tokenizer,
                template_messages,
                add_generation_prompt=req.generation_prompt,
                enable_thinking=req.enable_thinking,
                tools=tool_specs,
                continue_final_message=req.continue_final_message,
            )

        try:
            return await run_in_threadpool(render)
        except (UserError, jinja2.TemplateError) as e:
            raise ApiError(400, f"the chat template refused the messages: {e}") from None

    # -- token counting (vLLM's /tokenize and /detokenize) -------------------------------------
    def parse_tokenize(
        self, body: bytes
    ) -> api.TokenizeCompletionRequest | api.TokenizeChatRequest:
        """A /tokenize body: the chat form when it carries `messages`, else the prompt form
        (vLLM's two), so that an error speaks of one form's fields."""
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            data = None  # `parse` words what is wrong with it
        chat = isinstance(data, dict) and "messages" in data
        return self.parse(api.TokenizeChatRequest if chat else api.TokenizeCompletionRequest, body)

    async def tokenize(
        self, req: api.TokenizeCompletionRequest | api.TokenizeChatRequest
    ) -> api.TokenizeResponse:
        """The token ids the model would be given for a prompt or a conversation (and their
        names), with the context they are measured against. Needs no engine: it answers during
        warm-up too."""
        tokenizer = self.model.tokenizer
        if isinstance(req, api.TokenizeChatRequest):
            if req.tools:
                self._check_template_renders_tools()
            ids = await self._render_chat(req, req.tools)
        else:
            ids = await run_in_threadpool(
                encode_text, tokenizer, req.prompt, req.add_special_tokens
            )
        return api.TokenizeResponse(
            count=len(ids),
            max_model_len=self.model.max_model_len,
            tokens=ids,
            token_strs=token_strings(tokenizer, ids) if req.return_token_strs else None,
        )

    async def detokenize(self, req: api.DetokenizeRequest) -> api.DetokenizeResponse:
        """The text of token ids, special tokens written out: /tokenize's inverse."""
        vocab = self.model.vocab_size
        if vocab is not None:
            for index, token in enumerate(req.tokens):
                if token >= vocab:
                    raise ApiError(
                        400,
                        f"token {token} is outside the vocabulary (0..{vocab - 1})",
                        param=f"tokens.{index}",
                    )
        text = await run_in_threadpool(decode_all, self.model.tokenizer, req.tokens)
        return api.DetokenizeResponse(prompt=text)

    def _check_tools(self) -> None:
        """Raises ApiError unless this server can offer tools to the model and read its calls."""
        if self.model.tool_call_parser is None:
            raise ApiError(
                400,
                "this server parses no tool calls: start it with --tool-call-parser hermes "
                '(Qwen3\'s format), or send tool_choice "none"',
                param="tools",
            )
        self._check_template_renders_tools()

    def _check_template_renders_tools(self) -> None:
        """Raises ApiError unless the chat template shows the model the tools it is given."""
        if not renders_tools(self.model.tokenizer):
            raise ApiError(
                400,
                f"the chat template of {self.model.name} does not render tools",
                param="tools",
            )

    def chat_output(self, req: api.GenerationRequest, prompt: list[int]) -> ChatOutput | None:
        """The parsers a chat choice's text goes through (None: a completion, or none on)."""
        if not isinstance(req, api.ChatCompletionRequest):
            return None
        reasoning = self.model.reasoning_parser is not None
        if not (reasoning or req.calls_tools):
            return None
        # The prompt's last tokens say whether the template opened the think block itself, or
        # the continued final message did (its tokens are at most its UTF-8 bytes).
        window = 16
        if req.continue_final_message:
            window += len(req.messages[-1].text().encode())
        tail = self.model.tokenizer.decode(prompt[-window:]) if reasoning else ""
        forced = req.forced_call if req.calls_tools else None
        output = ChatOutput(
            reasoning=reasoning,
            # A forced call's start ends the prompt: the answer begins inside its block.
            open_at_start=forced is None and opens_reasoning(tail),
            tools=req.calls_tools,
            # A named function is called once, as OpenAI's forced call.
            single_call=req.parallel_tool_calls is False or bool(forced),
        )
        if forced is not None:
            output.feed(forced_call_start(forced or None))  # held: the block is not closed
        return output

    def engine_requests(
        self, req: api.GenerationRequest, prompts: list[list[int]]
    ) -> list[Request]:
        """One engine request per choice: choice i * n + j is the j-th of prompt i (OpenAI's
        order). With a seed s, choice j draws with seed s + j (as vLLM's): the choices of a
        prompt differ, and each is what a request of that prompt and seed alone gets. Raises
        ApiError for a prompt that does not fit (`check_choices` has counted them before)."""
        several = len(prompts) > 1
        limits = [
            self.token_limit(req, len(ids), index if several else None)
            for index, ids in enumerate(prompts)
        ]
        least = min(limits)
        if req.min_tokens > least:
            limit = (
                f"the {least} tokens this request may generate (give {req.token_limit_param})"
                if req.token_limit is None
                else f"{req.token_limit_param} {req.token_limit}"
            )
            raise ApiError(
                400, f"min_tokens: {req.min_tokens} is more than {limit}", param="min_tokens"
            )
        defaults = self.model.defaults
        top_k = defaults.top_k if req.top_k is None else max(req.top_k, 0)  # -1 means off
        repetition = (
            defaults.repetition_penalty
            if req.repetition_penalty is None
            else req.repetition_penalty
        )
        for name, off in (
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
            ("repetition_penalty", 1.0),
        ):
            value = getattr(req, name)
            if value is not None and value != off and not self.runner.engine.cfg.penalties:
                raise ApiError(
                    400,
                    f"{name}: a penalty needs a server started with --penalties, which "
                    f"counts each request's tokens on the device (this one takes only {off:g})",
                    param=name,
                )
        if req.priority and not self.priority_scheduling:
            raise ApiError(
                400,
                "priority: needs a server started with --scheduling-policy priority (this one "
                "serves first come, first served and takes only 0)",
                param="priority",
            )
        bias = req.logit_bias or {}
        if bias and not self.runner.engine.cfg.max_logit_bias:
            raise ApiError(
                400,
                "logit_bias: needs a server started with --max-logit-bias N, which holds each "
                "request's biases on the device (this one takes only {})",
                param="logit_bias",
            )
        if req.allowed_token_ids and not self.runner.engine.cfg.max_logit_bias:
            raise ApiError(
                400,
                "allowed_token_ids: needs a server started with --max-logit-bias N, which holds "
                "up to N allowed tokens of each request on the device",
                param="allowed_token_ids",
            )
        sampling = SamplingConfig(
            temperature=defaults.temperature if req.temperature is None else req.temperature,
            top_k=top_k,
            top_p=defaults.top_p if req.top_p is None else req.top_p,
            min_p=defaults.min_p if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=repetition,
            logit_bias={int(token): value for token, value in bias.items()},
            allowed_token_ids=tuple(req.allowed_token_ids or ()),
        )
        return [
            Request(
                prompt_ids=ids,
                max_new_tokens=limit,
                # None: Batcher.submit draws a fresh one for each choice
                seed=None if req.seed is None else (req.seed + j) % 2**32,
                sampling=sampling,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
                cache_salt=req.cache_salt,
                priority=req.priority,
                logprobs=req.wants_logprobs,
                top_logprobs=req.alternatives,
                prompt_logprobs=req.prompt_logprobs,
            )
            for ids, limit in zip(prompts, limits, strict=True)
            for j in range(req.n)
        ]

    def truncate(self, req: api.GenerationRequest, prompts: list[list[int]]) -> list[list[int]]:
        """Each prompt's last `truncate_prompt_tokens` tokens (vLLM's: -1 keeps max_model_len of
        them); a 400 for more than max_model_len."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            return prompts
        context = self.model.max_model_len
        if keep > context:
            raise ApiError(
                400,
                f"truncate_prompt_tokens {keep} is more than max_model_len {context}",
                param="truncate_prompt_tokens",
            )
        keep = context if keep == -1 else keep
        return [ids[-keep:] for ids in prompts]

    def _echo(
        self, req: api.GenerationRequest, prompts: list[list[int]]
    ) -> list[tuple[str, list[int]]] | None:
        """Each prompt's text (as sent, or its ids decoded: always where it may have been
        truncated) and ids, for a completion's echo."""
        if not req.echoes:
            return None
        return [
            (
                given
                if isinstance(given, str) and req.truncate_prompt_tokens is None
                else self.model.tokenizer.decode(ids),
                ids,
            )
            for given, ids in zip(req.prompts, prompts, strict=True)
        ]

    def check_choices(self, req: api.GenerationRequest, prompts: int) -> None:
        """Raises ApiError for more choices than the server can ever hold at once (its slots
        and its queue): a 400, since waiting would not help."""
        count = prompts * req.n
        slots, waiting = self.runner.engine.cfg.num_slots, self.runner.max_waiting
        if count > slots + waiting:
            asked = f"{prompts} prompts x n {req.n}" if prompts > 1 else f"n {req.n}"
            raise ApiError(
                400,
                f"{count} choices ({asked}) are more than this server holds at once: "
                f"{slots + waiting} ({slots} slots and a queue of {waiting}, --max-waiting)",
                param="n" if req.n > 1 else "prompt",
            )

    def submit(self, req: api.GenerationRequest, requests: list[Request]) -> _Choices:
        """Queues every choice, or none: a refusal cancels those already queued."""
        loop = asyncio.get_running_loop()
        lives: list[_Live] = []
        try:
            for engine_req in requests:
                live = _Live(loop, self.runner)
                live.handle = self.runner.submit(engine_req, live.on_event)
                lives.append(live)
        except (QueueFullError, EngineError, ServiceUnavailable) as e:
            _Choices(lives).cancel()
            if isinstance(e, QueueFullError):
                raise _unavailable(f"the queue is full: {e}") from None
            if isinstance(e, ServiceUnavailable):
                raise _unavailable(str(e)) from None
            param = _param_of(req, e.field)
            if param == "prompt" and len(requests) > req.n:  # several prompts: which one
                param = f"prompt.{len(lives) // req.n}"
            raise ApiError(400, str(e), param=param) from None
        return _Choices(lives)

    def token_limit(
        self, req: api.GenerationRequest, prompt_len: int, index: int | None = None
    ) -> int:
        """The request's max new tokens; when it names none, its endpoint's default (16 for
        completions, as OpenAI's and vLLM's) within what the context leaves, or all of that (chat,
        as vLLM). Raises ApiError (context_length_exceeded) when prompt + answer cannot fit;
        `index` names the prompt among several."""
        context = self.model.max_model_len
        limit = req.token_limit
        prompt = _param_of(req, "prompt_ids")
        owner = "the messages'" if prompt == "messages" else "the prompt's"
        if index is not None:
            prompt, owner = f"prompt.{index}", f"prompt {index}'s"
        if prompt_len >= context:
            raise ApiError(
                400,
                f"{owner} {prompt_len} tokens leave no room to generate within "
                f"max_model_len {context}",
                param=prompt,
                code="context_length_exceeded",
            )
        if limit is None:
            default = req.default_token_limit
            room = context - prompt_len
            return room if default is None else min(default, room)
        if prompt_len + limit > context:
            raise ApiError(
                400,
                f"{owner} {prompt_len} tokens plus {req.token_limit_param} {limit} make "
                f"{prompt_len + limit}, over max_model_len {context}",
                param=req.token_limit_param,
                code="context_length_exceeded",
            )
        return limit

    async def generate(self, http: HttpRequest, req: api.GenerationRequest, chat: bool) -> Response:
        arrived = time.monotonic()
        rid = request_id(http)
        if req.request_id is not None:  # the body's (vLLM's field) over the header's
            rid = req.request_id
        if self.draining:
            raise _unavailable("the server is shutting down")
        # Before tokenizing: a request for more choices than can ever run costs nothing.
        self.check_choices(req, len(req.prompts) if isinstance(req, api.CompletionRequest) else 1)
        prompts = self.truncate(req, await self.encode_prompts(req))
        choices = self.submit(req, self.engine_requests(req, prompts))
        self.live.add(choices)
        # Stop tokens end the text without text of their own, unless the request keeps what
        # stopped it (EOS is a special token: it shows only where they are not skipped either).
        hidden = frozenset(req.stop_token_ids or ()) | (
            frozenset() if req.ignore_eos else frozenset(self.model.stop_tokens)
        )
        if req.include_stop_str_in_output:
            hidden = frozenset()
        gens = [
            _Generation(
                live,
                self.model.tokenizer,
                req.stop_strings,
                hidden,
                self.metrics,
                self.chat_output(req, prompts[index // req.n]),
                req.min_tokens,
                req.include_stop_str_in_output,
                req.skip_special_tokens,
            )
            for index, live in enumerate(choices.lives)
        ]
        prompt_lens = [len(ids) for ids in prompts]
        # Every choice's pieces, as they come: (choice index, piece; None once it has finished).
        merged: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(_pump(i, gen, merged)) for i, gen in enumerate(gens)]
        finished = False

        def finish() -> None:
            # Idempotent: called by whichever ends the request first (the response, or the
            # watcher when a streamed response was cancelled before its body ever started).
            nonlocal finished
            if finished:
                return
            finished = True
            watcher.cancel()
            for pump in pumps:
                pump.cancel()
            choices.cancel()
            self.live.discard(choices)
            self.metrics.e2e.observe(time.monotonic() - arrived)
            for index, gen in enumerate(gens):
                outcome = gen.outcome()
                if outcome is not None:
                    prompt_len = prompt_lens[index // req.n]
                    self.metrics.observe_request(outcome[0], prompt_len, outcome[1])

        watcher = asyncio.create_task(self._watch_disconnect(http, choices, finish))

        prefix = "chatcmpl" if chat else "cmpl"
        shape = _Shape(
            chat,
            f"{prefix}-{rid}",
            int(time.time()),
            self.model.name,
            req.return_token_ids,
            self.token_text if req.wants_logprobs else None,
            self._echo(req, prompts),
            req.n,
            req.return_tokens_as_token_ids,
        )

        def usage() -> api.Usage:
            return _usage(sum(prompt_lens), gens, req.n)

        if not req.stream:
            try:
                response = await self._whole(gens, merged, shape, usage)
            finally:
                finish()
            response.headers[REQUEST_ID_HEADER] = rid
            return response
        try:
            first = await _next_event(merged)
        except _ClientGone:
            finish()
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            finish()
            raise
        return StreamingResponse(
            self._stream(
                gens, merged, shape, first, req.include_usage, req.continuous_usage, usage, finish
            ),
            media_type="text/event-stream",
            headers={
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                REQUEST_ID_HEADER: rid,
            },
        )

    async def _whole(
        self,
        gens: list[_Generation],
        merged: asyncio.Queue,
        shape: _Shape,
        usage: Callable[[], api.Usage],
    ) -> Response:
        texts: list[list[str]] = [[] for _ in gens]
        ended = 0
        try:
            while ended < len(gens):
                index, piece = await _next_event(merged)
                if piece is None:
                    ended += 1
                else:
                    texts[index].append(piece[0])
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        if any(gen.finish_reason == "abort" for gen in gens):
            raise _unavailable("the server shut down before this request finished")
        body = shape.response(["".join(t) for t in texts], gens, usage())
        return JSONResponse(shape.dump(body))

    async def _stream(
        self,
        gens: list[_Generation],
        merged: asyncio.Queue,
        shape: _Shape,
        first: tuple[int, tuple[str, list[int], list[Score]] | None],
        include_usage: bool,
        continuous_usage: bool,
        usage: Callable[[], api.Usage],
        finish: Callable[[], None],
    ) -> AsyncIterator[bytes]:
        """Each choice's chunks as they come, each naming its choice's index; every choice ends
        with a chunk holding its finish reason, the stream with the usage (if asked) and
        [DONE]. With `continuous_usage` every chunk also carries the usage so far: the tokens
        of the pieces sent up to it, every choice's."""
        sent = 0

        def event_bytes(chunk: api.Completion | api.ChatCompletionChunk) -> bytes:
            if continuous_usage:
                whole = usage()
                chunk.usage = whole.model_copy(
                    update={
                        "completion_tokens": sent,
                        "total_tokens": whole.prompt_tokens + sent,
                    }
                )
            return _sse(shape.dump(chunk))

        try:
            for index in range(len(gens)):
                opening = shape.opening(index)
                if opening is not None:
                    yield event_bytes(opening)
            event, ended, echoed = first, 0, set()
            while True:
                index, piece = event
                gen = gens[index]
                if index not in echoed:  # a choice's first event: its prompt first, if echoed
                    echoed.add(index)
                    echo = shape.echo_chunk(index, gen)
                    if echo is not None:
                        yield event_bytes(echo)
                if piece is not None:
                    text, ids, scores = piece
                    sent += len(ids)
                    part = gen.parse(text)
                    if part or (ids and (shape.with_ids or shape.token_text is not None)):
                        logprobs = shape.logprobs(gen, ids, scores)
                        yield event_bytes(shape.chunk(index, part, ids, logprobs=logprobs))
                else:
                    ended += 1
                    if ended == len(gens):
                        finish()  # the request is over (and counted) before its client hears so
                    part = gen.parse_end()
                    if part:
                        yield event_bytes(shape.chunk(index, part, []))
                    reason = gen.reported_finish_reason
                    yield event_bytes(shape.chunk(index, "", [], reason))
                    if ended == len(gens):
                        break
                event = await _next_event(merged)
            if include_usage:
                yield _sse(shape.dump(shape.usage_chunk(usage())))
            yield _sse("[DONE]")
        except ApiError as e:
            yield _sse(e.body.model_dump())
            yield _sse("[DONE]")
        except _ClientGone:
            return
        finally:
            finish()

    @staticmethod
    async def _watch_disconnect(
        http: HttpRequest, choices: _Choices, finish: Callable[[], None]
    ) -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass
        choices.interrupt("disconnected")
        finish()


_CLOSE = {"Connection": "close"}


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the body of {size} bytes exceeds the limit of {limit}", headers=_CLOSE)


class _CountStatus:
    """ASGI wrapper counting responses by status code (outermost, so errors count too)."""

    def __init__(self, app, metrics: ServingMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        answered = False

        async def counting_send(message):
            nonlocal answered
            if message["type"] == "http.response.start":
                answered = True
                self.metrics.http_responses.labels(str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            if not answered:
                self.metrics.http_responses.labels(str(CLIENT_CLOSED)).inc()


class _ConnectionLimit:
    """ASGI wrapper answering a request that arrives while more than `limit` connections are
    open with an OpenAI 503 (Retry-After, Connection: close). uvicorn's own limit_concurrency
    answers text/plain with no Retry-After, before the app (or its response counter) sees it.

    `/health` and `/metrics` are answered past the limit: they cost next to nothing, and a
    liveness probe or a Prometheus scrape that failed whenever the server is saturated would
    restart a busy server or leave a gap exactly where the overload shows."""

    EXEMPT = frozenset({"/health", "/metrics"})

    def __init__(self, app, limit: int, open_connections: Callable[[], int]):
        self.app = app
        self.limit = limit
        self.open_connections = open_connections

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and scope["path"] not in self.EXEMPT
            and (count := self.open_connections()) > self.limit
        ):
            error = _unavailable(
                f"the server has {count} connections open (--max-connections {self.limit})"
            )
            error.headers.update(_CLOSE)
            return await _error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


class _ApiKey:
    """ASGI wrapper refusing a request that does not carry `Authorization: Bearer <key>` with a
    401 (OpenAI's invalid_api_key error, `WWW-Authenticate: Bearer`), before anything reads its
    body. `/health` and `/metrics` need no key: probes and scrapers send none (keep them behind
    the network's own controls). The key is compared in constant time and never echoed."""

    EXEMPT = _ConnectionLimit.EXEMPT

    def __init__(self, app, key: str):
        if not key or key != key.strip() or not key.isascii():
            raise ValueError("an API key is non-empty ASCII without spaces at either end")
        self.app = app
        self.key = key.encode()

    def _authorized(self, headers) -> bool | None:
        """True for the key, False for another, None for no bearer credentials at all."""
        given = next((value for name, value in headers if name == b"authorization"), None)
        scheme, _, token = (given or b"").strip().partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return None
        return hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.EXEMPT:
            authorized = self._authorized(scope["headers"])
            if not authorized:
                message = (
                    "the API key is not valid"
                    if authorized is False
                    else "an API key is required: send it as the header "
                    "'Authorization: Bearer <key>' (OpenAI clients do, from their api_key)"
                )
                error = ApiError(
                    401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
                )
                return await _error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(
    server: OpenAIServer,
    max_connections: int | None = None,
    open_connections: Callable[[], int] = lambda: 0,
    api_key: str | None = None,
):
    """The ASGI app: FastAPI routes over `server`, behind the connection limit (None: none;
    `open_connections` counts them, the request's own included) and, given `api_key`, the key
    check, wrapped to count response codes."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        server.loop = asyncio.get_running_loop()
        yield

    app = FastAPI(
        title="dspark-jax", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )

    @app.exception_handler(ApiError)
    async def api_error(_request, error: ApiError):
        return _error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error_response(
            ApiError(error.status_code, str(error.detail), kind=kind, headers=error.headers)
        )

    @app.exception_handler(Exception)
    async def internal_error(_request, error: Exception):
        log.error("request failed", exc_info=error)
        return _error_response(
            ApiError(500, f"internal error: {type(error).__name__}", kind="server_error")
        )

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        status, body = server.health()
        # Like every 503 of this server: a probe or client waiting for warm-up knows when.
        headers = {"Retry-After": "1"} if status == 503 else None
        return JSONResponse(body, status_code=status, headers=headers)

    @app.get("/version")
    async def version():
        from dspark_jax import __version__

        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return JSONResponse(server.models().model_dump(mode="json"))

    @app.get("/v1/models/{name:path}")  # a served name may hold slashes (org/model)
    async def model(name: str):
        return JSONResponse(server.model_card(name).model_dump(mode="json"))

    async def with_body(http: HttpRequest, answer) -> Response:
        """`answer(body)` once the body has arrived; nothing for a client that went away."""
        try:
            body = await server.read_body(http)
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        return await answer(body)

    async def endpoint(http: HttpRequest, schema, chat: bool) -> Response:
        async def answer(body: bytes) -> Response:
            return await server.generate(http, server.parse(schema, body), chat)

        return await with_body(http, answer)

    async def as_json(reply) -> Response:
        return JSONResponse((await reply).model_dump(mode="json"))

    @app.post("/tokenize")
    async def tokenize(http: HttpRequest) -> Response:
        return await with_body(
            http, lambda body: as_json(server.tokenize(server.parse_tokenize(body)))
        )

    @app.post("/detokenize")
    async def detokenize(http: HttpRequest) -> Response:
        return await with_body(
            http,
            lambda body: as_json(server.detokenize(server.parse(api.DetokenizeRequest, body))),
        )

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        return await endpoint(http, api.CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        return await endpoint(http, api.ChatCompletionRequest, chat=True)

    if max_connections is not None:
        app = _ConnectionLimit(app, max_connections, open_connections)
    if api_key is not None:
        app = _ApiKey(app, api_key)
    return _CountStatus(app, server.metrics)
