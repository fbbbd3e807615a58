"""Dump every output of one audit in a canonical form, to compare two versions of the audit byte
for byte (``report.json``, ``report.md``, ``report.html``, the chart PNGs' SHA-256, each Parquet
table's schema and sorted rows, and the result's details, info, samples, histogram, timeline).

Usage (from the repository root; the bench's audit parameters, ``--worked`` for the worked
example's)::

    .venv/bin/python bench/audit_outputs.py LOG OUT_DIR before.json [--worked]
    # ... change the audit ...
    .venv/bin/python bench/audit_outputs.py LOG OUT_DIR after.json [--worked]
    .venv/bin/python bench/audit_outputs.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NOW = datetime.datetime(2026, 2, 1, 12, 0, tzinfo=datetime.timezone.utc)


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def dump(log: str, out: str, worked: bool) -> dict[str, Any]:
    """Audit ``log`` into ``out`` and return its outputs in canonical form."""
    from taskonce.spark_ext import audit, build_session

    spark = build_session("local[2]", driver_memory="2g", conf={"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    if worked:
        sys.path.insert(0, str(REPO))
        from tests.spark import worked as example

        options: dict[str, Any] = {
            "broker_bounds": example.BROKER_BOUNDS,
            "simulate_windows": example.WINDOWS,
            "grace_s": example.GRACE_S,
        }
    else:
        options = {
            "broker_bounds": {"redis-visibility": 3600.0},
            "simulate_windows": [60, 300, 3600, 86400],
        }
    result = audit(spark, [log], out=out, now=NOW, **options)
    folder = Path(out)
    outputs: dict[str, Any] = {
        name: (folder / name).read_text() for name in ("report.json", "report.md", "report.html")
    }
    for png in sorted((folder / "charts").glob("*")):
        outputs[f"charts/{png.name}"] = hashlib.sha256(png.read_bytes()).hexdigest()
    for table in sorted((folder / "tables").iterdir()):
        frame = spark.read.parquet(str(table))
        rows = sorted(
            json.dumps(row.asDict(recursive=True), default=str, sort_keys=True)
            for row in frame.collect()
        )
        outputs[f"tables/{table.name}"] = {"schema": frame.schema.simpleString(), "rows": rows}
    for name in ("details", "info", "what_if", "leaks_sample", "stuck_sample", "histogram"):
        outputs[name] = _plain(getattr(result, name))
    outputs["timeline"] = _plain(result.timeline)
    spark.stop()
    return outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="LOG OUT_DIR DUMP, or with --compare A B")
    parser.add_argument("--worked", action="store_true", help="the worked example's options")
    parser.add_argument("--compare", action="store_true", help="compare two dumps")
    args = parser.parse_args(argv)
    if args.compare:
        first, second = (json.loads(Path(p).read_text()) for p in args.paths)
        differ = [name for name in sorted({*first, *second}) if first.get(name) != second.get(name)]
        print("identical" if not differ else f"differ: {', '.join(differ)}", f"({len(first)})")
        return 1 if differ else 0
    log, out, target = args.paths
    Path(target).write_text(json.dumps(dump(log, out, args.worked), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
