"""A group or chord header built by a slow generator is written as it is built.

Celery publishes each member as the generator yields it (celery #3021), so the first
members run while the generator still works; Celery's own suite checks it
(``t/integration/test_canvas.py::test_chord::test_generator``). The outbox writes a
group's members in one INSERT once the group is complete, except when the builder
pauses: then what it built so far is written at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import chord
from celery.signals import before_task_publish
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from celery_outbox.enqueue import GROUP_PAUSE_SECONDS
from celery_outbox.models import OutboxMessage
from tests.project.shop.tasks import collect, record

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


def written() -> int:
    """Rows this connection sees (its own transaction's included)."""
    return OutboxMessage.objects.count()


@pytest.fixture
def handed_over() -> Iterator[list[str]]:
    """Task ids in the order Celery hands them to the producer (``before_task_publish``)."""
    ids: list[str] = []

    def note(headers: dict[str, Any], **_: Any) -> None:
        ids.append(str(headers["id"]))

    before_task_publish.connect(note, weak=False)
    yield ids
    before_task_publish.disconnect(note)


def slow_members(
    count: int, seen: list[tuple[int, int]], handed_over: list[str]
) -> Iterator[Any]:
    """Header members, each after a pause; notes (rows written, members Celery
    handed over) before each one."""
    for index in range(count):
        time.sleep(GROUP_PAUSE_SECONDS * 1.5)
        seen.append((written(), len(handed_over)))
        yield record.s(f"m{index}")


@pytest.mark.parametrize("size", [3, 6])
def test_a_chord_header_from_a_slow_generator_is_written_as_it_is_built(
    size: int, handed_over: list[str]
) -> None:
    """Outside a transaction, each member is written when Celery would publish it."""
    seen: list[tuple[int, int]] = []
    chord(slow_members(size, seen, handed_over), collect.s("done")).apply_async()
    assert written() == size
    assert [rows for rows, _ in seen] == [handed for _, handed in seen]
    # What Celery's own test checks: the first member is out before the last one
    # is built.
    assert seen[-1][0] >= 1, seen


def test_inside_a_transaction_the_header_is_one_insert(
    handed_over: list[str],
) -> None:
    """Nothing would be seen before the commit anyway: one INSERT at the end."""
    seen: list[tuple[int, int]] = []
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        chord(slow_members(4, seen, handed_over), collect.s("done")).apply_async()
    inserts = [
        q["sql"]
        for q in queries.captured_queries
        if "INSERT INTO celery_outbox_message" in q["sql"]
    ]
    assert len(inserts) == 1
    assert written() == 4
