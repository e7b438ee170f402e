"""The admin pages, rendered by Django's test client on real rows (outbox on ``default``)."""

from __future__ import annotations

import json

import pytest
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.db import transaction
from django.test import Client, override_settings
from kombu.compression import compress

from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.outcomes import Action, Decision, Settlement
from celery_outbox.store import Stores
from celery_outbox.store.operator import OperatorQueries

from .builders import dead_letter_due, envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

OUTBOX = "/admin/celery_outbox/outboxmessage/"
DEAD = "/admin/celery_outbox/deadletter/"


@pytest.fixture
def store() -> OperatorQueries:
    return Stores("default").operator()


def add(store: OperatorQueries, *tags: str, **overrides: object) -> list[int]:
    envelopes = [envelope(tag, **overrides) for tag in tags]
    with transaction.atomic(using=store.alias):
        Stores(store.alias).writer().insert(envelopes)
    return [
        OutboxMessage.objects.using("default").get(task_id=e.task_id).id
        for e in envelopes
    ]


def secret_body(**overrides: object) -> dict[str, object]:
    body = json.dumps([["alice"], {"password": "hunter2"}, {}]).encode()
    return {"body": body, **overrides}


def kill_all(store: OperatorQueries) -> list[int]:
    dead_letter_due(Stores(store.alias).relay(), 100, "PreconditionFailed: too big")
    return list(DeadLetter.objects.using("default").values_list("id", flat=True))


def logged(flag: int) -> list[str]:
    return list(
        LogEntry.objects.filter(action_flag=flag).values_list(
            "change_message", flat=True
        )
    )


def test_changelist_shows_the_summary(
    admin_client: Client, store: OperatorQueries
) -> None:
    add(store, "a", "b")
    add(store, "c", task_name="shop.add", queue="other")
    claim = Stores(store.alias).relay().claim(1, 30)
    Stores(store.alias).relay().settle(
        claim.token,
        Settlement(
            retry=(Decision(claim.messages[0].id, Action.RETRY, 600, "NotFound: q"),)
        ),
    )

    page = admin_client.get(OUTBOX)

    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="outbox-pending">3<' in html
    assert 'id="outbox-due">2<' in html
    assert 'id="outbox-retrying">1<' in html
    assert 'id="outbox-in-flight">0<' in html
    assert "<td>shop.add</td><td>other</td><td>1</td><td>1</td>" in html
    assert "<td>shop.record</td><td>celery</td><td>2</td><td>1</td>" in html
    assert "retrying" in html  # the state column
    assert "NotFound: q" in html
    filtered = admin_client.get(OUTBOX, {"state": "retrying"}).content.decode()
    assert "1 outbox message" in filtered


def test_the_admin_is_read_only(admin_client: Client, store: OperatorQueries) -> None:
    (row,) = add(store, "a")
    assert admin_client.get(f"{OUTBOX}add/").status_code == 403
    page = admin_client.get(f"{OUTBOX}{row}/change/").content.decode()
    assert 'name="_save"' not in page
    assert admin_client.get(f"{OUTBOX}{row}/delete/").status_code == 403


def test_detail_shows_decoded_arguments(
    admin_client: Client, store: OperatorQueries
) -> None:
    (plain,) = add(store, "plain", **secret_body())
    data, codec = compress(secret_body()["body"], "zlib")
    (compressed,) = add(
        store,
        "zipped",
        body=data,
        headers={"task": "shop.record", "compression": codec, "argsrepr": "x"},
    )

    for row in (plain, compressed):
        html = admin_client.get(f"{OUTBOX}{row}/change/").content.decode()
        assert "alice" in html
        assert "hunter2" in html


def test_detail_shows_headers_and_properties_as_formatted_json(
    admin_client: Client, store: OperatorQueries
) -> None:
    (row,) = add(
        store,
        "json",
        headers={"task": "shop.record", "retries": 0, "origin": "gen1@web"},
        properties={"priority": 5, "correlation_id": "c-1"},
    )
    html = admin_client.get(f"{OUTBOX}{row}/change/").content.decode()
    # Indented JSON with sorted keys, HTML-escaped: not a Python repr.
    assert (
        "{\n  &quot;origin&quot;: &quot;gen1@web&quot;,\n  &quot;retries&quot;: 0,"
        in html
    )
    assert (
        "&quot;correlation_id&quot;: &quot;c-1&quot;,\n  &quot;priority&quot;: 5"
        in html
    )
    assert "'origin'" not in html


@override_settings(CELERY_OUTBOX_REDACTOR="tests.integration.redactors.hide_passwords")
def test_detail_redacts_arguments(admin_client: Client, store: OperatorQueries) -> None:
    add(
        store,
        "secret",
        headers={"task": "shop.record", "kwargsrepr": "{'password': 'hunter2'}"},
        **secret_body(),
    )
    kill_all(store)
    (dead,) = DeadLetter.objects.using("default").values_list("id", flat=True)

    html = admin_client.get(f"{DEAD}{dead}/change/").content.decode()

    assert "alice" in html
    assert "***" in html
    assert "hunter2" not in html
    assert "PreconditionFailed: too big" in html


@override_settings(CELERY_OUTBOX_REDACTOR="tests.integration.redactors.broken")
def test_a_failing_redactor_hides_everything(
    admin_client: Client, store: OperatorQueries
) -> None:
    (row,) = add(store, "secret", **secret_body())
    html = admin_client.get(f"{OUTBOX}{row}/change/").content.decode()
    assert "alice" not in html
    assert "hunter2" not in html
    assert "the redactor raised an error" in html


def test_action_retry_now(admin_client: Client, store: OperatorQueries) -> None:
    (row,) = add(store, "a")
    claim = Stores(store.alias).relay().claim(1, 30)
    Stores(store.alias).relay().settle(
        claim.token, Settlement(retry=(Decision(row, Action.RETRY, 600, "NotFound"),))
    )
    assert store.stats().due == 0

    page = admin_client.post(
        OUTBOX, {"action": "retry_now", "_selected_action": [row]}, follow=True
    )

    assert "1 message(s) will be published at once." in page.content.decode()
    assert store.stats().due == 1
    assert logged(CHANGE) == ["Made due now (retry now)."]


def test_action_move_to_dead_letters(
    admin_client: Client, store: OperatorQueries
) -> None:
    leased, free = add(store, "leased", "free")
    assert [m.id for m in Stores(store.alias).relay().claim(1, 30).messages] == [leased]

    page = admin_client.post(
        OUTBOX,
        {"action": "move_to_dead_letters", "_selected_action": [free, leased]},
        follow=True,
    )

    html = page.content.decode()
    assert (
        "1 message(s) moved to the dead letters; 1 skipped (held by a relay)." in html
    )
    dead = DeadLetter.objects.using("default").get()
    assert (dead.original_id, dead.last_error) == (
        free,
        "moved by admin from the admin",
    )
    assert logged(CHANGE) == ["Moved to dead letters: moved by admin from the admin."]
    entry = LogEntry.objects.get()
    assert entry.object_id == str(free)


def test_replaying_a_selection_someone_already_replayed_replays_nothing(
    admin_client: Client, store: OperatorQueries
) -> None:
    # "Go" pressed twice, or a colleague was quicker: the selected row is gone.
    add(store, "picked", "other-1", "other-2")
    first = min(kill_all(store))
    for _ in range(2):
        page = admin_client.post(
            DEAD, {"action": "replay", "_selected_action": [first]}, follow=True
        )
    assert "0 dead letter(s) replayed into the outbox." in page.content.decode()
    assert store.stats().dead == 2


def test_dead_letter_actions_replay_and_delete(
    admin_client: Client, store: OperatorQueries
) -> None:
    add(store, "again", "gone")
    first, second = sorted(kill_all(store))
    replayed_task = DeadLetter.objects.using("default").get(id=first).task_id

    page = admin_client.post(
        DEAD, {"action": "replay", "_selected_action": [first]}, follow=True
    )
    assert "1 dead letter(s) replayed into the outbox." in page.content.decode()
    assert [
        m.envelope.task_id for m in Stores(store.alias).relay().claim(10, 30).messages
    ] == [replayed_task]
    assert logged(CHANGE) == [
        "Replayed into the outbox (same message, attempts reset)."
    ]

    page = admin_client.post(
        DEAD,
        {"action": "delete_dead_letters", "_selected_action": [second]},
        follow=True,
    )
    assert "1 dead letter(s) deleted." in page.content.decode()
    assert store.stats().dead == 0
    assert LogEntry.objects.filter(action_flag=DELETION, object_id=str(second)).exists()


@pytest.mark.parametrize(
    ("page", "action", "rows"),
    [
        (OUTBOX, "retry_now", "outbox"),
        (OUTBOX, "move_to_dead_letters", "outbox"),
        (DEAD, "replay", "dead"),
        (DEAD, "delete_dead_letters", "dead"),
    ],
)
def test_an_action_on_more_rows_than_the_limit_does_nothing_and_says_why(
    admin_client: Client,
    store: OperatorQueries,
    monkeypatch: pytest.MonkeyPatch,
    page: str,
    action: str,
    rows: str,
) -> None:
    from celery_outbox.admin import MessageAdminMixin

    monkeypatch.setattr(MessageAdminMixin, "action_limit", 2)
    add(store, "a", "b", "c")
    if rows == "dead":
        kill_all(store)
    before = (store.stats().pending, store.stats().dead)

    response = admin_client.post(
        page,
        # "Select all 3": Django hands the action the whole filtered queryset.
        {"action": action, "_selected_action": ["0"], "select_across": "1"},
        follow=True,
    )

    html = response.content.decode()
    assert "3 rows are selected; an action here works on at most 2" in html
    assert "Nothing was done" in html
    assert (store.stats().pending, store.stats().dead) == before
    assert not LogEntry.objects.exists()
    if rows == "dead":
        assert "manage.py outbox tasks replay" in html
