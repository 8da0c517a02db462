"""Prometheus metrics of the server: the engine loop's `Observer` plus HTTP and compile counters.

Names follow vLLM's (`vllm:` becomes `dspark:`), so dashboards and load generators built for it
read these: requests running / waiting, slot occupancy (now, and over decode rounds as
`slot_rounds / (device_rounds x slots_total)`), KV cache usage, prompt / generation tokens, time
to first token, inter-token latency, end-to-end latency, finish reasons and the speculative
decoding counters (`spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos`). DSpark's scheduler verifies fewer drafts than the drafter
proposes, so it adds the verified counts beside the proposed ones
(`..._num_verified_tokens[_per_pos]`); the mean acceptance length is 1 + accepted / drafts (the
bonus or correction token every round commits).

`dspark:jax_compilations_total` counts XLA compilations in this process (a `jax.monitoring`
listener): after warm-up it must stay flat, whatever mix of sampling settings arrives.

Every metric lives in the `ServingMetrics.registry` of its server, not in prometheus_client's
global registry, so several servers (tests) in one process do not collide.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import jax
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from dspark_jax.decoding.batching import Observer

PREFIX = "dspark:"
_COMPILE_EVENT_SUFFIX = "backend_compile_duration"

_compile_lock = threading.Lock()
_compiles = 0
_listening = False


def _on_event_duration(event: str, duration_secs: float, **_kwargs) -> None:
    global _compiles
    if event.endswith(_COMPILE_EVENT_SUFFIX):
        with _compile_lock:
            _compiles += 1


def watch_compilations() -> None:
    """Starts counting this process's XLA compilations (idempotent; listeners cannot be
    removed, so there is one for the whole process)."""
    global _listening
    with _compile_lock:
        if _listening:
            return
        _listening = True
    jax.monitoring.register_event_duration_secs_listener(_on_event_duration)


def compile_count() -> int:
    """XLA compilations since `watch_compilations` was first called."""
    with _compile_lock:
        return _compiles


class _CompileCollector:
    def collect(self):
        family = CounterMetricFamily(
            f"{PREFIX}jax_compilations", "XLA programs compiled by this process"
        )
        family.add_metric([], compile_count())
        yield family


# Seconds; tuned for CPU tests up to slow accelerators under load.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _Metric(NamedTuple):
    """One metric of `ServingMetrics`: the attribute holding it and its name after `PREFIX`."""

    attr: str
    kind: type
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


_METRICS = (
    _Metric("running", Gauge, "num_requests_running", "Requests holding a slot"),
    _Metric("waiting", Gauge, "num_requests_waiting", "Requests queued for a slot"),
    _Metric("slots_busy", Gauge, "slots_busy", "Slots holding a request"),
    _Metric("slots_total", Gauge, "slots_total", "Slots of the engine"),
    _Metric("occupancy", Gauge, "slot_occupancy", "Busy slots / slots (0..1)"),
    _Metric("pages_reserved", Gauge, "kv_pages_reserved", "KV pages reserved by admitted requests"),
    _Metric("pages_total", Gauge, "kv_pages_total", "KV pages in the pool"),
    _Metric("kv_usage", Gauge, "kv_cache_usage_perc", "Reserved / pool pages (0..1)"),
    _Metric(
        "slot_rounds",
        Counter,
        "slot_rounds",
        "Turns live slots took in decode rounds (/ device_rounds x slots = occupancy)",
    ),
    _Metric("device_rounds", Counter, "device_rounds", "Decode rounds the device ran"),
    _Metric("ready", Gauge, "engine_ready", "1 once warm-up compiled every program"),
    _Metric("prompt_tokens", Counter, "prompt_tokens", "Prompt tokens of finished requests"),
    _Metric("generation_tokens", Counter, "generation_tokens", "Tokens generated"),
    _Metric(
        "finished",
        Counter,
        "request_success",
        "Requests the engine finished, by reason (abort: cancelled)",
        ("finished_reason",),
    ),
    _Metric(
        "ttft",
        Histogram,
        "time_to_first_token_seconds",
        "Submission to first token",
        buckets=_LATENCY_BUCKETS,
    ),
    _Metric(
        "itl",
        Histogram,
        "inter_token_latency_seconds",
        "Time between tokens of one request (a chunk's gap shared by its tokens)",
        buckets=_ITL_BUCKETS,
    ),
    _Metric(
        "e2e",
        Histogram,
        "e2e_request_latency_seconds",
        "Request arrival to the end of its answer",
        buckets=_LATENCY_BUCKETS,
    ),
    _Metric(
        "http_responses", Counter, "http_responses", "HTTP responses by status code", ("code",)
    ),
    _Metric("drafts", Counter, "spec_decode_num_drafts", "Draft blocks (speculative rounds)"),
    _Metric(
        "draft_tokens",
        Counter,
        "spec_decode_num_draft_tokens",
        "Draft tokens proposed (gamma per block)",
    ),
    _Metric(
        "verified_tokens",
        Counter,
        "spec_decode_num_verified_tokens",
        "Draft tokens the policy sent to the target",
    ),
    _Metric("accepted_tokens", Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted"),
    _Metric(
        "accepted_per_pos",
        Counter,
        "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by block position (0-based)",
        ("position",),
    ),
    _Metric(
        "verified_per_pos",
        Counter,
        "spec_decode_num_verified_tokens_per_pos",
        "Draft tokens verified, by block position (0-based)",
        ("position",),
    ),
    _Metric(
        "mean_acceptance",
        Gauge,
        "spec_decode_mean_acceptance_length",
        "Tokens committed per speculative round since start (1 + accepted / drafts)",
    ),
)


class ServingMetrics(Observer):
    """The engine loop's observer (called on the loop thread) and the HTTP layer's counters.

    Each metric of `_METRICS` is the attribute its table row names (`self.running`, ...).
    """

    def __init__(self, num_slots: int, kv_pages: int, gamma: int):
        watch_compilations()
        self.registry = CollectorRegistry()
        self.gamma = gamma
        self._slots = num_slots
        self._pages = kv_pages
        for m in _METRICS:
            extra = {} if m.buckets is None else {"buckets": m.buckets}
            metric = m.kind(PREFIX + m.name, m.doc, m.labels, registry=self.registry, **extra)
            setattr(self, m.attr, metric)
        self.slots_total.set(num_slots)
        self.pages_total.set(kv_pages)
        self.registry.register(_CompileCollector())
        self._drafts = 0
        self._accepted = 0
        # Children exist from the start, so a scrape shows every position (at 0) at once.
        self._accepted_pos = [self.accepted_per_pos.labels(str(k)) for k in range(gamma)]
        self._verified_pos = [self.verified_per_pos.labels(str(k)) for k in range(gamma)]

    # -- Observer (the engine loop thread) ----------------------------------------------------
    def on_step(self, waiting: int, running: int, slots_busy: int, pages_reserved: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        self.slots_busy.set(slots_busy)
        self.occupancy.set(slots_busy / self._slots)
        self.pages_reserved.set(pages_reserved)
        self.kv_usage.set(pages_reserved / self._pages)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_tokens(self, count: int, inter_token_s: float) -> None:
        for _ in range(count):
            self.itl.observe(inter_token_s)

    def on_rounds(self, verified_r: np.ndarray, accepted_r: np.ndarray, gamma: int) -> None:
        rounds = int(verified_r.shape[0])
        if not rounds:
            return
        accepted = int(accepted_r.sum())
        self.drafts.inc(rounds)
        self.draft_tokens.inc(rounds * gamma)
        self.verified_tokens.inc(int(verified_r.sum()))
        self.accepted_tokens.inc(accepted)
        k = np.arange(gamma)
        verified_k = (verified_r[:, None] > k[None, :]).sum(axis=0)
        accepted_k = (accepted_r[:, None] > k[None, :]).sum(axis=0)
        for pos in range(gamma):
            self._verified_pos[pos].inc(int(verified_k[pos]))
            self._accepted_pos[pos].inc(int(accepted_k[pos]))
        self._drafts += rounds
        self._accepted += accepted
        self.mean_acceptance.set(1.0 + self._accepted / self._drafts)

    def on_chunk(self, slot_rounds: int, device_rounds: int, num_slots: int) -> None:
        self.slot_rounds.inc(slot_rounds)
        self.device_rounds.inc(device_rounds)

    def on_finish(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.finished.labels(reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
