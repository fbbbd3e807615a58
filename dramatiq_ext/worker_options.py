"""The middleware's keyword arguments as the core's :class:`~taskonce.worker_options.WorkerOptions`.

``IdempotencyMiddleware(relay_every=…, start_timeout=…, store_error_min_backoff=…,
store_error_max_backoff=…)``: seconds for the first two, milliseconds for the back-off (as
Dramatiq's own ``min_backoff``/``max_backoff``). A keyword left out keeps the default's value
(``settings.TASKONCE``'s, for :class:`taskonce.django_ext.IdempotencyMiddleware`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from taskonce.checks import check_count
from taskonce.worker_options import WorkerOptions

#: Each keyword's field of :class:`WorkerOptions`.
FIELDS = {
    "relay_every": "relay_every",
    "start_timeout": "start_timeout",
    "store_error_min_backoff": "backoff_first",
    "store_error_max_backoff": "backoff_cap",
}
#: The keywords in milliseconds: whole numbers, as Dramatiq's own back-off.
MILLISECONDS = frozenset({"store_error_min_backoff", "store_error_max_backoff"})


def worker_options(keywords: Mapping[str, object], default: WorkerOptions) -> WorkerOptions:
    """``default`` with the keywords given (not None) in its place, each named as written:
    ``IdempotencyMiddleware(relay_every=-1) must be a number of seconds, 0 or more``."""
    values: dict[str, object] = {}
    names = dict(default.names)
    for keyword, value in keywords.items():
        if value is None:
            continue
        name = f"IdempotencyMiddleware({keyword}=…)"
        if keyword in MILLISECONDS:
            value = check_count(name, value, unit="milliseconds") / 1000
        values[FIELDS[keyword]] = value
        names[FIELDS[keyword]] = name
    return dataclasses.replace(default, **values, names=names)  # type: ignore[arg-type]


__all__ = ["worker_options"]
