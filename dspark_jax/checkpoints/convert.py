"""PyTorch (Hugging Face / DeepSpec) weights <-> our NNX models.

Our module tree mirrors the PyTorch names, so the key map is one rule: the NNX path joined with
dots is the PyTorch key, with `kernel` <-> `weight` transposed ([in, out] vs [out, in]) and
`embedding` <-> `weight` as is. Target keys carry the `model.` prefix except `lm_head`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.checkpoints.safetensors_io import CheckpointError
from dspark_jax.config import DrafterConfig, Qwen3Config
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.sharding import host_value, put_host_array, state_shardings


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


def key_path_names(key_path) -> tuple[str, ...]:
    """A pytree key path as strings, whatever the key kinds (dict keys, list indices, attributes).

    List indices and the int keys of pure dicts both become "0", as Orbax metadata spells them.
    """
    return tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in key_path)


def shape_problems(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    ignore: Iterable[str] = (),
) -> list[str]:
    """Missing keys, unexpected keys (less `ignore`) and shape mismatches, one line per kind,
    each with its count and at most `_SHOWN` names (a checkpoint saved with other key names
    misses every key: a full list ran to tens of kB)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected) - set(ignore))
    mismatched = [
        f"{key}: expected {list(want)}, found {list(found[key])}"
        for key, want in sorted(expected.items())
        if key in found and tuple(found[key]) != tuple(want)
    ]
    problems = []
    for kind, items, sep in (
        ("missing keys", missing, ", "),
        ("unexpected keys", unexpected, ", "),
        ("shape mismatches", mismatched, "; "),
    ):
        if items:
            problems.append(f"{kind} ({len(items)}): {_capped(items, sep)}")
    return problems


_SHOWN = 8  # names a problem line lists before "and N more"


def _capped(items: list[str], sep: str = ", ") -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return sep.join(items[:_SHOWN]) + more


def dtype_problems(dtypes: Mapping[str, np.dtype]) -> list[str]:
    """Tensors a model cannot hold as parameters: non-floating ones, and floating ones that
    differ from the rest (the model holds one parameter dtype). One line per kind."""
    dtypes = {key: np.dtype(d) for key, d in dtypes.items()}
    problems = []
    other = sorted(key for key, d in dtypes.items() if not is_float_dtype(d))
    if other:
        shown = _capped([f"{key} ({dtypes[key].name})" for key in other])
        problems.append(f"non-floating parameters ({len(other)}): {shown}")
    floats = Counter(d.name for d in dtypes.values() if is_float_dtype(d))
    if len(floats) > 1:
        (common, count), *_ = floats.most_common()
        odd = sorted(k for k, d in dtypes.items() if is_float_dtype(d) and d.name != common)
        shown = _capped([f"{key} ({dtypes[key].name})" for key in odd])
        problems.append(
            f"mixed floating dtypes: {count} parameters are {common}, but {shown}; the "
            "model holds one dtype (give one to cast every parameter to, e.g. --dtype "
            f"{common}, if the mix is intended)"
        )
    return problems


def is_float_dtype(dtype) -> bool:
    """Whether `dtype` is floating, bfloat16 and the other ml_dtypes floats included."""
    return jnp.issubdtype(np.dtype(dtype), jnp.floating)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _torch_key(names: tuple[str, ...], prefix: str) -> tuple[str, bool]:
    """(PyTorch key, whether the array is transposed) for an NNX parameter path."""
    *module, leaf = names
    name = ".".join(module + ["bias" if leaf == "bias" else "weight"])
    if prefix and module[0] != "lm_head":
        name = prefix + name
    return name, leaf == "kernel"


def load_from_torch(
    model_ctor: Callable[[], nnx.Module], source: TensorSource, prefix: str, *, ignore=(), mesh=None
) -> nnx.Module:
    """Builds a model whose parameters come from `source`, checking every key, shape and dtype
    first (`dtype_problems`: every parameter floating, all of one dtype).

    `model_ctor()` makes the module; it is evaluated abstractly (no allocation), so the arrays
    held afterwards are exactly those read from `source`. With a `mesh`, each tensor goes from
    host memory straight into its rules-table sharding (`dspark_jax.sharding`): no device ever
    holds a whole copy of a sharded weight.
    """
    graphdef, state = nnx.split(nnx.eval_shape(model_ctor))
    shardings = {}
    if mesh is not None:
        pure = nnx.to_pure_dict(state_shardings(state, mesh, strict=True))
        for key_path, sharding in jax.tree_util.tree_flatten_with_path(pure)[0]:
            shardings[key_path_names(key_path)] = sharding
    expected = {}  # torch key -> (parameter path, transposed, expected torch shape)
    for key_path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_variable)[0]:
        path = key_path_names(key_path)
        key, transpose = _torch_key(path, prefix)
        expected[key] = (path, transpose, tuple(var.shape)[::-1] if transpose else var.shape)
    problems = shape_problems(
        {key: shape for key, (_, _, shape) in expected.items()},
        {key: tuple(source.shape(key)) for key in source.keys()},
        ignore,
    )
    if problems:
        raise CheckpointError("checkpoint does not match the model config: " + " | ".join(problems))
    problems = dtype_problems({key: source.dtype(key) for key in expected})
    if problems:
        raise CheckpointError("checkpoint tensors of the wrong dtype: " + " | ".join(problems))

    values = {}
    for key, (path, transpose, _) in expected.items():
        array = source.get(key)
        array = array.T if transpose else array
        values[path] = put_host_array(array, shardings[path]) if mesh else jnp.asarray(array)

    def fill(key_path, var):
        return var.replace(values[key_path_names(key_path)])

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state, is_leaf=_is_variable))


def export_to_torch(model: nnx.Module, prefix: str) -> dict[str, np.ndarray]:
    """The model's parameters as PyTorch-layout numpy arrays keyed like the reference."""
    _, state = nnx.split(model)
    out = {}
    for key_path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_variable)[0]:
        key, transpose = _torch_key(key_path_names(key_path), prefix)
        array = np.asarray(host_value(var[...]))
        out[key] = np.ascontiguousarray(array.T if transpose else array)
    return out


def torch_shapes(model: nnx.Module, prefix: str) -> dict[str, tuple[int, ...]]:
    """The keys and shapes `export_to_torch` gives `model` (which may be abstract)."""
    _, state = nnx.split(model)
    out = {}
    for key_path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_variable)[0]:
        key, transpose = _torch_key(key_path_names(key_path), prefix)
        out[key] = tuple(reversed(var.shape)) if transpose else tuple(var.shape)
    return out


def target_from_torch(cfg: Qwen3Config, source: TensorSource, mesh=None) -> Qwen3:
    """A Qwen3 target from Hugging Face `Qwen3ForCausalLM` weights, in the checkpoint's dtype
    (sharded over `mesh` when given)."""
    ignore = (_HEAD,) if cfg.tie_word_embeddings else ()
    dtype = _source_dtype(source)
    model = load_from_torch(
        lambda: Qwen3(cfg, rngs=nnx.Rngs(0), param_dtype=dtype),
        source,
        "model.",
        ignore=ignore,
        mesh=mesh,
    )
    if cfg.tie_word_embeddings and _HEAD in source.keys():
        _check_tied_head(source.get(_HEAD), host_value(model.embed_tokens.embedding[...]))
    return model


_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"


def _check_tied_head(head: np.ndarray, embed: np.ndarray) -> None:
    """Refuses a head stored beside a tied embedding unless it is a copy of it: the model would
    compute its logits with the embedding, not with the head the file holds (transformers uses
    the file's), and so be another model than the checkpoint."""
    if head.shape == embed.shape and np.array_equal(head, embed):
        return
    differs = f"has shape {list(head.shape)}" if head.shape != embed.shape else "differs"
    raise CheckpointError(
        f"config.json sets tie_word_embeddings, but {_HEAD} {differs} from {_EMBED} "
        f"({list(embed.shape)}): the head would be replaced by the embedding. If the "
        f"checkpoint was saved untied, set tie_word_embeddings to false in config.json; if "
        f"{_HEAD} is stale, remove it from the file"
    )


def drafter_from_torch(cfg: DrafterConfig, source: TensorSource, mesh=None) -> DSparkDrafter:
    """A drafter from DeepSpec / released `dspark_*` / `dflash_*` weights, in their dtype
    (sharded over `mesh` when given)."""
    dtype = _source_dtype(source)
    return load_from_torch(
        lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0), param_dtype=dtype), source, "", mesh=mesh
    )


def _source_dtype(source: TensorSource):
    """The dtype of the checkpoint's first floating tensor; models load in it (bit exact)."""
    for key in source.keys():
        if is_float_dtype(source.dtype(key)):
            return jnp.dtype(source.dtype(key))
    raise CheckpointError("checkpoint holds no floating-point tensors")
