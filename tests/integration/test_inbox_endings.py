"""The inbox keeps what a body did when Celery acknowledges its message for good.

A body that ends with ``Ignore`` (``self.replace()`` raises it too) is never
delivered again: its inbox transaction commits what it wrote. Run through Celery's
tracer in this process, as a worker runs it, on every database.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import shared_task, states
from celery.app.trace import build_tracer
from celery.exceptions import Ignore

from celery_outbox.inbox.store import InboxStore
from tests.project.shop.models import TaskRun

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")


@shared_task(bind=True, name="tests.inbox.ignores", inbox=True)
def ignores(self: Any, tag: str, using: str) -> None:
    """Stores its own outcome, then asks Celery to record none (``Ignore``)."""
    TaskRun.objects.using(using).create(task_id=self.request.id, tag=tag)
    raise Ignore()


@pytest.fixture
def on(alias: str, settings: Any) -> str:
    """Put the inbox on ``alias``; returns it."""
    settings.CELERY_OUTBOX_INBOX_DATABASE = alias
    return alias


def delivered(task: Any, task_id: str, *args: Any) -> str:
    """Run a delivery as a worker does (not eagerly); the state it ended in."""
    trace = build_tracer(task.name, task, store_errors=False, app=task.app)
    request = {"id": task_id, "headers": {}, "delivery_info": {}}
    info = trace(task_id, args, {}, request).info
    return "SUCCESS" if info is None else str(info.state)


def test_a_body_that_ends_with_ignore_keeps_its_effects_and_runs_once(on: str) -> None:
    tag, task_id = f"ignore-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    assert delivered(ignores, task_id, tag, on) == states.IGNORED
    assert InboxStore(on).seen(ignores.name, task_id)
    assert delivered(ignores, task_id, tag, on) == states.IGNORED  # the duplicate
    assert TaskRun.objects.using(on).filter(tag=tag).count() == 1
