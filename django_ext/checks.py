"""System checks (``manage.py check``) for taskonce's settings, under the tag ``taskonce``.

- ``taskonce.E001``: ``settings.TASKONCE`` is not valid: not a dict, an unknown key (with the
  close one), a bad ``EVENTS``, ``SEND_LIMIT``, ``DISPATCH_LEASE``, ``RELAY_EVERY``,
  ``START_TIMEOUT`` or ``STORE_RETRY_DELAY``;
- ``taskonce.E002``: a policy of ``DEFAULT`` or ``QUEUES`` is not valid (unknown field, bad
  value), in the words the guard would refuse it with: one error per problem, every bad field
  of every policy dict (the guard stops at the first);
- ``taskonce.E003``: ``STORE`` is not a store URL taskonce can open (unknown scheme, bad option,
  missing extra);
- ``taskonce.E004``: ``STORE`` is ``django://ALIAS`` and ``ALIAS`` is not in ``DATABASES`` (or
  its backend is not PostgreSQL, MySQL/MariaDB or SQLite);
- ``taskonce.E005``: a policy is ``transactional`` and the store has no transaction to share
  (``redis://``, ``memory://``);
- ``taskonce.E006``: the store's server answers that the URL's database does not exist;
- ``taskonce.E007``: ``STORE`` is ``django://ALIAS`` and taskonce's migrations have not all run
  on that database (not reported while ``migrate``, ``makemigrations``, ``showmigrations``,
  ``sqlmigrate`` or ``squashmigrations`` runs the checks, nor when the database does not
  answer);
- ``taskonce.W001``: a policy is ``transactional`` and the store is an SQL URL: only writes
  through ``taskonce.current_session()`` share the mark's transaction, not the ORM's;
- ``taskonce.W002``: ``DRAMATIQ_BROKER["MIDDLEWARE"]`` lacks
  ``taskonce.django_ext.IdempotencyMiddleware``;
- ``taskonce.W003``: a policy is ``transactional`` on ``django://ALIAS`` while ``DATABASES`` has
  other aliases or ``DATABASE_ROUTERS`` is set: writes routed elsewhere are outside the
  handler's transaction;
- ``taskonce.W004``: the store (Redis, PostgreSQL, MySQL/MariaDB) did not answer within
  :data:`PROBE_TIMEOUT` seconds.

The checks build no guard (it would start threads): they validate the settings with the same
functions the guard uses (:class:`~taskonce.policy.Policy`, :class:`~taskonce.policy.Policies`)
and open a store only to close it at once; only W004 makes a round trip, with a short timeout,
and it is a warning so that ``migrate`` still runs while Redis is down.
"""

from __future__ import annotations

import difflib
import logging
import re
import sys
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from django.core.checks import CheckMessage, Error, Warning, register

from taskonce.errors import ConfigError
from taskonce.policy import FIELDS, Policies, Policy
from taskonce.stores import open_store, redact
from taskonce.stores.sql.connecting import missing_database

logger = logging.getLogger("taskonce.django_ext")

#: The tag of taskonce's checks (``manage.py check --tag taskonce``).
TAG = "taskonce"
#: Seconds the reachability check (W004) waits for the store.
PROBE_TIMEOUT = 2.0
#: The middleware ``DRAMATIQ_BROKER["MIDDLEWARE"]`` should name (either path).
MIDDLEWARE_PATHS = (
    "taskonce.django_ext.IdempotencyMiddleware",
    "taskonce.django_ext.middleware.IdempotencyMiddleware",
)
_NON_TRANSACTIONAL = ("redis", "rediss", "unix", "memory")
_SQL = ("sqlite", "postgresql", "postgres", "mysql", "mariadb")
_NETWORK = ("redis", "rediss", "unix", "postgresql", "postgres", "mysql", "mariadb")
_DOCS = "see the Django page of taskonce's documentation (docs/django.md)"


def _scheme(url: str) -> str:
    """The store kind a URL names: ``redis``, ``postgresql``, ``django``, …"""
    return url.split("://", 1)[0].split("+", 1)[0].lower()


# -- E001 / E002: the settings and the policies ------------------------------------------------


def _guard_options(values: Mapping[str, Any]) -> list[CheckMessage]:
    """E001 for the guard's options as :func:`~taskonce.django_ext.conf.build_guard` passes
    them (``DEFAULT``/``QUEUES`` dicts, ``EVENTS`` sinks, ``SEND_LIMIT``, ``DISPATCH_LEASE``)
    and the worker options (``RELAY_EVERY``, …), each by the check that refuses it in use."""
    from taskonce.dispatch import check_dispatch_lease
    from taskonce.django_ext import conf
    from taskonce.handoff import check_send_limit

    problems: list[str] = []
    for name in ("DEFAULT", "QUEUES"):
        if not isinstance(values[name], Mapping):
            problems.append(
                f'settings.TASKONCE["{name}"] must be a dict, not {type(values[name]).__name__}'
            )
    problems += _event_sink_problems(values["EVENTS"])
    if values["SEND_LIMIT"] is not None:
        try:
            check_send_limit(values["SEND_LIMIT"])
        except ConfigError as exc:
            problems.append(str(exc))
    if values["DISPATCH_LEASE"] is not None:
        try:
            check_dispatch_lease(values["DISPATCH_LEASE"])
        except ConfigError as exc:
            problems.append(str(exc))
    try:
        conf.worker_options()
    except ConfigError as exc:
        problems.append(str(exc))
    return [
        Error(
            f"settings.TASKONCE: {text}",
            hint="SEND_LIMIT is bytes (int); DISPATCH_LEASE, RELAY_EVERY, START_TIMEOUT and "
            "STORE_RETRY_DELAY seconds; EVENTS sinks such as "
            f'taskonce.JsonlEvents("events.jsonl"); {_DOCS}',
            id="taskonce.E001",
        )
        for text in problems
    ]


def _event_sink_problems(events: Any) -> list[str]:
    """What the guard would refuse in ``EVENTS``: not iterable, or a sink without ``emit``."""
    from taskonce.events import EventSink

    problems: list[str] = []
    try:
        for sink in list(events):
            if not isinstance(sink, EventSink):
                problems.append(f"Guard(events=…): {sink!r} has no emit(event) method")
    except TypeError:
        problems.append(
            'settings.TASKONCE["EVENTS"] must be a list of event sinks, not '
            f"{type(events).__name__}"
        )
    return problems


#: How Policy's own errors name the field they are about: ``Policy.mode='eagre' is not …``.
_BAD_FIELD = re.compile(r"Policy\.(\w+)=")


def _policy_problems(base: Policy, override: Any) -> tuple[Policy | None, list[str]]:
    """``override`` applied over ``base`` as the guard applies it, and every problem of it in
    the guard's words: the guard stops at the first, a check names them all. After each
    problem the fields it names (unknown ones, or the bad one) are left out and the rest is
    tried again, so one bad field hides no other. The policy is None when there is a problem."""
    if not isinstance(override, Mapping):
        try:
            return base.overridden_by(override), []
        except ConfigError as exc:
            return None, [str(exc)]
    fields = dict(override)
    problems: list[str] = []
    while True:
        try:
            policy = base.replace(**fields)
        except ConfigError as exc:
            problems.append(str(exc))
            named = _BAD_FIELD.match(str(exc))
            bad = (set(fields) - FIELDS) or ({named[1]} & set(fields) if named else set())
            if not bad:
                return None, problems  # about several fields at once: none to leave out
            for name in bad:
                del fields[name]
            continue
        return (None if problems else policy), problems


def _policies(values: Mapping[str, Any]) -> tuple[Policies | None, list[CheckMessage]]:
    """The policies of ``DEFAULT`` and ``QUEUES`` as the guard builds them, or one E002 per
    problem (every bad field of every policy dict) with the guard's own ConfigError text."""
    hint = f"Policy fields: {', '.join(sorted(FIELDS))}; {_DOCS}"
    default, problems = _policy_problems(Policy(), values["DEFAULT"])
    errors = [
        Error(f'settings.TASKONCE["DEFAULT"]: {text}', hint=hint, id="taskonce.E002")
        for text in problems
    ]
    for queue, override in values["QUEUES"].items():
        # over the default as far as it is valid, so a queue's own mistakes are found too
        _, problems = _policy_problems(default or Policy(), override)
        errors += [
            Error(
                f'settings.TASKONCE["QUEUES"]: policy of queue {queue!r}: {text}',
                hint=hint,
                id="taskonce.E002",
            )
            for text in problems
        ]
    if errors:
        return None, errors
    try:
        policies = Policies(values["DEFAULT"], values["QUEUES"], lambda policy: None)
    except ConfigError as exc:
        return None, [Error(f'settings.TASKONCE["QUEUES"]: {exc}', hint=hint, id="taskonce.E002")]
    return policies, []


def _transactional(policies: Policies) -> list[str]:
    """Where a policy is transactional: ``the default policy``, ``queue 'payments'``."""
    where = ["the default policy"] if policies.default.transactional else []
    where += [f"queue {name!r}" for name, p in policies.queues.items() if p.transactional]
    return where


# -- E003 / E004: the store URL ----------------------------------------------------------------


def _django_alias(url: str) -> tuple[str | None, list[CheckMessage]]:
    """The alias of a ``django://ALIAS`` URL, or E004."""
    from django.conf import settings
    from django.db import connections

    from .store import alias_of
    from .store.statements import VENDORS

    try:
        alias = alias_of(url)
    except ConfigError as exc:
        return None, [Error(str(exc), hint=f"e.g. django://default; {_DOCS}", id="taskonce.E004")]
    aliases = list(settings.DATABASES)
    if alias not in aliases:
        close = difflib.get_close_matches(alias, aliases, n=1)
        guess = f" (did you mean django://{close[0]}?)" if close else ""
        return None, [
            Error(
                f'settings.TASKONCE["STORE"] is django://{alias}, but settings.DATABASES has no '
                f"alias {alias!r}{guess}",
                hint=f"name one of DATABASES' aliases: {', '.join(aliases) or 'none'}",
                id="taskonce.E004",
            )
        ]
    vendor = connections[alias].vendor  # the backend's class attribute: no connection
    if vendor not in VENDORS:
        return None, [
            Error(
                f"store django://{alias}: the {vendor!r} backend is not supported",
                hint="taskonce stores records in PostgreSQL, MariaDB/MySQL or SQLite",
                id="taskonce.E004",
            )
        ]
    return alias, []


def _store_url(values: Mapping[str, Any]) -> tuple[str | None, list[CheckMessage]]:
    """``STORE`` when taskonce can open it (opened and closed, never connected), or E003."""
    from taskonce.django_ext import conf

    hint = (
        'e.g. "django://default" (the project\'s database), "redis://localhost:6379/0" or '
        f'"postgresql+psycopg://user@host/db"; {_DOCS}'
    )
    try:
        url = conf.store_url()
        if _scheme(url) != "django" and not url.lower().startswith("redis+cluster://"):
            open_store(url).close()  # a cluster client would connect to its nodes: not here
    except ConfigError as exc:
        return None, [Error(str(exc), hint=hint, id="taskonce.E003")]
    return url, []


# -- E005 / W001 / W003: transactional policies and the store ---------------------------------


def _transaction_messages(url: str, alias: str | None, where: list[str]) -> list[CheckMessage]:
    from django.conf import settings

    if not where:
        return []
    places = ", ".join(where)
    scheme = _scheme(url)
    if scheme in _NON_TRANSACTIONAL:
        return [
            Error(
                f"Policy.transactional=True ({places}) needs an SQL store; {redact(url)} has no "
                "database transaction to share",
                hint='set STORE to "django://default" so that the handler\'s ORM writes and the '
                "mark commit together, or set transactional to False",
                id="taskonce.E005",
            )
        ]
    if scheme in _SQL:
        return [
            Warning(
                f"Policy.transactional=True ({places}) with the SQL store {redact(url)}: only "
                "the handler's writes through taskonce.current_session() share the mark's "
                "transaction; its ORM writes on Django's connection commit on their own",
                hint='set STORE to "django://ALIAS" (the database the handlers write to) to '
                "put the ORM's writes in the mark's transaction",
                id="taskonce.W001",
            )
        ]
    others = [name for name in settings.DATABASES if name != alias]
    routers = list(getattr(settings, "DATABASE_ROUTERS", []) or [])
    if alias is None or not (others or routers):
        return []
    why = []
    if others:
        why.append(f"DATABASES has other aliases ({', '.join(others)})")
    if routers:
        why.append("DATABASE_ROUTERS is set")
    return [
        Warning(
            f"Policy.transactional=True ({places}) runs the handler in "
            f"transaction.atomic(using={alias!r}) and {' and '.join(why)}: the handler's writes "
            f"routed to another database are not in that transaction and do not commit or "
            "roll back with the mark",
            hint=f"write in guarded handlers only to {alias!r} (the store's alias); once checked, "
            'silence this with SILENCED_SYSTEM_CHECKS = ["taskonce.W003"]',
            id="taskonce.W003",
        )
    ]


# -- W002: Dramatiq's middleware ---------------------------------------------------------------


def _dramatiq_middleware() -> list[CheckMessage]:
    from django.conf import settings

    broker = getattr(settings, "DRAMATIQ_BROKER", None)
    if not isinstance(broker, Mapping):
        return []
    middleware = list(broker.get("MIDDLEWARE") or [])
    for entry in middleware:
        if isinstance(entry, str):
            if entry in MIDDLEWARE_PATHS:
                return []
        else:
            from taskonce.dramatiq_ext import IdempotencyMiddleware

            if isinstance(entry, IdempotencyMiddleware):
                return []
    return [
        Warning(
            'settings.DRAMATIQ_BROKER["MIDDLEWARE"] does not have '
            "taskonce.django_ext.IdempotencyMiddleware: the project's Dramatiq actors run "
            "unguarded (their idempotency options are ignored)",
            hint=f'add "{MIDDLEWARE_PATHS[0]}" to DRAMATIQ_BROKER["MIDDLEWARE"], after '
            '"dramatiq.middleware.Retries"',
            id="taskonce.W002",
        )
    ]


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E001–E005, W001–W003: ``settings.TASKONCE`` and what it meets, without connecting."""
    from taskonce.django_ext import conf

    messages = _dramatiq_middleware()
    try:
        values = conf.read_settings()
    except ConfigError as exc:
        return [
            Error(
                str(exc),
                hint=f"TASKONCE's keys: {', '.join(conf.DEFAULTS)}; {_DOCS}",
                id="taskonce.E001",
            ),
            *messages,
        ]
    messages += _guard_options(values)
    policies = None
    if isinstance(values["DEFAULT"], Mapping) and isinstance(values["QUEUES"], Mapping):
        policies, found = _policies(values)
        messages += found
    url, found = _store_url(values)
    messages += found
    alias = None
    if url is not None and _scheme(url) == "django":
        alias, found = _django_alias(url)
        messages += found
        if alias is None:
            url = None
    if url is not None and policies is not None:
        messages += _transaction_messages(url, alias, _transactional(policies))
    return messages


# -- W004: the store answers -------------------------------------------------------------------


def _probe(url: str) -> None:
    """One round trip to the store at ``url`` within :data:`PROBE_TIMEOUT`; the store is closed
    (its connections too) before this returns."""
    scheme = _scheme(url)
    if scheme in ("redis", "rediss", "unix"):
        store: Any = open_store(url, socket_timeout=PROBE_TIMEOUT)
        try:
            store.client.ping()
        finally:
            store.close()
        return
    seconds = max(1, round(PROBE_TIMEOUT))
    timeouts: dict[str, Any] = {"connect_timeout": seconds}
    if scheme in ("mysql", "mariadb"):
        timeouts.update(read_timeout=seconds, write_timeout=seconds)
    store = open_store(url, create=False, engine_options={"connect_args": timeouts})
    try:
        with store.engine.connect() as connection:
            connection.exec_driver_sql("SELECT 1")
    finally:
        store.close()


def _one_line(exc: BaseException, url: str) -> str:
    """The error in one line, without the URL's password."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    return text.replace(password, "***") if password else text


def check_store_answers(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W004: a network store (Redis, PostgreSQL, MySQL/MariaDB URL) answers within
    :data:`PROBE_TIMEOUT` seconds. ``django://`` stores are Django's databases (``migrate``
    reaches them), ``memory://`` and SQLite files have nothing to reach; a URL E003 refused
    is not probed."""
    from taskonce.django_ext import conf

    try:
        url = conf.store_url()
    except ConfigError:
        return []  # E001 / E003
    if _scheme(url) not in _NETWORK:
        return []
    try:
        _probe(url)
    except ConfigError:
        return []  # E003 says what is wrong with the URL
    except Exception as exc:
        logger.debug("store probe of %s failed", redact(url), exc_info=True)
        missing = missing_database(exc)
        if missing:
            return [
                Error(
                    f"the store {redact(url)}: the server says {missing}",
                    hint="create that database, or correct the database name in "
                    'settings.TASKONCE["STORE"]; workers refuse to start until then',
                    id="taskonce.E006",
                )
            ]
        return [
            Warning(
                f"the store {redact(url)} did not answer within {PROBE_TIMEOUT:g} s "
                f"({_one_line(exc, url)})",
                hint="workers refuse to start until it answers (exit status 78): check "
                'settings.TASKONCE["STORE"] and that the server runs',
                id="taskonce.W004",
            )
        ]
    return []


# -- E007: the migrations ran ------------------------------------------------------------------

#: Django's commands that make, inspect or apply migrations: E007 does not stop them (a new
#: project runs ``makemigrations`` before its first ``migrate``). ``check``, ``runserver`` and
#: the workers still report it.
MIGRATION_COMMANDS = frozenset(
    {"makemigrations", "migrate", "showmigrations", "sqlmigrate", "squashmigrations"}
)


def check_migrations(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """E007: taskonce's migrations have all run on the database of a ``django://ALIAS`` store.

    ``migrate`` runs the checks with its database (``databases``) before it applies them: not
    reported there, nor by an in-process ``call_command("check", databases=…)``; ``manage.py
    check --database …`` reports it. Nor while one of :data:`MIGRATION_COMMANDS` runs (named
    by ``sys.argv``, as ``manage.py`` and ``django-admin`` have it). A database that does not
    answer (not created yet, a build without one) is not reported: ``migrate`` says that
    itself."""
    from django.db import DatabaseError

    from taskonce.django_ext import conf

    from .store.schema import unapplied_migrations

    if databases is not None and sys.argv[1:2] != ["check"]:
        return []
    if sys.argv[1:2] and sys.argv[1] in MIGRATION_COMMANDS:
        return []  # they make, show or apply the very migrations E007 asks for
    try:
        url = conf.store_url()
    except ConfigError:
        return []  # E001 / E003
    if _scheme(url) != "django":
        return []
    alias, _ = _django_alias(url)
    if alias is None:
        return []  # E004
    try:
        unapplied = unapplied_migrations(alias)
    except DatabaseError:
        logger.debug("could not read the migrations of database %r", alias, exc_info=True)
        return []
    if not unapplied:
        return []
    return [
        Error(
            f"taskonce's migration(s) {', '.join(unapplied)} have not run on database "
            f"{alias!r}, where the store django://{alias} keeps its records",
            hint=f"python manage.py migrate --database {alias}",
            id="taskonce.E007",
        )
    ]


register(check_settings, TAG)
register(check_store_answers, TAG)
register(check_migrations, TAG)

__all__ = [
    "MIDDLEWARE_PATHS",
    "MIGRATION_COMMANDS",
    "PROBE_TIMEOUT",
    "TAG",
    "check_migrations",
    "check_settings",
    "check_store_answers",
]
