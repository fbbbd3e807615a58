"""What taskonce costs a Django project, beside the same work without it, in one run.

- **A transactional task.** The body of a Django task — ``Order`` updated, a ``Payment``
  created through the ORM — run as a careful task runs it without taskonce (inside
  ``transaction.atomic()``), against the same body guarded with ``transactional: True`` on a
  ``django://default`` store (eager: claim, the body and the completion in one transaction;
  lazy with ``check_first: False``: the body and the mark in one transaction, no look-up).
  In-process through ``Guard.execute`` (the framework's own cost is the same either way).
- **A view that sends.** ``Order.objects.create`` and ``charge.delay(pk)`` in
  ``transaction.atomic()``: plain ``transaction.on_commit(lambda: charge.delay(pk))``, against
  ``taskonce.django_ext.send_on_commit()`` (the send written as a row in the transaction,
  published from on_commit, marked sent). Celery on a redis-server of the benchmark's own.

PostgreSQL, database ``taskonce_bench`` (created, and emptied afterwards). Variants alternate
batch by batch; each ratio is the median of a variant's batches over the median of the
baseline's beside it.

    .venv/bin/python bench/django_cost.py [--messages 300] [--rounds 7] [--write-docs]
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as h

DB = "taskonce_bench"


def configure() -> None:
    import django
    import psycopg
    from django.conf import settings

    with psycopg.connect("host=127.0.0.1 user=postgres dbname=test", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB,)).fetchone():
            conn.execute(f'CREATE DATABASE "{DB}"')
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": DB,
                "USER": "postgres",
                "HOST": "127.0.0.1",
                "CONN_MAX_AGE": None,  # a worker's connection lives across tasks
            }
        },
        INSTALLED_APPS=["django.contrib.contenttypes", "taskonce.django_ext", "djangobench"],
        TASKONCE={"STORE": "django://default"},
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
        USE_TZ=True,
    )
    django.setup()
    from django.core.management import call_command

    call_command("migrate", run_syncdb=True, verbosity=0)


def empty() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "TRUNCATE djangobench_payment, djangobench_order, taskonce_keys, taskonce_keys_live"
        )


def per_message(run: Callable[[int], object], n: int) -> float:
    """Wall µs per call of ``run`` over ``n`` calls."""
    import time

    start = time.perf_counter()
    for i in range(n):
        run(i)
    return (time.perf_counter() - start) * 1e6 / n


def task_variants(messages: int) -> dict[str, Callable[[int], object]]:
    from django.db import transaction
    from djangobench.models import Order, Payment

    from taskonce import Delivery, Guard
    from taskonce.django_ext import DjangoStore

    orders = [Order.objects.create(ref=str(i)).pk for i in range(messages)]

    def body(i: int) -> None:
        Order.objects.filter(pk=orders[i]).update(paid=True)
        Payment.objects.create(order_id=orders[i], cents=500)

    def plain(i: int) -> None:
        with transaction.atomic():
            body(i)

    guards = {
        "eager": Guard(DjangoStore(), default={"mode": "eager", "transactional": True}),
        "lazy": Guard(
            DjangoStore(),
            default={"mode": "lazy", "transactional": True, "check_first": False},
        ),
    }

    def guarded(mode: str) -> Callable[[int], object]:
        guard = guards[mode]

        def run(i: int) -> object:
            delivery = Delivery(uuid.uuid4().hex, "payments", task="shop.charge")
            return guard.execute(delivery, body, (i,))

        return run

    return {
        "plain, in atomic()": plain,
        "taskonce eager, transactional": guarded("eager"),
        "taskonce lazy, transactional, check_first False": guarded("lazy"),
    }


def view_variants(broker_url: str) -> tuple[dict[str, Callable[[int], object]], Any]:
    from celery import Celery
    from django.db import transaction
    from djangobench.models import Order

    from taskonce import Guard
    from taskonce.celery_ext import IdempotentTask, setup
    from taskonce.django_ext import DjangoStore, send_on_commit

    app = Celery("bench", broker=broker_url, set_as_current=False)
    guard = Guard(DjangoStore())
    setup(app, guard)

    @app.task(base=IdempotentTask, acks_late=True, name="shop.charge")
    def charge(order_id: int) -> None: ...

    def plain(i: int) -> None:
        with transaction.atomic():
            order = Order.objects.create(ref=str(i))
            transaction.on_commit(lambda: charge.delay(order.pk))

    def outbox(i: int) -> None:
        with transaction.atomic(), send_on_commit(guard=guard):
            order = Order.objects.create(ref=str(i))
            charge.delay(order.pk)

    return {"plain on_commit(delay)": plain, "send_on_commit()": outbox}, app


def measure(
    variants: dict[str, Callable[[int], object]], messages: int, rounds: int
) -> dict[str, float]:
    names = list(variants)
    for name in names:  # warm up: connections, compiled statements
        per_message(variants[name], min(20, messages))
    runs: dict[str, list[float]] = {name: [] for name in names}
    for _, name in h.interleaved(rounds, names):
        runs[name].append(per_message(variants[name], messages))
        empty_payments()
    return {name: h.med(values) for name, values in runs.items()}


def empty_payments() -> None:
    from django.db import connection

    with connection.cursor() as cursor:  # keep the tables small and alike for every batch
        cursor.execute("TRUNCATE djangobench_payment, taskonce_keys")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    load_start = h.loadavg()
    configure()
    empty()
    rows = []
    tasks = measure(task_variants(args.messages), args.messages, args.rounds)
    base = tasks["plain, in atomic()"]
    for name, value in tasks.items():
        rows.append(("a transactional task", name, f"{value:,.0f}", f"{value / base:.2f}×"))
    server = h.RedisServer().start()
    try:
        variants, _app = view_variants(server.url)  # the app must live while it publishes
        views = measure(variants, args.messages, args.rounds)
        base = views["plain on_commit(delay)"]
        for name, value in views.items():
            rows.append(("a view that sends", name, f"{value:,.0f}", f"{value / base:.2f}×"))
    finally:
        server.kill()
        empty()
    import django

    text = h.table(("work", "variant", "µs per message (median)", "ratio"), rows, "llrr")
    command = h.command_line("bench/django_cost.py")
    text += "\n\n" + h.measured_line(
        command, load_start, [f"Django {django.__version__}", "PostgreSQL 127.0.0.1"]
    )
    print(text)
    if args.write_docs:
        h.write_block("django-cost", text)


if __name__ == "__main__":
    main()
