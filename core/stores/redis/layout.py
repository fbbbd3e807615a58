"""The Redis store's record: one Redis string per key, packed text, written by the client (a
claim, a plain mark) or by the scripts, and read back here.

Why a packed string and not a hash of fields: a week of messages is tens of millions of
records, and a completed one must cost little more than the smallest thing Redis can keep
under that key name (a plain ``SET key <8 bytes> PX``). A Redis string of at most 44 bytes is
one allocation with its object header (``embstr``); at most 28 bytes it fits the 48-byte size
class, which puts a completed eager record with its fingerprint (26 bytes) at 136 bytes of
``MEMORY USAGE`` against the floor's 120 on the default key names (docs/performance.md). A
listpack hash of the same fields was 232.

The layout, the first character saying which (``|`` separates fields; text fields never hold
one, see :func:`safe`; numbers are hexadecimal)::

    i<owner>|<created>|<lease>|<fp>|<worker>[|<crashes>]
                                                   a claim (in progress; both numbers 11 digits)
    c<created>|<fp>[|<result>]                     completed (an eager claim's completion)
    m<created>|<fp>[|<result>]                     marked (lazy)
    p<created>|<fp>|<token>|<recorded>|<dispatch>|<n>|<sends>[|<result>]
    q…                                             as p, for a lazy mark
    a<created>|<fp>|<token>|<due>|<dispatch>|<n>|<entries>[|<result>]
    b…                                             as a, for a lazy mark
    x<created>|<fp>|<crashes>                      quarantined (its owners died too often)

``p``/``q``: completed or marked with deferred sends still to publish: their dispatch
``token``, when they were ``recorded``, the end of a dispatcher's lease (``dispatch``), and
``sends``, a JSON array of the sends' JSON texts, ``n`` bytes long.

``a``/``b``: completed or marked, their sends published and awaiting their receipts
(:mod:`taskonce.receipts`): the same shape as ``p``/``q``, so one parse reads all four, with
``due`` (when the relay should look at them) where ``recorded`` was and ``entries``, the
receipts' own JSON text (kept as it is), ``n`` bytes long. ``token`` and ``dispatch`` are the
relay's lease on them (both let go, ``token`` empty, when they are written). An empty ``due``
says none is awaited any more: the entries were given up on and are kept only for ``taskonce
inspect`` (the record is out of the receipts index). A record has sends pending or awaits
receipts, never both, so a kind letter says which, and a record of any of the four kinds is a
handled key to a claim or a mark.

Times are whole milliseconds *before the record's expiry* (the key's own ``PX``, set by the
Redis server's clock): ``created`` is the first claim or mark, ``lease`` the end of a claim's
lease, ``dispatch`` the end of a dispatcher's lease (0 when it outlives the record), ``due``
the receipts' due time (0 when it is not before the expiry: never reached). A client
can write a record with one plain ``SET … NX PX`` and still have every time judged by the
server's clock (a claim's lease ends ``keep_ms`` before the expiry it asks for), a script can
tell whether a lease ran out from ``PTTL`` alone (``PTTL <= lease``), and the numbers stay as
short as the retention is long, whatever the date. A script that moves the expiry rewrites the
offsets. Hexadecimal because a script reads it with ``tonumber(s, 16)`` (``strtoul``) and
writes it with ``%x``, a fraction of the instructions of decimal's ``strtod`` and ``%.14g`` on
the completion's path, and it is shorter; a claim's two numbers have a fixed width, so the
completion finds them without a search.

``crashes``: how many times a claim of the key was taken over from a dead, silent or expired
owner (``Policy.crash_limit``). A new claim has none (the field is left out, so it costs a
first claim nothing); the take-overs write it, a renewal keeps it, a completion drops it.

``result`` is the last field (it may hold anything); ``sends`` is length-prefixed for the same
reason. ``fp``, ``owner``, ``worker`` and ``token`` are written by :func:`packed_fp` and
:func:`safe`, so none holds a ``|``; an absent one is empty.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import re
from typing import Any

#: the kinds a record starts with
CLAIM, COMPLETED, MARKED, SENDING, MARKED_SENDING = "i", "c", "m", "p", "q"
AWAITING, MARKED_AWAITING = "a", "b"
QUARANTINED = "x"
KINDS = frozenset(
    (CLAIM, COMPLETED, MARKED, SENDING, MARKED_SENDING, AWAITING, MARKED_AWAITING, QUARANTINED)
)
_HEX = re.compile(r"(?:[0-9a-f]{2})+")
_UNSAFE = re.compile(r"[|~]")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def packed_fp(fingerprint: str | None) -> str:
    """A fingerprint as the record holds it: a lowercase hex digest as the URL-safe Base64 of
    its bytes (24 hex digits become 16 characters); any other text as ``~`` and the Base64 of
    its UTF-8; None as empty. The scripts compare packed fingerprints as they are."""
    if fingerprint is None:
        return ""
    if _HEX.fullmatch(fingerprint):
        return _b64(bytes.fromhex(fingerprint))
    return "~" + _b64(fingerprint.encode("utf-8"))


def unpacked_fp(packed: str) -> str | None:
    """The inverse of :func:`packed_fp`."""
    if not packed:
        return None
    if packed[0] == "~":
        return _unb64(packed[1:]).decode("utf-8")
    return _unb64(packed).hex()


def safe(text: str | None) -> str:
    """An owner token, worker identity or dispatch token as the record holds it: as it is,
    unless it holds a ``|`` or starts with ``~`` (then ``~`` and its Base64); None as empty."""
    if not text:
        return ""
    if _UNSAFE.search(text) is None:
        return text
    return "~" + _b64(text.encode("utf-8"))


def unsafe(field: str) -> str | None:
    """The inverse of :func:`safe`."""
    if not field:
        return None
    if field[0] == "~":
        return _unb64(field[1:]).decode("utf-8")
    return field


#: a claim's numbers are this many hex digits (up to 557 years)
WIDTH = 11


def claim_record(owner: str, ttl_ms: int, keep_ms: int, fp: str, worker: str) -> str:
    """A new claim as the client writes it with ``SET … NX PX ttl_ms`` (``fp`` packed, the
    texts :func:`safe`): created at the write (``ttl_ms`` before the expiry), its lease ending
    ``keep_ms`` before the expiry."""
    if ttl_ms >= 16**WIDTH:
        raise ValueError(f"a lease and keep_for of {ttl_ms} ms together are too long to keep")
    return f"i{owner}|{ttl_ms:011x}|{keep_ms:011x}|{fp}|{worker}"


def mark_record(keep_ms: int, fp: str, result: str | None) -> str:
    """A lazy mark as the client writes it with ``SET … NX PX keep_ms``."""
    return f"m{keep_ms:x}|{fp}" if result is None else f"m{keep_ms:x}|{fp}|{result}"


def sending_record(
    kind: str, keep_ms: int, fp: str, token: str, lease_ms: int, sends: str, result: str | None
) -> str:
    """A mark with pending ``sends`` (a JSON array) as :data:`mark_sends` writes it: recorded
    now, its dispatcher's lease ``lease_ms`` from now, kept ``keep_ms``."""
    size = len(sends.encode("utf-8"))
    dispatch = max(0, keep_ms - lease_ms)
    head = f"{kind}{keep_ms:x}|{fp}|{token}|{keep_ms:x}|{dispatch:x}|{size:x}|{sends}"
    return head if result is None else f"{head}|{result}"


def kind_of(value: Any) -> str | None:
    """A record's kind by a look at its first field only (for counting many), or None when
    ``value`` cannot be a record of this layout."""
    raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
    kind = raw[:1].decode("ascii", "replace")
    return kind if kind in KINDS and b"|" in raw else None


@dataclasses.dataclass(frozen=True)
class Fields:
    """A record read back: its kind and fields, times as offsets before the expiry (ms)."""

    kind: str
    created: int
    fingerprint: str | None = None
    result: str | None = None
    owner: str | None = None
    lease: int = 0
    worker: str | None = None
    token: str | None = None
    sends: tuple[str, ...] = ()
    #: the entries awaiting their receipts (kinds ``a``/``b``: JSON text, as it was written)
    receipts: str | None = None
    #: their due time (ms before the expiry), None when none is awaited any more
    due: int | None = None
    #: take-overs of the key from dead owners (claims, quarantined records)
    crashes: int = 0


def parse(value: Any) -> Fields | None:
    """The fields of a record (a reply item: bytes or text), or None when ``value`` is not a
    record of this layout (a foreign key under the prefix)."""
    if value is None:
        return None
    raw = value if isinstance(value, bytes) else str(value).encode("utf-8")
    try:
        return _parse(raw)
    except (ValueError, IndexError, UnicodeDecodeError, binascii.Error):
        return None


def _parse(raw: bytes) -> Fields | None:
    kind = raw[:1].decode("ascii")
    if kind not in KINDS:
        return None
    if kind == CLAIM:
        owner, created, lease, fp, worker, *crashes = raw[1:].decode("utf-8").split("|")
        if len(crashes) > 1:
            return None
        return Fields(
            kind,
            int(created, 16),
            unpacked_fp(fp),
            owner=unsafe(owner),
            lease=int(lease, 16),
            worker=unsafe(worker),
            crashes=int(crashes[0], 16) if crashes else 0,
        )
    if kind == QUARANTINED:
        created, fp, count = raw[1:].decode("ascii").split("|")
        return Fields(kind, int(created, 16), unpacked_fp(fp), crashes=int(count, 16))
    if kind in (COMPLETED, MARKED):
        parts = raw[1:].split(b"|", 2)
        result = parts[2].decode("utf-8") if len(parts) > 2 else None
        return Fields(kind, int(parts[0], 16), unpacked_fp(parts[1].decode("ascii")), result)
    # p/q: created, fp, token, recorded, dispatch, n, the rest; a/b: due where recorded is
    head = raw[1:].split(b"|", 6)
    size = int(head[5], 16)
    block, tail = head[6][:size], head[6][size:]
    if tail and tail[:1] != b"|":
        return None
    fields = Fields(
        kind,
        int(head[0], 16),
        unpacked_fp(head[1].decode("ascii")),
        tail[1:].decode("utf-8") if tail else None,
        token=unsafe(head[2].decode("utf-8")),
    )
    if kind in (SENDING, MARKED_SENDING):
        return dataclasses.replace(fields, sends=tuple(json.loads(block)))
    due = int(head[3], 16) if head[3] else None
    return dataclasses.replace(fields, receipts=block.decode("utf-8"), due=due)


__all__ = [
    "AWAITING",
    "CLAIM",
    "COMPLETED",
    "KINDS",
    "MARKED",
    "MARKED_AWAITING",
    "MARKED_SENDING",
    "QUARANTINED",
    "SENDING",
    "Fields",
    "claim_record",
    "kind_of",
    "mark_record",
    "packed_fp",
    "parse",
    "safe",
    "sending_record",
    "unpacked_fp",
    "unsafe",
]
