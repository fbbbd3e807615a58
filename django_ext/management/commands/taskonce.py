"""``manage.py taskonce stats|inspect KEY|release KEY|purge|relay``: the ``taskonce`` command's
verbs on the project's store (``settings.TASKONCE["STORE"]``).

The verbs run :func:`taskonce.cli.main` itself: the same options (``--store URL`` names another
store than the project's; ``relay`` refuses it), the same output and the same exit statuses
(:mod:`taskonce.exits`: 0 done, 1 no live record for KEY, 2 could not run as asked, 70 a bug).
``relay`` publishes through the project's guard (:func:`taskonce.django_ext.guard`) with the
publishers the project registered on it (Celery's ``setup(app, guard())``, the Dramatiq
middleware of ``DRAMATIQ_BROKER``), or through the app or broker named by ``--celery-app`` /
``--dramatiq-broker`` as ``taskonce relay`` does.

Django's own options (``--settings``, ``--pythonpath``, ``-v``) go before the verb; the verb's
options after it (``manage.py taskonce inspect --help`` lists them).
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from taskonce.errors import ConfigError
from taskonce.exits import EXIT_ERROR
from taskonce.guard import Guard

logger = logging.getLogger("taskonce.django_ext")

#: The verbs of ``manage.py taskonce`` (the ``taskonce`` command's store verbs).
VERBS = ("stats", "inspect", "release", "purge", "relay")

#: Django's options that ``manage.py`` applied before the command ran (``--settings``,
#: ``--pythonpath``): dropped when they stand after the verb, where the verb would refuse them.
_APPLIED = ("--settings", "--pythonpath")


def project_relay_guard() -> Guard:
    """The project's guard for ``manage.py taskonce relay``: :func:`taskonce.django_ext.guard`,
    with the publisher of django_dramatiq's broker attached when ``DRAMATIQ_BROKER`` has
    taskonce's middleware (Celery's is there when the project called ``setup(app, guard())``).

    :raises ConfigError: the guard has no publisher, so it could publish nothing."""
    from django.apps import apps
    from django.conf import settings

    from taskonce.django_ext import conf

    guard = conf.guard()
    if getattr(settings, "DRAMATIQ_BROKER", None) and apps.is_installed("django_dramatiq"):
        import dramatiq

        from taskonce.dramatiq_ext import IdempotencyMiddleware

        broker = dramatiq.get_broker()
        for middleware in broker.middleware:
            if isinstance(middleware, IdempotencyMiddleware) and middleware.guard is guard:
                middleware.attach(broker)  # registers the Dramatiq publisher on the guard
    if not guard.frameworks():
        raise ConfigError(
            "manage.py taskonce relay: the project's guard has no publisher, so it could publish "
            "nothing; call taskonce.celery_ext.setup(app, taskonce.django_ext.guard()) where "
            "the project makes its Celery app (imported when Django starts, e.g. from the "
            "project package's __init__.py), add 'taskonce.django_ext.IdempotencyMiddleware' to "
            "DRAMATIQ_BROKER['MIDDLEWARE'] with django_dramatiq installed, or name the app or "
            "broker: --celery-app MODULE:app / --dramatiq-broker MODULE:broker"
        )
    return guard


def _without_applied(arguments: list[str]) -> list[str]:
    """``arguments`` less the Django options ``manage.py`` already applied."""
    kept: list[str] = []
    skip = False
    for argument in arguments:
        if skip:
            skip = False
        elif argument in _APPLIED:
            skip = True  # and its value
        elif not argument.startswith(tuple(f"{name}=" for name in _APPLIED)):
            kept.append(argument)
    return kept


def _names_a_store(arguments: list[str]) -> bool:
    """Whether the verb's ``arguments`` give ``--store URL`` (or ``--store=URL``)."""
    return any(a == "--store" or a.startswith("--store=") for a in arguments)


class Command(BaseCommand):
    """``manage.py taskonce VERB [options]``: :func:`taskonce.cli.main` on the project's store.

    From the command line the process exits with the verb's exit status. Through
    ``call_command`` a status other than 0 raises :class:`CommandError` with that
    ``returncode`` (the verb's output is written first)."""

    help = (
        "Inspect and maintain the project's taskonce store (settings.TASKONCE['STORE']): "
        "stats, inspect KEY, release KEY, purge, relay. The verb's options follow it "
        "(manage.py taskonce VERB --help); --store URL names another store (not for relay). "
        "Exit status: 0 done, 1 no live record for KEY, "
        "2 could not run as asked, 70 an unexpected error."
    )
    # The verbs report a bad setting or a store that does not answer themselves, in one line
    # with the taskonce command's exit status, instead of a system check's error; and they
    # do not wait for the checks' probe of an unreachable store.
    requires_system_checks: list[str] = []
    _exit_with_status = False
    _prog = "manage.py taskonce"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("verb", choices=VERBS, help="what to do: " + ", ".join(VERBS))
        parser.add_argument(
            "arguments",
            nargs=argparse.REMAINDER,
            metavar="...",
            help="the verb's arguments and options (manage.py taskonce VERB --help)",
        )

    def run_from_argv(self, argv: list[str]) -> None:
        """From the command line: exit with the verb's status, its output unchanged."""
        self._exit_with_status = True
        program = os.path.basename(argv[0])
        self._prog = f"{'python -m django' if program == '__main__.py' else program} {argv[1]}"
        super().run_from_argv(argv)

    def handle(self, *args: Any, **options: Any) -> None:
        from taskonce import cli
        from taskonce.django_ext import conf

        verb = str(options["verb"])
        arguments = _without_applied(list(options["arguments"]))
        given = _names_a_store(arguments)
        if given and verb == "relay":
            raise CommandError(
                "manage.py taskonce relay publishes with the project's guard, whose store is "
                'settings.TASKONCE["STORE"]: --store cannot name another; to relay the sends of '
                "another store, run: taskonce relay --store URL --celery-app MODULE:app (or "
                "--dramatiq-broker MODULE:broker)",
                returncode=EXIT_ERROR,
            )
        url = None
        if not given:  # --store URL: that store instead of the project's, as `taskonce` does
            try:
                url = conf.store_url()
            except ConfigError as exc:
                raise CommandError(str(exc), returncode=EXIT_ERROR) from None
        try:
            code = cli.main(
                [verb, *arguments],
                out=self.stdout,
                prog=self._prog,
                commands=VERBS,
                store=url,
                relay_guard=project_relay_guard,
            )
        except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already said
            code = exc.code if isinstance(exc.code, int) else EXIT_ERROR
        if code == 0:
            return
        if self._exit_with_status:
            raise SystemExit(code)  # run_from_argv closes Django's connections on the way out
        raise CommandError(f"taskonce {verb} ended with exit status {code}", returncode=code)
