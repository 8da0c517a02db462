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
from dspark_jax.models.layers import graph_loops, target_backend

STREAM_DRAFT = 0
STREAM_ACCEPT = 1
STREAM_RESIDUAL = 2

# Token-id sentinels; no real token id is negative.
PAD_TOKEN = -1  # output slots past the tokens a request committed
NO_STOP_TOKEN = -2  # the whole stop list of a request that ends only at its length limit

# The engine holds top_k as int32; a k this large already keeps every token of any vocabulary.
TOP_K_MAX = 2**31 - 1

# OpenAI's range for presence_penalty and frequency_penalty (vLLM's too).
PENALTY_MAX = 2.0
# OpenAI's range for a logit_bias value: -100 bans a token in effect, 100 all but forces it.
LOGIT_BIAS_MAX = 100.0


class SamplingConfigError(UserError):
    """A sampling parameter is out of range."""


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are sampled; hashable so it can be a static jit argument.

    temperature 0 means greedy (argmax). top_k 0, top_p 1.0 and min_p 0 switch those filters
    off. min_p keeps the tokens at least min_p times as likely as the likeliest (after
    temperature, top-k and top-p, in Hugging Face's order; the likeliest is the same either
    way).

    presence_penalty and frequency_penalty (OpenAI's, -2 to 2; 0 = off) lower the logit of each
    token the request has generated so far: by presence_penalty once, and by frequency_penalty
    per time it was generated; negative values raise it. They apply to the target's logits
    before temperature and the filters, as OpenAI and vLLM apply them, and only in the engine,
    which counts the request's tokens (an engine built with `EngineConfig.penalties`): the
    functions here that take a config filter one row of logits and know no history, so they
    refuse a config with penalties (`filters` is the config without them; `apply_penalties`
    adjusts logits by given counts).

    repetition_penalty (Hugging Face's and vLLM's, > 0; 1 = off) divides the positive logits and
    multiplies the negative ones of each token in the prompt or generated so far, once however
    often it occurs: above 1 it makes repeats less likely. It applies before the other two
    penalties (vLLM's order) and, like them, only in the engine, which also holds the set of
    each request's prompt tokens (`apply_repetition_penalty`).

    logit_bias (OpenAI's) adds a value in [-100, 100] to the logits of chosen token ids before
    temperature and the filters, at every token of the request: a mapping {token id: bias} (or
    (id, bias) pairs), kept as pairs sorted by id. Like the penalties it is applied by the
    engine (an engine built with `EngineConfig.max_logit_bias`), and the row functions here
    refuse it.

    allowed_token_ids (vLLM's): when not empty, every other token's logit is -inf at every token
    of the request, so only these can be drawn (after the penalties and the logit bias, whose
    entries on other tokens then count for nothing). Kept sorted, without repeats; applied by
    the engine alone, which holds them where it holds the biases (`EngineConfig.max_logit_bias`
    bounds their number).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    allowed_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        numbers = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty")
        for name in numbers + ("repetition_penalty",):
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
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingConfigError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_MAX <= value <= PENALTY_MAX:
                raise SamplingConfigError(
                    f"{name} must be in [{-PENALTY_MAX:g}, {PENALTY_MAX:g}] (0 = off), got {value}"
                )
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise SamplingConfigError(
                f"repetition_penalty must be finite and > 0 (1 = off; above 1 discourages "
                f"repeats), got {self.repetition_penalty}"
            )
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        object.__setattr__(self, "allowed_token_ids", _token_set(self.allowed_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusted(self) -> bool:
        """Penalties, a logit bias or allowed tokens change the logits before the filters (the
        engine's work)."""
        return self.penalized or bool(self.logit_bias) or bool(self.allowed_token_ids)

    @property
    def penalized(self) -> bool:
        """Some penalty is on: the tokens depend on the request's history beyond its logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def filters(self) -> SamplingConfig:
        """This config without its penalties, logit bias and allowed tokens: what filters each
        row of (adjusted) logits."""
        return dataclasses.replace(
            self,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            repetition_penalty=1.0,
            logit_bias=(),
            allowed_token_ids=(),
        )

    @property
    def bias_entries(self) -> tuple[tuple[int, float], ...]:
        """The (token id, bias) pairs the engine holds for this config (`bias_entries`)."""
        return bias_entries(self.logit_bias, self.allowed_token_ids)


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """`SamplingConfig.logit_bias` as (token id, bias) pairs sorted by id, each checked."""
    try:
        items = list(bias.items()) if hasattr(bias, "items") else list(bias)
    except TypeError:
        raise SamplingConfigError(
            f"logit_bias must map token ids to biases, got {bias!r}"
        ) from None
    pairs = {}
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise SamplingConfigError(
                f"logit_bias must map token ids to biases, got the entry {item!r}"
            )
        token, value = item
        token_id = as_integer(token)
        if token_id is None or token_id < 0:
            raise SamplingConfigError(
                f"logit_bias keys must be token ids (integers >= 0), got {token!r}"
            )
        try:
            if isinstance(value, bool | str | bytes):
                raise TypeError
            number = float(value)
        except (TypeError, ValueError):
            raise SamplingConfigError(
                f"logit_bias[{token_id}] must be a number, got {value!r}"
            ) from None
        if not -LOGIT_BIAS_MAX <= number <= LOGIT_BIAS_MAX:  # NaN fails this too
            raise SamplingConfigError(
                f"logit_bias[{token_id}] must be in [{-LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], "
                f"got {number}"
            )
        if token_id in pairs:
            raise SamplingConfigError(f"logit_bias names token {token_id} twice")
        pairs[token_id] = number
    return tuple(sorted(pairs.items()))


def bias_entries(logit_bias, allowed_token_ids) -> tuple[tuple[int, float], ...]:
    """The (token id, bias) pairs a slot holds for a logit bias (pairs or a mapping) and
    allowed tokens: the bias alone or, with allowed tokens, each of them with its bias (0
    unless biased; a bias on another token counts for nothing). As many as the engine's
    `max_logit_bias` must hold."""
    pairs = tuple(logit_bias.items()) if hasattr(logit_bias, "items") else tuple(logit_bias)
    if not allowed_token_ids:
        return pairs
    given = dict(pairs)
    return tuple((token, given.get(token, 0.0)) for token in dict.fromkeys(allowed_token_ids))


def _token_set(ids) -> tuple[int, ...]:
    """`SamplingConfig.allowed_token_ids` as sorted distinct token ids, each checked."""
    if isinstance(ids, str | bytes) or hasattr(ids, "items"):
        raise SamplingConfigError(f"allowed_token_ids must be a sequence of token ids, got {ids!r}")
    try:
        items = list(ids)
    except TypeError:
        raise SamplingConfigError(
            f"allowed_token_ids must be a sequence of token ids, got {ids!r}"
        ) from None
    tokens = set()
    for item in items:
        token = as_integer(item)
        if token is None or token < 0:
            raise SamplingConfigError(
                f"allowed_token_ids must be token ids (integers >= 0), got {item!r}"
            )
        tokens.add(token)
    return tuple(sorted(tokens))


GREEDY = SamplingConfig()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings as arrays (one row per request, or per token of a request).

    Shapes are the leading (batch) shape of the logits they filter. temperature 0 is greedy, top_k
    0, top_p 1 and min_p 0 switch those filters off: the same meaning as `SamplingConfig`, as
    data, so one compiled program serves every mix of settings.
    """

    temperature: jax.Array  # float32
    top_k: jax.Array  # int32
    top_p: jax.Array  # float32
    min_p: jax.Array  # float32

    @classmethod
    def from_config(cls, cfg: SamplingConfig, shape: tuple[int, ...] = ()) -> RowSampling:
        return cls(
            temperature=jnp.full(shape, cfg.temperature, jnp.float32),
            top_k=jnp.full(shape, cfg.top_k, jnp.int32),
            top_p=jnp.full(shape, cfg.top_p, jnp.float32),
            min_p=jnp.full(shape, cfg.min_p, jnp.float32),
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

    def only(self, mask: jax.Array) -> RowSampling:
        """These settings where `mask` (the shape of the fields) holds, greedy elsewhere: rows
        that carry no request (a finished slot, padding) must not keep the top-k/top-p search
        and the random draw running for the rows that do."""
        return RowSampling(
            temperature=jnp.where(mask, self.temperature, 0.0),
            top_k=jnp.where(mask, self.top_k, 0),
            top_p=jnp.where(mask, self.top_p, 1.0),
            min_p=jnp.where(mask, self.min_p, 0.0),
        )


def as_rows(cfg: SamplingConfig | RowSampling, shape: tuple[int, ...]) -> RowSampling:
    if isinstance(cfg, SamplingConfig):
        if cfg.penalized:
            raise SamplingConfigError(
                "penalties depend on the tokens a request has generated, which a row of logits "
                "does not know: adjust the logits with `apply_penalties` and filter them with "
                "the config's `filters` (the engine does both)"
            )
        if cfg.logit_bias:
            raise SamplingConfigError(
                "a logit_bias is added to the logits before the filters: add it to the row "
                "(`apply_logit_bias`) and filter it with the config's `filters` (the engine "
                "does both)"
            )
        if cfg.allowed_token_ids:
            raise SamplingConfigError(
                "allowed_token_ids mask the logits before the filters: mask the row "
                "(`apply_allowed_tokens`) and filter it with the config's `filters` (the "
                "engine does both)"
            )
        return RowSampling.from_config(cfg, shape)
    return cfg.broadcast(shape) if cfg.temperature.shape != shape else cfg


_SIGN = -(2**31)  # int32 sign bit


def _ordered_keys(x: jax.Array) -> jax.Array:
    """int32 keys of float32 values, ordered as the values are (-inf lowest, +inf highest)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, ~bits ^ _SIGN, bits)


def _key_values(keys: jax.Array) -> jax.Array:
    """The float32 values of `_ordered_keys`."""
    return jax.lax.bitcast_convert_type(jnp.where(keys < 0, ~(keys ^ _SIGN), keys), jnp.float32)


def _smallest_key(holds, lo_x1: jax.Array, hi_x1: jax.Array, unroll: bool | None = None
                  ) -> jax.Array:
    """Per row, the smallest int32 key t in [lo, hi] where `holds(t, step_x1)` [..., 1] is
    true, for a predicate that is false below some key and true from it on, and true at `hi`:
    32 halvings.

    `unroll` (None: for a GPU whose programs do not take loops into their CUDA graphs,
    `layers.graph_loops`) writes the halvings out. There a loop's every trip would end with
    the host reading its predicate back before it launches the next: a row that filters would
    cost 32 round trips to the host per filter at every place a round samples, and a loop
    anywhere inside the round's conditionals (the token buckets, the filters' switch) would
    keep those conditionals out of the graph too, a round trip each in every round whether or
    not a row filters. Written out, the halvings are 32 reductions in the graph, at twice the
    compile time of a speculative program. Where loops are recorded into the graph (an NVIDIA
    GPU by default, `layers.compiler_options`, which the engine's programs are compiled with)
    and on the CPU, the loop stays. The same halvings either way, so the same cutoffs.

    `step_x1` is None in the loop. Written out, it is a per-row boolean, false wherever the
    caller's values matter (lo > hi: the bounds never cross where the predicate holds at
    `hi`; in a row where it does not -- a filter the row does not use, whose result is
    discarded -- they can, and from then on `hi` no longer moves, whatever the predicate
    says), but not known to XLA: `holds` makes what it computes from the values depend on it
    (`_row_cutoffs`: the divisor NaN where it is true), so that each step's expression is its
    own. XLA eliminates common subexpressions before it fuses: 32 identical steps' keys and
    probabilities of the values would become [rows, V] arrays written once and read by every
    step (at 64 slots 0.6 GB of temporaries, each step reading 8 bytes a value instead of the
    logits' 4). Passing the values through an optimisation barrier at each step did not stop
    that (tried on a variant of this search compiled for an H200: the keys and probabilities
    were still written out as [rows, V] arrays).
    """
    if unroll is None:
        unroll = target_backend() == "gpu" and not graph_loops()

    def halve(bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        ok = holds(mid, lo > hi if unroll else None)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    bounds = (lo_x1, hi_x1)
    if not unroll:
        return jax.lax.fori_loop(0, 32, lambda _, b: halve(b), bounds)[1]
    for _ in range(32):
        bounds = halve(bounds)
    return bounds[1]


def _row_cutoffs(
    values_xv: jax.Array,
    top_k_x: jax.Array,
    top_p_x: jax.Array,
    temperature_x: jax.Array | None = None,
) -> jax.Array:
    """The smallest kept value of each row [X, 1] of `values_xv` [X, V] under its top-k then top-p
    filters (top_k 0 or >= V and top_p 1 switch them off; such a row gets -inf). With
    `temperature_x`, the values are logits, each row divided by its temperature first
    (`_scaled`).

    Both filters keep every token tied with the last kept value. Top-p is measured on the
    distribution left after top-k, normalised over all of it, ties included: its cutoff is the
    smallest value v whose strictly larger values hold less than top_p of that mass.

    Each cutoff is one of the row's values, found by bisection over their int32 ordering keys (32
    masked counts or sums over the vocabulary) rather than by sorting it: a sort of [rows, V] is
    the costliest pass in a round with V in the hundred thousands, on every backend. Every count
    and sum runs along its own row, so a row's cutoff does not depend on the other rows of the
    block; each search runs only when some row of the block uses its filter.

    Each halving reads the values as they came (the lm head's logits) and computes a value's
    key and probability again from them: on a GPU a top-p pass over [512, V] int32 keys and
    float32 probabilities read twice the bytes of one over the float32 logits, and 32 passes are
    most of what filtering costs there, where the arithmetic redone is cheap beside the memory
    traffic.
    """
    vocab = values_xv.shape[-1]

    def values(step_x1=None):
        """The float32 values (logits / temperature); given a search step's `step_x1` (see
        `_smallest_key`), divided by a divisor that is NaN where it is true: bitwise the same
        values, as an expression of that step's own."""
        divisor_x = temperature_x
        if step_x1 is not None:
            one_x = jnp.ones(values_xv.shape[:1], jnp.float32)
            divisor_x = jnp.where(step_x1[:, 0], jnp.nan, one_x if divisor_x is None else divisor_x)
        if divisor_x is None:
            return values_xv.astype(jnp.float32)
        return _scaled(values_xv, divisor_x)

    keys_xv = _ordered_keys(values())
    lo_x1 = jnp.min(keys_xv, axis=-1, keepdims=True)
    hi_x1 = jnp.max(keys_xv, axis=-1, keepdims=True)
    k_x1 = top_k_x[:, None]
    use_k_x1 = (k_x1 > 0) & (k_x1 < vocab)
    p_x1 = top_p_x[:, None]
    use_p_x1 = p_x1 < 1.0
    off_x1 = jnp.full(lo_x1.shape, -jnp.inf, jnp.float32)

    def kth_value():
        # The k-th largest value: the smallest t with fewer than k values above it.
        def above(t_x1, step_x1):
            return jnp.sum(_ordered_keys(values(step_x1)) > t_x1, axis=-1, keepdims=True) < k_x1

        kth_key_x1 = _smallest_key(above, lo_x1, hi_x1)
        return jnp.where(use_k_x1, _key_values(kth_key_x1), -jnp.inf)

    kth_x1 = jax.lax.cond(jnp.any(use_k_x1), kth_value, lambda: off_x1)

    def p_cut():
        scaled = values()
        in_k_xv = scaled >= kth_x1
        log_norm_x1 = jax.nn.logsumexp(jnp.where(in_k_xv, scaled, -jnp.inf), -1, keepdims=True)

        def below(t_x1, step_x1):
            # mass strictly above t, below top_p
            x_xv = values(step_x1)
            prob_xv = jnp.where(x_xv >= kth_x1, jnp.exp(x_xv - log_norm_x1), 0.0)
            mass_x1 = jnp.sum(
                jnp.where(_ordered_keys(x_xv) > t_x1, prob_xv, 0.0), axis=-1, keepdims=True
            )
            return mass_x1 < p_x1

        cut_key_x1 = _smallest_key(below, lo_x1, hi_x1)
        return jnp.where(use_p_x1, _key_values(cut_key_x1), -jnp.inf)

    p_cut_x1 = jax.lax.cond(jnp.any(use_p_x1), p_cut, lambda: off_x1)
    return jnp.maximum(kth_x1, p_cut_x1)


# Sizes (rows) of the blocks that `_filter_cutoffs` searches when only some rows filter: one request
# of a verification bucket at gamma 7 is 8 rows, eight of them 64; the whole batch is the last rung.
# Multiples of 8: XLA's CPU reductions over 4096 values or more sum a row of a block of 3, 5 or 7
# rows differently from the whole batch, and were not seen to in blocks of 4, 8, 16 or 64
# (tests/test_sampling.py holds every block to the whole batch's cutoffs).
_ROW_BLOCKS = (8, 64, 512)

# The fewest values (rows x vocabulary) of a block worth gathering; smaller ones are left to the
# whole batch. XLA's CPU backend sums fewer than 4096 values by a tree of 32-wide windows but more
# by a library kernel, so such a block could round a row's top-p mass differently from the whole
# batch and move a cutoff that lies within an ulp of top_p. Blocks that small are cheap to skip.
_BLOCK_MIN_VALUES = 4096


def _row_blocks(rows: int, vocab: int) -> tuple[int, ...]:
    """The block sizes `_filter_cutoffs` may search for [rows, vocab] logits, smallest first: the
    `_ROW_BLOCKS` below `rows` that hold `_BLOCK_MIN_VALUES`, then `rows`."""
    return tuple(b for b in _ROW_BLOCKS if b < rows and b * vocab >= _BLOCK_MIN_VALUES) + (rows,)


def _temperatures(rows: RowSampling) -> jax.Array:
    """Each row's divisor of its logits: its temperature, 1 for greedy rows."""
    return jnp.where(rows.greedy, 1.0, rows.temperature)


def _scaled(logits_xv: jax.Array, temperature_x: jax.Array) -> jax.Array:
    """float32 logits / T: what the filters and the softmax see."""
    return logits_xv.astype(jnp.float32) / temperature_x[..., None]


def _filter_cutoffs(logits_xv: jax.Array, rows: RowSampling) -> jax.Array:
    """The smallest kept value of each row [..., 1] of its scaled logits (`_scaled`) under its
    top-k then top-p filters (`_row_cutoffs`); -inf for a row that does not filter, greedy rows
    included (their output is the argmax whatever the cutoff).

    The logits go into the search's conditional as they come (the lm head's output, already in
    memory) and are scaled inside it: an operand of a conditional is a buffer of its own, so
    passing the scaled rows would have them written out in full every round ([512, V] float32
    at Qwen3's vocabulary: 311 MB, then read again by every pass of the softmax) even when no
    row filters, where outside a conditional XLA fuses the scaling into the passes that read it.

    The search costs what the filtering rows need, not the whole batch: the n rows that filter are
    gathered, in order, into the smallest block of `_row_blocks` that holds them (3 rows of 512
    search [8, V]), their cutoffs found there and read back by each row's place in the block. A
    block the size of the batch searches it in place, and n = 0 searches nothing. One program holds
    every rung and `lax.switch` picks one by the traced n, so no setting changes what is compiled.
    A row's cutoff is the same in any block (`_ROW_BLOCKS`, `_BLOCK_MIN_VALUES`), so it does not
    depend on how many other rows filter.
    """
    vocab = logits_xv.shape[-1]
    lead = logits_xv.shape[:-1]
    logits_xv = logits_xv.reshape(-1, vocab)
    temperature_x = _temperatures(rows).reshape(-1)
    top_k_x = rows.top_k.reshape(-1)
    top_p_x = rows.top_p.reshape(-1)
    filters_x = ~rows.greedy.reshape(-1) & (((top_k_x > 0) & (top_k_x < vocab)) | (top_p_x < 1.0))
    count = jnp.sum(filters_x, dtype=jnp.int32)
    slot_x = jnp.cumsum(filters_x, dtype=jnp.int32) - 1
    sizes = _row_blocks(logits_xv.shape[0], vocab)

    def search(size):
        if size == logits_xv.shape[0]:
            return lambda: _row_cutoffs(
                logits_xv,
                jnp.where(filters_x, top_k_x, 0),
                jnp.where(filters_x, top_p_x, 1.0),
                temperature_x,
            )

        def gathered():
            (row_b,) = jnp.nonzero(filters_x, size=size, fill_value=0)
            live_b = jnp.arange(size) < count
            cut_b1 = _row_cutoffs(
                logits_xv[row_b],
                jnp.where(live_b, top_k_x[row_b], 0),
                jnp.where(live_b, top_p_x[row_b], 1.0),
                temperature_x[row_b],
            )
            return jnp.where(filters_x[:, None], cut_b1[jnp.clip(slot_x, 0, size - 1)], -jnp.inf)

        return gathered

    off_x1 = jnp.full((logits_xv.shape[0], 1), -jnp.inf, jnp.float32)
    rung = jnp.sum(count > jnp.asarray((0,) + sizes[:-1], jnp.int32))
    cutoff_x1 = jax.lax.switch(rung, [lambda: off_x1] + [search(size) for size in sizes])
    return cutoff_x1.reshape(lead + (1,))


def filtered_logprobs(logits_xv: jax.Array, cfg: SamplingConfig | RowSampling) -> jax.Array:
    """Log-probabilities [..., V] (float32) of the distribution that sampling draws from.

    Greedy rows: 0 at the first argmax, -inf elsewhere. Others: logits / T, then top-k, then top-p
    (nucleus), then min-p, then log_softmax. `cfg` is one `SamplingConfig` for every row or a
    `RowSampling` whose fields have the logits' leading shape (or a prefix of it, broadcast). The
    cutoff search that top-k and top-p need covers only the rows that use them
    (`_filter_cutoffs`), and none when no row does; every row gets bitwise the same result
    whichever other rows filter, so a row's output never depends on its neighbours' settings.
    """
    return logprobs_and_argmax(logits_xv, cfg)[0]


def logprobs_and_argmax(
    logits_xv: jax.Array, cfg: SamplingConfig | RowSampling
) -> tuple[jax.Array, jax.Array]:
    """(`filtered_logprobs`, each row's first argmax of the logits [...], int32).

    One pass over the vocabulary finds the argmax and, with it, the softmax's maximum: x / T
    rounds monotonically in x and no filter drops the top logit, so the largest kept scaled
    logit is the argmax's own -- bitwise what `jax.nn.log_softmax` would reduce for. On a GPU
    each reduction over a vocabulary-long row is a kernel or two of its own (one row splits
    across blocks, then a second kernel combines them), launched at every draft position of a
    round: sharing it saves two such passes, and `sample_from_logprobs` given the argmax saves
    the third (a greedy row's log-probabilities are one-hot at it).
    """
    rows = as_rows(cfg, logits_xv.shape[:-1])
    greedy_x = rows.greedy
    scaled_xv = _scaled(logits_xv, _temperatures(rows))
    vocab = logits_xv.shape[-1]
    cutoff_x1 = _filter_cutoffs(logits_xv, rows)
    best_x = jnp.argmax(logits_xv, axis=-1).astype(jnp.int32)
    top_x1 = jax.lax.stop_gradient(jnp.take_along_axis(scaled_xv, best_x[..., None], axis=-1))
    # Min-p needs no search: p >= min_p * p_max is x / T >= max(x / T) + log(min_p), and top-k
    # and top-p never drop the likeliest token (log 0 = -inf: off).
    cutoff_x1 = jnp.maximum(cutoff_x1, top_x1 + jnp.log(rows.min_p)[..., None])
    # log_softmax's own steps (shift by the maximum, log of the sum of exps) on the kept values.
    shifted_xv = jnp.where(scaled_xv >= cutoff_x1, scaled_xv, -jnp.inf) - top_x1
    logp_xv = shifted_xv - jnp.log(jnp.sum(jnp.exp(shifted_xv), axis=-1, keepdims=True))
    onehot_xv = jnp.arange(vocab) == best_x[..., None]
    logp_xv = jnp.where(greedy_x[..., None], jnp.where(onehot_xv, 0.0, -jnp.inf), logp_xv)
    return logp_xv, best_x


def penalties(counts_xv: jax.Array, presence_x: jax.Array, frequency_x: jax.Array) -> jax.Array:
    """What each row's penalties take off its logits [..., V] (float32): `counts_xv` (how many
    times the row's request generated each token) times frequency_x, plus presence_x where the
    count is positive (`SamplingConfig.presence_penalty`, `frequency_penalty`; OpenAI's
    formula). Exactly 0 for a row whose penalties are 0."""
    counts_xv = counts_xv.astype(jnp.float32)
    return frequency_x[..., None] * counts_xv + presence_x[..., None] * (counts_xv > 0)


def apply_penalties(
    logits_xv: jax.Array, counts_xv: jax.Array, presence_x: jax.Array, frequency_x: jax.Array
) -> jax.Array:
    """float32 logits less their rows' `penalties`: what the filters then see. A row whose
    penalties are 0 keeps its (float32) logits bitwise."""
    return logits_xv.astype(jnp.float32) - penalties(counts_xv, presence_x, frequency_x)


def apply_repetition_penalty(
    logits_xv: jax.Array, seen_xv: jax.Array, repetition_x: jax.Array
) -> jax.Array:
    """float32 logits [..., V] with each row's `SamplingConfig.repetition_penalty` applied to
    the tokens `seen_xv` marks (bool, [..., V]: in the prompt or generated): a positive logit
    divided by it, a negative one multiplied (Hugging Face's and vLLM's formula). A row whose
    penalty is 1 keeps its float32 logits bitwise."""
    logits_xv = logits_xv.astype(jnp.float32)
    penalty_x1 = repetition_x[..., None]
    penalized_xv = jnp.where(logits_xv > 0, logits_xv / penalty_x1, logits_xv * penalty_x1)
    return jnp.where(seen_xv, penalized_xv, logits_xv)


def apply_logit_bias(logits_xv: jax.Array, ids_xk: jax.Array, bias_xk: jax.Array) -> jax.Array:
    """float32 logits [..., V] plus each row's `SamplingConfig.logit_bias`, given as token ids
    [..., K] and biases [..., K] (entries past a row's own pad with bias 0, which changes
    nothing: a row without a bias keeps its float32 logits bitwise, -0.0 aside)."""
    vocab = logits_xv.shape[-1]
    k = ids_xk.shape[-1]
    flat_xv = logits_xv.astype(jnp.float32).reshape(-1, vocab)
    rows_x1 = jnp.arange(flat_xv.shape[0])[:, None]
    flat_xv = flat_xv.at[rows_x1, ids_xk.reshape(-1, k)].add(
        bias_xk.reshape(-1, k).astype(jnp.float32), mode="drop"
    )
    return flat_xv.reshape(logits_xv.shape)


def allowed_rows(ids_xk: jax.Array, only_x: jax.Array, vocab: int) -> jax.Array:
    """bool [..., V]: the tokens each row may draw -- its ids [..., K] where `only_x` [...] holds
    (allowed_token_ids; entries past a row's own repeat one of them), every token elsewhere."""
    k = ids_xk.shape[-1]
    rows = ids_xk.reshape(-1, k).shape[0]
    marked_xv = jnp.zeros((rows, vocab), bool)
    marked_xv = marked_xv.at[jnp.arange(rows)[:, None], ids_xk.reshape(-1, k)].set(
        True, mode="drop"
    )
    return marked_xv.reshape(*ids_xk.shape[:-1], vocab) | ~only_x[..., None]


def apply_allowed_tokens(logits_xv: jax.Array, ids_xk: jax.Array, only_x: jax.Array) -> jax.Array:
    """float32 logits [..., V] with -inf at every token but a row's ids [..., K] in the rows
    where `only_x` [...] holds (`SamplingConfig.allowed_token_ids`); other rows keep their
    float32 logits bitwise."""
    allowed_xv = allowed_rows(ids_xk, only_x, logits_xv.shape[-1])
    return jnp.where(allowed_xv, logits_xv.astype(jnp.float32), -jnp.inf)


def ban_tokens(logits_xv: jax.Array, ids_xk: jax.Array, ban_x: jax.Array) -> jax.Array:
    """float32 logits [..., V] with each row's token ids [..., K] (negative: none) set to -inf in
    the rows where `ban_x` [...] holds: no sampling, filter or argmax can pick them there. Other
    rows keep their float32 logits bitwise. A logit bias of -inf at the banned ids, 0 (at id 0:
    a negative index would count from the end of the row) elsewhere."""
    banned_xk = ban_x[..., None] & (ids_xk >= 0)
    return apply_logit_bias(
        logits_xv, jnp.where(banned_xk, ids_xk, 0), jnp.where(banned_xk, -jnp.inf, 0.0)
    )


def logit_bias_rows(ids_xk: jax.Array, bias_xk: jax.Array, vocab: int) -> jax.Array:
    """Each row's logit bias as a dense float32 row [..., V] (0 off its ids)."""
    zeros = jnp.zeros((*ids_xk.shape[:-1], vocab), jnp.float32)
    return apply_logit_bias(zeros, ids_xk, bias_xk)


def categorical(keys_b: jax.Array, logprobs_bv: jax.Array) -> jax.Array:
    """One int32 token per row from unnormalised log-probabilities, row b with key b."""
    draw = jax.vmap(lambda key, logp_v: jax.random.categorical(key, logp_v))
    return draw(keys_b, logprobs_bv).astype(jnp.int32)


def sample_from_logprobs(
    keys_b: jax.Array,
    logprobs_bv: jax.Array,
    greedy_b: jax.Array,
    argmax_b: jax.Array | None = None,
) -> jax.Array:
    """Tokens [B] from `filtered_logprobs` rows: argmax for greedy rows, a draw for the others.

    A greedy row's log-probabilities are one-hot, so a draw would return its argmax too; when
    every row is greedy no random numbers are generated at all. `argmax_b`, where the caller has
    it (`logprobs_and_argmax`), is each row's argmax of its logits, which a greedy row's one-hot
    log-probabilities peak at: it saves reducing them again.
    """
    if argmax_b is None:
        argmax_b = jnp.argmax(logprobs_bv, axis=-1)
    argmax_b = argmax_b.astype(jnp.int32)
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
    if isinstance(cfg, SamplingConfig) and cfg.greedy and not cfg.adjusted:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    rows = as_rows(cfg, logits_bv.shape[:-1])
    logprobs_bv, argmax_b = logprobs_and_argmax(logits_bv, rows)
    return sample_from_logprobs(keys_b, logprobs_bv, rows.greedy, argmax_b)


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
