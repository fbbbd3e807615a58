"""The Celery app of the outside-API and internal-error worker tests: everything of
:mod:`tests.celery.app_under_test`, plus ``t.charge`` (calls a payments API with
``taskonce.current_key()`` as its ``Idempotency-Key``).

``TO_BREAK_FIRST_CLAIM``: a file path; the first claim any process of this worker makes (the
one that creates that file) raises ``TypeError``, as an incompatible store driver would.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from typing import Any

import taskonce
from tests.celery.app_under_test import GUARD, app, guarded_task

__all__ = ["app", "charge"]


@guarded_task(acks_late=True, reject_on_worker_lost=True, name="t.charge")
def charge(
    self: Any, url: str, order: str, amount: int, keys_file: str, die_after_call: bool = False
) -> str:
    """Charge ``amount`` for ``order`` at the payments API ``url``, keyed by the delivery's
    key; note that key (and this process) in ``keys_file``, one line per run. The first run
    (``die_after_call``) SIGKILLs its own process after the API answered, before returning."""
    key = taskonce.current_key()
    with open(keys_file, "a") as notes:
        notes.write(json.dumps({"pid": os.getpid(), "key": key}) + "\n")
    with open(keys_file) as notes:
        run = sum(1 for line in notes if line.strip())
    request = urllib.request.Request(
        url,
        data=json.dumps({"order": order, "amount": amount}).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": key or ""},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        charge_id = str(json.load(answer)["id"])
    if die_after_call and run == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # charged, but the task never ends
    return charge_id


def _break_first_claim(flag: str) -> None:
    store = GUARD.store
    claim = store.claim

    def first_claim_fails(*args: Any, **kwargs: Any) -> Any:
        try:
            fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return claim(*args, **kwargs)
        os.close(fd)
        raise TypeError("claim() got an unexpected keyword argument 'px' (injected by the test)")

    store.claim = first_claim_fails  # type: ignore[method-assign]


if os.environ.get("TO_BREAK_FIRST_CLAIM"):
    _break_first_claim(os.environ["TO_BREAK_FIRST_CLAIM"])
