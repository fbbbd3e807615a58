"""Writing an audit's outputs into one folder: Parquet tables, ``report.json``, ``report.md``,
``report.html`` and PNG charts. Each run replaces what an earlier run wrote there (and only
that: other files in the folder are left alone).
"""

from __future__ import annotations

import base64
import html
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taskonce.spark_ext.semantics import (
    ADVISE,
    GAP_BUCKETS,
    advice_text,
    human_bytes,
    human_duration,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from taskonce.spark_ext.audit import AuditResult

logger = logging.getLogger("taskonce.spark_ext")

#: What a run writes into its folder (removed first, so no output mixes two runs).
OUTPUT_NAMES = ("tables", "charts", "report.json", "report.md", "report.html")
TABLE_NAMES = (
    "metrics",
    "gap_buckets",
    "what_if",
    "duplicates",
    "leaks",
    "stuck_claims",
    "timeline",
)
#: Most rows of a per-queue or per-task table shown in report.md / report.html.
MAX_SCOPE_ROWS = 50


def clear_outputs(out: str | os.PathLike[str]) -> Path:
    """Create ``out`` and remove the outputs of an earlier run from it."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for name in OUTPUT_NAMES:
        target = folder / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
    return folder


def write_outputs(
    spark: SparkSession, result: AuditResult, out: str | os.PathLike[str], charts: bool = True
) -> None:
    """Write every output of ``result`` into ``out``; ``report.json`` is written last (through
    a temporary file and a rename), so a reader never sees a half-written one."""
    from taskonce.spark_ext.tables import start_tables

    folder = clear_outputs(out)
    # the Parquet tables are Spark jobs, written in threads while this one draws the charts
    tables = start_tables(spark, result, folder / "tables")
    images: dict[str, Path] = {}
    try:
        if charts:
            try:
                from taskonce.spark_ext.charts import draw_charts
            except ImportError as exc:  # matplotlib is in the "spark" extra
                logger.warning("no charts: %s (pip install 'taskonce[spark]')", exc)
            else:
                images = draw_charts(result, folder / "charts")
    finally:
        tables.wait()
    (folder / "report.md").write_text(render_markdown(result, images), encoding="utf-8")
    (folder / "report.html").write_text(render_html(result, images), encoding="utf-8")
    partial = folder / "report.json.tmp"
    partial.write_text(json.dumps(result.report, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, folder / "report.json")
    logger.info("audit outputs written to %s", folder)


# -- the readable reports -----------------------------------------------------------------


def _advised(result: AuditResult) -> bool:
    """Whether the overall advice is a window to configure (not a log too short to advise)."""
    advice = result.report.get("advice") or {}
    return bool(advice.get("overall", {}).get("verdict", ADVISE) == ADVISE)


def _verdict(result: AuditResult) -> list[str]:
    overall = result.report["overall"]
    lines: list[str] = []
    problems = result.problems()
    advised = _advised(result)
    if problems:
        lines.append("**Action needed:**")
        lines += [f"- {problem}" for problem in problems]
    elif advised:
        lines.append("**No leaks; every queue's keep_for covers its recommendation.**")
    else:
        lines.append(
            "**No leaks; but this log is too short to advise a keep_for** (see below): its "
            "silence about late duplicates is no evidence that none come."
        )
    advice = result.report["advice"]
    text = advice_text(advice, advice["overall"], overall["recommended_keep_for_s"], markup=True)
    lines.append("")
    if advised:
        basis = []
        if overall["gap_p999_s"] or overall["gap_max_s"]:
            basis.append(
                f"p99.9 redelivery gap {overall['gap_p999_s']:g} s × safety factor "
                f"{result.info['safety_factor']:g}"
            )
        if advice.get("broker_bound_s") is not None:
            basis.append(f"the broker bound {advice['broker_bound_s']:g} s")
        if not basis:
            basis.append("no duplicates and no broker bound: the minimum window")
        sizes = ", ".join(
            f"{human_bytes(size)} in {name}"
            for name, size in result.info["recommended_store_bytes"].items()
        )
        lines.append(
            f"{text}. It is the larger of {' and '.join(basis)}, rounded "
            f"up. At {result.info['keys_per_s']:.3g} new keys/s that holds about "
            f"{result.info['recommended_store_keys']:,} keys ({sizes})."
        )
    else:
        lines.append(text)
    return lines


def _scope_table(
    result: AuditResult, plural: str, columns: Sequence[tuple[str, str]]
) -> tuple[list[str], list[list[str]], int]:
    """Header and rows of a per-queue/per-task table (largest by deliveries first)."""
    scope = plural[:-1]
    entries = sorted(
        result.report[plural].items(), key=lambda item: (-item[1]["deliveries"], item[0])
    )
    rows: list[list[str]] = []
    for name, metrics in entries[:MAX_SCOPE_ROWS]:
        detail = _with_advice(result, plural, name, result.details[f"{scope}:{name}"])
        rows.append([name, *[_cell(field, metrics, detail) for field, _ in columns]])
    return [scope, *[title for _, title in columns]], rows, len(entries)


def _with_advice(
    result: AuditResult, plural: str, name: str, detail: dict[str, Any]
) -> dict[str, Any]:
    """``detail`` with the scope's advice verdict as ``advice`` (for its table cell)."""
    advice = result.report.get("advice") or {}
    scope = advice.get("overall") if plural == "overall" else advice.get(plural, {}).get(name)
    verdict = (scope or {}).get("verdict")
    shown = "—" if verdict is None else ("advise" if verdict == ADVISE else "too short")
    return {**detail, "advice": shown}


def _cell(field: str, metrics: dict[str, Any], detail: dict[str, Any]) -> str:
    if field == "advice":
        return str(detail.get("advice", "—"))
    if field == "duplicate_rate":
        return f"{100 * detail['duplicate_rate']:.2f}%"
    if field == "keep_for_in_force_s" or field.startswith("recovery_"):
        value = detail.get(field)
        return "—" if value is None else f"{value:g}"
    if field in detail and field not in metrics:
        return f"{detail[field]:,}"
    value = metrics[field]
    return f"{value:g}" if isinstance(value, float) else f"{value:,}"


_SUMMARY_COLUMNS = (
    ("deliveries", "deliveries"),
    ("distinct_keys", "keys"),
    ("runs", "runs"),
    ("duplicates_skipped", "dup. skipped"),
    ("duplicates_in_flight", "dup. in flight"),
    ("duplicate_rate", "dup. rate"),
    ("failures", "failures"),
    ("releases", "releases"),
    ("takeovers", "take-overs"),
    ("quarantined", "quarantined"),
    ("leaks", "leaks"),
    ("near_misses", "near misses"),
    ("stuck_claims", "stuck"),
)
#: Takeovers of dead owners: from the owner's last sign of life to the takeover.
_RECOVERY_COLUMNS = (
    ("recovery_p50_s", "take-over recovery p50 s"),
    ("recovery_p95_s", "take-over recovery p95 s"),
    ("recovery_max_s", "take-over recovery max s"),
)
_GAP_COLUMNS = (
    ("gap_p50_s", "p50 s"),
    ("gap_p95_s", "p95 s"),
    ("gap_p99_s", "p99 s"),
    ("gap_p999_s", "p99.9 s"),
    ("gap_max_s", "max s"),
    ("keep_for_in_force_s", "keep_for s"),
    ("recommended_keep_for_s", "recommended s"),
    ("advice", "advice"),
)


#: One table of the readable reports: (title, header, rows, note).
Section = tuple[str, list[str], list[list[str]], str]


def _sections(result: AuditResult) -> list[Section]:
    """(title, header, rows, note) of every table of the readable reports."""
    return [
        *_overall_sections(result),
        *_scope_sections(result),
        *_what_if_sections(result),
        *_sends_sections(result),
        *_sample_sections(result),
    ]


def _overall_sections(result: AuditResult) -> list[Section]:
    """The overall figures and the redelivery gaps' buckets."""
    overall = result.report["overall"]
    detail = _with_advice(result, "overall", "", result.details["overall"])
    sections: list[Section] = []
    sections.append(
        (
            "Overall",
            ["figure", "value"],
            [[title, _cell(field, overall, detail)] for field, title in _SUMMARY_COLUMNS]
            + [[title, _cell(field, overall, detail)] for field, title in _RECOVERY_COLUMNS]
            + [[title, _cell(field, overall, detail)] for field, title in _GAP_COLUMNS],
            "",
        )
    )
    sections.append(
        (
            "Redelivery gaps",
            ["bucket", "duplicates"],
            [[label, f"{detail['buckets'][label]:,}"] for label, _ in GAP_BUCKETS],
            f"Percentiles are {result.info['percentiles']} over {detail['gaps']:,} duplicates "
            "with a known first run.",
        )
    )
    return sections


def _scope_sections(result: AuditResult) -> list[Section]:
    """Per queue and per task: the counts, then the gaps and windows."""
    sections: list[Section] = []
    for plural in ("queues", "tasks"):
        for suffix, columns in (("", _SUMMARY_COLUMNS), (" — gaps and windows", _GAP_COLUMNS)):
            header, rows, total = _scope_table(result, plural, columns)
            note = (
                f"The {MAX_SCOPE_ROWS} largest of {total} by deliveries; all are in "
                "report.json and tables/metrics."
                if total > MAX_SCOPE_ROWS
                else ""
            )
            sections.append((f"Per {plural[:-1]}{suffix}", header, rows, note))
    return sections


def _what_if_sections(result: AuditResult) -> list[Section]:
    """The what-if windows (none without any)."""
    sections: list[Section] = []
    if result.what_if:
        stores = sorted(result.info["bytes_per_key"])
        sections.append(
            (
                "What if keep_for were…",
                ["keep_for", "suppressed", "leaked", "store keys", *stores],
                [
                    [
                        f"{row['keep_for_s']:g} s ({human_duration(float(row['keep_for_s']))})",
                        f"{row['suppressed']:,}",
                        f"{row['leaked']:,}",
                        f"{row['store_keys']:,}",
                        *[human_bytes(row["store_bytes"][name]) for name in stores],
                    ]
                    for row in result.what_if
                ],
                "Each duplicate is judged against its key's first run: suppressed when its gap "
                "is within the window (in-flight duplicates always are), leaked otherwise; "
                "concurrent duplicates leak under any window. Store keys = new keys per second "
                "× window.",
            )
        )
    return sections


def _sends_sections(result: AuditResult) -> list[Section]:
    """The hand-off's and the producer outbox's figures (each only when it has records)."""
    sections: list[Section] = []
    handoff = result.report.get("handoff") or {}
    if handoff.get("records_deferred") or handoff.get("discarded"):
        sections.append(
            (
                "Hand-off (deferred sends)",
                ["figure", "value"],
                [
                    ["records whose sends were deferred", f"{handoff['records_deferred']:,}"],
                    ["published", f"{handoff['records_dispatched']:,}"],
                    ["stranded (unpublished at the log's end)", f"{handoff['stranded']:,}"],
                    ["runs whose sends were discarded", f"{handoff['discarded']:,}"],
                    ["dispatch lag p50 s", f"{handoff['dispatch_lag_p50_s']:g}"],
                    ["dispatch lag p99 s", f"{handoff['dispatch_lag_p99_s']:g}"],
                    ["dispatch lag max s", f"{handoff['dispatch_lag_max_s']:g}"],
                ],
                "Dispatch lag: from the outcome recorded with its sends to their first "
                "publication (by the worker, a redelivery or the relay). Stranded sends wait "
                "for a relay (`taskonce relay`).",
            )
        )
    producer = result.report.get("producer") or {}
    if producer.get("records_deferred") or producer.get("discarded"):
        sections.append(
            (
                "Producer outbox (sends from send_on_commit)",
                ["figure", "value"],
                [
                    ["sends committed", f"{producer['records_deferred']:,}"],
                    ["published", f"{producer['records_dispatched']:,}"],
                    ["stranded (unpublished at the log's end)", f"{producer['stranded']:,}"],
                    ["discarded (rolled back)", f"{producer['discarded']:,}"],
                    ["dispatch lag p50 s", f"{producer['dispatch_lag_p50_s']:g}"],
                    ["dispatch lag p99 s", f"{producer['dispatch_lag_p99_s']:g}"],
                    ["dispatch lag max s", f"{producer['dispatch_lag_max_s']:g}"],
                ],
                "Dispatch lag: from the application's commit to the send's publication (right "
                "after the commit, or by the relay after a crash or a broker outage).",
            )
        )
    return sections


def _sample_sections(result: AuditResult) -> list[Section]:
    """The samples of leaked keys and stuck claims."""
    overall = result.report["overall"]
    sections: list[Section] = []
    sections.append(
        (
            "Leaked keys",
            ["key", "queue", "task", "leaked runs", "first run", "last leak"],
            [
                [
                    str(row["key"]),
                    str(row["queue"]),
                    str(row["task"]),
                    str(row["leaked_runs"]),
                    str(row["first_run_at"]),
                    str(row["last_leak_at"]),
                ]
                for row in result.leaks_sample
            ],
            f"Latest {len(result.leaks_sample)} of {overall['leaks']:,}; all in tables/leaks."
            if overall["leaks"]
            else "None.",
        )
    )
    sections.append(
        (
            "Stuck claims",
            ["key", "queue", "worker", "claimed", "lease s", "deadline", "ended"],
            [
                [
                    str(row["key"]),
                    str(row["queue"]),
                    str(row["worker"]),
                    str(row["claimed_at"]),
                    f"{row['lease_s']:g}",
                    str(row["deadline"]),
                    "open at log end" if row["open_at_log_end"] else str(row["ended_at"]),
                ]
                for row in result.stuck_sample
            ],
            f"Latest {len(result.stuck_sample)} of {overall['stuck_claims']:,}; all in "
            "tables/stuck_claims."
            if overall["stuck_claims"]
            else "None.",
        )
    )
    return sections


def _input_lines(result: AuditResult) -> list[str]:
    info = result.info
    sources = ", ".join(f"`{source}`" for source in info["sources"]) or "—"
    return [
        f"Generated {result.report['generated_at']} from {result.report['events']:,} events "
        f"({info['first_ts'] or '—'} to {info['last_ts'] or '—'}) in {sources}.",
        f"Malformed rows dropped: {info['malformed']:,}. Stuck means not ended within lease + "
        f"{info['grace_s']:g} s; a near miss is a suppressed duplicate later than "
        f"{info['near_miss_ratio']:g} × the keep_for in force. Definitions: docs/audit.md.",
    ]


def render_markdown(result: AuditResult, images: dict[str, Path]) -> str:
    """``report.md``: the verdict, the tables, links to the charts."""
    lines = ["# taskonce audit", "", *_input_lines(result), "", *_verdict(result), ""]
    for title, header, rows, note in _sections(result):
        lines += [f"## {title}", ""]
        if rows:
            lines.append("| " + " | ".join(header) + " |")
            lines.append(
                "| " + " | ".join("---" if i == 0 else "---:" for i in range(len(header))) + " |"
            )
            lines += ["| " + " | ".join(_md(cell) for cell in row) + " |" for row in rows]
            lines.append("")
        if note:
            lines += [note, ""]
    if images:
        lines += ["## Charts", ""]
        for name, path in images.items():
            lines += [f"![{name}](charts/{path.name})", ""]
    return "\n".join(lines)


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def render_html(result: AuditResult, images: dict[str, Path]) -> str:
    """``report.html``: the same content, self-contained (charts embedded as PNG data)."""
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<title>taskonce audit</title><style>",
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:80em;color:#222}",
        "table{border-collapse:collapse;margin:.5em 0 1.5em}",
        "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}",
        "td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}",
        ".bad{color:#b00020}.ok{color:#1b5e20}.warn{color:#8a4b00}",
        "img{max-width:100%;border:1px solid #ddd}",
        "</style></head><body><h1>taskonce audit</h1>",
    ]
    parts += [f"<p>{_inline(line)}</p>" for line in _input_lines(result)]
    # green only for a window to configure: a log too short to advise is amber, not green
    verdict_class = "bad" if result.problems() else ("ok" if _advised(result) else "warn")
    parts.append(f"<div class='{verdict_class}'>")
    items: list[str] = []
    for line in _verdict(result):
        if line.startswith("- "):
            items.append(f"<li>{_inline(line[2:])}</li>")
            continue
        if items:
            parts.append("<ul>" + "".join(items) + "</ul>")
            items = []
        if line:
            parts.append(f"<p>{_inline(line)}</p>")
    if items:
        parts.append("<ul>" + "".join(items) + "</ul>")
    parts.append("</div>")
    for name, path in images.items():
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(
            f"<h2>{html.escape(name)}</h2><img alt='{html.escape(name)}' "
            f"src='data:image/png;base64,{data}'>"
        )
    for title, header, rows, note in _sections(result):
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if rows:
            parts.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header))
            parts += [
                "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>"
                for row in rows
            ]
            parts.append("</table>")
        if note:
            parts.append(f"<p>{_inline(note)}</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _inline(text: str) -> str:
    """The little Markdown the verdict uses (``**bold**``, backticks) as HTML."""
    escaped = html.escape(text)
    out: list[str] = []
    for index, piece in enumerate(escaped.split("**")):
        out.append(f"<strong>{piece}</strong>" if index % 2 else piece)
    joined = "".join(out)
    pieces = joined.split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))
