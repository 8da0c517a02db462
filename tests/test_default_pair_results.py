"""benchmarks/default_pair_results.py without running a model: a step's output is reused only
when the arguments and inputs that made it are those asked for now, and a wrong --build or
--drafters is refused before anything is written."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import default_pair_results as dpr  # noqa: E402

# Writes argv[1] into argv[2] and counts its calls in argv[2] + ".calls".
WRITER = [
    sys.executable,
    "-c",
    "import sys, pathlib; out = pathlib.Path(sys.argv[2]); out.write_text(sys.argv[1]); "
    "calls = pathlib.Path(sys.argv[2] + '.calls'); "
    "calls.write_text(str(int(calls.read_text()) + 1 if calls.exists() else 1))",
]


def calls(output: Path) -> int:
    return int(Path(str(output) + ".calls").read_text())


def test_output_is_reused_only_for_the_same_arguments_and_inputs(tmp_path, capsys):
    output, log, prompts = tmp_path / "out.json", tmp_path / "step.log", tmp_path / "p.jsonl"
    prompts.write_text("a\n")
    commands: list[dict] = []

    def step(value: str) -> None:
        dpr.run(WRITER, [value, str(output)], log, commands, output, (prompts,))

    step("16")
    assert calls(output) == 1 and commands[-1]["seconds"] is not None
    record = json.loads(dpr.args_record(output).read_text())
    assert record["args"] == ["16", str(output)] and record["commit"] and record["date"]
    step("16")  # same arguments and inputs: reused, and said so
    assert calls(output) == 1 and commands[-1]["seconds"] is None
    assert commands[-1]["reused"]["commit"] == record["commit"]

    step("128")  # other settings: made again, with the setting that differs named
    assert calls(output) == 2 and output.read_text() == "128"
    assert "argument 1: 16 then, 128 now" in capsys.readouterr().out
    prompts.write_text("b\n")  # an input changed: made again
    step("128")
    assert calls(output) == 3
    assert f"{prompts} changed" in capsys.readouterr().out

    dpr.args_record(output).unlink()  # an output of unknown origin is not trusted
    step("128")
    assert calls(output) == 4
    assert "no record" in capsys.readouterr().out


def test_options_names_the_flag_that_differs(tmp_path):
    before = ["generate", "--max-new-tokens", "16", "--no-plain", "--max-num-seqs", "2"]
    now = ["generate", "--max-new-tokens", "128", "--no-plain", "--max-num-seqs", "2"]
    output = tmp_path / "x.json"
    output.write_text("{}")
    dpr.args_record(output).write_text(json.dumps({"args": before, "inputs": {}}))
    reason = dpr.stale_reason(output, dpr.args_record(output), {"args": now, "inputs": {}})
    assert reason is not None and "--max-new-tokens: 16 then, 128 now" in reason
    assert "--max-num-seqs" not in reason and "--no-plain" not in reason
    flag = dpr.stale_reason(
        output, dpr.args_record(output), {"args": [*before, "--overwrite"], "inputs": {}}
    )
    assert flag is not None and "--overwrite: not given then, given now" in flag
    same = {"args": before, "inputs": {}}
    assert dpr.stale_reason(output, dpr.args_record(output), same) is None


def fake_build(root: Path, drafters=("dspark-distilled", "dflash-distilled")) -> Path:
    for sub in ("target", *(f"drafters/{d}" for d in drafters)):
        (root / sub).mkdir(parents=True)
        (root / sub / "config.json").write_text("{}")
    (root / "corpus").mkdir()
    for name in ("heldout.jsonl", "calibration.jsonl"):
        (root / "corpus" / name).write_text("{}\n")
    return root


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--drafters", "foo"], "--drafters 'foo': choose among dspark, dflash"),
        (["--phase=-typo"], "dspark-typo/config.json"),
        (["--build", "{tmp}/nobuild"], "nobuild/target/config.json"),
    ],
)
def test_bad_build_or_drafters_is_refused_before_writing(tmp_path, capsys, argv, message):
    build = fake_build(tmp_path / "build")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exc:
        dpr.main(["--build", str(build), *argv, "--out", str(tmp_path / "results")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results").exists() and not (tmp_path / "nobuild").exists()


def test_one_drafter_needs_only_its_own_folder(tmp_path, capsys, monkeypatch):
    build = fake_build(tmp_path / "build", drafters=("dflash-distilled",))
    with pytest.raises(SystemExit) as exc:
        dpr.main(["--build", str(build), "--drafters", "dspark", "--out", str(tmp_path / "r")])
    assert exc.value.code == 2 and "dspark-distilled/config.json" in capsys.readouterr().err
    (build / "corpus" / "calibration.jsonl").unlink()  # only the full run calibrates
    ran = []
    monkeypatch.setattr(dpr, "run", lambda *a, **k: ran.append(a[1][0]))  # no model runs here
    argv = ["--build", str(build), "--drafters", "dflash", "--out", str(tmp_path / "r")]
    assert dpr.main(argv) == 0 and ran == ["generate", "generate"]


def test_printed_tables_have_the_columns_of_results_md():
    """docs/results.md says its tables are what the script prints: same headers, and the share
    of resamples as a percentage."""
    gamma = 7
    side = {
        "tau": 3.2,
        "tau_ci95": [2.9, 3.6],
        "rounds": 4513,
        "conditional": [0.5] * (gamma - 1) + [None],
    }
    diff = {"dspark_minus_dflash": 0.46, "ci95": [0.33, 0.61], "share_of_resamples_above_zero": 1.0}
    entry = {"dspark": side, "dflash": side, "tau_difference": diff}
    per_k = [0.1] * gamma
    calibration = {
        "n_survival": [8165] * gamma,
        "survival_rate": per_k,
        "ece_before": per_k,
        "ece_after": per_k,
        "auc_before": [0.614] + [None] * (gamma - 1),
        "temperatures": [20.0, 0.861] + [15.6] * (gamma - 2),
        "mean_ece": [0.06, 0.05],
    }
    printed = dpr.markdown({"acceptance": {"T=0": entry}, "calibration": calibration})
    doc = (Path(__file__).resolve().parents[1] / "docs" / "results.md").read_text()
    headers = [line for line in printed.splitlines() if line.startswith("| T ")]
    headers += [line for line in printed.splitlines() if line.startswith("| k ")]
    assert len(headers) == 3
    for header in headers:
        assert header in doc, header
    assert "| 0 | DSpark | 3.200 | [2.900, 3.600] | 4513 |" in printed
    assert "| 100% |" in printed
    assert "| 1 | 8165 | 0.100 | 0.1000 | 0.1000 | 0.614 | 20.0 |" in printed
    assert "| 2 | 8165 | 0.100 | 0.1000 | 0.1000 | - | 0.861 |" in printed
