"""The evaluation driver: turn-by-turn answering of prompt datasets, and its baseline replay.

`answer_conversations` answers multi-turn prompts the way a chat user would see them: every
conversation's turn i is generated in one batched `generate` call, and the model's own answer to
turn i goes into the context of turn i+1. `replay` times another engine (plain decoding, the
baseline) on exactly the prompts of such a run. Decode throughput excludes prefill and, after
`warm_up`, compilation. Statistics are `stats`'s; tables and plots are the CLI's
(`dspark_jax.cli.report`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from dspark_jax.decoding.engine import Engine, EngineError
from dspark_jax.decoding.generate import BatchTiming, Request, Result, generate
from dspark_jax.decoding.stats import AcceptanceStats, acceptance_stats, add_timing
from dspark_jax.tokenizer import decode_text, encode_chat


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
