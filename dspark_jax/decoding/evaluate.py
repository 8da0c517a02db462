"""The evaluation driver: turn-by-turn answering of prompt datasets, and its baseline replay.

`answer_conversations` answers multi-turn prompts the way a chat user would see them: the model's
own answer to turn i goes into the context of turn i+1, and every conversation runs through one
continuously batched loop. `replay` times another engine (plain decoding, the baseline) on
exactly the prompts of such a run. Decode throughput excludes prefill and (engines are warmed up
by their callers) compilation. Statistics are `stats`'s; tables and plots are the CLI's
(`dspark_jax.cli.report`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from dspark_jax.decoding.batching import Batcher, LoopTiming, Request, Result
from dspark_jax.decoding.engine import Engine, EngineError
from dspark_jax.decoding.stats import AcceptanceStats, acceptance_stats
from dspark_jax.sampling import GREEDY, SamplingConfig
from dspark_jax.tokenizer import decode_text, encode_chat


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
    timing: LoopTiming
    skipped: list[str]  # why a conversation stopped early (its prompt did not fit)

    def results(self) -> list[Result]:
        return [t.result for t in self.turns]


TokenCallback = Callable[[int, int, list[int]], None]  # (conversation, turn, new tokens)
TurnCallback = Callable[[Turn], None]


def _turn_request(
    engine: Engine,
    tokenizer,
    messages: list[dict[str, str]],
    max_new_tokens: int,
    sampling: SamplingConfig,
    seed: int,
    enable_thinking: bool,
    logprobs: bool = False,
    ignore_eos: bool = False,
    min_tokens: int = 0,
) -> Request:
    """The request answering `messages`' last turn; EngineError when it does not fit `engine`.
    One place for `answer_conversations` and `unfit_conversations`, so the check made before
    compiling is the one the run makes."""
    ids = encode_chat(tokenizer, messages, enable_thinking=enable_thinking)
    engine.check_request(ids, max_new_tokens, seed)
    return Request(
        ids,
        max_new_tokens,
        seed=seed,
        sampling=sampling,
        logprobs=logprobs,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
    )


def answer_conversations(
    engine: Engine,
    tokenizer,
    conversations: Sequence[Sequence[str]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
    enable_thinking: bool = False,
    on_tokens: TokenCallback | None = None,
    on_turn: TurnCallback | None = None,
    progress: bool = False,
    skip_unfit: bool = False,
    policy_index: int | None = None,
    logprobs: bool = False,
    ignore_eos: bool = False,
    min_tokens: int = 0,
) -> ConversationRun:
    """Answers every conversation turn by turn; see the module docstring.

    Conversations advance independently: the moment a conversation's answer to turn i is done,
    its turn i+1 (with that answer in its context) joins the running batch. A prompt that does
    not fit the engine raises `EngineError`, or with `skip_unfit` ends its conversation there
    and is listed in `skipped` (conversations and turns counted from 1, as the CLI labels
    answers). Request seeds are `seed + conversation * max_turns + turn`.
    `policy_index`: the member of the engine's `PolicySwitch` that runs (see `Batcher`).
    `logprobs`: the answers' results carry their tokens' log-probabilities (`Request.logprobs`).
    `ignore_eos`, `min_tokens`: every answer's (`Request`'s); an answer that ignores EOS runs to
    `max_new_tokens`.
    """
    max_turns = max((len(c) for c in conversations), default=0)
    batcher = Batcher(
        engine, max_waiting=max(len(conversations), 1), timed=True, policy_index=policy_index
    )
    run = ConversationRun(turns=[], timing=batcher.timing, skipped=[])
    stop = engine.stop_tokens
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(c) for c in conversations), unit="turn", desc="generate")

    def send(c: int, turn: int, history: list[dict[str, str]]) -> None:
        messages = history + [{"role": "user", "content": conversations[c][turn]}]
        try:
            request = _turn_request(
                engine,
                tokenizer,
                messages,
                max_new_tokens,
                sampling,
                seed + c * max_turns + turn,
                enable_thinking,
                logprobs,
                ignore_eos,
                min_tokens,
            )
        except EngineError as e:
            if not skip_unfit:
                raise EngineError(f"conversation {c + 1} turn {turn + 1}: {e}") from None
            run.skipped.append(f"conversation {c + 1} turn {turn + 1}: {e}")
            if bar is not None:
                bar.update(len(conversations[c]) - turn)
            return

        def on_event(kind: str, payload) -> None:
            if kind == "tokens" and on_tokens is not None:
                on_tokens(c, turn, payload)
            elif kind == "error":
                raise payload
            elif kind == "done":
                text = decode_text(tokenizer, payload.tokens, stop)
                record = Turn(c, turn, request, payload, text)
                run.turns.append(record)
                if bar is not None:
                    bar.update(1)
                if on_turn is not None:
                    on_turn(record)
                if turn + 1 < len(conversations[c]):
                    answer = {"role": "assistant", "content": text}
                    send(c, turn + 1, messages + [answer])

        batcher.submit(request, on_event)

    for c in range(len(conversations)):
        if conversations[c]:
            send(c, 0, [])
    batcher.run_until_idle()
    if bar is not None:
        bar.close()
    run.turns.sort(key=lambda t: (t.conversation, t.turn))
    return run


def unfit_conversations(
    engine: Engine,
    tokenizer,
    conversations: Sequence[Sequence[str]],
    *,
    max_new_tokens: int,
    seed: int = 0,
    enable_thinking: bool = False,
) -> list[str]:
    """Why each conversation whose first turn `engine` refuses would be skipped whole by
    `answer_conversations(..., skip_unfit=True)`, found without running anything: a caller can
    tell before compiling that nothing would be measured."""
    max_turns = max((len(c) for c in conversations), default=0)
    reasons = []
    for c, turns in enumerate(conversations):
        if not turns:
            continue
        messages = [{"role": "user", "content": turns[0]}]
        try:
            _turn_request(
                engine,
                tokenizer,
                messages,
                max_new_tokens,
                GREEDY,
                seed + c * max_turns,
                enable_thinking,
            )
        except EngineError as e:
            reasons.append(f"conversation {c + 1} turn 1: {e}")
    return reasons


def replay(engine: Engine, run: ConversationRun, progress: bool = False) -> LoopTiming:
    """Times `engine` on the prompts of `run` with the same lengths, settings and seeds, and the
    same dependencies: a conversation's turn i+1 joins the batch only once the replay has
    answered its turn i, as in `run`, where that answer was part of its prompt. (Sent all at
    once, a multi-turn dataset let the baseline batch turns the run could not yet have had,
    and the speedup measured the difference in concurrency.) `progress` shows a bar ("plain")
    of the turns replayed."""
    conversations: dict[int, list[Turn]] = {}
    for t in sorted(run.turns, key=lambda t: (t.conversation, t.turn)):
        conversations.setdefault(t.conversation, []).append(t)
    batcher = Batcher(engine, max_waiting=max(len(conversations), 1), timed=True)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(run.turns), unit="turn", desc="plain")

    def send(turns: list[Turn], i: int) -> None:
        def on_event(kind: str, payload) -> None:
            if kind == "error":
                raise payload
            if kind == "done":
                if bar is not None:
                    bar.update(1)
                if i + 1 < len(turns):
                    send(turns, i + 1)

        batcher.submit(turns[i].request, on_event)

    for turns in conversations.values():
        send(turns, 0)
    batcher.run_until_idle()
    if bar is not None:
        bar.close()
    return batcher.timing


# -- per-dataset report ------------------------------------------------------------------------
@dataclasses.dataclass
class DatasetReport:
    name: str
    conversations: int
    turns: int
    skipped: list[str]
    stats: AcceptanceStats
    spec_timing: LoopTiming
    plain_timing: LoopTiming | None

    @property
    def speedup(self) -> float | None:
        """Decode tokens/s of speculative over plain decoding (None unless both were measured)."""
        spec = self.spec_timing.decode_rate
        plain = None if self.plain_timing is None else self.plain_timing.decode_rate
        if spec is None or not plain:
            return None
        return spec / plain

    def to_json(self) -> dict[str, Any]:
        def timing(t: LoopTiming | None):
            if t is None:
                return None
            return {
                "prefill_s": t.prefill_s,
                "decode_s": t.decode_s,
                "decoded_tokens": t.decoded_tokens,
                "device_rounds": t.rounds,
                "decode_tokens_per_s": t.decode_rate,  # null: no decode round ran
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
    spec: Engine,
    plain: Engine | None,
    tokenizer,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
    enable_thinking: bool = False,
    progress: bool = False,
    policy_index: int | None = None,
    ignore_eos: bool = False,
    min_tokens: int = 0,
) -> tuple[DatasetReport, ConversationRun]:
    """Speculative decoding over `conversations`, then plain decoding on the same prompts.
    `policy_index`: the member of `spec`'s `PolicySwitch` that runs; `ignore_eos`,
    `min_tokens`: as `answer_conversations` takes them (the replay makes the same requests)."""
    run = answer_conversations(
        spec,
        tokenizer,
        conversations,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        seed=seed,
        enable_thinking=enable_thinking,
        progress=progress,
        skip_unfit=True,
        policy_index=policy_index,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
    )
    plain_timing = replay(plain, run, progress) if plain is not None else None
    report = DatasetReport(
        name=name,
        conversations=len(conversations),
        turns=len(run.turns),
        skipped=run.skipped,
        stats=acceptance_stats(run.results(), spec.gamma),
        spec_timing=run.timing,
        plain_timing=plain_timing,
    )
    return report, run
