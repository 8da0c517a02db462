"""Multi-host training on one machine: `dspark-jax train --distributed` as two processes with four
CPU devices each, talking through jax.distributed (gloo collectives on CPU), each process reading
its own rows of the grain input and writing its own part of the Orbax checkpoints.

- Three steps of 2 processes x 4 devices equal three steps of 1 process x 8 devices (losses and
  trained parameters, within float tolerance: the cross-process reductions sum in another order).
- (slow) Parameters sharded over both processes and two length buckets: the second process is
  killed while a checkpoint is being written; both are restarted, resume from the last complete
  checkpoint and finish exactly as an uninterrupted two-process run.
- (slow) `train/slurm_multinode.sbatch` runs two "nodes" under a stand-in `srun`.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from train_helpers import REPO, TRAIN_CHILD, child_env, write_conversations, write_train_config

from dspark_jax.cli.train import load_train_config
from dspark_jax.tokenizer import load_tokenizer
from dspark_jax.training.data import BatchRows, DataConfig, make_iterator
from dspark_jax.training.trainer import train

NUM_PROCESSES = 2
LOCAL_DEVICES = 4
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    # Answers of 4..33 bytes: conversations of 21..50 tokens, in both buckets of (32, 48).
    folder = tmp_path_factory.mktemp("multihost-data")
    return write_conversations(folder / "train.jsonl", range(40), answer_spread=30)


def write_config(folder: Path, data: Path, num_steps: int, seq_lens, mesh) -> Path:
    return write_train_config(
        folder / "config.py",
        batch_size=8,
        warmup_ratio=0.0,
        mesh=mesh,
        name="multihost-test",
        data=(str(data),),
        num_steps=num_steps,
        seq_lens=seq_lens,
        save_every=2,
        keep_checkpoints=2,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """The processes of one distributed run, started on a fresh coordinator port."""

    def __init__(self, config: Path, output: Path, logs: Path, *, cache_dir=None, die_at=None):
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = logs
        port = free_port()
        self.procs = []
        for rank in range(NUM_PROCESSES):
            die = str(die_at) if die_at is not None and rank == 1 else ""
            args = [sys.executable, "-c", textwrap.dedent(TRAIN_CHILD), die]
            args += ["--config", str(config), "--output", str(output), "--no-progress"]
            args += ["--distributed", "--coordinator-address", f"127.0.0.1:{port}"]
            args += ["--num-processes", str(NUM_PROCESSES), "--process-id", str(rank)]
            with open(logs / f"{rank}.out", "w") as out, open(logs / f"{rank}.err", "w") as err:
                self.procs.append(
                    subprocess.Popen(
                        args, env=child_env(cache_dir, LOCAL_DEVICES), stdout=out, stderr=err
                    )
                )

    def log(self, rank: int) -> str:
        return (self.logs / f"{rank}.err").read_text()[-3000:]

    def wait(self, rank: int, timeout: float = TIMEOUT_S) -> int:
        try:
            return self.procs[rank].wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"process {rank} still running after {timeout} s:\n{self.log(rank)}")

    def wait_all_ok(self) -> list[dict]:
        """Every process's summary (the JSON that `dspark-jax train` prints at the end)."""
        summaries = []
        for rank in range(NUM_PROCESSES):
            code = self.wait(rank)
            if code != 0:
                self.kill()
                pytest.fail(f"process {rank} exited with {code}:\n{self.log(rank)}")
            stdout = (self.logs / f"{rank}.out").read_text()
            summaries.append(json.loads(stdout[stdout.index("{\n") :]))
        return summaries

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def train_records(output: Path) -> list[dict]:
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def assert_same_training(got: list[dict], want: list[dict], rtol: float) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want, strict=True):
        for key in ("loss", "ce", "l1", "bce", "grad_norm", "tau", "lr"):
            np.testing.assert_allclose(a[key], b[key], rtol=rtol, err_msg=f"step {a['step']} {key}")


def assert_same_params(got: Path, want: Path, atol: float) -> None:
    a, b = (
        load_file(got / "drafter" / "model.safetensors"),
        load_file(want / "drafter" / "model.safetensors"),
    )
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=atol, err_msg=key)


def test_two_processes_train_like_one(data_file, tmp_path):
    # Data parallel: every process holds the whole drafter, the batch is split over 8 devices.
    config = write_config(tmp_path, data_file, num_steps=3, seq_lens=None, mesh=(-1, 1, 1))
    # The two-process run goes on in the background while this process trains on its 8 devices.
    run = Processes(config, tmp_path / "two", tmp_path / "logs")
    try:
        one = train(load_train_config(str(config)), tmp_path / "one", progress=False)
    finally:
        summaries = run.wait_all_ok()
    assert [s["step"] for s in summaries] == [3, 3] and one.final_step == 3
    # Process 0 writes the metrics and the exported drafter; every process saves its iterator.
    assert summaries[0]["export"] and summaries[1]["export"] is None
    data_items = sorted(p.name for p in (tmp_path / "two" / "checkpoints" / "3" / "data").iterdir())
    assert [n for n in data_items if n.endswith(".json")] == [
        "process_0-of-2.json",
        "process_1-of-2.json",
    ]
    one_records = train_records(tmp_path / "one")
    assert len({r["loss"] for r in one_records}) == 3
    assert_same_training(train_records(tmp_path / "two"), one_records, rtol=1e-5)
    assert_same_params(tmp_path / "two", tmp_path / "one", atol=1e-5)


@pytest.mark.slow
def test_killed_process_then_restart_of_both_resumes_from_last_checkpoint(data_file, tmp_path):
    # fsdp over both processes: each holds and checkpoints only its shards of the parameters.
    config = write_config(tmp_path, data_file, num_steps=6, seq_lens=(32, 48), mesh=(1, -1, 1))
    # Each process buckets its own rows: in some steps the two batches differ in length and are
    # padded to the longer one to make the global batch.
    cfg = load_train_config(str(config))
    data_cfg = DataConfig(
        paths=cfg.data, seq_len=48, seq_lens=cfg.seq_lens, batch_size=4, seed=cfg.recipe.seed
    )
    tokenizer = load_tokenizer(cfg.target)
    lengths = [
        [batch["tokens"].shape[1] for batch in itertools.islice(stream, 6)]
        for stream in (
            make_iterator(data_cfg, tokenizer, BatchRows.of_process(rank, NUM_PROCESSES, 4))
            for rank in range(NUM_PROCESSES)
        )
    ]
    assert any(a != b for a, b in zip(*lengths, strict=True)), lengths
    cache = tmp_path / "jax-cache"
    reference = Processes(config, tmp_path / "reference", tmp_path / "logs-ref", cache_dir=cache)
    reference.wait_all_ok()
    want = train_records(tmp_path / "reference")
    assert len({r["loss"] for r in want}) == 6

    out = tmp_path / "run"
    crashed = Processes(config, out, tmp_path / "logs-crash", cache_dir=cache, die_at=4)
    assert crashed.wait(1) == -signal.SIGKILL, crashed.log(1)
    # Process 0 is left waiting for its peer (it would abort by itself once the coordination
    # service misses process 1's heartbeats); the job is torn down as a scheduler would.
    crashed.kill()
    ckpt = out / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["2", "4.orbax-checkpoint-tmp"]
    assert [r["step"] for r in train_records(out)] == [1, 2, 3, 4]

    restarted = Processes(config, out, tmp_path / "logs-restart", cache_dir=cache)
    summaries = restarted.wait_all_ok()
    assert [(s["resumed_from"], s["step"]) for s in summaries] == [(2, 6), (2, 6)]
    assert "incomplete checkpoint 4.orbax-checkpoint-tmp" in restarted.log(0)
    # metrics.jsonl is cut back to the checkpoint resumed from (step 2): steps 1-2 of the crashed
    # run, then the restart's 3-6.
    resumed = train_records(out)[2:]
    # The same two-process programs on the same data: the resumed steps are bit-identical.
    assert_same_training(resumed, want[2:], rtol=0)
    assert_same_params(out, tmp_path / "reference", atol=0)
    assert sorted(p.name for p in ckpt.iterdir()) == ["4", "6"]


# SLURM's srun on one machine: srun's options are dropped and the command runs once per task, with
# the variables srun gives a task (all on node "localhost"); the device ids the launcher exported
# for jax are recorded.
FAKE_SRUN = """#!/usr/bin/env bash
while [[ $1 == -* ]]; do shift; done
echo "$JAX_LOCAL_DEVICE_IDS" > "$LOGS/local_device_ids"
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_STEP_NODELIST=localhost \\
        "$@" > "$LOGS/$i.out" 2> "$LOGS/$i.err" &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""


@pytest.mark.slow
def test_slurm_launcher_runs_two_nodes_under_a_stand_in_srun(tmp_path):
    bin_dir, logs, out = tmp_path / "bin", tmp_path / "logs", tmp_path / "run"
    bin_dir.mkdir()
    logs.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(0o755)
    env = child_env(devices=LOCAL_DEVICES)
    env.update(
        PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]]),
        LOGS=str(logs),
        SLURM_JOB_ID="1",
        SLURM_NTASKS=str(NUM_PROCESSES),
        SLURM_GPUS_ON_NODE=str(LOCAL_DEVICES),
        JAX_COORDINATOR_PORT=str(free_port()),
        CONFIG="tiny-dspark",
        OUTPUT=str(out),
    )
    launcher = REPO / "train" / "slurm_multinode.sbatch"
    proc = subprocess.run(
        ["bash", str(launcher), "--steps", "2", "--eval-data", "--no-export"],
        env=env,
        cwd=tmp_path,
        timeout=TIMEOUT_S,
    )
    errors = [(logs / f"{rank}.err").read_text()[-3000:] for rank in range(NUM_PROCESSES)]
    assert proc.returncode == 0, errors
    # jax's SLURM detection alone would narrow each process to the GPU of its local rank.
    assert (logs / "local_device_ids").read_text().strip() == "0,1,2,3"
    for rank in range(NUM_PROCESSES):
        stdout = (logs / f"{rank}.out").read_text()
        assert json.loads(stdout[stdout.index("{\n") :])["step"] == 2
    assert [r["step"] for r in train_records(out)] == [2]
    data_items = sorted(p.name for p in (out / "checkpoints" / "2" / "data").glob("*.json"))
    assert data_items == ["process_0-of-2.json", "process_1-of-2.json"]
