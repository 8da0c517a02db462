"""The training recipe: hyperparameters of one drafter training run.

The recipe holds what the optimizer and the loss need; the drafter's shape (block size, depth,
anchors per sequence) is the drafter config's, so each value has one home. Named recipes (the
released ones and the tiny CPU one) are values in `configs/recipes.py` and `configs/train_*.py`.
"""

from __future__ import annotations

import dataclasses

from dspark_jax.config import DTYPES, ConfigError


@dataclasses.dataclass(frozen=True)
class TrainRecipe:
    """Hyperparameters of one drafter training run.

    Upstream (DeepSpec) pairs these with AdamW over float32 master weights and a learning rate
    that rises linearly for int(warmup_ratio * total_steps) steps, then follows a cosine to 0.
    `global_batch_size` counts sequences per optimizer step; `max_length` is in tokens; the loss
    is ce_weight * CE + l1_weight * L1 + confidence_weight * BCE with per-position weights
    exp(-k / loss_decay_gamma).
    """

    learning_rate: float
    warmup_ratio: float
    weight_decay: float
    dtype: str
    global_batch_size: int
    num_epochs: int
    max_grad_norm: float
    max_length: int
    loss_decay_gamma: float
    ce_weight: float
    l1_weight: float
    confidence_weight: float
    seed: int

    def __post_init__(self):
        positive = (
            "learning_rate",
            "global_batch_size",
            "num_epochs",
            "max_grad_norm",
            "max_length",
            "loss_decay_gamma",
        )
        bad = [f"{name}={getattr(self, name)}" for name in positive if not getattr(self, name) > 0]
        if bad:
            raise ConfigError(f"TrainRecipe fields must be positive: {', '.join(bad)}")
        non_negative = ("weight_decay", "ce_weight", "l1_weight", "confidence_weight")
        bad = [f"{name}={getattr(self, name)}" for name in non_negative if getattr(self, name) < 0]
        if bad:
            raise ConfigError(f"TrainRecipe fields must be >= 0: {', '.join(bad)}")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {DTYPES}")


def dflash_recipe(recipe: TrainRecipe) -> TrainRecipe:
    """DeepSpec's DFlash variant of `recipe`: the same run with cross-entropy only (the drafter
    has no Markov or confidence head to train)."""
    return dataclasses.replace(recipe, ce_weight=1.0, l1_weight=0.0, confidence_weight=0.0)
