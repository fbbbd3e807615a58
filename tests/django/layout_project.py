"""A Django project written out as a new user lays one out (Celery's Django layout, the
docs' page): ``manage.py``, ``proj/settings.py``, ``proj/celery.py`` doing
``setup(app, taskonce.django_ext.guard())`` and imported from ``proj/__init__.py``, and a
``shop`` app (``Order``, ``Payment``, the guarded task ``shop.tasks.charge`` and a checkout
view that sends it in ``send_on_commit()``). SQLite in the project's folder, Celery's
in-memory broker unless told otherwise. Its commands run in subprocesses with the project's
folder as their working directory, as a user's shell has it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MANAGE = """\
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
"""

#: INIT and CELERY are docs/django.md's Celery example, line for line (tests/test_docs.py).
INIT = """\
from .celery import app as celery_app

__all__ = ("celery_app",)
"""

CELERY = """\
import os

from celery import Celery

import taskonce.django_ext
from taskonce.celery_ext import setup

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
setup(app, taskonce.django_ext.guard())
"""

SETTINGS = """\
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "layout-tests-only"
DEBUG = True
ALLOWED_HOSTS = ["*"]
USE_TZ = True
ROOT_URLCONF = "proj.urls"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "db.sqlite3"}}}}
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "taskonce.django_ext",
    "shop",
]
CELERY_BROKER_URL = {broker!r}
TASKONCE = {taskonce}
"""

URLS = """\
from django.urls import path

from shop import views

urlpatterns = [path("checkout/", views.checkout)]
"""

MODELS = """\
from django.db import models


class Order(models.Model):
    ref = models.CharField(max_length=40, unique=True)
    paid = models.BooleanField(default=False)


class Payment(models.Model):
    order = models.ForeignKey(Order, on_delete=models.CASCADE)
    cents = models.IntegerField()
"""

TASKS = """\
from celery import shared_task

from taskonce.celery_ext import IdempotentTask

from .models import Order, Payment


@shared_task(base=IdempotentTask, acks_late=True, reject_on_worker_lost=True)
def charge(order_id):
    Order.objects.filter(pk=order_id).update(paid=True)
    Payment.objects.create(order_id=order_id, cents=500)
"""

VIEWS = """\
from django.db import transaction
from django.http import JsonResponse

from taskonce.django_ext import send_on_commit

from .models import Order
from .tasks import charge


def checkout(request):
    with transaction.atomic(), send_on_commit():
        order = Order.objects.create(ref=request.POST["ref"])
        charge.delay(order.pk)
    return JsonResponse({"order": order.pk})
"""

#: The project's settings.TASKONCE when a test gives none.
VALID = '{"STORE": "django://default", "DEFAULT": {"mode": "eager", "transactional": True}}'


def write_project(
    folder: Path, taskonce: str = VALID, broker: str = "memory://", tests: str = ""
) -> Path:
    """The project in ``folder`` with ``TASKONCE = <taskonce>`` (Python source) and
    ``shop/tests.py`` = ``tests``; returns ``folder``."""
    files = {
        "manage.py": MANAGE,
        "proj/__init__.py": INIT,
        "proj/celery.py": CELERY,
        "proj/settings.py": SETTINGS.format(broker=broker, taskonce=taskonce),
        "proj/urls.py": URLS,
        "shop/__init__.py": "",
        "shop/models.py": MODELS,
        "shop/tasks.py": TASKS,
        "shop/views.py": VIEWS,
        "shop/tests.py": tests,
    }
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


def env() -> dict[str, str]:
    """A user's shell environment: taskonce installed, nothing of the test session's."""
    found = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PYTEST_", "DJANGO_", "TASKONCE_", "CELERY_"))
    }
    found.pop("PYTHONPATH", None)
    return found


def run(folder: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python ARGV`` in the project's folder (``manage.py …``, ``-m celery …``, ``-m pytest``)."""
    return subprocess.run(
        [sys.executable, *argv],
        cwd=folder,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def celery() -> str:
    """The ``celery`` command of this environment (its name is what Celery's own worker check
    and taskonce's look at)."""
    return str(Path(sys.executable).with_name("celery"))


def docs_block(page: str, first_line: str) -> str:
    """The fenced Python block of ``docs/<page>`` whose first line is ``first_line``, as
    written."""
    text = (ROOT / "docs" / page).read_text()
    for match in re.finditer(r"^```python[^\n]*\n(.*?)^```", text, re.S | re.M):
        if match.group(1).startswith(first_line + "\n"):
            return match.group(1)
    raise AssertionError(f"docs/{page} has no Python block starting with {first_line!r}")
