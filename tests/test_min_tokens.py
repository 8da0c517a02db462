"""min_tokens (vLLM's): no stop token -- the request's own or the model's end-of-turn ids -- ends a
request before it has that many new tokens. They are banned from the target's logits at those
places (the first token, sampled at prefill, included), so the answer is the target's with them
masked there: greedy tokens are compared exactly with a reference that runs the target over each
whole prefix (`fixture_models.adjusted_greedy_reference`), on the plain engine and on the
speculative one (whose drafter is not told: a stop token drafted too early is rejected).
Requests without min_tokens beside them keep their own tokens. The draws under it are held to
the masked target's distribution by tests/test_lossless.py (slow set).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from fixture_models import (
    ADJUSTED_CFG,
    TRACE_CFG,
    TRACE_PLAIN_CFG,
    adjusted_greedy_reference,
    load_pair,
    reference_traces,
)

from dspark_jax.decoding.batching import Batcher, Request, generate
from dspark_jax.decoding.engine import Engine, EngineError
from dspark_jax.sampling import SamplingConfig, ban_tokens

# The pair and engine configurations of tests/test_engine.py: the same programs, found in the
# run's persistent compilation cache by whichever file runs second.
VARIANT = "vanilla"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def models():
    return load_pair(VARIANT)


@pytest.fixture(scope="module")
def prompts():
    return [t["prompt"] for t in reference_traces(VARIANT)["traces"][:3]]


@pytest.fixture(scope="module")
def engines(models):
    target, drafter = models
    return {
        "spec": Engine(target, drafter, TRACE_CFG),
        "plain": Engine(target, None, TRACE_PLAIN_CFG),
    }


def _reference(target, request, eos=()):
    """The greedy answer `request` should get: its stop tokens (and the model's `eos`) banned
    from its first min_tokens tokens, the answer ending at the first one after."""
    stops = tuple(request.stop_token_ids) + tuple(eos)
    return adjusted_greedy_reference(
        target,
        request.prompt_ids,
        SamplingConfig(),
        request.max_new_tokens,
        TRACE_CFG.max_model_len,
        stops,
        request.min_tokens,
    )


def test_ban_tokens_masks_each_rows_ids_where_asked():
    logits = jnp.asarray([[1.0, 2.0, 3.0, 4.0], [0.5, -0.5, 0.5, 0.5]], jnp.bfloat16)
    ids = jnp.asarray([[3, 1, -2], [2, -2, -2]], jnp.int32)  # -2: padding (NO_STOP_TOKEN)
    out = ban_tokens(logits, ids, jnp.asarray([True, False]))
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, [[1.0, -np.inf, 3.0, -np.inf], [0.5, -0.5, 0.5, 0.5]])
    # Padding ids ban nothing (a negative index would count from the end of the row).
    out = ban_tokens(logits, ids, jnp.asarray([True, True]))
    np.testing.assert_array_equal(out[1], [0.5, -0.5, -np.inf, 0.5])


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_greedy_stop_tokens_wait_for_min_tokens(models, engines, prompts, kind):
    target, _ = models
    engine = engines[kind]
    free = [_reference(target, Request(p, NEW_TOKENS)) for p in prompts]
    # Stop tokens the free answers reach early: their 4th token, their first, and one that
    # recurs (a second prompt's space).
    requests = [
        Request(prompts[0], NEW_TOKENS, stop_token_ids=(free[0][3],), min_tokens=8),
        Request(prompts[2], NEW_TOKENS, stop_token_ids=(free[2][0],), min_tokens=1),
        Request(prompts[1], NEW_TOKENS, stop_token_ids=(free[1][0],), min_tokens=5),
        # The whole answer: no stop token can end it.
        Request(prompts[0], 10, stop_token_ids=(free[0][1], free[0][2]), min_tokens=10),
    ]
    # A stop token the free answer first reaches at min_tokens itself: the ban lifts at that
    # very place, which a speculative round verifies beside places before it (each row's own
    # place, not its round's first, decides).
    firsts = [k for k, t in enumerate(free[0]) if k >= 6 and t not in free[0][:k]]
    at_the_limit = [
        Request(prompts[0], NEW_TOKENS, stop_token_ids=(free[0][k],), min_tokens=k)
        for k in firsts[:2]
    ]
    assert len(at_the_limit) == 2
    want = [_reference(target, r) for r in requests]
    unbanned = [_reference(target, dataclasses.replace(r, min_tokens=0)) for r in requests]
    for request, tokens, early in zip(requests, want, unbanned, strict=True):
        assert len(early) <= request.min_tokens <= len(tokens)  # the ban changes the answer
        assert not set(tokens[: request.min_tokens]) & set(request.stop_token_ids)
    assert want[3] != free[0][:10] and len(want[3]) == 10
    # Beside a request without min_tokens, which keeps its own tokens.
    results, _ = generate(engine, requests[:3] + [Request(prompts[0], NEW_TOKENS)])
    assert [r.tokens for r in results] == want[:3] + [free[0]]
    assert [r.finish_reason for r in results[:3]] == [
        "stop" if t[-1] in r.stop_token_ids else "length"
        for r, t in zip(requests[:3], want[:3], strict=True)
    ]
    results, _ = generate(engine, requests[3:])
    assert results[0].tokens == want[3] and results[0].finish_reason == "length"
    results, _ = generate(engine, at_the_limit)
    assert [r.tokens for r in results] == [free[0][: r.min_tokens + 1] for r in at_the_limit]


def test_the_models_end_of_turn_waits_too_after_a_logit_bias(adjusted_engine, prompts):
    """min_tokens holds back the model's own end-of-turn ids (unless ignore_eos), after the
    request's logit bias: one that pushes EOS first comes at min_tokens. On the engine with
    both adjustments of tests/test_logit_bias.py (the same programs)."""
    target, _ = load_pair("gated")
    eos = target.cfg.eos_token_ids
    engine = adjusted_engine  # Engine(*load_pair("gated"), ADJUSTED_CFG)
    pushed = SamplingConfig(logit_bias={eos[0]: 40.0})
    requests = [
        Request(p, 16, sampling=pushed, min_tokens=m)
        for p, m in zip(prompts, (0, 6, 1), strict=True)
    ]
    want = [
        adjusted_greedy_reference(
            target, r.prompt_ids, pushed, 16, ADJUSTED_CFG.max_model_len, eos, r.min_tokens
        )
        for r in requests
    ]
    assert [len(w) for w in want] == [1, 7, 2] and all(w[-1] == eos[0] for w in want)
    results, _ = generate(engine, requests)
    assert [r.tokens for r in results] == want
    assert {r.finish_reason for r in results} == {"stop"}
    results, _ = generate(engine, [dataclasses.replace(requests[1], ignore_eos=True)])
    assert len(results[0].tokens) == 16 and results[0].finish_reason == "length"


def test_sampled_answers_hold_no_stop_token_before_min_tokens(engines, prompts):
    """Seeded samples: no stop token before min_tokens (where the free answers end early),
    the same answer alone and beside others, and requests without min_tokens beside them
    untouched; nothing compiles after warm-up."""
    spec = engines["spec"]
    spec.warm_up()
    before = spec.compiled_programs()
    sampling = SamplingConfig(temperature=1.0)
    stops = (32, 101)  # a space and an "e": frequent in the fixture's training text
    free = [
        Request(prompts[i % 3], NEW_TOKENS, seed=i, sampling=sampling, stop_token_ids=stops)
        for i in range(8)
    ]
    baseline, _ = generate(spec, free)
    assert sum(len(r.tokens) < 10 for r in baseline) >= 4  # stop tokens come early unbanned
    held = [dataclasses.replace(r, min_tokens=10) for r in free[:4]]
    mixed, _ = generate(spec, held + free[4:])
    assert [r.tokens for r in mixed[4:]] == [r.tokens for r in baseline[4:]]
    for result in mixed[:4]:
        assert len(result.tokens) >= 10 and not set(result.tokens[:10]) & set(stops)
    alone, _ = generate(spec, held[:1])
    assert alone[0].tokens == mixed[0].tokens
    assert spec.compiled_programs() == before


def test_min_tokens_is_checked(engines, prompts):
    batcher = Batcher(engines["plain"])
    for bad in (-1, 9, 2.0, True, "3", None):
        request = Request(prompts[0], 8, min_tokens=bad)
        with pytest.raises(EngineError, match=r"min_tokens must be an integer in 0\.\.") as err:
            batcher.submit(request, lambda *_: None)
        assert err.value.field == "min_tokens"
    batcher.submit(Request(prompts[0], 8, min_tokens=np.int64(8)), lambda *_: None)
