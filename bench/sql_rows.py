"""What a remembered message costs an SQL store, and what purging many costs PostgreSQL.

**Bytes per row.** For PostgreSQL, MariaDB and SQLite: ``--rows`` eager messages as a worker
leaves them (a claim with its owner token and worker identity, completed, 64-character
fingerprint, no result), then the table's and each index's size per row: PostgreSQL
``pg_relation_size`` of the heap and each index after ``VACUUM ANALYZE``; MariaDB
``information_schema.TABLES`` (InnoDB pages: data and indexes) after ``ANALYZE TABLE``; SQLite
the ``dbstat`` pages of the table and each index.

**Purge at scale (PostgreSQL).** ``--purge-rows`` expired records written straight into a table
of the store's DDL (``INSERT … SELECT generate_series``), then ``store.purge()`` timed, with:
the WAL it wrote (``pg_current_wal_lsn`` before and after), the most row locks it held at once
and the longest a concurrent claim of a new key waited while it ran (a second connection
claiming every 50 ms), and the table's size before, after, and after ``VACUUM`` (bloat: what a
delete leaves until vacuum; this server runs without autovacuum).

    .venv/bin/python bench/sql_rows.py [--rows 20000] [--purge-rows 1000000] [--write-docs]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as h

from taskonce.stores import open_store

URLS = {
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test",
}
#: The guard's fingerprint now (96 bits, 24 hex digits) and before this change (64).
FINGERPRINTS = {"after": "f" * 24, "before": "f" * 64}
FINGERPRINT = FINGERPRINTS["after"]
WORKER = "host-name.example/4026531836/12345/987654"


def fill(store: Any, rows: int, fingerprint: str = FINGERPRINT) -> None:
    """``rows`` eager messages, claimed and completed as a worker leaves them."""
    for _ in range(rows):
        key = f"payments:{uuid.uuid4()}"
        owner = secrets.token_hex(16)
        store.claim(key, owner, 300, 7 * 86400, fingerprint, WORKER)
        store.complete(key, owner, 7 * 86400, None)


def sizes(family: str, store: Any, table: str) -> dict[str, int]:
    """Bytes of the table and of each of its indexes."""
    engine = store.engine
    with engine.connect() as connection:
        if family == "postgresql":
            connection.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                f"VACUUM ANALYZE {table}"
            )
            found = {
                "table": connection.exec_driver_sql(
                    f"SELECT pg_relation_size('{table}')"
                ).scalar_one()
            }
            for name, size in connection.exec_driver_sql(
                "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) "
                f"FROM pg_index WHERE indrelid = '{table}'::regclass"
            ):
                found[name] = size
            return found
        if family == "mariadb":
            connection.exec_driver_sql(f"ANALYZE TABLE {table}")
            data, index = connection.exec_driver_sql(
                "SELECT data_length, index_length FROM information_schema.tables "
                f"WHERE table_schema = DATABASE() AND table_name = '{table}'"
            ).one()
            return {"table (clustered on the key)": int(data), "secondary indexes": int(index)}
        return _sqlite_sizes(connection, table)


def _sqlite_sizes(connection: Any, table: str) -> dict[str, int]:
    rows = connection.exec_driver_sql("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").all()
    names = {
        str(n)
        for (n,) in connection.exec_driver_sql(
            "SELECT name FROM sqlite_master WHERE tbl_name = ?", (table,)
        )
    }
    return {str(name): int(size) for name, size in rows if name in names}


def bytes_per_row(family: str, rows: int, tmp: Path, layout: str) -> list[tuple[str, ...]]:
    """The table's and its indexes' bytes per row; ``layout`` ``before`` rebuilds what this
    change trimmed: the relay's index over every row, and 64-digit fingerprints."""
    table = f"bench_rows_{secrets.token_hex(4)}"
    url = URLS.get(family) or f"sqlite:///{tmp}/rows-{layout}.db"
    store: Any = open_store(url, table=table)
    try:
        store.create_tables()
        if layout == "before" and family != "mariadb":  # MariaDB's index was never partial
            index = f"ix_{table}_sends_at"
            with store.engine.begin() as connection:
                connection.exec_driver_sql(f"DROP INDEX {index}")
                connection.exec_driver_sql(f"CREATE INDEX {index} ON {table} (sends_at)")
        fill(store, rows, FINGERPRINTS[layout])
        found = sizes(family, store, table)
    finally:
        with store.engine.begin() as connection:
            for name in (table, f"{table}_live"):
                connection.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
        store.close()
    total = sum(found.values())
    parts = ", ".join(
        f"{name.replace(table, 'keys')} {size / rows:.0f}" for name, size in found.items()
    )
    return [(family, layout, f"{total / rows:.0f}", parts)]


# -- purge at scale ---------------------------------------------------------------------------


def expired_table(store: Any, table: str, rows: int) -> None:
    """``rows`` records that expired an hour ago, written by the database in batches."""
    batch = 1_000_000
    with store.engine.begin() as connection:
        for start in range(0, rows, batch):
            count = min(batch, rows - start)
            connection.exec_driver_sql(
                f"INSERT INTO {table} (key, status, owner, fingerprint, created_at, lease_until, "
                "expires_at, worker) SELECT 'payments:' || md5(g::text), 'completed', "
                f"md5((g + 1)::text), '{FINGERPRINT}', extract(epoch from now()) - 86400, "
                "extract(epoch from now()) - 86000, extract(epoch from now()) - 3600 - g / 1000.0, "
                f"'{WORKER}' FROM generate_series({start}, {start + count - 1}) AS g"
            )


def purge_at_scale(rows: int) -> tuple[list[tuple[str, str]], str]:
    table = f"bench_purge_{secrets.token_hex(4)}"
    store: Any = open_store(URLS["postgresql"], table=table)
    other: Any = open_store(URLS["postgresql"], table=table)
    try:
        store.create_tables()
        started = time.monotonic()
        expired_table(store, table, rows)
        with store.engine.connect() as connection:
            connection.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                f"VACUUM ANALYZE {table}"
            )
        fill_s = time.monotonic() - started
        engine = store.engine

        def scalar(sql: str) -> Any:
            with engine.connect() as connection:
                return connection.exec_driver_sql(sql).scalar_one()

        size_before = scalar(f"SELECT pg_total_relation_size('{table}')")
        lsn_before = scalar("SELECT pg_current_wal_lsn()::text")
        done = threading.Event()
        waits: list[float] = []
        most_locks = [0.0]

        def claims() -> None:
            while not done.is_set():
                began = time.perf_counter()
                key = f"payments:{uuid.uuid4()}"
                other.claim(key, secrets.token_hex(16), 300, 3600, None, WORKER)
                waits.append(time.perf_counter() - began)
                # Row locks live in the rows, not in pg_locks: what a purge holds is one batch's
                # rows for as long as its transaction runs, sampled here.
                held = scalar(
                    "SELECT coalesce(max(extract(epoch FROM clock_timestamp() - xact_start)), 0) "
                    "FROM pg_stat_activity WHERE query LIKE 'DELETE FROM%%' AND state = 'active'"
                )
                most_locks[0] = max(most_locks[0], float(held))
                done.wait(0.05)

        watcher = threading.Thread(target=claims)
        watcher.start()
        began = time.monotonic()
        deleted = store.purge()
        purge_s = time.monotonic() - began
        done.set()
        watcher.join()
        wal = scalar(f"SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '{lsn_before}')")
        size_after = scalar(f"SELECT pg_total_relation_size('{table}')")
        dead = scalar(f"SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = '{table}'")
        with engine.connect() as connection:
            connection.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                f"VACUUM {table}"
            )
        size_vacuumed = scalar(f"SELECT pg_total_relation_size('{table}')")
    finally:
        with store.engine.begin() as connection:
            for name in (table, f"{table}_live"):
                connection.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
        store.close()
        other.close()
    mb = 1024 * 1024
    rows_out = [
        ("expired rows purged", f"{deleted:,} (written in {fill_s:.0f} s)"),
        ("purge time", f"{purge_s:.1f} s ({deleted / purge_s:,.0f} rows/s)"),
        ("WAL written", f"{wal / mb:,.0f} MB ({wal / max(deleted, 1):.0f} B per row)"),
        (
            "rows locked at once; the longest a batch's transaction was seen",
            f"at most one batch (1,000); {most_locks[0] * 1e3:.0f} ms",
        ),
        (
            "a concurrent claim's wait (median / max)",
            f"{statistics.median(waits) * 1e3:.1f} / {max(waits) * 1e3:.0f} ms"
            f" over {len(waits)} claims",
        ),
        ("table + indexes before", f"{size_before / mb:,.0f} MB"),
        ("after the purge (dead rows)", f"{size_after / mb:,.0f} MB ({dead:,} dead)"),
        ("after VACUUM (reusable, not returned)", f"{size_vacuumed / mb:,.0f} MB"),
    ]
    return rows_out, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--purge-rows", type=int, default=1_000_000, help="0: no purge")
    parser.add_argument("--families", default="postgresql,mariadb,sqlite")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    import tempfile

    command = h.command_line("bench/sql_rows.py")
    if args.rows:
        load_start = h.loadavg()
        with tempfile.TemporaryDirectory() as tmp:
            rows: list[tuple[str, ...]] = []
            for family in args.families.split(","):
                for layout in ("before", "after"):
                    rows += bytes_per_row(family, args.rows, Path(tmp), layout)
        header = ("store", "layout", "bytes per row", "table and each index, per row")
        text = h.table(header, rows, "llrl") + "\n\n" + h.measured_line(command, load_start)
        print(text)
        if args.write_docs:
            h.write_block("sql-rows", text)
    if args.purge_rows:
        load_start = h.loadavg()
        purge, _ = purge_at_scale(args.purge_rows)
        text = h.table(("taskonce purge, PostgreSQL", "measured"), purge, "lr")
        text += "\n\n" + h.measured_line(command, load_start)
        print(text)
        if args.write_docs:
            h.write_block("sql-purge", text)


if __name__ == "__main__":
    main()
