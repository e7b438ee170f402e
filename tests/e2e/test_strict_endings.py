"""Every way a real worker ends a strict head settles it: no head held until its lease.

A strict key of two tasks: a head that ends in one of the ways Celery can end a
request, and ``next``. A prefork worker and a relay on the test database, with a
strict lease of 10 s (so a head nobody settled would be published again,
and run again, within the test). Each test waits for what a user checks: the key's
next task ran (or the key is blocked, as ``outbox ordering stats`` shows), and the
head ran no more than it should.

The tests share a stack per database and worker size; each asserts on its own
key and tags. A test that kills a worker's process has a stack of its own.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import transaction

from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.store import Stores
from tests.e2e.conftest import BROKER_AMQP, Stack, StackSpec, on_stack, wait_until
from tests.project.celery_app import app
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import ending, record

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(databases="__all__", transaction=True),
]

#: Seconds a strict head stays running without a report (the test settings' lease):
#: a head nobody settled is published again well within a test's 30 s wait, and a
#: report a loaded machine delays by a few seconds still comes first (at 3 s, CI's
#: newest session ran three heads twice beside two other sessions).
LEASE = "10"


def spec(vendor: str = "postgresql", prefork: int = 2) -> StackSpec:
    """A prefork worker of ``prefork`` processes and a relay, on the strict lease."""
    return StackSpec(
        vendor,
        pool="prefork",
        concurrency=prefork,
        env=(("OUTBOX_TEST_STRICT_LEASE", LEASE),),
        label=f"lease{LEASE}",
    )


#: The stores' SQL differs between these (the settlements, PostgreSQL's wake-up).
BOTH = on_stack(spec("postgresql"), spec("mysql"))
#: A worker of one process: a busy task keeps the head waiting in the queue.
BOTH_ONE_PROCESS = on_stack(spec("postgresql", 1), spec("mysql", 1))
ON_POSTGRESQL = on_stack(spec())
ON_POSTGRESQL_ONE_PROCESS = on_stack(spec(prefork=1))


def started(stack: Stack, lease: str) -> Stack:
    """A stack of the test's own: a prefork worker of two processes and a relay."""
    stack.env["OUTBOX_TEST_STRICT_LEASE"] = lease
    stack.start_worker(pool="prefork", concurrency=2)
    stack.start_relay()
    return stack


def strict_key(
    stack: Stack, head: Callable[[str, str], Any], **options: Any
) -> tuple[str, str]:
    """Write ``head(tag, key)`` and ``next``, strict, in one key; (head's tag, key)."""
    prefix = uuid.uuid4().hex[:8]
    key, tag = f"{prefix}:K", f"{prefix}:head"
    with transaction.atomic(using=stack.alias):
        head(tag, key)
        record.apply_async(
            (f"{prefix}:next",), ordering_key=key, ordering="strict", **options
        )
    return tag, key


def runs(stack: Stack, tag: str) -> int:
    return TaskRun.objects.using(stack.alias).filter(tag=tag).count()


def next_ran(stack: Stack, key: str, timeout: float = 30) -> None:
    prefix = key.split(":")[0]
    wait_until(
        lambda: runs(stack, f"{prefix}:next") == 1,
        timeout,
        "the key's next task",
        lambda: f"outbox: {list(OutboxMessage.objects.using(stack.alias).values())}",
    )


def outbox_empty(stack: Stack) -> None:
    rows = OutboxMessage.objects.using(stack.alias)
    wait_until(lambda: not rows.exists(), 10, "an empty outbox")


def blocked_by(stack: Stack, key: str, timeout: float = 30) -> str:
    """Wait until ``outbox ordering stats`` shows ``key`` blocked; its head's error."""
    store = Stores(stack.alias).ordering()

    def heads() -> list[Any]:
        return [b for b in store.ordering_stats().blocked if b.key == key]

    wait_until(lambda: bool(heads()), timeout, f"key {key} blocked")
    (head,) = heads()
    return str(head.last_error)


def started_pid(stack: Stack, tag: str) -> int:
    wait_until(lambda: runs(stack, f"started:{tag}") > 0, 30, f"{tag} to start")
    row = TaskRun.objects.using(stack.alias).get(tag=f"started:{tag}")
    return int(row.value)


@BOTH
def test_a_rejected_head_blocks_its_key_and_runs_once(stack: Stack) -> None:
    tag, key = strict_key(
        stack,
        lambda tag, key: ending.apply_async(
            (tag, "reject"), ordering_key=key, ordering="strict"
        ),
    )
    assert "reject requeue=False" in blocked_by(stack, key)
    assert runs(stack, f"started:{tag}") == 1
    assert runs(stack, f"{key.split(':')[0]}:next") == 0
    stack.assert_alive()


@ON_POSTGRESQL
def test_a_rejected_head_of_a_skip_key_is_dead_lettered_and_the_key_goes_on(
    stack: Stack,
) -> None:
    tag, key = strict_key(
        stack,
        lambda tag, key: ending.apply_async(
            (tag, "reject"),
            ordering_key=key,
            ordering="strict",
            ordering_policy="skip",
        ),
    )
    next_ran(stack, key)
    dead = DeadLetter.objects.using(stack.alias).get(ordering_key=key)
    assert "reject requeue=False" in dead.last_error
    assert runs(stack, f"started:{tag}") == 1
    outbox_empty(stack)


@ON_POSTGRESQL
def test_a_head_killed_by_its_hard_time_limit_blocks_its_key(stack: Stack) -> None:
    tag, key = strict_key(
        stack,
        lambda tag, key: ending.apply_async(
            (tag, "sleep", 30.0), ordering_key=key, ordering="strict", time_limit=1
        ),
    )
    assert "TimeLimitExceeded" in blocked_by(stack, key)
    assert runs(stack, f"started:{tag}") == 1
    assert runs(stack, tag) == 0
    stack.assert_alive()


@BOTH_ONE_PROCESS
def test_a_head_revoked_in_the_queue_never_runs_and_its_key_goes_on(
    stack: Stack,
) -> None:
    busy = f"busy-{uuid.uuid4().hex[:8]}"
    with transaction.atomic(using=stack.alias):
        # Keeps the only worker process busy while the head waits in the queue.
        ending.apply_async((busy, "sleep", 3.0))
    started_pid(stack, busy)
    tag, key = strict_key(
        stack,
        lambda tag, key: ending.apply_async(
            (tag,), ordering_key=key, ordering="strict", task_id=tag
        ),
    )
    wait_until(
        lambda: (
            OutboxMessage.objects.using(stack.alias)
            .filter(task_id=tag, state="running")
            .exists()
        ),
        10,
        "the head published",
    )
    app.control.revoke(tag)
    next_ran(stack, key)
    assert runs(stack, f"started:{tag}") == 0
    outbox_empty(stack)


@ON_POSTGRESQL_ONE_PROCESS
def test_a_head_expired_in_the_queue_never_runs_and_its_key_goes_on(
    stack: Stack,
) -> None:
    busy = f"busy-{uuid.uuid4().hex[:8]}"
    with transaction.atomic(using=stack.alias):
        ending.apply_async((busy, "sleep", 3.0))
    started_pid(stack, busy)
    tag, key = strict_key(
        stack,
        lambda tag, key: ending.apply_async(
            (tag,), ordering_key=key, ordering="strict", expires=1
        ),
    )
    next_ran(stack, key)
    assert runs(stack, f"started:{tag}") == 0
    outbox_empty(stack)


@ON_POSTGRESQL
def test_a_head_terminated_by_a_revoke_is_not_run_again_and_its_key_goes_on(
    stack: Stack,
) -> None:
    tag, key = strict_key(
        stack,
        lambda tag, key: ending.apply_async(
            (tag, "sleep", 30.0), ordering_key=key, ordering="strict", task_id=tag
        ),
    )
    started_pid(stack, tag)
    app.control.revoke(tag, terminate=True)
    next_ran(stack, key)
    assert runs(stack, f"started:{tag}") == 1
    assert runs(stack, tag) == 0
    outbox_empty(stack)


@pytest.mark.parametrize("vendor", ["postgresql", "mysql"])
def test_a_head_whose_worker_process_died_runs_again_at_once(
    e2e: Any, vendor: str
) -> None:
    # A lease far longer than the wait: only the main process's report republishes.
    # A stack of its own: the test kills one of its worker's processes.
    stack = started(e2e(vendor, BROKER_AMQP), lease="120")
    tag, key = strict_key(
        stack,
        lambda tag, key: ending.apply_async(
            (tag, "sleep", 60.0), ordering_key=key, ordering="strict"
        ),
    )
    os.kill(started_pid(stack, tag), signal.SIGKILL)
    begun = time.monotonic()
    next_ran(stack, key, timeout=30)
    print(f"lost head run again, next ran {time.monotonic() - begun:.1f} s after kill")
    assert runs(stack, f"started:{tag}") == 2
    assert runs(stack, tag) == 1
    outbox_empty(stack)


@ON_POSTGRESQL
def test_a_replaced_head_holds_its_key_until_its_replacement_ran(stack: Stack) -> None:
    tag, key = strict_key(
        stack,
        lambda tag, key: ending.apply_async(
            (tag, "replace", 2.0), ordering_key=key, ordering="strict"
        ),
    )
    next_ran(stack, key)
    done = TaskRun.objects.using(stack.alias)
    order = list(
        done.filter(tag__in=[f"{tag}:replacement", f"{key.split(':')[0]}:next"])
        .order_by("id")
        .values_list("tag", flat=True)
    )
    assert order == [f"{tag}:replacement", f"{key.split(':')[0]}:next"]
    assert runs(stack, f"started:{tag}") == 1
    outbox_empty(stack)


@ON_POSTGRESQL
def test_a_retried_head_holds_its_key_until_its_retry_ran(stack: Stack) -> None:
    tag, key = strict_key(
        stack,
        lambda tag, key: ending.apply_async(
            (tag, "retry", 2.0), ordering_key=key, ordering="strict"
        ),
    )
    next_ran(stack, key)
    done = TaskRun.objects.using(stack.alias)
    order = list(
        done.filter(tag__in=[tag, f"{key.split(':')[0]}:next"])
        .order_by("id")
        .values_list("tag", flat=True)
    )
    assert order == [tag, f"{key.split(':')[0]}:next"]
    assert runs(stack, f"started:{tag}") == 2
    outbox_empty(stack)
