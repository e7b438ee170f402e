"""RabbitMQ publisher: one long-lived channel, publisher confirms awaited per batch.

A batch is published back to back with ``mandatory`` set, then the relay waits once
for all its confirms. A nack or a basic.return fails only that message. If the
broker closes the channel because of one message (too large, unknown exchange),
the unconfirmed messages are sent again one at a time, so the poison message fails
alone with the broker's reason and the rest go through.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import amqp
import amqp.exceptions as amqp_errors

from ..envelope import StoredMessage, as_dict
from ..relay.core import Outcome, PublishResult
from .base import Budget, all_with, describe, envelope_properties, is_outage

logger = logging.getLogger("celery_outbox.broker")


class _Confirms:
    """Delivery tags of one channel's unconfirmed messages, and what came back."""

    def __init__(self, first_tag: int = 1) -> None:
        self.next_tag = first_tag
        self.by_tag: dict[int, int] = {}  # delivery tag -> outbox row id
        self.by_task: dict[str, list[int]] = {}  # task id -> row ids not yet confirmed
        self.results: dict[int, PublishResult] = {}

    def sent(self, message: StoredMessage) -> None:
        self.by_tag[self.next_tag] = message.id
        self.by_task.setdefault(message.envelope.task_id, []).append(message.id)
        self.next_tag += 1

    def settle(
        self, tag: int, multiple: bool, outcome: Outcome, error: str = ""
    ) -> None:
        tags = [t for t in self.by_tag if t <= tag] if multiple else [tag]
        for t in tags:
            row_id = self.by_tag.pop(t, None)
            if row_id is not None and row_id not in self.results:
                self.results[row_id] = PublishResult(row_id, outcome, error)

    def returned(
        self, exc: BaseException, exchange: str, routing_key: str, message: Any
    ) -> None:
        headers = getattr(message, "headers", None) or {}
        rows = self.by_task.get(str(headers.get("id", "")), [])
        for row_id in rows:
            if row_id not in self.results:
                self.results[row_id] = PublishResult(
                    row_id,
                    Outcome.FAILED,
                    f"Unroutable: {describe(exc)} (exchange={exchange!r}, "
                    f"routing_key={routing_key!r}); no queue is bound for it.",
                )
                return

    @property
    def waiting(self) -> bool:
        return bool(self.by_tag)


def _about_declaration(exc: amqp_errors.AMQPError) -> bool:
    """Whether a channel error answers an exchange or queue declaration (the probe's)."""
    method = str(getattr(exc, "method_name", "") or "")
    return method.startswith(("Exchange.", "Queue."))


class AmqpPublisher:
    """Publishes over py-amqp with batched publisher confirms."""

    def __init__(
        self,
        connect: Callable[[], Any],
        resolve_queue: Callable[[str], Any],
        *,
        confirm: bool = True,
        mandatory: bool = True,
    ) -> None:
        """``connect`` returns a new kombu Connection; ``resolve_queue`` maps a name to a Queue."""
        self._connect = connect
        self._resolve_queue = resolve_queue
        self._confirm = confirm
        self._mandatory = mandatory
        self._connection: Any = None
        self._channel: Any = None
        self._probe: Any = None
        self._next_tag = 1
        self._confirms = _Confirms()
        self._declared: set[str] = set()
        self._exchanges: set[str] = {""}

    # -- Publisher -------------------------------------------------------------

    def publish(
        self, messages: Sequence[StoredMessage], budget: Budget
    ) -> list[PublishResult]:
        """Publish a batch; see the module docstring for how failures are isolated."""
        if not messages:
            return []
        try:
            results = self._publish_batch(messages, budget)
        except amqp_errors.ChannelError as exc:
            if is_outage(exc):
                self.close()
                return all_with(messages, Outcome.OUTAGE, describe(exc))
            logger.warning(
                "Channel closed by the broker (%s); isolating the batch", describe(exc)
            )
            self._drop_channel()
            results = self._confirms.results
            return self._isolate(messages, results, budget)
        except Exception as exc:
            if not is_outage(exc):
                raise
            results = self._confirms.results
            self.close()
            return [
                results.get(m.id) or PublishResult(m.id, Outcome.OUTAGE, describe(exc))
                for m in messages
            ]
        return [results[m.id] for m in messages]

    def ping(self) -> None:
        """Open (or reuse) the channel; raises when the broker is unreachable."""
        self._open_channel()

    def close(self) -> None:
        """Drop the connection; the next batch reconnects."""
        connection, self._connection = self._connection, None
        self._channel = self._probe = None
        self._declared.clear()
        self._exchanges = {""}
        if connection is not None:
            try:
                connection.release()
            except Exception:  # the connection is already broken; nothing to save
                logger.debug("error while closing a broken connection", exc_info=True)

    # -- internals -------------------------------------------------------------

    def _publish_batch(
        self, messages: Sequence[StoredMessage], budget: Budget
    ) -> dict[int, PublishResult]:
        channel = self._open_channel()
        # Delivery tags count every publish on the channel since confirm_select.
        confirms = self._confirms = _Confirms(self._next_tag)
        for message in messages:
            if not budget.keep_going():
                confirms.results[message.id] = PublishResult(
                    message.id, Outcome.NOT_SENT
                )
                continue
            failure = self._prepare_route(message)
            if failure is not None:
                confirms.results[message.id] = failure
                continue
            self._send(channel, message, budget.deadline())
            if self._confirm:
                confirms.sent(message)
                self._next_tag = confirms.next_tag
            else:
                confirms.results[message.id] = PublishResult(
                    message.id, Outcome.PUBLISHED
                )
        self._await(budget)
        return confirms.results

    def _isolate(
        self,
        messages: Sequence[StoredMessage],
        known: dict[int, PublishResult],
        budget: Budget,
    ) -> list[PublishResult]:
        results: list[PublishResult] = []
        for message in messages:
            if message.id in known:
                results.append(known[message.id])
                continue
            try:
                results.append(self._publish_batch([message], budget)[message.id])
            except amqp_errors.ChannelError as exc:
                self._drop_channel()
                outcome = Outcome.OUTAGE if is_outage(exc) else Outcome.FAILED
                results.append(PublishResult(message.id, outcome, describe(exc)))
            except Exception as exc:
                if not is_outage(exc):
                    raise
                self.close()
                results.append(PublishResult(message.id, Outcome.OUTAGE, describe(exc)))
        return results

    def _open_channel(self) -> Any:
        if self._channel is not None and self._channel.is_open:
            return self._channel
        if self._connection is None:
            connection = self._connect()
            connection.ensure_connection(max_retries=0)
            self._connection = connection
        channel = self._connection.connection.channel()
        if self._confirm:
            channel.confirm_select()
            channel.events["basic_ack"].add(self._on_ack)
            channel.events["basic_nack"].add(self._on_nack)
        channel.events["basic_return"].add(self._on_return)
        self._channel = channel
        self._next_tag = 1
        return channel

    def _drop_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None and channel.is_open:
            try:
                channel.close()
            except Exception:
                logger.debug("error while closing a channel", exc_info=True)

    def _prepare_route(self, message: StoredMessage) -> PublishResult | None:
        """Declare the message's queues and check its exchange, once per connection.

        This runs on a separate channel: when the broker refuses a declaration it
        closes that channel, and the publishing channel with its pending confirms
        must survive that.
        """
        envelope = message.envelope
        try:
            for name in envelope.declare:
                if name not in self._declared:
                    queue = self._resolve_queue(name)
                    if queue is not None:
                        queue(self._probe_channel()).declare()
                        self._exchanges.add(queue.exchange.name)
                    self._declared.add(name)
            if envelope.exchange not in self._exchanges:
                self._probe_channel().exchange_declare(
                    envelope.exchange, "direct", passive=True
                )
                self._exchanges.add(envelope.exchange)
        except amqp_errors.ChannelError as exc:
            if is_outage(exc) or not _about_declaration(exc):
                # While we waited for the probe's answer the broker closed the
                # publishing channel: that error belongs to the batch, not to this message.
                raise
            self._probe = None
            return PublishResult(message.id, Outcome.FAILED, describe(exc))
        return None

    def _probe_channel(self) -> Any:
        if self._probe is None or not self._probe.is_open:
            self._open_channel()
            self._probe = self._connection.connection.channel()
        return self._probe

    def _send(self, channel: Any, message: StoredMessage, deadline: float) -> None:
        envelope = message.envelope
        body = amqp.Message(
            envelope.body,
            content_type=envelope.content_type,
            content_encoding=envelope.content_encoding,
            application_headers=as_dict(envelope.headers),
            priority=envelope.priority,
            **envelope_properties(message),
        )
        channel.basic_publish(
            body,
            exchange=envelope.exchange,
            routing_key=envelope.routing_key,
            mandatory=self._mandatory,
            timeout=max(deadline - time.monotonic(), 0.001),
        )

    def _await(self, budget: Budget) -> None:
        """Wait for every confirm, in slices so the relay can heartbeat meanwhile."""
        confirms = self._confirms
        while confirms.waiting:
            budget.keep_going()  # lets the relay touch its liveness file and renew leases
            remaining = budget.deadline() - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    "publisher confirms did not arrive before the send timeout"
                )
            try:
                self._connection.connection.drain_events(timeout=min(remaining, 1.0))
            except TimeoutError:
                continue

    def _on_ack(self, tag: int, multiple: bool) -> None:
        self._confirms.settle(tag, multiple, Outcome.PUBLISHED)

    def _on_nack(self, tag: int, multiple: bool) -> None:
        self._confirms.settle(
            tag, multiple, Outcome.FAILED, "The broker nacked the message."
        )

    def _on_return(
        self, exc: BaseException, exchange: str, routing_key: str, msg: Any
    ) -> None:
        self._confirms.returned(exc, exchange, routing_key, msg)
