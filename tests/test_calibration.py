"""Calibration metrics and Sequential Temperature Scaling."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.calibration import metrics, sts
from dspark_jax.cli import report


def _ece_loop(p, y, n_bins):
    """Independent ECE: explicit bins with half-open edges, last bin closed."""
    total = 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        in_bin = [
            (pi, yi)
            for pi, yi in zip(p, y, strict=True)
            if lo <= pi < hi or (b == n_bins - 1 and pi == 1)
        ]
        if in_bin:
            mp = sum(pi for pi, _ in in_bin) / len(in_bin)
            my = sum(yi for _, yi in in_bin) / len(in_bin)
            total += len(in_bin) / len(p) * abs(mp - my)
    return total


def _auc_pairs(s, y):
    """Independent AUC: fraction of (positive, negative) pairs ranked correctly, ties 1/2."""
    pos = [si for si, yi in zip(s, y, strict=True) if yi]
    neg = [si for si, yi in zip(s, y, strict=True) if not yi]
    wins = sum((sp > sn) + 0.5 * (sp == sn) for sp, sn in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_ece_hand_computed():
    # bins [0, .5), [.5, 1]: |0.15 - 0.5| * 2/4 + |0.9 - 1| * 2/4
    assert metrics.ece([0.1, 0.2, 0.85, 0.95], [0, 1, 1, 1], n_bins=2) == pytest.approx(0.225)
    # p = 1 falls in the last bin, p = 0 in the first
    assert metrics.ece([0.0, 1.0], [0, 1], n_bins=15) == 0.0
    assert metrics.ece([1.0, 1.0], [0, 1], n_bins=15) == pytest.approx(0.5)


def test_ece_matches_loop_and_is_small_when_calibrated():
    rng = np.random.default_rng(0)
    p = rng.uniform(size=400)
    y = rng.uniform(size=400) < p**2
    for n_bins in (1, 7, 15):
        assert metrics.ece(p, y, n_bins) == pytest.approx(_ece_loop(p, y, n_bins), abs=1e-12)
    p = rng.uniform(size=200_000)
    y = rng.uniform(size=p.size) < p
    # 15 bins x ~13k samples: per-bin noise ~0.004, so a calibrated ECE stays well under 0.01.
    assert metrics.ece(p, y) < 0.01


def test_ece_rows_matches_ece():
    rng = np.random.default_rng(1)
    p_gn = rng.uniform(size=(5, 300))
    y = (rng.uniform(size=300) < 0.4).astype(float)
    np.testing.assert_allclose(
        metrics.ece_rows(p_gn, y, 15), [metrics.ece(row, y) for row in p_gn], atol=1e-12
    )


def test_roc_auc_hand_ties_and_pairs():
    assert metrics.roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert metrics.roc_auc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)
    assert metrics.roc_auc([0.2, 0.9], [1, 0]) == 0.0
    rng = np.random.default_rng(2)
    s = rng.integers(0, 6, size=120).astype(float)  # many ties
    y = rng.uniform(size=120) < 0.3 + 0.1 * s
    assert metrics.roc_auc(s, y) == pytest.approx(_auc_pairs(s, y), abs=1e-12)


def test_roc_auc_invariant_under_monotone_transform():
    rng = np.random.default_rng(3)
    s = rng.normal(size=500)
    y = rng.uniform(size=500) < 1 / (1 + np.exp(-2 * s))
    base = metrics.roc_auc(s, y)
    assert 0.6 < base < 0.95
    for f in (np.exp, lambda x: 3 * x - 7, lambda x: 1 / (1 + np.exp(-x / 4)), np.cbrt):
        assert metrics.roc_auc(f(s), y) == pytest.approx(base, abs=1e-12)


def test_roc_auc_single_class_is_nan_and_bad_input_raises():
    assert np.isnan(metrics.roc_auc([0.1, 0.2], [1, 1]))
    with pytest.raises(metrics.MetricInputError, match="binary"):
        metrics.roc_auc([0.1, 0.2], [0, 2])
    with pytest.raises(metrics.MetricInputError, match="labels"):
        metrics.ece([0.1, 0.2], [0, 1, 1])
    with pytest.raises(metrics.MetricInputError, match=r"\[0, 1\]"):
        metrics.brier([1.2], [1])
    with pytest.raises(metrics.MetricInputError, match="empty"):
        metrics.ece([], [])


def test_brier_hand_computed():
    assert metrics.brier([0.9, 0.2, 0.5], [1, 0, 0]) == pytest.approx((0.01 + 0.04 + 0.25) / 3)


def test_reliability_diagram_writes_png(tmp_path):
    rng = np.random.default_rng(4)
    panels = []
    for _ in range(5):
        p = rng.uniform(size=300)
        y = rng.uniform(size=300) < p
        panels.append({"raw": (np.sqrt(p), y), "STS": (p, y)})
    panels.append({"raw": (np.array([]), np.array([]))})
    out = report.reliability_diagram(panels, tmp_path / "sub" / "rel.png", title="test")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_log_count_axes_label_powers_of_ten_only():
    """Counts 1..55 span under two decades: matplotlib then labelled the minor ticks too (6x10^1,
    4x10^1, ...), which overlapped in the reliability diagram's histogram strip (position 5 of a
    real run)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.8, 1.2))
    ax = fig.add_subplot()
    counts = np.r_[np.full(55, 0.02), np.full(4, 0.1), 0.2, 0.2]
    ax.hist(counts, bins=np.linspace(0, 1, 16), histtype="step")
    report.log_counts(ax)
    fig.canvas.draw()
    assert [t.get_text() for t in ax.yaxis.get_minorticklabels() if t.get_text()] == []
    low, high = ax.get_ylim()
    ticks = zip(ax.yaxis.get_majorticklabels(), ax.yaxis.get_majorticklocs(), strict=True)
    assert [t.get_text() for t, y in ticks if low <= y <= high] == ["$\\mathdefault{10^{1}}$"]


# ---------------------------------------------------------------- STS


def _synthetic_records(n_blocks, gamma, overconfidence, seed):
    """Blocks with known per-position acceptance probabilities p = sigmoid(t); the drafter's
    confidence logit is `overconfidence * t`. Verified lengths are outcome-independent: 70 %
    full blocks, the rest uniform in 0..gamma."""
    rng = np.random.default_rng(seed)
    mu_k = 2.0 - 0.4 * np.arange(gamma)
    t_nk = mu_k[None, :] + 1.2 * rng.normal(size=(n_blocks, gamma))
    accept_nk = rng.uniform(size=(n_blocks, gamma)) < 1 / (1 + np.exp(-t_nk))
    leading = np.cumprod(accept_nk, axis=1).sum(axis=1)
    full = rng.uniform(size=n_blocks) < 0.7
    verified = np.where(full, gamma, rng.integers(0, gamma + 1, size=n_blocks))
    accepted = np.minimum(leading, verified)
    return sts.CalibrationRecords(overconfidence * t_nk, verified, accepted)


def test_event_definitions():
    rec = sts.CalibrationRecords(np.zeros((3, 3)), [2, 3, 0], [1, 0, 0])
    obs, surv = sts.survival_events(rec)
    np.testing.assert_array_equal(obs, [[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    np.testing.assert_array_equal(surv, [[1, 0, 0], [0, 0, 0], [0, 0, 0]])
    obs, acc = sts.conditional_events(rec)
    np.testing.assert_array_equal(obs, [[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    np.testing.assert_array_equal(acc, [[1, 0, 0], [0, 0, 0], [0, 0, 0]])


def test_records_validation_save_load_concatenate(tmp_path):
    with pytest.raises(sts.CalibrationInputError, match="accepted_n"):
        sts.CalibrationRecords(np.zeros((1, 3)), [1], [2])
    with pytest.raises(sts.CalibrationInputError, match="verified_n"):
        sts.CalibrationRecords(np.zeros((1, 3)), [4], [0])
    a = _synthetic_records(50, 4, 1.0, seed=0)
    b = _synthetic_records(30, 4, 1.0, seed=1)
    a.save(tmp_path / "a.npz")
    loaded = sts.CalibrationRecords.load(tmp_path / "a.npz")
    np.testing.assert_array_equal(loaded.conf_logits_nk, a.conf_logits_nk)
    np.testing.assert_array_equal(loaded.accepted_n, a.accepted_n)
    both = sts.CalibrationRecords.concatenate([a, b])
    assert len(both) == 80 and both.gamma == 4
    np.testing.assert_array_equal(both.verified_n[50:], b.verified_n)
    with pytest.raises(sts.CalibrationInputError, match="gamma"):
        sts.CalibrationRecords.concatenate([a, _synthetic_records(5, 3, 1.0, seed=2)])


def test_split_is_deterministic_and_partitions():
    fit, hold = sts.split_by_block(100, 0.3, seed=7)
    fit2, hold2 = sts.split_by_block(100, 0.3, seed=7)
    np.testing.assert_array_equal(hold, hold2)
    np.testing.assert_array_equal(fit, fit2)
    assert len(hold) == 30 and sorted(np.concatenate([fit, hold]).tolist()) == list(range(100))
    assert not np.array_equal(hold, sts.split_by_block(100, 0.3, seed=8)[1])
    with pytest.raises(sts.CalibrationInputError, match="holdout_fraction"):
        sts.split_by_block(100, 1.0, seed=0)


def test_fit_leaves_calibrated_confidences_near_one():
    temps = sts.fit_sts(_synthetic_records(20_000, 4, 1.0, seed=3))
    # Grid steps are 2.5 %; sampling noise moves the ECE minimum by a few steps at most.
    np.testing.assert_allclose(temps, 1.0, rtol=0.25)


def test_sts_fixes_overconfidence_and_preserves_ranking():
    gamma = 5
    records = _synthetic_records(20_000, gamma, 3.0, seed=5)
    art, report = sts.calibrate(
        records, 0.3, seed=0, drafter_fingerprint="drafter-a", sampling_temperature=1.0
    )
    temps = np.asarray(art.temperatures)
    # logits = 3 x true logit, so T = 3 makes every survival product exact.
    np.testing.assert_allclose(temps, 3.0, rtol=0.25)
    hold = report["holdout"]
    before, after = np.asarray(hold["ece_before"]), np.asarray(hold["ece_after"])
    assert np.all(before > 0.04), before
    assert np.all(after < 0.25 * before), (before, after)
    # The floor is the ECE of the true survival probabilities on the same ~4.5k-5.7k held-out
    # samples (finite-sample binning noise, ~0.01-0.025 here); STS must come within 0.01 of it.
    _, hold_idx = sts.split_by_block(len(records), 0.3, seed=0)
    held = records.subset(hold_idx)
    surv_obs, survived = sts.survival_events(held)
    true_nk = sts.survival_product(held.conf_logits_nk / 3.0, np.ones(gamma))
    oracle = np.array(
        [metrics.ece(true_nk[surv_obs[:, k], k], survived[surv_obs[:, k], k]) for k in range(gamma)]
    )
    assert np.all(after < oracle + 0.01), (after, oracle)
    # Brier is a proper score: calibration must improve it too.
    assert np.all(np.asarray(hold["brier_after"]) < np.asarray(hold["brier_before"]))

    # Per-position ranking of c_k on the conditional event is untouched by STS.
    obs, acc = sts.conditional_events(held)
    artifact = sts.StsArtifact(tuple(temps), "sha256:test", 1.0, n_records=len(held))
    calibrated = np.asarray(
        jax.nn.sigmoid(jax.jit(artifact.calibrated_logits)(jnp.asarray(held.conf_logits_nk)))
    )
    for k in range(gamma):
        rows = obs[:, k]
        z, y = held.conf_logits_nk[rows, k], acc[rows, k]
        raw_auc = metrics.roc_auc(1 / (1 + np.exp(-z)), y)
        assert metrics.roc_auc(1 / (1 + np.exp(-z / temps[k])), y) == raw_auc
        assert hold["conditional_auc"][k] == pytest.approx(raw_auc, abs=1e-12)
        # float32 rounding can merge near-equal scores into ties, so allow a tie-sized change.
        assert metrics.roc_auc(calibrated[rows, k], y) == pytest.approx(raw_auc, abs=1e-4)
        assert 0.6 < raw_auc < 0.9


def test_calibrated_logits_match_host_and_check_shape():
    z = np.array([[2.0, -1.0, 0.5], [6.0, 3.0, -4.0]])
    temps = np.array([0.5, 2.0, 4.0])
    host = 1 / (1 + np.exp(-z / temps))
    artifact = sts.StsArtifact(tuple(temps), "sha256:test", 1.0, n_records=2)
    np.testing.assert_allclose(
        jax.nn.sigmoid(artifact.calibrated_logits(jnp.asarray(z, jnp.float32))), host, rtol=1e-6
    )
    four = sts.StsArtifact((1.0, 1.0, 1.0, 1.0), "sha256:test", 1.0, n_records=2)
    with pytest.raises(sts.CalibrationInputError, match="positions"):
        four.calibrated_logits(jnp.zeros((2, 3)))


def test_artifact_round_trip_and_mismatch(tmp_path):
    records = _synthetic_records(3_000, 3, 2.0, seed=9)
    art, _ = sts.calibrate(
        records, 0.3, seed=1, drafter_fingerprint="sha256:abc", sampling_temperature=0.7
    )
    path = tmp_path / "sts.json"
    art.save(path)
    loaded = sts.StsArtifact.load(path)
    loaded.check("sha256:abc", 0.7, block_size=3)
    assert loaded.temperatures == art.temperatures and loaded.gamma == 3
    assert loaded.n_records == 3_000 and loaded.metrics == art.metrics
    np.testing.assert_allclose(loaded.temps(), art.temperatures, rtol=1e-6)
    with pytest.raises(sts.StsArtifactMismatchError, match="drafter 'sha256:abc'"):
        loaded.check("sha256:other", 0.7)
    with pytest.raises(ValueError, match="sampling temperature 0.7"):
        loaded.check("sha256:abc", 1.0)


@pytest.mark.parametrize(
    ("field", "value", "refusal"),
    [
        ("temperatures", 5, "temperatures must be a list of numbers, got 5"),
        ("temperatures", "abcdefg", "temperatures must be a list of numbers, got 'abcdefg'"),
        ("temperatures", ["a"] * 7, "temperatures must be a list of numbers"),
        ("sampling_temperature", None, "sampling_temperature must be finite and >= 0, got None"),
        ("sampling_temperature", "1", "got '1'"),
        ("drafter_fingerprint", 5, "drafter_fingerprint must be a non-empty string, got 5"),
        ("n_records", "many", "n_records must be an integer >= 0, got 'many'"),
        ("metrics", 3, "metrics must be a dict, got 3"),
    ],
)
def test_a_hand_edited_sts_artifact_is_refused_by_name(field, value, refusal, tmp_path):
    """An artifact is a file users edit: a bad field raised a raw TypeError or ValueError (a
    traceback from the commands), or was taken (a numeric fingerprint, n_records 'many')."""
    path = tmp_path / "sts.json"
    sts.StsArtifact((1.0,) * 7, "sha256:test", 1.0, n_records=3).save(path)
    body = json.loads(path.read_text())
    body[field] = value
    path.write_text(json.dumps(body))
    with pytest.raises(sts.CalibrationInputError, match=f"^{path}: .*{refusal}"):
        sts.StsArtifact.load(path)
