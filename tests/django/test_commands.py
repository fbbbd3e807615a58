"""``manage.py taskonce``: the ``taskonce`` command's verbs on the project's store, with the same
output and exit statuses; run as ``python -m django taskonce …`` in subprocesses (exit statuses,
stderr) and through ``call_command`` in this process."""

from __future__ import annotations

import io
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import taskonce
from taskonce.cli import main as taskonce_main
from tests.django.ops_fixtures import (
    CLAIMED,
    EXPIRED,
    HANDLED,
    KEYS,
    OTHER,
    SENDING,
    db_name,
    django,
    project_store,
    put_records,
    settings_module,
)


@pytest.fixture
def store() -> Iterator[Any]:
    yield from project_store()


def sql_url() -> str:
    """The same database as ``django://default``, as the taskonce command's SQL store URL."""
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{db_name()}"


def cli(*argv: str) -> tuple[int, str]:
    """The ``taskonce`` command itself, on the same table through an SQL URL."""
    out = io.StringIO()
    code = taskonce_main([*argv, "--store", sql_url()], out=out)
    return code, out.getvalue()


def test_stats_prints_what_the_taskonce_command_prints(store: Any) -> None:
    put_records(store)
    run = django("taskonce", "stats")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "DjangoStore django://default (table taskonce_keys)"
    code, text = cli("stats")
    assert code == 0
    assert lines[1:] == text.splitlines()[1:]  # all but the store's description
    assert any(line.split()[:3] == ["payments", "2", "2"] for line in lines)
    run = django("taskonce", "stats", "--json", "--queue", "emails")
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert (data["queue"], data["keys"], data["sends_pending"]) == ("emails", 2, 1)


def test_inspect_a_record_and_a_missing_key(store: Any) -> None:
    put_records(store)
    run = django("taskonce", "inspect", CLAIMED, "--utc")
    assert run.returncode == 0, run.stderr
    ticking = re.compile(r"^lease left .*$", re.M)  # seconds pass between the two runs
    assert ticking.sub("", run.stdout) == ticking.sub("", cli("inspect", CLAIMED, "--utc")[1])
    assert ticking.search(run.stdout)
    assert "state        claimed" in run.stdout
    run = django("taskonce", "inspect", "--queue", "emails", "m-sending", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["key"] == SENDING
    # no live record: exit status 1, the similar live keys suggested, as the command does
    run = django("taskonce", "inspect", "refunds:m-claimed")
    assert run.returncode == 1
    assert run.stdout == cli("inspect", "refunds:m-claimed")[1]
    assert "live keys ending in ':m-claimed': payments:m-claimed" in run.stdout


def test_release_deletes_that_record_only(store: Any) -> None:
    put_records(store)
    run = django("taskonce", "release", CLAIMED)
    assert (run.returncode, run.stdout) == (0, f"released {CLAIMED!r}\n"), run.stderr
    assert store.get(CLAIMED) is None
    assert all(store.get(key) is not None for key in (OTHER, HANDLED, SENDING))
    run = django("taskonce", "release", CLAIMED)
    assert run.returncode == 1
    assert run.stdout.startswith(f"no live record for key {CLAIMED!r}: nothing released\n")


def test_purge_deletes_the_expired_records(store: Any) -> None:
    put_records(store)
    run = django("taskonce", "purge", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"deleted": 1}
    from taskonce.django_ext.models import Record

    assert sorted(Record.objects.using("default").values_list("key", flat=True)) == sorted(
        set(KEYS) - {EXPIRED}
    )


def test_bad_verbs_and_options_exit_2(store: Any) -> None:
    run = django("taskonce", "bogus")
    assert run.returncode == 2
    assert "invalid choice: 'bogus' (choose from 'stats', 'inspect', 'release', 'purge'" in (
        run.stderr
    )
    run = django("taskonce")
    assert run.returncode == 2
    assert "the following arguments are required: verb" in run.stderr
    for verb in ("demo", "audit", "init-db", "bench"):  # the command's other verbs: not here
        assert django("taskonce", verb).returncode == 2
    # relay publishes with the project's guard: another store is refused, saying why
    run = django("taskonce", "relay", "--store", "redis://127.0.0.1:6379/0")
    assert run.returncode == 2
    assert (
        "CommandError: manage.py taskonce relay publishes with the project's guard, whose store "
        'is settings.TASKONCE["STORE"]: --store cannot name another; to relay the sends of '
        "another store, run: taskonce relay --store URL --celery-app MODULE:app"
    ) in run.stderr
    run = django("taskonce", "inspect")
    assert run.returncode == 2
    assert "taskonce inspect: error: the following arguments are required: KEY" in run.stderr
    # Django's own options may follow the verb too
    run = django("taskonce", "stats", "--settings", "tests.django_project.settings")
    assert run.returncode == 0, run.stderr


def test_store_names_another_store_than_the_projects(store: Any, tmp_path: Path) -> None:
    put_records(store)  # in the project's store, not in the one named
    other = taskonce.open_store(f"sqlite:///{tmp_path / 'other.db'}")
    try:
        assert other.mark("jobs:m-1", 3600.0, None, None)
    finally:
        other.close()
    for argv in (
        ["--store", f"sqlite:///{tmp_path / 'other.db'}"],
        [f"--store=sqlite:///{tmp_path / 'other.db'}"],
    ):
        run = django("taskonce", "inspect", "jobs:m-1", *argv)
        assert run.returncode == 0, run.stderr
        assert "jobs:m-1" in run.stdout and "marked" in run.stdout
        run = django("taskonce", "inspect", HANDLED, *argv)
        assert run.returncode == 1  # the project's record is not in that store


def test_help_lists_the_verbs_options(store: Any) -> None:
    run = django("taskonce", "inspect", "--help")
    assert run.returncode == 0
    assert run.stdout.startswith("usage: python -m django taskonce inspect")
    assert "--queue QUEUE" in run.stdout and "--store" not in run.stdout


def test_a_store_setting_that_cannot_work_exits_2(store: Any, tmp_path: Path) -> None:
    path = settings_module(tmp_path, "nostore_settings", 'TASKONCE = {"STORE": "django://nope"}')
    run = django("taskonce", "stats", settings="nostore_settings", extra_path=path)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "taskonce: error: store django://nope: no database 'nope' in settings.DATABASES "
        "(there: default, mariadb, sqlite)"
    )
    path = settings_module(tmp_path, "badstore_settings", 'TASKONCE = {"STORE": 42}')
    run = django("taskonce", "stats", settings="badstore_settings", extra_path=path)
    assert run.returncode == 2
    assert run.stderr.strip() == (
        'CommandError: settings.TASKONCE["STORE"] must be a store URL such as '
        '"django://default" or "redis://localhost:6379/0", not 42'
    )


def test_relay_without_a_publisher_says_how_to_register_one(store: Any) -> None:
    run = django("taskonce", "relay", "--once")
    assert run.returncode == 2
    assert "the project's guard has no publisher" in run.stderr
    assert "taskonce.celery_ext.setup(app, taskonce.django_ext.guard())" in run.stderr


def test_call_command_raises_command_error_with_the_exit_status(store: Any) -> None:
    from django.core.management import CommandError, call_command

    put_records(store)
    out = io.StringIO()
    call_command("taskonce", "inspect", HANDLED, stdout=out)
    assert "state        marked" in out.getvalue()
    with pytest.raises(CommandError) as raised:
        call_command("taskonce", "inspect", "nope:x", stdout=io.StringIO())
    assert raised.value.returncode == 1
    assert str(raised.value) == "taskonce inspect ended with exit status 1"
    with pytest.raises(CommandError) as raised:
        call_command("taskonce", "bogus")
    assert "invalid choice: 'bogus'" in str(raised.value)


def test_relay_publishes_through_the_projects_celery_app(store: Any) -> None:
    """A record whose sends were never published (the broker was down when its handler
    finished); the project's Celery app, set up with the project's guard, publishes them."""
    import celery
    from django.core.management import call_command

    from taskonce import Guard, handoff
    from taskonce.celery_ext import setup
    from taskonce.django_ext import DjangoStore, guard

    stranding = Guard(DjangoStore("default"))

    def down(send: Any) -> None:
        raise ConnectionError("broker down")

    stranding.register_publisher("celery", down)

    def body() -> None:
        capture = handoff.current()
        assert capture is not None
        capture.add("celery", {"task": "shop.ship", "args": [7]}, message_id="child-7")

    stranding.run("m-stranded", "orders", body)
    stranding.close()
    assert store.get("orders:m-stranded").sends_pending

    # kombu's memory:// transport keeps its queues per process, for every app: a queue of this
    # test's own, so a message another file's test left in "celery" is not the one read back.
    queue = f"djops-{uuid.uuid4().hex[:10]}"
    app = celery.Celery("djops_relay", broker="memory://", set_as_current=False)
    app.conf.task_default_queue = queue
    setup(app, guard())
    out = io.StringIO()
    call_command("taskonce", "relay", "--once", "--older-than", "0", stdout=out)
    assert out.getvalue() == "published the pending sends of 1 record(s)\n"
    assert not store.get("orders:m-stranded").sends_pending
    with app.connection_for_read() as connection:
        message = connection.SimpleQueue(queue).get(timeout=5)
        assert message.headers["id"] == "child-7"
        assert message.headers["task"] == "shop.ship"
        message.ack()


def test_relay_publishes_through_django_dramatiqs_broker(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With django_dramatiq installed, the broker DRAMATIQ_BROKER describes carries taskonce's
    middleware on the project's guard; ``manage.py taskonce relay`` publishes through it."""
    import uuid

    import pika

    from taskonce import Guard, handoff
    from taskonce.django_ext import DjangoStore
    from tests.helpers import require_service

    require_service("rabbitmq")
    queue = f"djops_relay_{uuid.uuid4().hex[:8]}"
    stranding = Guard(DjangoStore("default"))

    def down(send: Any) -> None:
        raise ConnectionError("broker down")

    stranding.register_publisher("dramatiq", down)

    def body() -> None:
        capture = handoff.current()
        assert capture is not None
        message = {"queue_name": queue, "actor_name": "ship", "args": [7], "kwargs": {}}
        capture.add("dramatiq", {**message, "message_timestamp": 1}, message_id="child-d7")

    stranding.run("m-stranded-d", "orders", body)
    stranding.close()
    assert store.get("orders:m-stranded-d").sends_pending

    monkeypatch.setenv("TASKONCE_DJANGO_DRAMATIQ", "1")  # django_dramatiq in INSTALLED_APPS
    run = django("taskonce", "relay", "--once", "--older-than", "0")
    assert (run.returncode, run.stdout) == (
        0,
        "published the pending sends of 1 record(s)\n",
    ), run.stderr
    assert not store.get("orders:m-stranded-d").sends_pending
    connection = pika.BlockingConnection(pika.URLParameters("amqp://guest:guest@127.0.0.1:5672"))
    try:
        channel = connection.channel()
        method, _, payload = channel.basic_get(queue, auto_ack=True)
        assert method is not None
        assert json.loads(payload)["message_id"] == "child-d7"
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ"):
            channel.queue_delete(name)
    finally:
        connection.close()
