"""Declaring a service's topology on the broker, with the broker's constraints checked first."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kombu import Queue

from ..broker.topics import use_rabbit_topics
from ..conf import OutboxSettings
from ..exceptions import OutboxConfigurationError
from .modes import Retries, announce, resolve, transport_of

logger = logging.getLogger("celery_outbox.events")

#: Quorum queues honour x-message-ttl (our retry steps and archive) from this version.
QUORUM_TTL_VERSION = (3, 10)


def check_broker(connection: Any, settings: OutboxSettings) -> Retries:
    """Who holds the retries on this broker; refuses, with what to do instead, a
    broker that cannot hold what the settings ask for."""
    transport = transport_of(connection)
    retries = resolve(settings.events_retries, transport)
    if transport == "amqp" and settings.events_queue_type == "quorum":
        version = server_version(connection)
        if version is not None and version < QUORUM_TTL_VERSION:
            shown = ".".join(map(str, version))
            raise OutboxConfigurationError(
                f"CELERY_OUTBOX_EVENTS_QUEUE_TYPE is 'quorum', but RabbitMQ {shown} "
                f"ignores x-message-ttl on quorum queues (retry delays and the "
                f"archive's age limit need it; 3.10 or later does). Upgrade RabbitMQ "
                f"or use 'classic'."
            )
    return retries


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


def declare(
    connection: Any,
    queues: Sequence[Queue],
    settings: OutboxSettings,
    service: str = "",
) -> Retries:
    """Declare every queue (and its exchanges and bindings); idempotent.

    Returns who holds the retries, after saying so in the log (a WARNING when the
    broker cannot hold them and the setting left it to us to choose).

    A queue that exists with other arguments (say classic where quorum is asked for,
    or another retry delay) is refused by the broker: that error names the queue and
    the way out.
    """
    connection.ensure_connection(max_retries=3)
    retries = check_broker(connection, settings)
    announce(retries, transport_of(connection), settings.events_retries, service)
    channel = connection.channel()
    # The bindings stored on Redis route by RabbitMQ's rules for every publisher.
    use_rabbit_topics(channel)
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
        if getattr(channel, "is_open", True):  # kombu's virtual channels lack it
            channel.close()
    return retries
