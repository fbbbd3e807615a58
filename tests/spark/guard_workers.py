"""Real worker processes around the framework-neutral :class:`taskonce.Guard`, for the audit's
end-to-end test: ``python -m tests.spark.guard_workers --events FILE ...``.

The supervisor opens one Redis store and one :class:`~taskonce.JsonlEvents` log, then forks
``--workers`` processes (``multiprocessing`` fork: the store and the log opened in the parent
are used in every child). Each worker pops messages from a Redis list (the "broker") and runs
them under the guard:

- ran → the handler's run is recorded (``RPUSH runs``), ``INCR final``;
- skipped (a duplicate) → ``INCR final``;
- deferred (in progress elsewhere) → pushed back after the guard's ``retry_after`` (a timer
  thread; the worker goes on), with ``deferred + 1``: the guard re-checks such a copy, and
  its event says so (``reason: "recheck"``);
- the handler raised (``fail_first`` on attempt 0) → pushed back with ``attempt + 1``: a retry.

A message is JSON ``{"id", "attempt", "fail_first", "slow"}``; ``"stop"`` ends a worker. A slow
handler sets ``started:<id>`` and sleeps 1.5 s, so the producer can deliver a duplicate while it
runs; that duplicate is deferred, then re-checked at a growing interval until the original has
ended, and skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import sys
import threading
import time
from typing import Any

import redis

import taskonce
from taskonce.guard import Delivery

QUEUE = "e2e"
TASK = "tests.spark.e2e.handle"
SLOW_SECONDS = 1.5


def _work(guard: taskonce.Guard, url: str, prefix: str) -> None:
    client = redis.Redis.from_url(url)
    inbox = f"{prefix}:broker"

    def handle(message: dict[str, Any], _id: str) -> str:
        # the guard fingerprints the arguments: only the id, which every copy and retry shares
        if message["slow"]:
            client.set(f"{prefix}:started:{message['id']}", "1")
            time.sleep(SLOW_SECONDS)
        if message["fail_first"] and message["attempt"] == 0:
            raise RuntimeError("first attempt fails")
        client.rpush(f"{prefix}:runs", message["id"])
        return str(message["id"])

    while True:
        popped = client.brpop([inbox], timeout=5)
        if popped is None:
            continue
        raw = popped[1].decode()
        if raw == "stop":
            return
        message = json.loads(raw)
        deferred = int(message.get("deferred", 0))
        delivery = Delivery(
            message["id"], QUEUE, task=TASK, attempt=message["attempt"], deferred=deferred
        )
        try:
            outcome = guard.execute(delivery, functools.partial(handle, message), (message["id"],))
        except taskonce.InProgressElsewhere as exc:
            # deliver it again later, as a broker's delayed retry would; this worker goes on
            again = json.dumps({**message, "deferred": deferred + 1})
            timer = threading.Timer(exc.retry_after, client.lpush, (inbox, again))
            timer.daemon = True
            timer.start()
            continue
        except RuntimeError:
            client.lpush(inbox, json.dumps({**message, "attempt": message["attempt"] + 1}))
            continue
        assert outcome.status in ("ran", "skipped"), outcome
        client.incr(f"{prefix}:final")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis", required=True, help="Redis URL for the store and the broker")
    parser.add_argument("--prefix", required=True, help="Redis key prefix of this run")
    parser.add_argument("--events", required=True, help="the JSONL event log")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--lease", type=float, default=6.0)
    args = parser.parse_args(argv)
    store = taskonce.open_store(args.redis, prefix=f"{args.prefix}:store")
    guard = taskonce.Guard(
        store,
        default=taskonce.Policy(mode="eager", lease=args.lease, keep_for=3600),
        events=[taskonce.JsonlEvents(args.events)],
    )
    context = multiprocessing.get_context("fork")
    workers = [
        context.Process(target=_work, args=(guard, args.redis, args.prefix), daemon=True)
        for _ in range(args.workers)
    ]
    for worker in workers:
        worker.start()
    redis.Redis.from_url(args.redis).set(f"{args.prefix}:ready", str(os.getpid()))
    codes = []
    for worker in workers:
        worker.join()
        codes.append(worker.exitcode)
    guard.close()
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
