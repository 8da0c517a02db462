"""The training loop: a frozen target run online, a drafter trained on its features.

`train(config, output_dir)` builds the mesh, loads the target (sharded by the rules table),
creates the drafter (embed_tokens and lm_head are the target's arrays, frozen), reads batches
from the grain pipeline, runs the jitted step, logs metrics (tqdm bar and `metrics.jsonl`),
evaluates on held-out batches at the start and the end, checkpoints with Orbax (resuming from the
newest complete checkpoint in `output_dir`), and finally exports the drafter in the PyTorch
(DeepSpec) layout.

Output folder:
    metrics.jsonl     one JSON object per logged train interval or evaluation
    checkpoints/      Orbax steps (see checkpointing.py)
    drafter/          the exported drafter (config.json + model.safetensors)
    data/             built-in corpora, when the config names one (see corpus.py)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
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
from dspark_jax.config import ConfigError, DrafterConfig
from dspark_jax.configs.recipes import TrainRecipe
from dspark_jax.sharding import MeshConfig, make_mesh, shard_state, state_shardings
from dspark_jax.tokenizer import load_tokenizer
from dspark_jax.training.checkpointing import TrainCheckpointer
from dspark_jax.training.corpus import resolve_data_paths
from dspark_jax.training.data import (
    DataConfig,
    JsonlConversationSource,
    check_seq_lens,
    make_iterator,
)
from dspark_jax.training.loss import LossWeights
from dspark_jax.training.step import (
    FrozenParams,
    Models,
    StepConfig,
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


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run: what to train, on what, and how the program runs it.

    `target`: a Hugging Face / converted target folder (or hub id). `drafter`: the drafter's shape,
    its block size, depth and anchors per sequence included. `data` / `eval_data`: JSONL paths or
    `builtin:python-stdlib` (the local Python standard library's source as conversations).
    `num_steps` None trains `recipe.num_epochs` over the data. `per_device_batch_size` sets the
    micro-batch (gradient accumulation runs global / (per-device x batch-parallel devices) micro
    steps); None processes the whole global batch at once. `target_dtype` None uses the recipe's
    dtype. `init_drafter` fine-tunes an existing drafter instead of starting from scratch.
    `seq_lens` are the length buckets of the training batches (strictly ascending, ending at
    `recipe.max_length`; one compiled step each); None pads everything to `recipe.max_length`.
    Evaluation always uses `recipe.max_length`.
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

    def __post_init__(self):
        r, d = self.recipe, self.drafter
        if r.confidence_weight > 0 and not d.enable_confidence_head:
            raise ConfigError(
                f"train config {self.name!r}: confidence_weight {r.confidence_weight} but the "
                "drafter has no confidence head"
            )
        if isinstance(self.data, str) or isinstance(self.eval_data, str):
            raise ConfigError("data and eval_data must be tuples of paths")
        for field in ("log_every", "eval_batches", "save_every", "keep_checkpoints"):
            if getattr(self, field) < 1:
                raise ConfigError(f"{field} must be >= 1, got {getattr(self, field)}")
        for field in ("num_steps", "per_device_batch_size"):
            if getattr(self, field) is not None and getattr(self, field) < 1:
                raise ConfigError(f"{field} must be >= 1 or None, got {getattr(self, field)}")
        StepConfig(d.num_anchors, self.anchors_per_chunk)
        if self.seq_lens is not None:
            object.__setattr__(self, "seq_lens", check_seq_lens(self.seq_lens, r.max_length))

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
                f"{batch_parallel_devices} devices"
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

    def run_record(self, total_steps: int, num_microbatches: int) -> dict[str, Any]:
        """What a checkpoint must agree with to be resumed by this run (JSON-normalised)."""
        record = {
            "drafter": self.drafter.to_hf(),
            "recipe": dataclasses.asdict(self.recipe),
            "total_steps": total_steps,
            "num_microbatches": num_microbatches,
            "anchors_per_chunk": self.anchors_per_chunk,
            "init_drafter": self.init_drafter,
        }
        return json.loads(json.dumps(record))


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
def _global_batch(local: dict[str, np.ndarray], shardings) -> dict[str, jax.Array]:
    return {
        k: jax.make_array_from_process_local_data(shardings[k], np.asarray(local[k]))
        for k in shardings
    }


def _python(x) -> float | list:
    a = np.asarray(x)
    return a.tolist() if a.ndim else float(a)


def _mean_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-metric means over steps (or eval batches), as JSON-ready Python values."""
    return {k: _python(np.mean([np.asarray(r[k]) for r in records], axis=0)) for k in records[0]}


class _JsonlLog:
    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


def count_conversations(paths: tuple[str, ...]) -> int:
    """Number of usable conversations in the JSONL files (one pass over them)."""
    return len(JsonlConversationSource(paths))


# -- the run -----------------------------------------------------------------------------------
def train(
    config: TrainConfig,
    output_dir: str | os.PathLike,
    *,
    stop_after: int | None = None,
    progress: bool = True,
    export: bool = True,
) -> TrainResult:
    """Trains (or resumes) `config` in `output_dir`; see the module docstring.

    `stop_after` ends the call after that many total steps (saving a checkpoint), as a preempted
    job would; calling again resumes.
    """
    output_dir = Path(output_dir).absolute()
    recipe = config.recipe
    mesh = make_mesh(config.mesh)
    num_microbatches = config.num_microbatches(mesh.shape["data"] * mesh.shape["fsdp"])
    if not config.data:
        raise ConfigError(f"train config {config.name!r} names no training data; pass --data")
    if recipe.global_batch_size % jax.process_count():
        raise ConfigError(
            f"global_batch_size {recipe.global_batch_size} is not divisible by "
            f"{jax.process_count()} processes"
        )
    is_main = jax.process_index() == 0
    if is_main:
        output_dir.mkdir(parents=True, exist_ok=True)

    data_paths = resolve_data_paths(config.data, output_dir)
    eval_paths = resolve_data_paths(config.eval_data, output_dir)

    models, params, frozen, tokenizer = _setup_models(config, mesh, progress)

    if config.num_steps is not None:
        total_steps = config.num_steps
    else:
        per_epoch = count_conversations(data_paths) // recipe.global_batch_size
        total_steps = max(1, recipe.num_epochs * per_epoch)
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

    local_batch = recipe.global_batch_size // jax.process_count()
    data_cfg = DataConfig(
        paths=data_paths,
        seq_len=recipe.max_length,
        seq_lens=config.seq_lens,
        batch_size=local_batch,
        seed=recipe.seed,
    )
    iterator = make_iterator(data_cfg, tokenizer)
    checkpointer = TrainCheckpointer(output_dir / "checkpoints", config.keep_checkpoints)
    record = config.run_record(total_steps, num_microbatches)
    resumed_from = checkpointer.latest_step()
    if resumed_from is not None:
        abstract = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            state,
            state_shardings(state, mesh),
        )
        state = checkpointer.restore(abstract, iterator, record)
        logger.info("resumed from step %d", resumed_from)

    # The sequence dimension is never sharded, so these shardings (and the jitted steps) take
    # every bucket length; each new length compiles once.
    shardings = batch_shardings(mesh, recipe.global_batch_size, recipe.max_length)
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
    eval_batches = _eval_batches(config, eval_paths, tokenizer, local_batch, shardings)
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

    log = _JsonlLog(output_dir / "metrics.jsonl", is_main)
    history: list[dict[str, Any]] = []

    def run_eval(step: int) -> dict[str, Any]:
        per_batch = [
            jax.device_get(evaluate(state.params, frozen, b, eval_key)) for b in eval_batches
        ]
        result = {"split": "eval", "step": step, **_mean_records(per_batch)}
        log.write(result)
        history.append(result)
        return result

    step = int(jax.device_get(state.step))
    eval_start = run_eval(step) if evaluate is not None and resumed_from is None else None
    end = total_steps if stop_after is None else min(stop_after, total_steps)
    bar = tqdm(total=end, initial=step, desc=config.name, disable=not (progress and is_main))
    pending: list[dict[str, jax.Array]] = []
    first_step = step
    timed_steps, timed_tokens, truncated = 0, 0, 0
    interval_start = time.perf_counter()
    while step < end:
        local = next(iterator)
        truncated += int(np.sum(local["num_tokens"] > local["length"]))
        batch = _global_batch(local, shardings)
        state, metrics = train_step(state, frozen, batch)
        pending.append(metrics)
        step += 1
        if step == first_step + 1:
            # Throughput excludes the first step of a call, which includes compilation.
            jax.block_until_ready(metrics)
            interval_start = time.perf_counter()
        else:
            timed_steps += 1
            timed_tokens += batch["tokens"].size
        if step % config.log_every == 0 or step == end:
            records = jax.device_get(pending)
            # `truncated`: this process's sequences cut to the largest bucket in the interval.
            entry = {"split": "train", "step": step, **_mean_records(records)}
            entry["truncated"] = truncated
            if timed_steps:
                elapsed = time.perf_counter() - interval_start
                entry["steps_per_s"] = timed_steps / elapsed
                entry["seq_tokens_per_s"] = timed_tokens / elapsed
            log.write(entry)
            history.append(entry)
            bar.set_postfix(loss=f"{entry['loss']:.3f}", tau=f"{entry['tau']:.2f}")
            pending, timed_steps, timed_tokens, truncated = [], 0, 0, 0
            interval_start = time.perf_counter()
        bar.update(1)
        if step % config.save_every == 0 or step == end:
            checkpointer.save(state, iterator, record)
    bar.close()
    checkpointer.wait_until_finished()
    checkpointer.close()

    done = step >= total_steps
    eval_end = run_eval(step) if evaluate is not None and done else None
    export_dir = None
    if done and export:
        export_dir = export_trained_drafter(
            models, state.params, frozen.drafter, output_dir / "drafter" if is_main else None
        )
    return TrainResult(output_dir, step, history, eval_start, eval_end, export_dir, resumed_from)


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

    drafter_cfg = config.drafter.with_dtype(recipe.dtype)
    drafter_cfg.check_target(target_cfg)
    if config.init_drafter is None:
        drafter = new_drafter(drafter_cfg, target, seed=recipe.seed)
    else:
        loaded_cfg, drafter, _ = load_drafter(
            config.init_drafter, dtype="float32", progress=progress
        )
        if dataclasses.replace(loaded_cfg, model=drafter_cfg.model) != drafter_cfg:
            raise ConfigError(f"init_drafter {config.init_drafter} does not match config.drafter")
    drafter_gd, params, frozen_drafter = split_drafter(drafter)
    frozen = FrozenParams(target_state, shard_state(frozen_drafter, mesh))
    return Models(target_gd, drafter_gd, drafter_cfg), params, frozen, load_tokenizer(target_dir)


def _eval_batches(
    config: TrainConfig, eval_paths: tuple[str, ...], tokenizer, local_batch: int, shardings
) -> list[dict[str, jax.Array]]:
    """The first `config.eval_batches` batches of the held-out data (fixed for the whole run)."""
    if not eval_paths:
        return []
    data_cfg = DataConfig(
        paths=eval_paths,
        seq_len=config.recipe.max_length,
        batch_size=local_batch,
        seed=config.recipe.seed,
        num_epochs=None,
    )
    iterator = make_iterator(data_cfg, tokenizer)
    return [_global_batch(next(iterator), shardings) for _ in range(config.eval_batches)]


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
    return write_drafter_torch(nnx.merge(graphdef, state), None, out, overwrite=True)
