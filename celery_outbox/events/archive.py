"""A service's archive queue: count, list, replay and purge, and queue depths for stats.

Listing and replaying read the archive with ``basic.get`` without acking: a message
that is not replayed goes back when the channel closes. Each pass is bounded by the
archive's length when it began, so messages put back are not read twice.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..exceptions import OutboxConfigurationError
from .delivery import ERROR_HEADER, FAILED_AT_HEADER
from .registry import EVENT_HEADER
from .topology import ServiceTopology


@dataclass(frozen=True)
class ArchivedEvent:
    """One archived event as ``list`` shows it."""

    id: str
    event: str
    queue: str
    retries: int
    error: str
    failed_at: str


@dataclass(frozen=True)
class ReplayResult:
    """What a replay did: events put back, events left (no match), events kept
    because their queue no longer exists, and the task ids of the events selected."""

    replayed: int
    left: int
    missing_queue: int
    #: The ids of the selected events (replayed, or kept for a missing queue).
    matched: frozenset[str] = frozenset()


def depth(channel: Any, name: str) -> int | None:
    """Messages ready in queue ``name``; None when it does not exist."""
    try:
        return int(channel.queue_declare(name, passive=True).message_count)
    except Exception as exc:
        # py-amqp sets ``code``; kombu's virtual transports (Redis) ``reply_code``.
        codes = {str(getattr(exc, name, "")) for name in ("code", "reply_code")}
        if "404" in codes:
            return None
        raise


def count(connection: Any, topology: ServiceTopology) -> int:
    """Events in the service's archive; :class:`OutboxConfigurationError` when the
    archive queue was never declared."""
    with connection.channel() as channel:
        return _archive_depth(channel, topology)


def _archive_depth(channel: Any, topology: ServiceTopology) -> int:
    found = depth(channel, topology.archive_name)
    if found is None:
        raise OutboxConfigurationError(
            f"The archive queue {topology.archive_name!r} does not exist on the "
            f"broker: service {topology.service!r} never declared its topology there. "
            f"Run: python manage.py outbox events declare (or start its worker)."
        )
    return found


def stats(connection: Any, topology: ServiceTopology) -> dict[str, int | None]:
    """Ready messages per queue of the service: event queues, retry steps, archive."""
    names = [queue.name for queue in topology.event_queues()]
    names += [queue.name for queue in topology.support_queues()]
    found: dict[str, int | None] = {}
    for name in names:
        with connection.channel() as channel:  # a missing queue closes it
            found[name] = depth(channel, name)
    return found


def list_archive(
    connection: Any, topology: ServiceTopology, limit: int = 100
) -> list[ArchivedEvent]:
    """Up to ``limit`` archived events, oldest first; the archive is left as it was."""
    with connection.channel() as channel:
        _archive_depth(channel, topology)
    with connection.channel() as channel:
        return [_describe(message) for message in _browse(channel, topology, limit)]


def replay(
    connection: Any,
    topology: ServiceTopology,
    *,
    event: str | None = None,
    ids: Sequence[str] = (),
    on_progress: Callable[[int, int], None] = lambda done, total: None,
) -> ReplayResult:
    """Put archived events back into their subscriber's queue with a fresh retry count.

    ``event`` (a glob) and ``ids`` select; none of them selects every event. Each
    event is acked in the archive only after the broker confirmed its new copy.
    """
    import amqp

    wanted = set(ids)
    replayed = left = missing = 0
    matched: set[str] = set()
    with connection.channel() as channel:
        total = _archive_depth(channel, topology)
        existing: dict[str, bool] = {}
        for message in _browse(channel, topology, total):
            archived = _describe(message)
            if (wanted and archived.id not in wanted) or (
                event is not None and not fnmatch.fnmatchcase(archived.event, event)
            ):
                left += 1
                continue
            matched.add(archived.id)
            if archived.queue not in existing:
                existing[archived.queue] = _exists(connection, archived.queue)
            if not existing[archived.queue]:
                missing += 1
                continue
            headers = dict(message.headers or {})
            for key in (ERROR_HEADER, FAILED_AT_HEADER, "x-death"):
                headers.pop(key, None)
            headers["retries"] = 0
            properties = dict(message.properties)
            properties["application_headers"] = headers
            channel.basic_publish_confirm(
                amqp.Message(message.body, **properties),
                exchange=topology.recover.name,
                routing_key=archived.queue,
            )
            channel.basic_ack(message.delivery_tag)
            replayed += 1
            on_progress(replayed, total)
    return ReplayResult(replayed, left, missing, frozenset(matched))


def purge(connection: Any, topology: ServiceTopology) -> int:
    """Delete every archived event; returns how many there were."""
    with connection.channel() as channel:
        _archive_depth(channel, topology)
        return int(channel.queue_purge(topology.archive_name) or 0)


def _exists(connection: Any, name: str) -> bool:
    # A passive declare of a missing queue closes its channel: a channel of its own.
    with connection.channel() as channel:
        return depth(channel, name) is not None


def _browse(channel: Any, topology: ServiceTopology, limit: int) -> Iterator[Any]:
    for _ in range(limit):
        message = channel.basic_get(topology.archive_name, no_ack=False)
        if message is None:
            return
        yield message


def _describe(message: Any) -> ArchivedEvent:
    headers = message.headers or {}
    return ArchivedEvent(
        id=str(headers.get("id", "")),
        event=str(headers.get(EVENT_HEADER, "")),
        queue=str(message.delivery_info.get("routing_key", "")),
        retries=int(headers.get("retries") or 0),
        error=str(headers.get(ERROR_HEADER, "")),
        failed_at=str(headers.get(FAILED_AT_HEADER, "")),
    )
