"""The differences between the redis-py releases the Redis store supports (5.0 and later),
bridged here and nowhere else.

- ``ConnectionPool.get_connection()``: redis-py 5.0 to 5.2 require a command name (which they
  ignore); 5.3 and later take none and warn when given one. :func:`pool_connection` passes one
  only where the installed pool requires it, found by looking at the method's signature once,
  not at the version number.
"""

from __future__ import annotations

import inspect
from typing import Any

#: Pool class → whether its ``get_connection`` requires a command name (read once per class).
_NEEDS_COMMAND_NAME: dict[Any, bool] = {}


def _needs_command_name(pool_type: Any) -> bool:
    """Whether ``pool_type.get_connection`` has a required first argument (redis-py < 5.3)."""
    known = _NEEDS_COMMAND_NAME.get(pool_type)
    if known is None:
        known = _NEEDS_COMMAND_NAME[pool_type] = _reads_command_name(pool_type)
    return known


def _reads_command_name(pool_type: Any) -> bool:
    """:func:`_needs_command_name`, uncached."""
    try:
        parameters = list(inspect.signature(pool_type.get_connection).parameters.values())
    except (TypeError, ValueError):  # no signature to read: assume today's form
        return False
    # parameters[0] is ``self`` (read from the class, the method is a plain function).
    return (
        len(parameters) > 1
        and parameters[1].kind
        in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        and parameters[1].default is inspect.Parameter.empty
    )


def pool_connection(pool: Any) -> Any:
    """A connection checked out of ``pool`` (a redis-py ``ConnectionPool`` or a subclass),
    on every supported redis-py release. The store sends only EVALSHA down it."""
    if _needs_command_name(type(pool)):
        return pool.get_connection("EVALSHA")
    return pool.get_connection()
