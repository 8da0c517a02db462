"""All presentation of the command line: tables, plots and printed summaries.

The library computes (statistics, reports, metrics, SPS tables); this module turns them into text
for a terminal and PNG figures, for the commands and the benchmarks. matplotlib is imported only
when a figure is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from dspark_jax.calibration import metrics

if TYPE_CHECKING:
    from dspark_jax.decoding.batching import LoopTiming, Result
    from dspark_jax.decoding.evaluate import DatasetReport
    from dspark_jax.decoding.policies import SpsProfile
    from dspark_jax.decoding.stats import AcceptanceStats


def _cell(value: float | None, spec: str) -> str:
    """A table cell: "-" for a value that is missing (None) or unseen (NaN)."""
    return "-" if value is None or math.isnan(value) else format(value, spec)


# -- generate ----------------------------------------------------------------------------------
def print_answer(label: str, prompt: str, text: str) -> None:
    """One finished answer under a header naming its prompt (shortened to one line)."""
    preview = prompt if len(prompt) <= 70 else prompt[:67] + "..."
    print(f"=== {label}: {preview!r}")
    print(text)


def generation_summary(
    results: Sequence[Result],
    timing: LoopTiming,
    stats: AcceptanceStats | None,
    compile_s: float | None = None,
) -> list[str]:
    """Lines of the summary after a generation: volume, speed, and acceptance when speculative.

    Compilation (the engine's warm-up) is reported apart from prefill and decode."""
    tokens = sum(len(r.tokens) for r in results)
    compiled = "" if compile_s is None else f"compile {compile_s:.2f} s (once), "
    lines = [
        f"requests {len(results)}, generated {tokens} tokens ({timing.decoded_tokens} in decode "
        f"rounds), {sum(r.rounds for r in results)} request rounds, {timing.rounds} device rounds",
        f"{compiled}prefill {timing.prefill_s:.3f} s, decode {timing.decode_s:.3f} s: "
        f"{timing.decode_tokens_per_s:.1f} decode tokens/s",
    ]
    if stats is None:
        lines.append("plain decoding: tau 1 (one token per target step)")
        return lines
    lines.append(
        f"tau {stats.tau:.3f} tokens per round (bonus included), "
        f"{stats.mean_verified:.2f} drafts verified per round"
    )
    cells = " ".join(f"{k}:{_cell(v, '.2f')}" for k, v in enumerate(stats.conditional, 1))
    lines.append(f"conditional acceptance by draft position  {cells}")
    return lines


# -- eval --------------------------------------------------------------------------------------
def format_table(reports: Sequence[DatasetReport]) -> str:
    """A fixed-width table: one row per dataset, then per-position acceptance and survival."""
    if not reports:
        return "(no datasets)"
    gamma = len(reports[0].stats.conditional)
    width = max(8, *(len(r.name) for r in reports))
    head = (
        f"{'dataset':<{width}} {'convs':>5} {'turns':>5} {'rounds':>7} {'tau':>6} "
        f"{'spec tok/s':>10} {'plain tok/s':>11} {'speedup':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in reports:
        plain = r.plain_timing.decode_tokens_per_s if r.plain_timing else None
        lines.append(
            f"{r.name:<{width}} {r.conversations:>5} {r.turns:>5} {r.stats.rounds:>7} "
            f"{_cell(r.stats.tau, '.3f'):>6} {_cell(r.spec_timing.decode_tokens_per_s, '.1f'):>10} "
            f"{_cell(plain, '.1f'):>11} {_cell(r.speedup, '.2f'):>7}"
        )
    for title, field in (
        ("conditional acceptance by draft position", "conditional"),
        ("prefix survival by draft position", "survival"),
    ):
        lines += ["", title]
        lines.append(f"{'dataset':<{width}} " + " ".join(f"{k:>5}" for k in range(1, gamma + 1)))
        for r in reports:
            values = getattr(r.stats, field)
            lines.append(f"{r.name:<{width}} " + " ".join(f"{_cell(v, '.3f'):>5}" for v in values))
    return "\n".join(lines)


def plot_reports(reports: Sequence[DatasetReport], path: str | Path) -> None:
    """PNG: conditional acceptance per position for each dataset, and tau / speedup bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in reports:
        positions = np.arange(1, len(r.stats.conditional) + 1)
        curves.plot(positions, r.stats.conditional, marker="o", label=r.name)
    curves.set_xlabel("draft position k")
    curves.set_ylabel("P(accept k | 1..k-1 accepted)")
    curves.set_ylim(0, 1.02)
    curves.set_title("Conditional acceptance")
    curves.grid(alpha=0.3)
    curves.legend(fontsize="small")

    x = np.arange(len(reports))
    taus = [r.stats.tau for r in reports]
    speedups = [r.speedup if r.speedup is not None else np.nan for r in reports]
    bars.bar(x - 0.2, taus, 0.4, label="tau (tokens / round)")
    bars.bar(x + 0.2, speedups, 0.4, label="speedup (spec / plain tok/s)")
    bars.set_xticks(x, [r.name for r in reports], rotation=30, ha="right")
    bars.set_title("Acceptance length and decode speedup")
    bars.grid(alpha=0.3, axis="y")
    bars.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- calibrate ---------------------------------------------------------------------------------
def format_report(part: dict, title: str) -> str:
    """A per-position table of `sts.position_metrics` output, with survival-weighted means."""
    lines = [
        title,
        f"{'pos':>3} {'n':>7} {'surv':>6} {'ECE raw':>8} {'ECE STS':>8} {'AUC raw':>8} "
        f"{'AUC STS':>8} {'Brier raw':>9} {'Brier STS':>9} {'cond AUC':>8}",
    ]
    for k, n in enumerate(part["n_survival"]):
        lines.append(
            f"{k + 1:>3} {n:>7} {_cell(part['survival_rate'][k], '.3f'):>6} "
            f"{_cell(part['ece_before'][k], '.4f'):>8} {_cell(part['ece_after'][k], '.4f'):>8} "
            f"{_cell(part['auc_before'][k], '.3f'):>8} {_cell(part['auc_after'][k], '.3f'):>8} "
            f"{_cell(part['brier_before'][k], '.4f'):>9} {_cell(part['brier_after'][k], '.4f'):>9} "
            f"{_cell(part['conditional_auc'][k], '.3f'):>8}"
        )
    means = mean_ece(part)
    lines.append(f"mean ECE over positions: raw {means[0]:.4f} -> STS {means[1]:.4f}")
    return "\n".join(lines)


def mean_ece(part: dict) -> tuple[float, float]:
    """(raw, STS) ECE averaged over positions with observations, as the paper reports it."""
    pairs = [
        (b, a) for b, a in zip(part["ece_before"], part["ece_after"], strict=True) if b is not None
    ]
    if not pairs:
        return float("nan"), float("nan")
    return sum(b for b, _ in pairs) / len(pairs), sum(a for _, a in pairs) / len(pairs)


def reliability_diagram(
    per_position: Sequence[Mapping[str, tuple[ArrayLike, ArrayLike]]],
    path: str | Path,
    n_bins: int = 15,
    title: str | None = None,
) -> Path:
    """Write a PNG with one reliability panel per draft position.

    `per_position[k]` maps a series name (e.g. "raw", "STS") to `(probs, labels)` for position
    k + 1; each series is drawn as a curve with its ECE and sample count in the legend. Series
    with no samples are listed in the legend as empty."""
    if len(per_position) == 0:
        raise metrics.MetricInputError("per_position is empty")
    # A bare Figure renders through Agg without touching pyplot's global backend.
    from matplotlib.figure import Figure

    n_panels = len(per_position)
    n_cols = min(n_panels, 4)
    n_rows = math.ceil(n_panels / n_cols)
    fig = Figure(figsize=(3.6 * n_cols, 3.6 * n_rows))
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    for k, series in enumerate(per_position):
        ax = axes[k // n_cols][k % n_cols]
        ax.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1)
        for name, (probs, labels) in series.items():
            if np.asarray(probs).size == 0:
                ax.plot([], [], marker="o", label=f"{name} (no samples)")
                continue
            mean_p, freq, _ = metrics.reliability_curve(probs, labels, n_bins)
            err = metrics.ece(probs, labels, n_bins)
            ax.plot(
                mean_p,
                freq,
                marker="o",
                markersize=3,
                label=f"{name} ECE {100 * err:.2f}% (n={np.asarray(probs).size})",
            )
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"position {k + 1}")
        ax.set_xlabel("predicted survival")
        ax.set_ylabel("empirical survival")
        ax.legend(loc="upper left", fontsize=7)
    for k in range(n_panels, n_rows * n_cols):
        axes[k // n_cols][k % n_cols].set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


# -- profile -----------------------------------------------------------------------------------
def plot_profile(profile: SpsProfile, path: str | Path) -> None:
    """PNG: steps/s and verified tokens/s against the total verified tokens of a step, with a
    mark where the table is not monotonic (a bigger step measured faster: noise or padding)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    ax_sps, ax_tok = fig.subplots(1, 2)
    tokens = np.asarray(profile.buckets)
    ax_sps.plot(tokens, profile.sps, marker="o")
    ax_tok.plot(tokens, tokens * profile.sps, marker="o")
    rising = np.flatnonzero(np.diff(profile.sps) > 0) + 1
    if rising.size:
        ax_sps.scatter(
            tokens[rising], profile.sps[rising], color="red", zorder=3, label="faster than smaller"
        )
        ax_sps.legend(fontsize=7)
    for ax, label in ((ax_sps, "steps / s"), (ax_tok, "verified tokens / s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("verified tokens per step (token bucket, anchors included)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    meta = profile.meta
    where = f"{meta.get('device', '?')}, {str(meta.get('date', ''))[:10]}"
    slots = meta.get("num_slots", "?")
    fig.suptitle(f"{meta.get('mode', '')} SPS, {slots} slots, {where}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
