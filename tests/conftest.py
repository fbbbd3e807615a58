"""Shared fixtures: one fixture per store kind (see tests/helpers.py for the services)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from taskonce.stores import Store
from tests.helpers import STORE_KINDS, drop_store, make_store


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
