"""How the Redis store connects: its URL forms (``redis://``, ``rediss://`` with TLS,
``unix://``, ``redis+sentinel://``, ``redis+cluster://``) and their query options, the client
each opens, a caller's client described without its password, and the clients' locks renewed
in a forked child.

Fork safety: redis-py's ``ConnectionPool`` remembers the pid that created it and, on every
``get_connection``/``release``/``disconnect``, ``ConnectionPool._checkpid()`` compares it with
``os.getpid()``; in a forked child it calls ``reset()`` and opens fresh sockets, and
``Connection.disconnect()`` only shuts a socket down in the process that opened it (checked in
the installed redis-py 8.1 source, ``redis/connection.py``). A store opened in a Celery or
Dramatiq parent therefore works in every child without sharing a socket; what a child needs is
fresh locks (:func:`unlock_pool`, :func:`unlock_cluster`).
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import weakref
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode

import redis
import redis.cluster
import redis.connection
import redis.exceptions
import redis.sentinel
from redis.backoff import NoBackoff
from redis.retry import Retry

from taskonce.errors import ConfigError, StoreUnavailable
from taskonce.stores import redact
from taskonce.stores.options import check_names, own_value, single_values
from taskonce.stores.redis.wire import UNAVAILABLE

DEFAULT_URL = "redis://127.0.0.1:6379/0"
SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "redis+sentinel")


def safe_url(url: str) -> str:
    """``url`` without secrets: :func:`taskonce.stores.redact` for the user-info part, plus a
    ``password`` query parameter (``unix:///run/redis.sock?password=…``) masked too."""
    redacted: str = redact(url)
    head, mark, tail = redacted.partition("?")
    query, hash_mark, fragment = tail.partition("#")
    pairs = parse_qsl(query, keep_blank_values=True)
    if not mark or not any(name.lower() == "password" for name, _ in pairs):
        return redacted
    masked = [(name, "***" if name.lower() == "password" else val) for name, val in pairs]
    # Rebuilt by hand: urlunsplit would turn "unix:///path" into "unix:/path".
    return f"{head}?{urlencode(masked, safe='*/')}{hash_mark}{fragment}"


def open_client(url: str, safe: str, socket_timeout: float) -> redis.Redis:
    """The client for ``url`` (``safe``: the URL without secrets, for messages).

    The client retries a command once, at once, after a connection error (a pooled connection
    that a Redis restart closed) but never after a timeout: a command that timed out may have
    run, and running a claim twice would make it look taken."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(
            f"RedisStore url {safe!r} is not a redis://, rediss://, unix://, "
            "redis+sentinel:// or redis+cluster:// URL"
        )
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise ConfigError(
            f"RedisStore url {safe!r} has scheme {scheme!r}; expected one of "
            f"{', '.join(s + '://' for s in SCHEMES)}"
        )
    try:
        if scheme == "redis+cluster":
            # RedisCluster has the same command methods the store calls (not a subclass).
            return cast(redis.Redis, open_cluster(url, safe, socket_timeout))
        if scheme == "redis+sentinel":
            return open_sentinel(url, safe, socket_timeout)
        return redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
        )
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        # redis-py's messages can quote the URL's query string; name only the redacted URL.
        raise ConfigError(f"RedisStore url {safe!r} is invalid ({type(exc).__name__})") from None


def open_cluster(url: str, safe: str, socket_timeout: float) -> Any:
    """A :class:`redis.cluster.RedisCluster` for ``redis+cluster://[auth@]host:port,…``.

    redis-py retries a cluster command after a connection error *or a timeout* by default;
    a claim that timed out may have run, and running it again would make the key look taken
    (by the same delivery), so the client this store opens never retries: the call fails
    with StoreUnavailable and the message comes back (``fail_closed``). Redirections after
    a resharding (MOVED/ASK) are followed all the same."""
    auth, hosts, path, query = split_multi_host(url, safe)
    if path not in ("", "/", "/0"):
        raise ConfigError(
            f"RedisStore url {safe!r}: a Redis Cluster has only database 0; the URL names {path!r}"
        )
    kwargs: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_timeout,
    }
    kwargs.update(url_kwargs(auth, "0", query))  # the URL's own timeouts win, as from_url
    kwargs.pop("db", None)
    nodes = [
        redis.cluster.ClusterNode(host, port)  # type: ignore[no-untyped-call]
        for host, port in hosts
    ]
    try:
        return redis.cluster.RedisCluster(
            startup_nodes=nodes, retry=Retry(NoBackoff(), 0), **kwargs
        )
    except redis.exceptions.RedisClusterException as exc:
        # Opening a cluster client asks the nodes for the slot map: none answered.
        raise StoreUnavailable(
            f"Redis store {safe} did not answer: none of the cluster nodes "
            f"{', '.join(f'{h}:{p}' for h, p in hosts)} could be reached ({exc})"
        ) from None
    except UNAVAILABLE as exc:
        raise StoreUnavailable(
            f"Redis store {safe} did not answer: {type(exc).__name__}: {exc}"
        ) from None


def open_sentinel(url: str, safe: str, socket_timeout: float) -> redis.Redis:
    """The master of ``redis+sentinel://[auth@]host:port,…/service_name[/db]`` through
    :class:`redis.sentinel.Sentinel`. The password (if any) is the master's and replicas';
    the sentinels are asked without one. Every new connection asks the sentinels where the
    master is, so after a failover the store reaches the promoted replica; a call in flight
    when the master died fails with StoreUnavailable (nothing is retried: it may have run)."""
    auth, hosts, path, query = split_multi_host(url, safe)
    parts = [part for part in path.split("/") if part]
    if not parts or len(parts) > 2:
        raise ConfigError(
            f"RedisStore url {safe!r}: a Sentinel URL names the service after the "
            "hosts: redis+sentinel://host:port[,host:port…]/service_name[/db]"
        )
    service, db = parts[0], (parts[1] if len(parts) > 1 else "0")
    if not db.isdigit():
        raise ConfigError(
            f"RedisStore url {safe!r}: the database after the service name must be "
            f"a number, got {db!r}"
        )
    timeouts = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_timeout}
    kwargs: dict[str, Any] = {**timeouts, **url_kwargs(auth, db, query)}
    sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        hosts, sentinel_kwargs=timeouts, **timeouts
    )
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        service, retry=Retry(NoBackoff(), 0), **kwargs
    )
    return client


def describe_client(client: redis.Redis) -> str:
    """A URL-like name of a caller's client, built without its password."""
    try:
        kwargs = client.connection_pool.connection_kwargs
    except AttributeError:
        return f"<{type(client).__name__}>"
    db = kwargs.get("db", 0)
    if kwargs.get("path"):
        return f"unix://{kwargs['path']}?db={db}"
    tls = "SSL" in getattr(client.connection_pool, "connection_class", type).__name__
    host, port = kwargs.get("host", "localhost"), kwargs.get("port", 6379)
    return f"{'rediss' if tls else 'redis'}://{host}:{port}/{db}"


# -- query options ---------------------------------------------------------------------------

# Connection parameters that take Python objects (callbacks, classes, retry policies, exception
# lists, socket constants), which a URL's text cannot give: redis-py would take the name and
# fail on the first connection, or misread the text (``retry_on_error`` becomes a list of
# letters).
_NOT_FROM_TEXT = frozenset(
    {
        "retry_on_error",
        "socket_type",
        "command_packer",
        "credential_provider",
        "driver_info",
        "event_dispatcher",
        "himport_registry",
        "maint_notifications_config",
        "maint_notifications_pool_handler",
        "maintenance_notification_hash",
        "maintenance_state",
        "orig_host_address",
        "orig_socket_connect_timeout",
        "orig_socket_timeout",
        "oss_cluster_maint_notifications_handler",
        "parser_class",
        "redis_connect_func",
        "retry",
        "socket_keepalive_options",
        "ssl_ocsp_context",
    }
)

_CONNECTION_CLASSES: dict[str, type[Any]] = {
    "redis": redis.connection.Connection,
    "rediss": redis.connection.SSLConnection,
    "unix": redis.connection.UnixDomainSocketConnection,
}


@functools.cache
def _driver_options(scheme: str) -> frozenset[str]:
    """The query options redis-py's ``from_url`` can hand to the connection of ``scheme``: the named
    parameters of its ``__init__`` and of the bases it passes ``**kwargs`` on to, plus the
    pool's ``max_connections``; the same set that decides whether redis-py raises TypeError."""
    names = {"max_connections"}
    for cls in _CONNECTION_CLASSES[scheme].__mro__:
        if "__init__" not in vars(cls):
            continue
        parameters = inspect.signature(vars(cls)["__init__"]).parameters.values()
        names.update(
            p.name
            for p in parameters
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        )
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return frozenset(names - _NOT_FROM_TEXT)


_PLAIN = _driver_options("redis")


def split_multi_host(url: str, safe: str) -> tuple[str, list[tuple[str, int]], str, str]:
    """``scheme://[auth@]host:port[,host:port…]/path?query`` as (auth, hosts, path, query);
    ConfigError for a host without a port number or none at all."""
    rest = url.split("://", 1)[1]
    rest, _, query = rest.partition("?")
    query = query.partition("#")[0]
    netloc, slash, path = rest.partition("/")
    auth, at, hostlist = netloc.rpartition("@")
    hosts: list[tuple[str, int]] = []
    for item in hostlist.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                f"RedisStore url {safe!r}: {item.strip()!r} is not host:port (list the nodes "
                "as host:port,host:port…)"
            )
        hosts.append((host.strip("[]"), int(port)))
    return (auth if at else ""), hosts, slash + path, query


def url_kwargs(auth: str, db: str, query: str) -> dict[str, Any]:
    """redis-py's connection keywords for a URL's user-info, database and query options,
    typed the way ``Redis.from_url`` types them (without host and port)."""
    text = f"redis://{auth + '@' if auth else ''}localhost/{db}{'?' + query if query else ''}"
    kwargs: dict[str, Any] = redis.connection.parse_url(text)  # type: ignore[no-untyped-call]
    kwargs.pop("host", None)
    kwargs.pop("port", None)
    return kwargs


def replicas(from_url: str | None, given: int | None) -> int:
    """The ``min_replicas`` option (URL or argument, not two different values), checked."""
    text = own_value(
        "RedisStore", "min_replicas", from_url, None if given is None else str(given), "0"
    )
    if isinstance(given, bool) or not text.isdigit():
        raise ConfigError(
            f"RedisStore min_replicas must be a whole number of replicas (0: off), got {text!r}"
        )
    return int(text)


def take_own_options(url: str) -> tuple[str, str | None, str | None]:
    """``url`` without its ``prefix`` and ``min_replicas`` query options, and their values;
    ConfigError for a query option that neither taskonce nor redis-py takes. URLs of other
    schemes are returned unchanged (:func:`open_client` refuses them)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    head, mark, tail = url.partition("?")
    if scheme in ("redis+cluster", "redis+sentinel"):
        scheme = "redis"  # options of each node's plain connection
    if scheme not in _CONNECTION_CLASSES or not mark:
        return url, None, None
    query, hash_mark, fragment = tail.partition("#")
    safe = safe_url(url)
    pairs = parse_qsl(query, keep_blank_values=True)
    values = single_values("RedisStore", safe, pairs)
    if scheme == "redis":
        tls = sorted(set(values) & (_driver_options("rediss") - _PLAIN))
        if tls:
            raise ConfigError(
                f"RedisStore url {safe!r}: query option {tls[0]!r} is a TLS option; "
                "TLS needs a rediss:// URL"
            )
    check_names(
        "RedisStore",
        safe,
        values,
        own=("prefix", "min_replicas"),
        driver=f"redis-py ({scheme}://)",
        accepted=_driver_options(scheme),
    )
    prefix = values.pop("prefix", None)
    min_replicas = values.pop("min_replicas", None)
    rest = f"?{urlencode(list(values.items()))}" if values else ""
    return f"{head}{rest}{hash_mark}{fragment}", prefix, min_replicas


# -- fork safety -----------------------------------------------------------------------------


def unlock_pool(client: Any) -> None:
    """Give a forked child's copy of redis-py's pool fresh locks.

    A thread of the parent (the liveness writer, a heartbeat, a Dramatiq worker thread) may hold
    the pool's ``_lock`` or ``_fork_lock`` at the moment another thread forks; that thread does
    not exist in the child, so the copied lock is never released and the child's first command
    (its ``reset()`` after the pid check takes ``_lock``) would wait for ever. Nothing else in
    the child can hold them yet: this runs before any of its threads."""
    pool = getattr(client, "connection_pool", None)
    for name in ("_lock", "_fork_lock"):
        old = getattr(pool, name, None)
        if old is not None and hasattr(old, "acquire"):
            setattr(
                pool, name, threading.RLock() if "RLock" in type(old).__name__ else threading.Lock()
            )


def unlock_cluster(client: Any) -> None:
    """:func:`unlock_pool` for a cluster client: its own lock, its node manager's two (the
    client and the manager may share one: they keep sharing its replacement) and every node's
    pool. redis-py's per-node pools check their pid and reconnect in the child, as a plain
    client's do."""
    fresh: dict[int, Any] = {}
    manager = getattr(client, "nodes_manager", None)
    for owner, name in ((client, "_lock"), (manager, "_lock"), (manager, "_initialization_lock")):
        old = getattr(owner, name, None)
        if old is None or not hasattr(old, "acquire"):
            continue
        if id(old) not in fresh:
            fresh[id(old)] = (
                threading.RLock() if "RLock" in type(old).__name__ else threading.Lock()
            )
        setattr(owner, name, fresh[id(old)])
    for node in list(getattr(manager, "nodes_cache", {}).values()):
        if node.redis_connection is not None:
            unlock_pool(node.redis_connection)


# Cluster clients the Redis stores opened or were given, unlocked in a forked child before any
# of its threads runs (plain clients are unlocked with their shared-trips line: trips.py).
_CLUSTER_CLIENTS: weakref.WeakSet[Any] = weakref.WeakSet()


def track_cluster(client: Any) -> None:
    """Unlock ``client`` (a cluster client) in every forked child."""
    _CLUSTER_CLIENTS.add(client)


def _unlock_clusters_after_fork() -> None:
    for client in list(_CLUSTER_CLIENTS):
        unlock_cluster(client)


os.register_at_fork(after_in_child=_unlock_clusters_after_fork)


__all__ = [
    "DEFAULT_URL",
    "SCHEMES",
    "describe_client",
    "open_client",
    "replicas",
    "safe_url",
    "take_own_options",
    "track_cluster",
    "unlock_cluster",
    "unlock_pool",
]
