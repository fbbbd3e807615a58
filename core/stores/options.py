"""Query options of store URLs: taskonce's own are taken out, the driver's are checked by name.

A store URL's query string mixes two kinds of option: taskonce's own (``prefix`` for Redis,
``table`` for SQL) and the driver's (redis-py's, libpq's, PyMySQL's, sqlite3's), which are
passed through. A name that belongs to neither is a configuration mistake; left to the driver it
surfaces only on the first connection, looking like an outage (which ``fail_closed`` retries
forever), so the stores refuse it when they are opened.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Mapping

from taskonce.errors import ConfigError

#: Where the options are documented for users.
DOCS = "docs/stores.md"


def check_names(
    store: str,
    url: str,
    names: Iterable[str],
    *,
    own: Collection[str],
    driver: str,
    accepted: Collection[str] | None,
    managed: Mapping[str, str] | None = None,
) -> None:
    """Raise :class:`ConfigError` naming the first of ``names`` that is not an option.

    :param store: the store's name for the message (``RedisStore``).
    :param url: the URL, already redacted.
    :param own: taskonce's own options of this store.
    :param driver: who takes the other options (``redis-py``), for the message.
    :param accepted: the driver's option names, or None when they cannot be known (an
        unfamiliar driver): then anything not ``managed`` passes through unchecked.
    :param managed: options the store sets itself, with the reason a URL may not set them.
    """
    managed = managed or {}
    for name in names:
        if name in managed:
            raise ConfigError(
                f"{store} url {url!r}: query option {name!r} cannot be set here: "
                f"{managed[name]} (see {DOCS})"
            )
        if name in own or accepted is None or name in accepted:
            continue
        choices = sorted({*own, *accepted} - set(managed))
        close = difflib.get_close_matches(name, choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{store} url {url!r}: unknown query option {name!r}{hint}; taskonce's own: "
            f"{', '.join(sorted(own))}; {driver} accepts: {', '.join(sorted(set(accepted)))} "
            f"(see {DOCS})"
        )


def single_values(store: str, url: str, pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """``pairs`` as a dict; :class:`ConfigError` when a name is given twice (a driver would
    silently keep one of them)."""
    values: dict[str, str] = {}
    for name, value in pairs:
        if name in values:
            raise ConfigError(f"{store} url {url!r}: query option {name!r} is given twice")
        values[name] = value
    return values


def own_value(store: str, name: str, from_url: str | None, given: str | None, default: str) -> str:
    """The value of taskonce option ``name``: from the URL or the keyword argument (the same
    value in both is fine, two different ones are a :class:`ConfigError`), else ``default``."""
    if from_url is not None and given is not None and from_url != given:
        raise ConfigError(
            f"{store}: {name} is {from_url!r} in the URL but {given!r} as an argument; give it once"
        )
    if from_url is not None:
        return from_url
    return default if given is None else given


__all__ = ["DOCS", "check_names", "own_value", "single_values"]
