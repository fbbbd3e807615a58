"""The ``idempotency`` actor option: read, validated and resolved to a policy per actor.

``@dramatiq.actor(idempotency=...)`` takes:

- nothing, ``None`` or ``True``: the policy of the actor's (canonical) queue in the guard;
- a ``dict`` of :class:`~taskonce.Policy` fields: applied over the queue's policy;
- a :class:`~taskonce.Policy`: replaces the queue's policy whole;
- ``False``: the actor is not guarded at all (no store round trip, no events).

The option is read from the actor only, never from a message's options: the policy is the
consumer's decision, and a producer must not be able to switch deduplication off for one
message.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dramatiq.common import q_name

from taskonce.dramatiq_ext.errors import IdempotencyConfigError
from taskonce.errors import ConfigError
from taskonce.policy import Policy

if TYPE_CHECKING:
    from dramatiq import Actor, Broker

    from taskonce.guard import Guard

logger = logging.getLogger("taskonce.dramatiq")

#: The actor option this package declares.
OPTION = "idempotency"


class ActorPolicies:
    """Resolves each actor's ``idempotency`` option to the :class:`Policy` in force for it.

    A resolved policy is cached per actor name, so the hot path hands the guard a ready
    :class:`Policy` (the guard uses a ``Policy`` override as is) and never re-parses a dict.
    ``None`` in the cache means the actor opted out with ``idempotency=False``.
    """

    #: The options :class:`~taskonce.dramatiq_ext.IdempotencyMiddleware` declares.
    actor_options = frozenset({OPTION})

    def __init__(self, guard: Guard) -> None:
        self._guard = guard
        self._policies: dict[str, Policy | None] = {}
        self._lock = threading.Lock()

    def resolve(self, actor: Actor[Any, Any]) -> Policy | None:
        """Validate ``actor``'s option and cache its policy; raises
        :class:`~taskonce.dramatiq_ext.errors.IdempotencyConfigError` naming the actor and
        the bad field."""
        policy = self._policy_of(actor.actor_name, actor.queue_name, actor.options)
        with self._lock:
            self._policies[actor.actor_name] = policy
        return policy

    def for_name(self, broker: Broker, actor_name: str) -> Policy | None:
        """The cached policy of the actor called ``actor_name`` on ``broker`` (resolved now if
        it never was; ``broker.get_actor`` raises ``ActorNotFound`` for an unknown name)."""
        try:
            return self._policies[actor_name]
        except KeyError:
            return self.resolve(broker.get_actor(actor_name))

    def forget(self, actor_name: str) -> None:
        """Drop a cached policy (an actor re-declared under the same name)."""
        with self._lock:
            self._policies.pop(actor_name, None)

    def _policy_of(
        self, actor_name: str, queue_name: str, options: Mapping[str, Any]
    ) -> Policy | None:
        value = options.get(OPTION)
        if value is False:
            return None
        if value is None or value is True:
            override: Policy | Mapping[str, Any] | None = None
        elif isinstance(value, (Policy, Mapping)):
            override = value
        else:
            raise IdempotencyConfigError(
                f"actor {actor_name!r}: {OPTION}={value!r} is not valid; pass a dict of Policy "
                "fields, a taskonce.Policy, True (the queue's policy) or False (not guarded)"
            )
        try:
            return self._guard.policy_for(q_name(queue_name), override)
        except ConfigError as exc:
            raise IdempotencyConfigError(f"actor {actor_name!r}, option {OPTION}: {exc}") from exc
