"""Model parameters in Orbax: save, read the stored metadata, restore with key and shape checks.

Parameters are stored as `nnx.to_pure_dict(nnx.state(model))` with a `StandardCheckpointer`;
restoring builds the model abstractly first (no allocation), so the arrays held afterwards are
exactly the ones read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from dspark_jax.checkpoints import interrupts
from dspark_jax.checkpoints.convert import is_float_dtype, key_path_names, shape_problems
from dspark_jax.checkpoints.orbax_reads import finished_reads
from dspark_jax.checkpoints.safetensors_io import CheckpointError
from dspark_jax.config import DrafterConfig
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.sharding import state_shardings


def abstract_model(cfg, param_dtype: str) -> nnx.Module:
    """An abstract (unallocated) target or drafter for `cfg`."""
    if isinstance(cfg, DrafterConfig):
        return nnx.eval_shape(lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype))
    return nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype))


def save_params(model: nnx.Module, params_dir: Path) -> None:
    """Writes the model's parameters to `params_dir` (which must not exist yet).

    A write the system refuses (a full disk, a quota) is an OSError naming the folder, once:
    the writes Orbax abandons when the first one fails end with it (`finished_reads` serves
    writes alike), and Orbax's own log of the failure from each of its threads is left out."""
    ckpt = ocp.StandardCheckpointer()
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(_not_failed_write_log)
    try:
        with finished_reads():
            try:
                ckpt.save(params_dir.resolve(), nnx.to_pure_dict(nnx.state(model)))
            finally:
                # Orbax writes in a background thread: an interrupted save must not return
                # (and let the caller delete the folder) while that thread still writes into it.
                with interrupts.deferred():
                    ckpt.wait_until_finished()
                    ckpt.close()
    except Exception as e:
        code = _OS_ERROR_CODE.search(str(e))
        if code is None:
            raise
        errno = int(code.group(1))
        why = f"cannot write the parameters: {os.strerror(errno)}"
        raise OSError(errno, why, str(params_dir)) from None
    finally:
        absl_logger.removeFilter(_not_failed_write_log)


# TensorStore's errors carry the system's errno in this form.
_OS_ERROR_CODE = re.compile(r"\[os_error_code='(\d+)'\]")


def _not_failed_write_log(record: logging.LogRecord) -> bool:
    # Orbax logs a failed write from each background thread before raising it in the caller.
    if record.levelno < logging.ERROR:
        return True
    error = record.exc_info[1] if record.exc_info else None
    return _OS_ERROR_CODE.search(f"{record.getMessage()} {error}") is None


def _not_metadata_warning(record: logging.LogRecord) -> bool:
    # Orbax logs this and returns no metadata; `read_metadata` reports that as an error.
    return not record.getMessage().startswith("Failed to get item metadata")


@contextlib.contextmanager
def _reading() -> Iterator[None]:
    """Orbax reads that end every read they start (`finished_reads`), without the warning Orbax
    logs (through absl) for metadata it cannot read."""
    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(_not_metadata_warning)
    try:
        with finished_reads():
            yield
    finally:
        absl_logger.removeFilter(_not_metadata_warning)


def _flat(tree) -> dict[str, Any]:
    """Leaves by dotted path; Orbax metadata spells list indices "0", our pure dicts 0."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(key_path_names(path)): leaf for path, leaf in leaves}


def read_metadata(params_dir: Path) -> dict[str, Any]:
    """The stored leaves' metadata (shape, dtype) by dotted parameter path."""
    if not params_dir.is_dir():
        raise CheckpointError(f"{params_dir}: parameter folder does not exist")
    try:
        with _reading(), ocp.StandardCheckpointer() as ckpt:
            item_metadata = ckpt.metadata(params_dir.resolve()).item_metadata
    except Exception as e:
        raise CheckpointError(
            f"{params_dir}: cannot read the Orbax checkpoint ({type(e).__name__}: {e})"
        ) from e
    if not item_metadata:
        raise CheckpointError(
            f"{params_dir}: cannot read the Orbax checkpoint (its parameter metadata is missing "
            "or unreadable, e.g. manifest.ocdbt was removed): the folder is incomplete or "
            "damaged; convert it again"
        )
    return _flat(item_metadata)


def restore_params(
    params_dir: Path,
    abstract: nnx.Module,
    stored: dict[str, Any],
    dtype: str | None,
    mesh=None,
    *,
    check_stored: Callable[[list[str], list[np.ndarray]], None] | None = None,
    place_as: str | None = None,
) -> nnx.Module:
    """Restores `abstract`'s parameters from `params_dir`, checking keys and shapes first.

    `stored` is `read_metadata(params_dir)`. The restore target is the abstract model's pure
    dict, so list indices stay int keys. Each leaf is read in its stored dtype, or cast to `dtype`
    by Orbax while reading.

    Without a `mesh`, leaves are read into host memory, then placed leaf by leaf as `jnp.asarray`
    places arrays read from safetensors: uncommitted, on the default device. Orbax's own device
    placement commits them to a device, and committed-ness is part of every jitted function's
    cache key, so the same weights from a converted folder would compile programs of their own
    (and mixed with arrays made on the host, compile again where the other form does not).

    With a `mesh`, Orbax reads every leaf straight into its rules-table sharding (each process
    reads the slices its devices hold: one checkpoint, one global sharding), committed like the
    sharded arrays `load_from_torch` makes from safetensors.

    Without a mesh, `check_stored(names, leaves)` sees every leaf in host memory as read (names
    and order as `integrity.check_tree` flattens the model) before any is placed, and
    `place_as` casts the floating leaves one by one as they are placed: a checksum of the
    stored bits, then a cast, with the device holding only the cast parameters.
    """
    if mesh is not None and (check_stored is not None or place_as is not None):
        raise ValueError("check_stored and place_as read through host memory: no mesh")
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

    def leaf_target(key_path, leaf, sharding=None):
        meta = stored[".".join(key_path_names(key_path))]
        cast = dtype is not None and is_float_dtype(meta.dtype)
        leaf_dtype = jnp.dtype(dtype if cast else meta.dtype)
        if sharding is not None:
            return jax.ShapeDtypeStruct(leaf.shape, leaf_dtype, sharding=sharding)
        # np.empty reserves address space only; Orbax fills it (and reads no sharding from it).
        return np.empty(leaf.shape, leaf_dtype)

    if mesh is None:
        target = jax.tree_util.tree_map_with_path(leaf_target, wanted)
    else:
        shardings = nnx.to_pure_dict(state_shardings(state, mesh, strict=True))
        target = jax.tree_util.tree_map_with_path(leaf_target, wanted, shardings)
    try:
        with _reading(), ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(params_dir.resolve(), target)
    except Exception as e:
        raise CheckpointError(
            f"{params_dir}: cannot read the Orbax checkpoint ({type(e).__name__}: {e})"
        ) from e
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(restored)
    del restored
    leaves = [leaf for _, leaf in paths_leaves]
    if check_stored is not None:
        check_stored([".".join(key_path_names(path)) for path, _ in paths_leaves], leaves)
    del paths_leaves
    for i, leaf in enumerate(leaves):
        if place_as is not None and is_float_dtype(leaf.dtype):
            leaf = leaf.astype(place_as)
        # Drops the host copy of leaf i before reading leaf i + 1 (sharded leaves stay as read).
        leaves[i] = jnp.asarray(leaf)
    nnx.replace_by_pure_dict(state, jax.tree.unflatten(treedef, leaves))
    return nnx.merge(graphdef, state)
