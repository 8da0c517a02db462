"""Named configs: Qwen3 targets, their DSpark/DFlash drafters, tiny test models, recipes.

Installed as the subpackage `dspark_jax.configs` (this folder is mapped into the wheel), so the
files import one another by absolute `dspark_jax.configs...` names: a copy of one, edited and
passed to `--config my_file.py`, works unchanged.

configs.get("dspark-qwen3-4b")  -> DrafterConfig
configs.get("qwen3-8b")         -> Qwen3Config
configs.get("dspark-recipe")    -> TrainRecipe
configs.names()                 -> every known name, sorted
"""

from __future__ import annotations

from dspark_jax.config import ConfigError, DrafterConfig, Qwen3Config
from dspark_jax.configs import qwen3, recipes, tiny
from dspark_jax.training.recipe import TrainRecipe

NamedConfig = Qwen3Config | DrafterConfig | TrainRecipe

_REGISTRY: dict[str, NamedConfig] = {
    "qwen3-4b": qwen3.QWEN3_4B,
    "qwen3-8b": qwen3.QWEN3_8B,
    "qwen3-14b": qwen3.QWEN3_14B,
    "dspark-qwen3-4b": qwen3.DSPARK_QWEN3_4B,
    "dspark-qwen3-8b": qwen3.DSPARK_QWEN3_8B,
    "dspark-qwen3-14b": qwen3.DSPARK_QWEN3_14B,
    "dflash-qwen3-4b": qwen3.DFLASH_QWEN3_4B,
    "dflash-qwen3-8b": qwen3.DFLASH_QWEN3_8B,
    "dflash-qwen3-14b": qwen3.DFLASH_QWEN3_14B,
    "tiny-vanilla-target": tiny.TINY_VANILLA_TARGET,
    "tiny-vanilla-dspark": tiny.TINY_VANILLA_DSPARK,
    "tiny-gated-target": tiny.TINY_GATED_TARGET,
    "tiny-gated-dspark": tiny.TINY_GATED_DSPARK,
    "dspark-recipe": recipes.DSPARK_RECIPE,
}


class UnknownConfigError(ConfigError):
    """A config name that is not in the registry."""


def names() -> tuple[str, ...]:
    """All registered config names, sorted."""
    return tuple(sorted(_REGISTRY))


def get(name: str) -> NamedConfig:
    """The config registered under `name` (configs are frozen, so callers may share it)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownConfigError(
            f"unknown config {name!r}; known configs: {', '.join(names())}"
        ) from None


__all__ = ["NamedConfig", "TrainRecipe", "UnknownConfigError", "get", "names"]
