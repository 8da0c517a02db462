"""allowed_token_ids (vLLM's): every token of a request, its first (sampled at prefill)
included, is drawn from its allowed tokens alone -- the target's logits with -inf elsewhere,
after its penalties and logit bias -- and requests without them are untouched by the ones
beside them that have them.

The fixture pair is float32, so greedy tokens are compared exactly with a reference that runs the
target over each whole prefix (`fixture_models.adjusted_greedy_reference`).
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from fixture_models import ADJUSTED_CFG, adjusted_greedy_reference

from dspark_jax.decoding import engine as engine_module
from dspark_jax.decoding.batching import Batcher, Request, generate
from dspark_jax.decoding.engine import Engine, EngineError
from dspark_jax.sampling import (
    SamplingConfig,
    SamplingConfigError,
    apply_allowed_tokens,
    filtered_logprobs,
)

NEW_TOKENS = 24
CFG = ADJUSTED_CFG  # up to 3 logit-bias (or allowed) tokens, and penalties


def _reference(target, prompt, sampling, n=NEW_TOKENS):
    return adjusted_greedy_reference(target, prompt, sampling, n, CFG.max_model_len)


@pytest.fixture(scope="module")
def free(gated_pair, gated_prompts):
    return [_reference(gated_pair[0], p, SamplingConfig()) for p in gated_prompts]


@pytest.fixture(scope="module")
def restricted(free):
    """Tokens the free answers hold, but not their first; with a bias that reorders them; and
    with penalties beside them."""
    first, second, third = free
    later = [t for t in dict.fromkeys(first[1:]) if t != first[0]][:3]
    return [
        SamplingConfig(allowed_token_ids=later),
        SamplingConfig(allowed_token_ids=second[2:4], logit_bias={second[3]: 2.0, 7: -1.0}),
        SamplingConfig(frequency_penalty=0.8, allowed_token_ids=(third[0], third[1], 32)),
    ]


def test_allowed_tokens_are_checked_and_kept_sorted():
    cfg = SamplingConfig(allowed_token_ids=[9, np.int64(3), 9])
    assert cfg.allowed_token_ids == (3, 9) and cfg.adjusted and not cfg.penalized
    assert cfg.filters == SamplingConfig() and not SamplingConfig(allowed_token_ids=()).adjusted
    both = SamplingConfig(allowed_token_ids=(3, 9), logit_bias={9: 2.0, 4: -1.0})
    assert both.bias_entries == ((3, 0.0), (9, 2.0))  # a bias off the allowed tokens is moot
    assert SamplingConfig(logit_bias={4: 1.0}).bias_entries == ((4, 1.0),)
    for bad, match in (
        ([-1], "token ids"),
        ([1.5], "token ids"),
        ([True], "token ids"),
        ("12", "a sequence of token ids"),
        ({1: 2}, "a sequence of token ids"),
        (5, "a sequence of token ids"),
    ):
        with pytest.raises(SamplingConfigError, match=match):
            SamplingConfig(allowed_token_ids=bad)
    with pytest.raises(SamplingConfigError, match="apply_allowed_tokens"):
        filtered_logprobs(jnp.zeros((2, 8)), cfg)


def test_apply_allowed_tokens_masks_the_rows_that_ask():
    logits = jnp.asarray([[1.0, 2.0, 3.0, 4.0], [0.5, -0.5, 0.5, 0.5]], jnp.bfloat16)
    ids = jnp.asarray([[2, 0, 2], [3, 3, 3]], jnp.int32)
    out = apply_allowed_tokens(logits, ids, jnp.asarray([True, False]))
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, [[1.0, -np.inf, 3.0, -np.inf], [0.5, -0.5, 0.5, 0.5]])


def test_greedy_tokens_follow_the_masked_target(
    gated_pair, adjusted_engine, adjusted_plain_engine, gated_prompts, free, restricted
):
    target, _ = gated_pair
    plain = adjusted_plain_engine  # Engine(target, None, CFG)
    requests = [
        Request(p, NEW_TOKENS, sampling=s) for p, s in zip(gated_prompts, restricted, strict=True)
    ]
    want = [_reference(target, r.prompt_ids, r.sampling) for r in requests]
    assert want[0][0] != free[0][0]  # the mask reaches the first token (prefill's)
    for w, r in zip(want, requests, strict=True):
        assert set(w) <= set(r.sampling.allowed_token_ids)
    assert len(set(want[0])) > 1  # not one token repeated: the model chooses among them
    neighbour = Request(gated_prompts[0], NEW_TOKENS)
    for engine in (plain, adjusted_engine):
        results, _ = generate(engine, requests + [neighbour])
        assert [r.tokens for r in results] == want + free[:1]


def test_samples_stay_in_the_allowed_tokens_and_the_free_keep_theirs(
    adjusted_engine, unadjusted_engine, gated_prompts
):
    """Sampled at temperature 1 (seeded) beside free requests, which get what an engine without
    room for biases gives them; a restricted sample is the same alone and among others."""
    free = [
        Request(gated_prompts[0], NEW_TOKENS),
        Request(
            gated_prompts[1], NEW_TOKENS, seed=7, sampling=SamplingConfig(temperature=0.8, top_k=9)
        ),
    ]
    allowed = (32, 101, 115)
    sampled = SamplingConfig(temperature=1.0, top_p=0.95, allowed_token_ids=allowed)
    restricted = Request(gated_prompts[2], NEW_TOKENS, seed=3, sampling=sampled)
    mixed, _ = generate(
        adjusted_engine, free + [restricted, dataclasses.replace(restricted, seed=4)]
    )
    alone, _ = generate(adjusted_engine, [restricted])
    # An engine with no room for the mask (nor penalties).
    baseline, _ = generate(unadjusted_engine, free)
    assert [r.tokens for r in mixed[:2]] == [r.tokens for r in baseline]
    assert mixed[2].tokens == alone[0].tokens != mixed[3].tokens
    for result in mixed[2:]:
        assert set(result.tokens) <= set(allowed) and len(set(result.tokens)) > 1


def test_the_drafter_draws_from_the_allowed_tokens_too(adjusted_engine):
    """What the drafter's rows are adjusted by: -inf off a live slot's allowed tokens, the
    bias on them; other slots keep their logits bitwise."""
    vocab = adjusted_engine.target_cfg.vocab_size
    logits = jnp.asarray(np.random.default_rng(0).normal(0, 3, (4, vocab)), jnp.float32)
    state = adjusted_engine.init_state().replace(
        bias_ids_sk=jnp.asarray([[3, 7, 3], [5, 0, 0], [2, 2, 2], [0, 0, 0]], jnp.int32),
        bias_sk=jnp.asarray([[0.0, 1.5, 0.0], [1.0, 0.0, 0.0], [0.0] * 3, [0.0] * 3]),
        allowed_s=jnp.asarray([True, False, True, True]),
        live_s=jnp.asarray([True, True, True, False]),
    )
    out = np.asarray(engine_module._draft_adjustments(state, vocab)(None)(logits))
    raw = np.asarray(logits)
    want0 = np.full(vocab, -np.inf, np.float32)
    want0[[3, 7]] = raw[0, [3, 7]] + np.asarray([0.0, 1.5], np.float32)
    np.testing.assert_array_equal(out[0], want0)
    want1 = raw[1].copy()
    want1[5] += 1.0
    np.testing.assert_array_equal(out[1], want1)  # a bias alone masks nothing
    assert np.isfinite(out[2]).sum() == 1 and out[2, 2] == raw[2, 2]
    np.testing.assert_array_equal(out[3], raw[3])  # not live


def test_no_program_compiles_after_warm_up(adjusted_engine, gated_prompts, restricted):
    adjusted_engine.warm_up()
    before = adjusted_engine.compiled_programs()
    sampled = dataclasses.replace(restricted[1], temperature=1.0)
    generate(
        adjusted_engine,
        [
            Request(gated_prompts[0], 12, sampling=restricted[0]),
            Request(gated_prompts[1], 12, seed=1, sampling=sampled),
        ],
    )
    assert adjusted_engine.compiled_programs() == before


def test_allowed_tokens_are_refused_where_they_cannot_apply(
    gated_pair, adjusted_engine, gated_prompts
):
    target, drafter = gated_pair
    without = Engine(target, drafter, dataclasses.replace(CFG, max_logit_bias=0))
    request = Request(gated_prompts[0], 8, sampling=SamplingConfig(allowed_token_ids=[5]))
    with pytest.raises(EngineError, match=r"allowed_token_ids need .*max_logit_bias=N") as err:
        Batcher(without).submit(request, lambda kind, payload: None)
    assert err.value.field == "allowed_token_ids"
    too_many = SamplingConfig(allowed_token_ids=[1, 2, 3, 4])
    with pytest.raises(EngineError, match="4 allowed_token_ids; this engine holds at most 3"):
        adjusted_engine.check_request(gated_prompts[0], 8, sampling=too_many)
    vocab = target.cfg.vocab_size
    with pytest.raises(EngineError, match=f"allowed token {vocab} is outside the vocabulary"):
        adjusted_engine.check_request(
            gated_prompts[0], 8, sampling=SamplingConfig(allowed_token_ids=[vocab])
        )
    # Only stop tokens, which min_tokens bans: nothing could be drawn before it.
    stops = Request(
        gated_prompts[0], 8, sampling=SamplingConfig(allowed_token_ids=[256]), min_tokens=2
    )
    with pytest.raises(EngineError, match="are all stop tokens") as err:
        Batcher(adjusted_engine).submit(stops, lambda kind, payload: None)
    assert err.value.field == "allowed_token_ids"
