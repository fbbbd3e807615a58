"""The Redis store's Lua scripts: one full file each in ``lua/``, read once when this module is
imported and registered once per client (:meth:`Scripts.register`).

Every script that writes begins by switching effects replication on: Redis < 5 needs it
before a script may write after the non-deterministic ``TIME``, and a script that writes what
it computed from ``PTTL`` must replicate that value, not run again on a replica whose clock
differs (later versions always do it: a no-op). The record's times are offsets before its
expiry (:mod:`.layout`), and the expiry is set relative to the server's clock (``PX``), so most
scripts judge a lease or move a time with ``PTTL`` alone; ``TIME`` is read only where an
absolute time leaves the server (a read's ``now``, the sends index's score). A record past its
expiry is absent for every script.

A new claim and a lazy mark without sends are not scripts: the client writes the packed record
with one plain ``SET … NX PX`` (:meth:`~taskonce.stores.redis.store.RedisStore.claim`); only a
claim that finds a record goes on to ``claim``. The hand-off variants (``complete_sends``,
``mark_sends``) are used only when the handler sent something: a task that sends nothing runs
the plain ones, with not one argument more.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from types import MappingProxyType

import redis
from redis.commands.core import Script

#: the scripts' names: ``lua/<name>.lua`` each
NAMES = (
    "claim",
    "take_over",
    "quarantine",
    "beat",
    "seen",
    "complete",
    "complete_sends",
    "release",
    "renew",
    "mark_sends",
    "get",
    "take_sends",
    "dispatched",
    "forget",
    "settle",
    "take_receipts",
    "relay",
    "sweep",
)
#: the scripts that write nothing (no ``WAIT`` for replicas after them)
READS = ("get", "seen", "relay")


def _read(name: str) -> str:
    folder = resources.files(__name__.rpartition(".")[0]).joinpath("lua")
    return folder.joinpath(f"{name}.lua").read_text(encoding="utf-8")


#: every script's text by name
TEXTS = MappingProxyType({name: _read(name) for name in NAMES})


@dataclasses.dataclass(frozen=True)
class Scripts:
    """The scripts registered with one client (each knows its text and SHA1)."""

    claim: Script
    take_over: Script
    quarantine: Script
    beat: Script
    seen: Script
    complete: Script
    complete_sends: Script
    release: Script
    renew: Script
    mark_sends: Script
    get: Script
    take_sends: Script
    dispatched: Script
    forget: Script
    settle: Script
    take_receipts: Script
    relay: Script
    sweep: Script

    @classmethod
    def register(cls, client: redis.Redis) -> Scripts:
        """Every script registered with ``client`` (no round trip: redis-py loads a script
        the first time the server answers that it does not have it)."""
        return cls(**{name: client.register_script(TEXTS[name]) for name in NAMES})

    def reads(self) -> frozenset[str]:
        """The SHA1s of the scripts that write nothing."""
        return frozenset(getattr(self, name).sha for name in READS)


__all__ = ["NAMES", "READS", "TEXTS", "Scripts"]
