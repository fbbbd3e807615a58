"""``current_session()``: the database session of the transactional delivery being handled."""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING

from taskonce.errors import TaskonceError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

_current: contextvars.ContextVar[Session | None] = contextvars.ContextVar(
    "taskonce_session", default=None
)


def current_session() -> Session:
    """The SQLAlchemy ``Session`` whose transaction also writes this delivery's mark.

    Write the handler's own rows through it: when the handler returns, the guard writes the
    mark in the same transaction and commits both; when it raises, both roll back. Do not
    commit it yourself. Only available inside a handler guarded with ``transactional=True``.
    """
    session = _current.get()
    if session is None:
        raise TaskonceError(
            "current_session() is only available inside a handler guarded by a policy with "
            "transactional=True on an SQL store"
        )
    return session
