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
from dspark_jax.cli import SPS_AUTO

if TYPE_CHECKING:
    from dspark_jax.decoding.batching import LoopTiming, Result
    from dspark_jax.decoding.evaluate import DatasetReport
    from dspark_jax.decoding.policies import SpsProfile
    from dspark_jax.decoding.stats import AcceptanceStats


# Points (bins, positions) resting on fewer observations than this are drawn hollow.
THIN_POINT = 10


def _cell(value: float | None, spec: str, missing: str = "-") -> str:
    """A table cell: `missing` for a value that is missing (None) or unseen (NaN)."""
    return missing if value is None or math.isnan(value) else format(value, spec)


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
        f"{_cell(timing.decode_rate, '.1f', 'n/a')} decode tokens/s",
    ]
    cached = sum(r.cached_tokens for r in results)
    if cached:
        prompt = sum(r.prompt_len for r in results)
        lines.append(f"prefix cache: {cached} of {prompt} prompt tokens reused, not prefilled")
    if stats is None:
        lines.append("plain decoding: tau 1 (one token per target step)")
        return lines
    if stats.rounds == 0:
        lines.append(
            "tau n/a: no speculative rounds (every answer ended with the token from its prompt)"
        )
        return lines
    lines.append(
        f"tau {stats.tau:.3f} tokens per round (bonus included), "
        f"{stats.mean_verified:.2f} drafts verified per round"
    )
    cells = " ".join(f"{k}:{_cell(v, '.2f')}" for k, v in enumerate(stats.conditional, 1))
    lines.append(f"conditional acceptance by draft position  {cells}")
    return lines


# -- eval --------------------------------------------------------------------------------------
def scheduler_note(policy: str, sps_table: str | None, stats) -> str | None:
    """A note when a scheduling policy verified no drafts at all: correct under its SPS table
    (no verification worth its cost at this slot count), but it reads like a broken drafter
    (tau 1.000) unless said."""
    if policy not in ("scheduler", "async-scheduler") or not stats or stats.mean_verified != 0:
        return None
    table = "the table profiled here" if sps_table == SPS_AUTO else f"SPS table {sps_table}"
    return (
        f"note: the {policy} verified no drafts: under {table} no verification is worth its "
        "cost at this slot count, so this run decoded plainly; profile the device you decode on "
        "with the --max-num-seqs you run"
    )


def speedup_note(reports: Sequence[DatasetReport]) -> str | None:
    """One line when speculation lost somewhere (speedup < 1): where, and the usual reason."""
    slower = [r for r in reports if r.speedup is not None and r.speedup < 1]
    if not slower:
        return None
    worst = min(slower, key=lambda r: r.speedup)
    names = ", ".join(r.name for r in slower)
    return (
        f"note: speculation was slower than plain decoding on {names} (down to "
        f"{worst.speedup:.2f}x at tau {_cell(worst.stats.tau, '.2f', 'n/a')}): a round costs a "
        "drafter pass plus a verification of every drafted token, which pays only where a target "
        "step is memory-bound (accelerators at small batch) and tau is high; on a CPU, or with a "
        "drafter close to the target's size, it does not"
    )


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
        # "-" where nothing was measured (no plain run, no decode round: every turn skipped)
        plain = r.plain_timing.decode_rate if r.plain_timing else None
        lines.append(
            f"{r.name:<{width}} {r.conversations:>5} {r.turns:>5} {r.stats.rounds:>7} "
            f"{_cell(r.stats.tau, '.3f'):>6} {_cell(r.spec_timing.decode_rate, '.1f'):>10} "
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


def _series_styles(n: int) -> list[dict]:
    """Distinct (colour, marker) pairs for n series: tab10 up to 10, then tab20, and the marker
    changes too so that no two series look alike even in print."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    markers = "osD^v<>ph*"
    return [
        {"color": cmap(i % cmap.N), "marker": markers[(i // 2 if n > 10 else i) % len(markers)]}
        for i in range(n)
    ]


def plot_reports(reports: Sequence[DatasetReport], path: str | Path) -> None:
    """PNG: conditional acceptance per position for each dataset (points resting on fewer than
    THIN_POINT observations hollow and labelled with their count), tau per dataset and decode
    speedup per dataset, each on its own axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, taus, speedups) = plt.subplots(
        1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [1.4, 1, 1]}
    )
    styles = _series_styles(len(reports))
    thin_seen = False
    for r, style in zip(reports, styles, strict=True):
        values = np.asarray(r.stats.conditional, float)
        counts = np.asarray(r.stats.conditional_n)
        positions = np.arange(1, len(values) + 1)
        curves.plot(positions, values, linestyle="-", label=r.name, **style)
        thin = (counts > 0) & (counts < THIN_POINT)
        if thin.any():
            thin_seen = True
            curves.scatter(
                positions[thin],
                values[thin],
                s=90,
                facecolors="white",
                edgecolors=[style["color"]],
                marker=style["marker"],
                zorder=3,
            )
            for x, y, n in zip(positions[thin], values[thin], counts[thin], strict=True):
                curves.annotate(
                    f"n={n}",
                    (x, y),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=6,
                    color=style["color"],
                )
    curves.set_xlabel("draft position k")
    curves.set_ylabel("P(accept k | 1..k-1 accepted)")
    curves.set_ylim(0, 1.05)
    title = "Conditional acceptance"
    if thin_seen:
        title += f" (hollow: fewer than {THIN_POINT} rounds)"
    curves.set_title(title)
    curves.grid(alpha=0.3)
    curves.legend(fontsize="small", ncol=2 if len(reports) > 6 else 1)

    x = np.arange(len(reports))
    names = [r.name for r in reports]
    colors = [s["color"] for s in styles]
    taus.bar(x, [r.stats.tau for r in reports], color=colors)
    taus.set_xticks(x, names, rotation=30, ha="right")
    taus.set_ylabel("tokens per round (bonus included)")
    taus.set_title("Acceptance length tau")
    taus.grid(alpha=0.3, axis="y")

    speedup = [r.speedup if r.speedup is not None else np.nan for r in reports]
    speedups.bar(x, speedup, color=colors)
    speedups.axhline(1.0, color="0.3", linestyle="--", linewidth=1)
    speedups.set_xticks(x, names, rotation=30, ha="right")
    speedups.set_ylabel("speculative / plain decode tokens/s")
    speedups.set_title("Decode speedup (dashed: break-even)")
    speedups.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- calibrate ---------------------------------------------------------------------------------
def format_report(part: dict, title: str) -> str:
    """A per-position table of `sts.position_metrics` output, with survival-weighted means.

    `n` counts observed outcomes (`surv` of them survived), `*` marks positions with fewer than
    THIN_OBSERVATIONS; an AUC is "-" unless each outcome has MIN_AUC_CLASS observations."""
    from dspark_jax.calibration.sts import MIN_AUC_CLASS, THIN_OBSERVATIONS

    lines = [
        title,
        f"{'pos':>3} {'n':>8} {'survived':>8} {'rate':>6} {'ECE raw':>8} {'ECE STS':>8} "
        f"{'AUC raw':>8} {'AUC STS':>8} {'Brier raw':>9} {'Brier STS':>9} {'cond n':>7} "
        f"{'cond AUC':>8}",
    ]
    thin = False
    for k, n in enumerate(part["n_survival"]):
        mark = "*" if n < THIN_OBSERVATIONS else " "
        thin = thin or n < THIN_OBSERVATIONS
        survived = part.get("n_survived", [None] * len(part["n_survival"]))[k]
        lines.append(
            f"{k + 1:>3} {n:>7}{mark} {_cell(survived, 'd'):>8} "
            f"{_cell(part['survival_rate'][k], '.3f'):>6} "
            f"{_cell(part['ece_before'][k], '.4f'):>8} {_cell(part['ece_after'][k], '.4f'):>8} "
            f"{_cell(part['auc_before'][k], '.3f'):>8} {_cell(part['auc_after'][k], '.3f'):>8} "
            f"{_cell(part['brier_before'][k], '.4f'):>9} {_cell(part['brier_after'][k], '.4f'):>9} "
            f"{part['n_conditional'][k]:>7} {_cell(part['conditional_auc'][k], '.3f'):>8}"
        )
    means = mean_ece(part)
    lines.append(f"mean ECE over positions: raw {means[0]:.4f} -> STS {means[1]:.4f}")
    note = f"AUC '-': fewer than {MIN_AUC_CLASS} observations of one outcome"
    if thin:
        note += f"; *: fewer than {THIN_OBSERVATIONS} observations (thin)"
    lines.append(note)
    return "\n".join(lines)


def mean_ece(part: dict) -> tuple[float, float]:
    """(raw, STS) ECE averaged over positions with observations, as the paper reports it."""
    pairs = [
        (b, a) for b, a in zip(part["ece_before"], part["ece_after"], strict=True) if b is not None
    ]
    if not pairs:
        return float("nan"), float("nan")
    return sum(b for b, _ in pairs) / len(pairs), sum(a for _, a in pairs) / len(pairs)


def calibration_warnings(temperatures: Sequence[float], report: Mapping) -> list[str]:
    """What the fitted temperatures and metrics of `sts.fit_and_report` cannot carry."""
    from dspark_jax.calibration.sts import MIN_AUC_CLASS, THIN_OBSERVATIONS

    lines = []
    low, high = report.get("grid_bounds", (None, None))
    for k in report.get("pinned", []):
        t = temperatures[k - 1]
        bound = "upper" if high is not None and math.isclose(t, high) else "lower"
        lines.append(
            f"position {k}: temperature {t:g} is pinned at the {bound} end of the search grid "
            f"[{low:g}, {high:g}]; the best fit lies at or beyond it (its confidences carry "
            "little information about the outcome, or the outcomes are nearly all the same)"
        )
    for split, key in (("fit", "fit"), ("held-out", "holdout")):
        part = report[key]
        for k, n in enumerate(part["n_survival"], 1):
            if n == 0:
                lines.append(f"{split} split, position {k}: no observations (temperature stays 1)")
            elif n < THIN_OBSERVATIONS:
                lines.append(
                    f"{split} split, position {k}: only {n} observations; its temperature and "
                    "metrics rest on too little data to trust"
                )
        withheld = [
            k
            for k, (auc, n) in enumerate(zip(part["auc_after"], part["n_survival"], strict=True), 1)
            if auc is None and n > 0
        ]
        if withheld:
            lines.append(
                f"{split} split: no AUC at position(s) {', '.join(map(str, withheld))} (fewer "
                f"than {MIN_AUC_CLASS} survived or failed blocks)"
            )
    return lines


def log_counts(ax) -> None:
    """A log scale for an axis of counts, labelled at powers of ten only: over less than two
    decades matplotlib labels the minor ticks too (6x10^1, 4x10^1, 3x10^1 ...), and on a
    histogram strip a few hundred pixels tall those labels overlap."""
    from matplotlib.ticker import LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10))
    ax.yaxis.set_minor_formatter(NullFormatter())


def reliability_diagram(
    per_position: Sequence[Mapping[str, tuple[ArrayLike, ArrayLike]]],
    path: str | Path,
    n_bins: int = 15,
    title: str | None = None,
) -> Path:
    """Write a PNG with one reliability panel per draft position, over a histogram of the
    predicted values.

    `per_position[k]` maps a series name (e.g. "raw", "STS") to `(probs, labels)` for position
    k + 1. Each series is a curve with its ECE and sample count in the legend; every bin's point
    is labelled with its count and drawn hollow when it holds fewer than THIN_POINT samples. The
    histogram under each panel shows how many predictions fall in each bin (log scale). A
    position with fewer than THIN_OBSERVATIONS samples is titled so and drawn grey. Series with
    no samples are listed in the legend as empty."""
    if len(per_position) == 0:
        raise metrics.MetricInputError("per_position is empty")
    # A bare Figure renders through Agg without touching pyplot's global backend.
    from matplotlib.figure import Figure

    from dspark_jax.calibration.sts import THIN_OBSERVATIONS

    n_panels = len(per_position)
    n_cols = min(n_panels, 4)
    n_rows = math.ceil(n_panels / n_cols)
    fig = Figure(figsize=(3.8 * n_cols, 4.6 * n_rows), layout="constrained")
    grid = fig.add_gridspec(2 * n_rows, n_cols, height_ratios=[3, 1] * n_rows)
    edges = np.linspace(0, 1, n_bins + 1)
    colors = {"raw": "tab:red", "STS": "tab:blue"}
    for k, series in enumerate(per_position):
        row, col = divmod(k, n_cols)
        ax = fig.add_subplot(grid[2 * row, col])
        hist = fig.add_subplot(grid[2 * row + 1, col], sharex=ax)
        ax.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1)
        n_max = max(np.asarray(p).size for p, _ in series.values())
        thin = n_max < THIN_OBSERVATIONS
        hist_max = 0
        for i, (name, (probs, labels)) in enumerate(series.items()):
            color = "0.55" if thin else colors.get(name, f"C{i}")
            n = np.asarray(probs).size
            if n == 0:
                ax.plot([], [], marker="o", color=color, label=f"{name} (no samples)")
                continue
            mean_p, freq, count = metrics.reliability_curve(probs, labels, n_bins)
            err = metrics.ece(probs, labels, n_bins)
            ax.plot(
                mean_p, freq, color=color, linewidth=1, label=f"{name} ECE {100 * err:.2f}% (n={n})"
            )
            solid = count >= THIN_POINT
            ax.scatter(mean_p[solid], freq[solid], s=14, color=color, zorder=3)
            ax.scatter(
                mean_p[~solid], freq[~solid], s=22, facecolors="white", edgecolors=[color], zorder=3
            )
            for x, y, c in zip(mean_p, freq, count, strict=True):
                ax.annotate(
                    str(c),
                    (x, y),
                    textcoords="offset points",
                    xytext=(3, -8),
                    fontsize=5,
                    color=color,
                )
            hist.hist(np.asarray(probs, float), bins=edges, histtype="step", color=color)
            hist_max = max(hist_max, int(count.max()))
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.05)
        label = f"position {k + 1}"
        if thin:
            label += f" (n={n_max}: too few to judge)"
        ax.set_title(label, color="tab:red" if thin else "black", fontsize=9)
        ax.set_ylabel("empirical survival")
        ax.legend(loc="upper left", fontsize=6)
        ax.tick_params(labelbottom=False)
        if hist_max > 50:  # counts spanning decades: a log scale keeps the thin bins visible
            log_counts(hist)
        hist.set_xlabel("predicted survival")
        hist.set_ylabel("count", fontsize=7)
    if title:
        fig.suptitle(f"{title} (bin labels: samples per bin; hollow: fewer than {THIN_POINT})")
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
    slots = f"{slots} slot{'' if slots == 1 else 's'}"
    fig.suptitle(f"{meta.get('mode', '')} SPS, {slots}, {where}", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
