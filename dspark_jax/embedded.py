"""Where the embedded default model pair lives.

The tiny byte-level target and drafter of the test fixtures (tests/fixtures/deepspec-tiny-vanilla)
ship as package data under `assets/tiny-vanilla/` (`target/` and `draft/`, see its README), so the
programs run offline with no checkpoint given. Library code finds them here.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

EMBEDDED_DIR = Path(str(resources.files("dspark_jax").joinpath("assets", "tiny-vanilla")))
EMBEDDED_NAME = EMBEDDED_DIR.name
EMBEDDED_TARGET = EMBEDDED_DIR / "target"
EMBEDDED_DRAFT = EMBEDDED_DIR / "draft"
