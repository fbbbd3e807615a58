"""The soak results table of ``docs/reliability.md`` from run folders' ``report.json``.

Run: ``.venv/bin/python -m bench.chaos.summarize build/chaos/<run> … [--write-docs]``
(``make chaos-all`` leaves one folder per variant under ``build/chaos``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.docs_section import command_lines, write_section  # noqa: E402

DOC = ROOT / "docs" / "reliability.md"
SECTION = "## Soak results"


def table(reports: list[dict[str, object]], command: str) -> str:
    lines = [
        SECTION,
        "",
        "Each row is one run of `bench/chaos/soak.py`: its messages, how long faults were "
        "injected, the faults by kind, and the ledger's verdict after the drain. *Broker lost* "
        "counts messages the broker or the framework lost that the guard had never recorded as "
        "handled (published again by the soak, with the same id, as a producer would); in the "
        "hand-off rows, *+ N children* counts children the guard had published that the broker "
        "then lost (published again by the soak with the id the hand-off gave them).",
        "",
        "| variant | messages | faults for | faults | lost | broker lost | doubled | explained "
        "| drain | promise held |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in reports:
        faults = ", ".join(f"{k} {v}" for k, v in dict(r["faults"]).items())  # type: ignore[call-overload]
        broker_lost = f"{r.get('broker_lost', 0)}"
        if r.get("handoff"):
            broker_lost += f" + {r.get('broker_lost_children', 0)} children"
        lines.append(
            f"| {r['variant']} | {r['messages']} | {r['injected_s']} s | {r['faults_total']}: "
            f"{faults} | {r['lost']} | {broker_lost} | {r['doubled']} "
            f"| {r['explained']} | {r['drain_s']} s | {'yes' if r['held'] else '**no**'} |"
        )
    lines += ["", *command_lines(command)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--command", default="make chaos-all", help="the command that ran them")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    reports = [json.loads((folder / "report.json").read_text()) for folder in args.folders]
    text = table(reports, args.command)
    print(text)
    if args.write_docs:
        write_section(text, DOC)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
