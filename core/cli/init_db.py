"""``taskonce init-db``: create an SQL store's table."""

from __future__ import annotations

import argparse
from typing import TextIO

from taskonce.cli.output import answer
from taskonce.cli.store import refuse_options, store_url
from taskonce.errors import ConfigError

NAME = "init-db"
HELP = "create the SQL store's table"
PARENTS = ("common", "store")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Nothing beyond the store options."""


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Create the table (``--table``) of the ``--store`` URL."""
    try:
        from taskonce.stores.sql import init_db
    except ImportError as exc:  # its message names the sql extra
        raise ConfigError(str(exc)) from None

    refuse_options(args, "init-db", "the table holds every queue", "queue")
    refuse_options(args, "init-db", "it creates an SQL store's table", "prefix")
    description = init_db(store_url(args), getattr(args, "table", None))
    answer(out, args, {"store": description}, f"ready: {description}")
    return 0
