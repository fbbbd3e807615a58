"""Settings of the test project (``DJANGO_SETTINGS_MODULE=tests.django_project.settings``).

Three databases on the machine's services, each the test process's own (named after the xdist
worker and the checkout, so neither parallel test processes nor two clones' runs share one;
worker processes a test starts inherit the name through ``TASKONCE_DJANGO_DB``): ``default``
on PostgreSQL (the project's database), ``mariadb`` and ``sqlite`` for the store-level tests. :func:`tests.django_project.databases.ready`
creates them and runs the migrations.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import pymysql

pymysql.install_as_MySQLdb()  # Django's MySQL backend on PyMySQL (no C client needed)

# Two clones (or worktrees) testing at the same time on one machine's services must not empty
# each other's tables: the name carries the checkout's.
CHECKOUT = hashlib.sha1(str(Path(__file__).resolve().parents[2]).encode()).hexdigest()[:6]
DB_NAME = os.environ.get("TASKONCE_DJANGO_DB") or (
    f"taskonce_django_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}_{CHECKOUT}"
)

SECRET_KEY = "tests-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
ROOT_URLCONF = "tests.django_project.urls"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": DB_NAME,
        "USER": "postgres",
        "HOST": "127.0.0.1",
        "PORT": 5432,
    },
    "mariadb": {
        "ENGINE": "django.db.backends.mysql",
        "NAME": DB_NAME,
        "USER": "root",
        "HOST": "127.0.0.1",
        "PORT": 3306,
    },
    "sqlite": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.path.join(tempfile.gettempdir(), f"{DB_NAME}.sqlite3"),
    },
}

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.admin",
    "taskonce.django_ext",
    "tests.django_project.shop",
]
if os.environ.get("TASKONCE_DJANGO_DRAMATIQ"):
    # A Dramatiq worker or web process of the project: django_dramatiq makes the broker
    # (with taskonce's middleware by its dotted path) when the apps are ready.
    INSTALLED_APPS.insert(0, "django_dramatiq")

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

if os.environ.get("TASKONCE_DJANGO_ATOMIC_REQUESTS"):
    DATABASES["default"]["ATOMIC_REQUESTS"] = True

# The shop's queues (tasks and actors alike): QUEUE (the default policy), QUEUE-lazy and
# QUEUE-optimistic. The worker tests give each run its own QUEUE, events file, marks directory
# (tests/django_project/shop/scenarios.py), relay period and dispatch lease by environment.
QUEUE = os.environ.get("TASKONCE_DJANGO_QUEUE", "shop")

TASKONCE = {
    "STORE": "django://default",
    "DEFAULT": {"mode": "eager", "transactional": True, "lease": 30},
    "QUEUES": {
        f"{QUEUE}-lazy": {"mode": "lazy", "transactional": True},
        f"{QUEUE}-optimistic": {"mode": "lazy", "transactional": True, "check_first": False},
    },
}
if os.environ.get("TASKONCE_DJANGO_EVENTS"):
    import taskonce

    TASKONCE["EVENTS"] = [taskonce.JsonlEvents(os.environ["TASKONCE_DJANGO_EVENTS"])]
if os.environ.get("TASKONCE_DJANGO_DISPATCH_LEASE"):
    TASKONCE["DISPATCH_LEASE"] = float(os.environ["TASKONCE_DJANGO_DISPATCH_LEASE"])

# Celery (tests/django_project/celery.py), broker on Redis db 14 unless a test says otherwise.
CELERY_BROKER_URL = os.environ.get("TASKONCE_DJANGO_BROKER", "redis://127.0.0.1:6379/14")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_DEFAULT_QUEUE = QUEUE
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASKONCE_RELAY_EVERY = float(os.environ.get("TASKONCE_DJANGO_RELAY_EVERY", "30"))

DRAMATIQ_BROKER = {
    "BROKER": "dramatiq.brokers.rabbitmq.RabbitmqBroker",
    "OPTIONS": {"url": os.environ.get("TASKONCE_DJANGO_AMQP", "amqp://guest:guest@127.0.0.1:5672")},
    "MIDDLEWARE": [
        "dramatiq.middleware.AgeLimit",
        "dramatiq.middleware.TimeLimit",
        "dramatiq.middleware.Callbacks",
        "dramatiq.middleware.Retries",
        "dramatiq.middleware.CurrentMessage",
        "django_dramatiq.middleware.DbConnectionsMiddleware",
        "taskonce.django_ext.IdempotencyMiddleware",
    ],
}
DRAMATIQ_AUTODISCOVER_MODULES = ["actors"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"taskonce": {"handlers": ["console"], "level": "INFO"}},
}
