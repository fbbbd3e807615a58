"""The guard's cost per message on the hot path, beside the raw Redis calls it replaces.

One process, one thread, a no-op handler, the Redis store, against a ``redis-server`` this
script starts on a free loopback port (so the server's ``INFO commandstats`` counts only this
script's commands) and stops by its pid:

- eager: ``guard.run(message_id, queue, noop)`` of a new message against what a hand-written
  guard does: ``SET key 1 NX PX lease`` before the handler and ``SET key done PX keep_for`` after
  (two round trips, no fencing, no events), through the store's own client;
- lazy: ``guard.run`` with ``Policy(mode="lazy")`` against ``GET key`` before and
  ``SET key done PX keep_for`` after;
- the client's floor: the same raw commands written down a connection kept out of the pool and
  packed by hiredis, the way the store sends its scripts (no redis-py command path).

The ratios are over the raw calls through redis-py (``client.set``/``client.get``).

Batches of the guard and of the raw pair alternate (their order swapping every round) so that
the machine's other work hits both alike. Per message: client CPU (``time.process_time``, the
robust figure on a shared machine) and wall time, each the median over the rounds, and the
ratio of the medians measured in the same run. A separate pass reads the server's
``INFO commandstats`` before and after a batch of each: commands and server CPU (usec) per
message.

``--loop N`` runs only ``guard.run`` N times (eager), for a profiler::

    .venv/bin/py-spy record -o docs/img/flame-guard-before.svg -r 500 -- \\
        .venv/bin/python bench/guard_cpu.py --loop 20000

Usage (from the repository root)::

    .venv/bin/python bench/guard_cpu.py                 # rounds 15, batch 500
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import hiredis
import redis
from local_redis import start_redis

import taskonce
from taskonce.stores.redis import RedisStore

LEASE_MS = 300_000
KEEP_MS = 7 * 86_400_000
QUEUE = "default"


def noop() -> None:
    """The handler: does nothing."""


def ids(n: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(n)]


#: The variants per mode, in table order: the guard, redis-py's own calls (what a user writes),
#: and the same raw commands written down a kept connection (the client's floor).
LABELS = ("taskonce", "raw", "floor")
RAW_NAMES = {"eager": "`SET NX PX` + `SET PX`", "lazy": "`GET` + `SET PX`"}


def variants(
    store: RedisStore, client: redis.Redis
) -> tuple[list[taskonce.Guard], dict[str, dict[str, Callable[[str], Any]]]]:
    """The guards, and per mode each variant's handling of one new message id."""
    eager = taskonce.Guard(store, default=taskonce.Policy(mode="eager"))
    lazy = taskonce.Guard(store, default=taskonce.Policy(mode="lazy"))
    conn: Any = client.connection_pool.get_connection()

    def command(*args: Any) -> Any:
        # What the store does with its scripts: hiredis packs, no redis-py command path.
        conn.send_packed_command([hiredis.pack_command(args)])
        return conn.read_response()

    def guarded_eager(mid: str) -> Any:
        return eager.run(mid, QUEUE, noop)

    def guarded_lazy(mid: str) -> Any:
        return lazy.run(mid, QUEUE, noop)

    def raw_eager(mid: str) -> None:
        key = f"raw:{QUEUE}:{mid}"
        if client.set(key, "1", nx=True, px=LEASE_MS):
            noop()
            client.set(key, "done", px=KEEP_MS)

    def raw_lazy(mid: str) -> None:
        key = f"raw:{QUEUE}:{mid}"
        if client.get(key) is None:
            noop()
            client.set(key, "done", px=KEEP_MS)

    def floor_eager(mid: str) -> None:
        key = f"raw:{QUEUE}:{mid}"
        if command("SET", key, "1", "NX", "PX", LEASE_MS):
            noop()
            command("SET", key, "done", "PX", KEEP_MS)

    def floor_lazy(mid: str) -> None:
        key = f"raw:{QUEUE}:{mid}"
        if command("GET", key) is None:
            noop()
            command("SET", key, "done", "PX", KEEP_MS)

    modes = {
        "eager": {"taskonce": guarded_eager, "raw": raw_eager, "floor": floor_eager},
        "lazy": {"taskonce": guarded_lazy, "raw": raw_lazy, "floor": floor_lazy},
    }
    return [eager, lazy], modes


def batch(fn: Callable[[str], Any], n: int) -> tuple[float, float]:
    """(CPU µs, wall µs) per call of ``fn`` over ``n`` new ids."""
    keys = ids(n)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for mid in keys:
        fn(mid)
    cpu1, wall1 = time.process_time(), time.perf_counter()
    return (cpu1 - cpu0) * 1e6 / n, (wall1 - wall0) * 1e6 / n


def commandstats(client: redis.Redis) -> dict[str, tuple[int, int]]:
    info = client.info("commandstats")
    return {name: (int(v["calls"]), int(v["usec"])) for name, v in info.items()}


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cost(
    client: redis.Redis, fn: Callable[[str], Any], n: int, pid: int
) -> tuple[float, float, str, float]:
    """(commands per call, server usec per call, the commands) over ``n`` calls. Commands a
    script runs count as commands and the EVALSHA that runs them does not; the server time is
    that of the commands the client sent (an EVALSHA's includes its script's commands). The
    ``INFO`` command itself is left out."""
    keys = ids(n)
    before = commandstats(client)
    cpu0 = process_cpu(pid)
    for mid in keys:
        fn(mid)
    cpu1 = process_cpu(pid)
    after = commandstats(client)
    delta = {}
    for name, (c1, u1) in after.items():
        c0, u0 = before.get(name, (0, 0))
        if c1 > c0 and name != "cmdstat_info":
            delta[name.removeprefix("cmdstat_")] = (c1 - c0, u1 - u0)
    scripted = "evalsha" in delta
    usec = delta["evalsha"][1] if scripted else sum(u for _, u in delta.values())
    inner = {name: c for name, (c, _) in delta.items() if name != "evalsha"}
    names = ", ".join(f"{name.upper()} {c / n:g}" for name, c in sorted(inner.items()))
    return sum(inner.values()) / n, usec / n, names, (cpu1 - cpu0) * 1e6 / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--loop", type=int, default=0, help="only run guard.run N times")
    args = parser.parse_args(argv)
    process, port = start_redis()
    try:
        store = RedisStore(f"redis://127.0.0.1:{port}/0", prefix="bench")
        client = store._client
        guards, pairs = variants(store, client)
        if args.loop:
            guarded = pairs["eager"]["taskonce"]
            for mid in ids(args.loop):
                guarded(mid)
            return 0
        for fns in pairs.values():  # warm-up: connections, scripts loaded
            for fn in fns.values():
                batch(fn, 200)
        load0 = os.getloadavg()
        samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for r in range(args.rounds):
            for mode, fns in pairs.items():
                order = list(fns.items())
                if r % 2:
                    order.reverse()
                for label, fn in order:
                    samples.setdefault((mode, label), []).append(batch(fn, args.batch))
        load1 = os.getloadavg()
        for guard in guards:  # its liveness writes would land in the commandstats
            guard._liveness.stop()
        stats = {
            (mode, label): server_cost(client, fn, 5000, process.pid)
            for mode, fns in pairs.items()
            for label, fn in fns.items()
        }
        version = client.info("server")["redis_version"]
        parser_name = type(client.connection_pool.get_connection()._parser).__name__
    finally:
        process.terminate()
        process.wait(10)

    def med(mode: str, label: str, i: int) -> float:
        return statistics.median(s[i] for s in samples[(mode, label)])

    print(f"$ .venv/bin/python bench/guard_cpu.py {shlex.join(sys.argv[1:])}".rstrip())
    print(
        f"Python {platform.python_version()}, redis-py {redis.__version__} ({parser_name}), "
        f"Redis {version}, nproc {os.cpu_count()}; load average {load0[0]:.2f} {load0[1]:.2f} "
        f"{load0[2]:.2f} at the start, {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at the end; "
        f"{args.rounds} rounds of {args.batch} messages"
    )
    print()
    print(
        "| mode | per message | client CPU µs | wall µs | CPU ratio | wall ratio "
        "| commands | server µs (commandstats) | server CPU µs | server commands |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    names = {
        "taskonce": "`guard.run`",
        "raw": "{} (redis-py)",
        "floor": "{} (kept connection, hiredis packing)",
    }
    for mode in pairs:
        for label in LABELS:
            cpu, wall = med(mode, label, 0), med(mode, label, 1)
            ratio_cpu = cpu / med(mode, "raw", 0)
            ratio_wall = wall / med(mode, "raw", 1)
            commands, usec, ran, server_cpu = stats[(mode, label)]
            name = names[label].format(RAW_NAMES[mode])
            print(
                f"| {mode} | {name} | {cpu:.0f} | {wall:.0f} | {ratio_cpu:.2f} | "
                f"{ratio_wall:.2f} | {commands:g} | {usec:.1f} | {server_cpu:.0f} | {ran} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
