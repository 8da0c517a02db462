"""benchmarks/gpu_targets.py: the four aims of the GPU session, judged from its JSON files."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_targets  # noqa: E402


def _write(folder: Path, name: str, data: dict) -> None:
    (folder / name).write_text(json.dumps(data))


def _decode(floor_ms, plain_ms=3.0, spec_ms=3.6):
    row = {"batch": 1, "plain_ms": plain_ms, "spec_ms": spec_ms, "floor_ms": floor_ms}
    row["round_over_step"] = spec_ms / plain_ms
    other = {**row, "batch": 8, "plain_ms": 100.0, "round_over_step": 9.0}
    meta = {"device": "H100", "dtype": "bfloat16", "context": 1024, "gamma": 7}
    return {**meta, "rows": [row, other]}


def _throughput(schedulers, others, concurrency=64):
    rows = [
        {"concurrency": concurrency, "mode": m, "throughput": t}
        for m, t in {**schedulers, **others}.items()
    ]
    rows.append({"concurrency": 1, "mode": "scheduler (5.2)", "throughput": 1e9})
    return {"device": "gpu: H100", "rows": rows}


def _train(mfu, drafter_mfu=None):
    models = {"target": "qwen3-4b", "drafter": "dspark-qwen3-4b", "dtype": "bfloat16"}
    return {"device": "1 x H100", **models, "achieved_tflops": 400.0, "step_s_median": 1.5,
            "mfu": mfu, "drafter_mfu": drafter_mfu, "model_flops_version": 2}  # fmt: skip


def test_every_aim_met(tmp_path):
    _write(tmp_path, "decode_speed.json", _decode(floor_ms=2.7))
    _write(tmp_path, "throughput.json", _throughput(
        {"scheduler (Alg. 1)": 1200.0, "scheduler (5.2)": 1250.0},
        {"no speculation": 600.0, "fixed gamma": 1000.0, "best threshold": 1100.0},
    ))  # fmt: skip
    _write(tmp_path, "train_throughput.json", _train(0.45))
    rows = gpu_targets.targets(tmp_path)
    assert [r["met"] for r in rows] == [True, True, True, True]
    assert rows[0]["value"] == pytest.approx(0.9)
    assert rows[1]["value"] == pytest.approx(1.2)
    # 5.2 at 1250 against the best threshold at 1100 -- concurrency 1 rows play no part.
    assert rows[2]["value"] == pytest.approx(1250 / 1100)
    assert "scheduler (5.2)" in rows[2]["detail"] and "best threshold" in rows[2]["detail"]
    table = gpu_targets.markdown(rows)
    assert table.count("**met**") == 4 and "not met" not in table


def test_aims_missed_or_not_measured(tmp_path):
    _write(tmp_path, "decode_speed.json", _decode(floor_ms=1.5, spec_ms=4.5))
    _write(tmp_path, "throughput.json", _throughput(
        {"scheduler (Alg. 1)": 1000.0}, {"fixed gamma": 1000.0}, concurrency=32
    ))  # fmt: skip
    rows = gpu_targets.targets(tmp_path)
    assert [r["met"] for r in rows] == [False, False, None, None]
    assert rows[0]["value"] == pytest.approx(0.5) and rows[1]["value"] == pytest.approx(1.5)
    assert "concurrency 64" in rows[2]["detail"]
    table = gpu_targets.markdown(rows)
    assert table.count("**not met**") == 2 and table.count("not measured") == 2


def test_cpu_results_are_not_measured(tmp_path):
    # A CPU run has no HBM floor and no peak FLOP/s: not measured, never "met".
    _write(tmp_path, "decode_speed.json", _decode(floor_ms=None))
    _write(tmp_path, "train_throughput.json", _train(None))
    rows = gpu_targets.targets(tmp_path)
    assert rows[0]["met"] is None and rows[3]["met"] is None
    assert rows[1]["met"] is True  # the round/step ratio needs no floor


def test_training_mfu_shows_the_drafter_part_and_refuses_to_judge_the_old_count(tmp_path):
    _write(tmp_path, "train_throughput.json", _train(0.45, drafter_mfu=0.12))
    row = gpu_targets.targets(tmp_path)[3]
    assert row["met"] is True and row["value"] == pytest.approx(0.45)
    assert "drafter-only MFU 0.12" in row["detail"]
    # A file from before model_flops_version 2 (its MFU counted dense attention, the Markov
    # W1 and the fc input gradient): shown, not judged either way.
    old = _train(0.45)
    del old["model_flops_version"], old["drafter_mfu"]
    _write(tmp_path, "train_throughput.json", old)
    row = gpu_targets.targets(tmp_path)[3]
    assert row["met"] is None and row["value"] == pytest.approx(0.45)
    assert "formula version 1, not 2" in row["detail"] and "re-run" in row["detail"]
    assert "not judged" in gpu_targets.markdown([{"name": "training", **row}])
    # An unknown device: no MFU, and the note says why.
    note = "no dense bf16 peak known for device kind 'NVIDIA H100 SXM9'"
    _write(tmp_path, "train_throughput.json", {**_train(None), "mfu_note": note})
    row = gpu_targets.targets(tmp_path)[3]
    assert row["met"] is None and row["value"] is None and note in row["detail"]
