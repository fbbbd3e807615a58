"""The version bridges (``taskonce.stores.redis.compat``, ``taskonce.stores.sql.compat``): each
chooses by what the installed release accepts. The matrix (tools/matrix.py) runs the stores on
the oldest and newest releases for real; these tests pin down both branches on any release."""

from __future__ import annotations

from typing import Any

from taskonce.stores.redis import compat as redis_compat
from taskonce.stores.sql import compat as sql_compat


class OldPool:
    """redis-py 5.0-5.2's form: the command name is required (and ignored)."""

    def get_connection(self, command_name: str, *keys: Any, **options: Any) -> str:
        return f"old:{command_name}"


class NewPool:
    """redis-py 5.3+'s form: no argument (one given is deprecated)."""

    def get_connection(self, command_name: str | None = None, *keys: Any, **options: Any) -> str:
        assert command_name is None, "a command name is deprecated here"
        return "new"


def test_pool_connection_passes_a_command_name_only_where_required() -> None:
    assert redis_compat.pool_connection(OldPool()) == "old:EVALSHA"
    assert redis_compat.pool_connection(NewPool()) == "new"


def test_the_installed_redis_pool_gives_a_connection() -> None:
    import redis

    pool = redis.ConnectionPool(host="127.0.0.1", port=6379)
    try:
        conn = redis_compat.pool_connection(pool)  # no connect happens until a command
        assert isinstance(conn, redis.Connection)
        pool.release(conn)
    finally:
        pool.disconnect()


def test_no_rollback_on_return_uses_what_sqlalchemy_takes(monkeypatch: Any) -> None:
    options: dict[str, Any] = {}
    monkeypatch.setattr(sql_compat, "_skips_autocommit_rollback", lambda: True)
    sql_compat.no_rollback_on_return(options)
    assert options == {"skip_autocommit_rollback": True}

    options = {}
    monkeypatch.setattr(sql_compat, "_skips_autocommit_rollback", lambda: False)
    sql_compat.no_rollback_on_return(options)
    assert options == {"pool_reset_on_return": None}

    options = {"pool_reset_on_return": "rollback"}  # the caller's own choice is kept
    sql_compat.no_rollback_on_return(options)
    assert options == {"pool_reset_on_return": "rollback"}
