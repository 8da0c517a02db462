"""argparse `type=` functions shared by the commands and the repository's scripts; light (no
JAX), so a script's `--help` stays quick."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A whole number >= 1 (argparse names the flag in front of the message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def unit_interval(text: str) -> float:
    """A number in [0, 1], a confidence (argparse names the flag in front of the message)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # nan fails too
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {text}")
    return value
