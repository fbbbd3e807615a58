"""CPU time of worker processes and of a store's redis-server, the one way the benchmarks read it.

- :func:`group_cpu`: user + system seconds of every live process in a process group (a Celery
  worker started with ``start_new_session=True``: its main process and its pool children),
  from ``/proc/<pid>/stat``. Take it before and after a round; the difference is the worker's
  CPU for the round (children that exit meanwhile are lost, so a round must not recycle them).
- :class:`StoreMeter`: a dedicated redis-server's own CPU time (``/proc/<pid>/stat``) and the
  time its commands took by its own account (``INFO commandstats`` ``usec``). Redis counts a
  command a Lua script runs under the command's own name *and* inside the script's ``usec``;
  :meth:`StoreMeter.since` counts it once, inside the script: the commands named by
  ``redis.call('…')`` in taskonce's Redis store scripts are left out of a round in which
  scripts ran (the benchmarks' other guards run no scripts; a taskonce round runs no
  top-level command of those names).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import re
from collections.abc import Iterable
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK")
_SCRIPTS = ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro")


def pid_cpu(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads, exited ones too)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state): utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / _TICK


def group_cpu(pgid: int) -> float:
    """User + system CPU seconds of every live process whose process group is ``pgid``."""
    return sum(group_cpu_split(pgid))


def group_cpu_split(pgid: int) -> tuple[float, float]:
    """User + system CPU seconds of the process group's leader (``pid == pgid``: a Celery
    worker's main process) and of its other live processes (the pool)."""
    leader = others = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:  # field 5: pgrp
            cpu = (int(fields[11]) + int(fields[12])) / _TICK
            if int(entry) == pgid:
                leader += cpu
            else:
                others += cpu
    return leader, others


def script_commands() -> frozenset[str]:
    """Command names the Lua scripts of taskonce's Redis store modules call."""
    import taskonce.stores as stores

    names: set[str] = set()
    for info in pkgutil.iter_modules(stores.__path__):
        if not info.name.startswith("redis"):
            continue
        module = importlib.import_module(f"taskonce.stores.{info.name}")
        for value in vars(module).values():
            if isinstance(value, str):
                names.update(re.findall(r"redis\.p?call\(\s*['\"](\w+)['\"]", value))
    return frozenset(name.lower() for name in names)


@dataclasses.dataclass(frozen=True)
class StoreReading:
    """What a store's redis-server had done at one moment (cumulative counters)."""

    cpu_s: float  # its process's user + system CPU seconds
    calls: dict[str, int]  # per command, as INFO commandstats counts them
    usec: dict[str, int]  # per command


@dataclasses.dataclass(frozen=True)
class StoreWork:
    """What a store's redis-server did between two readings."""

    cpu_s: float  # its process's user + system CPU seconds
    usec: int  # top-level commands' usec (a script's includes the commands it ran)
    commands: int  # commands as Redis counts them (those scripts ran included)
    scripts: int  # EVAL/EVALSHA/FCALL calls
    #: per command: (calls, usec); a command a script ran has its calls here and its usec
    #: inside the script's (0 of its own), as :attr:`usec` counts it
    by_command: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)


class StoreMeter:
    """Reads a redis-server's CPU and command time; ``pid`` is its process id."""

    def __init__(self, client: Any, pid: int, nested: Iterable[str] | None = None) -> None:
        self.client = client
        self.pid = pid
        self.nested = frozenset(script_commands() if nested is None else nested)

    def read(self) -> StoreReading:
        calls: dict[str, int] = {}
        usec: dict[str, int] = {}
        for name, value in self.client.info("commandstats").items():
            command = name.removeprefix("cmdstat_")
            if command in ("info", "config|resetstat"):  # our own readings
                continue
            calls[command], usec[command] = int(value["calls"]), int(value["usec"])
        return StoreReading(pid_cpu(self.pid), calls, usec)

    def since(self, before: StoreReading) -> StoreWork:
        """The work done since ``before``: where scripts ran meanwhile, the commands their
        Lua calls (by name) are counted inside the scripts' time only."""
        after = self.read()
        calls = {c: n - before.calls.get(c, 0) for c, n in after.calls.items()}
        usec = {c: n - before.usec.get(c, 0) for c, n in after.usec.items()}
        scripts = sum(calls.get(c, 0) for c in _SCRIPTS)
        own = {
            command: 0 if scripts and command in self.nested and command not in _SCRIPTS else spent
            for command, spent in usec.items()
        }
        by_command = {c: (n, own[c]) for c, n in calls.items() if n}
        return StoreWork(
            after.cpu_s - before.cpu_s,
            sum(own.values()),
            sum(calls.values()),
            scripts,
            by_command,
        )
