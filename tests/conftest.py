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


# -- the order and grouping of the test files across pytest-xdist processes ---------------------

#: The longest work units of the suite, longest first (a full run at -n 3 on the 2-CPU CI
#: machine: the sum of each unit's setup, call and teardown times, in seconds, in brackets).
#: ``make test`` runs them first, so the short files fill in at the end and the processes
#: finish together, instead of one process starting a long file when the others are done.
#: The rest follow in collection order. Re-measure with ``--durations=0`` when a file grows.
LONGEST_FIRST = (
    "tests/spark",  # (301) one unit: see _work_unit
    "tests/test_handoff_crash_points.py",  # (179)
    "tests/test_store_receipts.py",  # (145)
    "tests/test_guard_states.py",  # (92-170: how many lease expiries hypothesis waits for)
    "tests/celery/test_recovery.py",  # (86)
    "tests/celery/test_handoff.py",  # (74)
    "tests/celery/test_sqs.py",  # (72, a loaded machine)
    "tests/test_store_properties.py",  # (60)
    "tests/test_store_receipts_sql.py",  # (59)
    "tests/celery/test_receipts_workers.py",  # (56)
    "tests/celery/test_quorum.py",  # (51, a loaded machine)
    "tests/dramatiq/test_receipts_workers.py",  # (50)
    "tests/test_docs.py",  # (47)
    "tests/dramatiq/test_handoff.py",  # (44)
    "tests/test_chaos.py",  # (44)
    "tests/test_race.py",  # (42)
    "tests/dramatiq/test_recovery.py",  # (41)
    "tests/test_store_contract.py",  # (32)
)


def _work_unit(nodeid: str) -> str:
    """The unit a test is scheduled with: its file, except that every Spark test file is one
    unit, so that one process starts the Spark session (a JVM) and audits the worked log once,
    instead of every process that gets a Spark file doing both (``spark`` and ``worked_audit``
    are session fixtures: per process)."""
    path = nodeid.split("::", 1)[0]
    return "tests/spark" if path.startswith("tests/spark/") else path


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The work units of LONGEST_FIRST first, in that order; a unit's tests keep theirs."""
    rank = {unit: index for index, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_work_unit(item.nodeid), len(rank)))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: unknown without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with the Spark files as one unit, units handed out in collection
    order (the order above) rather than xdist's default of the most tests first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileSparkTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    config.option.loadscopereorder = False
    return LoadFileSparkTogether(config, log)
