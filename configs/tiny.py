"""Tiny configs equal to the golden fixtures in tests/fixtures (see its README).

A 4-layer byte-level target (vocab 288: bytes, EOS 256, mask 257, 30 unused rows) and a 2-layer
drafter tapping layers 0 and 2, in float32 like the fixtures; "vanilla" and "gated" name the
drafter's Markov head, and the vanilla fixture's target ties its embeddings. The vanilla pair's
weights ship with the package (`dspark_jax.embedded.TINY_DIR`).
"""

from __future__ import annotations

import dataclasses

from dspark_jax.config import DrafterConfig, Qwen3Config, RopeConfig

TINY_EOS_TOKEN_ID = 256
TINY_MASK_TOKEN_ID = 257

TINY_GATED_TARGET = Qwen3Config(
    vocab_size=288,
    hidden_size=96,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope=RopeConfig(theta=1_000_000.0),
    tie_word_embeddings=False,
    max_position_embeddings=4096,
    eos_token_id=TINY_EOS_TOKEN_ID,
    dtype="float32",
)
TINY_VANILLA_TARGET = dataclasses.replace(TINY_GATED_TARGET, tie_word_embeddings=True)


def _tiny_drafter(markov_head_type: str) -> DrafterConfig:
    return DrafterConfig(
        model=dataclasses.replace(TINY_GATED_TARGET, num_hidden_layers=2),
        block_size=7,
        mask_token_id=TINY_MASK_TOKEN_ID,
        target_layer_ids=(0, 2),
        num_target_layers=TINY_GATED_TARGET.num_hidden_layers,
        markov_rank=32,
        markov_head_type=markov_head_type,
        enable_confidence_head=True,
        confidence_head_with_markov=True,
        num_anchors=48,
    )


TINY_VANILLA_DSPARK = _tiny_drafter("vanilla")
TINY_GATED_DSPARK = _tiny_drafter("gated")
