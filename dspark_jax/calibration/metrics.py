"""Calibration and discrimination metrics for confidence scores (host-side NumPy).

Probabilities and binary labels are 1-D arrays of the same length. Empty inputs, mismatched
shapes, probabilities outside [0, 1] and non-binary labels raise `MetricInputError`.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from dspark_jax.errors import UserError


class MetricInputError(UserError):
    """Raised when a metric receives arrays it cannot score."""


def _as_labels(labels: ArrayLike, n: int, name: str = "labels") -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or y.shape[0] != n:
        raise MetricInputError(f"{name} must be 1-D with {n} entries, got shape {y.shape}")
    if y.dtype != bool and not np.all((y == 0) | (y == 1)):
        raise MetricInputError(f"{name} must be binary (0/1 or bool)")
    return y.astype(np.float64)


def _as_probs(probs: ArrayLike) -> np.ndarray:
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1:
        raise MetricInputError(f"probs must be 1-D, got shape {p.shape}")
    if p.shape[0] == 0:
        raise MetricInputError("probs is empty")
    if not np.all((p >= 0.0) & (p <= 1.0)):
        raise MetricInputError("probs must lie in [0, 1] (and not be NaN)")
    return p


def _bin_index(p: np.ndarray, n_bins: int) -> np.ndarray:
    # p == 1.0 belongs to the last bin, not to an extra one.
    return np.minimum((p * n_bins).astype(np.int64), n_bins - 1)


def ece(probs: ArrayLike, labels: ArrayLike, n_bins: int = 15) -> float:
    """Expected calibration error: equal-width bins on [0, 1], |mean p - mean y| weighted by
    the fraction of samples in each bin."""
    if n_bins < 1:
        raise MetricInputError(f"n_bins must be >= 1, got {n_bins}")
    p = _as_probs(probs)
    y = _as_labels(labels, p.shape[0])
    return float(ece_rows(p[None, :], y, n_bins)[0])


def ece_rows(probs_gn: np.ndarray, labels_n: np.ndarray, n_bins: int = 15) -> np.ndarray:
    """ECE of each row of `probs_gn` (G candidate calibrations of the same N samples) against
    one label vector; the vectorised form used by grid searches. Inputs are not re-validated."""
    g, n = probs_gn.shape
    idx_gn = _bin_index(probs_gn, n_bins) + n_bins * np.arange(g)[:, None]
    # n_b * |mean(p_b) - mean(y_b)| == |sum_{i in b} (p_i - y_i)|, so no per-bin division.
    gap = np.bincount(
        idx_gn.ravel(), weights=(probs_gn - labels_n[None, :]).ravel(), minlength=g * n_bins
    )
    return np.abs(gap.reshape(g, n_bins)).sum(axis=1) / n


def roc_auc(scores: ArrayLike, labels: ArrayLike) -> float:
    """Area under the ROC curve via the Mann-Whitney statistic (tied scores get average ranks).

    Returns NaN when only one class is present (AUC is undefined there)."""
    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or s.shape[0] == 0:
        raise MetricInputError(f"scores must be a non-empty 1-D array, got shape {s.shape}")
    if np.any(np.isnan(s)):
        raise MetricInputError("scores contain NaN")
    y = _as_labels(labels, s.shape[0]) > 0.5
    n_pos = int(y.sum())
    n_neg = y.shape[0] - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    # 1-based rank of a group of equal scores = mean of the positions it occupies.
    last_rank = np.cumsum(counts)
    avg_rank = last_rank - (counts - 1) / 2.0
    rank_sum_pos = float(avg_rank[inverse][y].sum())
    return (rank_sum_pos - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def brier(probs: ArrayLike, labels: ArrayLike) -> float:
    """Mean squared error between probabilities and binary outcomes."""
    p = _as_probs(probs)
    y = _as_labels(labels, p.shape[0])
    return float(np.mean((p - y) ** 2))


def reliability_curve(
    probs: ArrayLike, labels: ArrayLike, n_bins: int = 15
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per non-empty bin: (mean predicted probability, empirical frequency, count)."""
    p = _as_probs(probs)
    y = _as_labels(labels, p.shape[0])
    idx = _bin_index(p, n_bins)
    count = np.bincount(idx, minlength=n_bins)
    sum_p = np.bincount(idx, weights=p, minlength=n_bins)
    sum_y = np.bincount(idx, weights=y, minlength=n_bins)
    keep = count > 0
    return sum_p[keep] / count[keep], sum_y[keep] / count[keep], count[keep]
