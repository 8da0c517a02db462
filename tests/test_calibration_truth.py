"""Calibration output that shows where its numbers are thin: temperatures pinned at the grid
bound, AUCs withheld below a stated class size, positions with few observations marked in the
table, the warnings and the reliability diagram; eval plots that keep 11+ datasets apart."""

from __future__ import annotations

import numpy as np
from fixture_models import fixture_dir

from dspark_jax import cli
from dspark_jax.calibration import sts
from dspark_jax.calibration.sts import CalibrationRecords, StsArtifact
from dspark_jax.cli import report

DRAFTER = fixture_dir("vanilla") / "draft"


def _thin_tail_records(n=400, seed=0):
    """Blocks of 7 verified to position 5 except five full blocks: positions 6 and 7 have a
    handful of observations, and late positions few survivals."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.5, 2.5, size=(n, 7))
    success = rng.uniform(size=(n, 7)) < 1 / (1 + np.exp(-z / 3))
    leading = np.sum(np.cumprod(success, axis=1), axis=1)
    verified = np.full(n, 7)
    verified[: n - 5] = 5
    return CalibrationRecords(z, verified, np.minimum(leading, verified))


def test_auc_needs_enough_of_each_outcome():
    z = np.linspace(-3, 3, 40)[:, None]
    # Two survivals among 40: a perfect ranking of two positives is not evidence.
    two = CalibrationRecords(z, np.ones(40), (np.arange(40) >= 38).astype(int))
    part = sts.position_metrics(two, np.ones(1))
    assert part["n_survived"] == [2] and part["auc_before"] == [None]
    assert part["conditional_auc"] == [None]
    many = CalibrationRecords(z, np.ones(40), (np.arange(40) >= 20).astype(int))
    assert sts.position_metrics(many, np.ones(1))["auc_before"] == [1.0]


def test_pinned_positions():
    grid = sts.default_grid()
    assert sts.pinned_positions(np.array([1.0, 20.0, 0.05, 3.0]), grid) == [2, 3]


def test_calibrate_warns_and_marks_thin_numbers(tmp_path, capsys):
    _thin_tail_records().save(tmp_path / "records.npz")
    out, plot = tmp_path / "sts.json", tmp_path / "rel.png"
    argv = ["calibrate", "--records", str(tmp_path / "records.npz"), "--drafter", str(DRAFTER)]
    argv += ["--temperature", "1", "--out", str(out), "--plot", str(plot)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    artifact = StsArtifact.load(out)
    pinned = artifact.metrics["pinned"]
    assert pinned and all(artifact.temperatures[k - 1] == 20.0 for k in pinned)
    for k in pinned:
        assert f"position {k}: temperature 20 is pinned at the upper end" in captured.err
    assert "only 2 observations" in captured.err
    assert "no AUC at position(s)" in captured.err
    held = artifact.metrics["holdout"]
    assert held["auc_after"][6] is None and held["n_survival"][6] == 2
    # The table withholds those AUCs ("-") and stars the thin positions.
    rows = {line.split()[0]: line for line in captured.out.splitlines() if line[:3].strip()}
    assert "2*" in rows["7"] and rows["7"].split()[6:8] == ["-", "-"]
    assert "AUC '-': fewer than 10 observations of one outcome" in captured.out
    # Table titles name the records file, not its whole path.
    assert "fit split of records.npz" in captured.out
    assert not any(str(tmp_path) in line for line in captured.out.splitlines() if "split" in line)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reliability_diagram_with_thin_and_empty_positions(tmp_path):
    records = _thin_tail_records()
    series = sts.reliability_series(records, np.ones(records.gamma))
    series.append({"raw": (np.array([]), np.array([]))})
    out = report.reliability_diagram(series, tmp_path / "rel.png", title="thin")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eleven_datasets_get_distinct_styles():
    styles = report._series_styles(11)
    assert len({s["color"] for s in styles}) == 11
    assert len({(s["color"], s["marker"]) for s in styles}) == 11
    assert len({s["color"] for s in report._series_styles(20)}) == 20
