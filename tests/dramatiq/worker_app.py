"""The worker entry point: ``python -m dramatiq tests.dramatiq.worker_app``.

Builds the test application from the ``TASKONCE_DQ_TEST_CONFIG`` environment variable (see
:mod:`tests.dramatiq.app`); Dramatiq's CLI finds the module-level ``broker``.
"""

from __future__ import annotations

import logging

from tests.dramatiq.app import Config, build

logging.getLogger("taskonce").setLevel(logging.INFO)

app = build(Config.from_env())
broker = app.broker
