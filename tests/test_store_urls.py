"""Store URL query options: taskonce's own are applied, the driver's pass through, anything else
is a ConfigError naming the option, raised by open_store before any connection."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

import taskonce
from taskonce.stores.redis import RedisStore
from taskonce.stores.sql import SQLStore
from tests.helpers import MARIADB_URL, POSTGRES_URL, REDIS_URL, drop_store, require_service

# Nothing listens on these: a store that tried to connect would fail with StoreUnavailable,
# so a ConfigError proves the option was refused at open_store.
NOWHERE = {
    "redis": "redis://:hunter2@127.0.0.1:1/9",
    "postgresql": "postgresql+psycopg://postgres:hunter2@127.0.0.1:1/test",
    "mariadb": "mysql+pymysql://root:hunter2@127.0.0.1:1/test",
}


def _suffix() -> str:
    return uuid.uuid4().hex[:10]


def _sql_url(kind: str, tmp_path: Path) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/urls.db"
    require_service(kind)
    return POSTGRES_URL if kind == "postgresql" else MARIADB_URL


def _with(url: str, query: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{query}"


# -- Redis ---------------------------------------------------------------------------------------


def test_redis_prefix_from_the_url_is_applied() -> None:
    require_service("redis")
    prefix = f"u{_suffix()}"
    store = taskonce.open_store(_with(REDIS_URL, f"prefix={prefix}&socket_timeout=2"))
    try:
        assert isinstance(store, RedisStore)
        assert store.mark("k", 60, None, None)
        assert store._client.exists(f"{prefix}:k") == 1
        assert store.stats()["completed"] == 1
        # the driver's own option reached redis-py, taskonce's did not
        kwargs = store._client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 2.0 and "prefix" not in kwargs
        assert store.describe().endswith(f"prefix={prefix}")
    finally:
        drop_store(store)


def test_redis_unknown_option_is_a_config_error_naming_it() -> None:
    with pytest.raises(taskonce.ConfigError) as caught:
        taskonce.open_store(_with(NOWHERE["redis"], "prefx=x"))
    text = str(caught.value)
    assert "unknown query option 'prefx' (did you mean 'prefix'?)" in text
    assert "redis-py (redis://) accepts: " in text and "socket_timeout" in text
    assert "hunter2" not in text and "docs/stores.md" in text


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("ssl_ca_certs=/ca.pem", "query option 'ssl_ca_certs' is a TLS option; TLS needs a rediss"),
        ("retry_on_error=x", "unknown query option 'retry_on_error'"),
        ("prefix=a&prefix=b", "query option 'prefix' is given twice"),
        ("prefix=", "prefix must be a non-empty string without whitespace, got ''"),
        ("db=nine", "is invalid (ValueError)"),
    ],
)
def test_redis_bad_options_are_refused_at_open(query: str, message: str) -> None:
    with pytest.raises(taskonce.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        taskonce.open_store(_with(NOWHERE["redis"], query))


def test_redis_tls_options_are_accepted_on_rediss() -> None:
    store = taskonce.open_store("rediss://127.0.0.1:1/0?ssl_cert_reqs=none&prefix=p")
    assert store.describe() == "RedisStore rediss://127.0.0.1:1/0?ssl_cert_reqs=none prefix=p"
    kwargs = store._client.connection_pool.connection_kwargs  # type: ignore[attr-defined]
    assert kwargs["ssl_cert_reqs"] == "none"
    store.close()


def test_redis_prefix_given_twice_differently_is_refused() -> None:
    with pytest.raises(taskonce.ConfigError, match="prefix is 'a' in the URL but 'b' as an arg"):
        taskonce.open_store("redis://127.0.0.1:1/0?prefix=a", prefix="b")
    store = taskonce.open_store("redis://127.0.0.1:1/0?prefix=a", prefix="a")
    assert store.describe().endswith("prefix=a")
    store.close()


# -- SQL -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "driver_option"),
    [
        ("postgresql", "connect_timeout=3&application_name=taskonce_test"),
        ("mariadb", "read_timeout=20&charset=utf8mb4"),
        ("sqlite", "timeout=3"),
    ],
)
def test_sql_table_from_the_url_is_applied_and_driver_options_pass(
    kind: str, driver_option: str, tmp_path: Path
) -> None:
    table = f"u_{_suffix()}"
    store = taskonce.open_store(_with(_sql_url(kind, tmp_path), f"table={table}&{driver_option}"))
    try:
        assert isinstance(store, SQLStore)
        assert store.mark("k", 60, None, None)
        with store._engine.connect() as connection:
            assert connection.execute(store._table.select()).fetchall()[0].key == "k"
        assert store._table.name == table
        assert f"(table {table})" in store.describe() and "table=" not in store.describe()
        if kind == "postgresql":
            with store._engine.connect() as connection:
                name = connection.exec_driver_sql("SHOW application_name").scalar()
            assert name == "taskonce_test"
    finally:
        drop_store(store)


@pytest.mark.parametrize(
    ("kind", "query", "message"),
    [
        ("postgresql", "tabel=x", "unknown query option 'tabel' (did you mean 'table'?)"),
        ("postgresql", "prefix=x", "unknown query option 'prefix'"),
        ("mariadb", "sslmode=require", "unknown query option 'sslmode'"),
        ("mariadb", "autocommit=1", "query option 'autocommit' cannot be set here"),
        ("mariadb", "read_timeout=soon", "cannot build an engine: invalid literal for int()"),
        ("sqlite", "mode=ro", "'mode' is an SQLite URI option; it needs a URI filename"),
        ("sqlite", "check_same_thread=true", "'check_same_thread' cannot be set here"),
        ("sqlite", "table=a&table=b", "query option 'table' is given twice"),
        ("sqlite", "table=a-b", "table 'a-b' is not a valid table name"),
    ],
)
def test_sql_bad_options_are_refused_at_open(
    kind: str, query: str, message: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path}/never.db" if kind == "sqlite" else NOWHERE[kind]
    with pytest.raises(taskonce.ConfigError) as caught:
        taskonce.open_store(_with(url, query))
    assert message in str(caught.value)
    assert "hunter2" not in str(caught.value)
    assert not (tmp_path / "never.db").exists()


def test_libpq_options_are_checked_against_libpq_itself() -> None:
    with pytest.raises(taskonce.ConfigError) as caught:
        taskonce.open_store(_with(NOWHERE["postgresql"], "table=t&ssl_mode=require"))
    text = str(caught.value)
    assert "unknown query option 'ssl_mode' (did you mean 'sslmode'?)" in text
    assert "libpq accepts: " in text and "sslrootcert" in text


def test_sqlite_uri_options_work_with_a_uri_filename(tmp_path: Path) -> None:
    path = tmp_path / "ro.db"
    writer = taskonce.open_store(f"sqlite:///{path}?table=ro_keys")
    assert writer.mark("k", 60, None, None)
    writer.close()
    reader = taskonce.open_store(f"sqlite:///file:{path}?mode=ro&uri=true&table=ro_keys")
    try:
        record: Any = reader.get("k")
        assert record is not None and record.status.value == "completed"
        with pytest.raises(taskonce.StoreUnavailable, match="readonly"):
            reader.mark("k2", 60, None, None)
    finally:
        reader.close()


def test_sql_table_given_twice_differently_is_refused(tmp_path: Path) -> None:
    with pytest.raises(taskonce.ConfigError, match="table is 'a' in the URL but 'b' as an arg"):
        taskonce.open_store(f"sqlite:///{tmp_path}/x.db?table=a", table="b")


# -- missing drivers: the extra to install, and the URL form it supports -------------------------


@pytest.mark.parametrize(
    ("url", "blocked", "wanted"),
    [
        (
            "postgresql://postgres:hunter2@127.0.0.1:1/test",
            "psycopg",
            "needs psycopg 3, which is not installed (import of psycopg halted; None in "
            "sys.modules): pip install 'taskonce[sql]' (postgresql:// means postgresql+psycopg://)",
        ),
        (
            "postgres://postgres:hunter2@127.0.0.1:1/test",
            "psycopg",
            "pip install 'taskonce[sql]' (postgresql:// means postgresql+psycopg://)",
        ),
        (
            "postgresql+psycopg2://postgres:hunter2@127.0.0.1:1/test",
            "psycopg2",
            "names the psycopg2 driver, which is not installed (import of psycopg2 halted; None "
            "in sys.modules); taskonce's sql extra installs psycopg 3: pip install "
            "'taskonce[sql]' and write the URL as postgresql+psycopg://user:password@host/db",
        ),
        (
            "mariadb://root:hunter2@127.0.0.1:1/test",
            "pymysql",
            "needs PyMySQL, which is not installed (import of pymysql halted; None in "
            "sys.modules): pip install 'taskonce[sql]' (mariadb:// means mariadb+pymysql://)",
        ),
        (
            "mysql+mysqldb://root:hunter2@127.0.0.1:1/test",
            "MySQLdb",
            "names the mysqldb driver, which is not installed (import of MySQLdb halted; None in "
            "sys.modules); taskonce's sql extra installs PyMySQL: pip install 'taskonce[sql]' "
            "and write the URL as mysql+pymysql://user:password@host/db",
        ),
    ],
)
def test_a_missing_sql_driver_names_the_extra_and_the_url_form(
    url: str, blocked: str, wanted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, blocked, None)  # `import <blocked>` raises ImportError
    with pytest.raises(taskonce.ConfigError) as caught:
        taskonce.open_store(url)
    text = str(caught.value)
    assert text.startswith("store URL '") and wanted in text
    assert "hunter2" not in text and ":***@" in text


@pytest.mark.parametrize(
    ("url", "module", "blocked", "wanted"),
    [
        (
            "redis://:hunter2@127.0.0.1:1/0",
            "taskonce.stores.redis",
            "redis",
            "store URL 'redis://:***@127.0.0.1:1/0': the Redis store needs redis-py, which is "
            "not installed (import of redis halted; None in sys.modules): "
            "pip install 'taskonce[redis]'",
        ),
        (
            "sqlite:///never.db",
            "taskonce.stores.sql",
            "sqlalchemy",
            "store URL 'sqlite:///never.db': the SQL store needs SQLAlchemy 2 and a driver: "
            "pip install 'taskonce[sql]'",
        ),
    ],
)
def test_a_missing_store_extra_is_a_config_error_naming_it(
    url: str, module: str, blocked: str, wanted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the store's module imported afresh, without its driver (the original is put back after)
    monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, blocked, None)
    with pytest.raises(taskonce.ConfigError) as caught:
        taskonce.open_store(url)
    assert str(caught.value) == wanted


def test_the_supported_drivers_still_open() -> None:
    for url in (NOWHERE["postgresql"], NOWHERE["mariadb"], "postgresql://u@127.0.0.1:1/db"):
        store = taskonce.open_store(url)  # nothing connects yet
        assert isinstance(store, SQLStore)
        store.close()
