"""Declaring a service's topology on the broker, with RabbitMQ's constraints checked first."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kombu import Queue

from ..conf import OutboxSettings
from ..exceptions import OutboxConfigurationError

logger = logging.getLogger("celery_outbox.events")

#: Quorum queues honour x-message-ttl (our retry steps and archive) from this version.
QUORUM_TTL_VERSION = (3, 10)


def check_broker(connection: Any, settings: OutboxSettings) -> None:
    """Refuse, with what to do instead, a broker that cannot hold this topology."""
    transport = getattr(connection.transport, "driver_type", "")
    if transport != "amqp":
        raise OutboxConfigurationError(
            f"Events need RabbitMQ (AMQP): broker-side retries use message TTLs and "
            f"dead-letter exchanges, which {transport or 'this broker'} does not have. "
            f"Use an amqp:// broker for events."
        )
    if settings.events_queue_type == "quorum":
        version = server_version(connection)
        if version is not None and version < QUORUM_TTL_VERSION:
            shown = ".".join(map(str, version))
            raise OutboxConfigurationError(
                f"CELERY_OUTBOX_EVENTS_QUEUE_TYPE is 'quorum', but RabbitMQ {shown} "
                f"ignores x-message-ttl on quorum queues (retry delays and the "
                f"archive's age limit need it; 3.10 or later does). Upgrade RabbitMQ "
                f"or use 'classic'."
            )


def server_version(connection: Any) -> tuple[int, ...] | None:
    """RabbitMQ's version from the connection's server properties, if it says."""
    properties = getattr(connection.connection, "server_properties", None) or {}
    text = properties.get("version")
    if isinstance(text, bytes):
        text = text.decode()
    if not isinstance(text, str):
        return None
    try:
        return tuple(int(part) for part in text.split("+")[0].split(".")[:2])
    except ValueError:
        return None


def declare(connection: Any, queues: Sequence[Queue], settings: OutboxSettings) -> None:
    """Declare every queue (and its exchanges and bindings); idempotent.

    A queue that exists with other arguments (say classic where quorum is asked for,
    or another retry delay) is refused by the broker: that error names the queue and
    the way out.
    """
    connection.ensure_connection(max_retries=3)
    check_broker(connection, settings)
    channel = connection.channel()
    try:
        for queue in queues:
            try:
                queue(channel).declare()
            except Exception as exc:
                if getattr(exc, "code", None) != 406:  # PRECONDITION_FAILED
                    raise
                raise OutboxConfigurationError(
                    f"RabbitMQ refused to declare {queue.name!r} as "
                    f"{dict(queue.queue_arguments or {})}: {exc}. It exists with other "
                    f"arguments (a changed setting such as the queue type or the retry "
                    f"count): delete it after draining it, or keep the old setting."
                ) from None
    finally:
        if channel.is_open:
            channel.close()
