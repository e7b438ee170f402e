"""The fault scenarios again, with half the tasks on the inbox, side by side.

Each transaction commits plain ``shop.record`` tasks and ``shop.inbox_record`` tasks
together (the RabbitMQ scenario: their late-acknowledged variants), so both kinds
live through the same faults. A plain task runs every copy the broker delivers; an
inbox task commits its effect once and records every other copy as skipped. Reported
per kind: copies delivered more than once, and effects written more than once.
"""

from __future__ import annotations

import random
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from celery import group
from django.db import transaction

from celery_outbox.models import DeadLetter
from tests.e2e.conftest import Proc, Stack, wait_until
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import (
    DUPLICATE_TASK_NAME,
    inbox_record,
    inbox_record_late,
    record,
    record_late,
)

from .test_faults import FAST_LEASE, outbox, rabbitmqctl, runs, wait_all_ran

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

E2E = Callable[..., Stack]
#: After every task ran once: time for a late copy to arrive before counting.
GRACE = 3.0
#: How long a task of the RabbitMQ scenario works before it records its run (s).
LATE_BODY_SECONDS = 0.02
#: How long each RabbitMQ outage lasts (s).
OUTAGE_SECONDS = 4.0


@dataclass(frozen=True)
class SideBySide:
    """Duplicates of the plain and the inbox tasks of one fault run."""

    lost: int
    plain_delivered: int
    plain_effects: int
    inbox_delivered: int
    inbox_effects: int

    def line(self, scenario: str) -> str:
        return (
            f"{scenario}: lost={self.lost} | without inbox: duplicates delivered="
            f"{self.plain_delivered} duplicate effects={self.plain_effects} | with "
            f"inbox: duplicates delivered={self.inbox_delivered} duplicate effects="
            f"{self.inbox_effects}"
        )


def enqueue_both(
    prefix: str,
    count: int,
    per_tx: int = 250,
    plain: Any = record,
    inbox: Any = inbox_record,
    extra: tuple[Any, ...] = (),
) -> list[str]:
    """Commit ``count`` plain and ``count`` inbox tasks, interleaved; returns their tags.

    Each task is called with its tag, then ``extra``.
    """
    calls = [
        (f"{prefix}-{kind}{i}", task)
        for i in range(count)
        for kind, task in (("p", plain), ("i", inbox))
    ]
    for start in range(0, len(calls), per_tx):
        with transaction.atomic():
            group(
                task.s(tag, *extra) for tag, task in calls[start : start + per_tx]
            ).apply_async()
    return [tag for tag, _ in calls]


def side_by_side(prefix: str, tags: list[str]) -> SideBySide:
    ran = runs(prefix)
    extra: Counter[str] = Counter()
    for tag, count in ran.items():
        extra["i" if tag.startswith(f"{prefix}-i") else "p"] += count - 1
    inbox_ids = TaskRun.objects.filter(tag__startswith=f"{prefix}-i").values("task_id")
    skipped = TaskRun.objects.filter(
        task_name=DUPLICATE_TASK_NAME, task_id__in=inbox_ids
    ).count()
    return SideBySide(
        lost=sum(1 for tag in tags if ran[tag] == 0),
        plain_delivered=extra["p"],
        plain_effects=extra["p"],
        inbox_delivered=skipped + extra["i"],
        inbox_effects=extra["i"],
    )


#: Rounds of five kills at most: a round's kills can all miss the moment that costs
#: a duplicate (about 3 % of rounds), and a proof needs duplicates.
KILL_ROUNDS = 3


@pytest.mark.django_db(transaction=True)
def test_relay_killed_five_times_inbox_side_by_side(
    e2e: E2E, measured: list[str]
) -> None:
    stack = e2e("postgresql")
    stack.start_worker(concurrency=8)
    seed = random.randrange(1_000_000)
    rng = random.Random(seed)
    rounds: list[tuple[SideBySide, int]] = []
    for round_ in range(1, KILL_ROUNDS + 1):
        result, in_flight_at_kills = kill_relay_five_times(stack, rng, round_)
        line = result.line(
            f"kill -9 relay x5 (seed={seed}, round {round_}, leased at the kills "
            f"{in_flight_at_kills})"
        )
        print(line)
        measured.append(line)
        rounds.append((result, in_flight_at_kills))
        if result.plain_delivered + result.inbox_delivered > 0:
            break
    for result, in_flight_at_kills in rounds:
        assert result.lost == 0
        assert result.inbox_effects == 0
        # Only a row a killed relay held leased can be published twice.
        assert result.plain_delivered + result.inbox_delivered <= in_flight_at_kills
    assert DeadLetter.objects.count() == 0
    assert any(r.plain_delivered + r.inbox_delivered > 0 for r, _ in rounds), (
        f"no duplicates in {len(rounds)} rounds of five kills: no proof"
    )


def kill_relay_five_times(
    stack: Stack, rng: random.Random, round_: int
) -> tuple[SideBySide, int]:
    """Commit 3,000 tasks, kill five relays mid-drain, let a sixth finish.

    Returns the side-by-side duplicates and how many rows the killed relays held.
    Each relay is killed once it has taken 50 to 250 rows off the outbox, so that
    every kill lands mid-drain (a timed kill can find the outbox empty), and at a
    random moment after the DELETE that showed it, so that the kill does not always
    land at the same point of the relay's next batch.
    """
    prefix = f"ikill-{uuid.uuid4().hex[:6]}"
    tags = enqueue_both(prefix, 1500)
    in_flight_at_kills = 0
    for n in range(5):
        rows_left = outbox().count() - rng.randint(50, 250)
        relay = stack.start_relay(
            "--batch-size",
            "100",
            *FAST_LEASE,
            name=f"relay-{round_}-{n}",
            wait=False,
        )
        kill_once_drained_to(relay, rows_left, rng.uniform(0.0, 0.03))
        in_flight_at_kills += outbox().filter(lease_token__isnull=False).count()
    final = stack.start_relay(
        "--batch-size", "100", *FAST_LEASE, name=f"relay-{round_}-final"
    )
    wait_all_ran(prefix, tags, 180)
    time.sleep(GRACE)
    final.popen.terminate()
    final.popen.wait(30)
    return side_by_side(prefix, tags), in_flight_at_kills


def kill_once_drained_to(relay: Proc, rows_left: int, delay: float) -> None:
    """SIGKILL ``relay`` ``delay`` s after the outbox holds at most ``rows_left`` rows."""
    wait_until(
        lambda: outbox().count() <= rows_left,
        60,
        f"{relay.name} to drain the outbox to {rows_left} rows",
        relay.output,
        interval=0.005,
    )
    time.sleep(delay)
    relay.popen.send_signal(signal.SIGKILL)
    relay.popen.wait(10)


def wait_ran(prefix: str, count: int, what: str) -> None:
    """Wait until ``count`` distinct tasks of ``prefix`` ran at least once."""
    wait_until(
        lambda: len(runs(prefix)) >= count,
        120,
        what,
        lambda: f"{len(runs(prefix))} ran",
    )


@pytest.mark.django_db(transaction=True)
def test_rabbitmq_stopped_mid_drain_inbox_side_by_side(
    e2e: E2E, measured: list[str]
) -> None:
    """Stops the shared RabbitMQ twice for 4 s: run it alone, never beside other test runs.

    The tasks acknowledge late (``acks_late=True``) and work for ``LATE_BODY_SECONDS``,
    so the worker is always busy running some: when the broker goes away, the bodies
    under way finish, their acknowledgements are lost with the connection, and the
    broker delivers those messages again once it is back.
    """
    stack = e2e("postgresql")
    concurrency = 3
    stack.start_worker(pool="prefork", concurrency=concurrency)
    prefix = f"irmq-{uuid.uuid4().hex[:6]}"
    tags = enqueue_both(
        prefix,
        1500,
        plain=record_late,
        inbox=inbox_record_late,
        extra=(LATE_BODY_SECONDS,),
    )
    total = len(tags)
    seed = random.randrange(1_000_000)
    rng = random.Random(seed)
    # Each outage starts once a random share of the tasks ran, while the worker is
    # busy with the rest.
    stops_at = [round(total * rng.uniform(low, low + 0.2)) for low in (0.15, 0.5)]
    parameters = (
        f"seed={seed} concurrency={concurrency} body={LATE_BODY_SECONDS * 1000:.0f}ms "
        f"outages={len(stops_at)}x{OUTAGE_SECONDS:.0f}s after {stops_at} of {total} ran"
    )
    print(parameters)
    stack.start_relay("--batch-size", "50", "--broker-outage-cooldown", "1")
    unpublished: list[int] = []
    for n, count in enumerate(stops_at, 1):
        wait_ran(prefix, count, f"{count} tasks to run before outage {n}")
        unpublished.append(outbox().count())
        rabbitmqctl("stop_app")
        try:
            time.sleep(OUTAGE_SECONDS)
        finally:
            rabbitmqctl("start_app")
    wait_all_ran(prefix, tags, 240)
    time.sleep(GRACE)
    result = side_by_side(prefix, tags)
    print(result.line("RabbitMQ stop_app/start_app x2, late acks"))
    measured.append(
        result.line(
            f"RabbitMQ stop_app/start_app x2, late acks ({parameters}, "
            f"still in the outbox at the stops {unpublished})"
        )
    )
    assert result.lost == 0
    assert DeadLetter.objects.count() == 0
    assert result.plain_delivered + result.inbox_delivered > 0, (
        "no duplicates: no proof"
    )
    assert result.inbox_effects == 0
    stack.assert_alive()
