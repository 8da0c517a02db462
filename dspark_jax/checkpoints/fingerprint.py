"""Fingerprints of drafter parameters: what ties an STS artifact or a conversion to one drafter."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np

from dspark_jax.checkpoints.convert import export_to_torch
from dspark_jax.models.drafter import DSparkDrafter


def fingerprint_tensors(tensors: Mapping[str, np.ndarray]) -> str:
    """sha256 hex digest over sorted (key, dtype, shape, raw bytes) of PyTorch-layout tensors.

    Equal for a safetensors file, our conversion of it (dtype "keep") and its export.
    """
    digest = hashlib.sha256()
    for key in sorted(tensors):
        array = np.ascontiguousarray(tensors[key])
        digest.update(json.dumps([key, array.dtype.name, list(array.shape)]).encode())
        digest.update(array.reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


def drafter_fingerprint(model: DSparkDrafter) -> str:
    """The fingerprint of a drafter's parameters (see `fingerprint_tensors`)."""
    return fingerprint_tensors(export_to_torch(model, ""))
