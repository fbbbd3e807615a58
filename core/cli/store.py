"""How the store commands find their store and their key: the URL from ``--store``,
``$TASKONCE_STORE`` or the default; a store of existing records opened without creating
anything; ``KEY`` or ``--queue QUEUE ID``."""

from __future__ import annotations

import argparse
import functools
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from taskonce.errors import ConfigError, TaskonceError
from taskonce.keys import make_key
from taskonce.stores import Store, open_store, redact

DEFAULT_STORE_PATH = "taskonce.db"
DEFAULT_STORE = f"sqlite:///{DEFAULT_STORE_PATH}"
_SQL_SCHEMES = ("sqlite", "postgresql", "postgres", "mysql", "mariadb")


def store_url(args: argparse.Namespace) -> str:
    """The store URL: ``--store``, else ``$TASKONCE_STORE``, else the default, which is said on
    stderr (an operator must not read the counts of a store they did not mean)."""
    url = getattr(args, "store", None) or os.environ.get("TASKONCE_STORE")
    if url:
        return str(url)
    sys.stderr.write(
        f"taskonce: no --store or TASKONCE_STORE given; using {DEFAULT_STORE} "
        f"({Path(DEFAULT_STORE_PATH).resolve()})\n"
    )
    return DEFAULT_STORE


def _sqlite_file(url: str) -> str | None:
    """The database file of an ``sqlite:///`` URL (None for other stores and in-memory SQLite)."""
    if not url.lower().startswith("sqlite:"):
        return None
    try:
        import sqlalchemy as sa
    except ImportError as exc:
        raise ConfigError(
            f"store URL {redact(url)!r} needs SQLAlchemy ({exc}): pip install 'taskonce[sql]'"
        ) from None

    database = sa.engine.make_url(url).database or ""
    if database.startswith("file:"):  # an SQLite URI filename: file:path?mode=…
        database = database[len("file:") :].split("?", 1)[0]
    return None if database in ("", ":memory:") else database


def open_existing(args: argparse.Namespace, *, read_only: bool) -> Store:
    """The store of a command that works on existing records: it never creates a database file
    or a table, and a read-only command opens SQLite read-only."""
    url = store_url(args)
    options = _namespace_options(args, url)
    path = _sqlite_file(url)
    if path is not None and not Path(path).is_file():
        raise TaskonceError(
            f"no store at {url}: {Path(path).resolve()} does not exist (give --store URL or set "
            "TASKONCE_STORE; `taskonce init-db --store URL` creates an SQL store)"
        )
    if url.split("://", 1)[0].split("+", 1)[0].lower() in _SQL_SCHEMES:
        options["create"] = False
    if path is not None and read_only:
        # sqlite3 opens the same file read-only: nothing this command does can write to it
        uri = f"file:{quote(str(Path(path).resolve()))}?mode=ro"
        connect = functools.partial(sqlite3.connect, uri, uri=True, check_same_thread=False)
        options["engine_options"] = {"creator": connect}
    return open_store(url, **options)


def _namespace_options(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """``--prefix`` / ``--table`` as store options; ConfigError when given to the other kind of
    store (they would be silently ignored otherwise)."""
    base = url.split("://", 1)[0].split("+", 1)[0].lower()
    options: dict[str, Any] = {}
    prefix, table = getattr(args, "prefix", None), getattr(args, "table", None)
    if prefix is not None:
        if base not in ("redis", "rediss", "unix"):
            raise ConfigError(f"--prefix applies to a Redis store; {redact(url)} is not one")
        options["prefix"] = prefix
    if table is not None:
        if base not in _SQL_SCHEMES:
            raise ConfigError(f"--table applies to an SQL store; {redact(url)} is not one")
        options["table"] = table
    return options


def refuse_options(args: argparse.Namespace, command: str, reason: str, *names: str) -> None:
    """ConfigError when an option that means nothing to ``command`` was given."""
    for name in names:
        if getattr(args, name, None) is not None:
            raise ConfigError(f"{command} takes no --{name}: {reason}")


def key_of(args: argparse.Namespace) -> str:
    """KEY as given, or with ``--queue`` the key of message id KEY on that queue."""
    queue = getattr(args, "queue", None)
    return str(args.key) if queue is None else make_key(args.key, queue, "id+queue")
