"""The engine with confidence policies on the fixture models: greedy outputs are exactly the
target's, the verified lengths are Algorithm 1's on the (STS-calibrated) confidences of each
round, and STS artifacts of another drafter or temperature are refused."""

import dataclasses

import jax
import numpy as np
import pytest
from fixture_models import load_pair, reference_traces
from test_scheduler import _reference_alg1, _survival

from dspark_jax.calibration.sts import StsArtifact, StsArtifactMismatchError
from dspark_jax.checkpoints.fingerprint import drafter_fingerprint
from dspark_jax.decoding import policies
from dspark_jax.decoding.engine import Engine, EngineConfig, EngineError
from dspark_jax.decoding.generate import Request, generate
from dspark_jax.sampling import SamplingConfig

CFG = EngineConfig(
    max_len=256, max_new_tokens=128, prompt_buckets=(64,), batch_buckets=(4,), rounds_per_chunk=16
)
# Steps/s per (batch, verify width) with a real trade-off: wider verification costs throughput.
PROFILE = policies.SpsProfile((1, 4), (1, 2, 4, 8), [[100, 97, 93, 85], [96, 90, 78, 55]])
STS_TEMPS = (1.5, 0.8, 1.2, 0.6, 1.0, 2.0, 0.9)


def _requests(variant):
    return [Request(t["prompt"], max_new_tokens=97) for t in reference_traces(variant)["traces"]]


def _check_greedy(variant, results):
    for trace, res in zip(reference_traces(variant)["traces"], results, strict=True):
        assert res.tokens[:96] == trace["greedy"]
        assert np.all(res.accepted <= res.verified)
        assert np.all(res.committed <= res.accepted + 1)


@pytest.mark.parametrize(
    "policy",
    [
        policies.ThresholdPolicy(0.5),
        policies.ThresholdPolicy(0.3, cumulative=True),
        policies.AsyncSchedulePolicy(PROFILE),
    ],
    ids=["threshold", "cumulative", "async"],
)
def test_greedy_output_is_the_target_greedy_output(policy):
    target, drafter = load_pair("vanilla")
    results, _ = generate(Engine(target, drafter, CFG, policy=policy), _requests("vanilla"), 4)
    _check_greedy("vanilla", results)
    verified = np.concatenate([r.verified for r in results])
    assert 0 < verified.mean() < drafter.cfg.block_size  # the policy really cuts blocks short


@pytest.mark.parametrize("variant", ["vanilla", "gated"])
def test_engine_lengths_are_algorithm_1_and_greedy_is_exact(variant):
    """Each round's verified lengths equal the paper's Algorithm 1 loop (which asserts that it
    never admits position j of a request before j-1) run on that round's confidences after STS,
    with the rectangle SPS table of the active requests; the output stays the greedy one."""
    target, drafter = load_pair(variant)
    fingerprint = drafter_fingerprint(drafter)
    sts = StsArtifact(STS_TEMPS, fingerprint, 0.0, n_records=1)
    engine = Engine(
        target,
        drafter,
        CFG,
        policy=policies.PrefixSchedulePolicy(PROFILE),
        sts=sts,
        drafter_fingerprint=fingerprint,
    )
    assert engine.verify_buckets == PROFILE.buckets
    results, _ = generate(engine, _requests(variant), 4)
    _check_greedy(variant, results)

    gamma = drafter.cfg.block_size
    row = np.asarray(PROFILE.row(4), np.float32)
    n_rounds = max(r.rounds for r in results)
    lengths_seen = set()
    for t in range(n_rounds):
        active = np.array([r.rounds > t for r in results])
        conf = np.zeros((4, gamma), np.float32)
        for b, r in enumerate(results):
            if active[b]:
                conf[b] = jax.nn.sigmoid(r.conf_logits[t] / np.asarray(STS_TEMPS, np.float32))
        table = np.asarray(
            policies.rectangle_sps_table(row, PROFILE.buckets, int(active.sum()), 4 * (gamma + 1))
        )
        want = _reference_alg1(_survival(conf), table, True, active)
        got = [r.verified[t] if active[b] else 0 for b, r in enumerate(results)]
        np.testing.assert_array_equal(got, want, err_msg=f"round {t}")
        lengths_seen.update(int(x) for x in got)
    assert len(lengths_seen) >= 3  # the schedule varies with the confidences


def test_mismatched_sts_artifacts_are_refused():
    target, drafter = load_pair("vanilla")
    fingerprint = drafter_fingerprint(drafter)
    _, gated = load_pair("gated")
    other = drafter_fingerprint(gated)
    good = StsArtifact(STS_TEMPS, fingerprint, 1.0, n_records=1)
    t1 = SamplingConfig(temperature=1.0)
    Engine(target, drafter, CFG, t1, sts=good, drafter_fingerprint=fingerprint)
    with pytest.raises(StsArtifactMismatchError, match="calibrated for drafter"):
        Engine(target, drafter, CFG, t1, sts=good, drafter_fingerprint=other)
    with pytest.raises(StsArtifactMismatchError, match="sampling temperature 1.0"):
        Engine(
            target,
            drafter,
            CFG,
            SamplingConfig(temperature=0.7),
            sts=good,
            drafter_fingerprint=fingerprint,
        )
    short = dataclasses.replace(good, temperatures=STS_TEMPS[:5])
    with pytest.raises(StsArtifactMismatchError, match="5 temperatures"):
        Engine(target, drafter, CFG, t1, sts=short, drafter_fingerprint=fingerprint)
    with pytest.raises(EngineError, match="drafter_fingerprint"):
        Engine(target, drafter, CFG, t1, sts=good)
    with pytest.raises(EngineError, match="needs a drafter"):
        Engine(target, None, CFG, t1, sts=good, drafter_fingerprint=fingerprint)


def test_profile_buckets_must_match_the_engine():
    target, drafter = load_pair("vanilla")
    policy = policies.PrefixSchedulePolicy(PROFILE)
    with pytest.raises(EngineError, match="differ from the SPS profile"):
        Engine(target, drafter, dataclasses.replace(CFG, verify_buckets=(4, 8)), policy=policy)
    small = policies.SpsProfile((4,), (1, 2, 4), [[3.0, 2.0, 1.0]])
    with pytest.raises(EngineError, match="gamma \\+ 1"):
        Engine(target, drafter, CFG, policy=policies.PrefixSchedulePolicy(small))
