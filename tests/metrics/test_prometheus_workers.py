"""PrometheusEvents in real multi-process workers: a ``celery worker -P prefork -c 2`` and a
``dramatiq --processes 2`` worker, each writing to its own ``PROMETHEUS_MULTIPROC_DIR``, scraped
over HTTP as Prometheus would. After N messages and K duplicates of them the scraped text shows
N claims, N completions, K skipped duplicates, N handler durations, N + K timed store claims
and no claim left in progress;
each handler ran N times in all. Every event also went to a sink that raises: the outcomes are
the same, and the worker logged the sink's failures.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from taskonce.demo.common import delete_redis_keys
from tests.helpers import REDIS_URL, require_service, wait_for
from tests.metrics.common import Scraper

ROOT = Path(__file__).resolve().parents[2]
#: The Redis broker database of these tests (the Celery tests use 1–4, Dramatiq's 5–8).
BROKER_URL = "redis://127.0.0.1:6379/9"
N, K = 12, 4


@pytest.fixture
def run(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A fresh prefix, metrics directory and scraper; the worker's process group and every
    Redis key of the prefix are gone afterwards."""
    require_service("redis")
    prefix = f"mx{uuid.uuid4().hex[:10]}"
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MX_BROKER": BROKER_URL,
        "MX_PREFIX": prefix,
        "MX_STORE": REDIS_URL,
        "MX_STORE_NS": prefix,
        "MX_READY": str(tmp_path / "ready"),
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
    }
    scraper = Scraper(metrics_dir)
    state: dict[str, Any] = {"env": env, "prefix": prefix, "scraper": scraper, "tmp": tmp_path}
    try:
        yield state
    finally:
        scraper.close()
        for process in (state.get("exposition"), state.get("process")):
            if process is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=15)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        delete_redis_keys(BROKER_URL, f"{prefix}*")
        delete_redis_keys(REDIS_URL, f"{prefix}*")


def start(run: dict[str, Any], command: list[str]) -> subprocess.Popen[bytes]:
    log = run["tmp"] / "worker.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, env=run["env"], stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    run["process"] = process
    run["log"] = log
    return process


def start_exposition(run: dict[str, Any]) -> Scraper:
    """The documented scrape setup: ``python -m taskonce.prometheus_events`` next to the
    workers, on the same directory, with the store for ``taskonce_sends_pending``."""
    store = f"{REDIS_URL}?prefix={run['prefix']}"
    process = subprocess.Popen(
        [sys.executable, "-m", "taskonce.prometheus_events", "--port", "0", "--addr",
         "127.0.0.1", "--store", store],
        cwd=ROOT, env=run["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    run["exposition"] = process
    assert process.stdout is not None
    line = process.stdout.readline().decode()  # "serving http://127.0.0.1:PORT/metrics from …"
    assert line.startswith("serving http://127.0.0.1:"), line + process.stdout.read().decode()
    return Scraper.at(line.split()[1])


def worker_log(run: dict[str, Any]) -> str:
    return Path(run["log"]).read_text(errors="replace")


def wait_for_count(run: dict[str, Any], event: str, expected: int) -> None:
    scraper: Scraper = run.get("exposed") or run["scraper"]

    def reached() -> bool:
        if run["process"].poll() is not None:
            raise AssertionError(f"worker exited:\n{worker_log(run)[-4000:]}")
        return scraper.value("taskonce_events_total", event=event) >= expected

    wait_for(reached, timeout=60, interval=0.2, what=f"{expected} {event} events")


def check_scrape(run: dict[str, Any], framework: str, task: str, queue: str) -> None:
    scraper: Scraper = run.get("exposed") or run["scraper"]
    text = scraper.text()
    labels = {"framework": framework, "task": task, "queue": queue}

    def value(name: str, **more: str) -> float:
        return scraper.value(name, text, **labels, **more)

    assert value("taskonce_events_total", event="claimed") == N, text
    assert value("taskonce_events_total", event="completed") == N, text
    assert value("taskonce_events_total", event="duplicate_skipped") == K, text
    assert value("taskonce_events_total", event="in_progress_deferred") == 0, text
    assert value("taskonce_events_total", event="released") == 0, text
    assert value("taskonce_handler_duration_seconds_count", outcome="completed") == N, text
    assert value("taskonce_handler_duration_seconds_bucket", outcome="completed", le="+Inf") == N
    assert value("taskonce_claims_in_progress") == 0, text
    # every delivery made one claim (the duplicates' found the key handled), every run completed
    calls = "taskonce_store_call_duration_seconds_count"
    assert scraper.value(calls, text, operation="claim", store="RedisStore") == N + K, text
    assert scraper.value(calls, text, operation="complete", store="RedisStore") == N, text
    runs = redis.Redis.from_url(REDIS_URL).get(f"{run['prefix']}:runs")
    assert int(runs or 0) == N  # each message ran once, the broken sink notwithstanding
    # the worker's processes hand their log lines to its main process, which writes them
    # when it gets to it: wait for the line rather than read the file once
    wait_for(
        lambda: "event sink" in worker_log(run) and "this sink is broken" in worker_log(run),
        timeout=30,
        what="the broken sink's traceback in the worker's log",
    )


def test_celery_prefork_worker_metrics_count_messages_and_duplicates(
    run: dict[str, Any],
) -> None:
    from celery import Celery

    prefix = run["prefix"]
    queue = f"{prefix}.q"
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
    app = Celery(f"publisher-{prefix}", broker=BROKER_URL, set_as_current=False)
    app.conf.update(
        broker_transport_options={"global_keyprefix": f"{prefix}:"},
        broker_connection_retry_on_startup=True,
    )
    try:
        for i in range(N):
            app.send_task("mx.work", args=(i,), queue=queue, task_id=f"{prefix}-{i}")
        wait_for_count(run, "completed", N)
        for i in range(K):  # the broker delivers K of them again, after they were handled
            app.send_task("mx.work", args=(i,), queue=queue, task_id=f"{prefix}-{i}")
        wait_for_count(run, "duplicate_skipped", K)
    finally:
        app.close()
    check_scrape(run, "celery", "mx.work", queue)


def test_dramatiq_multiprocess_worker_metrics_count_messages_and_duplicates(
    run: dict[str, Any],
) -> None:
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker

    prefix = run["prefix"]
    start(run, [
        sys.executable, "-m", "dramatiq", "tests.metrics.dramatiq_app:broker",
        "--processes", "2", "--threads", "2", "--path", str(ROOT),
    ])  # fmt: skip
    run["exposed"] = start_exposition(run)
    broker = RedisBroker(url=BROKER_URL, namespace=prefix)
    broker.declare_queue(prefix)

    def message(i: int) -> dramatiq.Message[Any]:
        return dramatiq.Message(
            queue_name=prefix, actor_name="mx_work", args=(i,), kwargs={}, options={},
            message_id=f"{prefix}-{i}",
        )  # fmt: skip

    try:
        for i in range(N):
            broker.enqueue(message(i))
        wait_for_count(run, "completed", N)
        for i in range(K):
            broker.enqueue(message(i))
        wait_for_count(run, "duplicate_skipped", K)
    finally:
        broker.close()
    check_scrape(run, "dramatiq", "mx_work", prefix)
    text = run["exposed"].text()
    assert re.search(r"^taskonce_sends_pending 0\.0$", text, re.MULTILINE), text  # from the store
