"""Blocked heads of ordered keys in the Django admin: list them, retry, skip, dead-letter.

:class:`OrderedKeysAdmin` is mixed into the outbox rows' admin
(:class:`celery_outbox.admin.OutboxMessageAdmin`). It adds the filter "ordered keys"
(blocked heads, running strict heads, keyed rows); with "blocked heads" picked the
list shows each blocked key, its head's task, when it blocked and its last error.
Three actions act on the keys of the selected rows through the same store methods
as ``manage.py outbox ordering``:

* retry: the head is due again with fresh attempts (``retry KEY``);
* skip: the head is deleted and the key goes on (``skip KEY --delete``);
* dead-letter: the head moves to the dead letters and the key goes on
  (``dead-letter KEY``, the same as ``skip KEY``).

A selected row that is not a blocked head is left alone and counted in the message.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from ..store import OrderingStore
from ..store.ordering import BLOCKED, RUNNING, blocked_since

#: The filter's query parameter and the value that lists blocked heads.
PARAMETER = "ordering"
BLOCKED_CHOICE = "blocked"

#: The columns of the blocked-heads list.
BLOCKED_COLUMNS = (
    "ordering_key",
    "task_name",
    "task_id",
    "blocked_at",
    "created_at",
    "attempts",
    "short_error",
)

#: A store method applied to one key: returns how many rows it changed.
KeyOperation = Callable[[Any, str], int]

if TYPE_CHECKING:
    _AdminBase = admin.ModelAdmin[Any]
else:
    _AdminBase = object


class OrderedKeysFilter(admin.SimpleListFilter):
    """Narrow the outbox rows to blocked heads, running strict heads or keyed rows."""

    title = "ordered keys"
    parameter_name = PARAMETER

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        """The choices an operator can pick."""
        return [
            (BLOCKED_CHOICE, "blocked heads"),
            (RUNNING, "running strict heads"),
            ("keyed", "any keyed row"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """Rows of the picked kind."""
        value = self.value()
        if value == BLOCKED_CHOICE:
            return cast("QuerySet[Any]", queryset.filter(state=BLOCKED))
        if value == RUNNING:
            return cast("QuerySet[Any]", queryset.filter(state=RUNNING))
        if value == "keyed":
            return cast("QuerySet[Any]", queryset.filter(ordering_key__isnull=False))
        return queryset


class OrderedKeysAdmin(_AdminBase):
    """The blocked-heads filter, columns and actions, for the outbox rows' admin.

    Mix it in before the host's other bases; the host shows ``short_error`` (as
    :class:`celery_outbox.admin.OutboxMessageAdmin` does).
    """

    def ordering_store(self) -> OrderingStore:
        """The ordered keys' store the actions go through (the outbox alias's)."""
        from ..store import outbox_stores

        return outbox_stores().ordering()

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Acting on a blocked head needs the change permission on the host's model."""
        opts = self.opts
        return bool(request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}"))

    def get_list_filter(self, request: HttpRequest) -> Any:
        """The host's filters, then "ordered keys"."""
        return (*super().get_list_filter(request), OrderedKeysFilter)

    def get_list_display(self, request: HttpRequest) -> Any:
        """With "blocked heads" picked: key, task, blocked at, written at, error."""
        if request.GET.get(PARAMETER) == BLOCKED_CHOICE:
            return BLOCKED_COLUMNS
        return super().get_list_display(request)

    @admin.display(description="blocked at")
    def blocked_at(self, obj: Any) -> datetime | None:
        """When the head blocked its key (None for a row that is not blocked)."""
        if obj.state != BLOCKED:
            return None
        return blocked_since(obj.available_at)


@admin.action(
    description="Ordered key: retry the blocked head", permissions=("operate",)
)
def retry_blocked(
    model_admin: Any, request: HttpRequest, queryset: QuerySet[Any]
) -> None:
    """Make the blocked heads of the selected rows' keys due now, attempts reset."""
    _act(
        model_admin,
        request,
        queryset,
        lambda store, key: int(store.retry_head(key)),
        "retried",
    )


@admin.action(
    description="Ordered key: skip the blocked head (delete it)",
    permissions=("operate",),
)
def skip_blocked(
    model_admin: Any, request: HttpRequest, queryset: QuerySet[Any]
) -> None:
    """Delete the blocked heads of the selected rows' keys; their keys go on."""
    _act(
        model_admin,
        request,
        queryset,
        lambda store, key: int(store.skip_head(key, dead_letter=False)),
        "skipped (deleted)",
    )


@admin.action(
    description="Ordered key: move the blocked head to the dead letters",
    permissions=("operate",),
)
def dead_letter_blocked(
    model_admin: Any, request: HttpRequest, queryset: QuerySet[Any]
) -> None:
    """Move the blocked heads of the selected rows' keys to the dead letters."""
    _act(
        model_admin,
        request,
        queryset,
        lambda store, key: int(store.dead_letter_head(key)),
        "moved to the dead letters",
    )


#: The actions on blocked heads, for the host admin's ``actions`` (operators only:
#: ``has_operate_permission``).
BLOCKED_ACTIONS = (retry_blocked, skip_blocked, dead_letter_blocked)


def _act(
    model_admin: Any,
    request: HttpRequest,
    queryset: QuerySet[Any],
    operation: KeyOperation,
    done: str,
) -> None:
    """Apply ``operation`` to the key of every selected blocked head, log, report."""
    heads = list(queryset.filter(state=BLOCKED).defer("body").order_by("id"))
    others = queryset.count() - len(heads)
    store = model_admin.ordering_store()
    changed = 0
    for head in heads:
        key = str(head.ordering_key)
        if operation(store, key):
            changed += 1
            model_admin.log_change(
                request, head, f"Blocked head of key {key!r} {done}."
            )
    text = f"{changed} blocked head(s) {done}."
    if len(heads) > changed:
        text += f" {len(heads) - changed} no longer blocked (left as they are)."
    if others > 0:
        text += f" {others} selected row(s) are not blocked heads (left as they are)."
    model_admin.message_user(
        request, text, messages.SUCCESS if changed else messages.WARNING
    )
