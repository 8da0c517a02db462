"""Tiny training runs for the fixture target: a DSpark and a DFlash drafter trained on CPU in
minutes on the Python standard library's own source (the text the target was trained on).

    dspark-jax train --config tiny-dspark
"""

from __future__ import annotations

import dataclasses

from dspark_jax import embedded
from dspark_jax.configs.recipes import DSPARK_RECIPE
from dspark_jax.configs.tiny import TINY_VANILLA_DSPARK
from dspark_jax.training.recipe import dflash_recipe
from dspark_jax.training.trainer import TrainConfig

TINY_TARGET = str(embedded.TINY_TARGET)

# The released recipe scaled down to the fixture models and a few CPU minutes. max_length holds a
# built-in corpus piece (at most 255 bytes, so 255 byte tokens) and its end-of-turn token: no
# sequence is truncated.
TINY_RECIPE = dataclasses.replace(
    DSPARK_RECIPE,
    learning_rate=3e-3,
    dtype="float32",
    global_batch_size=8,
    num_epochs=1,
    max_length=256,
    seed=0,
)
TINY_DFLASH_RECIPE = dflash_recipe(TINY_RECIPE)

# The fixture drafter (2 layers, block 7) with fewer anchors per sequence for CPU.
TINY_DSPARK_DRAFTER = dataclasses.replace(TINY_VANILLA_DSPARK, num_anchors=32)
TINY_DFLASH_DRAFTER = dataclasses.replace(
    TINY_DSPARK_DRAFTER,
    markov_rank=0,
    enable_confidence_head=False,
    confidence_head_with_markov=False,
)

_COMMON = dict(
    target=TINY_TARGET,
    data=("builtin:python-stdlib",),
    eval_data=("builtin:python-stdlib-eval",),
    num_steps=400,
    anchors_per_chunk=16,
    log_every=20,
    eval_batches=4,
    save_every=200,
    keep_checkpoints=2,
)

TRAIN_CONFIGS = {
    "tiny-dspark": TrainConfig(
        name="tiny-dspark", drafter=TINY_DSPARK_DRAFTER, recipe=TINY_RECIPE, **_COMMON
    ),
    "tiny-dflash": TrainConfig(
        name="tiny-dflash", drafter=TINY_DFLASH_DRAFTER, recipe=TINY_DFLASH_RECIPE, **_COMMON
    ),
}
