"""Where a failed subscriber's retries wait: on the broker or in the database.

RabbitMQ holds them in TTL queues that dead-letter back to the subscriber's queue.
Redis has neither message TTLs nor dead-letter exchanges: there each retry is an
outbox row due ``2^n`` seconds later, and an event whose retries are used up is a
dead letter of the outbox. ``CELERY_OUTBOX_EVENTS_RETRIES`` chooses (``"auto"``: the
broker on RabbitMQ, the database anywhere else).
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from ..exceptions import OutboxConfigurationError

logger = logging.getLogger("celery_outbox.events")


class Retries(enum.Enum):
    """Who holds a failed event until its next attempt."""

    BROKER = "broker"
    DATABASE = "database"


def resolve(setting: str, transport: str) -> Retries:
    """The retries of a service whose broker speaks ``transport`` (kombu's
    ``driver_type``: ``amqp``, ``redis`` ...), for the setting's value."""
    if setting == "database":
        return Retries.DATABASE
    if transport == "amqp":
        return Retries.BROKER
    if setting == "broker":
        raise OutboxConfigurationError(
            f"CELERY_OUTBOX_EVENTS_RETRIES is 'broker', but the broker is "
            f"{transport or 'not RabbitMQ'}: broker-side retries need message TTLs and "
            f"dead-letter exchanges, which only RabbitMQ (amqp://) has. Set it to "
            f"'database' (or 'auto') to hold the retries in the outbox, or use RabbitMQ."
        )
    return Retries.DATABASE


def transport_of(connection: Any) -> str:
    """kombu's name of the connection's transport type (no connection is opened)."""
    return str(getattr(connection.transport, "driver_type", "") or "")


def announce(retries: Retries, transport: str, setting: str, service: str) -> None:
    """Say at start, once per declare, what a service's retries rely on."""
    if retries is Retries.DATABASE and setting == "auto":
        logger.warning(
            "events: the broker of service %s is %s, which has no message TTLs or "
            "dead-letter exchanges: broker-side retries are not available. Failed "
            "subscribers are retried through the outbox (rows due 1, 2, 4 ... s later) and "
            "archived as dead letters. Set CELERY_OUTBOX_EVENTS_RETRIES = 'database' "
            "to say so and silence this warning.",
            service,
            transport or "not RabbitMQ",
        )
    else:
        logger.info(
            "events: service %s holds its retries in the %s", service, retries.value
        )
