"""The differences between the SQLAlchemy releases the SQL store supports (2.0.28 and later),
bridged here and nowhere else.

- ``skip_autocommit_rollback`` (SQLAlchemy 2.0.43): the pool's reset-on-return ROLLBACK is a
  round trip on PyMySQL even in autocommit mode. Older releases refuse the option; there
  :func:`no_rollback_on_return` asks for ``pool_reset_on_return=None`` instead, which skips
  the same ROLLBACK: the store's autocommit engine never leaves a transaction open on a
  connection it returns. Found by looking at the dialect's arguments, not the version number.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from sqlalchemy.engine.default import DefaultDialect


@functools.lru_cache(maxsize=1)
def _skips_autocommit_rollback() -> bool:
    """Whether this SQLAlchemy's dialects take ``skip_autocommit_rollback``."""
    return "skip_autocommit_rollback" in inspect.signature(DefaultDialect.__init__).parameters


def no_rollback_on_return(options: dict[str, Any]) -> None:
    """Set in ``options`` (an autocommit engine's ``create_engine`` keyword arguments) what
    keeps the pool from sending ROLLBACK when a connection goes back to it, unless the caller
    set it already."""
    if _skips_autocommit_rollback():
        options.setdefault("skip_autocommit_rollback", True)
    elif "skip_autocommit_rollback" not in options:
        options.setdefault("pool_reset_on_return", None)
