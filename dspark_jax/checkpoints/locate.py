"""Finding a model the user names: a local folder or a hub id, and which form the folder has.

Every program accepts, for a target or a drafter, any of

    a converted folder (ours: `dspark_jax.json` manifest plus `draft/` and/or `target/`),
    one part of a converted folder (`O/draft`, `O/target`: `config.json` plus `params/`),
    a Hugging Face / DeepSpec safetensors folder (`config.json` plus `*.safetensors`),
    for a drafter, a training run whose final export is `RUN/drafter/`,
    a Hugging Face hub id (`org/name`), downloaded into the hub cache when the hub is reachable.

`locate(path, part)` resolves any of them to the folder holding `config.json` and tells whether it
is ours (with its manifest entry) or a PyTorch-layout folder.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from dspark_jax.checkpoints.safetensors_io import CheckpointError

FORMAT_NAME = "dspark-jax"
FORMAT_VERSION = 1
MANIFEST = "dspark_jax.json"
PARAMS = "params"
DRAFT, TARGET = "draft", "target"
PART_NAMES = {DRAFT: "drafter", TARGET: "target"}
# Where `dspark-jax train` writes the run's final drafter.
RUN_DRAFTER = "drafter"
# config.json fields only a drafter has (DFlash files keep them under `dflash_config`).
DRAFTER_KEYS = ("block_size", "mask_token_id", "target_layer_ids")

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "tokenizer*",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
]


def looks_like_hub_id(name: str) -> bool:
    """Whether `name` can only mean a hub repository: `owner/name` with no path syntax (no
    leading ./ ../ / or ~, no backslash) and no local folder named like its owner -- with
    `ckpt/` present, `ckpt/qwen3-4b` is a mistyped path, not a repository."""
    if not _HUB_ID.fullmatch(name) or name.startswith((".", "~")):
        return False
    owner = name.split("/", 1)[0]
    return not Path(owner).exists()


def resolve_model_dir(path_or_repo_id: str) -> Path:
    """Returns a local model directory: `path_or_repo_id` itself, or a hub snapshot of it.

    The hub is asked only for names that exist nowhere locally and look like hub ids; the user
    is told on stderr, since whatever lives at that name will be used."""
    local = Path(path_or_repo_id).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise CheckpointError(f"{local}: is not a directory")
    if not looks_like_hub_id(path_or_repo_id):
        raise CheckpointError(
            f"{path_or_repo_id}: no such folder (and not a Hugging Face hub id of the form "
            "owner/name)"
        )
    print(f"fetching from the hub: {path_or_repo_id}", file=sys.stderr, flush=True)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path_or_repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as e:
        raise CheckpointError(
            f"{path_or_repo_id}: no such folder, and the Hugging Face hub could not provide it "
            f"({type(e).__name__}: {' '.join(str(e).split())})"
        ) from e


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a converted folder, refused when it is not ours or too new to read."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path}: not a {FORMAT_NAME} manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {version!r} is not supported (this build reads "
            f"1..{FORMAT_VERSION}); upgrade dspark-jax"
        )
    return manifest


def locate(path: str | os.PathLike, part: str) -> tuple[Path, dict[str, Any] | None]:
    """(folder holding config.json, manifest entry or None); the entry is None for PyTorch folders.

    Accepts a converted folder, one of its parts, a safetensors folder or a hub id.
    """
    root = resolve_model_dir(str(path))
    if part == DRAFT and not (root / "config.json").exists():
        # A training run's final export (`dspark-jax train` writes RUN/drafter/).
        if (root / RUN_DRAFTER / "config.json").is_file():
            return root / RUN_DRAFTER, None
        if _is_training_checkpoint(root):
            raise CheckpointError(
                f"{root}: a training run or checkpoint without its final {RUN_DRAFTER}/ (the run "
                f"has not finished): export one with dspark-jax export --draft {root} --out DIR "
                "and use DIR"
            )
    if (root / MANIFEST).is_file():
        manifest = read_manifest(root / MANIFEST)
        if part not in manifest.get("converted", []):
            raise CheckpointError(
                f"{root}: this converted folder holds no {part} "
                f"(converted: {', '.join(manifest.get('converted', [])) or 'nothing'})"
            )
        return root / part, manifest.get(part, {})
    if (root / PARAMS).is_dir():
        parent = root.parent / MANIFEST
        if parent.is_file() and root.name in PART_NAMES and root.name != part:
            raise CheckpointError(
                f"{root} is the {PART_NAMES[root.name]} of a converted folder, not a "
                f"{PART_NAMES[part]}: give {root.parent} (or {root.parent / part})"
            )
        entry = read_manifest(parent).get(root.name, {}) if parent.is_file() else {}
        return root, entry
    return root, None


def _is_training_checkpoint(folder: Path) -> bool:
    """Whether `folder` looks like a training run, its `checkpoints/` or one step of it."""
    return (
        (folder / "checkpoints").is_dir()
        or folder.name == "checkpoints"
        or (folder.name.isdigit() and folder.parent.name == "checkpoints")
    )


def check_part_config(raw: dict[str, Any], part_dir: Path, part: str) -> None:
    """Refuses a config.json of the other kind of model, or of a layout we do not read, with a
    message that says what the folder is (a wrong folder otherwise fails much later, as a list
    of missing or unexpected parameters)."""
    if "speculators_model_type" in raw:
        raise CheckpointError(
            f"{part_dir} is a drafter in vLLM's speculators layout (speculators_model_type "
            f"{raw['speculators_model_type']!r}), which leaves its embedding and head to the "
            "verifier; dspark-jax reads the reference (DeepSpec) layout: use the drafter this "
            "was exported from, or export it again with --format reference"
        )
    nested = raw.get("dflash_config") or {}
    drafter_keys = sorted(k for k in DRAFTER_KEYS if k in raw or k in nested)
    if part == TARGET and drafter_keys:
        raise CheckpointError(
            f"{part_dir} looks like a drafter checkpoint (its config.json has "
            f"{', '.join(drafter_keys)}), not a target: give it as the drafter (--draft) and "
            "the Qwen3 model it drafts for as the target"
        )
    if part == DRAFT and not drafter_keys and raw.get("model_type") == "qwen3":
        raise CheckpointError(
            f"{part_dir} looks like a target (a Qwen3 config.json without block_size or "
            "target_layer_ids), not a drafter: give it as the target (--target) and a DSpark "
            "or DFlash drafter as the drafter (--draft; calibrate's --drafter)"
        )


def check_not_converted(folder: Path) -> None:
    """Refuses a folder of ours where a PyTorch-layout checkpoint is expected (convert)."""
    if (folder / MANIFEST).is_file() or (folder / PARAMS).is_dir():
        raise CheckpointError(
            f"{folder} is already a converted {FORMAT_NAME} folder: the commands read it as it "
            "is (--target / --draft), so there is nothing to convert; give the PyTorch folder "
            "it came from to convert again"
        )
