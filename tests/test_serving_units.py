"""Pieces of the server that need no engine: text assembly, schemas, metrics, the failure path."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading

import httpx
import numpy as np
import pytest
from _chat_tokenizer import build_chat_tokenizer
from pydantic import ValidationError
from serving_helpers import StandInEngine, wait_until
from uvicorn.config import LOGGING_CONFIG
from uvicorn.logging import AccessFormatter

import dspark_jax
from dspark_jax.decoding.batching import Handle
from dspark_jax.embedded import EMBEDDED_TARGET
from dspark_jax.serving import runtime
from dspark_jax.serving.app import ApiError, HttpLimits, OpenAIServer, ServedModel
from dspark_jax.serving.http_server import HttpServer, bind_socket
from dspark_jax.serving.metrics import ServingMetrics
from dspark_jax.serving.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    CompletionRequest,
    DetokenizeRequest,
)
from dspark_jax.serving.runtime import EngineRunner
from dspark_jax.serving.text_stream import StopStrings, TextStream
from dspark_jax.tokenizer import ByteTokenizer, load_tokenizer


def test_incremental_text_never_splits_a_character():
    text = "naïve — 数据 ok"
    ids = list(text.encode())
    stream = TextStream(ByteTokenizer())
    pieces = [stream.push([i]) for i in ids]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    # A character cut by the end of the stream still comes out (as a replacement character).
    stream = TextStream(ByteTokenizer())
    assert stream.push(list("é".encode())[:1]) == ""
    assert stream.flush() == "\ufffd"


def test_incremental_text_skips_special_tokens():
    stream = TextStream(ByteTokenizer())
    assert stream.push([104, 105, 256, 33]) == "hi!"


class _CountingBytes(ByteTokenizer):
    """Counts the ids every decode call is given (the cost of incremental detokenization)."""

    decoded = 0

    def decode(self, ids):
        self.decoded += len(ids)
        return super().decode(ids)


class _SilentZero:
    """A tokenizer whose id 0 is an ordinary (non-special) token with no text; others are bytes."""

    all_special_ids = ()
    decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return bytes(i for i in ids if i).decode("utf-8", errors="replace")


@pytest.mark.parametrize("make", [_CountingBytes, _SilentZero])
def test_incremental_text_cost_stays_linear_in_tokens_that_add_no_text(make):
    # EOS pushed while a request ignores EOS (or a skipped special token) adds no text; the
    # window used to keep every one of them, so each push re-decoded the whole run (quadratic).
    silent = 256 if make is _CountingBytes else 0
    costs = {}
    for n in (500, 2000):
        tokenizer = make()
        stream = TextStream(tokenizer)
        pieces = [stream.push(list(b"ok "))]
        pieces += [stream.push([silent]) for _ in range(n)]
        pieces += [stream.push([i]) for i in "é!".encode()]
        pieces += [stream.push([silent]) for _ in range(n)] + [stream.flush()]
        assert "".join(pieces) == "ok é!"
        costs[n] = tokenizer.decoded
    assert costs[2000] <= 4 * costs[500] + 50  # linear: 4x the tokens, 4x the cost (not 16x)
    # EOS from the very first token on (the model ends at once and ignore_eos keeps it going).
    tokenizer = _CountingBytes()
    stream = TextStream(tokenizer)
    assert [stream.push([256]) for _ in range(2000)] == [""] * 2000
    assert stream.push(list(b"hi")) == "hi" and tokenizer.decoded < 10


def test_incremental_text_matches_whole_decode_with_silent_tokens_between():
    tokenizer = load_tokenizer(EMBEDDED_TARGET)
    eos = tokenizer.eos_token_id
    words = tokenizer.encode(" naïve data, ok") + [eos] * 3 + tokenizer.encode(" more")
    ids = [i for w in words for i in ([w, eos] if w % 3 else [w])]
    stream = TextStream(tokenizer)
    text = "".join(stream.push([i]) for i in ids) + stream.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(stream._ids) - stream._prefix <= 4  # the window holds no EOS


def test_stop_strings_hold_back_what_could_become_one():
    stops = StopStrings(["STOP", "\n\n"])
    assert stops.feed("abc S") == "abc "
    assert stops.feed("T") == ""
    assert stops.feed("x\n") == "STx"
    assert not stops.matched
    assert stops.feed("\nrest") == ""
    assert stops.matched
    assert stops.feed("more") == "" and stops.finish() == ""


def test_stop_strings_release_the_held_tail_at_the_end():
    stops = StopStrings(["STOP"])
    assert stops.feed("abST") == "ab"
    assert stops.finish() == "ST"
    assert StopStrings([]).feed("anything") == "anything"


def test_stop_strings_included_release_at_once_and_end_with_the_first_completed():
    """include_stop_str_in_output: nothing is held back, the text ends with the stop string that
    completed first (across pieces too), and a stop string seen before min_tokens armed the
    stops does not end a later piece."""
    stops = StopStrings(["STOP", "\n\n"], include=True)
    assert stops.feed("abc S") == "abc S"  # not held: it is text either way
    assert stops.feed("TO") == "TO" and not stops.matched
    assert stops.feed("Px\n\ny") == "P" and stops.matched
    assert stops.feed("more") == "" and stops.finish() == ""
    # One character a piece: the lookback spans the pieces.
    stops = StopStrings(["three", "STOP"], include=True)
    assert "".join(stops.feed(c) for c in "one two STOP three") == "one two STOP"
    # The first stop string to complete, not the first to start: "B" ends before "XABC" does.
    stops = StopStrings(["XABC", "B"], include=True)
    assert stops.feed("..XABC") == "..XAB" and stops.matched
    # Unarmed, a stop string passes; armed, only one ending in the new text counts.
    stops = StopStrings(["ab", "b"], include=True)
    assert stops.feed("xab", armed=False) == "xab"
    assert stops.feed("c", armed=True) == "c" and not stops.matched
    assert stops.feed("a", armed=True) == "a"
    assert stops.feed("bz", armed=True) == "b" and stops.matched


def test_special_tokens_are_written_out_unless_skipped():
    tokenizer = load_tokenizer(EMBEDDED_TARGET)
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode(" one") + [eos] + tokenizer.encode(" two") + [eos]
    for skip in (True, False):
        stream = TextStream(tokenizer, skip_special_tokens=skip)
        text = "".join(stream.push([i]) for i in ids) + stream.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert tokenizer.eos_token in text and text.count(tokenizer.eos_token) == 2
    # Stop tokens stay out either way; the byte tokenizer's special ids have no text.
    stream = TextStream(tokenizer, stop_tokens=[eos], skip_special_tokens=False)
    assert "".join(stream.push([i]) for i in ids) + stream.flush() == " one two"
    stream = TextStream(ByteTokenizer(), skip_special_tokens=False)
    assert stream.push([104, 105, 256, 33]) == "hi!"


def test_schemas():
    req = CompletionRequest.model_validate_json(b'{"prompt": [[5, 6]], "stop": "x"}')
    assert req.prompt == [5, 6] and req.stop_strings == ("x",)
    assert req.prompts == [[5, 6]]
    # A list of several prompts asks for n choices of each; one prompt of ids stays one.
    several = CompletionRequest.model_validate_json(b'{"prompt": ["a", "b"], "n": 3}')
    assert several.prompts == ["a", "b"] and several.n == 3
    assert CompletionRequest.model_validate_json(b'{"prompt": [[1], [2, 3]]}').prompts == [
        [1],
        [2, 3],
    ]
    assert CompletionRequest.model_validate_json(b'{"prompt": [4, 5]}').prompts == [[4, 5]]
    for body, fragment in (
        (b'{"prompt": ["a", ""]}', "prompt 1 of the 2 is empty"),
        (b'{"prompt": "x", "n": 0}', "greater than or equal to 1"),
        (b'{"prompt": "x", "n": 129}', "less than or equal to 128"),
    ):
        with pytest.raises(ValidationError, match=fragment):
            CompletionRequest.model_validate_json(body)
    chat = ChatCompletionRequest.model_validate_json(
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
        b' {"type": "text", "text": "b"}]}], "max_tokens": 9, "max_completion_tokens": 3}'
    )
    assert chat.messages[0].text() == "ab" and chat.token_limit == 3
    for body in (
        b'{"prompt": "x", "stream_options": {"include_usage": true}}',
        b'{"prompt": "x", "logprobs": 6}',
        b'{"prompt": "x", "top_k": -2}',
        b'{"prompt": "x", "min_p": 1.5}',
        b'{"prompt": "x", "min_p": -0.1}',
        b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
    ):
        schema = ChatCompletionRequest if b"messages" in body else CompletionRequest
        with pytest.raises(ValidationError):
            schema.model_validate_json(body)


def test_sampling_defaults_come_from_the_models_generation_config(tmp_path):
    """Fields a request leaves out follow generation_config.json (Qwen3's names temperature,
    top_p and top_k; min_p where a model has it); a value out of range there is refused when
    the server starts, not in every request."""
    from dspark_jax.sampling import SamplingConfigError
    from dspark_jax.serving.app import SamplingDefaults

    assert SamplingDefaults.from_model_dir(tmp_path) == SamplingDefaults()
    config = tmp_path / "generation_config.json"
    config.write_text('{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05}')
    assert SamplingDefaults.from_model_dir(tmp_path) == SamplingDefaults(0.6, 0.95, 20, 0.05)
    config.write_text('{"temperature": 0.6, "min_p": 2}')
    with pytest.raises(SamplingConfigError, match="min_p must be in"):
        SamplingDefaults.from_model_dir(tmp_path)
    # Qwen2.5's files name a repetition penalty (which needs an engine with penalties).
    config.write_text('{"temperature": 0.7, "repetition_penalty": 1.05}')
    defaults = SamplingDefaults.from_model_dir(tmp_path)
    assert (defaults.temperature, defaults.repetition_penalty) == (0.7, 1.05)
    config.write_text('{"repetition_penalty": 0}')
    with pytest.raises(SamplingConfigError, match="repetition_penalty must be"):
        SamplingDefaults.from_model_dir(tmp_path)
    req = CompletionRequest.model_validate_json(b'{"prompt": "x", "min_p": 0}')
    assert req.min_p == 0.0


def test_null_is_the_default_where_openai_allows_null():
    nulls = b'"n": null, "stream": null, "ignore_eos": null, "return_token_ids": null'
    req = CompletionRequest.model_validate_json(b'{"prompt": "x", "echo": null, ' + nulls + b"}")
    assert (req.n, req.stream, req.echo, req.ignore_eos, req.return_token_ids) == (
        1,
        False,
        False,
        False,
        False,
    )
    chat = ChatCompletionRequest.model_validate_json(
        b'{"messages": [{"role": "user", "content": "x"}], ' + nulls + b', "stream_options": null}'
    )
    assert (chat.n, chat.stream, chat.ignore_eos, chat.return_token_ids) == (1, False, False, False)
    # vLLM's flags: null is their default, which for skip_special_tokens is true.
    req = CompletionRequest.model_validate_json(
        b'{"prompt": "x", "skip_special_tokens": null, "include_stop_str_in_output": null}'
    )
    assert (req.skip_special_tokens, req.include_stop_str_in_output) == (True, False)


def test_neutral_values_of_fields_the_server_does_not_implement_are_accepted():
    CompletionRequest.model_validate_json(
        b'{"prompt": "x", "store": false, "metadata": {"team": "a"}, "service_tier": "auto",'
        b' "user": "u1", "suffix": "", "best_of": 1, "logprobs": null, "logit_bias": {},'
        b' "presence_penalty": 0, "frequency_penalty": null, "safety_identifier": "h1",'
        b' "prompt_cache_key": "k1"}'
    )
    ChatCompletionRequest.model_validate_json(
        b'{"messages": [{"role": "user", "content": "x"}], "store": false, "metadata": {},'
        b' "service_tier": "default", "user": "u1", "parallel_tool_calls": true, "tools": [],'
        b' "safety_identifier": "h1", "prompt_cache_key": null,'
        b' "tool_choice": "none", "logprobs": false, "top_logprobs": 0,'
        b' "response_format": {"type": "text"}, "reasoning_effort": null}'
    )
    # vLLM's detokenizer choice for slow tokenizers: its default only.
    spaced = b'{"prompt": "x", "spaces_between_special_tokens": %s}'
    CompletionRequest.model_validate_json(spaced % b"true")
    with pytest.raises(ValidationError, match="false is not supported by this server"):
        CompletionRequest.model_validate_json(spaced % b"false")


def test_chat_roles():
    tool = ChatCompletionRequest.model_validate_json(
        b'{"messages": [{"role": "user", "content": "2+2?"},'
        b' {"role": "assistant", "content": null},'
        b' {"role": "tool", "content": "4", "tool_call_id": "call_1"}]}'
    )
    assert tool.messages[2].tool_call_id == "call_1"
    assert tool.messages[1].text() == ""
    developer = ChatCompletionRequest.model_validate_json(
        b'{"messages": [{"role": "developer", "content": "be brief"}]}'
    )
    assert developer.messages[0].template_role == "system"
    for body in (
        b'{"messages": [{"role": "user"}]}',
        b'{"messages": [{"role": "user", "content": null}]}',
        b'{"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]}',
    ):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate_json(body)


def test_an_assistant_reply_sent_back_as_the_client_got_it_is_accepted():
    """The OpenAI SDK's `reply.choices[0].message.model_dump()` carries the response's null
    fields (refusal, tool_calls, ...); multi-turn clients append it to the history as is."""
    chat = ChatCompletionRequest.model_validate_json(
        b'{"messages": [{"role": "user", "content": "hi"},'
        b' {"role": "assistant", "content": "Hello", "refusal": null, "tool_calls": null,'
        b' "function_call": null, "audio": null, "annotations": []},'
        b' {"role": "user", "content": "more"}]}'
    )
    assert [m.text() for m in chat.messages] == ["hi", "Hello", "more"]
    # What the server cannot honour, and a call without its function, is refused by name.
    for field, value in (
        ("refusal", b'"no"'),
        ("tool_calls", b'[{"id": "c", "type": "function"}]'),
        ("audio", b'{"id": "a"}'),
    ):
        body = (
            b'{"messages": [{"role": "assistant", "content": "x", "'
            + field.encode()
            + b'": '
            + value
            + b"}]}"
        )
        with pytest.raises(ValidationError, match=f"messages.0.{field}"):
            ChatCompletionRequest.model_validate_json(body)


def test_stream_deltas_leave_out_what_they_do_not_carry():
    assert ChatDelta().model_dump() == {}
    assert ChatDelta(content="hi").model_dump(mode="json") == {"content": "hi"}
    chunk = ChatCompletionChunk(
        id="c", created=0, model="m", choices=[ChatChunkChoice(delta=ChatDelta())]
    )
    assert chunk.model_dump()["choices"][0]["delta"] == {}


def test_spec_decode_counters_per_position():
    m = ServingMetrics(num_slots=2, kv_pages=10, gamma=3)
    m.on_rounds(np.array([3, 2, 0]), np.array([3, 1, 0]), 3)
    m.on_rounds(np.array([1]), np.array([0]), 3)
    assert m.drafts._value.get() == 4
    assert m.draft_tokens._value.get() == 12
    assert m.verified_tokens._value.get() == 6
    assert m.accepted_tokens._value.get() == 4
    assert [m.accepted_per_pos.labels(str(k))._value.get() for k in range(3)] == [2, 1, 1]
    assert [m.verified_per_pos.labels(str(k))._value.get() for k in range(3)] == [3, 2, 1]
    assert m.mean_acceptance._value.get() == pytest.approx(1 + 4 / 4)


def test_spec_decode_metrics_only_when_drafting():
    """A plain server exports no speculative counters (a mean acceptance of 0 would read as a
    drafter that never helps); a drafting one shows every position from the start."""
    from prometheus_client import generate_latest

    plain = generate_latest(ServingMetrics(num_slots=2, kv_pages=10, gamma=0).registry).decode()
    assert "dspark:num_requests_running" in plain
    assert "spec_decode" not in plain
    drafting = generate_latest(ServingMetrics(num_slots=2, kv_pages=10, gamma=2).registry).decode()
    assert "dspark:spec_decode_mean_acceptance_length" in drafting
    assert 'dspark:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 0.0' in drafting


class _ExplodingBatcher:
    """Takes requests like a Batcher; its loop step fails once a request has arrived."""

    def __init__(self, engine, max_waiting, observer, prefix_caching):
        self.arrived = threading.Event()

    def submit(self, request, on_event):
        self.arrived.set()
        return Handle(0, request, on_event, (), 0.0)

    def cancel(self, handle):
        pass

    def step(self) -> bool:
        if self.arrived.wait(0.01):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while allocating")
        return False


class _IdleBatcher(_ExplodingBatcher):
    def step(self) -> bool:
        return False


class _WarmingEngine(StandInEngine):
    """Stays in warm-up until `done` is set."""

    def __init__(self):
        self.done = threading.Event()

    def warm_up(self) -> None:
        self.done.wait(30)


def test_health_during_warm_up_is_a_503_with_retry_after(monkeypatch):
    monkeypatch.setattr(runtime, "Batcher", _IdleBatcher)
    engine = _WarmingEngine()
    model = ServedModel("m", ByteTokenizer(), 64, (256,))
    app_server = OpenAIServer(EngineRunner(engine, max_waiting=4), model, ServingMetrics(1, 1, 0))
    server = HttpServer(app_server, bind_socket("127.0.0.1", 0), log_level="critical").start()
    host, port = server.address
    url = f"http://{host}:{port}/health"
    try:
        assert wait_until(lambda: server.started, 30, interval=0.01)
        for warming in (httpx.get(url, timeout=10), httpx.head(url, timeout=10)):
            assert warming.status_code == 503
            assert warming.headers["retry-after"] == "1"
        assert httpx.get(url, timeout=10).json()["status"] == "warming up"
        engine.done.set()
        assert app_server.runner.wait_ready(30)
        ready = httpx.get(url, timeout=10)
        assert ready.status_code == 200 and "retry-after" not in ready.headers
    finally:
        engine.done.set()
        server.shutdown(30)


def test_the_drain_notice_says_what_ctrl_c_does_here():
    """uvicorn's "Waiting for connections to close. (CTRL+C to force quit)": here a second
    Ctrl-C ends the running requests and only a third quits (`_Uvicorn.handle_exit`)."""
    sock = bind_socket("127.0.0.1", 0)
    try:
        HttpServer(_chat_server(ByteTokenizer()), sock, log_level="critical")
    finally:
        sock.close()
    record = logging.LogRecord(
        "uvicorn.error", logging.INFO, __file__, 1,
        "Waiting for connections to close. (CTRL+C to force quit)", (), None,
    )
    assert logging.getLogger("uvicorn.error").filter(record)
    message = record.getMessage()
    assert "force quit" not in message
    assert "Ctrl+C again ends them at once, a third Ctrl+C quits" in message
    other = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Shutting down", (), None)
    assert logging.getLogger("uvicorn.error").filter(other)
    assert other.getMessage() == "Shutting down"


@pytest.mark.parametrize("stopped_during_warm_up", [False, True])
def test_ready_is_logged_only_when_the_server_becomes_ready(
    monkeypatch, caplog, stopped_during_warm_up
):
    """A Ctrl-C during warm-up drains at once, but the warm-up runs to its end; its "ready"
    would come after uvicorn's "Finished server process"."""
    monkeypatch.setattr(runtime, "Batcher", _IdleBatcher)
    # The CLI stops this logger propagating to the root, where caplog listens.
    logger = logging.getLogger(runtime.__name__)
    caplog.set_level(logging.INFO, logger=runtime.__name__)
    logger.addHandler(caplog.handler)
    engine = _WarmingEngine()
    runner = EngineRunner(engine, max_waiting=1).start()
    try:
        if stopped_during_warm_up:
            runner.close()
        engine.done.set()
        assert runner.wait_ready(30) is not stopped_during_warm_up
        assert runner.stop(30)
    finally:
        engine.done.set()
        logger.removeHandler(caplog.handler)
    logged = [r.getMessage() for r in caplog.records if r.name == runtime.__name__]
    assert any(m.startswith("ready:") for m in logged) is not stopped_during_warm_up, logged
    assert runner.status == runtime.STOPPED


def test_past_max_connections_a_request_gets_an_openai_503(monkeypatch):
    monkeypatch.setattr(runtime, "Batcher", _IdleBatcher)
    model = ServedModel("m", ByteTokenizer(), 64, (256,))
    metrics = ServingMetrics(1, 1, 0)
    app_server = OpenAIServer(EngineRunner(StandInEngine(), max_waiting=4), model, metrics)
    server = HttpServer(
        app_server, bind_socket("127.0.0.1", 0), max_connections=2, log_level="critical"
    ).start()
    host, port = server.address
    base = f"http://{host}:{port}"
    url = f"{base}/v1/models"
    idle = []
    try:
        assert app_server.runner.wait_ready(30)
        assert httpx.get(url, timeout=10).status_code == 200
        idle = [socket.create_connection((host, port), timeout=10) for _ in range(2)]
        connections = server._server.server_state.connections
        assert wait_until(lambda: len(connections) == 2, 10)
        refused = httpx.get(url, timeout=10)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert "--max-connections 2" in refused.json()["error"]["message"]
        assert metrics.http_responses.labels("503")._value.get() == 1
        # Liveness probes and scrapes still answer: a saturated server is busy, not dead.
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        assert httpx.head(f"{base}/health", timeout=10).status_code == 200
        scraped = httpx.get(f"{base}/metrics", timeout=10)
        assert scraped.status_code == 200 and "dspark:http_responses_total" in scraped.text
        assert metrics.http_responses.labels("503")._value.get() == 1
        for c in idle:
            c.close()
        assert wait_until(lambda: httpx.get(url, timeout=10).status_code == 200, 10)
    finally:
        for c in idle:
            c.close()
        server.shutdown(30)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_head_timeout_is_in_the_access_log_like_a_body_timeout(monkeypatch):
    """uvicorn logs what goes through the app (a body timeout); a request head that never
    completes is answered below it, and gets the same access-log line."""
    monkeypatch.setattr(runtime, "Batcher", _IdleBatcher)
    model = ServedModel("m", ByteTokenizer(), 64, (256,))
    limits = HttpLimits(read_timeout_s=0.5)
    app_server = OpenAIServer(
        EngineRunner(StandInEngine(), max_waiting=4), model, ServingMetrics(1, 1, 0), limits
    )
    server = HttpServer(app_server, bind_socket("127.0.0.1", 0), read_timeout_s=0.5)
    access = logging.getLogger("uvicorn.access")
    logged = _Records()
    access.addHandler(logged)
    host, port = server.address
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    try:
        server.start()
        assert app_server.runner.wait_ready(30)
        for sent in (head, head + b"Content-Length: 100\r\n\r\n{", b"POST /v1/co"):
            with socket.create_connection((host, port), timeout=10) as c:
                c.sendall(sent)
                answer = b""
                while chunk := c.recv(65536):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer
        assert wait_until(lambda: len(logged.records) == 3, 10)
    finally:
        access.removeHandler(logged)
        server.shutdown(30)
    # Formatted as the server's access log formats them (uvicorn's own format).
    formatter = AccessFormatter(LOGGING_CONFIG["formatters"]["access"]["fmt"], use_colors=False)
    lines = [formatter.format(r) for r in logged.records]
    assert all(
        line.endswith('"POST /v1/completions HTTP/1.1" 408 Request Timeout') for line in lines[:2]
    )
    # A request line that never arrived whole is not guessed at.
    assert lines[2].endswith('"- - HTTP/-" 408 Request Timeout'), lines
    assert all(line.startswith("INFO:") and " 127.0.0.1:" in line for line in lines), lines


def test_engine_failure_answers_in_flight_requests_and_stops_the_server(monkeypatch):
    monkeypatch.setattr(runtime, "Batcher", _ExplodingBatcher)
    model = ServedModel("m", ByteTokenizer(), 64, (256,))
    app_server = OpenAIServer(
        EngineRunner(StandInEngine(), max_waiting=4), model, ServingMetrics(1, 1, 0)
    )
    server = HttpServer(app_server, bind_socket("127.0.0.1", 0), log_level="critical")
    host, port = server.address
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(server.serve()))
    thread.start()
    assert app_server.runner.wait_ready(30)
    r = httpx.post(f"http://{host}:{port}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "engine_failed"
    assert "RESOURCE_EXHAUSTED" in r.json()["error"]["message"]
    thread.join(30)
    assert status == [1]
    assert app_server.runner.status == runtime.FAILED
    with pytest.raises(runtime.ServiceUnavailable):
        app_server.runner.submit(None, lambda kind, payload: None)


def _chat_server(tokenizer) -> OpenAIServer:
    model = ServedModel("m", tokenizer, 256, (tokenizer.eos_token_id,))
    runner = EngineRunner(StandInEngine(), max_waiting=1)
    return OpenAIServer(runner, model, ServingMetrics(1, 1, 0))


def test_seeds_take_any_64_bit_integer():
    """OpenAI and vLLM take any int64 seed; the engine's seeds are uint32, so seeds fold onto
    them (-1 and 2**32 - 1 draw alike) instead of a 400 for seed -1."""
    def seed(value):
        return CompletionRequest.model_validate({"prompt": "x", "seed": value}).seed

    assert seed(-1) == 2**32 - 1
    assert seed(7) == 7
    assert seed(2**40 + 5) == 5
    assert seed(-(2**63)) == 0
    for bad in (2**63, -(2**63) - 1, 1.5, "7"):
        with pytest.raises(ValidationError):
            seed(bad)


def test_default_token_limit_per_endpoint():
    """Without max_tokens a completion gets the Completions API's 16 tokens (within what the
    context leaves) and a chat completion all the context leaves -- OpenAI's and vLLM's
    defaults; a named limit is kept as named."""
    server = _chat_server(build_chat_tokenizer())  # max_model_len 256
    completion = CompletionRequest.model_validate({"prompt": "x"})
    assert server.token_limit(completion, 10) == 16
    assert server.token_limit(completion, 250) == 6
    named = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 100})
    assert server.token_limit(named, 10) == 100
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert server.token_limit(chat, 10) == 246


def test_choices_fan_out_in_openai_order_with_consecutive_seeds():
    """n choices of each prompt: choice i * n + j is prompt i's j-th, seeded seed + j (vLLM's
    rule, so each choice is what a request with that seed alone gets); a prompt that cannot fit
    is named by its index, and more choices than slots + queue can ever hold is a 400 on n."""
    server = _chat_server(build_chat_tokenizer())  # 1 slot, queue of 1, max_model_len 256
    req = CompletionRequest.model_validate(
        {"prompt": [[1, 2], [3]], "n": 1, "seed": 2**32 - 1, "max_tokens": 5}
    )
    requests = server.engine_requests(req, [[1, 2], [3]])
    assert [(r.prompt_ids, r.seed, r.max_new_tokens) for r in requests] == [
        ([1, 2], 2**32 - 1, 5),
        ([3], 2**32 - 1, 5),
    ]
    server.runner.max_waiting = 5
    two = CompletionRequest.model_validate({"prompt": [[1], [2]], "n": 3, "seed": 2**32 - 2})
    requests = server.engine_requests(two, [[1], [2]])
    assert [(r.prompt_ids, r.seed) for r in requests] == [
        ([1], 2**32 - 2),
        ([1], 2**32 - 1),
        ([1], 0),  # seeds wrap as the request's own seed does
        ([2], 2**32 - 2),
        ([2], 2**32 - 1),
        ([2], 0),
    ]
    unseeded = CompletionRequest.model_validate({"prompt": "x", "n": 2})
    assert [r.seed for r in server.engine_requests(unseeded, [[1]])] == [None, None]
    server.check_choices(two, 2)  # 6 choices: 1 slot + a queue of 5
    with pytest.raises(ApiError, match="7 choices") as caught:
        server.check_choices(CompletionRequest.model_validate({"prompt": "x", "n": 7}), 1)
    assert caught.value.body.error.param == "n" and caught.value.status == 400
    long = CompletionRequest.model_validate({"prompt": ["a", "b"], "max_tokens": 10})
    with pytest.raises(ApiError, match="prompt 1's 250 tokens plus max_tokens 10") as caught:
        server.engine_requests(long, [[1], [1] * 250])
    assert caught.value.body.error.param == "max_tokens"  # as for one prompt
    assert caught.value.body.error.code == "context_length_exceeded"
    with pytest.raises(ApiError, match="prompt 0's 256 tokens leave no room") as caught:
        server.engine_requests(long, [[1] * 256, [1]])
    assert caught.value.body.error.param == "prompt.0"


def test_chat_template_and_enable_thinking():
    tokenizer = build_chat_tokenizer()
    server = _chat_server(tokenizer)

    def rendered(body: bytes) -> str:
        req = ChatCompletionRequest.model_validate_json(body)
        (ids,) = asyncio.run(server.encode_prompts(req))
        return tokenizer.decode(ids)

    messages = b'"messages": [{"role": "user", "content": "hi"}]'
    plain = rendered(b"{" + messages + b"}")
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # A developer message is a system message to the template (OpenAI's newer name for it).
    developer = rendered(b'{"messages": [{"role": "developer", "content": "be brief"}]}')
    assert developer.startswith("<|im_start|>system\nbe brief<|im_end|>\n")
    # A message's name is accepted and not passed to the template (docs/serving.md).
    named = rendered(b'{"messages": [{"role": "user", "content": "hi", "name": "alice"}]}')
    assert named == plain
    thinking = rendered(b"{" + messages + b', "chat_template_kwargs": {"enable_thinking": true}}')
    assert thinking == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # Streamed text leaves special tokens out and keeps the think markers (no reasoning parser).
    stream = TextStream(tokenizer)
    ids = tokenizer.encode("<think>ok</think> done<|im_end|>")
    assert "".join(stream.push([i]) for i in ids) + stream.flush() == "<think>ok</think> done"


@pytest.mark.parametrize("loaded", [True, False], ids=["load_tokenizer", "AutoTokenizer"])
def test_a_prompt_past_the_tokenizer_limit_is_a_400_without_a_tokenizer_warning(
    loaded, transformers_log
):
    from transformers import AutoTokenizer

    config = json.loads((EMBEDDED_TARGET / "tokenizer_config.json").read_text())
    limit = config["model_max_length"]
    # A tokenizer the server's caller loaded itself keeps transformers' limit until served.
    tokenizer = (
        load_tokenizer(EMBEDDED_TARGET)
        if loaded
        else AutoTokenizer.from_pretrained(EMBEDDED_TARGET, local_files_only=True)
    )
    server = _chat_server(tokenizer)
    req = CompletionRequest.model_validate({"prompt": "hello world " * limit})
    (ids,) = asyncio.run(server.encode_prompts(req))
    assert len(ids) > limit
    with pytest.raises(ApiError) as caught:
        server.token_limit(req, len(ids))
    assert caught.value.body.error.code == "context_length_exceeded"
    warned = "longer than the specified maximum"
    assert not [r for r in transformers_log.records if warned in r.getMessage()]
    # The check can fail: the same encode with transformers' limit in place warns.
    AutoTokenizer.from_pretrained(EMBEDDED_TARGET, local_files_only=True).encode(
        "hello world " * limit
    )
    assert [r for r in transformers_log.records if warned in r.getMessage()]


def test_a_template_that_refuses_the_messages_is_a_400():
    tokenizer = build_chat_tokenizer("{{ raise_exception('roles must alternate') }}")
    server = _chat_server(tokenizer)
    req = ChatCompletionRequest.model_validate_json(
        b'{"messages": [{"role": "user", "content": "x"}]}'
    )
    with pytest.raises(ApiError, match="roles must alternate") as caught:
        asyncio.run(server.encode_prompts(req))
    assert caught.value.status == 400


def test_open_connections_leave_out_those_closing():
    """A connection answered 503 (Connection: close) stays in uvicorn's set until its socket
    is gone; counted, it made a burst of 8 requests past --max-connections 6 refuse all 8."""
    from types import SimpleNamespace

    from dspark_jax.serving.http_server import open_connections

    def conn(closing: bool):
        return SimpleNamespace(transport=SimpleNamespace(is_closing=lambda: closing))

    state = SimpleNamespace(connections=[conn(False), conn(True), conn(False), conn(True)])
    assert open_connections(state) == 2
    state.connections.append(SimpleNamespace())  # made, transport not yet set
    assert open_connections(state) == 3


def _warming_server(tokenizer, vocab_size: int | None):
    """An HTTP server still in warm-up (its engine waits for `engine.done`), the model's context
    2040 tokens: what answers there needs no engine."""
    engine = _WarmingEngine()
    model = ServedModel("m", tokenizer, 2040, (tokenizer.eos_token_id,), vocab_size=vocab_size)
    app_server = OpenAIServer(EngineRunner(engine, max_waiting=4), model, ServingMetrics(1, 1, 0))
    server = HttpServer(app_server, bind_socket("127.0.0.1", 0), log_level="critical").start()
    assert wait_until(lambda: server.started, 30, interval=0.01)
    host, port = server.address
    return engine, app_server, server, f"http://{host}:{port}"


def test_tokenize_counts_what_the_generation_endpoints_give_the_model(monkeypatch):
    """vLLM's /tokenize: a prompt's ids as /v1/completions encodes it, a conversation's as
    /v1/chat/completions renders it, with the context they count against and, on request, the
    tokens' names; answered during warm-up (no engine work). /detokenize inverts it, special
    tokens written out."""
    monkeypatch.setattr(runtime, "Batcher", _IdleBatcher)
    tokenizer = load_tokenizer(EMBEDDED_TARGET)
    engine, app_server, server, base = _warming_server(tokenizer, vocab_size=4096)

    def post(path: str, **body) -> dict:
        r = httpx.post(f"{base}{path}", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def generation_ids(schema, **body) -> list[int]:
        (ids,) = asyncio.run(app_server.encode_prompts(schema.model_validate(body)))
        return ids

    try:
        assert httpx.get(f"{base}/health", timeout=10).status_code == 503  # still warming up
        text = "def f(x):\n    return x"
        ids = generation_ids(CompletionRequest, prompt=text)
        assert post("/tokenize", prompt=text) == {
            "count": len(ids), "max_model_len": 2040, "tokens": ids, "token_strs": None,
        }  # fmt: skip
        named = post("/tokenize", prompt=text, return_token_strs=True)["token_strs"]
        assert named == tokenizer.convert_ids_to_tokens(ids) and len(named) == len(ids)
        assert "".join(named) == text.replace(" ", "Ġ").replace("\n", "Ċ")  # byte-level names
        # The conversation as chat renders it; without the generation prompt, a prefix of it
        # short of the assistant header; thinking on renders no empty think block.
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        chat_ids = generation_ids(ChatCompletionRequest, messages=messages)
        chat = post("/tokenize", messages=messages)
        assert chat["tokens"] == chat_ids and chat["count"] == len(chat_ids)
        bare = post("/tokenize", messages=messages, add_generation_prompt=False)["tokens"]
        assert 0 < len(bare) < len(chat_ids) and chat_ids[: len(bare)] == bare
        assert tokenizer.decode(chat_ids[len(bare) :]).startswith("<|im_start|>assistant\n")
        # A final assistant message continued (vLLM's continue_final_message): the generation
        # prompt, then its text, open -- no end-of-turn after it.
        reply = messages + [{"role": "assistant", "content": "Sure, here"}]
        for endpoint in ("/tokenize", "chat"):
            body = dict(messages=reply, continue_final_message=True)
            if endpoint == "chat":
                opened = generation_ids(ChatCompletionRequest, **body)
            else:
                opened = post("/tokenize", **body)["tokens"]
            assert opened[: len(chat_ids)] == chat_ids
            assert tokenizer.decode(opened[len(chat_ids) :]) == "Sure, here"
        thinking = {"enable_thinking": True}
        assert post("/tokenize", messages=messages, chat_template_kwargs=thinking)[
            "tokens"
        ] == generation_ids(ChatCompletionRequest, messages=messages, chat_template_kwargs=thinking)
        assert len(generation_ids(
            ChatCompletionRequest, messages=messages, chat_template_kwargs=thinking
        )) < len(chat_ids)  # fmt: skip
        # /detokenize gives the template's text back, control tokens and all.
        back = post("/detokenize", tokens=chat_ids)["prompt"]
        assert back.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi")
        assert post("/tokenize", prompt=back, add_special_tokens=False)["tokens"] == chat_ids
        assert post("/detokenize", tokens=ids) == {"prompt": text}
        assert post("/detokenize", tokens=[]) == {"prompt": ""}
        # Refusals: a 4xx naming the field, in the OpenAI error shape.
        user = [{"role": "user", "content": "hi"}]
        tool = {"type": "function", "function": {"name": "f"}}
        for path, body, status, param, fragment in [
            ("/tokenize", {}, 400, "prompt", "Field required"),
            ("/tokenize", {"prompt": 7}, 400, "prompt", "valid string"),
            ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, 400,
             "add_generation_prompt", "Extra inputs are not permitted"),
            ("/tokenize", {"messages": []}, 400, "messages", "at least 1 item"),
            ("/tokenize", {"messages": user, "continue_final_message": True,
             "add_generation_prompt": True}, 400, "continue_final_message",
             "needs add_generation_prompt: false"),
            ("/tokenize", {"messages": user, "add_special_tokens": True}, 400,
             "add_special_tokens", "not supported by this server"),
            ("/tokenize", {"messages": user, "tools": [tool]}, 400, "tools",
             "does not render tools"),
            ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model", "serves 'm'"),
            ("/detokenize", {"tokens": [1, 4096]}, 400, "tokens.1",
             "token 4096 is outside the vocabulary (0..4095)"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens.0", "greater than or equal to 0"),
            ("/detokenize", {"tokens": "1,2"}, 400, "tokens", "valid array"),
        ]:  # fmt: skip
            r = httpx.post(f"{base}{path}", json=body, timeout=30)
            error = r.json()["error"]
            assert (r.status_code, error["param"]) == (status, param), (body, r.text)
            assert fragment in error["message"], (body, error)
        assert httpx.post(f"{base}/tokenize", content=b"", timeout=30).status_code == 400
    finally:
        engine.done.set()
        server.shutdown(30)


def test_byte_tokens_are_named_in_byte_fallback_notation():
    """The byte models' tokens have no vocabulary names: printable ASCII is itself, any other
    byte <0xNN>, the special ids by role; their text skips the special ids."""
    server = _chat_server(ByteTokenizer())
    req = server.parse_tokenize(b'{"prompt": "a\\n\\u00e9", "return_token_strs": true}')
    answer = asyncio.run(server.tokenize(req))
    assert answer.tokens == [97, 10, 0xC3, 0xA9]
    assert answer.token_strs == ["a", "<0x0A>", "<0xC3>", "<0xA9>"]
    assert ByteTokenizer().token_string(256) == "<eos>"
    assert ByteTokenizer().token_string(257) == "<mask>"
    assert ByteTokenizer().token_string(260) == "<unused260>"
    detokenize = server.parse(DetokenizeRequest, b'{"tokens": [104, 256, 105]}')
    assert asyncio.run(server.detokenize(detokenize)).prompt == "hi"


def test_an_api_key_is_asked_of_every_request_but_probes_and_scrapes(monkeypatch):
    """--api-key: a request without `Authorization: Bearer <key>` (or with another key) gets
    OpenAI's 401 invalid_api_key, counted, the key it sent not echoed; /health and /metrics
    answer without one; an OpenAI client given the key as its api_key gets in."""
    monkeypatch.setattr(runtime, "Batcher", _IdleBatcher)
    model = ServedModel("m", ByteTokenizer(), 64, (256,))
    metrics = ServingMetrics(1, 1, 0)
    app_server = OpenAIServer(EngineRunner(StandInEngine(), max_waiting=4), model, metrics)
    server = HttpServer(
        app_server, bind_socket("127.0.0.1", 0), log_level="critical", api_key="s3cret"
    ).start()
    host, port = server.address
    base = f"http://{host}:{port}"
    try:
        assert app_server.runner.wait_ready(30)
        refused = []
        for headers in ({}, {"Authorization": "Bearer wr0ng"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic czNjcmV0"}):  # fmt: skip
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                                 ("POST", "/tokenize"), ("GET", "/v1/no-such-route")):  # fmt: skip
                r = httpx.request(
                    method, f"{base}{path}", json={"prompt": "x"}, headers=headers, timeout=10
                )
                assert r.status_code == 401, (headers, path, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert "wr0ng" not in r.text and "s3cret" not in r.text
                refused.append(r.json()["error"]["message"])
        assert "the API key is not valid" in refused[4]
        assert "'Authorization: Bearer <key>'" in refused[0] == refused[8] == refused[12]
        assert metrics.http_responses.labels("401")._value.get() == 16
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200
        assert httpx.get(f"{base}/version", timeout=10).status_code == 401
        for scheme in ("Bearer", "bearer"):
            keyed = {"Authorization": f"{scheme} s3cret"}
            assert httpx.get(f"{base}/v1/models", headers=keyed, timeout=10).status_code == 200
        version = httpx.get(f"{base}/version", headers=keyed, timeout=10).json()
        assert version == {"version": dspark_jax.__version__}
        import openai

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["m"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="other", max_retries=0).models.list()
    finally:
        server.shutdown(30)
