"""The SQL store: :class:`SQLStore` (``from taskonce.stores.sql import SQLStore``) and
:func:`init_db` (``taskonce init-db``).

A package of files with one job each:

- :mod:`.store`: :class:`SQLStore`, the store contract on one table (its own statements in
  autocommit);
- :mod:`.transactional`: the transactional extension (the caller's transaction: the
  transactional mode, the producer outbox);
- :mod:`.receipts`: the receipts part (the relay's lease on awaited receipts, their write-back,
  the receivers' records, the relay's work in one statement);
- :mod:`.schema`: the tables, their creation and migration, a row read as a record;
- :mod:`.statements`: the statements, built by small builders;
- :mod:`.connecting`: URLs and driver checks, engines, fork handling.
"""

from __future__ import annotations

try:
    import sqlalchemy  # noqa: F401 - checked here, before any module of the package needs it
except ImportError as _exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "the SQL store needs SQLAlchemy 2 and a driver: pip install 'taskonce[sql]'"
    ) from _exc

from taskonce.stores.sql.schema import DEFAULT_TABLE
from taskonce.stores.sql.store import SQLStore, init_db

__all__ = ["DEFAULT_TABLE", "SQLStore", "init_db"]
