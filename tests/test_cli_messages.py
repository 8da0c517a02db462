"""Small truths of the command line: --version, `python -m dspark_jax`, output folders that are
not overwritten without --overwrite (named as the flag, not as a Python argument)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from dspark_jax.cli import main
from dspark_jax.embedded import TINY_DRAFT


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dspark-jax {version('dspark-jax')}"


@pytest.mark.parametrize("module", ["dspark_jax", "dspark_jax.cli"])
def test_python_dash_m_runs_the_cli(module):
    """`python -m dspark_jax serve ...` is the spelling people try first."""
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: dspark-jax") and "serve" in done.stdout


def test_eval_refuses_a_non_empty_output_folder(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["x"]}) + "\n")
    out = tmp_path / "results"
    out.mkdir()
    (out / "eval.json").write_text("{}")
    assert main(["eval", str(prompts), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not empty" in err and "--overwrite" in err
    assert (out / "eval.json").read_text() == "{}"


def test_eval_overwrite_replaces_the_whole_folder(tmp_path, capsys, monkeypatch):
    """A run that writes no calibration records must not leave the previous run's beside its
    own eval.json: --overwrite replaces the folder, written whole and renamed into place."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["x"]}) + "\n")
    out = tmp_path / "results"
    out.mkdir()
    (out / "calibration_records.npz").write_bytes(b"from the previous run")
    (out / "eval.json").write_text("{}")
    seen = {}

    def evaluate_nothing(name, conversations, spec, plain, tokenizer, **kwargs):
        from dspark_jax.decoding.batching import LoopTiming
        from dspark_jax.decoding.evaluate import ConversationRun, DatasetReport
        from dspark_jax.decoding.stats import acceptance_stats

        seen["out_during_run"] = sorted(p.name for p in out.iterdir())
        stats = acceptance_stats([], spec.gamma)
        report = DatasetReport(name, 1, 0, [], stats, LoopTiming(), None)
        return report, ConversationRun([], LoopTiming(), [])

    # What is tested is the writing: no compiling, no decoding.
    monkeypatch.setattr("dspark_jax.decoding.engine.Engine.warm_up", lambda self: None)
    monkeypatch.setattr("dspark_jax.decoding.evaluate.evaluate_dataset", evaluate_nothing)
    argv = ["eval", str(prompts), "--out", str(out), "--overwrite", "--no-plain"]
    argv += ["--max-new-tokens", "1"]
    assert main(argv) == 0
    assert seen["out_during_run"] == ["calibration_records.npz", "eval.json"]
    assert sorted(p.name for p in out.iterdir()) == ["eval.json", "eval.png"]
    assert json.loads((out / "eval.json").read_text())["settings"]["calibration_records"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl", "results"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--datasets-dir", "ds", "--out", "ds"],  # the datasets' folder itself
        ["ds/code.jsonl", "--out", "ds"],  # the folder of a dataset file
        ["ds/code.jsonl", "--out", "."],  # a folder above it
        ["--datasets-dir", "ds", "--out", "ds/results"],  # inside the datasets' folder
        ["ds/code.jsonl", "--policy", "threshold", "--threshold", "0.6", "--sts", "ds/sts.json"]
        + ["--out", "ds"],
        ["ds/code.jsonl", "--draft", "ds/draft", "--out", "ds"],  # a model folder
    ],
)
def test_eval_refuses_an_output_overlapping_its_inputs(tmp_path, monkeypatch, capsys, argv):
    """--out is replaced whole, so with --overwrite an --out holding the datasets (or the STS
    artifact, or a model) deleted them and exited 0."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "code.jsonl").write_text(json.dumps({"turns": ["x"]}) + "\n")
    (tmp_path / "ds" / "sts.json").write_text("{}")
    shutil.copytree(TINY_DRAFT, tmp_path / "ds" / "draft")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert main(["eval", *argv, "--overwrite", "--no-plain"]) == 2
    err = capsys.readouterr().err
    out = argv[argv.index("--out") + 1]
    assert err.startswith(f"dspark-jax eval: error: --out {out}: overlaps the input "), err
    assert "choose another folder" in err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_existing_export_names_the_flag(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert main(["export", "--draft", str(TINY_DRAFT), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "use --overwrite" in err and "overwrite=True" not in err


@pytest.mark.parametrize("out, where", [(".", "is the working"), ("..", "is a parent of")])
@pytest.mark.parametrize("command", ["convert", "export"])
def test_atomic_outputs_refuse_the_working_directory(
    tmp_path, monkeypatch, capsys, command, out, where
):
    """The output replaces its whole folder by a rename, which fails for the folder a process
    is in ("[Errno 16] Device or resource busy"): refused up front, nothing touched."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    argv = [command, "--draft", str(TINY_DRAFT), "--out", out, "--overwrite"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dspark-jax {command}: error: --out {out}: {where}")
    assert "Errno" not in err
    assert (work / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def _policy_args(*argv: str):
    import argparse

    from dspark_jax.cli.args import add_policy_arguments

    parser = argparse.ArgumentParser()
    add_policy_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--policy", "threshold"], "--policy threshold needs --threshold"),
        (["--policy", "cumulative-threshold"], "needs --threshold"),
        (["--policy", "scheduler"], "--policy scheduler needs --sps-table: a table from "
         "dspark-jax profile, or auto"),  # fmt: skip
        (["--policy", "async-scheduler"], "needs --sps-table"),
        (["--sts", "sts.json"], "--policy fixed reads none"),
        # Temperature scaling keeps a logit's sign, which is all threshold 0.5 compares.
        (
            ["--policy", "threshold", "--threshold", "0.5", "--sts", "sts.json"],
            "at --threshold 0.5 compares exactly that sign: the artifact would change nothing",
        ),
        (
            ["--policy", "fixed", "--threshold", "0.5"],
            "--threshold is read by --policy threshold and cumulative-threshold only; --policy "
            "fixed would ignore it",
        ),
        (
            ["--policy", "threshold", "--threshold", "0.5", "--sps-table", "sps.json"],
            "--sps-table is read by --policy scheduler and async-scheduler only",
        ),
        (
            ["--policy", "scheduler", "--sps-table", "sps.json", "--gamma", "3"],
            "--gamma is read by --policy fixed only",
        ),
    ],
)
def test_policy_flags_are_named(argv, fragment):
    """A policy without its setting names the flag to add; a setting the chosen policy does not
    read (--sts or --threshold with the fixed policy, ...) is refused rather than ignored."""
    from dspark_jax.cli.args import build_policy
    from dspark_jax.decoding.policies import PolicyError

    with pytest.raises(PolicyError, match=fragment):
        build_policy(_policy_args(*argv), 7)
    assert build_policy(_policy_args("--policy", "threshold", "--threshold", "0.5"), 7)


def test_sps_table_auto_takes_the_table_the_caller_profiles():
    """`--sps-table auto` builds the scheduler on what the caller's `profile` measures (the
    engine the command builds, so no slot or model check applies); a caller with no engine to
    profile (a benchmark's table-only policy) refuses it in one line."""
    import numpy as np

    from dspark_jax.cli.args import build_policy
    from dspark_jax.decoding.policies import PolicyError, PrefixSchedulePolicy, SpsProfile

    table = SpsProfile((8, 16, 32), np.array([300.0, 250.0, 200.0]), {"num_slots": 4})
    args = _policy_args("--policy", "scheduler", "--sps-table", "auto")
    calls = []
    policy = build_policy(args, 7, num_slots=4, profile=lambda: calls.append(1) or table)
    assert isinstance(policy, PrefixSchedulePolicy) and calls == [1]
    assert policy.sps is table
    with pytest.raises(PolicyError, match="--sps-table auto profiles the engine a command builds"):
        build_policy(args, 7, num_slots=4)


def test_eval_says_why_when_speculation_loses():
    from types import SimpleNamespace

    from dspark_jax.cli.report import speedup_note

    def report(name, speedup, tau):
        return SimpleNamespace(name=name, speedup=speedup, stats=SimpleNamespace(tau=tau))

    assert speedup_note([report("a", 1.4, 3.0), report("b", None, 2.0)]) is None
    note = speedup_note([report("a", 1.4, 3.0), report("b", 0.3, 2.5), report("c", 0.8, 2.9)])
    assert note.startswith("note: speculation was slower than plain decoding on b, c")
    assert "0.30x at tau 2.50" in note and "\n" not in note


def test_a_scheduler_that_verified_nothing_says_why():
    """Under an SPS table where no verification pays (a 1-slot CPU table), the scheduler decodes
    plainly: tau 1.000 and 0.00 drafts per round, which read like a broken drafter."""
    from types import SimpleNamespace

    from dspark_jax.cli.report import scheduler_note

    none, some = SimpleNamespace(mean_verified=0.0), SimpleNamespace(mean_verified=2.5)
    note = scheduler_note("scheduler", "sps.json", none)
    assert note.startswith("note: the scheduler verified no drafts: under SPS table sps.json")
    assert "the table profiled here" in scheduler_note("async-scheduler", "auto", none)
    assert scheduler_note("scheduler", "sps.json", some) is None
    assert scheduler_note("fixed", None, none) is None  # gamma 0 asked for it
    assert scheduler_note("scheduler", "sps.json", None) is None  # no drafter


def test_profile_warns_on_a_non_monotonic_sps_table():
    from dspark_jax.cli.profile import non_monotonic_warning

    assert non_monotonic_warning([1, 2, 4], [100.0, 90.0, 60.0]) is None
    warning = non_monotonic_warning([1, 2, 4, 8], [100.0, 90.0, 95.0, 50.0])
    assert warning.startswith("warning: the SPS table is not monotonic")
    assert "4 tokens (95.0/s) > 2 (90.0/s)" in warning and "8 tokens" not in warning


def test_single_file_outputs_are_never_half_written(tmp_path):
    """generate --json, calibrate's artifact and plot, profile's table and plot: written to a
    sibling and renamed, so an interrupt (or error) mid-write leaves the old file as it was."""
    from dspark_jax.cli.paths import atomic_file

    path = tmp_path / "deep" / "out.json"
    with atomic_file(path) as tmp:
        assert tmp.parent == path.parent and tmp.suffix == ".json" and tmp.name.startswith(".")
        tmp.write_text("first")
    assert path.read_text() == "first"
    with pytest.raises(KeyboardInterrupt), atomic_file(path) as tmp:
        tmp.write_text("half")
        raise KeyboardInterrupt
    assert path.read_text() == "first"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.json"]


def test_train_distributed_outside_a_cluster_is_one_line(tmp_path):
    """`train --distributed` on a host that is no TPU pod, SLURM or Open MPI job (and without the
    three flags) says what is missing in one line, not with JAX's traceback."""
    import os
    import subprocess
    import sys

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMI_", "TPU_", "CLOUD_TPU"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    args = ["train", "--config", "tiny-dspark", "--output", str(tmp_path / "run"), "--distributed"]
    proc = subprocess.run(
        [sys.executable, "-m", "dspark_jax.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("dspark-jax train: error: --distributed: no cluster"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--coordinator-address HOST:PORT, --num-processes N and --process-id I" in proc.stderr
    assert not (tmp_path / "run").exists()
