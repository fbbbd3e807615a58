"""System checks (``manage.py check``): each check's id and text, in this process with
``override_settings``, and ``python -m django check`` / ``migrate`` in subprocesses."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from taskonce.errors import ConfigError
from taskonce.policy import Policy
from tests.django.ops_fixtures import db_name, django, project_store, settings_module
from tests.helpers import require_service, wait_for

UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"  # port 1: nothing listens
PROJECT = {"STORE": "django://default", "DEFAULT": {"mode": "eager", "transactional": True}}


@pytest.fixture(autouse=True)
def store() -> Iterator[Any]:
    yield from project_store()


class Router:
    """A database router that routes nothing (it says nothing about any model)."""


def run(**settings: Any) -> list[Any]:
    """taskonce's checks with ``settings`` overridden (restored after)."""
    from django.core.checks import run_checks
    from django.test.utils import override_settings

    with override_settings(**settings):
        return list(run_checks(tags=["taskonce"]))


def only(messages: list[Any], check_id: str) -> Any:
    """The one message of ``check_id`` (failing with all of them otherwise)."""
    found = [m for m in messages if m.id == check_id]
    assert len(found) == 1, messages
    assert found[0].hint, found[0]
    return found[0]


def ids(messages: list[Any]) -> list[str]:
    return sorted(m.id for m in messages)


def config_error(build: Any) -> str:
    with pytest.raises(ConfigError) as raised:
        build()
    return str(raised.value)


def test_the_test_projects_settings_have_only_the_routing_warning() -> None:
    assert ids(run()) == ["taskonce.W003"]  # the project's own settings, whatever its queues
    message = only(run(TASKONCE=PROJECT), "taskonce.W003")
    assert message.msg == (
        "Policy.transactional=True (the default policy) runs the handler in "
        "transaction.atomic(using='default') and DATABASES has other aliases (mariadb, sqlite): "
        "the handler's writes routed to another database are not in that transaction and do not "
        "commit or roll back with the mark"
    )
    assert "SILENCED_SYSTEM_CHECKS" in message.hint
    assert run(TASKONCE={**PROJECT, "DEFAULT": {"transactional": False}}) == []
    queue = run(TASKONCE={**PROJECT, "DEFAULT": {}, "QUEUES": {"pay": {"transactional": True}}})
    assert "(queue 'pay')" in only(queue, "taskonce.W003").msg
    routed = run(TASKONCE=PROJECT, DATABASE_ROUTERS=[f"{__name__}.Router"])
    assert "and DATABASE_ROUTERS is set" in only(routed, "taskonce.W003").msg


def test_e001_unknown_setting_with_the_close_one() -> None:
    message = only(run(TASKONCE={"STROE": "django://default"}), "taskonce.E001")
    assert message.msg.startswith(
        "settings.TASKONCE has no setting 'STROE' (did you mean 'STORE'?); known: STORE, DEFAULT"
    )
    assert "STORE, DEFAULT, QUEUES, EVENTS" in message.hint
    assert only(run(TASKONCE=["STORE"]), "taskonce.E001").msg == (
        "settings.TASKONCE must be a dict, not list"
    )


def test_e001_guard_options() -> None:
    messages = run(TASKONCE={**PROJECT, "SEND_LIMIT": 0, "EVENTS": [object()]})
    assert ids(messages) == ["taskonce.E001", "taskonce.E001", "taskonce.W003"]
    texts = sorted(m.msg for m in messages if m.id == "taskonce.E001")
    assert texts[0].startswith("settings.TASKONCE: Guard(events=…): <object object at")
    assert texts[1] == (
        "settings.TASKONCE: Guard(send_limit=0) must be a whole number of bytes, 1 or more"
    )
    message = only(run(TASKONCE={**PROJECT, "DISPATCH_LEASE": -1}), "taskonce.E001")
    assert message.msg == (
        "settings.TASKONCE: Guard(dispatch_lease=-1) must be a positive number of seconds"
    )
    message = only(run(TASKONCE={**PROJECT, "QUEUES": ["emails"]}), "taskonce.E001")
    assert message.msg == 'settings.TASKONCE: settings.TASKONCE["QUEUES"] must be a dict, not list'


def test_e002_bad_policy_field_or_value_with_the_guards_text() -> None:
    message = only(run(TASKONCE={**PROJECT, "DEFAULT": {"mdoe": "lazy"}}), "taskonce.E002")
    expected = config_error(lambda: Policy().replace(mdoe="lazy"))
    assert "(did you mean 'mode'?)" in expected
    assert message.msg == f'settings.TASKONCE["DEFAULT"]: {expected}'
    assert "Policy fields: check_first, check_payload" in message.hint
    queues = {"emails": {"mode": "lazzy"}}
    message = only(run(TASKONCE={**PROJECT, "QUEUES": queues}), "taskonce.E002")
    assert message.msg == (
        "settings.TASKONCE[\"QUEUES\"]: policy of queue 'emails': Policy.mode='lazzy' is not "
        "valid; choose one of eager, lazy"
    )
    lease = {"DEFAULT": {"lease": 0}}
    assert "Policy.lease=0 must be a positive" in only(run(TASKONCE=lease), "taskonce.E002").msg


def test_e002_names_every_bad_field_of_every_policy() -> None:
    """The guard stops at the first mistake; the check names them all, one error each."""
    taskonce = {
        **PROJECT,
        "DEFAULT": {"mode": "eagre", "lease": 0, "mdoe": "lazy", "keep_for": 3600},
        "QUEUES": {"emails": {"transactional": "yes", "crash_limit": -1}, "ok": {"lease": 9}},
    }
    found = [m.msg for m in run(TASKONCE=taskonce) if m.id == "taskonce.E002"]
    assert found[0].startswith(
        "settings.TASKONCE[\"DEFAULT\"]: unknown Policy field(s) mdoe (did you mean 'mode'?); "
        "known: check_first, "
    )
    assert found[1:] == [
        "settings.TASKONCE[\"DEFAULT\"]: Policy.mode='eagre' is not valid; choose one of eager, "
        "lazy",
        'settings.TASKONCE["DEFAULT"]: Policy.lease=0 must be a positive number of seconds',
        "settings.TASKONCE[\"QUEUES\"]: policy of queue 'emails': Policy.transactional='yes' is "
        "not valid; it must be True or False",
        "settings.TASKONCE[\"QUEUES\"]: policy of queue 'emails': Policy.crash_limit=-1 must be "
        "a whole number, 0 or more (0 turns quarantine off)",
    ]


def test_e003_a_store_url_taskonce_cannot_open() -> None:
    message = only(run(TASKONCE={"STORE": "mongodb://db/x"}), "taskonce.E003")
    assert message.msg.startswith("unknown store URL scheme 'mongodb' in 'mongodb://db/x'")
    assert "django://default" in message.hint
    message = only(run(TASKONCE={"STORE": "redis://:sekrit@h:6379/0?colour=red"}), "taskonce.E003")
    assert "sekrit" not in message.msg and "***" in message.msg
    assert only(run(TASKONCE={"STORE": "localhost"}), "taskonce.E003").msg.startswith(
        'settings.TASKONCE["STORE"] must be a store URL'
    )


def test_e004_unknown_django_alias() -> None:
    messages = run(TASKONCE={**PROJECT, "STORE": "django://defualt"})
    assert ids(messages) == ["taskonce.E004"]  # nothing about transactions on a wrong alias
    message = messages[0]
    assert message.msg == (
        'settings.TASKONCE["STORE"] is django://defualt, but settings.DATABASES has no alias '
        "'defualt' (did you mean django://default?)"
    )
    assert message.hint == "name one of DATABASES' aliases: default, mariadb, sqlite"
    assert ids(run(TASKONCE={"STORE": "django://default/x"})) == ["taskonce.E004"]


def test_e005_transactional_on_a_store_without_transactions() -> None:
    require_service("redis")
    url = "redis://:sekrit@127.0.0.1:6379/15"
    messages = run(TASKONCE={**PROJECT, "STORE": url})
    assert "taskonce.E005" in ids(messages)
    message = only(messages, "taskonce.E005")
    assert message.msg == (
        "Policy.transactional=True (the default policy) needs an SQL store; "
        "redis://:***@127.0.0.1:6379/15 has no database transaction to share"
    )
    assert 'set STORE to "django://default"' in message.hint
    queues = {"pay": {"transactional": True}}
    message = only(run(TASKONCE={"STORE": "memory://", "QUEUES": queues}), "taskonce.E005")
    assert message.msg.startswith("Policy.transactional=True (queue 'pay') needs an SQL store;")
    assert "taskonce.E005" not in ids(run(TASKONCE={"STORE": "memory://"}))


def test_w001_transactional_with_an_sql_url(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    messages = run(TASKONCE={**PROJECT, "STORE": f"sqlite:///{path}"})
    assert ids(messages) == ["taskonce.W001"]
    assert messages[0].msg == (
        f"Policy.transactional=True (the default policy) with the SQL store sqlite:///{path}: "
        "only the handler's writes through taskonce.current_session() share the mark's "
        "transaction; its ORM writes on Django's connection commit on their own"
    )
    assert "django://ALIAS" in messages[0].hint
    assert not path.exists()  # checked without connecting: no database file made


def test_w002_dramatiq_broker_without_the_middleware() -> None:
    broker = {"BROKER": "dramatiq.brokers.stub.StubBroker", "MIDDLEWARE": ["x.Retries"]}
    message = only(run(DRAMATIQ_BROKER=broker), "taskonce.W002")
    assert message.msg == (
        'settings.DRAMATIQ_BROKER["MIDDLEWARE"] does not have '
        "taskonce.django_ext.IdempotencyMiddleware: the project's Dramatiq actors run unguarded "
        "(their idempotency options are ignored)"
    )
    assert '"taskonce.django_ext.IdempotencyMiddleware"' in message.hint
    assert "taskonce.W002" in ids(run(DRAMATIQ_BROKER={"BROKER": "x.Broker"}))
    for path in (
        "taskonce.django_ext.IdempotencyMiddleware",
        "taskonce.django_ext.middleware.IdempotencyMiddleware",
    ):
        with_it = {**broker, "MIDDLEWARE": ["x.Retries", path]}
        assert "taskonce.W002" not in ids(run(DRAMATIQ_BROKER=with_it))
    # a bad TASKONCE does not hide it
    assert "taskonce.W002" in ids(run(DRAMATIQ_BROKER=broker, TASKONCE={"X": 1}))


def test_w004_an_unreachable_store_warns_within_the_timeout() -> None:
    before = threading.active_count()
    started = time.monotonic()
    messages = run(TASKONCE={"STORE": UNREACHABLE_REDIS})
    assert time.monotonic() - started < 4
    assert ids(messages) == ["taskonce.W004"]
    message = messages[0]
    assert message.msg.startswith(
        f"the store {UNREACHABLE_REDIS} did not answer within 2 s (ConnectionError: "
    )
    assert "exit status 78" in message.hint
    url = "postgresql+psycopg://postgres:sekrit@127.0.0.1:1/x"
    message = only(run(TASKONCE={"STORE": url}), "taskonce.W004")
    assert "postgresql+psycopg://postgres:***@127.0.0.1:1/x did not answer" in message.msg
    assert "sekrit" not in message.msg
    assert threading.active_count() == before


def _connections_to(database: str) -> int:
    from django.db import connections

    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", [database])
        return int(cursor.fetchone()[0])


def test_reachable_stores_pass_and_leave_no_thread_or_connection() -> None:
    """The probe's store is on a database of its own, so no other test's connection (a guard's
    thread, a worker of an earlier module) is counted with it."""
    require_service("redis")
    from tests.django_project.databases import _create

    probed = f"{db_name()}_checks"
    _create("default", probed)
    before_threads = threading.active_count()
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{probed}"
    assert run(TASKONCE={"STORE": url}) == []
    assert run(TASKONCE={"STORE": "redis://127.0.0.1:6379/15"}) == []
    assert run(TASKONCE={"STORE": "memory://"}) == []
    # a closed connection's server process leaves pg_stat_activity a moment after it
    wait_for(lambda: _connections_to(probed) == 0, timeout=5, what="the probe's connection gone")
    assert threading.active_count() == before_threads


def test_manage_py_check_and_migrate_with_redis_down(tmp_path: Path) -> None:
    body = f'TASKONCE = {{"STORE": "{UNREACHABLE_REDIS}"}}'
    path = settings_module(tmp_path, "redisdown_settings", body)
    check = django("check", "--tag", "taskonce", settings="redisdown_settings", extra_path=path)
    assert check.returncode == 0, check.stderr
    assert "(taskonce.W004) the store redis://127.0.0.1:1/0 did not answer within 2 s" in (
        check.stderr
    )
    migrate = django("migrate", "--noinput", settings="redisdown_settings", extra_path=path)
    assert migrate.returncode == 0, migrate.stderr


def test_manage_py_check_fails_on_an_error(tmp_path: Path) -> None:
    body = 'TASKONCE = {"STORE": "memory://", "DEFAULT": {"transactional": True}}'
    path = settings_module(tmp_path, "memtx_settings", body)
    check = django("check", settings="memtx_settings", extra_path=path)
    assert check.returncode == 1
    assert "SystemCheckError" in check.stderr
    assert "?: (taskonce.E005) Policy.transactional=True (the default policy) needs an SQL " in (
        check.stderr
    )
    assert "HINT: set STORE to" in check.stderr
