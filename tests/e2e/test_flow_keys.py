"""End to end: a flow's limits per key (``flow_key=``) with real relays and workers.

* ``running``: at most 2 tasks of a key run at once, measured from the start and
  end times the tasks record, while the relays publish the other keys' tasks past
  a capped key (more than 2 run at once overall); every task runs once and every
  slot is freed by the worker's reports. On PostgreSQL and MariaDB.
* A key's tasks that retry (``self.retry()``) hold its cap too.
* A key shared by two flows (a tenant's id): a slot freed in one flow lets that
  flow's next task of the key go, whatever the other flow's tasks of the key do.
* ``queued``: a key committed behind another key's backlog of 1,500 tasks starts
  within a second or so of its commit, not behind the backlog.
* ``lease``: a worker killed mid-task never reports its end; its slot frees when
  the lease (counted from the start it reported) is over, and the key's next task
  runs then, not before and not a lease later.
* A task that expires in RabbitMQ's queue, and one that puts its message back
  (``Reject(requeue=True)``): the first frees its slot when a worker discards
  it, not at the lease; the second keeps it until its next run ends, so that the
  key's next task never runs beside it.
* A relay killed with ``kill -9`` while it holds a batch of a rate's flow: no
  second holds more starts than the rate and one batch, and nothing is lost.

The tasks record their own intervals (``shop.hold``: ``start:<tag>`` and
``end:<tag>``). The test process names a task's flow in its headers when it sends
it, so it gets the same ``CELERY_OUTBOX_FLOWS`` as the relays and the worker.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone

from celery_outbox.models import FlowSlot, OutboxMessage
from tests.e2e.conftest import (
    BROKER_AMQP,
    Proc,
    Stack,
    StackSpec,
    alias_for,
    on_stack,
    wait_until,
)
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import add, hold, record, record_late, requeue_once

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

E2EFactory = Callable[..., Stack]
#: The flow of the tests of one flow.
FLOW = "partner"


def on(vendor: str) -> pytest.MarkDecorator:
    """Real commits (the subprocesses must see the rows) on ``vendor``'s test database."""
    return pytest.mark.django_db(transaction=True, databases=[alias_for(vendor)])


def flow(task: str = "shop.hold", **policy: object) -> dict[str, object]:
    """``CELERY_OUTBOX_FLOWS`` of one flow, :data:`FLOW`, over ``task``."""
    return {FLOW: {"tasks": [task], **policy}}


def started(
    stack: Stack,
    settings: Any,
    flows: Mapping[str, object],
    concurrency: int,
    *relay: str,
    relays: int = 1,
    sender: bool = True,
) -> Stack:
    """A threads worker and ``relays`` relays under ``flows``, :func:`ready`."""
    stack.env.update(OUTBOX_TEST_FLOWS=json.dumps(flows))
    stack.start_worker(concurrency=concurrency)
    for _ in range(relays):
        stack.start_relay(*relay)
    return ready(stack, settings, flows, sender=sender)


def ready(
    stack: Stack, settings: Any, flows: Mapping[str, object], *, sender: bool = True
) -> Stack:
    """``stack`` once a task of no flow has run on it. ``sender``: the test process
    has the flows too (else it sends as a process of older settings)."""
    if sender:
        settings.CELERY_OUTBOX_FLOWS = flows
    tag = f"warm-{uuid.uuid4().hex[:8]}"
    with transaction.atomic(using=stack.alias):
        add.delay(1, 2, tag=tag)
    wait_until(
        lambda: TaskRun.objects.using(stack.alias).filter(tag=tag).exists(),
        60,
        "the worker to start",
    )
    return stack


def send(task: Any, *args: object, key: str) -> None:
    """``task.apply_async(args, flow_key=key)``."""
    task.apply_async(args, flow_key=key)


def marks(alias: str, kind: str, prefix: str) -> dict[str, list[datetime]]:
    """The times each task tagged ``prefix...`` recorded its ``start`` or ``end``,
    by tag."""
    found: dict[str, list[datetime]] = {}
    rows = TaskRun.objects.using(alias).filter(tag__startswith=f"{kind}:{prefix}")
    for tag, at in rows.values_list("tag", "ran_at"):
        found.setdefault(tag.split(":", 1)[1], []).append(at)
    return found


def intervals(alias: str, prefix: str) -> dict[str, tuple[datetime, datetime]]:
    """Each finished run of ``prefix``: (start, end), by tag; each ran once."""
    starts, ends = marks(alias, "start", prefix), marks(alias, "end", prefix)
    assert all(len(times) == 1 for times in (*starts.values(), *ends.values()))
    return {tag: (starts[tag][0], ends[tag][0]) for tag in ends}


def most_at_once(spans: Iterable[tuple[datetime, datetime]]) -> int:
    """The most intervals that overlap at one instant (an end before a start at a
    tie: a run that ended as another began did not overlap it)."""
    events = sorted(step for start, end in spans for step in ((start, 1), (end, -1)))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def killed(proc: Proc) -> None:
    """``kill -9`` the process and its children (its session's group)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.popen.wait(10)
    proc.long_running = False  # killed on purpose


# -- running: the cap per key ------------------------------------------------------

KEYS = 3
PER_KEY = 8
RUNNING = 2
#: Seconds each task of the cap's test holds its slot.
HOLD = 0.5
#: The cap's flow on a threads worker of 8 and a relay: the stack the tests of one
#: relay under the cap share (each on keys of its own; the lease is 300 s).
CAPPED = flow(running=RUNNING)
ON_CAPPED = on_stack(
    StackSpec(
        concurrency=8, env=(("OUTBOX_TEST_FLOWS", json.dumps(CAPPED)),), label="capped"
    )
)


def capped_keys(stack: Stack) -> None:
    """3 keys x 8 tasks sent key after key: at most :data:`RUNNING` of a key at
    once, more than that overall, each task once, every slot freed by a report."""
    alias, prefix = stack.alias, uuid.uuid4().hex[:8]
    begun = time.monotonic()
    # Key after key: a FIFO relay would publish the first key's 8 at once.
    with transaction.atomic(using=alias):
        for key in range(KEYS):
            for n in range(PER_KEY):
                send(hold, f"{prefix}:{key}:{n}", HOLD, key=f"tenant-{prefix}-{key}")
    wait_until(
        lambda: len(marks(alias, "end", prefix)) >= KEYS * PER_KEY,
        60,
        f"{KEYS * PER_KEY} runs",
        lambda: f"{len(marks(alias, 'end', prefix))} ended",
    )
    took = time.monotonic() - begun
    runs = intervals(alias, prefix)
    assert len(runs) == KEYS * PER_KEY  # every task ran, each once
    by_key = {
        key: most_at_once(
            span for tag, span in runs.items() if tag.split(":")[1] == str(key)
        )
        for key in range(KEYS)
    }
    overall = most_at_once(runs.values())
    print(f"most at once per key {by_key}, overall {overall}, {took:.1f} s")
    assert max(by_key.values()) <= RUNNING, by_key
    # The relays published past a capped key: the keys ran side by side.
    assert overall > RUNNING, overall
    # Every slot was freed by its task's report (the lease is 300 s).
    wait_until(
        lambda: not FlowSlot.objects.using(alias).filter(flow=FLOW).exists(),
        10,
        "every slot to be freed",
    )
    assert not OutboxMessage.objects.using(alias).exists()
    stack.assert_alive()


@pytest.mark.parametrize(
    "vendor",
    [
        pytest.param("postgresql", marks=on("postgresql")),
        pytest.param("mysql", id="mariadb", marks=on("mysql")),
    ],
)
def test_no_more_than_the_cap_of_a_key_runs_at_once_and_the_keys_run_side_by_side(
    e2e: E2EFactory, settings: Any, vendor: str
) -> None:
    stack = e2e(vendor, BROKER_AMQP)
    capped_keys(started(stack, settings, flow(running=RUNNING), 8, relays=2))


@on("postgresql")
@ON_CAPPED
def test_tasks_sent_before_their_flow_was_configured_free_their_slots_too(
    stack: Stack, settings: Any
) -> None:
    # Their headers carry the key and no flow: the relay's flow takes their slots,
    # and its name must reach the worker's reports, or each slot waits 300 s.
    capped_keys(ready(stack, settings, CAPPED, sender=False))


@on("postgresql")
@ON_CAPPED
def test_a_keys_retried_tasks_hold_its_cap_too(stack: Stack, settings: Any) -> None:
    # self.retry(countdown=0) writes the retry's row before the run's end is
    # reported: the run's slot counts until then, and its end frees its own slot.
    ready(stack, settings, CAPPED)
    alias, prefix = stack.alias, uuid.uuid4().hex[:8]
    with transaction.atomic(using=alias):
        for n in range(PER_KEY):
            send(hold, f"{prefix}:{n}", HOLD / 2, 2, key=f"tenant-{prefix}")
    wait_until(
        lambda: len(marks(alias, "end", prefix)) >= 3 * PER_KEY,
        60,
        f"{3 * PER_KEY} runs",
        lambda: f"{len(marks(alias, 'end', prefix))} ended",
    )
    runs = intervals(alias, prefix)
    assert len(runs) == 3 * PER_KEY  # 2 retries each, every run once
    most = most_at_once(runs.values())
    print(f"retried: most at once {most} of one key")
    assert most <= RUNNING, most
    wait_until(
        lambda: not FlowSlot.objects.using(alias).filter(flow=FLOW).exists(),
        10,
        "every slot to be freed",
    )
    stack.assert_alive()


#: Seconds partner's long task runs in the test of a key shared by two flows.
LONG = 6.0


@on("postgresql")
def test_a_key_shared_by_two_flows_is_not_held_up_by_the_other_flows_tasks(
    e2e: E2EFactory, settings: Any
) -> None:
    flows = {
        "partner": {"tasks": ["shop.hold"], "running": 1},
        "mailer": {"tasks": ["shop.record_late"], "running": 1},
    }
    stack = started(e2e("postgresql", BROKER_AMQP), settings, flows, 4)
    alias, prefix = stack.alias, uuid.uuid4().hex[:8]
    key, long = f"tenant-{prefix}", f"{prefix}:long"
    mails = [f"{prefix}:mail:{n}" for n in range(3)]
    with transaction.atomic(using=alias):
        # partner: a long task, and one that waits for its slot (older than the mails).
        send(hold, long, LONG, key=key)
        send(hold, f"{prefix}:next", key=key)
        for tag in mails:
            send(record_late, tag, 0.2, key=key)
    done = TaskRun.objects.using(alias).filter(tag__in=mails)
    wait_until(lambda: done.count() >= len(mails), 30, "the mailer's tasks to run")
    finished = max(done.values_list("ran_at", flat=True))
    took = (finished - marks(alias, "start", long)[long][0]).total_seconds()
    print(
        f"the mailer's 3 tasks ran within {took:.1f} s of partner's long task's start"
    )
    # One after the other, 0.2 s each: not behind partner's long task.
    assert took < LONG - 2, took
    assert not marks(alias, "start", f"{prefix}:next")  # partner's key still capped
    stack.assert_alive()


# -- queued: the quiet key behind a backlog ----------------------------------------

NOISY = 1500
QUIET = 20
QUEUED = 4


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile: the smallest value at or above ``share`` of them."""
    ranked = sorted(values)
    return ranked[max(0, math.ceil(share * len(ranked)) - 1)]


# Alone on the machine (the serial part of the newest session), as the rate's own
# e2e test: a worker starved of the CPU by the parallel sessions would measure the
# machine, not the flow.
@pytest.mark.serial
@on("postgresql")
def test_a_quiet_key_starts_within_seconds_behind_another_keys_backlog(
    e2e: E2EFactory, settings: Any
) -> None:
    stack = started(e2e("postgresql", BROKER_AMQP), settings, flow(queued=QUEUED), 4)
    alias, prefix = stack.alias, uuid.uuid4().hex[:8]
    noisy, quiet = f"{prefix}:noisy:", f"{prefix}:quiet:"
    with transaction.atomic(using=alias):
        for n in range(NOISY):
            send(hold, f"{noisy}{n}", key="noisy")
    time.sleep(2.0)
    with transaction.atomic(using=alias):
        for n in range(QUIET):
            send(hold, f"{quiet}{n}", key="quiet")
        committed = timezone.now()  # as it commits: no latency left out
    noisy_before = len(marks(alias, "start", noisy))
    wait_until(
        lambda: len(marks(alias, "start", quiet)) >= QUIET,
        30,
        f"{QUIET} quiet tasks to start",
    )
    starts = marks(alias, "start", quiet)
    assert all(len(times) == 1 for times in starts.values())  # each once
    latencies = [(times[0] - committed).total_seconds() for times in starts.values()]
    last = max(times[0] for times in starts.values())
    noisy_starts = [times[0] for times in marks(alias, "start", noisy).values()]
    noisy_by_last = sum(1 for at in noisy_starts if at <= last)
    p95 = percentile(latencies, 0.95)
    print(
        f"quiet key: start - commit p50 {percentile(latencies, 0.5):.2f} s, p95 "
        f"{p95:.2f} s, max {max(latencies):.2f} s; noisy started: {noisy_before} at "
        f"the quiet commit, {noisy_by_last} by the last quiet start, of {NOISY}"
    )
    assert p95 < 3.0, sorted(latencies)
    # The backlog was there and still is: the quiet key did not wait behind it ...
    assert noisy_by_last < NOISY // 2, noisy_by_last
    # ... and the noisy key went on beside the quiet one.
    assert any(committed < at < last for at in noisy_starts)
    stack.assert_alive()


# -- lease: a worker killed mid-task -----------------------------------------------

LEASE = 5.0


@on("postgresql")
def test_a_killed_workers_slot_frees_after_the_lease_and_the_keys_next_task_runs(
    e2e: E2EFactory, settings: Any
) -> None:
    stack = started(
        e2e("postgresql", BROKER_AMQP), settings, flow(running=1, lease=LEASE), 2
    )
    alias, prefix = stack.alias, uuid.uuid4().hex[:8]
    first, second, key = f"{prefix}:first", f"{prefix}:second", f"tenant-{prefix}"
    sent = timezone.now()
    with transaction.atomic(using=alias):
        send(hold, first, 60.0, key=key)
        send(hold, second, key=key)
    # The worker reported the first's start: its slot's lease counts from then.
    slot = FlowSlot.objects.using(alias).filter(flow=FLOW, flow_key=key, started=True)
    wait_until(slot.exists, 30, "the first task to start")
    frees_at = slot.get().expires_at
    (worker,) = [proc for proc in stack.procs if proc.name == "worker"]
    killed(worker)  # the threads pool's one process, and its task: no report
    killed_at = timezone.now()
    assert not marks(alias, "start", second)
    stack.start_worker(concurrency=2)
    # A task of no flow, to know when the new worker takes tasks: on a loaded
    # machine its start alone can take longer than the lease.
    warm = f"{prefix}:warm"
    with transaction.atomic(using=alias):
        add.delay(1, 2, tag=warm)
    wait_until(
        lambda: TaskRun.objects.using(alias).filter(tag=warm).exists(),
        60,
        "the new worker to take a task",
    )
    ready_at = timezone.now()
    wait_until(
        lambda: bool(marks(alias, "start", second)),
        30,
        "the second task to start",
        lambda: f"slots {list(FlowSlot.objects.using(alias).values())}",
    )
    started_first = marks(alias, "start", first)[first][0]
    started_second = marks(alias, "start", second)[second][0]
    # From when both the slot was free and a worker took tasks.
    late = (started_second - max(frees_at, ready_at)).total_seconds()
    print(
        f"first started {(started_first - sent).total_seconds():.2f} s after the "
        f"send, killed {(killed_at - started_first).total_seconds():.2f} s after its "
        f"start; second started {(started_second - started_first).total_seconds():.2f}"
        f" s after the first's start, {(started_second - killed_at).total_seconds():.2f}"
        f" s after the kill, {late:.2f} s after the slot's lease ended"
    )
    assert (frees_at - started_first).total_seconds() >= LEASE - 0.5  # from the start
    # Not before the lease ended, and soon after it (not a second lease later).
    assert started_second >= frees_at
    assert late <= 4.0, late
    assert marks(alias, "start", first) == {first: [started_first]}  # not run again
    assert not marks(alias, "end", first)
    assert marks(alias, "start", second) == {second: [started_second]}
    stack.assert_alive()


# -- endings in the broker: an expiry, a requeue -----------------------------------

#: The lease of the endings' tests: long enough that a slot freed by it shows.
ENDINGS_LEASE = 30.0
#: Seconds after its call the expiring task expires.
EXPIRES = 3.0


@on("postgresql")
def test_a_task_that_expires_in_the_queue_frees_its_slot_before_the_lease(
    e2e: E2EFactory, settings: Any
) -> None:
    # With its broker TTL, RabbitMQ dropped the task unseen, and the key's next
    # task waited the whole lease. Without it, a worker discards the task (its
    # expires header) and reports it.
    flows = flow(running=1, lease=ENDINGS_LEASE)
    settings.CELERY_OUTBOX_FLOWS = flows
    stack = e2e("postgresql", BROKER_AMQP)
    stack.env.update(OUTBOX_TEST_FLOWS=json.dumps(flows))
    stack.start_relay()  # no worker yet: the task expires in the queue
    alias, prefix = stack.alias, uuid.uuid4().hex[:8]
    expired, following, key = f"{prefix}:expired", f"{prefix}:next", f"t-{prefix}"
    with transaction.atomic(using=alias):
        hold.apply_async((expired,), flow_key=key, expires=EXPIRES)
        send(hold, following, key=key)
    called = time.monotonic()
    slot = FlowSlot.objects.using(alias).filter(flow=FLOW, flow_key=key)
    wait_until(slot.exists, 15, "the expiring task to be published")
    frees_at = slot.get().expires_at  # by the lease
    time.sleep(max(0.0, called + EXPIRES + 1.0 - time.monotonic()))
    stack.start_worker(concurrency=2)
    wait_until(
        lambda: bool(marks(alias, "start", following)),
        ENDINGS_LEASE + 15,
        "the key's next task to start",
    )
    started_next = marks(alias, "start", following)[following][0]
    early = (frees_at - started_next).total_seconds()
    print(f"the key's next task started {early:.1f} s before the lease would free it")
    assert early > 5.0, early
    assert not marks(alias, "start", expired)  # it expired: never ran
    stack.assert_alive()


@on("postgresql")
def test_a_task_that_requeues_its_message_holds_its_slot_until_its_next_run_ends(
    e2e: E2EFactory, settings: Any
) -> None:
    # Its slot freed at the Reject, the key's next task was published and ran
    # beside the task's second run: two under running 1.
    flows = {FLOW: {"tasks": ["shop.hold", "shop.requeue_once"], "running": 1}}
    stack = started(e2e("postgresql", BROKER_AMQP), settings, flows, 2)
    alias, prefix = stack.alias, uuid.uuid4().hex[:8]
    key = f"t-{prefix}"
    with transaction.atomic(using=alias):
        requeue_once.apply_async((f"{prefix}:requeued", 2.0), flow_key=key)
        # Tasks of no flow that keep both threads busy until 3 s: the requeued
        # message, and the key's next task were it published, start together then.
        record_late.delay(f"busy:{prefix}:0", 3.0)
        record_late.delay(f"busy:{prefix}:1", 1.0)
        send(hold, f"{prefix}:next", 1.0, key=key)
    wait_until(
        lambda: len(marks(alias, "end", prefix)) >= 3,
        30,
        "both runs and the next task",
        lambda: f"{marks(alias, 'end', prefix)}",
    )
    runs = intervals(alias, prefix)
    assert sorted(runs) == [
        f"{prefix}:next",
        f"{prefix}:requeued/0",
        f"{prefix}:requeued/1",
    ]
    most = most_at_once(runs.values())
    print(f"a requeued task and its key's next: most at once {most}")
    assert most == 1, runs
    wait_until(
        lambda: not FlowSlot.objects.using(alias).filter(flow=FLOW).exists(),
        10,
        "every slot to be freed",
    )
    stack.assert_alive()


# -- rate: a relay killed mid-batch ------------------------------------------------

RATE = 20
BATCH = 10
TASKS = 300


def most_in_any_second(times: list[datetime]) -> int:
    return max(
        sum(1 for t in times if 0 <= (t - start).total_seconds() < 1.0)
        for start in times
    )


# Alone on the machine (the serial part of the newest session), as the rate's own
# e2e test: a worker starved of the CPU by the parallel sessions would measure the
# machine, not the flow.
@pytest.mark.serial
@on("postgresql")
def test_a_relay_killed_mid_batch_lets_the_rate_through_no_more_than_one_batch_over(
    e2e: E2EFactory, settings: Any
) -> None:
    relay = ("--batch-size", str(BATCH))
    stack = started(
        e2e("postgresql", BROKER_AMQP),
        settings,
        flow("shop.record", rate=f"{RATE}/s"),
        8,
        *relay,
    )
    alias, prefix = stack.alias, uuid.uuid4().hex[:8]
    with transaction.atomic(using=alias):
        for n in range(TASKS):
            record.delay(f"{prefix}:{n}")
    runs = TaskRun.objects.using(alias).filter(tag__startswith=f"{prefix}:")
    outbox = OutboxMessage.objects.using(alias)
    wait_until(lambda: runs.count() >= 2 * RATE, 30, "the drain to be under way")
    in_flight = 0
    for _ in range(5):  # until a kill lands while the relay holds a batch
        (doomed,) = [p for p in stack.procs if p.name.startswith("relay") and p.alive()]
        wait_until(
            lambda: outbox.filter(holder__isnull=False).exists(),
            10,
            "the relay to claim a batch",
            interval=0.005,
        )
        killed(doomed)
        in_flight = outbox.filter(lease_token__isnull=False).count()
        stack.start_relay(*relay)
        if in_flight:
            break
    assert in_flight, "every kill came after the relay's batch"
    wait_until(
        lambda: runs.values("tag").distinct().count() >= TASKS,
        90,
        f"{TASKS} tasks to run",
    )
    times = sorted(runs.values_list("ran_at", flat=True))
    tags = Counter(runs.values_list("tag", flat=True))
    most = most_in_any_second(times)
    print(
        f"relay killed holding {in_flight} rows: most starts in any second {most} "
        f"(rate {RATE}, batch {BATCH}), {sum(tags.values()) - len(tags)} ran twice, "
        f"span {(times[-1] - times[0]).total_seconds():.1f} s"
    )
    assert most <= RATE + BATCH
    stack.assert_alive()
