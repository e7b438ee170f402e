"""End to end: the test commits (or rolls back) business transactions that enqueue tasks,
a real ``manage.py outbox relay`` publishes them and a real Celery worker runs them.

Every task records its execution as a TaskRun row in the same test database, so the
assertions count executions: committed work runs exactly once, rolled-back work never.

The tests on PostgreSQL and RabbitMQ with a plain relay and worker share one stack
(:data:`PLAIN`); each counts the executions of its own tags. A test that needs
another relay, no relay, or a relay stopped on purpose has a stack of its own.
"""

from __future__ import annotations

import ast
import contextlib
import random
import re
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from celery import chain, chord, group
from django.db import transaction

from celery_outbox.models import DeadLetter, OutboxMessage
from tests.e2e.conftest import (
    BROKER_AMQP,
    BROKER_REDIS,
    Stack,
    StackSpec,
    alias_for,
    on_stack,
    wait_until,
)
from tests.project.shop.models import Order, TaskRun
from tests.project.shop.tasks import add, collect, flaky, record, spawn_child

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(240),
]

#: Bound on waiting for tasks to be published and executed.
RUN_TIMEOUT = 60.0
#: After the expected executions appeared: time for a stray (rolled-back or
#: duplicate) execution to show up before the exact counts are asserted.
GRACE = 1.5

E2EFactory = Callable[..., Stack]


class Rollback(Exception):
    """Raised to roll back a test transaction."""


def db(*vendors: str) -> pytest.MarkDecorator:
    """Real commits (subprocesses must see the rows) on the test databases of ``vendors``."""
    return pytest.mark.django_db(
        transaction=True, databases=[alias_for(v) for v in vendors]
    )


def new_prefix(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def runs(alias: str, prefix: str) -> Counter[str]:
    """How many times each tag starting with ``prefix`` was executed."""
    tags = TaskRun.objects.using(alias).filter(tag__startswith=prefix)
    return Counter(tags.values_list("tag", flat=True))


def outbox_rows(alias: str) -> int:
    return OutboxMessage.objects.using(alias).count()


def wait_for_runs(
    alias: str, prefix: str, expected: set[str], timeout: float = RUN_TIMEOUT
) -> None:
    """Wait until every expected tag has run at least once."""
    wait_until(
        lambda: expected <= set(runs(alias, prefix)),
        timeout,
        f"{len(expected)} tasks to run",
        lambda: (
            f"{len(expected - set(runs(alias, prefix)))} never ran, e.g. "
            f"{sorted(expected - set(runs(alias, prefix)))[:5]}; outbox has "
            f"{outbox_rows(alias)} rows"
        ),
    )


def wait_for_empty_outbox(alias: str, timeout: float = 30.0) -> None:
    # A task can run before the relay settled (deleted) its row: wait, don't assert.
    wait_until(
        lambda: outbox_rows(alias) == 0,
        timeout,
        "the outbox table to be empty",
        lambda: f"{outbox_rows(alias)} rows left",
    )


def assert_exactly_once(counts: Counter[str], expected: set[str]) -> None:
    duplicates = {tag: n for tag, n in counts.items() if n > 1}
    extra = sum(n - 1 for n in duplicates.values())
    assert extra == 0, (
        f"{extra} duplicate executions, e.g. {sorted(duplicates.items())[:5]}"
    )
    unexpected = set(counts) - expected
    assert not unexpected, (
        f"{len(unexpected)} unexpected executions: {sorted(unexpected)[:5]}"
    )
    missing = expected - set(counts)
    assert not missing, f"{len(missing)} missing executions: {sorted(missing)[:5]}"


def enqueue_work(tag: str, kind: int) -> set[str]:
    """Enqueue one unit of work (plain, countdown, chain or group); returns its tags."""
    if kind % 4 == 0:
        record.delay(tag)
        return {tag}
    if kind % 4 == 1:
        record.apply_async((tag,), countdown=1)
        return {tag}
    if kind % 4 == 2:
        chain(record.si(f"{tag}-first"), record.si(f"{tag}-second")).delay()
        return {f"{tag}-first", f"{tag}-second"}
    tags = {f"{tag}-g{n}" for n in range(3)}
    group(record.si(t) for t in sorted(tags)).delay()
    return tags


def delivery(vendor: str, broker: str = BROKER_AMQP) -> StackSpec:
    """A worker and a relay on ``vendor`` and ``broker``."""
    # SQLite has one writer at a time: one task at a time keeps lock waits short.
    if vendor == "sqlite":
        return StackSpec(vendor, broker, pool="solo", concurrency=1)
    return StackSpec(vendor, broker)


#: PostgreSQL and RabbitMQ, a threads worker and a relay: the tests' shared stack.
PLAIN = delivery("postgresql")


# -- 1 and 2: the guarantee, on every database and on both brokers -----------------


@pytest.mark.parametrize(
    ("shared_stack", "committed", "rolled_back"),
    [
        pytest.param(PLAIN, 60, 20, id="postgresql-rabbitmq", marks=db("postgresql")),
        pytest.param(
            delivery("mysql"), 20, 8, id="mariadb-rabbitmq", marks=db("mysql")
        ),
        pytest.param(
            delivery("sqlite"), 20, 8, id="sqlite-rabbitmq", marks=db("sqlite")
        ),
        pytest.param(
            delivery("postgresql", BROKER_REDIS),
            20,
            8,
            id="postgresql-redis",
            marks=db("postgresql"),
        ),
        pytest.param(
            delivery("postgresql_commit"),
            30,
            10,
            id="postgresql-write-on-commit-rabbitmq",
            marks=db("postgresql_commit"),
        ),
    ],
    indirect=["shared_stack"],
    scope="module",  # the shared stack's: pytest groups the tests of each stack
)
def test_committed_tasks_run_exactly_once_and_rolled_back_never(
    stack: Stack, committed: int, rolled_back: int
) -> None:
    alias = stack.alias
    prefix = new_prefix("deliver")
    plan = [True] * committed + [False] * rolled_back
    random.Random(20240601).shuffle(plan)
    expected: set[str] = set()
    forbidden: set[str] = set()

    for index, commit in enumerate(plan):
        tag = f"{prefix}-{'commit' if commit else 'rollback'}{index}"
        if commit:
            with transaction.atomic(using=alias):
                Order.objects.using(alias).create(number=tag)
                expected |= enqueue_work(tag, index)
        else:
            with contextlib.suppress(Rollback), transaction.atomic(using=alias):
                Order.objects.using(alias).create(number=tag)
                forbidden |= enqueue_work(tag, index)
                raise Rollback

    assert Order.objects.using(alias).count() == committed
    wait_for_runs(alias, prefix, expected)
    wait_for_empty_outbox(alias)
    time.sleep(GRACE)

    counts = runs(alias, prefix)
    assert set(counts) & forbidden == set(), "tasks of rolled-back transactions ran"
    assert_exactly_once(counts, expected)
    assert outbox_rows(alias) == 0
    assert DeadLetter.objects.using(alias).count() == 0
    stack.assert_alive()


# -- 3: chords, with the Redis result backend -----------------------------------------


@db("postgresql")
@on_stack(PLAIN)
def test_chord_runs_its_body_once_with_the_header_results(stack: Stack) -> None:
    alias = stack.alias
    prefix = new_prefix("chord")

    def make_chord(name: str) -> tuple[Any, set[str], str]:
        headers = [f"{prefix}-{name}-h{n}" for n in range(3)]
        body = f"{prefix}-{name}-body"
        sig = chord(
            [add.s(n, n, tag=tag) for n, tag in enumerate(headers)],
            collect.s(tag=body),
        )
        return sig, {*headers, body}, body

    committed, committed_tags, body = make_chord("commit")
    rolled_back, forbidden, _ = make_chord("rollback")
    with transaction.atomic(using=alias):
        committed.delay()
    with contextlib.suppress(Rollback), transaction.atomic(using=alias):
        rolled_back.delay()
        raise Rollback

    wait_for_runs(alias, prefix, committed_tags)
    wait_for_empty_outbox(alias)
    time.sleep(GRACE)

    counts = runs(alias, prefix)
    assert set(counts) & forbidden == set(), "a rolled-back chord ran"
    assert_exactly_once(counts, committed_tags)
    body_run = TaskRun.objects.using(alias).get(tag=body)
    assert body_run.task_name == "shop.collect"
    assert ast.literal_eval(body_run.value) == [0, 2, 4]
    stack.assert_alive()


# -- 4: Task.retry() and tasks sent from inside the worker --------------------------


@db("postgresql")
def test_retries_and_worker_children_bypass_the_outbox_unless_in_a_transaction(
    e2e: E2EFactory,
) -> None:
    stack = e2e("postgresql", BROKER_AMQP)
    alias = stack.alias
    prefix = new_prefix("worker")
    with transaction.atomic(using=alias):
        flaky_id = flaky.delay(f"{prefix}-flaky").id
        direct_id = spawn_child.delay(f"{prefix}-direct").id
        atomic_id = spawn_child.delay(f"{prefix}-atomic", atomic=True).id
    assert outbox_rows(alias) == 3

    # Publish those three, then run the worker with NO relay: whatever the worker
    # sends through the outbox stays in the table, whatever it sends direct runs.
    code, log = stack.run_relay("--until-empty")
    assert code == 0, log
    assert outbox_rows(alias) == 0
    stack.start_worker()

    attempts = {f"{prefix}-flaky-attempt-{n}" for n in range(3)}
    wait_for_runs(
        alias,
        prefix,
        {
            *attempts,
            f"{prefix}-flaky",
            f"{prefix}-direct",
            f"{prefix}-direct-child",
            f"{prefix}-atomic",
        },
    )
    # Task.retry() re-sent the task direct, twice; the worker's spawn outside a
    # transaction went direct; the one inside atomic() is the only outbox row.
    assert list(
        OutboxMessage.objects.using(alias).values_list("task_name", flat=True)
    ) == ["shop.trace"]
    assert runs(alias, f"{prefix}-atomic-child") == Counter()

    code, log = stack.run_relay("--until-empty")
    assert code == 0, log
    wait_for_runs(alias, prefix, {f"{prefix}-atomic-child"})
    time.sleep(GRACE)

    counts = runs(alias, prefix)
    assert_exactly_once(
        counts,
        {
            *attempts,
            f"{prefix}-flaky",
            f"{prefix}-direct",
            f"{prefix}-direct-child",
            f"{prefix}-atomic",
            f"{prefix}-atomic-child",
        },
    )
    flaky_runs = TaskRun.objects.using(alias).filter(tag__startswith=f"{prefix}-flaky")
    assert set(flaky_runs.values_list("task_id", flat=True)) == {flaky_id}
    for parent, parent_id in (("direct", direct_id), ("atomic", atomic_id)):
        child = TaskRun.objects.using(alias).get(tag=f"{prefix}-{parent}-child")
        assert child.task_name == "shop.trace"
        assert ast.literal_eval(child.value) == {
            "parent_id": parent_id,
            "root_id": parent_id,
        }
    assert outbox_rows(alias) == 0
    assert DeadLetter.objects.using(alias).count() == 0
    stack.assert_alive()


# -- 5: two relays on one PostgreSQL table ------------------------------------------

BATCH_LINE = re.compile(r"batch: (\d+) claimed, (\d+) published")


@db("postgresql")
def test_two_relays_publish_every_row_exactly_once(e2e: E2EFactory) -> None:
    # 24 batches of 25 for two relays racing while the commits arrive: enough for
    # both to claim, and for a row claimed twice to show (2,000 rows proved no more,
    # at four times the worker's time, in every session of the matrix).
    total, per_transaction = 600, 50
    stack = e2e("postgresql", BROKER_AMQP)
    alias = stack.alias
    stack.start_worker(concurrency=8)
    relays = [
        stack.start_relay("--batch-size", "25", name=f"relay-{n}") for n in (1, 2)
    ]
    prefix = new_prefix("bulk")
    expected = {f"{prefix}-{n}" for n in range(total)}

    # The relays are already polling: they compete for rows while commits arrive.
    for start in range(0, total, per_transaction):
        with transaction.atomic(using=alias):
            for n in range(start, start + per_transaction):
                record.delay(f"{prefix}-{n}")

    wait_for_runs(alias, prefix, expected, timeout=120)
    wait_for_empty_outbox(alias)
    time.sleep(GRACE)
    assert_exactly_once(runs(alias, prefix), expected)
    stack.assert_alive()

    codes = {relay.name: relay.terminate() for relay in relays}
    assert codes == {"relay-1": 0, "relay-2": 0}
    published = {}
    for relay in relays:
        log = relay.output()
        assert "Traceback" not in log, log
        assert "was lost" not in log, log
        batches = [(int(c), int(p)) for c, p in BATCH_LINE.findall(log)]
        assert all(c == p for c, p in batches), (
            f"{relay.name} failed to publish some rows"
        )
        published[relay.name] = sum(p for _, p in batches)
    assert sum(published.values()) == total, published
    assert all(published.values()), f"one relay published nothing: {published}"
    assert DeadLetter.objects.using(alias).count() == 0


# -- 6: the relay process: --until-empty, SIGTERM, one relay per SQLite file -----------


@db("postgresql")
def test_until_empty_exits_zero_once_drained(e2e: E2EFactory) -> None:
    stack = e2e("postgresql", BROKER_AMQP)
    alias = stack.alias
    prefix = new_prefix("drain")
    expected = {f"{prefix}-{n}" for n in range(30)}
    with transaction.atomic(using=alias):
        for tag in sorted(expected):
            record.delay(tag)

    code, log = stack.run_relay("--until-empty", "--batch-size", "7")
    assert code == 0, log
    assert outbox_rows(alias) == 0
    code, log = stack.run_relay("--until-empty")
    assert code == 0, log

    stack.start_worker()
    wait_for_runs(alias, prefix, expected)
    time.sleep(GRACE)
    assert_exactly_once(runs(alias, prefix), expected)


@db("postgresql")
def test_sigterm_stops_a_waiting_relay_promptly_with_exit_zero(e2e: E2EFactory) -> None:
    stack = e2e("postgresql", BROKER_AMQP)
    # A long poll interval: the relay is asleep when the signal arrives.
    relay = stack.start_relay("--poll-interval", "60")
    started = time.monotonic()
    relay.popen.send_signal(signal.SIGTERM)
    code = relay.popen.wait(timeout=15)
    elapsed = time.monotonic() - started
    assert code == 0, relay.output()
    assert elapsed < 5.0, f"the relay took {elapsed:.1f} s to stop"
    assert "relay stopped: signal" in relay.output()


@db("sqlite")
def test_a_second_relay_on_the_same_sqlite_file_is_refused(e2e: E2EFactory) -> None:
    stack = e2e("sqlite", BROKER_AMQP)
    first = stack.start_relay()

    code, log = stack.run_relay(timeout=60)
    assert code != 0, log
    assert "SQLite" in log and "one relay" in log, log
    assert first.alive(), first.output()

    assert first.terminate() == 0, first.output()
