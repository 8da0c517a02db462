"""Host-side batch generation over the engine: bucketing, chunked streaming, per-request stats.

The host touches the device once per chunk of rounds (to stream tokens and check completion);
everything inside a chunk stays on device.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from dspark_jax.decoding.engine import Engine, EngineError


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_ids: Sequence[int]
    max_new_tokens: int = 256
    seed: int = 0


@dataclasses.dataclass
class Result:
    tokens: list[int]
    finish_reason: str  # "stop" (a stop token was generated) or "length"
    prompt_len: int
    verified: np.ndarray  # per round: drafts verified
    accepted: np.ndarray  # per round: drafts accepted
    committed: np.ndarray  # per round: tokens committed, bonus included
    conf_logits: np.ndarray  # per round x block position: confidence logits

    @property
    def rounds(self) -> int:
        return len(self.committed)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification round (bonus included)."""
        return float(np.mean(self.committed)) if len(self.committed) else 0.0


@dataclasses.dataclass
class BatchTiming:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decoded_tokens: int = 0  # tokens from decode rounds (the first token comes from prefill)
    rounds: int = 0  # device rounds (the max over requests of each batch)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decoded_tokens / self.decode_s if self.decode_s else 0.0


StreamCallback = Callable[[int, list[int]], None]


def generate(
    engine: Engine,
    requests: Sequence[Request],
    batch_size: int = 8,
    on_tokens: StreamCallback | None = None,
    progress: bool = False,
) -> tuple[list[Result], BatchTiming]:
    """Generates for every request, `batch_size` at a time; `on_tokens(i, new_tokens)` streams."""
    if batch_size < 1:
        raise EngineError(f"batch_size must be >= 1, got {batch_size}")
    for i, r in enumerate(requests):
        try:
            engine.check_fits(len(r.prompt_ids), r.max_new_tokens)
        except EngineError as e:
            raise EngineError(f"request {i}: {e}") from None
    results: list[Result | None] = [None] * len(requests)
    timing = BatchTiming()
    starts = range(0, len(requests), batch_size)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), unit="req", desc="generate")
    for start in starts:
        idx = list(range(start, min(start + batch_size, len(requests))))
        _run_batch(engine, requests, idx, results, timing, on_tokens)
        if bar is not None:
            bar.update(len(idx))
    if bar is not None:
        bar.close()
    return results, timing


def _run_batch(engine: Engine, requests, idx, results, timing: BatchTiming, on_tokens) -> None:
    cfg = engine.cfg
    batch = cfg.batch_bucket(len(idx))
    longest = max(len(requests[i].prompt_ids) for i in idx)
    width = cfg.prompt_bucket(longest)
    prompts = np.zeros((batch, width), np.int32)
    prompt_len = np.ones((batch,), np.int32)
    max_new = np.zeros((batch,), np.int32)
    seeds = np.zeros((batch,), np.uint32)
    active = np.zeros((batch,), bool)
    for row, i in enumerate(idx):
        r = requests[i]
        prompts[row, : len(r.prompt_ids)] = r.prompt_ids
        prompt_len[row] = len(r.prompt_ids)
        max_new[row] = r.max_new_tokens
        seeds[row] = r.seed
        active[row] = True

    t0 = time.perf_counter()
    state = engine.init_state(batch)
    state = engine.prefill(state, prompts, prompt_len, max_new, seeds, active)
    sent = np.zeros((batch,), np.int64)
    generated = np.asarray(state.num_generated_b)
    timing.prefill_s += time.perf_counter() - t0
    _stream(state, idx, sent, generated, max_new, on_tokens)

    t0 = time.perf_counter()
    done = np.asarray(state.done_b)
    while not done.all():
        state = engine.decode_chunk(state)
        done, generated = jax.device_get((state.done_b, state.num_generated_b))
        _stream(state, idx, sent, generated, max_new, on_tokens)
    timing.decode_s += time.perf_counter() - t0

    host = jax.device_get(state)
    timing.rounds += int(np.max(host.rounds_b[: len(idx)], initial=0))
    for row, i in enumerate(idx):
        n = min(int(host.num_generated_b[row]), int(max_new[row]))
        tokens = host.tokens_bn[row, :n].tolist()
        rounds = int(host.rounds_b[row])
        stop = any(t in engine.stop_tokens for t in tokens[-1:])
        timing.decoded_tokens += max(n - 1, 0)
        results[i] = Result(
            tokens=tokens,
            finish_reason="stop" if stop else "length",
            prompt_len=int(prompt_len[row]),
            verified=host.verified_bn[row, :rounds],
            accepted=host.accepted_bn[row, :rounds],
            committed=host.committed_bn[row, :rounds],
            conf_logits=host.conf_logits_bnk[row, :rounds],
        )


def _stream(state, idx, sent, generated, max_new, on_tokens) -> None:
    if on_tokens is None:
        return
    rows = [row for row in range(len(idx)) if min(generated[row], max_new[row]) > sent[row]]
    if not rows:
        return
    tokens = np.asarray(state.tokens_bn)
    for row in rows:
        upto = min(int(generated[row]), int(max_new[row]))
        on_tokens(idx[row], tokens[row, sent[row] : upto].tolist())
        sent[row] = upto
