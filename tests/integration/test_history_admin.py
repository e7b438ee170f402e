"""The history in the admin, and the links between a task's records (outbox on ``default``)."""

from __future__ import annotations

from html import unescape
from urllib.parse import urlencode

import pytest
from django.apps import apps
from django.db import transaction
from django.test import Client

from celery_outbox.history_admin import RESULTS_APP, result_url
from celery_outbox.models import DeadLetter, HistoryEvent, OutboxMessage
from celery_outbox.outcomes import Action, Decision, Settlement
from celery_outbox.store import Stores

from .builders import envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

OUTBOX = "/admin/celery_outbox/outboxmessage/"
DEAD = "/admin/celery_outbox/deadletter/"
HISTORY = "/admin/celery_outbox/historyevent/"


@pytest.fixture
def store() -> Stores:
    return Stores("default", holder="b" * 32, history=True)


def add(store: Stores, tag: str) -> str:
    message = envelope(tag)
    with transaction.atomic(using=store.alias):
        store.writer().insert([message])
    return message.task_id


def settle(store: Stores, action: Action, error: str = "") -> None:
    claim = store.relay().claim(10, 30)
    decisions = [Decision(m.id, action, 600.0, error) for m in claim.messages]
    store.relay().settle(claim.token, Settlement.of(decisions))


def link(path: str, task_id: str) -> str:
    """The href of a link to ``path`` filtered by task id, as the page writes it."""
    return f'href="{path}?{urlencode({"task_id": task_id})}"'


def page(client: Client, path: str, **query: str) -> str:
    response = client.get(path, query)
    assert response.status_code == 200
    return unescape(response.content.decode())


def test_an_outbox_row_links_to_its_history(
    admin_client: Client, store: Stores
) -> None:
    task_id = add(store, "a")
    settle(store, Action.RETRY, "NotFound: no queue 'emails'")

    html = page(admin_client, OUTBOX)
    assert link(HISTORY, task_id) in html
    row = OutboxMessage.objects.using("default").get(task_id=task_id)
    assert link(HISTORY, task_id) in page(admin_client, f"{OUTBOX}{row.id}/change/")

    history = page(admin_client, HISTORY, task_id=task_id)
    assert "1 history event" in history
    assert "NotFound: no queue 'emails'" in history
    assert link(OUTBOX, task_id) in history
    assert link(DEAD, task_id) in history


def test_a_dead_letter_links_to_its_history(
    admin_client: Client, store: Stores
) -> None:
    task_id = add(store, "a")
    settle(store, Action.DEAD_LETTER, "PreconditionFailed: message too big")
    dead = DeadLetter.objects.using("default").get(task_id=task_id)

    assert link(HISTORY, task_id) in page(admin_client, DEAD)
    assert link(HISTORY, task_id) in page(admin_client, f"{DEAD}{dead.id}/change/")
    history = page(admin_client, HISTORY, task_id=task_id)
    assert "PreconditionFailed: message too big" in history
    assert ">dead<" in history


def test_the_history_lists_only_the_asked_task(
    admin_client: Client, store: Stores
) -> None:
    first = add(store, "a")
    settle(store, Action.DELETE)
    second = add(store, "b")
    settle(store, Action.DELETE)

    html = page(admin_client, HISTORY, task_id=first)
    assert first in html
    assert second not in html
    assert "2 history events" in page(admin_client, HISTORY)


def test_the_history_is_read_only(admin_client: Client, store: Stores) -> None:
    add(store, "a")
    settle(store, Action.DELETE)
    event = HistoryEvent.objects.using("default").get()

    assert admin_client.get(f"{HISTORY}add/").status_code == 403
    detail = page(admin_client, f"{HISTORY}{event.id}/change/")
    assert 'name="_save"' not in detail
    assert "published" in detail
    assert admin_client.get(f"{HISTORY}{event.id}/delete/").status_code == 403
    assert admin_client.post(f"{HISTORY}{event.id}/change/", {}).status_code == 403
    assert HistoryEvent.objects.using("default").count() == 1


def test_no_result_link_without_django_celery_results(
    admin_client: Client, store: Stores
) -> None:
    # This test project does not install django-celery-results: no link to its admin.
    assert not apps.is_installed(RESULTS_APP)
    task_id = add(store, "a")
    assert result_url(task_id) is None
    assert "taskresult" not in page(admin_client, OUTBOX)
