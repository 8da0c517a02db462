"""The OpenAI-compatible server, in-process (uvicorn on a thread, port 0) on the fixture pair.

Black-box through HTTP: continuous batching (short requests overtake a long one), no
compilation after warm-up whatever the sampling settings, greedy equal to the engine's offline
`generate` and to the reference's plain greedy decoding, seeded sampling independent of the
traffic around it, cancellation on disconnect, a full queue, a short load run, and hostile
clients (slow heads and bodies, short bodies, deep JSON, non-finite numbers).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from fixture_models import fixture_dir, reference_traces
from serving_helpers import DONE, SMALL_ENGINE, metrics, sse_events, wait_idle, wait_until

from dspark_jax.checkpoints.converted import load_decoding_models
from dspark_jax.decoding.batching import Request, generate
from dspark_jax.decoding.engine import Engine
from dspark_jax.errors import UserError
from dspark_jax.sampling import SamplingConfig
from dspark_jax.serving.app import HttpLimits, SamplingDefaults, ServedModel
from dspark_jax.serving.http_server import HttpServer, bind_socket, build_app_server
from dspark_jax.serving.metrics import compile_count, watch_compilations
from dspark_jax.tokenizer import ByteTokenizer

# Many requests through the same few programs: the time is in running them (tests/conftest.py).
pytestmark = pytest.mark.optimized

READ_TIMEOUT_S = 2.0
MODEL = "tiny-vanilla"
SEEDED = dict(temperature=0.9, top_p=0.9, seed=1234, max_tokens=48, ignore_eos=True)


@dataclasses.dataclass
class Served:
    url: str
    app_server: object
    traces: list
    offline_greedy: list
    offline_seeded: list

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def served():
    watch_compilations()
    root = fixture_dir("vanilla")
    models = load_decoding_models(root / "target", root / "draft", progress=False)
    engine = Engine(models.target, models.drafter, SMALL_ENGINE, stop_tokens=models.stop_tokens)
    traces = reference_traces("vanilla")["traces"]
    # The engine's offline path, run on the same engine before the server takes it over.
    greedy, _ = generate(engine, [Request(t["prompt"], max_new_tokens=96) for t in traces])
    seeded_sampling = SamplingConfig(SEEDED["temperature"], 0, SEEDED["top_p"])
    seeded, _ = generate(
        engine,
        [
            Request(
                list(b"def parse_args(argv):\n"),
                max_new_tokens=SEEDED["max_tokens"],
                seed=SEEDED["seed"],
                sampling=seeded_sampling,
                ignore_eos=True,
            )
        ],
    )
    model = ServedModel.of_engine(
        engine, MODEL, models.tokenizer, SamplingDefaults.from_model_dir(models.model_dir)
    )
    app_server = build_app_server(
        engine, model, max_waiting=64, limits=HttpLimits(read_timeout_s=READ_TIMEOUT_S)
    )
    server = HttpServer(
        app_server,
        bind_socket("127.0.0.1", 0),
        read_timeout_s=READ_TIMEOUT_S,
        drain_timeout_s=10,
        log_level="warning",
    ).start()
    host, port = server.address
    assert app_server.runner.wait_ready(600), app_server.runner.error
    assert compile_count() > 0  # the counter sees compilations on this JAX version
    yield Served(
        f"http://{host}:{port}",
        app_server,
        traces,
        [r.tokens for r in greedy],
        seeded[0].tokens,
    )
    server.shutdown(60)


def _complete(url: str, timeout: float = 120, **body) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_tokens(
    http: httpx.Client, log: list, name: str, go: threading.Event | None = None, **body
) -> dict:
    """Streams a completion (after `go`, if given); appends (name, token count so far) to `log`
    per chunk."""
    body = {"model": MODEL, "stream": True, "return_token_ids": True, **body}
    ids, finish = [], None
    if go is not None:
        go.wait()
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for event in sse_events(r):
            if event == DONE:
                break
            choice = event["choices"][0]
            ids += choice.get("token_ids") or []
            finish = choice["finish_reason"] or finish
            log.append((name, len(ids)))
    return {"token_ids": ids, "finish_reason": finish}


def _text_and_finish(url: str, request: dict) -> tuple[str, str]:
    """A completion's text and finish reason, whole or (with stream: true) from its chunks."""
    if not request.get("stream"):
        choice = _complete(url, **request)["choices"][0]
        return choice["text"], choice["finish_reason"]
    with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=120) as r:
        events = list(sse_events(r))
    assert events[-1] == DONE
    return (
        "".join(e["choices"][0]["text"] for e in events[:-1]),
        events[-2]["choices"][0]["finish_reason"],
    )


def _clients(url: str, n: int) -> list[httpx.Client]:
    """HTTP clients with their connection already open."""
    clients = [httpx.Client(base_url=url, timeout=300) for _ in range(n)]
    for c in clients:
        assert c.get("/health").status_code == 200
    return clients


def test_models_and_health(served):
    assert httpx.get(f"{served.url}/health").json()["status"] == "ok"
    head = httpx.head(f"{served.url}/health")
    assert head.status_code == 200 and head.content == b""
    models = served.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert served.client.models.retrieve(MODEL).model_dump() == models.data[0].model_dump()
    assert models.data[0].model_extra["root"] == MODEL  # built without one: the name
    r = httpx.get(f"{served.url}/v1/models/gpt-4")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"


def test_a_request_may_use_all_of_the_advertised_max_model_len(served):
    advertised = served.client.models.list().data[0].model_extra["max_model_len"]
    # The engine keeps one verification block (anchor + 7 drafts) beyond a request's last token.
    assert advertised == SMALL_ENGINE.max_model_len - 8
    prompt = list(b"# a long one\n")
    body = dict(prompt=prompt, temperature=0, ignore_eos=True)
    full = _complete(served.url, max_tokens=advertised - len(prompt), **body)
    assert full["usage"]["total_tokens"] == advertised
    r = httpx.post(
        f"{served.url}/v1/completions",
        json={**body, "max_tokens": advertised - len(prompt) + 1},
        timeout=30,
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


CHAT = [{"role": "user", "content": "x"}]
LONG = "x" * 600  # over max_model_len on its own


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("completions", {"prompt": LONG}, "prompt"),
        ("completions", {"prompt": LONG, "max_tokens": 5}, "prompt"),
        ("completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens"),
        ("chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
        ("chat/completions", {"messages": CHAT, "max_tokens": 5000}, "max_tokens"),
        (
            "chat/completions",
            {"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 5000},
            "max_completion_tokens",
        ),
    ],
)
def test_context_length_errors_name_the_field(served, path, body, param):
    r = httpx.post(f"{served.url}/v1/{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == param
    assert "max_model_len 504" in error["message"]


def test_greedy_equals_offline_generate_and_plain_greedy(served):
    """All four prompts in flight together; each answer equals the engine's offline generate
    and the PyTorch reference's target-only greedy decoding, token for token."""

    def ask(trace):
        body = _complete(
            served.url, prompt=trace["prompt"], max_tokens=96, temperature=0, return_token_ids=True
        )
        return body["choices"][0]["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(served.traces)) as pool:
        answers = list(pool.map(ask, served.traces))
    for trace, answer, offline in zip(served.traces, answers, served.offline_greedy, strict=True):
        assert answer == offline
        assert answer == trace["greedy"]


def test_seeded_sampling_alone_or_in_a_busy_server(served):
    prompt = "def parse_args(argv):\n"
    alone = _complete(served.url, prompt=prompt, return_token_ids=True, **SEEDED)
    assert alone["choices"][0]["token_ids"] == served.offline_seeded
    log: list = []
    clients = _clients(served.url, 3)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        busy = [
            pool.submit(
                _stream_tokens,
                clients[i],
                log,
                f"bg{i}",
                prompt=f"class Thing{i}:\n",
                max_tokens=480,
                ignore_eos=True,
                temperature=t,
                top_p=p,
                seed=i,
            )
            for i, (t, p) in enumerate([(1.0, 1.0), (0.0, 1.0), (0.6, 0.8)])
        ]
        assert wait_until(lambda: len(log) >= 3, 120, interval=0.001)
        joined = _complete(served.url, prompt=prompt, return_token_ids=True, **SEEDED)
        events_at_join = len(log)
        for f in busy:
            assert f.result()["finish_reason"] == "length"
    assert len(log) > events_at_join  # the others were still running when it finished
    assert joined["choices"][0]["token_ids"] == served.offline_seeded


def test_short_requests_overtake_a_long_one(served):
    """Continuous batching, black-box: requests sent while a long one streams start within a
    couple of its chunks and finish long before it."""
    log: list = []
    long_tokens = 480
    go = threading.Event()
    # Connections and threads exist before the clock starts: what is measured is the server.
    clients = _clients(served.url, 4)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        long = pool.submit(
            _stream_tokens,
            clients[0],
            log,
            "long",
            prompt="import os\n",
            max_tokens=long_tokens,
            ignore_eos=True,
            temperature=0.7,
            seed=5,
        )
        shorts = [
            pool.submit(
                _stream_tokens,
                clients[1 + i],
                log,
                f"short{i}",
                go,
                prompt=f"x = {i}\n",
                max_tokens=8,
                ignore_eos=True,
                temperature=0.5 * i,
                seed=i,
            )
            for i in range(3)
        ]
        assert wait_until(lambda: len(log) >= 2, 120, interval=0.001)
        sent_at = len(log)
        go.set()
        for f in shorts:
            assert f.result()["finish_reason"] == "length"
        assert len(long.result()["token_ids"]) == long_tokens
    for i in range(3):
        name = f"short{i}"
        first = next(k for k, (n, _) in enumerate(log) if n == name)
        last = max(k for k, (n, _) in enumerate(log) if n == name)
        long_chunks_before_first = sum(n == "long" for n, _ in log[sent_at:first])
        # Typically 2: the chunk in flight when the request arrives, and the one dispatched
        # ahead of its prefill (the loop reads a chunk behind); one more when host threads lag.
        long_done_by_then = max(c for n, c in log[: last + 1] if n == "long")
        assert long_chunks_before_first <= 4, (sent_at, log)
        assert long_done_by_then < long_tokens / 2, log


def test_unseen_sampling_settings_compile_nothing(served):
    before = compile_count()
    mixes = [
        dict(temperature=0.123, top_p=0.77, top_k=5, seed=99),
        dict(temperature=1.87, top_p=0.31, seed=7),
        dict(temperature=0.0, top_k=3),
        dict(temperature=0.9, min_p=0.2, seed=3),
    ]
    with concurrent.futures.ThreadPoolExecutor(len(mixes)) as pool:
        futures = [
            pool.submit(_complete, served.url, prompt="for i in range(", max_tokens=24, **mix)
            for mix in mixes
        ]
        for f in futures:
            assert f.result()["choices"][0]["finish_reason"] in ("stop", "length")
    assert compile_count() == before
    assert metrics(served.url)["dspark:jax_compilations_total"] == before


def test_stop_strings_cut_text_and_free_the_slot(served):
    prompt = "def main():\n    "
    free = _complete(served.url, prompt=prompt, max_tokens=60, temperature=0, ignore_eos=True)
    text = free["choices"][0]["text"]
    stop = text[10:12]
    cut = _complete(
        served.url,
        prompt=prompt,
        max_tokens=60,
        temperature=0,
        ignore_eos=True,
        stop=[stop, "\x00never"],
        return_token_ids=True,
    )
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == text[: text.index(stop)]
    # The answer ends with the token that completed the stop string.
    assert bytes(choice["token_ids"]).decode() == text[: text.index(stop) + len(stop)]
    assert cut["usage"]["completion_tokens"] == len(choice["token_ids"])
    # Streamed, the text arrives in pieces and never shows part of the stop string.
    with httpx.stream(
        "POST",
        f"{served.url}/v1/completions",
        json={
            "prompt": prompt,
            "max_tokens": 60,
            "temperature": 0,
            "ignore_eos": True,
            "stop": stop,
            "stream": True,
        },
        timeout=120,
    ) as r:
        events = list(sse_events(r))
    assert events[-1] == DONE
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == choice["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    wait_idle(served.url)


def test_include_stop_str_in_output_keeps_what_stopped_the_answer(served):
    """vLLM's include_stop_str_in_output: the stop string ends the text instead of being cut
    from it (whole and streamed), and a stop token from stop_token_ids keeps its text."""
    prompt = served.traces[0]["prompt"]  # token ids, whose greedy answer varies
    body = dict(prompt=prompt, max_tokens=40, temperature=0, ignore_eos=True)
    free = _complete(served.url, return_token_ids=True, **body)["choices"][0]
    text, ids = free["text"], free["token_ids"]
    assert bytes(ids).decode() == text  # one byte a token
    stop = text[10:12]
    kept = text[: text.index(stop) + len(stop)]
    for stream in (False, True):
        request = dict(stop=[stop], include_stop_str_in_output=True, stream=stream, **body)
        answer, finish = _text_and_finish(served.url, request)
        assert (answer, finish) == (kept, "stop")
    at = next(k for k in range(3, len(ids)) if ids[k] not in ids[:k])  # a token's first place
    for include in (False, True):
        choice = _complete(
            served.url, stop_token_ids=[ids[at]], include_stop_str_in_output=include, **body
        )["choices"][0]
        assert choice["text"] == bytes(ids[: at + include]).decode()
    wait_idle(served.url)


def test_truncate_prompt_tokens_keeps_the_prompts_end(served):
    """vLLM's truncate_prompt_tokens: the answer, the echo and the usage are those of the
    prompt's last k tokens; -1 keeps max_model_len of them; 0 or more than max_model_len is
    a 400 naming the field."""
    prompt = "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n"
    body = dict(max_tokens=12, temperature=0, echo=True)
    cut = _complete(served.url, prompt=prompt, truncate_prompt_tokens=9, **body)
    tail = _complete(served.url, prompt=prompt[-9:], **body)
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]
    assert cut["choices"][0]["text"].startswith(prompt[-9:])
    assert cut["usage"]["prompt_tokens"] == 9
    context = served.app_server.model.max_model_len
    for keep in (len(prompt), -1, context):
        whole = _complete(served.url, prompt=prompt, truncate_prompt_tokens=keep, **body)
        assert whole["choices"][0]["text"].startswith(prompt)
        assert whole["usage"]["prompt_tokens"] == len(prompt)
    for keep, fragment in ((0, "-1 (as many as max_model_len)"), (context + 1, "max_model_len")):
        r = httpx.post(
            f"{served.url}/v1/completions",
            json={"prompt": prompt, "truncate_prompt_tokens": keep},
            timeout=60,
        )
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "truncate_prompt_tokens"
        assert fragment in error["message"]
    wait_idle(served.url)


def test_x_request_id_names_the_response(served):
    """A client's X-Request-Id (vLLM's) becomes the response's id behind "cmpl-" / "chatcmpl-",
    every streamed chunk's too, and comes back in the same header; without one the server's
    own id does; one that is not printable ASCII without spaces is a 400."""
    url, body = f"{served.url}/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}
    r = httpx.post(url, json=body, headers={"X-Request-Id": "trace-42"}, timeout=120)
    assert r.status_code == 200, r.text
    assert (r.json()["id"], r.headers["x-request-id"]) == ("cmpl-trace-42", "trace-42")
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "stream": True}
    with httpx.stream(
        "POST", f"{served.url}/v1/chat/completions", json=chat,
        headers={"X-Request-Id": "chat-7"}, timeout=120,
    ) as s:  # fmt: skip
        assert s.headers["x-request-id"] == "chat-7"
        events = list(sse_events(s))
    assert events[-1] == DONE and {e["id"] for e in events[:-1]} == {"chatcmpl-chat-7"}
    r = httpx.post(url, json=body, timeout=120)
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]
    for bad in ("two words", "x" * 257):
        r = httpx.post(url, json=body, headers={"X-Request-Id": bad}, timeout=120)
        assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"]
    # vLLM's request_id field names it too, over the header.
    named = {**body, "request_id": "body-9"}
    r = httpx.post(url, json=named, headers={"X-Request-Id": "header-1"}, timeout=120)
    assert (r.json()["id"], r.headers["x-request-id"]) == ("cmpl-body-9", "body-9")
    r = httpx.post(url, json={**body, "request_id": "two words"}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    wait_idle(served.url)


def test_repetition_penalty_off_is_taken_without_penalties(served):
    """This server runs without --penalties: a repetition_penalty of 1 (off) is served as if
    left out; a model whose own default is another one cannot be served by its engine."""
    body = dict(prompt=served.traces[0]["prompt"], max_tokens=8, temperature=0)
    off = _complete(served.url, repetition_penalty=1, **body)["choices"][0]["text"]
    assert off == _complete(served.url, **body)["choices"][0]["text"]
    engine = served.app_server.runner.engine
    with pytest.raises(UserError, match="repetition_penalty 1.05.*--penalties"):
        ServedModel.of_engine(
            engine, MODEL, ByteTokenizer(), SamplingDefaults(repetition_penalty=1.05)
        )


def test_min_tokens_holds_back_stop_tokens_and_strings(served):
    """No stop token ends an answer before min_tokens (the engine bans them there), and a stop
    string counts only once it completes at or after that token."""
    prompt = served.traces[0]["prompt"]  # token ids, whose greedy answer varies
    body = dict(prompt=prompt, max_tokens=40, temperature=0, return_token_ids=True)
    free = _complete(served.url, ignore_eos=True, **body)["choices"][0]
    text, ids = free["text"], free["token_ids"]
    assert bytes(ids).decode() == text  # one byte a token
    at = next(k for k in range(3, len(ids)) if ids[k] not in ids[:k])  # a token's first place
    first = ids[at]
    cut = _complete(served.url, ignore_eos=True, stop_token_ids=[first], **body)["choices"][0]
    assert cut["token_ids"] == ids[: at + 1] and cut["finish_reason"] == "stop"
    held = _complete(
        served.url, ignore_eos=True, stop_token_ids=[first], min_tokens=at + 8, **body
    )["choices"][0]
    tokens = held["token_ids"]
    assert len(tokens) >= at + 8 and first not in tokens[: at + 8]
    assert tokens[:at] == ids[:at] and tokens[at] != first
    # A stop string that the free answer completes before token 12 and again after.
    stop = next(
        s for s in (text[3], " ", "\n", "(", "_", "e")
        if s in text[:11] and s in text[12:]
    )
    late = next(j for j in range(len(text)) if text.startswith(stop, j) and j + len(stop) >= 12)
    for stream in (False, True):
        request = dict(ignore_eos=True, stop=stop, min_tokens=12, stream=stream, **body)
        answer, finish = _text_and_finish(served.url, request)
        assert (answer, finish) == (text[:late], "stop")
    wait_idle(served.url)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_counts_what_the_client_got(served, stream):
    """A stop string cuts the answer and cancels the rest: the metrics count the answer the
    client got (finish reason stop, its tokens, their latencies), not the tokens the engine
    produced before the cancel landed."""
    prompt = "def main():\n    "
    free = _complete(served.url, prompt=prompt, max_tokens=8, temperature=0, ignore_eos=True)
    stop = free["choices"][0]["text"][3:5]
    wait_idle(served.url)
    before = metrics(served.url)
    body = {
        "prompt": prompt,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stop": stop,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    if stream:
        with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as r:
            events = list(sse_events(r))
        assert events[-1] == DONE
        finish, usage = events[-3]["choices"][0]["finish_reason"], events[-2]["usage"]
    else:
        r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        finish, usage = r.json()["choices"][0]["finish_reason"], r.json()["usage"]
    assert finish == "stop" and usage["completion_tokens"] < 8
    after = wait_idle(served.url)

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert grew("dspark:request_success_total{finished_reason=stop}") == 1
    assert grew("dspark:request_success_total{finished_reason=abort}") == 0
    assert grew("dspark:generation_tokens_total") == usage["completion_tokens"]
    assert grew("dspark:prompt_tokens_total") == usage["prompt_tokens"]
    # Every token after the first has one inter-token latency.
    assert grew("dspark:inter_token_latency_seconds_count") == usage["completion_tokens"] - 1


def test_streaming_chat_with_usage_through_the_openai_client(served):
    client = served.client
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "# utils\n"}, {"role": "user", "content": "def "}],
        max_completion_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "# utils\n"}, {"role": "user", "content": "def "}],
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].message.content == text
    assert whole.usage.prompt_tokens == len(b"# utils\ndef ")


def test_tokenize_counts_the_prompt_tokens_a_request_is_charged(served):
    """/tokenize on the serving engine: its count is the usage's prompt_tokens of the same chat
    and completion, its limit the one /v1/models advertises; /detokenize gives the text back."""
    messages = [{"role": "system", "content": "# utils\n"}, {"role": "user", "content": "def "}]
    prompt = "import os\n"
    forms = (({"messages": messages}, "chat/completions"), ({"prompt": prompt}, "completions"))
    for form, path in forms:
        counted = httpx.post(f"{served.url}/tokenize", json={"model": MODEL, **form}, timeout=30)
        assert counted.status_code == 200, counted.text
        body = httpx.post(
            f"{served.url}/v1/{path}", json={"model": MODEL, **form, "max_tokens": 1}, timeout=120
        ).json()
        assert counted.json()["count"] == body["usage"]["prompt_tokens"]
        (card,) = httpx.get(f"{served.url}/v1/models", timeout=30).json()["data"]
        assert counted.json()["max_model_len"] == card["max_model_len"]
    back = httpx.post(f"{served.url}/detokenize", json={"tokens": list(b"def f")}, timeout=30)
    assert back.json() == {"prompt": "def f"}


def test_token_logprobs_whole_streamed_and_through_the_openai_client(served):
    """Each token the answer holds (its token_ids, the end-of-turn token included) has its
    log-probability under the target; streamed chunks carry those of their tokens, and the
    same seeded request gets the same numbers streamed or not, in both endpoints' shapes."""
    body = {**SEEDED, "prompt": "def add(a, b):\n", "max_tokens": 24, "logprobs": 0}
    whole = _complete(served.url, return_token_ids=True, **body)["choices"][0]
    logprobs = whole["logprobs"]
    ids = whole["token_ids"]
    assert len(ids) == 24
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(ids)
    assert logprobs["tokens"] == [ByteTokenizer().decode([t]) for t in ids]
    assert whole["text"].isascii() and "".join(logprobs["tokens"]) == whole["text"]
    assert logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(24)]
    assert all(-50 < lp <= 0 for lp in logprobs["token_logprobs"])
    assert min(logprobs["token_logprobs"]) < -0.1  # sampled at 0.9: not all certain
    assert logprobs["top_logprobs"] == [
        {t: lp} for t, lp in zip(logprobs["tokens"], logprobs["token_logprobs"], strict=True)
    ]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    with httpx.stream(
        "POST", f"{served.url}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        for event in sse_events(r):
            if event != DONE and event["choices"][0]["logprobs"] is not None:
                for key, values in streamed.items():
                    values += event["choices"][0]["logprobs"][key]
    assert streamed == {k: logprobs[k] for k in streamed}
    # Chat: OpenAI's content entries, read by the OpenAI client.
    chat = served.client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=0,
        extra_body={"return_token_ids": True},
    )
    choice = chat.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == len(choice.model_extra["token_ids"])
    assert "".join(e.token for e in entries) == choice.message.content
    assert all(e.bytes == list(e.token.encode()) and e.top_logprobs == [] for e in entries)
    assert all(e.logprob <= 0 for e in entries)
    # With alternatives: as many as asked, likeliest first; greedy, the token is the first.
    chat = served.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    for e in chat.choices[0].logprobs.content:
        values = [a.logprob for a in e.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
    # Completions' legacy dicts hold the alternatives and the token itself.
    three = _complete(served.url, **{**body, "logprobs": 3})["choices"][0]["logprobs"]
    assert three["token_logprobs"] == logprobs["token_logprobs"]  # the same seeded tokens
    for token, lp, alternatives in zip(
        three["tokens"], three["token_logprobs"], three["top_logprobs"], strict=True
    ):
        assert alternatives[token] == lp and lp <= max(alternatives.values())
        assert 1 <= len(alternatives) <= 4  # byte tokens that decode alike share a key
    # Not asked for: null, as before.
    plain = _complete(served.url, prompt="x", max_tokens=2)
    assert plain["choices"][0]["logprobs"] is None


def test_return_tokens_as_token_ids_names_tokens_by_id(served):
    """vLLM's return_tokens_as_token_ids: log-probabilities name each token (and alternative)
    "token_id:<id>", an echoed prompt's too; values, bytes and text offsets are unchanged."""
    prompt = served.traces[1]["prompt"]
    body = dict(prompt=prompt, max_tokens=6, temperature=0, logprobs=2, return_token_ids=True)
    for extra in ({}, {"echo": True}):
        plain = _complete(served.url, **body, **extra)["choices"][0]
        named = _complete(served.url, **body, **extra, return_tokens_as_token_ids=True)
        named = named["choices"][0]
        ids = (prompt if extra else []) + plain["token_ids"]
        assert named["logprobs"]["tokens"] == [f"token_id:{i}" for i in ids]
        assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
        # (the second request maps the first's cached prompt pages: float32 rounding apart)
        values = named["logprobs"]["token_logprobs"]
        assert values == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
        for top in named["logprobs"]["top_logprobs"][bool(extra) :]:
            assert len(top) >= 2 and all(k.startswith("token_id:") for k in top)
    chat = dict(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True)
    chat["top_logprobs"] = 2
    plain = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=120).json()
    chat["return_tokens_as_token_ids"] = True
    named = httpx.post(f"{served.url}/v1/chat/completions", json=chat, timeout=120).json()
    plain, named = (r["choices"][0]["logprobs"]["content"] for r in (plain, named))
    assert [e["bytes"] for e in named] == [e["bytes"] for e in plain]
    assert [e["logprob"] for e in named] == pytest.approx([e["logprob"] for e in plain], abs=1e-5)
    assert all(e["token"].startswith("token_id:") for e in named)
    assert all(t["token"].startswith("token_id:") for e in named for t in e["top_logprobs"])
    wait_idle(served.url)


def test_echo_returns_the_prompt_and_its_tokens_log_probabilities(served):
    """echo with logprobs (what evaluation harnesses send to score a text: max_tokens 1,
    logprobs 1): the prompt's text and tokens come first, the first token without a
    log-probability, each other with its own given those before it and the likeliest there."""
    prompt = "def add(a, b):\n    return"
    body = dict(prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    choice = _complete(served.url, return_token_ids=True, **body)["choices"][0]
    logprobs = choice["logprobs"]
    n = len(prompt.encode()) + 1
    assert choice["text"].startswith(prompt) and len(choice["text"]) == n
    assert logprobs["tokens"] == list(choice["text"])  # one byte per token, ASCII here
    assert logprobs["text_offset"] == list(range(n))
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(-50 < lp <= 0 for lp in logprobs["token_logprobs"][1:])
    for token, lp, alternatives in zip(
        logprobs["tokens"][1:],
        logprobs["token_logprobs"][1:],
        logprobs["top_logprobs"][1:],
        strict=True,
    ):
        assert alternatives[token] == lp and lp <= max(alternatives.values()) + 1e-6
    # Greedy: the answer's token is the likeliest after the prompt.
    (last,) = [lp for t, lp in logprobs["top_logprobs"][-1].items() if t == logprobs["tokens"][-1]]
    assert last == max(logprobs["top_logprobs"][-1].values())
    # The same prompt again, now in the prefix cache: the same numbers (it prefills it all).
    again = _complete(served.url, **body)["choices"][0]["logprobs"]
    np.testing.assert_allclose(
        again["token_logprobs"][1:], logprobs["token_logprobs"][1:], rtol=1e-5, atol=1e-6
    )
    # echo alone: the text, no log-probabilities.
    plain = _complete(served.url, prompt=prompt, max_tokens=2, temperature=0, echo=True)
    assert plain["choices"][0]["text"].startswith(prompt)
    assert plain["choices"][0]["logprobs"] is None


def _streamed_choices(url: str, **body) -> dict[int, list[dict]]:
    """A streamed completion's chunks' choices, by index."""
    choices: dict[int, list[dict]] = {}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={"model": MODEL, "stream": True, **body}, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for event in sse_events(r):
            if event != DONE:
                for choice in event["choices"]:
                    choices.setdefault(choice["index"], []).append(choice)
    return choices


def test_a_streamed_echo_sends_the_prompt_first_and_adds_up_to_the_whole_answer(served):
    """Streamed, each choice's first chunk is its prompt (with logprobs: the prompt tokens',
    offsets from 0), the answer's chunks follow with offsets running on; joined, the text and
    the log-probability lists are the whole response's."""
    prompt = "def add(a, b):\n    return"
    body = dict(prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=2, n=2, seed=3)
    whole = _complete(served.url, **body)["choices"]
    streamed = _streamed_choices(served.url, **body)
    assert sorted(streamed) == [0, 1]
    for index, chunks in streamed.items():
        first = chunks[0]
        assert first["text"] == prompt and first["finish_reason"] is None
        assert first["logprobs"]["text_offset"][0] == 0
        assert first["logprobs"]["token_logprobs"][0] is None
        assert len(first["logprobs"]["tokens"]) == len(prompt.encode())
        assert chunks[-1]["finish_reason"] == whole[index]["finish_reason"] == "length"
        assert "".join(c["text"] for c in chunks) == whole[index]["text"]
        for field in ("tokens", "text_offset", "token_logprobs", "top_logprobs"):
            joined = [x for c in chunks if c["logprobs"] for x in c["logprobs"][field]]
            assert joined == whole[index]["logprobs"][field], field
    # Echo alone, streamed: the prompt's text first, then the answer's, no log-probabilities.
    plain = _streamed_choices(served.url, prompt=prompt, max_tokens=2, temperature=0, echo=True)
    assert plain[0][0]["text"] == prompt and all(c["logprobs"] is None for c in plain[0])


def test_the_next_chat_turn_maps_the_pages_of_the_answer_it_holds(served):
    """A chat's second turn holds the first turn's prompt and answer, and the server kept the
    answer's full pages as well as the prompt's: the second turn prefills only the rest (the
    byte model renders a conversation as its messages' text, and the answer's text encodes to
    the tokens generated)."""
    url = f"{served.url}/v1/chat/completions"
    body = dict(model=MODEL, temperature=0, ignore_eos=True, return_token_ids=True)
    first = [{"role": "user", "content": "# Helpers for paths and files.\ndef "}]
    one = httpx.post(url, json={**body, "messages": first, "max_tokens": 40}, timeout=120).json()
    answer = one["choices"][0]["message"]["content"]
    assert list(answer.encode()) == one["choices"][0]["token_ids"] and len(answer) == 40
    prompt_len = one["usage"]["prompt_tokens"]
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "\n"}]
    two = httpx.post(url, json={**body, "messages": second, "max_tokens": 4}, timeout=120).json()
    assert two["usage"]["prompt_tokens"] == prompt_len + 40 + 1
    # Every full page of the first turn's prompt and answer but the one holding the answer's
    # last token, whose K/V no round wrote.
    cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt_len + 40 - 1) // 16 * 16 > prompt_len // 16 * 16


def test_a_shared_prompt_prefix_is_reported_as_cached_tokens(served):
    """The second prompt starting with the first one's 40 tokens maps their two full pages
    (16 tokens each) from the prefix cache: its usage and the metrics say so, streamed or not,
    and the OpenAI client reads the field."""
    shared = list(b"# A module of small helpers for the OS.\n")
    assert len(shared) == 40
    before = metrics(served.url)
    first = _complete(served.url, prompt=shared + list(b"def a"), max_tokens=4, temperature=0)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    client = served.client
    stream = client.completions.create(
        model=MODEL,
        prompt=shared + list(b"import os"),
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = list(stream)[-1].usage
    assert usage.prompt_tokens == 49 and usage.prompt_tokens_details.cached_tokens == 32
    whole = client.completions.create(
        model=MODEL, prompt=shared + list(b"class P"), max_tokens=4, temperature=0
    )
    assert whole.usage.prompt_tokens_details.cached_tokens == 32
    after = metrics(served.url)
    hits = after["dspark:prefix_cache_hits_total"] - before["dspark:prefix_cache_hits_total"]
    queries = (
        after["dspark:prefix_cache_queries_total"] - before["dspark:prefix_cache_queries_total"]
    )
    assert (hits, queries) == (64, 45 + 49 + 47)
    # A salt keeps a request apart from unsalted ones and other salts (vLLM's `cache_salt`).
    salted = [
        _complete(served.url, prompt=shared + list(b"def b"), max_tokens=4, cache_salt=salt)
        for salt in ("tenant-1", "tenant-1", "tenant-2")
    ]
    assert [s["usage"]["prompt_tokens_details"]["cached_tokens"] for s in salted] == [0, 32, 0]
    r = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": MODEL, "prompt": "x", "cache_salt": ""},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_n_choices_are_what_their_seeds_draw_alone(served):
    """n choices of one prompt decode side by side; choice j is what the request alone draws
    with seed + j (choice 0: the offline engine's answer), and the usage counts the prompt once
    and every choice's tokens."""
    prompt = "def parse_args(argv):\n"
    three = _complete(served.url, prompt=prompt, return_token_ids=True, n=3, **SEEDED)
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    ids = [c["token_ids"] for c in three["choices"]]
    assert ids[0] == served.offline_seeded
    for j in (1, 2):
        alone = _complete(
            served.url, prompt=prompt, return_token_ids=True, **{**SEEDED, "seed": 1234 + j}
        )
        assert ids[j] == alone["choices"][0]["token_ids"]
    assert len({tuple(i) for i in ids}) == 3  # the seeds differ, so do the answers
    usage = three["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == 3 * SEEDED["max_tokens"]
    assert usage["total_tokens"] == len(prompt) + 3 * SEEDED["max_tokens"]


def test_several_prompts_get_n_choices_each_in_openai_order(served):
    """A list of prompts: choice i * n + j is prompt i's j-th, greedy ones equal to the offline
    engine's answer for that prompt (two prompts x two choices, more than the slots' share)."""
    traces = served.traces[:2]
    body = _complete(
        served.url,
        prompt=[t["prompt"] for t in traces],
        n=2,
        max_tokens=96,
        temperature=0,
        return_token_ids=True,
    )
    got = [c["token_ids"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert got == [served.offline_greedy[0]] * 2 + [served.offline_greedy[1]] * 2
    assert body["usage"]["prompt_tokens"] == sum(len(t["prompt"]) for t in traces)
    assert body["usage"]["completion_tokens"] == sum(len(ids) for ids in got)


def test_streamed_choices_carry_their_index_and_end_one_by_one(served):
    """A streamed chat with n = 2: each choice opens with the assistant role, its deltas and a
    last chunk with its finish reason, interleaved as they come; then one usage chunk and one
    [DONE]. Each choice's text is the whole answer's."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "def "}],
        "n": 2,
        "temperature": 0.8,
        "seed": 7,
        "max_tokens": 30,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    texts, roles, finishes, events = ["", ""], [0, 0], [None, None], []
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = list(sse_events(r))
    assert events[-1] == DONE and events.count(DONE) == 1
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 60
    for event in events[:-2]:
        (choice,) = event["choices"]
        i = choice["index"]
        assert finishes[i] is None  # nothing of a choice after its last chunk
        roles[i] += choice["delta"].get("role") == "assistant"
        texts[i] += choice["delta"].get("content", "")
        finishes[i] = choice["finish_reason"]
    assert roles == [1, 1] and finishes == ["length", "length"]
    whole = httpx.post(
        f"{served.url}/v1/chat/completions",
        json={k: v for k, v in body.items() if k not in ("stream", "stream_options")},
        timeout=120,
    ).json()
    assert [c["message"]["content"] for c in whole["choices"]] == texts
    assert texts[0] != texts[1]


def test_continuous_usage_counts_the_tokens_sent_so_far(served):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far, its
    completion tokens those of the chunks sent up to it (both choices'), the last one the
    stream's final usage."""
    body = {
        "model": MODEL,
        "prompt": "def ",
        "n": 2,
        "temperature": 0.8,
        "seed": 3,
        "max_tokens": 25,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = list(sse_events(r))
    assert events[-1] == DONE
    final = events[-2]["usage"]
    chunks = events[:-2]
    assert len(chunks) > 4 and final["completion_tokens"] == 50
    sent = 0
    for chunk in chunks:
        (choice,) = chunk["choices"]
        sent += len(choice["token_ids"] or [])
        assert chunk["usage"]["completion_tokens"] == sent
        assert chunk["usage"]["prompt_tokens"] == final["prompt_tokens"] == 4
        assert chunk["usage"]["total_tokens"] == 4 + sent
    assert chunks[-1]["usage"] == final
    # Without include_usage there is no usage to send continuously: refused, not ignored.
    body["stream_options"] = {"continuous_usage_stats": True}
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream_options.continuous_usage_stats"
    assert "needs include_usage: true" in r.json()["error"]["message"]


def test_client_disconnect_cancels_its_request(served):
    before = metrics(served.url).get("dspark:request_success_total{finished_reason=abort}", 0)
    # 480 tokens take several tenths of a second even on a fast host: both give up long before.
    body = {"prompt": "while True:\n", "max_tokens": 480, "ignore_eos": True, "stream": True}
    body["n"] = 2  # both choices end with the connection
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as r:
        events = sse_events(r)
        next(events)
        next(events)
    # A non-streaming client that gives up (read timeout) closes its connection too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{served.url}/v1/completions",
            json={"prompt": "while True:\n", "max_tokens": 480, "ignore_eos": True},
            timeout=httpx.Timeout(10, read=0.2),
        )
    after = wait_idle(served.url)
    assert wait_until(lambda: not served.app_server.live, 10)
    assert after["dspark:request_success_total{finished_reason=abort}"] == before + 3


def test_full_queue_answers_503_at_once(served):
    batcher = served.app_server.runner.batcher
    limit = batcher.max_waiting
    log: list = []
    clients = _clients(served.url, SMALL_ENGINE.num_slots)
    body = dict(prompt="x", max_tokens=480, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(SMALL_ENGINE.num_slots) as pool:
        streams = [  # every slot busy
            pool.submit(_stream_tokens, c, log, f"s{i}", **body) for i, c in enumerate(clients)
        ]
        assert wait_until(lambda: len(log) >= SMALL_ENGINE.num_slots, 120, interval=0.001)
        batcher.max_waiting = 0  # a queue with no room left
        try:
            t0 = time.monotonic()
            refused = httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)
            waited = time.monotonic() - t0
            # Room for one of three choices: all or nothing, the one queued is taken back.
            batcher.max_waiting = 1
            partly = httpx.post(f"{served.url}/v1/completions", json={**body, "n": 3}, timeout=120)
            # The one queued is cancelled, not left to take a slot when one frees.
            assert wait_until(lambda: batcher.num_waiting == 0, 10)
        finally:
            batcher.max_waiting = limit
        for f in streams:
            assert f.result()["finish_reason"] == "length"
    assert refused.status_code == 503
    assert waited < 5
    assert refused.headers["retry-after"] == "1"
    assert "queue is full" in refused.json()["error"]["message"]
    assert partly.status_code == 503 and "queue is full" in partly.json()["error"]["message"]
    wait_idle(served.url)


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        (b'{"prompt": "x", "temperature": 1e400}', 400, "finite"),
        (b'{"prompt": "x", "top_p": NaN}', 400, "finite"),
        (b'{"prompt": "x", "temperature": "hot"}', 400, "temperature"),
        (b'{"prompt": "x", "max_tokens": 100000000000000000000}', 400, "max_tokens"),
        (b'{"prompt": "x", "max_tokens": 600}', 400, "max_model_len"),
        (b'{"prompt": "x", "seed": 9223372036854775808}', 400, "seed"),
        (b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
        (b'{"prompt": "x", "n": 0}', 400, "n: input should be greater than or equal to 1"),
        (b'{"prompt": "x", "n": 200}', 400, "n: input should be less than or equal to 128"),
        (b'{"prompt": "x", "n": 100}', 400, "100 choices (n 100) are more than"),
        (b'{"prompt": "x", "stream": 1}', 400, "stream"),
        (b'{"prompt": "x", "frobnicate": true}', 400, "frobnicate"),
        (b'{"prompt": [1, 2, 300]}', 400, "0..287 (the vocabulary)"),
        (b'{"prompt": ""}', 400, "empty"),
        (b'{"prompt": ["a", ""]}', 400, "prompt 1 of the 2 is empty"),
        (
            json.dumps({"prompt": "x", "stop_token_ids": [*range(1, 18)]}).encode(),
            400,
            "limit of 16",
        ),
        # What json.dumps writes for a lone surrogate (the strict parser blames an escape).
        (
            json.dumps({"prompt": "\ud800", "max_tokens": 2}).encode(),
            400,
            "unpaired UTF-16 surrogate",
        ),
        (b'{"prompt": "\\udc00x", "max_tokens": 2}', 400, "unpaired UTF-16 surrogate"),
        (b'{"prompt": "x", "stop": [' + b"[" * 300 + b"]" * 300 + b"]}", 400, "recursion limit"),
        (b'{"prompt": [5, 99999]}', 400, "vocabulary"),
        (b'{"prompt": "x", "stop_token_ids": [99999]}', 400, "vocabulary"),
        (b'{"prompt": "x", "model": "gpt-4"}', 404, "does not exist"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "recursion"),
        (b'{"prompt": "x",', 400, "JSON"),
        (b"\xff\xfe\x00", 400, "JSON"),
        (b"", 400, "body is required"),
        (b"[]", 400, "object"),
    ],
)
def test_bad_completion_bodies_get_4xx(served, body, status, fragment):
    r = httpx.post(
        f"{served.url}/v1/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment.lower() in error["message"].lower(), error
    assert error["type"]


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


@pytest.mark.parametrize(
    "path, body, param, fragment",
    [
        ("completions", {"prompt": "x", "n": 1.5}, "n", "valid integer"),
        ("completions", {"prompt": "x", "logprobs": 6}, "logprobs", "less than or equal to 5"),
        # This server runs without --penalties (test_serve_command.py's runs with).
        ("completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "penalties"),
        ("completions", {"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty", "-2"),
        ("completions", {"prompt": "x", "repetition_penalty": 1.2}, "repetition_penalty", "1)"),
        ("completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "than 0"),
        # ... nor with --max-logit-bias.
        ("completions", {"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias", "--max-logit-bias"),
        ("completions", {"prompt": "x", "allowed_token_ids": [5]}, "allowed_token_ids",
         "--max-logit-bias N"),
        ("completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids",
         "at least 1 item"),
        ("completions", {"prompt": "x", "logit_bias": {"05": 1}}, "logit_bias.05", "pattern"),
        ("completions", {"prompt": "x", "logit_bias": {"5": -101}}, "logit_bias.5", "-100"),
        ("completions", {"prompt": "x", "logit_bias": {"5": "1"}}, "logit_bias.5", "number"),
        ("completions", {"prompt": "x", "store": True}, "store", "true is not supported"),
        ("completions", {"prompt": "x", "min_tokens": -1}, "min_tokens", "greater than or equal"),
        # min_tokens within the request's limit: the one it gives, or its endpoint's default.
        ("completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens", "max_to"),
        ("completions", {"prompt": "x", "min_tokens": 17}, "min_tokens", "the 16 tokens"),
        (
            "chat/completions",
            {"messages": CHAT, "max_completion_tokens": 2, "min_tokens": 3},
            "min_tokens",
            "max_completion_tokens 2",
        ),
        ("completions", {"prompt": "x", "stop": 5}, "stop", "a string or an array of strings"),
        ("completions", {"prompt": "x", "stop": ["a", ""]}, "stop.1", "at least 1 character"),
        ("completions", {"prompt": [1, "a"]}, "prompt.1", "valid integer"),
        ("completions", {"prompt": "x", "stream_options": {}}, "stream_options", "stream: true"),
        (
            "chat/completions",
            {"messages": CHAT, "top_logprobs": 5},
            "top_logprobs",
            "needs logprobs",
        ),
        (
            "chat/completions",
            {"messages": CHAT, "tools": TOOLS, "tool_choice": {"type": "function",
             "function": {"name": "g"}}},
            "tool_choice",
            "names 'g', which is not among the tools (f)",
        ),
        ("chat/completions", {"messages": CHAT, "service_tier": "flex"}, "service_tier", "flex"),
        (
            "chat/completions",
            {"messages": CHAT, "reasoning_effort": "low"},
            "reasoning_effort",
            "low",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            "messages.0.content",
            "a string or an array of text parts",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user"}]},
            "messages.0.content",
            "needs content",
        ),
    ],
)
def test_refusals_name_the_field_in_one_message(served, path, body, param, fragment):
    r = httpx.post(f"{served.url}/v1/{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ") and ";" not in error["message"]
    assert fragment in error["message"]


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"prompt": [5, 99999]}, "prompt", "prompt ids must lie in 0..287"),
        # Of several prompts, the one refused (after the first was queued, and taken back).
        ({"prompt": [[5], [5, 99999]]}, "prompt.1", "prompt ids must lie in 0..287"),
        ({"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids", "stop token ids must"),
        ({"prompt": "x", "stop_token_ids": list(range(1, 18))}, "stop_token_ids", "exceed"),
    ],
)
def test_refusals_of_the_engine_name_the_field_too(served, body, param, fragment):
    """The checks the engine makes at submit (vocabulary, stop ids) name the body's field
    like the schema's own refusals (param was null)."""
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_nulls_neutral_values_and_every_role_are_accepted(served):
    nulls = dict(n=None, stream=None, ignore_eos=None, return_token_ids=None)
    r = httpx.post(
        f"{served.url}/v1/completions",
        json={"prompt": "x", "max_tokens": 4, "echo": None, "store": False, **nulls},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert "token_ids" not in r.json()["choices"][0]
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "system", "content": "# tools\n"},
        {"role": "user", "content": "what is 2+2?"},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "4", "tool_call_id": "call_1", "name": "add"},
    ]
    neutral = dict(
        store=False,
        parallel_tool_calls=False,
        metadata={"team": "search"},
        service_tier="auto",
        user="u1",
        safety_identifier="u1-hash",
        prompt_cache_key="chat-v1",
        response_format={"type": "text"},
        reasoning_effort=None,
        tools=[],
        tool_choice="none",
    )
    r = httpx.post(
        f"{served.url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 4, **nulls, **neutral},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_streamed_chat_deltas_have_no_null_fields(served):
    body = {"messages": CHAT, "max_tokens": 6, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=60) as r:
        deltas = [e["choices"][0]["delta"] for e in sse_events(r) if e != DONE]
    assert deltas[0] == {"role": "assistant"}
    assert deltas[-1] == {}
    assert all(set(d) == {"content"} and d["content"] for d in deltas[1:-1])


def test_bad_chat_bodies_and_routes_get_4xx(served):
    url = served.url
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "wizard"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
    )
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/v1/completions").status_code == 405
    r = httpx.get(f"{url}/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    c = _open(url)
    try:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 67108864\r\n\r\n")
        assert _answer(c).startswith(b"HTTP/1.1 413")
    finally:
        c.close()


def _open(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _answer(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_heads_time_out_without_a_thread_each(served):
    timeouts_before = metrics(served.url).get("dspark:http_responses_total{code=408}", 0)
    threads = threading.active_count()
    clients = [_open(served.url) for _ in range(60)]
    try:
        for c in clients:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        # The server still answers others at once, and holds no thread per slow client.
        t0 = time.monotonic()
        assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
        assert time.monotonic() - t0 < 1.0
        assert threading.active_count() - threads < 5
        for c in clients[:30]:  # half of them keep dribbling: the deadline is not reset by bytes
            c.sendall(b"X-")
        t0 = time.monotonic()
        answers = [_answer(c) for c in clients]
        waited = time.monotonic() - t0
    finally:
        for c in clients:
            c.close()
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), {a[:40] for a in answers}
    assert waited < READ_TIMEOUT_S + 5
    # Each an OpenAI error object, each counted.
    error = json.loads(answers[0].split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "timeout" and "request head did not arrive" in error["message"]
    timeouts = metrics(served.url)["dspark:http_responses_total{code=408}"]
    assert timeouts - timeouts_before == len(clients)


def test_short_bodies_time_out_with_408_without_a_thread_each(served):
    threads = threading.active_count()
    clients = [_open(served.url) for _ in range(30)]
    try:
        for c in clients:
            c.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n" + b'{"prompt": "x"'
            )
        assert threading.active_count() - threads < 5
        t0 = time.monotonic()
        answers = [_answer(c) for c in clients]
        waited = time.monotonic() - t0
    finally:
        for c in clients:
            c.close()
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers), {a[:40] for a in answers}
    assert all(b"did not arrive" in a for a in answers)
    assert waited < READ_TIMEOUT_S + 5


def test_short_load_run(served):
    """16 clients for a few rounds each: streaming, cancelled and plain requests with rotating
    temperatures and top-p. No errors, no refused connection, no compilation, nothing leaks."""
    compiles = compile_count()
    before_all = metrics(served.url)
    codes_before = {k: v for k, v in before_all.items() if "http_responses_total" in k}
    temperatures = (0.0, 0.5, 0.8, 1.0, 1.3)
    top_ps = (1.0, 0.9, 0.7)

    def client(i: int) -> list[str]:
        outcomes = []
        with httpx.Client(base_url=served.url, timeout=300) as http:
            for j in range(3):
                k = i * 3 + j
                body = {
                    "prompt": f"def f{k}(x):\n",
                    "max_tokens": (8, 16, 32)[k % 3],
                    "temperature": temperatures[k % 5],
                    "top_p": top_ps[k % 3],
                    "seed": k,
                }
                kind = ("stream", "cancel", "plain")[(i + j) % 3]
                if kind == "plain":
                    r = http.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    outcomes.append(r.json()["choices"][0]["finish_reason"])
                    continue
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    events = sse_events(r)
                    first = next(events)
                    if kind == "cancel":
                        outcomes.append("cancelled")
                        continue
                    last = [first, *events]
                    assert last[-1] == DONE
                    outcomes.append(last[-2]["choices"][0]["finish_reason"])
        return outcomes

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outcomes = [o for f in [pool.submit(client, i) for i in range(16)] for o in f.result()]
    assert len(outcomes) == 48
    assert set(outcomes) <= {"stop", "length", "cancelled"}
    after = wait_idle(served.url)
    assert wait_until(lambda: not served.app_server.live, 10)  # no request left behind
    codes = {k: v - codes_before.get(k, 0) for k, v in after.items() if "http_responses_total" in k}
    assert all(v == 0 for k, v in codes.items() if "code=5" in k), codes
    assert compile_count() == compiles
    slot_turns = after["dspark:slot_rounds_total"] - before_all["dspark:slot_rounds_total"]
    rounds = after["dspark:device_rounds_total"] - before_all["dspark:device_rounds_total"]
    assert 0 < slot_turns <= rounds * SMALL_ENGINE.num_slots  # occupancy in (0, 1]

    def grew(name: str) -> float:
        return after[name] - before_all.get(name, 0)

    # Each request was admitted once; 16 clients on 4 slots queue, and a request's wait for a
    # slot is part of its time to first token.
    queue, ttft = "dspark:request_queue_time_seconds", "dspark:time_to_first_token_seconds"
    assert grew(f"{queue}_count") == grew(f"{ttft}_count") == 48
    assert 0 < grew(f"{queue}_sum") < grew(f"{ttft}_sum")
    # Per request, the tokens the totals count: each finished request observed once.
    finished = sum(grew(k) for k in after if k.startswith("dspark:request_success_total{"))
    for kind in ("prompt", "generation"):
        assert grew(f"dspark:request_{kind}_tokens_count") == finished == 48
        assert grew(f"dspark:request_{kind}_tokens_sum") == grew(f"dspark:{kind}_tokens_total") > 0
