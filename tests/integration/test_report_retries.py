"""A worker's report outlives a database outage: tried again until it is written.

The reporter writes on an alias whose server sits behind a :class:`~tests.proxy.Proxy`
that the test cuts for 2 s; the shared server itself is never stopped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections, transaction
from django.test import override_settings

from celery_outbox.engine.reports import Reporter
from celery_outbox.exceptions import OutboxDatabaseError
from celery_outbox.flow.gate import candidate
from celery_outbox.store import Stores

from ..contract.flow_contract import keyed_flow, of_key
from ..proxy import Proxy

#: The test database, and the same one through the proxy.
REAL = "default"
PROXIED = "default_through_a_proxy"
# Known when the test databases are set up (a mirror of REAL: nothing created, and
# a test may open it from a thread of its own); the fixture points it at the proxy.
connections.settings.setdefault(
    PROXIED, dict(connections.settings[REAL], TEST={"MIRROR": REAL})
)

pytestmark = pytest.mark.django_db(databases=[REAL, PROXIED], transaction=True)


@pytest.fixture
def proxied() -> Iterator[Proxy]:
    """The test database as the alias :data:`PROXIED`, through a proxy."""
    real = connections[REAL].settings_dict
    if connections[REAL].vendor == "sqlite":
        pytest.skip("SQLite has no server to cut")
    with Proxy(str(real["HOST"] or "127.0.0.1"), int(real["PORT"] or 5432)) as node:
        mirror = connections.settings[PROXIED]
        connections.settings[PROXIED] = dict(
            real, HOST=node.host, PORT=str(node.port), TEST={"MIRROR": REAL}
        )
        try:
            yield node
        finally:
            node.cut()  # the reporter's connection through it ends with it
            connections.settings[PROXIED] = mirror


def test_the_end_of_a_task_reported_during_an_outage_frees_its_slot_after_it(
    proxied: Proxy,
) -> None:
    partner = keyed_flow(running=1)
    with transaction.atomic(using=REAL):
        Stores(REAL).writer().insert([of_key("a1", "a"), of_key("a2", "a")])
    claim = Stores(REAL).relay().claim(10, 30.0)
    first, _ = claim.messages
    decided = (
        Stores(REAL)
        .flows()
        .decide(partner, [candidate(m) for m in claim.messages], claim.token)
    )
    assert len(decided.waiting) == 1  # a2 waits for a1's slot

    reporter = Reporter()
    task_id = first.envelope.task_id
    proxied.cut()
    with override_settings(CELERY_OUTBOX_DATABASE=PROXIED):
        reporter.send(
            lambda stores: stores.flows().task_ended(partner, "a", task_id),
            task_id,
            "succeeded",
            slot=("flow-end", partner.name, task_id),
        )
    time.sleep(2.0)  # the database is away: the report is tried, and waits
    assert not reporter.wait(0.1)
    proxied.restore()
    back = time.monotonic()
    assert reporter.wait(15.0)
    # The backoff's cap, not the lease (300 s): a2 is due as soon as it is written.
    assert time.monotonic() - back < 12.0
    again = Stores(REAL).relay().claim(10, 30.0).messages
    assert [m.envelope.task_id.split("-")[0] for m in again] == ["a2"]
    assert reporter.stop(1.0) == []


def test_a_report_not_written_by_the_shutdown_is_named() -> None:
    reporter = Reporter()

    def down(_: Stores) -> int:
        raise OutboxDatabaseError("connection refused")

    with override_settings(CELERY_OUTBOX_DATABASE=REAL):
        reporter.send(down, "t-1", "succeeded")
    assert reporter.stop(0.3) == ["t-1 (succeeded)"]


def test_a_tasks_reports_are_written_in_their_order_after_an_outage() -> None:
    """A start the database refused is not overtaken by its task's end."""
    reporter = Reporter(random_source=lambda: 0.0)
    written: list[str] = []
    refusals = {"a": 2}

    def report(name: str) -> Any:
        def write(_: Stores) -> int:
            task = name.split()[0]
            if refusals.get(task, 0) and name.endswith("started"):
                refusals[task] -= 1
                raise OutboxDatabaseError("connection refused")
            written.append(name)
            return 1

        return write

    with override_settings(CELERY_OUTBOX_DATABASE=REAL):
        for name in ("a started", "a succeeded", "b started", "b succeeded"):
            task, state = name.split()
            reporter.send(report(name), task, state, slot=name)
        assert reporter.wait(20.0)
    assert written.index("a started") < written.index("a succeeded")
    assert written.index("b started") < written.index("b succeeded")
    # The refused report did not hold back the other task's.
    assert written.index("b started") < written.index("a started")
    assert reporter.stop(1.0) == []
