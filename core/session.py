"""``current_session()``: the database session of the transactional delivery being handled."""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING

from taskonce.errors import TaskonceError
from taskonce.stores.base import Store
from taskonce.stores.transactional import TransactionalStore
from taskonce.ticket import Ticket, reset_var

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
    from sqlalchemy.orm import Session

    if not isinstance(session, Session):
        raise TaskonceError(
            "current_session(): this handler's transaction is Django's (a django:// store): "
            "write through the ORM on the store's database; its rows commit with the mark"
        )
    return session


def open_session(store: Store, ticket: Ticket) -> None:
    """Begin the transactional ``ticket``'s session on ``store`` (an SQL store: policies with
    ``transactional=True`` are refused for others) and make it :func:`current_session`."""
    assert isinstance(store, TransactionalStore)
    session = store.open_session()
    ticket.session = session
    ticket.session_token = _current.set(session)


def close_session(ticket: Ticket) -> None:
    """Close the transactional ``ticket``'s session (rolling back whatever was not committed)
    and take it out of :func:`current_session`."""
    session = ticket.session
    if session is None:
        return
    ticket.session = None
    try:
        session.close()
    finally:
        if ticket.session_token is not None:
            reset_var(_current, ticket.session_token)
            ticket.session_token = None
