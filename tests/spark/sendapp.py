"""The Celery app and task that ``send_rows`` sends to in the Spark tests (imported on the
executors by path, so it lives in a module of its own).

``flaky_export`` stands in for ``export_row`` and makes the first attempt of Spark partition 0
fail after it has sent ``FAIL_AFTER`` rows — the situation deterministic ids are for: Spark runs
the task again and the second attempt sends the whole partition, the first rows a second time.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

BROKER_URL = os.environ.get("TASKONCE_TEST_BROKER", "redis://127.0.0.1:6379/9")
FAIL_AFTER = 3

app = Celery("taskonce_spark_tests", broker=BROKER_URL, set_as_current=False)
app.conf.broker_connection_retry_on_startup = False
app.conf.broker_transport_options = {"socket_timeout": 5}


@app.task(name="tests.spark.sendapp.export_row")
def export_row(**row: Any) -> dict[str, Any]:
    """The consumer-side handler's name and signature (the test's consumer runs its own)."""
    return row


class FlakyFirstAttempt:
    """``apply_async`` that raises in the first attempt of partition 0 after ``fail_after``
    sends, then delegates as usual (also in the retry)."""

    def __init__(self, task: Any, fail_after: int) -> None:
        self.task = task
        self.fail_after = fail_after
        self.sent: dict[int, int] = {}

    def apply_async(self, **options: Any) -> Any:
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is not None and context.partitionId() == 0 and context.attemptNumber() == 0:
            attempt = context.taskAttemptId()
            if self.sent.get(attempt, 0) >= self.fail_after:
                raise RuntimeError(
                    f"injected failure after {self.fail_after} rows (partition 0, attempt 0)"
                )
            self.sent[attempt] = self.sent.get(attempt, 0) + 1
        return self.task.apply_async(**options)


flaky_export = FlakyFirstAttempt(export_row, FAIL_AFTER)


# -- Dramatiq ------------------------------------------------------------------------------

import dramatiq  # noqa: E402
from dramatiq.brokers.redis import RedisBroker  # noqa: E402

DRAMATIQ_NAMESPACE = "taskonce-spark-tests"
DRAMATIQ_QUEUE = "spark_send"
dramatiq_broker = RedisBroker(url=BROKER_URL, namespace=DRAMATIQ_NAMESPACE)


@dramatiq.actor(broker=dramatiq_broker, queue_name=DRAMATIQ_QUEUE)
def export_row_actor(**row: Any) -> None:
    """A Dramatiq actor for ``send_rows`` (the test reads its messages from Redis)."""
