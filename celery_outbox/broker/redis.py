"""Redis publisher: a batch is one pipeline of ``LPUSH`` commands, written directly.

Each list the batch reaches gets one ``LPUSH`` with all its messages, in order (a
new one past a megabyte). Each message is the JSON document kombu's Redis transport
writes for a publish (base64 body, headers, properties with the delivery info and a
fresh delivery tag), so workers cannot tell it from a message Celery sent itself.
Each copy of a message that reaches several lists has a delivery tag of its own
(:func:`_delivery_tags`), where kombu gives all the copies of one publish the same.
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
import dataclasses
import json
import os
import reprlib
from collections.abc import Iterator, Sequence
from typing import Any

from ..envelope import (
    Envelope,
    JsonObject,
    StoredMessage,
    as_dict,
    dump_json,
    json_text,
)
from ..outcomes import Outcome, PublishResult
from .base import Budget, broker_condition, describe, envelope_properties
from .kombu import KombuPublisher, logger

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

    #: An ``LPUSH`` takes the batch's next messages for its list until their text
    #: passes this many bytes; then the list's next ``LPUSH`` starts. Redis reads a
    #: whole command into memory before it runs it.
    PUSH_BYTES = 1024 * 1024
    #: Whether the direct path may be used at all; False sends every message through
    #: kombu's ``Producer`` (the benchmark compares both).
    direct = True
    #: The start-up check's verdict on this publisher; None until it ran.
    _checked: bool | None = None

    def ping(self) -> str:
        """Connect (or reuse the connection) and check the direct path now.

        Returns the node that answered (a URL, its password masked).
        """
        self._direct_path(self._open().channel)
        return self.node

    def _publish_batch(
        self, producer: Any, messages: Sequence[StoredMessage], budget: Budget
    ) -> list[PublishResult] | None:
        """One pipeline for the batch; the broker took it once it executed."""
        channel = producer.channel
        if not self._direct_path(channel):
            return super()._publish_batch(producer, messages, budget)
        return self._pipelined(producer, channel, messages, budget)

    def _send(self, producer: Any, message: StoredMessage) -> None:
        """kombu's ``Producer`` path: a copy per list, by name, where the direct path
        names each copy's list (:func:`_delivery_infos`); else as kombu routes it."""
        envelope = message.envelope
        self._declare(producer, envelope)
        channel = producer.channel
        exchange = envelope.exchange
        if exchange and channel.typeof(exchange).type in ("direct", "topic"):
            queues = sorted(channel._lookup(exchange, envelope.routing_key))
            if queues and names_its_list(channel, exchange, queues):
                for queue in queues:
                    self._produce(producer, message, "", queue)
                return
        self._produce(producer, message, exchange, envelope.routing_key)

    def _direct_path(self, channel: Any) -> bool:
        """Whether batches on ``channel`` take the direct path; checks it the first time."""
        if not (self.direct and direct_path_available(channel)):
            return False
        if self._checked is None:
            problem = direct_path_problem(channel)
            if problem is not None:
                logger.warning(
                    "The relay's direct Redis path does not match this kombu's Redis "
                    "transport (%s); kombu's Producer publishes every message "
                    "instead. This costs speed, not correctness.",
                    problem,
                )
            self._checked = problem is None
        return self._checked

    def _pipelined(
        self,
        producer: Any,
        channel: Any,
        messages: Sequence[StoredMessage],
        budget: Budget,
    ) -> list[PublishResult]:
        routes: dict[tuple[str, str], list[str] | None] = {}
        #: Per route, the delivery info of the copy each list gets (by queue).
        infos: dict[tuple[str, str], dict[str, str]] = {}
        # One tag per copy: drawn for one copy per message, more when needed.
        tags = _delivery_tags(len(messages))
        pushes = _Pushes(self.PUSH_BYTES)
        sent: list[tuple[StoredMessage, list[int]]] = []  # with its pushes
        by_kombu: list[StoredMessage] = []
        unrouted: list[StoredMessage] = []
        with channel.conn_or_acquire() as client:
            for message in messages:
                if not budget.keep_going():
                    break
                envelope = message.envelope
                if self._declare(producer, envelope):
                    routes.clear()  # a new binding may change a cached route
                key = (envelope.exchange, envelope.routing_key)
                if key not in routes:
                    routes[key] = _route(channel, *key)
                    infos[key] = _delivery_infos(channel, *key, routes[key] or [])
                queues = routes[key]
                if queues is None:
                    by_kombu.append(message)
                    continue
                if not queues:
                    # kombu would drop it without a word: nothing was published.
                    unrouted.append(message)
                    continue
                used = []
                for queue in queues:
                    info = infos[key][queue]
                    payload, priority = _payload(message, next(tags), info)
                    used.append(
                        pushes.add(channel._q_for_pri(queue, priority), payload)
                    )
                sent.append((message, used))
            # Every push runs even when one is refused (a key of another type): the
            # refusals come back as values, so only the messages of that push fail,
            # and the rest, already in their lists, are not sent again. Lost
            # connections still raise.
            replies = pushes.execute(client) if sent else []
        done: dict[int, PublishResult] = {}
        for message, used in sent:
            errors = [
                replies[index]
                for index in used
                if isinstance(replies[index], Exception)
            ]
            done[message.id] = _pushed(message, errors)
        outages = [r for r in done.values() if r.outcome is Outcome.OUTAGE]
        if outages:
            logger.warning("broker outage, no attempt used: %s", outages[0].error)
            # A server that refuses every push (a replica, a primary without its
            # replicas after a failover) stays so on this connection: the next batch
            # connects again, to the primary Sentinel or the DNS name points at now.
            self.close()
        for message in by_kombu:
            done[message.id] = self._one_by_one([message], budget)[0]
        for message in unrouted:
            envelope = message.envelope
            done[message.id] = PublishResult(
                message.id,
                Outcome.FAILED,
                f"No queue is bound to exchange {envelope.exchange!r} with routing key "
                f"{envelope.routing_key!r}: Redis would drop the message. Declare the "
                f"queue (task_queues, or queue=Queue(...) at the call).",
            )
        return [
            done.get(m.id) or PublishResult(m.id, Outcome.NOT_SENT) for m in messages
        ]


class _Pushes:
    """A batch's ``LPUSH`` commands: one per list, with all its messages in order.

    ``LPUSH key a b c`` leaves the list as ``LPUSH key a``, ``LPUSH key b``, ``LPUSH
    key c`` would, in one command: one reply to read instead of one per message, and
    all or none of the values are pushed. Past ``limit`` bytes a list's command is
    closed and the next message for that list starts another one, sent after it.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._commands: list[tuple[str, list[str]]] = []
        self._sizes: list[int] = []
        self._open: dict[str, int] = {}

    def add(self, key: str, payload: str) -> int:
        """Push ``payload`` onto list ``key``; returns the index of the command that does."""
        index = self._open.get(key)
        if index is None or self._sizes[index] + len(payload) > self._limit:
            index = len(self._commands)
            self._commands.append((key, []))
            self._sizes.append(0)
            self._open[key] = index
        self._commands[index][1].append(payload)
        self._sizes[index] += len(payload)
        return index

    def execute(self, client: Any) -> list[Any]:
        """Send every command in one pipeline; a reply per command (a refusal as its exception)."""
        pipe = client.pipeline(transaction=False)
        for key, payloads in self._commands:
            pipe.lpush(key, *payloads)
        return list(pipe.execute(raise_on_error=False))


def _pushed(message: StoredMessage, errors: Sequence[Exception]) -> PublishResult:
    """A message's result from the replies to its pushes.

    A refusal about the server or the user (a replica, ``NOPERM``, ``LOADING``) is
    an outage: every message would meet it, and none is to blame.
    """
    if not errors:
        return PublishResult(message.id, Outcome.PUBLISHED)
    condition = broker_condition(errors[0])
    if condition is not None:
        return PublishResult(message.id, Outcome.OUTAGE, condition)
    return PublishResult(message.id, Outcome.FAILED, describe(errors[0]))


def direct_path_available(channel: Any) -> bool:
    """Whether ``channel`` is a kombu Redis channel the direct path knows how to use."""
    return all(hasattr(channel, name) for name in CHANNEL_API) and (
        channel.body_encoding == "base64"
    )


def _samples() -> list[tuple[StoredMessage, int]]:
    """Messages :func:`direct_path_problem` writes, with the priority each goes out with:
    one as the enqueue path builds it, one as a claim reads it from the table."""
    headers = {
        "lang": "py",
        "task": "shop.send_receipt",
        "id": "b1e4a0c2-0000-4000-8000-000000000001",
        "eta": None,
        "retries": 0,
        "timelimit": [None, 30.5],
        "ignore_result": False,
        "stamps": {"tenant": ["a", 1]},
        "argsrepr": "(42, 'déjà vu')",
    }
    properties = {
        "correlation_id": "b1e4a0c2-0000-4000-8000-000000000001",
        "reply_to": "6c7f2b1e-1d4b-3f0a-9a53-5d1c1e0c2a11",
        "delivery_mode": 2,
    }
    built = Envelope(
        task_id=str(headers["id"]),
        task_name="shop.send_receipt",
        exchange="",
        routing_key="celery",
        body=b'[[42], {}, {"callbacks": null}]',
        content_type="application/json",
        content_encoding="utf-8",
        headers=headers,
        properties={**properties, "priority": 0},
    )
    claimed = dataclasses.replace(
        built,
        routing_key="celery-outbox-check",
        body=bytes(range(256)),
        content_type="application/x-msgpack",
        content_encoding="binary",
        headers=JsonObject(dump_json(headers)),
        properties=JsonObject(
            dump_json({**properties, "delivery_mode": 1, "priority": 7})
        ),
    )
    return [(StoredMessage(1, 0, built), 0), (StoredMessage(2, 0, claimed), 7)]


def direct_path_problem(channel: Any) -> str | None:
    """What keeps the direct path from writing, on ``channel``, documents kombu reads
    back as the messages sent; None when nothing does.

    kombu's channel must answer its private names (``_q_for_pri``, ``_lookup``,
    ``_expires``) as the direct path expects, the documents must have the fields of
    kombu's own (``prepare_message``), and kombu's consumer side
    (``message_to_python``) must read each sample document back as its message.
    """
    try:
        if channel._q_for_pri("celery", 0) != "celery":
            return "the list of priority 0 is not the queue's own"
        if not isinstance(channel._q_for_pri("celery", 7), str):
            return "a priority's list has no name"
        if list(channel._lookup("", "celery")) != ["celery"]:
            return "the default exchange routes elsewhere"
        if "celery-outbox-check" in channel._expires:
            return "an expiry is known for a queue that does not exist"
        fields = channel.prepare_message(b"", 0, "", "", {}, {}).keys()
        for message, priority in _samples():
            envelope = message.envelope
            route = {"exchange": envelope.exchange, "routing_key": envelope.routing_key}
            tag = next(_delivery_tags(1))
            document = json.loads(_payload(message, tag, json.dumps(route))[0])
            if document.keys() != fields:
                return f"kombu writes the fields {sorted(fields)}"
            read = channel.message_to_python(document)
            expected = as_dict(envelope.properties)
            pairs = {
                "body": (read.body, envelope.body),
                "headers": (read.headers, as_dict(envelope.headers)),
                "content type": (read.content_type, envelope.content_type),
                "encoding": (read.content_encoding, envelope.content_encoding),
                "delivery info": (read.delivery_info, route),
                "delivery tag": (read.delivery_tag, tag),
                "priority": (read.properties.get("priority"), priority),
                "delivery mode": (
                    read.properties.get("delivery_mode"),
                    expected["delivery_mode"],
                ),
                "correlation id": (
                    read.properties.get("correlation_id"),
                    expected["correlation_id"],
                ),
            }
            for name, (got, sent) in pairs.items():
                if got != sent:
                    return (
                        f"kombu reads a sample message's {name} as {reprlib.repr(got)}"
                    )
    except Exception as exc:
        return f"the check raised {exc!r}"
    return None


def _route(channel: Any, exchange: str, routing_key: str) -> list[str] | None:
    """The lists a publish to ``exchange`` with ``routing_key`` lands in; None: use kombu."""
    if exchange and channel.typeof(exchange).type not in ("direct", "topic"):
        return None  # fanout: PUBLISH to subscribers, kombu's business
    queues = sorted(channel._lookup(exchange, routing_key))
    if any(queue in channel._expires for queue in queues):
        return None  # queues with x-expires also get PEXPIRE commands
    return queues


def _delivery_infos(
    channel: Any, exchange: str, routing_key: str, queues: Sequence[str]
) -> dict[str, str]:
    """The delivery info each list's copy carries, by queue (JSON).

    kombu's Redis transport puts a copy a worker took and did not acknowledge back by
    routing its delivery info again (``restore_visible``, ``restore_unacked``: a
    worker killed, a visibility timeout passed). Through an exchange the restoring
    channel has not declared (the events exchange, a worker's channel never does),
    that routing finds no list and the copy is dropped; through an exchange that
    routes to several lists, every list gets the copy again. So a copy that is one
    of several, or routed by a topic, names its own list (the default exchange, the
    queue as routing key), as a message published to that queue by name would: it
    is put back where it was, and only there. A direct route to one list keeps the
    exchange and routing key, as kombu writes them.
    """
    if not names_its_list(channel, exchange, queues):
        kept = json.dumps({"exchange": exchange, "routing_key": routing_key})
        return dict.fromkeys(queues, kept)
    return {
        queue: json.dumps({"exchange": "", "routing_key": queue}) for queue in queues
    }


def names_its_list(channel: Any, exchange: str, queues: Sequence[str]) -> bool:
    """Whether each copy of a publish to ``exchange`` that lands in ``queues`` must
    name its own list (see :func:`_delivery_infos`): all but the default exchange
    and a direct route to one list."""
    return bool(exchange) and not (
        len(queues) == 1 and channel.typeof(exchange).type == "direct"
    )


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
    """Random version-4 UUIDs as text, without end: ``count`` from each call to the
    system's RNG.

    Every copy takes its own. kombu's Redis transport keeps a message a worker took
    and has not acknowledged in its ``unacked`` hash by delivery tag, and an ack
    deletes that tag's entry: copies in several lists that shared one tag (what
    kombu's own publish to a topic or direct exchange gives them) shared one entry,
    so the first service to acknowledge its copy deleted the entry of every other.
    A worker of another service killed while it ran its copy then left nothing to
    put back: the copy was lost, never delivered again.
    """
    count = max(count, 1)
    while True:
        data = os.urandom(16 * count)
        for start in range(0, 16 * count, 16):
            raw = bytearray(data[start : start + 16])
            raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
            raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
            text = raw.hex()
            yield f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"
