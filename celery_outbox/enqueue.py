"""The enqueue path: turn what Celery would publish into an outbox row.

Celery's ``send_task`` does all the work of a publish (routing, lineage, eta and
expires anchored at call time, ``before_task_publish``) and then calls
``producer.publish(...)``. :class:`CapturingProducer` is that producer: instead of
talking to the broker it serializes the body exactly as kombu would and writes the
message into the outbox, in the caller's transaction.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timezone, tzinfo
from typing import Any

from django.apps import apps
from django.db import connections, transaction
from kombu import Exchange, Queue
from kombu.compression import compress
from kombu.entity import maybe_delivery_mode
from kombu.exceptions import EncodeError
from kombu.serialization import dumps

from .broker.amqpcodec import amqp_problem
from .conf import OutboxSettings, OutsideTransaction, get_settings
from .durations import is_seconds
from .envelope import Envelope, JsonObject, dump_json
from .exceptions import (
    OutboxConfigurationError,
    OutboxSerializationError,
    OutboxTransactionError,
    OutboxValueError,
)
from .flow_limits import FLOW_HEADER, KEY_HEADER, check_key, flow_of
from .ordering_options import HEADER as ORDERING_HEADER
from .ordering_options import OPTION_NAMES, pop_options
from .propagation import OTEL_TRACE_MODULE, add_trace_headers, capture_log_context
from .queues import cached_queue_spec
from .scheduling import schedule
from .store.dedup import DedupKeys
from .store.roles import outbox_alias
from .store.store import OutboxWriter, check_fits
from .text import check_text

logger = logging.getLogger("celery_outbox")


class Route(enum.Enum):
    """Where one ``send_task`` call goes."""

    OUTBOX = "outbox"
    DIRECT = "direct"


@dataclasses.dataclass(frozen=True)
class CallContext:
    """What :func:`choose_route` needs to know about the call, as plain values."""

    task_name: str
    task_id: str | None
    #: Id of the task the current worker is executing, if any.
    running_task_id: str | None
    #: Whether the outbox alias is inside ``transaction.atomic()``.
    outbox_in_atomic: bool
    #: Whether another database alias is (business data elsewhere).
    other_alias_in_atomic: bool = False


def is_excluded(task_name: str, patterns: Sequence[str]) -> bool:
    """Whether a task name matches one of the exclusion names or glob patterns."""
    return any(fnmatch.fnmatchcase(task_name, pattern) for pattern in patterns)


def choose_route(call: CallContext, settings: OutboxSettings) -> Route:
    """Decide whether a call goes through the outbox or straight to the broker.

    * excluded task names go direct;
    * ``Task.retry()`` (same task id as the running task) goes direct: it re-sends a
      message the worker already holds, and no business transaction produced it;
    * inside a worker, calls outside any transaction go direct (no needless relay
      latency, no warning); calls inside ``atomic()`` keep the outbox guarantee, and
      ``atomic()`` on another database is refused as it is in a web process;
    * everything else goes through the outbox.
    """
    if is_excluded(call.task_name, settings.exclude_tasks):
        return Route.DIRECT
    if call.running_task_id is not None:
        if call.task_id is not None and call.task_id == call.running_task_id:
            return Route.DIRECT
        if (
            settings.direct_from_worker
            and not call.outbox_in_atomic
            and not call.other_alias_in_atomic  # the outbox path raises a clear error
        ):
            return Route.DIRECT
    return Route.OUTBOX


def require_installed() -> bool:
    """True, or :class:`OutboxConfigurationError` when the Django app is not installed."""
    if not apps.is_installed("celery_outbox"):
        raise OutboxConfigurationError(
            "'celery_outbox' is not in INSTALLED_APPS, so its tables and the relay "
            "command do not exist. Add 'celery_outbox' to INSTALLED_APPS and run "
            "'python manage.py migrate celery_outbox'."
        )
    return True


@dataclasses.dataclass(frozen=True)
class GuardWording:
    """What :class:`TransactionGuard` says, for one kind of write.

    Each text is formatted with ``name`` (the task name or category), ``alias`` (the
    outbox's) and ``others`` (the aliases whose transactions are open).
    """

    #: Raised: inside ``atomic()``, but on another alias than the outbox's.
    other_database: str
    #: Raised under ``CELERY_OUTBOX_OUTSIDE_TRANSACTION = 'raise'``.
    outside_raise: str
    #: Logged once per name under ``'warn'``.
    outside_warn: str


TASK_WORDING = GuardWording(
    other_database=(
        "Task {name!r} was sent inside transaction.atomic() on database {others}, but "
        "the outbox lives on {alias!r}: its row would commit on its own, even if your "
        "transaction rolls back. Wrap the call in transaction.atomic(using={alias!r}) "
        "too, or set CELERY_OUTBOX_DATABASE to the alias your business data uses."
    ),
    outside_raise=(
        "Task {name!r} was sent outside transaction.atomic() on {alias!r} and "
        "CELERY_OUTBOX_OUTSIDE_TRANSACTION is 'raise'. Send it inside "
        "transaction.atomic(using={alias!r}), or set the setting to 'warn'."
    ),
    outside_warn=(
        "Task {name!r} was sent outside transaction.atomic(); its outbox row was "
        "committed on its own (autocommit). Wrap the call in atomic() to tie it to "
        "your data, or set CELERY_OUTBOX_OUTSIDE_TRANSACTION = 'allow' to silence "
        "this warning (logged once per task name)."
    ),
)


class TransactionGuard:
    """Checks that a write will commit or roll back with the caller's transaction."""

    def __init__(self, wording: GuardWording = TASK_WORDING) -> None:
        self.wording = wording
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def check(self, alias: str, name: str, mode: OutsideTransaction) -> None:
        """Raise or warn when the outbox alias is not inside ``atomic()``."""
        if connections[alias].in_atomic_block:
            return
        others = sorted(
            conn.alias
            for conn in connections.all(initialized_only=True)
            if conn.alias != alias and conn.in_atomic_block
        )
        words = self.wording
        if others:
            raise OutboxTransactionError(
                words.other_database.format(
                    name=name, alias=alias, others=", ".join(map(repr, others))
                )
            )
        if mode is OutsideTransaction.RAISE:
            raise OutboxTransactionError(
                words.outside_raise.format(name=name, alias=alias, others="")
            )
        if mode is OutsideTransaction.WARN:
            with self._lock:
                first = name not in self._warned
                self._warned.add(name)
            if first:
                logger.warning(
                    "%s", words.outside_warn.format(name=name, alias=alias, others="")
                )


class CapturingProducer:
    """A stand-in for ``kombu.Producer`` that writes each publish into the outbox."""

    def __init__(
        self,
        *,
        connection: Any,
        default_serializer: str,
        default_compression: str | None,
        sink: Callable[[Sequence[Envelope]], Mapping[str, str]],
        buffered: bool = False,
        event_exchange: str | None = None,
        amqp: bool = False,
        zone: tzinfo = timezone.utc,
        autocommit: Callable[[], bool] | None = None,
    ) -> None:
        """``amqp``: the relay publishes with py-amqp, so messages it cannot encode are refused.

        ``zone`` is the app's timezone, which the ``eta`` header is read with, as the
        worker reads it (a naive ``eta`` is UTC), to tell whether the task is
        scheduled (:mod:`.scheduling`).
        ``autocommit`` tells a buffered producer whether its writes commit at once
        (the outbox alias is not inside ``atomic()``): it then writes a group's first
        member at once, as Celery would publish it, and later ones when the builder
        pauses (a generator), instead of all of them at the end.
        """
        #: Celery wraps the publish in ``connection._reraise_as_library_errors()``;
        #: the connection is never opened by the enqueue path.
        self.connection = connection
        #: Read by Celery's eager mode; None means "the app's task_serializer".
        self.serializer: str | None = None
        self._default_serializer = default_serializer
        self._default_compression = default_compression
        self._sink = sink
        self._buffered = buffered
        self._pending: list[Envelope] = []
        self._autocommit = autocommit
        self._last_member_at = time.monotonic()
        self._written = False
        #: Celery's monitoring events (task_send_sent_event) are not stored: a
        #: "task-sent" event at call time would announce a publish that has not
        #: happened; the relay sends it once it has (relay/sent.py).
        self._event_exchange = event_exchange
        self.amqp = amqp
        self.zone = zone
        #: Task ids whose ``dedup_key`` another task held, with that task's id
        #: (taken back by :meth:`take_holder`).
        self._refused: dict[str, str] = {}

    def take_holder(self, task_id: str) -> str | None:
        """The task that held the call's ``dedup_key``, if the call wrote nothing."""
        return self._refused.pop(task_id, None)

    def flush(self) -> None:
        """Write what a buffered producer collected, in one INSERT."""
        pending, self._pending = self._pending, []
        if pending:
            self._written = True
            self._sink(pending)

    def discard(self) -> None:
        """Forget what a buffered producer collected (the canvas call failed)."""
        self._pending = []

    def _emit(self, envelope: Envelope) -> None:
        if self._buffered:
            self._pending.append(envelope)
            now = time.monotonic()
            paused = now - self._last_member_at >= GROUP_PAUSE_SECONDS
            self._last_member_at = now
            if (not self._written or paused) and self._autocommit_now():
                # Outside a transaction a header built slowly (from a generator) is
                # written as it is built: its first members run meanwhile, as with
                # Celery. Inside one, nothing is seen before the commit anyway.
                self.flush()
        else:
            self._refused.update(self._sink([envelope]))

    def _autocommit_now(self) -> bool:
        return self._autocommit is not None and self._autocommit()

    @property
    def channel(self) -> Any:
        """The broker channel, for result backends (rpc://) that declare a reply queue."""
        return self.connection.default_channel

    def publish(
        self,
        body: Any,
        routing_key: str | None = None,
        delivery_mode: int | str | None = None,
        priority: int | None = 0,  # kombu's default: the broker sees priority 0
        serializer: str | None = None,
        headers: Mapping[str, Any] | None = None,
        compression: str | None = None,
        exchange: str | Exchange | None = None,
        declare: Sequence[Any] | None = None,
        expiration: float | None = None,
        **properties: Any,
    ) -> None:
        """Record one message; keyword names follow ``kombu.Producer.publish``."""
        for transport_only in ("retry", "retry_policy", "timeout", "confirm_timeout"):
            properties.pop(transport_only, None)
        properties.pop("mandatory", None)
        properties.pop("immediate", None)
        ordering_given = {
            name: properties.pop(name) for name in OPTION_NAMES if name in properties
        }
        dedup_key = properties.pop("dedup_key", None)
        dedup_window = properties.pop("dedup_window", None)
        flow_key = properties.pop("flow_key", None)
        headers = dict(headers or {})
        exchange_name, default_mode = _exchange_details(exchange)
        if self._event_exchange and exchange_name == self._event_exchange:
            return
        properties["delivery_mode"] = maybe_delivery_mode(delivery_mode or default_mode)
        if expiration is not None:
            properties["expiration"] = str(int(expiration * 1000))
        if priority is not None:
            properties["priority"] = priority
        if isinstance(properties.get("reply_to"), Queue):
            properties["reply_to"] = properties["reply_to"].name
        if OTEL_TRACE_MODULE in sys.modules:
            # Adds trace headers only where no instrumentation already did.
            add_trace_headers(headers)
        task_name = str(headers.get("task", ""))
        ordering = pop_options(ordering_given, task_name)
        if ordering.header is not None:
            headers[ORDERING_HEADER] = ordering.header
        if flow_key is not None or KEY_HEADER in headers:
            headers.update(flow_headers(flow_key, headers, task_name))
        content_type, content_encoding, data = serialize(
            body, serializer or self._default_serializer, task_name
        )
        codec = compression or self._default_compression
        if codec:
            data, headers["compression"] = compress(data, codec)
        declared = [entity for entity in declare or () if isinstance(entity, Queue)]
        queues = tuple(entity.name for entity in declared)
        try:
            specs = tuple(cached_queue_spec(entity) for entity in declared)
        except ValueError as exc:
            raise OutboxValueError(
                f"Cannot enqueue task {task_name[:80]!r}: {exc}, so the relay could "
                f"not declare it as you did. Use plain values in the queue's "
                f"arguments. Nothing was written."
            ) from None
        envelope = Envelope(
            task_id=str(headers.get("id", "")),
            task_name=task_name,
            exchange=exchange_name,
            routing_key=routing_key or "",
            body=data,
            content_type=content_type,
            content_encoding=content_encoding,
            # Encoded now, on every engine: a value JSON cannot hold is the
            # caller's mistake, refused here and not at the INSERT or the COMMIT.
            headers=encoded_mapping("headers", headers, task_name),
            properties=encoded_mapping("properties", properties, task_name),
            declare=queues,
            declare_specs=specs,
            queue=queues[0] if queues else (routing_key or ""),
            arguments_preview=preview(headers),
            ordering_key=ordering.key,
            log_context=capture_log_context(get_settings()),
        )
        if headers.get("eta") is not None:  # all a task without an ETA pays
            envelope = schedule(
                envelope, headers, after=get_settings().schedule_after, zone=self.zone
            )
        if dedup_key is not None or dedup_window is not None:
            envelope = dataclasses.replace(
                envelope,
                **dedup_options(dedup_key, dedup_window, task_name, self._buffered),
            )
        if self.amqp:
            refuse_for_amqp(task_name, amqp_problem(envelope))
        self._emit(envelope)


def dedup_options(
    key: Any, window: Any, task_name: str, buffered: bool
) -> dict[str, Any]:
    """``dedup_key`` and ``dedup_window`` checked; :class:`OutboxValueError` names the mistake."""
    where = f"Cannot enqueue task {task_name[:80]!r}"
    if key is None:
        raise OutboxValueError(
            f"{where}: dedup_window needs a dedup_key. Nothing was written."
        )
    if not isinstance(key, str) or not 0 < len(key) <= 255:
        raise OutboxValueError(
            f"{where}: dedup_key must be a non-empty string of at most 255 characters, "
            f"got {key!r}. Nothing was written."
        )
    check_text(key, "dedup_key", where)
    if buffered:
        raise OutboxValueError(
            f"{where}: dedup_key is not supported inside a group or chord (its "
            f"members share one result). Send the task on its own. Nothing was written."
        )
    seconds = 0.0 if window is None else window
    if not is_seconds(seconds):
        raise OutboxValueError(
            f"{where}: dedup_window must be a number of seconds >= 0, got {window!r}. "
            f"Nothing was written."
        )
    return {"dedup_key": key, "dedup_window": float(seconds)}


def refuse_for_amqp(task_name: str, problem: str | None) -> None:
    """Raise :class:`OutboxValueError` for a ``problem`` found by :mod:`.broker.amqpcodec`."""
    if problem is not None:
        raise OutboxValueError(
            f"Cannot enqueue task {task_name[:80]!r}: {problem}, so RabbitMQ could "
            f"never receive it. Change that value. Nothing was written."
        )


#: Who hears of the rows an enqueue wrote, with their alias: called inside the
#: caller's transaction, before it commits. The Django signal ``message_created``
#: subscribes here when Django starts (:mod:`celery_outbox.apps`): the lanes that
#: write rows (this path, a held event retry) import no observer.
WRITTEN: list[Callable[[Sequence[Envelope], str], None]] = []


def announce_written(envelopes: Sequence[Envelope], alias: str) -> None:
    """Tell :data:`WRITTEN`'s subscribers that ``envelopes`` were written on ``alias``."""
    for subscriber in WRITTEN:
        subscriber(envelopes, alias)


#: Outside a transaction, a group member that comes this long after the one before
#: it (the group is built by a slow generator) is written at once, with those before.
GROUP_PAUSE_SECONDS = 0.1


def flow_headers(
    given: Any, headers: Mapping[str, Any], task_name: str
) -> dict[str, str]:
    """The headers of a call's ``flow_key`` (or of the key its headers carry: a
    retry's), checked, with the name of the flow that covers the task.

    Raises :class:`OutboxValueError` naming the mistake; nothing is written then.
    """
    value = given if given is not None else headers.get(KEY_HEADER)
    try:
        key = check_key(value, f"Cannot enqueue task {task_name[:80]!r}")
        check_text(key, "flow_key", f"Cannot enqueue task {task_name[:80]!r}")
    except ValueError as exc:
        raise OutboxValueError(str(exc)) from None
    found = flow_of(get_settings().flows, task_name)
    if found is None:  # kept with the message; no flow counts it
        return {KEY_HEADER: key}
    return {KEY_HEADER: key, FLOW_HEADER: found.name}


def _exchange_details(exchange: str | Exchange | None) -> tuple[str, Any]:
    if isinstance(exchange, Exchange):
        return exchange.name, exchange.delivery_mode
    return exchange or "", None


def serialize(body: Any, serializer: str, task_name: str) -> tuple[str, str, bytes]:
    """The body as kombu's serializer registry encodes it, or a clear refusal."""
    try:
        content_type, content_encoding, payload = dumps(body, serializer=serializer)
    except (EncodeError, TypeError, ValueError) as exc:
        culprit = _find_unencodable(body, serializer)
        raise OutboxSerializationError(
            f"Cannot enqueue task {task_name!r}: {culprit} cannot be encoded with the "
            f"{serializer!r} serializer ({exc}). Pass plain values (ids, strings, numbers), "
            f"or configure a serializer that accepts this type. Nothing was written."
        ) from exc
    # kombu hands text serializers' output to the transport as str; publish as bytes.
    data = (
        payload.encode(content_encoding or "utf-8")
        if isinstance(payload, str)
        else payload
    )
    return str(content_type), str(content_encoding), bytes(data)


def encoded_mapping(
    kind: str, mapping: Mapping[str, Any], task_name: str
) -> JsonObject:
    """``mapping`` with its stored JSON text, or :class:`OutboxSerializationError`."""
    try:
        return JsonObject(dump_json(dict(mapping)), dict(mapping))
    except (EncodeError, TypeError, ValueError, RecursionError) as exc:
        where = unencodable_path(dict(mapping))
        raise OutboxSerializationError(
            f"Cannot enqueue task {task_name[:80]!r}: the value at {kind}{where} cannot be "
            f"stored as JSON ({exc}). Pass text, numbers, booleans, None, lists and "
            f"dicts with text keys (or dates, UUIDs and decimals). Nothing was written."
        ) from exc


def unencodable_path(value: Any, path: str = "", depth: int = 0) -> str:
    """Where in ``value`` the first value JSON cannot hold sits: ``['a']['b'][2]: set``."""
    if depth > _MAX_PATH_DEPTH:
        return f"{path}: nested deeper than {_MAX_PATH_DEPTH} levels"
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                return f"{path}[{key!r}] (its key): {type(key).__name__}"
            found = unencodable_path(item, f"{path}[{key!r}]", depth + 1)
            if found:
                return found
        return ""
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = unencodable_path(item, f"{path}[{index}]", depth + 1)
            if found:
                return found
        return ""
    try:
        dump_json([value])
    except (EncodeError, TypeError, ValueError, RecursionError):
        return f"{path}: {type(value).__name__}"
    return ""


#: How deep :func:`unencodable_path` looks before it says "nested too deep".
_MAX_PATH_DEPTH = 64


def _find_unencodable(body: Any, serializer: str) -> str:
    """Name the first argument the serializer refuses, for the error message.

    With the json serializer, also the path to the value inside it
    (``keyword argument 'a' (kwargs['a']['b'][2]: set)``).
    """
    if isinstance(body, (tuple, list)) and len(body) >= 2:
        args, kwargs = body[0], body[1]
        candidates: list[tuple[str, str, Any]] = [
            (f"positional argument {index}", f"args[{index}]", value)
            for index, value in enumerate(args or ())
        ]
        if isinstance(kwargs, Mapping):
            candidates += [
                (f"keyword argument {key!r}", f"kwargs[{key!r}]", value)
                for key, value in kwargs.items()
            ]
        for label, path, value in candidates:
            try:
                dumps(value, serializer=serializer)
            except Exception:
                kind = type(value)
                found = f"{label} of type {kind.__module__}.{kind.__qualname__}"
                inside = unencodable_path(value, path) if serializer == "json" else ""
                if inside and not inside.startswith(f"{path}:"):
                    found += f" ({inside})"
                return found
    return "the message body"


def preview(headers: Mapping[str, Any]) -> str:
    args = headers.get("argsrepr")
    kwargs = headers.get("kwargsrepr")
    if args is None and kwargs is None:
        return ""
    return preview_of(args, kwargs)


def preview_of(args: Any, kwargs: Any) -> str:
    """The ``arguments_preview`` column of a message with these ``argsrepr``/``kwargsrepr``."""
    text = f"args={args} kwargs={kwargs}"
    if not text.isascii():
        # Celery's repr keeps a lone surrogate (a file name that is not UTF-8, say);
        # the message escapes it in JSON, the preview column needs it escaped too.
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


class Enqueuer:
    """Writes captured messages through the store, with the transaction checks."""

    def __init__(
        self,
        on_commit: Callable[[str, Sequence[str]], None] | None = None,
        on_expired: Callable[[Sequence[Envelope]], None] | None = None,
    ) -> None:
        """``on_commit(alias, task_ids)`` is called for each write when publish-on-commit is on.

        ``on_expired(envelopes)`` is called once the caller's transaction commits,
        with the scheduled messages written to the dead letters because they expire
        before their ETA: a worker would have revoked them as expired.
        """
        self.guard = TransactionGuard()
        self._on_commit = on_commit
        self._on_expired = on_expired
        self._installed = False

    def autocommit(self) -> bool:
        """Whether a write now commits on its own (the outbox alias is not in ``atomic()``)."""
        return not connections[outbox_alias(get_settings())].in_atomic_block

    def write(
        self, envelopes: Sequence[Envelope], *, guarded: bool = True
    ) -> Mapping[str, str]:
        """Insert messages on the outbox alias, in the caller's transaction, in one INSERT.

        Returns ``{task_id: holder}`` for the messages not written because another
        task holds their ``dedup_key``. Without ``guarded`` no transaction is asked
        for: a worker's scheduled retry, which Celery would have sent at once.
        """
        if not self._installed:
            self._installed = require_installed()
        settings = get_settings()
        alias = outbox_alias(settings)
        names = (
            (envelopes[0].task_name,)
            if len(envelopes) == 1
            else dict.fromkeys(e.task_name for e in envelopes)
        )
        for name in names if guarded else ():
            self.guard.check(alias, name, settings.outside_transaction)
        refused: Mapping[str, str] = {}
        if any(envelope.dedup_key is not None for envelope in envelopes):
            # Checked before a key is taken in the caller's transaction.
            for envelope in envelopes:
                check_fits(envelope)
            refused = DedupKeys(alias).hold_keys(envelopes)
            envelopes = [e for e in envelopes if e.task_id not in refused]
            if not envelopes:
                return refused
        # Built here on the alias resolved above, not by the factory: the call's only
        # object. The writer coalesces the hints of a burst of commits.
        OutboxWriter(alias).insert(envelopes, notify=settings.notify)
        if self._on_expired is not None and any(e.dead_reason for e in envelopes):
            expired = [e for e in envelopes if e.dead_reason]
            on_expired = self._on_expired
            transaction.on_commit(lambda: on_expired(expired), using=alias)
        announce_written(envelopes, alias)
        if settings.publish_on_commit and self._on_commit is not None:
            self._on_commit(alias, [e.task_id for e in envelopes])
        return refused
