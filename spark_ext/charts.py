"""PNG charts of an audit (matplotlib, headless): the redelivery gap distribution, duplicates
per queue over time, and the what-if windows. They are drawn from the small aggregates the audit
already collected, never from the events."""

from __future__ import annotations

import datetime
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from taskonce.spark_ext.semantics import GAP_BUCKETS, human_duration

if TYPE_CHECKING:
    from taskonce.spark_ext.audit import AuditResult

logger = logging.getLogger("taskonce.spark_ext")


#: Legends sit outside the axes so they never cover a bar: right of a chart that is alone in
#: its figure, below one that shares its figure with another (the gaps chart).
_LEGEND_RIGHT: dict[str, Any] = {"fontsize": 8, "loc": "upper left", "bbox_to_anchor": (1.01, 1.0)}
_LEGEND_BELOW: dict[str, Any] = {
    "fontsize": 8,
    "loc": "upper center",
    "bbox_to_anchor": (0.5, -0.2),
}


def draw_charts(result: AuditResult, folder: Path) -> dict[str, Path]:
    """Draw the charts into ``folder``; returns title → PNG path (in display order)."""
    folder.mkdir(parents=True, exist_ok=True)
    charts: dict[str, Path] = {}
    charts["Redelivery gap distribution"] = _save(gaps_figure(result), folder / "gaps.png")
    charts["Duplicates per queue over time"] = _save(
        timeline_figure(result), folder / "duplicates.png"
    )
    if result.what_if:
        charts["What-if windows"] = _save(what_if_figure(result), folder / "what_if.png")
    return charts


def _save(figure: Figure, path: Path) -> Path:
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def gaps_figure(result: AuditResult) -> Figure:
    """The redelivery gap distribution: a log-scale histogram with the percentile and window
    marks, and the duplicates per gap bucket."""
    overall = result.report["overall"]
    buckets = result.details["overall"]["buckets"]
    figure, (left, right) = plt.subplots(
        1, 2, figsize=(11, 4.5), width_ratios=(3, 2), layout="constrained"
    )
    if result.histogram:
        edges = [10**b for b, _ in result.histogram]
        widths = [10 ** (b + 0.25) - 10**b for b, _ in result.histogram]
        left.bar(
            edges,
            [count for _, count in result.histogram],
            width=widths,
            align="edge",
            color="#4c72b0",
        )
        left.set_xscale("log")
        marks = [
            ("p50", overall["gap_p50_s"], "#55a868"),
            ("p99.9", overall["gap_p999_s"], "#c44e52"),
            ("recommended", float(overall["recommended_keep_for_s"]), "#8172b2"),
        ]
        keep_for = result.details["overall"]["keep_for_in_force_s"]
        if keep_for:
            marks.append(("keep_for", float(keep_for), "#000000"))
        for label, value, colour in marks:
            if value > 0:
                left.axvline(
                    value,
                    color=colour,
                    linestyle="--",
                    linewidth=1,
                    label=f"{label} {human_duration(value)}",
                )
        left.legend(ncols=len(marks), **_LEGEND_BELOW)
        left.yaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        left.text(0.5, 0.5, "no duplicates", ha="center", va="center", transform=left.transAxes)
    left.set_xlabel("gap: duplicate's time − key's first claim or mark (s, log scale)")
    left.set_ylabel("duplicates")
    left.set_title("Redelivery gaps")
    labels = [label for label, _ in GAP_BUCKETS]
    right.bar(labels, [buckets[label] for label in labels], color="#dd8452")
    right.tick_params(axis="x", labelsize=8, labelrotation=30)
    right.yaxis.set_major_locator(MaxNLocator(integer=True))
    right.set_title("By bucket")
    right.set_ylabel("duplicates")
    return figure


def timeline_figure(result: AuditResult) -> Figure:
    """Duplicates per queue over time, stacked bars per time bucket."""
    figure, axes = plt.subplots(figsize=(11, 4), layout="constrained")
    width_s = result.timeline_bucket_s
    starts = sorted({row["bucket_start"] for row in result.timeline})
    if starts:
        first = _parse(starts[0])
        count = int((_parse(starts[-1]) - first).total_seconds() // width_s) + 1
        moments = [first + datetime.timedelta(seconds=i * width_s) for i in range(count)]
        index = {moment: i for i, moment in enumerate(moments)}
        series: dict[str, list[int]] = {}
        for row in result.timeline:
            counts = series.setdefault(str(row["queue"]), [0] * count)
            counts[index[_parse(row["bucket_start"])]] += int(row["duplicates"])
        bottom = [0] * count
        positions = list(range(count))
        for queue, counts in sorted(series.items()):
            axes.bar(positions, counts, width=0.9, bottom=bottom, label=queue)
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
        axes.legend(title="queue", **_LEGEND_RIGHT)
        axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        step = max(1, count // 10)
        axes.set_xticks(positions[::step])
        axes.set_xticklabels(
            [m.strftime("%m-%d %H:%M:%S") for m in moments[::step]], rotation=30, ha="right"
        )
    else:
        axes.text(0.5, 0.5, "no deliveries", ha="center", va="center", transform=axes.transAxes)
    axes.set_ylabel(f"duplicates per {human_duration(float(width_s))}")
    axes.set_title("Duplicates per queue over time (UTC; the largest queues)")
    return figure


def _parse(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ")


def what_if_figure(result: AuditResult) -> Figure:
    """Duplicates each what-if ``keep_for`` would have suppressed and leaked."""
    figure, axes = plt.subplots(figsize=(8, 4), layout="constrained")
    labels = [human_duration(float(row["keep_for_s"])) for row in result.what_if]
    suppressed = [int(row["suppressed"]) for row in result.what_if]
    leaked = [int(row["leaked"]) for row in result.what_if]
    axes.bar(labels, suppressed, color="#55a868", label="suppressed")
    axes.bar(labels, leaked, bottom=suppressed, color="#c44e52", label="leaked")
    axes.set_xlabel("keep_for")
    axes.set_ylabel("duplicates")
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_title("Duplicates suppressed vs leaked per window")
    axes.legend(**_LEGEND_RIGHT)
    return figure
