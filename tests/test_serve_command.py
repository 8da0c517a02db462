"""`dspark-jax serve` as a real process: the official openai client, start-up validation, drain.

One server process on the byte-level fixture pair serves the openai-client checks (models,
completions and chat, streaming and not, mixed temperatures / top-p / seeds in flight together),
then takes a SIGTERM with requests running and queued: the queued ones get 503, the running ones
finish, the process exits 0. Bad settings fail before anything loads, in one line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import subprocess
import time

import httpx
import numpy as np
import openai
import pytest
from serving_helpers import (
    DONE,
    FIXTURE_SERVE_FLAGS,
    SMALL_SERVE_FLAGS,
    metrics,
    serve_command,
    sse_events,
    wait_until,
)

from dspark_jax.cli import serve as command
from dspark_jax.errors import UserError

MODEL = "tiny-vanilla"
# Long enough that the running requests are still running when the drain starts.
MAX_MODEL_LEN = 2048
LONG_TOKENS = 1900


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--rounds-per-chunk", "0"], "--rounds-per-chunk must be >= 1"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--max-num-seqs", "1000000"], "--max-num-seqs must be <="),
        (["--kv-pages", "-3"], "--kv-pages must be >= 1"),
        (["--max-model-len", "0"], "--max-model-len must be >= 1"),
        (["--max-waiting", "0"], "--max-waiting must be >= 1"),
        (["--read-timeout", "nan"], "--read-timeout must be > 0"),
        (["--read-timeout", "0"], "--read-timeout must be > 0"),
        (["--drain-timeout", "inf"], "--drain-timeout must be >= 0"),
        (["--sps-table", "/no/such/sps.json"], "no such file"),
        (["--sts", "/no/such/sts.json"], "no such file"),
        (["--draft", "somewhere"], "needs its target"),
        (["--no-draft", "--policy", "threshold", "--threshold", "0.5"], "need a drafter"),
        (["--token-buckets", "8,x"], "comma-separated integers"),
        (["--prefill-buckets", "0"], "positive integers"),
        (["--max-num-seqs", "8", "--draft-buckets", "2,4"], "must end at --max-num-seqs 8"),
        (["--no-draft", "--draft-buckets", "8"], "--draft-buckets needs a drafter"),
        (["--api-key", " "], "--api-key is empty; give a key"),
    ],
)
def test_bad_settings_are_refused_before_loading(argv, fragment):
    with pytest.raises(UserError, match=fragment):
        command.check_arguments(_args(*argv))


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--host", "no-such-host.invalid"], "cannot resolve"),
        (["--max-model-len", "100000"], "max_position_embeddings"),
        (["--max-model-len", "4090"], "use at most 4088"),  # 4096 less one block of 7 + 1
        (["--kv-pages", "3"], "cannot hold one request"),
        (["--max-num-seqs", "60000", "--max-model-len", "4088"], "lower --kv-pages"),
        # The embedded pair's template knows no tools: the model would never see them.
        (["--tool-call-parser", "hermes"], "does not render tools"),
    ],
)
def test_bad_settings_are_refused_before_serving(argv, fragment):
    """Checked after the socket or the models, still before warm-up: no compilation, no wait."""
    with pytest.raises(UserError, match=fragment):
        command.run(_args("--port", "0", *argv))


def _start(tmp_path, *flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        serve_command(
            "--port=0", "--log-level=warning", *FIXTURE_SERVE_FLAGS, *SMALL_SERVE_FLAGS, *flags
        ),
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )
    line = proc.stdout.readline()
    assert "serving tiny-vanilla" in line, (line, (tmp_path / "serve.log").read_text())
    keyed = env is not None and command.API_KEY_ENV in env
    assert ("/v1 (API key required) -- " in line) is keyed, line
    caching = "off" if "--no-prefix-caching" in flags else "on"
    parser = "; reasoning parser qwen3" if "--reasoning-parser=qwen3" in flags else ""
    assert f"prefix caching {caching}{parser})" in line, line
    url = line.split(" on ")[1].split("/v1")[0]
    return proc, url


def _openai_checks(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    # --max-model-len is what /v1/models advertises and what a request may use, prompt + answer.
    card = client.models.list().data[0]
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    # vLLM's root: the model the served name stands for, as --target gave it.
    assert f"--target={card.model_extra['root']}" in FIXTURE_SERVE_FLAGS
    assert card.model_extra["parent"] is None
    full = client.completions.create(
        model=MODEL,
        prompt=[65],
        max_tokens=MAX_MODEL_LEN - 1,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert full.usage.total_tokens == MAX_MODEL_LEN
    greedy = client.completions.create(
        model=MODEL, prompt="def add(a, b):\n", max_tokens=24, temperature=0
    )
    assert greedy.choices[0].finish_reason in ("stop", "length")
    assert greedy.usage.prompt_tokens == len(b"def add(a, b):\n")

    def completion(stream: bool, **kw):
        if not stream:
            r = client.completions.create(model=MODEL, prompt="import ", max_tokens=32, **kw)
            return r.choices[0].text, r.choices[0].finish_reason
        chunks = list(
            client.completions.create(
                model=MODEL, prompt="import ", max_tokens=32, stream=True, **kw
            )
        )
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    def chat(stream: bool, **kw):
        messages = [{"role": "user", "content": "for x in "}]
        if not stream:
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, **kw)
            return r.choices[0].message.content, r.choices[0].finish_reason
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=32, stream=True, **kw
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        return text, chunks[-1].choices[0].finish_reason

    allowed = {"allowed_token_ids": [66, 67]}
    jobs = [
        (completion, True, dict(temperature=0.7, top_p=0.9, seed=1)),
        (completion, False, dict(temperature=0.7, top_p=0.9, seed=1)),
        (completion, False, dict(temperature=1.2, seed=2)),
        (chat, True, dict(temperature=0.0)),
        (chat, False, dict(temperature=0.0)),
        (chat, True, dict(temperature=0.5, top_p=0.8, seed=3)),
        (chat, False, dict(temperature=0.5, top_p=0.8, seed=3)),
        (completion, True, dict(temperature=1.0, top_p=0.5, seed=4)),
        # The server runs with --penalties.
        (completion, True, dict(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5)),
        (completion, False, dict(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5)),
        (completion, False, dict(temperature=0.0)),
        # ... and --max-logit-bias: byte 65 ("A") pushed up by 100 is every token.
        (completion, True, dict(temperature=0.0, logit_bias={"65": 100})),
        (completion, False, dict(temperature=0.8, seed=5, logit_bias={"65": 100, "32": -100})),
        # ... which also apply a repetition penalty (vLLM's field, beyond the OpenAI client's).
        (completion, True, dict(temperature=0.0, extra_body={"repetition_penalty": 1.5})),
        (completion, False, dict(temperature=0.0, extra_body={"repetition_penalty": 1.5})),
        # ... and vLLM's allowed_token_ids, which --max-logit-bias holds too: "B" and "C" only.
        (completion, True, dict(temperature=1.0, seed=6, extra_body=allowed)),
    ]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(fn, stream, **kw) for fn, stream, kw in jobs]
        answers = [f.result() for f in futures]
    for text, finish in answers:
        assert finish in ("stop", "length")
        assert text or finish == "stop"
    # The same request streamed or not, concurrently with the others: the same answer.
    assert answers[0] == answers[1]
    assert answers[3] == answers[4]
    assert answers[5] == answers[6]
    assert answers[8] == answers[9] != answers[10]  # the penalties change the greedy answer
    assert answers[11] == answers[12] == ("A" * 32, "length")
    assert answers[13] == answers[14] != answers[10]
    restricted, finish = answers[15]
    assert set(restricted) == {"B", "C"} and (len(restricted), finish) == (32, "length")
    # More allowed tokens than the 2 the server holds per request: a 400 naming the field.
    refused = httpx.post(
        f"{url}/v1/completions",
        json={"model": MODEL, "prompt": "x", "allowed_token_ids": [65, 66, 67]},
        timeout=60,
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "allowed_token_ids" and "holds at most 2" in error["message"]


def _stream_until_done(url: str, first_token: list) -> dict:
    body = {"prompt": "x", "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        events = list(_note_first(sse_events(r), first_token))
    return {"done": events[-1] == DONE, "finish": events[-2]["choices"][0]["finish_reason"]}


def _note_first(events, first_token: list):
    for i, e in enumerate(events):
        if i == 0:
            first_token.append(True)
        yield e


@pytest.mark.optimized
def test_serve_openai_client_and_sigterm_drain(tmp_path):
    # JAX logs each compilation: the compile counter must count as many, loading's included (it
    # started listening only with the metrics, after the models had loaded: 8 of 16).
    # With the reasoning parser: the byte model writes no think block, so its chat answers are
    # all content, as without it (and the startup line says the parser is on).
    proc, url = _start(
        tmp_path,
        f"--max-model-len={MAX_MODEL_LEN}",
        "--reasoning-parser=qwen3",
        "--penalties",
        "--max-logit-bias=2",
        env={"JAX_LOG_COMPILES": "1"},
    )
    try:
        statuses = []

        def healthy() -> bool:
            try:
                statuses.append(httpx.get(f"{url}/health", timeout=5).status_code)
            except httpx.TransportError:
                return False
            return statuses[-1] == 200

        assert wait_until(healthy, 600, interval=0.2), (tmp_path / "serve.log").read_text()
        assert statuses[0] == 503  # warming up: listening, not yet compiled
        logged = (tmp_path / "serve.log").read_text().count("Finished XLA compilation of")
        assert logged > 0
        assert metrics(url)["dspark:jax_compilations_total"] == logged

        # A second server on the same port: one line, no traceback, before loading anything.
        port = url.rsplit(":", 1)[1]
        clash = subprocess.run(
            serve_command(f"--port={port}"), capture_output=True, text=True, timeout=120
        )
        assert clash.returncode == 2
        assert f"port {port} on 127.0.0.1 is already in use" in clash.stderr
        assert "Traceback" not in clash.stderr and len(clash.stderr.strip().splitlines()) == 1

        _openai_checks(url)

        # Drain: both slots busy with long streams, two requests queued (one of two choices,
        # shed together), then SIGTERM.
        started: list = []
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            running = [pool.submit(_stream_until_done, url, started) for _ in range(2)]
            assert wait_until(lambda: len(started) == 2, 120, interval=0.01)
            queued = [
                pool.submit(
                    httpx.post,
                    f"{url}/v1/completions",
                    json={"prompt": "q", "max_tokens": 8, "n": n},
                    timeout=120,
                )
                for n in (1, 2)
            ]
            assert wait_until(lambda: metrics(url)["dspark:num_requests_waiting"] == 3, 60)
            proc.send_signal(signal.SIGTERM)
            for f in queued:
                r = f.result()
                assert r.status_code == 503, r.text
                assert "shutting down" in r.json()["error"]["message"]
            for f in running:
                assert f.result() == {"done": True, "finish": "length"}
        assert proc.wait(120) == 0
        assert "stopped" in proc.stdout.read()
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# Requests long enough to outlast a short drain deadline many times over on any host.
UNENDING = {"max_tokens": 3990, "ignore_eos": True, "temperature": 1.5}


def _abort_running_requests(tmp_path, drain_timeout: float, signals: int) -> float:
    """One long streaming and one long non-streaming request, then `signals` Ctrl-Cs: both
    requests are cut short by the server itself with a whole answer, and the process exits 0
    without a traceback. Returns the seconds from the first Ctrl-C to the exit."""
    proc, url = _start(
        tmp_path, "--max-model-len=4000", f"--drain-timeout={drain_timeout}", "--no-prefix-caching"
    )
    try:
        assert wait_until(lambda: _health(url) == 200, 600, interval=0.2)
        started: list = []

        def stream() -> list:
            body = {"prompt": "a", "stream": True, **UNENDING}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                return list(_note_first(sse_events(r), started))

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            streamed = pool.submit(stream)
            whole = pool.submit(
                httpx.post, f"{url}/v1/completions", json={"prompt": "b", **UNENDING}, timeout=120
            )
            assert wait_until(
                lambda: started and metrics(url)["dspark:num_requests_running"] == 2, 120, 0.02
            )
            t0 = time.monotonic()
            for _ in range(signals):
                proc.send_signal(signal.SIGINT)
                time.sleep(0.2)
            events, answer = streamed.result(), whole.result()
        assert proc.wait(60) == 0
        waited = time.monotonic() - t0
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["type"] == "service_unavailable"
        assert "shut down before this request finished" in answer.json()["error"]["message"]
        assert events[-1] == DONE
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
        assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
        log = (tmp_path / "serve.log").read_text()
        assert "Traceback" not in log and "ERROR" not in log, log
        return waited
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_drain_deadline_ends_running_requests_with_whole_answers(tmp_path):
    waited = _abort_running_requests(tmp_path, drain_timeout=0.5, signals=1)
    assert 0.5 <= waited < 15


def test_a_second_ctrl_c_aborts_running_requests_at_once(tmp_path):
    waited = _abort_running_requests(tmp_path, drain_timeout=300, signals=2)
    assert waited < 15


def test_the_api_key_comes_from_the_flag_or_else_the_environment(monkeypatch):
    monkeypatch.delenv(command.API_KEY_ENV, raising=False)
    assert command.api_key(_args()) is None
    monkeypatch.setenv(command.API_KEY_ENV, "")  # empty is unset
    assert command.api_key(_args()) is None
    monkeypatch.setenv(command.API_KEY_ENV, "from-env")
    assert command.api_key(_args()) == "from-env"
    assert command.api_key(_args("--api-key", "from-flag")) == "from-flag"
    for bad in ("clé", "key\n", " key"):
        with pytest.raises(UserError, match=r"--api-key must be printable ASCII"):
            command.api_key(_args("--api-key", bad))
    monkeypatch.setenv(command.API_KEY_ENV, "key ")
    with pytest.raises(UserError, match=r"^\$DSPARK_JAX_API_KEY must be printable ASCII"):
        command.api_key(_args())


def test_ctrl_c_during_warm_up_exits_promptly(tmp_path):
    """Warm-up cannot be interrupted mid-compilation; Ctrl-C still ends the process at once
    (after --drain-timeout), with status 0 and no traceback. (Its server takes its API key from
    the environment: the startup line says a key is required, and a request without it gets
    401 while /health answers.)"""
    proc, url = _start(tmp_path, "--drain-timeout=1", env={command.API_KEY_ENV: "k3y"})
    try:
        assert wait_until(lambda: _health(url) == 503, 120, interval=0.05)
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
        keyed = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k3y"}, timeout=5)
        assert keyed.status_code == 200
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert time.monotonic() - t0 < 20
        assert "stopped during warm-up" in proc.stdout.read()
        assert "Traceback" not in (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def test_sps_table_auto_is_not_a_file_to_look_for():
    # `--sps-table auto` profiles the served engine at start-up: the check that a given table
    # exists passes it by (the next check, on the models, is what refuses this command line).
    argv = ["--policy", "scheduler", "--sps-table", "auto", "--draft", "somewhere"]
    with pytest.raises(UserError, match="a drafter needs its target"):
        command.run(_args("--port", "0", *argv))


def test_an_sps_table_of_another_slot_count_is_refused(tmp_path):
    # A table's step times describe one batch size: serve checks it against --max-num-seqs, as
    # generate and eval do, before anything compiles.
    from dspark_jax.decoding.policies import SpsProfile

    table = tmp_path / "sps.json"
    SpsProfile((8, 16, 32), np.array([300.0, 250.0, 200.0]), {"num_slots": 2}).save(table)
    argv = ["--policy", "scheduler", "--sps-table", str(table), "--max-num-seqs", "1"]
    with pytest.raises(UserError, match=f"--sps-table {table} was profiled") as refused:
        command.run(_args("--port", "0", *argv))
    # serve runs --max-num-seqs slots, however many requests come: no cap to mention.
    assert str(refused.value).endswith(
        "Profile again with dspark-jax profile --max-num-seqs 1, or serve with --max-num-seqs 2"
    )
