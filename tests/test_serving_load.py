"""Load: 64 concurrent clients for 5 minutes against a `dspark-jax serve` process (slow).

Each client loops over streaming, cancelled (disconnects after the first chunk) and plain
requests with rotating temperatures and top-p, most of them behind one of two shared headers
(the prefix cache maps, evicts and drops pages throughout). Holds: zero server errors, zero
refused or reset connections, no compilation after warm-up, prefix cache hits, no slot or page
leak (occupancy and held pages back to 0) and flat
memory (the server's resident set over the last third of the run no higher than over the middle
third, within a small margin).
"""

from __future__ import annotations

import collections
import concurrent.futures
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from serving_helpers import (
    DONE,
    FIXTURE_SERVE_FLAGS,
    metrics,
    serve_command,
    sse_events,
    wait_idle,
    wait_until,
)

CLIENTS = 64
SECONDS = 300
# Flat memory: the last third of the run peaks no higher than the middle third, within what
# allocator pools and in-flight buffers swing by (a leak of a few KiB per request shows).
MEMORY_SLACK = 24 * 2**20
FLAGS = [
    *FIXTURE_SERVE_FLAGS,
    "--port=0",
    "--log-level=warning",
    "--max-num-seqs=8",
    "--max-model-len=512",
    "--rounds-per-chunk=4",
    "--prefill-chunk=64",
    "--prefill-buckets=64",
    "--token-buckets=64",
    f"--max-waiting={CLIENTS}",
]
TEMPERATURES = (0.0, 0.3, 0.7, 1.0, 1.4)
# Prompt headers: none, 96 and 102 tokens (6 pages of 16 byte tokens, and 6 more tokens).
HEADERS = ("", "# Helpers for the command line of a small tool.\n" * 2, '"""CSV files."""\n' * 6)
TOP_PS = (1.0, 0.95, 0.8, 0.5)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class _Tally:
    """Outcome counts shared by the client threads."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def add(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1


def _client(url: str, i: int, stop: threading.Event, tally: _Tally) -> None:
    k = i
    with httpx.Client(base_url=url, timeout=600) as http:
        while not stop.is_set():
            body = {
                "prompt": HEADERS[(k // 3) % len(HEADERS)] + f"def f{k}(x):\n",
                "max_tokens": (16, 48, 96, 200)[k % 4],
                "temperature": TEMPERATURES[k % len(TEMPERATURES)],
                "top_p": TOP_PS[k % len(TOP_PS)],
                "seed": k,
            }
            kind = ("stream", "cancel", "plain")[k % 3]
            k += CLIENTS
            try:
                if kind == "plain":
                    r = http.post("/v1/completions", json=body)
                    tally.add(f"plain {r.status_code}")
                    continue
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    tally.add(f"{kind} {r.status_code}")
                    events = sse_events(r)
                    next(events)
                    if kind == "stream":
                        assert list(events)[-1] == DONE
            except httpx.TransportError as e:
                tally.add(f"transport {type(e).__name__}")


@pytest.mark.slow
def test_64_clients_for_5_minutes(tmp_path):
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(serve_command(*FLAGS), stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        url = proc.stdout.readline().split(" on ")[1].split("/v1")[0]

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(healthy, 900, interval=0.5)
        before = metrics(url)  # /health answered 503 while warming up: count from here
        compiles = before["dspark:jax_compilations_total"]
        assert compiles > 0  # warm-up's compilations were counted: the counter works
        tally = _Tally()
        stop = threading.Event()
        rss = []
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            clients = [pool.submit(_client, url, i, stop, tally) for i in range(CLIENTS)]
            t0 = time.monotonic()
            while time.monotonic() - t0 < SECONDS:
                time.sleep(5)
                rss.append((time.monotonic() - t0, _rss_bytes(proc.pid)))
            stop.set()
            for f in clients:
                f.result()
        after = wait_idle(url, timeout=60)
        codes = {
            k: v - before.get(k, 0)
            for k, v in after.items()
            if k.startswith("dspark:http_responses_total")
        }
        counts = tally.counts
        assert set(counts) <= {"plain 200", "stream 200", "cancel 200"}, counts
        assert counts.total() > CLIENTS * 3, counts
        assert not any("code=5" in k and v for k, v in codes.items()), codes
        assert after["dspark:jax_compilations_total"] == compiles
        hits = after["dspark:prefix_cache_hits_total"] - before["dspark:prefix_cache_hits_total"]
        assert hits > 0
        middle = [b for t, b in rss if SECONDS / 3 <= t < 2 * SECONDS / 3]
        last = [b for t, b in rss if t >= 2 * SECONDS / 3]
        mib = [(round(t), b >> 20) for t, b in rss]
        print(f"outcomes {dict(counts)}; resident set (s, MiB): {mib}")
        assert max(last) <= max(middle) + MEMORY_SLACK, mib
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
