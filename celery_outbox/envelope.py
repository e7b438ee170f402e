"""The broker message as it is stored: serialized once, at enqueue.

An :class:`Envelope` holds exactly what Celery handed to ``Producer.publish`` after
routing, signals and serialization, so the relay publishes the same bytes without
rebuilding anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kombu.utils import json as kombu_json

from .exceptions import UnsupportedPayloadVersion

#: The layout of a stored message. A relay refuses rows with a newer version, loudly.
PAYLOAD_VERSION = 1
SUPPORTED_PAYLOAD_VERSIONS = frozenset({1})

#: The log context of a message that has none (shared, read-only).
EMPTY_LOG_CONTEXT: Mapping[str, Any] = MappingProxyType({})
#: How an empty log context is stored: a constant, so enqueue does no JSON work for it.
EMPTY_LOG_CONTEXT_JSON = "{}"


def _no_log_context() -> Mapping[str, Any]:
    return EMPTY_LOG_CONTEXT


@dataclass(frozen=True)
class Envelope:
    """One broker message, ready to publish."""

    task_id: str
    task_name: str
    exchange: str
    routing_key: str
    body: bytes
    content_type: str
    content_encoding: str
    headers: Mapping[str, Any]
    properties: Mapping[str, Any]
    declare: tuple[str, ...] = ()
    #: Each declared queue's declaration as the caller made it (JSON text of
    #: :func:`celery_outbox.queues.queue_spec`), in ``declare``'s order; "" or
    #: missing: the relay declares the queue its own app knows by that name.
    declare_specs: tuple[str, ...] = ()
    queue: str = ""
    arguments_preview: str = ""
    ordering_key: str | None = None
    #: A caller's key that refuses a second enqueue while this one holds it
    #: (:mod:`celery_outbox.store.dedup`); not stored with the row, never sent.
    dedup_key: str | None = None
    #: Seconds after the enqueue the key stays held, even once published.
    dedup_window: float = 0.0
    #: Log context variables (structlog) captured at enqueue; stored, never sent.
    log_context: Mapping[str, Any] = field(default_factory=_no_log_context)
    #: A scheduled task's seconds from the enqueue to its ETA (:mod:`.scheduling`):
    #: its row is due then. None: due at once.
    due_in: float | None = None
    #: ``time.monotonic()`` when ``due_in`` was measured: a row written later (a
    #: group's members, a buffered row at ``COMMIT``) takes off what has passed.
    due_in_measured_at: float | None = None
    #: Set when the message is written straight to the dead letters, with this reason
    #: (a scheduled task that expires before its ETA); never sent.
    dead_reason: str = ""

    @property
    def priority(self) -> int | None:
        """The message priority, when one was set."""
        value = self.properties.get("priority")
        return int(value) if value is not None else None

    @property
    def expiration(self) -> str | None:
        """The per-message TTL in milliseconds, as AMQP wants it."""
        value = self.properties.get("expiration")
        return str(value) if value is not None else None


@dataclass(frozen=True)
class StoredMessage:
    """A claimed outbox row: the envelope plus what the relay needs to settle it."""

    id: int
    attempts: int
    envelope: Envelope
    #: Seconds since the row was written, when claimed (database clock).
    age_seconds: float | None = None
    #: Published before: a strict head claimed again once its running lease ended
    #: (its worker did not report), not a first publish.
    republish: bool = False


def dump_json(value: Any) -> str:
    """Encode headers or properties; kombu's encoder keeps datetimes, UUIDs and decimals.

    Plain values (the usual headers) take the standard library's cached C encoder, which
    writes the same text; kombu's encoder is built per call and only needed for the rest.
    """
    if type(value) is dict or type(value) is list:
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            pass  # a datetime, UUID, Decimal...: kombu's encoder marks it
    return str(kombu_json.dumps(value))


class JsonObject(Mapping[str, Any]):
    """A stored JSON object (headers, properties), decoded on first use.

    The relay claims every row's headers; a publisher that sends them as text
    (Redis) never pays for decoding and encoding them again.
    """

    __slots__ = ("_text", "_value")

    def __init__(self, text: str, value: dict[str, Any] | None = None) -> None:
        """``value``, when given, must be what ``text`` decodes to (nothing checks it)."""
        self._text = text
        self._value = value

    @classmethod
    def read(cls, text: str, what: str) -> JsonObject:
        """A stored object, decoded now; :class:`ValueError` naming ``what`` if it is not one.

        A publisher that splices the stored text into its message (Redis) would
        otherwise hand a consumer garbage, and delete the row as published.
        """
        try:
            value = load_json(text)
        except (TypeError, ValueError):
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"its {what} are not a JSON object: {str(text)[:80]!r}")
        return cls(text, value)

    @property
    def text(self) -> str:
        """The JSON text, as stored."""
        return self._text

    @property
    def value(self) -> dict[str, Any]:
        """The decoded object (decoded once, then kept)."""
        if self._value is None:
            decoded = load_json(self._text)
            if not isinstance(decoded, dict):
                raise ValueError(f"expected a JSON object, got {self._text[:80]!r}")
            self._value = decoded
        return self._value

    def __getitem__(self, key: str) -> Any:
        return self.value[key]

    def get(self, key: str, default: Any = None) -> Any:
        """``value.get``, without going through ``__getitem__``."""
        return self.value.get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self.value)

    def __len__(self) -> int:
        return len(self.value)

    def __repr__(self) -> str:
        return f"JsonObject({self._text!r})"


def as_dict(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict with the items of ``mapping`` (decoding a :class:`JsonObject` once)."""
    if isinstance(mapping, JsonObject):
        return dict(mapping.value)
    return dict(mapping)


def json_text(mapping: Mapping[str, Any]) -> str:
    """``mapping`` as stored JSON: a :class:`JsonObject`'s own text, else encoded."""
    if isinstance(mapping, JsonObject):
        return mapping.text
    return dump_json(mapping if type(mapping) is dict else dict(mapping))


def load_json(text: str) -> Any:
    """Decode what :func:`dump_json` wrote.

    kombu marks datetimes, UUIDs and decimals with ``"__type__"``; text without that
    marker is plain JSON, which the C decoder reads faster (the relay's hot path).
    """
    if _KOMBU_TYPE_MARKER not in text:
        return json.loads(text)
    return kombu_json.loads(text)


_KOMBU_TYPE_MARKER = '"__type__"'


def dump_log_context(context: Mapping[str, Any]) -> str:
    """Encode a captured log context; never raises (values it cannot encode become text)."""
    if not context:
        return EMPTY_LOG_CONTEXT_JSON
    try:
        return json.dumps(
            dict(context), default=str, skipkeys=True, separators=(",", ":")
        )
    except (TypeError, ValueError):
        # e.g. a circular reference: lose the context, never the task.
        return EMPTY_LOG_CONTEXT_JSON


def load_log_context(text: str | None) -> Mapping[str, Any]:
    """Decode what :func:`dump_log_context` wrote; NULL (a row written by an older version) is empty."""
    if not text or text == EMPTY_LOG_CONTEXT_JSON:
        return EMPTY_LOG_CONTEXT
    try:
        value = json.loads(text)
    except ValueError:
        return EMPTY_LOG_CONTEXT
    return value if isinstance(value, dict) else EMPTY_LOG_CONTEXT


def check_payload_version(version: int, row_id: int) -> None:
    """Refuse a row this relay does not understand."""
    if version not in SUPPORTED_PAYLOAD_VERSIONS:
        raise UnsupportedPayloadVersion(
            f"Outbox row {row_id} has payload version {version}; this relay understands "
            f"{sorted(SUPPORTED_PAYLOAD_VERSIONS)}. Upgrade celery-outbox on the relay."
        )
