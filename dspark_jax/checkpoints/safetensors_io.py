"""Safetensors file I/O: a validating lazy reader for Hugging Face model folders, a writer and
atomic output directories.

The reader parses the safetensors header itself (8-byte little-endian length, then JSON) so that
every malformed input is reported as a `CheckpointError` naming the file and the problem before
any tensor is used, and so that bfloat16 works in numpy (the safetensors numpy backend rejects
it). Tensors are read one at a time, so 8B/14B targets never have to fit in host memory at once.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
import socket
import struct
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from dspark_jax.checkpoints import interrupts
from dspark_jax.errors import UserError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Explicit little-endian: the format is little-endian whatever the host is.
_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_DTYPE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in _DTYPES.items()}


class CheckpointError(UserError):
    """Malformed or missing checkpoint input; the message names the file and the problem."""


@dataclass(frozen=True)
class _TensorInfo:
    path: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor data in the file
    nbytes: int


def _read_header(path: Path) -> tuple[dict[str, str], dict[str, _TensorInfo]]:
    """Parses and validates one safetensors header; returns (metadata, tensors)."""
    file_size = path.stat().st_size
    if file_size < 8:
        raise CheckpointError(f"{path}: file is {file_size} bytes, shorter than the 8-byte header")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > file_size - 8:
            raise CheckpointError(
                f"{path}: header length {header_len} is larger than the file "
                f"({file_size - 8} bytes after the length prefix)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from e
    except RecursionError:
        raise CheckpointError(f"{path}: header is JSON nested too deeply to read") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, not an object")

    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")

    data_start = 8 + header_len
    data_size = file_size - data_start
    tensors: dict[str, _TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for key, entry in header.items():
        where = f"{path}: tensor {key!r}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: header entry is not an object")
        dtype_name = entry.get("dtype")
        if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
            raise CheckpointError(
                f"{where}: unknown dtype {dtype_name!r} (known: {', '.join(_DTYPES)})"
            )
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative ints")
        offsets = entry.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise CheckpointError(f"{where}: data_offsets {offsets!r} are not [begin, end]")
        dtype = _DTYPES[dtype_name]
        expected = math.prod(shape) * dtype.itemsize
        begin, end = offsets
        if end - begin != expected:
            raise CheckpointError(
                f"{where}: data_offsets {offsets} span {end - begin} bytes but shape {shape} x "
                f"{dtype_name} ({dtype.itemsize} bytes) needs {expected}"
            )
        tensors[key] = _TensorInfo(path, dtype, tuple(shape), data_start + begin, expected)
        spans.append((begin, end, key))

    data_end = max((end for _, end, _ in spans), default=0)
    if data_end > data_size:
        raise CheckpointError(
            f"{path}: truncated: expected {data_end} bytes of tensor data, file has {data_size}"
        )
    # Overlapping tensors would silently alias each other's bytes.
    spans.sort()
    for (_, prev_end, prev_key), (begin, _, key) in zip(spans, spans[1:], strict=False):
        if begin < prev_end:
            raise CheckpointError(f"{path}: tensors {prev_key!r} and {key!r} overlap")
    return metadata, tensors


def _load_index(index_path: Path) -> dict[str, str]:
    try:
        index = json.loads(index_path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index_path}: not valid JSON ({e})") from e
    except RecursionError:
        raise CheckpointError(f"{index_path}: JSON nested too deeply to read") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f"{index_path}: no 'weight_map' object mapping keys to shard files")
    return weight_map


class SafetensorsFolder:
    """Lazy, validated view of a model folder (`model.safetensors` or an index with shards).

    A path to a single `.safetensors` file is accepted too. All headers are parsed and checked
    on construction; tensor data is read only by `get`, one tensor at a time.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if self.path.is_file() and self.path.suffix == ".safetensors":
            self.metadata, self._tensors = _read_header(self.path)
            return
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: checkpoint folder does not exist")
        single, index_path = self.path / SINGLE_FILE, self.path / INDEX_FILE
        if single.is_file():
            self.metadata, self._tensors = _read_header(single)
            return
        if not index_path.is_file():
            raise CheckpointError(f"{self.path}: contains neither {SINGLE_FILE} nor {INDEX_FILE}")

        weight_map = _load_index(index_path)
        shard_names = sorted(set(weight_map.values()))
        missing = [name for name in shard_names if not (self.path / name).is_file()]
        if missing:
            raise CheckpointError(f"{index_path}: shard files listed but missing: {missing}")
        headers = {name: _read_header(self.path / name) for name in shard_names}
        self._tensors = {}
        for key, name in weight_map.items():
            shard_tensors = headers[name][1]
            if key not in shard_tensors:
                raise CheckpointError(
                    f"{index_path}: key {key!r} is listed in shard {name} but absent from it"
                )
            self._tensors[key] = shard_tensors[key]
        # Shards written together carry the same metadata; the first one stands for all.
        self.metadata = headers[shard_names[0]][0] if shard_names else {}

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._tensors)

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def _info(self, key: str) -> _TensorInfo:
        try:
            return self._tensors[key]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named {key!r}") from None

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of tensor `key`, from the header."""
        return self._info(key).shape

    def dtype(self, key: str) -> np.dtype:
        """Numpy dtype of tensor `key` (bfloat16 as `ml_dtypes.bfloat16`)."""
        return self._info(key).dtype

    def file(self, key: str) -> Path:
        """The file holding tensor `key` (one of the shards of a sharded folder)."""
        return self._info(key).path

    def get(self, key: str) -> np.ndarray:
        """Reads tensor `key` from disk into a new writable array."""
        info = self._info(key)
        out = np.empty(info.shape, info.dtype)
        with open(info.path, "rb") as f:
            f.seek(info.offset)
            got = f.readinto(out.reshape(-1).view(np.uint8))
        if got != info.nbytes:
            raise CheckpointError(
                f"{info.path}: truncated: tensor {key!r} needs {info.nbytes} bytes, read {got}"
            )
        return out


def save_safetensors(
    tensors: Mapping[str, np.ndarray],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Writes `tensors` as one standard safetensors file (readable by `safetensors.torch`)."""
    metadata = {"format": "pt"} if metadata is None else dict(metadata)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"{path}: metadata must map strings to strings")
    arrays: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        if not isinstance(key, str) or not key or key == "__metadata__":
            raise CheckpointError(f"{path}: invalid tensor name {key!r}")
        array = np.asarray(value)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        if array.dtype not in _DTYPE_NAMES:
            raise CheckpointError(f"{path}: tensor {key!r} has unsupported dtype {array.dtype}")
        # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
        arrays[key] = np.require(array, requirements="C")

    # Widest dtypes first keeps every tensor aligned to its item size (the data starts 8-aligned).
    order = sorted(arrays, key=lambda k: (-arrays[k].dtype.itemsize, k))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key in order:
        array = arrays[key]
        header[key] = {
            "dtype": _DTYPE_NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for key in order:
            f.write(arrays[key].reshape(-1).view(np.uint8))


# Leftovers of a crashed run that recorded no owner (older builds) or ran on another host (a
# shared filesystem) are judged by age: a live run writes into its folder, keeping its mtime fresh,
# and converting the largest targets takes well under an hour.
STALE_AFTER_S = 24 * 3600


def _owner() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


# Errors of a write that name no file (a full disk under `file.write`).
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}


def _failed_writing_into(error: OSError, folder: Path) -> bool:
    """Whether `error` is about a path in `folder` (or `folder` itself), or names no path while
    its errno is that of a failed write."""
    if not error.errno:
        return False
    if error.filename is None:
        return error.errno in _WRITE_ERRNOS
    try:
        return Path(os.fsdecode(error.filename)).absolute().is_relative_to(folder.absolute())
    except (TypeError, ValueError):
        return False


def remove_stale_siblings(path: Path) -> list[Path]:
    """Removes the hidden working folders `.NAME.tmp-*` (and `.NAME.old-*` once NAME exists
    again) that earlier runs killed mid-write left beside `path`; returns what was removed.

    One whose owner (host and pid are in its name) is a dead process on this host is stale; an
    `.old-` one is the previous output moved aside, so it goes only when `path` is back in place.
    Without an owner on this host, only age tells (`STALE_AFTER_S`)."""
    if not path.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(tmp|old)-(.+)")
    owned = re.compile(r"(.+)-(\d+)-[0-9a-f]{12}")
    host = socket.gethostname()
    removed = []
    for sibling in path.parent.iterdir():
        match = pattern.fullmatch(sibling.name)
        if match is None or not sibling.is_dir():
            continue
        if match.group(1) == "old" and not path.exists():
            continue
        owner = owned.fullmatch(match.group(2))
        if owner is not None and owner.group(1) == host:
            stale = not _pid_alive(int(owner.group(2)))
        else:
            stale = time.time() - sibling.stat().st_mtime > STALE_AFTER_S
        if stale:
            shutil.rmtree(sibling, ignore_errors=True)
            removed.append(sibling)
    return removed


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yields a fresh sibling directory to write into; renames it to `path` on success.

    On any exception the temporary directory is deleted and `path` is left untouched. With
    `overwrite`, an existing `path` directory is moved aside, replaced, then deleted. Working
    folders of earlier runs that were killed are removed first (`remove_stale_siblings`). Ctrl-C
    is honoured even when a library swallows it, and never interrupts the rename or the cleanup.
    """
    path = Path(path)

    def check_target() -> None:
        if path.exists() and not path.is_dir():
            raise FileExistsError(f"{path}: exists and is not a directory; refusing to replace it")
        if path.exists() and not overwrite:
            raise FileExistsError(
                f"{path}: output directory exists (use --overwrite to replace it)"
            )

    check_target()
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(path)
    # A sibling, so the final rename stays on one filesystem and is atomic.
    tmp = path.parent / f".{path.name}.tmp-{_owner()}-{uuid.uuid4().hex[:12]}"
    old: Path | None = None
    with interrupts.guarded() as guard:
        tmp.mkdir()
        try:
            yield tmp
            guard.check()
            with guard.holding():
                check_target()
                if path.exists():
                    old = path.parent / f".{path.name}.old-{_owner()}-{uuid.uuid4().hex[:12]}"
                    os.replace(path, old)
                try:
                    os.replace(tmp, path)
                except BaseException:
                    if old is not None:
                        os.replace(old, path)
                    raise
        except BaseException as e:
            with guard.holding():
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and _failed_writing_into(e, tmp):
                # Named by the folder asked for, not the hidden working folder just removed.
                raise OSError(e.errno, e.strerror, str(path)) from e
            raise
        if old is not None:
            with guard.holding():
                shutil.rmtree(old)
