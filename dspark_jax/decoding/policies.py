"""Verification-length policies: how many drafts each request sends to the target in a round.

A policy runs inside the engine's jitted round. Each round it sees the drafter's confidence
logits for the block (already divided by the STS temperatures when the engine holds an
artifact, so sigmoid(logit) is the calibrated conditional confidence c_k), the mask of active
rows and a carry of its own that lives in `DecodeState`; it returns per-request draft lengths
0..gamma and the next carry. Lengths are counts, so what a request verifies is always a prefix.

Lossless policies decide whether draft k is verified from information available before x_k
was sampled: fixed lengths, thresholds (c_k depends on x_{<k} only), Algorithm 1 with its early
stop, and the Section 5.2 variant (its capacity comes from confidences two rounds old).

SPS (steps per second of a decoding step: the target's verification forward, or a whole round
when profiled in round mode, see `profiling`) enters the schedulers either as a 1-D table over
the total number of verified tokens B (the paper's packed-batch engine) or as a measured
`SpsProfile`. Our engine verifies a padded rectangle [batch bucket, verify bucket], so
with a profile the table seen by Algorithm 1 is the cost of the rectangle that B tokens spread
evenly over the R active requests need: SPS(B) = sps(batch, smallest bucket >= ceil(B / R)).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from dspark_jax.decoding import scheduler
from dspark_jax.errors import UserError

SPS_FORMAT = "dspark-jax/sps/v1"
_SPS_ARRAYS = ("batch_sizes", "buckets", "sps")


class PolicyError(UserError):
    """A policy that cannot be built or used as asked (bad parameters, missing inputs)."""


@runtime_checkable
class Policy(Protocol):
    """A stateful, jittable verification-length policy (see the module docstring)."""

    needs_confidence: bool

    def init_carry(self, batch: int, gamma: int) -> Any:
        """The carry at the start of a batch (a pytree of arrays; `()` when stateless)."""
        ...

    def step(
        self, conf_logits_bk: jax.Array | None, active_b: jax.Array, carry: Any
    ) -> tuple[jax.Array, Any]:
        """(int32 draft lengths [B], next carry); inactive rows must get 0."""
        ...


def _masked(lengths_b: jax.Array, active_b: jax.Array) -> jax.Array:
    return jnp.where(active_b, lengths_b, 0).astype(jnp.int32)


def _require_conf(conf_logits_bk: jax.Array | None, name: str) -> jax.Array:
    if conf_logits_bk is None:
        raise PolicyError(f"{name} needs confidence logits; this drafter has no confidence head")
    return jax.nn.sigmoid(conf_logits_bk.astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class FixedPolicy:
    """Verify `gamma` drafts (clipped to the block) for every active request."""

    gamma: int
    needs_confidence: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.gamma < 0:
            raise PolicyError(f"gamma must be >= 0, got {self.gamma}")

    def init_carry(self, batch: int, gamma: int) -> tuple:
        return ()

    def step(self, conf_logits_bk, active_b, carry):
        return _masked(jnp.full(active_b.shape, self.gamma, jnp.int32), active_b), carry


@dataclasses.dataclass(frozen=True)
class ThresholdPolicy:
    """Stop at the first c_k below `threshold` (or the first survival a_k when `cumulative`)."""

    threshold: float
    cumulative: bool = False
    needs_confidence: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise PolicyError(f"threshold must lie in [0, 1], got {self.threshold}")

    def init_carry(self, batch: int, gamma: int) -> tuple:
        return ()

    def step(self, conf_logits_bk, active_b, carry):
        conf_bk = _require_conf(conf_logits_bk, "a threshold policy")
        lengths_b = scheduler.threshold_lengths(conf_bk, self.threshold, self.cumulative)
        return _masked(lengths_b, active_b), carry


# -- SPS profiles --------------------------------------------------------------------------------
class SpsProfileError(UserError):
    """A malformed SPS profile (file or arrays)."""


@dataclasses.dataclass(frozen=True, eq=False)
class SpsProfile:
    """Measured steps per second of the verification forward, per batch size x verify bucket.

    `sps_bw[i, j]` is for `batch_sizes[i]` rows of `buckets[j]` tokens each (B = rows x width
    tokens). `meta` records where and how it was measured (device, date, config, ...)."""

    batch_sizes: tuple[int, ...]
    buckets: tuple[int, ...]
    sps_bw: np.ndarray
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = tuple(int(b) for b in self.batch_sizes)
        buckets = tuple(int(w) for w in self.buckets)
        sps = np.asarray(self.sps_bw, dtype=np.float64)
        for name, values in (("batch_sizes", sizes), ("buckets", buckets)):
            if not values or min(values) < 1 or list(values) != sorted(set(values)):
                raise SpsProfileError(f"{name} must be strictly increasing positive ints: {values}")
        if sps.shape != (len(sizes), len(buckets)):
            raise SpsProfileError(
                f"sps must be [batch_sizes, buckets] = {(len(sizes), len(buckets))}, "
                f"got {sps.shape}"
            )
        if not np.all(np.isfinite(sps) & (sps > 0)):
            raise SpsProfileError("sps must be finite and positive")
        object.__setattr__(self, "batch_sizes", sizes)
        object.__setattr__(self, "buckets", buckets)
        object.__setattr__(self, "sps_bw", sps)

    def row(self, batch: int) -> np.ndarray:
        """SPS per bucket for `batch` rows: the smallest profiled batch size >= `batch`."""
        for i, size in enumerate(self.batch_sizes):
            if size >= batch:
                return self.sps_bw[i]
        raise SpsProfileError(
            f"batch size {batch} exceeds the largest profiled one ({self.batch_sizes[-1]}); "
            "profile larger batches"
        )

    def packed_table(self, max_tokens: int) -> np.ndarray:
        """1-D SPS over total tokens 0..max_tokens for a packed engine: the fastest profiled
        rectangle holding at least that many tokens (0 where none does)."""
        tokens = np.outer(self.batch_sizes, self.buckets).ravel()
        sps = self.sps_bw.ravel()
        n = np.arange(max_tokens + 1)
        fits = tokens[None, :] >= n[:, None]
        return np.where(fits.any(axis=1), np.max(np.where(fits, sps, 0.0), axis=1), 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SPS_FORMAT,
            **self.meta,
            "batch_sizes": list(self.batch_sizes),
            "buckets": list(self.buckets),
            "sps": self.sps_bw.tolist(),
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> SpsProfile:
        try:
            body = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SpsProfileError(f"{path}: cannot read the SPS table ({e})") from e
        if not isinstance(body, dict) or body.get("format") != SPS_FORMAT:
            raise SpsProfileError(f"{path}: not an SPS table (format {SPS_FORMAT!r} expected)")
        missing = set(_SPS_ARRAYS) - set(body)
        if missing:
            raise SpsProfileError(f"{path}: lacks {sorted(missing)}")
        meta = {k: v for k, v in body.items() if k not in ("format", *_SPS_ARRAYS)}
        return cls(body["batch_sizes"], body["buckets"], np.asarray(body["sps"]), meta)


def profile_meta(**extra: Any) -> dict[str, Any]:
    """Device and date of a measurement made now, plus `extra` fields."""
    device = jax.devices()[0]
    return {
        "device": f"{device.platform}: {device.device_kind}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **extra,
    }


def rectangle_sps_table(
    sps_w: jax.Array, buckets: Sequence[int], n_active: jax.Array, max_tokens: int
) -> jax.Array:
    """SPS over total tokens 0..max_tokens when B tokens are spread evenly over `n_active` rows
    of a rectangle padded to `buckets` widths (jittable; 0 past the largest bucket)."""
    buckets_w = jnp.asarray(buckets, jnp.int32)
    n_tokens = jnp.arange(max_tokens + 1, dtype=jnp.int32)
    rows = jnp.maximum(n_active, 1)
    width = (n_tokens + rows - 1) // rows
    idx = jnp.searchsorted(buckets_w, width, side="left")
    return jnp.where(idx < len(buckets), sps_w[jnp.minimum(idx, len(buckets) - 1)], 0.0)


def _sps_table(sps: SpsProfile | jax.Array, active_b: jax.Array, gamma: int) -> jax.Array:
    if isinstance(sps, SpsProfile):
        batch = active_b.shape[0]
        row = jnp.asarray(sps.row(batch), jnp.float32)
        n_active = jnp.sum(active_b, dtype=jnp.int32)
        return rectangle_sps_table(row, sps.buckets, n_active, batch * (gamma + 1))
    return sps


def _check_sps(sps: SpsProfile | ArrayLike) -> SpsProfile | jax.Array:
    if isinstance(sps, SpsProfile):
        return sps
    table = np.asarray(sps, dtype=np.float32)
    if table.ndim != 1 or table.size < 2:
        raise PolicyError(f"an SPS table must be 1-D over token counts, got shape {table.shape}")
    if not np.all(np.isfinite(table) & (table >= 0)):
        raise PolicyError("SPS table entries must be finite and >= 0")
    return jnp.asarray(table)


# -- schedulers ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class PrefixSchedulePolicy:
    """Paper Algorithm 1 (`scheduler.prefix_schedule`) on the round's confidences.

    `early_stop=False` is the retrospective global search of Appendix A: NOT lossless when the
    confidences depend on sampled drafts (the Markov feature); it exists to demonstrate that."""

    sps: SpsProfile | jax.Array
    early_stop: bool = True
    needs_confidence: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "sps", _check_sps(self.sps))

    def init_carry(self, batch: int, gamma: int) -> tuple:
        return ()

    def step(self, conf_logits_bk, active_b, carry):
        conf_bk = _require_conf(conf_logits_bk, "Algorithm 1")
        table = _sps_table(self.sps, active_b, conf_bk.shape[1])
        return scheduler.prefix_schedule(conf_bk, table, self.early_stop, active_b), carry


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HistoryCarry:
    """Confidences and active masks of the last two rounds (index 0 is the older one)."""

    conf_2bk: jax.Array
    active_2b: jax.Array
    rounds_seen: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class AsyncSchedulePolicy:
    """Section 5.2: capacity K from the confidences of two rounds before (global search, no
    early stop), then this round admits its top-K candidates by current survival. The first two
    rounds of a batch have no history and use Algorithm 1 with early stop."""

    sps: SpsProfile | jax.Array
    needs_confidence: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "sps", _check_sps(self.sps))

    def init_carry(self, batch: int, gamma: int) -> HistoryCarry:
        return HistoryCarry(
            conf_2bk=jnp.zeros((2, batch, gamma), jnp.float32),
            active_2b=jnp.zeros((2, batch), bool),
            rounds_seen=jnp.int32(0),
        )

    def step(self, conf_logits_bk, active_b, carry: HistoryCarry):
        conf_bk = _require_conf(conf_logits_bk, "the asynchronous scheduler")
        gamma = conf_bk.shape[1]
        old_active_b = carry.active_2b[0]
        capacity = scheduler.capacity_from_history(
            carry.conf_2bk[0], _sps_table(self.sps, old_active_b, gamma), old_active_b
        )
        async_b = scheduler.top_k_schedule(conf_bk, capacity, active_b)
        warmup_b = scheduler.prefix_schedule(
            conf_bk, _sps_table(self.sps, active_b, gamma), True, active_b
        )
        lengths_b = jnp.where(carry.rounds_seen >= 2, async_b, warmup_b)
        carry = HistoryCarry(
            conf_2bk=jnp.stack([carry.conf_2bk[1], conf_bk]),
            active_2b=jnp.stack([carry.active_2b[1], active_b.astype(bool)]),
            rounds_seen=carry.rounds_seen + 1,
        )
        return lengths_b, carry


POLICY_NAMES = ("fixed", "threshold", "cumulative-threshold", "scheduler", "async-scheduler")


def make_policy(
    name: str,
    gamma: int,
    *,
    threshold: float | None = None,
    sps: SpsProfile | ArrayLike | None = None,
) -> Policy:
    """A policy by name (`POLICY_NAMES`): thresholds need `threshold`, schedulers `sps`."""
    if name == "fixed":
        return FixedPolicy(gamma)
    if name in ("threshold", "cumulative-threshold"):
        if threshold is None:
            raise PolicyError(f"policy {name!r} needs a threshold")
        return ThresholdPolicy(threshold, cumulative=name == "cumulative-threshold")
    if name in ("scheduler", "async-scheduler"):
        if sps is None:
            raise PolicyError(f"policy {name!r} needs an SPS table (dspark-jax profile)")
        return PrefixSchedulePolicy(sps) if name == "scheduler" else AsyncSchedulePolicy(sps)
    raise PolicyError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
