"""Worker identity and liveness: telling a dead claim owner from a slow one.

Every claim records its owner's *worker identity*, ``host/ns/pid/start``:

``host``   ``TASKONCE_WORKER_ID`` when set, else the host name
``ns``     the process's pid namespace (``/proc/self/ns/pid``), so two containers that share a
           host name but not a pid namespace never judge each other's pids
``pid``    the process id
``start``  the process start time (``/proc/<pid>/stat`` field 22, clock ticks since boot), so a
           new process that reuses a dead owner's pid is not taken for the owner

A claim found in progress is judged by two signs of life:

* **on the same host** (same ``host`` and ``ns``): the owner process is gone — no such pid, a
  different start time, or a zombie — so the claim is taken over at once;
* **anywhere**: each worker process writes a liveness record in the store every
  :data:`BEAT_INTERVAL` seconds that lives :data:`LIVENESS_WINDOW` seconds by the store's
  clock. An owner whose record has lapsed is silent (dead, paused or cut off) and its claim is
  taken over. The lease stays as the backstop.

One daemon thread per process writes the liveness record (:class:`Liveness`); after a fork the
child starts its own, under its own identity.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING

from taskonce.errors import ConfigError, StoreUnavailable
from taskonce.outage import StoreHealth

if TYPE_CHECKING:
    from taskonce.stores.base import Record, Store

logger = logging.getLogger(__name__)

#: Seconds between two liveness writes of one worker process.
BEAT_INTERVAL = 4.0
#: Seconds a liveness record lives after its write (store clock): a silent owner is judged dead
#: at most this long after its last sign of life (three missed writes).
LIVENESS_WINDOW = 12.0
#: Seconds a process must itself have written its record without a failure before it calls
#: another owner silent: after a store outage every owner looks silent until its next write,
#: which comes within two intervals of the store answering again.
SILENCE_STREAK = 2 * BEAT_INTERVAL
#: The environment variable that names the host part of the worker identity.
ENV_VAR = "TASKONCE_WORKER_ID"
#: Longest accepted ``TASKONCE_WORKER_ID``.
MAX_NAME_LENGTH = 100


@dataclasses.dataclass(frozen=True)
class Identity:
    """A worker process's identity; ``str()`` gives the form stored with claims."""

    host: str
    ns: str
    pid: int
    start: str

    def __str__(self) -> str:
        return f"{self.host}/{self.ns}/{self.pid}/{self.start}"

    @classmethod
    def parse(cls, text: str | None) -> Identity | None:
        """The identity in ``text``, or None when it is not one (an older or foreign claim)."""
        if not text:
            return None
        parts = text.rsplit("/", 3)
        if len(parts) != 4 or not parts[2].isdigit():
            return None
        return cls(parts[0], parts[1], int(parts[2]), parts[3])

    def same_host(self, other: Identity) -> bool:
        """Whether ``other`` runs where this process can see its pid."""
        return self.host == other.host and self.ns == other.ns and self.ns != ""


def host_name() -> str:
    """``TASKONCE_WORKER_ID`` if set (checked), else the host name.

    :raises ConfigError: when ``TASKONCE_WORKER_ID`` is empty, too long, or contains ``/`` or
        whitespace.
    """
    name = os.environ.get(ENV_VAR)
    if name is None:
        return socket.gethostname().replace("/", "_") or "localhost"
    if not name or len(name) > MAX_NAME_LENGTH or "/" in name or any(c.isspace() for c in name):
        raise ConfigError(
            f"{ENV_VAR}={name!r} is not valid: use 1 to {MAX_NAME_LENGTH} characters without "
            "'/' or whitespace, unique per host or container"
        )
    return name


def _pid_namespace() -> str:
    try:
        link = os.readlink("/proc/self/ns/pid")  # e.g. "pid:[4026531836]"
    except OSError:
        return ""  # no /proc: pids cannot be checked, only liveness records decide
    return link.partition("[")[2].rstrip("]")


def process_start(pid: int) -> str | None:
    """The start time of live process ``pid`` (clock ticks since boot, as text), or None when
    there is no such process or it is a zombie (dead, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: fields after it are
    # split from the last ')'. Field 3 is the state, field 22 the start time.
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 20 or fields[0] in ("Z", "X", "x"):
        return None
    return fields[19]


_cached: tuple[int, Identity] | None = None


def identity() -> Identity:
    """This process's identity (recomputed after a fork, when the pid changes)."""
    global _cached
    pid = os.getpid()
    if _cached is None or _cached[0] != pid:
        start = process_start(pid) or f"t{time.time_ns()}"
        _cached = (pid, Identity(host_name(), _pid_namespace(), pid, start))
    return _cached[1]


_cached_text: tuple[Identity, str] | None = None


def identity_text() -> str:
    """``str(identity())``, formatted once per identity: it is written with every claim."""
    global _cached_text
    me = identity()
    if _cached_text is None or _cached_text[0] is not me:
        _cached_text = (me, str(me))
    return _cached_text[1]


def owner_gone(owner: Identity) -> bool | None:
    """Whether ``owner`` is known dead by a look at this host's processes: True when it ran on
    this host and its process no longer exists (a reused pid has another start time); False
    when it runs; None when it ran elsewhere (only its liveness record can tell)."""
    me = identity()
    if not me.same_host(owner):
        return None
    if owner.pid == me.pid:
        return owner.start != me.start
    return process_start(owner.pid) != owner.start


class Liveness:
    """Writes this process's liveness record every :data:`BEAT_INTERVAL` seconds.

    A daemon thread starts at :meth:`start` — the guard's first delivery in a process, or a
    worker's start check — and again in every forked child of a process where it ran (Celery's
    pool processes, Dramatiq's worker processes), so a worker writes its record from its start
    while a process that only imports the guard (a web process; Django loading its apps) never
    writes one.
    :meth:`ensure` runs before every claim: if this process has not written its record yet,
    it writes it at once, so no claim exists without one; otherwise it only reads an
    attribute. A failed write is retried on the next beat; after one, the process does not call
    another owner silent until it has itself written without a gap for
    :data:`SILENCE_STREAK` seconds (:meth:`silence_wait`).

    :param store: where the records go.
    :param health: told of each write's success or failure, so an outage is logged once per
        change (:class:`~taskonce.outage.StoreHealth`) instead of once per beat; default a
        health of this liveness's own.
    """

    def __init__(self, store: Store, health: StoreHealth | None = None) -> None:
        self._store = store
        self.health = health if health is not None else StoreHealth(store.describe())
        self._stopped = threading.Event()
        self._thread: tuple[int, threading.Thread] | None = None
        self._reset()
        ref = weakref.ref(self)
        # A fork waits for a liveness write in flight: the writing thread does not exist in the
        # child, and a fork in the middle of its round trip would leave the child a half-done
        # import (redis-py imports lazily on first use) or a lock nobody releases.
        os.register_at_fork(
            before=lambda: _hold_for_fork(ref),
            after_in_parent=lambda: _release_after_fork(ref),
            after_in_child=lambda: _restart_in_child(ref),
        )

    def start(self) -> None:
        """Start this process's liveness thread unless it runs (one attribute read then)."""
        running = self._thread
        if running is None or running[0] != os.getpid():
            with self._lock:
                if self._thread is running:
                    self._start()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._held_for_fork = False
        self._written_pid = -1  # the pid whose record has been written
        self._healthy_since: float | None = None  # time.monotonic() of the streak's first beat

    def _start(self) -> None:
        if self._stopped.is_set():
            return
        thread = threading.Thread(
            target=_beat_loop, args=(weakref.ref(self), os.getpid()), name="taskonce-liveness"
        )
        thread.daemon = True
        self._thread = (os.getpid(), thread)
        thread.start()

    def ensure(self) -> None:
        """Make sure this process's liveness record has been written.

        :raises StoreUnavailable: when it has not and cannot be (the claim would fail too).
        """
        if self._written_pid == os.getpid():
            return
        self.start()
        try:
            self.beat()
        except StoreUnavailable as exc:
            raise StoreUnavailable(
                f"could not write this worker's liveness record before its first claim: {exc}"
            ) from exc

    def beat(self) -> None:
        """Write this process's liveness record now."""
        with self._lock:
            try:
                self._store.beat(identity_text(), LIVENESS_WINDOW)
            except BaseException:
                self._healthy_since = None
                raise
            if self._healthy_since is None:
                self._healthy_since = time.monotonic()
            self._written_pid = os.getpid()

    def silence_wait(self) -> float:
        """Seconds until this process may call an owner silent: 0 once it has itself written
        its record without a failure for :data:`SILENCE_STREAK` seconds."""
        since = self._healthy_since
        if since is None:
            return SILENCE_STREAK
        return max(0.0, SILENCE_STREAK - (time.monotonic() - since))

    def stop(self, timeout: float | None = 0.0) -> None:
        """Stop writing (the guard is closed); the record lapses after its window. Waits up to
        ``timeout`` seconds (None: as long as it takes) for this process's thread to end."""
        self._stopped.set()
        running = self._thread
        if (
            timeout != 0
            and running is not None
            and running[0] == os.getpid()
            and running[1] is not threading.current_thread()
        ):
            running[1].join(timeout)


def _hold_for_fork(ref: weakref.ReferenceType[Liveness]) -> None:
    liveness = ref()
    if liveness is not None:
        liveness._lock.acquire()
        liveness._held_for_fork = True


def _release_after_fork(ref: weakref.ReferenceType[Liveness]) -> None:
    liveness = ref()
    if liveness is not None and liveness._held_for_fork:
        liveness._held_for_fork = False
        liveness._lock.release()


def _restart_in_child(ref: weakref.ReferenceType[Liveness]) -> None:
    liveness = ref()
    if liveness is not None:
        liveness._reset()  # the parent's lock may be held by a thread that is gone here
        if liveness._thread is not None:  # it ran in the parent: a worker's pool process
            liveness._start()


def _beat_loop(ref: weakref.ReferenceType[Liveness], pid: int) -> None:
    """The liveness thread: holds its Liveness only weakly, so a guard that is dropped (or
    closed) stops writing; a forked child runs its own loop."""
    while os.getpid() == pid:
        liveness = ref()
        if liveness is None or liveness._stopped.is_set():
            return
        try:
            liveness.beat()
            liveness.health.answered()
        except StoreUnavailable as exc:
            logger.debug("could not write the liveness record: %s", exc)
            liveness.health.failed(exc)
        except Exception:  # the thread must outlive any one failure
            logger.exception("liveness write failed")
        stopped = liveness._stopped
        del liveness
        if stopped.wait(BEAT_INTERVAL):
            return


#: A deferred duplicate of a live owner's claim comes back this long after the owner's liveness
#: record would lapse, so that it finds the lapse if the owner died meanwhile.
LAPSE_MARGIN = 0.5


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the signs of life say about a claim's owner."""

    dead: bool
    reason: str | None = None  # why it is taken over: "owner_dead" | "owner_silent"
    recovery_s: float | None = None  # seconds from its last liveness write to now
    recheck_in: float | None = None  # when it is alive: judge again after this many seconds


def judge_owner(store: Store, record: Record, liveness: Liveness) -> Verdict | None:
    """Whether the owner of the live claim ``record`` is known dead; None when the claim
    names no worker identity (written by an older version: only its lease decides).

    Dead: it ran on this host and its process is gone, or its liveness record lapsed while
    this process could write its own (``liveness``; during a store outage everyone looks
    silent).
    """
    owner = Identity.parse(record.worker)
    if owner is None or record.owner is None:
        return None
    assert record.worker is not None
    seen = store.seen(record.worker)
    recovery = None if seen is None else round(seen.ago, 3)
    if owner_gone(owner):
        return Verdict(True, "owner_dead", recovery)
    if seen is not None and seen.remaining > 0:
        return Verdict(False, recheck_in=seen.remaining + LAPSE_MARGIN)
    wait = liveness.silence_wait()
    if wait > 0:
        return Verdict(False, recheck_in=wait + LAPSE_MARGIN)
    return Verdict(True, "owner_silent", recovery)


__all__ = [
    "BEAT_INTERVAL",
    "ENV_VAR",
    "LIVENESS_WINDOW",
    "SILENCE_STREAK",
    "Identity",
    "Liveness",
    "host_name",
    "identity",
    "identity_text",
    "owner_gone",
    "process_start",
]
