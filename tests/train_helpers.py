"""Setup shared by the training tests: chat data cut from a file of this repository, a config
file around the tiny target and drafter, and `dspark-jax train` in a child process that can be
made to die while writing a checkpoint."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

REPO = Path(__file__).parents[1]

_CONFIG_FILE = """
import dataclasses
from dspark_jax.configs.train_tiny import TINY_DSPARK_DRAFTER, TINY_RECIPE, TINY_TARGET
from dspark_jax.sharding import MeshConfig
from dspark_jax.training.trainer import TrainConfig

recipe = dataclasses.replace(
    TINY_RECIPE, global_batch_size={batch_size}, max_length=48, warmup_ratio={warmup_ratio}
)
CONFIG = TrainConfig(
    target=TINY_TARGET,
    drafter=dataclasses.replace(TINY_DSPARK_DRAFTER, num_anchors=8),
    recipe=recipe,
    mesh=MeshConfig(*{mesh!r}),
    anchors_per_chunk=4,
    log_every=1,
{fields})
"""

# One `dspark-jax train` process. argv[1]: a step whose checkpoint the process dies in (SIGKILL
# after writing its data-iterator item, before Orbax commits the step), or "" to run normally;
# the rest are the command's arguments.
TRAIN_CHILD = """
import os, signal, sys
import grain
from dspark_jax.cli import main

if sys.argv[1]:
    original = grain.checkpoint.CheckpointHandler.save

    def save_then_die(self, directory, item=None, args=None):
        original(self, directory, item, args)
        if f"/{sys.argv[1]}.orbax-checkpoint-tmp" in str(directory):
            os.kill(os.getpid(), signal.SIGKILL)

    grain.checkpoint.CheckpointHandler.save = save_then_die
sys.exit(main(["train", *sys.argv[2:]]))
"""

# `dspark-jax train` (argv[1:]) given Ctrl-C after its second step, then again half a second into
# Orbax's commit of the checkpoint that follows (held up for two seconds): the second aborts.
ABORTED_TRAIN_CHILD = """
import asyncio, os, signal, sys, threading
from orbax.checkpoint._src.path import atomicity
from dspark_jax.cli import main
from dspark_jax.training import trainer

steps = []
make_train_step = trainer.make_train_step

def make_interrupted_step(*args, **kwargs):
    step = make_train_step(*args, **kwargs)

    def run(*a):
        out = step(*a)
        steps.append(1)
        if len(steps) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    return run

trainer.make_train_step = make_interrupted_step
finalize = atomicity.AtomicRenameTemporaryPath.finalize

async def slow_finalize(self, *args, **kwargs):
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    await asyncio.sleep(2)
    return await finalize(self, *args, **kwargs)

atomicity.AtomicRenameTemporaryPath.finalize = slow_finalize
sys.exit(main(["train", *sys.argv[1:]]))
"""


def write_conversations(path: Path, ks, answer_spread: int) -> Path:
    """One conversation per k, cut from training/loss.py at offset 80 k: a 16-byte question and
    an answer of 4 .. 3 + answer_spread bytes, so 21 .. 20 + answer_spread tokens in all."""
    source = (REPO / "dspark_jax" / "training" / "loss.py").read_text()
    with open(path, "w") as f:
        for k in ks:
            i = 80 * k
            answer = source[i + 16 : i + 20 + (k * 29) % answer_spread]
            messages = [
                {"role": "user", "content": source[i : i + 16]},
                {"role": "assistant", "content": answer},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def write_train_config(
    path: Path, *, batch_size: int = 4, warmup_ratio: float = 0.25, mesh=(2, 2, 2), **fields
) -> Path:
    """A config file of the tiny target and drafter (8 anchors, 4 per chunk, sequences of at
    most 48 tokens, a log line every step); `fields` are further `TrainConfig` fields."""
    lines = "".join(f"    {name}={value!r},\n" for name, value in fields.items())
    path.write_text(
        _CONFIG_FILE.format(batch_size=batch_size, warmup_ratio=warmup_ratio, mesh=mesh,
                            fields=lines)
    )
    return path


def child_env(cache_dir: Path | None = None, devices: int | None = None) -> dict[str, str]:
    """This process's environment for a child that imports this checkout, reads and writes the
    persistent compilation cache `cache_dir` (if any) and, given `devices`, runs on that many
    CPU devices."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if devices is not None:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return env


def read_events(folder: Path) -> tuple[dict[str, dict[int, float]], list[int]]:
    """(tag -> {step: value}, purge steps) from the TensorBoard event files in `folder` (TFRecord
    framing), read as TensorBoard reads them: a session start at step T (a run restarted from
    step T - 1) discards the values at steps >= T read before it."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    purges = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            if event.session_log.status == event_pb2.SessionLog.START:
                purges.append(event.step)
                for values in scalars.values():
                    for step in [s for s in values if s >= event.step]:
                        del values[step]
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars, purges
