"""``outbox relay --until-empty`` exits 0 only when it published what it claimed (#37).

With the broker down, every row it claimed waits in the outbox: the command fails
(exit status 1) and says why, on PostgreSQL and MariaDB, with a RabbitMQ and a
Redis URL. A port nobody listens on stands for the broker that is down.
"""

from __future__ import annotations

from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import transaction
from django.test import override_settings

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


def enqueue(alias: str, queue: str) -> None:
    """``ROWS`` rows for this run's queue."""
    with transaction.atomic(using=alias):
        Stores(alias).writer().insert(
            [
                envelope(f"r{n}", routing_key=queue, declare=(queue,), queue=queue)
                for n in range(ROWS)
            ]
        )


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
    assert text.startswith("relay stopped: unfinished: 20 row(s) this run could not")
    assert "20 deferred by a broker outage (no attempt used)" in text
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
