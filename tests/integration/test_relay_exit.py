"""``outbox relay --until-empty`` exits 0 only when nothing it could send is left (#37, #45).

With the broker down, every row it claimed waits in the outbox: the command fails
(exit status 1) and says why, on PostgreSQL and MariaDB, with a RabbitMQ and a
Redis URL; so does a second run within the outage cooldown, which claims nothing.
Rows a flow holds back end the run with a status of their own (3), counted. A port
nobody listens on stands for the broker that is down.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import transaction
from django.test import override_settings

from celery_outbox.cli.exits import ExitStatus
from celery_outbox.flow_limits import KEY_HEADER
from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.store import Stores
from tests.proxy import closed_port

from .builders import envelope

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

ROWS = 20


@pytest.fixture(params=["postgresql", "mysql"])
def vendor_alias(request: pytest.FixtureRequest) -> Iterator[str]:
    """The alias of each server database, as the outbox's database."""
    from tests.e2e.conftest import alias_for

    alias = alias_for(request.param)
    with override_settings(CELERY_OUTBOX_DATABASE=alias):
        yield alias


@pytest.fixture(params=["amqp", "redis"])
def broker_down(request: pytest.FixtureRequest, outbox_app: Any) -> Iterator[str]:
    """The app's broker is a port nobody listens on; yields its URL."""
    with closed_port() as sock:
        port = sock.getsockname()[1]
        url = (
            f"amqp://guest:guest@127.0.0.1:{port}//"
            if request.param == "amqp"
            else f"redis://127.0.0.1:{port}/14"
        )
        was = outbox_app.conf.broker_url
        outbox_app.conf.broker_url = url
        try:
            yield url
        finally:
            outbox_app.conf.broker_url = was


def enqueue(alias: str, queue: str, **headers: str) -> None:
    """``ROWS`` rows for this run's queue, with ``headers`` added."""
    rows = []
    for n in range(ROWS):
        row = envelope(f"r{n}", routing_key=queue, declare=(queue,), queue=queue)
        rows.append(dataclasses.replace(row, headers={**row.headers, **headers}))
    with transaction.atomic(using=alias):
        Stores(alias).writer().insert(rows)


def relay_until_empty() -> CommandError | None:
    """``outbox relay --until-empty``; the error it ended with, if any."""
    try:
        call_command(
            "outbox", "relay", "--until-empty", stdout=StringIO(), stderr=StringIO()
        )
    except CommandError as exc:
        return exc
    return None


def test_until_empty_with_the_broker_down_fails_naming_why(
    vendor_alias: str, broker_down: str, test_queue: str
) -> None:
    enqueue(vendor_alias, test_queue)
    with pytest.raises(CommandError) as raised:
        call_command(
            "outbox", "relay", "--until-empty", stdout=StringIO(), stderr=StringIO()
        )
    assert raised.value.returncode == 1
    text = str(raised.value)
    assert text.startswith("relay stopped: unfinished: 20 row(s) wait in the outbox")
    assert "20 not published, no attempt used (deferred by a broker outage" in text
    assert "refused" in text.lower()  # the connection's reason, as the log says it
    rows = OutboxMessage.objects.using(vendor_alias)
    assert rows.count() == ROWS
    assert set(rows.values_list("attempts", flat=True)) == {0}
    assert DeadLetter.objects.using(vendor_alias).count() == 0


def test_until_empty_with_the_broker_up_exits_0_with_the_outbox_empty(
    vendor_alias: str, test_queue: str
) -> None:
    enqueue(vendor_alias, test_queue)
    call_command(
        "outbox", "relay", "--until-empty", stdout=StringIO(), stderr=StringIO()
    )
    assert OutboxMessage.objects.using(vendor_alias).count() == 0


def test_a_second_run_within_the_outage_cooldown_still_fails(
    vendor_alias: str, broker_down: str, test_queue: str
) -> None:
    # The first run puts every row back for the cooldown (5 s); the second finds
    # none due and claims none: the rows are as unsent as they were.
    enqueue(vendor_alias, test_queue)
    first = relay_until_empty()
    assert first is not None and first.returncode == 1
    again = relay_until_empty()
    assert again is not None, "a retried drain passed with every row unsent"
    assert again.returncode == ExitStatus.FAILED
    text = str(again)
    assert text.startswith("relay stopped: unfinished: 20 row(s) wait in the outbox")
    assert "20 not published, no attempt used (deferred by a broker outage" in text
    assert "refused" in text.lower()
    assert OutboxMessage.objects.using(vendor_alias).count() == ROWS


@pytest.mark.parametrize(
    ("flow", "headers", "published"),
    [
        ({"tasks": ["shop.record"], "rate": "1/d"}, {}, 1),
        ({"tasks": ["shop.record"], "running": 1}, {KEY_HEADER: "tenant-1"}, 1),
    ],
    ids=["rate", "key-limit"],
)
def test_rows_a_flow_holds_back_end_the_run_held_and_counted(
    vendor_alias: str,
    test_queue: str,
    flow: dict[str, Any],
    headers: dict[str, str],
    published: int,
) -> None:
    enqueue(vendor_alias, test_queue, **headers)
    with override_settings(CELERY_OUTBOX_FLOWS={"slow": flow}):
        ended = relay_until_empty()
    held = ROWS - published
    assert OutboxMessage.objects.using(vendor_alias).count() == held
    assert ended is not None, "exit 0 with rows a flow holds back, not a word of them"
    assert ended.returncode == ExitStatus.HELD
    assert str(ended) == (
        f"relay stopped: held: {held} row(s) held by a limit: {held} held back by a "
        f"flow (its rate, or a flow key at its limit; 'outbox flows stats' shows them)"
    )
