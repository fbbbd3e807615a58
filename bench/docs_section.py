"""The one way every benchmark writes its own section of ``docs/performance.md``."""

from __future__ import annotations

import os
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
INTRO = (
    "# Performance\n\n"
    "How these figures are made: each benchmark prints a table and the command; ratios are "
    "measured in one run against a baseline on the same machine.\n"
)


def command_lines(command: str) -> list[str]:
    """The closing lines of a section: the command that made its figures, as a code block."""
    return ["Command:", "", "```", command, "```", ""]


def write_section(section: str, doc: Path = DOC) -> None:
    """Replace the section of ``doc`` that ``section``'s first line (its ``## `` heading)
    names, up to the next ``## `` heading; append it when absent, create the file when
    missing. The file is read just before it is replaced (atomically): other benchmarks own
    the other sections."""
    heading = section.splitlines()[0].rstrip()
    if not heading.startswith("## "):
        raise ValueError(f"a section starts with its '## ' heading, not {heading!r}")
    body = doc.read_text(encoding="utf-8") if doc.exists() else INTRO
    lines = body.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    block = section.rstrip("\n") + "\n"
    if start is None:
        new = body.rstrip("\n") + "\n\n" + block
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        tail = "".join(lines[end:])
        new = "".join(lines[:start]) + block + ("\n" + tail if tail else "")
    doc.parent.mkdir(parents=True, exist_ok=True)
    tmp = doc.with_name(f".{doc.name}.{os.getpid()}.tmp")
    tmp.write_text(new, encoding="utf-8")
    os.replace(tmp, doc)
