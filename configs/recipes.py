"""The released training recipe as a value (DeepSpec config/dspark/dspark_qwen3_4b*.py).

The drafter's shape in that recipe (block 7, 5 layers, 512 anchors per sequence) is in the drafter
configs of `qwen3.py`."""

from __future__ import annotations

from dspark_jax.training.recipe import TrainRecipe, dflash_recipe

# DeepSpec config/dspark/dspark_qwen3_4b*.py, the recipe of the released drafters.
DSPARK_RECIPE = TrainRecipe(
    learning_rate=6e-4,
    warmup_ratio=0.04,
    weight_decay=0.0,
    dtype="bfloat16",
    global_batch_size=512,
    num_epochs=10,
    max_grad_norm=1.0,
    max_length=4096,
    loss_decay_gamma=4.0,
    ce_weight=0.1,
    l1_weight=0.9,
    confidence_weight=1.0,
    seed=42,
)
DFLASH_RECIPE = dflash_recipe(DSPARK_RECIPE)
