"""Orbax reads that fail leave nothing running behind them (`finished_reads`)."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from dspark_jax.checkpoints.orbax_reads import finished_reads


@pytest.fixture
def unraisable(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(repr(u.exc_value)))
    return seen


def test_a_failed_restore_ends_the_reads_it_abandoned(tmp_path, unraisable):
    """One truncated array file fails the restore while the other arrays' reads are in flight:
    Orbax closes its loop on them, and they used to print Orbax's exception with a TensorStore
    spec each when garbage-collected (at interpreter exit, for a command)."""
    rng = np.random.default_rng(0)
    state = {f"w{i}": jnp.asarray(rng.standard_normal((300, 400), np.float32)) for i in range(8)}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "params", state)
    largest = max((tmp_path / "params").rglob("d/*"), key=lambda f: f.stat().st_size)
    with open(largest, "r+b") as f:
        f.truncate(largest.stat().st_size // 3)
    target = {k: ocp.utils.to_shape_dtype_struct(v) for k, v in state.items()}
    for _ in range(3):
        with pytest.raises(Exception, match="Encountered error while reading array"):
            with finished_reads(), ocp.StandardCheckpointer() as ckpt:
                ckpt.restore(tmp_path / "params", target)
    time.sleep(0.2)  # late tensorstore results arrive within milliseconds
    gc.collect()
    assert unraisable == []


def test_a_closed_loop_has_cancelled_and_awaited_what_was_left_on_it(unraisable):
    """The loops made inside are closed as `asyncio.run` closes its own: tasks still pending are
    cancelled and run to their end, the default executor joined, and results handed over by
    other threads afterwards are dropped."""
    ended = []

    async def abandoned():
        try:
            await asyncio.sleep(3600)
        finally:
            ended.append("cleaned up")

    async def failing():
        asyncio.get_running_loop().create_task(abandoned())
        await asyncio.sleep(0)
        raise ValueError("first read failed")

    before = asyncio.get_event_loop_policy()
    with finished_reads():
        loop = asyncio.new_event_loop()
        try:
            with pytest.raises(ValueError, match="first read failed"):
                loop.run_until_complete(failing())
        finally:
            loop.close()
    assert asyncio.get_event_loop_policy() is before
    assert ended == ["cleaned up"]
    late = threading.Thread(target=loop.call_soon_threadsafe, args=(print, "late"))
    late.start()
    late.join()
    gc.collect()
    assert unraisable == []


def test_the_policy_is_put_back_when_the_read_raises():
    before = asyncio.get_event_loop_policy()
    with pytest.raises(RuntimeError, match="boom"):
        with finished_reads():
            assert asyncio.get_event_loop_policy() is not before
            raise RuntimeError("boom")
    assert asyncio.get_event_loop_policy() is before
