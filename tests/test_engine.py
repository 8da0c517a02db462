"""The batched engine reproduces the reference's greedy traces and is batch invariant."""

import jax
import pytest
from fixture_models import VARIANTS, load_pair, reference_traces

from dspark_jax.decoding.engine import Engine, EngineConfig, EngineError
from dspark_jax.decoding.generate import Request, generate
from dspark_jax.sampling import SamplingConfig

# The reference counts its 96 tokens after the first one, then keeps the first 96 overall.
REFERENCE_NEW_TOKENS = 97
CFG = EngineConfig(
    max_len=256,
    max_new_tokens=128,
    prompt_buckets=(64, 128),
    batch_buckets=(1, 4, 8),
    rounds_per_chunk=8,
)


@pytest.fixture(scope="module", params=VARIANTS)
def setup(request):
    target, drafter = load_pair(request.param)
    return request.param, target, drafter


def _requests(traces, **kw):
    return [Request(t["prompt"], max_new_tokens=REFERENCE_NEW_TOKENS, **kw) for t in traces]


def test_greedy_traces_alone_and_batched(setup):
    variant, target, drafter = setup
    traces = reference_traces(variant)["traces"]
    spec = Engine(target, drafter, CFG)
    plain = Engine(target, None, CFG)
    batched, _ = generate(spec, _requests(traces), batch_size=4)
    for trace, res in zip(traces, batched, strict=True):
        alone, _ = generate(spec, _requests([trace]), batch_size=1)
        for r in (res, alone[0]):
            assert r.tokens[:96] == trace["output"]
            assert r.committed.tolist() == trace["acceptance_lengths"]
        assert res.tokens[:96] == trace["greedy"]
    greedy, _ = generate(plain, _requests(traces), batch_size=4)
    for trace, res in zip(traces, greedy, strict=True):
        assert res.tokens[:96] == trace["greedy"]
        assert set(res.committed.tolist()) == {1}


def _mixed_requests(seed_base=0):
    text = b"def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description="
    return [
        Request(list(text[: 20 + 9 * i]), max_new_tokens=12 + 5 * i, seed=seed_base + i)
        for i in range(5)
    ]


@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(), SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9)],
)
def test_batch_invariance(setup, sampling):
    """A request's output depends only on itself and its seed, not on its batch mates."""
    _, target, drafter = setup
    engine = Engine(target, drafter, CFG, sampling=sampling)
    requests = _mixed_requests()
    together, _ = generate(engine, requests, batch_size=8)
    for i in (0, 3):
        alone, _ = generate(engine, [requests[i]], batch_size=1)
        assert alone[0].tokens == together[i].tokens
        assert len(together[i].tokens) == requests[i].max_new_tokens
    reseeded, _ = generate(engine, [Request(requests[3].prompt_ids, 27, seed=99)], batch_size=1)
    if not sampling.greedy:
        assert reseeded[0].tokens != together[3].tokens


def test_no_compilation_after_warmup(setup):
    _, target, drafter = setup
    engine = Engine(target, drafter, CFG, sampling=SamplingConfig(temperature=1.0))
    # Warm-up: one batch bucket and one prompt bucket.
    generate(engine, _mixed_requests(), batch_size=8)
    compiles = []
    listener = lambda name, *a, **k: compiles.append(name) if "compile" in name else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        shuffled = [
            Request(r.prompt_ids[:-3], r.max_new_tokens + 4, r.seed + 7)
            for r in _mixed_requests()[::-1]
        ]
        generate(engine, shuffled, batch_size=8)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert engine._decode._cache_size() == 1
    assert engine._prefill._cache_size() == 1


def test_prompt_that_does_not_fit_is_refused(setup):
    _, target, drafter = setup
    engine = Engine(target, drafter, CFG)
    with pytest.raises(EngineError, match="max_len is 256"):
        generate(engine, [Request([1] * 200, max_new_tokens=100)])
    with pytest.raises(EngineError, match="empty prompt"):
        generate(engine, [Request([], max_new_tokens=4)])
