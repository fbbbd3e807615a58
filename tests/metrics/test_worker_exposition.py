"""docs/operations.md's exposition from the Celery worker's main process: ``serve(9808, …)`` in
a ``worker_init`` receiver (tests/metrics/celery_app.py with ``MX_SERVE=1``, the page's lines),
scraped over HTTP on that port while the prefork pool's processes run the tasks: their counts,
summed, and ``taskonce_sends_pending`` from the store.

The page's port is fixed, so a lock file in the system's temporary directory keeps two test runs
on this machine (other checkouts too) from using it at once."""

from __future__ import annotations

import contextlib
import fcntl
import re
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.helpers import wait_for
from tests.metrics.common import Scraper
from tests.metrics.test_prometheus_workers import (
    BROKER_URL,
    K,
    N,
    check_scrape,
    run,  # noqa: F401  (the fixture)
    start,
    wait_for_count,
    worker_log,
)

PORT = 9808  # docs/operations.md's


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))  # where serve() binds
        except OSError:
            return False
    return True


@contextlib.contextmanager
def the_pages_port() -> Iterator[None]:
    """Hold the page's port for this test: a lock no other run of it takes meanwhile, and the
    port free (a worker of a run that just ended may still be closing it)."""
    with open(Path(tempfile.gettempdir()) / f"taskonce-tests-port-{PORT}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest-timeout bounds the wait
        wait_for(lambda: _free(PORT), timeout=30, interval=0.2, what=f"port {PORT} to be free")
        yield


def test_the_celery_worker_serves_its_pool_processes_metrics(run: dict[str, Any]) -> None:  # noqa: F811
    from celery import Celery

    prefix = run["prefix"]
    queue = f"{prefix}.q"
    run["env"]["MX_SERVE"] = "1"
    with the_pages_port():
        start(run, [
            sys.executable, "-m", "celery", "-A", "tests.metrics.celery_app", "worker",
            "-P", "prefork", "-c", "2", "-Q", queue, "-n", f"{prefix}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
        ])  # fmt: skip
        ready = Path(run["env"]["MX_READY"])

        def is_ready() -> bool:
            if run["process"].poll() is not None:
                raise AssertionError(f"worker exited:\n{worker_log(run)[-4000:]}")
            return ready.exists()

        wait_for(is_ready, timeout=60, interval=0.1, what="the celery worker to be ready")
        run["exposed"] = Scraper.at(f"http://127.0.0.1:{PORT}/metrics")
        app = Celery(f"publisher-{prefix}", broker=BROKER_URL, set_as_current=False)
        app.conf.update(
            broker_transport_options={"global_keyprefix": f"{prefix}:"},
            broker_connection_retry_on_startup=True,
        )
        try:
            for i in range(N):
                app.send_task("mx.work", args=(i,), queue=queue, task_id=f"{prefix}-{i}")
            wait_for_count(run, "completed", N)
            for i in range(K):
                app.send_task("mx.work", args=(i,), queue=queue, task_id=f"{prefix}-{i}")
            wait_for_count(run, "duplicate_skipped", K)
        finally:
            app.close()
        check_scrape(run, "celery", "mx.work", queue)  # the pool processes' counts, summed
        text = run["exposed"].text()
        assert re.search(r"^taskonce_sends_pending 0\.0$", text, re.MULTILINE), text
