"""One RedisStore script call with redis-py's hiredis reply parser against its pure-Python one.

Two ``RedisStore`` objects on the same Redis (``--url``, default DB 15 of the local server),
each over its own ``redis.Redis`` client whose ``parser_class`` is hiredis' or the
pure-Python RESP2 parser; everything else is the same. Operations: ``claim`` of a new key (a
one-integer reply), ``get`` of a completed record (a ten-item reply) and the duplicate path,
``claim`` of a key already handled (the record comes back with the refusal). Batches of
``--calls`` calls alternate between the two parsers for ``--rounds`` rounds; the table shows
each side's median time per call and the ratio pure-Python / hiredis measured in the same run.

Usage (from the repository root)::

    .venv/bin/python bench/redis_parser.py
    .venv/bin/python bench/redis_parser.py --calls 5000 --rounds 9

Keys are written under a random prefix and removed afterwards.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
import uuid
from collections.abc import Callable

import redis
from redis._parsers import _HiredisParser, _RESP2Parser

from taskonce.stores.redis import RedisStore


def per_call_us(calls: int, op: Callable[[int], object]) -> float:
    start = time.perf_counter()
    for i in range(calls):
        op(i)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    prefix = f"bench{uuid.uuid4().hex[:8]}"
    stores = {
        name: RedisStore(
            client=redis.Redis.from_url(args.url, parser_class=cls), prefix=f"{prefix}{name}"
        )
        for name, cls in (("hiredis", _HiredisParser), ("python", _RESP2Parser))
    }
    for store in stores.values():
        for i in range(args.calls):  # the records that get and the duplicate path read
            store.mark(f"q:done{i}", 600, "f" * 64, '{"ok": true}')

    def operations(store: RedisStore, round_no: int) -> dict[str, Callable[[int], object]]:
        return {
            "claim (new key)": lambda i: store.claim(f"q:r{round_no}:{i}", "o", 60, 600, "fp"),
            "get (a record)": lambda i: store.get(f"q:done{i}"),
            "claim (duplicate)": lambda i: store.claim(f"q:done{i}", "o", 60, 600, "f" * 64),
        }

    timings: dict[tuple[str, str], list[float]] = {}
    for round_no in range(args.rounds):
        order = list(stores) if round_no % 2 == 0 else list(reversed(stores))
        for name in order:
            for op_name, op in operations(stores[name], round_no).items():
                timings.setdefault((op_name, name), []).append(per_call_us(args.calls, op))

    command = ".venv/bin/python bench/redis_parser.py " + shlex.join(sys.argv[1:])
    print(f"redis-py {redis.__version__}, {args.calls} calls x {args.rounds} rounds")
    print()
    print("| operation | hiredis | pure Python | pure Python / hiredis |")
    print("| --- | ---: | ---: | ---: |")
    for op_name in operations(stores["hiredis"], 0):
        fast = statistics.median(timings[(op_name, "hiredis")])
        slow = statistics.median(timings[(op_name, "python")])
        print(f"| {op_name} | {fast:.0f} µs | {slow:.0f} µs | {slow / fast:.2f}× |")
    print()
    print(command.strip())

    for store in stores.values():
        client = store._client
        names = list(client.scan_iter(match=f"{store._prefix}:*", count=1000))
        for start in range(0, len(names), 1000):
            client.delete(*names[start : start + 1000])
        client.close()


if __name__ == "__main__":
    main()
