"""Whether py-amqp can put a message into frames: checked at the call, not at the relay.

JSON stores any integer and any length of text; AMQP does not. A ``basic.publish``
carries the exchange, the routing key and most properties, and ``queue.declare`` the
queue's name, as *short strings* (at most 255 bytes of UTF-8), the priority and the
delivery mode as one byte, and header integers in at most 64 bits. A message outside
those limits can never reach RabbitMQ: the relay would fail it on every attempt and
dead-letter it. When the app's broker is AMQP, the enqueue path asks
:func:`amqp_problem` and refuses such a call inside the caller's transaction instead.

A quick walk accepts the usual message (plain values well within the limits)
without encoding anything. Anything else goes to py-amqp's own encoder, over the
values the relay will send (the stored JSON form of the headers and properties), so
a call is refused only when the relay could not publish it.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import amqp
import amqp.exceptions as amqp_errors
from amqp.serialization import dumps

from ..envelope import Envelope, as_dict, json_text, load_json

#: What py-amqp's encoder raises for a value it has no encoding for.
ENCODING_ERRORS: tuple[type[BaseException], ...] = (
    amqp_errors.FrameSyntaxError,
    struct.error,
    OverflowError,
    TypeError,
    ValueError,
    AttributeError,
)
#: The longest AMQP short string, in bytes.
SHORTSTR_BYTES = 255
#: py-amqp's and RabbitMQ's default largest frame; the broker may lower it, never
#: raise it past what the client asked for.
FRAME_MAX = 131072
#: What a content header frame leaves for the properties: the frame's own 8 bytes,
#: and class, weight, body size and property flags (14 bytes).
HEADER_FRAME_BYTES = FRAME_MAX - 8 - 14


def amqp_problem(envelope: Envelope) -> str | None:
    """Why py-amqp could not encode a publish of ``envelope``, or None if it can.

    The answer is a phrase for an error message (``"its header 'n' holds ..."``).
    """
    headers = as_dict(envelope.headers)
    properties = as_dict(envelope.properties)
    too_big = _frame_problem(envelope, headers, properties)
    if too_big is not None:
        return too_big
    if _plainly_fits(envelope, headers, properties):
        return None  # the common case, without encoding anything
    if _encodes(envelope, headers, properties):
        return None
    # The relay sends the headers and properties the store kept, as JSON: a tuple
    # becomes a list and a number key a string. Judge that form.
    try:
        headers = load_json(json_text(envelope.headers))
        properties = load_json(json_text(envelope.properties))
    except (TypeError, ValueError):
        return None  # not JSON at all: the store says so, in its own words
    if _encodes(envelope, headers, properties):
        return None
    return _pinpoint(envelope, headers, properties)


def _frame_problem(
    envelope: Envelope, headers: Mapping[str, Any], properties: Mapping[str, Any]
) -> str | None:
    """Why the properties cannot fit in one content header frame, or None.

    AMQP never splits that frame: a larger one makes RabbitMQ close the whole
    connection (``frame_too_large``), every time the relay tries.
    """
    stored = len(json_text(envelope.headers)) + len(json_text(envelope.properties))
    if stored * 4 + 1024 < HEADER_FRAME_BYTES:  # no encoding is four times JSON's
        return None
    size = 0
    try:
        sent = _as_relay_sends(envelope, headers, properties)
        for name, kind in amqp.Message.PROPERTIES:
            value = sent.get(name)
            if value is not None:
                size += len(dumps(kind, (value,)))
    except ENCODING_ERRORS:
        return None  # the other checks say what is wrong with it
    if size <= HEADER_FRAME_BYTES:
        return None
    return (
        f"its headers and properties take {size:,} bytes in AMQP, and RabbitMQ "
        f"takes at most {HEADER_FRAME_BYTES:,} in one frame (frame_max "
        f"{FRAME_MAX:,}); pass large values as arguments, not headers"
    )


def shortstr_problem(what: str, value: str) -> str | None:
    """Why ``value`` cannot be an AMQP short string, or None if it can."""
    if len(value) * 4 <= SHORTSTR_BYTES:  # even four bytes a character fit
        return None
    size = len(value.encode("utf-8", "surrogatepass"))
    if size <= SHORTSTR_BYTES:
        return None
    return (
        f"its {what} is {size} bytes long in UTF-8 and AMQP carries at most "
        f"{SHORTSTR_BYTES} bytes there"
    )


#: The AMQP type of each basic property py-amqp sends (the others it leaves out).
_PROPERTY_KINDS = {key: kind for key, kind in amqp.Message.PROPERTIES}
_LONG = 2**63


def _plainly_fits(
    envelope: Envelope, headers: Mapping[str, Any], properties: Mapping[str, Any]
) -> bool:
    """True only when every value is of a plain kind within AMQP's limits.

    A quick walk that never encodes: it answers False for anything unusual (a
    subclass of int, a Decimal, a number key), and :func:`_encodes` then decides.
    """
    names = (
        envelope.exchange,
        envelope.routing_key,
        envelope.content_type,
        envelope.content_encoding,
        *envelope.declare,
    )
    if not all(shortstr_problem("", name) is None for name in names):
        return False
    if not _plain_table(headers):
        return False
    for key, value in properties.items():
        kind = _PROPERTY_KINDS.get(key)
        if kind is None or value is None:
            continue
        value_kind = type(value)
        if kind == "s":
            if value_kind is not str or shortstr_problem("", value) is not None:
                return False
        elif kind == "o":
            if value_kind is not int or not 0 <= value <= 255:
                return False
        else:
            return False
    return True


def _plain_table(table: Mapping[str, Any]) -> bool:
    for key, value in table.items():
        if type(key) is not str or shortstr_problem("", key) is not None:
            return False
        if not _plain_item(value):
            return False
    return True


def _plain_item(value: Any) -> bool:
    kind = type(value)
    if kind is str or kind is bool or kind is float or value is None:
        return True
    if kind is int:
        return bool(-_LONG <= value < _LONG)
    if kind is dict:
        return _plain_table(value)
    if kind is list or kind is tuple:
        return all(_plain_item(item) for item in value)
    return False


def _encodes(
    envelope: Envelope, headers: Mapping[str, Any], properties: Mapping[str, Any]
) -> bool:
    try:
        dumps(
            "s" * (2 + len(envelope.declare)),
            (envelope.exchange, envelope.routing_key, *envelope.declare),
        )
        # Each property py-amqp's frame writer would encode, by the type its
        # Message class declares for it (unknown keys it leaves out, as here).
        sent = _as_relay_sends(envelope, headers, properties)
        for name, kind in amqp.Message.PROPERTIES:
            value = sent.get(name)
            if value is not None:
                dumps(kind, (value,))
    except ENCODING_ERRORS:
        return False
    return True


def _as_relay_sends(
    envelope: Envelope, headers: Mapping[str, Any], properties: Mapping[str, Any]
) -> dict[str, Any]:
    """The properties of the relay's ``amqp.Message`` (see ``AmqpPublisher._send``)."""
    sent = dict(properties)
    priority = sent.pop("priority", None)
    sent.update(
        content_type=envelope.content_type,
        content_encoding=envelope.content_encoding,
        application_headers=headers,
        priority=None if priority is None else int(priority),
    )
    return sent


def _pinpoint(
    envelope: Envelope, headers: Mapping[str, Any], properties: Mapping[str, Any]
) -> str:
    for what, text in (
        ("exchange", envelope.exchange),
        ("routing key", envelope.routing_key),
        ("content type", envelope.content_type),
        ("content encoding", envelope.content_encoding),
    ):
        problem = shortstr_problem(what, text)
        if problem is not None:
            return problem
    for name in envelope.declare:
        problem = shortstr_problem(f"queue name {_label(name)}", name)
        if problem is not None:
            return problem
    for key, value in headers.items():
        problem = shortstr_problem(f"header name {_label(key)}", key)
        if problem is not None:
            return problem
        try:
            dumps("F", ({key: value},))
        except ENCODING_ERRORS as exc:
            return (
                f"its header {_label(key)} holds a value AMQP cannot carry "
                f"({_shorten(exc)}; integers must fit in 64 bits)"
            )
    try:
        sent = _as_relay_sends(envelope, headers, properties)
    except ENCODING_ERRORS:
        return f"its priority {_shorten(properties.get('priority'))} is not a number"
    for key, kind in amqp.Message.PROPERTIES:
        value = sent.get(key)
        if key in {"content_type", "content_encoding", "application_headers"}:
            continue
        if value is None or kind == "bit":
            continue
        if kind == "s" and isinstance(value, str):
            # Celery's correlation_id is the task id: name what the caller chose.
            same_as_id = key == "correlation_id" and value == envelope.task_id
            problem = shortstr_problem(
                "task id" if same_as_id else f"{key} property", value
            )
            if problem is not None:
                return problem
        try:
            dumps(kind, (value,))
        except ENCODING_ERRORS:
            return (
                f"its {key} property {_shorten(value)} is not a valid AMQP "
                f"{_KINDS.get(kind, kind)}"
            )
    return "py-amqp cannot encode its headers or properties"


_KINDS = {
    "s": "short string (at most 255 bytes of UTF-8)",
    "o": "octet (an integer from 0 to 255)",
    "L": "64-bit unsigned integer",
    "F": "table",
}


def _label(name: str) -> str:
    return repr(name) if len(name) <= 40 else f"{name[:40]!r}..."


def _shorten(value: Any) -> str:
    text = str(value) if isinstance(value, BaseException) else repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
