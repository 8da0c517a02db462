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


def logit_bias(text: str) -> dict[int, float]:
    """A JSON object of token ids to biases, as the OpenAI API's `logit_bias` takes it
    ('{"1024": -100, "42": 5}'); the ids and values are checked by `SamplingConfig`."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f'expected a JSON object of token ids to biases (\'{{"1024": -100}}\'), got {text!r}'
        )
    out = {}
    for key, bias in value.items():
        # ASCII digits only: str.isdigit() also takes "²", which int() refuses.
        if not (key.isascii() and key.isdigit()) or (len(key) > 1 and key[0] == "0"):
            raise argparse.ArgumentTypeError(f"keys are token ids (0, 1, 2, ...), got {key!r}")
        out[int(key)] = bias
    return out



def int_list(text: str, least: int = 0) -> tuple[int, ...]:
    """Integers separated by commas or spaces ("32,101 115"): one or more, each >= `least`."""
    try:
        values = tuple(int(v) for v in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}"
        ) from None
    if not values or min(values) < least:
        raise argparse.ArgumentTypeError(f"expected one or more integers >= {least}, got {text!r}")
    return values


def token_ids(text: str) -> tuple[int, ...]:
    return int_list(text, 0)


def positive_ints(text: str) -> tuple[int, ...]:
    return int_list(text, 1)
