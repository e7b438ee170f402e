"""OutboxCelery: a ``celery.Celery`` whose publishes become outbox rows."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from celery import Celery
from celery.utils import uuid
from django.db import DatabaseError, connections
from django.utils.module_loading import import_string

from .conf import OutboxSettings, get_settings
from .enqueue import (
    CallContext,
    CapturingProducer,
    Enqueuer,
    Route,
    choose_route,
    is_excluded,
)
from .envelope import Envelope
from .exceptions import OutboxConfigurationError, OutboxDatabaseError
from .flow.worker import install as install_flow_reports
from .flow_limits import KEY_HEADER, flow_of
from .ordering.worker import install as install_ordering_reports
from .scheduling import far_eta
from .store import outbox_alias
from .text import check_text

_instances: weakref.WeakSet[OutboxCelery] = weakref.WeakSet()

logger = logging.getLogger("celery_outbox")


class OutboxCelery(Celery):
    """A Celery app that writes every task into the outbox, in the caller's transaction.

    ``delay()``, ``apply_async()``, ``send_task()`` and canvas (chain, group, chord
    header) all end in :meth:`send_task`; the call returns the usual ``AsyncResult``
    with the task id the worker will see. The relay (``manage.py outbox relay``)
    publishes the row once the transaction has committed.
    """

    #: Celery's ``DjangoTask`` plus the opt-in inbox (``@app.task(inbox=True)``) and
    #: the ordering defaults (``@app.task(ordering="strict")``), composed in
    #: :mod:`celery_outbox.task`; no-ops for tasks that do not use them. A
    #: ``task_cls=`` argument still wins (derive it from ``OutboxTask``).
    task_cls = "celery_outbox.task:OutboxTask"
    #: Celery's remote control, whose ``revoke()`` first deletes a task's outbox row
    #: (:mod:`celery_outbox.revoke`).
    control_cls = "celery_outbox.revoke:OutboxControl"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Given as an argument: Celery 5.4's Django fix-up replaces a task class
        # it was not given so (5.5 on also keeps a subclass's attribute).
        kwargs.setdefault("task_cls", self.task_cls)
        super().__init__(*args, **kwargs)
        self._outbox_enqueuer = Enqueuer(
            on_commit=self._publish_after_commit, on_expired=self._announce_expired
        )
        # A kombu Connection object per call cost a third of an enqueue: the unbuffered
        # capture producer holds no per-call state, so each thread keeps one.
        self._outbox_local = threading.local()
        self._outbox_commit_publisher: Any = None
        _instances.add(self)
        # Strict ordering and flow keys: workers report when a watched task starts
        # or ends (no-op for the others).
        install_ordering_reports()
        install_flow_reports()

    def send_task(self, name: str, *args: Any, **options: Any) -> Any:
        """Send a task by name: through the outbox, or direct when :func:`choose_route` says so."""
        settings = get_settings()
        given = options.get("producer")
        running = self.current_worker_task
        if running is not None and "flow_key" not in options:
            inherited = retried_flow_key(running, options.get("task_id"))
            if inherited is not None:
                options["flow_key"] = inherited
        if self._route(name, options.get("task_id"), settings, running) is Route.DIRECT:
            if self._schedules(name, options, settings) or self._gated(name, settings):
                # Celery would publish it at once, to wait in a worker: it waits in
                # the outbox instead, written on its own (no transaction to join).
                # A flow's task (a retry, a task sent by a task) does too: its rate
                # counts what the relays publish, and only they do.
                options["task_id"] = options.get("task_id") or uuid()
                try:
                    return super().send_task(
                        name,
                        *args,
                        **{**options, "producer": self._thread_producer(guarded=False)},
                    )
                except (DatabaseError, OutboxDatabaseError) as exc:
                    # Celery needs only the broker: a worker's retry must not be
                    # lost (Task.retry rejects the message when the send fails).
                    logger.warning(
                        "the outbox database failed (%s: %s): task %s [%s] goes to "
                        "the broker at once, as Celery sends it (a task due later "
                        "waits in a worker until its ETA; a flow's task is not "
                        "counted by its flow)",
                        type(exc).__name__,
                        exc,
                        name,
                        options["task_id"],
                    )
            options.pop("flow_key", None)  # not a message property: no flow counts it
            if given is None or isinstance(given, CapturingProducer):
                # Our producer_or_acquire buffers into the outbox: take a real one.
                with super().producer_or_acquire(None) as producer:
                    options["producer"] = producer
                    return super().send_task(name, *args, **options)
            return super().send_task(name, *args, **options)
        options.pop("connection", None)
        options.pop("publisher", None)
        if options.get("task_id") is not None:  # a result backend may use it first
            check_text(options["task_id"], "task_id", f"Cannot enqueue task {name!r}")
        producer = given
        if not isinstance(producer, CapturingProducer):
            producer = options["producer"] = self._thread_producer()
        result = super().send_task(name, *args, **options)
        holder = producer.take_holder(result.id)
        if holder is not None:
            # Another task holds the call's dedup_key: nothing was written; the
            # caller gets that task's result, as if it had sent it.
            ignored = getattr(result, "ignored", None)
            result = (options.get("result_cls") or self.AsyncResult)(holder)
            if ignored is not None:
                result.ignored = ignored
        return result

    @contextlib.contextmanager
    def producer_or_acquire(  # type: ignore[override]
        self, producer: Any = None
    ) -> Iterator[Any]:
        """Celery's canvas sends a group's members through one producer: buffer them.

        Inside the caller's transaction, every member that goes through the outbox
        is collected and written in one INSERT when the group is complete. Outside
        one, the first member is written at once, as Celery would publish it, and
        the others together, or as they come when the group is built slowly (a
        generator: Celery publishes each member as it is yielded).
        """
        if producer is not None:
            yield producer
            return
        buffer = self._capturing_producer(buffered=True)
        try:
            yield buffer
        except BaseException:
            buffer.discard()
            raise
        buffer.flush()

    def event(self, name: str) -> Callable[[Callable[..., Any]], Any]:
        """Declare an event: ``@app.event("order.created")`` on a validating function.

        Calling the result validates, then writes the event in the caller's
        transaction; see :mod:`celery_outbox.events`.
        """
        from .events import Event

        return lambda function: Event(self, name, function)

    def subscriber(
        self, pattern: str, **options: Any
    ) -> Callable[[Callable[..., Any]], Any]:
        """Subscribe to the events matching ``pattern`` (``order.*``) in this app's service.

        The function becomes a task of this app; ``max_retries=`` and ``retry_for=``
        set its retries, ``inbox=True`` runs it once per event. See
        :mod:`celery_outbox.events`.
        """
        from .events import registry_of

        return lambda function: registry_of(self).add_subscriber(
            pattern, function, **options
        )

    def _publish_after_commit(self, alias: str, task_ids: Sequence[str]) -> None:
        if self._outbox_commit_publisher is None:
            from .relay.oncommit import CommitPublisher
            from .signals import send_relay_signals

            # The relay's Django signals, as `outbox relay` sends them.
            self._outbox_commit_publisher = CommitPublisher(
                self, observers=[send_relay_signals]
            )
        self._outbox_commit_publisher.schedule(alias, task_ids)

    def _announce_expired(self, envelopes: Sequence[Envelope]) -> None:
        """Scheduled tasks that expire before their ETA went to the dead letters: the
        result backend says what a worker that received them would (revoked, expired)."""
        from .revoke import EXPIRED_REASON, announce

        announce(self, envelopes, reason=EXPIRED_REASON)

    def _thread_producer(self, *, guarded: bool = True) -> CapturingProducer:
        attribute = "producer" if guarded else "unguarded_producer"
        producer: CapturingProducer | None = getattr(
            self._outbox_local, attribute, None
        )
        if producer is None:
            producer = self._capturing_producer(buffered=False, guarded=guarded)
            setattr(self._outbox_local, attribute, producer)
        return producer

    def _capturing_producer(
        self, *, buffered: bool, guarded: bool = True
    ) -> CapturingProducer:
        conf = self.conf
        connection = self.connection_for_write()
        write = self._outbox_enqueuer.write
        return CapturingProducer(
            connection=connection,
            default_serializer=conf.task_serializer,
            default_compression=conf.task_compression,
            sink=write if guarded else functools.partial(write, guarded=False),
            buffered=buffered,
            event_exchange=conf.event_exchange,
            # A group's producer asks the thread's: a kombu transport per group is
            # not free.
            amqp=self._thread_producer().amqp
            if buffered
            else _publishes_with_amqp(connection),
            zone=self.timezone,
            autocommit=self._outbox_enqueuer.autocommit if buffered else None,
        )

    def _gated(self, name: str, settings: OutboxSettings) -> bool:
        """Whether a call a worker would send straight to the broker is a flow's
        task (docs/flow.md), written to the outbox instead, as :meth:`_schedules`.

        Not inside ``atomic()`` on the outbox alias: ``Task.retry`` raises through
        the block, which would roll the row back (it goes to the broker then).
        """
        return (
            bool(settings.flows)
            and flow_of(settings.flows, name) is not None
            and not is_excluded(name, settings.exclude_tasks)
            and not connections[outbox_alias(settings)].in_atomic_block
        )

    def _schedules(
        self, name: str, options: dict[str, Any], settings: OutboxSettings
    ) -> bool:
        """Whether a call routed to the broker is scheduled in the outbox instead.

        A far ETA (:func:`~.scheduling.far_eta`) from a worker, unless the task is
        excluded, or the outbox alias is inside ``atomic()``: ``Task.retry`` raises
        through the block, which would roll the row back.
        """
        return (
            far_eta(options, settings.schedule_after, zone=self.timezone)
            and not is_excluded(name, settings.exclude_tasks)
            and not connections[outbox_alias(settings)].in_atomic_block
        )

    def _route(
        self, name: str, task_id: str | None, settings: OutboxSettings, running: Any
    ) -> Route:
        running_id = running.request.id if running is not None else None
        in_atomic = others_in_atomic = False
        if running_id is not None:
            alias = outbox_alias(settings)
            in_atomic = connections[alias].in_atomic_block
            others_in_atomic = any(
                conn.in_atomic_block
                for conn in connections.all(initialized_only=True)
                if conn.alias != alias
            )
        return choose_route(
            CallContext(
                task_name=name,
                task_id=task_id,
                running_task_id=running_id,
                outbox_in_atomic=in_atomic,
                other_alias_in_atomic=others_in_atomic,
            ),
            settings,
        )


def _publishes_with_amqp(connection: Any) -> bool:
    """Whether the relay would publish over py-amqp (``amqp://``, ``pyamqp://``)."""
    try:
        return bool(connection.transport.driver_type == "amqp")
    except Exception:  # an unknown transport: the relay says so at start-up
        return False


def resolve_app(settings: OutboxSettings | None = None) -> OutboxCelery:
    """The app the relay publishes with: ``CELERY_OUTBOX_APP``, or the only OutboxCelery."""
    settings = settings or get_settings()
    if settings.app:
        try:
            app = import_string(settings.app)
        except ImportError as exc:
            raise OutboxConfigurationError(
                f"CELERY_OUTBOX_APP = {settings.app!r} cannot be imported ({exc}). Set it "
                f"to the dotted path of your Celery app, e.g. 'proj.celery.app'."
            ) from exc
        if not isinstance(app, OutboxCelery):
            raise OutboxConfigurationError(
                f"CELERY_OUTBOX_APP = {settings.app!r} is a {type(app).__name__}, not an "
                f"OutboxCelery. Create your app with celery_outbox.OutboxCelery(...)."
            )
        return app
    if len(_instances) > 1:
        # A dropped app lives on in its reference cycles until the collector runs.
        gc.collect()
    apps = list(_instances)
    if len(apps) == 1:
        return apps[0]
    found = "no OutboxCelery app was created" if not apps else f"{len(apps)} apps exist"
    raise OutboxConfigurationError(
        f"Cannot tell which Celery app the relay should use: {found}. Set "
        f"CELERY_OUTBOX_APP = 'proj.celery.app' (the dotted path of your OutboxCelery)."
    )


def retried_flow_key(running: Any, task_id: Any) -> str | None:
    """The flow key of the task a worker runs, when it sends itself again (a
    ``retry()``: the same task id), so that its retry waits for a slot of the same
    key; None otherwise. A broker's custom header reaches the request as an
    attribute; an eager or direct call's, in its ``headers``."""
    request = getattr(running, "request", None)
    if request is None or task_id is None or getattr(request, "id", None) != task_id:
        return None
    key = getattr(request, KEY_HEADER, None) or (
        getattr(request, "headers", None) or {}
    ).get(KEY_HEADER)
    return key if isinstance(key, str) and key else None
