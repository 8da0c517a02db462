"""The launchers users copy (`serve/serve_gpu.sh`, `serve/serve_tpu.sh`, `train/single_gpu.sh`,
`train/tpu_pod.sh`): the command line each hands `dspark-jax`, read by a stand-in `dspark-jax` on
the PATH, and that command line parsed by the command's real parser, so a launcher cannot pass
an option the command has dropped or renamed. (`train/slurm_multinode.sbatch` trains for real
under a stand-in `srun`: tests/test_train_multihost.py.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dspark_jax.cli import _parser

ROOT = Path(__file__).parents[1]
# What the launchers read from the environment: none leaks in from the developer's.
SETTINGS = ("MODEL", "MESH", "HOST", "PORT", "MAX_MODEL_LEN", "CONFIG", "OUTPUT", "DATA")


def _launch(tmp_path, script, env=(), args=()):
    """(exit status, the arguments `script` (a path from the repository's root) ran
    `dspark-jax` with, its stderr)."""
    fake = tmp_path / "bin" / "dspark-jax"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    environ.update(env, PATH=f"{fake.parent}:{os.environ['PATH']}")
    done = subprocess.run(
        ["bash", str(ROOT / script), *args], env=environ, capture_output=True, text=True
    )
    return done.returncode, done.stdout.splitlines(), done.stderr


def _serve_args(argv):
    assert argv[0] == "serve"
    return _parser("serve").parse_args(argv)


def test_gpu_launcher_without_a_model_serves_the_embedded_pair(tmp_path):
    status, argv, _ = _launch(tmp_path, "serve/serve_gpu.sh")
    assert status == 0
    assert argv == ["serve", "--host", "0.0.0.0", "--port", "8000", "--max-num-seqs", "16"]
    args = _serve_args(argv)
    assert (args.target, args.draft, args.max_model_len) == (None, None, None)


def test_gpu_launcher_passes_a_model_path_with_spaces_whole(tmp_path):
    model = str(tmp_path / "my models" / "qwen3-4b")
    status, argv, _ = _launch(
        tmp_path, "serve/serve_gpu.sh", {"MODEL": model, "PORT": "9001"}, ["--penalties"]
    )
    assert status == 0
    args = _serve_args(argv)
    assert (args.target, args.draft) == (model, model)
    assert (args.port, args.max_num_seqs, args.max_model_len) == (9001, 16, 4096)
    assert args.penalties
    status, argv, _ = _launch(
        tmp_path, "serve/serve_gpu.sh", {"MODEL": model, "MAX_MODEL_LEN": "8192"}
    )
    assert _serve_args(argv).max_model_len == 8192


@pytest.mark.parametrize("mesh", [None, "1,1,4", "-1,1,1"])
def test_tpu_launcher_command_line_parses(tmp_path, mesh):
    model = str(tmp_path / "my models" / "qwen3-8b")
    env = {"MODEL": model, **({"MESH": mesh} if mesh else {})}
    status, argv, _ = _launch(tmp_path, "serve/serve_tpu.sh", env)
    assert status == 0
    args = _serve_args(argv)
    assert (args.target, args.draft, args.dtype) == (model, model, "bfloat16")
    assert (args.host, args.max_num_seqs, args.max_model_len) == ("0.0.0.0", 32, 4096)
    expected_mesh = None if mesh is None else tuple(int(n) for n in mesh.split(","))
    given = args.mesh and (args.mesh.data, args.mesh.fsdp, args.mesh.tensor)
    assert given == expected_mesh


def test_tpu_launcher_without_a_model_says_what_to_set(tmp_path):
    status, argv, err = _launch(tmp_path, "serve/serve_tpu.sh")
    assert status != 0 and argv == []
    assert "set MODEL to a converted folder" in err


def test_single_gpu_launcher_leaves_the_default_output_to_the_cli(tmp_path):
    status, argv, _ = _launch(tmp_path, "train/single_gpu.sh", {"CONFIG": "my.py"})
    assert status == 0
    assert argv == ["train", "--config", "my.py", "--mesh=-1,1,1"]
    _, argv, _ = _launch(
        tmp_path, "train/single_gpu.sh", {"CONFIG": "my.py", "OUTPUT": "runs/my run"}
    )
    assert argv == ["train", "--config", "my.py", "--output", "runs/my run", "--mesh=-1,1,1"]
    args = _parser("train").parse_args(argv)
    assert (args.output, args.mesh.data, args.mesh.fsdp, args.mesh.tensor) == (
        "runs/my run",
        -1,
        1,
        1,
    )


def test_tpu_pod_launcher_command_line_parses(tmp_path):
    """DATA's paths (space-separated) each a --data file, the mesh over every chip's fsdp; no
    OUTPUT, a refusal that says what to set."""
    status, argv, err = _launch(tmp_path, "train/tpu_pod.sh")
    assert status != 0 and argv == []
    assert "set OUTPUT to a folder that every host of the slice shares" in err
    output = str(tmp_path / "shared runs" / "8b")
    env = {"OUTPUT": output, "DATA": "a.jsonl b.jsonl"}
    status, argv, _ = _launch(tmp_path, "train/tpu_pod.sh", env, ["--steps", "7"])
    assert status == 0
    args = _parser("train").parse_args(argv)
    assert (args.config, args.output) == ("dspark-qwen3-8b", output)
    assert args.data == ["a.jsonl", "b.jsonl"] and args.steps == 7
    assert args.distributed and args.no_progress
    assert (args.mesh.data, args.mesh.fsdp, args.mesh.tensor) == (1, -1, 1)
