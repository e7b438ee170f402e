"""Redis publisher: a batch is one pipeline of ``LPUSH`` commands, written directly.

The message each ``LPUSH`` carries is the JSON document kombu's Redis transport
writes for a publish (base64 body, headers, properties with the delivery info and a
fresh delivery tag), so workers cannot tell it from a message Celery sent itself.
What depends on the broker's state -- which lists an exchange routes a key to, the
list of each priority, the key prefix -- is asked of kombu's Redis channel, once per
exchange and routing key in a batch. The stored headers go out as their stored text,
never decoded and encoded again.

Messages outside that common shape (a fanout exchange, a queue with an expiry, a
transport configured with another body encoding) are published through kombu's
``Producer`` like any other transport, in the same batch.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from ..envelope import JsonObject, StoredMessage, json_text
from ..relay.core import Outcome, PublishResult
from .base import Budget, describe, envelope_properties
from .kombu import KombuPublisher

#: What the direct path asks of kombu's Redis channel; a kombu without one of them
#: gets the ``Producer`` path for every message.
CHANNEL_API = (
    "conn_or_acquire",
    "typeof",
    "_lookup",
    "_q_for_pri",
    "_expires",
    "body_encoding",
)

#: AMQP's persistent delivery mode, kombu's default for a message that names none.
PERSISTENT = 2
_DELIVERY_MODES = {"persistent": 2, "transient": 1}


class RedisPublisher(KombuPublisher):
    """Publishes to kombu's Redis transport with one pipeline per batch."""

    def _publish_batch(
        self, producer: Any, messages: Sequence[StoredMessage], budget: Budget
    ) -> list[PublishResult] | None:
        """One pipeline for the batch; the broker took it once it executed."""
        channel = producer.channel
        if not direct_path_available(channel):
            return super()._publish_batch(producer, messages, budget)
        return self._pipelined(producer, channel, messages, budget)

    def _pipelined(
        self,
        producer: Any,
        channel: Any,
        messages: Sequence[StoredMessage],
        budget: Budget,
    ) -> list[PublishResult]:
        routes: dict[tuple[str, str], list[str] | None] = {}
        infos: dict[tuple[str, str], str] = {}
        tags = _delivery_tags(len(messages))
        sent: list[tuple[StoredMessage, int]] = []  # with its number of pushes
        by_kombu: list[StoredMessage] = []
        with channel.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            for message in messages:
                if not budget.keep_going():
                    break
                envelope = message.envelope
                if self._declare(producer, envelope.declare):
                    routes.clear()  # a new binding may change a cached route
                key = (envelope.exchange, envelope.routing_key)
                if key not in routes:
                    routes[key] = _route(channel, *key)
                    infos[key] = json.dumps({"exchange": key[0], "routing_key": key[1]})
                queues = routes[key]
                if queues is None:
                    by_kombu.append(message)
                    continue
                payload, priority = _payload(message, next(tags), infos[key])
                for queue in queues:
                    pipe.lpush(channel._q_for_pri(queue, priority), payload)
                sent.append((message, len(queues)))
            # Every push runs even when one is refused (a key of another type): the
            # refusals come back as values, so only their messages fail, and the
            # rest, already in their lists, are not sent again. Lost connections
            # still raise.
            replies = iter(pipe.execute(raise_on_error=False) if sent else ())
        done: dict[int, PublishResult] = {}
        for message, pushes in sent:
            errors = [
                reply
                for reply in itertools.islice(replies, pushes)
                if isinstance(reply, Exception)
            ]
            done[message.id] = (
                PublishResult(message.id, Outcome.FAILED, describe(errors[0]))
                if errors
                else PublishResult(message.id, Outcome.PUBLISHED)
            )
        for message in by_kombu:
            done[message.id] = self._one_by_one([message], budget)[0]
        return [
            done.get(m.id) or PublishResult(m.id, Outcome.NOT_SENT) for m in messages
        ]


def direct_path_available(channel: Any) -> bool:
    """Whether ``channel`` is a kombu Redis channel the direct path knows how to use."""
    return all(hasattr(channel, name) for name in CHANNEL_API) and (
        channel.body_encoding == "base64"
    )


def _route(channel: Any, exchange: str, routing_key: str) -> list[str] | None:
    """The lists a publish to ``exchange`` with ``routing_key`` lands in; None: use kombu."""
    if exchange and channel.typeof(exchange).type not in ("direct", "topic"):
        return None  # fanout: PUBLISH to subscribers, kombu's business
    queues = sorted(channel._lookup(exchange, routing_key))
    if any(queue in channel._expires for queue in queues):
        return None  # queues with x-expires also get PEXPIRE commands
    return queues


def _payload(
    message: StoredMessage, delivery_tag: str, delivery_info: str
) -> tuple[str, int]:
    """The JSON kombu's Redis transport would write for this message, and its priority.

    ``delivery_info`` is the JSON of the message's exchange and routing key.
    """
    envelope = message.envelope
    stored = envelope.properties
    values = stored.value if isinstance(stored, JsonObject) else dict(stored)
    priority = values.get("priority")
    mode = values.get("delivery_mode")
    added = (
        f', "body_encoding": "base64", "delivery_tag": "{delivery_tag}", '
        f'"delivery_info": {delivery_info}}}'
    )
    if (
        isinstance(stored, JsonObject)
        and _plain_int(priority)
        and _plain_int(mode)
        and mode
        and values.keys().isdisjoint(_ADDED)
        and stored.text.endswith("}")
    ):
        # The stored text already holds what kombu would write: add to it.
        properties = stored.text[:-1] + added
    else:
        rest = envelope_properties(message)
        if isinstance(mode, str):
            mode = _DELIVERY_MODES.get(mode, mode)
        rest["delivery_mode"] = mode or PERSISTENT
        priority = envelope.priority or 0
        rest["priority"] = priority
        for name in _ADDED:
            rest.pop(name, None)
        properties = json.dumps(rest)[:-1] + added
    payload = "".join(
        (
            '{"body": "',
            base64.b64encode(envelope.body).decode("ascii"),
            '", "content-encoding": ',
            json.dumps(envelope.content_encoding),
            ', "content-type": ',
            json.dumps(envelope.content_type),
            ', "headers": ',
            json_text(envelope.headers),
            ', "properties": ',
            properties,
            "}",
        )
    )
    return payload, max(0, min(int(priority or 0), 9))


#: Properties the transport sets on every publish.
_ADDED = ("body_encoding", "delivery_tag", "delivery_info")


def _plain_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _delivery_tags(count: int) -> Iterator[str]:
    """``count`` random version-4 UUIDs as text, from one call to the system's RNG."""
    data = os.urandom(16 * count)
    for start in range(0, 16 * count, 16):
        raw = bytearray(data[start : start + 16])
        raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
        raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
        text = raw.hex()
        yield f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"
