"""``InboxMixin``: runs a task body once per message, however often it is delivered.

The inbox's part of the app's task class (:class:`celery_outbox.task.OutboxTask`).
A task uses the inbox when it says ``@app.task(inbox=True)``, or when
``CELERY_OUTBOX_INBOX = True`` and it does not say ``inbox=False``. Before its body
runs, the worker opens ``transaction.atomic()`` on the inbox alias and INSERTs (task
name, key); the body runs in that transaction and both commit together. A delivery
whose row is already committed is skipped.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore
from django.db import IntegrityError, OperationalError, transaction

from ..conf import OutboxSettings, get_settings
from ..exceptions import OutboxValueError
from ..store import outbox_alias
from ..text import check_text
from .signals import send_duplicate_skipped

logger = logging.getLogger("celery_outbox.inbox")

#: The message header that carries a caller's idempotency key.
KEY_HEADER = "inbox_key"
#: The longest key the inbox table holds.
MAX_KEY_LENGTH = 255
#: Runs of the inbox transaction whose INSERT may end in a deadlock. InnoDB: copies
#: that waited for an uncommitted row of their key hold shared locks on it; when it
#: rolls back, two of them insert at once and one is chosen to fail.
DEADLOCK_ATTEMPTS = 3

#: The request whose inbox transaction is open in this thread (or greenlet), if any.
_open_request: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "celery_outbox_inbox_open", default=None
)


class _Duplicate(Exception):
    """The (task, key) row exists: leave the transaction without running the body."""


class _Deadlocked(Exception):
    """The row's INSERT, the first statement of the inbox's own transaction, was
    chosen to break a deadlock: the transaction is gone and is run again."""


class _RetryAfterRollback(Exception):
    """``retry()`` was called inside the inbox transaction; it is sent after the rollback."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__("retry sent once the inbox transaction rolled back")
        self.retry_args = args
        self.retry_kwargs = kwargs


def inbox_alias(settings: OutboxSettings) -> str:
    """The alias of the inbox table: ``CELERY_OUTBOX_INBOX_DATABASE`` or the outbox's."""
    return settings.inbox_database or outbox_alias(settings)


@contextlib.contextmanager
def inbox_atomic(using: str) -> Iterator[None]:
    """``transaction.atomic(using=...)`` around an inbox row and its body.

    An exception rolls both back, except ``Ignore`` (``self.replace()`` raises it
    too), which commits and then goes on: Celery acknowledges an ignored message and
    never delivers it again, so what the body did (the replacement it sent, a result
    it stored itself) must stay, and the row with it.
    """
    ignored: Ignore | None = None
    with transaction.atomic(using=using):
        try:
            yield
        except Ignore as ended:
            ignored = ended
    if ignored is not None:
        raise ignored


def uses_inbox(task_option: bool | None, task_name: str, every_task: bool) -> bool:
    """Whether a task runs through the inbox.

    ``inbox=True``/``False`` on the task wins; otherwise ``CELERY_OUTBOX_INBOX``
    decides, except for Celery's own tasks (``celery.*``), which write nothing.
    """
    if task_option is not None:
        return bool(task_option)
    return every_task and not task_name.startswith("celery.")


def message_key(request: Any) -> str:
    """The inbox key of a delivery: the caller's ``inbox_key`` header, else the task id.

    Custom headers reach ``request.headers`` (and, from a broker, also an attribute of
    the request named after the header).
    """
    headers = request.headers or {}
    key = headers.get(KEY_HEADER) or getattr(request, KEY_HEADER, None)
    return str(key) if key else str(request.id)


def checked_key(task_name: str, key: Any) -> str:
    """A caller's key, refused with a clear message when the table cannot hold it."""
    if not isinstance(key, str) or not key:
        raise OutboxValueError(
            f"inbox_key of {task_name} must be a non-empty string, got {key!r}."
        )
    if len(key) > MAX_KEY_LENGTH:
        raise OutboxValueError(
            f"inbox_key of {task_name} is {len(key)} characters long; the inbox holds "
            f"at most {MAX_KEY_LENGTH}. Hash a longer key (e.g. hashlib.sha256)."
        )
    return check_text(key, "inbox_key", f"Cannot send task {task_name}")


if TYPE_CHECKING:
    from celery import Task

    _Base = Task[Any, Any]
else:  # a part of the task class: Celery's Task comes after it in the class's MRO
    _Base = object


class InboxMixin(_Base):
    """The inbox part of a task class: the body runs at most once per message key
    (opt-in per task). Needs Celery's ``Task`` after it in the bases."""

    #: ``True``/``False`` from ``@app.task(inbox=...)``; None follows ``CELERY_OUTBOX_INBOX``.
    inbox: bool | None = None

    def uses_inbox(self) -> bool:
        """Whether this task's deliveries go through the inbox."""
        return uses_inbox(self.inbox, str(self.name), get_settings().inbox)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request_stack.top
        if request is None or request.called_directly:
            # A plain function call (``task(x)``): no message, nothing to deduplicate.
            return super().__call__(*args, **kwargs)
        # Called by Celery's tracer, which already pushed the request: run the body as
        # the tracer does for a task class without ``__call__``.
        if not self.uses_inbox():
            return self.run(*args, **kwargs)
        return self._run_once(request, args, kwargs)

    def _run_once(
        self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        alias = inbox_alias(get_settings())
        # A key another service sent: refused with its culprit, not by the driver.
        key = check_text(message_key(request), "inbox key", f"Cannot run {self.name}")
        try:
            for attempt in range(1, DEADLOCK_ATTEMPTS + 1):
                try:
                    return self._run_in_transaction(alias, key, request, args, kwargs)
                except _Deadlocked:
                    if attempt == DEADLOCK_ATTEMPTS:
                        raise
        except _Duplicate:
            self._skip(request, key, alias)
        except _RetryAfterRollback as after:
            # The transaction is gone: the retry message is written (or sent) for real.
            return super().retry(*after.retry_args, **after.retry_kwargs)

    def _run_in_transaction(
        self,
        alias: str,
        key: str,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """INSERT the inbox row, then run the body; both commit, or neither
        (:func:`inbox_atomic`: a body that ends with ``Ignore`` commits)."""
        # Imported here: this class is resolved before Django's models are loaded.
        from .store import InboxStore, deadlocked

        store = InboxStore(alias)
        # Only a transaction of our own is whole again after a deadlock: InnoDB rolls
        # back every statement of the deadlocked one, a caller's too.
        own = not transaction.get_connection(alias).in_atomic_block
        token = _open_request.set(request)
        try:
            with inbox_atomic(alias):
                try:
                    store.record(str(self.name), key)
                except IntegrityError:
                    raise _Duplicate from None
                except OperationalError as exc:
                    if own and deadlocked(exc):
                        raise _Deadlocked from exc
                    raise
                return self.run(*args, **kwargs)
        finally:
            _open_request.reset(token)

    def _skip(self, request: Any, key: str, alias: str) -> None:
        logger.info(
            "inbox: %s[%s] already ran for key %r; acknowledged without running it",
            self.name,
            request.id,
            key,
        )
        send_duplicate_skipped(
            task_id=request.id, task_name=self.name, key=key, using=alias
        )
        # Ignore, not a return value: the first delivery's stored result stays, and its
        # callbacks and the next step of its chain are not sent a second time.
        raise Ignore(f"duplicate delivery of inbox key {key!r}")

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``; inside the inbox transaction, sent after it rolled back.

        The retry message would otherwise be written to the outbox in the very
        transaction the failure rolls back, and be lost with it.
        """
        if _open_request.get() is self.request:
            raise _RetryAfterRollback(args, kwargs)
        return super().retry(*args, **kwargs)

    def apply_async(self, *args: Any, **options: Any) -> Any:
        """Celery's ``apply_async``, plus ``inbox_key=``: the caller's idempotency key."""
        return super().apply_async(*args, **self._with_key(options))

    def apply(self, *args: Any, **options: Any) -> Any:
        """Celery's ``apply`` (run here, eagerly), plus ``inbox_key=``."""
        return super().apply(*args, **self._with_key(options))

    def _with_key(self, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` with ``inbox_key`` moved into the headers, for inbox tasks only."""
        key = options.pop(KEY_HEADER, None)
        headers = options.get("headers") or {}
        if key is None and KEY_HEADER not in headers:
            return options
        if not self.uses_inbox():
            if key is not None:
                raise OutboxValueError(
                    f"inbox_key was given to {self.name}, which does not use the inbox: "
                    f"declare it with @app.task(inbox=True) or drop the key."
                )
            # Never hand a key to a task that ignores it.
            options["headers"] = {k: v for k, v in headers.items() if k != KEY_HEADER}
            return options
        if key is not None:
            options["headers"] = {**headers, KEY_HEADER: checked_key(self.name, key)}
        else:  # given as a header: checked all the same, before anything is sent
            checked_key(self.name, headers[KEY_HEADER])
        return options
