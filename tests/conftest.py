"""Shared fixtures: one fixture per store kind (see tests/helpers.py for the services)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from taskonce.stores import Store
from tests.helpers import STORE_KINDS, drop_store, make_store

# Every JVM the tests start inherits this: the Spark sessions of the test processes, the
# `taskonce audit` subprocesses, a docs snippet's session, the standalone cluster's master,
# workers and executors. They live seconds to minutes on logs of a few dozen events, where the
# C2 compiler's threads burn more CPU than its code gives back: on the 2-CPU CI machine a fresh
# JVM's audit of the worked log takes about half the time with C1 alone. The JIT tier changes
# no result. A JAVA_TOOL_OPTIONS of your own is kept.
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1")


@pytest.fixture(params=STORE_KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
    s = make_store(request.param, tmp_path)
    try:
        yield s
    finally:
        drop_store(s)


@pytest.fixture(scope="session", autouse=True)
def redis_deployments_stopped() -> Iterator[None]:
    """Stop the Redis Cluster and Sentinel servers a test started (by their pids), if any."""
    from tests import redis_topologies

    yield
    redis_topologies.stop_all()


@pytest.fixture(autouse=True)
def no_capture_left_over() -> Iterator[None]:
    """Each test starts outside any hand-off capture: a test that begins a guarded delivery in
    the main thread and never finishes it (to look at the ticket) must not capture the sends of
    the tests after it."""
    from taskonce import handoff

    token = handoff._capture.set(None)
    yield
    handoff._capture.reset(token)
