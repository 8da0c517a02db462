"""Our converted checkpoint layout, its loaders, and export back to the PyTorch layout.

A converted folder O holds

    O/dspark_jax.json          format name and version, what was converted, sources, fingerprint
    O/draft/config.json        the drafter's original config.json (num_target_layers filled in
                               from the target when it lacked it)
    O/draft/params/            Orbax StandardCheckpointer of nnx.state(model).to_pure_dict()
    O/target/config.json       the target's original config.json
    O/target/params/           same, for the target
    O/target/tokenizer*, generation_config.json, ...   copied from the target folder

Either part may be absent. Loaders also take a Hugging Face / DeepSpec safetensors folder or a
hub id (see `locate`), so every program can point at whichever form the user has.

A loaded model computes in the dtype its parameters are stored in, unless a `dtype` is asked for,
in which case the parameters are cast and the config's compute dtype follows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

from dspark_jax.checkpoints import orbax_io
from dspark_jax.checkpoints.convert import (
    drafter_from_torch,
    export_to_torch,
    is_float_dtype,
    target_from_torch,
)
from dspark_jax.checkpoints.fingerprint import drafter_fingerprint
from dspark_jax.checkpoints.integrity import check_host_leaves, check_parameters
from dspark_jax.checkpoints.locate import (
    DRAFT,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    PARAMS,
    PART_NAMES,
    TARGET,
    check_not_converted,
    check_part_config,
    locate,
    read_manifest,
    resolve_model_dir,
)
from dspark_jax.checkpoints.safetensors_io import (
    SINGLE_FILE,
    CheckpointError,
    SafetensorsFolder,
    atomic_output_dir,
    save_safetensors,
)
from dspark_jax.config import (
    DRAFTER_MODEL_TYPE,
    DTYPES,
    ConfigError,
    DrafterConfig,
    Qwen3Config,
    read_config_json,
)
from dspark_jax.errors import UserError
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.sharding import check_model_split, models_split_sizes
from dspark_jax.tokenizer import copy_tokenizer_bundle, load_tokenizer, stop_token_ids

if TYPE_CHECKING:
    from dspark_jax.calibration.sts import StsArtifact
    from dspark_jax.decoding.engine import Engine, EngineConfig
    from dspark_jax.decoding.policies import Policy
    from dspark_jax.tokenizer import Tokenizer

# float16 is for GPUs without bfloat16 (a T4 on Colab).
CONVERT_DTYPES = ("keep", "float32", "bfloat16", "float16")


# -- small helpers -----------------------------------------------------------------------------
def _dtype_name(dtype) -> str:
    """Canonical name of a floating dtype we can compute in ("float32", "bfloat16", ...)."""
    try:
        name = np.dtype(jnp.dtype(dtype)).name
    except TypeError as e:
        raise ConfigError(f"unknown dtype {dtype!r}") from e
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return name


def _first_float_dtype(dtypes, where: Path) -> str:
    for dtype in dtypes:
        if is_float_dtype(dtype):
            return _dtype_name(dtype)
    raise CheckpointError(f"{where}: holds no floating-point parameters")


def _stored_float_dtype(folder: SafetensorsFolder) -> str:
    """The dtype of a safetensors folder's first floating tensor, refused (naming its file) when
    the models cannot compute in it (float64): it needs a cast."""
    for key in folder.keys():
        dtype = np.dtype(folder.dtype(key))
        if is_float_dtype(dtype):
            if dtype.name not in DTYPES:
                raise CheckpointError(
                    f"{folder.file(key)}: tensor {key!r} is {dtype.name}, which the models do "
                    f"not compute in ({', '.join(DTYPES)}); convert it with a cast, e.g. "
                    "--dtype float32"
                )
            return dtype.name
    raise CheckpointError(f"{folder.path}: holds no floating-point parameters")


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def check_no_overlap(out: Path, sources: list[Path], option: str | None = None) -> None:
    """Refuses an output that is, contains or sits inside a source (a folder or a file): the
    output replaces its whole folder, so --overwrite would delete the source. `option` names the
    output in the message as the command line gave it (`--out`)."""
    resolved = Path(out).resolve()
    for source in sources:
        source = Path(source).resolve()
        if resolved == source or resolved in source.parents or source in resolved.parents:
            where = f"output {resolved}" if option is None else f"{option} {out}:"
            raise UserError(f"{where} overlaps the input {source}; choose another folder")


def target_folders(target: str | os.PathLike | None) -> list[Path]:
    """The local folders a drafter's target (or verifier) `target`, as given, stands for: the
    folder itself and, when it is a converted folder, the one its target was converted from
    (which the speculators layout names and reads). None for a hub id or no target. An export
    must not be written over them, as over its drafter."""
    if target is None or not Path(target).expanduser().is_dir():
        return []
    from dspark_jax.checkpoints.speculators import verifier_source

    folder = Path(target).expanduser()
    try:
        source = verifier_source(str(folder))[1]
    except CheckpointError:  # a converted folder without a target: nothing more to protect
        source = None
    return [folder] + ([source] if source is not None else [])


@contextlib.contextmanager
def _on_host() -> Iterator[None]:
    """Places arrays in host memory: converting a 14B target must not need accelerator memory."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        cpu = None
    with jax.default_device(cpu) if cpu is not None else contextlib.nullcontext():
        yield


class _ReadSource:
    """A SafetensorsFolder seen through an optional floating cast, ticking a progress bar."""

    def __init__(self, folder: SafetensorsFolder, cast: str | None, bar: tqdm):
        self._folder, self._bar = folder, bar
        self._cast = None if cast is None else np.dtype(jnp.dtype(cast))

    def keys(self):
        return self._folder.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self._folder.shape(key)

    def dtype(self, key: str) -> np.dtype:
        stored = self._folder.dtype(key)
        return self._cast if self._cast is not None and is_float_dtype(stored) else stored

    def get(self, key: str) -> np.ndarray:
        array = self._folder.get(key)
        if self._cast is not None and is_float_dtype(array.dtype):
            array = array.astype(self._cast)
        self._bar.update(1)
        return array


def _from_torch_folder(
    folder: SafetensorsFolder, cfg, dtype: str | None, progress: bool, mesh=None
):
    """(cfg with its compute dtype set, model) from a PyTorch-layout folder.

    Without a `dtype` the tensors are read as stored, so the model's checks see their dtypes
    (one floating dtype for all); with one, every floating tensor is cast to it (float64 too,
    which only a cast can read)."""
    cfg = cfg.with_dtype(dtype or _stored_float_dtype(folder))
    build = drafter_from_torch if isinstance(cfg, DrafterConfig) else target_from_torch
    bar = tqdm(
        total=len(folder),
        desc=f"reading {folder.path.name}",
        unit="tensor",
        leave=False,
        disable=None if progress else True,
    )
    with bar:
        try:
            return cfg, build(cfg, _ReadSource(folder, dtype, bar), mesh)
        except CheckpointError as e:
            raise CheckpointError(f"{folder.path}: {e}") from None


def _from_jax_folder(part_dir: Path, cfg, dtype: str | None, mesh=None):
    """(cfg with its compute dtype set, model) from one part of a converted folder."""
    params_dir = part_dir / PARAMS
    stored = orbax_io.read_metadata(params_dir)
    compute = dtype or _first_float_dtype((m.dtype for m in stored.values()), params_dir)
    cfg = cfg.with_dtype(compute)
    return cfg, orbax_io.restore_params(
        params_dir, orbax_io.abstract_model(cfg, compute), stored, dtype, mesh
    )


def _cast_model(cfg, model, dtype: str):
    """`model` with floating parameters cast to `dtype` and compute dtype `dtype` (each array
    keeps its sharding)."""
    cfg = cfg.with_dtype(dtype)
    graphdef, state = nnx.split(orbax_io.abstract_model(cfg, dtype))
    pure = nnx.to_pure_dict(nnx.state(model))
    nnx.replace_by_pure_dict(
        state, jax.tree.map(lambda a: a.astype(dtype) if is_float_dtype(a.dtype) else a, pure)
    )
    return cfg, nnx.merge(graphdef, state)


def _check_loaded(model, part: str, part_dir: Path, entry) -> None:
    """Refuses non-finite parameters, and for a converted folder, parameters whose checksum
    differs from the one recorded at conversion (folders converted before checksums were
    recorded have none to compare). `model` holds the parameters as stored: read uncast."""
    checksum = check_parameters(model, f"the {PART_NAMES[part]} at {part_dir}")
    _compare_checksum(part, part_dir, entry, checksum)


def _compare_checksum(part: str, part_dir: Path, entry, checksum: str) -> None:
    recorded = (entry or {}).get("checksum")
    if recorded is not None and recorded != checksum:
        raise CheckpointError(
            f"{part_dir}: the {PART_NAMES[part]}'s parameters do not match the checksum "
            f"recorded at conversion ({recorded[:12]}..., found {checksum[:12]}...): the folder "
            "was modified or damaged; convert it again"
        )


def _part_config(part_dir: Path, part: str) -> dict[str, Any]:
    """The config.json of a drafter or target folder, refused when it is the other kind."""
    raw = read_config_json(part_dir)
    check_part_config(raw, part_dir, part)
    return raw


def read_part_config(path: str | os.PathLike, part: str) -> dict[str, Any]:
    """The config.json of the `part` ("draft" or "target") that `path` names, in any form the
    loaders take (see `locate`), without reading parameters."""
    return _part_config(locate(path, part)[0], part)


def _check_mesh_heads(what: str, model_cfg: Qwen3Config, mesh) -> None:
    if mesh is not None:
        check_model_split(what, model_cfg, mesh)


def _lacks_num_target_layers(raw: Mapping[str, Any]) -> bool:
    """Whether a drafter config.json lacks num_target_layers (released DSpark ones do), at the
    top or under `dflash_config`, as `DrafterConfig.from_hf` reads them."""
    nested = raw.get("dflash_config")
    return {**(nested if isinstance(nested, dict) else {}), **raw}.get("num_target_layers") is None


def _read_drafter(path, dtype: str | None, progress: bool, mesh=None, target=None):
    """(original config dict, cfg, model, fingerprint of the stored parameters).

    A config.json that lacks num_target_layers gets it from `target` (the drafter's target, as
    conversion fills it in), when given; the dict returned then holds it."""
    part_dir, entry = locate(path, DRAFT)
    raw = _part_config(part_dir, DRAFT)
    target_cfg = None
    if _lacks_num_target_layers(raw):
        if target is None:
            raise CheckpointError(
                f"{part_dir}: config.json lacks num_target_layers (the depth of the drafter's "
                "target, which released DSpark configs leave out): add it, or give the target to "
                "fill it in from (dspark-jax convert --draft DRAFT --target TARGET, or export's "
                "--target)"
            )
        target_cfg = Qwen3Config.from_hf(read_part_config(target, TARGET))
        raw = {**raw, "num_target_layers": target_cfg.num_hidden_layers}
    cfg = DrafterConfig.from_hf(raw)
    if target_cfg is not None:
        cfg.check_target(target_cfg)
    _check_mesh_heads(f"drafter {part_dir}", cfg.model, mesh)
    if entry is None:
        cfg, model = _from_torch_folder(SafetensorsFolder(part_dir), cfg, None, progress, mesh)
    else:
        cfg, model = _from_jax_folder(part_dir, cfg, None, mesh)
    _check_loaded(model, DRAFT, part_dir, entry)
    fingerprint = drafter_fingerprint(model)
    recorded = (entry or {}).get("fingerprint")
    if recorded is not None and recorded != fingerprint:
        raise CheckpointError(
            f"{part_dir}: parameters do not match the fingerprint recorded at conversion "
            f"({recorded[:12]}..., found {fingerprint[:12]}...): the folder was modified or damaged"
        )
    if dtype is not None and _dtype_name(dtype) != cfg.model.dtype:
        cfg, model = _cast_model(cfg, model, _dtype_name(dtype))
        # A narrower dtype can overflow to infinity (float16 tops out at 65504).
        check_parameters(model, f"the drafter at {part_dir} cast to {cfg.model.dtype}")
    return raw, cfg, model, fingerprint


# -- public loaders ----------------------------------------------------------------------------
def load_target(
    path: str | os.PathLike, dtype=None, *, progress: bool = True, mesh=None
) -> tuple[Qwen3Config, Qwen3, Path]:
    """(config, Qwen3 target, folder with its tokenizer files) from any supported form.

    `path`: a converted folder, its `target/`, a Hugging Face safetensors folder or a hub id.
    `dtype` (e.g. "bfloat16") casts the parameters and sets the compute dtype for serving.
    `progress` shows a bar while safetensors are read, on a terminal only. `mesh`: every
    parameter is read straight into its rules-table sharding on it (see `dspark_jax.sharding`).
    """
    part_dir, entry = locate(path, TARGET)
    cfg = Qwen3Config.from_hf(_part_config(part_dir, TARGET))
    _check_mesh_heads(f"target {part_dir}", cfg, mesh)
    dtype = None if dtype is None else _dtype_name(dtype)
    if (entry or {}).get("checksum") is None:
        # Nothing recorded to check the stored bits against: cast as the parameters are read.
        if entry is None:
            folder = SafetensorsFolder(part_dir)
            cfg, model = _from_torch_folder(folder, cfg, dtype, progress, mesh)
        else:
            cfg, model = _from_jax_folder(part_dir, cfg, dtype, mesh)
        _check_loaded(model, TARGET, part_dir, entry)
        return cfg, model, part_dir
    # The checksum recorded at conversion is of the stored bits: checked before any cast (one of
    # the cast parameters would not tell damaged data from the rounding of the cast).
    params_dir = part_dir / PARAMS
    stored = orbax_io.read_metadata(params_dir)
    stored_dtype = _first_float_dtype((m.dtype for m in stored.values()), params_dir)
    if dtype is None or dtype == stored_dtype:
        cfg, model = _from_jax_folder(part_dir, cfg, None, mesh)
        _check_loaded(model, TARGET, part_dir, entry)
        return cfg, model, part_dir
    if mesh is None:
        # Checked in host memory as read, cast leaf by leaf as placed: the device never holds the
        # stored copy beside the cast one (a float32 target served in bfloat16 would need 3x).
        def check(names, leaves):
            checksum = check_host_leaves(names, leaves, f"the target at {part_dir}")
            _compare_checksum(TARGET, part_dir, entry, checksum)

        cfg = cfg.with_dtype(dtype)
        model = orbax_io.restore_params(
            params_dir,
            orbax_io.abstract_model(cfg, dtype),
            stored,
            None,
            check_stored=check,
            place_as=dtype,
        )
    else:
        # Sharded: each device reads its slices as stored, then they are cast (the stored and
        # cast copies of one device's share meet there).
        cfg, model = _from_jax_folder(part_dir, cfg, None, mesh)
        _check_loaded(model, TARGET, part_dir, entry)
        cfg, model = _cast_model(cfg, model, dtype)
    # A narrower dtype can overflow to infinity (float16 tops out at 65504).
    check_parameters(model, f"the target at {part_dir} cast to {dtype}")
    return cfg, model, part_dir


def load_drafter(
    path: str | os.PathLike, dtype=None, *, progress: bool = True, mesh=None
) -> tuple[DrafterConfig, DSparkDrafter, str]:
    """(config, drafter, fingerprint) from any supported form (see `load_target`).

    The fingerprint is that of the stored parameters (before any `dtype` cast); loading a
    converted folder checks it against the one recorded at conversion.
    """
    _, cfg, model, fingerprint = _read_drafter(path, dtype, progress, mesh)
    return cfg, model, fingerprint


# -- conversion --------------------------------------------------------------------------------
def _num_params(model: nnx.Module) -> int:
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(model)))


def convert_checkpoints(
    out: str | os.PathLike,
    draft: str | os.PathLike | None = None,
    target: str | os.PathLike | None = None,
    *,
    dtype: str = "keep",
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Converts PyTorch-layout drafter and/or target folders into our layout; returns the manifest.

    Both configs are read and, with both parts, checked against each other before anything is
    written. Output is atomic: on any error (or Ctrl-C) `out` is not created or changed.
    """
    if draft is None and target is None:
        raise UserError("nothing to convert: give a drafter, a target or both")
    if dtype not in CONVERT_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(CONVERT_DTYPES)}")
    cast = None if dtype == "keep" else dtype
    out = Path(out)
    sources = {
        part: resolve_model_dir(str(src))
        for part, src in ((DRAFT, draft), (TARGET, target))
        if src is not None
    }
    check_no_overlap(out, list(sources.values()))
    for folder in sources.values():
        check_not_converted(folder)

    raws: dict[str, dict[str, Any]] = {}
    cfgs: dict[str, Any] = {}
    filled: list[str] = []
    if TARGET in sources:
        raws[TARGET] = _part_config(sources[TARGET], TARGET)
        cfgs[TARGET] = Qwen3Config.from_hf(raws[TARGET])
    if DRAFT in sources:
        raw = dict(_part_config(sources[DRAFT], DRAFT))
        nested = raw.get("dflash_config") or {}
        if "num_target_layers" not in raw and "num_target_layers" not in nested and TARGET in cfgs:
            raw["num_target_layers"] = cfgs[TARGET].num_hidden_layers
            filled.append("num_target_layers")
        raws[DRAFT] = raw
        cfgs[DRAFT] = DrafterConfig.from_hf(raw)
        if TARGET in cfgs:
            cfgs[DRAFT].check_target(cfgs[TARGET])
    folders = {part: SafetensorsFolder(src) for part, src in sources.items()}

    manifest: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "converted": [p for p in (DRAFT, TARGET) if p in sources],
        "dtype": dtype,
    }
    with _on_host(), atomic_output_dir(out, overwrite=overwrite) as tmp:
        for part in manifest["converted"]:
            part_dir = tmp / part
            part_dir.mkdir()
            _, model = _from_torch_folder(folders[part], cfgs[part], cast, progress)
            checksum = check_parameters(model, f"the {PART_NAMES[part]} at {sources[part]}")
            orbax_io.save_params(model, part_dir / PARAMS)
            _write_json(part_dir / "config.json", raws[part])
            floats = [a.dtype for a in jax.tree.leaves(nnx.state(model)) if is_float_dtype(a.dtype)]
            entry: dict[str, Any] = {
                "source": str(draft if part == DRAFT else target),
                "resolved_source": str(sources[part].resolve()),
                "param_dtype": _dtype_name(floats[0]),
                "num_params": _num_params(model),
                "checksum": checksum,
            }
            if part == DRAFT:
                entry["fingerprint"] = drafter_fingerprint(model)
                if filled:
                    entry["filled_config_fields"] = filled
            else:
                entry["copied_files"] = copy_tokenizer_bundle(sources[part], part_dir)
            manifest[part] = entry
            del model  # frees the drafter before the (much larger) target is read
        _write_json(tmp / MANIFEST, manifest)
    return manifest


# -- export ------------------------------------------------------------------------------------
def _config_diffs(written: DrafterConfig, model: DrafterConfig) -> list[str]:
    """Fields on which two drafter configs disagree, the compute dtype aside."""
    pairs = [
        (f.name, getattr(written, f.name), getattr(model, f.name))
        for f in dataclasses.fields(DrafterConfig)
        if f.name != "model"
    ]
    pairs += [
        (f.name, getattr(written.model, f.name), getattr(model.model, f.name))
        for f in dataclasses.fields(Qwen3Config)
        if f.name != "dtype"
    ]
    return [f"{name}: config {a!r}, model {b!r}" for name, a, b in pairs if a != b]


def write_drafter_torch(
    model: DSparkDrafter,
    hf_config: Mapping[str, Any] | None,
    out: str | os.PathLike,
    *,
    overwrite: bool = False,
) -> Path:
    """Writes `model` as a PyTorch (DeepSpec) drafter folder: config.json + model.safetensors.

    `hf_config` is the config.json dict to write (the original one for a converted drafter);
    None writes `model.cfg.to_hf()` with model_type `DRAFTER_MODEL_TYPE`, so transformers' Auto
    classes refuse the folder rather than load it as a plain Qwen3 without its DSpark tensors.
    Its `dtype`/`torch_dtype` is set to the parameters' dtype when they disagree. Atomic, like
    conversion.
    """
    if hf_config is None:
        config = {**model.cfg.to_hf(), "model_type": DRAFTER_MODEL_TYPE}
    else:
        config = dict(hf_config)
    diffs = _config_diffs(DrafterConfig.from_hf(config), model.cfg)
    if diffs:
        raise ConfigError(
            "hf_config describes a different drafter than the model: " + "; ".join(diffs)
        )
    tensors = export_to_torch(model, "")
    float_names = {a.dtype.name for a in tensors.values() if is_float_dtype(a.dtype)}
    if len(float_names) == 1:
        (name,) = float_names
        for key in ("dtype", "torch_dtype"):
            if key in config and str(config[key]).removeprefix("torch.") != name:
                config[key] = name
    out = Path(out)
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        save_safetensors(tensors, tmp / SINGLE_FILE, metadata={"format": "pt"})
        _write_json(tmp / "config.json", config)
    return out


EXPORT_FORMATS = ("reference", "speculators")


def write_drafter(
    model: DSparkDrafter,
    hf_config: Mapping[str, Any] | None,
    out: str | os.PathLike,
    *,
    fmt: str = "reference",
    verifier: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes `model` in layout `fmt`: "reference" (`write_drafter_torch`) or "speculators"
    (`speculators.write_drafter_speculators`, which needs the `verifier`: the target's Hugging
    Face folder or hub id)."""
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"export format {fmt!r} is not one of {', '.join(EXPORT_FORMATS)}")
    if fmt == "reference":
        return write_drafter_torch(model, hf_config, out, overwrite=overwrite)
    from dspark_jax.checkpoints.speculators import write_drafter_speculators

    if verifier is None:
        raise UserError(
            "the speculators layout names the drafter's target (its embedding and head are read "
            "from there); give it with --target (a Hugging Face folder or hub id)"
        )
    return write_drafter_speculators(model, out, verifier=verifier, overwrite=overwrite)


def recorded_target(part_dir: Path) -> str | None:
    """The target stored beside a converted drafter (its converted folder), if any."""
    return converted_beside(part_dir, TARGET)


def converted_beside(part_dir: Path, part: str) -> str | None:
    """The converted folder holding `part_dir` when it also holds `part` (DRAFT or TARGET)."""
    root = part_dir.parent
    if (root / MANIFEST).is_file() and part in read_manifest(root / MANIFEST).get(
        "converted", []
    ):
        return str(root)
    return None


def export_drafter(
    src: str | os.PathLike,
    out: str | os.PathLike,
    overwrite: bool = False,
    *,
    fmt: str = "reference",
    verifier: str | None = None,
) -> Path:
    """Exports a converted drafter (or any loadable one) to layout `fmt` at `out` (see
    `write_drafter`); the verifier defaults to the target converted beside the drafter."""
    part_dir, _ = locate(src, DRAFT)
    protected = [part_dir]
    if (part_dir.parent / MANIFEST).is_file():
        protected.append(part_dir.parent)
    verifier = verifier or recorded_target(part_dir)
    # The target too: the speculators layout reads it, and names it as the verifier.
    check_no_overlap(Path(out), protected + target_folders(verifier))
    raw, _, model, _ = _read_drafter(part_dir, None, progress=False, target=verifier)
    return write_drafter(model, raw, out, fmt=fmt, verifier=verifier, overwrite=overwrite)


@dataclasses.dataclass(frozen=True)
class DecodingModels:
    """What decoding needs: the target, an optional drafter, the tokenizer and stop tokens."""

    target: Qwen3
    model_dir: Path
    drafter: DSparkDrafter | None
    drafter_path: str | None
    drafter_fingerprint: str | None
    tokenizer: Tokenizer
    stop_tokens: tuple[int, ...]
    mesh: Mesh | None = None  # where the parameters live (None: one device)

    @property
    def gamma(self) -> int:
        return 0 if self.drafter is None else self.drafter.cfg.block_size

    def engine(
        self,
        cfg: EngineConfig,
        *,
        policy: Policy | None = None,
        sts: StsArtifact | None = None,
        speculative: bool = True,
    ) -> Engine:
        """The slot engine over these models, with their stop tokens, drafter fingerprint and
        mesh: speculative when there is a drafter (and `speculative`), else plain decoding."""
        from dspark_jax.decoding.engine import Engine

        # Plain decoding gets the policy and artifact too, and refuses them: dropping them here
        # would silently serve something else than asked.
        plain = not speculative or self.drafter is None
        return Engine(
            self.target,
            None if plain else self.drafter,
            cfg,
            policy=policy,
            stop_tokens=self.stop_tokens,
            sts=sts,
            drafter_fingerprint=None if plain else self.drafter_fingerprint,
            mesh=self.mesh,
        )


def load_decoding_models(
    target: str | os.PathLike,
    draft: str | os.PathLike | None = None,
    dtype=None,
    *,
    progress: bool = True,
    mesh=None,
) -> DecodingModels:
    """Loads a target (and a drafter, checked against it) with the target's tokenizer.

    Stop tokens are the target config's EOS ids, generation_config.json's and the tokenizer's.
    `mesh`: both models' parameters are read straight into their shardings on it.
    """
    target_cfg, target_model, model_dir = load_target(target, dtype, progress=progress, mesh=mesh)
    drafter = fingerprint = None
    if draft is not None:
        _, drafter, fingerprint = load_drafter(draft, dtype, progress=progress, mesh=mesh)
        drafter.cfg.check_target(target_cfg)
    tokenizer = load_tokenizer(model_dir)
    return DecodingModels(
        target=target_model,
        model_dir=Path(model_dir),
        drafter=drafter,
        drafter_path=None if draft is None else str(draft),
        drafter_fingerprint=fingerprint,
        tokenizer=tokenizer,
        stop_tokens=stop_token_ids(model_dir, target_cfg.eos_token_ids, tokenizer),
        mesh=mesh,
    )


def _decoding_configs(target, draft):
    """The configs (Qwen3Config, DrafterConfig) of a target and a drafter (or None), read alone."""
    configs = []
    for path, part, config_cls in ((target, TARGET, Qwen3Config), (draft, DRAFT, DrafterConfig)):
        if path is not None:
            part_dir, _ = locate(path, part)
            configs.append(config_cls.from_hf(_part_config(part_dir, part)))
    return configs


def decoding_param_bytes(
    target: str | os.PathLike, draft: str | os.PathLike | None = None, dtype=None
) -> int:
    """Bytes the parameters of a target (and drafter) take, from their configs alone."""
    total = 0
    for cfg in _decoding_configs(target, draft):
        model_cfg = cfg.model if isinstance(cfg, DrafterConfig) else cfg
        name = model_cfg.dtype if dtype is None else _dtype_name(dtype)
        abstract = orbax_io.abstract_model(cfg, name)
        total += sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(nnx.state(abstract)))
    return total


def decoding_split_sizes(
    target: str | os.PathLike, draft: str | os.PathLike | None = None
) -> list[int]:
    """Every size of a target (and drafter) that a mesh's tensor axis must divide
    (`sharding.tensor_split_sizes`), from their configs alone."""
    configs = _decoding_configs(target, draft)
    return models_split_sizes(*(c.model if isinstance(c, DrafterConfig) else c for c in configs))
