"""Time the Spark audit at 1M and 10M events on ``local[2]``; record events/second and peak
memory in docs/performance.md (its block in "Spark audit").

For each size it writes a synthetic log with bench/gen_events.py (kept in ``--workdir`` and
reused when its parameters match), runs the audit in a child process (a fresh JVM, the
``taskonce audit`` defaults: ``--driver-memory 2g``, what-if windows, a broker bound) and
samples the resident memory of that process tree every 0.25 s: the Python driver and the JVM
(local mode: the Spark driver and its executor threads). It checks the report against the
generator's truth (deliveries, runs, keys, duplicates, failures, leaks, stuck claims).

The Python driver's peak memory is the evidence that the driver never collects the data: it
stays the same at 1M and 10M events (only aggregates come back); the work and the data stay in
the JVM, which spills to disk.

Usage (from the repository root)::

    .venv/bin/python bench/audit_scale.py                         # 1M and 10M, print
    .venv/bin/python bench/audit_scale.py --sizes 1000000 --write-docs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gen_events import TRUTH_FIELDS
from harness import loadavg, measured_line, table, write_block  # bench/ is sys.path[0]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SIZES = "1000000,10000000"
GENERATOR = [
    "--dup-rate",
    "0.05",
    "--gap-median",
    "30",
    "--gap-sigma",
    "2",
    "--late-rate",
    "0.01",
    "--late-gap",
    "3600",
    "--keep-for",
    "86400",
]
CHECKED = TRUTH_FIELDS  # the figures gen_events.py knows exactly


#: The audit's passes (``AuditRun`` methods), in order, as the table names them.
PASSES = ("classify", "per_key", "per_scope", "gaps", "what_if", "result", "write")


def _jvm_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (the JVM) so far, from /proc."""
    with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _heap_peak_bytes(spark: Any) -> int:
    """The JVM's peak heap use: the sum of each heap pool's peak (``MemoryPoolMXBean``), an
    upper bound of the heap's own peak (the pools peak at different moments)."""
    factory = spark._jvm.java.lang.management.ManagementFactory
    return sum(
        int(pool.getPeakUsage().getUsed())
        for pool in factory.getMemoryPoolMXBeans()
        if str(pool.getType()) == "Heap memory"
    )


def child(args: argparse.Namespace) -> int:
    """Run one audit pass by pass in this process, then Spark's floor for the same job in the
    same JVM; print the timings as JSON."""
    started = time.monotonic()
    from pyspark.sql import functions as F

    from taskonce.spark_ext import build_session
    from taskonce.spark_ext.audit import AuditRun
    from taskonce.spark_ext.inputs import read_events
    from taskonce.spark_ext.report import write_outputs

    spark = build_session(args.master, driver_memory=args.driver_memory)
    spark.sparkContext.setLogLevel("ERROR")
    convert_s = None
    if args.input == "parquet":
        # a Parquet copy of the JSONL log, written once and reused (not timed as the audit)
        parquet = str(Path(args.events_file).with_suffix(".parquet"))
        if not Path(parquet).exists():
            begun = time.monotonic()
            read_events(spark, [args.events_file]).drop("seq", "_corrupt_record").withColumn(
                "ts", F.timestamp_millis("t_ms")
            ).drop("t_ms").write.parquet(parquet)
            convert_s = time.monotonic() - begun
        args.events_file = parquet
    jvm_pid = int(spark._jvm.java.lang.ProcessHandle.current().pid())
    ready = time.monotonic()

    def floor_job(out: str) -> dict[str, float]:
        """Spark's floor for this job: read the events, group them by key, write Parquet."""
        wall, cpu = time.monotonic(), _jvm_cpu_s(jvm_pid)
        (
            read_events(spark, [args.events_file])
            .groupBy("key")
            .agg(F.count(F.lit(1)).alias("events"), F.min("t_ms"), F.max("t_ms"))
            .write.mode("overwrite")
            .parquet(out)
        )
        shutil.rmtree(out, ignore_errors=True)
        return {"wall_s": time.monotonic() - wall, "cpu_s": _jvm_cpu_s(jvm_pid) - cpu}

    # the floor job once before the audit, so that both timed runs find the JVM warm (its
    # just-in-time compiler, the file in the page cache)
    warmup = floor_job(f"{args.out}-warmup")
    run = AuditRun(
        spark,
        [args.events_file],
        broker_bounds={"redis-visibility": 3600.0},
        simulate_windows=[60, 300, 3600, 86400],
    )
    passes: dict[str, dict[str, float]] = {}

    def timed(name: str, work: Any) -> Any:
        wall, cpu = time.monotonic(), _jvm_cpu_s(jvm_pid)
        value = work()
        passes[name] = {"wall_s": time.monotonic() - wall, "cpu_s": _jvm_cpu_s(jvm_pid) - cpu}
        return value

    try:
        for name in PASSES[:-2]:
            timed(name, getattr(run, name))
        result = timed("result", run.result)
        timed("write", lambda: write_outputs(spark, result, args.out, charts=True))
    finally:
        run.close()
    audit_wall = sum(p["wall_s"] for p in passes.values())
    audit_cpu = sum(p["cpu_s"] for p in passes.values())
    audit_heap = _heap_peak_bytes(spark)

    floor = floor_job(f"{args.out}-floor")
    spark.stop()
    print(
        json.dumps(
            {
                "session_s": ready - started,
                "convert_s": convert_s,
                "audit_s": audit_wall,
                "audit_cpu_s": audit_cpu,
                "passes": passes,
                "floor_s": floor["wall_s"],
                "floor_cpu_s": floor["cpu_s"],
                "warmup": warmup,
                "heap_peak_bytes": audit_heap,
                "report": result.report,
                "percentiles": result.info["percentiles"],
                "python_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            }
        )
    )
    return 0


def _tree(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += parents.get(pid, [])
    return found


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def measure(args: argparse.Namespace, events_file: Path, out: Path) -> dict[str, Any]:
    """Run the child audit and sample its process tree's memory."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--events-file",
        str(events_file),
        "--out",
        str(out),
        "--master",
        args.master,
        "--driver-memory",
        args.driver_memory,
        "--input",
        args.input,
    ]
    peaks = {"total": 0, "java": 0}
    stop = threading.Event()
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, cwd=REPO, text=True)

    def sample() -> None:
        while not stop.wait(0.25):
            pids = _tree(process.pid)
            sizes = {pid: _rss_kb(pid) for pid in pids}
            peaks["total"] = max(peaks["total"], sum(sizes.values()))
            java = sum(size for pid, size in sizes.items() if _name(pid) == "java")
            peaks["java"] = max(peaks["java"], java)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = process.communicate()
    stop.set()
    sampler.join()
    if process.returncode != 0:
        raise SystemExit(f"the audit failed (exit {process.returncode})")
    data: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
    data["wall_s"] = time.monotonic() - started
    data["peak_tree_kb"] = peaks["total"]
    data["peak_java_kb"] = peaks["java"]
    return data


def generate(events: int, workdir: Path) -> tuple[Path, dict[str, Any], float | None]:
    """The log of ``events`` events (reused when already written with these parameters)."""
    path = workdir / f"events-{events}.jsonl"
    truth_path = workdir / f"events-{events}.truth.json"
    if path.exists() and truth_path.exists():
        truth = json.loads(truth_path.read_text())
        if truth.get("parameters", {}).get("events") == events:
            return path, truth, None
    started = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "gen_events.py"),
            "--events",
            str(events),
            "--out",
            str(path),
            "--truth",
            str(truth_path),
            *GENERATOR,
        ],
        check=True,
    )
    return path, json.loads(truth_path.read_text()), time.monotonic() - started


PASS_NAMES = {
    "classify": "classify (read, group by key, keep)",
    "per_key": "per key (keep the rare key rows, stuck claims)",
    "per_scope": "per scope (event counts, keys, leaked keys)",
    "gaps": "gaps (percentiles, histogram, leaks table)",
    "what_if": "what-if and timeline",
    "result": "hand-off, samples, report",
    "write": "write (Parquet tables, charts, reports)",
}


def render(rows: list[dict[str, Any]], args: argparse.Namespace, load_start: str) -> str:
    def cpu(wall: float, cpu: float) -> str:
        return f"{wall:.1f} ({cpu:.1f})"

    main_rows = [
        [
            f"{r['events']:,}",
            f"{r['input_mb']:,.0f} MB",
            cpu(r["floor_s"], r["floor_cpu_s"]),
            cpu(r["audit_s"], r["audit_cpu_s"]),
            f"{r['audit_s'] / r['floor_s']:.1f}× ({r['audit_cpu_s'] / r['floor_cpu_s']:.1f}×)",
            f"{r['events'] / r['audit_s']:,.0f}",
            f"{r['heap_peak_bytes'] / 2**20:,.0f} MB",
            f"{r['peak_java_kb'] / 1024:,.0f} MB",
            f"{r['python_maxrss_kb'] / 1024:,.0f} MB",
            r["percentiles"],
            r["truth"],
        ]
        for r in rows
    ]
    pass_rows = [
        [label, *(cpu(r["passes"][name]["wall_s"], r["passes"][name]["cpu_s"]) for r in rows)]
        for name, label in PASS_NAMES.items()
    ]
    warmups = (cpu(r["warmup"]["wall_s"], r["warmup"]["cpu_s"]) for r in rows)
    pass_rows.append(["*JVM warm-up: the floor job once, before the audit*", *warmups])
    header = "Events|Input|Floor s|Audit s|Ratio wall (CPU)|Events/s|Heap peak|Peak RSS JVM|"
    header += "Peak RSS Python driver|Percentiles|Truth"
    flags = (f"--sizes {args.sizes} " if args.sizes != DEFAULT_SIZES else "") + (
        f"--input {args.input} " if args.input != "jsonl" else ""
    )
    versions = [f"Java {_java()}", f"PySpark {_pyspark()}"] + ([args.note] if args.note else [])
    form = "JSONL file" if args.input == "jsonl" else "Parquet folder"
    return "\n\n".join(
        [
            f"One {form} per size, on `--master {args.master}` with `--driver-memory "
            f"{args.driver_memory}`.",
            table(header.split("|"), main_rows, "rrrrrrrrrll"),
            "Per pass, wall seconds (JVM CPU seconds):",
            table(
                ["Pass", *(f"{r['events']:,} events" for r in rows)],
                pass_rows,
                "l" + "r" * len(rows),
            ),
            measured_line(
                f".venv/bin/python bench/audit_scale.py {flags}--write-docs", load_start, versions
            ),
        ]
    )


def _java() -> str:
    try:
        text = subprocess.run(
            ["java", "-version"], capture_output=True, text=True, check=False
        ).stderr
    except OSError:
        return "?"
    first = text.splitlines()[0] if text else "?"
    return first.split('"')[1] if '"' in first else first


def _pyspark() -> str:
    try:
        import pyspark

        return str(pyspark.__version__)
    except ImportError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="event counts")
    parser.add_argument(
        "--workdir", default=str(REPO / "build" / "audit-scale"), help="logs go here"
    )
    parser.add_argument(
        "--input",
        choices=("jsonl", "parquet"),
        default="jsonl",
        help="audit the JSONL log, or a Parquet copy of it (written once by Spark)",
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the generated logs in --workdir"
    )
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--driver-memory", default="2g")
    parser.add_argument(
        "--write-docs", action="store_true", help="write the block in docs/performance.md"
    )
    parser.add_argument("--note", default="", help="a remark on the load, for the docs")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--events-file", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    load_start = loadavg()
    for size in [int(s) for s in args.sizes.split(",")]:
        path, truth, generated_s = generate(size, workdir)
        if generated_s is not None:
            print(f"generated {truth['events']:,} events in {generated_s:.1f} s")
        out = workdir / f"out-{size}"
        print(f"auditing {truth['events']:,} events (load {loadavg()}) …", flush=True)
        data = measure(args, path, out)
        if data.get("convert_s") is not None:
            print(f"wrote the Parquet copy in {data['convert_s']:.1f} s")
        overall = data["report"]["overall"]
        mismatches = [
            f"{name} {overall[name]} ≠ {truth[name]}"
            for name in CHECKED
            if overall[name] != truth[name]
        ]
        if data["report"]["events"] != truth["events"]:
            mismatches.append(f"events {data['report']['events']} ≠ {truth['events']}")
        row = {
            "events": truth["events"],
            "input_mb": path.stat().st_size / 1e6,
            "truth": "matches" if not mismatches else "MISMATCH: " + "; ".join(mismatches),
            **data,
        }
        rows.append(row)
        print(
            f"{row['events']:,} events: audit {row['audit_s']:.1f} s "
            f"({row['audit_cpu_s']:.1f} CPU s), floor {row['floor_s']:.1f} s "
            f"({row['floor_cpu_s']:.1f} CPU s), ratio {row['audit_s'] / row['floor_s']:.1f}×; "
            f"heap peak {row['heap_peak_bytes'] / 2**20:,.0f} MB, "
            f"peak JVM {row['peak_java_kb'] / 1024:,.0f} MB, "
            f"Python driver {row['python_maxrss_kb'] / 1024:,.0f} MB, "
            f"whole tree {row['peak_tree_kb'] / 1024:,.0f} MB; truth {row['truth']}",
            flush=True,
        )
        shutil.rmtree(out, ignore_errors=True)
        if args.write_docs:  # after each size: a later size that fails keeps the earlier ones
            write_block("spark-audit", render(rows, args, load_start))
        if not args.keep_logs:  # a 10M-event log takes 3 GB
            path.unlink(missing_ok=True)
            path.with_suffix(".truth.json").unlink(missing_ok=True)
            shutil.rmtree(path.with_suffix(".parquet"), ignore_errors=True)
    print(f"\n{render(rows, args, load_start)}")
    return 0 if all(row["truth"] == "matches" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
