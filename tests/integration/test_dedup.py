"""dedup_key: a second enqueue while the first waits writes nothing and returns its result."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.db import connections, transaction

from celery_outbox.exceptions import OutboxDatabaseError, OutboxValueError
from celery_outbox.models import DedupKey, DedupSlot, OutboxMessage
from celery_outbox.store import Stores
from celery_outbox.store.dialects import DEDUP_SLOTS
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


class HolderRollsBack(Exception):
    """Raised by the key's first holder to roll its transaction back."""


#: Rounds per case: the deadlock came in 10 of 10 rounds with three writers waiting.
ROUNDS = 4
#: How long the first holder keeps its key before it rolls back.
HOLD = 0.6


@dataclass
class Race:
    """One round: a holder takes a key and rolls back while ``waiting`` writers wait."""

    alias: str
    waiting: int
    taker_rolls_back: bool
    key: str = field(default_factory=lambda: f"rollback-{uuid.uuid4().hex[:8]}")
    holds: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Task ids the committed writers got back.
    results: list[str] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    #: The writers that took the key and rolled back.
    rolled_back: list[int] = field(default_factory=list)

    def run(self) -> None:
        threads = [threading.Thread(target=self.holder)]
        threads += [
            threading.Thread(target=self.writer, args=(n,)) for n in range(self.waiting)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads)

    def holder(self) -> None:
        try:
            with transaction.atomic(using=self.alias):
                record.apply_async(("holder",), dedup_key=self.key, ignore_result=True)
                self.holds.set()
                time.sleep(HOLD)  # the writers wait for the key meanwhile
                raise HolderRollsBack
        except HolderRollsBack:
            pass
        except BaseException as exc:
            with self.lock:
                self.errors.append(exc)
        finally:
            self.holds.set()
            connections[self.alias].close()

    def writer(self, n: int) -> None:
        mine = uuid.uuid4().hex
        try:
            assert self.holds.wait(10)
            with transaction.atomic(using=self.alias):
                # Written before the key: a deadlock would roll it back too.
                Order.objects.using(self.alias).create(number=f"{self.key}-{n}")
                sent = record.apply_async(
                    (f"w{n}",), dedup_key=self.key, ignore_result=True, task_id=mine
                )
                if self._rolls_back(n, took=sent.id == mine):
                    time.sleep(HOLD / 2)  # the rest wait for this one now
                    raise HolderRollsBack
            with self.lock:
                self.results.append(str(sent.id))
        except HolderRollsBack:
            pass
        except BaseException as exc:
            with self.lock:
                self.errors.append(exc)
        finally:
            connections[self.alias].close()

    def _rolls_back(self, n: int, *, took: bool) -> bool:
        """Whether writer ``n``, which took the key or not, rolls back (the first taker)."""
        with self.lock:
            if self.taker_rolls_back and took and not self.rolled_back:
                self.rolled_back.append(n)
                return True
        return False


@pytest.mark.parametrize(
    ("waiting", "taker_rolls_back"), [(3, False), (5, False), (5, True)]
)
@pytest.mark.parametrize("alias", ["mysql", "default"])
def test_writers_waiting_on_a_key_whose_holder_rolls_back_see_no_error(
    alias: str, waiting: int, taker_rolls_back: bool, settings: Any
) -> None:
    """One writer holds a key and rolls back while ``waiting`` others wait for it.

    Every other writer's enqueue returns; one of them takes the key, the rest get
    its task (with ``taker_rolls_back``, the first to take it rolls back too, and
    the next one takes it). On MariaDB three waiting writers got a deadlock (1213),
    which rolls back the caller's whole transaction, in every round (#37).
    """
    settings.CELERY_OUTBOX_DATABASE = alias
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = False
    for round_ in range(ROUNDS):
        race = Race(alias, waiting, taker_rolls_back)
        race.run()
        assert race.errors == [], f"round {round_}: {race.errors!r}"
        assert len(race.rolled_back) == int(taker_rolls_back), f"round {round_}"
        committed = waiting - len(race.rolled_back)
        rows = list(
            OutboxMessage.objects.using(alias).values_list("task_id", flat=True)
        )
        assert len(rows) == 1, f"round {round_}: {rows}"
        assert race.results == rows * committed, f"round {round_}"
        orders = Order.objects.using(alias).filter(number__startswith=race.key)
        assert orders.count() == committed, f"round {round_}"
        OutboxMessage.objects.using(alias).all().delete()


#: How long any lock wait of the crossed-keys test may last (MariaDB's
#: innodb_lock_wait_timeout, PostgreSQL's lock_timeout): bounded, and far above
#: the time either database takes to find a deadlock it can see.
WAIT_LIMIT = 8
#: Time for a thread to reach its lock wait before the next one starts.
SETTLE = 0.4


def bound_waits(alias: str) -> None:
    """Bound every lock wait of this thread's connection to WAIT_LIMIT seconds."""
    with connections[alias].cursor() as cursor:
        if connections[alias].vendor == "mysql":
            cursor.execute(f"SET SESSION innodb_lock_wait_timeout = {WAIT_LIMIT}")
        else:
            cursor.execute(f"SET lock_timeout = '{WAIT_LIMIT}s'")


def is_deadlock(exc: BaseException) -> bool:
    """Whether ``exc`` is the package's database error for a deadlock the database
    found (MySQL/MariaDB 1213, PostgreSQL 40P01)."""
    if not isinstance(exc, OutboxDatabaseError):
        return False
    cause = exc.__cause__
    while cause is not None:  # Django's error, then (on PostgreSQL) the driver's
        code = getattr(cause, "sqlstate", None) or (cause.args or [None])[0]
        if code in (1213, "40P01"):
            return True
        cause = cause.__cause__
    return False


@dataclass
class Crossed:
    """Two transactions take keys A and B in crossed order; a bystander writes A."""

    alias: str
    started: float = field(default_factory=time.monotonic)
    steps: dict[str, threading.Event] = field(
        default_factory=lambda: {
            name: threading.Event() for name in ("t1 has a", "t2 has b", "t3 waits")
        }
    )
    errors: dict[str, BaseException] = field(default_factory=dict)
    failed_at: list[float] = field(default_factory=list)
    results: dict[str, list[str]] = field(default_factory=dict)

    def run(self) -> None:
        threads = {
            name: threading.Thread(target=self.writer, args=(name, body))
            for name, body in (("t1", self.t1), ("t2", self.t2), ("t3", self.t3))
        }
        for thread in threads.values():
            thread.start()
        for thread in threads.values():
            thread.join(3 * WAIT_LIMIT)
        assert not any(thread.is_alive() for thread in threads.values())

    def writer(self, name: str, body: Any) -> None:
        sent: list[str] = []
        try:
            bound_waits(self.alias)
            with transaction.atomic(using=self.alias):
                body(sent)
            self.results[name] = sent
        except BaseException as exc:
            self.failed_at.append(time.monotonic() - self.started)
            self.errors[name] = exc
        finally:
            for step in self.steps.values():
                step.set()  # a failed thread holds nobody up
            connections[self.alias].close()

    def take(self, key: str, sent: list[str]) -> None:
        sent.append(record.apply_async((key,), dedup_key=key, ignore_result=True).id)

    def t1(self, sent: list[str]) -> None:
        self.take("crossed-a", sent)
        self.steps["t1 has a"].set()
        assert self.steps["t3 waits"].wait(WAIT_LIMIT)
        self.take("crossed-b", sent)  # waits for t2

    def t2(self, sent: list[str]) -> None:
        assert self.steps["t1 has a"].wait(WAIT_LIMIT)
        self.take("crossed-b", sent)
        self.steps["t2 has b"].set()
        assert self.steps["t3 waits"].wait(WAIT_LIMIT)
        time.sleep(SETTLE)  # t1 waits for b meanwhile
        self.take("crossed-a", sent)  # waits for t1 (behind t3): the cycle

    def t3(self, sent: list[str]) -> None:
        assert self.steps["t2 has b"].wait(WAIT_LIMIT)
        threading.Timer(SETTLE, self.steps["t3 waits"].set).start()
        self.take("crossed-a", sent)  # waits for t1: the bystander


@pytest.mark.parametrize("alias", ["mysql", "default"])
def test_crossed_keys_fail_fast_with_one_deadlock_and_the_bystander_goes_on(
    alias: str, settings: Any
) -> None:
    """T1 takes A then B, T2 takes B then A, T3 writes A while T1 holds it.

    The database finds the deadlock between T1 and T2 at once and rolls one of them
    back; the other and T3 finish. On MariaDB a named lock (GET_LOCK) hid T2's wait
    from InnoDB: all three hung until innodb_lock_wait_timeout (49 s by default),
    then T3 failed with 1205 and T1 or T2 with 1213 (#45).
    """
    settings.CELERY_OUTBOX_DATABASE = alias
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = False
    race = Crossed(alias)
    race.run()
    assert list(race.errors) in (["t1"], ["t2"]), race.errors
    [error] = race.errors.values()
    assert is_deadlock(error), repr(error)
    assert race.failed_at[0] < 3.0  # PostgreSQL's deadlock_timeout is 1 s
    assert sorted(race.results) == sorted({"t1", "t2", "t3"} - set(race.errors))
    keys = dict(DedupKey.objects.using(alias).values_list("dedup_key", "task_id"))
    assert sorted(keys.values()) == sorted(waiting(alias))  # two rows, one per key
    assert race.results["t3"] == [keys["crossed-a"]]


def test_the_slots_outlive_a_flush_and_one_found_missing_is_written_back(
    settings: Any,
) -> None:
    """Migration 0014 writes the slot rows; the flush after each test leaves them
    (the table is not Django's to flush). An emptied table does not stop an enqueue:
    the key's slot row is written back."""
    settings.CELERY_OUTBOX_DATABASE = "mysql"
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = False
    slots = DedupSlot.objects.using("mysql")
    assert slots.count() == DEDUP_SLOTS
    slots.all().delete()
    try:
        with transaction.atomic(using="mysql"):
            sent = record.apply_async(("a",), dedup_key="slot-gone")
        assert waiting("mysql") == [sent.id]
        assert slots.count() == 1
    finally:
        slots.all().delete()
        slots.bulk_create([DedupSlot(slot=slot) for slot in range(DEDUP_SLOTS)])
