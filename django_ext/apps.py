"""The Django app ``taskonce.django_ext``."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig


class TaskonceConfig(AppConfig):
    """Registers the system checks and forgets the guard when a test overrides
    ``TASKONCE``."""

    name = "taskonce.django_ext"
    label = "taskonce"
    verbose_name = "taskonce"
    default_auto_field = "django.db.models.AutoField"

    def ready(self) -> None:
        from django.core.signals import setting_changed

        from . import checks  # noqa: F401 - registers the checks

        setting_changed.connect(_settings_changed, dispatch_uid="taskonce-settings")


def _settings_changed(setting: str, **_: Any) -> None:
    if setting in ("TASKONCE", "DATABASES"):
        from .conf import reset

        reset()
