"""What ``min_replicas=1`` costs a RedisStore write: ``claim`` of a new key with and without
a ``WAIT`` for one replica.

Starts its own master and replica (``redis-server`` on free loopback ports, in a temporary
folder; stopped by their pids at the end), opens two stores on the master, one with
``min_replicas=1``, and times batches of ``--calls`` claims alternating between them for
``--rounds`` rounds. The table shows each side's median time per call and the ratio, measured
in the same run.

Usage (from the repository root)::

    .venv/bin/python bench/redis_min_replicas.py
    .venv/bin/python bench/redis_min_replicas.py --calls 3000 --rounds 9
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

import taskonce


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(folder: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    command += ["--appendonly", "no", "--dir", str(folder), *extra]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait(condition: object, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():  # type: ignore[operator]
                return
        except redis.exceptions.RedisError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="taskonce-bench-"))
    master_port, replica_port = free_port(), free_port()
    (folder / "m").mkdir()
    (folder / "r").mkdir()
    master = start(folder / "m", master_port)
    replica = start(folder / "r", replica_port, "--replicaof", "127.0.0.1", str(master_port))
    try:
        probe = redis.Redis(port=replica_port, decode_responses=True)
        wait(lambda: probe.info("replication").get("master_link_status") == "up", "the replica")
        probe.close()
        url = f"redis://127.0.0.1:{master_port}/0"
        stores = {
            "off": taskonce.open_store(url, prefix="off"),
            "min_replicas=1": taskonce.open_store(url, prefix="on", min_replicas=1),
        }
        timings: dict[str, list[float]] = {name: [] for name in stores}
        for round_no in range(args.rounds):
            order = list(stores) if round_no % 2 == 0 else list(reversed(stores))
            for name in order:
                store = stores[name]
                begin = time.perf_counter()
                for i in range(args.calls):
                    store.claim(f"q:{round_no}:{i}", "owner", 60, 600, None)
                timings[name].append((time.perf_counter() - begin) / args.calls * 1e6)
        off = statistics.median(timings["off"])
        on = statistics.median(timings["min_replicas=1"])
        print(f"redis-py {redis.__version__}, {args.calls} claims x {args.rounds} rounds")
        print()
        print("| claim of a new key | time per call | vs off |")
        print("| --- | ---: | ---: |")
        print(f"| off (default) | {off:.0f} µs | 1.00× |")
        print(f"| `min_replicas=1` | {on:.0f} µs | {on / off:.2f}× |")
        print()
        print(shlex.join([".venv/bin/python", "bench/redis_min_replicas.py", *sys.argv[1:]]))
        for store in stores.values():
            store.close()
    finally:
        for process in (replica, master):
            process.kill()
            process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
