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
