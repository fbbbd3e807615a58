"""Where the Redis store keeps things: the Redis name of a record, of a worker's liveness
record and of the sends and receipts indexes, on one server and on a cluster (the buckets' slot
tags).

On Redis Cluster (``redis+cluster://``) every key one script touches must hash to one slot, and
the record and the sends index are touched together. One index for the whole store would put
every record in its slot (one node doing all the work: no cluster at all), and moving the index
writes out of the scripts would let a crash between the two writes lose a record from the relay's
sight. So the store is cut into :data:`CLUSTER_BUCKETS` buckets, each with its own hash tag and
its own index: a record lives at ``f"{{{prefix}/{n}}}:{key}"`` and its bucket's index at
``f"{{{prefix}/{n}}}!sends"``, where the bucket is ``crc32(key) % CLUSTER_BUCKETS`` and ``n``
is picked so that the buckets' slots are spread evenly over the 16384 slots (so over the
masters). A record and its index always move together in a resharding. The receipts index
(records awaiting their receipts, scored by due time) is the bucket's too, at
``f"{{{prefix}/{n}}}!receipts"``, so one script reads a bucket's two indexes.
"""

from __future__ import annotations

import functools
import re
import zlib

# Buckets of a cluster store: enough that the records spread over a few dozen masters, few
# enough that a relay sweep reads every bucket's index at once.
CLUSTER_BUCKETS = 64
_SLOTS = 16384

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def glob_escape(text: str) -> str:
    """``text`` with SCAN's glob characters escaped."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


@functools.cache
def bucket_tags(prefix: str) -> tuple[str, ...]:
    """The hash tag of each bucket: ``f"{prefix}/{n}"`` with the first ``n`` whose slot lies in
    the bucket's share of the slot range, so the buckets are spread evenly over the masters
    (``redis-cli --cluster create`` gives each master one contiguous range)."""
    from redis.crc import key_slot

    tags = []
    n = 0
    for bucket in range(CLUSTER_BUCKETS):
        low, high = bucket * _SLOTS // CLUSTER_BUCKETS, (bucket + 1) * _SLOTS // CLUSTER_BUCKETS
        n = 0
        while not low <= key_slot(f"{prefix}/{n}".encode()) < high:
            n += 1
        tags.append(f"{prefix}/{n}")
    return tuple(tags)


class Names:
    """The Redis names of one store's keys.

    :param prefix: the store's prefix.
    :param cluster: whether the store is on Redis Cluster (records in hash-tagged buckets).
    """

    def __init__(self, prefix: str, cluster: bool) -> None:
        self.prefix = prefix
        self.cluster = cluster
        self.tags: tuple[str, ...] = bucket_tags(prefix) if cluster else ()
        self._index = f"{prefix}!sends"
        self._receipts = f"{prefix}!receipts"

    def _tag(self, key: str) -> str:
        return self.tags[zlib.crc32(key.encode("utf-8")) % CLUSTER_BUCKETS]

    def record(self, key: str) -> str:
        """The Redis name of ``key``'s record."""
        if self.cluster:
            return f"{{{self._tag(key)}}}:{key}"
        return f"{self.prefix}:{key}"

    def index_of(self, key: str) -> str:
        """The sends index of ``key``'s record: in the same hash slot on a cluster."""
        if self.cluster:
            return f"{{{self._tag(key)}}}!sends"
        return self._index

    def indexes(self) -> list[str]:
        """Every sends index of the store (one per bucket on a cluster)."""
        if self.cluster:
            return [f"{{{tag}}}!sends" for tag in self.tags]
        return [self._index]

    def receipts_of(self, key: str) -> str:
        """The receipts index of ``key``'s record: in the same hash slot on a cluster."""
        if self.cluster:
            return f"{{{self._tag(key)}}}!receipts"
        return self._receipts

    def buckets(self) -> list[tuple[str, str, str]]:
        """Each bucket's ``(record name prefix, sends index, receipts index)``: one on a single
        server. A record's name is its prefix and its key, as the indexes list it."""
        if self.cluster:
            return [(f"{{{tag}}}:", f"{{{tag}}}!sends", f"{{{tag}}}!receipts") for tag in self.tags]
        return [(f"{self.prefix}:", self._index, self._receipts)]

    def pattern(self, key_prefix: str = "") -> str:
        """The SCAN pattern of this store's records whose key starts with ``key_prefix``."""
        escaped = glob_escape(key_prefix)
        if self.cluster:
            return "{" + glob_escape(self.prefix) + "/*}:" + escaped + "*"
        return glob_escape(self.prefix) + ":" + escaped + "*"

    def key_of(self, name: str) -> str:
        """The key of a record's Redis name (the inverse of :meth:`record`)."""
        if self.cluster:
            return name.partition("}:")[2]
        return name[len(self.prefix) + 1 :]

    @staticmethod
    def live_key(worker: str) -> str:
        """The key (before :meth:`record`) of ``worker``'s liveness record: under the same
        prefix (so removing a prefix's keys removes these too), in a sub-namespace that the
        guard's keys (``queue:id``) do not use."""
        return f"~live:{worker}"


__all__ = ["CLUSTER_BUCKETS", "Names", "bucket_tags", "glob_escape"]
