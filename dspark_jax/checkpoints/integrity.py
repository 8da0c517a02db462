"""Whether loaded parameters can be trusted: all finite, and the same bits that were converted.

One jitted program per parameter tree computes, for every leaf, whether it is finite and a
position-weighted checksum of its bits, where the parameters already live (no host copy). The
weights are odd, so changing any one element always changes its leaf's checksum; the digest of
all leaves' checksums is recorded at conversion and compared at load. That catches damaged or
edited files at the cost of one pass over the parameters, cheap enough to run on every load. (The
drafter also keeps its sha256 fingerprint, which STS artifacts are tied to; that one is computed
on the host.)
"""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.checkpoints.convert import key_path_names
from dspark_jax.checkpoints.safetensors_io import CheckpointError

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}
_GOLDEN = 0x9E3779B1  # odd, so i -> i * _GOLDEN is a bijection mod 2**32


def _leaf_summary(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(all finite, checksum) of one leaf: sum_i bits_i * (2 i _GOLDEN + 1) mod 2**32."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    bits = jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)
    bits = bits.reshape(-1)
    index = jnp.arange(bits.shape[0], dtype=jnp.uint32)
    weights = index * jnp.uint32(_GOLDEN) * jnp.uint32(2) + jnp.uint32(1)
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
    return finite, jnp.sum(bits * weights, dtype=jnp.uint32)


@jax.jit
def _summaries(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    finite, checksums = zip(*(_leaf_summary(x) for x in leaves), strict=True)
    return jnp.stack(finite), jnp.stack(checksums)


# What a refusal says non-finite weights would cost, unless its caller says what to do instead.
_DECODING = "decoding from it would not follow the model"


def check_parameters(model: nnx.Module, what: str, instead: str = _DECODING) -> str:
    """Raises CheckpointError naming `what` (e.g. "the drafter at PATH") and the parameters that
    hold NaN or infinity, then `instead` (what to do, or what it would cost); returns the
    checksum digest of the parameters (hex)."""
    return check_tree(nnx.to_pure_dict(nnx.state(model)), what, instead)


def check_tree(params, what: str, instead: str = _DECODING) -> str:
    """`check_parameters` of a pytree of arrays (a train state's parameters, which may be
    sharded over the devices of several processes: each process calls it)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    names = [".".join(key_path_names(path)) for path, _ in leaves]
    arrays = [leaf for _, leaf in leaves]
    finite_l, checksum_l = jax.device_get(_summaries(arrays))
    return _digest(names, arrays, finite_l, checksum_l, what, instead)


# Elements a host checksum reads at a time (bounds its temporaries to a few hundred MB).
_HOST_CHUNK = 1 << 24


def _host_leaf_summary(x: np.ndarray) -> tuple[bool, int]:
    """`_leaf_summary` of a host array, the same bits: for a leaf read into host memory, to be
    checked before it is cast and placed (so the device never holds it as stored)."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        x = x.astype(np.uint8)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[x.dtype.itemsize]
    bits = x.reshape(-1).view(unsigned)
    total = np.uint32(0)
    with np.errstate(over="ignore"):
        for start in range(0, bits.shape[0], _HOST_CHUNK):
            part = bits[start : start + _HOST_CHUNK].astype(np.uint32)
            index = np.arange(start, start + part.shape[0], dtype=np.uint64).astype(np.uint32)
            weights = index * np.uint32(_GOLDEN) * np.uint32(2) + np.uint32(1)
            total = np.uint32(total + np.sum(part * weights, dtype=np.uint32))
    # Integers and bools are finite; every other kind is a float (bfloat16 is kind "V").
    finite = x.dtype.kind in "biu" or bool(np.all(np.isfinite(x)))
    return finite, int(total)


def check_host_leaves(
    names: list[str], arrays: list[np.ndarray], what: str, instead: str = _DECODING
) -> str:
    """`check_tree` of leaves in host memory, in the order `check_tree` flattens their tree."""
    finite_l, checksum_l = zip(*(_host_leaf_summary(a) for a in arrays), strict=True)
    return _digest(names, arrays, finite_l, checksum_l, what, instead)


def _digest(names, arrays, finite_l, checksum_l, what: str, instead: str) -> str:
    bad = [name for name, ok in zip(names, finite_l, strict=True) if not ok]
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise CheckpointError(
            f"{what}: parameters hold NaN or infinite values ({shown}); the checkpoint is "
            f"damaged or diverged in training, and {instead}"
        )
    digest = hashlib.sha256()
    for name, array, checksum in zip(names, arrays, checksum_l, strict=True):
        digest.update(json.dumps([name, np.dtype(array.dtype).name, list(array.shape)]).encode())
        digest.update(int(checksum).to_bytes(4, "little"))
    return digest.hexdigest()
