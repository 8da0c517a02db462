"""The static-shape batched decode engine: prefill, speculative rounds and plain decoding.

Everything between prefill and the end of a chunk of rounds runs on device: the round is one
traced function and the loop over rounds is a `lax.while_loop`, so the host only sees finished
chunks. Shapes are bounded by buckets (batch size, prompt length, verification length), so the
set of compiled programs is small and known after warm-up:

  prefill:  one program per (batch bucket, prompt bucket) used
  decode:   one program per batch bucket used (speculative or plain, per sampling config)

Buffers (KV caches, output tokens, statistics) live in `DecodeState` and are donated to each
call, so XLA updates them in place.

How many drafts each request verifies is decided by a policy (`dspark_jax.decoding.policies`)
inside the round, from the drafter's confidence logits divided by the temperatures of an
optional STS artifact; a policy's carry (e.g. the Section 5.2 history) lives in `DecodeState`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.calibration.sts import StsArtifact
from dspark_jax.decoding.policies import FixedPolicy, Policy, PolicyError, SpsProfile
from dspark_jax.decoding.verify import verify
from dspark_jax.errors import UserError
from dspark_jax.models.drafter import DSparkDrafter
from dspark_jax.models.layers import KVCache
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.sampling import (
    NO_STOP_TOKEN,
    PAD_TOKEN,
    STREAM_DRAFT,
    STREAM_RESIDUAL,
    SamplingConfig,
    position_keys,
    request_keys,
    sample_tokens,
)

GREEDY = SamplingConfig()


class EngineError(UserError):
    """A request the engine cannot serve as configured (e.g. a prompt that does not fit)."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static shape settings. `max_len` bounds prompt + generated tokens per request."""

    max_len: int = 2048
    max_new_tokens: int = 512
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prompt_buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    # Verification lengths (anchor + drafts) the target forward is padded to; None = gamma + 1 only.
    verify_buckets: tuple[int, ...] | None = None
    rounds_per_chunk: int = 32

    def batch_bucket(self, n: int) -> int:
        return _bucket(n, self.batch_buckets, "batch size")

    def prompt_bucket(self, n: int) -> int:
        fitting = tuple(b for b in self.prompt_buckets if b <= self.max_len) + (self.max_len,)
        return _bucket(n, fitting, "prompt length")


def power_of_two_buckets(batch_size: int) -> tuple[int, ...]:
    """Powers of two below `batch_size`, and `batch_size` itself (for a last, partial batch)."""
    return (*(1 << i for i in range((batch_size - 1).bit_length())), batch_size)


def _bucket(n: int, buckets: tuple[int, ...], what: str) -> int:
    for b in sorted(buckets):
        if b >= n:
            return b
    raise EngineError(f"{what} {n} exceeds the largest bucket {max(buckets)}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Per-slot decoding state; row b is one request. Rounds are indexed per request."""

    target_cache: KVCache  # lengths = position of the anchor (committed tokens before it)
    draft_cache: KVCache | None  # drafter context K/V, same lengths; None for plain decoding
    anchor_b: jax.Array  # last committed token, not yet in the target cache
    keys_b: jax.Array  # per-request PRNG stream
    max_new_b: jax.Array  # tokens to generate (including the first one from prefill)
    num_generated_b: jax.Array
    done_b: jax.Array
    tokens_bn: jax.Array  # generated tokens, PAD_TOKEN past num_generated_b
    rounds_b: jax.Array  # rounds run by each request
    verified_bn: jax.Array  # per round: drafts verified
    accepted_bn: jax.Array  # per round: drafts accepted (before stop truncation)
    committed_bn: jax.Array  # per round: tokens committed (bonus included)
    conf_logits_bnk: jax.Array  # per round: confidence logits of the drafted block (before STS)
    policy_carry: Any = ()  # the length policy's own state, reset at prefill

    def replace(self, **changes) -> DecodeState:
        return dataclasses.replace(self, **changes)


def _init_state(
    target: Qwen3,
    drafter: DSparkDrafter | None,
    cfg: EngineConfig,
    batch: int,
    gamma: int,
    policy: Policy,
) -> DecodeState:
    cap = cfg.max_new_tokens + gamma + 1
    rounds = cfg.max_new_tokens + 1
    return DecodeState(
        target_cache=target.init_cache(batch, cfg.max_len),
        draft_cache=None if drafter is None else drafter.init_context_cache(batch, cfg.max_len),
        anchor_b=jnp.zeros((batch,), jnp.int32),
        keys_b=request_keys(0, jnp.arange(batch)),
        max_new_b=jnp.zeros((batch,), jnp.int32),
        num_generated_b=jnp.zeros((batch,), jnp.int32),
        done_b=jnp.ones((batch,), bool),
        tokens_bn=jnp.full((batch, cap), PAD_TOKEN, jnp.int32),
        rounds_b=jnp.zeros((batch,), jnp.int32),
        verified_bn=jnp.zeros((batch, rounds), jnp.int32),
        accepted_bn=jnp.zeros((batch, rounds), jnp.int32),
        committed_bn=jnp.zeros((batch, rounds), jnp.int32),
        conf_logits_bnk=jnp.zeros((batch, rounds, max(gamma, 1)), jnp.float32),
        policy_carry=policy.init_carry(batch, gamma),
    )


def _is_stop(tokens, stop_tokens_s):
    return jnp.any(tokens[..., None] == stop_tokens_s, axis=-1)


def _prefill(
    target: Qwen3,
    drafter: DSparkDrafter | None,
    sampling: SamplingConfig,
    policy: Policy,
    state: DecodeState,
    prompts_bp,
    prompt_len_b,
    max_new_b,
    seeds_b,
    active_b,
    stop_tokens_s,
) -> DecodeState:
    """Runs the prompts (right-padded to one bucket) and samples each request's first token."""
    batch = prompts_bp.shape[0]
    target_cache = state.target_cache.replace(lengths=jnp.zeros((batch,), jnp.int32))
    taps = () if drafter is None else drafter.cfg.target_layer_ids
    out = target(prompts_bp, target_cache, tap_layer_ids=taps, key_window=prompts_bp.shape[1])
    last_b11 = (prompt_len_b - 1)[:, None, None]
    last_hidden_bd = jnp.take_along_axis(out.hidden_btd, last_b11, axis=1)[:, 0]
    keys_b = jax.vmap(lambda seed: jax.random.key(seed))(seeds_b)
    first_keys = position_keys(keys_b, prompt_len_b, STREAM_RESIDUAL)
    first_b = sample_tokens(first_keys, target.logits(last_hidden_bd), sampling)
    draft_cache = state.draft_cache
    if drafter is not None:
        draft_cache = drafter.append_context(
            draft_cache.replace(lengths=jnp.zeros((batch,), jnp.int32)), out.taps_btf, prompt_len_b
        )
    stopped_b = _is_stop(first_b, stop_tokens_s)
    tokens_bn = jnp.full_like(state.tokens_bn, PAD_TOKEN).at[:, 0].set(first_b)
    zeros_bn = jnp.zeros_like(state.verified_bn)
    return state.replace(
        target_cache=out.cache.replace(lengths=prompt_len_b),
        draft_cache=draft_cache,
        anchor_b=first_b,
        keys_b=keys_b,
        max_new_b=max_new_b,
        num_generated_b=jnp.ones((batch,), jnp.int32),
        done_b=~active_b | stopped_b | (max_new_b <= 1),
        tokens_bn=tokens_bn,
        rounds_b=jnp.zeros((batch,), jnp.int32),
        verified_bn=zeros_bn,
        accepted_bn=zeros_bn,
        committed_bn=zeros_bn,
        conf_logits_bnk=jnp.zeros_like(state.conf_logits_bnk),
        policy_carry=policy.init_carry(batch, state.conf_logits_bnk.shape[2]),
    )


def _record(buffer_bn, rounds_b, values_b, active_b):
    """Writes row b's values (a scalar, or a vector for a [B, N, K] buffer) at its round."""
    rows = jnp.arange(buffer_bn.shape[0])
    cols = jnp.where(active_b, rounds_b, buffer_bn.shape[1])  # inactive rows write nowhere
    return buffer_bn.at[rows, cols].set(values_b.astype(buffer_bn.dtype), mode="drop")


def _commit(
    state: DecodeState,
    tokens_bj,
    num_committed_b,
    stopped_b,
    active_b,
    max_len: int,
    lookahead: int,
) -> DecodeState:
    """Appends committed tokens to the output and updates the per-request counters."""
    rows = jnp.arange(tokens_bj.shape[0])[:, None]
    cols = state.num_generated_b[:, None] + jnp.arange(tokens_bj.shape[1])[None, :]
    cols = jnp.where(active_b[:, None], cols, state.tokens_bn.shape[1])
    tokens_bn = state.tokens_bn.at[rows, cols].set(tokens_bj, mode="drop")
    num_generated_b = state.num_generated_b + jnp.where(active_b, num_committed_b, 0)
    # A request also ends when its next round could run past the preallocated cache.
    full_b = state.target_cache.lengths + lookahead >= max_len
    done_b = state.done_b | (active_b & (stopped_b | (num_generated_b >= state.max_new_b) | full_b))
    return state.replace(
        tokens_bn=tokens_bn,
        num_generated_b=num_generated_b,
        done_b=done_b,
        rounds_b=state.rounds_b + active_b.astype(jnp.int32),
    )


def _verify_forward(target: Qwen3, tokens_bt, cache: KVCache, taps, buckets, n_rows, bucket_idx):
    """Target forward over the first `buckets[bucket_idx]` verification slots, padded back out.

    Each bucket is its own branch of a `lax.switch`, so one compiled program covers them all and
    only the chosen branch runs.
    """

    def branch(width):
        def run(cache):
            out = target(tokens_bt[:, :width], cache, tap_layer_ids=taps)
            logits = target.logits(out.hidden_btd)
            pad = ((0, 0), (0, n_rows - width), (0, 0))
            taps_btf = None if out.taps_btf is None else jnp.pad(out.taps_btf, pad)
            return jnp.pad(logits, pad), taps_btf, out.cache

        return run

    if len(buckets) == 1:
        return branch(buckets[0])(cache)
    return jax.lax.switch(bucket_idx, [branch(w) for w in buckets], cache)


def _spec_round(
    target: Qwen3,
    drafter: DSparkDrafter,
    sampling: SamplingConfig,
    policy: Policy,
    sts: StsArtifact | None,
    verify_buckets: tuple[int, ...],
    max_len: int,
    stop_tokens_s,
    state: DecodeState,
) -> DecodeState:
    gamma = drafter.cfg.block_size
    active_b = ~state.done_b
    start_b = state.target_cache.lengths  # position of the anchor

    h_bkd = drafter.draft_hidden(state.anchor_b, state.draft_cache)
    slot_positions_bk = start_b[:, None] + 1 + jnp.arange(gamma)[None, :]
    # Drafts past a rejection are drafted again next round at the same positions. Fresh noise per
    # round keeps a policy carry that holds earlier rounds' confidences (hence their drafts)
    # independent of this round's drafts, which losslessness of history-based policies needs.
    round_keys_b = jax.vmap(jax.random.fold_in)(state.keys_b, state.rounds_b)
    draft_keys_bk = position_keys(round_keys_b, slot_positions_bk, STREAM_DRAFT)
    block = drafter.sample_block(h_bkd, state.anchor_b, draft_keys_bk, sampling)
    policy_logits_bk = block.conf_logits_bk
    if sts is not None:
        policy_logits_bk = sts.calibrated_logits(block.conf_logits_bk)
    lengths_b, policy_carry = policy.step(policy_logits_bk, active_b, state.policy_carry)
    lengths_b = jnp.where(active_b, jnp.clip(lengths_b, 0, gamma), 0).astype(jnp.int32)

    need = jnp.max(lengths_b) + 1
    bucket_idx = jnp.sum(jnp.asarray(verify_buckets) < need)
    verify_in = jnp.concatenate([state.anchor_b[:, None], block.tokens_bk], axis=1)
    logits_bjv, taps_bjf, target_cache = _verify_forward(
        target,
        verify_in,
        state.target_cache,
        drafter.cfg.target_layer_ids,
        verify_buckets,
        gamma + 1,
        bucket_idx,
    )
    result = verify(
        block.tokens_bk,
        block.logprobs_bkv,
        logits_bjv,
        lengths_b,
        state.keys_b,
        start_b + 1,
        sampling,
        stop_tokens_s,
    )

    # Commit: the cache keeps the anchor and the accepted drafts; the rest is rolled back by
    # length alone. Their target features become the drafter's new context.
    new_len_b = jnp.where(active_b, start_b + 1 + result.num_accepted_b, start_b)
    draft_cache = drafter.append_context(
        state.draft_cache, taps_bjf, jnp.where(active_b, 1 + result.num_accepted_b, 0)
    )
    conf_bk = (
        block.conf_logits_bk
        if block.conf_logits_bk is not None
        else jnp.zeros((state.anchor_b.shape[0], gamma), jnp.float32)
    )
    state = state.replace(
        target_cache=target_cache.replace(lengths=new_len_b),
        draft_cache=draft_cache,
        anchor_b=jnp.where(active_b, result.next_token_b, state.anchor_b),
        verified_bn=_record(state.verified_bn, state.rounds_b, lengths_b, active_b),
        accepted_bn=_record(state.accepted_bn, state.rounds_b, result.num_accepted_b, active_b),
        committed_bn=_record(state.committed_bn, state.rounds_b, result.num_committed_b, active_b),
        conf_logits_bnk=_record(state.conf_logits_bnk, state.rounds_b, conf_bk, active_b),
        policy_carry=policy_carry,
    )
    return _commit(
        state,
        result.tokens_bj,
        result.num_committed_b,
        result.stopped_b,
        active_b,
        max_len,
        lookahead=gamma + 1,
    )


def _plain_round(
    target: Qwen3, sampling: SamplingConfig, max_len: int, stop_tokens_s, state: DecodeState
) -> DecodeState:
    """One target step per round: the baseline speculative decoding is measured against."""
    active_b = ~state.done_b
    start_b = state.target_cache.lengths
    out = target(state.anchor_b[:, None], state.target_cache)
    keys_b = position_keys(state.keys_b, start_b + 1, STREAM_RESIDUAL)
    next_b = sample_tokens(keys_b, target.logits(out.hidden_btd[:, 0]), sampling)
    stopped_b = _is_stop(next_b, stop_tokens_s)
    ones_b = jnp.ones_like(next_b)
    state = state.replace(
        target_cache=out.cache.replace(lengths=jnp.where(active_b, start_b + 1, start_b)),
        anchor_b=jnp.where(active_b, next_b, state.anchor_b),
        committed_bn=_record(state.committed_bn, state.rounds_b, ones_b, active_b),
    )
    return _commit(state, next_b[:, None], ones_b, stopped_b, active_b, max_len, lookahead=1)


def _run_chunk(round_fn, rounds_per_chunk: int, state: DecodeState) -> DecodeState:
    def cond(carry):
        i, s = carry
        return (i < rounds_per_chunk) & jnp.any(~s.done_b)

    def body(carry):
        i, s = carry
        return i + 1, round_fn(s)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


def _check_sts(
    sts: StsArtifact,
    drafter: DSparkDrafter | None,
    fingerprint: str | None,
    sampling: SamplingConfig,
) -> None:
    """Refuses an STS artifact the engine cannot apply, or one fitted for another drafter,
    block size or sampling temperature."""
    if drafter is None:
        raise EngineError("an STS artifact needs a drafter; plain decoding has no confidences")
    if drafter.confidence_head is None:
        raise EngineError("an STS artifact needs a drafter with a confidence head")
    if fingerprint is None:
        raise EngineError(
            "pass drafter_fingerprint (as returned by load_drafter) with an STS artifact, so the "
            "engine can check that the artifact belongs to this drafter"
        )
    sts.check(fingerprint, sampling.temperature, drafter.cfg.block_size)


def _engine_verify_buckets(cfg: EngineConfig, policy: Policy, gamma: int) -> tuple[int, ...]:
    """The engine's verify buckets; a policy with a measured SPS profile must use its buckets,
    since its SPS values describe exactly those widths."""
    profile = getattr(policy, "sps", None)
    if isinstance(profile, SpsProfile):
        if cfg.verify_buckets is not None and tuple(sorted(cfg.verify_buckets)) != profile.buckets:
            raise EngineError(
                f"verify_buckets {tuple(sorted(cfg.verify_buckets))} differ from the SPS "
                f"profile's buckets {profile.buckets}; use the profile's (or leave them unset)"
            )
        buckets = profile.buckets
    else:
        buckets = tuple(sorted(cfg.verify_buckets or (gamma + 1,)))
    if buckets[-1] < gamma + 1:
        raise EngineError(f"largest verify bucket {buckets[-1]} < gamma + 1 = {gamma + 1}")
    return buckets


class Engine:
    """Jitted prefill and decode chunks over a target (and optionally a drafter).

    The models are split into (graphdef, state) once; the jitted functions are pure functions of
    the parameter states and a donated `DecodeState`. `policy` (a `Policy`, default: verify the
    whole block) chooses the verified lengths; `sts` (an `StsArtifact`,
    checked against `drafter_fingerprint` and the sampling temperature) calibrates the
    confidence logits the policy sees.
    """

    def __init__(
        self,
        target: Qwen3,
        drafter: DSparkDrafter | None,
        cfg: EngineConfig,
        sampling: SamplingConfig = GREEDY,
        policy: Policy | None = None,
        stop_tokens: tuple[int, ...] = (),
        sts: StsArtifact | None = None,
        drafter_fingerprint: str | None = None,
    ):
        self.cfg = cfg
        self.sampling = sampling
        self.target_cfg = target.cfg
        self.speculative = drafter is not None
        self.gamma = drafter.cfg.block_size if drafter is not None else 0
        if drafter is not None:
            drafter.cfg.check_target(target.cfg)
        if sts is not None:
            _check_sts(sts, drafter, drafter_fingerprint, sampling)
        self.sts = sts
        gamma = self.gamma
        policy = FixedPolicy(gamma) if policy is None else policy
        if not isinstance(policy, Policy):
            raise PolicyError(f"policy must be a Policy, got {type(policy).__name__}")
        if drafter is not None and policy.needs_confidence and drafter.confidence_head is None:
            raise EngineError(
                f"{type(policy).__name__} needs confidences; this drafter has no confidence head"
            )
        self.policy = policy
        self.stop_tokens = tuple(stop_tokens) or target.cfg.eos_token_ids
        self._target_graph, self.target_params = nnx.split(target)
        self._drafter_graph, self.drafter_params = (
            nnx.split(drafter) if drafter is not None else (None, None)
        )
        verify_buckets = _engine_verify_buckets(cfg, policy, gamma) if self.speculative else ()
        self.verify_buckets = verify_buckets
        stop_s = jnp.asarray(self.stop_tokens or (NO_STOP_TOKEN,), jnp.int32)
        tg, dg = self._target_graph, self._drafter_graph

        def merge(target_params, drafter_params):
            t = nnx.merge(tg, target_params)
            d = nnx.merge(dg, drafter_params) if dg is not None else None
            return t, d

        def prefill(
            target_params,
            drafter_params,
            state,
            prompts_bp,
            prompt_len_b,
            max_new_b,
            seeds_b,
            active_b,
        ):
            t, d = merge(target_params, drafter_params)
            return _prefill(
                t,
                d,
                sampling,
                policy,
                state,
                prompts_bp,
                prompt_len_b,
                max_new_b,
                seeds_b,
                active_b,
                stop_s,
            )

        def decode(target_params, drafter_params, state):
            t, d = merge(target_params, drafter_params)
            if d is None:
                round_fn = functools.partial(_plain_round, t, sampling, cfg.max_len, stop_s)
            else:
                round_fn = functools.partial(
                    _spec_round,
                    t,
                    d,
                    sampling,
                    policy,
                    sts,
                    verify_buckets,
                    cfg.max_len,
                    stop_s,
                )
            return _run_chunk(round_fn, cfg.rounds_per_chunk, state)

        self._prefill = jax.jit(prefill, donate_argnums=(2,))
        self._decode = jax.jit(decode, donate_argnums=(2,))
        self._init = {}

    def init_state(self, batch: int) -> DecodeState:
        if batch not in self._init:
            self._init[batch] = jax.jit(
                lambda tp, dp: _init_state(
                    nnx.merge(self._target_graph, tp),
                    nnx.merge(self._drafter_graph, dp) if self._drafter_graph else None,
                    self.cfg,
                    batch,
                    self.gamma,
                    self.policy,
                )
            )
        return self._init[batch](self.target_params, self.drafter_params)

    def check_fits(self, prompt_len: int, max_new: int) -> None:
        need = prompt_len + max_new + self.gamma + 1
        if prompt_len < 1:
            raise EngineError("empty prompt: a request needs at least one token")
        if max_new > self.cfg.max_new_tokens:
            raise EngineError(
                f"max_new_tokens {max_new} exceeds the engine's limit {self.cfg.max_new_tokens}"
            )
        if need > self.cfg.max_len:
            raise EngineError(
                f"a prompt of {prompt_len} tokens plus {max_new} new tokens (and {self.gamma + 1} "
                f"verification slots) needs {need} cache positions; the engine's max_len is "
                f"{self.cfg.max_len}"
            )

    def prefill(
        self, state: DecodeState, prompts_bp, prompt_len_b, max_new_b, seeds_b, active_b
    ) -> DecodeState:
        return self._prefill(
            self.target_params,
            self.drafter_params,
            state,
            prompts_bp,
            prompt_len_b,
            max_new_b,
            seeds_b,
            active_b,
        )

    def decode_chunk(self, state: DecodeState) -> DecodeState:
        return self._decode(self.target_params, self.drafter_params, state)
