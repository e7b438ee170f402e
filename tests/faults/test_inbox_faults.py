"""The fault scenarios again, with half the tasks on the inbox, side by side.

Each transaction commits plain ``shop.record`` tasks and ``shop.inbox_record`` tasks
together, so both kinds live through the same faults. A plain task runs every copy
the broker delivers; an inbox task commits its effect once and records every other
copy as skipped. Reported per kind: copies delivered more than once, and effects
written more than once.
"""

from __future__ import annotations

import random
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from celery import group
from django.db import transaction

from celery_outbox.models import DeadLetter
from tests.e2e.conftest import Stack, wait_until
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import DUPLICATE_TASK_NAME, inbox_record, record

from .test_faults import FAST_LEASE, outbox, rabbitmqctl, runs, wait_all_ran

pytestmark = [pytest.mark.faults, pytest.mark.e2e]

E2E = Callable[..., Stack]
#: After every task ran once: time for a late copy to arrive before counting.
GRACE = 3.0


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


def enqueue_both(prefix: str, count: int, per_tx: int = 250) -> list[str]:
    """Commit ``count`` plain and ``count`` inbox tasks, interleaved; returns their tags."""
    tags = [f"{prefix}-{kind}{i}" for i in range(count) for kind in ("p", "i")]
    for start in range(0, len(tags), per_tx):
        with transaction.atomic():
            group(
                (inbox_record if "-i" in tag else record).s(tag)
                for tag in tags[start : start + per_tx]
            ).apply_async()
    return tags


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


@pytest.mark.django_db(transaction=True)
def test_relay_killed_five_times_inbox_side_by_side(
    e2e: E2E, measured: list[str]
) -> None:
    stack = e2e("postgresql")
    stack.start_worker(concurrency=8)
    prefix = f"ikill-{uuid.uuid4().hex[:6]}"
    tags = enqueue_both(prefix, 1500)
    seed = random.randrange(1_000_000)
    rng = random.Random(seed)
    for n in range(5):
        relay = stack.start_relay("--batch-size", "100", *FAST_LEASE, name=f"relay-{n}")
        time.sleep(rng.uniform(0.2, 0.8))
        relay.popen.send_signal(signal.SIGKILL)
        relay.popen.wait(10)
    stack.start_relay("--batch-size", "100", *FAST_LEASE, name="relay-final")
    wait_all_ran(prefix, tags, 180)
    time.sleep(GRACE)
    result = side_by_side(prefix, tags)
    print(result.line("kill -9 relay x5"))
    measured.append(result.line(f"kill -9 relay x5 (seed={seed})"))
    assert result.lost == 0
    assert DeadLetter.objects.count() == 0
    assert result.plain_delivered + result.inbox_delivered > 0, (
        "no duplicates: no proof"
    )
    assert result.inbox_effects == 0


@pytest.mark.django_db(transaction=True)
def test_rabbitmq_stopped_mid_drain_inbox_side_by_side(
    e2e: E2E, measured: list[str]
) -> None:
    """Stops the shared RabbitMQ for 4 s: run it alone, never beside other test runs."""
    stack = e2e("postgresql")
    stack.start_worker(pool="prefork", concurrency=3)
    prefix = f"irmq-{uuid.uuid4().hex[:6]}"
    tags = enqueue_both(prefix, 1500)
    stack.start_relay("--batch-size", "50", "--broker-outage-cooldown", "1")
    total = len(tags)
    wait_until(lambda: outbox().count() < total - 100, 60, "the drain to start")
    rabbitmqctl("stop_app")
    try:
        time.sleep(4)
    finally:
        rabbitmqctl("start_app")
    wait_all_ran(prefix, tags, 240)
    time.sleep(GRACE)
    result = side_by_side(prefix, tags)
    print(result.line("RabbitMQ stop_app/start_app"))
    measured.append(result.line("RabbitMQ stop_app/start_app"))
    assert result.lost == 0
    assert DeadLetter.objects.count() == 0
    assert result.inbox_effects == 0
    stack.assert_alive()
