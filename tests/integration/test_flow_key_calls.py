"""A call's ``flow_key=``: what the row carries to the relay and the worker, and a
key that is not a text refused at the call with the caller's transaction going on."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.db import transaction

from celery_outbox.exceptions import OutboxValueError
from celery_outbox.flow_limits import FLOW_HEADER, KEY_HEADER
from celery_outbox.models import OutboxMessage
from tests.project.shop.tasks import add, record

pytestmark = pytest.mark.django_db(databases="__all__", transaction=True)

FLOWS = {"partner": {"tasks": ["shop.record"], "running": 2}}


@pytest.fixture
def on_alias(alias: str, settings: Any) -> str:
    settings.CELERY_OUTBOX_DATABASE = alias
    settings.CELERY_OUTBOX_PUBLISH_ON_COMMIT = False
    settings.CELERY_OUTBOX_FLOWS = FLOWS
    return alias


def headers_of(alias: str, task_id: str) -> dict[str, Any]:
    row = OutboxMessage.objects.using(alias).get(task_id=task_id)
    found = json.loads(row.headers)
    assert isinstance(found, dict)
    return found


def test_the_row_carries_its_key_and_flow_to_the_relay_and_the_worker(
    on_alias: str,
) -> None:
    with transaction.atomic(using=on_alias):
        keyed = record.apply_async(("a",), flow_key="tenant-42").id
        unflowed = add.apply_async((1, 2), flow_key="tenant-42").id
        plain = record.apply_async(("b",)).id
    found = headers_of(on_alias, keyed)
    assert (found[KEY_HEADER], found[FLOW_HEADER]) == ("tenant-42", "partner")
    # A task no flow covers keeps its key, and no flow counts it.
    found = headers_of(on_alias, unflowed)
    assert (found[KEY_HEADER], FLOW_HEADER in found) == ("tenant-42", False)
    assert KEY_HEADER not in headers_of(on_alias, plain)


@pytest.mark.parametrize("key", [42, 3.5, "", "x" * 256, b"tenant"])
def test_a_key_that_is_not_a_text_is_refused_at_the_call(
    on_alias: str, key: Any
) -> None:
    marker = f"kept-{uuid.uuid4().hex[:8]}"
    with transaction.atomic(using=on_alias):
        with pytest.raises(OutboxValueError) as caught:
            record.apply_async(("a",), flow_key=key)
        sent = record.apply_async((marker,)).id
    assert "flow_key must be a text of 1 to 255 characters" in str(caught.value)
    assert "Nothing was written" in str(caught.value)
    assert list(
        OutboxMessage.objects.using(on_alias).values_list("task_id", flat=True)
    ) == [sent]
