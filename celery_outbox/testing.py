"""Helpers for testing code that sends tasks through the outbox.

The pytest plugin (:mod:`celery_outbox.pytest_plugin`) hands out an
:class:`OutboxFixture`; everything here can also be used without pytest. Nothing is
patched: reading goes through the outbox table, draining runs the real
:class:`~celery_outbox.relay.loop.Relay` with a publisher of your choice (the
:class:`~celery_outbox.broker.InMemoryPublisher` by default), and running tasks uses
Celery's own ``Task.apply``.

Import this module only once Django is configured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from celery.signals import task_prerun
from kombu import serialization
from kombu.compression import decompress
from kombu.serialization import dumps, loads

from .broker import Budget, InMemoryPublisher, Publisher, build_publisher
from .conf import get_settings
from .engine.loop import Turn
from .engine.waiter import Waiter
from .envelope import Envelope, StoredMessage, load_json
from .exceptions import OutboxError
from .outcomes import Outcome, PublishResult
from .relay.config import RelayConfig
from .relay.loop import Relay
from .relay.observations import LoopError, RelayObservation
from .signals import send_relay_signals
from .store import Stores, outbox_alias
from .store.store import read_declarations

__all__ = [
    "DecodedBody",
    "EnqueuedTask",
    "ExecutedTask",
    "OutboxDrainError",
    "OutboxFixture",
    "decode_body",
    "decode_message",
    "load_payload",
    "task_name_of",
]

#: kombu's serializer registry (content type -> serializer name); not in the stubs.
_SERIALIZERS: Any = serialization.registry  # type: ignore[attr-defined]

#: A task object (anything with a ``name``) or a task name.
TaskRef = Any


class OutboxDrainError(OutboxError, AssertionError):
    """A drain in a test could not publish every message it claimed.

    It is an ``AssertionError`` too, so pytest reports it as a test failure.
    """


@dataclass(frozen=True)
class DecodedBody:
    """The call a message carries: positional and keyword arguments, and the canvas parts."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: Protocol 2's third element: ``callbacks``, ``errbacks``, ``chain``, ``chord``.
    embed: dict[str, Any]


def load_payload(envelope: Envelope) -> Any:
    """The message body as the worker's consumer sees it: decompressed, deserialized."""
    data: bytes = envelope.body
    codec = envelope.headers.get("compression")
    if codec:
        data = decompress(data, codec)
    return loads(data, envelope.content_type, envelope.content_encoding)


def decode_body(envelope: Envelope) -> DecodedBody:
    """Decompress and deserialize a message body as a worker would.

    The body is Celery's message protocol 2: ``[args, kwargs, embed]``.
    """
    payload = load_payload(envelope)
    if not isinstance(payload, (list, tuple)) or len(payload) != 3:
        raise ValueError(
            f"Message {envelope.task_id} ({envelope.task_name}) does not hold a Celery "
            f"protocol 2 body [args, kwargs, embed]: {payload!r:.200}"
        )
    args, kwargs, embed = payload
    return DecodedBody(tuple(args or ()), dict(kwargs or {}), dict(embed or {}))


def _as_datetime(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    text = str(value)
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    return datetime.fromisoformat(text)


@dataclass(frozen=True)
class EnqueuedTask:
    """One message in the outbox (or published by a drain), decoded for assertions."""

    task_name: str
    task_id: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    #: When the worker may run it (``eta=`` or ``countdown=``, anchored at the call).
    eta: datetime | None
    expires: datetime | None
    queue: str
    exchange: str
    routing_key: str
    priority: int | None
    retries: int
    parent_id: str | None
    root_id: str | None
    group_id: str | None
    embed: dict[str, Any]
    headers: Mapping[str, Any]
    properties: Mapping[str, Any]
    envelope: Envelope = field(repr=False)

    @property
    def call(self) -> str:
        """The call as Python source: ``shop.add(1, 2, tag='x')``."""
        parts = [repr(a) for a in self.args]
        parts += [f"{key}={value!r}" for key, value in self.kwargs.items()]
        return f"{self.task_name}({', '.join(parts)})"

    def describe(self) -> str:
        """The call plus what else a reader of a failed assertion wants: id, queue, eta."""
        extras = [f"id={self.task_id}", f"queue={self.queue!r}"]
        if self.eta is not None:
            extras.append(f"eta={self.eta.isoformat()}")
        if self.expires is not None:
            extras.append(f"expires={self.expires.isoformat()}")
        if self.priority:
            extras.append(f"priority={self.priority}")
        return f"{self.call}  [{', '.join(extras)}]"

    def matches(
        self,
        task: TaskRef | None = None,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> bool:
        """Whether this message is a call of ``task`` with exactly these arguments.

        ``None`` matches anything. Expected values go through the message's own
        serializer before they are compared, so ``(1, (2, 3))`` matches a JSON body's
        ``[1, [2, 3]]``; values it cannot encode (``unittest.mock.ANY``) are compared
        as they are.
        """
        if task is not None and self.task_name != task_name_of(task):
            return False
        if args is not None:
            expected = tuple(self._normalized(value) for value in args)
            if len(expected) != len(self.args) or not all(
                e == a for e, a in zip(expected, self.args, strict=True)
            ):
                return False
        if kwargs is not None:
            if set(kwargs) != set(self.kwargs):
                return False
            if not all(self._normalized(kwargs[k]) == self.kwargs[k] for k in kwargs):
                return False
        return True

    def _normalized(self, value: Any) -> Any:
        serializer = _SERIALIZERS.type_to_name.get(self.envelope.content_type)
        if serializer is None:
            return value
        try:
            content_type, encoding, data = dumps(value, serializer=serializer)
            return loads(data, content_type, encoding)
        except Exception:
            return value


def task_name_of(task: TaskRef) -> str:
    """The registered name of a task object, or the string itself."""
    if isinstance(task, str):
        return task
    name = getattr(task, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"Expected a Celery task or a task name, got {task!r}.")
    return name


def decode_message(envelope: Envelope) -> EnqueuedTask:
    """Decode a stored or published message into an :class:`EnqueuedTask`."""
    body = decode_body(envelope)
    meta = envelope.headers
    return EnqueuedTask(
        task_name=envelope.task_name,
        task_id=envelope.task_id,
        args=body.args,
        kwargs=body.kwargs,
        eta=_as_datetime(meta.get("eta")),
        expires=_as_datetime(meta.get("expires")),
        queue=envelope.queue,
        exchange=envelope.exchange,
        routing_key=envelope.routing_key,
        priority=envelope.priority,
        retries=int(meta.get("retries") or 0),
        parent_id=meta.get("parent_id"),
        root_id=meta.get("root_id"),
        group_id=meta.get("group"),
        embed=body.embed,
        headers=meta,
        properties=envelope.properties,
        envelope=envelope,
    )


@dataclass(frozen=True)
class ExecutedTask:
    """A message :meth:`OutboxFixture.run_enqueued` ran, and Celery's eager result."""

    message: EnqueuedTask
    #: A ``celery.result.EagerResult``: ``.result``, ``.state``, ``.traceback``.
    result: Any

    @property
    def value(self) -> Any:
        """What the task returned (or the exception it raised, when not propagated)."""
        return self.result.result

    @property
    def state(self) -> str:
        """``SUCCESS``, ``FAILURE``, ``RETRY`` ..."""
        return str(self.result.state)


class _RecordingPublisher:
    """Wraps a publisher and remembers what it confirmed and what it did not."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.published: list[Envelope] = []
        self.unpublished: list[tuple[Envelope, PublishResult]] = []

    def publish(
        self, messages: Sequence[StoredMessage], budget: Budget
    ) -> list[PublishResult]:
        results = self.inner.publish(messages, budget)
        by_id = {m.id: m.envelope for m in messages}
        for result in results:
            envelope = by_id[result.message_id]
            if result.outcome is Outcome.PUBLISHED:
                self.published.append(envelope)
            else:
                self.unpublished.append((envelope, result))
        return results

    def ping(self) -> str | None:
        return self.inner.ping()

    def close(self) -> None:
        self.inner.close()


def _listing(messages: Sequence[EnqueuedTask]) -> str:
    if not messages:
        return "  (nothing)"
    return "\n".join(f"  - {m.describe()}" for m in messages)


def _expectation(
    task: TaskRef, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
) -> str:
    name = task_name_of(task)
    if args is None and kwargs is None:
        return name
    parts = ["*" if args is None else ", ".join(repr(a) for a in args)]
    if kwargs is None:
        parts.append("**")
    else:
        parts += [f"{key}={value!r}" for key, value in kwargs.items()]
    return f"{name}({', '.join(p for p in parts if p)})"


#: How many batches one drain publishes at most before it gives up (a runaway loop).
MAX_DRAIN_BATCHES = 10_000


class OutboxFixture:
    """The outbox as a test sees it: what is enqueued, assertions, drain, run.

    ``alias`` and ``app`` default to the configured ones, looked up on each use, so
    a test may change ``CELERY_OUTBOX_DATABASE`` with pytest-django's ``settings``.
    """

    def __init__(self, *, alias: str | None = None, app: Any = None) -> None:
        self._alias = alias
        self._app = app
        #: The in-memory broker :meth:`drain` publishes to unless told otherwise.
        self.broker = InMemoryPublisher()

    # -- what is enqueued --------------------------------------------------------

    @property
    def alias(self) -> str:
        """The database alias holding the outbox tables."""
        return self._alias or outbox_alias(get_settings())

    @property
    def app(self) -> Any:
        """The ``OutboxCelery`` whose tasks :meth:`run_enqueued` looks up."""
        if self._app is None:
            from .app import resolve_app

            return resolve_app(get_settings())
        return self._app

    @property
    def messages(self) -> list[EnqueuedTask]:
        """Every row in the outbox now, oldest first, decoded."""
        from .models import OutboxMessage

        rows = OutboxMessage.objects.using(self.alias).order_by("id")
        return [decode_message(_envelope_of(row)) for row in rows]

    def task_names(self) -> list[str]:
        """Names of the enqueued tasks, oldest first."""
        return [m.task_name for m in self.messages]

    def filter(
        self,
        task: TaskRef | None = None,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[EnqueuedTask]:
        """The enqueued messages that match (see :meth:`EnqueuedTask.matches`)."""
        return [m for m in self.messages if m.matches(task, args, kwargs)]

    def clear(self) -> int:
        """Delete every row from the outbox (in the test's transaction); returns how many."""
        from .models import OutboxMessage

        deleted, _ = OutboxMessage.objects.using(self.alias).all().delete()
        return int(deleted)

    # -- assertions --------------------------------------------------------------

    def assert_enqueued(
        self,
        task: TaskRef,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        count: int | None = None,
    ) -> list[EnqueuedTask]:
        """Fail unless ``task`` is enqueued with these arguments (``count`` times, if given).

        ``args`` and ``kwargs`` left as ``None`` match anything; given, they must be
        exactly the call's. Returns the matching messages, for further checks
        (``eta``, ``queue``...). The failure message lists everything that was enqueued.
        """
        __tracebackhide__ = True  # pytest shows the caller's line
        messages = self.messages
        found = [m for m in messages if m.matches(task, args, kwargs)]
        if (count is None and found) or (count is not None and len(found) == count):
            return found
        wanted = _expectation(task, args, kwargs)
        times = "at least once" if count is None else f"{count} time(s)"
        found_ids = {id(m) for m in found}
        same_name = [
            m
            for m in messages
            if m.task_name == task_name_of(task) and id(m) not in found_ids
        ]
        lines = [
            f"Expected {wanted} to be enqueued {times}, found it {len(found)} time(s)."
        ]
        if found:
            lines += ["Matching:", _listing(found)]
        if same_name:
            lines += [
                f"{task_name_of(task)} with other arguments:",
                _listing(same_name),
            ]
        lines += [f"Everything in the outbox ({len(messages)}):", _listing(messages)]
        raise AssertionError("\n".join(lines))

    def assert_not_enqueued(
        self,
        task: TaskRef,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Fail if ``task`` is enqueued with these arguments (``None`` matches anything)."""
        __tracebackhide__ = True  # pytest shows the caller's line
        messages = self.messages
        found = [m for m in messages if m.matches(task, args, kwargs)]
        if not found:
            return
        raise AssertionError(
            "\n".join(
                [
                    f"Expected {_expectation(task, args, kwargs)} not to be enqueued, "
                    f"found it {len(found)} time(s):",
                    _listing(found),
                    f"Everything in the outbox ({len(messages)}):",
                    _listing(messages),
                ]
            )
        )

    # -- drain -------------------------------------------------------------------

    def drain(
        self,
        publisher: Publisher | None = None,
        *,
        broker: Literal["memory", "real"] = "memory",
        strict: bool = True,
        scheduled: bool = True,
    ) -> list[Envelope]:
        """Publish every due row with the real relay loop; returns what was published.

        ``publisher`` is any :class:`~celery_outbox.broker.Publisher`; without one the
        messages go to :attr:`broker` (in memory), or with ``broker="real"`` to the
        app's broker. With ``strict`` a message the publisher did not confirm fails
        the drain (:class:`OutboxDrainError`), naming it and the broker's reason;
        without, it stays in the outbox as the relay would leave it (retry,
        dead letter, cool-down). With ``scheduled`` (the default) tasks waiting in
        the outbox for their ETA are made due first, as if it had come (their
        message keeps its ``eta``); ``scheduled=False`` leaves them waiting, as a
        relay would.
        """
        if scheduled:
            self._make_scheduled_due()
        owned = False
        if publisher is None:
            if broker == "real":
                from .app import resolve_app

                settings = get_settings()
                publisher = build_publisher(
                    self._app or resolve_app(settings), settings
                )
                owned = True
            elif broker == "memory":
                publisher = _as_publisher(self.broker)
            else:
                raise ValueError(f"broker must be 'memory' or 'real', got {broker!r}.")
        recording = _RecordingPublisher(publisher)
        errors: list[LoopError] = []

        def listen(event: RelayObservation) -> None:
            if isinstance(event, LoopError):
                errors.append(event)

        store = Stores(self.alias).relay()
        waiter = Waiter()  # the relay's self-pipe: closed here, not left to leak
        relay = Relay(
            store,
            recording,
            # The drain runs inside the test's transaction, which a second
            # connection could not see: no prefetching.
            RelayConfig.from_settings(get_settings(), until_empty=True, prefetch=False),
            waiter=waiter,
            # The relay's Django signals, as `outbox relay` sends them.
            observers=(send_relay_signals, listen),
        )
        try:
            with store.relay_lock():
                self._run(relay, errors)
        finally:
            waiter.close()
            if owned:
                publisher.close()
        if strict and recording.unpublished:
            listing = "\n".join(
                f"  - {decode_message(envelope).describe()}: "
                f"{result.outcome.value} {result.error}".rstrip()
                for envelope, result in recording.unpublished
            )
            raise OutboxDrainError(
                f"The drain published {len(recording.published)} message(s), but "
                f"{len(recording.unpublished)} were not confirmed by the broker:\n"
                f"{listing}"
            )
        return recording.published

    def _make_scheduled_due(self) -> None:
        from .models import OutboxMessage

        waiting = OutboxMessage.objects.using(self.alias).filter(due_at__isnull=False)
        ids = list(waiting.values_list("id", flat=True))
        if ids:
            Stores(self.alias).operator().retry_now(ids)

    @staticmethod
    def _run(relay: Relay, errors: list[LoopError]) -> None:
        for _ in range(MAX_DRAIN_BATCHES):
            cycle = relay.run_once()
            if errors:
                raise OutboxDrainError(
                    "The relay failed while draining the outbox: "
                    + "; ".join(f"{e.stage}: {e.error}" for e in errors)
                )
            if cycle in (Turn.EMPTY, Turn.PAUSED):
                return
        raise OutboxDrainError(
            f"The outbox was still not empty after {MAX_DRAIN_BATCHES} batches."
        )

    def drained_messages(self) -> list[EnqueuedTask]:
        """Everything :meth:`drain` published to :attr:`broker` so far, decoded."""
        return [decode_message(e) for e in self.broker.published]

    # -- run ---------------------------------------------------------------------

    def run_enqueued(
        self, *, max_rounds: int = 10, propagate: bool = True
    ) -> list[ExecutedTask]:
        """Drain to the in-memory broker and run each message as a worker would.

        Each message is decoded and run with Celery's ``Task.apply`` under its own
        task id, with its callbacks (``link``) and the rest of its chain. Tasks
        enqueued while running are picked up in the next round, up to
        ``max_rounds``; if the outbox still holds messages then, the call fails.
        ``eta``, ``countdown`` and ``expires`` are not waited for. With
        ``propagate`` a task's exception is raised here.
        """
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be at least 1, got {max_rounds}.")
        executed: list[ExecutedTask] = []
        for _ in range(max_rounds):
            envelopes = self.drain()
            if not envelopes:
                return executed
            for envelope in envelopes:
                executed.append(self.run_message(envelope, propagate=propagate))
        left = self.messages
        if left:
            raise AssertionError(
                f"Tasks were still being enqueued after {max_rounds} round(s) of "
                f"run_enqueued (a task that keeps enqueueing itself?). Raise max_rounds "
                f"if that is expected. Still in the outbox ({len(left)}):\n"
                + _listing(left)
            )
        return executed

    def run_message(
        self, envelope: Envelope, *, propagate: bool = True
    ) -> ExecutedTask:
        """Run one published message with ``Task.apply``, as a worker would receive it."""
        message = decode_message(envelope)
        app = self.app
        try:
            task = app.tasks[message.task_name]
        except KeyError:
            raise LookupError(
                f"Task {message.task_name!r} (id {message.task_id}) is not registered "
                f"in the Celery app {app.main!r}; a worker would reject it. Is the "
                f"module that defines it imported (autodiscover_tasks)?"
            ) from None
        with _capture_sends_from_tasks(), _sent_by(message):
            result = task.apply(
                message.args,
                message.kwargs,
                link=message.embed.get("callbacks"),
                link_error=message.embed.get("errbacks"),
                task_id=message.task_id,
                retries=message.retries,
                throw=propagate,
                exchange=message.exchange,
                routing_key=message.routing_key,
                priority=message.priority,
            )
            if result.state == "SUCCESS":
                _continue_chain(app, message, result.result)
        return ExecutedTask(message, result)


@contextlib.contextmanager
def _sent_by(message: EnqueuedTask) -> Iterator[None]:
    """Run ``Task.apply`` with the lineage (parent and root ids) the message carries.

    A worker takes a task's ``parent_id`` and ``root_id`` from the message; Celery's
    ``Task.apply`` does not (before 5.6 it sets neither, from 5.6 it takes them from
    the task running around the call). Celery's public ``task_prerun`` signal comes
    after the request is pushed and before the body runs: the message's lineage is
    written into that request there, so every Celery version gives the task what a
    worker would.
    """
    parent_id = message.parent_id
    root_id = message.root_id or message.task_id

    def give_lineage(sender: Any = None, task_id: Any = None, **_: Any) -> None:
        request = getattr(sender, "request", None)
        if task_id == message.task_id and request is not None:
            request.parent_id = parent_id
            request.root_id = root_id

    task_prerun.connect(give_lineage, weak=False)
    try:
        yield
    finally:
        task_prerun.disconnect(give_lineage)


def _capture_sends_from_tasks() -> Any:
    """Settings under which every task a running task sends lands in the outbox.

    A real worker publishes some sends straight to the broker: excluded task names,
    and calls outside a transaction when ``CELERY_OUTBOX_DIRECT_FROM_WORKER`` is on.
    In a test they must not reach a broker; in the outbox, :meth:`run_enqueued` runs
    them in its next round. The calls that would have gone direct are written
    without the outside-transaction warning, since a worker would not warn either.
    """
    from django.test import override_settings

    overrides: dict[str, Any] = {"CELERY_OUTBOX_EXCLUDE_TASKS": ()}
    if get_settings().direct_from_worker:
        overrides["CELERY_OUTBOX_DIRECT_FROM_WORKER"] = False
        overrides["CELERY_OUTBOX_OUTSIDE_TRANSACTION"] = "allow"
    return override_settings(**overrides)


def _continue_chain(app: Any, message: EnqueuedTask, retval: Any) -> None:
    """Send the next step of a chain, as the worker does after a success."""
    chain = list(message.embed.get("chain") or ())
    if not chain:
        return
    from celery import signature

    following = signature(chain.pop(), app=app)
    options: dict[str, Any] = {
        "chain": chain,
        "parent_id": message.task_id,
        "root_id": message.root_id or message.task_id,
    }
    if message.priority is not None:
        options["priority"] = message.priority
    following.apply_async((retval,), **options)


def _as_publisher(candidate: Any) -> Publisher:
    # InMemoryPublisher.publish names its second parameter ``deadline: float`` while
    # the Publisher protocol passes a Budget; it never reads it, so it is a Publisher
    # in every way the relay uses.
    publisher: Publisher = candidate
    return publisher


def _envelope_of(row: Any) -> Envelope:
    return Envelope(
        task_id=row.task_id,
        task_name=row.task_name,
        exchange=row.exchange,
        routing_key=row.routing_key,
        body=bytes(row.body),
        content_type=row.content_type,
        content_encoding=row.content_encoding,
        headers=load_json(row.headers),
        properties=load_json(row.properties),
        declare=read_declarations(row.declare_queues)[0],
        declare_specs=read_declarations(row.declare_queues)[1],
        queue=row.queue,
        arguments_preview=row.arguments_preview,
        ordering_key=row.ordering_key,
    )
