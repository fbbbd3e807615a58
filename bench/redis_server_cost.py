"""The Redis store's work on the server per eager message, beside plain commands and beside
record shapes the store could take instead.

One eager message is a claim of a new key and its completion. Rows, all against a redis-server
this script starts on a free loopback port (so its counters hold only this script's commands)
and stops by its pid:

- ``SET NX PX`` + ``SET PX``: what Powertools' idempotency and a hand-written guard send (no
  owner token, no fencing);
- two scripts that do nothing (``EVALSHA`` of ``return 1``, twice): what any two Lua round
  trips cost, whatever the scripts do;
- the store: its own claim and complete scripts, sent as it sends them (``EVALSHA`` with the
  arguments ``RedisStore.claim`` and ``RedisStore.complete`` build: owner token, lease, keep,
  a 64-character fingerprint, a worker identity);
- two shapes the store does not use, measured to say what they would save: the claim as one
  plain ``SET key <record as a string> NX PX <lease + keep> GET`` (a reply of nil: claimed; a
  record found goes on to a script), and the completion as a script that checks the owner
  token (``GET``) and writes either a string mark (``SET … PX keep``: two calls) or today's
  hash mark (``DEL``, ``HSET``, ``PEXPIRE``).

Each variant runs in two ways, batches alternating (their order swapped every round): *one at a
time*, each command a round trip down a kept connection packed by hiredis (as the store sends
its scripts), and *pipelined*, 100 commands per write, which leaves out most of the per-round-
trip system calls so what remains is the commands' own execution. Per message: the server's main
thread's CPU time (``/proc/<pid>/schedstat``, nanoseconds: commands, event loop and, one at a
time, the socket system calls) and the ``INFO commandstats`` usec of the commands the client
sent (an ``EVALSHA``'s includes its script's commands). Medians over the rounds, ratios over
the ``SET`` pair of the same round.

Usage (from the repository root)::

    .venv/bin/python bench/redis_server_cost.py                   # rounds 7, batch 2000
    .venv/bin/python bench/redis_server_cost.py --write-docs      # also its docs section
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hiredis
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_section import DOC, command_lines, write_section
from local_redis import start_redis

from taskonce.stores.redis import RedisStore

HEADING = "## Redis store: the server's work per message"
LEASE_MS = 300_000
KEEP_MS = 7 * 86_400_000
FINGERPRINT = "f" * 64
WORKER = "bench-host/4026531836/12345/67890"  # a worker identity as long as a real one
PIPELINE = 100

#: The shapes' scripts: KEYS[1] the record; ARGV owner, keep_ms[, fingerprint]. The claim's
#: string starts with "i" and the owner token, then "|" and the rest of the record.
STRING_MARK = """
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 1, #ARGV[1] + 2) ~= 'i' .. ARGV[1] .. '|' then return 0 end
redis.call('SET', KEYS[1], 'c|' .. string.sub(v, #ARGV[1] + 3), 'PX', ARGV[2])
return 1
"""
HASH_MARK = """
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 1, #ARGV[1] + 2) ~= 'i' .. ARGV[1] .. '|' then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'st', 'c', 'fp', ARGV[3], 'ca', '1795460509053', 'lu', '1795460809053')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
NOTHING = "return 1"

#: Per variant: (label, the commands of one message's first call, of its second).
Commands = Callable[[str, str], tuple[tuple[Any, ...], tuple[Any, ...]]]


def variants(store: RedisStore, client: redis.Redis) -> dict[str, tuple[str, Commands]]:
    shas = {name: client.script_load(text) for name, text in _SCRIPTS.items()}
    # The store's own scripts, loaded as its first call would load them.
    claim, complete = (client.script_load(s.script) for s in (store._claim, store._complete))

    def set_pair(key: str, owner: str) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return ("SET", key, "1", "NX", "PX", LEASE_MS), ("SET", key, "done", "PX", KEEP_MS)

    def nothing(key: str, owner: str) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        call = ("EVALSHA", shas["nothing"], 1, key, owner, KEEP_MS)
        return call, call

    def scripts(key: str, owner: str) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return (
            ("EVALSHA", claim, 1, key, owner, LEASE_MS, KEEP_MS, "1", FINGERPRINT, WORKER),
            ("EVALSHA", complete, 1, key, owner, KEEP_MS, "0", ""),
        )

    def shape(mark: str) -> Commands:
        def commands(key: str, owner: str) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
            record = f"i{owner}|{LEASE_MS}|{KEEP_MS}|{FINGERPRINT}|{WORKER}"
            return (
                ("SET", key, record, "NX", "PX", LEASE_MS + KEEP_MS, "GET"),
                ("EVALSHA", shas[mark], 1, key, owner, KEEP_MS, FINGERPRINT),
            )

        return commands

    return {
        "set": ("`SET NX PX` + `SET PX` (Powertools, hand-written)", set_pair),
        "nothing": ("two scripts that do nothing (`return 1`)", nothing),
        "store": ("the store: claim + complete scripts", scripts),
        "string": ("shape: `SET … NX PX … GET` + script `GET`, `SET PX`", shape("string")),
        "hash": (
            "shape: `SET … NX PX … GET` + script `GET`, `DEL`, `HSET`, `PEXPIRE`",
            shape("hash"),
        ),
    }


_SCRIPTS = {"nothing": NOTHING, "string": STRING_MARK, "hash": HASH_MARK}

#: What a variant's replies must be for a new key (a wrong shape must not pass unnoticed).
EXPECTED = {
    "set": (b"OK", b"OK"),
    "nothing": (1, 1),
    "store": (1, 1),
    "string": (None, 1),
    "hash": (None, 1),
}


def main_thread_ns(pid: int) -> int:
    """On-CPU nanoseconds of ``pid``'s main thread (where redis-server runs every command)."""
    with open(f"/proc/{pid}/schedstat", encoding="ascii") as handle:
        return int(handle.read().split()[0])


class Link:
    """A connection kept out of the pool: commands packed by hiredis, no redis-py command path."""

    def __init__(self, client: redis.Redis) -> None:
        self.conn: Any = client.connection_pool.get_connection()

    def send(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        self.conn.send_packed_command([hiredis.pack_command(c) for c in commands])
        return [self.conn.read_response() for _ in commands]


def chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def batch(
    link: Link, client: redis.Redis, pid: int, name: str, commands: Commands, n: int, way: str
) -> tuple[float, float]:
    """(server CPU µs, commandstats µs) per message over ``n`` new keys."""
    messages = [commands(f"bench:default:{uuid.uuid4()}", uuid.uuid4().hex) for _ in range(n)]
    firsts = [m[0] for m in messages]
    seconds = [m[1] for m in messages]
    before, cpu0 = counters(client), main_thread_ns(pid)
    if way == "pipelined":
        replies = [r for part in chunks(firsts, PIPELINE) for r in link.send(part)]
        replies2 = [r for part in chunks(seconds, PIPELINE) for r in link.send(part)]
        pairs = list(zip(replies, replies2, strict=True))
    else:
        pairs = [(link.send([first])[0], link.send([second])[0]) for first, second in messages]
    cpu1, after = main_thread_ns(pid), counters(client)
    for reply in pairs:
        if reply != EXPECTED[name]:
            raise RuntimeError(f"{name}: a new key answered {reply!r}, not {EXPECTED[name]!r}")
    sent = sum(1 for m in messages for c in m if c[0] == "SET")
    return (cpu1 - cpu0) / 1e3 / n, sent_usec(before, after, sent) / n


def counters(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """(calls, usec) of SET and EVALSHA so far."""
    info = client.info("commandstats")
    return {
        name: (int(info[f"cmdstat_{name}"]["calls"]), int(info[f"cmdstat_{name}"]["usec"]))
        for name in ("set", "evalsha")
        if f"cmdstat_{name}" in info
    }


def sent_usec(
    before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], sets: int
) -> float:
    """The commandstats usec of what the client sent: its EVALSHAs' (their scripts' commands
    included) and its own ``sets`` SETs', which are their share of the SET time when a script
    ran SETs too (Redis counts those under SET as well as inside the script)."""
    spent = {
        name: (c - before.get(name, (0, 0))[0], u - before.get(name, (0, 0))[1])
        for name, (c, u) in after.items()
    }
    set_calls, set_usec = spent.get("set", (0, 0))
    return spent.get("evalsha", (0, 0))[1] + (set_usec * sets / set_calls if set_calls else 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=2000)
    parser.add_argument("--write-docs", action="store_true", help=f"write {HEADING!r}")
    args = parser.parse_args(argv)
    command = shlex.join(
        [".venv/bin/python", "bench/redis_server_cost.py", *(argv or sys.argv[1:])]
    )
    process, port = start_redis()
    ways = ("one at a time", "pipelined")
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        store = RedisStore(f"redis://127.0.0.1:{port}/0", prefix="bench")
        client = redis.Redis(port=port)
        link = Link(client)
        table = variants(store, client)
        for name, (_, commands) in table.items():  # warm-up: scripts cached, allocator warm
            for way in ways:
                batch(link, client, process.pid, name, commands, 200, way)
        load0 = os.getloadavg()
        for round_no in range(args.rounds):
            order = list(table.items())
            if round_no % 2:
                order.reverse()
            for way in ways:
                for name, (_, commands) in order:
                    sample = batch(link, client, process.pid, name, commands, args.batch, way)
                    samples.setdefault((way, name), []).append(sample)
        load1 = os.getloadavg()
        version = client.info("server")["redis_version"]
        store.close()
    finally:
        process.terminate()
        process.wait(10)

    def med(way: str, name: str, i: int) -> float:
        return statistics.median(s[i] for s in samples[(way, name)])

    rows = []
    for name, (label, _) in table.items():
        cells = [label]
        for way in ways:
            cpu, stat = med(way, name, 0), med(way, name, 1)
            cells += [f"{cpu:.1f}", f"{cpu / med(way, 'set', 0):.2f}", f"{stat:.1f}"]
        rows.append("| " + " | ".join(cells) + " |")
    store_ratio = med(ways[0], "store", 0) / med(ways[0], "set", 0)
    string_ratio = med(ways[0], "string", 0) / med(ways[0], "set", 0)
    lines = [
        HEADING,
        "",
        "The server's work for one eager message (a claim of a new key and its completion) on "
        "a redis-server the benchmark starts for itself, beside two plain `SET`s, two scripts "
        "that do nothing, and two record shapes the store does not use, measured to say what "
        "they would save: the claim as one plain `SET key <record as a string> NX PX "
        "<lease + keep> GET` (nil: claimed; a record found goes on to a script) and the "
        "completion as a script that checks the owner token and writes a string mark (`GET`, "
        "`SET PX`) or today's hash mark (`GET`, `DEL`, `HSET`, `PEXPIRE`). *One at a time*: each "
        "command its own round trip down a kept connection (how the store sends its scripts); "
        f"*pipelined*: {PIPELINE} commands per write, which leaves out most of the system calls "
        "of a round trip, so what remains is the commands' own execution. *Server CPU* is the "
        "redis-server main thread's CPU time per message (`/proc/<pid>/schedstat`), "
        "*commandstats* the `INFO commandstats` usec of what the client sent (a script's includes "
        f"its commands); medians of {args.rounds} rounds of {args.batch} messages, batches "
        "alternating, ratios over the `SET` pair of the same run. "
        f"Redis {version}, Python {platform.python_version()}, nproc {os.cpu_count()}; load "
        f"average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} at the start, "
        f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} at the end.",
        "",
        "| per message | server CPU µs, one at a time | ratio | commandstats µs | "
        "server CPU µs, pipelined | ratio | commandstats µs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        f"One at a time, the store's two scripts cost the server {store_ratio:.2f}× the CPU of "
        f"the two `SET`s, the string shape {string_ratio:.2f}×.",
        "",
        *command_lines(command),
    ]
    section = "\n".join(lines)
    print(section)
    if args.write_docs:
        write_section(section, DOC)
        print(f"written to {DOC.relative_to(DOC.parents[1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
