"""What a Dramatiq broker needs for the message of a killed worker process to come back.

- **RabbitMQ**: nothing. A message stays unacknowledged while its actor runs, and the broker
  requeues it as soon as the dead process's connection closes.
- **Redis**: the broker has no connection to lose. A fetched message sits in its worker's
  ``__acks__`` set; a live worker's *maintenance* (on ``maintenance_chance`` commands in a
  million) moves it back to its queue once the dead worker's heartbeat is older than
  ``heartbeat_timeout`` (ms). ``maintenance_chance=0`` never moves it back: the run is lost.
  A ``heartbeat_timeout`` as long as a policy's ``keep_for`` brings a message back after the
  guard forgot its run (a worker killed after recording it, before acknowledging): it runs
  again. (``dead_message_ttl`` only says how long dead-lettered messages are kept.)

:func:`requeue_warnings` says which of these a broker's settings defeat; the middleware logs
them once when a worker starts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from taskonce.policy import Policy

MAINTENANCE_OFF = (
    "taskonce: the Redis broker has maintenance_chance=%r: the messages of a worker process "
    "that dies (SIGKILL, out of memory) are never moved back to their queue, so a run killed "
    "mid-actor is lost. Keep maintenance_chance above 0 (Dramatiq's default: 1000 commands in "
    "a million)."
)
HEARTBEAT_TOO_LONG = (
    "taskonce: the Redis broker's heartbeat_timeout (%g s) is not shorter than keep_for (%g s) "
    "of actor %s: a dead worker process's message can come back after taskonce has forgotten "
    "its run, and run again. Lower heartbeat_timeout (Dramatiq's default: 60 s) or raise "
    "keep_for."
)


def requeue_warnings(broker: Any, policies: Iterable[tuple[str, Policy | None]]) -> list[str]:
    """The settings of ``broker`` that defeat the return of a killed process's messages, as
    warning lines; ``policies``: each guarded actor's name and policy (None: not guarded).
    Only Dramatiq's :class:`~dramatiq.brokers.redis.RedisBroker` has such settings."""
    try:
        from dramatiq.brokers.redis import RedisBroker
    except ImportError:  # Dramatiq without its redis extra: no Redis broker either
        return []
    if not isinstance(broker, RedisBroker):
        return []
    warnings = []
    chance = broker.maintenance_chance
    if not isinstance(chance, (int, float)) or chance <= 0:
        warnings.append(MAINTENANCE_OFF % (chance,))
    timeout = broker.heartbeat_timeout
    guarded = [(name, p) for name, p in policies if p is not None and p.enabled]
    if isinstance(timeout, (int, float)) and guarded:
        name, shortest = min(guarded, key=lambda item: item[1].keep_for)
        if timeout / 1000.0 >= shortest.keep_for:
            warnings.append(HEARTBEAT_TOO_LONG % (timeout / 1000.0, shortest.keep_for, name))
    return warnings
