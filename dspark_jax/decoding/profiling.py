"""Steps per second of the engine per batch size x verify bucket: the SPS table.

Two things can be timed:

- "verify": the target's verification forward alone (`engine._verify_forward`): a target step
  over [batch, width] new tokens attending to `context_len` cached positions, with logits for
  every row. This is SPS(B) as the paper defines it for the target.
- "round": a whole speculative round of the engine (draft, sample, verify, accept, commit) with
  every request verifying width - 1 drafts. Algorithm 1 trades expected accepted tokens against
  the time of a step; when the drafter is not negligible next to the target (small targets, or
  a large lm_head over the block), only the round time says what a longer verification costs.

Each timing runs `steps` steps inside one jitted loop, so host dispatch is paid once per timing,
as in the engine's on-device round loop. Speed does not depend on weight or cache values, so
random weights and arbitrary tokens measure the real shapes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.decoding.engine import GREEDY, Engine, EngineConfig, _verify_forward
from dspark_jax.decoding.policies import FixedPolicy, SpsProfile, profile_meta
from dspark_jax.errors import UserError
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.sampling import NO_STOP_TOKEN, SamplingConfig


class ProfileError(UserError):
    """Profiling arguments that cannot be measured."""


def _median_step_seconds(run_once: Callable[[], None], steps: int, repeats: int) -> float:
    run_once()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_once()
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


def _verify_seconds(
    target: Qwen3, batch: int, width: int, context_len: int, steps: int, repeats: int
) -> float:
    graph, params = nnx.split(target)
    tokens_bt = jnp.zeros((batch, width), jnp.int32)

    def run(params, cache):
        model = nnx.merge(graph, params)

        def body(_, carry):
            cache, checksum = carry
            cache = cache.replace(lengths=jnp.full((batch,), context_len, jnp.int32))
            logits, _, cache = _verify_forward(model, tokens_bt, cache, (), (width,), width, 0)
            # A reduction over the whole vocabulary, as verification does, keeps XLA from
            # dropping or slicing the lm_head.
            return cache, checksum + jnp.max(logits)

        return jax.lax.fori_loop(0, steps, body, (cache, jnp.float32(0)))

    run = jax.jit(run, donate_argnums=(1,))
    state = {"cache": target.init_cache(batch, context_len + width)}

    def once():
        state["cache"], checksum = run(params, state["cache"])
        jax.block_until_ready(checksum)

    return _median_step_seconds(once, steps, repeats)


def _round_seconds(
    target: Qwen3,
    drafter: DSparkDrafter,
    sampling: SamplingConfig,
    batch: int,
    width: int,
    context_len: int,
    steps: int,
    repeats: int,
) -> float:
    gamma = drafter.cfg.block_size
    # Enough room that no request finishes (or fills its cache) before the last timed round.
    new_tokens = (repeats + 2) * steps * width + 1
    cfg = EngineConfig(
        max_len=context_len + new_tokens + gamma + 2,
        max_new_tokens=new_tokens,
        batch_buckets=(batch,),
        prompt_buckets=(context_len,),
        verify_buckets=tuple(sorted({width, gamma + 1})),
        rounds_per_chunk=steps,
    )
    engine = Engine(target, drafter, cfg, sampling, FixedPolicy(width - 1), (NO_STOP_TOKEN,))
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, target.cfg.vocab_size, size=(batch, context_len), dtype=np.int32)
    state = {
        "s": engine.prefill(
            engine.init_state(batch),
            prompts,
            np.full(batch, context_len, np.int32),
            np.full(batch, new_tokens, np.int32),
            np.arange(batch, dtype=np.uint32),
            np.ones(batch, bool),
        )
    }

    def once():
        state["s"] = engine.decode_chunk(state["s"])
        jax.block_until_ready(state["s"].done_b)

    seconds = _median_step_seconds(once, steps, repeats)
    if bool(np.any(np.asarray(state["s"].done_b))):
        raise ProfileError("a request finished during round profiling; timings would be short")
    return seconds


def measure_sps(
    target: Qwen3,
    batch_sizes: Sequence[int],
    buckets: Sequence[int],
    *,
    drafter: DSparkDrafter | None = None,
    sampling: SamplingConfig = GREEDY,
    context_len: int = 1024,
    steps: int = 10,
    repeats: int = 5,
    log: Callable[[str], None] | None = None,
) -> np.ndarray:
    """Median steps per second [len(batch_sizes), len(buckets)]: of the verification forward,
    or of whole speculative rounds when a `drafter` is given."""
    if steps < 1 or repeats < 1:
        raise ProfileError(f"steps ({steps}) and repeats ({repeats}) must be >= 1")
    if context_len < 1:
        raise ProfileError(f"context_len must be >= 1, got {context_len}")
    if drafter is not None and max(buckets) > drafter.cfg.block_size + 1:
        raise ProfileError(
            f"bucket {max(buckets)} exceeds block size + 1 = {drafter.cfg.block_size + 1}: a "
            "round never verifies more"
        )
    sps = np.zeros((len(batch_sizes), len(buckets)))
    for i, batch in enumerate(batch_sizes):
        for j, width in enumerate(buckets):
            if drafter is None:
                seconds = _verify_seconds(target, batch, width, context_len, steps, repeats)
            else:
                seconds = _round_seconds(
                    target, drafter, sampling, batch, width, context_len, steps, repeats
                )
            sps[i, j] = 1.0 / seconds
            if log is not None:
                log(
                    f"batch {batch:4d} x width {width:3d} = {batch * width:6d} tokens: "
                    f"{1e3 * seconds:8.3f} ms/step, {sps[i, j]:9.1f} steps/s"
                )
    return sps


def profile_target(
    target: Qwen3,
    batch_sizes: Sequence[int],
    buckets: Sequence[int],
    *,
    drafter: DSparkDrafter | None = None,
    sampling: SamplingConfig = GREEDY,
    context_len: int = 1024,
    steps: int = 10,
    repeats: int = 5,
    log: Callable[[str], None] | None = None,
    **meta,
) -> SpsProfile:
    """`measure_sps` as an `SpsProfile` stamped with device, date, mode and `meta`."""
    batch_sizes, buckets = sorted(set(batch_sizes)), sorted(set(buckets))
    sps = measure_sps(
        target,
        batch_sizes,
        buckets,
        drafter=drafter,
        sampling=sampling,
        context_len=context_len,
        steps=steps,
        repeats=repeats,
        log=log,
    )
    stamp = profile_meta(
        mode="verify" if drafter is None else "round",
        context_len=context_len,
        steps=steps,
        repeats=repeats,
        dtype=str(target.dtype),
        temperature=sampling.temperature,
        **meta,
    )
    return SpsProfile(tuple(batch_sizes), tuple(buckets), sps, stamp)
