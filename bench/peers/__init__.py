"""taskonce side by side with celery-once, celery-singleton and Powertools' idempotency."""
