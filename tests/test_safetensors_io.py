import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dspark_jax.checkpoints.safetensors_io import (
    CheckpointError,
    SafetensorsFolder,
    atomic_output_dir,
    save_safetensors,
)

FIXTURE_DRAFT = Path(__file__).parent / "fixtures" / "deepspec-tiny-gated" / "draft"


def _sample_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w_f32": rng.standard_normal((3, 5)).astype(np.float32),
        "w_transposed_f32": rng.standard_normal((5, 3)).astype(np.float32).T,
        "w_bf16": rng.standard_normal((4, 7)).astype(ml_dtypes.bfloat16),
        "w_f16": rng.standard_normal((2, 3, 2)).astype(np.float16),
        "ids_i64": rng.integers(-(2**40), 2**40, size=(6,), dtype=np.int64),
        "mask_bool": rng.random((5,)) > 0.5,
        "scalar_f32": np.float32(1.5).reshape(()),
        "empty_i32": np.zeros((0, 4), np.int32),
    }


def _bits(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def _write_raw(path: Path, header: dict | bytes, data: bytes = b"") -> Path:
    header_bytes = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + data)
    return path


def _write_sharded(folder: Path) -> dict[str, np.ndarray]:
    tensors = _sample_tensors()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:3]}
    shards["model-00002-of-00002.safetensors"] = names[3:]
    folder.mkdir(exist_ok=True)
    for shard, keys in shards.items():
        save_safetensors({k: tensors[k] for k in keys}, folder / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def test_round_trip_preserves_bits_dtypes_shapes_and_metadata(tmp_path):
    tensors = _sample_tensors()
    save_safetensors(tensors, tmp_path / "model.safetensors", metadata={"format": "pt", "a": "b"})
    folder = SafetensorsFolder(tmp_path)
    assert folder.keys() == sorted(tensors)
    assert folder.metadata == {"format": "pt", "a": "b"}
    for key, want in tensors.items():
        assert folder.dtype(key) == want.dtype, key
        assert folder.shape(key) == want.shape, key
        got = folder.get(key)
        assert got.dtype == want.dtype and got.shape == want.shape, key
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=key)
    assert folder.dtype("w_bf16") == np.dtype(ml_dtypes.bfloat16)


def test_default_metadata_and_single_file_path(tmp_path):
    path = tmp_path / "x.safetensors"
    save_safetensors({"a": np.arange(3, dtype=np.float32)}, path)
    folder = SafetensorsFolder(path)
    assert folder.metadata == {"format": "pt"}
    np.testing.assert_array_equal(folder.get("a"), np.arange(3, dtype=np.float32))


def test_torch_reads_our_file_bit_exactly(tmp_path):
    tensors = _sample_tensors()
    save_safetensors(tensors, tmp_path / "model.safetensors")
    loaded = load_file(tmp_path / "model.safetensors")
    assert sorted(loaded) == sorted(tensors)
    assert loaded["w_bf16"].dtype == torch.bfloat16
    for key, want in tensors.items():
        got = loaded[key]
        assert tuple(got.shape) == want.shape, key
        got_bytes = got.contiguous().view(-1).view(torch.uint8).numpy()
        np.testing.assert_array_equal(got_bytes, _bits(want), err_msg=key)


def test_we_read_torch_bf16_file_bit_exactly(tmp_path):
    want = torch.randn(5, 9, generator=torch.Generator().manual_seed(0)).bfloat16()
    save_file({"w": want}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    got = SafetensorsFolder(tmp_path).get("w")
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(
        got.view(np.uint16), want.view(torch.int16).numpy().view(np.uint16)
    )


def test_reads_reference_fixture_like_safe_open():
    folder = SafetensorsFolder(FIXTURE_DRAFT)
    with safe_open(FIXTURE_DRAFT / "model.safetensors", framework="numpy") as ref:
        assert folder.keys() == sorted(ref.keys())
        assert folder.metadata == ref.metadata()
        for key in ref.keys():
            want = ref.get_tensor(key)
            assert folder.shape(key) == want.shape, key
            assert folder.dtype(key) == want.dtype, key
            np.testing.assert_array_equal(folder.get(key), want, err_msg=key)


def test_sharded_folder_with_index(tmp_path):
    tensors = _write_sharded(tmp_path)
    folder = SafetensorsFolder(tmp_path)
    assert folder.keys() == sorted(tensors)
    assert len(folder) == len(tensors) and "w_f32" in folder and "nope" not in folder
    assert folder.metadata == {"format": "pt"}
    for key, want in tensors.items():
        np.testing.assert_array_equal(_bits(folder.get(key)), _bits(want), err_msg=key)


def test_unknown_key_is_a_checkpoint_error(tmp_path):
    save_safetensors({"a": np.zeros(2, np.float32)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no tensor named 'b'"):
        SafetensorsFolder(tmp_path).get("b")


def _good_header() -> dict:
    return {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}


def _bad_single_file(tmp_path: Path, case: str) -> Path:
    """Builds a folder whose model.safetensors has the defect `case`; returns the file path."""
    path = tmp_path / "model.safetensors"
    header = _good_header()
    if case == "short":
        path.write_bytes(b"\x01\x02\x03")
    elif case == "header_too_long":
        path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    elif case == "bad_json":
        _write_raw(path, b'{"a": [', bytes(24))
    elif case == "truncated":
        _write_raw(path, header, bytes(20))
    elif case == "inconsistent":
        header["a"]["data_offsets"] = [0, 20]
        _write_raw(path, header, bytes(24))
    elif case == "unknown_dtype":
        header["a"]["dtype"] = "F12"
        _write_raw(path, header, bytes(24))
    elif case == "dtype_not_a_string":  # was a TypeError (an unhashable list) with a traceback
        header["a"]["dtype"] = ["F32"]
        _write_raw(path, header, bytes(24))
    elif case == "nested_too_deeply":  # was a RecursionError with a traceback
        _write_raw(path, b"[" * 100_000 + b"]" * 100_000, bytes(24))
    return path


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("short", "shorter than the 8-byte header"),
        ("header_too_long", "header length 1000 is larger than the file"),
        ("bad_json", "header is not valid JSON"),
        ("truncated", "truncated: expected 24 bytes of tensor data, file has 20"),
        ("inconsistent", "span 20 bytes but shape [2, 3] x F32 (4 bytes) needs 24"),
        ("unknown_dtype", "unknown dtype 'F12'"),
        ("dtype_not_a_string", "unknown dtype ['F32']"),
        ("nested_too_deeply", "header is JSON nested too deeply to read"),
    ],
)
def test_bad_single_file_errors(tmp_path, case, fragment):
    path = _bad_single_file(tmp_path, case)
    with pytest.raises(CheckpointError) as info:
        SafetensorsFolder(tmp_path)
    assert fragment in str(info.value)
    assert str(path) in str(info.value)


def test_missing_folder_and_empty_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        SafetensorsFolder(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="contains neither model.safetensors nor"):
        SafetensorsFolder(tmp_path)


def test_bad_index_errors(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON") as info:
        SafetensorsFolder(tmp_path)
    assert str(index) in str(info.value)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="no 'weight_map'"):
        SafetensorsFolder(tmp_path)
    index.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="JSON nested too deeply to read"):
        SafetensorsFolder(tmp_path)


def test_index_naming_missing_shard(tmp_path):
    _write_sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing: \\['model-00002-of-00002.safetensors'\\]"):
        SafetensorsFolder(tmp_path)


def test_index_key_absent_from_its_shard(tmp_path):
    _write_sharded(tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00002.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="key 'ghost' is listed in shard model-00001"):
        SafetensorsFolder(tmp_path)


def test_overlapping_tensors_are_rejected(tmp_path):
    header = _good_header()
    header["b"] = {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}
    _write_raw(tmp_path / "model.safetensors", header, bytes(24))
    with pytest.raises(CheckpointError, match="'a' and 'b' overlap"):
        SafetensorsFolder(tmp_path)


def test_atomic_output_dir_success_and_refusal(tmp_path):
    out = tmp_path / "ckpt"
    with atomic_output_dir(out) as tmp:
        assert tmp.parent == tmp_path and tmp != out and not out.exists()
        (tmp / "f.txt").write_text("new")
    assert (out / "f.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(FileExistsError, match="exists"), atomic_output_dir(out):
        pytest.fail("body must not run when the output exists")
    assert (out / "f.txt").read_text() == "new"


@pytest.mark.parametrize("existing", [False, True])
def test_atomic_output_dir_exception_leaves_nothing(tmp_path, existing):
    out = tmp_path / "ckpt"
    if existing:
        out.mkdir()
        (out / "f.txt").write_text("old")
    with pytest.raises(RuntimeError, match="boom"), atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "f.txt").write_text("partial")
        raise RuntimeError("boom")
    if existing:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
        assert [p.name for p in out.iterdir()] == ["f.txt"]
        assert (out / "f.txt").read_text() == "old"
    else:
        assert list(tmp_path.iterdir()) == []


def test_atomic_output_dir_overwrite_replaces(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "f.txt").write_text("new")
    assert [p.name for p in out.iterdir()] == ["f.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
