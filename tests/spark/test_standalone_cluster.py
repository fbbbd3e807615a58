"""``taskonce audit --master spark://…`` on a Spark standalone cluster: a master and two workers
started from the pyspark installation's own ``spark-class`` on loopback (free ports, their own
work folders), stopped by their pids. The events come from a folder every executor can read (one
machine: the same path) and from a PostgreSQL table over JDBC (Debian's driver jar, shipped to
the executors by ``spark.jars``); both reports equal, figure for figure, the audit of the same
events on ``local[2,2]``.

Marked ``slow`` and ``spark_cluster``: it starts four JVMs besides the test session's own (about
two minutes on a quiet 2-CPU machine). It is part of the default run; ``make spark-cluster`` runs
it alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from taskonce.spark_ext import AuditResult
from tests.helpers import IN_CI, POSTGRES_URL, free_port, wait_for
from tests.spark import worked
from tests.spark.test_jdbc import events_table  # noqa: F401 - the worked events in a table

# Two audits on four JVMs of a shared 2-CPU machine take minutes, above the suite's 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.spark_cluster, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
# The worked log's judging options, as the command line takes them.
JUDGING = [
    "--broker-bound",
    "redis-visibility=1h",
    "--simulate-windows",
    ",".join(f"{window:g}" for window in worked.WINDOWS),
    "--grace",
    f"{worked.GRACE_S:g}s",
]


def _spark_class() -> str:
    import pyspark

    path = Path(pyspark.__file__).parent / "bin" / "spark-class"
    if not path.exists() or (shutil.which("java") is None and not os.environ.get("JAVA_HOME")):
        message = f"no Spark launcher at {path} or no Java (apt-get install default-jre-headless)"
        pytest.fail(message) if IN_CI else pytest.skip(message)
    return str(path)


class StandaloneCluster:
    """A Spark master and two workers (1 core, 1 GB each) on 127.0.0.1."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port, self.ui_port = free_port(), free_port()
        self.processes: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_LOG_DIR": str(folder / "logs"),
            "SPARK_WORKER_DIR": str(folder / "work"),
            "PYSPARK_PYTHON": sys.executable,  # the executors' Python: this virtualenv's
        }

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _start(self, name: str, *args: str) -> None:
        log = (self.folder / f"{name}.log").open("wb")
        # spark-class execs java: the pid is the JVM's own.
        self.processes.append(
            subprocess.Popen(
                [_spark_class(), *args], env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        )
        log.close()

    def alive_workers(self) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=2) as r:
                return int(json.load(r).get("aliveworkers", 0))
        except OSError:
            return 0

    def start(self) -> StandaloneCluster:
        self._start(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1", "--port", str(self.port), "--webui-port", str(self.ui_port),
        )  # fmt: skip
        for n in range(2):
            self._start(
                f"worker{n}",
                "org.apache.spark.deploy.worker.Worker",
                self.url,
                "--host", "127.0.0.1", "--port", str(free_port()),
                "--webui-port", str(free_port()), "--cores", "1", "--memory", "1g",
                "--work-dir", str(self.folder / f"work{n}"),
            )  # fmt: skip

        def ready() -> bool:
            for process in self.processes:
                if process.poll() is not None:
                    logs = "\n".join(p.read_text()[-1500:] for p in self.folder.glob("*.log"))
                    raise AssertionError(f"a Spark daemon exited:\n{logs}")
            return self.alive_workers() == 2

        wait_for(ready, timeout=120, interval=0.5, what="the master to see two alive workers")
        return self

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    cluster = StandaloneCluster(tmp_path_factory.mktemp("spark-standalone"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _audit_on(cluster: StandaloneCluster, out: Path, *source: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "taskonce.cli", "audit", *source, "--out", str(out)]
    command += ["--master", cluster.url, "--no-progress", "--no-charts", *JUDGING]
    done = subprocess.run(
        command, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    spark_log = (out / "spark.log").read_text()
    # It ran on the cluster's executors, not in a local mode.
    assert f"Connecting to master {cluster.url}" in spark_log, spark_log[-3000:]
    assert "Granted executor ID" in spark_log, spark_log[-3000:]
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def _figures(report: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in report.items() if name != "generated_at"}


def test_audit_on_a_standalone_cluster_equals_local_mode(
    standalone: StandaloneCluster,
    worked_audit: tuple[AuditResult, Path],
    events_table: str,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    local = _figures(worked_audit[0].report)  # the same events on local[2,2]
    shared = tmp_path / "shared"
    shared.mkdir()
    log = worked.write_jsonl(shared / "events.jsonl", worked.worked_events())
    from_folder = _audit_on(standalone, tmp_path / "out-folder", str(log))
    assert _figures(from_folder) == local
    assert from_folder["overall"] == worked.EXPECTED_OVERALL

    jdbc_url = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
    from_table = _audit_on(
        standalone, tmp_path / "out-table", "--jdbc-url", jdbc_url, "--jdbc-table", events_table
    )
    assert _figures(from_table) == local
