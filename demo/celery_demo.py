"""``taskonce demo``: duplicate deliveries against a real Celery worker, and a balance that holds.

:func:`run_demo` starts ``celery worker`` (prefork, two pool processes) on
:mod:`taskonce.demo.celery_app`, sends ``count`` guarded "charge" tasks, re-publishes every
fifth one with the same task id (a producer that sent twice), SIGKILLs the pool process in
the middle of one charge (the broker gives that message back; it runs again once the dead
claim's lease is out), draws a progress bar, and prints what happened: sent, delivered, ran,
duplicates skipped, and the ledger's balance against the expected one.

Embedded default (nothing to install): an SQLite store and kombu's SQLAlchemy transport on
SQLite, both in a temporary directory. ``store`` / ``broker`` URLs run the same demo on Redis,
RabbitMQ or PostgreSQL; everything the demo creates there carries a random name and is removed
afterwards.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, TextIO

from taskonce.demo import common as _demo
from taskonce.events import Event

#: every n-th charge is published a second time with the same task id
DUPLICATE_EVERY = 5
#: the claim lease of the demo (the killed charge waits this long before it runs again)
LEASE = 4.0
#: the demo gives up (and reports what it saw) after this many seconds
DEADLINE = 55.0
_DECISIONS = (
    Event.CLAIMED.value,
    Event.LEASE_TAKEN_OVER.value,
    Event.DUPLICATE_SKIPPED.value,
    Event.IN_PROGRESS_DEFERRED.value,
)


def broker_options(broker: str, namespace: str) -> dict[str, Any]:
    """Transport options of the demo's broker (shared by the worker and the publisher)."""
    if broker.startswith("redis"):
        return {"global_keyprefix": f"{namespace}:"}
    if broker.startswith("sqla+sqlite"):
        return {"connect_args": {"timeout": 30}}
    return {}


def run_demo(*, store: str | None, broker: str | None, count: int, out: TextIO) -> int:
    """Run the demo; returns the exit code (0: every order charged exactly once).

    :param store: store URL, or None for an SQLite file in a temporary directory.
    :param broker: broker URL, or None for kombu's SQLAlchemy transport on SQLite.
    :param count: charge tasks to send (a fifth of them are sent twice).
    :param out: where the progress and the report are written.
    """
    if count < 1:
        out.write("taskonce demo: --count must be at least 1\n")
        return 2
    if store is not None and store.startswith("memory"):
        out.write(
            "taskonce demo: the worker's processes must share the store; use sqlite:///…, "
            "redis://… or postgresql+psycopg://… (memory:// lives in one process)\n"
        )
        return 2
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="taskonce-demo-"))
    tag = uuid.uuid4().hex[:8]
    namespace = f"taskonce_demo_{tag}"
    store_url = store or f"sqlite:///{workdir / 'store.db'}"
    broker_url = broker or f"sqla+sqlite:///{workdir / 'broker.db'}"
    queue = f"taskonce-demo-{tag}"
    sql = _demo.is_sql(store_url)
    ledger_table = f"taskonce_demo_ledger_{tag}"
    ledger = f"sql:{ledger_table}" if sql else f"sqlite:{workdir / 'ledger.db'}"

    rng = random.Random(20261122)
    orders = [(f"order-{i:04d}", rng.randint(100, 9999), str(uuid.uuid4())) for i in range(count)]
    duplicates = [i for i in range(count) if i % DUPLICATE_EVERY == 2]
    victim = count // 3
    while victim in duplicates and victim + 1 < count:
        victim += 1

    from taskonce.stores import redact

    out.write("taskonce demo — a real Celery worker (prefork, 2 pool processes)\n")
    out.write(f"  broker  {redact(broker_url)}\n")
    out.write(
        f"  store   {redact(store_url)}"
        + (" (transactional: ledger row and mark commit together)\n" if sql else "\n")
    )
    out.write(
        f"  {count} charges, {len(duplicates)} of them published twice with the same task id; "
        "one pool process is killed mid-charge\n\n"
    )
    out.flush()

    worker: subprocess.Popen[bytes] | None = None
    app: Any = None
    ok = False
    try:
        _demo.prepare_ledger(store_url, ledger, ledger_table)
        env = {
            **os.environ,
            "TASKONCE_DEMO_BROKER": broker_url,
            "TASKONCE_DEMO_QUEUE": queue,
            "TASKONCE_DEMO_STORE": store_url,
            "TASKONCE_DEMO_NS": namespace,
            "TASKONCE_DEMO_LEDGER": ledger,
            "TASKONCE_DEMO_DIR": str(workdir),
            "TASKONCE_DEMO_LEASE": str(LEASE),
        }
        command = [
            sys.executable, "-m", "celery", "-A", "taskonce.demo.celery_app", "worker",
            "-P", "prefork", "-c", "2", "-Q", queue, "-n", f"demo-{tag}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            "-l", os.environ.get("TASKONCE_DEMO_LOGLEVEL", "WARNING"),
        ]  # fmt: skip
        out.write("  starting the worker … ")
        out.flush()
        with open(workdir / "worker.log", "ab") as log:
            worker = subprocess.Popen(
                command,
                cwd=workdir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = started + DEADLINE
        while not (workdir / "ready").exists():
            if worker.poll() is not None or time.monotonic() > deadline:
                out.write("failed\n")
                _demo.tail(workdir / "worker.log", out)
                return 1
            time.sleep(0.05)
        out.write(f"ready (pid {worker.pid}) after {time.monotonic() - started:.1f}s\n")

        from celery import Celery

        app = Celery(f"taskonce-demo-publisher-{tag}", broker=broker_url, set_as_current=False)
        app.conf.update(
            broker_transport_options=broker_options(broker_url, namespace),
            broker_connection_retry_on_startup=True,
            task_ignore_result=True,
        )
        sending = time.monotonic()
        with warnings.catch_warnings(), app.producer_or_acquire() as producer:
            # kombu's SQLAlchemy transport uses an ORM option SQLAlchemy 2.1 deprecates
            warnings.simplefilter("ignore", DeprecationWarning)
            # Half the duplicates follow their original at once (they may meet it in flight),
            # the other half come after everything else (the original is long done).
            late = duplicates[1::2]
            for index, (order, cents, task_id) in enumerate(orders):
                again = index in duplicates and index not in late
                for _ in range(2 if again else 1):
                    app.send_task(
                        "taskonce_demo.charge",
                        args=(order, cents),
                        kwargs={"stall": index == victim},
                        task_id=task_id,
                        queue=queue,
                        producer=producer,
                    )
            for index in late:
                order, cents, task_id = orders[index]
                app.send_task(
                    "taskonce_demo.charge",
                    args=(order, cents),
                    kwargs={"stall": False},
                    task_id=task_id,
                    queue=queue,
                    producer=producer,
                )
        out.write(
            f"  sent {count} charges + {len(duplicates)} duplicates in "
            f"{time.monotonic() - sending:.1f}s\n"
        )
        out.flush()

        events = _demo.Events(workdir / "events.jsonl")
        progress = _demo.Progress(out, count)
        killed: str | None = None
        victim_file = workdir / "victim.pid"
        while True:
            counts = events.update()
            if killed is None and victim_file.exists():
                with contextlib.suppress(ValueError, ProcessLookupError):
                    pid = int(victim_file.read_text().strip() or 0)
                    os.kill(pid, signal.SIGKILL)
                    killed = f"  killed pool process {pid} in the middle of {orders[victim][0]}"
                    if progress.tty:
                        out.write("\r" + " " * 90 + "\r")
                    out.write(f"{killed} (SIGKILL)\n")
            progress.draw(counts[Event.COMPLETED.value], counts)
            finished = (
                counts[Event.COMPLETED.value] >= count
                and counts[Event.DUPLICATE_SKIPPED.value] >= len(duplicates)
                and killed is not None
            )
            if finished or time.monotonic() > deadline or worker.poll() is not None:
                break
            time.sleep(0.1)
        progress.end()
        if worker.poll() is not None:
            out.write("  the worker stopped unexpectedly:\n")
            _demo.tail(workdir / "worker.log", out)
        _demo.stop(worker)
        worker = None
        counts = events.update()

        rows, balance = _demo.read_ledger(store_url, ledger, ledger_table)
        expected = sum(cents for _, cents, _ in orders)
        delivered = sum(counts[name] for name in _DECISIONS)
        ran = counts[Event.CLAIMED.value] + counts[Event.LEASE_TAKEN_OVER.value]
        interrupted = ran - counts[Event.COMPLETED.value]
        ok = rows == count and balance == expected and counts[Event.COMPLETED.value] == count
        out.write("\n")
        lines = [
            ("sent", str(count + len(duplicates)),
             f"{count} charges + {len(duplicates)} re-published with the same task ids"),
            ("delivered", str(delivered),
             "messages a pool process picked up, redeliveries included"),
            ("ran", str(ran),
             f"{counts['completed']} charges completed"
             + (f" + {interrupted} killed mid-charge, its claim taken over, run again"
                if interrupted else "")),
            ("duplicates skipped", str(counts[Event.DUPLICATE_SKIPPED.value]),
             "acknowledged without running"),
            ("deferred in flight", str(counts[Event.IN_PROGRESS_DEFERRED.value]),
             "arrived while the charge was running: delivered again later"),
        ]  # fmt: skip
        return _demo.report(
            out,
            lines,
            ledger_rows=rows,
            orders=count,
            expected=expected,
            balance=balance,
            ok=ok,
            started=started,
            workdir=workdir,
        )
    except KeyboardInterrupt:
        out.write("\ninterrupted\n")
        return 130
    finally:
        if worker is not None:
            _demo.stop(worker)
        if app is not None:
            with contextlib.suppress(Exception):
                _clean_broker(app, broker_url, queue, namespace)
            app.close()
        with contextlib.suppress(Exception):
            _demo.clean_store(store_url, namespace, ledger_table, temporary=store is None)
        if ok and not os.environ.get("TASKONCE_DEMO_KEEP"):
            shutil.rmtree(workdir, ignore_errors=True)


def _clean_broker(app: Any, broker_url: str, queue: str, namespace: str) -> None:
    if broker_url.startswith("redis"):
        _demo.delete_redis_keys(broker_url, f"{namespace}:*")
    elif broker_url.startswith(("amqp", "pyamqp")):
        import importlib

        entity: Any = importlib.import_module("kombu.entity")  # kombu's typing is partial
        with app.connection_for_write() as conn:
            channel = conn.channel()
            entity.Queue(queue, channel=channel).delete()
            entity.Exchange(queue, channel=channel).delete()
