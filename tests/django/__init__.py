"""Tests of taskonce.django_ext against the test project (tests/django_project)."""
