"""The project's Celery app, laid out as Celery's Django guide has it::

    celery -A tests.django_project.celery worker -P prefork

Settings come from Django's (``CELERY_*``); the guard from ``settings.TASKONCE``. Tasks are
in ``shop/tasks.py`` (found by ``autodiscover_tasks``).
"""

from __future__ import annotations

import os

from celery import Celery

from taskonce.celery_ext import setup
from taskonce.django_ext import guard

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_project.settings")

app = Celery("django_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
setup(app, guard())
