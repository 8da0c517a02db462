"""Training configuration without training: what the CLI and TrainConfig hand to the trainer,
and the checks made before a target is loaded."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from train_helpers import write_conversations

from dspark_jax.cli import main
from dspark_jax.config import ConfigError
from dspark_jax.configs.train_tiny import TRAIN_CONFIGS
from dspark_jax.training import trainer
from dspark_jax.training.data import BatchRows


def _given_config(monkeypatch, argv) -> trainer.TrainConfig:
    """The TrainConfig `dspark-jax train argv` hands to `train`."""
    seen = {}

    def fake_train(config, output, **kwargs):
        seen["config"] = config
        raise trainer.TrainingInterrupted(0, output)

    monkeypatch.setattr(trainer, "train", fake_train)
    assert main(["train", *argv]) == 130
    return seen["config"]


def test_skip_bad_records_reaches_the_data(monkeypatch, tmp_path):
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    bad = {"messages": [{"role": "assistant", "content": "a"}, *good["messages"]]}
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [good] * 20 + [bad]))
    argv = ["--config", "tiny-dspark", "--data", str(data), "--eval-data", "--output",
            str(tmp_path / "run")]
    assert not _given_config(monkeypatch, argv).skip_bad_records
    config = _given_config(monkeypatch, [*argv, "--skip-bad-records"])
    assert config.skip_bad_records
    rows = BatchRows(tuple(range(8)), 8)
    run_data = trainer._open_data(config, tmp_path, rows)
    assert len(run_data.train_source) == 20 and run_data.train.skip_bad_records
    with pytest.raises(trainer.DataError, match=r"d\.jsonl:21: the conversation starts with"):
        trainer._open_data(dataclasses.replace(config, skip_bad_records=False), tmp_path, rows)


def test_thinking_reaches_the_data_and_the_run_record(monkeypatch, tmp_path):
    data = write_conversations(tmp_path / "d.jsonl", range(20), 8)
    argv = ["--config", "tiny-dspark", "--data", str(data), "--eval-data", "--output",
            str(tmp_path / "run")]
    off = _given_config(monkeypatch, argv)
    on = _given_config(monkeypatch, [*argv, "--thinking"])
    assert not off.enable_thinking and on.enable_thinking
    rows = BatchRows(tuple(range(8)), 8)
    assert trainer._open_data(on, tmp_path, rows).train.enable_thinking
    assert not trainer._open_data(off, tmp_path, rows).train.enable_thinking
    # a resume must keep it; the records of earlier versions (thinking off) stay resumable
    assert "enable_thinking" not in off.run_record(1, 1)
    assert on.run_record(1, 1)["enable_thinking"] is True


def test_epochs_count_whole_passes_over_the_data(caplog):
    recipe = dataclasses.replace(
        TRAIN_CONFIGS["tiny-dspark"].recipe,
        num_epochs=10,
        global_batch_size=8,
    )
    assert trainer.epoch_steps(20, recipe) == 25  # 200 sequences, not 10 x (20 // 8) = 20
    assert not caplog.records
    with caplog.at_level("WARNING", logger="dspark_jax"):
        assert trainer.epoch_steps(5, recipe) == 6  # not 1
    assert "5 training conversations are fewer than one global batch (8)" in caplog.text
    assert trainer.epoch_steps(1, dataclasses.replace(recipe, num_epochs=1)) == 1


def test_max_length_beyond_the_targets_context_is_refused(tmp_path):
    config = TRAIN_CONFIGS["tiny-dspark"]
    target = tmp_path / "target"
    shutil.copytree(config.target, target)
    target_config = json.loads((target / "config.json").read_text())
    target_config["max_position_embeddings"] = config.recipe.max_length // 2
    (target / "config.json").write_text(json.dumps(target_config))
    data = write_conversations(tmp_path / "d.jsonl", range(20), answer_spread=20)
    short = dataclasses.replace(config, target=str(target), data=(str(data),), eval_data=())
    with pytest.raises(ConfigError, match=r"max_length 256 exceeds the target's context "
                       r"\(max_position_embeddings 128"):
        trainer.train(short, tmp_path / "run", progress=False, export=False)
    assert not (tmp_path / "run").exists()


def test_a_copied_configs_file_loads(tmp_path):
    from dspark_jax.cli.train import load_train_config
    from dspark_jax.configs import train_tiny

    copy = tmp_path / "my_run.py"
    copy.write_text(Path(train_tiny.__file__).read_text())
    with pytest.raises(ConfigError, match=r"add a line such as CONFIG = TRAIN_CONFIGS\['tiny-"):
        load_train_config(str(copy))
    copy.write_text(copy.read_text() + '\nCONFIG = TRAIN_CONFIGS["tiny-dflash"]\n')
    assert load_train_config(str(copy)).name == "tiny-dflash"
    one = tmp_path / "one.py"
    one.write_text(
        "from dspark_jax.configs.train_tiny import TRAIN_CONFIGS as ALL\n"
        "TRAIN_CONFIGS = {'mine': ALL['tiny-dspark']}\n"
    )
    assert load_train_config(str(one)).name == "tiny-dspark"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        # A float count was accepted and rounded by the loop (num_steps=2.5 ran to step 3).
        ("num_steps", 2.5, "num_steps must be an integer >= 1 or None, got 2.5"),
        ("log_every", 1.5, "log_every must be an integer >= 1, got 1.5"),
        ("eval_every", 2.0, "eval_every must be an integer >= 1 or None, got 2.0"),
        ("anchors_per_chunk", 4.0, "anchors_per_chunk must be an integer >= 1, got 4.0"),
        # Strings failed with a bare TypeError at the first comparison.
        ("num_steps", "10", "num_steps must be an integer >= 1 or None, got '10'"),
        ("save_every", "5", "save_every must be an integer >= 1, got '5'"),
        ("eval_batches", True, "eval_batches must be an integer >= 1, got True"),
        ("keep_checkpoints", None, "keep_checkpoints must be an integer >= 1, got None"),
        ("per_device_batch_size", 0, "per_device_batch_size must be >= 1 or None, got 0"),
        # check_seq_lens truncated 128.5 to 128.
        ("seq_lens", (64, 128.5, 256), r"seq_lens must be a tuple of integers or None, got \(64"),
        ("seq_lens", "256", "seq_lens must be a tuple of integers or None, got '256'"),
        # None failed with a bare AttributeError.
        ("drafter", None, "drafter must be a DrafterConfig, got None"),
        ("recipe", None, "recipe must be a TrainRecipe, got None"),
        ("mesh", None, "mesh must be a MeshConfig, got None"),
        # Flags: "no" counted as true.
        ("holdout", "no", "holdout must be True or False, got 'no'"),
        ("skip_bad_records", 1, "skip_bad_records must be True or False, got 1"),
        ("enable_thinking", "yes", "enable_thinking must be True or False, got 'yes'"),
        # Refused only when train loaded the target.
        ("target_dtype", "int8", r"target_dtype must be one of \('float32', 'bfloat16', "
         r"'float16'\) or None \(the recipe's dtype\), got 'int8'"),
    ],
)
def test_train_config_refuses_bad_fields_when_built(field, value, message):
    config = TRAIN_CONFIGS["tiny-dspark"]
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(config, **{field: value})


def test_train_config_takes_numpy_integers_and_none_where_allowed():
    import numpy as np

    config = dataclasses.replace(
        TRAIN_CONFIGS["tiny-dspark"],
        num_steps=np.int64(5),
        log_every=np.int32(2),
        seq_lens=np.array([64, 256]),
        target_dtype="bfloat16",
    )
    assert type(config.num_steps) is int and type(config.log_every) is int
    assert config.seq_lens == (64, 256) and all(type(n) is int for n in config.seq_lens)
    config = dataclasses.replace(
        config, num_steps=None, per_device_batch_size=None, eval_every=None, seq_lens=None,
        target_dtype=None,
    )
    assert config.num_steps is None and config.eval_every is None


def test_init_from_ignores_drafter_fields_outside_the_weights():
    """--init-from compares the drafter configs but for fields the parameters do not depend on
    (num_anchors: 48 vs 32 refused the tiny config starting from the package's tiny drafter):
    the parameters' shapes are the same whatever their values, and every other field counts."""
    import jax
    from flax import nnx

    from dspark_jax.checkpoints.converted import load_target
    from dspark_jax.configs.train_tiny import TINY_DSPARK_DRAFTER, TINY_TARGET
    from dspark_jax.training.step import new_drafter, split_drafter

    _, target, _ = load_target(TINY_TARGET, progress=False)

    def shapes(cfg):
        params = split_drafter(new_drafter(cfg.with_dtype("float32"), target, seed=0))[1]
        return jax.tree.map(lambda x: x.shape, nnx.to_pure_dict(params))

    d = TINY_DSPARK_DRAFTER
    free = [
        dataclasses.replace(d, num_anchors=d.num_anchors // 2),
        dataclasses.replace(d, model=dataclasses.replace(d.model, max_position_embeddings=64)),
        d.with_dtype("bfloat16"),
    ]
    assert sorted(trainer.INIT_FREE_FIELDS) == ["dtype", "max_position_embeddings", "num_anchors"]
    for other in free:
        assert trainer._drafter_diffs(other, d) == []
        assert shapes(other) == shapes(d)
    assert trainer._drafter_diffs(dataclasses.replace(d, block_size=d.block_size + 1), d) == [
        f"block_size: {d.block_size + 1} vs {d.block_size}"
    ]


def test_a_checkpoint_of_another_run_names_the_fields_and_values():
    from dspark_jax.training.checkpointing import record_differences

    saved = {"recipe": {"learning_rate": 6e-4, "global_batch_size": 4, "seed": 0}, "steps": 6}
    now = {"recipe": {"learning_rate": 1e-2, "global_batch_size": 8, "seed": 0}, "steps": 6,
           "processes": 1}
    assert record_differences(saved, now) == [
        "processes: absent then, 1 now",
        "recipe.global_batch_size: 4 then, 8 now",
        "recipe.learning_rate: 0.0006 then, 0.01 now",
    ]
    assert record_differences(saved, saved) == []
    # Absolute paths that differ near their end: the shared start is dropped, not the difference.
    runs = "/mnt/shared/team/runs/dspark-qwen3-8b-sharegpt/checkpoints/"
    assert record_differences({"init_drafter": runs + "1200"}, {"init_drafter": runs + "2400"}) == [
        "init_drafter: ...checkpoints/1200' then, ...checkpoints/2400' now"
    ]


def test_a_config_file_that_fails_is_one_line_naming_it(tmp_path, capsys):
    config = tmp_path / "cfg.py"
    config.write_text(
        "from dspark_jax.configs.train_tiny import TINY_DSPARK_DRAFTER, TINY_RECIPE, TINY_TARGET\n"
        "from dspark_jax.training.trainer import TrainConfig\n"
        "CONFIG = TrainConfig(target=TINY_TARGET, drafter=TINY_DSPARK_DRAFTER, "
        "recipe=TINY_RECIPE)\n"
    )
    assert main(["train", "--config", str(config), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"dspark-jax train: error: config file {config}:3: TypeError: TrainConfig.__init__() "
        "missing 2 required positional arguments: 'name' and 'data'"
    ]

