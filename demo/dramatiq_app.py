"""The Dramatiq app of ``taskonce demo --framework dramatiq``: one guarded ``charge`` actor.

The demo (:mod:`taskonce.demo.dramatiq_demo`) starts ``python -m dramatiq
taskonce.demo.dramatiq_app:broker`` with these environment variables:

- ``TASKONCE_DEMO_BROKER``: ``redis://…`` or ``amqp://…``.
- ``TASKONCE_DEMO_QUEUE``: the queue of the ``charge`` actor (also the Redis key namespace).
- ``TASKONCE_DEMO_STORE``, ``TASKONCE_DEMO_NS``: store URL and its table (SQL) or prefix
  (Redis).
- ``TASKONCE_DEMO_LEDGER``: ``sql:<table>`` — the charge is written through
  :func:`taskonce.current_session` into this table of the store's database (transactional:
  the ledger row and the mark commit together); or ``sqlite:<path>`` — a local SQLite ledger
  written after the work (Redis store).
- ``TASKONCE_DEMO_DIR``: where the events file, the ready files and the victim's pid go.
- ``TASKONCE_DEMO_LEASE``: the claim lease in seconds.

Importing the module without ``TASKONCE_DEMO_BROKER`` builds nothing.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import dramatiq

import taskonce
from taskonce.demo import common as _demo
from taskonce.dramatiq_ext.middleware import IdempotencyMiddleware

ENV = os.environ
#: the pid file the victim charge writes before it stalls (the demo SIGKILLs that process)
VICTIM_FILE = "victim.pid"
#: a Redis broker counts a worker as dead after this long without a heartbeat (ms)
HEARTBEAT_TIMEOUT = 5000

logger = logging.getLogger("taskonce.demo")


class _Ready(dramatiq.Middleware):
    """Writes ``ready-<pid>`` into the demo's directory once a worker process consumes."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir

    def after_worker_boot(self, broker: dramatiq.Broker, worker: dramatiq.Worker) -> None:
        (self.workdir / f"ready-{os.getpid()}").write_text(str(os.getpid()))


def make_broker(url: str, namespace: str) -> dramatiq.Broker:
    """The demo's broker (the worker's and the publisher's)."""
    if url.startswith("amqp"):
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=url)
    from dramatiq.brokers.redis import RedisBroker

    # A killed worker's fetched messages go back once its heartbeat is HEARTBEAT_TIMEOUT old;
    # queue maintenance (which moves them) runs on one command in ten instead of one in 1000.
    return RedisBroker(  # type: ignore[no-untyped-call]
        url=url,
        namespace=namespace,
        heartbeat_timeout=HEARTBEAT_TIMEOUT,
        maintenance_chance=100_000,
    )


def build() -> tuple[dramatiq.Broker, dramatiq.Actor[Any, Any]]:
    """The worker's broker, with the guard, and the ``charge`` actor."""
    broker_url = ENV["TASKONCE_DEMO_BROKER"]
    queue = ENV["TASKONCE_DEMO_QUEUE"]
    store_url = ENV["TASKONCE_DEMO_STORE"]
    namespace = ENV["TASKONCE_DEMO_NS"]
    ledger = ENV["TASKONCE_DEMO_LEDGER"]
    workdir = Path(ENV["TASKONCE_DEMO_DIR"])
    lease = float(ENV.get("TASKONCE_DEMO_LEASE", "4"))
    sql_store = not store_url.startswith(("redis", "rediss", "unix", "memory"))
    store_options = {"table": namespace} if sql_store else {"prefix": namespace}
    guard = taskonce.Guard(
        taskonce.open_store(store_url, **store_options),
        default=taskonce.Policy(mode="eager", lease=lease, transactional=sql_store),
        events=[taskonce.JsonlEvents(workdir / "events.jsonl")],
    )
    broker = make_broker(broker_url, queue)
    broker.add_middleware(IdempotencyMiddleware(guard, store_error_min_backoff=500))
    broker.add_middleware(_Ready(workdir))

    def charge(order_id: str, cents: int, stall: bool = False) -> int:
        """Charge an order: a little work, then one ledger row. ``stall`` makes the first run
        write its pid and hang, so the demo can SIGKILL the process mid-charge."""
        time.sleep(0.01)
        victim = workdir / VICTIM_FILE
        if stall and not victim.exists():
            victim.write_text(str(os.getpid()))
            time.sleep(60)
        _demo.write_ledger(ledger, order_id, cents)
        return cents

    declare = dramatiq.actor(broker=broker, actor_name="charge", queue_name=queue, max_retries=3)
    return broker, declare(charge)


if "TASKONCE_DEMO_BROKER" in ENV:
    broker, charge = build()
