"""Exit statuses: the ``taskonce`` command's, its hints for what is missing, and a worker's
refusal to start.

One rule for every command (:data:`EXIT_CODES` is in ``taskonce --help`` and
docs/operations.md), the extra that installs a module an ``ImportError`` names, and
:func:`refuse_start`, with which the Celery and Dramatiq adapters stop a worker whose
configuration can never work.
"""

from __future__ import annotations

import logging
from typing import NoReturn

#: Exit status of a worker stopped by a configuration error or a store that does not answer at
#: its start (``EX_CONFIG`` of sysexits.h); Celery's and the ``dramatiq`` command exit with it.
EXIT_CONFIG = 78


def refuse_start(exc: Exception, log: logging.Logger) -> NoReturn:
    """Stop a starting worker in one line on ``log``, with :data:`EXIT_CONFIG`, before it
    consumes anything. ``SystemExit`` is no ``Exception``: Celery's signals and Dramatiq's hooks,
    which log and swallow those, let it through, and both commands exit with its code."""
    log.critical("taskonce: %s; the worker does not start", exc)
    raise SystemExit(EXIT_CONFIG) from exc


# Exit statuses, the same for every command (EXIT_CODES is in --help and docs/operations.md).
EXIT_OK = 0  # done
EXIT_NOT_FOUND = 1  # ran, and the answer is "not there": no live record for KEY
EXIT_ERROR = 2  # could not run as asked: usage, configuration, store unreachable
EXIT_BUG = 70  # an unexpected error (sysexits' EX_SOFTWARE): its traceback is on stderr
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_CODES = f"""\
exit status, the same for every command:
  {EXIT_OK:<4} done (purge and relay too when there was nothing to do)
  {EXIT_NOT_FOUND:<4} not there: inspect/release found no live record for KEY (the
       live keys it may have meant are suggested); audit --fail-on-leak
       found a problem; the demo's exactly-once check failed
  {EXIT_ERROR:<4} could not run as asked, said in one line on stderr: bad arguments,
       a store URL or option refused, a missing extra (pip install
       'taskonce[sql]'), no store at that path, the store did not answer
  {EXIT_BUG:<4} an unexpected error (its traceback on stderr)
  {EXIT_INTERRUPTED:<4} interrupted (Ctrl-C); relay, which runs until stopped, exits 0

Store keys are QUEUE:ID (e.g. celery:<task id>), or the message id alone with
identity="id"; inspect/release --queue QUEUE ID build the first form."""


#: The extra that installs each optional top-level module.
_EXTRAS = {
    "redis": "redis",
    "sqlalchemy": "sql",
    "psycopg": "sql",
    "pymysql": "sql",
    "celery": "celery",
    "kombu": "celery",
    "dramatiq": "dramatiq",
    "pika": "dramatiq",
    "pyspark": "spark",
    "prometheus_client": "prometheus",
    "opentelemetry": "otel",
}


def extra_hint(exc: ImportError) -> str:
    """Which extra installs the module ``exc`` misses (``taskonce[all]`` only when unknown)."""
    top = (exc.name or "").partition(".")[0]
    extra = _EXTRAS.get(top)
    if extra is None:
        return "install the matching extra, e.g. pip install 'taskonce[all]'"
    return f"it comes with the {extra!r} extra: pip install 'taskonce[{extra}]'"
