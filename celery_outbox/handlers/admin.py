"""Django admin for the handler outboxes: read-only lists, pauses as kill switches.

A pause added here stops its category or shard at the next message a processor
runs; deleting it resumes, through
:class:`~celery_outbox.store.handlers.sql.HandlerStore` so the shards it stopped are
due at once. Dead letters can be replayed (written back at the end of their shards,
as ``manage.py outbox handlers replay`` does). Lists show the router's database for
these tables.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db import router
from django.db.models import Model, QuerySet
from django.http import HttpRequest

from ..store.handlers.sql import HandlerStore
from .models import HandlerDeadLetter, HandlerMessage, HandlerPause, HandlerShard
from .registry import registry

#: The most dead letters one admin action replays (each is loaded and logged).
REPLAY_LIMIT = 10_000


def _store() -> HandlerStore:
    return HandlerStore(router.db_for_write(HandlerMessage))


class _ReadOnly(admin.ModelAdmin):  # type: ignore[type-arg]
    """Handler outbox rows: on the router's database, read-only like the outbox's.

    Rows are written by :func:`~celery_outbox.handlers.emit` and the processor;
    operators act through the actions below, which call the store. (The outbox's
    admins say the same through ``celery_outbox.history_admin.ReadOnlyRecords``,
    which sits above this lane.)
    """

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Nothing is added by hand."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Fields are never edited."""
        return False


@admin.register(HandlerMessage)
class HandlerMessageAdmin(_ReadOnly):
    """Messages waiting for their receiver, oldest first."""

    list_display = ("id", "category", "shard", "object_id", "created_at")
    list_filter = ("category",)
    search_fields = ("shard", "object_id")
    ordering = ("id",)


@admin.register(HandlerShard)
class HandlerShardAdmin(_ReadOnly):
    """Shards with messages: blocked heads (attempts, last error), leases, holds."""

    list_display = (
        "shard",
        "attempts",
        "next_attempt_at",
        "failing_since",
        "held_by",
        "leased_until",
    )
    search_fields = ("shard",)
    ordering = ("-attempts", "next_attempt_at")
    actions = ["pause_shards"]

    @admin.action(description="Pause the selected shards")
    def pause_shards(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        store = _store()
        for shard in queryset.values_list("shard", flat=True):
            store.pause(HandlerPause.Kind.SHARD, shard, f"admin: {request.user}")
        self.message_user(request, f"{queryset.count()} shard(s) paused.")


@admin.register(HandlerDeadLetter)
class HandlerDeadLetterAdmin(_ReadOnly):
    """Messages whose receiver failed ``max_attempts`` times, with the last error."""

    list_display = ("id", "category", "shard", "object_id", "attempts", "died_at")
    list_filter = ("category",)
    search_fields = ("shard", "object_id")
    actions = ["replay"]

    def has_replay_permission(self, request: HttpRequest) -> bool:
        """Replaying needs the change permission on handler dead letters."""
        return bool(
            request.user.has_perm("celery_outbox_handlers.change_handlerdeadletter")
        )

    @admin.action(
        description="Replay (run again, at the end of their shards)",
        permissions=("replay",),
    )
    def replay(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """Write the selected dead letters back as new messages of their shards."""
        count = queryset.count()
        if count > REPLAY_LIMIT:
            self.message_user(
                request,
                f"{count:,} dead letters are selected; this action replays at most "
                f"{REPLAY_LIMIT:,}. Nothing was done: narrow the selection, or use "
                f"`manage.py outbox handlers replay` (ids, --name, --key, --all).",
                messages.ERROR,
            )
            return
        picked = {int(obj.pk): obj for obj in queryset.defer("payload", "last_error")}
        report = _store().replay(ids=list(picked), coalesces=registry.coalesces)
        for pk in report.ids:
            self.log_change(request, picked[pk], "Replayed at the end of its shard.")
        text = f"{report.replayed} dead letter(s) replayed."
        if report.superseded:
            text += (
                f" {report.superseded} left: a newer message of their object waits "
                f"in their shard and would run instead."
            )
        self.message_user(
            request, text, messages.SUCCESS if report.replayed else messages.WARNING
        )


@admin.register(HandlerPause)
class HandlerPauseAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    """Kill switches: add one to pause, delete it to resume."""

    list_display = ("kind", "value", "reason", "created_at")
    fields = ("kind", "value", "reason")

    def has_change_permission(
        self, request: HttpRequest, obj: Model | None = None
    ) -> bool:
        return False

    def save_model(
        self, request: HttpRequest, obj: Any, form: Any, change: bool
    ) -> None:
        _store().pause(HandlerPause.Kind(obj.kind), obj.value, obj.reason)

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        _store().resume(HandlerPause.Kind(obj.kind), obj.value)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        for kind, value in queryset.values_list("kind", "value"):
            _store().resume(HandlerPause.Kind(kind), value)
