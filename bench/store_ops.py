"""Per-operation latency of every taskonce store, beside the raw minimum of its backend.

For each store (memory, Redis, PostgreSQL, MariaDB, SQLite) this measures ``claim`` (a new
key), ``complete`` and ``release`` (of a claim), ``mark`` (a new key) and ``duplicate`` (a
``claim`` of a key that is already marked: the EXISTS path a duplicate delivery costs), each
beside the raw minimum measured in the same run through the same client and connection pool:

- Redis: one ``SET key val NX PX 300000`` through the store's own client (``store._client``);
- SQL: one autocommit ``INSERT`` of a row into a scratch table of the same column shape,
  through the store's own AUTOCOMMIT engine (``store._engine``);
- memory: one dict insert under a lock (no aim; shown for scale).

Baseline and operation batches are interleaved (their order alternating, the operations
rotating) so that machine noise hits both alike; each operation's ratio is its median over the
median of the baseline batches run next to it. Round trips per call are counted in a separate
pass: Redis commands sent by the client, SQL statements executed by SQLAlchemy, and on MariaDB
the server's own ``Questions`` counter for the session (it also sees the ``ROLLBACK`` that
PyMySQL sends when SQLAlchemy returns an autocommit connection to the pool).

It also measures bytes per key: Redis ``MEMORY USAGE`` of a completed key (64-character
fingerprint, no result) and PostgreSQL ``pg_total_relation_size`` / rows after 10,000 marks.

Usage (from the repository root)::

    .venv/bin/python bench/store_ops.py                      # all stores, print the table
    .venv/bin/python bench/store_ops.py --stores redis,postgresql --iterations 5000
    .venv/bin/python bench/store_ops.py --write-docs         # also rewrite the section of
                                                             # docs/performance.md

Everything it creates is removed afterwards: Redis keys under a random prefix in DB 15, SQL
tables with random names, the SQLite temporary directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import hashlib
import math
import os
import platform
import secrets
import shlex
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from taskonce.stores import ClaimOutcome, MemoryStore, Store, open_store

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `taskonce bench` runs it by runpy
from docs_section import DOC, write_section

REPO = Path(__file__).resolve().parent.parent
SECTION = "## Store operations"

STORES = ("memory", "redis", "postgresql", "mariadb", "sqlite")
SQL_STORES = ("postgresql", "mariadb", "sqlite")
OPS = ("claim", "complete", "release", "mark", "duplicate")
DEFAULT_URLS = {
    "redis": "redis://127.0.0.1:6379/15",
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test",
}
LABELS = {
    "memory": "memory",
    "redis": "Redis",
    "postgresql": "PostgreSQL",
    "mariadb": "MariaDB",
    "sqlite": "SQLite",
}
#: (store, op) → the largest acceptable ratio median(op) / median(raw baseline).
AIMS = {
    ("redis", "claim"): 1.3,
    ("redis", "complete"): 1.3,
    ("postgresql", "claim"): 1.5,
    ("mariadb", "claim"): 1.5,
    ("sqlite", "claim"): 1.5,
}

LEASE = 300.0
KEEP_FOR = 7 * 86400.0
FINGERPRINT = hashlib.sha256(b"taskonce bench payload").hexdigest()  # 64 characters
OWNER = secrets.token_hex(16)  # the guard's owner tokens look like this
OTHER_OWNER = secrets.token_hex(16)
QUEUE = "default"
PG_SIZE_ROWS = 10_000
REDIS_SIZE_KEYS = 200
TRIP_CALLS = 20


def fresh_keys(n: int) -> list[str]:
    """Store keys as the guard makes them (identity ``id+queue``: ``queue:message id``)."""
    return [f"{QUEUE}:{uuid.uuid4()}" for _ in range(n)]


# -- targets -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Target:
    """One store under test, with the raw operation it is compared with."""

    name: str
    store: Store
    raw: Callable[[str], object]  # one raw write of a fresh key
    raw_keys: Callable[[int], list[str]]
    raw_label: str
    version: str
    count_trips: Callable[[Callable[[str], object], list[str]], float] | None
    trips_note: str
    cleanups: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    bytes_per_key: dict[str, Any] = dataclasses.field(default_factory=dict)

    def cleanup(self) -> None:
        for fn in reversed(self.cleanups):
            try:
                fn()
            except Exception as exc:  # keep cleaning the rest
                print(f"  cleanup of {self.name} failed: {type(exc).__name__}: {exc}")


def open_memory(_args: argparse.Namespace) -> Target:
    store = MemoryStore()
    lock = threading.Lock()
    scratch: dict[str, str] = {}

    def raw(key: str) -> None:
        with lock:
            scratch[key] = FINGERPRINT

    target = Target(
        name="memory",
        store=store,
        raw=raw,
        raw_keys=fresh_keys,
        raw_label="dict insert under a lock",
        version=f"Python {platform.python_version()}",
        count_trips=None,
        trips_note="in-process",
    )
    target.cleanups.append(store.close)
    return target


def open_redis(args: argparse.Namespace) -> Target:
    from taskonce.stores.redis import RedisStore

    prefix = f"bench-{secrets.token_hex(4)}"
    store = open_store(args.redis_url, prefix=prefix)
    assert isinstance(store, RedisStore)
    client = store._client
    version = str(client.info("server")["redis_version"])

    def raw(key: str) -> object:
        return client.set(key, "1", nx=True, px=300000)

    def raw_keys(n: int) -> list[str]:
        return [f"{prefix}:raw:{uuid.uuid4()}" for _ in range(n)]

    def count_trips(fn: Callable[[str], object], keys: list[str]) -> float:
        # Commands written to a socket: the store sends its scripts down its own connection,
        # not through the client's execute_command, so the count is taken at the connection.
        import redis.connection

        calls = 0
        cls = redis.connection.AbstractConnection
        original = cls.send_packed_command

        def counting(self: Any, command: Any, *a: Any, **kw: Any) -> Any:
            nonlocal calls
            calls += 1
            return original(self, command, *a, **kw)

        cls.send_packed_command = counting  # type: ignore[method-assign]
        try:
            for key in keys:
                fn(key)
        finally:
            cls.send_packed_command = original  # type: ignore[method-assign]
        return calls / len(keys)

    def drop_keys() -> None:
        pattern = prefix.replace("[", "\\[") + ":*"
        batch: list[Any] = []
        for name in client.scan_iter(match=pattern, count=1000):
            batch.append(name)
            if len(batch) >= 1000:
                client.delete(*batch)
                batch = []
        if batch:
            client.delete(*batch)

    target = Target(
        name="redis",
        store=store,
        raw=raw,
        raw_keys=raw_keys,
        raw_label="SET NX PX",
        version=f"Redis {version}",
        count_trips=count_trips,
        trips_note="commands written to the connection",
    )
    target.cleanups.append(store.close)
    target.cleanups.append(drop_keys)
    return target


def open_sql(name: str, args: argparse.Namespace, tmpdir: Path) -> Target:
    import sqlalchemy as sa
    from sqlalchemy import event

    from taskonce.stores.sql import SQLStore

    if name == "sqlite":
        url = f"sqlite:///{tmpdir / 'bench.db'}"
    else:
        url = getattr(args, f"{name}_url")
    suffix = secrets.token_hex(4)
    table = f"bench_ops_{suffix}"
    store = open_store(url, table=table)
    assert isinstance(store, SQLStore)
    target_cleanups: list[Callable[[], None]] = [store.close]
    try:
        store.create_tables()
        target_cleanups.append(lambda: store._table.drop(store._engine, checkfirst=True))
        target_cleanups.append(lambda: store._live_table.drop(store._engine, checkfirst=True))
        # The scratch table: created by a second store so that it has exactly the DDL (column
        # types, collation, index) of a store table; written through the first store's engine.
        scratch_store = SQLStore(url, table=f"bench_raw_{suffix}")
        try:
            scratch_store.create_tables()
        finally:
            scratch_store.close()
        scratch = scratch_store._table
        target_cleanups.append(lambda: scratch.drop(store._engine, checkfirst=True))
        scratch_live = scratch_store._live_table
        target_cleanups.append(lambda: scratch_live.drop(store._engine, checkfirst=True))
    except BaseException:
        for fn in reversed(target_cleanups):
            fn()
        raise

    engine = store._engine  # the store's AUTOCOMMIT engine
    insert = sa.insert(scratch).values(
        key=sa.bindparam("k"),
        status=sa.bindparam("st"),
        owner=sa.bindparam("ow"),
        fingerprint=sa.bindparam("fp"),
        result=sa.bindparam("rs"),
        created_at=sa.bindparam("ca"),
        lease_until=sa.bindparam("lu"),
        expires_at=sa.bindparam("ex"),
    )

    def raw(key: str) -> None:
        now = time.time()
        params = {
            "k": key,
            "st": "completed",
            "ow": None,
            "fp": FINGERPRINT,
            "rs": None,
            "ca": now,
            "lu": 0.0,
            "ex": now + KEEP_FOR,
        }
        with engine.connect() as connection:
            connection.execute(insert, params)

    with engine.connect() as connection:
        if name == "postgresql":
            version = "PostgreSQL " + str(
                connection.exec_driver_sql("SHOW server_version").scalar()
            )
        elif name == "mariadb":
            version = "MariaDB " + str(connection.exec_driver_sql("SELECT VERSION()").scalar())
        else:
            version = f"SQLite {sqlite3.sqlite_version}"

    def statement_count(fn: Callable[[str], object], keys: list[str]) -> float:
        calls = 0

        def before(*_a: Any, **_kw: Any) -> None:
            nonlocal calls
            calls += 1

        event.listen(engine, "before_cursor_execute", before)
        try:
            for key in keys:
                fn(key)
        finally:
            event.remove(engine, "before_cursor_execute", before)
        return calls / len(keys)

    def questions() -> int:
        with engine.connect() as connection:
            row = connection.exec_driver_sql("SHOW SESSION STATUS LIKE 'Questions'").one()
        return int(row[1])

    def question_count(fn: Callable[[str], object], keys: list[str]) -> float:
        # The SHOW itself and the ROLLBACK after it add a fixed amount; measure it with nothing
        # in between and subtract it.
        start = questions()
        overhead = questions() - start
        before = questions()
        for key in keys:
            fn(key)
        after = questions()
        return (after - before - overhead) / len(keys)

    if name == "mariadb":
        count_trips, note = question_count, "server-side Questions of the session"
    elif name == "postgresql":
        count_trips, note = statement_count, "statements executed"
    else:
        count_trips, note = statement_count, "statements executed (in-process)"

    target = Target(
        name=name,
        store=store,
        raw=raw,
        raw_keys=fresh_keys,
        raw_label="autocommit INSERT",
        version=version,
        count_trips=count_trips,
        trips_note=note,
    )
    target.cleanups.extend(target_cleanups)
    return target


# -- operations ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Op:
    setup: Callable[[str], object] | None
    call: Callable[[str], object]
    ok: Callable[[object], bool]


def operations(store: Store) -> dict[str, Op]:
    def claim_new(key: str) -> object:
        return store.claim(key, OWNER, LEASE, KEEP_FOR, FINGERPRINT).outcome

    def mark_new(key: str) -> object:
        return store.mark(key, KEEP_FOR, FINGERPRINT, None)

    return {
        "claim": Op(None, claim_new, lambda r: r is ClaimOutcome.CLAIMED),
        "complete": Op(
            claim_new, lambda k: store.complete(k, OWNER, KEEP_FOR, None), lambda r: r is None
        ),
        "release": Op(claim_new, lambda k: store.release(k, OWNER), lambda r: r is None),
        "mark": Op(None, mark_new, lambda r: r is True),
        "duplicate": Op(
            mark_new,
            lambda k: store.claim(k, OTHER_OWNER, LEASE, KEEP_FOR, FINGERPRINT).outcome,
            lambda r: r is ClaimOutcome.EXISTS,
        ),
    }


# -- one message's pair of calls (Redis) -------------------------------------------------------

#: The largest acceptable ratio of a pair's client CPU over the raw pair it replaces.
PAIR_AIM = 1.1
PAIR_ROUNDS = 15
PAIR_BATCH = 200
PAIR_SERVER_CALLS = 2000
KEEP_MS = round(KEEP_FOR * 1000)
WORKER = "bench-host/4026531836/12345/67890"  # a worker identity as long as a real one


@dataclasses.dataclass
class PairResult:
    """One message's store calls against the raw Redis calls a hand-written guard makes."""

    mode: str
    label: str
    raw_label: str
    cpu_us: float  # client CPU per message (process time), median over the rounds
    wall_us: float
    raw_cpu_us: float
    raw_wall_us: float
    commands: float = 0.0  # commands the server ran per message (a script's, not its EVALSHA)
    server_us: float = 0.0  # INFO commandstats usec per message
    server_cpu_us: float = 0.0  # the redis-server process's CPU per message
    names: str = ""
    raw_commands: float = 0.0
    raw_server_us: float = 0.0
    raw_server_cpu_us: float = 0.0
    raw_names: str = ""

    @property
    def cpu_ratio(self) -> float:
        return self.cpu_us / self.raw_cpu_us

    @property
    def wall_ratio(self) -> float:
        return self.wall_us / self.raw_wall_us


def pair_calls(
    store: Any, client: Any
) -> dict[str, tuple[str, str, Callable[[str], object], Callable[[str], object]]]:
    """Per mode: labels, the store's calls for one new message, the raw calls they replace."""

    def eager(mid: str) -> object:
        key = f"{QUEUE}:{mid}"
        if store.claim(key, OWNER, LEASE, KEEP_FOR, FINGERPRINT, WORKER).outcome is not (
            ClaimOutcome.CLAIMED
        ):
            raise RuntimeError(f"claim of a new key {key!r} did not claim")
        store.complete(key, OWNER, KEEP_FOR, None)
        return None

    def raw_eager(mid: str) -> object:
        key = f"{store._prefix}:raw:{mid}"
        if not client.set(key, "1", nx=True, px=300000):
            raise RuntimeError(f"SET NX of a new key {key!r} did not set")
        return client.set(key, "done", px=KEEP_MS)

    def lazy(mid: str) -> object:
        key = f"{QUEUE}:{mid}"
        if store.get(key) is not None or not store.mark(key, KEEP_FOR, FINGERPRINT, None):
            raise RuntimeError(f"check + mark of a new key {key!r} found it recorded")
        return None

    def raw_lazy(mid: str) -> object:
        key = f"{store._prefix}:raw:{mid}"
        if client.get(key) is not None:
            raise RuntimeError(f"GET of a new key {key!r} found it")
        return client.set(key, "done", px=KEEP_MS)

    return {
        "eager": ("claim + complete", "`SET NX PX` + `SET PX`", eager, raw_eager),
        "lazy": ("check (`get`) + mark", "`GET` + `SET PX`", lazy, raw_lazy),
    }


def pair_batch(fn: Callable[[str], object], n: int) -> tuple[float, float]:
    """(client CPU µs, wall µs) per call of ``fn`` over ``n`` new message ids."""
    mids = [str(uuid.uuid4()) for _ in range(n)]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for mid in mids:
        fn(mid)
    return (time.process_time() - cpu0) * 1e6 / n, (time.perf_counter() - wall0) * 1e6 / n


def measure_pairs(target: Target, rounds: int, batch: int) -> list[PairResult]:
    """Each mode's pair beside its raw pair, in interleaved batches (order swapped every
    round) on the store's client; then the server's share on a private redis-server."""
    store: Any = target.store
    calls = pair_calls(store, store._client)
    for _, _, fn, raw in calls.values():  # warm-up
        pair_batch(fn, 100)
        pair_batch(raw, 100)
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for round_no in range(rounds):
        for mode, (_, _, fn, raw) in calls.items():
            order = [("store", fn), ("raw", raw)]
            if round_no % 2:
                order.reverse()
            for side, f in order:
                samples.setdefault((mode, side), []).append(pair_batch(f, batch))

    def med(mode: str, side: str, i: int) -> float:
        return statistics.median(sample[i] for sample in samples[(mode, side)])

    results = [
        PairResult(
            mode,
            label,
            raw_label,
            med(mode, "store", 0),
            med(mode, "store", 1),
            med(mode, "raw", 0),
            med(mode, "raw", 1),
        )
        for mode, (label, raw_label, _, _) in calls.items()
    ]
    server_share(results)
    return results


def server_share(results: list[PairResult]) -> None:
    """Fill in the server's share of each pair: INFO commandstats and the process's CPU, on a
    redis-server of this benchmark's own (nothing else's commands in its counters)."""
    from guard_cpu import server_cost, start_redis

    from taskonce.stores.redis import RedisStore

    process, port = start_redis()
    try:
        store = RedisStore(f"redis://127.0.0.1:{port}/0", prefix="bench")
        calls = pair_calls(store, store._client)
        for result in results:
            _, _, fn, raw = calls[result.mode]
            pair_batch(fn, 100)
            pair_batch(raw, 100)
            result.commands, result.server_us, result.names, result.server_cpu_us = server_cost(
                store._client, fn, PAIR_SERVER_CALLS, process.pid
            )
            (
                result.raw_commands,
                result.raw_server_us,
                result.raw_names,
                result.raw_server_cpu_us,
            ) = server_cost(store._client, raw, PAIR_SERVER_CALLS, process.pid)
        store.close()
    finally:
        process.terminate()
        process.wait(10)


def pair_aim(ratio: float) -> str:
    return f"≤ {PAIR_AIM}× {'met' if ratio <= PAIR_AIM else 'MISSED'}"


def pair_rows(pairs: list[PairResult]) -> list[list[str]]:
    rows = []
    for p in pairs:
        rows.append(
            [
                p.mode,
                p.label,
                f"{p.cpu_us:.0f}",
                f"{p.wall_us:.0f}",
                f"{p.cpu_ratio:.2f}",
                f"{p.wall_ratio:.2f}",
                pair_aim(p.cpu_ratio),
                f"{p.commands:g}",
                f"{p.server_us:.1f}",
                f"{p.server_cpu_us:.0f}",
                p.names,
            ]
        )
        rows.append(
            [
                p.mode,
                f"*raw {p.raw_label}* (baseline)",
                f"{p.raw_cpu_us:.0f}",
                f"{p.raw_wall_us:.0f}",
                "1.00",
                "1.00",
                "",
                f"{p.raw_commands:g}",
                f"{p.raw_server_us:.1f}",
                f"{p.raw_server_cpu_us:.0f}",
                p.raw_names,
            ]
        )
    return rows


PAIR_HEADER = [
    "Mode",
    "Per message",
    "Client CPU µs",
    "Wall µs",
    "CPU ratio",
    "Wall ratio",
    "Aim (CPU)",
    "Server commands",
    "Server µs (commandstats)",
    "Server CPU µs",
    "Commands run",
]


def pair_table(pairs: list[PairResult]) -> str:
    lines = [
        "| " + " | ".join(PAIR_HEADER) + " |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in pair_rows(pairs)]
    return "\n".join(lines)


def pair_text(pairs: list[PairResult]) -> str:
    if not pairs:
        return ""
    verdicts = "; ".join(
        f"{p.label} {p.cpu_ratio:.2f}× the client CPU of {p.raw_label} (aim ≤ {PAIR_AIM}×: "
        f"{'met' if p.cpu_ratio <= PAIR_AIM else 'missed'}), {p.wall_ratio:.2f}× its wall time"
        for p in pairs
    )
    server = "; ".join(
        f"{p.mode} {p.commands:g} commands and {p.server_us:.0f} µs of commandstats time "
        f"against {p.raw_commands:g} and {p.raw_server_us:.0f} µs (process CPU "
        f"{p.server_cpu_us:.0f} against {p.raw_server_cpu_us:.0f} µs)"
        for p in pairs
    )
    return (
        f"Against the pair aims: {verdicts}. On the server, per message: {server}. The store "
        "still sends one EVALSHA per call, so it makes as many round trips as the raw pair; "
        "its client CPU is lower than the raw calls' because it writes them down a connection "
        "it keeps (no pool checkout, no redis-py command path per call) and packs them with "
        "hiredis directly, while the raw calls go through redis-py's `set`/`get`. The server "
        "side is where it is not on par: running a script as such costs the server about what "
        "a plain command does, but each command a script runs from Lua costs it a few µs more "
        "than the same command sent alone, and the scripts run several (the commands above) "
        "where the raw pair sends one each; they are what make the claim atomic and every "
        "later write fenced (see [the server's work per message]"
        "(#redis-store-the-servers-work-per-message))."
    )


# -- measuring -----------------------------------------------------------------------------------


#: One timed call: (wall-clock ns, this thread's CPU ns). Wall minus CPU is, roughly, the time
#: spent waiting for the server (network and the server's own work).
Sample = tuple[int, int]


@dataclasses.dataclass
class Stat:
    median_us: float
    p99_us: float
    cpu_median_us: float  # client CPU: Python, the driver, the socket system calls
    n: int


def stat(samples: list[Sample]) -> Stat:
    ordered = sorted(wall for wall, _ in samples)
    p99 = ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]
    cpu = statistics.median(cpu for _, cpu in samples)
    return Stat(statistics.median(ordered) / 1000.0, p99 / 1000.0, cpu / 1000.0, len(ordered))


@dataclasses.dataclass
class OpResult:
    op: str
    stat: Stat
    paired_baseline: Stat
    trips: float | None

    @property
    def ratio(self) -> float:
        return self.stat.median_us / self.paired_baseline.median_us


@dataclasses.dataclass
class StoreResult:
    target: str
    version: str
    raw_label: str
    baseline: Stat
    baseline_trips: float | None
    trips_note: str
    ops: list[OpResult]
    connections: int | None
    bytes_per_key: dict[str, Any]
    elapsed_s: float
    pairs: list[PairResult] = dataclasses.field(default_factory=list)


def timed_batch(fn: Callable[[str], object], keys: list[str], out: list[Sample]) -> list[object]:
    results: list[object] = []
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    for key in keys:
        c0 = cpu_clock()
        t0 = clock()
        result = fn(key)
        t1 = clock()
        c1 = cpu_clock()
        out.append((t1 - t0, c1 - c0))
        results.append(result)
    return results


def run_rounds(
    target: Target,
    ops: dict[str, Op],
    iterations: int,
    batch: int,
    samples: dict[str, list[Sample]],
    paired: dict[str, list[Sample]],
) -> None:
    """``iterations`` timed calls of every operation, in batches of ``batch``, each batch run
    next to a batch of the raw baseline; the order of operations rotates every round and the
    baseline goes first in every other batch."""
    names = list(ops)
    for round_no in range(math.ceil(iterations / batch)):
        size = min(batch, iterations - round_no * batch)
        shift = round_no % len(names)
        gc.collect()
        for index, name in enumerate(names[shift:] + names[:shift]):
            op = ops[name]
            keys = fresh_keys(size)
            raw_keys = target.raw_keys(size)
            if op.setup is not None:
                for key in keys:
                    op.setup(key)
            op_out: list[Sample] = []
            base_out: list[Sample] = []
            if (round_no + index) % 2 == 0:
                timed_batch(target.raw, raw_keys, base_out)
                results = timed_batch(op.call, keys, op_out)
            else:
                results = timed_batch(op.call, keys, op_out)
                timed_batch(target.raw, raw_keys, base_out)
            bad = [result for result in results if not op.ok(result)]
            if bad:
                raise RuntimeError(f"{target.name} {name}: unexpected result {bad[0]!r}")
            samples[name].extend(op_out)
            paired[name].extend(base_out)


def pooled_connections(target: Target) -> int | None:
    """How many connections the store's pool holds after the run (1 = every call, baseline and
    operations alike, went over the same connection)."""
    store: Any = target.store
    if target.name == "redis":
        pool = store._client.connection_pool
        created = getattr(pool, "_created_connections", None)
        return int(created) if created is not None else None
    if target.name in SQL_STORES:
        pool = store._engine.pool
        return int(pool.checkedin()) + int(pool.checkedout())
    return None


def measure(target: Target, iterations: int, batch: int, warmup: int) -> StoreResult:
    started = time.perf_counter()
    ops = operations(target.store)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        scrap: dict[str, list[Sample]] = {name: [] for name in ops}
        run_rounds(target, ops, warmup, batch, scrap, {name: [] for name in ops})
        samples: dict[str, list[Sample]] = {name: [] for name in ops}
        paired: dict[str, list[Sample]] = {name: [] for name in ops}
        run_rounds(target, ops, iterations, batch, samples, paired)
    finally:
        if gc_was_enabled:
            gc.enable()

    trips: dict[str, float | None] = {name: None for name in ops}
    baseline_trips = None
    if target.count_trips is not None:
        for name, op in ops.items():
            keys = fresh_keys(TRIP_CALLS)
            if op.setup is not None:
                for key in keys:
                    op.setup(key)
            trips[name] = target.count_trips(op.call, keys)
        baseline_trips = target.count_trips(target.raw, target.raw_keys(TRIP_CALLS))

    all_baseline = [sample for name in ops for sample in paired[name]]
    return StoreResult(
        target=target.name,
        version=target.version,
        raw_label=target.raw_label,
        baseline=stat(all_baseline),
        baseline_trips=baseline_trips,
        trips_note=target.trips_note,
        ops=[OpResult(name, stat(samples[name]), stat(paired[name]), trips[name]) for name in ops],
        connections=pooled_connections(target),
        bytes_per_key=target.bytes_per_key,
        elapsed_s=time.perf_counter() - started,
    )


def redis_bytes_per_key(target: Target) -> dict[str, Any]:
    """MEMORY USAGE of completed keys: claimed with a 64-character fingerprint, completed
    without a result (the median over a few hundred keys)."""
    store: Any = target.store
    client = store._client
    usages: list[int] = []
    names: list[str] = []
    for key in fresh_keys(REDIS_SIZE_KEYS):
        store.claim(key, OWNER, LEASE, KEEP_FOR, FINGERPRINT)
        store.complete(key, OWNER, KEEP_FOR, None)
        name = store._key(key)
        names.append(name)
        usages.append(int(client.memory_usage(name, samples=0)))
    encoding = client.object("encoding", names[0])
    if isinstance(encoding, bytes):
        encoding = encoding.decode()
    return {
        "bytes": int(statistics.median(usages)),
        "key_chars": len(names[0]),
        "encoding": str(encoding),
        "samples": len(usages),
    }


def postgres_bytes_per_key(url: str) -> dict[str, Any]:
    """pg_total_relation_size (heap, TOAST and both indexes) per row of a fresh table holding
    ``PG_SIZE_ROWS`` marks written by ``SQLStore.mark`` (64-character fingerprint, no result)."""
    import sqlalchemy as sa

    from taskonce.stores.sql import SQLStore

    table = f"bench_size_{secrets.token_hex(4)}"
    store = SQLStore(url, table=table)
    try:
        store.create_tables()
        try:
            started = time.perf_counter()
            for key in fresh_keys(PG_SIZE_ROWS):
                if not store.mark(key, KEEP_FOR, FINGERPRINT, None):
                    raise RuntimeError(f"mark of the new key {key!r} found a record")
            elapsed = time.perf_counter() - started
            query = sa.text(
                "SELECT pg_total_relation_size(CAST(:t AS regclass)), "
                "pg_relation_size(CAST(:t AS regclass)), "
                "pg_indexes_size(CAST(:t AS regclass))"
            )
            with store._engine.connect() as connection:
                total, heap, indexes = connection.execute(query, {"t": table}).one()
                rows = connection.execute(sa.select(sa.func.count()).select_from(store._table))
                count = int(rows.scalar_one())
        finally:
            store._table.drop(store._engine, checkfirst=True)
    finally:
        store.close()
    return {
        "bytes": round(int(total) / count),
        "heap_bytes": round(int(heap) / count),
        "index_bytes": round(int(indexes) / count),
        "rows": count,
        "marks_per_s": round(count / elapsed),
    }


# -- reporting -----------------------------------------------------------------------------------


def fmt_trips(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.0f}" if abs(value - round(value)) < 0.05 else f"{value:.2f}"


def aim_text(store: str, op: str, ratio: float) -> str:
    limit = AIMS.get((store, op))
    if limit is None:
        return ""
    return f"≤ {limit}× {'met' if ratio <= limit else 'MISSED'}"


def table_rows(results: list[StoreResult]) -> list[list[str]]:
    rows = []
    for result in results:
        label = LABELS[result.target]
        rows.append(
            [
                label,
                f"raw {result.raw_label}",
                fmt_trips(result.baseline_trips),
                f"{result.baseline.median_us:.1f}",
                f"{result.baseline.p99_us:.1f}",
                f"{result.baseline.cpu_median_us:.1f}",
                "",
                "1.00",
                "",
            ]
        )
        for op in result.ops:
            rows.append(
                [
                    label,
                    op.op,
                    fmt_trips(op.trips),
                    f"{op.stat.median_us:.1f}",
                    f"{op.stat.p99_us:.1f}",
                    f"{op.stat.cpu_median_us:.1f}",
                    f"{op.paired_baseline.median_us:.1f}",
                    f"{op.ratio:.2f}",
                    aim_text(result.target, op.op, op.ratio),
                ]
            )
    return rows


HEADER = [
    "store",
    "operation",
    "round trips",
    "median µs",
    "p99 µs",
    "client CPU µs",
    "baseline µs",
    "ratio",
    "aim",
]


def plain_table(results: list[StoreResult]) -> str:
    rows = [HEADER, *table_rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    numeric = {2, 3, 4, 5, 6, 7}
    lines = []
    for n, row in enumerate(rows):
        cells = [
            cell.rjust(widths[i]) if i in numeric and n else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(results: list[StoreResult]) -> str:
    header = [
        "Store",
        "Operation",
        "Round trips",
        "Median µs",
        "p99 µs",
        "Client CPU µs",
        "Baseline median µs",
        "Ratio",
        "Aim",
    ]
    lines = [
        "| " + " | ".join(header) + " |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in table_rows(results):
        if row[1].startswith("raw "):
            row = [row[0], f"*{row[1]}* (baseline)", *row[2:]]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def bytes_lines(results: list[StoreResult]) -> list[str]:
    lines = []
    for result in results:
        info = result.bytes_per_key
        if not info:
            continue
        if result.target == "redis":
            lines.append(
                f"Redis: {info['bytes']} bytes per completed key (MEMORY USAGE, median of "
                f"{info['samples']} keys; {info['encoding']} hash, key name "
                f"{info['key_chars']} characters, 64-character fingerprint, no result)"
            )
        elif result.target == "postgresql":
            lines.append(
                f"PostgreSQL: {info['bytes']} bytes per mark (pg_total_relation_size / rows "
                f"after {info['rows']:,} marks: heap {info['heap_bytes']} + indexes "
                f"{info['index_bytes']}; 64-character fingerprint, no result)"
            )
    return lines


def command_line() -> str:
    python = Path(sys.executable)
    try:
        shown = str(python.relative_to(REPO)) if python.is_relative_to(REPO) else str(python)
    except ValueError:
        shown = str(python)
    script = Path(sys.argv[0]).resolve()
    script_text = str(script.relative_to(REPO)) if script.is_relative_to(REPO) else sys.argv[0]
    return shlex.join([shown, script_text, *sys.argv[1:]])


def machine(results: list[StoreResult], load: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = [r.version for r in results if r.target != "memory"]
    start, end = load
    return (
        f"nproc {os.cpu_count()} ({cpu}), Python {platform.python_version()}"
        + "".join(f", {v}" for v in versions)
        + f"; load average (1/5/15 min) {' '.join(f'{x:.2f}' for x in start)} at the start, "
        f"{' '.join(f'{x:.2f}' for x in end)} at the end"
    )


def interpretation(results: list[StoreResult]) -> str:
    found = {(r.target, o.op): o for r in results for o in r.ops}
    by_store = {r.target: r for r in results}
    parts: list[str] = []
    verdicts = []
    for (store, op), limit in AIMS.items():
        if (store, op) in found:
            ratio = found[store, op].ratio
            verdicts.append(
                f"{LABELS[store]} {op} {ratio:.2f}× (aim ≤ {limit}×: "
                f"{'met' if ratio <= limit else 'missed'})"
            )
    if verdicts:
        parts.append("Against the aims: " + "; ".join(verdicts) + ".")
    redis_ops = [found[("redis", op)] for op in ("claim", "complete") if ("redis", op) in found]
    if len(redis_ops) == 2:
        claim, complete = redis_ops
        base = claim.paired_baseline

        def split(op: OpResult) -> str:
            extra = op.stat.median_us - op.paired_baseline.median_us
            cpu = op.stat.cpu_median_us - op.paired_baseline.cpu_median_us
            return (
                f"{op.op} {extra:+.0f} µs, of which {cpu:+.0f} µs client CPU and "
                f"{extra - cpu:+.0f} µs waiting on Redis"
            )

        trips = (
            f"{fmt_trips(claim.trips)} round trip each"
            if claim.trips == complete.trips
            else f"{fmt_trips(claim.trips)} and {fmt_trips(complete.trips)} round trips"
        )
        parts.append(
            f"A Redis claim and a complete are {trips}, like the raw SET: one EVALSHA each. "
            "The claim of a new key's script reads the hash (HMGET) and the server clock "
            "(TIME, for the lease's end) and writes one HSET and a relative PEXPIRE; the "
            "complete's reads the hash and writes HDEL, HSET and PEXPIRE, without the clock. "
            f"Beside the raw SET ({split(claim)}; {split(complete)}), the store spends less "
            "client CPU, since it writes its scripts down a connection it keeps instead of "
            "through redis-py's command path, and its wait on Redis includes the script's run "
            "on the server (a Lua call costs more than a plain command). The raw SET itself "
            "is mostly "
            f"client CPU ({base.cpu_median_us:.0f} of {base.median_us:.0f} µs), so these "
            "ratios fall when the client is slower and rise when it is faster; 1.3× leaves "
            f"{0.3 * base.median_us:.0f} µs for everything a claim does beyond a SET."
        )
    sql = [s for s in SQL_STORES if s in by_store]
    if sql:
        claims = ", ".join(
            f"{LABELS[s]} {found[s, 'claim'].ratio:.2f}×" for s in sql if (s, "claim") in found
        )
        dups = ", ".join(
            f"{LABELS[s]} {found[s, 'duplicate'].ratio:.2f}× in "
            f"{fmt_trips(found[s, 'duplicate'].trips)}"
            for s in sql
            if (s, "duplicate") in found
        )
        parts.append(
            f"A SQL claim of a new key ({claims}) is one INSERT … ON CONFLICT DO NOTHING "
            "(INSERT IGNORE on MariaDB) whose times come from the database clock: the same "
            "round trips as the raw INSERT, and like it bound by the commit's log flush; "
            "complete and release are one fenced UPDATE or DELETE. The duplicate check "
            f"({dups} round trips) is the INSERT that finds the key taken and inserts nothing, "
            "then a SELECT of the record in its way; it writes nothing, so it skips the "
            "commit's log flush that a raw INSERT pays, which offsets part or all of the "
            "extra statement."
        )
    maria = by_store.get("mariadb")
    if maria is not None and maria.baseline_trips is not None and maria.baseline_trips >= 1.5:
        parts.append(
            f"On MariaDB every call, the raw INSERT included, costs "
            f"{fmt_trips(maria.baseline_trips)} round trips instead of 1: SQLAlchemy rolls "
            "back an AUTOCOMMIT connection when it goes back to the pool and PyMySQL sends "
            "that ROLLBACK to the server (psycopg skips it on an idle connection), which "
            "raises MariaDB's absolute latencies but not the ratios."
        )
    if "memory" in by_store:
        parts.append(
            "The memory store's figures are Python call overhead against a bare dict insert, "
            "shown for scale only."
        )
    return " ".join(parts)


def section(
    results: list[StoreResult],
    command: str,
    when: datetime.datetime,
    load: tuple[tuple[float, ...], tuple[float, ...]],
    iterations: dict[str, int],
) -> str:
    counts = ", ".join(f"{LABELS[r.target]} {iterations[r.target]}" for r in results)
    lines = [
        SECTION,
        "",
        "Per-operation latency of each store beside the raw minimum of its backend, measured "
        "in the same run through the same client and connection pool: for Redis one "
        "`SET key val NX PX 300000` through the store's own client, for SQL one autocommit "
        "`INSERT` of a row of the same column shape into a scratch table through the store's "
        "own AUTOCOMMIT engine, for memory a dict insert under a lock. `claim` and `mark` "
        "write a new key, `complete` and `release` act on a claim, `duplicate` is a `claim` "
        "of a key that is already marked (what a duplicate delivery costs). Baseline and "
        "operation batches alternate so machine noise hits both alike; *Ratio* is the "
        "operation's median over the median of the baseline batches run beside it "
        "(*Baseline median µs*); *Client CPU µs* is the median CPU time of the benchmark's "
        "thread per call (Python, the driver, socket system calls), so the median minus it "
        "is roughly the wait for the server. Round trips per call are counted in a separate "
        "pass (Redis: commands sent; PostgreSQL and SQLite: statements executed; MariaDB: "
        "the session's "
        f"`Questions` counter). Timed calls per operation: {counts}.",
        "",
        markdown_table(results),
        "",
    ]
    pairs = [p for r in results for p in r.pairs]
    if pairs:
        lines += [
            "One message on Redis: the store's calls for a new message (eager: `claim` + "
            "`complete`; lazy: `get` + `mark`) against the raw calls a hand-written guard "
            "makes instead (`SET key 1 NX PX` before the handler and `SET key done PX` after; "
            "lazy `GET` + `SET PX`), through the same client. Batches of "
            f"{PAIR_BATCH} messages alternate between the two for {PAIR_ROUNDS} rounds (the "
            "order swapped every round); *Client CPU µs* is the process's CPU time per message "
            "(`time.process_time`, the robust figure on a loaded machine), *Wall µs* its wall "
            "time, each the median over the rounds, and the ratios are of those medians. The "
            "server's share is measured on a redis-server that the benchmark starts for it "
            f"alone, over {PAIR_SERVER_CALLS} messages each: *Server commands* counts the "
            "commands the server ran (those a script runs, not the EVALSHA that runs them), "
            "*Server µs* is the `INFO commandstats` usec of what the client sent, *Server CPU "
            "µs* the redis-server process's own CPU time (`/proc/<pid>/stat`: the commands, "
            "the event loop and the socket system calls).",
            "",
            pair_table(pairs),
            "",
        ]
    sizes = bytes_lines(results)
    if sizes:
        lines += ["Bytes per key:", ""]
        lines += [f"- {line}." for line in sizes]
        lines.append("")
    lines += [
        "Command:",
        "",
        "```sh",
        command,
        "```",
        "",
        f"Measured {when:%Y-%m-%d %H:%M} UTC on {machine(results, load)}.",
        "",
        interpretation(results),
        "",
    ]
    if pairs:
        lines += [pair_text(pairs), ""]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Per-operation latency of the taskonce stores against the raw minimum "
        "of each backend (see the module docstring)."
    )
    parser.add_argument(
        "--stores",
        default=",".join(STORES),
        help=f"comma-separated subset of {','.join(STORES)} (default: all)",
    )
    parser.add_argument(
        "--iterations",
        type=int,
        help="timed calls per operation (default 2000 for redis and memory, 500 for SQL)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        help="calls per batch before switching between baseline and operation "
        "(default 50 for redis and memory, 20 for SQL)",
    )
    parser.add_argument("--redis-url", default=DEFAULT_URLS["redis"])
    parser.add_argument("--postgresql-url", default=DEFAULT_URLS["postgresql"])
    parser.add_argument("--mariadb-url", default=DEFAULT_URLS["mariadb"])
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help=f"replace the '{SECTION}' section of docs/performance.md with the results",
    )
    args = parser.parse_args(argv)
    chosen = [s.strip().lower() for s in args.stores.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STORES]
    if unknown or not chosen:
        parser.error(f"--stores: unknown {unknown}; choose from {','.join(STORES)}")
    args.stores = [s for s in STORES if s in chosen]
    if args.iterations is not None and args.iterations < 1:
        parser.error("--iterations must be at least 1")
    if args.batch is not None and args.batch < 1:
        parser.error("--batch must be at least 1")
    return args


@dataclasses.dataclass
class Plan:
    iterations: int
    batch: int
    warmup: int


def plan_for(name: str, args: argparse.Namespace) -> Plan:
    sql = name in SQL_STORES
    iterations = args.iterations or (500 if sql else 2000)
    batch = args.batch or (20 if sql else 50)
    warmup = min(iterations, 100 if sql else 300)
    return Plan(iterations, min(batch, iterations), warmup)


def open_target(name: str, args: argparse.Namespace, tmpdir: Path) -> Target:
    if name == "memory":
        return open_memory(args)
    if name == "redis":
        return open_redis(args)
    return open_sql(name, args, tmpdir)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = command_line()
    when = datetime.datetime.now(datetime.timezone.utc)
    load_start = os.getloadavg()
    results: list[StoreResult] = []
    failed: list[str] = []
    iterations: dict[str, int] = {}
    tmpdir = Path(tempfile.mkdtemp(prefix="taskonce-bench-"))
    try:
        for name in args.stores:
            plan = plan_for(name, args)
            iterations[name] = plan.iterations
            print(
                f"{LABELS[name]}: {plan.iterations} calls per operation in batches of "
                f"{plan.batch} after {plan.warmup} warm-up calls …",
                flush=True,
            )
            try:
                target = open_target(name, args, tmpdir)
            except Exception as exc:
                print(f"  {LABELS[name]} could not be opened: {type(exc).__name__}: {exc}")
                failed.append(name)
                continue
            try:
                result = measure(target, plan.iterations, plan.batch, plan.warmup)
                if name == "redis":
                    result.bytes_per_key.update(redis_bytes_per_key(target))
                    result.pairs = measure_pairs(target, PAIR_ROUNDS, PAIR_BATCH)
                elif name == "postgresql":
                    result.bytes_per_key.update(postgres_bytes_per_key(args.postgresql_url))
                results.append(result)
                print(
                    f"  done in {result.elapsed_s:.1f} s ({target.version}; "
                    f"connections in the pool afterwards: {result.connections})",
                    flush=True,
                )
            except Exception:
                traceback.print_exc()
                failed.append(name)
            finally:
                target.cleanup()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    load = (load_start, os.getloadavg())

    print()
    print(plain_table(results))
    print()
    for line in bytes_lines(results):
        print(f"bytes per key: {line}")
    notes = sorted({f"{LABELS[r.target]}: {r.trips_note}" for r in results})
    print("round trips counted as: " + "; ".join(notes))
    print(f"machine: {machine(results, load)}")
    print(f"command: {command}")
    pairs = [p for r in results for p in r.pairs]
    if pairs:
        print()
        print("Redis, one message's calls against the raw calls they replace:")
        print(pair_table(pairs))
        print(pair_text(pairs))
    print()
    print(interpretation(results))

    if failed:
        print(f"\nFAILED: {', '.join(LABELS[f] for f in failed)}", file=sys.stderr)
        if args.write_docs:
            print("docs/performance.md left unchanged (not every store was measured)")
        return 1
    if args.write_docs:
        write_section(section(results, command, when, load, iterations))
        print(f"\nwrote the '{SECTION}' section of {DOC.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
