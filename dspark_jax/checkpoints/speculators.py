"""vLLM's `speculators` layout of a DSpark drafter (`speculators_model_type: "dspark"`).

The layout follows the speculators library's `DSparkSpeculatorConfig` / `DSparkDraftModel`
(speculators 0.9.0), the form in which vLLM serves DSpark drafters:

    config.json         speculators fields (below) and the drafter's Qwen3 body as
                        `transformer_layer_config`
    model.safetensors   the reference tensors without `embed_tokens.weight` and `lm_head.weight`

Differences from the reference (DeepSpec) layout:

- The embedding and the LM head are not stored: the loader reads them from the verifier named in
  `speculators_config.verifier.name_or_path` (the drafter's are the target's, frozen in training).
  So the verifier must be a Hugging Face folder or hub id, and when it is a local folder the
  export checks that its tensors equal the drafter's.
- `aux_hidden_state_layer_ids` count layers as indices into transformers' `hidden_states`
  (0 = the embedding output), one more than DeepSpec's `target_layer_ids`.
- `sample_from_anchor: true`: the anchor is the first prediction position, as in DeepSpec (so a
  block of `block_size` drafts, `speculative_tokens` = block_size). DFlash drafters trained here
  are the same model with `markov_rank` 0 and no confidence head, written the same way.
- Markov and confidence head tensors keep their names and shapes (`markov_head.markov_w1/w2`,
  `gate_proj`, `joint_proj`, `confidence_head.proj`); the inputs are concatenated in the same
  order ([hidden; W1[prev]] for the gate and the confidence head, [state; W1[prev]; hidden] for
  the RNN head).

`check_speculators_config` holds a config to that schema (field names, types, allowed values and
the consistency the loader relies on); the tests also run the library's own loader when it is
installed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dspark_jax.checkpoints.convert import export_to_torch, torch_shapes
from dspark_jax.checkpoints.locate import MANIFEST, TARGET, read_manifest
from dspark_jax.checkpoints.orbax_io import abstract_model
from dspark_jax.checkpoints.safetensors_io import (
    SINGLE_FILE,
    CheckpointError,
    SafetensorsFolder,
    atomic_output_dir,
    save_safetensors,
)
from dspark_jax.config import DrafterConfig, read_config_json
from dspark_jax.models.drafter import DSparkDrafter

SPECULATORS_VERSION = "0.9.0"  # the version whose schema this layout follows
MODEL_TYPE = "dspark"
ARCHITECTURE = "DSparkDraftModel"
# Stored by the verifier, not by the drafter file.
VERIFIER_TENSORS = ("embed_tokens.weight", "lm_head.weight")
# Keys of the drafter's config.json that are not part of its Qwen3 body.
_DSPARK_KEYS = (
    "architectures",
    "block_size",
    "confidence_head_with_markov",
    "enable_confidence_head",
    "markov_head_type",
    "markov_rank",
    "mask_token_id",
    "num_anchors",
    "num_target_layers",
    "target_layer_ids",
)
_MARKOV_TYPES = ("vanilla", "gated", "rnn")


def speculators_config(
    cfg: DrafterConfig, verifier: str, verifier_architectures: list[str]
) -> dict[str, Any]:
    """The config.json of `cfg` in the speculators layout, `verifier` its target."""
    body = {k: v for k, v in cfg.to_hf().items() if k not in _DSPARK_KEYS}
    return {
        "architectures": [ARCHITECTURE],
        "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
        "block_size": cfg.block_size,
        "confidence_head_with_markov": cfg.confidence_head_with_markov,
        "draft_vocab_size": cfg.model.vocab_size,
        "dtype": cfg.model.dtype,
        "enable_confidence_head": cfg.enable_confidence_head,
        "markov_head_type": cfg.markov_head_type,
        "markov_rank": cfg.markov_rank,
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": True,
        "sliding_window_non_causal": False,
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": cfg.block_size,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"architectures": list(verifier_architectures), "name_or_path": verifier},
        },
        "speculators_model_type": MODEL_TYPE,
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": body,
    }


def _type_problems(config: Mapping[str, Any]) -> list[str]:
    expected: dict[str, tuple[type, ...]] = {
        "architectures": (list,),
        "aux_hidden_state_layer_ids": (list,),
        "block_size": (int,),
        "confidence_head_with_markov": (bool,),
        "draft_vocab_size": (int,),
        "enable_confidence_head": (bool,),
        "markov_head_type": (str,),
        "markov_rank": (int,),
        "mask_token_id": (int,),
        "sample_from_anchor": (bool,),
        "speculators_config": (dict,),
        "speculators_model_type": (str,),
        "speculators_version": (str,),
        "transformer_layer_config": (dict,),
    }
    problems = []
    for key, types in expected.items():
        if key not in config:
            problems.append(f"missing {key}")
        elif not isinstance(config[key], types) or (
            types == (int,) and isinstance(config[key], bool)
        ):
            problems.append(f"{key} is a {type(config[key]).__name__}")
    return problems


def check_speculators_config(config: Mapping[str, Any]) -> None:
    """Raises CheckpointError unless `config` is a valid speculators DSpark config.json."""
    problems = _type_problems(config)
    if problems:
        raise CheckpointError("not a speculators DSpark config: " + "; ".join(problems))
    body = config["transformer_layer_config"]
    spec = config["speculators_config"]
    if config["speculators_model_type"] != MODEL_TYPE:
        problems.append(f"speculators_model_type {config['speculators_model_type']!r}")
    if config["markov_head_type"] not in _MARKOV_TYPES:
        problems.append(f"markov_head_type {config['markov_head_type']!r}")
    if config["markov_rank"] < 0:
        problems.append("markov_rank < 0")
    if config["enable_confidence_head"] and config["confidence_head_with_markov"]:
        if config["markov_rank"] == 0:
            problems.append("confidence_head_with_markov needs markov_rank > 0")
    if body.get("model_type") != "qwen3":
        problems.append(f"transformer_layer_config.model_type {body.get('model_type')!r}")
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
        if not isinstance(body.get(key), int):
            problems.append(f"transformer_layer_config.{key} missing")
    if config["draft_vocab_size"] != body.get("vocab_size"):
        # A smaller draft vocabulary needs t2d / d2t maps, which DSpark drafters do not have.
        problems.append("draft_vocab_size differs from the vocabulary")
    ids = config["aux_hidden_state_layer_ids"]
    if not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        problems.append(f"aux_hidden_state_layer_ids {ids!r}")
    if spec.get("algorithm") != MODEL_TYPE:
        problems.append(f"speculators_config.algorithm {spec.get('algorithm')!r}")
    verifier = spec.get("verifier") or {}
    if not isinstance(verifier.get("name_or_path"), str) or not verifier["name_or_path"]:
        problems.append("speculators_config.verifier.name_or_path missing")
    methods = spec.get("proposal_methods") or []
    names = [m.get("proposal_type") for m in methods if isinstance(m, Mapping)]
    if spec.get("default_proposal_method") not in names:
        problems.append("default_proposal_method is not among proposal_methods")
    for m in methods:
        tokens = m.get("speculative_tokens") if isinstance(m, Mapping) else None
        if not isinstance(tokens, int) or not 1 <= tokens <= config["block_size"]:
            problems.append(f"speculative_tokens {tokens!r} not in 1..block_size")
    if problems:
        raise CheckpointError("invalid speculators DSpark config: " + "; ".join(problems))


def expected_tensors(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor a speculators DSpark file of `cfg` holds."""
    shapes = torch_shapes(abstract_model(cfg, cfg.model.dtype), "")
    return {k: s for k, s in shapes.items() if k not in VERIFIER_TENSORS}


def _local_verifier(verifier: str) -> Path | None:
    """The local folder of a verifier given as a path (None for a hub id)."""
    path = Path(verifier).expanduser()
    return path if path.is_dir() else None


def _hub_id_of(path: Path) -> str | None:
    """`owner/name` of a snapshot in the Hugging Face hub cache (`.../models--owner--name/...`)."""
    for part in path.parts:
        if part.startswith("models--") and part.count("--") >= 2:
            return part.removeprefix("models--").replace("--", "/", 1)
    return None


def _name_of(folder: Path) -> str:
    """A local verifier folder as its config names it: its hub id when it is a snapshot in the
    hub cache, else its absolute path (a relative one means nothing to a loader run elsewhere)."""
    return _hub_id_of(folder.resolve()) or str(folder.resolve())


def verifier_source(verifier: str) -> tuple[str, Path | None]:
    """(`verifier` as the speculators loader can read it, its local folder or None): a hub id as
    it is, a local folder as `_name_of` says, a converted dspark-jax folder replaced by the Hugging
    Face folder or hub id its target was converted from."""
    folder = _local_verifier(verifier)
    if folder is None:
        return verifier, None
    if not (folder / MANIFEST).is_file():
        return _name_of(folder), folder
    manifest = read_manifest(folder / MANIFEST)
    entry = manifest.get(TARGET)
    if not entry or not entry.get("source"):
        raise CheckpointError(
            f"{folder} holds no converted target to name as the verifier; give the target's "
            "Hugging Face folder or hub id"
        )
    source = Path(entry.get("resolved_source") or entry["source"]).expanduser()
    if source.is_dir():
        return _name_of(source), source
    # Moved or deleted since the conversion: named as recorded, nothing to check against.
    return _hub_id_of(source) or str(entry.get("resolved_source") or entry["source"]), None


def _verifier_tensors(folder: Path) -> dict[str, np.ndarray]:
    """embed_tokens and lm_head (the embedding when tied) of a Hugging Face Qwen3 folder."""
    st = SafetensorsFolder(folder)
    keys = set(st.keys())
    embed = st.get("model.embed_tokens.weight")
    head = st.get("lm_head.weight") if "lm_head.weight" in keys else embed
    return {"embed_tokens.weight": embed, "lm_head.weight": head}


def _check_verifier_tensor(name: str, theirs: np.ndarray, mine: np.ndarray, folder: Path) -> None:
    """Refuses a drafter whose `name` tensor (`mine`) is not the verifier's (`theirs`): the
    speculators loader replaces it with the verifier's. A drafter converted with --dtype holds
    the verifier's tensor cast, which is not it when the cast rounds (bfloat16 -> float16
    flushes values below 6e-8 to zero); that is said as such, not blamed on the target."""
    if theirs.shape == mine.shape and np.array_equal(
        np.asarray(theirs, np.float32), np.asarray(mine, np.float32)
    ):
        return
    as32 = np.asarray(mine, np.float32)
    if (
        theirs.shape == mine.shape
        and theirs.dtype != mine.dtype
        and np.array_equal(np.asarray(theirs.astype(mine.dtype), np.float32), as32)
    ):
        changed = np.count_nonzero(np.asarray(theirs, np.float32) != as32)
        cast, own = mine.dtype.name, theirs.dtype.name
        raise CheckpointError(
            f"the drafter's {name} is the verifier's ({folder}) cast from {own} to {cast}, "
            f"which changed {changed} of its {mine.size} values (a conversion with --dtype "
            f"{cast}): the speculators loader takes the embedding and head from the verifier, "
            "uncast, so this export would not be the drafter as converted. Export the "
            "speculators layout from a conversion without --dtype (or with the checkpoint's "
            f"own, --dtype {own})"
        )
    raise CheckpointError(
        f"the drafter's {name} differs from the verifier's ({folder}); the speculators loader "
        "would replace it with the verifier's, so this export would not be the drafter you "
        "trained. Name the drafter's own target."
    )


def write_drafter_speculators(
    model: DSparkDrafter, out: str | os.PathLike, *, verifier: str, overwrite: bool = False
) -> Path:
    """Writes `model` in the speculators layout at `out` (atomically); `verifier` is its target
    (Hugging Face folder or hub id). A local verifier is read to check that its embedding and
    head are the drafter's, since the loader takes them from there."""
    verifier, folder = verifier_source(verifier)
    tensors = export_to_torch(model, "")
    architectures = ["Qwen3ForCausalLM"]
    if folder is not None:
        architectures = list(read_config_json(folder).get("architectures") or architectures)
        for name, array in _verifier_tensors(folder).items():
            _check_verifier_tensor(name, np.asarray(array), np.asarray(tensors[name]), folder)
    config = speculators_config(model.cfg, verifier, architectures)
    check_speculators_config(config)
    kept = {k: v for k, v in tensors.items() if k not in VERIFIER_TENSORS}
    out = Path(out)
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        save_safetensors(kept, tmp / SINGLE_FILE, metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
