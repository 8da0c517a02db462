"""The known-acceptance drafter: through the slot engine, each block position is accepted at the
chosen rate (given the earlier ones were), greedy and sampled, and its confidence is calibrated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import configs
from dspark_jax.decoding.batching import Request, generate
from dspark_jax.decoding.engine import Engine, EngineConfig
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.known_acceptance import (
    KnownAcceptanceDrafter,
    KnownAcceptanceError,
    mute_target,
)
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.sampling import GREEDY, SamplingConfig

TARGET = configs.get("tiny-vanilla-target")
DRAFTER = configs.get("tiny-vanilla-dspark")
GAMMA = DRAFTER.block_size
# Falling like a trained drafter's, but high enough that the last positions are reached often.
ACCEPTANCE = tuple(np.linspace(0.95, 0.7, GAMMA).round(3))


@pytest.fixture(scope="module")
def models():
    target = mute_target(Qwen3(TARGET, rngs=nnx.Rngs(0)))
    drafter = KnownAcceptanceDrafter(DRAFTER, ACCEPTANCE, rngs=nnx.Rngs(1))
    return target, drafter


_RUNS: dict = {}


def _accepted_counts(models, sampling) -> tuple[np.ndarray, np.ndarray]:
    """Drafts accepted per round and confidence logits per round and position (cached)."""
    if sampling in _RUNS:
        return _RUNS[sampling]
    target, drafter = models
    # One verification and one drafter branch: every round verifies all 8 slots' blocks until
    # the last requests end, so smaller buckets would hardly run (and each compiles for seconds).
    cfg = EngineConfig(
        num_slots=8,
        max_model_len=512,
        prefill_chunk=16,
        prefill_buckets=(16,),
        token_buckets=(8 * (GAMMA + 1),),
        draft_buckets=(8,),
    )
    engine = Engine(target, drafter, cfg)  # fixed gamma: every draft is verified
    requests = [
        Request(list(range(2, 10)), 200, seed=i, sampling=sampling, ignore_eos=True)
        for i in range(16)
    ]
    results, _ = generate(engine, requests)
    assert all(r.verified.min() == GAMMA for r in results)
    accepted = np.concatenate([r.accepted for r in results])
    conf = np.concatenate([r.conf_logits for r in results])
    _RUNS[sampling] = accepted, conf
    return accepted, conf


@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=1.0)], ids=str)
def test_each_position_is_accepted_at_its_rate(models, sampling):
    accepted, conf_logits = _accepted_counts(models, sampling)
    assert len(accepted) > 500  # rounds: 16 requests x 200 tokens at tau ~5
    for k, rate in enumerate(ACCEPTANCE):
        reached = accepted >= k  # every earlier draft accepted: position k was decided
        n = int(reached.sum())
        measured = float((accepted[reached] > k).mean())
        sigma = np.sqrt(rate * (1 - rate) / n)
        assert abs(measured - rate) < 5 * sigma, (k, measured, rate, n)
    # Calibrated: the mean confidence at each position is its acceptance rate.
    mean_conf_k = (1 / (1 + np.exp(-conf_logits))).mean(axis=0)
    np.testing.assert_allclose(mean_conf_k, ACCEPTANCE, atol=0.03)


def test_confidence_predicts_acceptance(models):
    """Drafts the drafter is more confident of are accepted more often (what thresholds use)."""
    accepted, conf_logits = _accepted_counts(models, GREEDY)
    first = conf_logits[:, 0]
    ok = accepted > 0
    low, high = first < np.median(first), first >= np.median(first)
    assert ok[high].mean() > ok[low].mean() + 0.05


def test_the_real_drafters_work_is_kept(models):
    """XLA must not drop the real drafter's computation whose outputs are replaced: the block
    sampler compiles to at least the real drafter's FLOPs."""
    _, known = models
    plain = DSparkDrafter(DRAFTER, rngs=nnx.Rngs(1))
    h_bkd = jnp.zeros((4, GAMMA, DRAFTER.model.hidden_size), known.dtype)
    anchor_b = jnp.arange(4, dtype=jnp.int32)
    keys_bk = jax.random.split(jax.random.key(0), (4, GAMMA))

    def flops(drafter) -> float:
        graphdef, params = nnx.split(drafter)
        def used(p):  # what the engine reads of a block (not its raw logits)
            block = nnx.merge(graphdef, p).sample_block(h_bkd, anchor_b, keys_bk, GREEDY)
            return block.tokens_bk, block.logprobs_bkv, block.conf_logits_bk

        cost = jax.jit(used).lower(params).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    assert flops(known) >= flops(plain) > 0


def test_greedy_target_is_muted(models):
    target, _ = models
    engine = Engine(target, None, EngineConfig(num_slots=1, max_model_len=64))
    (result,), _ = generate(engine, [Request([5, 6, 7], 8, ignore_eos=True)])
    assert result.tokens == [0] * 8


@pytest.mark.parametrize(
    "acceptance, concentration, match",
    [
        ((0.5,) * (GAMMA - 1), 4.0, "acceptance rates for a block"),
        ((1.0,) * GAMMA, 4.0, r"in \(0, 1\)"),
        ((0.5,) * GAMMA, 0.0, "concentration"),
    ],
)
def test_bad_profiles_are_refused(acceptance, concentration, match):
    with pytest.raises(KnownAcceptanceError, match=match):
        KnownAcceptanceDrafter(DRAFTER, acceptance, concentration=concentration, rngs=nnx.Rngs(0))
