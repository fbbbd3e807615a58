"""The chaos soak: real Celery and Dramatiq workers, a ledger, and faults injected meanwhile."""
