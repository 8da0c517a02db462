"""Loads the golden fixtures of the PyTorch reference vendored under tests/fixtures."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from dspark_jax.checkpoints.convert import drafter_from_torch, target_from_torch
from dspark_jax.checkpoints.safetensors_io import SafetensorsFolder
from dspark_jax.config import DrafterConfig, Qwen3Config, read_config_json

FIXTURES = Path(__file__).parent / "fixtures"
VARIANTS = ("vanilla", "gated")


def fixture_dir(variant: str) -> Path:
    return FIXTURES / f"deepspec-tiny-{variant}"


@functools.cache
def load_pair(variant: str):
    """(target, drafter) converted from the fixture's PyTorch checkpoints."""
    root = fixture_dir(variant)
    target_cfg = Qwen3Config.from_hf(read_config_json(root / "target"))
    drafter_cfg = DrafterConfig.from_hf(read_config_json(root / "draft"))
    target = target_from_torch(target_cfg, SafetensorsFolder(root / "target"))
    drafter = drafter_from_torch(drafter_cfg, SafetensorsFolder(root / "draft"))
    return target, drafter


def reference_arrays(variant: str) -> dict[str, np.ndarray]:
    return dict(np.load(fixture_dir(variant) / "reference.npz"))


def reference_traces(variant: str) -> dict:
    return json.loads((fixture_dir(variant) / "reference.json").read_text())


def max_rel_err(actual, expected) -> float:
    """max |a - e| / max |e|: relative error on the tensor's scale (near-zero entries included)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))
