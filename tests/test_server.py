"""The HTTP server: batched answers equal direct `generate`, streaming, errors, shutdown."""

import http.client
import json
import threading

import pytest

from dspark_jax import cli
from dspark_jax.checkpoints.converted import load_decoding_models
from dspark_jax.decoding.engine import Engine, EngineConfig
from dspark_jax.decoding.generate import Request, generate
from dspark_jax.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET
from dspark_jax.sampling import SamplingConfig
from dspark_jax.serving.server import (
    DSparkServer,
    ServerClosedError,
    ServerConfig,
    parse_generate,
)
from dspark_jax.serving.text_stream import TextStream
from dspark_jax.tokenizer import ByteTokenizer

# One batch bucket keeps compilation to one program set per engine.
CFG = ServerConfig(
    batch_size=4,
    max_wait_s=0.3,
    engine=EngineConfig(
        max_len=160, max_new_tokens=40, rounds_per_chunk=2, batch_buckets=(4,), prompt_buckets=(64,)
    ),
)
PROMPTS = [
    b" the feature in question, but may continue to us",
    b" to debug a statement or an expression.\n    # Bo",
    b"def parse_args(argv=None):\n",
    b"import os\nimport sys\n\n",
]
NEW_TOKENS = [40, 31, 25, 17]


@pytest.fixture(scope="module")
def served():
    model = load_decoding_models(EMBEDDED_TARGET, EMBEDDED_DRAFT)
    server = DSparkServer(model, CFG, port=0).start()
    yield model, server
    server.shutdown()


@pytest.fixture(scope="module")
def reference(served):
    model, _ = served
    engine = Engine(
        model.target,
        model.drafter,
        CFG.engine,
        SamplingConfig(),
        stop_tokens=model.stop_tokens,
    )
    requests = [Request(list(p), n) for p, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
    return generate(engine, requests, batch_size=4)[0]


def _post(server, body, path="/v1/generate", raw=None):
    conn = http.client.HTTPConnection(*server.address, timeout=60)
    payload = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, body=payload, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, resp.getheader("Content-Type"), data


def _post_json(server, body, **kw):
    status, _, data = _post(server, body, **kw)
    return status, json.loads(data)


def test_concurrent_greedy_requests_match_generate(served, reference):
    _, server = served
    batches_before = server.worker.batches_run
    answers = [None] * len(PROMPTS)

    def call(i):
        body = {"prompt": PROMPTS[i].decode(), "max_new_tokens": NEW_TOKENS[i]}
        answers[i] = _post_json(server, body)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (status, answer), expected in zip(answers, reference, strict=True):
        assert status == 200, answer
        assert answer["token_ids"] == expected.tokens
        assert answer["text"] == bytes(t for t in expected.tokens if t < 256).decode()
        assert answer["finish_reason"] == expected.finish_reason
        assert answer["tau"] == pytest.approx(expected.tau)
        assert answer["rounds"] == expected.rounds
        assert answer["usage"]["completion_tokens"] == len(expected.tokens)
        assert answer["usage"]["prompt_tokens"] == expected.prompt_len
    assert any(a["tau"] > 1.5 for _, a in answers)
    # Requests sent together within max_wait_s share batches (one, unless a thread started late).
    assert server.worker.batches_run - batches_before < len(PROMPTS)


def test_plain_decoding_and_token_ids_input(served, reference):
    """Greedy plain decoding equals greedy speculative decoding (lossless at temperature 0)."""
    _, server = served
    status, answer = _post_json(
        server,
        {"token_ids": list(PROMPTS[0]), "speculative": False, "max_new_tokens": NEW_TOKENS[0]},
    )
    assert status == 200, answer
    assert answer["token_ids"] == reference[0].tokens
    assert answer["tau"] == 1.0
    assert answer["rounds"] == NEW_TOKENS[0] - 1  # the first token comes from prefill


def test_streaming_matches_plain_answer(served, reference):
    _, server = served
    body = {
        "messages": [{"role": "user", "content": PROMPTS[1].decode()}],
        "max_new_tokens": NEW_TOKENS[1],
        "stream": True,
    }
    status, content_type, data = _post(server, body)
    assert status == 200
    assert content_type == "text/event-stream"
    events = [
        json.loads(block.removeprefix("data: ")) for block in data.decode().split("\n\n") if block
    ]
    *chunks, final = events
    assert final["done"] is True
    assert len(chunks) > 1  # several decode chunks arrived separately
    assert [t for c in chunks for t in c["token_ids"]] == reference[1].tokens
    assert "".join(c["delta"] for c in chunks) == final["text"]
    assert final["token_ids"] == reference[1].tokens


def test_sampled_requests_depend_on_seed_only(served):
    _, server = served
    body = {"prompt": PROMPTS[2].decode(), "max_new_tokens": 24, "temperature": 1.0, "top_p": 0.95}
    first = _post_json(server, {**body, "seed": 7})
    again = _post_json(server, {**body, "seed": 7})
    other = _post_json(server, {**body, "seed": 8})
    assert first[0] == again[0] == other[0] == 200
    assert first[1]["token_ids"] == again[1]["token_ids"]
    assert first[1]["token_ids"] != other[1]["token_ids"]


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"prompt": "x" * 130}, "max_len"),  # fits no cache: the engine's own message
        ({"prompt": "x", "max_new_tokens": 41}, "max_new_tokens 41"),
        ({"prompt": "x", "temprature": 0.5}, "unknown fields ['temprature']"),
        ({"prompt": "x", "token_ids": [1]}, "exactly one of"),
        ({"token_ids": [1, 300]}, "token_ids must be ints"),
        ({"prompt": "x", "temperature": -1}, "temperature must be >= 0"),
        ({"prompt": "x", "max_new_tokens": True}, "'max_new_tokens' must be int"),
        ({"messages": [{"content": "hi"}]}, "message 0"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_requests_are_400_with_a_message(served, body, fragment):
    _, server = served
    status, answer = _post_json(server, body)
    assert status == 400
    assert fragment in answer["error"]


def test_bad_json_unknown_path_and_health(served):
    _, server = served
    status, answer = _post_json(server, None, raw=b"{not json")
    assert status == 400 and "not valid JSON" in answer["error"]
    assert _post_json(server, {}, path="/v2/nothing")[0] == 404
    conn = http.client.HTTPConnection(*server.address, timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    health = json.loads(resp.read())
    conn.request("GET", "/missing")
    missing = conn.getresponse()
    missing.read()
    conn.close()
    assert resp.status == 200 and health["status"] == "ok"
    assert health["model"]["block_size"] == 7 and health["model"]["stop_tokens"] == [256]
    assert missing.status == 404


def test_greedy_requests_share_one_engine_key(served):
    model, _ = served
    params = parse_generate({"prompt": "ab", "top_k": 5, "top_p": 0.5, "seed": 3}, model, CFG)
    assert params.sampling == SamplingConfig()
    assert params.prompt_ids == [97, 98] and params.max_new_tokens == CFG.engine.max_new_tokens
    sampled = parse_generate({"prompt": "ab", "temperature": 0.5, "top_k": 5}, model, CFG)
    assert sampled.sampling == SamplingConfig(temperature=0.5, top_k=5)


def test_text_stream_holds_back_split_characters():
    stream = TextStream(ByteTokenizer())
    euro = list("€".encode())
    assert stream.push([ord("a"), euro[0]]) == "a"
    assert stream.push(euro[1:]) == "€"
    assert stream.push([euro[0]]) == ""
    assert stream.flush() == "\ufffd"


def test_shutdown_refuses_new_work(served):
    model, _ = served
    server = DSparkServer(model, CFG, port=0).start()
    host, port = server.address
    server.shutdown(timeout=10)
    with pytest.raises(ServerClosedError):
        server.worker.submit(Request([1, 2, 3], 4), SamplingConfig(), True)
    with pytest.raises(OSError):
        http.client.HTTPConnection(host, port, timeout=2).request("GET", "/health")


def test_cli_lists_serve(capsys):
    assert cli.main(["serve", "--help"]) == 0
    assert "--batch-size" in capsys.readouterr().out
