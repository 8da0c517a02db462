"""Orbax checkpoints of a training run: trainable drafter params, optimizer state, step, PRNG key,
the grain iterator position of every process, and a small JSON record of the run's settings.

Frozen weights (the target and the drafter's embed_tokens / lm_head) are not saved: they are
rebuilt from the target exactly as at the start of the run.

Crash safety is Orbax's: a step is written into `<step>.orbax-checkpoint-tmp-<time>` and renamed
to `<step>` only after every item is complete (on file systems without atomic rename Orbax writes
a commit marker instead), so a crash mid-save leaves a temporary folder that is never listed as a
step. Opening a run reports such leftovers, deletes them, and resumes from the newest complete
step.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from dspark_jax.errors import UserError
from dspark_jax.training.step import TrainState

logger = logging.getLogger(__name__)

STATE, DATA, META = "state", "data", "meta"


class TrainCheckpointError(UserError):
    """A checkpoint that cannot be restored into this run."""


class TrainCheckpointer:
    """Keeps the newest `max_to_keep` steps of a run under `directory` (saves run in background)."""

    def __init__(self, directory: str | os.PathLike, max_to_keep: int, *, async_save: bool = True):
        if max_to_keep < 1:
            raise TrainCheckpointError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = Path(directory).absolute()
        self.incomplete = self._incomplete_saves()
        for name in self.incomplete:
            logger.warning("ignoring incomplete checkpoint %s (a save was interrupted)", name)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                cleanup_tmp_directories=True,
                enable_async_checkpointing=async_save,
                create=True,
            ),
            item_names=(STATE, DATA, META),
        )

    def _incomplete_saves(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        return sorted(Path(p).name for p in ocp.path.step.tmp_checkpoints(self.directory))

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(
        self,
        state: TrainState,
        data_iterator: grain.DatasetIterator,
        meta: dict[str, Any],
    ) -> None:
        """Starts saving `state` at its step (the iterator position is captured now)."""
        step = int(jax.device_get(state.step))
        self._manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    STATE: ocp.args.StandardSave(state),
                    DATA: grain.checkpoint.CheckpointSave(data_iterator),
                    META: ocp.args.JsonSave(meta),
                }
            ),
            force=True,
        )

    def restore(
        self,
        abstract_state: TrainState,
        data_iterator: grain.DatasetIterator,
        meta: dict[str, Any],
        step: int | None = None,
    ) -> TrainState:
        """The state saved at `step` (default: newest), placed with `abstract_state`'s shardings.

        `data_iterator` is moved to the saved position. `meta` must equal the saved record (the
        same drafter, target and recipe), else TrainCheckpointError.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise TrainCheckpointError(f"{self.directory}: no complete checkpoint to restore")
        saved_meta = self._manager.restore(
            step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()})
        )[META]
        if saved_meta != meta:
            diffs = sorted(
                k for k in set(saved_meta) | set(meta) if saved_meta.get(k) != meta.get(k)
            )
            raise TrainCheckpointError(
                f"{self.directory}/{step} belongs to a different run (differs in: "
                f"{', '.join(diffs)}); use a new output folder or the original settings"
            )
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    STATE: ocp.args.StandardRestore(abstract_state),
                    DATA: grain.checkpoint.CheckpointRestore(data_iterator),
                }
            ),
        )
        return restored[STATE]

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> TrainCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
