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
