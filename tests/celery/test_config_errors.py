"""A configuration that can never run a guarded task stops the worker at start; a configuration
error met at run time rejects the message without requeue — never acknowledges (loses) it.

In process for the moments (finalize, the worker-start check, the tracer's handling), and with
real ``celery worker`` processes: refusing to start (both ways a guard is configured), and a
message dead-lettered by RabbitMQ with its body not run.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.app.trace import build_tracer
from celery.exceptions import Reject

import taskonce
from taskonce.celery_ext import IdempotentTask, setup
from taskonce.celery_ext.config import EXIT_CONFIG, _check_at_worker_start
from tests.celery.conftest import (
    MATRIX_DB,
    QUEUE_NAMES,
    Table,
    Worker,
    broker_url,
    clean_broker,
    drop_store,
    new_prefix,
    publisher,
    start_stack,
    stop_stack,
    store_url,
    worker_env,
)
from tests.celery.queues import dead_lettered_queue
from tests.helpers import free_port, wait_for

WANTS_SQL = {"transactional": True}


def make_app(**conf: Any) -> Celery:
    app = Celery(f"cfg-{uuid.uuid4().hex[:6]}", broker="memory://", set_as_current=False)
    app.conf.update(task_default_queue="work", **conf)
    return app


def declare_wants_sql(app: Celery) -> Any:
    @app.task(base=IdempotentTask, shared=False, acks_late=True, name="ship", idempotency=WANTS_SQL)
    def ship() -> str:
        return "shipped"

    return ship


# -- in process ------------------------------------------------------------------------------


def test_setup_before_the_task_is_declared_fails_at_finalize() -> None:
    """The issue's order: setup(app, guard) first, tasks after; finalize (which every worker
    does at start) raises instead of logging."""
    app = make_app()
    setup(app, taskonce.Guard(taskonce.MemoryStore(), queues={"payments": {"mode": "lazy"}}))
    declare_wants_sql(app)
    with pytest.raises(taskonce.ConfigError) as info:
        app.finalize()
    text = str(info.value)
    assert "task 'ship'" in text
    assert "needs an SQL store" in text


def test_a_task_declared_on_a_finalized_app_with_a_guard_fails_at_once() -> None:
    app = make_app()
    setup(app, taskonce.Guard(taskonce.MemoryStore()))
    app.finalize()
    with pytest.raises(taskonce.ConfigError, match=r"task 'ship'.*needs an SQL store"):
        declare_wants_sql(app)


def test_worker_start_check_stops_the_worker_of_a_settings_configured_app(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app(taskonce_store="memory://")
    declare_wants_sql(app)
    app.finalize()  # no guard yet: built from the settings when the worker starts
    with (
        caplog.at_level(logging.CRITICAL, logger="taskonce.celery"),
        pytest.raises(SystemExit) as info,
    ):
        _check_at_worker_start(sender=SimpleNamespace(app=app))
    assert info.value.code == EXIT_CONFIG
    assert "task 'ship'" in caplog.text
    assert "needs an SQL store" in caplog.text
    assert caplog.text.rstrip().endswith("the worker does not start")


def test_config_error_at_run_time_is_rejected_without_requeue(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What the worker's tracer does with it: REJECTED (Reject, requeue=False), not FAILURE."""
    app = make_app()
    setup(app, taskonce.Guard(taskonce.MemoryStore()))
    runs: list[int] = []

    @app.task(base=IdempotentTask, shared=False, acks_late=True, name="later")
    def later() -> None:
        runs.append(1)

    app.finalize()
    later.idempotency = WANTS_SQL  # changed after the checks: met only when a message runs
    tracer = build_tracer(later.name, later, app=app, eager=False, propagate=False)
    with caplog.at_level(logging.ERROR, logger="taskonce.celery"):
        _, info, _, _ = tracer("id-1", (), {}, {"id": "id-1", "delivery_info": {}})
    assert runs == []
    assert info.state == "REJECTED"
    assert isinstance(info.retval, Reject) and info.retval.requeue is False
    assert "later[id-1] not run: configuration error" in caplog.text
    assert "rejected without requeue, not acknowledged" in caplog.text
    with pytest.raises(taskonce.ConfigError, match="needs an SQL store"):
        later.apply(task_id="id-2", throw=True)  # eager runs raise the error itself
    assert runs == []


# -- real workers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("configured_by", "extra"),
    [("setup", {}), ("settings", {"TO_BY_SETTINGS": "1"})],
    ids=["setup", "settings"],
)
def test_real_worker_refuses_to_start_with_a_task_that_needs_an_sql_store(
    tmp_path: Path, configured_by: str, extra: dict[str, str]
) -> None:
    prefix = new_prefix()
    burl = broker_url("redis", MATRIX_DB)
    surl, namespace = store_url("redis")
    env = worker_env(
        prefix, burl, surl, namespace, tmp_path / "events.jsonl", {"TO_BAD_TASK": "1", **extra}
    )
    worker = Worker(tmp_path, env, [f"{prefix}.{name}" for name in QUEUE_NAMES]).launch()
    try:
        wait_for(lambda: not worker.alive(), timeout=60, what="the worker to refuse to start")
        assert worker.process is not None
        code = worker.process.returncode
        output = worker.log()
        # Both ways of configuring end the same: one line and EX_CONFIG (setup() once raised
        # out of the app's finalize with a traceback and status 1).
        assert code == EXIT_CONFIG, output
        assert "task 't.wants_sql'" in output
        assert "needs an SQL store" in output
        assert "the worker does not start" in output
        assert "Traceback" not in output
        assert not worker.ready_file.exists()
    finally:
        worker.stop()
        app = publisher(burl, prefix)
        clean_broker(app, burl, prefix, [f"{prefix}.{name}" for name in QUEUE_NAMES])
        app.close()
        drop_store(surl, namespace)


@pytest.fixture
def dlx_stack(tmp_path: Path) -> Iterator[Any]:
    """A RabbitMQ-broker / Redis-store worker whose ``eager`` queue dead-letters into
    ``{prefix}.dead``, and whose ``t.misconfigured`` meets a ConfigError in every pool process."""
    running = start_stack(
        tmp_path, "rabbitmq", "redis", extra_env={"TO_DLX": "1", "TO_BREAK_AT_RUN": "1"}
    )
    dead = f"{running.prefix}.dead"
    from kombu import Queue

    with running.app.connection_for_write() as conn:
        Queue(dead, channel=conn.channel()).declare()
    try:
        yield running
    finally:
        try:
            with running.app.connection_for_write() as conn:
                Queue(dead, channel=conn.channel()).delete()
        finally:
            stop_stack(running)


def test_real_worker_dead_letters_a_message_that_meets_a_config_error(
    dlx_stack: Any, runs: Table
) -> None:
    stack = dlx_stack
    task_id = f"cfg-{uuid.uuid4().hex[:8]}"
    stack.app.send_task(
        "t.misconfigured",
        args=(runs.name, "never"),
        task_id=task_id,
        queue=dead_lettered_queue(stack.prefix),
    )

    def dead_lettered() -> Any:
        with stack.app.connection_for_write() as conn:
            message = conn.default_channel.basic_get(f"{stack.prefix}.dead", no_ack=True)
        return message

    message = wait_for(dead_lettered, timeout=40, what="the message in the dead-letter queue")
    assert message.headers["id"] == task_id
    death = message.headers["x-death"][0]
    assert death["reason"] == "rejected"
    assert death["queue"] == stack.q("eager")
    assert runs.count("never") == 0  # the body never ran
    assert stack.events(task_id) == []  # nothing claimed, nothing recorded
    output = stack.worker.log()
    assert f"t.misconfigured[{task_id}] not run: configuration error" in output
    assert "needs an SQL store" in output
    assert "rejected without requeue, not acknowledged" in output
    assert stack.worker.alive()


def test_real_worker_refuses_to_start_on_a_settings_typo_met_by_setup_at_import(
    tmp_path: Path,
) -> None:
    """setup(app) at module level raises while `celery worker` imports the app: before, the
    command said it could not import the module, with a traceback, exit 2."""
    prefix = new_prefix()
    burl = broker_url("redis", MATRIX_DB)
    surl, namespace = store_url("redis")
    env = worker_env(
        prefix, burl, surl, namespace, tmp_path / "events.jsonl", {"TO_SETTINGS_TYPO": "1"}
    )
    worker = Worker(tmp_path, env, [f"{prefix}.{name}" for name in QUEUE_NAMES]).launch()
    try:
        wait_for(lambda: not worker.alive(), timeout=60, what="the worker to refuse to start")
        assert worker.process is not None
        output = worker.log()
        assert worker.process.returncode == EXIT_CONFIG, output
        assert "Traceback" not in output and "Couldn't import" not in output
        (line,) = [line for line in output.splitlines() if line.strip()]
        assert "setting taskonce_default: unknown Policy field(s) mdoe" in line
        assert "did you mean 'mode'?" in line
        assert line.endswith("the worker does not start")
    finally:
        worker.stop()


@pytest.mark.parametrize("configured_by", ["setup", "settings"])
def test_real_worker_refuses_to_start_when_its_store_does_not_answer(
    tmp_path: Path, runs: Table, configured_by: str
) -> None:
    """A wrong port in the store URL: the worker waits taskonce_start_timeout, then exits 78
    with one line before it consumes anything; the message waiting in the broker runs once a
    worker with the right URL starts."""
    prefix = new_prefix()
    burl = broker_url("redis", MATRIX_DB)
    surl, namespace = store_url("redis")
    wrong = f"redis://127.0.0.1:{free_port()}/0"
    queues = [f"{prefix}.{name}" for name in QUEUE_NAMES]
    app = publisher(burl, prefix)
    extra = {"TO_START_TIMEOUT": "2"}
    if configured_by == "settings":
        extra["TO_BY_SETTINGS"] = "1"
    try:
        sent = app.send_task("t.record", args=(runs.name, "waiting"), queue=f"{prefix}.eager")
        env = worker_env(prefix, burl, wrong, namespace, tmp_path / "events.jsonl", extra)
        worker = Worker(tmp_path, env, queues).launch()
        try:
            wait_for(lambda: not worker.alive(), timeout=60, what="the worker to refuse to start")
            assert worker.process is not None
            output = worker.log()
            assert worker.process.returncode == EXIT_CONFIG, output
            refusal = [line for line in output.splitlines() if "does not start" in line]
            assert len(refusal) == 1, output
            assert "could not be reached within 2 s" in refusal[0]
            assert "check its URL" in refusal[0]
            assert "Connection refused" in refusal[0]
            # the one line: no outage warning before it (the store never answered)
            assert "stopped answering" not in output and "unreachable" not in output
            assert "Traceback" not in output
            assert not worker.ready_file.exists()
        finally:
            worker.stop()
        assert runs.count("waiting") == 0
        right = worker_env(prefix, burl, surl, namespace, tmp_path / "events.jsonl")
        good = Worker(tmp_path / "right", right, queues)
        (tmp_path / "right").mkdir()
        good.start()
        try:
            wait_for(lambda: runs.count("waiting") == 1, timeout=30, what="the message to run")
            assert [row[2] for row in runs.rows("waiting")] == [sent.id]
        finally:
            good.stop()
    finally:
        clean_broker(app, burl, prefix, queues)
        app.close()
        drop_store(surl, namespace)
