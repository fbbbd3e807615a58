"""Run a framework's own test suite twice, without and with taskonce, and compare.

:mod:`tools.celery_canvas` (Celery's canvas integration tests, ``IdempotentTask`` as the task
class) and :mod:`tools.dramatiq_suite` (Dramatiq's ``tests/``, ``IdempotencyMiddleware`` on
every broker) use :mod:`tools.upstream.common`; what reaches into the frameworks' test
processes lives in ``tools/upstream/site`` (put first on ``PYTHONPATH``). See CONTRIBUTING.md.
"""
