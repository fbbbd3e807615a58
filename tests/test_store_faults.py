"""An unreachable store: fail_closed runs nothing and loses nothing; fail_open runs unguarded.

The Redis cases start their own redis-server and stop only that one, by its pid.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import taskonce
from taskonce import Guard, Policy, StoreUnavailable
from tests.helpers import RedisServer, free_port

SECRET = "s3cret-pw"


class Names:
    def __init__(self) -> None:
        self.names: list[str] = []

    def emit(self, event: Any) -> None:
        self.names.append(event["event"])


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(password=SECRET).start()
    try:
        yield server
    finally:
        server.stop()


def test_redis_goes_down_fail_closed_runs_nothing_and_recovers(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    events = Names()
    store = taskonce.open_store(redis_server.url, socket_timeout=1.0)
    guard = Guard(store, events=[events])
    runs: list[str] = []
    assert guard.run("m1", "q", runs.append, "m1").status == "ran"

    redis_server.stop()
    with pytest.raises(StoreUnavailable, match="did not answer claim") as info:
        guard.run("m2", "q", runs.append, "m2")
    assert runs == ["m1"], "fail_closed ran a handler without its guard"
    assert events.names[-1] == "store_error"
    assert SECRET not in str(info.value) and SECRET not in caplog.text
    assert ":***@" in str(info.value)

    redis_server.start()  # same port: the broker's later try finds the store back
    assert guard.run("m2", "q", runs.append, "m2").status == "ran"
    assert guard.run("m2", "q", runs.append, "m2").status == "skipped"
    assert runs == ["m1", "m2"]
    guard.close()


def test_redis_down_fail_open_runs_unguarded_with_a_store_error(
    redis_server: RedisServer,
) -> None:
    events = Names()
    store = taskonce.open_store(redis_server.url, socket_timeout=1.0)
    guard = Guard(store, default=Policy(on_store_error="fail_open"), events=[events])
    redis_server.stop()
    runs: list[str] = []
    outcome = guard.run("m1", "q", runs.append, "m1")
    assert outcome.status == "unguarded" and runs == ["m1"]
    assert events.names == ["store_error"]
    guard.close()


def test_store_dies_while_the_handler_runs(redis_server: RedisServer) -> None:
    events = Names()
    guard = Guard(taskonce.open_store(redis_server.url, socket_timeout=1.0), events=[events])

    def handler() -> None:
        redis_server.stop()

    with pytest.raises(StoreUnavailable, match="did not answer complete"):
        guard.run("m1", "q", handler)
    # the claim stays until its lease runs out, so a redelivery cannot run it meanwhile
    assert events.names == ["claimed", "store_error"]
    guard.close()


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql+psycopg://postgres:{SECRET}@127.0.0.1:{{port}}/test",
        f"mysql+pymysql://root:{SECRET}@127.0.0.1:{{port}}/test",
        f"redis://:{SECRET}@127.0.0.1:{{port}}/0",
        "sqlite:///{tmp}/no/such/dir/store.db",
    ],
    ids=["postgresql", "mariadb", "redis", "sqlite"],
)
@pytest.mark.parametrize("on_store_error", ["fail_closed", "fail_open"])
def test_unreachable_store(url: str, on_store_error: str, tmp_path: Path) -> None:
    url = url.format(port=free_port(), tmp=tmp_path)
    events = Names()
    guard = Guard(
        taskonce.open_store(url), default=Policy(on_store_error=on_store_error), events=[events]
    )
    runs: list[str] = []
    if on_store_error == "fail_closed":
        with pytest.raises(StoreUnavailable) as info:
            guard.run("m1", "q", runs.append, "m1")
        assert runs == []
        assert SECRET not in str(info.value)
        assert "claim" in str(info.value)
    else:
        assert guard.run("m1", "q", runs.append, "m1").status == "unguarded"
        assert runs == ["m1"]
    assert events.names == ["store_error"]
    guard.close()
