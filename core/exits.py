"""The ``taskonce`` command's exit statuses and its hints for what is missing.

One rule for every command (:data:`EXIT_CODES` is in ``taskonce --help`` and
docs/operations.md), and the extra that installs a module an ``ImportError`` names.
"""

from __future__ import annotations

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
