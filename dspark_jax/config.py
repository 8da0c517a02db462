"""Frozen model configs built from (and written back to) Hugging Face `config.json` dicts.

Configs are hashable: they live inside Flax NNX graph definitions, which `jax.jit` treats as
static, so every field is an immutable scalar or tuple.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from dspark_jax.errors import UserError

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
DTYPES = ("float32", "bfloat16", "float16")


# The model_type of drafter config.json files we write: transformers does not know it, so its
# Auto classes refuse the drafter instead of loading it as a plain Qwen3 without its DSpark
# tensors. The released drafters say "qwen3"; both are read.
DRAFTER_MODEL_TYPE = "dspark"


class ConfigError(UserError):
    """A model or run config (config.json, a named config, a setting) that we cannot use."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; `rope_type` is "default" or "yarn"."""

    theta: float = 1_000_000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ("default", "yarn"):
            raise ConfigError(
                f"unsupported rope_type {self.rope_type!r}: only 'default' and 'yarn' are "
                "implemented"
            )
        if self.rope_type == "yarn" and self.original_max_position_embeddings is None:
            raise ConfigError("yarn RoPE needs original_max_position_embeddings")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> RopeConfig:
        """Reads `rope_parameters` (transformers >= 5) or the older `rope_theta`/`rope_scaling`."""
        params = dict(d.get("rope_parameters") or {})
        legacy = dict(d.get("rope_scaling") or {})
        if "rope_theta" not in params:
            params["rope_theta"] = d.get("rope_theta", 10_000.0)
        for key, value in legacy.items():
            params.setdefault("rope_type" if key == "type" else key, value)
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type == "yarn":
            max_pos = d.get("max_position_embeddings")
            original = params.get("original_max_position_embeddings")
            factor = params.get("factor")
            if factor is None:
                if not (max_pos and original):
                    raise ConfigError("yarn RoPE needs factor or both max/original positions")
                factor = max_pos / original
            return cls(
                theta=float(params["rope_theta"]),
                rope_type="yarn",
                factor=float(factor),
                original_max_position_embeddings=int(original) if original else None,
                beta_fast=float(params.get("beta_fast") or 32.0),
                beta_slow=float(params.get("beta_slow") or 1.0),
                attention_factor=params.get("attention_factor"),
                mscale=params.get("mscale"),
                mscale_all_dim=params.get("mscale_all_dim"),
                truncate=bool(params.get("truncate", True)),
            )
        return cls(theta=float(params["rope_theta"]), rope_type=rope_type)

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_theta": self.theta, "rope_type": self.rope_type}
        if self.rope_type == "yarn":
            out.update(
                factor=self.factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
            )
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, key) is not None:
                    out[key] = getattr(self, key)
            if not self.truncate:
                out["truncate"] = False
        return out

    def attention_scaling(self) -> float:
        """The factor transformers multiplies into cos/sin (1 for default RoPE)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)


# The shape of a model: what its step times depend on (not its weights, dtype or context).
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
# Sizes a model cannot have zero (or fewer) of; checked before anything divides by them.
_POSITIVE_SIZES = (*SHAPE_FIELDS, "max_position_embeddings")


def _refuse_unsupported_qwen3(d: dict[str, Any]) -> None:
    """Refuses the Qwen3 variants transformers would run and this port computes otherwise: an
    activation other than SiLU, and sliding-window attention (the port attends over the whole
    context). Both appear in released Qwen3 files only at their inert defaults."""
    act = d.get("hidden_act") or "silu"
    if act not in ("silu", "swish"):  # transformers maps both names to SiLU
        raise ConfigError(f"hidden_act {act!r} is not supported: Qwen3 models here use silu")
    layer_types = d.get("layer_types")
    if layer_types is not None and not isinstance(layer_types, list):
        raise ConfigError(f"config.json: layer_types must be a list, got {layer_types!r}")
    other = sorted({str(k) for k in layer_types or ()} - {"full_attention", "sliding_attention"})
    if other:
        raise ConfigError(f"layer_types {other} are not supported (full_attention only)")
    use_window = d.get("use_sliding_window") and d.get("sliding_window") is not None
    window = _int(d, "sliding_window") if use_window else None
    if window is None or window >= _int(d, "max_position_embeddings", 40_960):
        return  # transformers' rule: no window without use_sliding_window; none shorter
    layers = _int(d, "num_hidden_layers")
    if layer_types is None:  # as transformers fills it in: layers from max_window_layers on
        first = _int(d, "max_window_layers", 28)
        sliding = [i for i in range(layers) if i >= first]
    else:
        sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if sliding:
        raise ConfigError(
            f"sliding-window attention (use_sliding_window with sliding_window {window}, in "
            f"layers {sliding[0]}..{sliding[-1]}) is not supported: this port attends over the "
            "whole context"
        )


def _int(d: dict[str, Any], key: str, default: int | None = None) -> int:
    """`d[key]` (or `default` when absent or null) as an int; refuses strings, booleans and
    fractions, which int() would parse, truncate or reject with a traceback."""
    value = d.get(key)
    if value is None:
        value = default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config.json: {key} must be an integer, got {value!r}")
    return value


def _float(d: dict[str, Any], key: str, default: float) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"config.json: {key} must be a number, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """A Qwen3 decoder: the target model, and the shape of the drafter's backbone."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40_960
    eos_token_id: int | tuple[int, ...] | None = None
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in _POSITIVE_SIZES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not math.isfinite(self.rms_norm_eps) or self.rms_norm_eps <= 0:
            raise ConfigError(
                f"rms_norm_eps must be a finite number > 0, got {self.rms_norm_eps!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {DTYPES}")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """`eos_token_id` as a tuple (empty when the config names none)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def with_dtype(self, dtype: str) -> Qwen3Config:
        """This config computing in `dtype`."""
        return dataclasses.replace(self, dtype=dtype)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Qwen3Config:
        model_type = d.get("model_type", "qwen3")
        if model_type != "qwen3":
            raise ConfigError(f"model_type {model_type!r} is not a Qwen3 model")
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            )
            if k not in d
        ]
        if missing:
            raise ConfigError(f"config.json lacks required fields: {', '.join(missing)}")
        _refuse_unsupported_qwen3(d)
        heads = _int(d, "num_attention_heads")
        eos = d.get("eos_token_id")
        dtype = str(d.get("dtype") or d.get("torch_dtype") or "bfloat16")
        head_dim = d.get("head_dim")
        if head_dim is None:
            hidden = _int(d, "hidden_size")
            if heads < 1 or hidden % heads:
                raise ConfigError(
                    f"config.json lacks head_dim and hidden_size {hidden} is not a multiple of "
                    f"num_attention_heads {heads}"
                )
            head_dim = hidden // heads
        return cls(
            vocab_size=_int(d, "vocab_size"),
            hidden_size=_int(d, "hidden_size"),
            intermediate_size=_int(d, "intermediate_size"),
            num_hidden_layers=_int(d, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=_int(d, "num_key_value_heads", heads),
            head_dim=_int({"head_dim": head_dim}, "head_dim"),
            rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
            rope=RopeConfig.from_hf(d),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=_int(d, "max_position_embeddings", 40_960),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            dtype=dtype.replace("torch.", ""),
        )

    def to_hf(self) -> dict[str, Any]:
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": None,
            "dtype": self.dtype,
            "eos_token_id": eos,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": 28,
            "model_type": "qwen3",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "pad_token_id": None,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": self.rope.to_hf(),
            "sliding_window": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
        }


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A DSpark (or DFlash: markov_rank 0, no confidence head) drafter.

    `model` is the drafter backbone's shape (num_hidden_layers = drafter layers); the rest are
    the DeepSpec fields. `num_target_layers` is the target's depth, used to reject taps of its
    final layer (transformers stores that one after the final norm).
    """

    model: Qwen3Config
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    num_anchors: int = 512

    def __post_init__(self):
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids is empty")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(
                f"unknown markov_head_type {self.markov_head_type!r}; "
                f"expected one of {', '.join(MARKOV_HEAD_TYPES)}"
            )
        for layer_id in self.target_layer_ids:
            if layer_id == self.num_target_layers - 1:
                raise ConfigError(
                    f"target_layer_ids contains {layer_id}, the target's final decoder layer: "
                    "transformers stores that hidden state after the final norm, so it is not a "
                    f"usable tap (valid ids: -1..{self.num_target_layers - 2})"
                )
            if not -1 <= layer_id < self.num_target_layers - 1:
                raise ConfigError(
                    f"target_layer_id {layer_id} is outside -1..{self.num_target_layers - 2} "
                    f"for a {self.num_target_layers}-layer target"
                )
        if not 0 <= self.mask_token_id < self.model.vocab_size:
            raise ConfigError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                f"(vocab_size {self.model.vocab_size})"
            )
        if self.markov_rank < 0:
            raise ConfigError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if (
            self.enable_confidence_head
            and self.confidence_head_with_markov
            and self.markov_rank == 0
        ):
            raise ConfigError(
                "confidence_head_with_markov needs a Markov head (markov_rank > 0); "
                "set confidence_head_with_markov to false for a rank-0 drafter"
            )

    @property
    def has_markov_head(self) -> bool:
        return self.markov_rank > 0

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids) * self.model.hidden_size

    def with_dtype(self, dtype: str) -> DrafterConfig:
        """This config with its backbone computing in `dtype`."""
        return dataclasses.replace(self, model=self.model.with_dtype(dtype))

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> DrafterConfig:
        # DFlash exports keep their drafter fields under `dflash_config`.
        extra = dict(d.get("dflash_config") or {})
        fields = {**extra, **{k: v for k, v in d.items() if k != "dflash_config"}}
        if fields.get("model_type") == DRAFTER_MODEL_TYPE:
            fields["model_type"] = "qwen3"
        missing = [
            k for k in ("block_size", "mask_token_id", "target_layer_ids") if k not in fields
        ]
        if missing:
            raise ConfigError(f"drafter config.json lacks: {', '.join(missing)}")
        is_dflash = "dflash_config" in d or "markov_rank" not in fields
        markov_rank = _int(fields, "markov_rank", 0)
        confidence = bool(fields.get("enable_confidence_head", not is_dflash))
        layer_ids = fields["target_layer_ids"]
        if not isinstance(layer_ids, list):
            raise ConfigError(f"config.json: target_layer_ids must be a list, got {layer_ids!r}")
        target_layer_ids = tuple(
            _int({"target_layer_ids": i}, "target_layer_ids") for i in layer_ids
        )
        num_target_layers = fields.get("num_target_layers")
        if num_target_layers is None:
            raise ConfigError(
                "drafter config.json lacks num_target_layers (the target's depth); add it or "
                "convert together with the target so it can be filled in"
            )
        return cls(
            model=Qwen3Config.from_hf(fields),
            block_size=_int(fields, "block_size"),
            mask_token_id=_int(fields, "mask_token_id"),
            target_layer_ids=target_layer_ids,
            num_target_layers=_int(fields, "num_target_layers"),
            markov_rank=markov_rank,
            markov_head_type=str(fields.get("markov_head_type", "vanilla")),
            enable_confidence_head=confidence,
            # Files of rank-0 drafters often omit this flag; it can only hold with a Markov head.
            confidence_head_with_markov=bool(
                fields.get("confidence_head_with_markov", confidence and markov_rank > 0)
            ),
            num_anchors=_int(fields, "num_anchors", 512),
        )

    def to_hf(self) -> dict[str, Any]:
        out = self.model.to_hf()
        out.update(
            architectures=["Qwen3DSparkModel"],
            block_size=self.block_size,
            confidence_head_with_markov=self.confidence_head_with_markov,
            enable_confidence_head=self.enable_confidence_head,
            markov_head_type=self.markov_head_type,
            markov_rank=self.markov_rank,
            mask_token_id=self.mask_token_id,
            num_anchors=self.num_anchors,
            num_target_layers=self.num_target_layers,
            target_layer_ids=list(self.target_layer_ids),
        )
        return dict(sorted(out.items()))

    def check_target(self, target: Qwen3Config) -> None:
        """Raises ConfigError when this drafter cannot run on `target`."""
        problems = []
        if target.hidden_size != self.model.hidden_size:
            problems.append(
                f"hidden_size: drafter {self.model.hidden_size}, target {target.hidden_size}"
            )
        if target.vocab_size != self.model.vocab_size:
            problems.append(
                f"vocab_size: drafter {self.model.vocab_size}, target {target.vocab_size}"
            )
        if target.num_hidden_layers != self.num_target_layers:
            problems.append(
                f"layer count: drafter expects a {self.num_target_layers}-layer target, "
                f"target has {target.num_hidden_layers}"
            )
        if problems:
            raise ConfigError("drafter and target disagree on " + "; ".join(problems))


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The JSON object in `path`, or in `path`/config.json when `path` is a folder."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"{path} does not exist")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return config
