"""Verification-length schedulers: thresholds, Algorithm 1 and the asynchronous variant.

All schedulers return per-request draft lengths l_r in 0..gamma (int32 [B]); every request also
verifies its anchor, so a request with l_r draft tokens sends 1 + l_r tokens to the target.
Confidences `conf_bk` are the calibrated conditional confidences c_{r,k}; the survival
probability of draft position j is a_{r,j} = prod_{i<=j} c_{r,i}.

SPS tables are 1-D arrays indexed by the total number of verified tokens (anchors included),
0..len-1. A token count past the end of the table has SPS 0: such a batch has throughput 0, so
it never improves on anything already admitted and is never chosen.

Section 5.2 (asynchronous variant), as read here: the verify batch size must be known before
the current round's drafts exist, so a capacity K is computed from the confidences of two rounds
before with the global search (Algorithm 1 without the early stop, free to jump SPS cliffs);
the current round then admits its own top-K candidates, ranked by their up-to-date survivals
(`capacity_from_history` then `top_k_schedule`). The global search cannot leak this round's
tokens because its input predates them. In the first two rounds there is no history; the caller
picks the capacity (e.g. Algorithm 1 with early stop on the current confidences).

Everything here is jittable with static shapes and no host syncs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


class SchedulerInputError(ValueError):
    """Raised for confidence arrays or SPS tables of the wrong shape or content."""


def _check_conf(conf_bk: jax.Array) -> None:
    if conf_bk.ndim != 2:
        raise SchedulerInputError(f"conf_bk must be [batch, gamma], got shape {conf_bk.shape}")


def threshold_lengths(conf_bk: jax.Array, threshold: float, cumulative: bool = False) -> jax.Array:
    """Draft lengths that stop at the first c_k < threshold (or the first a_k < threshold when
    `cumulative`)."""
    _check_conf(conf_bk)
    score_bk = jnp.cumprod(conf_bk, axis=1) if cumulative else conf_bk
    keep_bk = (score_bk >= threshold).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(keep_bk, axis=1), axis=1, dtype=jnp.int32)


def _sps_at(sps_table: jax.Array, n_tokens: jax.Array) -> jax.Array:
    size = sps_table.shape[0]
    in_range = (n_tokens >= 0) & (n_tokens < size)
    return jnp.where(in_range, sps_table[jnp.clip(n_tokens, 0, size - 1)], 0.0)


def _admission_order(
    conf_bk: jax.Array, active_b: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Candidates (r, j) in admission order: a_{r,j} descending, then j, then r ascending.

    Returns (a_sorted, valid_sorted, r_sorted, n_active). Because a_{r,j} <= a_{r,j-1}, ordering
    ties by j puts (r, j-1) before (r, j), so every prefix of the order is prefix-closed per
    request. Candidates with a = 0 (outside the paper's candidate space E) and those of inactive
    requests are marked invalid and sorted last."""
    _check_conf(conf_bk)
    b, g = conf_bk.shape
    a_bk = jnp.cumprod(conf_bk.astype(jnp.float32), axis=1)
    active = jnp.ones((b,), bool) if active_b is None else active_b.astype(bool)
    valid_bk = (a_bk > 0) & active[:, None]
    key_bk = jnp.where(valid_bk, -a_bk, jnp.inf)
    r_bk = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, g))
    j_bk = jnp.broadcast_to(jnp.arange(g, dtype=jnp.int32)[None, :], (b, g))
    order = jnp.lexsort((r_bk.ravel(), j_bk.ravel(), key_bk.ravel()))
    n_active = jnp.sum(active, dtype=jnp.int32)
    return a_bk.ravel()[order], valid_bk.ravel()[order], r_bk.ravel()[order], n_active


def _lengths_from_count(r_sorted: jax.Array, n_admit: jax.Array, b: int) -> jax.Array:
    admitted = (jnp.arange(r_sorted.shape[0]) < n_admit).astype(jnp.int32)
    return jnp.zeros((b,), jnp.int32).at[r_sorted].add(admitted)


def _throughput_path(
    conf_bk: jax.Array, sps_table: jax.Array, active_b: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    if sps_table.ndim != 1:
        raise SchedulerInputError(f"sps_table must be 1-D, got shape {sps_table.shape}")
    a_sorted, valid_sorted, r_sorted, n_active = _admission_order(conf_bk, active_b)
    tau_path = n_active + jnp.cumsum(jnp.where(valid_sorted, a_sorted, 0.0))
    n_tok_path = n_active + 1 + jnp.arange(a_sorted.shape[0], dtype=jnp.int32)
    theta_path = jnp.where(valid_sorted, tau_path * _sps_at(sps_table, n_tok_path), -jnp.inf)
    theta0 = n_active * _sps_at(sps_table, n_active)
    theta = jnp.concatenate([theta0[None], theta_path]).astype(jnp.float32)
    return theta, r_sorted


def admission_throughput(
    conf_bk: jax.Array, sps_table: jax.Array, active_b: jax.Array | None = None
) -> jax.Array:
    """Theta along the admission path, float32 [B*gamma + 1]: entry i is tau* x SPS(R + i)
    after admitting the first i candidates; entries past the valid candidates are -inf."""
    return _throughput_path(conf_bk, sps_table, active_b)[0]


def prefix_schedule(
    conf_bk: jax.Array,
    sps_table: jax.Array,
    early_stop: bool = True,
    active_b: jax.Array | None = None,
) -> jax.Array:
    """Paper Algorithm 1: per-request draft lengths maximising Theta = tau* x SPS(B).

    B starts at R (the active requests' anchors) and tau* at R; candidates are admitted in
    `_admission_order`. With `early_stop` the admission stops at the first candidate whose Theta
    does not strictly improve (the causal, lossless rule). With `early_stop=False` the result is
    the first global argmax of Theta over the whole path, the retrospective search of Appendix A:
    it is not lossless when confidences depend on sampled draft tokens, and is exposed for the
    history-based capacity of Section 5.2 and for tests. Inactive requests (`active_b` False) get
    length 0 and do not count towards R."""
    theta, r_sorted = _throughput_path(conf_bk, sps_table, active_b)
    if early_stop:
        improving = (theta[1:] > theta[:-1]).astype(jnp.int32)
        n_admit = jnp.sum(jnp.cumprod(improving))
    else:
        n_admit = jnp.argmax(theta)
    return _lengths_from_count(r_sorted, n_admit, conf_bk.shape[0])


def capacity_from_history(
    conf_bk_history: jax.Array, sps_table: jax.Array, active_b: jax.Array | None = None
) -> jax.Array:
    """Section 5.2 capacity: the number of draft tokens K (int32 scalar) that the unconstrained
    global search (Algorithm 1 without the early stop) admits on confidences from two rounds
    before. Pass the active mask of that round.

    K counts draft tokens only; anchors are always verified, so the next verify batch holds
    R + K tokens where R is the number of requests active then. The search may run past SPS
    cliffs because nothing in its input depends on the draft tokens it will gate."""
    lengths = prefix_schedule(conf_bk_history, sps_table, early_stop=False, active_b=active_b)
    return jnp.sum(lengths, dtype=jnp.int32)


def top_k_schedule(
    conf_bk: jax.Array, capacity: jax.Array | int, active_b: jax.Array | None = None
) -> jax.Array:
    """Section 5.2 allocation: admit the `capacity` candidates with the highest current survival
    a_{r,j} (same order and validity as Algorithm 1), fewer if fewer have a > 0.

    Lossless when `capacity` does not depend on this round's draft tokens: (r, j) is admitted iff
    fewer than `capacity` candidates precede it, and every candidate that can precede it has a
    survival computed without x_{r,j}."""
    _, valid_sorted, r_sorted, _ = _admission_order(conf_bk, active_b)
    n_valid = jnp.sum(valid_sorted, dtype=jnp.int32)
    n_admit = jnp.clip(jnp.asarray(capacity, jnp.int32), 0, n_valid)
    return _lengths_from_count(r_sorted, n_admit, conf_bk.shape[0])
