"""Where a benchmark number came from: the commit it was measured at."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit() -> str:
    """Short hash of HEAD, with "+dirty" when the working tree has uncommitted changes."""
    here = Path(__file__).parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, cwd=here
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
