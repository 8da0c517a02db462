"""Steps per second of the engine per token bucket: the SPS table the scheduler reads.

The engine packs every live slot's anchor and verified drafts into one token axis padded to a
token bucket, so a step's cost follows the total number of verified tokens B. For each of the
engine's token buckets B one of two things is timed:

- "round": a whole speculative round of the engine (draft the live slots, in their slot
  bucket; sample, verify exactly B tokens, accept, commit). Algorithm 1 trades expected
  accepted tokens against the time of a step; when the drafter is not negligible next to the
  target (small targets, or a large lm_head over the block), only the round time says what a
  longer verification costs.
- "verify": the target's packed forward over B tokens alone, logits for every token included:
  SPS(B) as the paper defines it for the target.

B tokens are spread over min(B, slots) live slots, each attending to `context_len` cached
positions. Each timing runs `steps` steps inside one jitted call (the engine's on-device loop,
or a `fori_loop`), so host dispatch is paid once per timing; rolling the lengths back between
timings keeps every step at the same context. Speed does not depend on weight or cache values, so
random weights and zero caches measure the real shapes.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dspark_jax.decoding.engine import (
    Engine,
    EngineConfig,
    SlotState,
    compile_engines,
    default_compile_workers,
    token_buckets,
    warm_up_all,
)
from dspark_jax.decoding.policies import SpsProfile, profile_meta, sps_model
from dspark_jax.errors import UserError, as_integer
from dspark_jax.models import paged
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.paged import PagedCache, TokenBatch
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.sampling import NO_STOP_TOKEN, SamplingConfig, SamplingConfigError


class ProfileError(UserError):
    """Profiling arguments that cannot be measured."""


@dataclasses.dataclass(frozen=True)
class CarriedLengths:
    """A policy whose per-slot lengths are whatever its carry holds (set by the profiler)."""

    needs_confidence: ClassVar[bool] = False

    def init_carry(self, batch: int, gamma: int) -> jax.Array:
        return jnp.zeros((batch,), jnp.int32)

    def reset_slots(self, carry: jax.Array, mask_b: jax.Array) -> jax.Array:
        return carry

    def step(self, conf_logits_bk, active_b, carry):
        return jnp.where(active_b, carry, 0), carry


def split_tokens(total: int, num_slots: int, gamma: int) -> np.ndarray:
    """Per-slot draft lengths (-1: slot idle) whose anchors + drafts make exactly `total`
    tokens: min(total, num_slots) live slots, the extra tokens dealt round-robin."""
    if not 1 <= total <= num_slots * (gamma + 1):
        raise ProfileError(
            f"{total} tokens cannot be verified by {num_slots} slots of block {gamma}"
        )
    live = min(total, num_slots)
    lengths = np.full((num_slots,), -1, np.int32)
    lengths[:live] = 0
    extra = total - live
    for i in range(extra):
        lengths[i % live] += 1
    return lengths


def _median_step_seconds(run_once: Callable[[], None], steps: int, repeats: int) -> float:
    run_once()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_once()
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


# Compile threads from which the next engine compiles beside the profiled round rather than
# after it (`stand_in_profile`). With fewer, the two compiles only share the cores: on a 2-core
# CPU a serving-load level (benchmarks/throughput.py, tiny shapes) took 58 s against 47 s.
BESIDE_MIN_WORKERS = 4


def stand_in_profile(cfg: EngineConfig, gamma: int, threads: bool = True) -> SpsProfile | None:
    """A stand-in SPS profile of the token buckets `profile_engine` times for `cfg` (its rates
    all 1), for building the engine that will run on the measured profile before it is measured
    and compiling it beside the profiled round (`profile_engine`'s `compile_with`): a
    scheduler's table is data of the engine's programs, not part of them, so they land in the
    persistent compilation cache, where the engine built on the measured profile finds them.

    None where that would not pay: no persistent compilation cache (the programs would be
    compiled twice), or, with `threads`, fewer than `BESIDE_MIN_WORKERS` compile threads
    (`default_compile_workers`)."""
    if not jax.config.jax_compilation_cache_dir:
        return None
    if threads and default_compile_workers() < BESIDE_MIN_WORKERS:
        return None
    buckets = token_buckets(cfg, CarriedLengths(), gamma)
    return SpsProfile(buckets, np.ones(len(buckets)))


def filled_state(engine: Engine, context_len: int, temperature: float = 0.0) -> SlotState:
    """Every slot holding a request at `context_len` that never finishes, on its own pages (the
    caches hold zeros: timings do not depend on their values). Set `live_s` to choose the slots
    that run."""
    cfg = engine.cfg
    s = cfg.num_slots
    state = engine.init_state()
    table = np.arange(s * cfg.pages_per_slot, dtype=np.int32).reshape(s, cfg.pages_per_slot)
    return placed(
        engine,
        state.replace(
            page_table_sp=jnp.asarray(table),
            lengths_s=jnp.full((s,), context_len, jnp.int32),
            max_new_s=jnp.full((s,), np.iinfo(np.int32).max // 2, jnp.int32),
            stop_sk=jnp.full_like(state.stop_sk, NO_STOP_TOKEN),
            sampling_s=dataclasses.replace(
                state.sampling_s, temperature=jnp.full((s,), temperature, jnp.float32)
            ),
        ),
    )


def placed(engine: Engine, state: SlotState) -> SlotState:
    """`state` with every array where the engine keeps it (its mesh shardings; a no-op on one
    device). A state mixing the engine's sharded arrays with fresh host-made ones calls the
    engine's programs with other input shardings than `Engine.lower` and the engine's own
    outputs have, and each such mix compiles the program again."""
    if engine.state_shardings is None:
        return state
    return jax.tree.map(jax.device_put, state, engine.state_shardings)


def _round_seconds(
    engine: Engine, state: SlotState, lengths: np.ndarray, context_len: int, repeats: int
) -> tuple[float, SlotState]:
    live = lengths >= 0
    box = {"state": state}

    def once():
        # Fresh arrays each call: the state (and whatever it holds) is donated.
        s = box["state"].replace(
            live_s=jnp.asarray(live),
            policy_carry=jnp.asarray(np.maximum(lengths, 0)),
            lengths_s=jnp.full((len(lengths),), context_len, jnp.int32),
            num_generated_s=jnp.zeros((len(lengths),), jnp.int32),
        )
        s = placed(engine, s)
        s, out = engine.decode_chunk(s)
        if not np.all(np.asarray(out.verified_sr)[live] >= 0):
            raise ProfileError("a slot stopped during round profiling; timings would be short")
        box["state"] = s

    seconds = _median_step_seconds(once, engine.cfg.rounds_per_chunk, repeats)
    return seconds, box["state"]


def _verify_seconds(
    engine: Engine,
    target: Qwen3,
    state: SlotState,
    lengths: np.ndarray,
    width: int,
    context_len: int,
    steps: int,
    repeats: int,
) -> tuple[float, SlotState]:
    graph = nnx.graphdef(target)
    start_s = jnp.full((engine.cfg.num_slots,), context_len, jnp.int32)
    count_s = jnp.asarray(np.where(lengths >= 0, lengths + 1, 0), jnp.int32)

    def run(params, pages, page_table):
        model = nnx.merge(graph, params)

        def body(_, carry):
            pages, checksum = carry
            batch = TokenBatch.per_slot(start_s, count_s, width)
            cache = PagedCache(pages, page_table, engine.target_layout)
            out = model.paged_forward(jnp.zeros((width,), jnp.int32), batch, cache)
            # A reduction over the whole vocabulary, as verification does, keeps XLA from
            # dropping or slicing the lm_head.
            logits_max = jnp.max(model.logits(out.hidden))
            pages = paged.write(cache, out.kv, batch, after=logits_max).pages
            return pages, checksum + logits_max

        return jax.lax.fori_loop(0, steps, body, (pages, jnp.float32(0)))

    # Compiled as the engine's programs are: on a GPU the steps loop runs inside the CUDA graph.
    run = jax.jit(run, donate_argnums=(1,), compiler_options=engine.compiler_options)
    box = {"pages": state.target_pages}

    def once():
        box["pages"], checksum = run(engine.target_params, box["pages"], state.page_table_sp)
        jax.block_until_ready(checksum)

    seconds = _median_step_seconds(once, steps, repeats)
    return seconds, state.replace(target_pages=box["pages"])


def profile_engine(
    target: Qwen3,
    drafter: DSparkDrafter | None,
    cfg: EngineConfig,
    *,
    mode: str = "round",
    temperature: float = 0.0,
    context_len: int = 1024,
    steps: int = 10,
    repeats: int = 5,
    log: Callable[[str], None] | None = None,
    mesh=None,
    compile_with: Sequence[Engine] = (),
    compile_only: bool = False,
    **meta,
) -> SpsProfile | None:
    """Median steps/s per token bucket of an engine built with `cfg` (its `token_buckets`, or
    the defaults for its slots and the drafter's block), stamped with device, date, the slots,
    the shapes of the models timed (`policies.sps_model`: an engine refuses the profile for
    other slots or models) and `meta`.

    Round mode needs the drafter and samples at `temperature`; verify mode times the target
    alone and samples nothing, so it takes no temperature. `mesh`: the engine runs sharded on
    it (the table then describes that mesh). `compile_with`: engines the caller builds next,
    warmed up (`Engine.warm_up`) on the same compile threads as the profiled round, before
    any timing: their compiling overlaps the profile's instead of following it.

    `compile_only` (round mode): compile what the profile compiles before it times anything --
    the round program and `compile_with`'s programs -- and return None, timing nothing and
    running nothing. With the persistent compilation cache on, a later profile with the same
    arguments (another process: a benchmark compiling ahead while something else runs) finds
    those programs built."""
    # Every argument is checked before anything is built: a bad one would otherwise fail only
    # after the engine has compiled (minutes on a large model), or be written into the table.
    for name, value, cls in (
        ("target", target, Qwen3),
        ("drafter", drafter, DSparkDrafter),
        ("cfg", cfg, EngineConfig),
        ("mesh", mesh, Mesh),
    ):
        if not isinstance(value, cls) and not (value is None and name in ("drafter", "mesh")):
            article = "an" if cls.__name__[0] in "AEIOU" else "a"
            raise ProfileError(f"{name} must be {article} {cls.__name__}, got {value!r}")
    if mode not in ("round", "verify"):
        raise ProfileError(f"mode must be 'round' or 'verify', got {mode!r}")
    if mode == "round" and drafter is None:
        raise ProfileError("round mode times whole speculative rounds: it needs a drafter")
    if compile_only and mode != "round":
        raise ProfileError("compile_only compiles round mode's program; verify mode has none")
    try:
        # The engine's own rule for a temperature (a finite number >= 0); also a plain float for
        # the table's metadata.
        temperature = SamplingConfig(temperature=temperature).temperature
    except SamplingConfigError as e:
        raise ProfileError(str(e)) from None
    if mode == "verify" and temperature != 0.0:
        raise ProfileError(
            f"verify mode times the target's forward alone and samples nothing, so temperature "
            f"{temperature:g} would be ignored: it applies to round mode only"
        )
    for name, value in (("context_len", context_len), ("steps", steps), ("repeats", repeats)):
        number = as_integer(value)
        if number is None:
            raise ProfileError(f"{name} must be an integer >= 1, got {value!r}")
        if number < 1:
            raise ProfileError(f"{name} must be >= 1, got {value}")
    context_len, steps, repeats = int(context_len), int(steps), int(repeats)
    if log is not None and not callable(log):
        raise ProfileError(f"log must be a function of one line or None, got {log!r}")
    try:
        engines = tuple(compile_with)
    except TypeError:  # not a sequence: refused as one below
        engines = (None,)
    if not all(isinstance(e, Engine) for e in engines):
        raise ProfileError(f"compile_with must be a sequence of Engines, got {compile_with!r}")
    compile_with = engines
    gamma = drafter.cfg.block_size if drafter is not None else 0
    round_mode = mode == "round"
    # What this call stamps into the table's metadata itself (profile_meta adds the device and
    # the date): `meta` may add fields, not replace these.
    own = dict(
        mode=mode,
        context_len=context_len,
        num_slots=cfg.num_slots,
        gamma=gamma,
        steps=steps,
        repeats=repeats,
        dtype=str(target.dtype),
        # The drafter's slot buckets: a round of few live slots drafts over the smallest that
        # holds them, so they shape what its small token buckets cost.
        **(
            {"temperature": temperature, "draft_buckets": list(cfg.slot_buckets())}
            if round_mode
            else {}
        ),
        mesh=None if mesh is None else dict(mesh.shape),
        # what an engine checks the profile against (verify mode times no drafter)
        model=sps_model(target.cfg, drafter.cfg if round_mode else None),
    )
    clash = sorted(set(meta) & {"device", "date", *own})
    if clash:
        named = ", ".join("the models it times" if key == "model" else key for key in clash)
        raise ProfileError(
            f"profile_engine records {named} itself: drop {', '.join(f'{k}=' for k in clash)}"
        )
    if gamma == 0 and cfg.token_buckets is None:
        raise ProfileError("without a drafter give the token buckets to measure")
    buckets = token_buckets(cfg, CarriedLengths(), gamma)
    if round_mode:
        # A round packs at most every slot's anchor and whole block: a bucket past the one that
        # holds that many is never chosen, and its row would time the largest round there is.
        most = cfg.num_slots * (gamma + 1)
        unreachable = [b for prev, b in itertools.pairwise(buckets) if prev >= most]
        if unreachable:
            raise ProfileError(
                f"token bucket(s) {', '.join(map(str, unreachable))} cannot be reached: a round "
                f"of {cfg.num_slots} slot(s) verifies at most {cfg.num_slots} x (block "
                f"{gamma} + 1) = {most} tokens; drop them, add slots, or time the target alone "
                f"(verify mode)"
            )
    # Enough drafts per slot to fill the largest bucket (verify mode may have no drafter).
    room = max(gamma, -(-buckets[-1] // cfg.num_slots) - 1)
    max_model_len = context_len + (steps + 1) * (room + 1) + room + 1
    limit = target.cfg.max_position_embeddings
    if max_model_len > limit:
        raise ProfileError(
            f"context_len {context_len} plus the profiled steps needs {max_model_len} positions; "
            f"the model has {limit}"
        )
    cfg = dataclasses.replace(
        cfg,
        max_model_len=max_model_len,
        num_pages=None,
        rounds_per_chunk=steps,
        token_buckets=buckets,
    )
    # Verify mode times the target alone: a plain engine, which takes no policy.
    engine = Engine(
        target,
        drafter if round_mode else None,
        cfg,
        policy=CarriedLengths() if round_mode else None,
        mesh=mesh,
    )
    # Everything compiles before the first timed step: the round program (verify mode's own is
    # built below) together with the caller's next engines.
    extra = [engine.lower()["decode_chunk"]] if round_mode else []
    if compile_only:
        compile_engines(compile_with, extra=extra)
        return None
    warm_up_all(compile_with, extra=extra)
    state = filled_state(engine, context_len, temperature)
    sps = np.zeros((len(buckets),))
    for i, width in enumerate(buckets):
        lengths = split_tokens(min(width, cfg.num_slots * (room + 1)), cfg.num_slots, room)
        if round_mode:
            seconds, state = _round_seconds(engine, state, lengths, context_len, repeats)
        else:
            seconds, state = _verify_seconds(
                engine, target, state, lengths, width, context_len, steps, repeats
            )
        sps[i] = 1.0 / seconds
        if log is not None:
            log(f"{width:6d} tokens: {1e3 * seconds:9.3f} ms/step, {sps[i]:9.1f} steps/s")
    stamp = profile_meta(**own, **meta)
    return SpsProfile(tuple(buckets), sps, stamp)
