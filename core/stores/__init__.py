"""Stores and :func:`open_store`, which picks one from a URL."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

from taskonce.errors import ConfigError
from taskonce.stores.base import (
    MAX_KEY_LENGTH,
    Awaiting,
    Claim,
    ClaimOutcome,
    DueForRelay,
    ReceiptLease,
    Record,
    Seen,
    SendLease,
    Status,
    Store,
)
from taskonce.stores.memory import MemoryStore

SUPPORTED_SCHEMES = (
    "memory://",
    "redis://",
    "rediss://",
    "unix://",
    "redis+sentinel://",
    "redis+cluster://",
    "sqlite:///",
    "postgresql[+driver]://",
    "mysql[+driver]://",
    "mariadb[+driver]://",
    "django://ALIAS",
)


def redact(url: str) -> str:
    """``url`` with any password (in the authority or a ``password=`` query parameter)
    replaced by ``***``, for logs and error messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.password is None and "password=" not in parts.query.lower():
        return url  # nothing to hide; urlunsplit would also drop the empty authority of file URLs
    if parts.password is not None:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        parts = parts._replace(netloc=netloc)
    if parts.query:
        query = [
            (name, "***" if name.lower() == "password" else value)
            for name, value in parse_qsl(parts.query, keep_blank_values=True)
        ]
        parts = parts._replace(query=urlencode(query, safe="*"))
    return parts.geturl()


def open_store(url: str, **options: Any) -> Store:
    """Open the store a URL names.

    ``memory://`` → :class:`MemoryStore`; ``redis://``, ``rediss://``, ``unix://``,
    ``redis+sentinel://``, ``redis+cluster://`` → :class:`~taskonce.stores.redis.RedisStore`;
    ``sqlite:///``, ``postgresql+psycopg://``, ``mysql+pymysql://`` (any SQLAlchemy URL of
    those dialects) →
    :class:`~taskonce.stores.sql.SQLStore`; ``django://ALIAS`` (in a Django project) →
    :class:`~taskonce.django_ext.DjangoStore`. ``options`` go to the store's constructor.

    The URL's query string takes taskonce's own options (``prefix`` for Redis, ``table`` for
    SQL) and the driver's, passed through; any other name raises :class:`ConfigError` here,
    before anything connects (the options table is in the documentation's stores page).
    A store whose driver is not installed is a :class:`ConfigError` naming the extra to install
    (``pip install 'taskonce[redis]'`` / ``'taskonce[sql]'``) and, for a driver the extra does
    not install (``postgresql+psycopg2://``), the URL form that uses the one it does.
    """
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(
            f"store URL {redact(str(url))!r} is not a URL; "
            f"supported: {', '.join(SUPPORTED_SCHEMES)}"
        )
    scheme = url.split("://", 1)[0].lower()
    base = scheme.split("+", 1)[0]
    if base == "memory":
        return MemoryStore(**options)
    if base in ("redis", "rediss", "unix"):
        try:
            from taskonce.stores.redis import RedisStore
        except ImportError as exc:  # its message names the extra
            raise ConfigError(f"store URL {redact(url)!r}: {exc}") from None
        return RedisStore(url, **options)
    if base in ("sqlite", "postgresql", "postgres", "mysql", "mariadb"):
        try:
            from taskonce.stores.sql import SQLStore
        except ImportError as exc:  # its message names the extra; a missing driver is
            # SQLStore's ConfigError, naming the extra and the URL form it supports
            raise ConfigError(f"store URL {redact(url)!r}: {exc}") from None
        return SQLStore(url, **options)
    if base == "django":
        try:
            from taskonce.django_ext.store import DjangoStore
        except ImportError as exc:
            raise ConfigError(
                f"store URL {redact(url)!r} needs Django: pip install 'taskonce[django]' ({exc})"
            ) from None
        if options:
            raise ConfigError(f"store URL {redact(url)!r} takes no options, got {sorted(options)}")
        return DjangoStore.from_url(url)
    raise ConfigError(
        f"unknown store URL scheme {scheme!r} in {redact(url)!r}; "
        f"supported: {', '.join(SUPPORTED_SCHEMES)}"
    )


__all__ = [
    "MAX_KEY_LENGTH",
    "SUPPORTED_SCHEMES",
    "Awaiting",
    "Claim",
    "ClaimOutcome",
    "DueForRelay",
    "MemoryStore",
    "ReceiptLease",
    "Record",
    "Seen",
    "SendLease",
    "Status",
    "Store",
    "open_store",
    "redact",
]
