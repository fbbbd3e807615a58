"""What a Redis Cluster store gives up by not sharing round trips between threads.

A cluster store sends every script as its own round trip (``_OneTrip``); a single-server store
lets threads that call at the same moment share one (``_SharedTrips``). This measures that
difference alone: one ``RedisStore`` on one Redis server (``--url``), ``claim`` + ``complete``
of new keys from N threads, once with the store's shared round trips and once with the cluster
store's one-trip-per-call sender swapped in, batches alternating, median of ``--rounds``.
CPU is the process's user + system time per pair.

Usage (from the repository root)::

    .venv/bin/python bench/cluster_trips.py
    .venv/bin/python bench/cluster_trips.py --threads 1,8 --pairs 4000 --rounds 7
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable

import taskonce
from taskonce.stores.redis import RedisStore, _OneTrip


def timed(threads: int, pairs: int, work: Callable[[str], None]) -> tuple[float, float]:
    per = pairs // threads
    start = threading.Barrier(threads + 1)
    tag = uuid.uuid4().hex[:8]

    def run(n: int) -> None:
        start.wait()
        for i in range(per):
            work(f"q:{tag}:{n}:{i}")

    workers = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    start.wait()
    for worker in workers:
        worker.join()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return per * threads / wall, cpu / (per * threads) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--threads", default="1,8")
    parser.add_argument("--pairs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    store = taskonce.open_store(args.url, prefix=f"bench{uuid.uuid4().hex[:8]}")
    assert isinstance(store, RedisStore)
    senders = {"shared": store._trips, "one per call": _OneTrip(store._client)}

    def pair(key: str) -> None:
        store.claim(key, "owner", 300, 600, None)
        store.complete(key, "owner", 600, None)

    print(
        "| threads | shared: pairs/s | one per call: pairs/s | throughput lost "
        "| shared: CPU/pair | one per call: CPU/pair |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for threads in [int(t) for t in args.threads.split(",")]:
        rates: dict[str, list[float]] = {name: [] for name in senders}
        cpus: dict[str, list[float]] = {name: [] for name in senders}
        for round_no in range(args.rounds):
            order = list(senders) if round_no % 2 == 0 else list(reversed(senders))
            for name in order:
                store._trips = senders[name]  # type: ignore[assignment]
                rate, cpu = timed(threads, args.pairs, pair)
                rates[name].append(rate)
                cpus[name].append(cpu)
        shared, alone = (statistics.median(rates[n]) for n in senders)
        shared_cpu, alone_cpu = (statistics.median(cpus[n]) for n in senders)
        print(
            f"| {threads} | {shared:,.0f} | {alone:,.0f} | {1 - alone / shared:.0%} "
            f"| {shared_cpu:.0f} µs | {alone_cpu:.0f} µs |"
        )
    print()
    print(shlex.join([".venv/bin/python", "bench/cluster_trips.py", *sys.argv[1:]]))
    store._trips = senders["shared"]  # type: ignore[assignment]
    client = store._client
    names = list(client.scan_iter(match=store._pattern(), count=1000))
    for start in range(0, len(names), 1000):
        client.delete(*names[start : start + 1000])
    store.close()


if __name__ == "__main__":
    main()
