"""Acceptance statistics of speculative decoding and the turn-by-turn evaluation driver.

`answer_conversations` answers multi-turn prompts the way a chat user would see them: every
conversation's turn i is generated in one batched `generate` call, and the model's own answer to
turn i goes into the context of turn i+1. `replay` times another engine (plain decoding, the
baseline) on exactly the prompts of such a run. Decode throughput excludes prefill and, after
`warm_up`, compilation.

Per-position statistics follow the paper (Figure 2): the conditional acceptance of draft position
k counts the rounds where drafts 1..k-1 were accepted and k was verified; prefix survival at k is
the share of rounds verifying k whose first k drafts were all accepted.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dspark_jax.calibration.records import records_from_results
from dspark_jax.calibration.sts import conditional_events, survival_events
from dspark_jax.decoding.engine import Engine, EngineError
from dspark_jax.decoding.generate import BatchTiming, Request, Result, generate
from dspark_jax.errors import UserError
from dspark_jax.tokenizer import decode_text, encode_chat


class DatasetError(UserError):
    """A prompts file that is missing, empty or not `{"turns": [...]}` JSON lines."""


# -- statistics --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AcceptanceStats:
    """Pooled statistics of speculative rounds; per-position arrays are indexed by k - 1."""

    rounds: int
    committed: int  # tokens committed by the rounds (bonus included)
    tau: float  # committed / rounds: mean acceptance length, bonus included
    mean_verified: float
    conditional: np.ndarray  # P(draft k accepted | drafts 1..k-1 accepted, k verified); NaN: unseen
    conditional_n: np.ndarray
    survival: np.ndarray  # P(drafts 1..k all accepted | k verified); NaN: unseen
    survival_n: np.ndarray

    def to_json(self) -> dict[str, Any]:
        return {
            "rounds": self.rounds,
            "committed": self.committed,
            "tau": self.tau,
            "mean_verified": self.mean_verified,
            "conditional_acceptance": _nan_to_none(self.conditional),
            "conditional_observations": self.conditional_n.tolist(),
            "prefix_survival": _nan_to_none(self.survival),
            "survival_observations": self.survival_n.tolist(),
        }


def _nan_to_none(values: np.ndarray) -> list[float | None]:
    return [None if np.isnan(v) else float(v) for v in values]


def _rates(events_nk: np.ndarray, observed_nk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n_k = observed_nk.sum(axis=0)
    hits_k = (events_nk & observed_nk).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n_k > 0, hits_k / np.maximum(n_k, 1), np.nan), n_k


def acceptance_stats(results: Iterable[Result], gamma: int) -> AcceptanceStats:
    """Pools every speculative round of `results` (from a drafter with block size `gamma`)."""
    results = [r for r in results if r.rounds]
    committed = int(sum(int(np.sum(r.committed)) for r in results))
    rounds = int(sum(r.rounds for r in results))
    if rounds == 0:
        nan_k = np.full(gamma, np.nan)
        zero_k = np.zeros(gamma, np.int64)
        return AcceptanceStats(0, 0, float("nan"), float("nan"), nan_k, zero_k, nan_k, zero_k)
    records = records_from_results(results)
    observed, accepted = conditional_events(records)
    conditional, conditional_n = _rates(accepted, observed)
    observed, survived = survival_events(records)
    survival, survival_n = _rates(survived, observed)
    return AcceptanceStats(
        rounds=rounds,
        committed=committed,
        tau=committed / rounds,
        mean_verified=float(np.mean(records.verified_n)),
        conditional=conditional,
        conditional_n=conditional_n,
        survival=survival,
        survival_n=survival_n,
    )


def add_timing(total: BatchTiming, part: BatchTiming) -> None:
    """Accumulates `part` into `total`."""
    total.prefill_s += part.prefill_s
    total.decode_s += part.decode_s
    total.decoded_tokens += part.decoded_tokens
    total.rounds += part.rounds


# -- warm-up -----------------------------------------------------------------------------------
def batch_buckets_needed(engine: Engine, num_requests: int, batch_size: int) -> set[int]:
    """The batch buckets `generate(engine, <num_requests>, batch_size)` will use."""
    if num_requests <= 0:
        return set()
    sizes = {min(batch_size, num_requests)}
    if num_requests % batch_size:
        sizes.add(num_requests % batch_size)
    return {engine.cfg.batch_bucket(n) for n in sizes}


def warm_up(engine: Engine, batch_buckets: Iterable[int]) -> None:
    """Compiles the decode program of each batch bucket, so timed runs exclude compilation.

    A freshly initialised state has every row done, so the compiled loop returns at once.
    """
    for batch in sorted(set(batch_buckets)):
        state = engine.decode_chunk(engine.init_state(batch))
        state.done_b.block_until_ready()


class WarmEngine:
    """An engine plus the batch buckets already compiled for it."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.warm: set[int] = set()

    def ensure(self, num_requests: int, batch_size: int) -> None:
        needed = batch_buckets_needed(self.engine, num_requests, batch_size) - self.warm
        warm_up(self.engine, needed)
        self.warm |= needed


# -- prompts -----------------------------------------------------------------------------------
def load_conversations(path: str | Path, limit: int | None = None) -> list[list[str]]:
    """User turns of each conversation in a JSONL file of `{"turns": [str, ...]}` lines."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such prompts file")
    conversations = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{number}: not JSON ({e.msg})") from None
            turns = entry.get("turns") if isinstance(entry, dict) else None
            if (
                not isinstance(turns, list)
                or not turns
                or not all(isinstance(t, str) for t in turns)
            ):
                raise DatasetError(f'{path}:{number}: expected {{"turns": [str, ...]}}')
            conversations.append(turns)
            if limit is not None and len(conversations) >= limit:
                break
    if not conversations:
        raise DatasetError(f"{path}: holds no conversations")
    return conversations


# -- turn-by-turn generation -------------------------------------------------------------------
@dataclasses.dataclass
class Turn:
    conversation: int
    turn: int
    request: Request
    result: Result
    text: str


@dataclasses.dataclass
class ConversationRun:
    turns: list[Turn]
    timing: BatchTiming
    skipped: list[str]  # why a conversation stopped early (its prompt did not fit)

    def results(self) -> list[Result]:
        return [t.result for t in self.turns]


TokenCallback = Callable[[int, int, list[int]], None]  # (conversation, turn, new tokens)
TurnCallback = Callable[[Turn], None]


def answer_conversations(
    engine: WarmEngine,
    tokenizer,
    conversations: Sequence[Sequence[str]],
    *,
    max_new_tokens: int,
    batch_size: int = 8,
    seed: int = 0,
    enable_thinking: bool = False,
    on_tokens: TokenCallback | None = None,
    on_turn: TurnCallback | None = None,
    progress: bool = False,
    skip_unfit: bool = False,
) -> ConversationRun:
    """Answers every conversation turn by turn; see the module docstring.

    A prompt that does not fit the engine raises `EngineError`, or with `skip_unfit` ends its
    conversation there and is listed in `skipped`. Request seeds are
    `seed + conversation * max_turns + turn`.
    """
    max_turns = max((len(c) for c in conversations), default=0)
    history: list[list[dict[str, str]]] = [[] for _ in conversations]
    alive = [True] * len(conversations)
    run = ConversationRun(turns=[], timing=BatchTiming(), skipped=[])
    stop = engine.engine.stop_tokens
    for turn in range(max_turns):
        index, requests = [], []
        for c, turns in enumerate(conversations):
            if not alive[c] or turn >= len(turns):
                continue
            messages = history[c] + [{"role": "user", "content": turns[turn]}]
            ids = encode_chat(tokenizer, messages, enable_thinking=enable_thinking)
            try:
                engine.engine.check_fits(len(ids), max_new_tokens)
            except EngineError as e:
                if not skip_unfit:
                    raise EngineError(f"conversation {c} turn {turn}: {e}") from None
                alive[c] = False
                run.skipped.append(f"conversation {c} turn {turn}: {e}")
                continue
            index.append(c)
            requests.append(Request(ids, max_new_tokens, seed=seed + c * max_turns + turn))
        if not requests:
            break
        engine.ensure(len(requests), batch_size)
        stream = None if on_tokens is None else _turn_stream(on_tokens, index, turn)
        results, timing = generate(
            engine.engine, requests, batch_size=batch_size, on_tokens=stream, progress=progress
        )
        add_timing(run.timing, timing)
        for c, request, result in zip(index, requests, results, strict=True):
            text = decode_text(tokenizer, result.tokens, stop)
            history[c] = history[c] + [
                {"role": "user", "content": conversations[c][turn]},
                {"role": "assistant", "content": text},
            ]
            record = Turn(c, turn, request, result, text)
            run.turns.append(record)
            if on_turn is not None:
                on_turn(record)
    return run


def _turn_stream(on_tokens: TokenCallback, index: list[int], turn: int):
    return lambda row, new: on_tokens(index[row], turn, new)


def replay(engine: WarmEngine, run: ConversationRun, batch_size: int = 8) -> BatchTiming:
    """Times `engine` on the prompts of `run`, turn by turn, with the same lengths and seeds."""
    timing = BatchTiming()
    by_turn: dict[int, list[Request]] = {}
    for t in run.turns:
        by_turn.setdefault(t.turn, []).append(t.request)
    for turn in sorted(by_turn):
        requests = by_turn[turn]
        engine.ensure(len(requests), batch_size)
        add_timing(timing, generate(engine.engine, requests, batch_size=batch_size)[1])
    return timing


# -- per-dataset report ------------------------------------------------------------------------
@dataclasses.dataclass
class DatasetReport:
    name: str
    conversations: int
    turns: int
    skipped: list[str]
    stats: AcceptanceStats
    spec_timing: BatchTiming
    plain_timing: BatchTiming | None

    @property
    def speedup(self) -> float | None:
        """Decode tokens/s of speculative over plain decoding."""
        if self.plain_timing is None or not self.plain_timing.decode_tokens_per_s:
            return None
        return self.spec_timing.decode_tokens_per_s / self.plain_timing.decode_tokens_per_s

    def to_json(self) -> dict[str, Any]:
        def timing(t: BatchTiming | None):
            if t is None:
                return None
            return {
                "prefill_s": t.prefill_s,
                "decode_s": t.decode_s,
                "decoded_tokens": t.decoded_tokens,
                "device_rounds": t.rounds,
                "decode_tokens_per_s": t.decode_tokens_per_s,
            }

        return {
            "conversations": self.conversations,
            "turns": self.turns,
            "skipped": self.skipped,
            **self.stats.to_json(),
            "speculative": timing(self.spec_timing),
            "plain": timing(self.plain_timing),
            "speedup": self.speedup,
        }


def evaluate_dataset(
    name: str,
    conversations: Sequence[Sequence[str]],
    spec: WarmEngine,
    plain: WarmEngine | None,
    tokenizer,
    *,
    max_new_tokens: int,
    batch_size: int = 8,
    seed: int = 0,
    enable_thinking: bool = False,
    progress: bool = False,
) -> tuple[DatasetReport, ConversationRun]:
    """Speculative decoding over `conversations`, then plain decoding on the same prompts."""
    run = answer_conversations(
        spec,
        tokenizer,
        conversations,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        seed=seed,
        enable_thinking=enable_thinking,
        progress=progress,
        skip_unfit=True,
    )
    plain_timing = replay(plain, run, batch_size) if plain is not None else None
    report = DatasetReport(
        name=name,
        conversations=len(conversations),
        turns=len(run.turns),
        skipped=run.skipped,
        stats=acceptance_stats(run.results(), spec.engine.gamma),
        spec_timing=run.timing,
        plain_timing=plain_timing,
    )
    return report, run


# -- presentation ------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or np.isnan(value) else format(value, spec)


def format_table(reports: Sequence[DatasetReport]) -> str:
    """A fixed-width table: one row per dataset, then per-position acceptance and survival."""
    if not reports:
        return "(no datasets)"
    gamma = len(reports[0].stats.conditional)
    width = max(8, *(len(r.name) for r in reports))
    head = (
        f"{'dataset':<{width}} {'convs':>5} {'turns':>5} {'rounds':>7} {'tau':>6} "
        f"{'spec tok/s':>10} {'plain tok/s':>11} {'speedup':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in reports:
        plain = r.plain_timing.decode_tokens_per_s if r.plain_timing else None
        lines.append(
            f"{r.name:<{width}} {r.conversations:>5} {r.turns:>5} {r.stats.rounds:>7} "
            f"{_fmt(r.stats.tau, '.3f'):>6} {_fmt(r.spec_timing.decode_tokens_per_s, '.1f'):>10} "
            f"{_fmt(plain, '.1f'):>11} {_fmt(r.speedup, '.2f'):>7}"
        )
    for title, field in (
        ("conditional acceptance by draft position", "conditional"),
        ("prefix survival by draft position", "survival"),
    ):
        lines += ["", title]
        lines.append(f"{'dataset':<{width}} " + " ".join(f"{k:>5}" for k in range(1, gamma + 1)))
        for r in reports:
            values = getattr(r.stats, field)
            lines.append(f"{r.name:<{width}} " + " ".join(f"{_fmt(v, '.3f'):>5}" for v in values))
    return "\n".join(lines)


def plot_reports(reports: Sequence[DatasetReport], path: str | Path) -> None:
    """PNG: conditional acceptance per position for each dataset, and tau / speedup bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in reports:
        positions = np.arange(1, len(r.stats.conditional) + 1)
        curves.plot(positions, r.stats.conditional, marker="o", label=r.name)
    curves.set_xlabel("draft position k")
    curves.set_ylabel("P(accept k | 1..k-1 accepted)")
    curves.set_ylim(0, 1.02)
    curves.set_title("Conditional acceptance")
    curves.grid(alpha=0.3)
    curves.legend(fontsize="small")

    x = np.arange(len(reports))
    taus = [r.stats.tau for r in reports]
    speedups = [r.speedup if r.speedup is not None else np.nan for r in reports]
    bars.bar(x - 0.2, taus, 0.4, label="tau (tokens / round)")
    bars.bar(x + 0.2, speedups, 0.4, label="speedup (spec / plain tok/s)")
    bars.set_xticks(x, [r.name for r in reports], rotation=30, ha="right")
    bars.set_title("Acceptance length and decode speedup")
    bars.grid(alpha=0.3, axis="y")
    bars.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
