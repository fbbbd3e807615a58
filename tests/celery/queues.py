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


def quorum_queue(prefix: str, delivery_limit: int = 0) -> Queue:
    """``{prefix}.eager`` as a RabbitMQ quorum queue (``x-queue-type: quorum``). With a
    ``delivery_limit``, RabbitMQ drops a message returned that many times (a rejection with
    requeue, a consumer's channel closed with it unacknowledged) into ``{prefix}.dead``
    instead of delivering it again. Worker and publisher declare it alike."""
    arguments: dict[str, object] = {"x-queue-type": "quorum"}
    if delivery_limit:
        arguments.update(
            {
                "x-delivery-limit": delivery_limit,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": f"{prefix}.dead",
            }
        )
    return Queue(f"{prefix}.eager", queue_arguments=arguments)
