"""The repetition penalty (Hugging Face's and vLLM's): each token in the prompt or generated so
far has its logit divided by the penalty where positive and multiplied where negative, before the
presence and frequency penalties. The engine marks each request's prompt tokens once, when the
request is installed (a program of its own, `mark_prompts`), so the penalty holds from the first
token on -- for prompt tokens whose K/V came from the prefix cache and for prompts prefilled in
several chunks too -- and counts the generated ones as the other penalties do.

As in tests/test_penalties.py, the fixture pair is float32 and greedy tokens are compared exactly
with a reference that runs the target over each whole prefix; test_lossless.py's slow chi-square
holds the sampled distribution to the penalised target's.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from fixture_models import ADJUSTED_CFG, adjusted_greedy_reference, reference_traces

from dspark_jax.decoding import engine as engine_module
from dspark_jax.decoding.batching import Batcher, Request, generate
from dspark_jax.decoding.engine import Engine, EngineError, PrefillItem
from dspark_jax.sampling import SamplingConfig, SamplingConfigError, apply_repetition_penalty

VARIANT = "gated"
NEW_TOKENS = 32
CFG = ADJUSTED_CFG  # test_penalties.py's engines: their programs are cache hits here
STRONG = SamplingConfig(repetition_penalty=1.5)
# One per prompt: each changes its greedy answer, the last one from the first token on (its
# prompt's likeliest next token is one of its own).
REPEATED = (
    SamplingConfig(repetition_penalty=0.7),  # below 1: repeats made likelier
    SamplingConfig(repetition_penalty=1.3, presence_penalty=0.5),
    STRONG,
)


@pytest.fixture(scope="module")
def models(gated_pair):
    return gated_pair  # load_pair(VARIANT): the pair of the shared engines below


@pytest.fixture(scope="module")
def spec(adjusted_engine):
    return adjusted_engine  # Engine(*models, CFG), built once per worker (tests/conftest.py)


@pytest.fixture(scope="module")
def plain(adjusted_plain_engine):
    return adjusted_plain_engine  # Engine(models[0], None, CFG)


@pytest.fixture(scope="module")
def prompts():
    return [t["prompt"] for t in reference_traces(VARIANT)["traces"][:3]]


def _reference(target, prompt, sampling, n=NEW_TOKENS):
    return adjusted_greedy_reference(target, prompt, sampling, n, CFG.max_model_len)


def _run(batcher, requests):
    """Each request through `batcher` in turn (the next one submitted once the last is done),
    so that later ones find the earlier prompts' pages in its prefix cache."""
    results = []
    for request in requests:
        out = {}

        def on_event(kind, payload, out=out):
            if kind == "done":
                out["r"] = payload

        batcher.submit(request, on_event)
        batcher.run_until_idle()
        results.append(out["r"])
    return results


def test_apply_repetition_penalty_is_hugging_faces_formula():
    logits = jnp.asarray([[2.0, -2.0, 3.0, -1.0], [1.0, -1.0, 0.0, 4.0]], jnp.bfloat16)
    seen = jnp.asarray([[True, True, False, False], [True, True, True, False]])
    out = apply_repetition_penalty(logits, seen, jnp.asarray([2.0, 0.5]))
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, [[1.0, -4.0, 3.0, -1.0], [2.0, -0.5, 0.0, 4.0]])
    # A penalty of 1: the logits bitwise, whatever is marked.
    np.testing.assert_array_equal(
        apply_repetition_penalty(logits, seen, jnp.ones((2,))), logits.astype(jnp.float32)
    )


def test_greedy_tokens_follow_the_penalised_target(models, spec, plain, prompts):
    """Prompt tokens are penalised from the first token on (the reference's differ from the
    unpenalised ones at once for some prompt), generated ones as they come, drafts in the block
    included; an unpenalised request beside them keeps its own tokens."""
    target, _ = models
    requests = [Request(p, NEW_TOKENS, sampling=s) for p, s in zip(prompts, REPEATED, strict=True)]
    want = [_reference(target, r.prompt_ids, r.sampling) for r in requests]
    free = [_reference(target, p, SamplingConfig()) for p in prompts]
    assert all(w != f for w, f in zip(want, free, strict=True))  # the penalty bites
    assert any(w[0] != f[0] for w, f in zip(want, free, strict=True))  # at the first token
    for engine in (spec, plain):
        results, _ = generate(engine, requests + [Request(prompts[0], NEW_TOKENS)])
        assert [r.tokens for r in results] == want + free[:1]


def test_the_drafter_takes_the_same_penalties(spec):
    """What the drafter's rows are adjusted by (`_draft_adjustments`): the target's adjustment
    over the prompt marks and the tokens counted before the round -- repetition, then presence
    and frequency, then the logit bias -- for live slots; a slot that is not live, or whose
    request has none, keeps its logits (as float32) bitwise."""
    vocab = spec.target_cfg.vocab_size
    rng = np.random.default_rng(0)
    slots = CFG.num_slots
    logits = jnp.asarray(rng.normal(0, 3, (slots, vocab)), jnp.float32)
    counts = rng.integers(0, 3, (slots, vocab)) * (rng.random((slots, vocab)) < 0.1)
    prompt = rng.random((slots, vocab)) < 0.2
    penalties = np.asarray([[0.5, 0.25, 1.3], [0.0, 0.0, 0.8], [0.0, 0.0, 1.0], [1.0, 0.0, 1.5]])
    bias_ids = np.asarray([[3, 7, 0], [0, 0, 0], [5, 0, 0], [0, 0, 0]], np.int32)
    bias = np.asarray([[1.0, -2.0, 0.0], [0.0, 0.0, 0.0], [4.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    live = np.asarray([True, True, True, False])
    state = spec.init_state().replace(
        penalties_s=jnp.asarray(penalties, jnp.float32),
        counts_sv=jnp.asarray(counts, jnp.int32),
        prompt_sv=jnp.asarray(prompt),
        bias_ids_sk=jnp.asarray(bias_ids),
        bias_sk=jnp.asarray(bias, jnp.float32),
        live_s=jnp.asarray(live),
    )
    adjusted = np.asarray(engine_module._draft_adjustments(state, vocab)(None)(logits))
    raw = np.asarray(logits, np.float64)
    for s in range(slots):
        if not live[s]:
            np.testing.assert_array_equal(adjusted[s], logits[s])
            continue
        presence, frequency, repetition = penalties[s]
        seen = prompt[s] | (counts[s] > 0)
        penalised = np.where(raw[s] > 0, raw[s] / repetition, raw[s] * repetition)
        want = np.where(seen, penalised, raw[s])
        want = want - frequency * counts[s] - presence * (counts[s] > 0)
        np.add.at(want, bias_ids[s], bias[s])
        np.testing.assert_allclose(adjusted[s], want, rtol=1e-6, atol=1e-6)
    # Gathered rows (a smaller bucket): the same rows' adjustments.
    rows = jnp.asarray([2, 0])
    gathered = engine_module._draft_adjustments(state, vocab)(rows)(logits[rows])
    np.testing.assert_array_equal(gathered, adjusted[[2, 0]])


def test_prefix_cached_and_chunked_prompts_are_penalised_whole(models, spec, prompts):
    """A prompt of three prefill chunks (prefill_chunk 64), then the same prompt with another
    ending, whose first pages come from the prefix cache: the tokens of those pages, never
    prefilled for it, are penalised too. Requests without the penalty are not touched by the
    marks in their slots; one with it run in a slot marked before sees only its own prompt's."""
    target, _ = models
    long = (prompts[0] * 6)[:140]
    sampling = STRONG
    first = Request(long[:130], 8, sampling=sampling)
    second = Request(long[:120] + prompts[1][:12], 8, sampling=sampling)
    after = Request(prompts[1], 8)
    short = Request(prompts[2], 8, sampling=sampling)
    reused = Request(prompts[1], 8, sampling=sampling)  # the fifth: a slot run before
    requests = [first, second, after, short, reused]
    batcher = Batcher(spec)
    results = _run(batcher, requests)
    assert results[0].cached_tokens == 0 and results[1].cached_tokens >= 64
    for request, result in zip(requests, results, strict=True):
        assert result.tokens == _reference(target, request.prompt_ids, request.sampling, 8)
    # The reused slot's marks are its own prompt's alone: the earlier request's were cleared.
    want = np.zeros((spec.target_cfg.vocab_size,), bool)
    want[reused.prompt_ids] = True
    rows = np.asarray(batcher.state.prompt_sv)
    assert any((row == want).all() for row in rows)


def test_many_prompt_tokens_are_marked_over_several_calls(models, monkeypatch, prompts):
    """More distinct prompt tokens than one marking call takes: marked over several (here
    PROMPT_MARKS is made 5), with the same tokens as in one."""
    target, drafter = models
    requests = [Request(p, 12, sampling=STRONG) for p in prompts[:2]]
    whole = [_reference(target, r.prompt_ids, r.sampling, 12) for r in requests]
    monkeypatch.setattr(engine_module, "PROMPT_MARKS", 5)
    engine = Engine(target, drafter, CFG)
    calls = []
    mark = engine._mark_prompts
    engine._mark_prompts = lambda *a: calls.append(1) or mark(*a)
    results, _ = generate(engine, requests)
    assert [r.tokens for r in results] == whole
    distinct = sum(len(set(p)) for p in prompts[:2])
    assert len(calls) >= -(-distinct // 5) > 2


def test_no_program_compiles_after_warm_up(spec, prompts):
    spec.warm_up()
    before = spec.compiled_programs()
    generate(spec, [Request(p, 10, sampling=s) for p, s in zip(prompts, REPEATED, strict=True)])
    generate(spec, [Request(prompts[0], 10, seed=3, sampling=SamplingConfig(temperature=1.0))])
    assert spec.compiled_programs() == before


def test_repetition_penalty_is_refused_where_it_cannot_apply(models, prompts):
    target, drafter = models
    without = Engine(target, drafter, dataclasses.replace(CFG, penalties=False))
    with pytest.raises(EngineError, match="repetition_penalty.*penalties=True") as err:
        Batcher(without).submit(Request(prompts[0], 8, sampling=STRONG), lambda *_: None)
    assert err.value.field == "sampling"
    for bad in (0.0, -1.0, float("inf"), float("nan"), "1.2", True):
        with pytest.raises(SamplingConfigError, match="repetition_penalty"):
            SamplingConfig(repetition_penalty=bad)
    assert not SamplingConfig(repetition_penalty=1.0).penalized
    assert SamplingConfig(repetition_penalty=1.1).filters == SamplingConfig()
    # The engine's own entry point needs the whole prompt with the installing chunk.
    engine = Engine(target, drafter, CFG)
    item = PrefillItem(
        0, np.asarray(prompts[0], np.int32), 0, len(prompts[0]), np.zeros(1, np.int32),
        0.0, 0, 1.0, 4, (), 0, repetition_penalty=1.2,
    )  # fmt: skip
    with pytest.raises(EngineError, match="PrefillItem.prompt_ids"):
        engine.pack_prefill([item])
