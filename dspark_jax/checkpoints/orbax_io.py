"""Model parameters in Orbax: save, read the stored metadata, restore with key and shape checks.

Parameters are stored as `nnx.to_pure_dict(nnx.state(model))` with a `StandardCheckpointer`;
restoring builds the model abstractly first (no allocation), so the arrays held afterwards are
exactly the ones read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from dspark_jax.checkpoints import interrupts
from dspark_jax.checkpoints.convert import is_float_dtype, key_path_names, shape_problems
from dspark_jax.checkpoints.safetensors_io import CheckpointError
from dspark_jax.config import DrafterConfig
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.qwen3 import Qwen3


def abstract_model(cfg, param_dtype: str) -> nnx.Module:
    """An abstract (unallocated) target or drafter for `cfg`."""
    if isinstance(cfg, DrafterConfig):
        return nnx.eval_shape(lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype))
    return nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype))


def save_params(model: nnx.Module, params_dir: Path) -> None:
    """Writes the model's parameters to `params_dir` (which must not exist yet)."""
    ckpt = ocp.StandardCheckpointer()
    try:
        ckpt.save(params_dir.resolve(), nnx.to_pure_dict(nnx.state(model)))
    finally:
        # Orbax writes in a background thread: an interrupted save must not return (and let the
        # caller delete the folder) while that thread still writes into it.
        with interrupts.deferred():
            ckpt.wait_until_finished()
            ckpt.close()


def _flat(tree) -> dict[str, Any]:
    """Leaves by dotted path; Orbax metadata spells list indices "0", our pure dicts 0."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(key_path_names(path)): leaf for path, leaf in leaves}


def read_metadata(params_dir: Path) -> dict[str, Any]:
    """The stored leaves' metadata (shape, dtype) by dotted parameter path."""
    if not params_dir.is_dir():
        raise CheckpointError(f"{params_dir}: parameter folder does not exist")
    try:
        with ocp.StandardCheckpointer() as ckpt:
            return _flat(ckpt.metadata(params_dir.resolve()).item_metadata)
    except Exception as e:
        raise CheckpointError(
            f"{params_dir}: cannot read the Orbax checkpoint ({type(e).__name__}: {e})"
        ) from e


def restore_params(
    params_dir: Path, abstract: nnx.Module, stored: dict[str, Any], dtype: str | None
) -> nnx.Module:
    """Restores `abstract`'s parameters from `params_dir`, checking keys and shapes first.

    `stored` is `read_metadata(params_dir)`. The restore target is the abstract model's pure
    dict, so list indices stay int keys. Each leaf is read in its stored dtype, or cast to `dtype`
    by Orbax while reading.
    """
    graphdef, state = nnx.split(abstract)
    wanted = nnx.to_pure_dict(state)
    problems = shape_problems(
        {key: tuple(leaf.shape) for key, leaf in _flat(wanted).items()},
        {key: tuple(meta.shape) for key, meta in stored.items()},
    )
    if problems:
        raise CheckpointError(
            f"{params_dir}: parameters do not match config.json: " + " | ".join(problems)
        )

    # An explicit device: the sharding recorded at save time names the converting machine's.
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def leaf_target(key_path, leaf):
        meta = stored[".".join(key_path_names(key_path))]
        cast = dtype is not None and is_float_dtype(meta.dtype)
        return jax.ShapeDtypeStruct(leaf.shape, dtype if cast else meta.dtype, sharding=sharding)

    target = jax.tree_util.tree_map_with_path(leaf_target, wanted)
    try:
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(params_dir.resolve(), target)
    except Exception as e:
        raise CheckpointError(
            f"{params_dir}: cannot read the Orbax checkpoint ({type(e).__name__}: {e})"
        ) from e
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state)
