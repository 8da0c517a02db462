"""STS on the fixtures' drafters, with calibration records collected by running the engine.

Records: 128 prompts of 48 bytes cut from the Python standard library's source (the byte-level
fixture target was trained on such text; vendored in tests/data/sts_prompts.json, so the records
do not depend on the interpreter's own stdlib), 128 new tokens each, full blocks verified (fixed
gamma), so every round observes up to 7 positions; ~4-6k blocks per run, 30% held out by block.

The fixture drafters' confidence heads were trained on temperature-1 labels. Sampling greedily
(T = 0) they are badly miscalibrated (held-out mean ECE ~15%) and STS lowers it; at T = 1 they
are already calibrated to within the finite-sample noise of the ECE itself, so there is nothing
for STS to fix (the test shows this with the ECE of a perfectly calibrated predictor).
"""

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from fixture_models import load_pair

from dspark_jax.calibration import metrics, sts
from dspark_jax.calibration.records import records_from_results
from dspark_jax.decoding.batching import Request, generate
from dspark_jax.decoding.engine import Engine, EngineConfig
from dspark_jax.sampling import SamplingConfig

# Held-out sets decoded through a few programs: the time is in running them (tests/conftest.py).
pytestmark = pytest.mark.optimized

N_PROMPTS = 128
PROMPT_BYTES = 48
CFG = EngineConfig(
    num_slots=64,
    max_model_len=192,
    rounds_per_chunk=32,
    # Slots free a few at a time once the first 64 prompts are in: calls of 8 prompts take the
    # refills without paying for 32 each time, and the first 64 in 8 calls cost what 2 did.
    prefill_chunk=PROMPT_BYTES * 8,
    prefill_seqs=8,
    prefill_buckets=(PROMPT_BYTES * 8,),
    token_buckets=(64 * 8,),
    draft_buckets=(64,),  # one program branch each, as for the tokens: compile time
)

HOLDOUT = 0.3
PROMPTS = Path(__file__).parent / "data" / "sts_prompts.json"


def stdlib_prompts():
    """The vendored prompts (how they were cut: see the file's "about")."""
    doc = json.loads(PROMPTS.read_text())
    prompts = [list(bytes.fromhex(h)) for h in doc["prompts_hex"]]
    assert len(prompts) == N_PROMPTS and {len(p) for p in prompts} == {PROMPT_BYTES}
    return prompts


@functools.cache
def _records(variant, temperature):
    target, drafter = load_pair(variant)
    engine = Engine(target, drafter, CFG)
    sampling = SamplingConfig(temperature=temperature)
    requests = [
        Request(p, 128, seed=i, sampling=sampling)
        for i, p in enumerate(stdlib_prompts())
    ]
    results, _ = generate(engine, requests)
    return records_from_results(results)


def _mean(values):
    return float(np.mean([v for v in values if v is not None]))


@pytest.mark.parametrize("variant", ["vanilla", "gated"])
def test_sts_lowers_held_out_ece_at_temperature_0(variant):
    records = _records(variant, 0.0)
    assert len(records) > 3000
    artifact, report = sts.calibrate(
        records, HOLDOUT, seed=0, drafter_fingerprint="fixture", sampling_temperature=0.0
    )
    held = report["holdout"]
    before, after = _mean(held["ece_before"]), _mean(held["ece_after"])
    assert before > 0.1, before  # the T=1-trained head is far off at T=0
    assert after < 0.9 * before, (before, after)

    # Order preservation: per position, the calibrated c_k ranks the conditional events exactly
    # as the raw logit does, so the AUC of c_k is unchanged (first survival position too).
    _, hold_idx = sts.split_by_block(len(records), HOLDOUT, 0)
    hold = records.subset(hold_idx)
    observed, accepted = sts.conditional_events(hold)
    calibrated = sts.survival_product(hold.conf_logits_nk, np.asarray(artifact.temperatures))
    calibrated[:, 1:] /= calibrated[:, :-1]  # back from survivals a_k to the c_k (float64)
    for k in range(records.gamma):
        rows = observed[:, k]
        raw_auc = metrics.roc_auc(hold.conf_logits_nk[rows, k], accepted[rows, k])
        # NaN (one outcome only at this position) on both sides, or the same number.
        assert metrics.roc_auc(calibrated[rows, k], accepted[rows, k]) == pytest.approx(
            raw_auc, abs=1e-12, nan_ok=True
        )
        n_accepted = int(accepted[rows, k].sum())
        assert held["n_accepted"][k] == n_accepted
        if min(n_accepted, int(rows.sum()) - n_accepted) < sts.MIN_AUC_CLASS:
            assert held["conditional_auc"][k] is None  # too few of one outcome to rank
        else:
            assert held["conditional_auc"][k] == pytest.approx(raw_auc, abs=1e-12)
    assert held["auc_after"][0] == pytest.approx(held["auc_before"][0], abs=1e-12)


def test_at_temperature_1_the_head_is_near_the_ece_noise_floor():
    """At T = 1 the raw held-out ECE is close to what a perfectly calibrated predictor with the
    same predicted survivals scores (labels redrawn from the predictions, 200 seeded draws), so
    there is little for STS to fix at this sample size; STS must not make it worse by more than
    twice that noise. (With 4x the records, three seeds gave raw 2.10 / 1.70 / 1.88% and STS
    1.86 / 1.75 / 1.77%: changes within the seed-to-seed spread.)"""
    records = _records("vanilla", 1.0)
    _, report = sts.calibrate(
        records, HOLDOUT, seed=0, drafter_fingerprint="fixture", sampling_temperature=1.0
    )
    _, hold_idx = sts.split_by_block(len(records), HOLDOUT, 0)
    hold = records.subset(hold_idx)
    observed, _ = sts.survival_events(hold)
    a_nk = sts.survival_product(hold.conf_logits_nk, np.ones(hold.gamma))
    rng = np.random.default_rng(0)
    floor = []
    for _ in range(200):
        per_position = []
        for k in range(hold.gamma):
            p = a_nk[observed[:, k], k]
            per_position.append(metrics.ece(p, rng.uniform(size=p.size) < p))
        floor.append(np.mean(per_position))
    held = report["holdout"]
    before, after = _mean(held["ece_before"]), _mean(held["ece_after"])
    assert before < 1.5 * np.median(floor), (before, np.median(floor))
    assert after < before + 2 * np.std(floor), (before, after, np.std(floor))
