"""Per-operation latency of every taskonce store, beside the raw minimum of its backend.

For each store (memory, Redis, PostgreSQL, MariaDB, SQLite): ``claim`` (a new key),
``complete`` and ``release`` (of a claim), ``mark`` (a new key) and ``duplicate`` (a ``claim``
of a marked key), each beside the raw minimum measured in the same run through the same client
and pool: Redis one ``SET key val NX PX 300000`` through ``store.client``; SQL one autocommit
``INSERT`` into a scratch table of the same DDL through ``store.engine``; memory a dict insert
under a lock. Baseline and operation batches alternate; each ratio is the operation's median
over the median of the baseline batches run beside it. Round trips are counted in a separate
pass (Redis: commands written to a connection; PostgreSQL and SQLite: statements executed;
MariaDB: the session's ``Questions``).

Redis also gets one message's pair of calls (eager claim + complete, lazy get + mark) against
the raw pair a hand-written guard sends, with the server's share on a redis-server of its own;
and bytes per key (Redis ``MEMORY USAGE``, PostgreSQL relation size after 10,000 marks).

    .venv/bin/python bench/store_ops.py [--stores redis,postgresql] [--iterations 5000]
        [--write-docs]

Everything it creates is removed afterwards. ``taskonce bench`` runs this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import math
import secrets
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `taskonce bench` runs it by runpy
import harness as h

from taskonce.stores import ClaimOutcome, MemoryStore, Store, open_store

STORES = ("memory", "redis", "postgresql", "mariadb", "sqlite")
SQL_STORES = ("postgresql", "mariadb", "sqlite")
URLS = {
    "redis": "redis://127.0.0.1:6379/15",
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test",
}
LABELS = dict(zip(STORES, ("memory", "Redis", "PostgreSQL", "MariaDB", "SQLite"), strict=True))
#: (store, op) → the largest acceptable ratio of its median over the raw baseline's.
AIMS = {
    ("redis", "claim"): 1.3,
    ("redis", "complete"): 1.3,
    ("postgresql", "claim"): 1.5,
    ("mariadb", "claim"): 1.5,
    ("sqlite", "claim"): 1.5,
}
PAIR_AIM, PAIR_ROUNDS, PAIR_BATCH, PAIR_SERVER_CALLS = 1.1, 15, 200, 2000
LEASE, KEEP_FOR = 300.0, 7 * 86400.0
KEEP_MS = round(KEEP_FOR * 1000)
FINGERPRINT = hashlib.sha256(b"taskonce bench payload").hexdigest()  # 64 characters
OWNER, OTHER_OWNER = secrets.token_hex(16), secrets.token_hex(16)
WORKER = "bench-host/4026531836/12345/67890"  # a worker identity as long as a real one
QUEUE = "default"


def fresh_keys(n: int) -> list[str]:
    """Store keys as the guard makes them (identity ``id+queue``: ``queue:message id``)."""
    return [f"{QUEUE}:{uuid.uuid4()}" for _ in range(n)]


@dataclasses.dataclass
class Target:
    """One store under test, with the raw write it is compared with."""

    name: str
    store: Store
    raw: Callable[[str], object]
    raw_keys: Callable[[int], list[str]]
    raw_label: str
    version: str
    count_trips: Callable[[Callable[[str], object], list[str]], float] | None = None
    prefix: str = ""  # Redis: the store's prefix, its records at `<prefix>:<key>`
    cleanups: list[Callable[[], object]] = dataclasses.field(default_factory=list)

    def cleanup(self) -> None:
        for fn in reversed(self.cleanups):
            try:
                fn()
            except Exception as exc:  # keep cleaning the rest
                print(f"  cleanup of {self.name} failed: {type(exc).__name__}: {exc}")


def open_memory(_args: argparse.Namespace, _tmp: Path) -> Target:
    lock, scratch = threading.Lock(), {}

    def raw(key: str) -> None:
        with lock:
            scratch[key] = FINGERPRINT

    store = MemoryStore()
    target = Target("memory", store, raw, fresh_keys, "dict insert under a lock", "")
    target.cleanups.append(store.close)
    return target


def count_commands(fn: Callable[[str], object], keys: list[str]) -> float:
    with h.counted_writes() as count:
        for key in keys:
            fn(key)
    return count[0] / len(keys)


def open_redis(args: argparse.Namespace, _tmp: Path) -> Target:
    prefix = f"bench-{secrets.token_hex(4)}"
    store: Any = open_store(args.redis_url, prefix=prefix)
    client = store.client
    version = f"Redis {client.info('server')['redis_version']}"
    raw = lambda key: client.set(key, "1", nx=True, px=300000)  # noqa: E731
    raw_keys = lambda n: [f"{prefix}:raw:{uuid.uuid4()}" for _ in range(n)]  # noqa: E731
    cleanups = [store.close, lambda: h.drop_keys(client, prefix)]
    return Target(
        "redis", store, raw, raw_keys, "SET NX PX", version, count_commands, prefix, cleanups
    )


def drop_tables(engine: Any, marker: str) -> None:
    """Drop the tables whose names contain ``marker`` (this run's random suffix)."""
    import sqlalchemy as sa

    meta = sa.MetaData()
    meta.reflect(engine, only=lambda name, _meta: marker in name)
    meta.drop_all(engine)


def open_sql(name: str, args: argparse.Namespace, tmp: Path) -> Target:
    import sqlalchemy as sa

    url = f"sqlite:///{tmp / 'bench.db'}" if name == "sqlite" else getattr(args, f"{name}_url")
    suffix = secrets.token_hex(4)
    store: Any = open_store(url, table=f"bench_ops_{suffix}")
    engine = store.engine  # the store's AUTOCOMMIT engine
    target = Target(name, store, lambda k: None, fresh_keys, "autocommit INSERT", "")
    target.cleanups += [store.close, lambda: drop_tables(engine, suffix)]
    store.create_tables()
    # the scratch table: made by a second store, so its DDL is exactly a store table's
    scratch_store: Any = open_store(url, table=f"bench_raw_{suffix}")
    scratch_store.create_tables()
    scratch_store.close()
    insert = sa.insert(sa.Table(f"bench_raw_{suffix}", sa.MetaData(), autoload_with=engine))

    def raw(key: str) -> None:
        now = time.time()
        row = {"key": key, "status": "completed", "owner": None, "fingerprint": FINGERPRINT}
        row |= {"result": None, "created_at": now, "lease_until": 0.0, "expires_at": now + KEEP_FOR}
        with engine.connect() as connection:
            connection.execute(insert, row)

    def statements(fn: Callable[[str], object], keys: list[str]) -> float:
        calls = [0]

        def before(*_a: Any, **_kw: Any) -> None:
            calls[0] += 1

        sa.event.listen(engine, "before_cursor_execute", before)
        try:
            for key in keys:
                fn(key)
        finally:
            sa.event.remove(engine, "before_cursor_execute", before)
        return calls[0] / len(keys)

    def questions() -> int:
        with engine.connect() as connection:
            return int(connection.exec_driver_sql("SHOW SESSION STATUS LIKE 'Questions'").one()[1])

    def questions_per_call(fn: Callable[[str], object], keys: list[str]) -> float:
        start = questions()
        overhead = questions() - start  # the SHOW itself and the ROLLBACK after it
        before = questions()
        for key in keys:
            fn(key)
        return (questions() - before - overhead) / len(keys)

    with engine.connect() as connection:
        if name == "postgresql":
            version = "PostgreSQL " + str(
                connection.exec_driver_sql("SHOW server_version").scalar()
            )
        elif name == "mariadb":
            version = "MariaDB " + str(connection.exec_driver_sql("SELECT VERSION()").scalar())
        else:
            version = f"SQLite {sqlite3.sqlite_version}"
    target.raw, target.version = raw, version
    target.count_trips = questions_per_call if name == "mariadb" else statements
    return target


# -- operations -------------------------------------------------------------------------------


def operations(
    store: Store,
) -> dict[
    str, tuple[Callable[[str], object] | None, Callable[[str], object], Callable[[object], bool]]
]:
    """Per operation: (setup of its key, the timed call, the expected result)."""

    def claim(key: str, owner: str = OWNER) -> object:
        return store.claim(key, owner, LEASE, KEEP_FOR, FINGERPRINT).outcome

    def mark(key: str) -> object:
        return store.mark(key, KEEP_FOR, FINGERPRINT, None)

    is_none = lambda r: r is None  # noqa: E731
    return {
        "claim": (None, claim, lambda r: r is ClaimOutcome.CLAIMED),
        "complete": (claim, lambda k: store.complete(k, OWNER, KEEP_FOR, None), is_none),
        "release": (claim, lambda k: store.release(k, OWNER), is_none),
        "mark": (None, mark, lambda r: r is True),
        "duplicate": (mark, lambda k: claim(k, OTHER_OWNER), lambda r: r is ClaimOutcome.EXISTS),
    }


Sample = tuple[int, int]  # one call: (wall ns, this thread's CPU ns)


def timed(fn: Callable[[str], object], keys: list[str], out: list[Sample]) -> list[object]:
    results, clock, cpu_clock = [], time.perf_counter_ns, time.thread_time_ns
    for key in keys:
        c0, t0 = cpu_clock(), clock()
        results.append(fn(key))
        t1, c1 = clock(), cpu_clock()
        out.append((t1 - t0, c1 - c0))
    return results


def run_rounds(
    target: Target, iterations: int, batch: int
) -> dict[str, tuple[list[Sample], list[Sample]]]:
    """Per operation: its samples and the baseline's batches run beside them; the operations'
    order rotates every round, the baseline goes first in every other batch."""
    ops = operations(target.store)
    samples: dict[str, tuple[list[Sample], list[Sample]]] = {name: ([], []) for name in ops}
    names = list(ops)
    for round_no in range(math.ceil(iterations / batch)):
        size = min(batch, iterations - round_no * batch)
        shift = round_no % len(names)
        gc.collect()
        for index, name in enumerate(names[shift:] + names[:shift]):
            setup, call, ok = ops[name]
            keys, raw_keys = fresh_keys(size), target.raw_keys(size)
            for key in keys if setup else ():
                setup(key)
            mine, base = samples[name]
            if (round_no + index) % 2 == 0:
                timed(target.raw, raw_keys, base)
            results = timed(call, keys, mine)
            if (round_no + index) % 2:
                timed(target.raw, raw_keys, base)
            if not all(map(ok, results)):
                raise RuntimeError(f"{target.name} {name}: unexpected result {results[0]!r}")
    return samples


@dataclasses.dataclass
class Stat:
    median_us: float
    p99_us: float
    cpu_us: float


def stat(samples: list[Sample]) -> Stat:
    walls = sorted(wall for wall, _ in samples)
    p99 = walls[max(0, math.ceil(0.99 * len(walls)) - 1)]
    cpu = statistics.median(cpu for _, cpu in samples)
    return Stat(statistics.median(walls) / 1000, p99 / 1000, cpu / 1000)


def measure(target: Target, iterations: int, batch: int, warmup: int) -> list[list[str]]:
    """The store's rows of the table: its baseline, then each operation."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        run_rounds(target, warmup, batch)
        samples = run_rounds(target, iterations, batch)
    finally:
        if was_enabled:
            gc.enable()
    trips: dict[str, str] = {}
    for name, (setup, call, _) in operations(target.store).items():
        keys = fresh_keys(20)
        for key in keys if setup else ():
            setup(key)
        trips[name] = fmt_trips(target.count_trips(call, keys) if target.count_trips else None)
    if target.count_trips:
        trips["raw"] = fmt_trips(target.count_trips(target.raw, target.raw_keys(20)))
    label = LABELS[target.name]
    base = stat([s for _, paired in samples.values() for s in paired])
    rows = [
        [
            label,
            f"*raw {target.raw_label}* (baseline)",
            trips.get("raw", "—"),
            *us(base),
            "",
            "1.00",
            "",
        ]
    ]
    for name, (mine, paired) in samples.items():
        own, beside = stat(mine), stat(paired)
        ratio = own.median_us / beside.median_us
        limit = AIMS.get((target.name, name))
        aim = f"≤ {limit}× {'met' if ratio <= limit else 'MISSED'}" if limit else ""
        rows.append(
            [label, name, trips[name], *us(own), f"{beside.median_us:.1f}", f"{ratio:.2f}", aim]
        )
    return rows


def us(s: Stat) -> list[str]:
    return [f"{s.median_us:.1f}", f"{s.p99_us:.1f}", f"{s.cpu_us:.1f}"]


def fmt_trips(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.0f}" if abs(value - round(value)) < 0.05 else f"{value:.2f}"


# -- one message's pair of calls (Redis) ------------------------------------------------------


def pair_calls(
    store: Any, prefix: str
) -> dict[str, tuple[str, str, Callable[[str], object], Callable[[str], object]]]:
    """Per mode: labels, the store's calls for one new message, the raw calls they replace."""
    client = store.client

    def eager(mid: str) -> object:
        key = f"{QUEUE}:{mid}"
        if (
            store.claim(key, OWNER, LEASE, KEEP_FOR, FINGERPRINT, WORKER).outcome
            is not ClaimOutcome.CLAIMED
        ):
            raise RuntimeError(f"claim of a new key {key!r} did not claim")
        return store.complete(key, OWNER, KEEP_FOR, None)

    def raw_eager(mid: str) -> object:
        if not client.set(f"{prefix}:raw:{mid}", "1", nx=True, px=300000):
            raise RuntimeError(f"SET NX of a new key {mid!r} did not set")
        return client.set(f"{prefix}:raw:{mid}", "done", px=KEEP_MS)

    def lazy(mid: str) -> object:
        key = f"{QUEUE}:{mid}"
        if store.get(key) is not None or not store.mark(key, KEEP_FOR, FINGERPRINT, None):
            raise RuntimeError(f"check + mark of a new key {key!r} found it recorded")
        return None

    def raw_lazy(mid: str) -> object:
        if client.get(f"{prefix}:raw:{mid}") is not None:
            raise RuntimeError(f"GET of a new key {mid!r} found it")
        return client.set(f"{prefix}:raw:{mid}", "done", px=KEEP_MS)

    return {
        "eager": ("claim + complete", "`SET NX PX` + `SET PX`", eager, raw_eager),
        "lazy": ("check (`get`) + mark", "`GET` + `SET PX`", lazy, raw_lazy),
    }


def ids(n: int) -> list[str]:
    return [str(uuid.uuid4()) for _ in range(n)]


def measure_pairs(target: Target) -> tuple[list[list[str]], list[str]]:
    """The pair table's rows and its verdicts: client CPU and wall time in interleaved
    batches on the store's client, then the server's share on a redis-server of our own."""
    calls = pair_calls(target.store, target.prefix)
    for _, _, fn, raw in calls.values():  # warm-up
        h.cpu_wall(fn, ids(100)), h.cpu_wall(raw, ids(100))
    got: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for round_no in range(PAIR_ROUNDS):
        for mode, (_, _, fn, raw) in calls.items():
            for side, f in [("store", fn), ("raw", raw)][:: -1 if round_no % 2 else 1]:
                got.setdefault((mode, side), []).append(h.cpu_wall(f, ids(PAIR_BATCH)))
    from taskonce.stores.redis import RedisStore

    server: dict[tuple[str, str], tuple[float, float, float, str]] = {}
    with h.RedisServer() as redis_server:
        store = RedisStore(redis_server.url, prefix="bench")
        meter = h.StoreMeter(store.client, redis_server.pid)
        for mode, (_, _, fn, raw) in pair_calls(store, "bench").items():
            for side, f in (("store", fn), ("raw", raw)):
                h.cpu_wall(f, ids(100))
                before = meter.read()
                h.cpu_wall(f, ids(PAIR_SERVER_CALLS))
                work, n = meter.since(before), PAIR_SERVER_CALLS
                server[mode, side] = (
                    (work.commands - work.scripts) / n,
                    work.usec / n,
                    work.cpu_s * 1e6 / n,
                    work.names(n),
                )
        store.close()
    rows, verdicts = [], []
    for mode, (label, raw_label, _, _) in calls.items():
        cpu, wall = (h.med(s[i] for s in got[mode, "store"]) for i in (0, 1))
        raw_cpu, raw_wall = (h.med(s[i] for s in got[mode, "raw"]) for i in (0, 1))
        ratio = cpu / raw_cpu
        met = "met" if ratio <= PAIR_AIM else "MISSED"
        for side, name, c, w, r, aim in (
            ("store", label, cpu, wall, f"{ratio:.2f}", f"≤ {PAIR_AIM}× {met}"),
            ("raw", f"*raw {raw_label}* (baseline)", raw_cpu, raw_wall, "1.00", ""),
        ):
            commands, usec, server_cpu, names = server[mode, side]
            wall_ratio = w / raw_wall
            rows.append(
                [
                    mode,
                    name,
                    f"{c:.0f}",
                    f"{w:.0f}",
                    r,
                    f"{wall_ratio:.2f}",
                    aim,
                    f"{commands:g}",
                    f"{usec:.1f}",
                    f"{server_cpu:.0f}",
                    names,
                ]
            )
        verdicts.append(
            f"{label} {ratio:.2f}× the client CPU of {raw_label} (aim ≤ {PAIR_AIM}×: "
            f"{met.lower()}), {wall / raw_wall:.2f}× its wall time"
        )
    return rows, verdicts


# -- bytes per key ----------------------------------------------------------------------------


def redis_bytes(target: Target) -> str:
    """MEMORY USAGE of completed keys (the guard's fingerprint, no result), median of 200."""
    from taskonce.keys import fingerprint

    store: Any = target.store
    usages, names = [], []
    fp = fingerprint("bench.task", (1,), {})
    for key in fresh_keys(200):
        store.claim(key, OWNER, LEASE, KEEP_FOR, fp)
        store.complete(key, OWNER, KEEP_FOR, None)
        names.append(f"{target.prefix}:{key}")  # a record lives at `<prefix>:<key>`
        usages.append(int(store.client.memory_usage(names[-1], samples=0)))
    encoding = store.client.object("encoding", names[0])
    encoding = encoding.decode() if isinstance(encoding, bytes) else encoding
    size = int(store.client.strlen(names[0]))
    return (
        f"Redis: {int(statistics.median(usages))} bytes per completed key (MEMORY USAGE, median "
        f"of {len(usages)} keys; a {size}-byte {encoding} string, key name {len(names[0])} "
        f"characters, the guard's {len(fp)}-digit fingerprint, no result)"
    )


def postgres_bytes(url: str, rows: int = 10_000) -> str:
    """pg_total_relation_size (heap, TOAST, indexes) per row after ``rows`` marks."""
    import sqlalchemy as sa

    table = f"bench_size_{secrets.token_hex(4)}"
    store: Any = open_store(url, table=table)
    try:
        store.create_tables()
        for key in fresh_keys(rows):
            if not store.mark(key, KEEP_FOR, FINGERPRINT, None):
                raise RuntimeError(f"mark of the new key {key!r} found a record")
        query = sa.text(
            "SELECT pg_total_relation_size(CAST(:t AS regclass)), "
            "pg_relation_size(CAST(:t AS regclass)), pg_indexes_size(CAST(:t AS regclass))"
        )
        with store.engine.connect() as connection:
            total, heap, index = connection.execute(query, {"t": table}).one()
            count = int(connection.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar_one())
    finally:
        drop_tables(store.engine, table)
        store.close()
    return (
        f"PostgreSQL: {round(total / count)} bytes per mark (pg_total_relation_size / rows after "
        f"{count:,} marks: heap {round(heap / count)} + indexes {round(index / count)}; "
        "64-character fingerprint, no result)"
    )


# -- main -------------------------------------------------------------------------------------

HEADER = "Store|Operation|Round trips|Median µs|p99 µs|Client CPU µs|Baseline median µs|Ratio|Aim"
PAIR_HEADER = (
    "Mode|Per message|Client CPU µs|Wall µs|CPU ratio|Wall ratio|Aim (CPU)|Server commands|"
    "Server µs (commandstats)|Server CPU µs|Commands run"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--stores", default=",".join(STORES), help=f"a subset of {','.join(STORES)}"
    )
    parser.add_argument("--iterations", type=int, help="timed calls per operation (2000; SQL 500)")
    parser.add_argument("--batch", type=int, help="calls per batch (50; SQL 20)")
    for name, url in URLS.items():
        parser.add_argument(f"--{name}-url", default=url)
    parser.add_argument(
        "--write-docs", action="store_true", help="write the block in docs/performance.md"
    )
    args = parser.parse_args(argv)
    chosen = [s.strip().lower() for s in args.stores.split(",") if s.strip()]
    if not chosen or set(chosen) - set(STORES):
        parser.error(f"--stores: choose from {','.join(STORES)}")
    if (args.iterations or 1) < 1 or (args.batch or 1) < 1:
        parser.error("--iterations and --batch must be at least 1")
    args.stores = [s for s in STORES if s in chosen]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command, load_start = h.command_line("bench/store_ops.py", argv), h.loadavg()
    rows: list[list[str]] = []
    pair_rows: list[list[str]] = []
    verdicts: list[str] = []
    sizes, versions, counts, failed = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="taskonce-bench-") as tmp:
        for name in args.stores:
            sql = name in SQL_STORES
            iterations = args.iterations or (500 if sql else 2000)
            batch = min(args.batch or (20 if sql else 50), iterations)
            print(
                f"{LABELS[name]}: {iterations} calls per operation in batches of {batch} …",
                flush=True,
            )
            target = None
            try:
                opener = {"memory": open_memory, "redis": open_redis}.get(name)
                target = opener(args, Path(tmp)) if opener else open_sql(name, args, Path(tmp))
                mine = measure(target, iterations, batch, min(iterations, 100 if sql else 300))
                if name == "redis":
                    sizes.append(redis_bytes(target))
                    pair_rows, pair_verdicts = measure_pairs(target)
                    verdicts += pair_verdicts
                elif name == "postgresql":
                    sizes.append(postgres_bytes(args.postgresql_url))
            except Exception as exc:
                print(f"  {LABELS[name]} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                failed.append(LABELS[name])
                continue
            finally:
                if target is not None:
                    target.cleanup()
            rows += mine
            versions += [target.version] if target.version else []
            counts.append(f"{LABELS[name]} {iterations}")
    aims = [
        f"{r[0]} {r[1]} {r[7]}× (aim {r[8].lower().replace('× ', '×: ')})" for r in rows if r[8]
    ]
    lines = [
        f"Timed calls per operation: {', '.join(counts)}.",
        "",
        h.table(HEADER.split("|"), rows, "llrrrrrrl"),
        "",
    ]
    if pair_rows:
        lines += [h.table(PAIR_HEADER.split("|"), pair_rows, "llrrrrlrrrl"), ""]
    if sizes:
        lines += ["Bytes per key:", "", *(f"- {size}." for size in sizes), ""]
    lines += [
        f"Against the aims: {'; '.join(aims + verdicts)}.",
        "",
        h.measured_line(command, load_start, versions),
    ]
    text = "\n".join(lines)
    print(f"\n{text}")
    if failed:
        print(f"\nFAILED: {', '.join(failed)}; docs/performance.md left unchanged", file=sys.stderr)
        return 1
    if args.write_docs:
        h.write_block("store-ops", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
