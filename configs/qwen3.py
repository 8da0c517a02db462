"""Qwen3 targets (values of the Hugging Face `config.json` files) and their block-7 drafters."""

from __future__ import annotations

import dataclasses

from dspark_jax.config import ConfigError, DrafterConfig, Qwen3Config, RopeConfig

# Qwen3 chat models end a turn with <|im_end|>; config.json lists only that id
# (generation_config.json adds <|endoftext|> 151643).
QWEN3_EOS_TOKEN_ID = 151645
# Not a tokenizer token: a spare embedding row past the added tokens, used by DeepSpec.
QWEN3_MASK_TOKEN_ID = 151669

DRAFT_BLOCK_SIZE = 7
DRAFT_NUM_LAYERS = 5
DRAFT_NUM_TAPS = 5


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=151_936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=1_000_000.0),
        tie_word_embeddings=tied,
        max_position_embeddings=40_960,
        eos_token_id=QWEN3_EOS_TOKEN_ID,
        dtype="bfloat16",
    )


QWEN3_4B = _qwen3(hidden=2560, intermediate=9728, layers=36, heads=32, tied=True)
QWEN3_8B = _qwen3(hidden=4096, intermediate=12288, layers=36, heads=32, tied=False)
QWEN3_14B = _qwen3(hidden=5120, intermediate=17408, layers=40, heads=40, tied=False)


def spaced_target_layers(num_target_layers: int, count: int = DRAFT_NUM_TAPS) -> tuple[int, ...]:
    """`count` evenly spaced tap layers from layer 1 to num_target_layers - 3.

    The rule behind the released [1, 9, 17, 25, 33] of the 36-layer targets; the last layer
    that may be tapped is num_target_layers - 2, and the released files stop one short of it.
    """
    first, last = 1, num_target_layers - 3
    if count < 2 or last - first < count - 1:
        raise ConfigError(
            f"cannot space {count} tap layers over layers {first}..{last} "
            f"of a {num_target_layers}-layer target"
        )
    return tuple(first + round(i * (last - first) / (count - 1)) for i in range(count))


def _drafter(
    target: Qwen3Config, target_layer_ids: tuple[int, ...], *, dspark: bool
) -> DrafterConfig:
    """The DeepSpec drafter for `target`: its backbone copies the target's shape with 5 layers.

    DFlash (as DeepSpec trains it) is the same backbone with markov_rank 0 and no confidence head.
    """
    return DrafterConfig(
        model=dataclasses.replace(
            target, num_hidden_layers=DRAFT_NUM_LAYERS, tie_word_embeddings=False
        ),
        block_size=DRAFT_BLOCK_SIZE,
        mask_token_id=QWEN3_MASK_TOKEN_ID,
        target_layer_ids=target_layer_ids,
        num_target_layers=target.num_hidden_layers,
        markov_rank=256 if dspark else 0,
        markov_head_type="vanilla",
        enable_confidence_head=dspark,
        confidence_head_with_markov=dspark,
        num_anchors=512,
    )


# As in the released drafter configs for the 36-layer targets.
TAPS_36_LAYERS = (1, 9, 17, 25, 33)
# Derived with spaced_target_layers(40), not read from a released DSpark config.json (it equals
# the list in DeepSpec's config/dflash/dflash_qwen3_14b.py training config).
TAPS_40_LAYERS = spaced_target_layers(40)

DSPARK_QWEN3_4B = _drafter(QWEN3_4B, TAPS_36_LAYERS, dspark=True)
DSPARK_QWEN3_8B = _drafter(QWEN3_8B, TAPS_36_LAYERS, dspark=True)
DSPARK_QWEN3_14B = _drafter(QWEN3_14B, TAPS_40_LAYERS, dspark=True)

DFLASH_QWEN3_4B = _drafter(QWEN3_4B, TAPS_36_LAYERS, dspark=False)
DFLASH_QWEN3_8B = _drafter(QWEN3_8B, TAPS_36_LAYERS, dspark=False)
DFLASH_QWEN3_14B = _drafter(QWEN3_14B, TAPS_40_LAYERS, dspark=False)
