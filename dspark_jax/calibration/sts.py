"""Sequential Temperature Scaling (STS) of the confidence head (paper Section 3.2.1).

Each record is one drafted block: confidence logits z_1..z_gamma, the verified length l
(0..gamma draft tokens sent to the target) and the accepted count n (0..l). Two events are read
off a record:

- prefix survival at position k: "n >= k", observed only when k <= l (a token that was not
  verified has no outcome). The scheduler consumes a_k = prod_{i<=k} c_i as the probability of
  this event, so STS calibrates a_k against it.
- conditional acceptance at k: "n >= k" given "n >= k-1", observed when n >= k-1 and l >= k.
  This is what a single c_k models; its ranking (AUC) is what temperature scaling preserves.

Records from a scheduled run are usable only if the verified length was chosen without looking
at the outcomes (true of Algorithm 1 with early stop, fixed lengths, or thresholds); verifying the
full block (l = gamma) gives the most observations per position.

`fit_sts` chooses T_1..T_gamma left to right, each by a 1-D grid search minimising the ECE of
a_k = prod_{i<=k} sigmoid(z_i / T_i) with T_1..T_{k-1} already fixed. `calibrate` splits by
block, fits and reports metrics in a `StsArtifact` that is tied to one drafter checkpoint and one
sampling temperature (`StsArtifact.check`); `StsArtifact.calibrated_logits` is the jittable
runtime side the engine applies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.calibration import metrics
from dspark_jax.errors import UserError, as_integer, is_real

ARTIFACT_FORMAT = "dspark-jax/sts/v1"
_ARTIFACT_FIELDS = (
    "temperatures",
    "gamma",
    "drafter_fingerprint",
    "sampling_temperature",
    "n_records",
    "metrics",
)


# AUC is reported only when each outcome (event and non-event) has at least this many
# observations: with two positives an AUC of 1.0 says nothing.
MIN_AUC_CLASS = 10
# Fewer observations than this at a position make its temperature and metrics thin: said in
# warnings and drawn apart in plots.
THIN_OBSERVATIONS = 30


def default_grid() -> np.ndarray:
    """241 log-spaced temperatures on [0.05, 20]; the middle point is exactly T = 1."""
    return np.geomspace(0.05, 20.0, 241)


class CalibrationInputError(UserError):
    """Raised for malformed calibration records or fitting arguments."""


class StsArtifactMismatchError(UserError):
    """Raised when an STS artifact belongs to another drafter or sampling temperature."""


RECORDS_NAME = "calibration_records.npz"  # what dspark-jax eval writes
_RECORD_ARRAYS = ("conf_logits_nk", "verified_n", "accepted_n")


@dataclasses.dataclass(frozen=True)
class CalibrationRecords:
    """Per-block confidence logits [N, gamma], verified lengths [N] and accepted counts [N].

    `drafter_fingerprint` and `sampling_temperature` say where the rounds came from (None when
    unknown: records written before eval recorded them, or built by hand); `calibrate` checks
    them against the drafter and temperature it is given."""

    conf_logits_nk: np.ndarray
    verified_n: np.ndarray
    accepted_n: np.ndarray
    drafter_fingerprint: str | None = None
    sampling_temperature: float | None = None

    def __post_init__(self) -> None:
        z = np.asarray(self.conf_logits_nk, dtype=np.float64)
        l_n = np.asarray(self.verified_n)
        n_n = np.asarray(self.accepted_n)
        if z.ndim != 2 or z.shape[1] < 1:
            raise CalibrationInputError(f"conf_logits_nk must be [N, gamma], got {z.shape}")
        if l_n.shape != (z.shape[0],) or n_n.shape != (z.shape[0],):
            raise CalibrationInputError(
                f"verified_n {l_n.shape} and accepted_n {n_n.shape} must be [{z.shape[0]}]"
            )
        for name, arr in (("verified_n", l_n), ("accepted_n", n_n)):
            if arr.size and not np.all(arr == np.round(arr)):
                raise CalibrationInputError(f"{name} must hold integers")
        l_n = l_n.astype(np.int32)
        n_n = n_n.astype(np.int32)
        if not np.all(np.isfinite(z)):
            raise CalibrationInputError("conf_logits_nk contains non-finite values")
        if np.any((l_n < 0) | (l_n > z.shape[1])):
            raise CalibrationInputError(f"verified_n must lie in 0..{z.shape[1]}")
        if np.any((n_n < 0) | (n_n > l_n)):
            raise CalibrationInputError("accepted_n must lie in 0..verified_n")
        temperature = self.sampling_temperature
        if temperature is not None:
            temperature = float(temperature)
            if not (math.isfinite(temperature) and temperature >= 0):
                raise CalibrationInputError(
                    f"sampling_temperature must be finite and >= 0, got {temperature}"
                )
        fingerprint = self.drafter_fingerprint
        if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
            raise CalibrationInputError("drafter_fingerprint must be a non-empty string")
        object.__setattr__(self, "conf_logits_nk", z)
        object.__setattr__(self, "verified_n", l_n)
        object.__setattr__(self, "accepted_n", n_n)
        object.__setattr__(self, "sampling_temperature", temperature)

    @property
    def gamma(self) -> int:
        return int(self.conf_logits_nk.shape[1])

    def __len__(self) -> int:
        return int(self.conf_logits_nk.shape[0])

    def subset(self, index: np.ndarray) -> CalibrationRecords:
        """The records at `index` (integer indices or a boolean mask over blocks)."""
        return dataclasses.replace(
            self,
            conf_logits_nk=self.conf_logits_nk[index],
            verified_n=self.verified_n[index],
            accepted_n=self.accepted_n[index],
        )

    def save(self, path: str | Path) -> None:
        provenance = {
            name: np.asarray(value)
            for name, value in (
                ("drafter_fingerprint", self.drafter_fingerprint),
                ("sampling_temperature", self.sampling_temperature),
            )
            if value is not None
        }
        np.savez(
            path,
            conf_logits_nk=self.conf_logits_nk,
            verified_n=self.verified_n,
            accepted_n=self.accepted_n,
            **provenance,
        )

    @classmethod
    def load(cls, path: str | Path) -> CalibrationRecords:
        not_records = (
            f"{path}: not a calibration records file (expected the {RECORDS_NAME} that "
            "dspark-jax eval writes"
        )
        try:
            # allow_pickle stays off: a records file holds plain arrays, and unpickling runs code.
            data = np.load(path)
        except OSError as e:
            raise CalibrationInputError(f"{path}: cannot read the records ({e})") from e
        except (ValueError, zipfile.BadZipFile):
            raise CalibrationInputError(f"{not_records}; this is neither npz nor npy)") from None
        except EOFError:  # an empty file
            raise CalibrationInputError(f"{not_records}; this file is empty)") from None
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise CalibrationInputError(f"{not_records}; this is one numpy array)")
        with data:
            missing = set(_RECORD_ARRAYS) - set(data.files)
            if missing:
                raise CalibrationInputError(f"{not_records}; it lacks {sorted(missing)})")
            try:
                fingerprint = data["drafter_fingerprint"] if "drafter_fingerprint" in data else None
                temperature = (
                    data["sampling_temperature"] if "sampling_temperature" in data else None
                )
                arrays = [data[name] for name in _RECORD_ARRAYS]
            except ValueError as e:  # an object array, which would need unpickling
                raise CalibrationInputError(f"{not_records}; {e})") from None
            return cls(
                *arrays,
                drafter_fingerprint=None if fingerprint is None else str(fingerprint),
                sampling_temperature=None if temperature is None else float(temperature),
            )

    @classmethod
    def concatenate(cls, parts: Sequence[CalibrationRecords]) -> CalibrationRecords:
        """Stack records from several runs; all must share gamma."""
        if not parts:
            raise CalibrationInputError("nothing to concatenate")
        gammas = {p.gamma for p in parts}
        if len(gammas) != 1:
            raise CalibrationInputError(f"records have different gamma: {sorted(gammas)}")
        fingerprints = {p.drafter_fingerprint for p in parts}
        temperatures = {p.sampling_temperature for p in parts}
        return cls(
            np.concatenate([p.conf_logits_nk for p in parts]),
            np.concatenate([p.verified_n for p in parts]),
            np.concatenate([p.accepted_n for p in parts]),
            # provenance survives only where every part agrees on it
            drafter_fingerprint=fingerprints.pop() if len(fingerprints) == 1 else None,
            sampling_temperature=temperatures.pop() if len(temperatures) == 1 else None,
        )


def check_observed(records: CalibrationRecords, name: str = "the records") -> None:
    """Refuses records in which no round verified a draft: no draft's outcome was observed, so
    no temperature can be fitted, and an artifact of T = 1 everywhere would change nothing."""
    if len(records) and not np.any(records.verified_n):
        raise CalibrationInputError(
            f"none of the {len(records)} rounds of {name} verified a draft (every round verified "
            "0 drafts, as with gamma 0), so no draft was accepted or rejected and there is "
            "nothing to calibrate: record rounds that verify drafts"
        )


def survival_events(records: CalibrationRecords) -> tuple[np.ndarray, np.ndarray]:
    """(observed_nk, survived_nk) for prefix survival "n >= k", k = 1..gamma."""
    k = np.arange(1, records.gamma + 1)[None, :]
    observed = records.verified_n[:, None] >= k
    survived = records.accepted_n[:, None] >= k
    return observed, survived


def conditional_events(records: CalibrationRecords) -> tuple[np.ndarray, np.ndarray]:
    """(observed_nk, accepted_nk) for "accepted at k given k-1 accepted", k = 1..gamma."""
    k = np.arange(1, records.gamma + 1)[None, :]
    observed = (records.accepted_n[:, None] >= k - 1) & (records.verified_n[:, None] >= k)
    accepted = records.accepted_n[:, None] >= k
    return observed, accepted


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # tanh form does not overflow for large |x|.
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def survival_product(conf_logits_nk: np.ndarray, temps: np.ndarray) -> np.ndarray:
    """Host-side a_k = prod_{i<=k} sigmoid(z_i / T_i) in float64."""
    return np.cumprod(_sigmoid(np.asarray(conf_logits_nk, np.float64) / temps[None, :]), axis=1)


def _check_temps(temps: np.ndarray, gamma: int) -> np.ndarray:
    t = np.asarray(temps, dtype=np.float64)
    if t.shape != (gamma,):
        raise CalibrationInputError(f"temperatures must have shape ({gamma},), got {t.shape}")
    if not np.all(np.isfinite(t) & (t > 0)):
        raise CalibrationInputError("temperatures must be finite and positive")
    return t


def fit_sts(
    records: CalibrationRecords, grid: np.ndarray | None = None, n_bins: int = 15
) -> np.ndarray:
    """Per-position temperatures [gamma], fitted left to right by grid search on ECE.

    A position with no observed survival outcome keeps T = 1 (records with none at all are
    refused, see `check_observed`); among equally good grid points the smallest temperature
    wins."""
    grid_g = default_grid() if grid is None else np.asarray(grid, dtype=np.float64)
    if grid_g.ndim != 1 or grid_g.size == 0 or not np.all(np.isfinite(grid_g) & (grid_g > 0)):
        raise CalibrationInputError("grid must be a non-empty 1-D array of positive temperatures")
    if len(records) == 0:
        raise CalibrationInputError("no calibration records")
    check_observed(records, "the fit records")
    if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 1:
        raise CalibrationInputError(f"n_bins must be an int >= 1, got {n_bins!r}")
    observed_nk, survived_nk = survival_events(records)
    temps = np.ones(records.gamma)
    prev_n = np.ones(len(records))
    # Bound the [grid chunk, N] working set to ~8M float64 values.
    chunk = max(1, 8_000_000 // max(1, len(records)))
    for k in range(records.gamma):
        z_k = records.conf_logits_nk[:, k]
        rows = observed_nk[:, k]
        if rows.any():
            labels = survived_nk[rows, k].astype(np.float64)
            errs = np.concatenate(
                [
                    metrics.ece_rows(
                        prev_n[rows][None, :] * _sigmoid(z_k[rows][None, :] / g[:, None]),
                        labels,
                        n_bins,
                    )
                    for g in np.array_split(grid_g, math.ceil(grid_g.size / chunk))
                ]
            )
            temps[k] = grid_g[int(np.argmin(errs))]
        prev_n = prev_n * _sigmoid(z_k / temps[k])
    return temps


def _nan_to_none(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def pinned_positions(temps: np.ndarray, grid: np.ndarray | None = None) -> list[int]:
    """Positions (1-based) whose fitted temperature sits at an end of the grid: the best value
    may lie beyond it, so the fit is a bound, not an optimum."""
    grid_g = default_grid() if grid is None else np.asarray(grid, dtype=np.float64)
    ends = (grid_g.min(), grid_g.max())
    return [
        k + 1 for k, t in enumerate(temps) if any(math.isclose(t, e, rel_tol=1e-9) for e in ends)
    ]


def _auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """ROC AUC, or None with fewer than MIN_AUC_CLASS observations of either outcome."""
    positives = int(np.sum(labels))
    if min(positives, len(labels) - positives) < MIN_AUC_CLASS:
        return None
    return _nan_to_none(metrics.roc_auc(scores, labels))


def position_metrics(
    records: CalibrationRecords, temps: np.ndarray, n_bins: int = 15
) -> dict[str, list[float | None]]:
    """Per-position lists: survival-product ECE / AUC / Brier before (T = 1) and after STS,
    observation counts (`n_survival`, of which `n_survived` survived) and survival rate, and the
    conditional-event AUC of c_k (identical before and after, since temperature scaling
    preserves each position's ranking; `n_conditional` observations, `n_accepted` accepted).
    NaN -> None; an AUC is None unless each outcome has MIN_AUC_CLASS observations."""
    temps = _check_temps(temps, records.gamma)
    observed_nk, survived_nk = survival_events(records)
    cond_obs_nk, cond_acc_nk = conditional_events(records)
    before_nk = survival_product(records.conf_logits_nk, np.ones(records.gamma))
    after_nk = survival_product(records.conf_logits_nk, temps)
    per_rate = (
        "survival_rate",
        "ece_before",
        "ece_after",
        "auc_before",
        "auc_after",
        "brier_before",
        "brier_after",
    )
    keys = ("n_survival", "n_survived", *per_rate, "n_conditional", "n_accepted")
    out: dict[str, list[float | None]] = {key: [] for key in (*keys, "conditional_auc")}
    for k in range(records.gamma):
        rows = observed_nk[:, k]
        y = survived_nk[rows, k]
        out["n_survival"].append(int(rows.sum()))
        out["n_survived"].append(int(y.sum()))
        cond_rows = cond_obs_nk[:, k]
        accepted = cond_acc_nk[cond_rows, k]
        out["n_conditional"].append(int(cond_rows.sum()))
        out["n_accepted"].append(int(accepted.sum()))
        out["conditional_auc"].append(_auc(records.conf_logits_nk[cond_rows, k], accepted))
        if not rows.any():
            for key in per_rate:
                out[key].append(None)
            continue
        out["survival_rate"].append(float(y.mean()))
        for tag, a_nk in (("before", before_nk), ("after", after_nk)):
            p = a_nk[rows, k]
            out[f"ece_{tag}"].append(metrics.ece(p, y, n_bins))
            out[f"auc_{tag}"].append(_auc(p, y))
            out[f"brier_{tag}"].append(metrics.brier(p, y))
    return out


def reliability_series(
    records: CalibrationRecords, temps: np.ndarray
) -> list[dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Per position {"raw": (a_k, survived), "STS": (a_k, survived)} for
    `dspark_jax.cli.report.reliability_diagram`."""
    temps = _check_temps(temps, records.gamma)
    observed_nk, survived_nk = survival_events(records)
    before_nk = survival_product(records.conf_logits_nk, np.ones(records.gamma))
    after_nk = survival_product(records.conf_logits_nk, temps)
    series = []
    for k in range(records.gamma):
        rows = observed_nk[:, k]
        y = survived_nk[rows, k]
        series.append({"raw": (before_nk[rows, k], y), "STS": (after_nk[rows, k], y)})
    return series


# How close a request's sampling temperature must be to the calibration temperature.
STS_TEMP_RTOL = 1e-6


@dataclasses.dataclass(frozen=True)
class StsArtifact:
    """Fitted STS temperatures plus the provenance that decides where they may be used."""

    temperatures: tuple[float, ...]
    drafter_fingerprint: str
    sampling_temperature: float
    n_records: int
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    # The file it was loaded from, named by its refusals (not saved; not part of its identity).
    source: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        # An artifact comes from a file a user may have edited: each field is checked by name.
        if not isinstance(self.temperatures, Sequence) or isinstance(self.temperatures, str):
            raise CalibrationInputError(
                f"temperatures must be a list of numbers, got {self.temperatures!r}"
            )
        if not all(is_real(t) for t in self.temperatures):
            raise CalibrationInputError(
                f"temperatures must be a list of numbers, got {list(self.temperatures)!r}"
            )
        temps = tuple(float(t) for t in self.temperatures)
        if not temps:
            raise CalibrationInputError("an STS artifact needs at least one temperature")
        _check_temps(np.asarray(temps), len(temps))
        if not isinstance(self.drafter_fingerprint, str) or not self.drafter_fingerprint:
            raise CalibrationInputError(
                f"drafter_fingerprint must be a non-empty string, got {self.drafter_fingerprint!r}"
            )
        t = self.sampling_temperature
        if not (is_real(t) and math.isfinite(t) and t >= 0):
            raise CalibrationInputError(f"sampling_temperature must be finite and >= 0, got {t!r}")
        if as_integer(self.n_records) is None or self.n_records < 0:
            raise CalibrationInputError(
                f"n_records must be an integer >= 0, got {self.n_records!r}"
            )
        if not isinstance(self.metrics, dict):
            raise CalibrationInputError(f"metrics must be a dict, got {self.metrics!r}")
        object.__setattr__(self, "temperatures", temps)
        object.__setattr__(self, "sampling_temperature", float(t))
        object.__setattr__(self, "n_records", int(self.n_records))

    @property
    def gamma(self) -> int:
        return len(self.temperatures)

    def temps(self) -> jax.Array:
        """Temperatures as a float32 [gamma] array."""
        return jnp.asarray(self.temperatures, dtype=jnp.float32)

    def calibrated_logits(self, conf_logits: jax.Array) -> jax.Array:
        """z_k / T_k in float32, whose sigmoid is the calibrated c_k; jittable, any leading dims."""
        if conf_logits.shape[-1] != self.gamma:
            raise CalibrationInputError(
                f"conf_logits has {conf_logits.shape[-1]} positions but the artifact has "
                f"{self.gamma} temperatures"
            )
        return conf_logits.astype(jnp.float32) / self.temps()

    def check(
        self,
        drafter_fingerprint: str,
        sampling_temperature: float | None,
        block_size: int | None = None,
    ) -> None:
        """Refuses the artifact for another drafter, sampling temperature or block size (None:
        not checked; an engine serving many temperatures applies it per request instead)."""
        named = "the STS artifact" if self.source is None else f"the STS artifact {self.source}"
        if self.drafter_fingerprint != drafter_fingerprint:
            raise StsArtifactMismatchError(
                f"{named} was calibrated for drafter {self.drafter_fingerprint!r}, not "
                f"for this drafter {drafter_fingerprint!r}; run dspark-jax calibrate for it"
            )
        if block_size is not None and self.gamma != block_size:
            raise StsArtifactMismatchError(
                f"{named} has {self.gamma} temperatures but the drafter's block size is "
                f"{block_size}"
            )
        if sampling_temperature is not None and not self.applies_to(sampling_temperature):
            raise StsArtifactMismatchError(
                f"{named} was calibrated at sampling temperature "
                f"{self.sampling_temperature}, but decoding samples at {sampling_temperature}; "
                "calibrate at this temperature"
            )

    def applies_to(self, sampling_temperature: float) -> bool:
        """Whether requests sampled at `sampling_temperature` may use these temperatures."""
        return math.isclose(
            self.sampling_temperature, sampling_temperature, rel_tol=STS_TEMP_RTOL, abs_tol=1e-9
        )

    def save(self, path: str | Path) -> None:
        body = {
            "format": ARTIFACT_FORMAT,
            "temperatures": list(self.temperatures),
            "gamma": self.gamma,
            "drafter_fingerprint": self.drafter_fingerprint,
            "sampling_temperature": self.sampling_temperature,
            "n_records": self.n_records,
            "metrics": self.metrics,
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(body, indent=2, allow_nan=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StsArtifact:
        """Read an artifact (`check` decides where it may be used)."""
        try:
            body = json.loads(Path(path).read_text())
        except OSError as e:
            raise CalibrationInputError(
                f"{path}: cannot read the STS artifact ({e.strerror})"
            ) from e
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CalibrationInputError(f"{path}: not an STS artifact ({e})") from e
        if not isinstance(body, dict) or body.get("format") != ARTIFACT_FORMAT:
            found = body.get("format") if isinstance(body, dict) else None
            raise CalibrationInputError(f"{path}: format {found!r}, expected {ARTIFACT_FORMAT!r}")
        missing = sorted(set(_ARTIFACT_FIELDS) - set(body))
        if missing:
            raise CalibrationInputError(f"{path}: lacks {missing}")
        if not isinstance(body["temperatures"], list):
            raise CalibrationInputError(
                f"{path}: temperatures must be a list of numbers, got {body['temperatures']!r}"
            )
        if body["gamma"] != len(body["temperatures"]):
            raise CalibrationInputError(
                f"{path}: gamma {body['gamma']} but {len(body['temperatures'])} temperatures"
            )
        try:
            return cls(
                temperatures=body["temperatures"],
                drafter_fingerprint=body["drafter_fingerprint"],
                sampling_temperature=body["sampling_temperature"],
                n_records=body["n_records"],
                metrics=body["metrics"],
                source=str(path),
            )
        except CalibrationInputError as e:
            raise CalibrationInputError(f"{path}: {e}") from None


def split_by_block(
    n_blocks: int, holdout_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic (fit_index, holdout_index) over blocks; both non-empty."""
    if not 0.0 < holdout_fraction < 1.0:
        raise CalibrationInputError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    n_hold = int(round(holdout_fraction * n_blocks))
    if n_hold < 1 or n_hold > n_blocks - 1:
        raise CalibrationInputError(
            f"{n_blocks} blocks cannot be split with holdout_fraction {holdout_fraction}"
        )
    perm = np.random.default_rng(seed).permutation(n_blocks)
    return np.sort(perm[n_hold:]), np.sort(perm[:n_hold])


def calibrate(
    records: CalibrationRecords,
    holdout_fraction: float = 0.3,
    seed: int = 0,
    *,
    drafter_fingerprint: str,
    sampling_temperature: float,
    grid: np.ndarray | None = None,
    n_bins: int = 15,
) -> tuple[StsArtifact, dict[str, Any]]:
    """Split blocks into fit / held-out, fit STS on the fit part, and report per-position
    metrics on both parts. Returns (artifact, metrics); the artifact carries the same metrics."""
    fit_idx, hold_idx = split_by_block(len(records), holdout_fraction, seed)
    artifact, report = fit_and_report(
        records.subset(fit_idx),
        records.subset(hold_idx),
        drafter_fingerprint=drafter_fingerprint,
        sampling_temperature=sampling_temperature,
        grid=grid,
        n_bins=n_bins,
    )
    report.update(holdout_fraction=holdout_fraction, seed=seed)
    return artifact, report


def fit_and_report(
    fit: CalibrationRecords,
    hold: CalibrationRecords,
    *,
    drafter_fingerprint: str,
    sampling_temperature: float,
    grid: np.ndarray | None = None,
    n_bins: int = 15,
) -> tuple[StsArtifact, dict[str, Any]]:
    """Fit STS on `fit` and report per-position metrics on both parts, the positions whose
    temperature is pinned at a grid bound (`pinned`, 1-based) and the minimum class size behind
    an AUC. Returns (artifact, metrics); the artifact carries the same metrics."""
    temps = fit_sts(fit, grid=grid, n_bins=n_bins)
    grid_g = default_grid() if grid is None else np.asarray(grid, dtype=np.float64)
    report = {
        "n_bins": n_bins,
        "grid_bounds": [float(grid_g.min()), float(grid_g.max())],
        "pinned": pinned_positions(temps, grid_g),
        "min_auc_class": MIN_AUC_CLASS,
        "fit": position_metrics(fit, temps, n_bins),
        "holdout": position_metrics(hold, temps, n_bins),
    }
    artifact = StsArtifact(
        temperatures=tuple(temps.tolist()),
        drafter_fingerprint=drafter_fingerprint,
        sampling_temperature=sampling_temperature,
        n_records=len(fit) + len(hold),
        metrics=report,
    )
    return artifact, report
