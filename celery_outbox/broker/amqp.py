"""RabbitMQ publisher: one long-lived channel, publisher confirms awaited per batch.

A batch is published back to back with ``mandatory`` set, then the relay waits once
for all its confirms. The relay encodes each publish's frames itself
(:mod:`.amqpframes`, the bytes py-amqp would write, once a start-up check showed
that they are) and sends the batch in a few
large writes. A nack or a basic.return fails only that message. If the
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
from amqp import spec
from amqp.method_framing import frame_writer

from ..envelope import StoredMessage, as_dict
from ..outcomes import Outcome, PublishResult
from ..queues import queues_to_declare
from .amqpframes import PublishEncoder
from .base import (
    Budget,
    ResourceAlarm,
    broker_condition,
    describe,
    envelope_properties,
    explain,
    is_outage,
)
from .failover import OnNodes, connect, node_lost

logger = logging.getLogger("celery_outbox.broker")


class _Confirms:
    """Delivery tags of one channel's unconfirmed messages, and what came back."""

    def __init__(self, first_tag: int = 1) -> None:
        self.next_tag = first_tag
        self.by_tag: dict[int, StoredMessage] = {}  # unconfirmed delivery tag -> row
        #: (exchange, routing key) -> delivery tags sent there, in publish order
        self.by_route: dict[tuple[str, str], list[int]] = {}
        self.results: dict[int, PublishResult] = {}
        #: Ids of the messages handed to the connection (confirmed or not).
        self.written: set[int] = set()

    def sent(self, message: StoredMessage) -> None:
        envelope = message.envelope
        self.by_tag[self.next_tag] = message
        route = (envelope.exchange, envelope.routing_key)
        self.by_route.setdefault(route, []).append(self.next_tag)
        self.next_tag += 1

    def settle(
        self, tag: int, multiple: bool, outcome: Outcome, error: str = ""
    ) -> None:
        tags = [t for t in self.by_tag if t <= tag] if multiple else [tag]
        for t in tags:
            message = self.by_tag.pop(t, None)
            if message is not None and message.id not in self.results:
                self.results[message.id] = PublishResult(message.id, outcome, error)

    def returned(
        self, exc: BaseException, exchange: str, routing_key: str, message: Any
    ) -> None:
        row = self._returned_row(exchange, routing_key, message)
        if row is None:  # without confirms nothing waits: the batch already counted
            logger.debug(
                "returned message matches no unconfirmed one (exchange=%r, "
                "routing_key=%r)",
                exchange,
                routing_key,
            )
            return
        self.results[row.id] = PublishResult(
            row.id,
            Outcome.FAILED,
            f"Unroutable: {describe(exc)} (exchange={exchange!r}, "
            f"routing_key={routing_key!r}); no queue is bound for it.",
        )

    def _returned_row(
        self, exchange: str, routing_key: str, message: Any
    ) -> StoredMessage | None:
        """The row a ``basic.return`` belongs to.

        The broker returns a message before it confirms it, so the row is among the
        unconfirmed ones sent to that exchange and routing key. Rows there may share a
        task id (a caller's own id, or no id header at all): the returned body and id
        header pick the right one; only rows identical in both are taken in publish
        order, and for those it makes no difference which one is retried.
        """
        waiting = [
            self.by_tag[tag]
            for tag in self.by_route.get((exchange, routing_key), ())
            if tag in self.by_tag and self.by_tag[tag].id not in self.results
        ]
        body = getattr(message, "body", None)
        if isinstance(body, str):
            body = body.encode(getattr(message, "content_encoding", None) or "utf-8")
        task_id = (getattr(message, "headers", None) or {}).get("id")

        def likeness(row: StoredMessage) -> tuple[bool, bool]:
            envelope = row.envelope
            return envelope.body == body, as_dict(envelope.headers).get("id") == task_id

        return max(waiting, key=likeness, default=None)  # the first of the likest

    @property
    def waiting(self) -> bool:
        return bool(self.by_tag)


class HeldFrames:
    """A py-amqp frame writer that holds a batch's ``basic.publish`` frames, then sends
    them in a few large writes instead of one socket write per message.

    py-amqp takes it as its ``frame_writer`` (a documented connection argument). The
    relay hands it the publishes it encoded itself (:meth:`publish`, see
    :mod:`.amqpframes`) and py-amqp the rest. Any other method (a declaration,
    ``channel.close``...) first sends what is held, so frames always leave in order;
    nothing is held while the relay waits for replies.
    """

    #: Send what is held once it reaches this many bytes.
    FLUSH_AT = 256 * 1024

    def __init__(self) -> None:
        self._holding = False
        self._this_frame_held = False
        self._held = bytearray()
        self._transport: Any = None
        #: Frames handed to :meth:`write` or :meth:`publish` so far: an error raised
        #: while this stands still came before any byte of the publish was written.
        self.reached = 0

    def __call__(self, connection: Any, transport: Any) -> Callable[..., Any]:
        """The writer for a new connection (py-amqp calls this when it connects)."""
        self._transport = transport
        self._held.clear()
        standard = frame_writer(connection, self)

        def write_frame(
            type_: int, channel: int, method_sig: Any, args: Any, content: Any
        ) -> Any:
            held = self._holding and method_sig == spec.Basic.Publish
            if not held:
                self.flush()
            self._this_frame_held = held
            try:
                return standard(type_, channel, method_sig, args, content)
            finally:
                self._this_frame_held = False

        return write_frame

    def write(self, data: Any) -> None:
        """What the standard writer calls with each encoded frame."""
        self.reached += 1
        if self._this_frame_held:
            self._hold(data)
        else:
            self._transport.write(data)

    def publish(self, frames: bytes) -> None:
        """The frames of one ``basic.publish``, encoded already: held like py-amqp's."""
        self.reached += 1
        if self._holding:
            self._hold(frames)
        else:
            self.flush()
            self._transport.write(frames)

    def _hold(self, data: Any) -> None:
        self._held += data
        if len(self._held) >= self.FLUSH_AT:
            self.flush()

    def hold(self) -> None:
        """Hold ``basic.publish`` frames from now on."""
        self._holding = True

    def release(self, timeout: float | None = None) -> None:
        """Stop holding and send what is held, within ``timeout`` seconds."""
        self._holding = False
        if not self._held or timeout is None:
            self.flush()
            return
        with self._transport.having_timeout(timeout):
            self.flush()

    def discard(self) -> None:
        """Stop holding and drop what is held (the batch failed before it was sent)."""
        self._holding = False
        self._held.clear()

    def flush(self) -> None:
        """Send what is held now."""
        if self._held:
            data = bytes(self._held)
            self._held.clear()
            self._transport.write(data)


def _skip_poll_before_each_publish(connection: Any) -> None:
    """Stop py-amqp reading the socket before every publish on ``connection``.

    When ``connection.blocked`` was negotiated, py-amqp tries a non-blocking read
    before each ``basic_publish`` to notice a "blocked" notification early: three
    system calls a message, a quarter of the relay's time. The relay reads the socket
    after every batch anyway (for the confirms), where py-amqp handles such a
    notification, so only this client-side check is turned off; the broker still
    sends the notifications.
    """
    capabilities = getattr(connection, "client_properties", {}).get("capabilities")
    if isinstance(capabilities, dict):
        capabilities["connection.blocked"] = False


def _about_declaration(exc: amqp_errors.AMQPError) -> bool:
    """Whether a channel error answers an exchange or queue declaration (the probe's)."""
    method = str(getattr(exc, "method_name", "") or "")
    return method.startswith(("Exchange.", "Queue."))


class AmqpPublisher(OnNodes):
    """Publishes over py-amqp with batched publisher confirms."""

    def __init__(
        self,
        connect: Callable[[], Any],
        resolve_queue: Callable[[str], Any],
        *,
        confirm: bool = True,
        mandatory: bool = True,
        encoder: PublishEncoder | None = None,
    ) -> None:
        """``connect`` returns a new kombu Connection; ``resolve_queue`` maps a name to a Queue.

        ``encoder`` puts each publish into frames: by default the relay's own encoder
        once its start-up check passed, else py-amqp (see :mod:`.amqpframes`).
        """
        #: How publishes are encoded; ``PublishEncoder(None)`` leaves all to py-amqp.
        self.encoder = encoder or PublishEncoder()
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
        self._frames = HeldFrames()
        #: Set while the broker has blocked the connection (a resource alarm).
        self._blocked: str | None = None
        #: The node of the current connection (URL, password masked), or the last one.
        self.node = ""
        #: The connection broke under a batch, and other nodes may answer.
        self._node_lost = False

    # -- Publisher -------------------------------------------------------------

    def _publish(
        self, messages: Sequence[StoredMessage], budget: Budget
    ) -> list[PublishResult]:
        """One batch on one connection; see the module docstring for how failures are
        isolated."""
        try:
            results = self._publish_batch(messages, budget)
        except amqp_errors.ChannelError as exc:
            if is_outage(exc):
                return self._outage(messages, exc)
            logger.warning(
                "Channel closed by the broker (%s); isolating the batch", describe(exc)
            )
            self._drop_channel()
            results = self._confirms.results
            return self._isolate(messages, results, budget)
        except Exception as exc:
            if not is_outage(exc):
                raise
            return self._outage(messages, exc)
        return [results[m.id] for m in messages]

    def _outage(
        self, messages: Sequence[StoredMessage], exc: BaseException
    ) -> list[PublishResult]:
        """Results of a batch whose connection failed: no attempt is used.

        What the broker confirmed before stays published (sending it again would
        only make a duplicate). The rest is an outage, ``in_flight`` when it was
        written to the connection and the failure may be its own (a frame the broker
        cannot take); never for a broker condition (credentials, alarm, TLS...).
        """
        known = self._confirms.results
        written = self._confirms.written
        condition = self._blocked is not None or broker_condition(exc) is not None
        # The node was up and went away (not an alarm: that holds the whole cluster).
        self._node_lost = self._blocked is None and node_lost(self._connection, exc)
        self.close()
        error = explain(exc)
        logger.warning("broker outage, no attempt used: %s", error)
        return [
            known.get(m.id)
            or PublishResult(
                m.id,
                Outcome.OUTAGE,
                error,
                in_flight=not condition and m.id in written,
            )
            for m in messages
        ]

    def ping(self) -> str:
        """Open (or reuse) the channel; raises when the broker is unreachable.

        Returns the node that answered (a URL, its password masked).
        """
        self.encoder.check()  # at start: its warning, if any, comes with the relay's
        self._open_channel()
        return self.node

    def depth(self, queues: Sequence[str]) -> dict[str, int]:
        """Messages ready in each of ``queues`` (a passive declare each, on the
        probe channel, which a missing queue closes: it holds none)."""
        self._open_channel()
        found: dict[str, int] = {}
        for name in queues:
            try:
                found[name] = int(
                    self._probe_channel()
                    .queue_declare(name, passive=True)
                    .message_count
                )
            except amqp_errors.NotFound:
                self._probe = None
                found[name] = 0
        return found

    def close(self) -> None:
        """Drop the connection; the next batch reconnects."""
        connection, self._connection = self._connection, None
        self._channel = self._probe = None
        self._blocked = None
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
        # Nothing an earlier batch left may answer for this one, even when opening
        # the channel fails.
        self._confirms = _Confirms()
        channel = self._open_channel(budget.keep_going)
        # Delivery tags count every publish on the channel since confirm_select.
        confirms = self._confirms = _Confirms(self._next_tag)
        written: list[StoredMessage] = []  # without confirms
        self._frames.hold()
        try:
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
                refused = self._send(channel, message)
                if refused is not None:
                    confirms.results[message.id] = refused
                    continue
                confirms.written.add(message.id)
                if self._confirm:
                    confirms.sent(message)
                    self._next_tag = confirms.next_tag
                else:
                    written.append(message)
        except BaseException:
            self._frames.discard()
            raise
        self._frames.release(max(budget.deadline() - time.monotonic(), 0.001))
        if written:
            self._barrier(channel)
        # Without confirms, a message counts as sent once the broker answered a
        # method sent after it, not when its frames were written: a broker that
        # closes the connection over one frame drops the frames after it unread.
        for message in written:
            confirms.results[message.id] = PublishResult(message.id, Outcome.PUBLISHED)
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
                if is_outage(exc):
                    results.extend(self._outage([message], exc))
                    continue
                self._drop_channel()
                results.append(PublishResult(message.id, Outcome.FAILED, describe(exc)))
            except Exception as exc:
                if not is_outage(exc):
                    raise
                results.extend(self._outage([message], exc))
        return results

    def _barrier(self, channel: Any) -> None:
        """A round trip on the publishing channel, answered after its publishes.

        The broker handles a channel's methods in order, so once ``basic.qos`` is
        answered it has taken every publish sent before it; if it closes the
        connection instead, this raises.
        """
        channel.basic_qos(0, 0, False)

    def _open_channel(self, between: Callable[[], object] | None = None) -> Any:
        """The publishing channel; connecting first tries every node of a failover
        list (``between`` runs between two nodes)."""
        if self._channel is not None and self._channel.is_open:
            return self._channel
        if self._connection is None:
            connection = self._connect()
            # py-amqp builds its frame writer with this when it connects (a new
            # dict: the one given may be shared with the app's other connections).
            connection.transport_options = {
                **(connection.transport_options or {}),
                "frame_writer": self._frames,
            }
            self.node = connect(connection, between)
            _skip_poll_before_each_publish(connection.connection)
            connection.connection.on_blocked = self._on_blocked
            connection.connection.on_unblocked = self._on_unblocked
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
            for name, queue in queues_to_declare(
                envelope.declare, envelope.declare_specs, self._resolve_queue
            ):
                if name not in self._declared:
                    if queue is not None:
                        queue(self._probe_channel()).declare()
                        # A queue with several bindings has no exchange of its own.
                        self._exchanges.update(
                            each.exchange.name
                            for each in (queue, *(queue.bindings or ()))
                            if each.exchange is not None
                        )
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

    def _send(self, channel: Any, message: StoredMessage) -> PublishResult | None:
        """Encode one publish; its frames are held until the batch is released.

        Returns a failure when the message cannot be put into AMQP frames at all (an
        integer header beyond 64 bits, a name or routing key over 255 bytes, a
        priority that is no number): py-amqp refuses it before any byte of it is
        written, so it fails alone and the channel's delivery tags stay in step.
        """
        envelope = message.envelope
        reached = self._frames.reached
        try:
            connection = channel.connection
            if connection is None:
                raise amqp_errors.RecoverableConnectionError(
                    "basic_publish: connection closed"
                )
            properties = dict(
                content_type=envelope.content_type,
                content_encoding=envelope.content_encoding,
                application_headers=as_dict(envelope.headers),
                priority=envelope.priority,
                **envelope_properties(message),
            )
            frames = self.encoder.frames(
                channel.channel_id,
                connection.frame_max,
                envelope.exchange,
                envelope.routing_key,
                self._mandatory,
                envelope.body,
                properties,
            )
            if frames is not None:
                self._frames.publish(frames)
                # As py-amqp's writer counts every frame write: it decides heartbeats.
                connection.bytes_sent += 1
            else:
                channel.basic_publish(
                    amqp.Message(envelope.body, **properties),
                    exchange=envelope.exchange,
                    routing_key=envelope.routing_key,
                    mandatory=self._mandatory,
                )
        except Exception as exc:
            # py-amqp's own errors are about the channel or the connection, except
            # the one its table encoder raises for a value of no AMQP type.
            about_the_message = isinstance(
                exc, amqp_errors.FrameSyntaxError
            ) or not isinstance(exc, (OSError, amqp_errors.AMQPError))
            if not about_the_message or self._frames.reached != reached:
                raise  # the batch's error: the relay's usual paths handle it
            return PublishResult(
                message.id,
                Outcome.FAILED,
                f"The message cannot be encoded for AMQP: {describe(exc)}. Check its "
                f"headers, properties, exchange and routing key.",
            )
        return None

    def _await(self, budget: Budget) -> None:
        """Wait for every confirm, in slices of at most a second so the relay can
        touch its liveness file and renew leases meanwhile.

        The socket's timeout is set once per slice, not once per frame read: acks
        arrive as many small frames, and each timeout change is a system call.
        """
        confirms = self._confirms
        connection = self._connection.connection
        while confirms.waiting:
            budget.keep_going()
            remaining = budget.deadline() - time.monotonic()
            if remaining <= 0 and self._blocked is not None:
                raise ResourceAlarm(self._blocked)
            if remaining <= 0:
                raise TimeoutError(
                    "publisher confirms did not arrive before the send timeout"
                )
            slice_seconds = min(remaining, 1.0)
            slice_end = time.monotonic() + slice_seconds
            with connection.transport.having_timeout(slice_seconds):
                while confirms.waiting and time.monotonic() < slice_end:
                    try:
                        connection.drain_events(timeout=None)
                    except TimeoutError:
                        break

    def _on_blocked(self, reason: str) -> None:
        logger.warning("the broker blocked publishing: %s", reason)
        self._blocked = reason

    def _on_unblocked(self) -> None:
        logger.info("the broker unblocked publishing")
        self._blocked = None

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
