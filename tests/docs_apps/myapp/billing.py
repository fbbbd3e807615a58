"""``myapp.billing``: docs/outside-apis.md's Celery task, as the page has it (tests/test_docs.py
checks the lines are the same), run by tests/celery/test_docs_outside_api.py on a real worker
against the fake payments server (``PAYMENTS_URL``)."""

import json
import os
import urllib.request

from myapp.tasks import app

import taskonce
from taskonce.celery_ext import IdempotentTask

PAYMENTS = os.environ.get("PAYMENTS_URL", "https://payments.example.com/v1/charges")


@app.task(base=IdempotentTask)
def charge(order_id: str, cents: int) -> str:
    request = urllib.request.Request(
        PAYMENTS,
        data=json.dumps({"order": order_id, "amount": cents}).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": taskonce.current_key()},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)["id"]
