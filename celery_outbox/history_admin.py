"""The history in the Django admin, and links between a task's records by task id.

:class:`HistoryEventAdmin` lists the events of ``CELERY_OUTBOX_HISTORY`` read-only.
:class:`TaskLinks` adds a "related" column to the outbox rows, dead letters and
history: links to the same task id's other records, and to django-celery-results'
``TaskResult`` admin when that app is installed and its admin registered.
"""

from __future__ import annotations

from typing import Any, cast
from urllib.parse import urlencode

from django.apps import apps
from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html_join
from django.utils.safestring import SafeString

from .conf import get_settings
from .models import DeadLetter, HistoryEvent, OutboxMessage

#: The app whose ``TaskResult`` admin a task id links to, when it is installed.
RESULTS_APP = "django_celery_results"

#: What each link target is called, and the changelist it opens.
_TARGETS = {
    "outbox": ("outbox", OutboxMessage),
    "dead": ("dead letters", DeadLetter),
    "history": ("history", HistoryEvent),
}


def result_url(task_id: str, site_name: str = "admin") -> str | None:
    """django-celery-results' admin list of the task's results; None without the app."""
    if not apps.is_installed(RESULTS_APP):
        return None
    try:
        url = reverse(
            "admin:django_celery_results_taskresult_changelist", current_app=site_name
        )
    except NoReverseMatch:  # installed, but its admin is not registered
        return None
    return f"{url}?{urlencode({'task_id': task_id})}"


def task_urls(
    task_id: str, targets: tuple[str, ...], site_name: str = "admin"
) -> list[tuple[str, str]]:
    """``(label, url)`` of each target's records of ``task_id`` that can be linked."""
    links: list[tuple[str, str]] = []
    for target in targets:
        if target == "result":
            url = result_url(task_id, site_name)
            if url is not None:
                links.append(("result", url))
            continue
        label, model = _TARGETS[target]
        opts = model._meta
        url = reverse(
            f"admin:{opts.app_label}_{opts.model_name}_changelist",
            current_app=site_name,
        )
        links.append((label, f"{url}?{urlencode({'task_id': task_id})}"))
    return links


class ReadOnlyRecords:
    """The one admin base of the package's tables: records shown, never edited.

    Rows are written by the enqueue path, the lanes and the stores; operators act
    on them through admin actions that call a store. Mixed in before
    ``admin.ModelAdmin`` by the outbox's admins; the handler outboxes' admin, a
    lane's, says the same itself (it imports nothing from this layer).
    """

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Nothing is added by hand."""
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """Fields are never edited."""
        return False


class OutboxRecords(ReadOnlyRecords):
    """Records on the outbox alias, shown read-only, never deleted in the ORM."""

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        """The records on the outbox alias."""
        from .store import outbox_alias

        queryset: QuerySet[Any] = super().get_queryset(request)  # type: ignore[misc]
        return cast("QuerySet[Any]", queryset.using(outbox_alias(get_settings())))

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        """No ORM deletes: the store's actions and the retention purge delete."""
        return False


class TaskLinks:
    """A "related" column: links to the task id's records in the other tables."""

    #: Which records to link: "outbox", "dead", "history", "result".
    task_link_targets: tuple[str, ...] = ("history", "result")

    @admin.display(description="related")
    def related(self, obj: Any) -> SafeString:
        """Links to the same task id's other records."""
        site = cast("admin.ModelAdmin[Any]", self).admin_site.name
        return format_html_join(
            " · ",
            '<a href="{}">{}</a>',
            (
                (url, label)
                for label, url in task_urls(obj.task_id, self.task_link_targets, site)
            ),
        )


@admin.register(HistoryEvent)
class HistoryEventAdmin(OutboxRecords, TaskLinks, admin.ModelAdmin):  # type: ignore[type-arg]
    """Each message's history (``CELERY_OUTBOX_HISTORY``): read-only, newest first."""

    task_link_targets = ("outbox", "dead", "result")
    list_display = (
        "at",
        "event",
        "task_name",
        "task_id",
        "attempt",
        "short_error",
        "process",
        "related",
    )
    list_filter = ("event", "task_name")
    search_fields = ("task_id", "task_name")
    ordering = ("-id",)
    fields = (
        "task_id",
        "task_name",
        "event",
        "at",
        "enqueued_at",
        "attempt",
        "error",
        "relay_id",
        "process",
        "related",
    )
    readonly_fields = fields

    @admin.display(description="reason")
    def short_error(self, obj: HistoryEvent) -> str:
        """The reason, cut to one line of 80 characters."""
        text = obj.error.strip().splitlines()[0] if obj.error.strip() else ""
        return text if len(text) <= 80 else text[:79] + "…"
