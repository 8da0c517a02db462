"""Orbax checkpoints of a training run: trainable drafter params, optimizer state, step, PRNG key,
the grain iterator position of every process, and a small JSON record of the run's settings.

Frozen weights (the target and the drafter's embed_tokens / lm_head) are not saved: they are
rebuilt from the target exactly as at the start of the run.

Crash safety is Orbax's: a step is written into `<step>.orbax-checkpoint-tmp-<time>` and renamed
to `<step>` only after every item is complete (on file systems without atomic rename Orbax writes
a commit marker instead), so a crash mid-save leaves a temporary folder that is never listed as a
step. Opening a run reports such leftovers, deletes them, and resumes from the newest complete
step.

A step folder `<run>/checkpoints/<step>` (or the run folder, or its `checkpoints/`, for the newest
step) is also what `--init-from` and `dspark-jax export` take: `find_checkpoint` locates it,
`read_meta` returns the run record saved with it (drafter config, recipe, target) and
`restore_state` the train state without the data-iterator position.

Damage from outside (a copy or rsync cut short, a disk filling up, a hand edit) is reported as
TrainCheckpointError naming the step folder. A step folder that visibly lacks one of its items
(`meta`, `state`, `data`; an empty folder included) is passed over, with a warning, for the newest
complete step before it; nothing is deleted. A step whose items are there but cannot be read is
refused, with what to do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from dspark_jax.checkpoints.orbax_reads import finished_reads
from dspark_jax.errors import UserError
from dspark_jax.training.step import TrainState

logger = logging.getLogger(__name__)

STATE, DATA, META = "state", "data", "meta"


class TrainCheckpointError(UserError):
    """A checkpoint that cannot be restored into this run."""


# Run-record fields that `check_record` leaves to the caller: the total step count may change
# when a run is resumed (extending or shortening it; the learning-rate schedule follows the new
# total), and the trainer compares the data itself (its refusal says how the data differ, and
# records of earlier versions hold none).
# Compared by the trainer itself (with messages naming the setting), or not at all:
# num_microbatches splits a step's batch without changing its loss, gradient or data.
NOT_COMPARED = (
    "total_steps", "data", "num_microbatches", "seq_lens", "target_dtype", "processes"
)


class _ReadOnlyNotice(logging.Filter):
    """Orbax's warning that a manager opens its folder read-only: said on every read here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


ITEMS = (META, STATE, DATA)
_warned_incomplete: set[Path] = set()


def missing_items(step_dir: Path) -> list[str]:
    """The items a step folder lacks (all of them for an empty folder)."""
    return [name for name in ITEMS if not (step_dir / name).is_dir()]


def _newest_complete(directory: Path, steps) -> int | None:
    """The newest of `steps` (folders of `directory`) that holds every item; says which newer
    ones it passes over, once each."""
    for step in sorted(steps, reverse=True):
        step_dir = directory / str(step)
        missing = missing_items(step_dir)
        if not missing:
            return step
        if step_dir not in _warned_incomplete:
            _warned_incomplete.add(step_dir)
            logger.warning(
                "ignoring checkpoint %s: incomplete (no %s; a save, copy or sync cut short), "
                "using the newest complete step before it; delete the folder once you no "
                "longer need it",
                step_dir,
                ", ".join(missing),
            )
    return None


def _damaged(directory: Path, step: int, what: str, error: Exception) -> TrainCheckpointError:
    """The refusal of a step whose `what` cannot be read (`error`: why), saying what to do."""
    # Orbax wraps a failed array read in an Exception whose text ends in the repr of a bound
    # pybind11 method ("See full TensorStore details: <bound method ...>"); TensorStore's own
    # error, its cause, says what is wrong. The file it names lies in the step folder named below.
    while "TensorStore details" in str(error) and isinstance(error.__cause__, Exception):
        error = error.__cause__
    lines = re.sub(r' in OCDBT database at local file "[^"]*"', "", str(error)).strip().splitlines()
    lines = lines or [type(error).__name__]
    cause = lines[0] if len(lines[0]) <= 200 else lines[0][:200] + "..."
    earlier = [
        p.name
        for p in directory.iterdir()
        if p.name.isdigit() and int(p.name) < step and not missing_items(p)
    ] if directory.is_dir() else []
    instead = (
        f"delete it to use the previous step ({max(map(int, earlier))})"
        if earlier
        else "delete it"
    )
    return TrainCheckpointError(
        f"{directory / str(step)}: its {what} cannot be read ({type(error).__name__}: {cause}); "
        f"if the folder is damaged (a copy cut short, a full disk), {instead} or restore it "
        "from a copy"
    )


class _IncompleteStepNotice(logging.Filter):
    """Orbax's warning about a step folder of `directory` without its metadata file: an
    incomplete step, which `_newest_complete` reports in words of its own."""

    def __init__(self, directory: Path):
        super().__init__()
        self.prefix = f"{directory}{os.sep}"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Metadata file does not exist") and self.prefix in message)


@contextlib.contextmanager
def _absl_filtered(*filters: logging.Filter) -> Iterator[None]:
    absl_logger = logging.getLogger("absl")
    for f in filters:
        absl_logger.addFilter(f)
    try:
        yield
    finally:
        for f in filters:
            absl_logger.removeFilter(f)


def _reader(directory: Path) -> ocp.CheckpointManager:
    """A manager that only reads `directory`. Its options are the ones Orbax would otherwise set
    itself for read-only use (and warn about); its remaining warning is filtered while it opens."""
    options = ocp.CheckpointManagerOptions(
        read_only=True,
        create=False,
        save_interval_steps=0,
        cleanup_tmp_directories=False,
        enable_async_checkpointing=False,
    )
    with _absl_filtered(_ReadOnlyNotice(), _IncompleteStepNotice(directory)):
        return ocp.CheckpointManager(directory, options=options, item_names=(STATE, DATA, META))


def find_checkpoint(path: str | os.PathLike) -> tuple[Path, int] | None:
    """(checkpoints folder, step) that `path` names, or None when it is no training checkpoint.

    `path` is a step folder (`<run>/checkpoints/<step>`), a run's `checkpoints/` folder or a run
    folder; the last two mean their newest complete step (incomplete newer ones are passed over
    with a warning). A step folder named itself must be complete, else TrainCheckpointError.
    """
    path = Path(path).absolute()
    if path.name.isdigit() and path.is_dir() and not (path / "checkpoints").is_dir():
        missing = missing_items(path)
        if not missing:
            return path.parent, int(path.name)
        if len(missing) < len(ITEMS) or path.parent.name == "checkpoints":
            raise TrainCheckpointError(
                f"{path}: an incomplete checkpoint (no {', '.join(missing)}; a save, copy or "
                "sync cut short); name another step, or the run folder for its newest complete "
                "one"
            )

    def is_step(p: Path) -> bool:
        return p.name.isdigit() and p.is_dir() and len(missing_items(p)) < len(ITEMS)

    for directory in (path, path / "checkpoints"):
        if not directory.is_dir() or not any(is_step(p) for p in directory.iterdir()):
            continue
        with _reader(directory) as manager, _absl_filtered(_IncompleteStepNotice(directory)):
            step = _newest_complete(directory, manager.all_steps())
        if step is None:
            raise TrainCheckpointError(f"{directory}: holds no complete checkpoint")
        return directory, step
    return None


def read_meta(directory: Path, step: int) -> dict[str, Any]:
    """The run record saved with checkpoint `step` of `directory`."""
    try:
        with finished_reads(), _reader(directory) as manager:
            restored = manager.restore(
                step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()})
            )
    except Exception as e:
        raise _damaged(directory, step, "run record (meta)", e) from e
    return restored[META]


def restore_state(directory: Path, step: int, abstract_state: TrainState) -> TrainState:
    """The train state of checkpoint `step` of `directory`, placed as `abstract_state` says."""
    try:
        with finished_reads(), _reader(directory) as manager:
            restored = manager.restore(
                step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(abstract_state)})
            )
    except Exception as e:
        raise _damaged(directory, step, "train state", e) from e
    return restored[STATE]


# At most this many differing fields are listed when a checkpoint of another run is refused.
MAX_LISTED_DIFFERENCES = 6
_ABSENT = object()


def record_differences(saved: Any, now: Any, prefix: str = "") -> list[str]:
    """The fields in which run records differ, nested ones by their dotted path, each with the
    checkpoint's value and this run's: ["recipe.learning_rate: 0.0006 then, 0.01 now"]."""
    if isinstance(saved, dict) and isinstance(now, dict):
        diffs = []
        for key in sorted(set(saved) | set(now)):
            path = f"{prefix}.{key}" if prefix else str(key)
            diffs += record_differences(saved.get(key, _ABSENT), now.get(key, _ABSENT), path)
        return diffs
    if saved == now:
        return []
    then, now_ = ("absent" if v is _ABSENT else repr(v) for v in (saved, now))
    if max(len(then), len(now_)) > _SHOWN_CHARS:
        # Long values (absolute paths) often differ only near their ends: drop what they share
        # at the start, then cut the rest, so that the difference shows.
        shared = len(os.path.commonprefix([then, now_]))
        skip = max(shared - 12, 0)
        then, now_ = (
            ("..." if skip else "") + text[skip : skip + _SHOWN_CHARS]
            + ("..." if len(text) > skip + _SHOWN_CHARS else "")
            for text in (then, now_)
        )
    return [f"{prefix or 'the record'}: {then} then, {now_} now"]


_SHOWN_CHARS = 60  # of each value in a difference


class TrainCheckpointer:
    """Keeps the newest `max_to_keep` steps of a run under `directory` (saves run in background)."""

    def __init__(self, directory: str | os.PathLike, max_to_keep: int, *, async_save: bool = True):
        if max_to_keep < 1:
            raise TrainCheckpointError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = Path(directory).absolute()
        self.incomplete = self._incomplete_saves()
        for name in self.incomplete:
            logger.warning("ignoring incomplete checkpoint %s (a save was interrupted)", name)
        # For as long as the checkpointer is open: Orbax warns whenever it lists the steps.
        self._notice = _IncompleteStepNotice(self.directory)
        logging.getLogger("absl").addFilter(self._notice)
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
        """The newest complete step, or None; newer step folders that lack an item are passed
        over with a warning (and left as they are)."""
        return _newest_complete(self.directory, self._manager.all_steps())

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
        if step in self._manager.all_steps():
            self._set_aside(step)
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

    def _set_aside(self, step: int) -> None:
        """Renames the incomplete folder of `step`, passed over when the run resumed from an
        earlier step, to `<step>.incomplete` so the run can save that step again; nothing is
        deleted. Every process decides from the steps its manager listed at start (the same
        list on each), process 0 renames, and all list the steps again after a barrier."""
        step_dir = self.directory / str(step)
        missing = missing_items(step_dir)  # all of them once process 0 has renamed it
        if not missing:  # a complete step is never overwritten (every process sees it so)
            raise TrainCheckpointError(f"{step_dir} exists already; it cannot be saved again")
        if jax.process_index() == 0:
            aside = step_dir.with_name(f"{step}.incomplete")
            n = 1
            while aside.exists():
                n += 1
                aside = step_dir.with_name(f"{step}.incomplete-{n}")
            step_dir.rename(aside)
            logger.warning(
                "saving step %d: moved the incomplete folder passed over at the start (no %s) "
                "aside to %s",
                step,
                ", ".join(missing),
                aside,
            )
        multihost_utils.sync_global_devices(f"dspark-jax: step {step} set aside")
        self._manager.reload()

    def restore(
        self,
        abstract_state: TrainState,
        data_iterator: grain.DatasetIterator,
        meta: dict[str, Any],
        step: int | None = None,
    ) -> tuple[TrainState, dict[str, Any]]:
        """(state saved at `step` (default: newest), its run record), the state placed with
        `abstract_state`'s shardings.

        `data_iterator` is moved to the saved position. `meta` must agree with the saved record
        (`check_record`), else TrainCheckpointError.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise TrainCheckpointError(f"{self.directory}: no complete checkpoint to restore")
        saved_meta = self.check_record(meta, step)
        try:
            with finished_reads():
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        **{
                            STATE: ocp.args.StandardRestore(abstract_state),
                            DATA: grain.checkpoint.CheckpointRestore(data_iterator),
                        }
                    ),
                )
        except Exception as e:
            raise _damaged(self.directory, step, "train state or data position", e) from e
        return restored[STATE], saved_meta

    def check_record(self, meta: dict[str, Any], step: int) -> dict[str, Any]:
        """The run record saved with `step`, once it equals `meta` (the same drafter, target and
        recipe) but for `NOT_COMPARED`; else TrainCheckpointError."""
        try:
            with finished_reads():
                saved_meta = self._manager.restore(
                    step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()})
                )[META]
        except Exception as e:
            raise _damaged(self.directory, step, "run record (meta)", e) from e
        if not isinstance(saved_meta, dict):
            raise _damaged(self.directory, step, "run record (meta)", TypeError("not an object"))
        diffs = record_differences(
            {k: v for k, v in saved_meta.items() if k not in NOT_COMPARED},
            {k: v for k, v in meta.items() if k not in NOT_COMPARED},
        )
        if diffs:
            shown = diffs[:MAX_LISTED_DIFFERENCES]
            more = len(diffs) - len(shown)
            listed = "; ".join(shown) + (f"; and {more} more" if more else "")
            raise TrainCheckpointError(
                f"{self.directory}/{step} belongs to a different run (differs in: {listed}); "
                "use a new output folder or the original settings"
            )
        return saved_meta

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
        logging.getLogger("absl").removeFilter(self._notice)

    def __enter__(self) -> TrainCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
