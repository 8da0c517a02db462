"""Named configs give models of the published sizes (traced abstractly) and round-trip as JSON."""

import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import jax
import pytest
from flax import nnx
from safetensors import safe_open

from dspark_jax import configs
from dspark_jax.config import ConfigError, DrafterConfig, Qwen3Config, read_config_json
from dspark_jax.configs.qwen3 import (
    DRAFT_BLOCK_SIZE,
    DRAFT_NUM_LAYERS,
    TAPS_36_LAYERS,
    spaced_target_layers,
)
from dspark_jax.configs.recipes import DSPARK_RECIPE
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.training.recipe import TrainRecipe

FIXTURES = Path(__file__).parent / "fixtures"

# safetensors totals shown on the Hugging Face model pages of Qwen/Qwen3-{4B,8B,14B}.
PUBLISHED_TARGET_PARAMS = {
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200,
}
DRAFTERS = ("dspark-qwen3-4b", "dspark-qwen3-8b", "dspark-qwen3-14b")
# Real initialisation of the 14B target writes ~30 GB and takes minutes on this CPU; an abstract
# one traces shapes only (~3 s measured on a shared 2-core machine).
EVAL_SHAPE_SECONDS = 20.0


def _layer_closed_form(c: Qwen3Config) -> int:
    d, q_dim = c.hidden_size, c.num_attention_heads * c.head_dim
    kv_dim = c.num_key_value_heads * c.head_dim
    attention = d * q_dim + 2 * d * kv_dim + q_dim * d + 2 * c.head_dim  # + q_norm, k_norm
    mlp = 3 * d * c.intermediate_size
    return attention + mlp + 2 * d  # + input / post-attention norms


def _target_closed_form(c: Qwen3Config) -> int:
    embed = c.vocab_size * c.hidden_size
    lm_head = 0 if c.tie_word_embeddings else embed
    return embed + c.num_hidden_layers * _layer_closed_form(c) + c.hidden_size + lm_head


def _drafter_closed_form(dc: DrafterConfig) -> int:
    m = dc.model
    d, v, r = m.hidden_size, m.vocab_size, dc.markov_rank
    embed_and_lm_head = 2 * v * d
    layers = m.num_hidden_layers * _layer_closed_form(m)
    fc = len(dc.target_layer_ids) * d * d
    norms = 2 * d  # hidden_norm, norm
    markov = 2 * v * r  # W1 and W2, each [V, r]
    if r and dc.markov_head_type == "gated":
        markov += (d + r) * r + r  # gate_proj weight and bias (the tiny gated fixture)
    conf_in = d + (r if dc.confidence_head_with_markov else 0)
    confidence = conf_in + 1 if dc.enable_confidence_head else 0
    return embed_and_lm_head + layers + fc + norms + markov + confidence


@functools.cache
def _abstract(cfg: Qwen3Config | DrafterConfig) -> tuple[int, tuple, tuple, float]:
    """(param count, param leaves, all state leaves, seconds) of the model nnx.eval_shape traces."""
    if isinstance(cfg, DrafterConfig):
        build = lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    else:
        build = lambda: Qwen3(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    start = time.perf_counter()
    model = nnx.eval_shape(build)
    seconds = time.perf_counter() - start
    params = tuple(jax.tree.leaves(nnx.state(model, nnx.Param)))
    count = sum(math.prod(leaf.shape) for leaf in params)
    return count, params, tuple(jax.tree.leaves(nnx.state(model))), seconds


def _check_abstract(cfg: Qwen3Config | DrafterConfig) -> None:
    """Nothing was allocated: every state leaf is a shape, params have the config's dtype."""
    _, params, state, seconds = _abstract(cfg)
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in state), {
        type(leaf).__name__ for leaf in state
    }
    model_dtype = (cfg.model if isinstance(cfg, DrafterConfig) else cfg).dtype
    assert {str(leaf.dtype) for leaf in params} == {model_dtype}
    assert seconds < EVAL_SHAPE_SECONDS


@pytest.mark.parametrize("name", sorted(PUBLISHED_TARGET_PARAMS))
def test_target_matches_published_count(name):
    cfg = configs.get(name)
    assert _target_closed_form(cfg) == PUBLISHED_TARGET_PARAMS[name]
    _check_abstract(cfg)
    assert _abstract(cfg)[0] == PUBLISHED_TARGET_PARAMS[name]


@pytest.mark.parametrize("name", DRAFTERS)
def test_drafter_matches_closed_form(name):
    cfg = configs.get(name)
    _check_abstract(cfg)
    assert _abstract(cfg)[0] == _drafter_closed_form(cfg)


def test_qwen3_4b_drafter_is_1_39b():
    # embed + lm_head 777,912,320; 5 layers 504,654,080; fc 32,768,000; norms 5,120;
    # Markov W1 + W2 77,791,232; confidence 2,560 + 256 + 1.
    cfg = configs.get("dspark-qwen3-4b")
    assert _drafter_closed_form(cfg) == 1_393_133_569
    assert _abstract(cfg)[0] == 1_393_133_569


@pytest.mark.parametrize("size", ["4b", "8b", "14b"])
def test_dflash_drops_only_the_heads(size):
    dspark, dflash = configs.get(f"dspark-qwen3-{size}"), configs.get(f"dflash-qwen3-{size}")
    d, v, r = dspark.model.hidden_size, dspark.model.vocab_size, dspark.markov_rank
    assert _drafter_closed_form(dflash) == _drafter_closed_form(dspark) - 2 * v * r - (d + r + 1)
    _check_abstract(dflash)
    assert _abstract(dflash)[0] == _drafter_closed_form(dflash)


@pytest.mark.parametrize("flavour", ["vanilla", "gated"])
def test_tiny_models_match_fixture_checkpoints(flavour):
    """The tiny configs build models with exactly as many weights as the fixture files hold."""
    for role, name in (("target", f"tiny-{flavour}-target"), ("draft", f"tiny-{flavour}-dspark")):
        cfg = configs.get(name)
        weights = FIXTURES / f"deepspec-tiny-{flavour}" / role / "model.safetensors"
        with safe_open(weights, "np") as f:
            stored = sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())
        assert _abstract(cfg)[0] == stored, name
        closed = _drafter_closed_form(cfg) if role == "draft" else _target_closed_form(cfg)
        assert closed == stored, name


@pytest.mark.parametrize("flavour", ["vanilla", "gated"])
def test_tiny_configs_equal_fixture_configs(flavour):
    folder = FIXTURES / f"deepspec-tiny-{flavour}"
    target = Qwen3Config.from_hf(read_config_json(folder / "target"))
    drafter = DrafterConfig.from_hf(read_config_json(folder / "draft"))
    assert configs.get(f"tiny-{flavour}-target") == target
    assert configs.get(f"tiny-{flavour}-dspark") == drafter
    drafter.check_target(target)


@pytest.mark.parametrize("name", [n for n in configs.names() if not n.endswith("-recipe")])
def test_named_config_round_trips_through_json(name):
    cfg = configs.get(name)
    parse = DrafterConfig.from_hf if isinstance(cfg, DrafterConfig) else Qwen3Config.from_hf
    assert parse(json.loads(json.dumps(cfg.to_hf()))) == cfg


def test_released_drafters_fit_their_targets():
    for size in ("4b", "8b", "14b"):
        target = configs.get(f"qwen3-{size}")
        for kind in ("dspark", "dflash"):
            drafter = configs.get(f"{kind}-qwen3-{size}")
            drafter.check_target(target)
            assert drafter.model.num_hidden_layers == DRAFT_NUM_LAYERS == 5
            assert drafter.block_size == DRAFT_BLOCK_SIZE == 7
            assert drafter.num_anchors == 512
            assert drafter.mask_token_id == 151669
            assert not drafter.model.tie_word_embeddings
            assert (drafter.model.num_attention_heads, drafter.model.num_key_value_heads) == (
                target.num_attention_heads,
                target.num_key_value_heads,
            )
    assert configs.get("qwen3-4b").tie_word_embeddings
    assert not configs.get("qwen3-8b").tie_word_embeddings
    assert not configs.get("qwen3-14b").tie_word_embeddings


def test_tap_layer_rule():
    assert spaced_target_layers(36) == TAPS_36_LAYERS == (1, 9, 17, 25, 33)
    assert configs.get("dspark-qwen3-14b").target_layer_ids == (1, 10, 19, 28, 37)
    with pytest.raises(ConfigError, match="cannot space 5 tap layers"):
        spaced_target_layers(6)


def test_registry_lists_known_names_for_unknown_one():
    assert "dspark-qwen3-4b" in configs.names()
    assert configs.get("dspark-recipe") is DSPARK_RECIPE
    with pytest.raises(configs.UnknownConfigError, match="known configs: .*dspark-qwen3-4b"):
        configs.get("dspark-qwen3-5b")
    with pytest.raises(ValueError):
        configs.get("qwen3")


def test_recipe_rejects_bad_values():
    assert isinstance(DSPARK_RECIPE, TrainRecipe)
    with pytest.raises(ConfigError, match="learning_rate=0"):
        dataclasses.replace(DSPARK_RECIPE, learning_rate=0)
    with pytest.raises(ConfigError, match="warmup_ratio"):
        dataclasses.replace(DSPARK_RECIPE, warmup_ratio=1.5)
    with pytest.raises(ConfigError, match="weight_decay"):
        dataclasses.replace(DSPARK_RECIPE, weight_decay=-0.1)
