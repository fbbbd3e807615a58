"""Receipts: a published send whose receiver is guarded on the same store is looked for in that
store, and published again when the broker lost it.

When the dispatcher publishes a record's sends (:mod:`taskonce.dispatch`), each framework's
publisher says where the send's *receipt* will show (:class:`~taskonce.handoff.Receipt`): the
key the receiving task's or actor's guard claims, marks or skips. Those sends stay in the
sender's record as *awaiting* (:class:`Entry`), and the record joins the store's receipts index,
due ``confirm_within`` seconds after the publish (after the send's ETA, when it has one). The
relay (:func:`look`) reads the receivers' records when that time comes: a send whose receiver
has a record is done; one without is published again under the same id (``sends_redispatched``,
reason ``unconfirmed``) and looked for again after 2, then 4, then 8 × ``confirm_within``; after
:data:`TRIES` re-sends without a receipt it is reported once (``send_unconfirmed``) and kept in
the record, given up on, for ``taskonce inspect``.

Bounded by ``keep_for``: the last look is :func:`window` after the publish, and a receipt must
never be looked for after the receiver's record may have expired (a handled child would then be
sent again). A send is awaited only when the receiver's ``keep_for`` is at least twice that
window; otherwise it is confirmed at publish, as a send to an unguarded receiver is, and a
warning says so once per receiving queue. (:class:`~taskonce.Policy` refuses a
``confirm_within`` set by hand that its own ``keep_for`` cannot hold.)

No write on the receiver's path: its guard's ordinary record is the receipt. For a lazy receiver
that record is the mark written after its handler, so ``confirm_within`` must exceed the time a
message may wait in its queue plus the handler's run; an eager receiver's claim is written when
it starts. A run that fails leaves no record of its key (the retry must be able to claim it), so
the guard marks ``<key>\x1freceived`` then (:func:`note_failure`; :data:`RECEIVED_SUFFIX`): a
retry waiting out its countdown is not taken for a lost message.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import secrets
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from taskonce.errors import StoreUnavailable, TaskonceError
from taskonce.events import Event, make_event
from taskonce.handoff import Receipt, Send
from taskonce.keys import queue_of
from taskonce.policy import RECEIPT_WINDOW
from taskonce.stores.base import Awaiting, Store

if TYPE_CHECKING:
    from taskonce.dispatch import Dispatcher

logger = logging.getLogger("taskonce")

#: A send without a receipt is published again at most this many times, then given up on.
TRIES = 3
#: Each look after a re-send waits twice as long as the one before.
BACKOFF = 2.0
#: A re-send that could not be published (broker down) is tried again after this many seconds,
#: without counting as a try.
RETRY_PUBLISH = 5.0
#: A delivery whose handler failed leaves no record of its key (an eager claim is released for
#: the retry; a lazy run marks nothing), yet it arrived: the guard marks its key with this
#: suffix, and a receipt counts it. Otherwise a retry waiting out its countdown would look
#: like a lost message, and each copy sent again would start a retry chain of its own. It
#: starts with a control character, which no message id or queue may contain
#: (:func:`taskonce.keys.make_key`), so the mark is never the key of a message: with a
#: printable suffix such as ``~received``, a message whose id is ``<id>~received`` would be
#: skipped as a duplicate once ``<id>`` had failed.
RECEIVED_SUFFIX = "\x1freceived"


def received_key(key: str) -> str:
    """The key the guard marks when a delivery of ``key`` failed (:data:`RECEIVED_SUFFIX`)."""
    return f"{key}{RECEIVED_SUFFIX}"


def note_failure(store: Store, key: str | None, keep_for: float) -> None:
    """Mark :func:`received_key` of a delivery whose handler failed (on the failure path only:
    one write per failed run, none on a run that succeeds). Best effort: a store that cannot
    take it costs at most one needless copy of the message later."""
    if key is None:
        return
    try:
        store.mark(received_key(key), keep_for, None, None)
    except (StoreUnavailable, TaskonceError) as exc:
        logger.debug("could not note the failed delivery of %s (%s)", key, exc)


def window(within: float, after: float = 0.0) -> float:
    """Seconds from a send's first publish to the last look for its receipt: ``within`` after
    the ETA, then after each of the :data:`TRIES` re-sends (whose ETA is as far again) 2, 4
    and 8 × ``within``."""
    return RECEIPT_WINDOW * within + (TRIES + 1) * after


def _next_wait(within: float, after: float, tries: int) -> float:
    """Seconds from a publish (the first, ``tries`` 0, or a re-send) to the look after it."""
    return after + within * BACKOFF**tries


@dataclasses.dataclass
class Entry:
    """One published send awaiting its receipt (or given up on).

    :param send: the send's JSON text, as recorded.
    :param key: its receiver's key in the store.
    :param at: seconds after the record's due time at which this entry is due.
    :param tries: how many times it was published again.
    :param after: seconds from a publish to the send's ETA.
    :param unconfirmed: given up on: no receipt after :data:`TRIES` re-sends.
    """

    send: str
    key: str
    at: float = 0.0
    tries: int = 0
    after: float = 0.0
    unconfirmed: bool = False

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"send": self.send, "key": self.key, "at": round(self.at, 3)}
        if self.tries:
            data["tries"] = self.tries
        if self.after:
            data["after"] = self.after
        if self.unconfirmed:
            data["unconfirmed"] = True
        return data

    @functools.cached_property
    def within(self) -> float:
        """The sender's ``confirm_within`` for this send (read from it once)."""
        return Send.from_json(self.send).within

    def rest(self, remaining: float) -> float:
        """Seconds from now until this entry's last look, when its next look is ``remaining``
        seconds away."""
        within = self.within
        return remaining + sum(
            _next_wait(within, self.after, tries) for tries in range(self.tries + 1, TRIES + 1)
        )


def encode(entries: Sequence[Entry]) -> str:
    """The entries as a record keeps them (compact JSON)."""
    return json.dumps([e.as_dict() for e in entries], separators=(",", ":"))


def decode(text: str) -> list[Entry]:
    """The inverse of :func:`encode`."""
    return [
        Entry(
            send=item["send"],
            key=item["key"],
            at=float(item.get("at", 0.0)),
            tries=int(item.get("tries", 0)),
            after=float(item.get("after", 0.0)),
            unconfirmed=bool(item.get("unconfirmed", False)),
        )
        for item in json.loads(text)
    ]


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_once(receiver: str, message: str, *args: Any) -> None:
    with _warned_lock:
        if receiver in _warned:
            return
        _warned.add(receiver)
    logger.warning(message, *args)


def awaiting(texts: Sequence[str], receipts: Sequence[Receipt | None]) -> Awaiting | None:
    """What a record keeps after publishing ``texts`` whose publishers answered ``receipts``:
    the sends to await (receiver guarded on this store, ``confirm_within`` on, the receiver's
    ``keep_for`` long enough), or None when there are none."""
    waiting: list[tuple[float, Entry]] = []
    for text, receipt in zip(texts, receipts, strict=True):
        if receipt is None:
            continue
        within = Send.from_json(text).within
        if within <= 0:
            continue
        after = max(0.0, receipt.after)
        if window(within, after) * 2 > receipt.keep_for:
            _warn_once(
                receipt.key.rsplit(":", 1)[0],
                "the receipt of a send to %s is not awaited: its receiver keeps its records "
                "%gs, less than twice the %gs taskonce would look for it (15 x confirm_within "
                "and the send's delay); raise the receiver's keep_for or lower the sender's "
                "confirm_within",
                receipt.key,
                receipt.keep_for,
                window(within, after),
            )
            continue
        waiting.append((_next_wait(within, after, 0), Entry(text, receipt.key, after=after)))
    if not waiting:
        return None
    return _awaiting(waiting, [])


def _awaiting(waiting: Sequence[tuple[float, Entry]], given_up: Sequence[Entry]) -> Awaiting:
    """The record's entries: those still awaited, each ``remaining`` seconds from its look, and
    those given up on."""
    if not waiting:
        return Awaiting(encode(given_up), None, 0.0)
    due = min(remaining for remaining, _ in waiting)
    for remaining, entry in waiting:
        entry.at = remaining - due
    last_look = max(entry.rest(remaining) for remaining, entry in waiting)
    # A margin beyond the last look, so the record outlives it whatever the relay's delay.
    margin = max(entry.within for _, entry in waiting)
    return Awaiting(encode([e for _, e in waiting] + list(given_up)), due, last_look + margin)


def look(dispatcher: Dispatcher, key: str) -> int:
    """The relay's look at record ``key``'s awaited receipts, when due: the sends without one
    are published again (or given up on after :data:`TRIES`). Returns how many it published.

    :raises StoreUnavailable: the store could not be read or written (the relay tries later).
    """
    store = dispatcher.store
    token = secrets.token_hex(16)
    lease = store.take_receipts(key, token, dispatcher.lease)
    if lease.entries is None:
        return 0  # not due, taken by another relay, or gone
    entries = decode(lease.entries)
    given_up = [e for e in entries if e.unconfirmed]
    awaited = [e for e in entries if not e.unconfirmed]
    due = [e for e in awaited if e.at - lease.late <= 0]
    waiting = [(e.at - lease.late, e) for e in awaited if e.at - lease.late > 0]
    found = store.have_records([k for e in due for k in (e.key, received_key(e.key))])
    seen = [found[2 * i] or found[2 * i + 1] for i in range(len(due))]
    unseen = [e for e, arrived in zip(due, seen, strict=True) if not arrived]
    published: list[Entry] = []
    failed = False
    for entry in unseen:
        if entry.tries >= TRIES:
            entry.unconfirmed = True
            given_up.append(entry)
            _unconfirmed(dispatcher, key, entry)
            continue
        if not failed and dispatcher.publish_all(key, (entry.send,)) is not None:
            entry.tries += 1
            published.append(entry)
            waiting.append((_next_wait(entry.within, entry.after, entry.tries), entry))
        else:
            failed = True  # the broker is down: look again soon, the try not counted
            waiting.append((RETRY_PUBLISH, entry))
    settled = _awaiting(waiting, given_up) if waiting or given_up else None
    try:
        store.settle_receipts(key, token, settled)
    except StoreUnavailable:
        # Published but not written back: they may be published once more, same ids.
        logger.warning("receipts of %s could not be written back after the relay's look", key)
        raise
    if published:
        _redispatched(dispatcher, key, published)
    return len(published)


def _redispatched(dispatcher: Dispatcher, key: str, published: Sequence[Entry]) -> None:
    from taskonce.outbox import OUTBOX_PREFIX

    texts = [e.send for e in published]
    if key.startswith(OUTBOX_PREFIX):
        dispatcher.outbox_event(Event.SENDS_REDISPATCHED, key, texts, reason="unconfirmed")
        return
    dispatcher.sinks.send(
        make_event(
            Event.SENDS_REDISPATCHED,
            key=key,
            lease_s=dispatcher.lease,
            count=len(texts),
            reason="unconfirmed",
        )
    )


def _unconfirmed(dispatcher: Dispatcher, key: str, entry: Entry) -> None:
    from taskonce.outbox import OUTBOX_PREFIX

    send = Send.from_json(entry.send)
    name = send.body.get("task") or send.body.get("actor_name")
    logger.warning(
        "send %s of %s to %s (%s) was published %d more times and never received; "
        "taskonce stops re-sending it (taskonce inspect %s)",
        send.id,
        key,
        entry.key,
        name,
        entry.tries,
        key,
    )
    dispatcher.sinks.send(
        make_event(
            Event.SEND_UNCONFIRMED,
            # the sender's record, for taskonce inspect; a producer's outbox record is no
            # delivery's key (its events name none)
            key=None if key.startswith(OUTBOX_PREFIX) else key,
            queue=queue_of(entry.key),
            message_id=send.id,
            task=name,
            framework=send.framework,
            count=1,
            reason="no_receipt",
        )
    )


def described(text: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    """A record's receipts (:attr:`~taskonce.stores.Record.receipts`) for ``taskonce
    inspect``: as JSON data, and as lines (``awaiting receipt …`` / ``unconfirmed send …``)."""
    if not text:
        return [], []
    data: list[dict[str, Any]] = []
    lines: list[str] = []
    for entry in decode(text):
        send = Send.from_json(entry.send)
        name = send.body.get("task") or send.body.get("actor_name") or "?"
        state = "unconfirmed send" if entry.unconfirmed else "awaiting receipt"
        lines.append(
            f"{state} {send.id} {send.framework} {name} -> {entry.key} "
            f"(re-sent {entry.tries} time{'' if entry.tries == 1 else 's'})"
        )
        data.append(
            {
                "id": send.id,
                "framework": send.framework,
                "name": name,
                "receiver_key": entry.key,
                "tries": entry.tries,
                "unconfirmed": entry.unconfirmed,
            }
        )
    return data, lines


__all__ = ["TRIES", "Entry", "awaiting", "decode", "described", "encode", "look", "window"]
