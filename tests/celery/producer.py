"""A web process's send: ``python -m tests.celery.producer TABLE LABEL QUEUE``.

Imports :mod:`tests.celery.app_under_test` (configured by the same ``TO_*`` environment as the
worker; an SQL store), prints ``ready``, waits for a line on its standard input, then sends
``t.record(TABLE, LABEL)`` to ``QUEUE`` inside :func:`taskonce.send_on_commit` on a session of
the store's database, commits (the guard publishes it right after) and prints the task id.
"""

from __future__ import annotations

import sys

import sqlalchemy as sa
from sqlalchemy.orm import Session

import taskonce
from tests.celery.app_under_test import GUARD, STORE, record


def main(table: str, label: str, queue: str) -> str:
    engine = sa.create_engine(STORE)
    try:
        with Session(engine) as session:
            with taskonce.send_on_commit(session, guard=GUARD):
                result = record.apply_async((table, label), queue=queue)
            session.commit()
    finally:
        engine.dispose()
    return str(result.id)


if __name__ == "__main__":
    print("ready", flush=True)
    sys.stdin.readline()
    print(main(*sys.argv[1:4]), flush=True)
    GUARD.close()
