"""Checkpoint/resume of the trainer: bit-identical continuation (with two length buckets and
partially filled bucket buffers at the resume point), keep-last-N, and a save killed midway
(SIGKILL in a subprocess) that must be ignored in favour of the previous checkpoint."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import pytest
from train_helpers import (
    ABORTED_TRAIN_CHILD,
    TRAIN_CHILD,
    child_env,
    read_events,
    write_conversations,
    write_train_config,
)

from dspark_jax.cli.train import load_train_config
from dspark_jax.tokenizer import load_tokenizer
from dspark_jax.training.checkpointing import TrainCheckpointer, TrainCheckpointError
from dspark_jax.training.data import DataConfig, make_iterator
from dspark_jax.training.trainer import train


@pytest.fixture(scope="module")
def config_file(tmp_path_factory, compile_cache):
    root = tmp_path_factory.mktemp("resume")
    # Answers of 4..63 bytes: conversations of 21..80 tokens fill both buckets or truncate.
    data = write_conversations(root / "train.jsonl", range(40), answer_spread=60)
    return write_train_config(
        root / "resume_config.py",
        name="resume-test",
        data=(str(data),),
        num_steps=6,
        seq_lens=(32, 48),
        save_every=2,
        keep_checkpoints=2,
    )


@pytest.fixture(scope="module")
def uninterrupted(config_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("run-a")
    result = train(load_train_config(str(config_file)), out, progress=False, export=False)
    return _losses(result.history)


def _losses(history) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in history if h["split"] == "train"}


def test_resume_continues_bit_identically(config_file, uninterrupted, tmp_path):
    config = load_train_config(str(config_file))
    # The trainer's input stream (one process): both buckets occur in the six steps and the
    # resume point after step 3 has examples waiting in the bucket buffers.
    data_cfg = DataConfig(
        paths=config.data,
        seq_len=config.recipe.max_length,
        seq_lens=config.seq_lens,
        batch_size=config.recipe.global_batch_size,
        seed=config.recipe.seed,
    )
    stream = make_iterator(data_cfg, load_tokenizer(config.target))
    lengths = [next(stream)["tokens"].shape[1] for _ in range(3)]
    assert any(stream.get_state()["buffered"])
    lengths += [next(stream)["tokens"].shape[1] for _ in range(3)]
    assert set(lengths) == {32, 48}
    assert sorted(uninterrupted) == [1, 2, 3, 4, 5, 6]
    assert len(set(uninterrupted.values())) == 6

    first = train(config, tmp_path, stop_after=3, progress=False, export=False)
    assert first.final_step == 3 and first.resumed_from is None
    assert TrainCheckpointer(tmp_path / "checkpoints", 2).all_steps() == [2, 3]

    second = train(config, tmp_path, progress=False, export=False)
    assert second.resumed_from == 3 and second.final_step == 6
    resumed = _losses(first.history) | _losses(second.history)
    assert resumed == uninterrupted  # exact float equality: bit-identical losses
    # keep-last-N: saves at 2, 3, 4 and 6 leave the newest two
    assert TrainCheckpointer(tmp_path / "checkpoints", 2).all_steps() == [4, 6]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "ce", "l1", "bce", "tau", "accept_rate_k", "conf_bias", "lr"} <= set(logged[0])


def test_a_resumed_run_logs_each_step_once(config_file, uninterrupted, tmp_path):
    """metrics.jsonl is cut back to the checkpoint a run resumes from, so steps logged after it
    by a run that died are not listed twice; TensorBoard is told to drop them (a session start
    at the first step logged again); a finished run run again logs nothing."""
    config = load_train_config(str(config_file))
    train(config, tmp_path, stop_after=3, progress=False, export=False)
    # As if the run had died after logging step 3, before its checkpoint was complete, in the
    # middle of a line.
    shutil.rmtree(tmp_path / "checkpoints" / "3")
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"split": "train", "st')
    result = train(config, tmp_path, progress=False, export=False)
    assert result.resumed_from == 2
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert {r["step"]: r["loss"] for r in logged} == uninterrupted
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    scalars, purges = read_events(tmp_path)
    assert purges == [0, 3]
    assert scalars["train/loss"] == pytest.approx(uninterrupted, rel=1e-6)
    finished = metrics.read_text()
    assert train(config, tmp_path, progress=False, export=False).history == []
    assert metrics.read_text() == finished


def test_checkpoint_killed_mid_save_is_ignored(
    config_file, uninterrupted, compile_cache, tmp_path, caplog
):
    # Dies while step 4's checkpoint is being written.
    args = ["4", "--config", str(config_file), "--output", str(tmp_path), "--no-progress"]
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TRAIN_CHILD), *args, "--no-export"],
        env=child_env(compile_cache),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    ckpt_dir = tmp_path / "checkpoints"
    leftovers = [p.name for p in ckpt_dir.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert len(leftovers) == 1 and leftovers[0].startswith("4.")
    assert any(p.name == "2" for p in ckpt_dir.iterdir())

    config = load_train_config(str(config_file))
    with caplog.at_level(logging.WARNING, logger="dspark_jax.training.checkpointing"):
        result = train(config, tmp_path, progress=False, export=False)
    assert any("incomplete checkpoint 4.orbax-checkpoint-tmp" in r.message for r in caplog.records)
    assert result.resumed_from == 2 and result.final_step == 6
    assert _losses(result.history) == {s: uninterrupted[s] for s in (3, 4, 5, 6)}
    assert not [p for p in ckpt_dir.iterdir() if ".orbax-checkpoint-tmp" in p.name]
    assert TrainCheckpointer(ckpt_dir, 2).all_steps() == [4, 6]


def test_resuming_on_other_data_is_refused(config_file, uninterrupted, tmp_path, caplog):
    """A run records the data it reads (their text, not their file names): resuming on other or
    changed data is refused rather than applying the saved data position to it; the same text
    under another name resumes, and so does a checkpoint of an earlier version (no record)."""
    config = load_train_config(str(config_file))

    def on(path):
        return dataclasses.replace(config, data=(str(path),))

    data = tmp_path / "data.jsonl"
    shutil.copy(config.data[0], data)
    run = tmp_path / "run"
    train(on(data), run, stop_after=3, progress=False, export=False)

    other = write_conversations(tmp_path / "other.jsonl", range(40, 80), answer_spread=60)
    with pytest.raises(TrainCheckpointError, match=f"trained on other data .*{other}: 40 conv"):
        train(on(other), run, progress=False, export=False)
    original = data.read_text()
    data.write_text(original + original.splitlines(keepends=True)[0])
    with pytest.raises(TrainCheckpointError, match="41 conversations, fingerprint [0-9a-f]+ now"):
        train(on(data), run, progress=False, export=False)
    # Blank lines do not count, the order of the lines does.
    data.write_text(original.replace("\n", "\n\n"))
    moved = tmp_path / "moved.jsonl"
    data.rename(moved)
    result = train(on(moved), run, stop_after=4, progress=False, export=False)
    assert result.resumed_from == 3

    meta = run / "checkpoints" / "4" / "meta" / "metadata"
    record = json.loads(meta.read_text())
    del record["data"]
    meta.write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING, logger="dspark_jax.training.trainer"):
        result = train(on(moved), run, progress=False, export=False)
    assert "does not record the data it was trained on" in caplog.text
    assert result.resumed_from == 4
    assert _losses(result.history) == {s: uninterrupted[s] for s in (5, 6)}


def test_second_ctrl_c_during_a_save_aborts_quietly(config_file, compile_cache, tmp_path):
    """A second Ctrl-C while Orbax commits a checkpoint abandons the save: exit 130 with one line,
    none of Orbax's reports of the save it could not finish (nor their tracebacks), and the next
    run ignores the partial save."""
    args = ["--config", str(config_file), "--output", str(tmp_path), "--no-progress"]
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(ABORTED_TRAIN_CHILD), *args, "--no-export"],
        env=child_env(compile_cache),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "absl" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == "dspark-jax train: interrupted"
    assert [p.name.split(".")[0] for p in (tmp_path / "checkpoints").iterdir()] == ["2"]
    assert TrainCheckpointer(tmp_path / "checkpoints", 2).all_steps() == []


def test_resume_with_other_micro_batching_and_settings(
    config_file, uninterrupted, tmp_path, monkeypatch
):
    """Another mesh (as on another device count) with --per-device-batch-size splits the step
    into another number of micro-batches: the same batches and the same losses, so it resumes.
    Other length buckets or another target dtype are refused before the target is loaded,
    naming the setting."""
    from dspark_jax.sharding import MeshConfig
    from dspark_jax.training import trainer

    config = load_train_config(str(config_file))
    train(config, tmp_path, stop_after=3, progress=False, export=False)
    original_setup = trainer._setup_models

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(trainer, "_setup_models", no_target)
    with pytest.raises(TrainCheckpointError, match=r"seq_lens 32,48, this run asks for 48\b"):
        train(dataclasses.replace(config, seq_lens=None), tmp_path, progress=False)
    with pytest.raises(TrainCheckpointError, match=r"float32, this run loads .* bfloat16"):
        train(dataclasses.replace(config, target_dtype="bfloat16"), tmp_path, progress=False)
    # Written by two processes (each saved its own data position): not damage, and not to be
    # deleted, as the failed restore of the missing position files said before.
    meta = tmp_path / "checkpoints" / "3" / "meta" / "metadata"
    record = json.loads(meta.read_text())
    assert record["processes"] == 1
    meta.write_text(json.dumps({**record, "processes": 2}))
    with pytest.raises(
        TrainCheckpointError, match=r"3 was written by 2 process\(es\).* this run has 1: resume it"
    ):
        train(config, tmp_path, progress=False)
    meta.write_text(json.dumps(record))
    monkeypatch.setattr(trainer, "_setup_models", original_setup)
    # 4 rows over data x fsdp = 2 devices, one per device: 2 micro-batches instead of 1.
    other = dataclasses.replace(config, mesh=MeshConfig(1, 2, 4), per_device_batch_size=1)
    result = train(other, tmp_path, progress=False, export=False)
    assert result.resumed_from == 3
    assert _losses(result.history) == pytest.approx(
        {s: uninterrupted[s] for s in (4, 5, 6)}, rel=1e-5
    )


def _signalling_steps(monkeypatch, signals: dict[int, tuple[int, ...]]) -> list[int]:
    """Makes the trainer's step send this process `signals[n]` right after its n-th step; returns
    the list that counts the steps run."""
    from dspark_jax.training import trainer

    steps: list[int] = []
    make_train_step = trainer.make_train_step

    def make_signalling_step(*args, **kwargs):
        step = make_train_step(*args, **kwargs)

        def run(*a):
            out = step(*a)
            steps.append(len(steps) + 1)
            for signum in signals.get(len(steps), ()):
                os.kill(os.getpid(), signum)
            return out

        return run

    monkeypatch.setattr(trainer, "make_train_step", make_signalling_step)
    return steps


@pytest.mark.parametrize("second", [False, True], ids=["once", "twice"])
def test_sigterm_stops_saves_and_exits_143(
    config_file, compile_cache, tmp_path, monkeypatch, capsys, second
):
    """SIGTERM (a scheduler's time limit, `timeout`, preemption) is taken as the first Ctrl-C:
    the step in flight finishes, a checkpoint of it is saved, and the command exits with 143 and
    one line; a second SIGTERM aborts without saving. The handler is there only while `train`
    runs: the previous one is back afterwards."""
    from dspark_jax.cli import main

    signals = (signal.SIGTERM, signal.SIGTERM) if second else (signal.SIGTERM,)
    steps = _signalling_steps(monkeypatch, {3: signals})
    received = []

    def previous(signum, frame):
        received.append(signum)

    old = signal.signal(signal.SIGTERM, previous)
    try:
        args = ["--config", str(config_file), "--output", str(tmp_path), "--no-progress"]
        status = main(["train", *args, "--no-export"])
        after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, old)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 143 and received == [] and after is previous
    assert steps == [1, 2, 3]
    if second:
        assert err[-1] == "dspark-jax train: terminated"
        assert not (tmp_path / "checkpoints" / "3").exists()
    else:
        saved = tmp_path / "checkpoints" / "3"
        assert err[-1] == f"dspark-jax train: terminated: saved step 3 in {saved}; run again to " \
            "resume"
        assert TrainCheckpointer(tmp_path / "checkpoints", 2).all_steps() == [2, 3]


@pytest.fixture(scope="module")
def stopped_at_3(config_file, tmp_path_factory):
    """A run stopped after step 3 (checkpoints 2 and 3), to copy and damage."""
    out = tmp_path_factory.mktemp("stopped")
    train(load_train_config(str(config_file)), out, stop_after=3, progress=False, export=False)
    return out


def test_incomplete_newer_step_folders_are_passed_over(
    config_file, stopped_at_3, tmp_path, caplog
):
    """Step folders that lack items (a copy or sync cut short: an empty folder, one holding only
    its run record) are passed over with a warning for the newest complete step, by a resume and
    by `find_checkpoint` (export, --init-from); named themselves, they are refused in one line."""
    from dspark_jax.training.checkpointing import find_checkpoint

    run = tmp_path / "run"
    shutil.copytree(stopped_at_3, run)
    checkpoints = run / "checkpoints"
    (checkpoints / "9").mkdir()
    (checkpoints / "8").mkdir()
    shutil.copytree(checkpoints / "3" / "meta", checkpoints / "8" / "meta")
    with caplog.at_level(logging.WARNING, logger="dspark_jax.training.checkpointing"):
        assert find_checkpoint(run) == (checkpoints, 3)
    ignored = "ignoring checkpoint {}: incomplete (no {};"
    assert ignored.format(checkpoints / "9", "meta, state, data") in caplog.text
    assert ignored.format(checkpoints / "8", "state, data") in caplog.text
    for step in ("8", "9"):
        with pytest.raises(TrainCheckpointError, match=f"checkpoints/{step}: an incomplete"):
            find_checkpoint(checkpoints / step)
    config = load_train_config(str(config_file))
    result = train(config, run, stop_after=4, progress=False, export=False)
    assert result.resumed_from == 3 and result.final_step == 4


def test_an_incomplete_folder_at_a_step_the_resumed_run_saves_is_set_aside(
    config_file, stopped_at_3, tmp_path, caplog
):
    """Resumed from step 3 past an incomplete `4/` (an empty folder, one with only its run
    record), the run saves step 4 again: the folder passed over is renamed `4.incomplete`
    (`4.incomplete-2` beside an older one), not deleted, and the run ends instead of failing
    at step 4 with Orbax's "Checkpoint for step 4 already exists" after training to it."""
    run = tmp_path / "run"
    shutil.copytree(stopped_at_3, run)
    checkpoints = run / "checkpoints"
    shutil.copytree(checkpoints / "3" / "meta", checkpoints / "4" / "meta")
    (checkpoints / "4.incomplete").mkdir()  # set aside by an earlier resume
    config = load_train_config(str(config_file))
    with caplog.at_level(logging.WARNING, logger="dspark_jax.training.checkpointing"):
        result = train(config, run, progress=False, export=False)
    assert result.resumed_from == 3 and result.final_step == 6
    aside = checkpoints / "4.incomplete-2"
    assert sorted(p.name for p in aside.iterdir()) == ["meta"]
    assert f"moved the incomplete folder passed over at the start (no state, data) aside to " \
        f"{aside}" in caplog.text
    assert TrainCheckpointer(checkpoints, 2).all_steps() == [4, 6]
    assert TrainCheckpointer(checkpoints, 2).latest_step() == 6


def _truncate_largest_array_file(step_dir):
    largest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)
    with open(largest, "r+b") as f:
        f.truncate(largest.stat().st_size // 3)


@pytest.mark.parametrize(
    "damage, what",
    [
        (lambda step: (step / "meta" / "metadata").write_text("{oops"), "run record"),
        (lambda step: (step / "data" / "process_0-of-1.json").unlink(), "data position"),
        (_truncate_largest_array_file, "train state or data position cannot be read (ValueError: "),
    ],
    ids=["bad-meta", "no-data-file", "truncated-array"],
)
def test_damaged_checkpoint_is_refused_in_one_line(
    config_file, stopped_at_3, tmp_path, damage, what, monkeypatch
):
    """A step whose items are there but cannot be read is refused (TrainCheckpointError, one
    line naming the step folder and what to do), not with the traceback of Orbax or
    TensorStore, and the run folder is left as it was. Nothing is printed after it: the reads
    of the other arrays that Orbax abandons when one fails used to be garbage-collected later,
    each printing Orbax's exception and TensorStore spec ("Exception ignored in: <coroutine
    object _read_array_index_and_device_put>"), and to report to a closed event loop."""
    run = tmp_path / "run"
    shutil.copytree(stopped_at_3, run)
    damage(run / "checkpoints" / "3")
    config = load_train_config(str(config_file))
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(repr(u.exc_value)))
    with pytest.raises(TrainCheckpointError) as refused:
        train(config, run, stop_after=4, progress=False, export=False)
    time.sleep(0.2)  # late tensorstore results arrive within milliseconds
    gc.collect()
    assert unraisable == []
    message = str(refused.value)
    assert "\n" not in message, message
    assert f"{run / 'checkpoints' / '3'}: its " in message and what in message, message
    assert "delete it to use the previous step (2)" in message, message
    # TensorStore's words, not Orbax's wrapper (which ended in a pybind11 method's repr)
    assert "bound method" not in message and "TensorStore details" not in message, message
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2", "3"]


def test_abandoned_saves_filter_drops_the_shutdown_reports_only(tmp_path):
    """Once an abort abandons a save, Orbax's background threads report that they found the
    interpreter's thread pools shut down, without naming the checkpoint folder: dropped, as are
    reports that name the folder or carry the KeyboardInterrupt; other errors still get out."""
    from dspark_jax.training.trainer import _AbandonedSaves

    def record(message, error=None):
        exc_info = (type(error), error, None) if error is not None else None
        return logging.LogRecord("absl", logging.ERROR, __file__, 1, message, (), exc_info)

    shut_down = RuntimeError("cannot schedule new futures after shutdown")
    keep = _AbandonedSaves(tmp_path / "checkpoints").filter
    assert not keep(record(
        "[process=0][thread=write_metadata_after_commits][operation_id=1] "
        "_SignalingThread.run() raised an exception: cannot schedule new futures after shutdown",
        shut_down,
    ))
    assert not keep(record("_SignalingThread.run() raised an exception", shut_down))
    at_exit = RuntimeError("cannot schedule new futures after interpreter shutdown")
    assert not keep(record("_SignalingThread.run() raised an exception", at_exit))
    assert not keep(record("callback failed", RuntimeError("Event loop is closed")))
    assert not keep(record(f"failed to commit {tmp_path / 'checkpoints' / '6'}"))
    assert not keep(record("waiting", KeyboardInterrupt()))
    assert keep(record("something else failed", RuntimeError("disk full")))
    assert keep(record("something else failed", ValueError("bad value")))


def _interrupting(monkeypatch, maker: str) -> None:
    """Makes the first call of the trainer's `maker` (make_train_step, make_eval_step) program
    get a Ctrl-C as it starts (where the step compiles)."""
    from dspark_jax.training import trainer

    make = getattr(trainer, maker)

    def make_interrupted(*args, **kwargs):
        program = make(*args, **kwargs)
        calls = []

        def run(*a):
            calls.append(1)
            if len(calls) == 1:
                os.kill(os.getpid(), signal.SIGINT)
            return program(*a)

        return run

    monkeypatch.setattr(trainer, maker, make_interrupted)


@pytest.mark.parametrize(
    "where", ["first-step", "first-evaluation", "first-step-resumed"]
)
def test_ctrl_c_before_the_first_step_has_finished_aborts_at_once(
    config_file, stopped_at_3, tmp_path, monkeypatch, where
):
    """Ctrl-C while the first step compiles or runs, or during the evaluation before it, counts
    as before training: it aborts at once (no step finished, nothing saved), and a fresh run
    leaves no folder behind; a resumed run's folder is left as it was."""
    config = dataclasses.replace(
        load_train_config(str(config_file)), holdout=where == "first-evaluation"
    )
    run = tmp_path / "run"
    if where == "first-step-resumed":
        shutil.copytree(stopped_at_3, run)
    before = sorted(p.name for p in run.iterdir()) if run.exists() else None
    maker = "make_eval_step" if where == "first-evaluation" else "make_train_step"
    _interrupting(monkeypatch, maker)
    with pytest.raises(KeyboardInterrupt):
        train(config, run, progress=False, export=False)
    if before is None:
        assert not run.exists(), sorted(p.name for p in run.iterdir())
    else:
        assert sorted(p.name for p in run.iterdir()) == before
        assert TrainCheckpointer(run / "checkpoints", 2).all_steps() == [2, 3]


def test_nan_weights_are_neither_exported_resumed_nor_used_to_init(tmp_path, monkeypatch):
    """A run whose parameters are NaN (diverged, as here from NaN initial weights, or damaged
    bytes in a checkpoint) saves its checkpoints as any run does, but its end-of-run export
    refuses to write the drafter, and resuming it or starting a run --init-from it is refused
    in one line before a step is trained on NaN."""
    from dspark_jax.checkpoints.safetensors_io import CheckpointError
    from dspark_jax.training import trainer

    data = write_conversations(tmp_path / "train.jsonl", range(40), answer_spread=60)
    config_file = write_train_config(
        tmp_path / "nan_config.py", name="nan-test", data=(str(data),), num_steps=2, save_every=2
    )
    init = trainer.init_train_state

    def nan_init(params, *args, **kwargs):
        return init(jax.tree.map(lambda x: x * jnp.nan, params), *args, **kwargs)

    monkeypatch.setattr(trainer, "init_train_state", nan_init)
    run = tmp_path / "diverged"
    with pytest.raises(CheckpointError, match=f"the drafter trained in {run}: parameters hold NaN"):
        train(load_train_config(str(config_file)), run, progress=False)
    assert not (run / "drafter").exists()
    assert TrainCheckpointer(run / "checkpoints", 2).all_steps() == [2]
    monkeypatch.setattr(trainer, "init_train_state", init)

    longer = dataclasses.replace(load_train_config(str(config_file)), num_steps=4)
    with pytest.raises(CheckpointError, match="resuming would only carry them on"):
        train(longer, run, progress=False, export=False)
    assert TrainCheckpointer(run / "checkpoints", 2).all_steps() == [2]
    from_nan = dataclasses.replace(longer, init_drafter=str(run))
    with pytest.raises(CheckpointError, match=r"--init-from: the drafter of step 2 of .*NaN"):
        train(from_nan, tmp_path / "from-nan", progress=False, export=False)
    assert not (tmp_path / "from-nan").exists()


def test_ctrl_c_logs_the_unfinished_interval(
    config_file, uninterrupted, compile_cache, tmp_path, monkeypatch
):
    """log_every 4, Ctrl-C after step 3: steps 1..3 are logged at step 3 (the step saved), so
    that after the resume every step is in metrics.jsonl once: the step-4 record is step 4
    alone."""
    from dspark_jax.cli import main

    text = config_file.read_text().replace("    log_every=1,\n", "    log_every=4,\n")
    config = tmp_path / "every4.py"
    config.write_text(text)
    out = tmp_path / "run"
    args = ["train", "--config", str(config), "--output", str(out), "--no-progress", "--no-export"]
    _signalling_steps(monkeypatch, {3: (signal.SIGINT,)})
    assert main(args) == 130
    metrics = out / "metrics.jsonl"
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in logged] == [3]
    want = sum(uninterrupted[k] for k in (1, 2, 3)) / 3
    assert logged[0]["loss"] == pytest.approx(want, rel=1e-5)
    monkeypatch.undo()
    assert main(args) == 0
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in logged if r["split"] == "train"] == [3, 4, 6]
    assert logged[1]["loss"] == pytest.approx(uninterrupted[4], rel=1e-5)
