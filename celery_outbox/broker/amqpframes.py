"""The frames of one ``basic.publish``, encoded by the relay instead of by py-amqp.

py-amqp encodes a message's properties through a general-purpose writer: one
``struct`` call per value and a ``BytesIO`` per table, behind a format string read
letter by letter. For the dozen JSON values of a Celery message's headers that is
most of what a relay spends per message on RabbitMQ (more than the socket).

:func:`publish_frames` writes the same bytes py-amqp's frame writer would for
``channel.basic_publish(amqp.Message(body, **properties), exchange, routing_key,
mandatory)``: the method frame, the content header frame and the body frames. It
handles the values JSON can hold (the stored headers and properties always are
JSON); a message with anything else (a ``Decimal``, a ``datetime``, bytes, a subclass
of a built-in type, a property name py-amqp's ``Message`` takes for itself) is left
to py-amqp whole, so its bytes and its errors are py-amqp's own.

The bytes are py-amqp's only as long as py-amqp writes what this module assumes.
:class:`PublishEncoder` therefore checks, before its first message, that both
encoders write the same bytes for a few representative messages
(:func:`self_check`); when they differ it logs a warning once and leaves every
message to py-amqp.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Mapping
from typing import Any

import amqp
from amqp import spec
from amqp.method_framing import frame_writer
from amqp.serialization import dumps

logger = logging.getLogger("celery_outbox.broker")

#: An encoder: (channel id, frame_max, exchange, routing key, mandatory, body,
#: properties) -> the publish's frames, or None to leave the message to py-amqp.
Encode = Callable[[int, int, str, str, bool, bytes, Mapping[str, Any]], bytes | None]
#: py-amqp's encoder, the same arguments: the frames it writes.
Reference = Callable[[int, int, str, str, bool, bytes, Mapping[str, Any]], bytes]

#: py-amqp's order of the basic properties, with their AMQP types.
PROPERTIES: tuple[tuple[str, str], ...] = tuple(amqp.Message.PROPERTIES)
#: Each property with its bit in the flag word. Bit 0 says another word follows, so
#: one word holds 15 properties; a py-amqp with more is left to encode them itself.
_FLAGGED = tuple(
    (name, kind, 1 << (15 - position))
    for position, (name, kind) in enumerate(PROPERTIES)
)
_ONE_FLAG_WORD = len(PROPERTIES) <= 15
#: Names ``amqp.Message(...)`` and its base class take as arguments of their own.
_NOT_PROPERTIES = frozenset(
    {"body", "children", "channel", "frame_method", "frame_args"}
)

_FRAME_END = b"\xce"
_OCTET = struct.Struct("B").pack
_LONG = struct.Struct(">I").pack
_LONGLONG = struct.Struct(">Q").pack
_FRAME_HEAD = struct.Struct(">BHI").pack
_LONGSTR_HEAD = struct.Struct(">cI").pack
_INT = struct.Struct(">ci").pack
_BIG_INT = struct.Struct(">cq").pack
_DOUBLE = struct.Struct(">cd").pack
_CONTENT_HEAD = struct.Struct(">HHQ").pack
_METHOD = struct.Struct(">HHH").pack(*spec.Basic.Publish, 0)  # and reserved-1
_TRUE, _FALSE, _VOID = b"t\x01", b"t\x00", b"V"

#: A table key's encoded form (length byte and UTF-8), by key: Celery's header names
#: repeat on every message.
_KEYS: dict[str, bytes] = {}
_KEYS_KEPT = 4096
#: A table entry's last value and its encoded form (key and value), by key: most of
#: a task's headers hold the same value on every message. Only for immutable values
#: whose equality means the same bytes (not floats: 0.0 == -0.0).
_LAST: dict[str, tuple[type, Any, bytes]] = {}
_KEPT_KINDS = frozenset({str, int, bool, type(None)})


class _Unusual(Exception):
    """A value the fast writer leaves to py-amqp."""


def publish_frames(
    channel_id: int,
    frame_max: int,
    exchange: str,
    routing_key: str,
    mandatory: bool,
    body: bytes,
    properties: Mapping[str, Any],
) -> bytes | None:
    """Every frame of the publish, as py-amqp would write them.

    None when the message should go through py-amqp's own ``basic_publish``: a body
    that is not bytes, a property named like an argument of ``amqp.Message``, or a
    value outside what JSON holds. Raises what py-amqp would raise for a JSON value
    it cannot encode (``struct.error`` for an integer past 64 bits, a
    ``FrameSyntaxError`` for a name over 255 bytes...), before anything is sent.
    """
    if type(body) is not bytes or not _NOT_PROPERTIES.isdisjoint(properties):
        return None
    try:
        method = _METHOD + _publish_arguments(exchange, routing_key, mandatory)
        header = _CONTENT_HEAD(spec.Basic.Publish[0], 0, len(body)) + _properties(
            properties
        )
    except _Unusual:
        return None
    chunk = frame_max - 8
    parts = [
        _FRAME_HEAD(1, channel_id, len(method)),
        method,
        _FRAME_END,
        _FRAME_HEAD(2, channel_id, len(header)),
        header,
        _FRAME_END,
    ]
    for start in range(0, len(body), chunk):
        piece = body[start : start + chunk]
        parts += (_FRAME_HEAD(3, channel_id, len(piece)), piece, _FRAME_END)
    return b"".join(parts)


def library_frames(
    channel_id: int,
    frame_max: int,
    exchange: str,
    routing_key: str,
    mandatory: bool,
    body: bytes,
    properties: Mapping[str, Any],
) -> bytes:
    """What py-amqp writes for ``channel.basic_publish(amqp.Message(body, **properties),
    exchange, routing_key, mandatory)``: its ``frame_writer`` fed as ``basic_publish``
    feeds it, on a connection of ``frame_max``."""
    written: list[bytes] = []
    write_frame = frame_writer(
        _Connection(frame_max), _Transport(lambda data: written.append(bytes(data)))
    )
    arguments = dumps("Bssbb", (0, exchange, routing_key, mandatory, False))
    message = amqp.Message(body, **properties)
    write_frame(1, channel_id, spec.Basic.Publish, arguments, message)
    return b"".join(written)


class _Connection:
    """The two attributes py-amqp's frame writer reads and counts."""

    def __init__(self, frame_max: int) -> None:
        self.frame_max = frame_max
        self.bytes_sent = 0


class _Transport:
    def __init__(self, write: Callable[[Any], None]) -> None:
        self.write = write


def _publish_arguments(exchange: Any, routing_key: Any, mandatory: bool) -> bytes:
    """The arguments of ``basic.publish`` after its reserved short."""
    return b"".join(
        (
            _shortstr(exchange or ""),
            _shortstr(routing_key or ""),
            b"\x01" if mandatory else b"\x00",
        )
    )


def _properties(properties: Mapping[str, Any]) -> bytes:
    """The property flags and list of a content header, as ``amqp.Message`` writes them."""
    if not _ONE_FLAG_WORD:
        raise _Unusual
    flags = 0
    parts: list[bytes] = []
    for name, kind, flag in _FLAGGED:
        value = properties.get(name)
        if value is not None:
            flags |= flag
            if kind == "s":
                parts.append(_shortstr(value or ""))
            elif kind == "F":
                parts.append(_table(value or {}))
            elif kind == "o":
                parts.append(_OCTET(value))
            elif kind == "L":
                parts.append(_LONGLONG(value))
            else:
                raise _Unusual
    return struct.pack(">H", flags) + b"".join(parts)


def _shortstr(value: Any) -> bytes:
    if type(value) is not str:
        raise _Unusual
    data = value.encode("utf-8", "surrogatepass")
    return _OCTET(len(data)) + data


def _key(name: Any) -> bytes:
    encoded = _KEYS.get(name)
    if encoded is None:
        if type(name) is not str:
            raise _Unusual
        data = name.encode("utf-8", "surrogatepass")
        encoded = _OCTET(len(data)) + data
        if len(_KEYS) >= _KEYS_KEPT:
            _KEYS.clear()
        _KEYS[name] = encoded
    return encoded


def _table(table: Any) -> bytes:
    if type(table) is not dict:
        raise _Unusual
    parts: list[bytes] = []
    for name, value in table.items():
        kind = type(value)
        last = _LAST.get(name)
        if last is not None and last[0] is kind and last[1] == value:
            parts.append(last[2])
            continue
        if kind in _KEPT_KINDS:
            encoded = [_key(name)]
            _item(value, encoded)
            entry = b"".join(encoded)
            if len(_LAST) >= _KEYS_KEPT:
                _LAST.clear()
            _LAST[name] = (kind, value, entry)
            parts.append(entry)
        else:
            parts.append(_key(name))
            _item(value, parts)
    data = b"".join(parts)
    return _LONG(len(data)) + data


def _array(values: list[Any] | tuple[Any, ...]) -> bytes:
    parts: list[bytes] = []
    for value in values:
        _item(value, parts)
    data = b"".join(parts)
    return _LONG(len(data)) + data


def _item(value: Any, parts: list[bytes]) -> None:
    kind = type(value)
    if kind is str:
        data = value.encode("utf-8", "surrogatepass")
        parts += (_LONGSTR_HEAD(b"S", len(data)), data)
    elif value is None:
        parts.append(_VOID)
    elif kind is bool:
        parts.append(_TRUE if value else _FALSE)
    elif kind is int:
        # py-amqp's bounds, including its -2**31 + 1: everything past them is 64-bit.
        if value > 2147483647 or value < -2147483647:
            parts.append(_BIG_INT(b"L", value))
        else:
            parts.append(_INT(b"I", value))
    elif kind is float:
        parts.append(_DOUBLE(b"d", value))
    elif kind is dict:
        parts += (b"F", _table(value))
    elif kind is list or kind is tuple:
        parts += (b"A", _array(value))
    else:
        raise _Unusual


# -- the start-up check ----------------------------------------------------------


def _celery_headers(task_id: str, number: int) -> dict[str, Any]:
    """A Celery task message's headers, with a value of every JSON kind."""
    return {
        "lang": "py",
        "task": "shop.send_receipt",
        "id": task_id,
        "shadow": None,
        "eta": None,
        "expires": "2026-01-02T03:04:05.678901+00:00",
        "group": None,
        "group_index": None,
        "retries": number,
        "timelimit": [None, 30.5],
        "root_id": task_id,
        "parent_id": None,
        "argsrepr": f"({number}, 'déjà vu')",
        "kwargsrepr": "{}",
        "origin": "gen1@web-1",
        "ignore_result": False,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {"tenant": ["a", 1, True, None, {"deep": -2.5}]},
        "x-limits": [2**31 - 1, 2**31, -(2**31) + 1, -(2**31), 2**63 - 1, -(2**63)],
        "x-float": -0.0,
    }


#: (frame_max, channel id, exchange, routing key, mandatory, body, properties) of the
#: messages :func:`self_check` encodes both ways.
SAMPLES: tuple[tuple[int, int, str, str, bool, bytes, dict[str, Any]], ...] = (
    (
        131072,
        1,
        "",
        "celery",
        True,
        b'[[42], {}, {"callbacks": null, "errbacks": null, "chain": null}]',
        {
            "content_type": "application/json",
            "content_encoding": "utf-8",
            "application_headers": _celery_headers("b1e4a0c2-0000-4000-8000-1", 0),
            "priority": 0,
            "correlation_id": "b1e4a0c2-0000-4000-8000-1",
            "reply_to": "6c7f2b1e-1d4b-3f0a-9a53-5d1c1e0c2a11",
            "delivery_mode": 2,
        },
    ),
    (
        4096,
        7,
        "orders",
        "orders.created",
        False,
        bytes(range(256)) * 40,  # several body frames
        {
            "content_type": "application/x-msgpack",
            "content_encoding": "binary",
            "application_headers": _celery_headers("b1e4a0c2-0000-4000-8000-2", 3),
            "priority": 9,
            "correlation_id": "b1e4a0c2-0000-4000-8000-2",
            "delivery_mode": 1,
            "expiration": "60000",
        },
    ),
)


def self_check(
    encode: Encode = publish_frames, reference: Reference = library_frames
) -> str | None:
    """What differs between ``encode`` and ``reference`` on :data:`SAMPLES`; None if nothing.

    Each sample is encoded twice by ``encode``, so that its second encoding comes
    from the values it kept from the first.
    """
    for sample in (*SAMPLES, *SAMPLES):
        frame_max, channel_id, exchange, routing_key, mandatory, body, props = sample
        args = (channel_id, frame_max, exchange, routing_key, mandatory, body, props)
        try:
            ours = encode(*args)
            theirs = reference(*args)
        except Exception as exc:
            return f"encoding a sample message raised {exc!r}"
        if ours is None:
            return "the relay's encoder left a sample message to py-amqp"
        if ours != theirs:
            at = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(ours, theirs, strict=False))
                    if a != b
                ),
                min(len(ours), len(theirs)),
            )
            return (
                f"a sample message's frames differ from byte {at} on; "
                f"{len(ours)} bytes, py-amqp wrote {len(theirs)}"
            )
    return None


class PublishEncoder:
    """Encodes each publish with the relay's own encoder, once it proved it writes
    what py-amqp writes; otherwise leaves every message to py-amqp.

    ``encode`` is the relay's encoder (None: py-amqp for everything) and
    ``reference`` py-amqp's; both are parameters so that tests can hand in an
    encoder that fails the check.
    """

    def __init__(
        self,
        encode: Encode | None = publish_frames,
        *,
        reference: Reference = library_frames,
    ) -> None:
        self._encode = encode
        self._reference = reference
        #: Whether the check ran (or was not needed), and the encoder it left.
        self._decided = encode is None
        self._use: Encode | None = None

    def check(self) -> bool:
        """Whether the relay's own encoder is used; the first call runs the check."""
        return self._encoder() is not None

    def frames(
        self,
        channel_id: int,
        frame_max: int,
        exchange: str,
        routing_key: str,
        mandatory: bool,
        body: bytes,
        properties: Mapping[str, Any],
    ) -> bytes | None:
        """The publish's frames; None: send it with py-amqp's ``basic_publish``."""
        encode = self._use if self._decided else self._encoder()
        if encode is None:
            return None
        return encode(
            channel_id, frame_max, exchange, routing_key, mandatory, body, properties
        )

    def _encoder(self) -> Encode | None:
        if not self._decided:
            assert self._encode is not None
            problem = self_check(self._encode, self._reference)
            if problem is None:
                self._use = self._encode
            else:
                logger.warning(
                    "The relay's own AMQP frame encoder does not write what py-amqp "
                    "%s writes (%s); py-amqp encodes every message instead. This "
                    "costs speed, not correctness.",
                    getattr(amqp, "__version__", "?"),
                    problem,
                )
            self._decided = True
        return self._use
