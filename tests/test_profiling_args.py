"""`profile_engine` checks its arguments before it builds or compiles anything: a bad one named
the wrong input, failed with a bare TypeError after compiling, or was written into the table."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from fixture_models import load_pair

from dspark_jax.decoding import profiling
from dspark_jax.decoding.engine import EngineConfig
from dspark_jax.decoding.profiling import ProfileError, profile_engine
from dspark_jax.errors import UserError

CFG = EngineConfig(num_slots=2, max_model_len=64, prefill_chunk=32, token_buckets=(2, 16))
QUICK = {"context_len": 8, "steps": 1, "repeats": 1}


@pytest.fixture(scope="module")
def pair():
    return load_pair("vanilla")


@pytest.fixture
def no_engine(monkeypatch):
    """Building the engine fails the test: every check must come before it."""

    def built(*args, **kwargs):
        raise AssertionError("profile_engine built an engine before refusing its arguments")

    monkeypatch.setattr(profiling.Engine, "__init__", built)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, r"temperature must be finite and >= 0 \(0 = greedy\), got -1.0"),
        ({"temperature": math.nan}, "temperature must be finite and >= 0 .*, got nan"),
        ({"temperature": math.inf}, "temperature must be finite and >= 0 .*, got inf"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"steps": 2.5}, "steps must be an integer >= 1, got 2.5"),
        ({"steps": 0}, "steps must be >= 1, got 0"),
        ({"repeats": "3"}, "repeats must be an integer >= 1, got '3'"),
        ({"context_len": 8.0}, "context_len must be an integer >= 1, got 8.0"),
        ({"num_slots": 99}, "profile_engine records num_slots itself: drop num_slots="),
        ({"date": "today", "dtype": "x"}, "records date, dtype itself: drop date=, dtype="),
        ({"model": {}}, "records the models it times itself: drop model="),
        ({"log": "stderr"}, "log must be a function of one line or None, got 'stderr'"),
        ({"compile_with": 3}, "compile_with must be a sequence of Engines, got 3"),
        ({"mesh": "data"}, "mesh must be a Mesh, got 'data'"),
        ({"mode": "verify", "temperature": "hot"}, "temperature must be a number, got 'hot'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_built(pair, no_engine, kwargs, message):
    target, drafter = pair
    args = {**QUICK, **kwargs}
    with pytest.raises(ProfileError, match=message):
        profile_engine(target, drafter, CFG, **args)


@pytest.mark.parametrize(
    ("which", "message"),
    [
        (0, "target must be a Qwen3, got None"),
        (1, "drafter must be a DSparkDrafter, got 'draft'"),
        (2, r"cfg must be an EngineConfig, got \{'num_slots': 2\}"),
    ],
)
def test_the_models_and_config_are_checked(pair, no_engine, which, message):
    models = [*pair, CFG]
    models[which] = [None, "draft", {"num_slots": 2}][which]
    with pytest.raises(ProfileError, match=message):
        profile_engine(*models, **QUICK)
    assert issubclass(ProfileError, UserError)


def test_a_bucket_no_round_can_fill_is_refused_in_round_mode(pair, no_engine):
    """One slot of block 7 verifies at most 8 tokens a round: a 128-token row timed the
    8-token round and was labelled 128 tokens (2.46 ms beside 2.45 ms; verify mode: 7.13)."""
    import dataclasses

    target, drafter = pair
    one = dataclasses.replace(CFG, num_slots=1, token_buckets=(8, 64, 128))
    with pytest.raises(ProfileError, match=r"bucket\(s\) 64, 128 cannot be reached: .* = 8 tokens"):
        profile_engine(target, drafter, one, **QUICK)


def test_the_table_records_plain_json_numbers(pair, tmp_path):
    """numpy scalars are taken and recorded as plain numbers; the saved table is strict JSON."""
    target, drafter = pair
    profile = profile_engine(
        target,
        drafter,
        EngineConfig(num_slots=2, max_model_len=64, prefill_chunk=32, token_buckets=(16,)),
        temperature=np.float32(0.5),
        context_len=np.int64(8),
        steps=np.int32(1),
        repeats=1,
        config="test",
    )
    meta = profile.meta
    assert meta["temperature"] == 0.5 and type(meta["temperature"]) is float
    assert type(meta["steps"]) is int and type(meta["context_len"]) is int
    assert meta["config"] == "test"
    profile.save(tmp_path / "sps.json")
    json.loads((tmp_path / "sps.json").read_text(), parse_constant=lambda c: pytest.fail(c))
