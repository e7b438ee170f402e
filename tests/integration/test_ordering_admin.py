"""Blocked heads of ordered keys in the admin and the command, on every database.

The admin's pages are rendered by Django's test client with the outbox on each alias
(``CELERY_OUTBOX_DATABASE``); the admin's own tables stay on ``default``.
"""

from __future__ import annotations

from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
from django.contrib.admin import site
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.db import transaction
from django.test import Client
from django.utils import formats, timezone

from celery_outbox.admin import OutboxMessageAdmin
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.ordering.core import ordered_settlement
from celery_outbox.outcomes import Action, Decision, Settlement
from celery_outbox.store import Stores
from celery_outbox.store.ordering import OrderingQueries

from .builders import keyed

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

OUTBOX = "/admin/celery_outbox/outboxmessage/"


@pytest.fixture
def store(alias: str, settings: Any) -> OrderingQueries:
    """The store on ``alias``, which the admin and the command use as the outbox."""
    settings.CELERY_OUTBOX_DATABASE = alias
    return Stores(alias).ordering()


def write(store: OrderingQueries, *envelopes: Any) -> dict[str, int]:
    """Insert; the row id of each tag."""
    with transaction.atomic(using=store.alias):
        Stores(store.alias).writer().insert(list(envelopes))
    rows = OutboxMessage.objects.using(store.alias).values_list("task_id", "id")
    return {task_id.rsplit("-", 1)[0]: row_id for task_id, row_id in rows}


def block_heads(store: OrderingQueries, count: int, error: str) -> None:
    """Claim ``count`` heads and fail them for good, as the relay does: they block."""
    claim = Stores(store.alias).relay().claim(count, 30)
    assert len(claim.messages) == count
    failed = Settlement(
        dead_letter=tuple(
            Decision(m.id, Action.DEAD_LETTER, 0.0, error) for m in claim.messages
        )
    )
    Stores(store.alias).relay().settle(
        claim.token, ordered_settlement(failed, claim.messages, 300.0)
    )


def claimed_tags(store: OrderingQueries) -> list[str]:
    claim = Stores(store.alias).relay().claim(10, 30)
    return [m.envelope.task_id.rsplit("-", 1)[0] for m in claim.messages]


def act(client: Client, action: str, *rows: int) -> str:
    page = client.post(
        OUTBOX, {"action": action, "_selected_action": list(rows)}, follow=True
    )
    assert page.status_code == 200
    return page.content.decode()


def test_the_admin_lists_blocked_keys_with_task_error_and_since(
    admin_client: Client, store: OrderingQueries
) -> None:
    write(store, keyed("a0", "org:1"), keyed("a1", "org:1"), keyed("b0", "org:2"))
    before = timezone.now()
    block_heads(store, 1, "PreconditionFailed: message too large")

    everything = admin_client.get(OUTBOX).content.decode()
    assert "blocked heads" in everything  # the filter is offered
    page = admin_client.get(OUTBOX, {"ordering": "blocked"})

    html = page.content.decode()
    assert page.status_code == 200
    assert "1 outbox message" in html
    head = OutboxMessage.objects.using(store.alias).get(state="blocked")
    assert "org:1" in html and head.task_id in html and "shop.record" in html
    assert "PreconditionFailed: message too large" in html
    assert "org:2" not in html  # the other key is not blocked
    # "blocked at" is the time of the block (not the far-off time it is due at).
    blocked_at = OutboxMessageAdmin(OutboxMessage, site).blocked_at(head)
    assert before - timedelta(seconds=5) < blocked_at < timezone.now()
    assert formats.localize(timezone.template_localtime(blocked_at)) in html
    (listed,) = store.blocked_heads()
    assert listed.blocked_seconds is not None and listed.blocked_seconds < 60
    assert "Ordered key: retry the blocked head" in html


def test_retry_makes_the_blocked_head_due_with_fresh_attempts(
    admin_client: Client, store: OrderingQueries
) -> None:
    ids = write(store, keyed("a0", "A"), keyed("a1", "A"))
    block_heads(store, 1, "refused")
    assert claimed_tags(store) == []  # the key waits for an operator

    html = act(admin_client, "retry_blocked", ids["a0"])

    assert "1 blocked head(s) retried." in html
    row = OutboxMessage.objects.using(store.alias).get(id=ids["a0"])
    assert (row.state, row.attempts) == (None, 0)
    assert claimed_tags(store) == ["a0", "a1"]  # the head first, then its run
    assert list(
        LogEntry.objects.filter(action_flag=CHANGE).values_list(
            "change_message", flat=True
        )
    ) == ["Blocked head of key 'A' retried."]


def test_skip_deletes_the_head_and_the_key_goes_on(
    admin_client: Client, store: OrderingQueries
) -> None:
    ids = write(store, keyed("a0", "A"), keyed("a1", "A"))
    block_heads(store, 1, "refused")

    html = act(admin_client, "skip_blocked", ids["a0"])

    assert "1 blocked head(s) skipped (deleted)." in html
    assert not OutboxMessage.objects.using(store.alias).filter(id=ids["a0"]).exists()
    assert not DeadLetter.objects.using(store.alias).exists()
    assert claimed_tags(store) == ["a1"]


def test_dead_letter_moves_the_head_with_its_error_and_the_key_goes_on(
    admin_client: Client, store: OrderingQueries
) -> None:
    ids = write(store, keyed("a0", "A"), keyed("a1", "A"), keyed("b0", "B"))
    block_heads(store, 2, "NotFound: no queue")  # a0 and b0 block their keys

    html = act(admin_client, "dead_letter_blocked", ids["a0"], ids["a1"])

    assert "1 blocked head(s) moved to the dead letters." in html
    assert "1 selected row(s) are not blocked heads (left as they are)." in html
    dead = DeadLetter.objects.using(store.alias).get()
    assert (dead.original_id, dead.ordering_key, dead.last_error) == (
        ids["a0"],
        "A",
        "NotFound: no queue",
    )
    assert claimed_tags(store) == ["a1"]  # A goes on; B still waits on its head
    assert [h.key for h in store.blocked_heads()] == ["B"]


def test_a_head_no_longer_blocked_is_left_alone(
    admin_client: Client, store: OrderingQueries
) -> None:
    ids = write(store, keyed("a0", "A"))
    block_heads(store, 1, "refused")
    assert store.retry_head("A") == 1  # someone else retried it meanwhile

    html = act(admin_client, "dead_letter_blocked", ids["a0"])

    assert "0 blocked head(s) moved to the dead letters." in html
    assert "1 selected row(s) are not blocked heads" in html
    assert not DeadLetter.objects.using(store.alias).exists()


def test_only_operators_get_the_actions(store: OrderingQueries) -> None:
    ids = write(store, keyed("a0", "A"))
    block_heads(store, 1, "refused")
    viewer = User.objects.create_user("viewer", password="x", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_outboxmessage"))
    client = Client()
    client.force_login(viewer)

    page = client.get(OUTBOX, {"ordering": "blocked"}).content.decode()
    assert "refused" in page  # sees the blocked key
    assert "retry_blocked" not in page
    client.post(OUTBOX, {"action": "retry_blocked", "_selected_action": [ids["a0"]]})
    assert OutboxMessage.objects.using(store.alias).get().state == "blocked"


def test_the_command_dead_letters_a_blocked_head(store: OrderingQueries) -> None:
    write(store, keyed("a0", "A"), keyed("a1", "A"))
    block_heads(store, 1, "refused")
    out = StringIO()

    call_command("outbox", "ordering", "stats", stdout=out)
    assert "blocked A: shop.record" in out.getvalue() and "rows, for " in out.getvalue()
    call_command("outbox", "ordering", "skip", "--key", "A", stdout=out)

    assert "skip: the head of 'A'" in out.getvalue()
    assert DeadLetter.objects.using(store.alias).get().ordering_key == "A"
    assert claimed_tags(store) == ["a1"]
    with pytest.raises(CommandError, match="no blocked head"):
        call_command("outbox", "ordering", "skip", "--key", "A", stdout=out)
