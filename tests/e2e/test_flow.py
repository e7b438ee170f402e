"""End to end: flow control with two real relays and a real Celery worker.

* 300 tasks of one flow at 20/s: no second of the worker's start times holds more
  than 20 + 10 %, and the rate is used (the last starts about 14 s after the first,
  as 300 at 20/s take; a limiter that wasted its windows would take longer).
* A flow's task retried by the worker (``self.retry``) and a flow's task sent by a
  task are outbox rows the gate decides on: the flow's records count every publish.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from datetime import datetime

import pytest
from django.db import transaction
from django.db.models import Sum

from celery_outbox.models import FlowRecord
from tests.e2e.conftest import BROKER_AMQP, Stack, alias_for, wait_until
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import add, flaky, record, spawn

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(120),
    pytest.mark.django_db(transaction=True, databases=[alias_for("postgresql")]),
]

E2EFactory = Callable[..., Stack]

TASKS = 300
RATE = 20


def started(stack: Stack, flows: dict[str, object]) -> Stack:
    """A worker and two relays of ``flows``, ready: a task of no flow has run."""
    stack.env.update(OUTBOX_TEST_FLOWS=json.dumps(flows))
    stack.start_worker(concurrency=8)
    stack.start_relay(name="relay")
    stack.start_relay(name="relay")
    tag = f"warm-{uuid.uuid4().hex[:8]}"
    with transaction.atomic():
        add.delay(1, 2, tag=tag)
    wait_until(
        lambda: TaskRun.objects.filter(tag=tag).exists(), 60, "the worker to start"
    )
    return stack


def most_in_any_second(times: list[datetime]) -> int:
    return max(
        sum(1 for t in times if 0 <= (t - start).total_seconds() < 1.0)
        for start in times
    )


# Alone on the machine (the serial part of the newest session): a worker starved of
# the CPU by the parallel sessions starts the queued tasks late and then in a burst,
# which would measure the machine, not the flow.
@pytest.mark.serial
def test_two_relays_hold_a_flow_to_its_rate_and_use_it(e2e: E2EFactory) -> None:
    stack = started(
        e2e("postgresql", BROKER_AMQP),
        # The day's rate never binds; it keeps the records a day, to be counted.
        {"partner": {"tasks": ["shop.record"], "rate": [f"{RATE}/s", "100000/d"]}},
    )
    prefix = f"flow-{uuid.uuid4().hex[:8]}"
    with transaction.atomic():
        for i in range(TASKS):
            record.delay(f"{prefix}-{i}")
    runs = TaskRun.objects.filter(tag__startswith=prefix)
    wait_until(lambda: runs.count() >= TASKS, 40, f"{TASKS} runs")
    stack.assert_alive()
    times = sorted(runs.values_list("ran_at", flat=True))
    assert len(times) == TASKS  # each once
    assert most_in_any_second(times) <= RATE * 1.1
    span = (times[-1] - times[0]).total_seconds()
    # 20 at once, then 20 per second: the last second starts 14 s after the first.
    assert 13.5 <= span <= 17.0, span
    # Every publish was recorded, by one relay or the other, before it was sent.
    recorded = FlowRecord.objects.filter(flow="partner").aggregate(n=Sum("tasks"))
    assert recorded["n"] == TASKS


def test_a_flows_retries_and_the_tasks_its_tasks_send_pass_the_gate(
    e2e: E2EFactory,
) -> None:
    started(
        e2e("postgresql", BROKER_AMQP),
        {"partner": {"tasks": ["shop.flaky", "shop.record"], "rate": "100/m"}},
    )
    tag = f"gated-{uuid.uuid4().hex[:8]}"
    with transaction.atomic():
        flaky.delay(f"{tag}-flaky")  # runs 3 times: 2 self.retry()
        spawn.delay(f"{tag}-spawn")  # no flow; sends shop.record, of the flow
    wait_until(
        lambda: (
            TaskRun.objects.filter(tag__in=[f"{tag}-flaky", f"{tag}-spawn-child"])
            .values("tag")
            .distinct()
            .count()
            == 2
        ),
        30,
        "the last retry and the child to run",
    )
    # Sent straight to the broker from the worker, the retries and the child would
    # not be here: 1 publish, not 4.
    recorded = FlowRecord.objects.filter(flow="partner").aggregate(n=Sum("tasks"))
    assert recorded["n"] == 4
