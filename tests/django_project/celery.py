"""The project's Celery app, laid out as Celery's Django guide has it::

    celery -A tests.django_project.celery worker -P prefork

Settings come from Django's (``CELERY_*``); the guard from ``settings.TASKONCE``. Tasks are
in ``shop/tasks.py`` (found by ``autodiscover_tasks``). The lines are those of
docs/django.md's Celery example (the copy tests/test_docs.py checks line for line is
tests/django/layout_project.py's).
"""

from __future__ import annotations

import os

from celery import Celery

import taskonce.django_ext
from taskonce.celery_ext import setup

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_project.settings")

app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
setup(app, taskonce.django_ext.guard())
