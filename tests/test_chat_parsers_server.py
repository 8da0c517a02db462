"""Reasoning and tool calls through the HTTP server (`--reasoning-parser qwen3`,
`--tool-call-parser hermes`), with the OpenAI client, whole and streamed.

The engine is a stand-in that answers every request with a scripted text's tokens, a few per
event (so markers arrive split across events): what is under test is the server's side, from
the rendered prompt to the message the client reads. The parsers' own cases are in
test_chat_output.py.
"""

from __future__ import annotations

import itertools
import json
import threading

import httpx
import numpy as np
import openai
import pytest
from _chat_tokenizer import QWEN_LIKE_TEMPLATE, QWEN_TOOLS_TEMPLATE, build_chat_tokenizer
from serving_helpers import DONE, StandInEngine, sse_events

from dspark_jax.decoding.batching import Handle, Result, Tokens
from dspark_jax.serving import runtime
from dspark_jax.serving.app import OpenAIServer, ServedModel
from dspark_jax.serving.http_server import HttpServer, bind_socket
from dspark_jax.serving.metrics import ServingMetrics
from dspark_jax.serving.runtime import EngineRunner

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
THOUGHT = "<think>\nThe user asks for the weather: call the tool.\n</think>\n\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
USER = [{"role": "user", "content": "Weather in Paris?"}]


class _ScriptedBatcher:
    """Answers each request with the tokens of `script` (then EOS), three tokens per event;
    keeps the prompts it was given."""

    script: list[int] = []
    prompts: list[list[int]] = []
    requests: list = []
    _ids = itertools.count()

    def __init__(self, engine, max_waiting, observer, prefix_caching):
        self._pending: list[Handle] = []
        self._lock = threading.Lock()

    def submit(self, request, on_event):
        handle = Handle(next(self._ids), request, on_event, (), 0.0)
        with self._lock:
            self._pending.append(handle)
        type(self).prompts.append(list(request.prompt_ids))
        type(self).requests.append(request)
        return handle

    def cancel(self, handle):
        pass

    def step(self) -> bool:
        with self._lock:
            pending, self._pending = self._pending, []
        for handle in pending:
            tokens = self.script
            for i in range(0, len(tokens), 3):
                piece = tokens[i : i + 3]
                handle.on_event("tokens", Tokens(piece, [-0.5] * len(piece)))
            none = np.zeros((0,), np.int32)
            result = Result(
                list(tokens),
                "stop",
                len(handle.request.prompt_ids),
                none,
                none,
                none,
                np.zeros((0, 1), np.float32),
            )
            handle.on_event("done", result)
        return bool(pending)


@pytest.fixture
def serve(monkeypatch):
    """serve(reasoning_parser, tool_call_parser, template) -> base URL of a running server."""
    monkeypatch.setattr(runtime, "Batcher", _ScriptedBatcher)
    servers = []

    def start(reasoning=None, tools=None, template=QWEN_TOOLS_TEMPLATE, priority=False):
        tokenizer = build_chat_tokenizer(template)
        _ScriptedBatcher.prompts = []
        _ScriptedBatcher.requests = []
        model = ServedModel(
            "m",
            tokenizer,
            4096,
            (tokenizer.eos_token_id,),
            reasoning_parser=reasoning,
            tool_call_parser=tools,
        )
        runner = EngineRunner(StandInEngine(), max_waiting=8)
        app_server = OpenAIServer(
            runner, model, ServingMetrics(1, 1, 0), priority_scheduling=priority
        )
        server = HttpServer(app_server, bind_socket("127.0.0.1", 0), log_level="critical")
        servers.append(server.start())
        assert runner.wait_ready(30)
        host, port = server.address
        return f"http://{host}:{port}", tokenizer

    yield start
    for server in servers:
        server.shutdown(30)


def _answer(tokenizer, text: str) -> None:
    _ScriptedBatcher.script = tokenizer.encode(text) + [tokenizer.eos_token_id]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_a_call_with_reasoning_whole_and_sent_back(serve):
    url, tokenizer = serve(reasoning="qwen3", tools="hermes")
    _answer(tokenizer, THOUGHT + CALL)
    client = _client(url)
    reply = client.chat.completions.create(model="m", messages=USER, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content is None
    assert message.model_extra["reasoning"] == "The user asks for the weather: call the tool."
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The tools reached the prompt through the template.
    prompt = tokenizer.decode(_ScriptedBatcher.prompts[-1])
    assert '"name": "get_weather"' in prompt and "# Tools" in prompt
    # The reply goes back into the history as the client got it, with the tool's result.
    _answer(tokenizer, "It is 21 degrees in Paris.")
    history = USER + [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'},
    ]
    final = client.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == "It is 21 degrees in Paris."
    assert final.choices[0].message.tool_calls is None
    prompt = tokenizer.decode(_ScriptedBatcher.prompts[-1])
    assert (
        "<think>\nThe user asks for the weather: call the tool.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    ) in prompt
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in prompt


def test_streamed_reasoning_and_call_arrive_as_deltas(serve):
    url, tokenizer = serve(reasoning="qwen3", tools="hermes")
    _answer(tokenizer, THOUGHT + "Checking.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"))
    body = {"messages": USER, "tools": [WEATHER], "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [e for e in sse_events(r) if e != DONE]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant"} and deltas[-1] == {}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    assert reasoning == "The user asks for the weather: call the tool."
    assert "".join(d.get("content", "") for d in deltas) == "Checking.\n"
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0, 1]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    # Every delta carries what it has and nothing null; the reasoning came in several.
    assert all(None not in d.values() for d in deltas)
    assert sum("reasoning" in d for d in deltas) > 1
    # The OpenAI client assembles the same stream.
    stream = _client(url).chat.completions.create(
        model="m", messages=USER, tools=[WEATHER], stream=True
    )
    names = [c.function.name for chunk in stream for c in chunk.choices[0].delta.tool_calls or []]
    assert names == ["get_weather", "get_weather"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_is_started_for_the_model(serve, stream):
    """tool_choice naming a function (or "required"): the prompt ends with the start of the
    call block -- the function's name and the arguments' key, or the name's key alone -- and
    the model's continuation completes one call (a named function is called once). The
    reasoning parser, on here, takes the answer as content: it starts inside the block."""
    url, tokenizer = serve(reasoning="qwen3", tools="hermes")
    rome = CALL.replace("Paris", "Rome")
    client = _client(url)
    for choice, start, answer in (
        (
            {"type": "function", "function": {"name": "get_weather"}},
            '<tool_call>\n{"name": "get_weather", "arguments": ',
            '{"city": "Paris"}}\n</tool_call>\n' + rome,
        ),
        ("required", '<tool_call>\n{"name": "', 'get_weather", "arguments": {"city": "Paris"}}'
         "\n</tool_call>"),
    ):  # fmt: skip
        _answer(tokenizer, answer)
        ask = dict(model="m", messages=USER, tools=[WEATHER], tool_choice=choice)
        if stream:
            chunks = list(client.chat.completions.create(**ask, stream=True))
            deltas = [c.choices[0].delta for c in chunks]
            calls = [call for d in deltas for call in d.tool_calls or []]
            content = "".join(d.content or "" for d in deltas)
            finish = chunks[-1].choices[0].finish_reason
        else:
            reply = client.chat.completions.create(**ask).choices[0]
            calls, content = reply.message.tool_calls, reply.message.content or ""
            finish = reply.finish_reason
        assert finish == "tool_calls" and content == ""
        (call,) = calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        prompt = tokenizer.decode(_ScriptedBatcher.prompts[-1])
        assert prompt.endswith("<|im_start|>assistant\n" + start)


def test_parallel_tool_calls_false_returns_one_call(serve):
    url, tokenizer = serve(tools="hermes")
    _answer(tokenizer, CALL + "\n" + CALL.replace("Paris", "Rome"))
    reply = _client(url).chat.completions.create(
        model="m", messages=USER, tools=[WEATHER], parallel_tool_calls=False
    )
    assert len(reply.choices[0].message.tool_calls) == 1


def test_without_tools_in_the_request_a_call_is_text_and_reasoning_still_splits(serve):
    url, tokenizer = serve(reasoning="qwen3", tools="hermes")
    _answer(tokenizer, THOUGHT + CALL)
    reply = _client(url).chat.completions.create(model="m", messages=USER)
    message = reply.choices[0].message
    assert message.content == CALL and message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning"].startswith("The user asks")
    # tool_choice "none": the tools are not shown to the model, the text is not parsed.
    reply = _client(url).chat.completions.create(
        model="m", messages=USER, tools=[WEATHER], tool_choice="none"
    )
    assert reply.choices[0].message.content == CALL
    assert "# Tools" not in tokenizer.decode(_ScriptedBatcher.prompts[-1])


def test_without_parsers_the_answer_is_plain_text(serve):
    url, tokenizer = serve()
    _answer(tokenizer, THOUGHT + "Hi.")
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER}, timeout=30)
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": THOUGHT + "Hi."}
    # Completions are never parsed.
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 200}, timeout=30)
    assert r.json()["choices"][0]["text"] == THOUGHT + "Hi."


def test_a_continued_reply_goes_on_inside_its_open_think_block(serve):
    """continue_final_message (vLLM's): the prompt ends with the prefilled start of the reply,
    and the reasoning parser knows the think block is open however long that start is."""
    url, tokenizer = serve(reasoning="qwen3", template=QWEN_LIKE_TEMPLATE)
    start = "<think>\nThe user asks about the weather in Paris, so a tool"
    _answer(tokenizer, " is needed.\n</think>\n\nIt is sunny.")
    body = {
        "messages": USER + [{"role": "assistant", "content": start}],
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": True},
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "It is sunny.", "reasoning": "is needed."}
    prompt = tokenizer.decode(_ScriptedBatcher.prompts[-1])
    assert prompt.endswith("<|im_start|>assistant\n" + start)
    both = {**body, "add_generation_prompt": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=both, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize(
    ("fields", "text"),
    [
        ({}, "one two STOP three"),
        ({"skip_special_tokens": False}, "one<|endoftext|> two STOP three"),
        (
            {"skip_special_tokens": False, "include_stop_str_in_output": True},
            "one<|endoftext|> two STOP three<|im_end|>",
        ),
        ({"stop": "STOP"}, "one two "),
        ({"stop": ["STOP", "three"], "include_stop_str_in_output": True}, "one two STOP"),
        ({"stop": "O", "skip_special_tokens": False}, "one<|endoftext|> two ST"),
    ],
)
def test_special_tokens_and_stop_strings_stay_in_the_text_when_asked(serve, fields, text):
    """vLLM's skip_special_tokens (false writes special tokens out) and
    include_stop_str_in_output (the stop string, or the stop token's own text, ends the text),
    on both endpoints, whole and streamed, the stream in pieces that split the stop string."""
    url, tokenizer = serve(tools=None, template=QWEN_LIKE_TEMPLATE)
    _answer(tokenizer, "one<|endoftext|> two STOP three")  # then EOS, <|im_end|>
    for path, body, read in (
        ("completions", {"prompt": "x", "max_tokens": 200}, lambda c: c["text"]),
        ("chat/completions", {"messages": USER}, lambda c: c["message"]["content"]),
    ):
        r = httpx.post(f"{url}/v1/{path}", json={**body, **fields}, timeout=30)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (read(choice), choice["finish_reason"]) == (text, "stop")
        streamed = {**body, **fields, "stream": True}
        with httpx.stream("POST", f"{url}/v1/{path}", json=streamed, timeout=30) as s:
            events = [e["choices"][0] for e in sse_events(s) if e != DONE]
        pieces = [e.get("text") or e.get("delta", {}).get("content") or "" for e in events]
        assert "".join(pieces) == text and sum(bool(p) for p in pieces) > 1


def test_a_thinking_template_opens_the_block_in_the_prompt(serve):
    """A template that ends the generation prompt with `<think>` (the thinking-only models'):
    the answer starts inside the block."""
    template = QWEN_LIKE_TEMPLATE.replace(
        "{{- '<|im_start|>assistant\\n' -}}", "{{- '<|im_start|>assistant\\n<think>\\n' -}}"
    )
    assert template != QWEN_LIKE_TEMPLATE
    url, tokenizer = serve(reasoning="qwen3", template=template)
    _answer(tokenizer, "Short thought.\n</think>\n\nHello.")
    body = {"messages": USER, "chat_template_kwargs": {"enable_thinking": True}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    message = r.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Hello.", "reasoning": "Short thought."}


@pytest.mark.parametrize(
    "parsers, template, body, param, fragment",
    [
        ({}, QWEN_TOOLS_TEMPLATE, {"tools": [WEATHER]}, "tools", "--tool-call-parser hermes"),
        (
            {"tools": "hermes"},
            QWEN_LIKE_TEMPLATE,
            {"tools": [WEATHER]},
            "tools",
            "does not render tools",
        ),
        (
            {"tools": "hermes"},
            QWEN_TOOLS_TEMPLATE,
            {"tool_choice": "required"},
            "tool_choice",
            '"required" needs tools',
        ),
        (
            {"tools": "hermes"},
            QWEN_TOOLS_TEMPLATE,
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
            "names 'f', which is not among the tools (get_weather)",
        ),
        (
            {"tools": "hermes"},
            QWEN_TOOLS_TEMPLATE,
            {
                "messages": USER + [{"role": "assistant", "content": "Let me"}],
                "continue_final_message": True,
                "tools": [WEATHER],
                "tool_choice": "required",
            },
            "tool_choice",
            "a forced call cannot continue the final message",
        ),
        (
            {"tools": "hermes"},
            QWEN_TOOLS_TEMPLATE,
            {"tool_choice": "auto"},
            "tool_choice",
            '"auto" needs tools',
        ),
        (
            {"tools": "hermes"},
            QWEN_TOOLS_TEMPLATE,
            {"tools": [{"type": "function", "function": {"name": "two words"}}]},
            "tools.0.function.name",
            "should match pattern",
        ),
        (
            {"tools": "hermes"},
            QWEN_TOOLS_TEMPLATE,
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            None,
            None,
        ),
    ],
)
def test_tool_requests_the_server_cannot_honour_are_400s(
    serve, parsers, template, body, param, fragment
):
    url, tokenizer = serve(tools=parsers.get("tools"), template=template)
    _answer(tokenizer, "ok")
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER, **body}, timeout=30)
    if param is None:  # an empty list of calls on a user message is a neutral value
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_calls_and_reasoning_belong_to_assistant_messages(serve):
    url, tokenizer = serve(tools="hermes")
    _answer(tokenizer, "ok")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for field, value in (("tool_calls", [call]), ("reasoning", "hm")):
        body = {"messages": [{"role": "user", "content": "x", field: value}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == f"messages.0.{field}"


def test_priority_reaches_the_queue_only_where_the_server_schedules_by_it(serve):
    """vLLM's priority: a server started with --scheduling-policy priority hands it to the
    engine's queue (tests/test_priority.py orders it there); a first-come-first-served one
    takes only 0 (or null) and answers anything else with a 400 that names the flag."""
    body = {"prompt": "x", "max_tokens": 4}
    for priority in (False, True):
        url, tokenizer = serve(template=QWEN_LIKE_TEMPLATE, priority=priority)
        _answer(tokenizer, "ok")
        for value in (None, 0, -3, 7):
            r = httpx.post(f"{url}/v1/completions", json={**body, "priority": value}, timeout=30)
            if value and not priority:
                error = r.json()["error"]
                assert r.status_code == 400 and error["param"] == "priority"
                assert "--scheduling-policy priority" in error["message"]
                continue
            assert r.status_code == 200, r.text
            assert _ScriptedBatcher.requests[-1].priority == (value or 0)


def test_add_special_tokens_puts_the_tokenizers_bos_around_a_completion_prompt(serve):
    """vLLM's add_special_tokens: a completion's text prompt gets what the tokenizer adds (here
    a BOS) unless it is false; a chat prompt is the template's alone (only false is taken),
    and token-id prompts are taken as they are."""
    from tokenizers.processors import TemplateProcessing

    url, tokenizer = serve(template=QWEN_LIKE_TEMPLATE)
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    _answer(tokenizer, "ok")
    text = tokenizer.encode("hi", add_special_tokens=False)
    for body, prompt in (
        ({"prompt": "hi"}, [bos] + text),
        ({"prompt": "hi", "add_special_tokens": None}, [bos] + text),
        ({"prompt": "hi", "add_special_tokens": False}, text),
        ({"prompt": text, "add_special_tokens": True}, text),
    ):
        r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
        assert _ScriptedBatcher.prompts[-1] == prompt
    for add, status in ((False, 200), (True, 400)):
        chat = {"messages": USER, "add_special_tokens": add}
        r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == status, r.text
