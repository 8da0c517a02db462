"""Helpers for the server tests: SSE parsing, metric scraping, the small engine they all use."""

from __future__ import annotations

import json
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dspark_jax.decoding.engine import EngineConfig

FIXTURE = Path(__file__).parent / "fixtures" / "deepspec-tiny-vanilla"
# `dspark-jax serve` on the byte-level fixture pair under its old embedded name: the server
# tests' prompts, lengths and timings were chosen for it.
FIXTURE_SERVE_FLAGS = [
    f"--target={FIXTURE / 'target'}",
    f"--draft={FIXTURE / 'draft'}",
    "--served-model-name=tiny-vanilla",
]

DONE = "[DONE]"

# Small enough to compile in seconds on two CPU cores: one verification bucket (4 slots x
# (block 7 + 1)), one prefill width. Chunks of 8 rounds (the server's default) last long enough
# that the host's HTTP work between two of them is not what the timing tests measure.
SMALL_ENGINE = EngineConfig(
    num_slots=4,
    max_model_len=512,
    page_size=16,
    rounds_per_chunk=8,
    prefill_chunk=64,
    prefill_seqs=2,
    prefill_buckets=(64,),
    token_buckets=(32,),
)

# The same shapes as command-line flags of `dspark-jax serve` (2 slots: 2 x 8 tokens).
SMALL_SERVE_FLAGS = [
    "--max-num-seqs=2",
    "--max-model-len=512",
    "--rounds-per-chunk=4",
    "--prefill-chunk=64",
    "--prefill-buckets=64",
    "--token-buckets=16",
    "--draft-buckets=2",
]


class StandInEngine:
    """What `EngineRunner` asks of an engine, for tests that put a stand-in Batcher in its place:
    one slot, one page, nothing to compile."""

    cfg = types.SimpleNamespace(num_slots=1, pool_pages=1)
    gamma = 0

    def warm_up(self) -> None:
        pass

    def compiled_programs(self) -> int:
        return 0


def sse_events(response: httpx.Response) -> Iterator[dict | str]:
    """The `data:` payloads of a server-sent-event stream: dicts, then DONE."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield DONE if payload == DONE else json.loads(payload)


def metrics(base_url: str) -> dict[str, float]:
    """Every sample of /metrics as {"name{label=value,...}": value}."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def wait_idle(base_url: str, timeout: float = 30.0) -> dict[str, float]:
    """Waits until no request holds a slot, a page or a queue place; returns the metrics."""
    keys = (
        "dspark:num_requests_running",
        "dspark:num_requests_waiting",
        "dspark:slots_busy",
        "dspark:kv_pages_reserved",
    )
    seen: dict[str, float] = {}

    def idle() -> bool:
        seen.update(metrics(base_url))
        return all(seen[k] == 0 for k in keys)

    assert wait_until(idle, timeout), {k: seen.get(k) for k in keys}
    return seen


def serve_command(*flags: str) -> list[str]:
    """argv running `dspark-jax serve` (the console script of this environment)."""
    return [sys.executable, "-m", "dspark_jax.cli", "serve", *flags]
