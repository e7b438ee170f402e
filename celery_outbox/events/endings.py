"""The endings of a delivery that the worker's main process sees, settled as the lane's.

The delivering task settles a failed subscriber in the pool's process that ran it
(:func:`~.delivery.deliver`): the retry or the archive is written, then the message
is acked. Two endings never reach that code, because the process is gone: the hard
time limit (the pool kills the process) and a lost process (killed, out of memory:
``WorkerLostError``). Left to Celery, the main process acks, rejects or requeues the
message by the task's options, and not the same in every release: with ``acks_late``
and ``acks_on_failure_or_timeout`` off, 5.4 rejects a timed-out message (RabbitMQ
dead-letters it into retry step 0; Redis drops it), 5.5 and 5.6 requeue it, and 5.7
requeues it unless ``acks_on_timeout``; with ``reject_on_worker_lost`` every release
requeues a lost one. A requeued message runs again at once, uncounted: an event that
always times out (or always kills its process) ran for ever.

:class:`DeliveryRequest`, the delivering task's request class (Celery's
``Task.Request``), settles both in the main process before Celery does: the retry
or the archive is published (or written) as :func:`~.delivery.settle_outside` says
for a subscriber that raised ``TimeLimitExceeded`` or ``WorkerLostError``, then the
message is acked; Celery's own handling, which follows, finds it acknowledged and
only records and signals. It also gives each delivery its subscriber's time limits
(``@app.subscriber(..., time_limit=, soft_time_limit=)``), which the subscriber's
task, called inside the delivering one, would otherwise not have.

A lost process while the worker shuts down cold is not the subscriber's doing: that
one is left to Celery (``reject_on_worker_lost`` requeues it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from billiard.einfo import ExceptionWithTraceback  # type: ignore[attr-defined]
from celery.app.task import Context
from celery.exceptions import Reject, TimeLimitExceeded, WorkerLostError
from celery.worker import state as worker_state
from celery.worker.request import Request
from django.db import close_old_connections

from .delivery import settle_outside
from .registry import EVENT_HEADER, registry_of

logger = logging.getLogger("celery_outbox.events")

#: Celery's (hard, soft) time limits of one request; None where unset.
TimeLimits = tuple[float | None, float | None]


def subscriber_limits(
    app: Any, request_dict: Mapping[str, Any], limits: Sequence[Any]
) -> TimeLimits:
    """A delivery's time limits: the message's own, else its subscriber's (else, as
    Celery goes on, the delivering task's and the worker's)."""
    hard, soft = limits
    event = request_dict.get(EVENT_HEADER)
    subscriber = (
        registry_of(app).subscriber_for(event) if isinstance(event, str) else None
    )
    if subscriber is None:
        return hard, soft
    task = subscriber.task
    return hard or task.time_limit, soft or task.soft_time_limit


class DeliveryRequest(Request):
    """The worker's request of an event delivery (the delivering task's ``Request``)."""

    #: Set once the main process settled this delivery (5.7 tells a time limit twice).
    settled = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.time_limits = subscriber_limits(
            self.task.app, self.request_dict, self.time_limits
        )

    def on_timeout(self, soft: bool, timeout: float) -> None:
        """Celery's, after settling a hard time limit (the gevent and eventlet pools
        tell it here only; prefork first through :meth:`on_failure`)."""
        if not soft:
            self._settle(TimeLimitExceeded(timeout))
        super().on_timeout(soft, timeout)

    def on_failure(self, exc_info: Any, *args: Any, **kwargs: Any) -> None:
        """Celery's, after settling a hard time limit or a lost process."""
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        lost = isinstance(exc, WorkerLostError) and not worker_state.should_terminate
        if lost or isinstance(exc, TimeLimitExceeded):
            self._settle(exc)
        super().on_failure(exc_info, *args, **kwargs)

    def _settle(self, exc: BaseException) -> None:
        """Write the retry or the archive for ``exc``, then ack (or reject, when it
        could not be written); once per delivery."""
        if self.settled:
            return
        self.settled = True
        task = self.task
        context = Context(self.request_dict)
        task.request_stack.push(context)
        # The main process's connections outlive any task: around each ending, as
        # Django does around a request, one past CONN_MAX_AGE or broken is closed.
        close_old_connections()
        try:
            settle_outside(task, exc, context.args, context.kwargs)
        except Reject as unsettled:
            self.reject(requeue=bool(getattr(unsettled, "requeue", False)))
            return
        except Exception:
            logger.exception(
                "event delivery %s ended with %r and could not be settled; "
                "Celery's own handling applies",
                self.id,
                exc,
            )
            return
        finally:
            task.request_stack.pop()
            close_old_connections()
        self.acknowledge()
