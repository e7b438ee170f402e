"""The writing side: :func:`emit` and :func:`outbox_context`."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from django.db import router, transaction

from ..conf import get_settings
from ..enqueue import GuardWording, TransactionGuard
from ..exceptions import (
    OutboxSerializationError,
    OutboxValueError,
)
from ..text import check_text
from .core import KEY_LENGTH, shard_key

logger = logging.getLogger("celery_outbox.handlers")


@dataclass
class _Scope:
    flush: bool
    #: Shards written inside the scope, per database alias.
    written: dict[str, set[str]] = field(default_factory=dict)


_scope: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "celery_outbox_handler_scope", default=None
)


@contextlib.contextmanager
def outbox_context(*, flush: bool = True) -> Iterator[None]:
    """Run the shards written inside the block in this process once they commit.

    ``flush=True`` (an API request that reports success) processes them right after
    the transaction commits, under the same lease rules as the processor: a shard
    another processor holds is left to it, and a receiver that fails leaves its
    message to the processor. ``flush=False`` (a background writer) leaves them to
    the processor, also inside an enclosing flushing block. The block may sit inside
    ``transaction.atomic()`` or wrap it; nothing is run if the block raises or the
    transaction rolls back.
    """
    scope = _Scope(flush)
    token = _scope.set(scope)
    try:
        yield
    finally:
        _scope.reset(token)
    for alias, shards in scope.written.items():
        _flush_on_commit(alias, shards)


def emit(
    category: str,
    *,
    shard: str | Iterable[Any],
    object_id: Any,
    payload: Any = None,
    using: str | None = None,
    flush: bool | None = None,
) -> None:
    """Write a message for ``category``'s receiver in the caller's transaction.

    ``shard``: ``("org", 42)`` or ``"org:42"``; messages of one shard run in order.
    ``object_id``: messages of one (shard, category, object id) coalesce: only the
    newest runs, unless the category opts out. ``payload``: anything JSON holds; a
    value it cannot hold raises :class:`OutboxSerializationError` and writes nothing.
    ``using``: the database (default: the router's choice for the handler tables);
    keep it the database of the rows the message describes. ``flush``: True runs the
    shard in this process after commit, False never; None follows
    :func:`outbox_context`.
    """
    category = _key(category, "category", "Cannot emit a handler message")
    where = f"Cannot emit a handler message of category {category!r}"
    key = _key(shard_key(shard), "shard", where)
    identifier = _key(str(object_id), "object_id", where)
    try:
        text = json.dumps(payload, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise OutboxSerializationError(
            f"the payload of handler category {category!r} cannot be stored as "
            f"JSON: {exc}. Pass plain dicts, lists, strings, numbers, booleans and None."
        ) from None
    alias = using or _default_alias()
    _guard.check(alias, category, get_settings().outside_transaction)
    from ..store.handlers.sql import HandlerStore

    HandlerStore(alias).write(category, key, identifier, text)
    scope = _scope.get()
    if flush is True:
        _flush_on_commit(alias, {key})
    elif flush is None and scope is not None and scope.flush:
        scope.written.setdefault(alias, set()).add(key)


def _key(value: object, what: str, where: str) -> str:
    """``value`` if its column stores it exactly; else :class:`OutboxValueError`.

    Checked before any statement, so the caller's transaction stays usable.
    """
    if value == "":
        raise OutboxValueError(
            f"{where}: {what} is empty; give 1 to {KEY_LENGTH} characters. Nothing "
            f"was written."
        )
    return check_text(value, what, where, limit=KEY_LENGTH)


def _default_alias() -> str:
    from .models import HandlerMessage

    return router.db_for_write(HandlerMessage)


def _flush_on_commit(alias: str, shards: set[str]) -> None:
    from .processor import flush_shards

    callback = functools.partial(flush_shards, alias, sorted(shards))
    transaction.on_commit(callback, using=alias)


#: The outside-transaction policy of tasks, in the words of handler messages.
_WORDING = GuardWording(
    other_database=(
        "A handler message of category {name!r} was emitted inside "
        "transaction.atomic() on {others}, but it is written to {alias!r}: it would "
        "commit on its own, even if your transaction rolls back. Pass using= the "
        "alias of your data."
    ),
    outside_raise=(
        "A handler message of category {name!r} was emitted outside "
        "transaction.atomic() on {alias!r} and CELERY_OUTBOX_OUTSIDE_TRANSACTION is "
        "'raise'. Emit it inside transaction.atomic(using={alias!r})."
    ),
    outside_warn=(
        "A handler message of category {name!r} was emitted outside "
        "transaction.atomic(); it was committed on its own. Emit it inside atomic() "
        "to tie it to your data, or set CELERY_OUTBOX_OUTSIDE_TRANSACTION = 'allow' "
        "(logged once per category)."
    ),
)
_guard = TransactionGuard(_WORDING)
