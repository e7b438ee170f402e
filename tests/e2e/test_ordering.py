"""Ordered keys end to end: real relays, real prefork workers, RabbitMQ, PostgreSQL.

Scale: ``OUTBOX_ORDERING_E2E_KEYS`` x ``OUTBOX_ORDERING_E2E_TASKS``. The default,
100 x 10, keeps ``make test`` within its time; the figures in docs/ordering.md were
measured at 200 x 20 (``OUTBOX_ORDERING_E2E_KEYS=200 OUTBOX_ORDERING_E2E_TASKS=20``).
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import time
from collections import defaultdict

import pytest
from django.db import transaction

from celery_outbox.models import DeadLetter, OutboxMessage
from celery_outbox.store import Stores
from tests.e2e.conftest import BROKER_AMQP, Stack, wait_until
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import ordered

KEYS = int(os.environ.get("OUTBOX_ORDERING_E2E_KEYS", "100"))
TASKS = int(os.environ.get("OUTBOX_ORDERING_E2E_TASKS", "10"))

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)


def enqueue(alias: str, prefix: str, *, strict: bool, hang: str = "") -> None:
    """KEYS x TASKS calls, interleaved across keys, 50 per transaction."""
    rng = random.Random(7)
    calls = [(k, n) for n in range(TASKS) for k in range(KEYS)]
    for start in range(0, len(calls), 50):
        with transaction.atomic(using=alias):
            for k, n in calls[start : start + 50]:
                tag = f"{prefix}:{k}:{n}"
                ordered.apply_async(
                    (tag, rng.random() * 0.05 if strict else 0.0),
                    {"mode": "hang" if tag == hang else ""},
                    ordering_key=f"{prefix}:{k}",
                    ordering="strict" if strict else None,
                )


def executions(alias: str, prefix: str) -> dict[int, list[int]]:
    """Per key, the task numbers in the order their runs were recorded."""
    found: dict[int, list[int]] = defaultdict(list)
    tags = TaskRun.objects.using(alias).filter(tag__startswith=f"{prefix}:")
    for tag in tags.order_by("id").values_list("tag", flat=True):
        _, key, number = tag.rsplit(":", 2)
        found[int(key)].append(int(number))
    return found


def violations(found: dict[int, list[int]]) -> int:
    """Runs of a key recorded after a run with a higher number."""
    return sum(
        1 for numbers in found.values() for a, b in itertools.pairwise(numbers) if b < a
    )


def drain(stack: Stack, prefix: str, timeout: float) -> dict[int, list[int]]:
    alias = stack.alias
    total = KEYS * TASKS
    wait_until(
        lambda: (
            TaskRun.objects.using(alias).filter(tag__startswith=f"{prefix}:").count()
            >= total
        ),
        timeout,
        f"{total} runs",
        lambda: (
            f"{TaskRun.objects.using(alias).filter(tag__startswith=f'{prefix}:').count()} ran"
        ),
        interval=0.5,
    )
    return executions(alias, prefix)


def test_strict_keys_run_in_order_on_two_prefork_workers_even_after_a_kill(
    e2e: object,
) -> None:
    stack: Stack = e2e("postgresql", BROKER_AMQP)  # type: ignore[operator]
    stack.env["OUTBOX_TEST_STRICT_LEASE"] = "8"
    alias = stack.alias
    prefix = f"strict{int(time.time())}"
    victim = f"{prefix}:3:{TASKS // 2}"
    stack.start_worker(pool="prefork", concurrency=2)
    stack.start_worker(pool="prefork", concurrency=2)
    stack.start_relay("--batch-size", "200")
    started = time.monotonic()
    enqueue(alias, prefix, strict=True, hang=victim)
    wait_until(
        lambda: TaskRun.objects.using(alias).filter(tag=f"started:{victim}").exists(),
        120,
        "the victim to start",
    )
    pid = int(TaskRun.objects.using(alias).get(tag=f"started:{victim}").value)
    os.kill(pid, signal.SIGKILL)
    found = drain(stack, prefix, timeout=300)
    seconds = time.monotonic() - started
    print(f"strict: {KEYS * TASKS} tasks in {seconds:.1f} s")
    assert violations(found) == 0
    assert {k: sorted(v) for k, v in found.items()} == {
        k: list(range(TASKS)) for k in range(KEYS)
    }  # each ran once: the killed run recorded nothing
    wait_until(
        lambda: not OutboxMessage.objects.using(alias).exists(), 30, "empty outbox"
    )
    stack.assert_alive()


def test_publish_order_per_key_holds_with_two_relays(e2e: object) -> None:
    stack: Stack = e2e("postgresql", BROKER_AMQP)  # type: ignore[operator]
    alias = stack.alias
    prefix = f"plain{int(time.time())}"
    # One consumer, one at a time: it runs messages in the order they were published.
    stack.start_worker(pool="solo", concurrency=1)
    enqueue(alias, prefix, strict=False)
    for n in (1, 2):
        stack.start_relay("--batch-size", "100", name=f"relay-{n}")
    found = drain(stack, prefix, timeout=240)
    assert violations(found) == 0
    assert {k: sorted(v) for k, v in found.items()} == {
        k: list(range(TASKS)) for k in range(KEYS)
    }
    stack.assert_alive()


def test_a_failing_strict_head_blocks_only_its_key_until_skipped(e2e: object) -> None:
    stack: Stack = e2e("postgresql", BROKER_AMQP)  # type: ignore[operator]
    alias = stack.alias
    prefix = f"block{int(time.time())}"
    stack.start_worker(pool="prefork", concurrency=2)
    stack.start_relay()
    with transaction.atomic(using=alias):
        for key in range(5):
            for n in range(4):
                mode = "fail" if (key, n) == (0, 1) else ""
                ordered.apply_async(
                    (f"{prefix}:{key}:{n}",),
                    {"mode": mode},
                    ordering_key=f"{prefix}:{key}",
                    ordering="strict",
                )
    runs = TaskRun.objects.using(alias).filter(tag__startswith=f"{prefix}:")
    wait_until(lambda: runs.count() >= 17, 60, "the other keys to drain")
    store = Stores(alias).ordering()
    wait_until(lambda: bool(store.blocked_heads()), 30, "the head to be blocked")
    (head,) = store.blocked_heads()
    assert head.key == f"{prefix}:0" and "ValueError" in head.last_error
    assert executions(alias, prefix)[0] == [0]  # 2 and 3 wait behind the failure
    assert store.skip_head(head.key) == 1
    wait_until(lambda: runs.count() >= 19, 60, "the rest of the key")
    assert executions(alias, prefix)[0] == [0, 2, 3]
    assert DeadLetter.objects.using(alias).filter(ordering_key=head.key).count() == 1
