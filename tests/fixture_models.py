"""Loads the golden fixtures of the PyTorch reference vendored under tests/fixtures."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import pytest

from dspark_jax.checkpoints.convert import drafter_from_torch, target_from_torch
from dspark_jax.checkpoints.safetensors_io import SafetensorsFolder
from dspark_jax.config import DrafterConfig, Qwen3Config, read_config_json
from dspark_jax.decoding.engine import EngineConfig

FIXTURES = Path(__file__).parent / "fixtures"
VARIANTS = ("vanilla", "gated")
# For checks of a mechanism the drafter's Markov head takes no part in (warm-up, gathering the
# drafted rows, the order of policies' work): the vanilla pair in the default run, the gated
# one only in the slow set (`python -m pytest -m slow`), where it would compile a second set
# of engines for the same check. The golden traces and parity run on both pairs by default.
VARIANTS_GATED_SLOW = (VARIANTS[0], pytest.param(VARIANTS[1], marks=pytest.mark.slow))

# The engine configurations tests/test_engine.py and tests/test_prefix_cache.py share: the
# speculative engine (the drafter over 2 or 4 rows; the default for 4 slots is one bucket of 4)
# and the plain one, which packs one token per live slot, so (8, 16, 32) would compile two
# branches it never runs. The file that runs second finds their programs in the run's
# persistent cache.
TRACE_CFG = EngineConfig(
    num_slots=4,
    max_model_len=256,
    page_size=16,
    rounds_per_chunk=8,
    prefill_chunk=64,
    prefill_buckets=(32, 64),
    token_buckets=(8, 16, 32),
    draft_buckets=(2, 4),
)
TRACE_PLAIN_CFG = dataclasses.replace(TRACE_CFG, token_buckets=(2, 4))

# The engine configuration tests/test_logit_bias.py and tests/test_penalties.py share, both
# adjustments on: the speculative, plain and 2x1x2-mesh engines of the gated pair are then the
# same programs in both files, and the file that runs second finds them in the run's persistent
# cache (each file had compiled its own: some 200 s of the CI machine's compiling). A request
# without a penalty or a bias gets its logits bitwise (both add zeros), so each file's checks
# hold as on an engine with only its own adjustment.
ADJUSTED_CFG = EngineConfig(
    num_slots=4,
    max_model_len=160,
    page_size=16,
    prefill_chunk=64,
    prefill_buckets=(64,),
    token_buckets=(8, 32),
    penalties=True,
    max_logit_bias=3,
)


def fixture_dir(variant: str) -> Path:
    return FIXTURES / f"deepspec-tiny-{variant}"


@functools.cache
def load_pair(variant: str):
    """(target, drafter) converted from the fixture's PyTorch checkpoints."""
    root = fixture_dir(variant)
    target_cfg = Qwen3Config.from_hf(read_config_json(root / "target"))
    drafter_cfg = DrafterConfig.from_hf(read_config_json(root / "draft"))
    target = target_from_torch(target_cfg, SafetensorsFolder(root / "target"))
    drafter = drafter_from_torch(drafter_cfg, SafetensorsFolder(root / "draft"))
    return target, drafter


def reference_arrays(variant: str) -> dict[str, np.ndarray]:
    return dict(np.load(fixture_dir(variant) / "reference.npz"))


def reference_traces(variant: str) -> dict:
    return json.loads((fixture_dir(variant) / "reference.json").read_text())


def max_rel_err(actual, expected) -> float:
    """max |a - e| / max |e|: relative error on the tensor's scale (near-zero entries included)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


_LOGITS_FNS: dict[int, object] = {}


def _last_logits(target, max_len: int):
    """seq [max_len] (padded past the prefix), index -> the target's logits there: one program
    for every prefix (the model is causal, so the padding after it changes nothing)."""
    import jax

    key = (id(target), max_len)
    if key not in _LOGITS_FNS:
        _LOGITS_FNS[key] = jax.jit(lambda seq, i: target.logits(target(seq[None]).hidden[0, i]))
    return _LOGITS_FNS[key]


def adjusted_greedy_reference(
    target, prompt, sampling, new_tokens: int, max_len: int, stops=(), min_tokens: int = 0
):
    """Greedy tokens of the target run over each whole prefix (numpy, float64), its logits
    divided (positive) or multiplied (negative) by the `sampling`'s repetition penalty where
    the token is in the prompt or generated so far, then less its presence and frequency
    penalties for the tokens generated so far, plus its logit bias, -inf off its allowed tokens
    (where it names any); with `stops`, up to the
    first of them (included), which are banned from the first `min_tokens` tokens."""
    logits_fn = _last_logits(target, max_len)
    tokens: list[int] = []
    while len(tokens) < new_tokens and not (tokens and tokens[-1] in stops):
        seq = np.zeros((max_len,), np.int32)
        seq[: len(prompt) + len(tokens)] = list(prompt) + tokens
        logits = np.asarray(logits_fn(seq, len(prompt) + len(tokens) - 1), np.float64)
        counts = np.bincount(np.asarray(tokens, np.int64), minlength=logits.shape[-1])
        seen = np.bincount(seq[: len(prompt) + len(tokens)], minlength=logits.shape[-1]) > 0
        p = sampling.repetition_penalty
        logits = np.where(seen, np.where(logits > 0, logits / p, logits * p), logits)
        logits = (
            logits - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0)
        )
        for token, bias in sampling.logit_bias:
            logits[token] += bias
        if sampling.allowed_token_ids:
            others = np.ones(logits.shape, bool)
            others[list(sampling.allowed_token_ids)] = False
            logits[others] = -np.inf
        if len(tokens) < min_tokens:
            logits[list(stops)] = -np.inf
        tokens.append(int(np.argmax(logits)))
    return tokens
