"""RedisStore claim + complete from many threads of one process, beside raw redis-py calls.

For each ``--threads`` count: the rate of claim + complete pairs (new keys) and the process CPU
per pair (user + system), beside two raw ``SET key val NX PX 300000`` calls through the store's
own client (``store.client``), rounds alternating, medians over ``--rounds``. The store shares
round trips between threads that call it at the same moment; *round trips/pair* counts the
writes to its connection (each one round trip, whatever it carries).

    .venv/bin/python bench/store_threads.py [--pairs 4000] [--rounds 5] [--threads 1,2,8]
        [--write-docs]
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import harness as h
import redis

import taskonce


def timed(threads: int, pairs: int, pair: Callable[[str], None]) -> tuple[float, float]:
    """Pairs per second and CPU µs per pair, ``pairs`` split over ``threads``."""
    tag, per = uuid.uuid4().hex[:8], pairs // threads
    start = threading.Barrier(threads + 1)

    def work(t: int) -> None:
        start.wait()
        for i in range(per):
            pair(f"{tag}-{t}-{i}")

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    start.wait()
    for worker in workers:
        worker.join()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return per * threads / wall, cpu / (per * threads) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", default="1,2,8")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    command, load_start = h.command_line("bench/store_threads.py"), h.loadavg()
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    store: Any = taskonce.open_store(args.redis_url, prefix=prefix)
    client = store.client

    def guarded(key: str) -> None:
        store.claim(key, "owner", 300, 600, None)
        store.complete(key, "owner", 600, None)

    def raw(key: str) -> None:
        client.set(f"{prefix}:raw:{key}", "1", nx=True, px=300_000)
        client.set(f"{prefix}:raw2:{key}", "1", nx=True, px=300_000)

    rows = []
    for threads in [int(t) for t in str(args.threads).split(",") if t.strip()]:
        got: dict[str, list[tuple[float, float]]] = {"store": [], "raw": []}
        trips: list[float] = []
        timed(threads, min(400, args.pairs), guarded)  # warm up: connections, scripts
        timed(threads, min(400, args.pairs), raw)
        for _, name in h.interleaved(args.rounds, ["store", "raw"]):
            with h.counted_writes() as sent:
                got[name].append(timed(threads, args.pairs, guarded if name == "store" else raw))
            if name == "store":
                trips.append(sent[0] / (args.pairs // threads * threads))
        rate, cpu = (h.med(g[i] for g in got["store"]) for i in (0, 1))
        raw_rate, raw_cpu = (h.med(g[i] for g in got["raw"]) for i in (0, 1))
        row = [threads, f"{rate:,.0f}", f"{raw_rate:,.0f}", f"{rate / raw_rate:.2f}×"]
        rows.append([*row, f"{cpu:.0f} µs", f"{raw_cpu:.0f} µs", f"{h.med(trips):.2f}"])
        print(f"{threads} threads: {rows[-1]}", flush=True)
    h.drop_keys(client, prefix)
    store.close()
    header = "threads|store pairs/s|raw pairs/s|throughput vs raw|store CPU/pair|raw CPU/pair|"
    text = "\n\n".join(
        [
            f"{args.pairs} pairs per round, median of {args.rounds} rounds.",
            h.table((header + "store round trips/pair").split("|"), rows, "rrrrrrr"),
            h.measured_line(command, load_start, [f"redis-py {redis.__version__}"]),
        ]
    )
    print(f"\n{text}")
    if args.write_docs:
        h.write_block("store-threads", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
