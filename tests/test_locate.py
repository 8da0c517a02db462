"""Resolving what the user names: a local folder or a hub id."""

import huggingface_hub.constants
import pytest

from dspark_jax.checkpoints.locate import resolve_model_dir
from dspark_jax.checkpoints.safetensors_io import CheckpointError


def test_resolve_model_dir_local_and_errors(tmp_path, monkeypatch):
    assert resolve_model_dir(str(tmp_path)) == tmp_path
    with pytest.raises(CheckpointError, match="not a Hugging Face hub id"):
        resolve_model_dir(str(tmp_path / "a" / "b"))
    file_path = tmp_path / "file.txt"
    file_path.write_text("")
    with pytest.raises(CheckpointError, match="is not a directory"):
        resolve_model_dir(str(file_path))

    # The constants are read at import time, so patch them as well as the environment.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="no such folder, and the Hugging Face hub"):
        resolve_model_dir("dspark-test-org/no-such-model")
