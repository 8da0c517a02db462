"""What `dspark-jax train` tells and keeps: held-out data from the user's own data, console
warnings, periodic evaluation, TensorBoard events beside metrics.jsonl, a progress bar on finished
steps, extending a finished run, --init-from a checkpoint or an exported drafter, exporting any
checkpoint, and Ctrl-C saving a checkpoint (exit 130, one line)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from train_helpers import read_events, write_conversations, write_train_config

from dspark_jax.checkpoints.safetensors_io import SafetensorsFolder
from dspark_jax.checkpoints.speculators import VERIFIER_TENSORS, check_speculators_config
from dspark_jax.cli import main
from dspark_jax.cli.train import load_train_config
from dspark_jax.configs.train_tiny import TINY_TARGET
from dspark_jax.embedded import EMBEDDED_DRAFT
from dspark_jax.errors import UserError
from dspark_jax.training import trainer
from dspark_jax.training.checkpointing import (
    TrainCheckpointer,
    TrainCheckpointError,
    find_checkpoint,
    read_meta,
)
from dspark_jax.training.trainer import train


@pytest.fixture(scope="module")
def files(tmp_path_factory, compile_cache):
    """(config file, training data with 60 conversations, a separate eval file)."""
    root = tmp_path_factory.mktemp("truth")
    # Answers of 4..63 bytes: conversations of 21..80 tokens, so some exceed max_length 48.
    data = write_conversations(root / "train.jsonl", range(60), answer_spread=60)
    evals = write_conversations(root / "eval.jsonl", range(60, 68), answer_spread=60)
    config = write_train_config(
        root / "truth_config.py",
        name="truth-test",
        data=(str(data),),
        eval_data=("builtin:python-stdlib-eval",),
        num_steps=2,
        save_every=100,
        keep_checkpoints=5,
    )
    return config, data, evals


def _config(files, **changes):
    config_file, _, evals = files
    base = load_train_config(str(config_file))
    return dataclasses.replace(base, **{"eval_data": (str(evals),), **changes})


@pytest.fixture(scope="module")
def base_run(files, tmp_path_factory):
    """Two steps saved at steps 1 and 2, exported at the end."""
    out = tmp_path_factory.mktemp("base")
    result = train(_config(files, save_every=1), out, progress=False)
    return out, result


class _RecordingBar:
    """Stands in for tqdm: checks at every tick that the steps counted have finished."""

    instances: list[_RecordingBar] = []

    def __init__(self, *, total, initial, desc, dispatched):
        self.n, self.initial, self.total, self.dispatched = initial, initial, total, dispatched
        _RecordingBar.instances.append(self)

    def update(self, n):
        self.n += n
        # The first `initial` steps ran before the bar started (the compiling step included).
        assert all(m.is_ready() for m in self.dispatched[: self.n])

    def set_postfix(self, **kw):
        pass

    def unpause(self):
        pass

    def write(self, text):
        pass

    def close(self):
        pass


def test_data_alone_holds_out_its_own_eval_set(files, tmp_path, capsys, monkeypatch):
    """--data without --eval-data: a share of the user's data is held out (and said), not the
    config's built-in Python eval set; warnings reach the console; evaluation every step;
    TensorBoard scalars beside metrics.jsonl; the bar counts finished steps only."""
    config_file, data, _ = files
    dispatched = []
    real_step = trainer.make_train_step

    def recording_step(*args, **kwargs):
        step = real_step(*args, **kwargs)

        def run(*a):
            state, metrics = step(*a)
            dispatched.append(metrics["loss"])
            return state, metrics

        return run

    monkeypatch.setattr(trainer, "make_train_step", recording_step)
    monkeypatch.setattr(trainer, "tqdm", lambda **kw: _RecordingBar(**kw, dispatched=dispatched))
    _RecordingBar.instances.clear()
    out = tmp_path / "run"
    args = ["train", "--config", str(config_file), "--data", str(data), "--steps", "3"]
    args += ["--eval-every", "1", "--output", str(out), "--no-export"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "holding out 4 of the 60 conversations" in err  # one eval batch of 4
    assert "training uses the other 56" in err
    assert "are truncated" in err and "sequences read by this call were truncated" in err
    assert not (out / "data").exists()  # the config's built-in eval corpus was never built

    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r["split"] == "eval"] == [0, 1, 2, 3]
    assert sum(r["truncated"] for r in logged if r["split"] == "train") > 0
    scalars, _ = read_events(out)
    assert set(scalars["train/loss"]) == {1, 2, 3}
    assert set(scalars["eval/loss"]) == {0, 1, 2, 3}
    for r in logged:
        assert scalars[f"{r['split']}/loss"][r["step"]] == pytest.approx(r["loss"], rel=1e-6)
        assert scalars[f"{r['split']}/accept_rate_k/1"][r["step"]] == pytest.approx(
            r["accept_rate_k"][0], rel=1e-6
        )
    (bar,) = _RecordingBar.instances
    assert bar.initial == 1 and bar.n == 3 and len(dispatched) == 3


def test_notices_print_once(capsys):
    """Orbax imports absl, which can leave the root logger a stderr handler (logging's
    basicConfig): the trainer's notices still print once, in the command's own format."""
    from dspark_jax.cli.train import _console_log

    root = logging.getLogger()
    basic = logging.StreamHandler(sys.stderr)
    basic.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    root.addHandler(basic)
    try:
        with _console_log():
            logging.getLogger("dspark_jax.training.trainer").warning("holding out 4")
    finally:
        root.removeHandler(basic)
    assert capsys.readouterr().err == "WARNING: holding out 4\n"
    assert logging.getLogger("dspark_jax").propagate


def test_throughput_leaves_out_evaluation_pauses(files, tmp_path, monkeypatch):
    """steps_per_s and seq_tokens_per_s count training time only, also when an evaluation falls
    inside a log interval (--eval-every not a multiple of log_every): on a clock where a step
    takes 1 s and an evaluation 100 s, every interval trains at 1 step/s."""
    clock = [0.0]

    def taking(seconds, make):
        def made(*args, **kwargs):
            run = make(*args, **kwargs)

            def timed(*a):
                clock[0] += seconds
                return run(*a)

            return timed

        return made

    monkeypatch.setattr(trainer, "make_train_step", taking(1.0, trainer.make_train_step))
    monkeypatch.setattr(trainer, "make_eval_step", taking(100.0, trainer.make_eval_step))
    monkeypatch.setattr(trainer, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    config = _config(files, num_steps=8, log_every=4, eval_every=3)
    result = train(config, tmp_path, progress=False, export=False)
    train_logs = [h for h in result.history if h["split"] == "train"]
    assert [h["step"] for h in train_logs] == [4, 8]
    # The first step (compilation) is outside the timing: 3 steps, then 4.
    assert [h["steps_per_s"] for h in train_logs] == [1.0, 1.0]
    tokens = config.recipe.global_batch_size * config.recipe.max_length
    assert [h["seq_tokens_per_s"] for h in train_logs] == [tokens, tokens]


def test_throughput_leaves_out_each_bucket_compile(files, tmp_path, monkeypatch):
    """With several length buckets each bucket's first step compiles: on a clock where a step
    takes 1 s and a compile 50 s, every logged interval still trains at 1 step/s, and the bar
    counts the compiling steps as steps."""
    clock = [0.0]
    shapes, dispatched = set(), []
    real_step = trainer.make_train_step

    def timed_step(*args, **kwargs):
        run = real_step(*args, **kwargs)

        def timed(state, frozen, batch):
            shape = batch["tokens"].shape
            clock[0] += 1.0 + (50.0 if shape not in shapes else 0.0)
            shapes.add(shape)
            state, metrics = run(state, frozen, batch)
            dispatched.append(metrics["loss"])
            return state, metrics

        return timed

    monkeypatch.setattr(trainer, "make_train_step", timed_step)
    monkeypatch.setattr(trainer, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(trainer, "tqdm", lambda **kw: _RecordingBar(**kw, dispatched=dispatched))
    _RecordingBar.instances.clear()
    config = _config(files, num_steps=8, log_every=2, eval_data=(), seq_lens=(32, 48))
    result = train(config, tmp_path, progress=True, export=False)
    assert len(shapes) == 2  # both buckets ran, so a later step compiled
    rates = [h["steps_per_s"] for h in result.history if "steps_per_s" in h]
    assert rates and all(r == 1.0 for r in rates)
    (bar,) = _RecordingBar.instances
    assert bar.n == 8


def test_too_little_data_to_hold_out_is_refused(files, tmp_path, capsys):
    config_file, data, evals = files
    small = tmp_path / "small.jsonl"
    small.write_text("".join(data.read_text().splitlines(keepends=True)[:9]))
    args = ["train", "--config", str(config_file), "--output", str(tmp_path / "run")]
    assert main([*args, "--data", str(small), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{small}: 9 conversations, too few to hold out an evaluation set" in err
    # An empty file is said to be empty, whether or not evaluation data is given.
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for eval_args in ([], ["--eval-data", str(evals)]):
        assert main([*args, "--data", str(empty), *eval_args, "--no-progress"]) == 2
        assert capsys.readouterr().err == (
            f"dspark-jax train: error: {empty}: no conversations (empty or blank lines only)\n"
        )


def test_data_is_checked_before_the_target_is_loaded(files, tmp_path, capsys, monkeypatch):
    """Bad training or evaluation data is refused before the target (a download of gigabytes
    for a hub id) is loaded."""
    config_file, data, evals = files

    def no_models(*args, **kwargs):
        raise AssertionError("the target was loaded before the data was checked")

    monkeypatch.setattr(trainer, "_setup_models", no_models)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "x"}\n')
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["Why?"]}) + "\n")
    missing = tmp_path / "no.jsonl"
    cases = [
        (["--data", str(bad), "--eval-data", str(evals)], f"{bad}:1: "),
        (["--data", str(data), "--eval-data", str(missing)], f"{missing}: no such file"),
        (["--data", str(data), "--eval-data", str(prompts)], f'{prompts}:1: a {{"turns"'),
    ]
    for data_args, message in cases:
        args = ["train", "--config", str(config_file), "--output", str(tmp_path / "run")]
        assert main([*args, *data_args, "--no-progress"]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "run").exists()


def _tree(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))}


def test_a_refused_run_leaves_nothing_behind(files, base_run, tmp_path, capsys):
    """A fresh run refused while it sets up removes what it made (the run folder, the built-in
    corpus it wrote, the checkpoints folder); a resumed run's folder keeps what it held."""
    config_file, data, _ = files
    out = tmp_path / "new" / "run"
    args = ["train", "--config", str(config_file), "--output", str(out), "--no-progress"]
    missing = str(tmp_path / "nope")
    # The config evaluates on the built-in corpus, written into the run folder before the
    # target, the drafter and the checkpoints are read.
    for bad in (["--data", missing], ["--target", missing], ["--init-from", missing]):
        assert main([*args, *bad]) == 2
        assert missing in capsys.readouterr().err
        assert not (tmp_path / "new").exists(), bad
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    assert main([*args, "--target", missing]) == 2
    assert _tree(out) == {"notes.txt": 4}
    resumed = tmp_path / "resumed"
    shutil.copytree(base_run[0], resumed)
    before = _tree(resumed)
    args[args.index(str(out))] = str(resumed)
    assert main([*args, "--target", missing]) == 2
    assert missing in capsys.readouterr().err
    assert _tree(resumed) == before


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--stop-after", "0"], "argument --stop-after: must be >= 1, got 0"),
        (["--stop-after", "-1"], "argument --stop-after: must be >= 1, got -1"),
        (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["--eval-every", "x"], "argument --eval-every: expected a whole number, got 'x'"),
        (["--anchors-per-chunk", "0"], "argument --anchors-per-chunk: must be >= 1, got 0"),
        (["--anchors-per-chunk", "3"], "--anchors-per-chunk (3) must divide num_anchors (8)"),
        (["--seq-lens", "8,16"], "--seq-lens must be strictly ascending lengths"),
        (["--per-device-batch-size", "3"], "--per-device-batch-size 3 x 4 batch-parallel"),
        # The embedded default pair's drafter: another hidden size. (The tiny-vanilla drafter
        # differs from this config's only in num_anchors, which shapes no weight.)
        (
            ["--init-from", str(EMBEDDED_DRAFT)],
            f"--init-from {EMBEDDED_DRAFT} does not match the config",
        ),
    ],
)
def test_errors_name_the_flags(files, tmp_path, capsys, flags, message):
    """A flag's value that does not fit is refused in one line naming the flag as typed, not the
    config field it sets; nothing runs and nothing is written."""
    config_file, _, _ = files
    out = tmp_path / "run"
    assert main(["train", "--config", str(config_file), "--output", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_stop_after_must_be_positive(files, tmp_path):
    with pytest.raises(UserError, match="stop_after must be >= 1 or None, got 0"):
        train(_config(files), tmp_path / "run", stop_after=0)
    assert not (tmp_path / "run").exists()


def test_extend_a_finished_run(files, base_run, tmp_path, caplog):
    base, base_result = base_run
    run = tmp_path / "run"
    shutil.copytree(base, run)
    # Run again as it is, a finished run evaluates its last step without logging it twice.
    logged = (run / "metrics.jsonl").read_text()
    again = train(_config(files), run, progress=False, export=False)
    assert again.resumed_from == 2 and again.history == []
    assert again.eval_end["loss"] == pytest.approx(base_result.eval_end["loss"], rel=1e-6)
    assert (run / "metrics.jsonl").read_text() == logged
    caplog.set_level("INFO", logger="dspark_jax")
    result = train(_config(files, num_steps=3), run, progress=False, export=False)
    assert result.resumed_from == 2 and result.final_step == 3
    evaluated = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evaluated if r["split"] == "eval"] == [0, 2, 3]
    assert "extending the run from 2 to 3 steps" in caplog.text
    assert "learning-rate schedule is recomputed for 3 steps" in caplog.text
    with pytest.raises(TrainCheckpointError, match="at step 3, past the 1 steps asked for"):
        train(_config(files, num_steps=1), run, progress=False, export=False)


def test_reading_a_checkpoint_is_quiet(base_run, caplog):
    """Resuming, --init-from and export read checkpoints through read-only Orbax managers, which
    must not warn about their read-only settings on every open."""
    base, _ = base_run
    with caplog.at_level(logging.WARNING):
        directory, step = find_checkpoint(base)
        assert read_meta(directory, step)["total_steps"] == 2
    assert [r.getMessage() for r in caplog.records if r.name == "absl"] == []


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    st = SafetensorsFolder(folder)
    return {k: st.get(k) for k in st.keys()}


def test_export_any_checkpoint(files, base_run, tmp_path, capsys):
    """`export --draft runs/x/checkpoints/N` writes the drafter of step N, bit-identical to the
    run's own export at its last step; a run folder means its newest step."""
    base, _ = base_run
    final = _tensors(base / "drafter")
    assert (
        main(["export", "--draft", str(base / "checkpoints" / "2"), "--out", str(tmp_path / "a")])
        == 0
    )
    assert "completed with the target" in capsys.readouterr().out
    exported = _tensors(tmp_path / "a")
    assert exported.keys() == final.keys()
    for key in final:
        np.testing.assert_array_equal(exported[key], final[key], err_msg=key)
    assert (tmp_path / "a" / "config.json").read_bytes() == (
        base / "drafter" / "config.json"
    ).read_bytes()
    assert main(["export", "--draft", str(base), "--out", str(tmp_path / "b")]) == 0
    np.testing.assert_array_equal(_tensors(tmp_path / "b")["fc.weight"], final["fc.weight"])
    assert (
        main(["export", "--draft", str(base / "checkpoints" / "1"), "--out", str(tmp_path / "c")])
        == 0
    )
    assert not np.array_equal(_tensors(tmp_path / "c")["fc.weight"], final["fc.weight"])
    # A drafter trained here in vLLM's speculators layout: the schema, the recorded target as
    # the verifier, every tensor but the verifier's embedding and head.
    spec = tmp_path / "spec"
    assert (
        main(["export", "--draft", str(base), "--format", "speculators", "--out", str(spec)]) == 0
    )
    config = json.loads((spec / "config.json").read_text())
    check_speculators_config(config)
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(
        Path(TINY_TARGET).resolve()
    )
    spec_tensors = _tensors(spec)
    assert set(spec_tensors) == set(final) - set(VERIFIER_TENSORS)
    for key, value in spec_tensors.items():
        np.testing.assert_array_equal(value, final[key], err_msg=key)
    # The output may not be (or sit inside) the checkpoint it reads.
    inside = base / "checkpoints" / "1" / "out"
    assert main(["export", "--draft", str(base / "checkpoints" / "1"), "--out", str(inside)]) == 2
    assert "overlaps the input" in capsys.readouterr().err


def test_export_of_a_diverged_checkpoint_is_refused(base_run, tmp_path, capsys, monkeypatch):
    """A step whose parameters hold NaN (a run that diverged) is refused in one line naming the
    step, and nothing is written."""
    base, _ = base_run
    restore = trainer.restore_state

    def diverged(directory, step, abstract_state):
        state = restore(directory, step, abstract_state)
        leaves, treedef = jax.tree.flatten(state.params)
        leaves[0] = leaves[0] * np.nan
        return state._replace(params=jax.tree.unflatten(treedef, leaves))

    monkeypatch.setattr(trainer, "restore_state", diverged)
    out = tmp_path / "nan"
    assert main(["export", "--draft", str(base / "checkpoints" / "2"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "step 2 of" in err and "NaN or infinite" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_a_run_given_as_draft_without_target_names_the_target_it_records(base_run, capsys):
    """`generate --draft RUN` decodes on the embedded target, which a tiny run's drafter does
    not fit: the refusal names the target the run's checkpoints record."""
    base, _ = base_run
    assert main(["generate", "--draft", str(base), "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert f"give --target {Path(TINY_TARGET).resolve()} (the target it records)" in err


def test_export_whose_recorded_target_moved_says_to_name_it(
    base_run, tmp_path, capsys, monkeypatch
):
    """The target a run recorded has moved: export said only "PATH: no such folder"."""
    base, _ = base_run
    read = trainer.checkpoint_drafter_config

    def moved(directory, step):
        cfg, meta = read(directory, step)
        return cfg, {**meta, "target": str(tmp_path / "moved-away")}

    monkeypatch.setattr(trainer, "checkpoint_drafter_config", moved)
    out = tmp_path / "x"
    assert main(["export", "--draft", str(base), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"{tmp_path / 'moved-away'}: no such folder" in err
    assert "if it has moved, name its folder (--target)" in err
    assert not out.exists()
    assert main(["export", "--draft", str(base), "--target", TINY_TARGET, "--out", str(out)]) == 0


def _starts_where_base_ended(files, base_run, source, out):
    """A run started from `source` begins where the base run ended: its first evaluation equals
    the base run's last (same held-out batches and anchors)."""
    _, base_result = base_run
    result = train(
        _config(files, init_drafter=str(source), num_steps=1), out, progress=False, export=False
    )
    assert result.eval_start["loss"] == pytest.approx(base_result.eval_end["loss"], rel=1e-6)
    assert result.eval_start["tau"] == pytest.approx(base_result.eval_end["tau"], rel=1e-6)


def test_init_from_checkpoint(files, base_run, tmp_path):
    base, _ = base_run
    _starts_where_base_ended(files, base_run, base / "checkpoints" / "2", tmp_path / "run")


@pytest.mark.slow
def test_init_from_exported_drafter_and_mismatch(files, base_run, tmp_path):
    base, _ = base_run
    _starts_where_base_ended(files, base_run, base / "drafter", tmp_path / "run")
    wrong = dataclasses.replace(_config(files).drafter, markov_rank=16)
    with pytest.raises(Exception, match="does not match the config's drafter: .*markov_rank"):
        train(
            _config(files, init_drafter=str(base), drafter=wrong),
            tmp_path / "wrong",
            progress=False,
        )


def test_ctrl_c_saves_a_checkpoint_and_exits_130(files, tmp_path, capsys, monkeypatch):
    """SIGINT during training stops after the step in flight, saves it, and the command exits
    130 with one line (no traceback); running again resumes from that step."""
    config_file, _, _ = files
    real_step = trainer.make_train_step

    def interrupting_step(*args, **kwargs):
        step = real_step(*args, **kwargs)
        calls = []

        def run(*a):
            out = step(*a)
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGINT)
            return out

        return run

    monkeypatch.setattr(trainer, "make_train_step", interrupting_step)
    out = tmp_path / "run"
    args = ["train", "--config", str(config_file), "--steps", "5", "--output", str(out)]
    assert main([*args, "--eval-data", "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last == (
        f"dspark-jax train: interrupted: saved step 2 in {out / 'checkpoints' / '2'}; "
        "run again to resume"
    )
    assert TrainCheckpointer(out / "checkpoints", 5).all_steps() == [2]


def test_ctrl_c_while_setting_up_aborts(files, tmp_path, capsys, monkeypatch):
    """Ctrl-C before training starts aborts the run (exit 130) and removes what it created, also
    when the KeyboardInterrupt lands where Python swallows it: in a garbage-collection callback
    or a __del__, it is printed ('Exception ignored in ...') and the program goes on."""
    config_file, _, _ = files
    real_setup = trainer._setup_models

    def setup_then_swallowed_ctrl_c(*args, **kwargs):
        models = real_setup(*args, **kwargs)
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            pass  # as Python does with one raised in a gc callback
        return models

    monkeypatch.setattr(trainer, "_setup_models", setup_then_swallowed_ctrl_c)
    out = tmp_path / "run"
    args = ["train", "--config", str(config_file), "--steps", "2", "--output", str(out)]
    assert main([*args, "--eval-data", "--no-progress"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "dspark-jax train: interrupted"
    assert not out.exists()
