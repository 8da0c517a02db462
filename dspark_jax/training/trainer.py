"""The training loop: a frozen target run online, a drafter trained on its features.

`train(config, output_dir)` builds the mesh, loads the target (sharded by the rules table),
creates the drafter (embed_tokens and lm_head are the target's arrays, frozen; the rest random,
or the parameters of `init_drafter`), reads batches from the grain pipeline, runs the jitted
step, logs metrics, evaluates on held-out batches (at the start, every `eval_every` steps and at
the end), checkpoints with Orbax every `save_every` steps (resuming from the newest complete
checkpoint in `output_dir`), and finally exports the drafter in the PyTorch (DeepSpec) layout.

Held-out data: `eval_data` files, or with `holdout` a deterministic share of `data` itself
(`DataConfig.heldout`), so evaluation measures the domain the drafter is trained on.

Resuming with a different `num_steps` extends (or shortens) the run: the learning-rate schedule
is recomputed over the new total from the restored step on, and the change is logged.

The progress bar advances when a step has finished on the device, not when it is dispatched, so
its rate and ETA are those of training; the first step (compilation) runs before the bar starts.
Ctrl-C (SIGINT) or SIGTERM (single-process runs) while training stops after the step in flight,
saves a checkpoint and raises `TrainingInterrupted`; a second signal interrupts at once. Before
training starts (the first step, compilation included, counts as before) and after it ends, either
signal interrupts at once (and reliably: see `_Interrupts`); SIGTERM as `errors.Terminated`.

Output folder:
    metrics.jsonl     one JSON object per logged train interval or evaluation
    events.out.tfevents.*   the same scalars for TensorBoard (`tensorboard --logdir <output>`)
    checkpoints/      Orbax steps (see checkpointing.py)
    drafter/          the exported drafter (config.json + model.safetensors)
    data/             built-in corpora, when the config names one (see corpus.py)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.multihost_utils import process_allgather
from tqdm.auto import tqdm

from dspark_jax.checkpoints.converted import load_drafter, load_target, write_drafter_torch
from dspark_jax.checkpoints.integrity import check_parameters, check_tree
from dspark_jax.checkpoints.interrupts import SIGNALS as STOP_SIGNALS
from dspark_jax.checkpoints.interrupts import raise_for
from dspark_jax.checkpoints.safetensors_io import CheckpointError
from dspark_jax.config import DTYPES, ConfigError, DrafterConfig
from dspark_jax.conversations import TURNS_AS
from dspark_jax.errors import as_integer
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.sharding import (
    MeshConfig,
    addressable_rows,
    make_mesh,
    shard_state,
    state_shardings,
)
from dspark_jax.tokenizer import load_tokenizer
from dspark_jax.training.checkpointing import (
    TrainCheckpointer,
    TrainCheckpointError,
    find_checkpoint,
    read_meta,
    restore_state,
)
from dspark_jax.training.corpus import resolve_data_paths
from dspark_jax.training.data import (
    BatchRows,
    DataConfig,
    DataError,
    JsonlConversationSource,
    check_seq_lens,
    global_batch,
    make_iterator,
    open_source,
    resolve_pad_id,
)
from dspark_jax.training.loss import LossWeights
from dspark_jax.training.recipe import TrainRecipe
from dspark_jax.training.step import (
    FrozenParams,
    Models,
    StepConfig,
    TrainState,
    batch_shardings,
    init_train_state,
    make_eval_step,
    make_optimizer,
    make_train_step,
    new_drafter,
    split_drafter,
)

logger = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003
# Steps dispatched ahead of the newest finished one: enough to keep the device busy while the
# host prepares the next batch, few enough that the progress bar tracks finished steps.
MAX_STEPS_AHEAD = 2
# With `holdout`, at most this share of the conversations of `data` is held out.
MAX_HOLDOUT_SHARE = 10


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run: what to train, on what, and how the program runs it.

    `target`: a Hugging Face / converted target folder (or hub id). `drafter`: the drafter's shape,
    its block size, depth and anchors per sequence included. `data` / `eval_data`: JSONL paths or
    `builtin:python-stdlib` (the local Python standard library's source as conversations).
    `num_steps` None trains `recipe.num_epochs` over the data. `per_device_batch_size` sets the
    micro-batch (gradient accumulation runs global / (per-device x batch-parallel devices) micro
    steps); None processes the whole global batch at once. `target_dtype` None uses the recipe's
    dtype. `init_drafter` starts from an existing drafter's parameters instead of random ones:
    an exported / converted drafter folder, or a training checkpoint (a step folder, a run's
    `checkpoints/` or a run folder: its newest step); the optimizer starts afresh. `seq_lens` are
    the length buckets of the training batches (strictly ascending, ending at
    `recipe.max_length`; one compiled step each); None pads everything to `recipe.max_length`.
    Evaluation always uses `recipe.max_length`. `turns` says how `{"turns": [...]}` records of
    the data are read ("prompts": refused, "dialogue": alternating user / assistant; see
    `DataConfig`). `holdout` (with no `eval_data`) holds out eval_batches x global_batch_size
    conversations of `data` (at most a tenth) as the evaluation set. `eval_every` evaluates every
    that many steps (besides the start and the end); `save_every` checkpoints every that many.
    `skip_bad_records` skips the lines of `data` / `eval_data` that hold no trainable
    conversation (saying how many) and trains on conversations the chat template refuses as
    padding with no loss (see `DataConfig`), instead of refusing the run. `enable_thinking`
    renders the conversations through the chat template with thinking on (Qwen3's
    `enable_thinking`), so that answers holding reasoning traces (`<think>...</think>`) train
    as the target writes them; off, the template's generation prompt holds an empty think
    block, and a template that renders such answers differently refuses them.
    """

    name: str
    target: str
    drafter: DrafterConfig
    recipe: TrainRecipe
    data: tuple[str, ...]
    eval_data: tuple[str, ...] = ()
    num_steps: int | None = None
    mesh: MeshConfig = MeshConfig()
    per_device_batch_size: int | None = None
    anchors_per_chunk: int = 64
    target_dtype: str | None = None
    init_drafter: str | None = None
    seq_lens: tuple[int, ...] | None = None
    log_every: int = 10
    eval_batches: int = 1
    save_every: int = 1000
    keep_checkpoints: int = 3
    turns: str = "prompts"
    holdout: bool = False
    eval_every: int | None = None
    skip_bad_records: bool = False
    enable_thinking: bool = False

    def __post_init__(self):
        # The objects first: every later check reads them, and a None or a dict would fail with
        # a bare AttributeError.
        for field, cls in (
            ("drafter", DrafterConfig),
            ("recipe", TrainRecipe),
            ("mesh", MeshConfig),
        ):
            value = getattr(self, field)
            if not isinstance(value, cls):
                raise ConfigError(
                    f"train config {self.name!r}: {field} must be a {cls.__name__}, got {value!r}"
                )
        # Counts: a float (2.5, or 2.0 from a division) would be rounded by the loop's step
        # comparisons or fail deep inside it, a string with a bare TypeError.
        optional = ("num_steps", "per_device_batch_size", "eval_every")
        for field in (
            *optional,
            "anchors_per_chunk",
            "log_every",
            "eval_batches",
            "save_every",
            "keep_checkpoints",
        ):
            value = getattr(self, field)
            if value is None and field in optional:
                continue
            number = as_integer(value)
            or_none = " or None" if field in optional else ""
            if number is None:
                raise ConfigError(f"{field} must be an integer >= 1{or_none}, got {value!r}")
            if number < 1:
                raise ConfigError(f"{field} must be >= 1{or_none}, got {value}")
            object.__setattr__(self, field, number)  # a numpy integer becomes a plain int
        for field in ("holdout", "skip_bad_records", "enable_thinking"):
            # "no" or 0.5 would count as true.
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"{field} must be True or False, got {getattr(self, field)!r}")
        if self.target_dtype is not None and self.target_dtype not in DTYPES:
            # Refused here rather than when train loads the target, minutes later.
            raise ConfigError(
                f"target_dtype must be one of {DTYPES} or None (the recipe's dtype), got "
                f"{self.target_dtype!r}"
            )
        r, d = self.recipe, self.drafter
        if r.confidence_weight > 0 and not d.enable_confidence_head:
            raise ConfigError(
                f"train config {self.name!r}: confidence_weight {r.confidence_weight} but the "
                "drafter has no confidence head"
            )
        for field in ("data", "eval_data"):
            object.__setattr__(self, field, _paths(field, getattr(self, field)))
        for field in ("target", "init_drafter"):
            if isinstance(getattr(self, field), os.PathLike):
                object.__setattr__(self, field, os.fspath(getattr(self, field)))
        if self.turns not in TURNS_AS:
            raise ConfigError(f"turns must be one of {TURNS_AS}, got {self.turns!r}")
        if self.holdout and self.eval_data:
            raise ConfigError("holdout splits the training data; it excludes eval_data")
        StepConfig(d.num_anchors, self.anchors_per_chunk)
        if self.seq_lens is not None:
            # check_seq_lens would truncate 2.5 to 2 (int()): only integers get that far.
            lens = self.seq_lens
            if isinstance(lens, str | bytes) or not hasattr(lens, "__iter__"):
                lens = None
            else:
                lens = [as_integer(n) for n in lens]
            if lens is None or any(n is None for n in lens):
                raise ConfigError(
                    f"seq_lens must be a tuple of integers or None, got {self.seq_lens!r}"
                )
            object.__setattr__(self, "seq_lens", check_seq_lens(lens, r.max_length))

    @property
    def loss_weights(self) -> LossWeights:
        r = self.recipe
        return LossWeights(r.ce_weight, r.l1_weight, r.confidence_weight, r.loss_decay_gamma)

    def num_microbatches(self, batch_parallel_devices: int) -> int:
        """Gradient-accumulation steps when the batch is split over that many devices."""
        global_batch = self.recipe.global_batch_size
        if global_batch % batch_parallel_devices:
            raise ConfigError(
                f"global_batch_size {global_batch} cannot be split over data x fsdp = "
                f"{batch_parallel_devices} devices: give a --mesh whose data x fsdp divides "
                f"it, or a config whose recipe.global_batch_size is a multiple of "
                f"{batch_parallel_devices}"
            )
        if self.per_device_batch_size is None:
            return 1
        micro = self.per_device_batch_size * batch_parallel_devices
        if global_batch % micro:
            raise ConfigError(
                f"per_device_batch_size {self.per_device_batch_size} x {batch_parallel_devices} "
                f"batch-parallel devices = {micro} does not divide global_batch_size {global_batch}"
            )
        return global_batch // micro

    def run_record(
        self, total_steps: int, num_microbatches: int, data: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """What a checkpoint must agree with to be resumed by this run (JSON-normalised); `data`
        identifies the data it reads."""
        record = {
            "drafter": self.drafter.to_hf(),
            "recipe": dataclasses.asdict(self.recipe),
            "target": _model_reference(self.target),
            "total_steps": total_steps,
            "num_microbatches": num_microbatches,
            "anchors_per_chunk": self.anchors_per_chunk,
            "seq_lens": list(self.seq_lens or (self.recipe.max_length,)),
            "target_dtype": self.target_dtype or self.recipe.dtype,
            "init_drafter": _model_reference(self.init_drafter),
            "data": data,
        }
        if self.enable_thinking:
            # It changes the tokens of every conversation; recorded only when on, so that the
            # checkpoints of earlier versions (which rendered with thinking off) still resume.
            record["enable_thinking"] = True
        return json.loads(json.dumps(record))


def _paths(field: str, value) -> tuple[str, ...]:
    """`data` / `eval_data` as a tuple of strings: one path (str or PathLike) or several."""
    if isinstance(value, str | os.PathLike):
        value = (value,)
    try:
        paths = tuple(os.fspath(p) for p in value)
    except TypeError:
        raise ConfigError(
            f"{field} must be a path or a sequence of paths (str or pathlib.Path), got {value!r}"
        ) from None
    return paths


def _model_reference(path: str | None) -> str | None:
    """A model path as recorded in checkpoints: absolute when it is a local folder, so the record
    still names it when read from elsewhere (hub ids stay as they are)."""
    if path is None or not Path(path).exists():
        return path
    return str(Path(path).resolve())


class TrainingInterrupted(Exception):
    """The run was stopped by Ctrl-C (`signum` SIGINT) or SIGTERM after a checkpoint of `step`
    was saved in `checkpoint`."""

    def __init__(self, step: int, checkpoint: Path, signum: int = signal.SIGINT):
        how = "terminated" if signum == signal.SIGTERM else "interrupted"
        super().__init__(f"{how}: saved step {step} in {checkpoint}; run again to resume")
        self.step, self.checkpoint, self.signum = step, checkpoint, int(signum)


@dataclasses.dataclass
class TrainResult:
    output_dir: Path
    final_step: int
    history: list[dict[str, Any]]  # the records written to metrics.jsonl by this call
    eval_start: dict[str, Any] | None  # held-out metrics of the untrained drafter (fresh runs)
    eval_end: dict[str, Any] | None
    export_dir: Path | None
    resumed_from: int | None


# -- helpers -----------------------------------------------------------------------------------
def _python(x) -> float | list:
    a = np.asarray(x)
    return a.tolist() if a.ndim else float(a)


def _mean_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-metric means over steps (or eval batches), as JSON-ready Python values."""
    return {k: _python(np.mean([np.asarray(r[k]) for r in records], axis=0)) for k in records[0]}


class _MetricsLog:
    """metrics.jsonl and TensorBoard event files (tensorboardX) in the run folder.

    Each record becomes scalars `<split>/<metric>` at its step; a per-position list becomes
    `<split>/<metric>/<k>` with k counted from 1.

    A run continues the log of the checkpoint it resumes from (`resumed_from`; None for a fresh
    run): records of later steps, written by a run that stopped before its next checkpoint, are
    dropped from metrics.jsonl (rewritten whole, then renamed over it), and the event file opens
    with a session start at the next step, which tells TensorBoard to drop the old scalars from
    there on. An evaluation already logged for a step is not logged again.
    """

    def __init__(self, output_dir: Path, enabled: bool, resumed_from: int | None):
        self.path, self.enabled = output_dir / "metrics.jsonl", enabled
        self._writer = None
        self._evaluated: set[int] = set()
        if enabled:
            from tensorboardX import SummaryWriter

            kept = self._cut_back(-1 if resumed_from is None else resumed_from)
            self._evaluated = {r["step"] for r in kept if r["split"] == "eval"}
            purge_step = 0 if resumed_from is None else resumed_from + 1
            self._writer = SummaryWriter(logdir=str(output_dir), purge_step=purge_step)

    def _cut_back(self, last_step: int) -> list[dict[str, Any]]:
        """The records of metrics.jsonl up to `last_step`, now all the file holds."""
        if not self.path.exists():
            return []
        lines = self.path.read_text().splitlines()
        kept = []
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the last line of a run killed while writing it
                continue
            if record["step"] <= last_step:
                kept.append(record)
        if len(kept) != len(lines):
            tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        return kept

    def write(self, record: dict[str, Any]) -> bool:
        """Logs `record`; False (nothing written) for an evaluation already logged."""
        if not self.enabled:
            return False
        split, step = record["split"], record["step"]
        if split == "eval":
            if step in self._evaluated:
                return False
            self._evaluated.add(step)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for name, value in record.items():
            if name in ("split", "step"):
                continue
            if isinstance(value, list):
                for k, v in enumerate(value, 1):
                    self._writer.add_scalar(f"{split}/{name}/{k}", v, step)
            else:
                self._writer.add_scalar(f"{split}/{name}", value, step)
        self._writer.flush()
        return True

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class _Interrupts:
    """SIGINT (Ctrl-C) and SIGTERM (a scheduler, `timeout`, a preempted VM) over a whole `train`
    call, in the main thread of a single-process run; the previous handlers come back after.

    While the run sets up or finishes, either aborts as usual (KeyboardInterrupt; for SIGTERM
    its subclass `Terminated`) and is also remembered, because Python prints and swallows a
    KeyboardInterrupt raised inside a garbage-collection callback or a `__del__`: `check`,
    called between the phases, raises it again. While training, the first signal asks the loop
    to stop at the next step boundary (where a checkpoint can be saved; `signum` says which
    signal); a second aborts at once, abandoning any save in flight, whose failure reports from
    Orbax are then silenced (the next run removes the partial save).
    """

    SIGNALS = STOP_SIGNALS

    def __init__(self, enabled: bool):
        self._enabled = enabled and threading.current_thread() is threading.main_thread()
        self._previous: dict[int, Any] = {}
        self.training = False
        self.stop_requested = False
        self.signum = signal.SIGINT  # the signal that asked to stop, or aborted
        self.aborted = False
        self.on_stop_request = None
        self.checkpoints: Path | None = None  # the folder of the saves an abort abandons

    def _handle(self, signum, frame) -> None:
        if self.training and not self.stop_requested:
            self.stop_requested = True
            self.signum = signum
            if self.on_stop_request is not None:
                self.on_stop_request(signum)
            return
        if not self.aborted:
            self.aborted, self.signum = True, signum
        if self.checkpoints is not None:
            _AbandonedSaves.silence(self.checkpoints)
        self._raise()

    def _raise(self) -> None:
        raise_for(self.signum)

    def check(self) -> None:
        """Raises the signal that aborted the run, in case it was swallowed where it landed."""
        if self.aborted:
            self._raise()

    def __enter__(self) -> _Interrupts:
        if self._enabled:
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous)
        self._previous = {}


class _AbandonedSaves(logging.Filter):
    """Orbax's reports (through absl's logger) on saves into `directory` that an abort left
    unfinished: the wait it interrupted, the background commit that fails once the interpreter
    shuts down, and the background threads that find the interpreter's thread pools shut down
    (their reports name no folder). An abort already says that nothing was saved. Installed
    only once a run aborts, so other errors go on being reported until then, and after it
    anything not of these kinds."""

    # What a background thread meets once the pools and loops it needs are shut down: "cannot
    # schedule new futures after shutdown" (its pool) or "after interpreter shutdown" (every
    # pool), or the event loop it reports to closed.
    SHUT_DOWN = ("cannot schedule new futures after", "Event loop is closed")

    def __init__(self, directory: Path):
        super().__init__()
        self.directory = str(directory)

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, KeyboardInterrupt):
            return False
        if isinstance(error, RuntimeError) and any(m in str(error) for m in self.SHUT_DOWN):
            return False
        message = record.getMessage()
        return self.directory not in message and not any(m in message for m in self.SHUT_DOWN)

    @classmethod
    def silence(cls, directory: Path) -> None:
        absl_logger = logging.getLogger("absl")
        if not any(
            isinstance(f, cls) and f.directory == str(directory) for f in absl_logger.filters
        ):
            absl_logger.addFilter(cls(directory))


# Steps of a call that must all carry no loss token before the run is stopped for it.
NO_LOSS_STEPS = 10

class _Truncations:
    """Counts sequences cut to the largest length bucket and says so on the console: once when it
    first happens, and in a total at the end of the call."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.interval = self.total = self.seen = 0
        # Truncated sequences left without a single loss token: their answers all cut off.
        self.emptied = 0
        self.warned = False

    def add(self, local: dict[str, np.ndarray], step: int) -> None:
        cut = local["num_tokens"] > local["length"]
        n = int(np.sum(cut))
        emptied = int(np.sum(cut & ~np.any(local["loss_mask"], axis=1)))
        self.interval += n
        self.total += n
        self.emptied += emptied
        self.seen += len(local["length"])
        if n and not self.warned:
            self.warned = True
            longest = int(np.max(local["num_tokens"]))
            logger.warning(
                "step %d: %d of %d sequences are longer than max_length %d (up to %d tokens) and "
                "are truncated; the loss never sees their ends%s (raise recipe.max_length / "
                "--seq-lens, or shorten the data). The count per interval is 'truncated' in "
                "metrics.jsonl.",
                step,
                n,
                len(local["length"]),
                self.max_length,
                longest,
                f", and {emptied} of them keep no answer token at all (their prompts fill "
                "max_length): they train nothing"
                if emptied
                else "",
            )

    def take_interval(self) -> int:
        n, self.interval = self.interval, 0
        return n

    def report(self) -> None:
        if self.total:
            every = " (every one of them)" if self.total == self.seen else ""
            emptied = ""
            if self.emptied:
                emptied = f", {self.emptied} of them to no answer token at all"
            logger.warning(
                "%d of %d sequences read by this call were truncated to max_length %d%s%s",
                self.total,
                self.seen,
                self.max_length,
                every,
                emptied,
            )

    def no_loss_error(self, first: int, last: int) -> DataError:
        """The error of a call whose steps `first`..`last` all carried no loss token."""
        if self.emptied:
            why = (
                f"{self.emptied} of the {self.seen} sequences this process read are longer than "
                f"max_length {self.max_length} with prompts that fill it, so truncation cut "
                "their answers off entirely; raise recipe.max_length / --seq-lens, or shorten "
                "the prompts"
            )
        else:
            why = "the sequences read hold no assistant tokens to learn"
        steps = f"step {first}" if first == last else f"steps {first}..{last}"
        return DataError(
            f"{steps} carried no loss token (num_tokens 0 in every one): {why}. "
            "Stopped rather than train a drafter on nothing."
        )


def epoch_steps(conversations: int, recipe: TrainRecipe) -> int:
    """Steps of `recipe.num_epochs` passes over `conversations` (the stream repeats, so an epoch
    need not fill whole batches), at least 1; says so when the data do not fill one batch."""
    batch = recipe.global_batch_size
    steps = max(1, recipe.num_epochs * conversations // batch)
    if conversations < batch:
        logger.warning(
            "%d training conversations are fewer than one global batch (%d): %d epochs make %d "
            "step%s of %d sequences, each conversation repeating within a batch; set num_steps "
            "(--steps) or a smaller global_batch_size for more",
            conversations,
            batch,
            recipe.num_epochs,
            steps,
            "" if steps == 1 else "s",
            batch,
        )
    return steps


def count_conversations(
    paths: tuple[str, ...], turns: str = "prompts", skip_bad_records: bool = False
) -> int:
    """Number of usable conversations in the JSONL files (one pass over them)."""
    return len(JsonlConversationSource(paths, skip_bad_records, turns=turns))


def heldout_count(config: TrainConfig, data_paths: tuple[str, ...]) -> tuple[int, int]:
    """(conversations of `data_paths` that `config.holdout` sets aside, conversations in all);
    says what it sets aside."""
    total = count_conversations(data_paths, config.turns, config.skip_bad_records)
    wanted = config.eval_batches * config.recipe.global_batch_size
    count = min(wanted, total // MAX_HOLDOUT_SHARE)
    if count < 1:
        raise DataError(
            f"{', '.join(data_paths)}: {total} conversations, too few to hold out an evaluation "
            f"set (at most 1 in {MAX_HOLDOUT_SHARE}); pass --eval-data FILE, or --eval-data with "
            "no file to train without evaluation"
        )
    repeats = (
        f"; each evaluation reads {wanted} sequences, so they repeat" if count < wanted else ""
    )
    logger.warning(
        "no --eval-data: holding out %d of the %d conversations of the training data for "
        "evaluation (those with the smallest hash of their text: the same split on every run "
        "and resume); training uses the other %d%s. Pass --eval-data to evaluate on files of "
        "your own.",
        count,
        total,
        total - count,
        repeats,
    )
    return count, total


@dataclasses.dataclass(frozen=True)
class _RunData:
    """The pipelines of the training data and the held-out data (None: no evaluation), with
    their sources indexed and checked."""

    train: DataConfig
    train_source: JsonlConversationSource
    eval: DataConfig | None
    eval_source: JsonlConversationSource | None

    def identity(self) -> dict[str, Any]:
        """What a resumed run must read again, for its run record: the text of the training and
        evaluation files (with their names, which are not compared) and the held-out count."""

        def of(source: JsonlConversationSource | None) -> dict[str, Any] | None:
            if source is None:
                return None
            return {
                "paths": [str(Path(p).resolve()) for p in source.paths],
                "conversations": source.num_total,
                "fingerprint": source.fingerprint,
            }

        return {
            "train": of(self.train_source),
            "eval": of(self.eval_source),
            "heldout": self.train.heldout,
        }


def _open_data(config: TrainConfig, output_dir: Path, rows: BatchRows) -> _RunData:
    """The run's data (built-in corpora written under `output_dir`), every file read once to
    index and check it: `eval_data` files whole, or with `holdout` the held-out part of `data`."""
    recipe = config.recipe
    data_paths = resolve_data_paths(config.data, output_dir)
    eval_paths = resolve_data_paths(config.eval_data, output_dir)
    heldout = heldout_count(config, data_paths)[0] if config.holdout else 0
    common = dict(
        seq_len=recipe.max_length,
        batch_size=len(rows.rows),
        seed=recipe.seed,
        turns=config.turns,
        skip_bad_records=config.skip_bad_records,
        enable_thinking=config.enable_thinking,
    )
    train = DataConfig(paths=data_paths, seq_lens=config.seq_lens, heldout=heldout, **common)
    held = None
    if heldout:
        held = DataConfig(paths=data_paths, heldout=heldout, part="heldout", **common)
    elif eval_paths:
        held = DataConfig(paths=eval_paths, **common)
    return _RunData(train, open_source(train), held, None if held is None else open_source(held))


def _check_resumable(checkpointer: TrainCheckpointer, step: int, record: dict[str, Any]) -> int:
    """The total step count saved with checkpoint `step`, once the checkpoint is one this run
    (`record`) can resume: the same run, reading the same data, not past its last step."""
    saved = checkpointer.check_record(record, step)
    where = checkpointer.directory / str(step)
    if "data" not in saved:
        logger.warning(
            "%s does not record the data it was trained on (written by an earlier version): "
            "resuming without checking that the data are the same",
            where,
        )
    else:
        differences = _data_differences(saved["data"], record["data"])
        if differences:
            raise TrainCheckpointError(
                f"{where} was trained on other data than this run reads ({differences}); "
                "resume with the original data, or start a new run in another output folder "
                "(from this checkpoint's weights with --init-from)"
            )
    _check_same_settings(where, saved, record)
    total_steps = record["total_steps"]
    if step > total_steps:
        raise TrainCheckpointError(
            f"{checkpointer.directory} is at step {step}, past the {total_steps} steps asked "
            f"for; to use an earlier state, export or --init-from one of its checkpoints "
            f"({', '.join(map(str, checkpointer.all_steps()))})"
        )
    return saved["total_steps"]


def _check_same_settings(where: Path, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Refuses a resume with another number of processes, other length buckets or another target
    dtype (settings that a checkpoint written by an earlier version does not record are not
    checked)."""
    fix = (
        "resume with the original setting, or start a new run in another output folder (from "
        "this checkpoint's weights with --init-from)"
    )
    if "processes" in saved and saved["processes"] != now["processes"]:
        # Not damage: without this, the restore failed on the missing position files and the
        # refusal advised deleting the step (and then every earlier one).
        raise TrainCheckpointError(
            f"{where} was written by {saved['processes']} process(es), each saving its own "
            f"data position, and this run has {now['processes']}: resume it with "
            f"{saved['processes']} process(es) (any mesh), or start a new run in another output "
            "folder (from this checkpoint's weights with --init-from)"
        )
    if "seq_lens" in saved and saved["seq_lens"] != now["seq_lens"]:
        raise TrainCheckpointError(
            f"{where} was trained with the length buckets seq_lens "
            f"{','.join(map(str, saved['seq_lens']))}, this run asks for "
            f"{','.join(map(str, now['seq_lens']))}: the data position saved with it holds "
            f"examples waiting in its buckets; {fix}"
        )
    if "target_dtype" in saved and saved["target_dtype"] != now["target_dtype"]:
        raise TrainCheckpointError(
            f"{where} was trained on the target's features in {saved['target_dtype']}, this run "
            f"loads the target in {now['target_dtype']} (target_dtype), which changes the "
            f"features and the losses; {fix}"
        )


def _data_differences(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """How the data identities `saved` and `now` (`_RunData.identity`) differ, or ''. The files'
    names do not count: the same text moved elsewhere is the same data."""

    def described(files: dict[str, Any] | None) -> str:
        if files is None:
            return "none"
        return (
            f"{', '.join(files['paths'])}: {files['conversations']} conversations, "
            f"fingerprint {files['fingerprint'][:12]}"
        )

    differences = []
    for part, label in (("train", "training data"), ("eval", "evaluation data")):
        a, b = saved.get(part), now.get(part)
        if (a and {**a, "paths": None}) != (b and {**b, "paths": None}):
            differences.append(f"{label}: {described(a)} then, {described(b)} now")
    if saved.get("heldout") != now.get("heldout"):
        differences.append(
            f"held out for evaluation: {saved.get('heldout')} conversations then, "
            f"{now.get('heldout')} now"
        )
    return "; ".join(differences)


def _schedule_change(
    recipe: TrainRecipe, step: int, saved_total: int, total_steps: int
) -> tuple[float, float]:
    """Learning rates at `step` under the schedules for `saved_total` and `total_steps` steps."""
    rates = []
    for total in (saved_total, total_steps):
        _, schedule = make_optimizer(
            recipe.learning_rate,
            total,
            int(recipe.warmup_ratio * total),
            recipe.weight_decay,
            recipe.max_grad_norm,
        )
        rates.append(float(schedule(step)))
    return rates[0], rates[1]


# -- the run -----------------------------------------------------------------------------------
def train(
    config: TrainConfig,
    output_dir: str | os.PathLike,
    *,
    stop_after: int | None = None,
    progress: bool = True,
    export: bool = True,
) -> TrainResult:
    """Trains (or resumes, or extends) `config` in `output_dir`; see the module docstring.

    `stop_after` ends the call after that many total steps (saving a checkpoint), as a preempted
    job would; calling again resumes. A call that fails or is interrupted before its first step
    has finished (bad data, a missing target, a checkpoint of another run, Ctrl-C) removes what
    it added to `output_dir`.
    """
    if stop_after is not None and stop_after < 1:
        raise ConfigError(f"stop_after must be >= 1 or None, got {stop_after}")
    output_dir = Path(output_dir).absolute()
    folder = _RunFolder(output_dir, jax.process_index() == 0)
    # With several processes each would take the signal at its own step and they could not save
    # one checkpoint together (nor stop at one step without a host round trip every step), so a
    # multi-process job is stopped as usual and resumes from its last `save_every` checkpoint.
    interrupts = _Interrupts(jax.process_count() == 1)
    try:
        with interrupts:
            return _train(config, output_dir, folder, interrupts, stop_after, progress, export)
    except BaseException:
        folder.remove_setup()
        raise


class _RunFolder:
    """What setting up a run adds to its folder (the folder itself, the built-in corpora, the
    checkpoints folder, the metrics log and event file), removed again when the run fails or
    is aborted before its first step has finished: a refused run leaves nothing behind, and the
    folder of a run being resumed keeps everything it held. Only process 0, which creates the
    folder, removes anything."""

    SETUP = ("data", "checkpoints", "metrics.jsonl")
    EVENTS = "events.out.tfevents."

    def __init__(self, path: Path, owner: bool):
        self.path, self.owner = path, owner
        self.missing = [p for p in (path, *path.parents) if not p.exists()]  # deepest first
        self.had = set(os.listdir(path)) if path.is_dir() else set()
        self.set_up = False

    def remove_setup(self) -> None:
        if not self.owner or self.set_up or not self.path.is_dir():
            return
        for name in set(os.listdir(self.path)) - self.had:
            if name in self.SETUP[:2]:
                shutil.rmtree(self.path / name, ignore_errors=True)
            elif name in self.SETUP or name.startswith(self.EVENTS):
                with contextlib.suppress(OSError):
                    (self.path / name).unlink()
        for made in self.missing:
            with contextlib.suppress(OSError):
                made.rmdir()


def _train(
    config: TrainConfig,
    output_dir: Path,
    folder: _RunFolder,
    interrupts: _Interrupts,
    stop_after: int | None,
    progress: bool,
    export: bool,
) -> TrainResult:
    recipe = config.recipe
    mesh = make_mesh(config.mesh)
    num_microbatches = config.num_microbatches(mesh.shape["data"] * mesh.shape["fsdp"])
    if not config.data:
        raise ConfigError(f"train config {config.name!r} names no training data; pass --data")
    is_main = jax.process_index() == 0
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
    # The sequence dimension is never sharded, so these shardings (and the jitted steps) take
    # every bucket length; each new length compiles once.
    shardings = batch_shardings(mesh, recipe.global_batch_size, recipe.max_length)
    # Each process reads the rows of the global batch that its devices hold.
    rows = BatchRows(
        addressable_rows(shardings["length"], recipe.global_batch_size), recipe.global_batch_size
    )
    # Bad data, and a checkpoint of another run or of other data, are refused before the target
    # (perhaps a download of gigabytes) is loaded.
    data = _open_data(config, output_dir, rows)
    interrupts.check()
    if config.num_steps is not None:
        total_steps = config.num_steps
    else:
        total_steps = epoch_steps(len(data.train_source), recipe)
    checkpointer = TrainCheckpointer(output_dir / "checkpoints", config.keep_checkpoints)
    interrupts.checkpoints = checkpointer.directory
    record = config.run_record(total_steps, num_microbatches, data.identity())
    # Each process saves and restores its own data position: a step resumes only with as many.
    record["processes"] = jax.process_count()
    resumed_from = checkpointer.latest_step()
    if resumed_from is not None:
        saved_total = _check_resumable(checkpointer, resumed_from, record)

    models, params, frozen, tokenizer = _setup_models(config, mesh, progress)
    interrupts.check()

    warmup_steps = int(recipe.warmup_ratio * total_steps)
    optimizer, schedule = make_optimizer(
        recipe.learning_rate, total_steps, warmup_steps, recipe.weight_decay, recipe.max_grad_norm
    )
    state = shard_state(init_train_state(params, optimizer, recipe.seed), mesh)
    step_cfg = StepConfig(
        config.drafter.num_anchors,
        config.anchors_per_chunk,
        num_microbatches,
        config.loss_weights,
    )
    iterator = make_iterator(data.train, tokenizer, rows, data.train_source)
    # Processes bucket their own rows: with several buckets they pad to a common length.
    pad_id = resolve_pad_id(tokenizer, data.train.pad_id) if len(data.train.seq_lens) > 1 else None
    init_checkpoint = None if config.init_drafter is None else find_checkpoint(config.init_drafter)
    if init_checkpoint is not None and resumed_from is None:
        restored = restore_state(*init_checkpoint, _abstract(state, state_shardings(state, mesh)))
        init_dir, init_step = init_checkpoint
        check_tree(
            nnx.to_pure_dict(restored.params),
            f"--init-from: the drafter of step {init_step} of {init_dir}",
            "training from it would only carry them on: start from an earlier step",
        )
        state = state._replace(params=restored.params)
    if resumed_from is not None:
        abstract = _abstract(state, state_shardings(state, mesh))
        state, _ = checkpointer.restore(abstract, iterator, record)
        # A run that diverged, or damaged bytes, would go on training on NaN and save it again.
        check_tree(
            nnx.to_pure_dict(state.params),
            f"the drafter of step {resumed_from} of {checkpointer.directory}",
            "resuming would only carry them on: delete that step folder to resume from the "
            "one before it, or start again in a new output folder",
        )
        logger.info("resumed from step %d", resumed_from)
        if saved_total != total_steps:
            before, after = _schedule_change(recipe, resumed_from, saved_total, total_steps)
            logger.warning(
                "%s the run from %d to %d steps: the learning-rate schedule is recomputed for "
                "%d steps (warmup %d, cosine to 0 at step %d); at step %d the learning rate "
                "goes from %.3g to %.3g",
                "extending" if total_steps > saved_total else "shortening",
                saved_total,
                total_steps,
                total_steps,
                warmup_steps,
                total_steps,
                resumed_from,
                before,
                after,
            )

    train_step = make_train_step(
        models,
        step_cfg,
        optimizer,
        schedule,
        mesh,
        state,
        frozen,
        recipe.global_batch_size,
        recipe.max_length,
    )
    eval_batches = _eval_batches(config, data, tokenizer, rows, shardings)
    evaluate = None
    if eval_batches:
        evaluate = make_eval_step(
            models,
            step_cfg,
            mesh,
            state.params,
            frozen,
            recipe.global_batch_size,
            recipe.max_length,
        )
    eval_key = jax.random.PRNGKey(recipe.seed + EVAL_SEED_OFFSET)

    interrupts.check()
    # The folder counts as set up (kept whatever happens next) once the first step has finished:
    # until then an abort or failure removes what this call added, the log included.
    log = _MetricsLog(output_dir, is_main, resumed_from)
    history: list[dict[str, Any]] = []

    def run_eval(step: int) -> dict[str, Any]:
        per_batch = [
            jax.device_get(evaluate(state.params, frozen, b, eval_key)) for b in eval_batches
        ]
        result = {"split": "eval", "step": step, **_mean_records(per_batch)}
        # Every process evaluates (the step is collective); process 0 knows what was logged.
        if log.write(result) or not log.enabled:
            history.append(result)
        return result

    step = int(jax.device_get(state.step))
    eval_start = run_eval(step) if evaluate is not None and resumed_from is None else None
    end = total_steps if stop_after is None else min(stop_after, total_steps)
    show_bar = progress and is_main
    bar = None
    inflight: collections.deque[jax.Array] = collections.deque()
    pending: list[dict[str, jax.Array]] = []
    first_step = step
    # Throughput of a log interval: its timed steps and tokens over the training time, which is
    # `timed_seconds` (before the interval's evaluation pauses) plus the time since
    # `interval_start`.
    timed_steps, timed_tokens, timed_seconds = 0, 0, 0.0
    compiled_shapes: set[tuple[int, ...]] = set()  # batch shapes the train step has run
    truncations = _Truncations(recipe.max_length)
    loss_seen = False  # whether a step of this call has carried a loss token
    interval_start = time.perf_counter()
    saved_step = resumed_from

    def finished(block_all: bool = False) -> None:
        """Ticks the bar for every dispatched step that has finished on the device."""
        while inflight and (block_all or len(inflight) > MAX_STEPS_AHEAD or inflight[0].is_ready()):
            jax.block_until_ready(inflight.popleft())
            if bar is not None:
                bar.update(1)

    def announce_stop(signum: int) -> None:
        message = (
            "SIGTERM: stopping after the step in flight and saving a checkpoint (a second "
            "signal aborts without saving)"
            if signum == signal.SIGTERM
            else "Ctrl-C: stopping after the step in flight and saving a checkpoint "
            "(Ctrl-C again to abort without saving)"
        )
        (bar.write if bar is not None else logger.warning)(message)

    interrupts.on_stop_request = announce_stop
    # `interrupts.training` (a first signal stops after the step in flight, with a checkpoint)
    # starts once the first step has finished: a signal during it, while it compiles, aborts at
    # once, as before training, rather than wait for the compilation and save a step.
    folder.set_up = step >= end
    # A stop request as read once per step, where the step's log interval is written: the loop
    # stops at a step whose interval it has logged (a request read only by the loop's test could
    # land after that point and leave the steps since the last log record unlogged).
    stopping = False
    try:
        while step < end and not stopping:
            interrupts.check()
            local = next(iterator)
            truncations.add(local, step + 1)
            batch = global_batch(local, shardings, pad_id)
            shape = batch["tokens"].shape
            # A length bucket's first step compiles (on the host, inside the call): like the
            # first step of the call, it is kept out of the throughput and the bar's rate.
            compiles = step > first_step and shape not in compiled_shapes
            if compiles:
                finished(block_all=True)
                timed_seconds += time.perf_counter() - interval_start
            state, metrics = train_step(state, frozen, batch)
            compiled_shapes.add(shape)
            pending.append(metrics)
            step += 1
            if step == first_step + 1:
                # The first step of a call includes compilation: throughput and the bar's
                # rate start after it.
                jax.block_until_ready(metrics)
                interrupts.check()
                folder.set_up = interrupts.training = True
                interval_start = time.perf_counter()
                if show_bar:
                    bar = tqdm(total=end, initial=step, desc=config.name)
            elif compiles:
                jax.block_until_ready(metrics)
                if bar is not None:
                    bar.update(1)
                    bar.unpause()
                interval_start = time.perf_counter()
            else:
                timed_steps += 1
                timed_tokens += batch["tokens"].size
                inflight.append(metrics["loss"])
            finished()
            stopping = interrupts.stop_requested
            if step % config.log_every == 0 or step == end or stopping:
                records = jax.device_get(pending)
                finished(block_all=True)
                # `truncated`: this process's sequences cut to the largest bucket.
                entry = {"split": "train", "step": step, **_mean_records(records)}
                entry["truncated"] = truncations.take_interval()
                if timed_steps:
                    elapsed = timed_seconds + time.perf_counter() - interval_start
                    entry["steps_per_s"] = timed_steps / elapsed
                    entry["seq_tokens_per_s"] = timed_tokens / elapsed
                log.write(entry)
                history.append(entry)
                loss_seen = loss_seen or any(float(r["num_tokens"]) > 0 for r in records)
                # Judged over NO_LOSS_STEPS steps at least (or the whole call, at its end): one
                # batch without a loss token (a few over-long prompts, a resume's first logged
                # step) says nothing about the data.
                enough = step - first_step >= NO_LOSS_STEPS or step == end
                if not loss_seen and enough and not stopping:
                    # Every process has the same (global) counts: all stop at this step.
                    raise truncations.no_loss_error(first_step + 1, step)
                if bar is not None:
                    bar.set_postfix(loss=f"{entry['loss']:.3f}", tau=f"{entry['tau']:.2f}")
                pending, timed_steps, timed_tokens, timed_seconds = [], 0, 0, 0.0
                interval_start = time.perf_counter()
            paused = False
            if evaluate is not None and config.eval_every and step % config.eval_every == 0:
                if step != end:  # the end has its own evaluation below
                    finished(block_all=True)
                    timed_seconds += time.perf_counter() - interval_start
                    run_eval(step)
                    paused = True
            if step % config.save_every == 0 or step == end:
                checkpointer.save(state, iterator, record)
                saved_step = step
            if paused:
                # Evaluation time is not training time: keep it out of the bar's rate and
                # the logged throughput.
                if bar is not None:
                    bar.unpause()
                interval_start = time.perf_counter()
        finished(block_all=True)
        if interrupts.stop_requested and saved_step != step:
            checkpointer.save(state, iterator, record)
            saved_step = step
    finally:
        interrupts.training = False
        if bar is not None:
            bar.close()
        # An abort leaves a save in flight unfinished (and unreported) rather than wait for it.
        if not interrupts.aborted:
            checkpointer.wait_until_finished()
            checkpointer.close()
            truncations.report()
    if interrupts.stop_requested:
        log.close()
        raise TrainingInterrupted(step, checkpointer.directory / str(step), interrupts.signum)

    done = step >= total_steps
    eval_end = None
    if evaluate is not None and done:
        eval_end = run_eval(step)
    log.close()
    export_dir = None
    if done and export:
        export_dir = export_trained_drafter(
            models, state.params, frozen.drafter, output_dir / "drafter" if is_main else None
        )
    interrupts.check()
    return TrainResult(output_dir, step, history, eval_start, eval_end, export_dir, resumed_from)


def _abstract(state: TrainState, shardings) -> TrainState:
    """Restore targets: the shapes and dtypes of `state`, placed with `shardings`."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )


def checkpoint_drafter_config(directory: Path, step: int) -> tuple[DrafterConfig, dict[str, Any]]:
    """(drafter config, run record) of a training checkpoint."""
    meta = read_meta(directory, step)
    if "drafter" not in meta:
        raise TrainCheckpointError(f"{directory}/{step}: its run record names no drafter")
    return DrafterConfig.from_hf(meta["drafter"]), meta


def drafter_from_checkpoint(
    path: str | os.PathLike, target: str | None = None
) -> tuple[DSparkDrafter, str]:
    """(drafter, target) of a training checkpoint (a step folder, a run's `checkpoints/` or a run
    folder): the drafter completed with the frozen embedding and head of its target and cast to
    the run's compute dtype, as the run's final export would write it.

    `target`: the target folder or hub id (default: the one recorded in the checkpoint).
    """
    found = find_checkpoint(path)
    if found is None:
        raise TrainCheckpointError(f"{path}: not a training checkpoint, run or checkpoints folder")
    directory, step = found
    cfg, meta = checkpoint_drafter_config(directory, step)
    recorded = target is None
    target = target or meta.get("target")
    if target is None:
        raise TrainCheckpointError(
            f"{directory}/{step} does not record its target; name it (--target)"
        )
    dtype = meta["recipe"]["dtype"]
    try:
        _, target_model, _ = load_target(target, progress=False)
    except CheckpointError as e:
        if not recorded or Path(target).expanduser().exists():
            raise
        raise TrainCheckpointError(
            f"{e}; it is the target {directory}/{step} records: if it has moved, name its "
            "folder (--target)"
        ) from e
    graphdef, params, frozen = split_drafter(
        new_drafter(cfg.with_dtype(dtype), target_model, seed=0)
    )
    template = init_train_state(params, make_optimizer(1.0, 2, 0, 0.0, 1.0)[0], 0)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    restored = restore_state(
        directory, step, _abstract(template, jax.tree.map(lambda _: device, template))
    )
    graphdef, state = nnx.split(nnx.merge(graphdef, frozen, restored.params))
    state = jax.tree.map(lambda x: np.asarray(x).astype(jnp.dtype(dtype)), state)
    drafter = nnx.merge(graphdef, state)
    # A run that diverged saves NaN like any other step: refused here as every loaded drafter is.
    check_parameters(drafter, f"the drafter of step {step} of {directory}")
    return drafter, target


def _setup_models(config: TrainConfig, mesh, progress: bool):
    """(models, trainable drafter params, frozen params, tokenizer), sharded on `mesh`.

    The target is sharded first, so the drafter's frozen embedding and head are the very same
    (sharded) arrays as the target's rather than copies.
    """
    recipe = config.recipe
    target_dtype = config.target_dtype or recipe.dtype
    target_cfg, target, target_dir = load_target(
        config.target, dtype=target_dtype, progress=progress
    )
    target_gd, target_state = nnx.split(target)
    target_state = shard_state(target_state, mesh)
    target = nnx.merge(target_gd, target_state)

    limit = target_cfg.max_position_embeddings
    if recipe.max_length > limit:
        # As decoding refuses: the target's features past its context are not what it produces.
        raise ConfigError(
            f"the recipe's max_length {recipe.max_length} exceeds the target's context "
            f"(max_position_embeddings {limit} in {target_dir}): the drafter would learn from "
            f"target features at positions the target does not support; use a recipe with "
            f"max_length (and seq_lens) of at most {limit}"
        )
    drafter_cfg = config.drafter.with_dtype(recipe.dtype)
    drafter_cfg.check_target(target_cfg)
    drafter = new_drafter(drafter_cfg, target, seed=recipe.seed)
    if config.init_drafter is not None:
        found = find_checkpoint(config.init_drafter)
        if found is not None:
            loaded_cfg, _ = checkpoint_drafter_config(*found)
            source = f"checkpoint {found[0]}/{found[1]}"
        else:
            loaded_cfg, loaded, _ = load_drafter(
                config.init_drafter, dtype="float32", progress=progress
            )
            source = str(config.init_drafter)
        diffs = _drafter_diffs(loaded_cfg, drafter_cfg)
        if diffs:
            raise ConfigError(
                f"init_drafter {config.init_drafter} does not match the config's drafter: "
                + "; ".join(diffs)
            )
        if found is None:
            graphdef, _, frozen = split_drafter(drafter)
            _, params, _ = split_drafter(loaded)
            drafter = nnx.merge(graphdef, frozen, params)
        # A checkpoint's parameters are restored into the sharded train state (see `train`).
        logger.info("initialising the drafter from %s", source)
    drafter_gd, params, frozen_drafter = split_drafter(drafter)
    frozen = FrozenParams(target_state, shard_state(frozen_drafter, mesh))
    return Models(target_gd, drafter_gd, drafter_cfg), params, frozen, load_tokenizer(target_dir)


# Drafter fields that --init-from may change: not part of the parameters' shapes or meaning (the
# compute dtype, the anchors sampled per sequence in training, the context length: RoPE is
# computed, not stored).
INIT_FREE_FIELDS = ("dtype", "num_anchors", "max_position_embeddings")


def _drafter_diffs(a: DrafterConfig, b: DrafterConfig) -> list[str]:
    ha, hb = a.to_hf(), b.to_hf()
    return [
        f"{k}: {ha.get(k)!r} vs {hb.get(k)!r}"
        for k in sorted(set(ha) | set(hb))
        if ha.get(k) != hb.get(k) and k not in INIT_FREE_FIELDS
    ]


def _eval_batches(
    config: TrainConfig, data: _RunData, tokenizer, rows: BatchRows, shardings
) -> list[dict[str, jax.Array]]:
    """The first `config.eval_batches` batches of the held-out data (fixed for the whole run)."""
    if data.eval is None:
        return []
    iterator = make_iterator(data.eval, tokenizer, rows, data.eval_source)
    return [global_batch(next(iterator), shardings) for _ in range(config.eval_batches)]


def export_trained_drafter(
    models: Models, params: nnx.State, frozen_drafter: nnx.State, out: Path | None
) -> Path | None:
    """Writes the trained drafter (in its compute dtype) as a PyTorch-layout folder.

    Every process must call it (parameters are gathered across hosts); only those given an `out`
    write.
    """
    drafter = nnx.merge(models.drafter, frozen_drafter, params)
    dtype = jnp.dtype(models.drafter_cfg.model.dtype)
    graphdef, state = nnx.split(drafter)
    state = jax.tree.map(
        lambda x: np.asarray(process_allgather(x, tiled=True)).astype(dtype), state
    )
    if out is None:
        return None
    drafter = nnx.merge(graphdef, state)
    # A run that diverged ends with NaN weights; they are not written as its drafter.
    check_parameters(
        drafter,
        f"the drafter trained in {out.parent}",
        "it is not exported: resume from, or --init-from, an earlier step with a lower "
        "learning rate",
    )
    return write_drafter_torch(drafter, None, out, overwrite=True)
