"""Queue declarations shared by the worker app and the tests that publish to it."""

from __future__ import annotations

from kombu import Queue


def dead_lettered_queue(prefix: str) -> Queue:
    """``{prefix}.eager`` with RabbitMQ dead-lettering into ``{prefix}.dead``: a message
    rejected without requeue lands there instead of vanishing. Worker and publisher must
    declare the queue with the same arguments (RabbitMQ refuses a redeclaration that differs)."""
    return Queue(
        f"{prefix}.eager",
        queue_arguments={
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": f"{prefix}.dead",
        },
    )
