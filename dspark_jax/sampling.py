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
import math

import jax
import jax.numpy as jnp

from dspark_jax.errors import UserError, as_integer

STREAM_DRAFT = 0
STREAM_ACCEPT = 1
STREAM_RESIDUAL = 2

# Token-id sentinels; no real token id is negative.
PAD_TOKEN = -1  # output slots past the tokens a request committed
NO_STOP_TOKEN = -2  # the whole stop list of a request that ends only at its length limit

# The engine holds top_k as int32; a k this large already keeps every token of any vocabulary.
TOP_K_MAX = 2**31 - 1


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
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            # A number (numpy's and JAX's scalars included), not a bool or a string like "0.7".
            try:
                if isinstance(value, (bool, str, bytes)):
                    raise TypeError
                number = float(value)
            except (TypeError, ValueError):
                raise SamplingConfigError(f"{name} must be a number, got {value!r}") from None
            object.__setattr__(self, name, number)
        # inf would flatten every distribution to uniform; NaN compares false with everything.
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise SamplingConfigError(
                f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}"
            )
        top_k = as_integer(self.top_k)
        if top_k is None or not 0 <= top_k <= TOP_K_MAX:
            raise SamplingConfigError(
                f"top_k must be an integer in 0..{TOP_K_MAX} (0 = off; any k at or above the "
                f"vocabulary size keeps every token too), got {self.top_k!r}"
            )
        object.__setattr__(self, "top_k", top_k)  # a numpy integer becomes a plain int
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingConfigError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingConfig()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings as arrays (one row per request, or per token of a request).

    Shapes are the leading (batch) shape of the logits they filter. temperature 0 is greedy, top_k
    0 and top_p 1 switch those filters off: the same meaning as `SamplingConfig`, as data, so one
    compiled program serves every mix of settings.
    """

    temperature: jax.Array  # float32
    top_k: jax.Array  # int32
    top_p: jax.Array  # float32

    @classmethod
    def from_config(cls, cfg: SamplingConfig, shape: tuple[int, ...] = ()) -> RowSampling:
        return cls(
            temperature=jnp.full(shape, cfg.temperature, jnp.float32),
            top_k=jnp.full(shape, cfg.top_k, jnp.int32),
            top_p=jnp.full(shape, cfg.top_p, jnp.float32),
        )

    def take(self, index) -> RowSampling:
        """Rows `index` (any integer array shape) of every field."""
        return jax.tree.map(lambda a: a[index], self)

    def broadcast(self, shape: tuple[int, ...]) -> RowSampling:
        """Each row repeated along trailing axes: fields [B] -> `shape` = (B, ...)."""
        extra = len(shape) - self.temperature.ndim
        return jax.tree.map(
            lambda a: jnp.broadcast_to(a.reshape(a.shape + (1,) * extra), shape), self
        )

    @property
    def greedy(self) -> jax.Array:
        return self.temperature <= 0.0


def as_rows(cfg: SamplingConfig | RowSampling, shape: tuple[int, ...]) -> RowSampling:
    if isinstance(cfg, SamplingConfig):
        return RowSampling.from_config(cfg, shape)
    return cfg.broadcast(shape) if cfg.temperature.shape != shape else cfg


def _filter_cutoffs(scaled_xv: jax.Array, rows: RowSampling) -> jax.Array:
    """The smallest kept value of each row [..., 1] under its top-k then top-p filters.

    Both filters keep every token tied with the last kept value. Top-p is measured on the
    distribution left after top-k, normalised over all of it, ties included.
    """
    vocab = scaled_xv.shape[-1]
    sorted_xv = -jnp.sort(-scaled_xv, axis=-1)
    use_k_x = (rows.top_k > 0) & (rows.top_k < vocab)
    kth_x1 = jnp.take_along_axis(sorted_xv, jnp.clip(rows.top_k - 1, 0, vocab - 1)[..., None], -1)
    kth_x1 = jnp.where(use_k_x[..., None], kth_x1, -jnp.inf)
    in_k_xv = sorted_xv >= kth_x1
    log_norm_x1 = jax.nn.logsumexp(jnp.where(in_k_xv, sorted_xv, -jnp.inf), -1, keepdims=True)
    cum_xv = jnp.cumsum(jnp.where(in_k_xv, jnp.exp(sorted_xv - log_norm_x1), 0.0), axis=-1)
    # Mass strictly before each sorted token; built by shifting so it is exactly monotone.
    before_xv = jnp.concatenate([jnp.zeros_like(cum_xv[..., :1]), cum_xv[..., :-1]], axis=-1)
    keep_xv = in_k_xv & (before_xv < rows.top_p[..., None])
    p_cut_x1 = jnp.min(jnp.where(keep_xv, sorted_xv, jnp.inf), axis=-1, keepdims=True)
    p_cut_x1 = jnp.where((rows.top_p < 1.0)[..., None], p_cut_x1, -jnp.inf)
    return jnp.maximum(kth_x1, p_cut_x1)


def filtered_logprobs(logits_xv: jax.Array, cfg: SamplingConfig | RowSampling) -> jax.Array:
    """Log-probabilities [..., V] (float32) of the distribution that sampling draws from.

    Greedy rows: 0 at the first argmax, -inf elsewhere. Others: logits / T, then top-k, then top-p
    (nucleus), then log_softmax. `cfg` is one `SamplingConfig` for every row or a `RowSampling`
    whose fields have the logits' leading shape (or a prefix of it, broadcast). The sort that the
    filters need runs only when some row filters; rows that do not filter get bitwise the same
    result either way, so a row's output never depends on its neighbours' settings.
    """
    rows = as_rows(cfg, logits_xv.shape[:-1])
    greedy_x = rows.greedy
    temperature_x = jnp.where(greedy_x, 1.0, rows.temperature)
    scaled_xv = logits_xv.astype(jnp.float32) / temperature_x[..., None]
    vocab = logits_xv.shape[-1]
    filters_x = ~greedy_x & (((rows.top_k > 0) & (rows.top_k < vocab)) | (rows.top_p < 1.0))
    no_cut = jnp.full(scaled_xv.shape[:-1] + (1,), -jnp.inf, jnp.float32)
    cutoff_x1 = jax.lax.cond(
        jnp.any(filters_x), lambda: _filter_cutoffs(scaled_xv, rows), lambda: no_cut
    )
    logp_xv = jax.nn.log_softmax(jnp.where(scaled_xv >= cutoff_x1, scaled_xv, -jnp.inf), axis=-1)
    best_x = jnp.argmax(logits_xv, axis=-1)
    onehot_xv = jnp.arange(vocab) == best_x[..., None]
    return jnp.where(greedy_x[..., None], jnp.where(onehot_xv, 0.0, -jnp.inf), logp_xv)


def categorical(keys_b: jax.Array, logprobs_bv: jax.Array) -> jax.Array:
    """One int32 token per row from unnormalised log-probabilities, row b with key b."""
    draw = jax.vmap(lambda key, logp_v: jax.random.categorical(key, logp_v))
    return draw(keys_b, logprobs_bv).astype(jnp.int32)


def sample_from_logprobs(
    keys_b: jax.Array, logprobs_bv: jax.Array, greedy_b: jax.Array
) -> jax.Array:
    """Tokens [B] from `filtered_logprobs` rows: argmax for greedy rows, a draw for the others.

    A greedy row's log-probabilities are one-hot, so a draw would return its argmax too; when
    every row is greedy no random numbers are generated at all.
    """
    argmax_b = jnp.argmax(logprobs_bv, axis=-1).astype(jnp.int32)
    return jax.lax.cond(
        jnp.all(greedy_b),
        lambda: argmax_b,
        lambda: jnp.where(greedy_b, argmax_b, categorical(keys_b, logprobs_bv)),
    )


def sample_tokens(
    keys_b: jax.Array, logits_bv: jax.Array, cfg: SamplingConfig | RowSampling
) -> jax.Array:
    """Sample one int32 token per row from `filtered_logprobs(logits_bv, cfg)`.

    Greedy rows take the first argmax and consume no randomness. Keys may be typed keys [B] or
    legacy uint32 keys [B, 2].
    """
    if isinstance(cfg, SamplingConfig) and cfg.greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    rows = as_rows(cfg, logits_bv.shape[:-1])
    return sample_from_logprobs(keys_b, filtered_logprobs(logits_bv, rows), rows.greedy)


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
