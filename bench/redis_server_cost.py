"""What a remembered message costs a redis-server: bytes per completed record and the server's
CPU per eager message, beside the plain commands a hand-written guard sends, in one run.

Everything runs against a redis-server this script starts on a free loopback port (so its
counters hold only this script's commands) and stops by its pid. Keys are named as the guard
names them with the default policy and prefix: ``taskonce:default:<uuid4>``.

*Bytes per remembered message*: a completed eager record with its fingerprint (the guard's
own, :func:`taskonce.keys.fingerprint` of a small payload), no result, against the floor: a
plain ``SET key <8 bytes> PX <keep>`` on the same key names. Two figures each: ``MEMORY
USAGE`` (median over the keys: the key's name, its entry and its value) and ``used_memory``
grown per key over the same number of keys written into an empty server (which also counts the
expiry's entry and the hash tables' slots). Beside them, the record of the layout the store had
before (a hash of ``st``, ``ca``, ``lu``, ``fp`` with a full SHA-256), written by that layout's
own scripts, kept below verbatim.

*Server CPU per eager message*: a claim of a new key and its completion, one message at a time
down a kept connection (each command its own round trip, as the store sends them), against
Powertools' two ``SET`` s (``SET NX PX`` + ``SET PX``): the redis-server main thread's CPU time
(``/proc/<pid>/schedstat``: the commands, the event loop and the socket system calls) and the
``INFO commandstats`` usec of what the client sent (a script's includes its commands). Rows:
the ``SET`` pair; two scripts that do nothing (what any two Lua round trips cost); the fenced
floor (the store's claim ``SET`` and a completion script that only checks the owner and
writes: ``GET``, ``SET PX``); the store itself (``RedisStore.claim`` + ``complete``); and the
layout before. Batches alternate, their order reversed every round; medians over the rounds,
ratios over the ``SET`` pair of the same round.

Usage (from the repository root)::

    .venv/bin/python bench/redis_server_cost.py                   # rounds 7, batch 2000
    .venv/bin/python bench/redis_server_cost.py --write-docs      # also its docs block
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hiredis
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (
    RedisServer,
    command_line,
    interleaved,
    loadavg,
    measured_line,
    med,
    table,
    write_block,
)

from taskonce.keys import fingerprint, owner_token
from taskonce.stores.redis import RedisStore
from taskonce.stores.redis.trips import Call, Command, command_of

BLOCK = "redis-server-cost"
LEASE_MS, KEEP_MS = 300_000, 7 * 86_400_000
WORKER = "bench-host/4026531836/12345/67890"  # a worker identity as long as a real one
PREFIX, QUEUE = "taskonce", "default"
FLOOR_VALUE = "handled!"  # 8 bytes that are not an integer (Redis would keep one as a number)

#: The layout before (commit 90252f2): a hash per record, claimed and completed by these two
#: scripts, sent with the arguments that layout's RedisStore built.
BEFORE_CLAIM = """
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end
local h = redis.call('HMGET', KEYS[1], 'st', 'ow', 'fp', 'rs', 'ca', 'lu', 'wk')
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local outcome = 1
local created = now
if h[1] then
  local expired_claim = h[1] == 'i' and tonumber(h[6]) <= now
  local same_payload = (not h[3]) or ARGV[4] ~= '1' or h[3] == ARGV[5]
  if not (expired_claim and same_payload) then
    local ex = ms(now + redis.call('PTTL', KEYS[1]))
    return {now, h[1], h[2], h[3], h[4], h[5], h[6], ex, h[7]}
  end
  outcome = 2
  created = tonumber(h[5])
  redis.call('DEL', KEYS[1])
end
local lease = tonumber(ARGV[2])
local f = {'st', 'i', 'ow', ARGV[1], 'ca', ms(created), 'lu', ms(now + lease)}
if ARGV[4] == '1' then f[#f + 1] = 'fp'; f[#f + 1] = ARGV[5] end
if ARGV[6] ~= '' then f[#f + 1] = 'wk'; f[#f + 1] = ARGV[6] end
redis.call('HSET', KEYS[1], unpack(f))
redis.call('PEXPIRE', KEYS[1], lease + tonumber(ARGV[3]))
return outcome
"""
BEFORE_COMPLETE = """
if redis.replicate_commands then redis.replicate_commands() end
local function ms(x) return string.format('%.0f', x) end
local h = redis.call('HMGET', KEYS[1], 'st', 'ow', 'lu')
if h[1] ~= 'i' or h[2] ~= ARGV[1] then return 0 end
if ARGV[3] == '1' then
  redis.call('HDEL', KEYS[1], 'ow', 'wk')
  redis.call('HSET', KEYS[1], 'st', 'c', 'rs', ARGV[4])
else
  redis.call('HDEL', KEYS[1], 'ow', 'rs', 'wk')
  redis.call('HSET', KEYS[1], 'st', 'c')
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
#: The fenced floor's completion: the owner checked, the record written, nothing else.
FENCED_COMPLETE = """
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 1, #ARGV[1] + 2) ~= 'i' .. ARGV[1] .. '|' then return 0 end
redis.call('SET', KEYS[1], 'c0|' .. ARGV[3], 'PX', ARGV[2])
return 1
"""
NOTHING = "return 1"


def payload_fp(n: int) -> str:
    """The guard's fingerprint of a small task call."""
    return fingerprint("shop.tasks.charge", (n, "EUR"), {"attempt": 1})


class Link:
    """A connection kept out of the pool, commands packed by hiredis (how the store sends)."""

    def __init__(self, client: redis.Redis) -> None:
        self.conn: Any = client.connection_pool.get_connection()

    def send(self, command: tuple[Any, ...]) -> Any:
        """One command, one round trip."""
        self.conn.send_packed_command([hiredis.pack_command(command)])
        return self.conn.read_response()


#: one message on a new key: (store, key name without prefix) -> its two commands
Message = Callable[[RedisStore, str], list[tuple[Any, ...]]]


def variants(client: redis.Redis) -> dict[str, tuple[str, Message]]:
    sha = {name: client.script_load(text) for name, text in _SCRIPTS.items()}

    def set_pair(_store: RedisStore, key: str) -> list[tuple[Any, ...]]:
        name = f"{PREFIX}:{key}"
        return [("SET", name, "1", "NX", "PX", LEASE_MS), ("SET", name, "done", "PX", KEEP_MS)]

    def nothing(_store: RedisStore, key: str) -> list[tuple[Any, ...]]:
        call = ("EVALSHA", sha["nothing"], 1, f"{PREFIX}:{key}", owner_token(), KEEP_MS)
        return [call, call]

    def fenced(_store: RedisStore, key: str) -> list[tuple[Any, ...]]:
        name, owner, fp = f"{PREFIX}:{key}", owner_token(), "Ab3_x9Zq-7PwLm0K"
        claim = f"i{owner}|{LEASE_MS + KEEP_MS:011x}|{KEEP_MS:011x}|{fp}|{WORKER}"
        return [
            ("SET", name, claim, "NX", "PX", LEASE_MS + KEEP_MS),
            ("EVALSHA", sha["fenced"], 1, name, owner, KEEP_MS, fp),
        ]

    def before(_store: RedisStore, key: str) -> list[tuple[Any, ...]]:
        name, owner = f"{PREFIX}:{key}", owner_token()
        fp = hashlib.sha256(key.encode()).hexdigest()  # 64 hex digits then
        return [
            ("EVALSHA", sha["before_claim"], 1, name, owner, LEASE_MS, KEEP_MS, "1", fp, WORKER),
            ("EVALSHA", sha["before_complete"], 1, name, owner, KEEP_MS, "0", ""),
        ]

    return {
        "set": ("`SET NX PX` + `SET PX` (Powertools, hand-written)", set_pair),
        "nothing": ("two scripts that do nothing (`return 1`)", nothing),
        "fenced": ("fenced floor: claim `SET NX PX` + script `GET`, `SET PX`", fenced),
        "store": ("**the store**: claim `SET NX PX` + complete script", store_commands),
        "before": ("the hash layout before: claim + complete scripts", before),
    }


_SCRIPTS = {
    "nothing": NOTHING,
    "fenced": FENCED_COMPLETE,
    "before_claim": BEFORE_CLAIM,
    "before_complete": BEFORE_COMPLETE,
}
#: what a new key must answer (a wrong shape must not pass unnoticed)
EXPECTED = {
    "set": (b"OK", b"OK"),
    "nothing": (1, 1),
    "fenced": (b"OK", 1),
    "store": (b"OK", 1),
    "before": (1, 1),
}


class Recorder:
    """Stands in for a store's transport: records the commands the store would send (as
    :func:`~taskonce.stores.redis.trips.command_of` builds them) and answers as a new key
    would, so the benchmark sends exactly the store's commands down its own kept connection,
    paced like the other rows (a slower client between commands leaves the server's caches
    colder, which shows as more server CPU per command on a busy machine)."""

    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []

    def run(self, script: Any, name: str, args: Any) -> Call:
        self.commands.append(command_of(script, name, args))
        call = Call(script, name, args)
        call.answer(b"OK" if isinstance(script, Command) else 1)
        return call


def store_commands(store: RedisStore, key: str) -> list[tuple[Any, ...]]:
    """The commands ``store`` sends for one eager message on a new ``key``: its claim (a
    plain ``SET … NX PX``) and its completion (``EVALSHA`` of the complete script)."""
    recorder = Recorder()
    store._trips = recorder  # type: ignore[assignment]  # this store only records
    owner = owner_token()
    store.claim(key, owner, LEASE_MS / 1000, KEEP_MS / 1000, payload_fp(1), WORKER)
    store.complete(key, owner, KEEP_MS / 1000, None)
    return recorder.commands


def main_thread_ns(pid: int) -> int:
    """On-CPU nanoseconds of ``pid``'s main thread (where redis-server runs every command)."""
    with open(f"/proc/{pid}/schedstat", encoding="ascii") as handle:
        return int(handle.read().split()[0])


def counters(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """(calls, usec) of SET and EVALSHA so far."""
    info = client.info("commandstats")
    return {
        name: (int(info[f"cmdstat_{name}"]["calls"]), int(info[f"cmdstat_{name}"]["usec"]))
        for name in ("set", "evalsha")
        if f"cmdstat_{name}" in info
    }


def sent_usec(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> float:
    """The commandstats usec of what the client sent: its EVALSHAs' (their commands included)
    and its own SETs' share of the SET time (Redis counts a SET a script runs under SET as
    well as inside the script)."""
    spent = {
        name: (c - before.get(name, (0, 0))[0], u - before.get(name, (0, 0))[1])
        for name, (c, u) in after.items()
    }
    return spent.get("evalsha", (0, 0))[1] + spent.get("set", (0, 0))[1]


def batch(
    server: RedisServer, store: RedisStore, link: Link, client: redis.Redis, name: str, n: int
) -> tuple[float, float]:
    """(server CPU µs, commandstats µs) per message over ``n`` new keys. Every command is
    built before the clock starts, so each row's commands reach the server at the pace of the
    same loop."""
    _, message = TABLE[name]
    messages = [message(store, f"{QUEUE}:{uuid.uuid4()}") for _ in range(n)]
    before, cpu0 = counters(client), main_thread_ns(server.pid)
    replies = [(link.send(first), link.send(second)) for first, second in messages]
    cpu1, after = main_thread_ns(server.pid), counters(client)
    for reply in replies:
        if reply != EXPECTED[name]:
            raise RuntimeError(f"{name}: a new key answered {reply!r}, not {EXPECTED[name]!r}")
    stat = sent_usec(before, after)
    if name in ("store", "fenced"):  # the SETs their scripts ran count inside the scripts
        sets = after.get("set", (0, 0))[0] - before.get("set", (0, 0))[0]
        set_usec = after.get("set", (0, 0))[1] - before.get("set", (0, 0))[1]
        stat -= set_usec * (sets - n) / sets if sets else 0.0  # n: the client's claim SETs
    return (cpu1 - cpu0) / 1e3 / n, stat / n


TABLE: dict[str, tuple[str, Message]] = {}


# -- bytes ------------------------------------------------------------------------------------


def memory(
    client: redis.Redis, store: RedisStore, link: Link, n: int
) -> dict[str, tuple[float, float, int, str]]:
    """Per kind of record: (MEMORY USAGE median, used_memory per key, value bytes, encoding)."""
    sha = {name: client.script_load(text) for name, text in _SCRIPTS.items()}

    def floor(key: str) -> None:
        link.send(("SET", f"{PREFIX}:{key}", FLOOR_VALUE, "PX", KEEP_MS))

    def record(key: str) -> None:
        owner = owner_token()
        store.claim(key, owner, LEASE_MS / 1000, KEEP_MS / 1000, payload_fp(len(key)), WORKER)
        store.complete(key, owner, KEEP_MS / 1000, None)

    def before(key: str) -> None:
        name, owner = f"{PREFIX}:{key}", owner_token()
        fp = hashlib.sha256(key.encode()).hexdigest()
        link.send(
            ("EVALSHA", sha["before_claim"], 1, name, owner, LEASE_MS, KEEP_MS, "1", fp, WORKER)
        )
        link.send(("EVALSHA", sha["before_complete"], 1, name, owner, KEEP_MS, "0", ""))

    found = {}
    for kind, write in (("floor", floor), ("store", record), ("before", before)):
        client.flushall()
        start = int(client.info("memory")["used_memory"])
        keys = [f"{QUEUE}:{uuid.uuid4()}" for _ in range(n)]
        for key in keys:
            write(key)
        grown = (int(client.info("memory")["used_memory"]) - start) / n
        names = [f"{PREFIX}:{key}" for key in keys[:: max(1, n // 500)]]
        usage = statistics.median(int(client.memory_usage(k, samples=0)) for k in names)
        encoding = client.object("encoding", names[0])
        size = client.strlen(names[0]) if kind != "before" else 0
        found[kind] = (usage, grown, int(size), encoding.decode() if encoding else "")
    client.flushall()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=2000)
    parser.add_argument("--keys", type=int, default=20_000, help="keys per kind of record")
    parser.add_argument("--write-docs", action="store_true", help=f"write the {BLOCK} block")
    args = parser.parse_args(argv)
    command = command_line("bench/redis_server_cost.py", argv)
    load_start = loadavg()
    samples: dict[str, list[tuple[float, float]]] = {}
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        store = RedisStore(server.url, prefix=PREFIX)
        link = Link(client)
        TABLE.update(variants(client))
        sizes = memory(client, store, link, args.keys)
        recording = RedisStore(server.url, prefix=PREFIX)
        for script in recording._scripts.__dict__.values():
            client.script_load(script.script)  # as the store's first call of each would
        for name in TABLE:  # warm-up: scripts cached, allocator warm
            batch(server, recording, link, client, name, 200)
        for _, name in interleaved(args.rounds, list(TABLE)):
            samples.setdefault(name, []).append(
                batch(server, recording, link, client, name, args.batch)
            )
        version = client.info("server")["redis_version"]
        store.close()
        client.close()
    text = report(samples, sizes, args, command, load_start, version)
    print(text)
    if args.write_docs:
        write_block(BLOCK, text)
    return 0


def report(
    samples: dict[str, list[tuple[float, float]]],
    sizes: dict[str, tuple[float, float, int, str]],
    args: argparse.Namespace,
    command: str,
    load_start: str,
    version: str,
) -> str:
    floor_usage, floor_grown = sizes["floor"][0], sizes["floor"][1]
    byte_rows = []
    for kind, label in (
        ("floor", f"the floor: `SET key <8 bytes> PX` ({sizes['floor'][3]})"),
        ("store", "**the store**: a completed eager record with its fingerprint"),
        ("before", "the hash layout before (`st`, `ca`, `lu`, `fp` of 64 hex digits)"),
    ):
        usage, grown, size, encoding = sizes[kind]
        value = f"{size} B string ({encoding})" if kind != "before" else f"hash ({encoding})"
        byte_rows.append(
            [
                label,
                value,
                f"{usage:.0f}",
                f"{usage / floor_usage:.2f}",
                f"{grown:.0f}",
                f"{grown / floor_grown:.2f}",
            ]
        )

    def ratio(name: str, i: int) -> float:
        # each round's own ratio, then their median: machine noise hits a round's batches alike
        pairs = zip(samples[name], samples["set"], strict=True)
        return med(mine[i] / base[i] for mine, base in pairs)

    cpu_rows = [
        [
            label,
            f"{med(s[0] for s in samples[name]):.1f}",
            f"{ratio(name, 0):.2f}",
            f"{med(s[1] for s in samples[name]):.1f}",
        ]
        for name, (label, _) in TABLE.items()
    ]
    usage_ratio = sizes["store"][0] / floor_usage
    grown_ratio = sizes["store"][1] / floor_grown
    cpu_ratio = ratio("store", 0)
    return "\n\n".join(
        [
            f"Bytes per remembered message, {args.keys} keys of each kind (`MEMORY USAGE`: "
            "median; *used_memory*: grown per key, the expiry's entry and the tables' slots "
            "included):",
            table(
                [
                    "record",
                    "value",
                    "MEMORY USAGE B",
                    "ratio",
                    "used_memory B per key",
                    "ratio",
                ],
                byte_rows,
                "llrrrr",
            ),
            f"Server CPU per eager message, one at a time, medians of {args.rounds} rounds of "
            f"{args.batch} messages (the ratio: each round's over its `SET` pair, the median):",
            table(["per message", "server CPU µs", "ratio", "commandstats µs"], cpu_rows, "lrrr"),
            f"Against the aims: bytes {usage_ratio:.2f}× the floor by `MEMORY USAGE`, "
            f"{grown_ratio:.2f}× by used_memory (aim ≤ 1.15×: "
            f"{'met' if max(usage_ratio, grown_ratio) <= 1.15 else 'not met'}); server CPU "
            f"{cpu_ratio:.2f}× the two `SET`s (aim ≤ 1.3×: "
            f"{'met' if cpu_ratio <= 1.3 else 'not met'}).",
            measured_line(command, load_start, [f"Redis {version}"]),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
