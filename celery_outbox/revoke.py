"""Revoke before publish: a revoke of a task still in the outbox deletes its row.

Two ways in, one outcome:

* **The caller.** ``AsyncResult.revoke()``, ``GroupResult.revoke()``,
  ``app.control.revoke()`` and ``app.control.terminate()`` end in
  :meth:`OutboxControl.revoke` (``OutboxCelery.control_cls``). It broadcasts
  Celery's revoke first, which needs only the broker, then deletes the rows in the
  caller's transaction; when that fails, :class:`OutboxRevokeError` says the
  broadcast went out and how to finish. In a process without Django set up
  (Flower, a ``celery`` command) the broadcast is all it sends.
* **The workers.** Every revoke broadcast a worker of an ``OutboxCelery`` app
  receives, whoever sent it (``celery control revoke``, Flower, a plain Celery app),
  deletes the rows too: the control class's mailbox gives the worker a
  :class:`RevokingNode`, which runs Celery's own revoke command, then deletes the
  rows off the consumer's thread, skipping rows another transaction has locked.

Whoever deletes a row leaves the result backend as the worker's revoke of the
message would have (:func:`announce`): the task ``REVOKED`` and, in a chord, its
part returned, so the chord fails and runs its errbacks as with Celery.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Sequence
from typing import Any

from celery import Celery
from celery.app.control import Control
from celery.app.task import Context
from django.apps import apps
from django.db import connections, transaction
from kombu.compression import decompress
from kombu.pidbox import Mailbox, Node
from kombu.serialization import loads, prepare_accept_content

from .conf import get_settings
from .enqueue import require_installed
from .envelope import Envelope
from .exceptions import OutboxRevokeError
from .store import outbox_alias, outbox_stores
from .text import unstorable_at

logger = logging.getLogger("celery_outbox")

#: The reasons Celery's worker stores with a task it revoked, or dropped as expired.
REVOKED_REASON = "revoked"
EXPIRED_REASON = "expired"


class RevokingNode(Node):
    """A worker's mailbox node: after Celery's ``revoke`` command, the outbox rows go too."""

    def handle(self, method: str, arguments: dict[str, Any] | None = None) -> Any:
        """Run the control command; for ``revoke``, then delete its tasks' rows."""
        reply = super().handle(method, arguments)
        app = getattr(self.state, "app", None)
        if method == "revoke" and isinstance(app, Celery):
            given = (arguments or {}).get("task_id")
            ids = [given] if isinstance(given, str) else list(given or ())
            if ids:
                # Off the consumer's thread: it must not wait for the database.
                threading.Thread(
                    target=_withdraw_for_worker,
                    args=(app, [str(task_id) for task_id in ids]),
                    name="outbox-revoke",
                    daemon=True,
                ).start()
        return reply


class RevokingMailbox(Mailbox):
    """Celery's control mailbox, whose worker node is a :class:`RevokingNode`."""

    node_cls = RevokingNode


class OutboxControl(Control):
    """Celery's remote control: a revoke also takes the task out of the outbox."""

    #: The workers' side: Celery's worker builds its mailbox node from this one.
    Mailbox = RevokingMailbox

    def revoke(self, task_id: str | Sequence[str], *args: Any, **kwargs: Any) -> Any:
        """Broadcast Celery's revoke (same arguments), then delete the tasks' rows.

        Each part is done whatever becomes of the other. The broadcast goes first:
        stopping a running task (``terminate=True``) needs only the broker, as with
        Celery, even while the outbox database is down. With the broker down, the
        rows still go (no relay can publish them meanwhile anyway), and Celery's
        error is raised, as with Celery.
        """
        given = [task_id] if isinstance(task_id, str) else list(task_id)
        # An id no row can hold (a NUL, a lone surrogate: refused at the enqueue) has
        # no row to delete; asking the database for it would only fail.
        ids = [each for each in given if unstorable_at(str(each)) is None]
        try:
            reply = super().revoke(task_id, *args, **kwargs)
        except Exception:
            if apps.ready:
                with contextlib.suppress(Exception):  # the broker's error says enough
                    withdraw(self.app, ids)
            raise
        if not apps.ready or not ids:
            # Django is not set up here (Flower, a `celery` command): no transaction
            # to join, and the workers that get the broadcast delete the rows.
            return reply
        try:
            withdraw(self.app, ids)
        except Exception as exc:
            raise OutboxRevokeError(ids, exc) from exc
        return reply


def withdraw(
    app: Celery, task_ids: Sequence[str], *, skip_locked: bool = False
) -> list[str]:
    """Delete the outbox rows of ``task_ids`` that no relay holds; the ids deleted.

    In the caller's transaction when there is one; once it commits, the result
    backend learns that the tasks were revoked (:func:`announce`). With
    ``skip_locked``, rows another transaction has locked are left to it.
    """
    require_installed()
    settings = get_settings()
    deleted = (
        outbox_stores(settings).operator().revoke(task_ids, skip_locked=skip_locked)
    )
    if not deleted:
        return []
    ids = list(dict.fromkeys(message.task_id for message in deleted))
    logger.info("revoked before publish (outbox rows deleted): %s", ", ".join(ids))
    alias = outbox_alias(settings)
    transaction.on_commit(functools.partial(announce, app, deleted), using=alias)
    return ids


def announce(
    app: Celery, messages: Sequence[Envelope], reason: str = REVOKED_REASON
) -> None:
    """Leave the result backend as a worker that revoked these messages would.

    Celery's worker stores ``REVOKED`` with the message's request and, for a chord
    member, returns its part of the chord (``mark_as_revoked``): the chord then
    fails and runs its errbacks. ``reason`` is the worker's: ``revoked``, or
    ``expired`` for a message that expired before it could run (a scheduled task
    that expires before its ETA, which goes to the dead letters). Tasks the backend
    sends meanwhile (errbacks) are written to the outbox together. A failure is
    logged, never raised: the rows are already gone.
    """
    alias = outbox_alias(get_settings())
    for message in {m.task_id: m for m in messages}.values():
        try:
            with transaction.atomic(using=alias):
                _mark_revoked(app, message, reason)
        except Exception:
            logger.exception(
                "task %s [%s] was never published (%s), but its result could not be "
                "stored as REVOKED: a group or chord waiting for it does not finish",
                message.task_name,
                message.task_id,
                reason,
            )


def _mark_revoked(app: Celery, message: Envelope, reason: str) -> None:
    """What Celery's worker does for a revoked message (``Request._announce_revoked``)."""
    task = app.tasks.get(message.task_name)
    headers = dict(message.headers)
    ignore_result = headers.get("ignore_result")
    if ignore_result is None:
        ignore_result = task.ignore_result if task else app.conf.task_ignore_result
    store_errors = not ignore_result or bool(
        task is not None and task.store_errors_even_if_ignored
    )
    backend = task.backend if task is not None else app.backend
    backend.mark_as_revoked(
        message.task_id,
        reason,
        request=worker_request(app, message),
        store_result=store_errors,
    )


def worker_request(app: Celery, message: Envelope) -> Context:
    """The request Celery's worker would build from ``message`` (``Request._context``).

    The headers (task id, group, group index, root and parent ids...), the
    properties the worker copies, the arguments, and the body's embedded canvas
    (callbacks, errbacks, chain, chord). A body that cannot be read still gives
    the headers' part.
    """
    properties = dict(message.properties)
    request: dict[str, Any] = dict(message.headers)
    request.update(
        properties=properties,
        reply_to=properties.get("reply_to"),
        correlation_id=properties.get("correlation_id"),
        delivery_info={
            "exchange": message.exchange,
            "routing_key": message.routing_key,
            "priority": properties.get("priority"),
            "redelivered": False,
        },
    )
    try:
        data = message.body
        if headers_codec := message.headers.get("compression"):
            data = decompress(data, headers_codec)
        accept = prepare_accept_content(app.conf.accept_content)
        payload = loads(
            data, message.content_type, message.content_encoding, accept=accept
        )
    except Exception as exc:
        logger.warning(
            "task %s [%s] was never published, and its body cannot be read (%s): "
            "a chord it belongs to is not told",
            message.task_name,
            message.task_id,
            exc,
        )
        return Context(request)
    if isinstance(payload, (list, tuple)) and len(payload) == 3:
        args, kwargs, embed = payload
        request.update(args=args, kwargs=kwargs)
        request.update(embed or {})
    return Context(request)


def _withdraw_for_worker(app: Celery, task_ids: Sequence[str]) -> None:
    """A worker's part of a revoke broadcast; its own transaction and connection."""
    try:
        withdraw(app, task_ids, skip_locked=True)
    except Exception:
        logger.exception(
            "a revoke of %s reached this worker, but their outbox rows could not be "
            "deleted: the worker drops these tasks, the relay may still publish them",
            ", ".join(task_ids),
        )
    finally:
        connections.close_all()  # this thread's connections only
