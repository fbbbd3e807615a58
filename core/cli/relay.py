"""``taskonce relay``: publish deferred sends left pending (a worker died after recording its
outcome), through the Celery app's or Dramatiq broker's connection."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import threading
from typing import Any, TextIO

from taskonce.cli.output import answer
from taskonce.errors import ConfigError
from taskonce.guard import Guard

NAME = "relay"
HELP = "publish deferred sends left pending (a worker died after recording its outcome)"
PARENTS = ("common",)

logger = logging.getLogger("taskonce.cli")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The app or broker to publish through, and the sweep's pace."""
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--celery-app", metavar="MODULE:APP", help="the Celery app, e.g. proj:app")
    target.add_argument(
        "--dramatiq-broker", metavar="MODULE:BROKER", help="the Dramatiq broker, e.g. proj:broker"
    )
    parser.add_argument("--once", action="store_true", help="one sweep, then exit")
    parser.add_argument(
        "--every", type=float, default=30.0, help="seconds between sweeps (default 30)"
    )
    parser.add_argument(
        "--older-than",
        type=float,
        default=10.0,
        help="only sends pending at least this many seconds (default 10)",
    )
    parser.add_argument("--batch", type=int, default=100, help="records per sweep (default 100)")


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Sweep once (``--once``) or every ``--every`` seconds until Ctrl-C."""
    guard = _relay_guard(args)
    stop = threading.Event()
    total = 0
    if not args.once:
        # it prints nothing until there is something to publish: say at once that it runs
        sys.stderr.write(
            f"{getattr(args, 'prog', 'taskonce')} relay: running every {args.every:g} s on "
            f"{guard.store.describe()}; Ctrl-C stops it; --once for one sweep\n"
        )
        sys.stderr.flush()
    try:
        while True:
            dispatched = guard.relay(older_than=args.older_than, batch=args.batch)
            total += dispatched
            if dispatched or args.once:
                text = f"published the pending sends of {dispatched} record(s)"
                answer(out, args, {"dispatched": dispatched}, text)
            if args.once:
                return 0
            if dispatched < args.batch:  # a full batch: more may be waiting, go on at once
                stop.wait(args.every)
    except KeyboardInterrupt:
        logger.info("relay stopped after publishing the sends of %d record(s)", total)
        return 0


def _load_object(spec: str, option: str) -> Any:
    """``MODULE:attribute`` imported (the attribute may be dotted)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{option} {spec!r}: expected MODULE:OBJECT, e.g. proj.celery:app")
    sys.path.insert(0, os.getcwd())  # like celery -A: modules of the current directory
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{option} {spec!r}: cannot import {module_name!r}: {exc}") from None
    value: Any = module
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise ConfigError(f"{option} {spec!r}: {module_name} has no {attribute!r}") from None
    return value


def _relay_guard(args: argparse.Namespace) -> Guard:
    """The guard of the app/broker named on the command line, its publisher registered by
    the adapter (``relay_guard`` of taskonce.celery_ext / taskonce.dramatiq_ext)."""
    if args.celery_app:
        target, adapter = _load_object(args.celery_app, "--celery-app"), "celery_ext"
    elif args.dramatiq_broker:
        target, adapter = _load_object(args.dramatiq_broker, "--dramatiq-broker"), "dramatiq_ext"
    elif getattr(args, "project_guard", None) is not None:  # main(relay_guard=…)
        project: Guard = args.project_guard()
        return project
    else:
        raise ConfigError(
            "taskonce relay needs --celery-app MODULE:app or --dramatiq-broker MODULE:broker: "
            "it publishes the pending sends through that app's or broker's connection"
        )
    module = importlib.import_module(f"taskonce.{adapter}")
    guard: Guard = module.relay_guard(target)
    return guard
