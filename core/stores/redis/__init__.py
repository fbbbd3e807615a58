"""The Redis store: :class:`RedisStore` (``from taskonce.stores.redis import RedisStore``).

A package of files with one job each:

- :mod:`.store`: :class:`RedisStore`, the store contract on Redis (one round trip per operation);
- :mod:`.layout`: the record, a packed string, and how it is read back;
- :mod:`.scripts` and ``lua/``: the Lua scripts, one full file each, read once;
- :mod:`.trips`: the transport, round trips shared by the threads of a process;
- :mod:`.connecting`: URLs, Sentinel, Cluster and TLS set-up, the clients' fork safety;
- :mod:`.names`: where records live (cluster buckets and their slot tags);
- :mod:`.wire`: durations and replies on the wire, errors that mean "cannot answer".
"""

from __future__ import annotations

try:
    import redis  # noqa: F401 - checked here, before any module of the package needs it
except ImportError as _exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"the Redis store needs redis-py, which is not installed ({_exc}): "
        "pip install 'taskonce[redis]'",
        name=_exc.name,
    ) from _exc

from taskonce.stores.redis.store import RedisStore
from taskonce.stores.redis.trips import NotReplicated

__all__ = ["NotReplicated", "RedisStore"]
