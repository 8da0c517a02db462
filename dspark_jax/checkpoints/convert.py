"""PyTorch (Hugging Face / DeepSpec) weights <-> our NNX models.

Our module tree mirrors the PyTorch names, so the key map is one rule: the NNX path joined with
dots is the PyTorch key, with `kernel` <-> `weight` transposed ([in, out] vs [out, in]) and
`embedding` <-> `weight` as is. Target keys carry the `model.` prefix except `lm_head`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.checkpoints.safetensors_io import CheckpointError
from dspark_jax.config import DrafterConfig, Qwen3Config
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.qwen3 import Qwen3


class TensorSource(Protocol):
    def keys(self): ...
    def shape(self, key: str) -> tuple[int, ...]: ...
    def dtype(self, key: str) -> np.dtype: ...
    def get(self, key: str) -> np.ndarray: ...


class DictSource:
    """A TensorSource over an in-memory {name: array} mapping (e.g. a torch state_dict)."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self._tensors = {k: np.asarray(v) for k, v in tensors.items()}

    def keys(self):
        return sorted(self._tensors)

    def shape(self, key):
        return tuple(self._tensors[key].shape)

    def dtype(self, key):
        return self._tensors[key].dtype

    def get(self, key):
        return self._tensors[key]


def _torch_key(path: tuple, prefix: str) -> tuple[str, bool]:
    """(PyTorch key, whether the array is transposed) for an NNX parameter path."""
    *module, leaf = (str(p) for p in path)
    transpose = leaf == "kernel"
    name = ".".join(module + ["bias" if leaf == "bias" else "weight"])
    if prefix and module[0] != "lm_head":
        name = prefix + name
    return name, transpose


def _path_tuple(key_path) -> tuple:
    out = []
    for k in key_path:
        out.append(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
    return tuple(out)


def load_from_torch(model_ctor, source: TensorSource, prefix: str, *, ignore=()) -> nnx.Module:
    """Builds a model whose parameters come from `source`, checking every key and shape first.

    `model_ctor(param_dtype)` makes the module; it is evaluated abstractly (no allocation), and
    each parameter takes the dtype stored in the checkpoint so the round trip is bit exact.
    """
    abstract = nnx.eval_shape(lambda: model_ctor(None))
    graphdef, state = nnx.split(abstract)
    flat = {
        _path_tuple(p): v
        for p, v in jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )[0]
    }
    expected = {}
    for path, var in flat.items():
        key, transpose = _torch_key(path, prefix)
        expected[key] = (path, transpose, var)
    available = set(source.keys())
    missing = sorted(set(expected) - available)
    unexpected = sorted(available - set(expected) - set(ignore))
    mismatched = []
    for key, (_, transpose, var) in expected.items():
        if key not in available:
            continue
        want = tuple(var.shape)
        want = want[::-1] if transpose else want
        found = tuple(source.shape(key))
        if found != want:
            mismatched.append(f"{key}: expected {list(want)}, found {list(found)}")
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): {'; '.join(mismatched)}")
    if problems:
        raise CheckpointError("checkpoint does not match the model config: " + " | ".join(problems))

    values = {}
    for key, (path, transpose, _) in expected.items():
        array = source.get(key)
        values[path] = jnp.asarray(array.T if transpose else array)

    def fill(key_path, var):
        return var.replace(values[_path_tuple(key_path)])

    filled = jax.tree_util.tree_map_with_path(
        fill, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return nnx.merge(graphdef, filled)


def export_to_torch(model: nnx.Module, prefix: str) -> dict[str, np.ndarray]:
    """The model's parameters as PyTorch-layout numpy arrays keyed like the reference."""
    _, state = nnx.split(model)
    out = {}
    for key_path, var in jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]:
        key, transpose = _torch_key(_path_tuple(key_path), prefix)
        array = np.asarray(jax.device_get(var[...]))
        out[key] = np.ascontiguousarray(array.T if transpose else array)
    return out


def target_from_torch(cfg: Qwen3Config, source: TensorSource) -> Qwen3:
    """A Qwen3 target from Hugging Face `Qwen3ForCausalLM` weights."""
    ignore = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
    return load_from_torch(
        lambda dt: Qwen3(cfg, rngs=nnx.Rngs(0), param_dtype=_source_dtype(source)),
        source, "model.", ignore=ignore,
    )


def drafter_from_torch(cfg: DrafterConfig, source: TensorSource) -> DSparkDrafter:
    """A drafter from DeepSpec / released `dspark_*` / `dflash_*` weights."""
    return load_from_torch(
        lambda dt: DSparkDrafter(cfg, rngs=nnx.Rngs(0), param_dtype=_source_dtype(source)),
        source, "",
    )


def _source_dtype(source: TensorSource):
    """The floating dtype of the checkpoint (its first floating tensor)."""
    for key in source.keys():
        dtype = np.dtype(source.dtype(key))
        if dtype.kind == "f" or dtype.name == "bfloat16":
            return jnp.dtype(dtype)
    raise CheckpointError("checkpoint holds no floating-point tensors")
