"""docs/celery.md's *Try it: send a duplicate*, as the page has it (tests/test_docs.py checks the
lines are the same): run by tests/celery/test_docs_duplicate.py next to a real worker of
``myapp.tasks``, with ``tests/docs_apps`` on ``PYTHONPATH``."""

from myapp.tasks import charge  # your app's module, with a worker consuming its queue

charge.apply_async(("A-1", 500), task_id="order-A-1")
charge.apply_async(("A-1", 500), task_id="order-A-1")  # skipped
