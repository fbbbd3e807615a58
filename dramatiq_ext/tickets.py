"""Which deliveries this middleware claimed: ownership tracked per message, thread-safely.

Dramatiq fires ``after_process_message`` and ``after_skip_message`` for *every* message —
also for one whose ``before_process_message`` never reached this middleware (an earlier
middleware raised or failed it). Only a delivery whose ticket is held here may be finished or
failed. Worker threads run hooks concurrently, and two deliveries of the same message id can be
in one process at once, so tickets are keyed by the identity of the delivery's
:class:`~dramatiq.broker.MessageProxy` (one object from ``before_*`` to ``after_*``), not by its
message id.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dramatiq.broker import MessageProxy

    from taskonce.guard import Ticket


class TicketBook:
    """Holds the :class:`~taskonce.Ticket` of every delivery between its ``before_*`` and
    ``after_*`` hooks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, tuple[MessageProxy, Ticket]] = {}

    def put(self, message: MessageProxy, ticket: Ticket) -> None:
        """Remember that this middleware began ``ticket`` for ``message``."""
        with self._lock:
            self._held[id(message)] = (message, ticket)

    def take(self, message: MessageProxy) -> Ticket | None:
        """The ticket held for ``message`` (forgetting it), or None when this middleware did not
        begin this delivery."""
        with self._lock:
            entry = self._held.get(id(message))
            if entry is None or entry[0] is not message:
                return None
            del self._held[id(message)]
        return entry[1]

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)
