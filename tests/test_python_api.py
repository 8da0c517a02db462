"""The library as a program imports it: the top-level names, and README's "From Python" example
run as written."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import dspark_jax

README = Path(__file__).resolve().parents[1] / "README.md"


def test_top_level_names_resolve_and_import_no_jax_until_used():
    assert dspark_jax.__all__[0] == "__version__"
    assert dspark_jax.__all__[1:] == list(dspark_jax._EXPORTS)
    for name in dspark_jax.__all__:
        assert getattr(dspark_jax, name) is not None, name
    from dspark_jax.decoding.engine import Engine

    assert dspark_jax.Engine is Engine
    assert set(dspark_jax.__all__) <= set(dir(dspark_jax))
    try:
        dspark_jax.Engin  # noqa: B018
    except AttributeError as e:
        assert "no attribute 'Engin'" in str(e)
    else:
        raise AssertionError("a misspelt name resolved")
    # The CLI's first import stays light: JAX loads with the first name that needs it.
    probe = "import sys, dspark_jax; print('jax' in sys.modules)"
    light = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert light.stdout.strip() == "False", light.stderr


def _readme_example() -> str:
    section = README.read_text().split("## From Python", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    return blocks[0]


def test_readme_example_runs_as_written(tmp_path):
    code = _readme_example()
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    answers = [line for line in lines if line.startswith("  [")]
    assert len(answers) == 2, done.stdout
    for line in answers:
        finish, count, tau = re.match(r"  \[(\w+), (\d+) tokens, tau ([\d.]+)\]", line).groups()
        assert finish in ("stop", "length") and 1 <= int(count) <= 64
        assert float(tau) >= 1.0


def test_training_docs_example_runs_as_written(tmp_path):
    """docs/training.md, "Training from Python": train, stop, resume, export, load."""
    docs = README.parent / "docs" / "training.md"
    section = docs.read_text().split("## Training from Python", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "steps 4 resumed from 2" in done.stdout
    assert "resumed from step 2" in done.stderr  # logging.basicConfig shows the notices
    assert (tmp_path / "runs" / "py" / "drafter").is_dir()
    # The commands that follow run the trained drafter on its own target.
    (shell,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-ec", shell.rstrip() + " --max-new-tokens 8"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tau" in done.stdout + done.stderr


def test_train_config_takes_paths(tmp_path):
    from dspark_jax.configs.train_tiny import TRAIN_CONFIGS

    base = TRAIN_CONFIGS["tiny-dspark"]
    one = dataclasses.replace(base, data=tmp_path / "a.jsonl", eval_data=Path("b.jsonl"))
    assert one.data == (str(tmp_path / "a.jsonl"),) and one.eval_data == ("b.jsonl",)
    two = dataclasses.replace(base, data=[Path("a.jsonl"), "b.jsonl"], target=tmp_path)
    assert two.data == ("a.jsonl", "b.jsonl") and two.target == str(tmp_path)
