"""logit_bias (OpenAI's): every token of a request, its first (sampled at prefill) included,
follows the target's logits plus the request's biases, beside penalties where it has both, and
requests without a bias are untouched by the ones beside them that have one.

The fixture pair is float32, so greedy tokens are compared exactly with a reference that runs the
target over each whole prefix (`fixture_models.adjusted_greedy_reference`).
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
    apply_logit_bias,
    filtered_logprobs,
    sample_tokens,
)
from dspark_jax.sharding import MeshConfig, make_mesh

VARIANT = "gated"
NEW_TOKENS = 32
CFG = ADJUSTED_CFG  # a logit bias of up to 3 tokens, and penalties (test_penalties.py's)


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
    return adjusted_greedy_reference(target, prompt, sampling, n, CFG.max_model_len)


@pytest.fixture(scope="module")
def unbiased(models, prompts):
    return [_reference(models[0], p, SamplingConfig()) for p in prompts]


@pytest.fixture(scope="module")
def biases(unbiased):
    """A ban of the first token and a later one; a push towards tokens the answer holds later
    and away from one; and (with penalties) a ban of the second token."""
    first, second, third = unbiased
    return [
        SamplingConfig(logit_bias={first[0]: -100.0, first[4]: -100}),
        SamplingConfig(logit_bias={second[6]: 4.0, second[7]: 2.5, second[1]: -3.0}),
        SamplingConfig(presence_penalty=1.0, frequency_penalty=0.3, logit_bias={third[1]: -100}),
    ]


def test_a_logit_bias_is_checked_and_kept_as_sorted_pairs():
    cfg = SamplingConfig(logit_bias={7: 1, np.int64(3): -2.5})
    assert cfg.logit_bias == ((3, -2.5), (7, 1.0)) and cfg.adjusted and not cfg.penalized
    assert SamplingConfig(logit_bias=[(7, 1.0), (3, -2.5)]) == cfg  # pairs: the same config
    assert hash(cfg) == hash(SamplingConfig(logit_bias=((3, -2.5), (7, 1))))
    assert cfg.filters == SamplingConfig() and not SamplingConfig(logit_bias={}).adjusted
    for bad, match in (
        ({5: 100.5}, r"logit_bias\[5\] must be in \[-100, 100\]"),
        ({5: float("nan")}, r"logit_bias\[5\] must be in"),
        ({5: "1"}, r"logit_bias\[5\] must be a number"),
        ({5: True}, r"logit_bias\[5\] must be a number"),
        ({-1: 1.0}, "token ids"),
        ({"5": 1.0}, "token ids"),
        ({2.5: 1.0}, "token ids"),
        ([(5, 1.0), (5, 2.0)], "names token 5 twice"),
        ([(5, 1.0, 2.0)], "the entry"),
        (5, "must map token ids to biases"),
    ):
        with pytest.raises(SamplingConfigError, match=match):
            SamplingConfig(logit_bias=bad)
    # A row of logits takes no bias through the filters: they refuse it, greedy too.
    logits = jnp.zeros((2, 8))
    keys = jax.random.split(jax.random.key(0), 2)
    for sampling in (cfg, SamplingConfig(temperature=0.5, logit_bias={1: 1.0})):
        with pytest.raises(SamplingConfigError, match="apply_logit_bias"):
            filtered_logprobs(logits, sampling)
        with pytest.raises(SamplingConfigError, match="apply_logit_bias"):
            sample_tokens(keys, logits, sampling)


def test_apply_logit_bias_adds_each_rows_biases_at_its_ids():
    logits = jnp.asarray([[1.0, 2.0, 3.0, 4.0], [0.5, -0.5, 0.5, 0.5]], jnp.bfloat16)
    ids = jnp.asarray([[3, 1, 0], [2, 0, 0]], jnp.int32)
    bias = jnp.asarray([[-100.0, 0.5, 0.0], [2.0, 0.0, 0.0]], jnp.float32)
    out = apply_logit_bias(logits, ids, bias)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, [[1.0, 2.5, 3.0, -96.0], [0.5, -0.5, 2.5, 0.5]])
    # No bias (entries padded with bias 0): the logits as they were.
    np.testing.assert_array_equal(
        apply_logit_bias(logits, ids, jnp.zeros_like(bias)), logits.astype(jnp.float32)
    )


def test_greedy_tokens_follow_the_biased_target(
    models, spec, adjusted_plain_engine, prompts, unbiased, biases
):
    target, _ = models
    # Without a drafter; counting tokens for penalties too: the third request has both.
    plain = adjusted_plain_engine  # Engine(target, None, CFG)
    requests = [Request(p, NEW_TOKENS, sampling=s) for p, s in zip(prompts, biases, strict=True)]
    want = [_reference(target, r.prompt_ids, r.sampling) for r in requests]
    assert want[0][0] != unbiased[0][0]  # the bias reaches the first token (prefill's)
    assert all(w != u for w, u in zip(want, unbiased, strict=True))
    assert unbiased[0][4] not in want[0] and unbiased[2][1] not in want[2]
    neighbour = Request(prompts[0], NEW_TOKENS)
    # Beside an unbiased request, which keeps its own tokens.
    results, _ = generate(plain, requests + [neighbour])
    assert [r.tokens for r in results] == want + unbiased[:1]
    results, _ = generate(spec, requests[:2] + [neighbour])
    assert [r.tokens for r in results] == want[:2] + unbiased[:1]
    # The drafter's logits take the bias too: the banned tokens are seldom drafted, so the
    # rounds keep taking drafts.
    assert np.mean(np.concatenate([r.accepted for r in results[:2]])) > 0.5


def test_requests_without_a_bias_do_not_see_the_others(spec, unadjusted_engine, prompts):
    """Unbiased requests (greedy and seeded samples) beside biased ones get the tokens an
    engine without logit bias gives them; a seeded biased sample gets the same tokens alone and
    among others."""
    free = [
        Request(prompts[0], NEW_TOKENS),
        Request(prompts[1], NEW_TOKENS, seed=7, sampling=SamplingConfig(temperature=0.8, top_k=9)),
    ]
    sampled = SamplingConfig(temperature=0.9, top_p=0.95, logit_bias={32: -100, 101: 3.0})
    biased = Request(prompts[2], NEW_TOKENS, seed=3, sampling=sampled)
    mixed, _ = generate(spec, free + [biased, dataclasses.replace(biased, seed=4)])
    alone, _ = generate(spec, [biased])
    # An engine with no room for biases (nor penalties).
    baseline, _ = generate(unadjusted_engine, free)
    assert [r.tokens for r in mixed[:2]] == [r.tokens for r in baseline]
    assert mixed[2].tokens == alone[0].tokens
    assert mixed[2].tokens != mixed[3].tokens  # a seed's own draws
    assert 32 not in mixed[2].tokens + mixed[3].tokens


def test_gathered_drafter_rows_take_their_own_slots_adjustments(models, prompts, biases):
    """The drafter runs over the smallest slot bucket of the live slots, gathered live first,
    and each gathered row takes its own slot's penalties and bias: a request that drafts from
    slot 1 or 2 once the short request in slot 0 is done (rows 0 and 1 of a bucket of 1 or 2)
    gets the same drafts, hence the same verified and accepted lengths and tokens, as alone in
    slot 0."""
    cfg = dataclasses.replace(CFG, draft_buckets=(1, 2, 4))
    gathered = Engine(*models, cfg)
    assert gathered.draft_buckets == (1, 2, 4)
    sampled = dataclasses.replace(biases[2], temperature=0.9, top_p=0.95)
    adjusted = [
        Request(prompts[2], NEW_TOKENS, seed=3, sampling=sampled),
        Request(prompts[1], NEW_TOKENS // 2, sampling=biases[1]),
    ]
    mixed, _ = generate(gathered, [Request(prompts[0], 4)] + adjusted)
    for request, got in zip(adjusted, mixed[1:], strict=True):
        alone, _ = generate(gathered, [request])
        assert got.tokens == alone[0].tokens
        np.testing.assert_array_equal(got.verified, alone[0].verified)
        np.testing.assert_array_equal(got.accepted, alone[0].accepted)
    # The adjusted drafts are taken: the rounds do not end at the first draft.
    assert np.mean(np.concatenate([r.accepted for r in mixed[1:]])) > 0.5


def test_no_program_compiles_after_warm_up(spec, prompts, biases):
    spec.warm_up()
    before = spec.compiled_programs()
    requests = [
        Request(prompts[0], 12, sampling=biases[0]),
        Request(prompts[1], 12, seed=1, sampling=dataclasses.replace(biases[1], temperature=1.0)),
        Request(prompts[2], 12, seed=2, sampling=SamplingConfig(temperature=1.0)),
    ]
    generate(spec, requests)
    generate(spec, requests[2:])  # rounds where no live request has a bias
    assert spec.compiled_programs() == before


def test_on_a_mesh_the_biases_split_with_the_slots(models, spec, prompts, biases):
    mesh = make_mesh(MeshConfig(2, 1, 2), jax.devices()[:4])
    sharded = Engine(*models, CFG, mesh=mesh)
    requests = [
        Request(prompts[0], 16, sampling=biases[0]),
        Request(prompts[1], 16, seed=5, sampling=dataclasses.replace(biases[1], temperature=0.7)),
        Request(prompts[2], 16, seed=6, sampling=SamplingConfig(temperature=1.0)),
        # allowed_token_ids live in the same slot rows (tests/test_allowed_tokens.py)
        Request(prompts[0], 16, seed=7, sampling=SamplingConfig(1.0, allowed_token_ids=(32, 101))),
    ]
    results, _ = generate(sharded, requests)
    expected, _ = generate(spec, requests)
    assert [r.tokens for r in results] == [r.tokens for r in expected]


def test_a_logit_bias_is_refused_where_it_cannot_apply(models, spec, prompts):
    target, drafter = models
    without = Engine(target, drafter, dataclasses.replace(CFG, max_logit_bias=0))
    request = Request(prompts[0], 8, sampling=SamplingConfig(logit_bias={5: 1.0}))
    with pytest.raises(EngineError, match=r"max_logit_bias=N") as err:
        Batcher(without).submit(request, lambda _: None)
    assert err.value.field == "logit_bias"
    too_many = SamplingConfig(logit_bias={1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0})
    with pytest.raises(EngineError, match="a logit_bias of 4 tokens; this engine takes at most 3"):
        spec.check_request(prompts[0], 8, sampling=too_many)
    vocab = target.cfg.vocab_size
    with pytest.raises(EngineError, match=f"token {vocab} is outside the vocabulary") as err:
        spec.check_request(prompts[0], 8, sampling=SamplingConfig(logit_bias={vocab: 1.0}))
    assert err.value.field == "logit_bias"
    for bad in (-1, 2.5, "2"):
        with pytest.raises(EngineError, match="max_logit_bias must be an integer >= 0"):
            EngineConfig(max_logit_bias=bad)
