"""Presence and frequency penalties: every token follows the target's logits less the penalties
for the tokens its request generated before it -- the anchor, earlier rounds' tokens and, in a
speculative round, the drafts a verified row comes after -- and requests without penalties are
untouched by the ones beside them that have some.

The fixture pair is float32, so greedy tokens are compared exactly with a reference that runs the
target over each whole prefix; the drafts-in-the-block counting is what makes the speculative
engine's tokens equal that reference (without it they part within the first rounds). That the
sampled distribution stays the penalised target's is test_lossless.py's chi-square (slow).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixture_models import ADJUSTED_CFG, adjusted_greedy_reference, reference_traces

from dspark_jax.decoding.batching import Batcher, Request, generate
from dspark_jax.decoding.engine import Engine, EngineConfig, EngineError
from dspark_jax.sampling import (
    SamplingConfig,
    SamplingConfigError,
    apply_penalties,
    filtered_logprobs,
    sample_tokens,
)
from dspark_jax.sharding import MeshConfig, make_mesh

VARIANT = "gated"  # a drafter with a Markov head: the penalties add to its bias
NEW_TOKENS = 40
CFG = ADJUSTED_CFG  # penalties on (and a logit bias of up to 3 tokens: test_logit_bias.py's)
PENALISED = (
    SamplingConfig(presence_penalty=1.0, frequency_penalty=0.5),
    SamplingConfig(frequency_penalty=1.5),
    SamplingConfig(presence_penalty=-0.5, frequency_penalty=0.8),
)
SAMPLED = SamplingConfig(temperature=0.8, top_p=0.95, presence_penalty=1.2)


@pytest.fixture(scope="module")
def models(gated_pair):
    return gated_pair  # load_pair(VARIANT): the pair of the shared engines below


@pytest.fixture(scope="module")
def spec(adjusted_engine):
    return adjusted_engine  # Engine(*models, CFG), built once per worker (tests/conftest.py)


@pytest.fixture(scope="module")
def prompts():
    return [t["prompt"] for t in reference_traces(VARIANT)["traces"][:3]]


def _reference(target, prompt, sampling, n=NEW_TOKENS):
    """Greedy tokens of the target run over each whole prefix, its logits less the penalties
    of the tokens generated so far (numpy, float64)."""
    return adjusted_greedy_reference(target, prompt, sampling, n, CFG.max_model_len)


def test_apply_penalties_is_openais_formula():
    logits = jnp.asarray([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.5, 0.5]], jnp.bfloat16)
    counts = jnp.asarray([[0, 1, 3, 0], [2, 0, 0, 1]], jnp.int32)
    out = apply_penalties(logits, counts, jnp.asarray([0.5, 0.0]), jnp.asarray([0.25, -1.0]))
    assert out.dtype == jnp.float32
    want = [[1.0, 2.0 - 0.25 - 0.5, 3.0 - 0.75 - 0.5, 4.0], [0.5 + 2.0, 0.5, 0.5, 0.5 + 1.0]]
    np.testing.assert_array_equal(out, want)
    # No penalty: the logits bitwise, whatever the counts.
    zero = jnp.zeros((2,), jnp.float32)
    np.testing.assert_array_equal(
        apply_penalties(logits, counts, zero, zero), logits.astype(jnp.float32)
    )


def test_greedy_tokens_follow_the_penalised_target(models, spec, adjusted_plain_engine, prompts):
    target, _ = models
    plain = adjusted_plain_engine  # Engine(target, None, CFG)
    requests = [Request(p, NEW_TOKENS, sampling=s) for p, s in zip(prompts, PENALISED, strict=True)]
    want = [_reference(target, r.prompt_ids, r.sampling) for r in requests]
    unpenalised = [_reference(target, p, SamplingConfig()) for p in prompts]
    assert all(w != u for w, u in zip(want, unpenalised, strict=True))  # the penalties bite
    for engine in (spec, plain):
        # Beside an unpenalised request, which keeps its own tokens.
        results, _ = generate(engine, requests + [Request(prompts[0], NEW_TOKENS)])
        assert [r.tokens for r in results] == want + unpenalised[:1]
        if engine is spec:  # rounds took drafts, some past a drafted token they repeat
            assert np.mean(np.concatenate([r.accepted for r in results[:3]])) > 0.5


def test_requests_without_penalties_do_not_see_the_others(spec, unadjusted_engine, prompts):
    """Unpenalised requests (greedy and seeded samples) beside penalised ones get the tokens an
    engine without penalties gives them; a seeded penalised sample gets the same tokens alone
    and among others."""
    free = [
        Request(prompts[0], NEW_TOKENS),
        Request(prompts[1], NEW_TOKENS, seed=7, sampling=SamplingConfig(temperature=0.8, top_k=9)),
    ]
    penalised = Request(prompts[2], NEW_TOKENS, seed=3, sampling=SAMPLED)
    mixed, _ = generate(spec, free + [penalised, dataclasses.replace(penalised, seed=4)])
    alone, _ = generate(spec, [penalised])
    # An engine with no room for penalties (nor biases).
    baseline, _ = generate(unadjusted_engine, free)
    assert [r.tokens for r in mixed[:2]] == [r.tokens for r in baseline]
    assert mixed[2].tokens == alone[0].tokens
    assert mixed[2].tokens != mixed[3].tokens  # a seed's own draws


def test_no_program_compiles_after_warm_up(spec, prompts):
    spec.warm_up()
    before = spec.compiled_programs()
    requests = [
        Request(prompts[0], 12, sampling=PENALISED[0]),
        Request(prompts[1], 12, seed=1, sampling=SAMPLED),
        Request(prompts[2], 12, seed=2, sampling=SamplingConfig(temperature=1.0)),
    ]
    generate(spec, requests)
    generate(spec, requests[2:])  # rounds where no live request has a penalty
    assert spec.compiled_programs() == before


def test_on_a_mesh_the_counts_split_with_the_slots(models, spec, prompts):
    """Slots over `data`, the vocabulary's logits over `tensor`: the single device's tokens
    (the repetition penalty's prompt marks split with the slots too)."""
    mesh = make_mesh(MeshConfig(2, 1, 2), jax.devices()[:4])
    sharded = Engine(*models, CFG, mesh=mesh)
    repeated = SamplingConfig(temperature=0.8, repetition_penalty=1.3)
    requests = [
        Request(prompts[0], 24, sampling=PENALISED[0]),
        Request(prompts[1], 24, seed=5, sampling=SAMPLED),
        Request(prompts[2], 24, seed=6, sampling=SamplingConfig(temperature=1.0)),
        Request(prompts[0], 24, seed=7, sampling=repeated),
    ]
    results, _ = generate(sharded, requests)
    expected, _ = generate(spec, requests)
    assert [r.tokens for r in results] == [r.tokens for r in expected]


def test_penalties_are_refused_where_they_cannot_apply(models, prompts):
    target, drafter = models
    without = Engine(target, drafter, dataclasses.replace(CFG, penalties=False))
    with pytest.raises(EngineError, match="penalties=True") as err:
        Batcher(without).submit(Request(prompts[0], 8, sampling=PENALISED[0]), lambda _: None)
    assert err.value.field == "sampling"
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"presence_penalty": "1"}):
        with pytest.raises(SamplingConfigError, match=next(iter(bad))):
            SamplingConfig(**bad)
    with pytest.raises(EngineError, match="penalties must be True or False"):
        EngineConfig(penalties="yes")
    # A row of logits knows no history: the filters refuse a config with penalties, greedy too.
    logits = jnp.zeros((2, 8))
    keys = jax.random.split(jax.random.key(0), 2)
    for sampling in (SAMPLED, PENALISED[0]):
        with pytest.raises(SamplingConfigError, match="apply_penalties"):
            filtered_logprobs(logits, sampling)
        with pytest.raises(SamplingConfigError, match="apply_penalties"):
            sample_tokens(keys, logits, sampling)
    np.testing.assert_array_equal(
        filtered_logprobs(logits, SAMPLED.filters),
        filtered_logprobs(logits, SamplingConfig(temperature=0.8, top_p=0.95)),
    )
