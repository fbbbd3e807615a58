"""The worker entry point of the outside-API and internal-error Dramatiq tests:
``python -m dramatiq tests.dramatiq.keys_app:broker``.

The application of :mod:`tests.dramatiq.app` (from ``TASKONCE_DQ_TEST_CONFIG``), plus the actor
``charge_key`` (:func:`declare`; the test process declares it on its own copy to send it).
``TO_BREAK_FIRST_CLAIM``: a file path; the first claim any process of this worker makes (the one
that creates that file) raises ``TypeError``, as an incompatible store driver would.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import urllib.request
from typing import Any

import dramatiq

import taskonce
from tests.dramatiq.app import CONFIG_ENV, App, Config, build


def declare(app: App) -> dramatiq.Actor[Any, Any]:
    """Declare ``charge_key`` on ``app``'s broker (queue ``main``)."""

    def charge_key(url: str, order: str, amount: int, keys_file: str, die: bool = False) -> str:
        """Charge at the payments API ``url`` keyed by ``taskonce.current_key()``; note the key
        (and this process) in ``keys_file``. The first run (``die``) SIGKILLs its process after
        the API answered, before returning."""
        key = taskonce.current_key()
        with open(keys_file, "a") as notes:
            notes.write(json.dumps({"pid": os.getpid(), "key": key}) + "\n")
        with open(keys_file) as notes:
            run = sum(1 for line in notes if line.strip())
        if url:
            request = urllib.request.Request(
                url,
                data=json.dumps({"order": order, "amount": amount}).encode(),
                headers={"Content-Type": "application/json", "Idempotency-Key": key or ""},
                method="POST",
            )
            with urllib.request.urlopen(request, timeout=10) as answer:
                charge_id = str(json.load(answer)["id"])
        else:
            charge_id = ""
        if die and run == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # charged, but the actor never returns
        return charge_id

    actor = dramatiq.actor(
        charge_key,
        broker=app.broker,
        queue_name=app.config.queue("main"),
        actor_name="charge_key",
        max_retries=0,
    )
    app.actors["charge_key"] = actor
    return actor


def break_first_claim(app: App, flag: str) -> None:
    """Make the first claim of any process sharing ``flag`` raise ``TypeError``."""
    store = app.guard.store
    claim = store.claim

    def first_claim_fails(*args: Any, **kwargs: Any) -> Any:
        try:
            fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return claim(*args, **kwargs)
        os.close(fd)
        raise TypeError("claim() got an unexpected keyword argument 'px' (injected by the test)")

    store.claim = first_claim_fails  # type: ignore[method-assign]


if CONFIG_ENV in os.environ:  # a worker process (the tests import this for declare())
    logging.getLogger("taskonce").setLevel(logging.INFO)
    app = build(Config.from_env())
    declare(app)
    if os.environ.get("TO_BREAK_FIRST_CLAIM"):
        break_first_claim(app, os.environ["TO_BREAK_FIRST_CLAIM"])
    broker = app.broker
