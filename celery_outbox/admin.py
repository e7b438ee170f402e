"""Django admin for the outbox and the dead letters: read-only views, operator actions.

The changelists read through the default queryset (on the outbox alias); every
action and the summary go through the operator's store
(:class:`~celery_outbox.store.OperatorStore`). Each action writes Django's admin log
and reports what it did. Arguments are decoded from the stored body and passed
through ``CELERY_OUTBOX_REDACTOR`` before display.
"""

from __future__ import annotations

import json
import pprint
from collections.abc import Iterable, Sequence
from typing import Any, cast

from django.contrib import admin, messages
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from .decoding import decode_arguments
from .envelope import load_json
from .flow.admin import FlowStateAdmin as FlowStateAdmin  # registers the flows' admin
from .history_admin import OutboxRecords, TaskLinks
from .models import DeadLetter, MessageFields, OutboxMessage
from .ordering.admin import BLOCKED_ACTIONS, OrderedKeysAdmin
from .redaction import redact_arguments
from .states import message_state
from .store import DeadLetterFilter, OperatorStore, outbox_stores

#: Headers that repeat the arguments; the decoded (and redacted) arguments replace them.
ARGUMENT_HEADERS = frozenset({"argsrepr", "kwargsrepr"})

ERROR_PREVIEW = 80


def operator_store() -> OperatorStore:
    """The operator's queries on the outbox alias."""
    return outbox_stores().operator()


def format_age(seconds: float | None) -> str:
    """A short human age: ``-``, ``42 s``, ``3.5 min``, ``2.0 h``, ``1.5 d``."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


class StateFilter(admin.SimpleListFilter):
    """Filter outbox rows by where they are in their life."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        """The states an operator can pick."""
        return [
            ("due", "due"),
            ("in_flight", "in_flight"),
            ("scheduled", "scheduled"),
            ("retrying", "retrying"),
            ("deferred", "deferred"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        """Narrow the changelist to the picked state."""
        now = timezone.now()
        value = self.value()
        if value == "due":
            return cast("QuerySet[Any]", queryset.filter(available_at__lte=now))
        if value == "in_flight":
            return cast(
                "QuerySet[Any]",
                queryset.filter(lease_token__isnull=False, available_at__gt=now),
            )
        if value == "scheduled":
            return cast(
                "QuerySet[Any]",
                queryset.filter(
                    lease_token__isnull=True, available_at__gt=now, due_at__gt=now
                ),
            )
        if value == "retrying":
            return cast(
                "QuerySet[Any]",
                queryset.filter(
                    lease_token__isnull=True, attempts__gt=0, available_at__gt=now
                ),
            )
        if value == "deferred":
            return cast(
                "QuerySet[Any]",
                queryset.filter(
                    lease_token__isnull=True, attempts=0, available_at__gt=now
                ).exclude(due_at__gt=now),
            )
        return queryset


class MessageAdminMixin(OutboxRecords):
    """Read-only display shared by the outbox and dead-letter admins."""

    #: The most rows one action works on: each is loaded and logged, so "select all"
    #: over a large backlog would hold it all in the web process's memory.
    action_limit = 10_000
    #: Where larger selections are handled, named in the refusal.
    bulk_hint = "narrow the selection with the filters and act on it in parts"

    @admin.display(description="last error")
    def short_error(self, obj: MessageFields) -> str:
        """The last error, cut to one line."""
        text = obj.last_error.strip().splitlines()[0] if obj.last_error.strip() else ""
        if len(text) > ERROR_PREVIEW:
            return text[: ERROR_PREVIEW - 1] + "…"
        return text

    @admin.display(description="arguments")
    def arguments(self, obj: MessageFields) -> SafeString:
        """The task's arguments, decoded from the stored body and redacted."""
        headers = _headers(obj)
        decoded = decode_arguments(
            bytes(obj.body), obj.content_type, obj.content_encoding, headers
        )
        if decoded.error:
            return format_html("<em>{}</em>", decoded.error)
        args, kwargs = redact_arguments(obj.task_name, decoded.args, decoded.kwargs)
        return format_html(
            "<pre>args   = {}\nkwargs = {}</pre>",
            pprint.pformat(args, width=100),
            pprint.pformat(kwargs, width=100),
        )

    @admin.display(description="headers")
    def shown_headers(self, obj: MessageFields) -> SafeString:
        """Message headers, without the argument representations."""
        headers = {
            key: value
            for key, value in _headers(obj).items()
            if key not in ARGUMENT_HEADERS
        }
        return format_html("<pre>{}</pre>", _formatted_json(headers))

    @admin.display(description="properties")
    def shown_properties(self, obj: MessageFields) -> SafeString:
        """The message's AMQP properties, as stored."""
        return format_html("<pre>{}</pre>", _formatted_json(_stored(obj.properties)))

    def _log_changed(
        self, request: HttpRequest, objects: Iterable[Model], message: str
    ) -> None:
        for obj in objects:
            self.log_change(request, obj, message)  # type: ignore[attr-defined]


def _headers(obj: MessageFields) -> dict[str, Any]:
    return _stored(obj.headers)


def _stored(text: str) -> dict[str, Any]:
    """A stored JSON object (headers, properties); empty when it is not one."""
    try:
        loaded = load_json(text)
    except ValueError:
        return {}
    return dict(loaded) if isinstance(loaded, dict) else {}


def _formatted_json(value: dict[str, Any]) -> str:
    """Indented JSON, keys sorted; dates, UUIDs and decimals as their text."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def _picked(
    admin_view: Any, request: HttpRequest, queryset: QuerySet[Any]
) -> dict[int, Any] | None:
    """The selected rows by id (without their bodies), for the admin log.

    None, after telling the user why, when there are more than the admin's
    ``action_limit``: nothing is done then.
    """
    count = queryset.count()
    if count > admin_view.action_limit:
        admin_view.message_user(
            request,
            f"{count:,} rows are selected; an action here works on at most "
            f"{admin_view.action_limit:,} at a time (each row is loaded and logged). "
            f"Nothing was done: {admin_view.bulk_hint}.",
            messages.ERROR,
        )
        return None
    return {int(obj.pk): obj for obj in queryset.defer("body")}


def _of(objects: dict[int, Any], ids: Sequence[int]) -> list[Any]:
    return [objects[i] for i in ids if i in objects]


_MESSAGE_FIELDS = (
    "task_name",
    "task_id",
    "queue",
    "exchange",
    "routing_key",
    "arguments",
    "attempts",
    "last_error",
    "created_at",
)


@admin.register(OutboxMessage)
class OutboxMessageAdmin(
    OrderedKeysAdmin,
    MessageAdminMixin,
    TaskLinks,
    admin.ModelAdmin,  # type: ignore[type-arg]
):
    """Waiting messages: read-only, with a summary and "retry now" / "move to dead letters"."""

    change_list_template = "admin/celery_outbox/outboxmessage/change_list.html"
    list_display = (
        "task_name",
        "task_id",
        "queue",
        "attempts",
        "created_at",
        "available_at",
        "current_state",
        "short_error",
        "related",
    )
    list_filter = (StateFilter, "queue", "task_name")
    search_fields = ("task_id", "task_name")
    ordering = ("id",)
    fields = (
        *_MESSAGE_FIELDS,
        "current_state",
        "available_at",
        "due_at",
        "lease_token",
        "content_type",
        "content_encoding",
        "shown_headers",
        "shown_properties",
        "related",
    )
    readonly_fields = fields
    actions = ("retry_now", "move_to_dead_letters", *BLOCKED_ACTIONS)

    # Not "state": the model has an ordering column of that name, which Django's
    # list_display would show instead of this method.
    @admin.display(description="state")
    def current_state(self, obj: OutboxMessage) -> str:
        """due, in_flight, scheduled, retrying, deferred, an ordered key's running /
        blocked, or parked (waiting for a slot of its flow key)."""
        if obj.state in ("running", "blocked", "parked"):
            # A strict head a worker runs; a head that blocks its key; a flow key's
            # task waiting for a slot.
            return str(obj.state)
        return message_state(
            obj.lease_token, obj.available_at, obj.attempts, timezone.now(), obj.due_at
        )

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Actions need the change permission on outbox messages."""
        return bool(request.user.has_perm("celery_outbox.change_outboxmessage"))

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The changelist with the outbox summary on top."""
        summary = operator_store().summary()
        context = {
            "outbox_summary": summary,
            "outbox_oldest": format_age(summary.oldest_pending_seconds),
            "outbox_next_due": format_age(summary.next_due_seconds),
            "outbox_backlog": [
                (group, format_age(group.oldest_seconds)) for group in summary.backlog
            ],
            **(extra_context or {}),
        }
        return super().changelist_view(request, context)

    @admin.action(description="Retry now", permissions=("operate",))
    def retry_now(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """Make the selected rows due now (rows a relay holds are skipped)."""
        picked = _picked(self, request, queryset)
        if picked is None:
            return
        changed = operator_store().retry_now(list(picked))
        self._log_changed(request, _of(picked, changed), "Made due now (retry now).")
        skipped = len(picked) - len(changed)
        self.message_user(
            request,
            f"{len(changed)} message(s) will be published at once"
            + (f"; {skipped} skipped (held by a relay)." if skipped else "."),
            messages.SUCCESS if changed else messages.WARNING,
        )

    @admin.action(description="Move to dead letters", permissions=("operate",))
    def move_to_dead_letters(
        self, request: HttpRequest, queryset: QuerySet[Any]
    ) -> None:
        """Stop publishing the selected rows: move them to the dead letters."""
        picked = _picked(self, request, queryset)
        if picked is None:
            return
        reason = f"moved by {request.user.get_username()} from the admin"
        moved = operator_store().move_to_dead_letters(list(picked), reason)
        self._log_changed(
            request, _of(picked, moved), f"Moved to dead letters: {reason}."
        )
        skipped = len(picked) - len(moved)
        self.message_user(
            request,
            f"{len(moved)} message(s) moved to the dead letters"
            + (f"; {skipped} skipped (held by a relay)." if skipped else "."),
            messages.SUCCESS if moved else messages.WARNING,
        )


@admin.register(DeadLetter)
class DeadLetterAdmin(MessageAdminMixin, TaskLinks, admin.ModelAdmin):  # type: ignore[type-arg]
    """Messages that used up their attempts: read-only, with "replay" and "delete"."""

    list_display = (
        "id",
        "task_name",
        "task_id",
        "queue",
        "attempts",
        "created_at",
        "dead_at",
        "short_error",
        "related",
    )
    list_filter = ("task_name", "queue", "dead_at")
    search_fields = ("task_id", "task_name")
    ordering = ("-dead_at", "-id")
    fields = (
        "original_id",
        *_MESSAGE_FIELDS,
        "dead_at",
        "content_type",
        "content_encoding",
        "shown_headers",
        "shown_properties",
        "related",
    )
    readonly_fields = fields
    actions = ("replay", "delete_dead_letters")
    bulk_hint = (
        "narrow the selection with the filters, or use `manage.py outbox tasks "
        "replay` (ids, --name, --since, --until, --all) or `manage.py outbox tasks "
        "purge`, which work in chunks"
    )

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Replaying needs the change permission on dead letters."""
        return bool(request.user.has_perm("celery_outbox.change_deadletter"))

    def has_remove_permission(self, request: HttpRequest) -> bool:
        """Deleting needs the delete permission on dead letters."""
        return bool(request.user.has_perm("celery_outbox.delete_deadletter"))

    @admin.action(description="Replay", permissions=("operate",))
    def replay(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """Put the selected dead letters back into the outbox, due now."""
        picked = _picked(self, request, queryset)
        if picked is None:
            return
        report = operator_store().replay_dead_letters(
            DeadLetterFilter(ids=tuple(picked))
        )
        self._log_changed(
            request,
            _of(picked, report.ids),
            "Replayed into the outbox (same message, attempts reset).",
        )
        self.message_user(
            request,
            f"{report.replayed} dead letter(s) replayed into the outbox.",
            messages.SUCCESS if report.replayed else messages.WARNING,
        )

    @admin.action(description="Delete", permissions=("remove",))
    def delete_dead_letters(
        self, request: HttpRequest, queryset: QuerySet[Any]
    ) -> None:
        """Delete the selected dead letters for good."""
        picked = _picked(self, request, queryset)
        if picked is None:
            return
        deleted = operator_store().delete_dead_letters(list(picked))
        gone = _of(picked, deleted)
        if gone and hasattr(admin.ModelAdmin, "log_deletions"):  # Django >= 5.1
            self.log_deletions(request, gone)  # type: ignore[arg-type]
        else:  # pragma: no cover - Django < 5.1
            for obj in gone:
                getattr(self, "log_deletion")(request, obj, str(obj))  # noqa: B009
        self.message_user(
            request,
            f"{len(gone)} dead letter(s) deleted.",
            messages.SUCCESS if gone else messages.WARNING,
        )
