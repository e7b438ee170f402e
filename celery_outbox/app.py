"""OutboxCelery: a ``celery.Celery`` whose publishes become outbox rows."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from celery import Celery, Task
from django.db import connections
from django.utils.module_loading import import_string

from .broker.amqpcodec import shortstr_problem
from .celeryconf import MemoizedSettings, memoize
from .conf import OutboxSettings, get_settings
from .enqueue import (
    CallContext,
    CapturingProducer,
    Enqueuer,
    Route,
    choose_route,
    outbox_alias,
    refuse_for_amqp,
)
from .exceptions import OutboxConfigurationError
from .fastpath import (
    PlainCall,
    Shapes,
    call_parts,
    current_process,
    new_task_id,
    publish_watched,
    task_id_of,
    task_running,
)

#: Where a task keeps its :class:`PlainCall` per thread.
_PLAIN_CALLS = "_outbox_plain_calls"
#: Threads whose plain calls a task keeps before it starts again.
_MAX_PLAIN_THREADS = 256

_instances: weakref.WeakSet[OutboxCelery] = weakref.WeakSet()


class OutboxCelery(Celery):
    """A Celery app that writes every task into the outbox, in the caller's transaction.

    ``delay()``, ``apply_async()``, ``send_task()`` and canvas (chain, group, chord
    header) all end in :meth:`send_task`; the call returns the usual ``AsyncResult``
    with the task id the worker will see. The relay (``manage.py outbox relay``)
    publishes the row once the transaction has committed.
    """

    #: Its plain calls skip most of Celery once one was sent (an app's own
    #: ``task_cls`` still works: its calls take the longer way).
    task_cls = "celery_outbox.task:OutboxTask"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._outbox_enqueuer = Enqueuer(on_commit=self._publish_after_commit)
        # A kombu Connection object per call cost a third of an enqueue: the unbuffered
        # capture producer holds no per-call state, so each thread keeps one.
        self._outbox_local = threading.local()
        self._outbox_commit_publisher: Any = None
        self._outbox_shapes = Shapes()
        # Celery sends this each time it has (re)loaded its configuration.
        self.on_after_configure.connect(_memoize_configuration, weak=False)
        _instances.add(self)

    def send_task(self, name: str, *args: Any, **options: Any) -> Any:
        """Send a task by name: through the outbox, or direct when :func:`choose_route` says so."""
        settings = get_settings()
        given = options.get("producer")
        running = self.current_worker_task
        if self._route(name, options.get("task_id"), settings, running) is Route.DIRECT:
            if given is None or isinstance(given, CapturingProducer):
                # Our producer_or_acquire buffers into the outbox: take a real one.
                with super().producer_or_acquire(None) as producer:
                    options["producer"] = producer
                    return super().send_task(name, *args, **options)
            return super().send_task(name, *args, **options)
        options.pop("connection", None)
        options.pop("publisher", None)
        if given is None and running is None and settings.fast_enqueue:
            return self._send_by_shape(name, args, options, settings)
        if not isinstance(given, CapturingProducer):
            options["producer"] = self._thread_producer()
        return super().send_task(name, *args, **options)

    def _send_by_shape(
        self,
        name: str,
        call_args: tuple[Any, ...],
        options: dict[str, Any],
        settings: OutboxSettings,
    ) -> Any:
        """Reuse the template of the call's shape, or go through Celery and learn one."""
        key = Shapes.key(name, call_args, options)  # before the producer is set
        producer = options["producer"] = self._thread_producer()
        conf = self.conf
        parts = call_parts(call_args)
        task_id = task_id_of(options)
        if task_id is not None:
            options["task_id"] = task_id  # Celery, if it sends this call, uses it too
        if (
            key is None
            or parts is None
            or task_id is None
            or not isinstance(conf, MemoizedSettings)
        ):
            return super().send_task(name, *call_args, **options)
        version = conf.version
        template = self._outbox_shapes.get(key, version)
        if template is None:
            process = current_process()
            producer.last = None
            result = super().send_task(name, *call_args, **options)
            last = producer.last
            # Only this call's own message: a receiver of message_created may have
            # sent another task (through Celery, too) since.
            if last is not None and last.task_id == task_id and last.task_name == name:
                self._outbox_shapes.learn(
                    key,
                    last,
                    version=version,
                    process=process,
                    args=parts[0],
                    kwargs=parts[1],
                    options=options,
                    app=self,
                    settings=settings,
                )
            return result
        if producer.amqp:  # the id is also the correlation_id, a short string
            refuse_for_amqp(name, shortstr_problem("task id", task_id))
        envelope = template.build(name, task_id, parts[0], parts[1], settings)
        self._outbox_shapes.used(task_id, template)
        ignore_result = options.get("ignore_result")
        if not ignore_result:
            self.backend.on_task_call(producer, task_id)
        self._outbox_enqueuer.write([envelope])
        result = (options.get("result_cls") or self.AsyncResult)(task_id)
        result.ignored = ignore_result
        return result

    def _send_plain(
        self, task: Any, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
    ) -> Any:
        """Send a plain call of ``task`` as its last one was sent; None: through Celery.

        Does what Celery's ``apply_async`` and :meth:`_send_by_shape` would do for this
        call, minus what the thread's :class:`PlainCall` already settled: the options
        (Celery keeps a task's options once read), the route and the shape.
        """
        plains: dict[int, PlainCall] | None = task.__dict__.get(_PLAIN_CALLS)
        if plains is None:
            return None
        plain = plains.get(threading.get_ident())
        if plain is None:
            return None
        template = plain.template
        conf = plain.conf
        # Another send_task (a subclass's, or one put on the app, such as a test's
        # mock) must see every call.
        if (
            type(self).send_task is not _OWN_SEND_TASK
            or "send_task" in self.__dict__
            or self.conf is not conf
            or template.version is not conf.version
            or template.process is not current_process()
            or plain.settings is not get_settings()
            or task.ignore_result is not plain.ignore_result
            or publish_watched()
            or task_running()  # inside a task: lineage, maybe direct
        ):
            return None
        soft, hard = task.soft_time_limit, task.time_limit
        if soft and hard and soft > hard:
            return None  # Celery's apply_async says what is wrong
        parts = call_parts((args, kwargs))
        if parts is None:
            return None
        if task.typing:
            check_arguments = getattr(task, "__header__", None)
            if check_arguments is not None:
                check_arguments(*parts[0], **parts[1])  # Celery's TypeError, as is
        # A new id is always a short ASCII string: no check for RabbitMQ needed.
        task_id = new_task_id()
        envelope = template.build(
            task.name, task_id, parts[0], parts[1], plain.settings
        )
        ignore_result = plain.ignore_result
        if not ignore_result:
            self.backend.on_task_call(self._thread_producer(), task_id)
        self._outbox_enqueuer.write([envelope])
        result = task.AsyncResult(task_id)
        result.ignored = ignore_result
        return result

    def _learn_plain(self, task: Any, result: Any) -> None:
        """After a plain call went through Celery: keep how it was sent, if a template built it."""
        if (
            type(task).shadow_name is not Task.shadow_name  # a shadow per call
            or task.__v2_compat__
            or getattr(task, "_dump_pydantic_arguments", None) is not None
        ):
            return
        template = self._outbox_shapes.built(getattr(result, "id", None) or "")
        conf = self.conf
        if template is None or not isinstance(conf, MemoizedSettings):
            return
        plains: dict[int, PlainCall] = task.__dict__.setdefault(_PLAIN_CALLS, {})
        if len(plains) >= _MAX_PLAIN_THREADS:  # threads come and go
            plains.clear()
        plains[threading.get_ident()] = PlainCall(
            template, conf, get_settings(), task.ignore_result
        )

    @contextlib.contextmanager
    def producer_or_acquire(  # type: ignore[override]
        self, producer: Any = None
    ) -> Iterator[Any]:
        """Celery's canvas sends a group's members through one producer: buffer them.

        Every member that goes through the outbox is collected and written in one
        INSERT when the group is complete, still inside the caller's transaction.
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

    def _publish_after_commit(self, alias: str, task_ids: Sequence[str]) -> None:
        if self._outbox_commit_publisher is None:
            from .relay.oncommit import CommitPublisher

            self._outbox_commit_publisher = CommitPublisher(self)
        self._outbox_commit_publisher.schedule(alias, task_ids)

    def _thread_producer(self) -> CapturingProducer:
        producer: CapturingProducer | None = getattr(
            self._outbox_local, "producer", None
        )
        if producer is None:
            producer = self._outbox_local.producer = self._capturing_producer(
                buffered=False
            )
        return producer

    def _capturing_producer(self, *, buffered: bool) -> CapturingProducer:
        conf = self.conf
        connection = self.connection_for_write()
        return CapturingProducer(
            connection=connection,
            default_serializer=conf.task_serializer,
            default_compression=conf.task_compression,
            sink=self._outbox_enqueuer.write,
            buffered=buffered,
            event_exchange=conf.event_exchange,
            # A group's producer asks the thread's: a kombu transport per group is
            # not free.
            amqp=self._thread_producer().amqp
            if buffered
            else _publishes_with_amqp(connection),
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


#: Plain calls skip Celery's apply_async, which ends in ``send_task``: only while
#: nobody has put another ``send_task`` in its place.
_OWN_SEND_TASK = OutboxCelery.send_task


def _publishes_with_amqp(connection: Any) -> bool:
    """Whether the relay would publish over py-amqp (``amqp://``, ``pyamqp://``)."""
    try:
        return bool(connection.transport.driver_type == "amqp")
    except Exception:  # an unknown transport: the relay says so at start-up
        return False


def _memoize_configuration(sender: Any = None, source: Any = None, **_: Any) -> None:
    memoize(source)


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
