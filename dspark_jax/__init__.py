"""dspark-jax: DSpark confidence-scheduled speculative decoding in JAX/Flax.

The names most programs need are importable from here (README, "From Python")::

    from dspark_jax import EngineConfig, Request, generate, load_decoding_models
    from dspark_jax import TrainConfig, train    # docs/training.md, "Training from Python"

They are loaded on first use, so `import dspark_jax` alone (the CLI's first step) does not
import JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "load_decoding_models": "dspark_jax.checkpoints.converted",
    "DecodingModels": "dspark_jax.checkpoints.converted",
    "load_target": "dspark_jax.checkpoints.converted",
    "load_drafter": "dspark_jax.checkpoints.converted",
    "Engine": "dspark_jax.decoding.engine",
    "EngineConfig": "dspark_jax.decoding.engine",
    "EngineError": "dspark_jax.decoding.engine",
    "Batcher": "dspark_jax.decoding.batching",
    "Request": "dspark_jax.decoding.batching",
    "Result": "dspark_jax.decoding.batching",
    "generate": "dspark_jax.decoding.batching",
    "make_policy": "dspark_jax.decoding.policies",
    "PolicySwitch": "dspark_jax.decoding.policies",
    "SamplingConfig": "dspark_jax.sampling",
    "StsArtifact": "dspark_jax.calibration.sts",
    "encode_chat": "dspark_jax.tokenizer",
    "TrainConfig": "dspark_jax.training.trainer",
    "train": "dspark_jax.training.trainer",
}

__all__ = [  # the names of _EXPORTS, spelled out for tools that read __all__
    "__version__",
    "load_decoding_models",
    "DecodingModels",
    "load_target",
    "load_drafter",
    "Engine",
    "EngineConfig",
    "EngineError",
    "Batcher",
    "Request",
    "Result",
    "generate",
    "make_policy",
    "PolicySwitch",
    "SamplingConfig",
    "StsArtifact",
    "encode_chat",
    "TrainConfig",
    "train",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dspark_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from dspark_jax.calibration.sts import StsArtifact
    from dspark_jax.checkpoints.converted import (
        DecodingModels,
        load_decoding_models,
        load_drafter,
        load_target,
    )
    from dspark_jax.decoding.batching import Batcher, Request, Result, generate
    from dspark_jax.decoding.engine import Engine, EngineConfig, EngineError
    from dspark_jax.decoding.policies import PolicySwitch, make_policy
    from dspark_jax.sampling import SamplingConfig
    from dspark_jax.tokenizer import encode_chat
    from dspark_jax.training.trainer import TrainConfig, train
