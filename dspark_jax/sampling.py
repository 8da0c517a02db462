"""Token sampling shared by the drafter and the verifier, and per-request PRNG streams.

Draft and target distributions must be filtered by the same function with the same config:
rejection sampling is lossless with respect to the *filtered* target distribution only if the
acceptance ratio compares two distributions that were post-processed identically.

Randomness is addressed, not threaded: the key for a token is derived from (seed, request id,
absolute position, stream), so what a request generates does not depend on which other requests
share its batch or on how the decode loop splits the sequence into rounds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dspark_jax.errors import UserError

STREAM_DRAFT = 0
STREAM_ACCEPT = 1
STREAM_RESIDUAL = 2

# Token-id sentinels; no real token id is negative.
PAD_TOKEN = -1  # output slots past the tokens a request committed
NO_STOP_TOKEN = -2  # the whole stop list of a request that ends only at its length limit


class SamplingConfigError(UserError):
    """A sampling parameter is out of range."""


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are sampled; hashable so it can be a static jit argument.

    temperature 0 means greedy (argmax). top_k 0 and top_p 1.0 switch those filters off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise SamplingConfigError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingConfigError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingConfigError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_logprobs(logits_xv: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Log-probabilities [..., V] (float32) of the distribution that sampling draws from.

    Greedy: 0 at the first argmax, -inf elsewhere. Otherwise logits / T, then top-k, then top-p
    (nucleus), then log_softmax. Both filters keep every token tied with the last kept value.
    """
    vocab = logits_xv.shape[-1]
    if cfg.greedy:
        best_x = jnp.argmax(logits_xv, axis=-1)
        onehot_xv = jnp.arange(vocab) == best_x[..., None]
        return jnp.where(onehot_xv, 0.0, -jnp.inf).astype(jnp.float32)

    scaled_xv = logits_xv.astype(jnp.float32) / jnp.float32(cfg.temperature)
    use_top_p = cfg.top_p < 1.0
    if 0 < cfg.top_k < vocab:
        # After top-k only these k values can be in the nucleus, so they replace a full sort.
        sorted_xk = jax.lax.top_k(scaled_xv, cfg.top_k)[0]
        # min, not sorted_xk[..., -1:]: XLA:CPU rewrites top_k followed by a slice into a sort.
        kth_x1 = jnp.min(sorted_xk, axis=-1, keepdims=True)
        scaled_xv = jnp.where(scaled_xv >= kth_x1, scaled_xv, -jnp.inf)
    elif use_top_p:
        sorted_xk = jnp.flip(jnp.sort(scaled_xv, axis=-1), axis=-1)
    if use_top_p:
        # Normalise over the whole filtered row so tokens tied with the k-th value count too.
        log_norm_x1 = jax.nn.logsumexp(scaled_xv, axis=-1, keepdims=True)
        cum_xk = jnp.cumsum(jnp.exp(sorted_xk - log_norm_x1), axis=-1)
        # Mass strictly before each sorted token; built by shifting so it is exactly monotone.
        before_xk = jnp.concatenate([jnp.zeros_like(cum_xk[..., :1]), cum_xk[..., :-1]], axis=-1)
        keep_xk = before_xk < jnp.float32(cfg.top_p)
        cutoff_x1 = jnp.min(jnp.where(keep_xk, sorted_xk, jnp.inf), axis=-1, keepdims=True)
        scaled_xv = jnp.where(scaled_xv >= cutoff_x1, scaled_xv, -jnp.inf)
    return jax.nn.log_softmax(scaled_xv, axis=-1)


def categorical(keys_b: jax.Array, logprobs_bv: jax.Array) -> jax.Array:
    """One int32 token per row from unnormalised log-probabilities, row b with key b."""
    draw = jax.vmap(lambda key, logp_v: jax.random.categorical(key, logp_v))
    return draw(keys_b, logprobs_bv).astype(jnp.int32)


def sample_tokens(keys_b: jax.Array, logits_bv: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Sample one int32 token per row from `filtered_logprobs(logits_bv, cfg)`.

    Greedy rows take the first argmax and consume no randomness. Keys may be typed keys [B] or
    legacy uint32 keys [B, 2].
    """
    if cfg.greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    return categorical(keys_b, filtered_logprobs(logits_bv, cfg))


def request_keys(seed: int | jax.Array, request_ids_b: jax.Array) -> jax.Array:
    """Typed PRNG keys [B], one independent stream per request id."""
    base = jax.random.key(seed)
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(base, jnp.asarray(request_ids_b))


def position_keys(keys_b: jax.Array, positions_b: jax.Array, stream: int | jax.Array) -> jax.Array:
    """Keys for (request, absolute position, stream).

    positions_b is [B] or [B, ...]; the result has the shape of positions_b (plus the trailing 2
    of legacy uint32 keys). Streams: STREAM_DRAFT for draft sampling, STREAM_ACCEPT for
    acceptance uniforms, STREAM_RESIDUAL for the correction or bonus token.
    """
    positions_b = jnp.asarray(positions_b)

    def fold(key, position):
        return jax.random.fold_in(jax.random.fold_in(key, stream), position)

    for _ in range(positions_b.ndim - 1):
        fold = jax.vmap(fold, in_axes=(None, 0))
    return jax.vmap(fold)(keys_b, positions_b)
