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
  :class:`RevokingNode`, which runs Celery's own revoke command, then hands the ids
  to :data:`WITHDRAWALS`: the process's reporter thread deletes them in batches,
  skipping rows another transaction has locked, and retries until it is written.
  A broadcast names the outbox database it is for (:func:`outbox_database`); a
  worker whose outbox is another database leaves its rows alone.

Whoever deletes a row leaves the result backend as the worker's revoke of the
message would have (:func:`announce`): the task ``REVOKED`` and, in a chord, its
part returned, so the chord fails and runs its errbacks as with Celery.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from celery import Celery
from celery.app.control import Control
from celery.app.task import Context
from celery.signals import worker_shutdown
from django.apps import apps
from django.db import connections, transaction
from kombu.compression import decompress
from kombu.pidbox import Mailbox, Node
from kombu.serialization import loads, prepare_accept_content

from .conf import get_settings
from .engine.reports import REPORTER, SHUTDOWN_SECONDS, Reporter
from .enqueue import require_installed
from .envelope import Envelope
from .exceptions import OutboxRevokeError
from .store import Stores, outbox_alias, outbox_stores
from .text import unstorable_at

logger = logging.getLogger("celery_outbox")

#: The reasons Celery's worker stores with a task it revoked, or dropped as expired.
REVOKED_REASON = "revoked"
EXPIRED_REASON = "expired"

#: The revoke argument naming the outbox database a broadcast is for.
DATABASE_ARGUMENT = "outbox_database"
#: Task ids one deletion of a worker takes: one statement, one transaction.
BATCH_SIZE = 500
#: Task ids a worker process holds for deletion; past it, the ids of a revoke are
#: logged as an error and not deleted by this worker.
PENDING_LIMIT = 100_000


class RevokingNode(Node):
    """A worker's mailbox node: after Celery's ``revoke`` command, the outbox rows go too."""

    def handle(self, method: str, arguments: dict[str, Any] | None = None) -> Any:
        """Run the control command; for ``revoke``, then queue its tasks' deletion.

        The deletion is queued only when the broadcast names this worker's outbox
        database, or names none (``celery control revoke`` where Django is not set
        up, Flower, a plain Celery app). Celery's own command runs either way.
        """
        if method != "revoke":
            return super().handle(method, arguments)
        given = dict(arguments or {})
        database = given.pop(DATABASE_ARGUMENT, None)
        reply = super().handle(method, given)
        app = getattr(self.state, "app", None)
        task_id = given.get("task_id")
        ids = [task_id] if isinstance(task_id, str) else list(task_id or ())
        if not ids or not isinstance(app, Celery):
            return reply
        if database is None or database == outbox_database():
            WITHDRAWALS.add(app, [str(one) for one in ids])
        else:
            logger.debug("a revoke for another outbox database left alone: %s", ids)
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

    def broadcast(self, command: str, *args: Any, **kwargs: Any) -> Any:
        """Celery's broadcast; a ``revoke`` names this project's outbox database.

        The workers of another project on the same broker (one RabbitMQ vhost, its
        own database) then leave their rows alone, whatever the task ids.
        ``celery control revoke`` comes this way too. Where Django is not set up the
        database is unknown, and the broadcast names none.
        """
        if command == "revoke" and apps.ready:
            kwargs.setdefault(DATABASE_ARGUMENT, outbox_database())
        return super().broadcast(command, *args, **kwargs)


def outbox_database() -> str:
    """The name of this process's outbox database in a revoke broadcast.

    A digest of its vendor, host, port and name as the Django settings spell them,
    the same in every process of a project that spells them the same way; two
    projects on one broker with databases of their own get different names.
    """
    alias = outbox_alias(get_settings())
    connection = connections[alias]
    spelled = [connection.vendor] + [
        str(connection.settings_dict.get(key) or "") for key in ("HOST", "PORT", "NAME")
    ]
    return hashlib.sha256(json.dumps(spelled).encode()).hexdigest()[:16]


def withdraw(
    app: Celery, task_ids: Sequence[str], *, skip_locked: bool = False
) -> list[str]:
    """Delete the outbox rows of ``task_ids`` that no relay holds; the ids deleted.

    In the caller's transaction when there is one; once it commits, the result
    backend learns that the tasks were revoked (:func:`announce`). With
    ``skip_locked``, rows another transaction has locked are left to it.
    """
    require_installed()
    return _withdraw(app, outbox_stores(), task_ids, skip_locked=skip_locked)


def _withdraw(
    app: Celery, stores: Stores, task_ids: Sequence[str], *, skip_locked: bool
) -> list[str]:
    deleted = stores.operator().revoke(task_ids, skip_locked=skip_locked)
    if not deleted:
        return []
    ids = list(dict.fromkeys(message.task_id for message in deleted))
    logger.info("revoked before publish (outbox rows deleted): %s", ", ".join(ids))
    on_commit = functools.partial(announce, app, deleted)
    transaction.on_commit(on_commit, using=stores.alias)
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


class Withdrawals:
    """The task ids a worker process was told to revoke, until their rows are deleted.

    Revoke broadcasts reach the worker's consumer thread (in a prefork worker, the
    main process), which must not wait for the database: :meth:`add` only puts the
    ids in a set, so a burst of revokes of one id is one id. The process's reporter
    thread (:mod:`celery_outbox.engine.reports`) deletes them, up to
    :data:`BATCH_SIZE` a statement, on its one connection: a burst costs no more
    threads or connections than a single revoke. The deletion is one report of the
    reporter (the ids added meanwhile join it): one that fails (the database down,
    out of connections, a lock) keeps its ids and is tried again as every report
    is, after the engine's backoff, until it is written or the worker ends
    (:meth:`stop`).
    """

    def __init__(
        self, reporter: Reporter = REPORTER, limit: int = PENDING_LIMIT
    ) -> None:
        self._reporter = reporter
        self._limit = limit
        self.forget()

    def forget(self) -> None:
        """Start empty (a forked child: the ids and the thread are the parent's)."""
        self._lock = threading.Lock()
        self._pending: dict[str, None] = {}
        self._app: Celery | None = None

    @property
    def pending(self) -> list[str]:
        """The ids waiting for deletion."""
        with self._lock:
            return list(self._pending)

    def add(self, app: Celery, task_ids: Iterable[str]) -> None:
        """Queue the deletion of these tasks' rows; never waits for the database."""
        with self._lock:
            new = [one for one in dict.fromkeys(task_ids) if one not in self._pending]
            room = max(self._limit - len(self._pending), 0)
            self._pending.update(dict.fromkeys(new[:room]))
            self._app = app
        if new[room:]:
            logger.error(
                "%d task ids wait for deletion already: the outbox rows of %s are not "
                "deleted by this worker (the relay publishes them, and workers that "
                "remember the revoke drop them); revoke them again once the database "
                "answers",
                self._limit,
                ", ".join(new[room:]),
            )
        if new[:room]:
            worker_shutdown.connect(
                _stop_withdrawals, weak=False, dispatch_uid="celery_outbox.revoke"
            )
            self._reporter.send(
                self._delete, new[0], "revoked", slot="celery_outbox.revoke"
            )

    def stop(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` for the deletions; the ids left."""
        self._reporter.wait(timeout)
        return self.pending

    def _delete(self, stores: Stores) -> int:
        """The reporter's part: delete batch after batch until none is pending;
        a batch that fails raises, and the reporter tries again."""
        deleted = 0
        while True:
            with self._lock:
                batch = list(itertools.islice(self._pending, BATCH_SIZE))
                app = self._app
            if not batch or app is None:
                return deleted
            deleted += len(_withdraw(app, stores, batch, skip_locked=True))
            with self._lock:
                for task_id in batch:
                    self._pending.pop(task_id, None)


#: The deletions of this process's worker.
WITHDRAWALS = Withdrawals()
os.register_at_fork(after_in_child=WITHDRAWALS.forget)


def _stop_withdrawals(**_: Any) -> None:
    left = WITHDRAWALS.stop(SHUTDOWN_SECONDS)
    if left:
        logger.error(
            "the worker ends before the outbox rows of %d revoked task(s) could be "
            "deleted (the database did not answer within %.0f s): the relay publishes "
            "them when they fall due, and a restarted worker no longer remembers the "
            "revoke; revoke them again: %s",
            len(left),
            SHUTDOWN_SECONDS,
            ", ".join(left),
        )
