"""Checkpoint conversion: the `dspark-jax convert` / `export` CLI and the loaders behind it."""

import functools
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from fixture_models import VARIANTS, fixture_dir
from flax import nnx
from safetensors.torch import load_file, save_file

from dspark_jax.checkpoints import orbax_io
from dspark_jax.checkpoints.converted import load_drafter, load_target, write_drafter_torch
from dspark_jax.checkpoints.fingerprint import fingerprint_tensors
from dspark_jax.checkpoints.safetensors_io import (
    CheckpointError,
    SafetensorsFolder,
    save_safetensors,
)
from dspark_jax.cli import main
from dspark_jax.config import DRAFTER_MODEL_TYPE, ConfigError
from dspark_jax.models.paged import TokenBatch
from dspark_jax.sampling import SamplingConfig

REPO = Path(__file__).parents[1]


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    source = SafetensorsFolder(folder)
    return {k: source.get(k) for k in source.keys()}


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, array in want.items():
        assert got[key].dtype == array.dtype and got[key].shape == array.shape, key
        assert got[key].tobytes() == array.tobytes(), key


def _assert_nothing_written(tmp_path: Path, name: str = "out") -> None:
    assert not (tmp_path / name).exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{name}.")]


def _copy_fixture(tmp_path: Path, variant: str) -> tuple[Path, Path]:
    root = tmp_path / f"src-{variant}"
    shutil.copytree(fixture_dir(variant), root, ignore=shutil.ignore_patterns("reference.*"))
    return root / "draft", root / "target"


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@functools.partial(jax.jit, static_argnums=0)
def _target_logits_jit(graphdef, state):
    target = nnx.merge(graphdef, state)
    tokens = jnp.asarray([[3, 17, 101, 255, 40, 7, 99, 256, 12, 64]], jnp.int32)
    return target.logits(target(tokens).hidden)


def _target_logits(target) -> np.ndarray:
    return np.asarray(_target_logits_jit(*nnx.split(target)))


@functools.partial(jax.jit, static_argnums=0)
def _draft_block_jit(graphdef, state):
    drafter = nnx.merge(graphdef, state)
    cfg = drafter.cfg
    features = jax.random.normal(jax.random.key(1), (15, cfg.num_context_features))
    lengths = jnp.array([9, 6], jnp.int32)
    context = TokenBatch.per_slot(jnp.zeros(2, jnp.int32), lengths, 15)
    cache = drafter.append_context(drafter.new_context_cache(2, 16), features, context)
    anchor = jnp.array([65, 10], jnp.int32)
    keys = jax.random.split(jax.random.key(0), (2, cfg.block_size))
    h = drafter.draft_hidden(anchor, lengths, jnp.array([True, True]), cache)
    return drafter.sample_block(h, anchor, keys, SamplingConfig(temperature=0.0))


def _draft_outputs(drafter) -> list[np.ndarray]:
    """Tokens, corrected logits and confidence logits of one greedy block on fixed features."""
    return [np.asarray(a) for a in _draft_block_jit(*nnx.split(drafter))]


def _assert_exact(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("variant", VARIANTS)
def test_convert_then_load_matches_original(tmp_path, capsys, variant):
    src = fixture_dir(variant)
    out = tmp_path / "out"
    code, err = _cli(
        capsys, "convert", "--draft", src / "draft", "--target", src / "target", "--out", out
    )
    assert code == 0, err
    manifest = json.loads((out / "dspark_jax.json").read_text())
    assert manifest["format"] == "dspark-jax" and manifest["format_version"] == 1
    assert manifest["converted"] == ["draft", "target"]
    assert json.loads((out / "draft" / "config.json").read_text()) == json.loads(
        (src / "draft" / "config.json").read_text()
    )
    assert (out / "target" / "generation_config.json").read_bytes() == (
        src / "target" / "generation_config.json"
    ).read_bytes()

    ref_cfg, ref_target, _ = load_target(src / "target")
    want_logits = _target_logits(ref_target)
    for path in (out, out / "target"):
        cfg, target, model_dir = load_target(path)
        assert cfg == ref_cfg and model_dir == out / "target"
        assert (target.lm_head is None) == (variant == "vanilla")  # vanilla's target is tied
        np.testing.assert_array_equal(_target_logits(target), want_logits)

    ref_dcfg, ref_drafter, ref_fp = load_drafter(src / "draft")
    assert ref_fp == fingerprint_tensors(_tensors(src / "draft"))
    assert ref_fp == manifest["draft"]["fingerprint"]
    want_draft = _draft_outputs(ref_drafter)
    for path in (out, out / "draft"):
        dcfg, drafter, fp = load_drafter(path)
        assert dcfg == ref_dcfg and fp == ref_fp
        _assert_exact(_draft_outputs(drafter), want_draft)


def test_serving_dtype_cast_agrees_across_sources(tmp_path, capsys):
    src = fixture_dir("gated")
    out = tmp_path / "out"
    assert _cli(capsys, "convert", "--target", src / "target", "--out", out)[0] == 0
    cfg, target, _ = load_target(out, dtype="bfloat16")
    assert cfg.dtype == "bfloat16"
    assert {a.dtype for a in jax.tree.leaves(target)} == {jnp.dtype(jnp.bfloat16)}
    _, ref_target, _ = load_target(src / "target", dtype="bfloat16")
    np.testing.assert_array_equal(_target_logits(target), _target_logits(ref_target))
    with pytest.raises(CheckpointError, match="holds no draft"):
        load_drafter(out)


def test_a_cast_load_still_checks_the_recorded_checksum(tmp_path, capsys):
    """A converted target whose parameters were modified (finite, plausible values) was refused
    by a plain load but loaded silently with a cast (`--dtype bfloat16` of generate/serve): the
    checksum was compared only without one. It is checked on the parameters as stored."""
    out = tmp_path / "conv"
    code, err = _cli(capsys, "convert", "--target", fixture_dir("vanilla") / "target", "--out", out)
    assert code == 0, err
    _, target, _ = load_target(out, progress=False)
    state = nnx.state(target)
    leaf = state["layers"][0]["mlp"]["down_proj"]["kernel"]
    leaf[...] = leaf[...].at[0, 0].add(1e-3)
    nnx.update(target, state)
    shutil.rmtree(out / "target" / "params")
    orbax_io.save_params(target, out / "target" / "params")
    for dtype in (None, "float32", "bfloat16", "float16"):
        with pytest.raises(CheckpointError, match=r"target's parameters do not match the checksum"):
            load_target(out, dtype, progress=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32", "bool"])
def test_host_checksums_equal_the_device_ones(monkeypatch, dtype):
    """A cast load checks the stored bits in host memory: the same finite flag and checksum as
    the device pass over the same leaf, in chunks too (the weights depend on the index)."""
    from dspark_jax.checkpoints import integrity

    x = (np.random.default_rng(3).standard_normal((37, 101)) * 3).astype(dtype)
    if dtype in ("float32", "bfloat16"):
        x[5, 7] = np.inf
    finite, checksum = jax.device_get(integrity._leaf_summary(jnp.asarray(x)))
    assert integrity._host_leaf_summary(x) == (bool(finite), int(checksum))
    monkeypatch.setattr(integrity, "_HOST_CHUNK", 100)
    assert integrity._host_leaf_summary(x) == (bool(finite), int(checksum))


def test_a_cast_load_places_only_cast_parameters(tmp_path, capsys, monkeypatch):
    """The checksum of a cast load is taken in host memory as read, and each leaf is cast as it
    is placed: reading the stored copy onto the device first, then casting, held both there
    (3x the served size for a float32 target served in bfloat16, enough to run a GPU out)."""
    out = tmp_path / "conv"
    code, err = _cli(capsys, "convert", "--target", fixture_dir("vanilla") / "target", "--out", out)
    assert code == 0, err
    _, stored, _ = load_target(out, progress=False)
    placed = []
    real = orbax_io.jnp.asarray

    def spy(x, *args, **kwargs):
        placed.append(np.dtype(x.dtype).name)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(orbax_io.jnp, "asarray", spy)
    cfg, cast, _ = load_target(out, "bfloat16", progress=False)
    monkeypatch.undo()
    assert placed and set(placed) == {"bfloat16"}
    assert cfg.dtype == "bfloat16"
    want = jax.tree.leaves(nnx.state(stored))
    got = jax.tree.leaves(nnx.state(cast))
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a[...].astype(jnp.bfloat16)), np.asarray(b[...]))


def _export_round_trip(tmp_path, capsys, draft: Path, *convert_args) -> Path:
    out, exported = tmp_path / "out", tmp_path / "exported"
    code, err = _cli(capsys, "convert", "--draft", draft, "--out", out, *convert_args)
    assert code == 0, err
    code, err = _cli(capsys, "export", "--draft", out, "--out", exported)
    assert code == 0, err
    assert SafetensorsFolder(exported).metadata == {"format": "pt"}
    return exported


@pytest.mark.parametrize("variant", VARIANTS)
def test_convert_export_round_trip_is_bit_exact(tmp_path, capsys, variant):
    draft = fixture_dir(variant) / "draft"
    exported = _export_round_trip(tmp_path, capsys, draft)
    _assert_same_tensors(_tensors(exported), _tensors(draft))
    assert (exported / "config.json").read_bytes() == (draft / "config.json").read_bytes()


def test_bf16_drafter_round_trip_is_bit_exact(tmp_path, capsys):
    fixture = fixture_dir("vanilla") / "draft"
    draft = tmp_path / "bf16-draft"
    draft.mkdir()
    state = {k: v.to(torch.bfloat16) for k, v in load_file(fixture / "model.safetensors").items()}
    save_file(state, draft / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(fixture / "config.json", draft / "config.json")
    _edit_config(draft, dtype="bfloat16")
    exported = _export_round_trip(tmp_path, capsys, draft)
    _assert_same_tensors(_tensors(exported), _tensors(draft))
    assert json.loads((exported / "config.json").read_text()) == json.loads(
        (draft / "config.json").read_text()
    )
    cfg, drafter, _ = load_drafter(tmp_path / "out")
    assert cfg.model.dtype == "bfloat16"
    assert {a.dtype for a in jax.tree.leaves(drafter)} == {jnp.dtype(jnp.bfloat16)}


def test_convert_dtype_bfloat16_casts_stored_params(tmp_path, capsys):
    draft = fixture_dir("gated") / "draft"
    exported = _export_round_trip(tmp_path, capsys, draft, "--dtype", "bfloat16")
    want = {k: v.astype(ml_dtypes.bfloat16) for k, v in _tensors(draft).items()}
    _assert_same_tensors(_tensors(exported), want)
    config = json.loads((exported / "config.json").read_text())
    original = json.loads((draft / "config.json").read_text())
    assert config == {**original, "dtype": "bfloat16"}


def test_convert_dtype_float16_for_gpus_without_bfloat16(tmp_path, capsys):
    # A T4 has no bfloat16: --dtype float16 stores and computes in half precision, within
    # float16's rounding of the float32 original.
    src, out = fixture_dir("gated"), tmp_path / "out"
    args = ("--draft", src / "draft", "--target", src / "target", "--out", out)
    code, err = _cli(capsys, "convert", *args, "--dtype", "float16")
    assert code == 0, err
    manifest = json.loads((out / "dspark_jax.json").read_text())
    assert manifest["dtype"] == "float16"
    assert manifest["draft"]["param_dtype"] == manifest["target"]["param_dtype"] == "float16"
    half = jnp.dtype(jnp.float16)
    cfg, target, _ = load_target(out)
    dcfg, drafter, _ = load_drafter(out)
    assert cfg.dtype == dcfg.model.dtype == "float16"
    assert {a.dtype for a in jax.tree.leaves(nnx.state(target))} == {half}
    assert {a.dtype for a in jax.tree.leaves(nnx.state(drafter, nnx.Param))} == {half}

    _, ref_target, _ = load_target(src / "target")
    got, want = _target_logits(target), _target_logits(ref_target)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=0.02, atol=0.02)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    _, ref_drafter, _ = load_drafter(src / "draft")
    got_block, want_block = _draft_outputs(drafter), _draft_outputs(ref_drafter)
    # corrected logits and confidence logits of the block, after the same greedy tokens
    np.testing.assert_array_equal(got_block[0], want_block[0])
    for g, w in zip(got_block[1:], want_block[1:], strict=True):
        np.testing.assert_allclose(g.astype(np.float32), w, rtol=0.02, atol=0.02)


def test_write_drafter_torch_for_a_drafter_trained_here(tmp_path):
    cfg, drafter, fp = load_drafter(fixture_dir("vanilla") / "draft")
    write_drafter_torch(drafter, None, tmp_path / "trained")
    written = json.loads((tmp_path / "trained" / "config.json").read_text())
    # model_type says what the folder is, so transformers' Auto classes do not load a bare Qwen3.
    assert written == {**cfg.to_hf(), "model_type": DRAFTER_MODEL_TYPE}
    cfg2, _, fp2 = load_drafter(tmp_path / "trained")
    assert cfg2 == cfg and fp2 == fp
    wrong = {**cfg.to_hf(), "block_size": cfg.block_size + 1}
    with pytest.raises(ConfigError, match="block_size"):
        write_drafter_torch(drafter, wrong, tmp_path / "wrong")
    _assert_nothing_written(tmp_path, "wrong")


def test_sharded_target_converts(tmp_path, capsys):
    src = fixture_dir("gated") / "target"
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    tensors = _tensors(src)
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for shard, keys in shards.items():
        save_safetensors({k: tensors[k] for k in keys}, sharded / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, sharded / name)

    code, err = _cli(capsys, "convert", "--target", sharded, "--out", tmp_path / "out")
    assert code == 0, err
    _, target, _ = load_target(tmp_path / "out")
    _, ref_target, _ = load_target(src)
    np.testing.assert_array_equal(_target_logits(target), _target_logits(ref_target))


def _drop_and_add_keys(draft: Path, target: Path) -> None:
    tensors = _tensors(draft)
    del tensors["markov_head.markov_w2.weight"]
    tensors["extra_head.weight"] = np.zeros((2, 2), np.float32)
    save_safetensors(tensors, draft / "model.safetensors")


def _reshape_norm(draft: Path, target: Path) -> None:
    tensors = _tensors(draft)
    tensors["hidden_norm.weight"] = tensors["hidden_norm.weight"][:95]
    save_safetensors(tensors, draft / "model.safetensors")


def _truncate(draft: Path, target: Path) -> None:
    path = draft / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _corrupt_header(draft: Path, target: Path) -> None:
    path = draft / "model.safetensors"
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    data[8 + header_len // 2 : 8 + header_len // 2 + 6] = b'\x00{]\xff"}'
    path.write_bytes(bytes(data))


def _retype(key: str, dtype):
    def breaker(draft: Path, target: Path) -> None:
        tensors = _tensors(draft)
        tensors[key] = tensors[key].astype(dtype)
        save_safetensors(tensors, draft / "model.safetensors")

    return breaker


BAD_INPUTS = {
    "integer_parameter": (
        _retype("norm.weight", np.int32),
        ["wrong dtype: non-floating parameters (1): norm.weight (int32)", "src-vanilla/draft: "],
    ),
    "mixed_float_dtypes": (
        _retype("fc.weight", np.float16),
        ["mixed floating dtypes: 30 parameters are float32, but fc.weight (float16)"],
    ),
    "missing_and_unexpected_keys": (
        _drop_and_add_keys,
        [
            "missing keys (1): markov_head.markov_w2.weight",
            "unexpected keys (1): extra_head.weight",
        ],
    ),
    "shape_mismatch": (_reshape_norm, ["hidden_norm.weight: expected [96], found [95]"]),
    "unknown_markov_head_type": (
        lambda d, t: _edit_config(d, markov_head_type="lstm"),
        ["unknown markov_head_type 'lstm'"],
    ),
    "hidden_size": (
        lambda d, t: _edit_config(t, hidden_size=120),
        ["hidden_size: drafter 96, target 120"],
    ),
    "vocab": (
        lambda d, t: _edit_config(t, vocab_size=300),
        ["vocab_size: drafter 288, target 300"],
    ),
    "layer_count": (
        lambda d, t: _edit_config(t, num_hidden_layers=5),
        ["layer count: drafter expects a 4-layer target, target has 5"],
    ),
    "final_layer_tap": (
        lambda d, t: _edit_config(d, target_layer_ids=[0, 3]),
        ["target_layer_ids contains 3, the target's final decoder layer"],
    ),
    "truncated": (_truncate, ["truncated: expected", "model.safetensors"]),
    "corrupt_header": (_corrupt_header, ["header is not valid JSON", "model.safetensors"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_reported_and_writes_nothing(tmp_path, capsys, case):
    breaker, expected = BAD_INPUTS[case]
    draft, target = _copy_fixture(tmp_path, "vanilla")
    breaker(draft, target)
    code, err = _cli(
        capsys, "convert", "--draft", draft, "--target", target, "--out", tmp_path / "out"
    )
    assert code == 2
    assert err.startswith("dspark-jax convert: error: ") and "Traceback" not in err
    for text in expected:
        assert text in err
    _assert_nothing_written(tmp_path)


def test_a_cast_takes_mixed_floats_but_never_integers(tmp_path, capsys):
    """--dtype says which dtype every parameter gets, so a mix of floats converts; an integer
    tensor is no parameter whatever the cast."""
    draft, _ = _copy_fixture(tmp_path, "vanilla")
    _retype("fc.weight", np.float16)(draft, None)
    cast = ["--dtype", "float32"]
    code, _ = _cli(capsys, "convert", "--draft", draft, "--out", tmp_path / "out", *cast)
    assert code == 0
    _, drafter, _ = load_drafter(tmp_path / "out")
    assert {x.dtype for x in jax.tree.leaves(nnx.state(drafter))} == {jnp.dtype("float32")}
    _retype("norm.weight", np.int32)(draft, None)
    code, err = _cli(capsys, "convert", "--draft", draft, "--out", tmp_path / "o2", *cast)
    assert code == 2 and "norm.weight (int32)" in err
    _assert_nothing_written(tmp_path, "o2")


def test_a_float64_checkpoint_converts_with_a_cast(tmp_path, capsys):
    """float64 tensors could not be converted even with --dtype float32 (the stored dtype was
    refused before the cast, in a message naming no file); without a cast the refusal names
    the file and the cast to give."""
    draft, target = _copy_fixture(tmp_path, "vanilla")
    weights = draft / "model.safetensors"
    save_file({k: v.double() for k, v in load_file(weights).items()}, weights)
    both = ["--draft", draft, "--target", target]
    code, err = _cli(capsys, "convert", *both, "--out", tmp_path / "out")
    assert code == 2, err
    assert f"{weights}: tensor " in err and "is float64, which the models do not compute" in err
    assert "--dtype float32" in err
    _assert_nothing_written(tmp_path)
    assert _cli(capsys, "convert", *both, "--dtype", "float32", "--out", tmp_path / "out")[0] == 0
    _, _, fingerprint = load_drafter(tmp_path / "out", progress=False)
    assert fingerprint == load_drafter(fixture_dir("vanilla") / "draft", progress=False)[2]


def test_a_tied_target_with_another_head_is_refused(tmp_path, capsys):
    """A target whose config ties the head to the embedding but whose file holds a different
    lm_head.weight (saved untied under a stale config) was converted with the embedding as its
    head, silently another model; a copy of the embedding is fine."""
    _, target = _copy_fixture(tmp_path, "vanilla")
    assert json.loads((target / "config.json").read_text())["tie_word_embeddings"]
    weights = target / "model.safetensors"
    tensors = load_file(weights)
    embed = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embed * 0.5 + 0.01}, weights)
    code, err = _cli(capsys, "convert", "--target", target, "--out", tmp_path / "out")
    assert code == 2 and f"{target}: config.json sets tie_word_embeddings, but" in err
    assert "lm_head.weight differs from model.embed_tokens.weight" in err
    _assert_nothing_written(tmp_path)
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_target(target, progress=False)
    save_file({**tensors, "lm_head.weight": embed.clone()}, weights)
    assert _cli(capsys, "convert", "--target", target, "--out", tmp_path / "out")[0] == 0
    np.testing.assert_array_equal(
        _target_logits(load_target(tmp_path / "out", progress=False)[1]),
        _target_logits(load_target(fixture_dir("vanilla") / "target", progress=False)[1]),
    )


def test_key_problems_list_a_few_names_and_the_counts():
    """A checkpoint saved under other key names (Qwen3Model without `model.`) listed every
    missing and unexpected key in one line, some 30 kB for an 8B target; each kind now names a
    few, as the dtype problems do, with its count."""
    from dspark_jax.checkpoints.convert import shape_problems

    expected = {f"model.layers.{i}.weight": (2,) for i in range(100)}
    found = {f"layers.{i}.weight": (2,) for i in range(100)}
    found.update({f"model.layers.{i}.weight": (3,) for i in range(20)})
    missing, unexpected, mismatched = shape_problems(expected, found)
    assert missing.startswith("missing keys (80): model.layers.20.weight, ")
    assert missing.endswith(" and 72 more") and missing.count(", ") == 7
    assert unexpected.startswith("unexpected keys (100): layers.0.weight, ")
    assert unexpected.endswith(" and 92 more")
    assert mismatched.startswith("shape mismatches (20): model.layers.0.weight: expected [2], ")
    assert mismatched.endswith(" and 12 more") and mismatched.count("; ") == 7


def test_existing_output_needs_overwrite(tmp_path, capsys):
    draft = fixture_dir("vanilla") / "draft"
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = _cli(capsys, "convert", "--draft", draft, "--out", out)
    assert code == 2 and "output directory exists" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]

    assert _cli(capsys, "convert", "--draft", draft, "--out", out, "--overwrite")[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["draft", "dspark_jax.json"]
    code, err = _cli(capsys, "export", "--draft", out, "--out", out / "draft")
    assert code == 2 and "overlaps the input" in err


def test_usage_errors(tmp_path, capsys):
    code, err = _cli(capsys, "convert", "--out", tmp_path / "out")
    assert code == 2 and "give --draft, --target or both" in err
    code, err = _cli(
        capsys,
        "convert",
        "--draft",
        fixture_dir("vanilla") / "draft",
        "--out",
        fixture_dir("vanilla"),
        "--overwrite",
    )
    assert code == 2 and "overlaps the input" in err
    assert (fixture_dir("vanilla") / "draft" / "model.safetensors").is_file()
    # A drafter without num_target_layers needs the target to fill it in.
    draft, target = _copy_fixture(tmp_path, "gated")
    config = json.loads((draft / "config.json").read_text())
    del config["num_target_layers"]
    (draft / "config.json").write_text(json.dumps(config))
    code, err = _cli(capsys, "convert", "--draft", draft, "--out", tmp_path / "out")
    assert code == 2 and "lacks num_target_layers" in err
    _assert_nothing_written(tmp_path)
    assert (
        _cli(capsys, "convert", "--draft", draft, "--target", target, "--out", tmp_path / "out")[0]
        == 0
    )
    assert json.loads((tmp_path / "out" / "draft" / "config.json").read_text()) == {
        **config,
        "num_target_layers": 4,
    }


def test_interrupt_leaves_no_output(tmp_path, capsys, monkeypatch):
    save = orbax_io.save_params

    def save_then_interrupt(model, params_dir):
        save(model, params_dir)
        raise KeyboardInterrupt

    monkeypatch.setattr(orbax_io, "save_params", save_then_interrupt)
    code, err = _cli(
        capsys, "convert", "--draft", fixture_dir("vanilla") / "draft", "--out", tmp_path / "out"
    )
    assert code == 130 and "interrupted" in err
    _assert_nothing_written(tmp_path)


_TERMINATED_WRITING = """
import os, signal, sys
from dspark_jax.checkpoints import converted, orbax_io
def then_sigterm(save):
    def save_then_sigterm(*args, **kwargs):
        save(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
    return save_then_sigterm
orbax_io.save_params = then_sigterm(orbax_io.save_params)
converted.save_safetensors = then_sigterm(converted.save_safetensors)
from dspark_jax.cli import main
sys.argv = ["dspark-jax", *sys.argv[1:]]
sys.exit(main())
"""


@pytest.mark.parametrize("command", ["convert", "export"])
def test_sigterm_leaves_no_output(tmp_path, command):
    """SIGTERM (timeout's, a scheduler's or a container stop's signal) while the output was
    written killed the process without a word and left its hidden working folder (gigabytes
    for a large target) beside --out: it is taken as Ctrl-C is, status 143 (128 + SIGTERM)."""
    draft = fixture_dir("vanilla") / "draft"
    argv = [sys.executable, "-c", _TERMINATED_WRITING, command, "--draft", str(draft)]
    done = subprocess.run(
        [*argv, "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 143, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == f"dspark-jax {command}: terminated"
    _assert_nothing_written(tmp_path)


def test_tampered_fingerprint_is_detected(tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        _cli(capsys, "convert", "--draft", fixture_dir("vanilla") / "draft", "--out", out)[0] == 0
    )
    manifest = json.loads((out / "dspark_jax.json").read_text())
    manifest["draft"]["fingerprint"] = "0" * 64
    (out / "dspark_jax.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="fingerprint recorded at conversion"):
        load_drafter(out / "draft")


def test_help_does_not_import_jax():
    code = (
        "import sys; from dspark_jax.cli import main; rc = main(['--help']); "
        "assert rc == 0 and 'jax' not in sys.modules, sorted(sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "convert" in done.stdout and "export" in done.stdout


def test_a_folder_of_the_wrong_kind_is_named_for_what_it_is(tmp_path, capsys):
    """Each mistake fails on what the folder is, not on a list of missing parameters."""
    root = fixture_dir("vanilla")
    out = tmp_path / "out"
    code, err = _cli(capsys, "convert", "--target", root / "draft", "--out", out)
    assert code == 2 and "draft looks like a drafter checkpoint (its config.json has" in err
    assert "missing keys" not in err
    code, err = _cli(capsys, "convert", "--draft", root / "target", "--out", out)
    assert code == 2 and "target looks like a target (a Qwen3 config.json" in err
    _assert_nothing_written(tmp_path)

    converted = tmp_path / "conv"
    both = ["--draft", root / "draft", "--target", root / "target"]
    assert _cli(capsys, "convert", *both, "--out", converted)[0] == 0
    for given in (converted, converted / "draft"):
        code, err = _cli(capsys, "convert", "--draft", given, "--out", out)
        assert code == 2 and f"{given} is already a converted dspark-jax folder" in err
    with pytest.raises(CheckpointError, match=r"conv/draft is the drafter of a converted folder"):
        load_target(converted / "draft", progress=False)
    with pytest.raises(CheckpointError, match=r"conv/target is the target of a converted folder"):
        load_drafter(converted / "target", progress=False)

    spec = tmp_path / "spec"
    export = ["export", "--draft", converted, "--format", "speculators", "--out", spec]
    assert _cli(capsys, *export)[0] == 0
    with pytest.raises(CheckpointError, match=r"vLLM's speculators layout .* --format reference"):
        load_drafter(spec, progress=False)


def test_a_training_run_gives_its_final_drafter(tmp_path):
    """`--draft runs/x` means the drafter the run exported, as export takes run folders."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"without its final drafter/ .* dspark-jax export"):
        load_drafter(run, progress=False)
    shutil.copytree(fixture_dir("vanilla") / "draft", run / "drafter")
    fingerprint = load_drafter(fixture_dir("vanilla") / "draft", progress=False)[2]
    assert load_drafter(run, progress=False)[2] == fingerprint


def test_a_target_without_its_drafter_names_the_embedded_default(capsys):
    target = fixture_dir("vanilla") / "target"
    code, err = _cli(capsys, "generate", "--target", target, "--max-new-tokens", "4")
    assert code == 2
    assert "came without --draft, so the drafter is the embedded dspark-jax-default one" in err
    assert "give --draft (its own drafter) or --no-draft" in err
