"""End to end: a revoke before publish, as a worker that revoked the task would leave it.

With a real relay, a real worker and the Redis result backend:

* a chord whose header member was revoked before publish fails and runs its errback,
  as with Celery (member published, then revoked in the worker); a group with a
  member revoked before publish completes;
* Celery's own ``celery control revoke ID`` (a broadcast, no ``Control.revoke()``)
  takes a scheduled task out of the outbox: the worker that receives it deletes the
  row, so the task does not run after the worker restarts.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from celery import chord, group
from django.db import transaction

from celery_outbox.models import OutboxMessage
from tests.e2e.conftest import BROKER_AMQP, Proc, Stack, alias_for, wait_until
from tests.project.celery_app import app
from tests.project.shop.models import TaskRun
from tests.project.shop.tasks import collect, errback, record

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(240),
    pytest.mark.django_db(transaction=True, databases=[alias_for("postgresql")]),
]

E2EFactory = Callable[..., Stack]

#: ETAs further away than this are scheduled in the outbox; the countdown used.
SCHEDULE_AFTER = 3.0
COUNTDOWN = 7.0
#: After the moment a task would have run: time for it to show.
GRACE = 3.0


def runs(prefix: str) -> Counter[str]:
    tags = TaskRun.objects.filter(tag__startswith=prefix)
    return Counter(tags.values_list("tag", flat=True))


def state(task_id: str) -> str:
    return str(app.AsyncResult(task_id).state)


def node_name(worker: Proc) -> str:
    """The worker's node name, as ``--destination`` takes it."""
    pattern = worker.args[worker.args.index("--hostname") + 1]
    return pattern.replace("%h", socket.gethostname())


def wait_for_node(worker: Proc) -> None:
    name = node_name(worker)
    wait_until(
        lambda: bool(app.control.ping(destination=[name], timeout=1.0)),
        60,
        f"worker {name} to answer a ping",
        worker.output,
    )


def test_a_chord_with_a_member_revoked_before_publish_fails_and_runs_its_errback(
    e2e: E2EFactory,
) -> None:
    stack = e2e("postgresql", BROKER_AMQP)
    tag = f"chord-{uuid.uuid4().hex[:8]}"
    with transaction.atomic():
        body = chord(
            [record.s(f"{tag}-revoked"), record.s(f"{tag}-kept")],
            collect.s(tag).on_error(errback.s()),
        ).apply_async()
        members = group(record.s(f"{tag}-g{n}") for n in range(3)).apply_async()
    revoked = body.parent.results[0].id
    app.control.revoke([revoked, members.results[0].id])

    stack.start_relay()
    stack.start_worker()
    wait_until(
        lambda: state(body.id) == "FAILURE" and f"errback:{body.id}" in runs("errback"),
        60,
        "the chord to fail and run its errback",
        lambda: f"chord {state(body.id)}, ran: {sorted(runs(tag))}",
    )
    wait_until(members.ready, 30, "the group to complete")
    stack.assert_alive()
    assert state(revoked) == "REVOKED"
    assert f"Dependency {revoked} raised" in str(app.AsyncResult(body.id).result)
    assert runs(tag) == Counter(
        dict.fromkeys([f"{tag}-kept", f"{tag}-g1", f"{tag}-g2"], 1)
    )
    assert [result.state for result in members.results] == [
        "REVOKED",
        "SUCCESS",
        "SUCCESS",
    ]


def test_celerys_own_revoke_command_takes_a_scheduled_task_out_of_the_outbox(
    e2e: E2EFactory, settings: Any
) -> None:
    settings.CELERY_OUTBOX_SCHEDULE_AFTER = SCHEDULE_AFTER
    stack = e2e("postgresql", BROKER_AMQP)
    stack.env.update(OUTBOX_TEST_SCHEDULE_AFTER=str(SCHEDULE_AFTER))
    worker = stack.start_worker()
    wait_for_node(worker)
    prefix = f"cli-{uuid.uuid4().hex[:8]}"
    with transaction.atomic():
        revoked = record.apply_async((f"{prefix}-revoked",), countdown=COUNTDOWN).id
        kept = record.apply_async((f"{prefix}-kept",), countdown=COUNTDOWN).id
    sent_at = time.monotonic()

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.project.celery_app",
            "control",
            "revoke",
            revoked,
            "--destination",
            node_name(worker),
        ],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "flagged as revoked" in done.stdout
    wait_until(
        lambda: not OutboxMessage.objects.filter(task_id=revoked).exists(),
        10,
        "the worker to delete the revoked task's row",
        worker.output,
    )

    # A worker that restarts forgets the revoke (no --statedb): nothing is left to run.
    assert worker.terminate() == 0, worker.output()
    worker.long_running = False  # stopped on purpose
    stack.start_relay()
    stack.start_worker()
    wait_until(
        lambda: f"{prefix}-kept" in runs(prefix), COUNTDOWN + 30, "the kept task"
    )
    time.sleep(max(0.0, sent_at + COUNTDOWN + GRACE - time.monotonic()))
    stack.assert_alive()
    assert runs(prefix) == Counter({f"{prefix}-kept": 1})
    assert not OutboxMessage.objects.filter(task_id__in=[revoked, kept]).exists()
