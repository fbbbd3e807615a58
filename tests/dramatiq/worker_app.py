"""The worker entry point: ``python -m dramatiq tests.dramatiq.worker_app``.

Builds the test application from the ``TASKONCE_DQ_TEST_CONFIG`` environment variable (see
:mod:`tests.dramatiq.app`); Dramatiq's CLI finds the module-level ``broker``.

With ``TASKONCE_DQ_GO`` naming a file, the import creates ``<that file>.waiting`` and waits (up
to 5 minutes) until that file exists: a worker started early, its imports done, that consumes
only once the test says so.
"""

from __future__ import annotations

import logging
import os
import time

from tests.dramatiq.app import Config, build

logging.getLogger("taskonce").setLevel(logging.INFO)

app = build(Config.from_env())
broker = app.broker

_go = os.environ.get("TASKONCE_DQ_GO")
if _go:
    with open(f"{_go}.waiting", "w"):
        pass
    _deadline = time.monotonic() + 300
    while not os.path.exists(_go) and time.monotonic() < _deadline:
        time.sleep(0.05)
