"""``PeriodicPurge``: delete an SQL store's expired marks from inside the Dramatiq workers.

An SQL store keeps expired rows until something deletes them (Redis expires its own keys, so
a Redis store never needs this). ``PeriodicPurge`` runs :meth:`taskonce.Guard.purge` — bounded
batches, one ``purged`` event — on a daemon thread of every worker process, every ``every``
seconds with ±10 % jitter so processes do not purge in lockstep. Two processes purging at
once is harmless (each ``DELETE`` removes rows that are already expired). Instead of it, a
cron job may run ``taskonce purge --store URL``.

::

    broker.add_middleware(IdempotencyMiddleware(guard))
    broker.add_middleware(PeriodicPurge(guard, every=3600))
"""

from __future__ import annotations

import logging
import random
import threading
from typing import TYPE_CHECKING

from dramatiq import Middleware

from taskonce.checks import check_count, check_seconds
from taskonce.errors import ConfigError, StoreUnavailable
from taskonce.guard import Guard

if TYPE_CHECKING:
    from dramatiq import Broker, Worker

logger = logging.getLogger("taskonce.dramatiq")


class PeriodicPurge(Middleware):
    """Purges the guard's store periodically while a worker runs.

    :param guard: the guard whose store is purged.
    :param every: seconds between purges (±10 % jitter). Default 3600.
    :param batch: rows per ``DELETE``. Default 1000.
    :param first_after: seconds after the worker boots before the first purge; default
        ``every`` (jittered).
    """

    def __init__(
        self,
        guard: Guard,
        *,
        every: float = 3600.0,
        batch: int = 1000,
        first_after: float | None = None,
    ) -> None:
        if not isinstance(guard, Guard):
            raise ConfigError(f"PeriodicPurge(guard=…) needs a taskonce.Guard, not {guard!r}")
        self.every = check_seconds("PeriodicPurge(every=…)", every)
        self.batch = check_count("PeriodicPurge(batch=…)", batch)
        if first_after is not None:
            first_after = check_seconds("PeriodicPurge(first_after=…)", first_after)
        if not hasattr(guard.store, "open_session"):
            logger.info(
                "PeriodicPurge on %s: this store expires its own records; purges will find "
                "nothing to delete",
                guard.store.describe(),
            )
        self.guard = guard
        self.first_after = first_after
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        """Start the purge thread of this worker process."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="taskonce-purge", daemon=True)
        self._thread.start()

    def before_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        """Stop the purge thread (a purge in progress finishes its current batch)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _jittered(self, seconds: float) -> float:
        return float(seconds * random.uniform(0.9, 1.1))

    def _loop(self) -> None:
        wait = self._jittered(self.first_after if self.first_after is not None else self.every)
        while not self._stop.wait(wait):
            self.purge_now()
            wait = self._jittered(self.every)

    def purge_now(self) -> int:
        """One purge; the number of records deleted (0 when the store was unreachable)."""
        try:
            return self.guard.purge(self.batch)
        except StoreUnavailable as exc:
            logger.warning("periodic purge skipped, store unreachable: %s", exc)
        except Exception:
            logger.exception("periodic purge failed")
        return 0
