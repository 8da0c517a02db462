"""Checkpoint/resume of the trainer: bit-identical continuation (with two length buckets and
partially filled bucket buffers at the resume point), keep-last-N, and a save killed midway
(SIGKILL in a subprocess) that must be ignored in favour of the previous checkpoint."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from dspark_jax.cli.train import load_train_config
from dspark_jax.tokenizer import load_tokenizer
from dspark_jax.training.checkpointing import TrainCheckpointer
from dspark_jax.training.data import DataConfig, make_iterator
from dspark_jax.training.trainer import train

REPO = Path(__file__).parents[1]

CONFIG_FILE = """
import dataclasses
from dspark_jax.configs.train_tiny import TINY_DSPARK_DRAFTER, TINY_RECIPE, TINY_TARGET
from dspark_jax.sharding import MeshConfig
from dspark_jax.training.trainer import TrainConfig

recipe = dataclasses.replace(TINY_RECIPE, global_batch_size=4, max_length=48, warmup_ratio=0.25)
CONFIG = TrainConfig(
    name="resume-test",
    target=TINY_TARGET,
    drafter=dataclasses.replace(TINY_DSPARK_DRAFTER, num_anchors=8),
    recipe=recipe,
    data=({data!r},),
    num_steps=6,
    mesh=MeshConfig(2, 2, 2),
    anchors_per_chunk=4,
    seq_lens=(32, 48),
    log_every=1,
    save_every=2,
    keep_checkpoints=2,
)
"""

# Run in a subprocess: kills itself while step 4's checkpoint is being written (after the data
# iterator item, before Orbax commits the step).
CRASHING_RUN = """
import os, signal, sys
import grain
from dspark_jax.cli import main

original = grain.checkpoint.CheckpointHandler.save

def save_then_die(self, directory, item=None, args=None):
    original(self, directory, item, args)
    if "4.orbax-checkpoint-tmp" in str(directory):
        os.kill(os.getpid(), signal.SIGKILL)

grain.checkpoint.CheckpointHandler.save = save_then_die
sys.exit(main(["train", "--config", sys.argv[1], "--output", sys.argv[2], "--no-progress",
               "--no-export"]))
"""


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """A persistent compilation cache shared by the runs (and the subprocess) of this module."""
    cache = tmp_path_factory.mktemp("jax-cache")
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    saved = {n: getattr(jax.config, n) for n in names}
    for name, value in zip(names, (str(cache), 0, 0), strict=True):
        jax.config.update(name, value)
    yield cache
    for name, value in saved.items():
        jax.config.update(name, value)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory, compile_cache):
    root = tmp_path_factory.mktemp("resume")
    data = root / "train.jsonl"
    source = (REPO / "dspark_jax" / "training" / "loss.py").read_text()
    with open(data, "w") as f:
        for k, i in enumerate(range(0, 40 * 80, 80)):
            # Answers of 4..63 bytes: conversations of 21..80 tokens fill both buckets or truncate.
            answer = source[i + 16 : i + 20 + (k * 29) % 60]
            messages = [
                {"role": "user", "content": source[i : i + 16]},
                {"role": "assistant", "content": answer},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    path = root / "resume_config.py"
    path.write_text(CONFIG_FILE.format(data=str(data)))
    return path


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


def test_checkpoint_killed_mid_save_is_ignored(
    config_file, uninterrupted, compile_cache, tmp_path, caplog
):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["JAX_COMPILATION_CACHE_DIR"] = str(compile_cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CRASHING_RUN), str(config_file), str(tmp_path)],
        env=env,
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
