"""Redis as deployed, started by the tests on loopback: a 3-master Redis Cluster and a master +
replica + 3 sentinels. Each server is a ``redis-server`` process of its own on a free port in a
temporary folder, stopped (only it) by its pid.

The deployments are started once per test session, on first use (:func:`cluster` and
:func:`sentinel`), and stopped by the session fixture in ``tests/conftest.py``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import IN_CI, free_port, wait_for


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        message = f"{name} is not installed (apt-get install redis-server redis-tools)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return found


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _info(port: int, section: str, password: str | None = None) -> dict[str, str]:
    """``INFO section`` of the server on ``port`` as a dict ({} while it does not answer)."""
    import redis

    try:
        client = redis.Redis(port=port, password=password, socket_timeout=2, decode_responses=True)
        try:
            return {str(k): str(v) for k, v in client.info(section).items()}
        finally:
            client.close()
    except redis.exceptions.RedisError:
        return {}


class _Server:
    """One redis-server (or sentinel) process with its own folder and config file."""

    def __init__(self, folder: Path, config: list[str], sentinel: bool = False) -> None:
        self.port = free_port()
        self.folder = folder / str(self.port)
        self.folder.mkdir(parents=True)
        self.config = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f"dir {self.folder}",
            "daemonize no",
            f'logfile "{self.folder / "log"}"',
            *([] if sentinel else ['save ""', "appendonly no"]),
            *config,
        ]
        self.sentinel = sentinel
        self.process: Any = None

    def start(self) -> _Server:
        path = self.folder / "redis.conf"
        path.write_text("\n".join(self.config) + "\n")
        command = [_binary("redis-server"), str(path)]
        if self.sentinel:
            command.append("--sentinel")
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

        def up() -> bool:
            if self.process.poll() is not None:
                log = self.folder / "log"
                raise AssertionError(
                    f"redis-server on port {self.port} exited: "
                    + (log.read_text()[-2000:] if log.exists() else "no log")
                )
            return _answers(self.port)

        wait_for(up, timeout=20, what=f"redis on port {self.port}")
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


class ClusterDeployment:
    """Three masters, no replicas, all 16384 slots assigned."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="taskonce-cluster-"))
        self.nodes = [
            _Server(
                self.folder,
                # The bus port is given: the default (port + 10000) may be taken or too high.
                ["cluster-enabled yes", "cluster-node-timeout 5000", f"cluster-port {free_port()}"],
            )
            for _ in range(3)
        ]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> ClusterDeployment:
        for node in self.nodes:
            node.start()
        create = [_binary("redis-cli"), "--cluster", "create"]
        create += [f"127.0.0.1:{n.port}" for n in self.nodes]
        create += ["--cluster-replicas", "0", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_for(
            lambda: (
                all(_info(n.port, "cluster").get("cluster_enabled") == "1" for n in self.nodes)
                and all(self._state_ok(n.port) for n in self.nodes)
            ),
            timeout=60,
            interval=0.1,
            what="the cluster to report cluster_state:ok on every node",
        )
        return self

    @staticmethod
    def _state_ok(port: int) -> bool:
        import redis

        try:
            client = redis.Redis(port=port, socket_timeout=2, decode_responses=True)
            try:
                info = client.execute_command("CLUSTER", "INFO")
            finally:
                client.close()
        except redis.exceptions.RedisError:
            return False
        text = info if isinstance(info, str) else str(info)
        return "cluster_state:ok" in text and "cluster_slots_assigned:16384" in text

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


class SentinelDeployment:
    """A master, one replica and three sentinels watching service ``name``."""

    name = "taskonce-main"

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="taskonce-sentinel-"))
        self.master = _Server(self.folder, [])
        self.replica = _Server(self.folder, [f"replicaof 127.0.0.1 {self.master.port}"])
        self.sentinels = [
            _Server(
                self.folder,
                [
                    f"sentinel monitor {self.name} 127.0.0.1 {self.master.port} 2",
                    f"sentinel down-after-milliseconds {self.name} 1000",
                    f"sentinel failover-timeout {self.name} 5000",
                    f"sentinel parallel-syncs {self.name} 1",
                ],
                sentinel=True,
            )
            for _ in range(3)
        ]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.name}"

    def start(self) -> SentinelDeployment:
        self.master.start()
        self.replica.start()
        wait_for(
            lambda: _info(self.replica.port, "replication").get("master_link_status") == "up",
            timeout=30,
            interval=0.1,
            what="the replica to sync with the master",
        )
        for sentinel in self.sentinels:
            sentinel.start()
        wait_for(
            lambda: all(self._sentinel_ready(s.port) for s in self.sentinels),
            timeout=30,
            interval=0.1,
            what="every sentinel to know the master, the replica and the other sentinels",
        )
        return self

    def _sentinel_ready(self, port: int) -> bool:
        import redis

        try:
            client = redis.Redis(port=port, socket_timeout=2, decode_responses=True)
            try:
                master = client.execute_command("SENTINEL", "MASTER", self.name)
            finally:
                client.close()
        except redis.exceptions.RedisError:
            return False
        if isinstance(master, list):  # redis-py 5.0 leaves the reply a flat list
            master = dict(zip(master[::2], master[1::2], strict=True))
        fields = {str(k).replace("_", "-"): v for k, v in dict(master or {}).items()}
        return (
            int(fields.get("num-slaves", 0)) == 1
            and int(fields.get("num-other-sentinels", 0)) == 2
            and "s_down" not in str(fields.get("flags", ""))
        )

    def master_port(self) -> int | None:
        """The port the sentinels currently name as the master."""
        import redis

        client = redis.Redis(port=self.sentinels[0].port, socket_timeout=2)
        try:
            host_port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name)
        except redis.exceptions.RedisError:
            return None
        finally:
            client.close()
        return int(host_port[1]) if host_port else None

    def stop(self) -> None:
        for server in (*self.sentinels, self.master, self.replica):
            server.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


_STARTED: dict[str, Any] = {}


def cluster() -> ClusterDeployment:
    """The session's Redis Cluster, started on first use."""
    if "cluster" not in _STARTED:
        deployment = ClusterDeployment()
        _STARTED["cluster"] = deployment
        deployment.start()
    return _STARTED["cluster"]  # type: ignore[no-any-return]


def sentinel() -> SentinelDeployment:
    """The session's Sentinel deployment, started on first use."""
    if "sentinel" not in _STARTED:
        deployment = SentinelDeployment()
        _STARTED["sentinel"] = deployment
        deployment.start()
    return _STARTED["sentinel"]  # type: ignore[no-any-return]


def stop_all() -> None:
    """Stop what this session started (only those processes, by their pids)."""
    while _STARTED:
        _, deployment = _STARTED.popitem()
        deployment.stop()


class TlsServer:
    """A redis-server that speaks only TLS, with a throwaway CA and a certificate for
    127.0.0.1 made by ``openssl`` in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ca = folder / "ca.crt"
        self.server: _Server | None = None

    def _certificates(self) -> None:
        openssl = _binary("openssl")

        def run(*args: str) -> None:
            done = subprocess.run(
                [openssl, *args], cwd=self.folder, capture_output=True, text=True, check=False
            )
            assert done.returncode == 0, done.stderr

        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            "/CN=taskonce test CA", "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "server.key", "-out", "server.csr")  # fmt: skip
        (self.folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
        run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "server.crt")  # fmt: skip

    def start(self) -> TlsServer:
        self._certificates()
        port = free_port()
        self.server = _Server(
            self.folder,
            [
                "port 0",
                f"tls-port {port}",
                f"tls-cert-file {self.folder / 'server.crt'}",
                f"tls-key-file {self.folder / 'server.key'}",
                f"tls-ca-cert-file {self.ca}",
                "tls-auth-clients no",
            ],
        )
        self.server.port = port  # the port that answers: the TLS one
        self.server.start()
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    def stop(self) -> None:
        if self.server is not None:
            self.server.kill()
