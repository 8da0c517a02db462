"""Where the model pairs shipped as package data live.

The default pair (`assets/default/`: a 4M-parameter Qwen3 target with a BPE tokenizer and chat
template, and its DSpark drafter, built by scripts/build_default_pair.py; see its README) is what
the commands, the server and the notebook decode with when no checkpoint is given, so they write
readable text offline on any machine. The tiny byte-level pair of the test fixtures
(`assets/tiny-vanilla/`, the same files as tests/fixtures/deepspec-tiny-vanilla) stays packaged
for the tiny training recipes (`dspark-jax train --config tiny-dspark`), which train against it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

_ASSETS = Path(str(resources.files("dspark_jax").joinpath("assets")))

EMBEDDED_DIR = _ASSETS / "default"
EMBEDDED_NAME = "dspark-jax-default"
EMBEDDED_TARGET = EMBEDDED_DIR / "target"
EMBEDDED_DRAFT = EMBEDDED_DIR / "draft"

TINY_DIR = _ASSETS / "tiny-vanilla"
TINY_TARGET = TINY_DIR / "target"
TINY_DRAFT = TINY_DIR / "draft"
