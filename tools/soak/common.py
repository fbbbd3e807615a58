"""What the soak's worker apps share: their configuration (JSON in ``CHAOS_CONFIG``) and the
ledger they write.

Every body run writes one *run* row (autocommit, before the body's work: the evidence of each
run, whatever happens after) and one *ledger* row: the effect whose count the soak checks. With
a transactional policy the ledger row goes through ``taskonce.current_session()`` and commits
with the guard's mark; otherwise it is an autocommit insert of its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import Any

import psycopg

from taskonce.policy import RECEIPT_WINDOW

ENV = "CHAOS_CONFIG"
#: Seconds the hand-off soak keeps records (with receipts on): longer than any run.
KEEP_FOR = 86400.0
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


@dataclasses.dataclass
class Config:
    """One soak's worker configuration."""

    broker: str  # the soak's own redis-server (redis://127.0.0.1:PORT/0)
    store: str  # store URL (PostgreSQL with application_name, or the soak's own redis-server)
    namespace: str  # store prefix (Redis) or table (SQL); also the queue name
    ledger: str  # PostgreSQL table of effects: (key, kind, pid)
    runs: str  # PostgreSQL table of body runs: (key, kind, pid, message_id)
    pg: str  # psycopg URL of the ledger (carries application_name)
    events: str  # JSONL events file
    mode: str = "eager"
    transactional: bool = True
    handoff: bool = False
    lease: float = 8.0
    body: float = 0.15  # seconds each body sleeps between its run row and its ledger row
    #: hand-off: seconds after a child's publish its receipt is looked for; 0: receipts off
    confirm_within: float = 0.0
    relay_every: float = 5.0  # seconds between two sweeps of each worker's relay

    @property
    def child_queue(self) -> str:
        """The hand-off's children's queue: their own, as a follow-up step's usually is, so a
        child does not wait behind a backlog of parents (longer than ``confirm_within``, it
        would be re-sent for being slow rather than lost)."""
        return f"{self.namespace}_child"

    def to_env(self) -> dict[str, str]:
        return {ENV: json.dumps(dataclasses.asdict(self))}

    @classmethod
    def from_env(cls) -> Config:
        return cls(**json.loads(os.environ[ENV]))

    def policy(self) -> dict[str, Any]:
        policy: dict[str, Any] = {
            "mode": self.mode,
            "lease": self.lease,
            "transactional": self.transactional,
        }
        if self.confirm_within:
            # A receipt is looked for up to RECEIPT_WINDOW (15) x confirm_within after the
            # publish, which must fit in half of keep_for: keep records a day, far more.
            policy["confirm_within"] = self.confirm_within
            policy["keep_for"] = max(KEEP_FOR, 2 * RECEIPT_WINDOW * self.confirm_within)
        return policy


def checked(name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"bad table name {name!r}")
    return name


class Ledger:
    """Autocommit writes to the soak's tables, one connection per process (opened after fork,
    opened again after a fault closed it)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._conn: psycopg.Connection[Any] | None = None
        self._pid = 0

    def _connection(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is None or conn.closed or conn.broken or self._pid != os.getpid():
            conn = psycopg.connect(self.config.pg, autocommit=True, connect_timeout=5)
            self._conn, self._pid = conn, os.getpid()
        return conn

    def _insert(self, table: str, key: str, kind: str, message_id: str | None = None) -> None:
        try:
            with self._connection().cursor() as cur:
                if message_id is None:
                    cur.execute(
                        f"INSERT INTO {checked(table)} (key, kind, pid) VALUES (%s, %s, %s)",
                        (key, kind, os.getpid()),
                    )
                else:
                    cur.execute(
                        f"INSERT INTO {checked(table)} (key, kind, pid, message_id) "
                        "VALUES (%s, %s, %s, %s)",
                        (key, kind, os.getpid(), message_id),
                    )
        except psycopg.OperationalError:
            self._conn = None  # a terminated backend: the retry connects again
            raise

    def run_started(self, key: str, kind: str, message_id: str) -> None:
        self._insert(self.config.runs, key, kind, message_id)

    def effect(self, key: str, kind: str) -> None:
        """The body's effect: through the guard's transaction when there is one."""
        if self.config.transactional:
            from sqlalchemy import text

            import taskonce

            taskonce.current_session().execute(
                text(
                    f"INSERT INTO {checked(self.config.ledger)} (key, kind, pid) "
                    "VALUES (:key, :kind, :pid)"
                ),
                {"key": key, "kind": kind, "pid": os.getpid()},
            )
        else:
            self._insert(self.config.ledger, key, kind)

    def body(self, key: str, kind: str, message_id: str) -> None:
        self.run_started(key, kind, message_id)
        time.sleep(self.config.body)
        self.effect(key, kind)


def create_tables(conn: Any, config: Config) -> None:
    for table, extra in ((config.ledger, ""), (config.runs, ", message_id text")):
        conn.execute(
            f"CREATE TABLE {checked(table)} (id bigserial PRIMARY KEY, key text NOT NULL, "
            f"kind text NOT NULL, pid int NOT NULL{extra}, "
            "at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )


def drop_tables(conn: Any, config: Config) -> None:
    for table in (config.ledger, config.runs):
        conn.execute(f"DROP TABLE IF EXISTS {checked(table)}")
