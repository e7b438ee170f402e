"""A handler processor killed with ``kill -9`` mid-receiver, on real processes.

Another processor, already running, takes the dead one's shard within seconds (its
heartbeat finds the dead one silent), not after the lease; the atomic receiver's
committed effect happens once.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from django.db import transaction

from celery_outbox.handlers import emit
from celery_outbox.handlers.models import HandlerMessage
from tests.e2e.conftest import Stack, wait_until
from tests.project.shop.models import TaskRun
from tests.project.shop.receivers import STALLED

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

#: Far longer than the test may take: a takeover that waited for it would fail.
LEASE = "120"


def test_a_killed_processors_shard_is_taken_within_seconds_and_runs_once(
    e2e: Callable[..., Stack], tmp_path: Path
) -> None:
    stack = e2e("postgresql")
    alias = stack.alias
    tag = uuid.uuid4().hex
    started = tmp_path / "started"
    options = ("--database", alias, "--lease-seconds", LEASE, "--poll-interval", "0.2")
    first = stack.start_handlers(*options, name="first")
    with transaction.atomic(using=alias):
        emit(
            STALLED,
            shard=("org", 1),
            object_id=1,
            payload={"tag": tag, "started": str(started), "stall": 600},
            using=alias,
        )
    wait_until(started.exists, 45, "the first processor to start the receiver")
    assert started.read_text() == str(first.pid)
    second = stack.start_handlers(*options, name="second")
    os.killpg(first.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    runs = TaskRun.objects.using(alias).filter(tag=tag)

    wait_until(
        lambda: runs.exists(),
        45,
        "the second processor to run the receiver",
        second.output,
    )

    taken_after = time.monotonic() - killed_at
    assert taken_after < 20, f"the shard was taken after {taken_after:.1f} s"
    assert "took over" in second.output()
    time.sleep(1)  # a second run, were there one, would commit now
    assert runs.count() == 1  # the killed run's write was rolled back
    assert not HandlerMessage.objects.using(alias).filter(category=STALLED).exists()
