"""Every exchange and queue of the events feature, as kombu entities (pure: no I/O).

For a service ``S`` and an events exchange ``E`` (names use ``:``, which event names
cannot hold, so no event queue can take the name of a retry queue)::

    E                 topic    the exchange events are published to
    E:unrouted        fanout   E's alternate exchange: an event no service handles
                               yet is dropped there (queue with x-max-length 0)
                               instead of being returned to the relay as unroutable
    E:S:<pattern>     queue    one per subscriber; bound to E by the pattern and to
                               E:S:recover by its own name; a message it rejects
                               dead-letters into E:S:retry:0
    E:S:retry:<n>     fanout + queue, x-message-ttl 2^n s, dead-letters into
                               E:S:recover keeping the routing key (the queue name)
    E:S:recover       direct   routes a retried event back to its queue only
    E:S:archive       fanout + queue, x-message-ttl and x-max-length

When the database holds the retries (Redis, or ``CELERY_OUTBOX_EVENTS_RETRIES =
"database"``) a service has its event queues only: no arguments, bound to E by
their pattern. A retry is an outbox row sent to the queue by name (the default
exchange), the archive is the outbox's dead letters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kombu import Exchange, Queue, binding

from ..conf import OutboxSettings
from .modes import Retries

#: Retry step ``n`` holds a message ``RETRY_UNIT_MS * 2**n`` milliseconds.
RETRY_UNIT_MS = 1000


def retry_delay(step: int) -> float:
    """Seconds a message waits in retry step ``step`` (0-based): 1, 2, 4 ..."""
    return float(RETRY_UNIT_MS * 2**step) / 1000


def events_exchange(settings: OutboxSettings) -> Exchange:
    """The topic exchange events are published to (its alternate exchange drops the
    events no queue is bound for)."""
    return Exchange(
        settings.events_exchange,
        type="topic",
        durable=True,
        arguments={"alternate-exchange": f"{settings.events_exchange}:unrouted"},
    )


def unrouted_queue(settings: OutboxSettings) -> Queue:
    """The sink of events no service handles; declaring it also declares the events
    exchange, so one stored declaration lets the relay create both."""
    name = f"{settings.events_exchange}:unrouted"
    sink = Exchange(name, type="fanout", durable=True)
    return Queue(
        name,
        exchange=sink,
        durable=True,
        queue_arguments={"x-max-length": 0},
        bindings=[
            binding(sink),
            # Never matches an event name (':' is not allowed in one): the binding
            # only makes the relay declare the events exchange with its arguments.
            binding(events_exchange(settings), routing_key="celery-outbox:declare"),
        ],
    )


@dataclass(frozen=True)
class ServiceTopology:
    """The queues and exchanges of one service, for the settings it was built with."""

    settings: OutboxSettings
    service: str
    patterns: tuple[str, ...]
    #: Who holds the retries: the broker (TTL queues, an archive queue) or the database.
    retries: Retries = Retries.BROKER

    @property
    def prefix(self) -> str:
        return f"{self.settings.events_exchange}:{self.service}"

    def queue_name(self, pattern: str) -> str:
        """The queue of this service's subscriber to ``pattern``."""
        return f"{self.prefix}:{pattern}"

    @property
    def recover(self) -> Exchange:
        return Exchange(f"{self.prefix}:recover", type="direct", durable=True)

    def retry_exchange(self, step: int) -> Exchange:
        return Exchange(f"{self.prefix}:retry:{step}", type="fanout", durable=True)

    @property
    def archive_exchange(self) -> Exchange:
        return Exchange(f"{self.prefix}:archive", type="fanout", durable=True)

    @property
    def archive_name(self) -> str:
        return f"{self.prefix}:archive"

    def event_queue(self, pattern: str) -> Queue:
        """The queue a subscriber consumes: events matching ``pattern``, and its retries."""
        name = self.queue_name(pattern)
        if self.retries is Retries.DATABASE:
            return Queue(
                name,
                durable=True,
                queue_arguments=self._typed({}) or None,
                bindings=[binding(events_exchange(self.settings), routing_key=pattern)],
            )
        arguments = self._typed(
            {
                "x-dead-letter-exchange": self.retry_exchange(0).name,
                "x-dead-letter-routing-key": name,
            }
        )
        return Queue(
            name,
            durable=True,
            queue_arguments=arguments,
            bindings=[
                binding(events_exchange(self.settings), routing_key=pattern),
                binding(self.recover, routing_key=name),
            ],
        )

    def consumed_queue(self, pattern: str) -> Queue:
        """The queue as the worker consumes it: declared by us at start, not by Celery
        (which would also bind it to its default exchange)."""
        declared = self.event_queue(pattern)
        return Queue(
            declared.name,
            exchange=events_exchange(self.settings),
            routing_key=pattern,
            durable=True,
            queue_arguments=declared.queue_arguments,
            no_declare=True,
        )

    def retry_queue(self, step: int) -> Queue:
        """Retry step ``step``: held ``2^step`` seconds, then back through recover."""
        exchange = self.retry_exchange(step)
        arguments = self._typed(
            {
                "x-message-ttl": RETRY_UNIT_MS * 2**step,
                "x-dead-letter-exchange": self.recover.name,
            }
        )
        return Queue(
            exchange.name, exchange=exchange, durable=True, queue_arguments=arguments
        )

    def archive_queue(self) -> Queue:
        """Events whose retries are used up, kept for a while for ``replay``."""
        arguments = self._typed(
            {
                "x-message-ttl": int(self.settings.events_archive_ttl * 1000),
                "x-max-length": self.settings.events_archive_max_length,
            }
        )
        return Queue(
            self.archive_name,
            exchange=self.archive_exchange,
            durable=True,
            queue_arguments=arguments,
        )

    def event_queues(self) -> list[Queue]:
        return [self.event_queue(pattern) for pattern in self.patterns]

    def support_queues(self) -> list[Queue]:
        """Retry steps and the archive (shared by all the service's subscribers); none
        when the database holds the retries."""
        if self.retries is Retries.DATABASE:
            return []
        steps = [self.retry_queue(n) for n in range(self.settings.events_max_retries)]
        return [*steps, self.archive_queue()]

    def all_queues(self) -> list[Queue]:
        """Every queue, in the order they are declared (exchanges come with them)."""
        return [
            unrouted_queue(self.settings),
            *self.support_queues(),
            *self.event_queues(),
        ]

    def _typed(self, arguments: dict[str, object]) -> dict[str, object]:
        if self.settings.events_queue_type == "quorum":
            return {**arguments, "x-queue-type": "quorum"}
        return arguments


def describe(queues: Iterable[Queue]) -> str:
    """The topology as text, one queue with its arguments and bindings per block."""
    lines: list[str] = []
    for queue in queues:
        arguments = ", ".join(
            f"{key}={value}"
            for key, value in sorted((queue.queue_arguments or {}).items())
        )
        lines.append(f"queue {queue.name}" + (f"  [{arguments}]" if arguments else ""))
        for exchange, key in _bindings(queue):
            lines.append(
                f"  <- {exchange.type} exchange {exchange.name}"
                + (f" by {key!r}" if key else "")
            )
    return "\n".join(lines)


def _bindings(queue: Queue) -> Sequence[tuple[Exchange, str]]:
    found: list[tuple[Exchange, str]] = []
    if queue.exchange is not None and queue.exchange.name:
        found.append((queue.exchange, queue.routing_key or ""))
    for each in queue.bindings or ():
        if (
            each.exchange is not None
            and (each.exchange, each.routing_key or "") not in found
        ):
            found.append((each.exchange, each.routing_key or ""))
    return found
