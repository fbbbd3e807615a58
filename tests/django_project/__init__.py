"""A real Django project for taskonce's tests: its settings, a shop app, Celery and Dramatiq."""
