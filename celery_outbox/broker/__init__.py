"""The broker behind one small interface: :class:`Publisher`.

``build_publisher`` picks the implementation for the app's broker URL: batched
publisher confirms on RabbitMQ (py-amqp), one pipeline per batch on Redis, kombu's
producer for every other transport. :class:`InMemoryPublisher` is the fake for tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kombu.utils.url import maybe_sanitize_url

from ..conf import OutboxSettings
from ..exceptions import OutboxConfigurationError
from .base import Budget, FixedBudget, Publisher, describe, is_outage
from .memory import InMemoryPublisher

__all__ = [
    "Budget",
    "FixedBudget",
    "InMemoryPublisher",
    "Publisher",
    "broker_driver",
    "build_publisher",
    "describe",
    "is_outage",
]


def broker_driver(app: Any) -> str:
    """The kombu driver of ``app``'s broker (``amqp``, ``redis``...), or a clear error.

    kombu answers an unknown URL scheme with a ``KeyError`` deep in its registry.
    """
    try:
        return str(app.connection_for_write().transport.driver_type)
    except KeyError as exc:
        url = maybe_sanitize_url(str(app.conf.broker_url))  # the password masked
        raise OutboxConfigurationError(
            f"The Celery broker URL {url!r} names no transport kombu knows "
            f"({str(exc.args[0] if exc.args else exc).strip()}). Fix CELERY_BROKER_URL "
            f"(app.conf.broker_url): e.g. 'amqp://user:password@host:5672//' or "
            f"'redis://host:6379/0'."
        ) from None


def build_publisher(app: Any, settings: OutboxSettings) -> Publisher:
    """The publisher for ``app``'s broker, with timeouts that really bound each publish."""
    driver = broker_driver(app)

    def resolve_queue(name: str) -> Any:
        try:
            return app.amqp.queues[name]
        except KeyError:
            return None

    if driver == "amqp":
        from .amqp import AmqpPublisher

        def connect_amqp() -> Any:
            return app.connection_for_write(
                connect_timeout=settings.send_timeout,
                transport_options={
                    "confirm_publish": False,  # confirms are awaited per batch instead
                    "read_timeout": settings.send_timeout,
                    "write_timeout": settings.send_timeout,
                },
            )

        return AmqpPublisher(
            connect_amqp, resolve_queue, confirm=settings.confirm_publish
        )

    from .kombu import KombuPublisher

    def connect() -> Any:
        options: dict[str, Any] = {}
        if driver == "redis":
            options = {
                "socket_timeout": settings.send_timeout,
                "socket_connect_timeout": settings.send_timeout,
            }
        return app.connection_for_write(
            connect_timeout=settings.send_timeout, transport_options=options
        )

    if driver == "redis":
        from .redis import RedisPublisher

        return RedisPublisher(connect, resolve_queue)
    return KombuPublisher(connect, resolve_queue)


if TYPE_CHECKING:  # every publisher implements the interface; mypy checks it here
    from .amqp import AmqpPublisher
    from .kombu import KombuPublisher
    from .redis import RedisPublisher

    _conforms: tuple[type[Publisher], ...] = (
        AmqpPublisher,
        KombuPublisher,
        RedisPublisher,
        InMemoryPublisher,
    )
