"""Priority admission (vLLM's `priority`): among the requests waiting for a slot, a lower value
is admitted first, equal values in arrival order; a running request is never preempted."""

from __future__ import annotations

import pytest

from dspark_jax.checkpoints.converted import load_decoding_models
from dspark_jax.decoding.batching import Batcher, Request
from dspark_jax.decoding.engine import Engine, EngineConfig, EngineError
from dspark_jax.embedded import TINY_TARGET


@pytest.fixture(scope="module")
def engine():
    models = load_decoding_models(TINY_TARGET, None, progress=False)
    return Engine(models.target, None, EngineConfig(num_slots=1, max_model_len=64))


def test_the_queue_is_ordered_by_priority_then_arrival(engine):
    """Admission only (no device work): one slot, a running request, then a queue."""
    batcher = Batcher(engine)

    def submit(priority: int):
        return batcher.submit(Request([1, 2], 4, priority=priority), lambda kind, payload: None)

    running = submit(5)
    batcher._drain_inbox()
    batcher._admit()
    assert running.slot is not None
    names = dict(b=0, c=-1, d=5, e=-1, f=0)
    handles = {name: submit(priority) for name, priority in names.items()}
    urgent = submit(-3)  # not preempting the running request: the slot stays its own
    batcher._drain_inbox()
    batcher._admit()
    assert running.slot is not None and urgent.slot is None
    order = [h.id for h in batcher.waiting]
    expected = [urgent] + [handles[n] for n in ("c", "e", "b", "f", "d")]
    assert order == [h.id for h in expected]
    # A cancel takes its request out of the order; the rest keep theirs.
    batcher.cancel(handles["e"])
    batcher._drain_inbox()
    assert [h.id for h in batcher.waiting] == [h.id for h in expected if h is not handles["e"]]


def test_requests_run_in_priority_order(engine):
    """End to end on a one-slot engine: the answers finish in the order of their priorities
    (the first, submitted alone, runs first whatever its own), and priority changes no token."""
    batcher = Batcher(engine)
    finished: list[str] = []
    results = {}

    def submit(name: str, priority: int) -> None:
        def on_event(kind, payload):
            if kind == "done":
                finished.append(name)
                results[name] = payload.tokens

        batcher.submit(Request([3, 4, 5], 6, seed=1, priority=priority), on_event)

    submit("first", 9)
    batcher.step()  # the first takes the slot
    for name, priority in (("low", 2), ("high", -2), ("mid", 0), ("high2", -2)):
        submit(name, priority)
    batcher.run_until_idle()
    assert finished == ["first", "high", "high2", "mid", "low"]
    assert len({tuple(tokens) for tokens in results.values()}) == 1


def test_priority_must_be_an_integer(engine):
    batcher = Batcher(engine)
    for bad in (0.5, "1", None):
        with pytest.raises(EngineError, match="priority must be an integer") as caught:
            batcher.submit(Request([1, 2], 4, priority=bad), lambda kind, payload: None)
        assert caught.value.field == "priority"
    assert batcher.num_waiting == 0
