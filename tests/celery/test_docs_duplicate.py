"""docs/celery.md's *Try it: send a duplicate*, as written: a real ``celery worker`` of the
user's ``myapp.tasks`` (tests/docs_apps) and the page's three lines run as a script
(tests/docs_apps/try_a_duplicate.py) — the task runs once, the second copy is skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from taskonce.demo.common import delete_redis_keys
from tests.docs_apps import PATH as APPS
from tests.docs_apps import myapp_worker
from tests.helpers import REDIS_URL, require_service, wait_for

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment of the user's processes: this run's own key prefix and events file."""
    require_service("redis")
    prefix = f"myapp{uuid.uuid4().hex[:10]}"
    yield {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(APPS), str(ROOT)]),
        "MYAPP_BROKER": REDIS_URL,
        "MYAPP_STORE": REDIS_URL,
        "MYAPP_PREFIX": prefix,
        "MYAPP_EVENTS": str(tmp_path / "events.jsonl"),
    }
    delete_redis_keys(REDIS_URL, f"{prefix}*")


def events(env: dict[str, str], message_id: str) -> list[str]:
    try:
        lines = Path(env["MYAPP_EVENTS"]).read_text().splitlines()
    except FileNotFoundError:
        return []
    found = [json.loads(line) for line in lines if line.strip()]
    return [e["event"] for e in found if e.get("message_id") == message_id]


def test_the_second_copy_is_skipped(env: dict[str, str], tmp_path: Path) -> None:
    with myapp_worker("myapp.tasks", env, tmp_path):
        subprocess.run(
            [sys.executable, str(APPS / "try_a_duplicate.py")],
            cwd=tmp_path, env=env, check=True, timeout=60,
        )  # fmt: skip
        wait_for(
            lambda: "duplicate_skipped" in events(env, "order-A-1"),
            timeout=60,
            interval=0.1,
            what=f"the second copy to be skipped: {events(env, 'order-A-1')}",
        )
        names: list[Any] = events(env, "order-A-1")
        assert names.count("completed") == 1 and names.count("duplicate_skipped") == 1, names
        runs = redis.Redis.from_url(REDIS_URL).get(f"{env['MYAPP_PREFIX']}:runs:A-1")
        assert int(runs or 0) == 1
