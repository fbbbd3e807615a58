"""Redis as deployed: a Sentinel failover mid-run, and the URLs of clusters and Sentinel
deployments that cannot work (each a clear error, before or instead of an outage).

The failover test starts its own master + replica + 3 sentinels (it kills that master); the
session's shared deployments (tests/redis_topologies.py) are left alone.
"""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import taskonce
from taskonce import ConfigError, Guard, InProgressElsewhere, Policy, StoreUnavailable
from taskonce.stores import Status
from tests.helpers import free_port, wait_for
from tests.redis_topologies import SentinelDeployment, TlsServer

KEYS = 120
KILL_AT = 40  # the master is SIGKILLed while this key's handler runs


class Events:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit(self, event: Any) -> None:
        self.events.append(dict(event))


@pytest.fixture
def own_sentinel() -> Iterator[SentinelDeployment]:
    deployment = SentinelDeployment()
    try:
        yield deployment.start()
    finally:
        deployment.stop()


def test_sentinel_failover_mid_run_runs_nothing_unguarded_and_loses_nothing(
    own_sentinel: SentinelDeployment,
) -> None:
    old_master = own_sentinel.master.port
    store = taskonce.open_store(f"{own_sentinel.url}?prefix=fo{uuid.uuid4().hex[:6]}")
    events = Events()
    guard = Guard(store, default=Policy(lease=3), events=[events])
    runs: collections.Counter[str] = collections.Counter()
    failed_in_flight: list[str] = []

    def handler(key: str) -> None:
        runs[key] += 1
        if key == f"k{KILL_AT}" and runs[key] == 1:
            own_sentinel.master.kill()  # SIGKILL: the completion of this key is in flight

    # A broker in miniature: a delivery that did not run or whose outcome is unknown comes back.
    queue = collections.deque(f"k{i}" for i in range(KEYS))
    deadline = time.monotonic() + 90
    while queue:
        assert time.monotonic() < deadline, f"{len(queue)} deliveries never got through"
        key = queue.popleft()
        before = runs[key]
        try:
            outcome = guard.run(key, "payments", handler, key)
        except StoreUnavailable:
            if runs[key] > before:
                failed_in_flight.append(key)
            queue.append(key)
            time.sleep(0.05)  # the broker's redelivery delay
            continue
        except InProgressElsewhere:
            queue.append(key)  # the claim the old master acknowledged, until its lease ends
            time.sleep(0.05)
            continue
        assert outcome.status in ("ran", "skipped")
    guard.close()

    assert own_sentinel.replica.port != old_master
    wait_for(  # the sentinel asked here may learn of the promotion a moment after the others
        lambda: own_sentinel.master_port() == own_sentinel.replica.port,
        timeout=30,
        what="the first sentinel to name the promoted replica as the master",
    )
    # None lost: every key is recorded as handled on the promoted replica.
    check = taskonce.open_store(f"{own_sentinel.url}?prefix={store._prefix}")  # type: ignore[attr-defined]
    try:
        for i in range(KEYS):
            record = check.get(f"payments:k{i}")
            assert record is not None and record.status is Status.COMPLETED, f"k{i}"
    finally:
        check.close()
    assert set(runs) == {f"k{i}" for i in range(KEYS)}
    # Nothing unguarded: every run follows a claim the store granted (fail_closed ran nothing
    # while the store was away), and only the delivery whose completion was in flight when
    # the master died ran again (its outcome was never recorded).
    granted = collections.Counter(
        e["key"].split(":", 1)[1]
        for e in events.events
        if e["event"] in ("claimed", "lease_taken_over")
    )
    assert granted == runs
    assert failed_in_flight == [f"k{KILL_AT}"]
    assert {key for key, n in runs.items() if n > 1} <= {f"k{KILL_AT}"}
    assert any(e["event"] == "store_error" for e in events.events)


def test_sentinel_url_without_a_service_name_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"names the service after the hosts"):
        taskonce.open_store("redis+sentinel://127.0.0.1:26379,127.0.0.1:26380")
    with pytest.raises(ConfigError, match=r"names the service after the hosts"):
        taskonce.open_store("redis+sentinel://:pw@127.0.0.1:26379/")


def test_multi_host_url_with_a_host_without_port_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'127.0.0.1' is not host:port"):
        taskonce.open_store("redis+cluster://127.0.0.1:7000,127.0.0.1")


def test_cluster_url_naming_an_unreachable_node_is_unavailable() -> None:
    port = free_port()  # nothing listens there
    with pytest.raises(StoreUnavailable) as info:
        taskonce.open_store(f"redis+cluster://:secret-pw@127.0.0.1:{port}", socket_timeout=1.0)
    text = str(info.value)
    assert f"none of the cluster nodes 127.0.0.1:{port} could be reached" in text
    assert "secret-pw" not in text and ":***@" in text


def test_cluster_url_with_a_database_or_a_braced_prefix_is_refused() -> None:
    from tests import redis_topologies

    url = redis_topologies.cluster().url
    with pytest.raises(ConfigError, match=r"a Redis Cluster has only database 0"):
        taskonce.open_store(f"{url}/3")
    with pytest.raises(ConfigError, match=r"adds its own hash tags"):
        taskonce.open_store(url, prefix="{taskonce}")
    with pytest.raises(ConfigError, match=r"unknown query option 'sockettimeout'"):
        taskonce.open_store(f"{url}?sockettimeout=2")


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[TlsServer]:
    server = TlsServer(tmp_path)
    try:
        yield server.start()
    finally:
        server.stop()


def test_rediss_url_with_the_ca_works_and_without_it_is_refused(tls_server: TlsServer) -> None:
    base = f"rediss://127.0.0.1:{tls_server.port}/0"
    store = taskonce.open_store(f"{base}?ssl_cert_reqs=required&ssl_ca_certs={tls_server.ca}")
    guard = Guard(store)
    runs: list[str] = []
    assert guard.run("m1", "q", runs.append, "m1").status == "ran"
    assert guard.run("m1", "q", runs.append, "m1").status == "skipped"
    assert runs == ["m1"]
    guard.close()
    # The server's certificate is signed by a CA the system does not trust: refused, and
    # fail_closed runs nothing.
    untrusted = Guard(taskonce.open_store(f"{base}?ssl_cert_reqs=required", socket_timeout=2.0))
    with pytest.raises(StoreUnavailable, match="certificate verify failed"):
        untrusted.run("m2", "q", runs.append, "m2")
    assert runs == ["m1"]
    untrusted.close()
    with pytest.raises(ConfigError, match="TLS needs a rediss:// URL"):
        taskonce.open_store(f"redis://127.0.0.1:{tls_server.port}/0?ssl_ca_certs={tls_server.ca}")


def test_min_replicas_met_runs_and_unmeetable_is_a_clear_error() -> None:
    from tests import redis_topologies

    url = redis_topologies.sentinel().url  # a master with one replica
    prefix = f"mr{uuid.uuid4().hex[:6]}"
    met = Guard(taskonce.open_store(f"{url}?prefix={prefix}&min_replicas=1"))
    runs: list[str] = []
    assert met.run("m1", "q", runs.append, "m1").status == "ran"
    assert met.run("m1", "q", runs.append, "m1").status == "skipped"
    met.close()

    unmet = Guard(
        taskonce.open_store(url, prefix=prefix, min_replicas=2, socket_timeout=1.0),
        default=Policy(on_store_error="fail_closed"),
    )
    with pytest.raises(StoreUnavailable) as info:
        unmet.run("m2", "q", runs.append, "m2")
    assert "acknowledged by 1 replica(s) within 500 ms, fewer than min_replicas=2" in str(
        info.value
    )
    assert runs == ["m1"], "a claim that could be lost in a failover ran its handler"
    assert unmet.store.get("q:m1") is not None  # reads do not wait
    unmet.close()


def test_min_replicas_bad_values_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"min_replicas must be a whole number.*'-1'"):
        taskonce.open_store("redis://127.0.0.1:6379/0?min_replicas=-1")
    with pytest.raises(ConfigError, match=r"min_replicas is '1' in the URL but '2'"):
        taskonce.open_store("redis://127.0.0.1:6379/0?min_replicas=1", min_replicas=2)
    from tests import redis_topologies

    with pytest.raises(ConfigError, match=r"min_replicas is not available on Redis Cluster"):
        taskonce.open_store(f"{redis_topologies.cluster().url}?min_replicas=1")
