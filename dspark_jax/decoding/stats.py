"""Acceptance statistics of speculative decoding, pooled over the rounds of many requests.

Per-position statistics follow the paper (Figure 2): the conditional acceptance of draft position
k counts the rounds where drafts 1..k-1 were accepted and k was verified; prefix survival at k is
the share of rounds verifying k whose first k drafts were all accepted.

tau counts what each round committed, as the reference (DeepSpec) does: a request's last round
may commit past its max_new_tokens, and those tokens count though they are cut from its answer
(a stop token, by contrast, ends the round's count where it stands): at most gamma tokens a
request that ends by length, over all its rounds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from dspark_jax.calibration.records import records_from_results
from dspark_jax.calibration.sts import conditional_events, survival_events
from dspark_jax.decoding.batching import Result


@dataclasses.dataclass(frozen=True)
class AcceptanceStats:
    """Pooled statistics of speculative rounds; per-position arrays are indexed by k - 1."""

    rounds: int
    committed: int  # tokens committed by the rounds (bonus included)
    tau: float  # committed / rounds: mean acceptance length, bonus included; NaN: no rounds
    mean_verified: float  # NaN: no rounds
    conditional: np.ndarray  # P(draft k accepted | drafts 1..k-1 accepted, k verified); NaN: unseen
    conditional_n: np.ndarray
    survival: np.ndarray  # P(drafts 1..k all accepted | k verified); NaN: unseen
    survival_n: np.ndarray

    def to_json(self) -> dict[str, Any]:
        """JSON-ready fields; what was never observed (NaN) is null, as JSON has no NaN."""
        return {
            "rounds": self.rounds,
            "committed": self.committed,
            "tau": _nan_to_none(self.tau),
            "mean_verified": _nan_to_none(self.mean_verified),
            "conditional_acceptance": _nan_to_none(self.conditional),
            "conditional_observations": self.conditional_n.tolist(),
            "prefix_survival": _nan_to_none(self.survival),
            "survival_observations": self.survival_n.tolist(),
        }


def _nan_to_none(values):
    """A float, or an array as a list, with NaN as None."""
    if np.ndim(values) == 0:
        return None if np.isnan(values) else float(values)
    return [None if np.isnan(v) else float(v) for v in values]


def _rates(events_nk: np.ndarray, observed_nk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n_k = observed_nk.sum(axis=0)
    hits_k = (events_nk & observed_nk).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n_k > 0, hits_k / np.maximum(n_k, 1), np.nan), n_k


def acceptance_stats(results: Iterable[Result], gamma: int) -> AcceptanceStats:
    """Pools every speculative round of `results` (from a drafter with block size `gamma`)."""
    results = [r for r in results if r.rounds]
    committed = int(sum(int(np.sum(r.committed)) for r in results))
    rounds = int(sum(r.rounds for r in results))
    if rounds == 0:
        nan_k = np.full(gamma, np.nan)
        zero_k = np.zeros(gamma, np.int64)
        return AcceptanceStats(0, 0, float("nan"), float("nan"), nan_k, zero_k, nan_k, zero_k)
    records = records_from_results(results)
    observed, accepted = conditional_events(records)
    conditional, conditional_n = _rates(accepted, observed)
    observed, survived = survival_events(records)
    survival, survival_n = _rates(survived, observed)
    return AcceptanceStats(
        rounds=rounds,
        committed=committed,
        tau=committed / rounds,
        mean_verified=float(np.mean(records.verified_n)),
        conditional=conditional,
        conditional_n=conditional_n,
        survival=survival,
        survival_n=survival_n,
    )
