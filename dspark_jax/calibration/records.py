"""Calibration records from decoding results: one record per verification round."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np

from dspark_jax.calibration.sts import CalibrationInputError, CalibrationRecords


class RoundStats(Protocol):
    """Per-round statistics of one request (what `generate` returns in each `Result`)."""

    conf_logits: np.ndarray  # [rounds, gamma] raw confidence logits (before STS)
    verified: np.ndarray  # [rounds] drafts sent to the target
    accepted: np.ndarray  # [rounds] drafts accepted by rejection sampling


def records_from_results(
    results: Iterable[RoundStats],
    *,
    drafter_fingerprint: str | None = None,
    sampling_temperature: float | None = None,
) -> CalibrationRecords:
    """Stacks every round of every result into `CalibrationRecords`, stamped with the drafter
    and sampling temperature that produced them (for `calibrate` to check).

    A round with l verified and n accepted drafts observes "draft k accepted given drafts
    1..k-1 accepted" for k = 1..min(n + 1, l): accepted for k <= n, rejected at k = n + 1 <= l
    (`sts.conditional_events`), and prefix survival "n >= k" for k <= l. The verified lengths
    must have been chosen without looking at the outcomes (true of every lossless policy)."""
    results = list(results)
    rows = [r for r in results if len(r.verified)]
    if not rows:
        raise CalibrationInputError(
            f"no verification rounds in {len(results)} results (plain decoding records nothing)"
        )
    return CalibrationRecords(
        np.concatenate([np.asarray(r.conf_logits) for r in rows]),
        np.concatenate([np.asarray(r.verified) for r in rows]),
        np.concatenate([np.asarray(r.accepted) for r in rows]),
        drafter_fingerprint=drafter_fingerprint,
        sampling_temperature=sampling_temperature,
    )
