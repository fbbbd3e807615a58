"""Keeping the first run's result in Dramatiq's ``Results`` backend.

``dramatiq.results.Results`` stores ``None`` for every skipped message that is not failed
(``after_skip_message``) and the exception for every failed one (``after_nack``). A skipped
duplicate carries the same message id, queue and actor as the delivery that ran, so its
result key is the same: without care, the duplicate would overwrite the first run's stored
result with ``None`` (or a dead-lettered payload mismatch with an exception).

``Results`` reads ``message.options["store_results"]`` before the actor's option, so turning
it off on *this delivery's* options (the delivery is acknowledged or dead-lettered right after
and never enqueued again — a redelivery copy is made before this runs) keeps the backend
untouched, whatever the order of the two middleware.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dramatiq.broker import MessageProxy


def keep_first_result(message: MessageProxy) -> None:
    """Make ``Results`` leave the stored result of ``message``'s id alone for this delivery."""
    message.options["store_results"] = False
