"""The soak results table of ``docs/reliability.md`` from run folders' ``report.json``.

Run: ``.venv/bin/python -m tools.soak.summarize build/chaos/<run> … [--write-docs]``
(``make chaos-all`` leaves one folder per variant under ``build/chaos``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reliability.md"
START, END = "<!-- soak:results -->", "<!-- /soak:results -->"


def table(reports: list[dict[str, object]]) -> str:
    lines = [
        "| variant | messages | faults for | faults | lost | broker lost | children repaired by "
        "taskonce | doubled | explained | drain | promise held |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in reports:
        faults = ", ".join(f"{k} {v}" for k, v in dict(r["faults"]).items())  # type: ignore[call-overload]
        lines.append(
            f"| {r['variant']} | {r['messages']} | {r['injected_s']} s | {r['faults_total']}: "
            f"{faults} | {r['lost']} | {broker_lost(r)} | {children(r)} | {r['doubled']} "
            f"| {r['explained']} | {r['drain_s']} s | {'yes' if r['held'] else '**no**'} |"
        )
    return "\n".join(lines)


def broker_lost(report: dict[str, object]) -> str:
    """Messages the broker or the framework lost, published again by the soak: parents, and in
    a hand-off run the children whose retry (or redelivery) was lost after their guard had
    claimed them."""
    text = f"{report.get('broker_lost', 0)}"
    if report.get("handoff"):
        text += f" + {report.get('child_retries_lost', 0)} child retries"
    return text


def children(report: dict[str, object]) -> str:
    """A hand-off run's children that taskonce's receipts published again: those a lost copy
    made run (repaired), the re-sends that found the child already run (it was only slow),
    and the children given up on (``send_unconfirmed``)."""
    if not report.get("handoff"):
        return "—"
    return (
        f"{report.get('children_repaired', 0)} (re-sends finding it run "
        f"{report.get('resends_found_run', 0)}, unconfirmed {report.get('send_unconfirmed', 0)})"
    )


def write_table(text: str) -> None:
    """Replace the table between the markers of docs/reliability.md (the prose is the doc's)."""
    body = DOC.read_text(encoding="utf-8")
    head, rest = body.split(START)
    DOC.write_text(f"{head}{START}\n\n{text}\n\n{END}{rest.split(END)[1]}", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    reports = [json.loads((folder / "report.json").read_text()) for folder in args.folders]
    text = table(reports)
    print(text)
    if args.write_docs:
        write_table(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
