"""Events and subscribers of one Celery app, and the task that delivers events to them.

Every event is one message whose Celery task name is :data:`DELIVER_TASK` in every
service, with the event name in the ``outbox_event`` header and the arguments as the
task's arguments. Each service registers its own task of that name (done by the
first ``@app.subscriber``): it finds the service's one subscriber whose pattern
matches the event and calls it. A service's patterns may not overlap, so each copy of
an event reaches exactly one of its queues and one subscriber runs it.

"Subscriber" is the events' word; ``celery_outbox.handlers`` (the handler outbox) has
receivers.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..conf import get_settings
from ..exceptions import OutboxConfigurationError
from .modes import Retries, resolve, transport_of
from .names import (
    check_event_name,
    check_name,
    check_pattern,
    check_service,
    matches,
    overlap,
)
from .topology import ServiceTopology, unrouted_queue

logger = logging.getLogger("celery_outbox.events")

#: The task name of every event message; each service has its own task of this name.
DELIVER_TASK = "celery_outbox.events.deliver"
#: The message header naming the event.
EVENT_HEADER = "outbox_event"

#: Called with a registry when its first subscriber is added, in the order added.
#: The parts of this folder that act on a service with subscribers hook in here as
#: they are imported (the package imports them), so this module needs none of them:
#: :mod:`.worker` declares and consumes the service's queues at worker start, and
#: :mod:`.delivery` registers the delivering task.
FIRST_SUBSCRIBER: list[Callable[[Registry], None]] = []


@dataclass(frozen=True)
class Subscriber:
    """One subscriber of one service: its pattern, its task and its retry policy."""

    pattern: str
    task: Any
    #: Retry steps before the event is archived; None: ``CELERY_OUTBOX_EVENTS_MAX_RETRIES``.
    max_retries: int | None
    #: Exceptions retried; any other exception archives the event at once.
    retry_for: tuple[type[BaseException], ...]

    def steps(self) -> int:
        if self.max_retries is not None:
            return self.max_retries
        return get_settings().events_max_retries


class Event:
    """An event declared with ``@app.event(name)``: call it (or ``.fire``) to fire it.

    The decorated function validates the arguments: when it raises, nothing is
    written. Then the event is written to the outbox in the caller's transaction.
    """

    def __init__(self, app: Any, name: str, validate: Callable[..., Any]) -> None:
        self.app = app
        self.name = check_event_name(name)
        self.validate = validate
        self.__doc__ = validate.__doc__
        self.__wrapped__ = validate

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fire(*args, **kwargs)

    def fire(self, *args: Any, **kwargs: Any) -> Any:
        """Validate, then enqueue the event; returns the message's ``AsyncResult``."""
        self.validate(*args, **kwargs)
        settings = get_settings()
        return self.app.send_task(
            DELIVER_TASK,
            args=list(args),
            kwargs=kwargs,
            exchange=settings.events_exchange,
            routing_key=self.name,
            headers={EVENT_HEADER: self.name},
            # The relay declares the events exchange (and its sink) from this.
            declare=[unrouted_queue(settings)],
            ignore_result=True,
        )

    def __repr__(self) -> str:
        return f"<Event {self.name}>"


class Registry:
    """The events and subscribers declared on one app."""

    def __init__(self, app: Any) -> None:
        self._app = weakref.ref(app)
        self.subscribers: dict[str, Subscriber] = {}
        self._has_subscribers = False
        self._retries: dict[tuple[str, str], Retries] = {}

    @property
    def app(self) -> Any:
        app = self._app()
        if app is None:  # pragma: no cover - the app owns the registry
            raise RuntimeError("the app of this registry is gone")
        return app

    @property
    def service(self) -> str:
        return check_service(self.app.main)

    def topology(self) -> ServiceTopology:
        settings = get_settings()
        return ServiceTopology(
            settings, self.service, tuple(self.subscribers), self.retries()
        )

    def transport(self) -> str:
        """kombu's transport type of the app's broker (``amqp``, ``redis`` ...)."""
        with self.app.connection_for_write() as connection:
            return transport_of(connection)

    def retries(self) -> Retries:
        """Who holds this service's retries, for the current setting and broker."""
        setting = get_settings().events_retries
        key = (setting, str(self.app.conf.broker_url or ""))
        found = self._retries.get(key)
        if found is None:
            found = self._retries[key] = resolve(setting, self.transport())
        return found

    def add_subscriber(
        self,
        pattern: str,
        function: Callable[..., Any],
        *,
        max_retries: int | None = None,
        retry_for: tuple[type[BaseException], ...] = (Exception,),
        **task_options: Any,
    ) -> Any:
        """Register ``function`` as this service's subscriber to ``pattern``; returns its task."""
        check_pattern(pattern)
        service = self.service
        _refuse_shared_service(self, service)
        for existing in self.subscribers:
            if overlap(existing, pattern):
                raise OutboxConfigurationError(
                    f"Service {service!r} already subscribes to {existing!r}, and "
                    f"{pattern!r} can match the same events: one event would reach "
                    f"two of its queues. Take both in one subscriber, or use patterns "
                    f"that do not overlap."
                )
        if max_retries is not None and not 0 <= max_retries <= 24:
            raise OutboxConfigurationError(
                f"max_retries of the subscriber to {pattern!r} must be 0-24, got "
                f"{max_retries!r}."
            )
        task_options.setdefault(
            "name", f"{function.__module__}.{function.__qualname__}"
        )
        check_name(
            task_options["name"], "subscriber name", f"Invalid subscriber {pattern!r}"
        )
        # A subscriber belongs to its service: not added to every app created later.
        task_options.setdefault("shared", False)
        task = self.app.task(**task_options)(function)
        self.subscribers[pattern] = Subscriber(
            pattern, task, max_retries, tuple(retry_for)
        )
        self._first_subscriber()
        return task

    def subscriber_for(self, event: str) -> Subscriber | None:
        """The one subscriber whose pattern matches ``event``, if any."""
        for pattern, subscriber in self.subscribers.items():
            if matches(pattern, event):
                return subscriber
        return None

    def _first_subscriber(self) -> None:
        if self._has_subscribers:
            return
        for hook in FIRST_SUBSCRIBER:
            hook(self)
        self._has_subscribers = True


#: The attribute of an app that holds its :class:`Registry`. On the app itself, not in
#: a weak-keyed mapping: the registry's subscriber tasks refer to the app, and a mapping
#: value that refers to its own key keeps it alive for good.
_ATTRIBUTE = "_celery_outbox_events"
_apps: weakref.WeakSet[Any] = weakref.WeakSet()


def registry_of(app: Any) -> Registry:
    """The :class:`Registry` of ``app`` (created on first use)."""
    registry: Registry | None = getattr(app, _ATTRIBUTE, None)
    if registry is None:
        registry = Registry(app)
        setattr(app, _ATTRIBUTE, registry)
        _apps.add(app)
    return registry


def _refuse_shared_service(registry: Registry, service: str) -> None:
    for other_app in list(_apps):
        other = registry_of(other_app)
        if other is not registry and other.subscribers and other_app.main == service:
            raise OutboxConfigurationError(
                f"Two apps with subscribers are both named {service!r}: they would share "
                f"its queues and each get only some of the events. Give each service "
                f"its own name: OutboxCelery('billing'), OutboxCelery('shipping')."
            )
