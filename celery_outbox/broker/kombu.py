"""Publisher for every other kombu transport (Redis, filesystem, in-memory, ...).

Messages are published with kombu's ``Producer`` from their stored bytes. Where the
transport supports publish batches (Redis, kombu >= 5.7) a whole batch goes out as
one pipeline; a publish counts once the command succeeded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..envelope import Envelope, StoredMessage, as_dict
from ..outcomes import Outcome, PublishResult
from ..queues import queues_to_declare
from .base import (
    Budget,
    all_with,
    describe,
    envelope_properties,
    explain,
    is_outage,
)
from .failover import OnNodes, connect, node_lost
from .topics import use_rabbit_topics

logger = logging.getLogger("celery_outbox.broker")


class KombuPublisher(OnNodes):
    """Publishes through a kombu ``Producer`` on one long-lived connection."""

    def __init__(
        self, connect: Callable[[], Any], resolve_queue: Callable[[str], Any]
    ) -> None:
        """``connect`` returns a new kombu Connection; ``resolve_queue`` maps a name to a Queue."""
        self._connect = connect
        self._resolve_queue = resolve_queue
        self._connection: Any = None
        self._producer: Any = None
        #: Queue names declared on the current connection (as AmqpPublisher does):
        #: binding a copy of the Queue for every publish cost a quarter of a batch.
        self._declared: set[str] = set()
        #: The node of the current connection (URL, password masked), or the last one.
        self.node = ""
        #: The connection broke under a batch, and other nodes may answer.
        self._node_lost = False

    def _publish(
        self, messages: Sequence[StoredMessage], budget: Budget
    ) -> list[PublishResult]:
        """One batch in one transport batch when possible, else message by message."""
        try:
            results = self._publish_batch(
                self._open(budget.keep_going), messages, budget
            )
            if results is not None:
                return results
        except Exception as exc:
            if is_outage(exc, self._connection_errors()):
                return self._outage(messages, exc)
            logger.warning(
                "Batch publish failed (%s); publishing one by one", describe(exc)
            )
        return self._one_by_one(messages, budget)

    def _publish_batch(
        self, producer: Any, messages: Sequence[StoredMessage], budget: Budget
    ) -> list[PublishResult] | None:
        """The batch through kombu's publish batches; None when the transport has none."""
        batch = getattr(producer, "batch", None)
        if batch is None or len(messages) < 2:
            return None
        sent = 0
        with batch(max_size=len(messages) * 4):
            for message in messages:
                if not budget.keep_going():
                    break
                self._send(producer, message)
                sent += 1
        return all_with(messages[:sent], Outcome.PUBLISHED) + all_with(
            messages[sent:], Outcome.NOT_SENT
        )

    def ping(self) -> str:
        """Connect (or reuse the connection); raises when the broker is unreachable.

        Returns the node that answered (a URL, its password masked).
        """
        self._open()
        return self.node

    def depth(self, queues: Sequence[str]) -> dict[str, int]:
        """Messages ready in each of ``queues`` (a passive declare each, on a
        channel of its own, which a missing queue may close: it holds none)."""
        self._open()
        found: dict[str, int] = {}
        channel = None
        try:
            for name in queues:
                if channel is None:
                    channel = self._connection.channel()
                try:
                    answer = channel.queue_declare(queue=name, passive=True)
                except self._connection.channel_errors:
                    # The transport's "no such queue" (AMQP closes the channel).
                    with contextlib.suppress(Exception):
                        channel.close()
                    channel = None
                    found[name] = 0
                    continue
                found[name] = int(answer.message_count)
        finally:
            if channel is not None:
                with contextlib.suppress(Exception):
                    channel.close()
        return found

    def close(self) -> None:
        """Drop the connection; the next batch reconnects."""
        connection, self._connection, self._producer = self._connection, None, None
        self._declared.clear()
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.release()

    def _one_by_one(
        self, messages: Sequence[StoredMessage], budget: Budget
    ) -> list[PublishResult]:
        results: list[PublishResult] = []
        for index, message in enumerate(messages):
            if not budget.keep_going():
                return results + all_with(messages[index:], Outcome.NOT_SENT)
            try:
                self._send(self._open(budget.keep_going), message)
            except Exception as exc:
                if is_outage(exc, self._connection_errors()):
                    return results + self._outage(messages[index:], exc)
                results.append(PublishResult(message.id, Outcome.FAILED, describe(exc)))
                continue
            results.append(PublishResult(message.id, Outcome.PUBLISHED))
        return results

    def _outage(
        self, messages: Sequence[StoredMessage], exc: BaseException
    ) -> list[PublishResult]:
        """Drop the connection; ``messages`` are an outage (no attempt used), and why."""
        self._node_lost = node_lost(self._connection, exc)
        self.close()
        error = explain(exc)
        logger.warning("broker outage, no attempt used: %s", error)
        return all_with(messages, Outcome.OUTAGE, error)

    def _open(self, between: Callable[[], object] | None = None) -> Any:
        """The producer; connecting first tries every node of a failover list
        (``between`` runs between two nodes)."""
        if self._producer is None:
            connection = self._connect()
            self.node = connect(connection, between)
            self._declared.clear()
            self._connection = connection
            self._producer = connection.Producer(auto_declare=False)
            # Redis and the other virtual transports route topics in the relay.
            use_rabbit_topics(self._producer.channel)
        return self._producer

    def _declare(self, producer: Any, envelope: Envelope) -> bool:
        """Declare the message's queues once per connection, before its first publish.

        Returns whether anything was declared now.
        """
        declared = False
        for name, queue in queues_to_declare(
            envelope.declare, envelope.declare_specs, self._resolve_queue
        ):
            if name in self._declared:
                continue
            if queue is not None:
                producer.maybe_declare(queue, retry=False)
                declared = True
            self._declared.add(name)
        return declared

    def _connection_errors(self) -> tuple[type[BaseException], ...]:
        if self._connection is None:
            return ()
        return tuple(self._connection.connection_errors)

    def _send(self, producer: Any, message: StoredMessage) -> None:
        envelope = message.envelope
        self._declare(producer, envelope)
        self._produce(producer, message, envelope.exchange, envelope.routing_key)

    def _produce(
        self, producer: Any, message: StoredMessage, exchange: str, routing_key: str
    ) -> None:
        """``producer.publish`` of the stored message, to ``exchange`` and ``routing_key``."""
        envelope = message.envelope
        properties = envelope_properties(message)
        # Stored in AMQP form (milliseconds, a string); kombu takes seconds.
        expiration_ms = properties.pop("expiration", None)
        producer.publish(
            envelope.body,
            exchange=exchange,
            routing_key=routing_key,
            content_type=envelope.content_type,
            content_encoding=envelope.content_encoding,
            headers=as_dict(envelope.headers),
            priority=envelope.priority,
            retry=False,
            expiration=None if expiration_ms is None else int(expiration_ms) / 1000,
            **properties,
        )
