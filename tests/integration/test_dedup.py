"""dedup_key: a second enqueue while the first waits writes nothing and returns its result."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import connections, transaction

from celery_outbox.exceptions import OutboxValueError
from celery_outbox.models import DedupKey, OutboxMessage
from celery_outbox.store import Stores
from tests.project.shop.models import Order
from tests.project.shop.tasks import record

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


@pytest.fixture
def on_alias(alias: str, settings: Any) -> str:
    settings.CELERY_OUTBOX_DATABASE = alias
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = False
    return alias


def waiting(alias: str) -> list[str]:
    return list(
        OutboxMessage.objects.using(alias)
        .order_by("id")
        .values_list("task_id", flat=True)
    )


def publish_all(alias: str) -> None:
    """What the relay does to the rows once the broker confirmed them."""
    OutboxMessage.objects.using(alias).all().delete()


def test_a_second_enqueue_with_a_waiting_key_writes_nothing_and_returns_the_first(
    on_alias: str,
) -> None:
    with transaction.atomic(using=on_alias):
        first = record.apply_async(("a",), dedup_key="invoice:42")
    with transaction.atomic(using=on_alias):
        Order.objects.using(on_alias).create(number="still written")
        second = record.apply_async(("b",), dedup_key="invoice:42")
        other = record.apply_async(("c",), dedup_key="invoice:43")
    assert second.id == first.id
    assert waiting(on_alias) == [first.id, other.id]
    assert (
        Order.objects.using(on_alias).count() == 1
    )  # the caller's transaction is fine


def test_once_published_the_key_is_free_again(on_alias: str) -> None:
    with transaction.atomic(using=on_alias):
        first = record.apply_async(("a",), dedup_key="k")
    publish_all(on_alias)
    with transaction.atomic(using=on_alias):
        second = record.apply_async(("b",), dedup_key="k")
    assert second.id != first.id
    assert waiting(on_alias) == [second.id]


def test_a_window_keeps_the_key_after_publishing(on_alias: str) -> None:
    with transaction.atomic(using=on_alias):
        first = record.apply_async(("a",), dedup_key="w", dedup_window=1.5)
    publish_all(on_alias)
    with transaction.atomic(using=on_alias):
        again = record.apply_async(("b",), dedup_key="w")
    assert again.id == first.id
    assert waiting(on_alias) == []
    time.sleep(1.6)
    with transaction.atomic(using=on_alias):
        later = record.apply_async(("c",), dedup_key="w")
    assert later.id != first.id
    assert waiting(on_alias) == [later.id]


def test_a_rolled_back_enqueue_leaves_the_key_free(on_alias: str) -> None:
    with pytest.raises(RuntimeError), transaction.atomic(using=on_alias):
        record.apply_async(("a",), dedup_key="r")
        raise RuntimeError("rollback")
    with transaction.atomic(using=on_alias):
        kept = record.apply_async(("b",), dedup_key="r")
    assert waiting(on_alias) == [kept.id]


def test_ended_keys_are_purged_and_held_ones_kept(on_alias: str) -> None:
    with transaction.atomic(using=on_alias):
        record.apply_async(("a",), dedup_key="ended")
        record.apply_async(("b",), dedup_key="window", dedup_window=3600)
    publish_all(on_alias)
    with transaction.atomic(using=on_alias):
        record.apply_async(("c",), dedup_key="waiting")
    assert Stores(on_alias).dedup().purge_dedup_keys(chunk_size=1) == 1
    assert sorted(
        DedupKey.objects.using(on_alias).values_list("dedup_key", flat=True)
    ) == [
        "waiting",
        "window",
    ]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dedup_key": ""}, "dedup_key must be a non-empty string"),
        ({"dedup_key": "k" * 256}, "at most 255 characters"),
        ({"dedup_key": 42}, "dedup_key must be a non-empty string"),
        ({"dedup_key": "k", "dedup_window": -1}, "dedup_window must be a number"),
        ({"dedup_window": 10}, "dedup_window needs a dedup_key"),
    ],
)
def test_bad_options_are_refused_at_the_call(
    on_alias: str, options: dict[str, Any], message: str
) -> None:
    with (
        transaction.atomic(using=on_alias),
        pytest.raises(OutboxValueError, match=message),
    ):
        record.apply_async(("a",), **options)
    assert waiting(on_alias) == []


@pytest.mark.parametrize("alias", ["default", "mysql"])
def test_concurrent_writers_of_one_key_write_one_row(alias: str, settings: Any) -> None:
    """Two transactions enqueue the same key at once: the second waits for the first.

    The first holds its transaction open after the enqueue; the second's enqueue
    blocks on the key until the first commits, then returns the first's result.
    """
    settings.CELERY_OUTBOX_DATABASE = alias
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = False
    first_sent = threading.Event()
    results: dict[str, str] = {}
    errors: list[BaseException] = []
    second_done_at: list[float] = []
    first_committed_at: list[float] = []

    def first() -> None:
        try:
            with transaction.atomic(using=alias):
                # ignore_result: no result-backend connection left open per thread.
                results["first"] = record.apply_async(
                    ("1",), dedup_key="race", ignore_result=True
                ).id
                first_sent.set()
                time.sleep(1.0)  # the second writer is blocked meanwhile
            first_committed_at.append(time.monotonic())
        except BaseException as exc:
            errors.append(exc)
            first_sent.set()
        finally:
            connections[alias].close()

    def second() -> None:
        try:
            first_sent.wait(10)
            with transaction.atomic(using=alias):
                results["second"] = record.apply_async(
                    ("2",), dedup_key="race", ignore_result=True
                ).id
            second_done_at.append(time.monotonic())
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections[alias].close()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert results["second"] == results["first"]
    assert second_done_at[0] >= first_committed_at[0] - 0.05  # it waited
    assert waiting(alias) == [results["first"]]
