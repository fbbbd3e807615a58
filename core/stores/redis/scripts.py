"""The Redis store's Lua scripts: one full file each in ``lua/``, read once when this module is
imported and registered once per client (:meth:`Scripts.register`).

Every script begins with the same two lines: Redis < 5 needs effects replication switched on
before a script may write after the non-deterministic ``TIME`` (later versions always do it:
a no-op), and ``ms()`` writes a number of milliseconds as an integer. A script that writes a
time into a record (a claim's lease end, a mark's creation) reads the server's clock with
``TIME`` as ``now``, in milliseconds; an expiry is set relative to the server's clock
(``PEXPIRE``), and a record past its expiry is absent for every script.

The hand-off variants (``complete_sends``, ``mark_sends``) are used only when the handler sent
something: a task that sends nothing runs the plain scripts, with not one argument more.
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
    "beat",
    "seen",
    "complete",
    "complete_sends",
    "release",
    "renew",
    "mark",
    "mark_sends",
    "get",
    "take_sends",
    "dispatched",
    "pending",
    "forget",
)
#: the scripts that write nothing (no ``WAIT`` for replicas after them)
READS = ("get", "seen", "pending")


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
    beat: Script
    seen: Script
    complete: Script
    complete_sends: Script
    release: Script
    renew: Script
    mark: Script
    mark_sends: Script
    get: Script
    take_sends: Script
    dispatched: Script
    pending: Script
    forget: Script

    @classmethod
    def register(cls, client: redis.Redis) -> Scripts:
        """Every script registered with ``client`` (no round trip: redis-py loads a script
        the first time the server answers that it does not have it)."""
        return cls(**{name: client.register_script(TEXTS[name]) for name in NAMES})

    def reads(self) -> frozenset[str]:
        """The SHA1s of the scripts that write nothing."""
        return frozenset(getattr(self, name).sha for name in READS)


__all__ = ["NAMES", "READS", "TEXTS", "Scripts"]
