"""How a claimed row becomes a message: by position, so the order must match CLAIM_COLUMNS."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from celery_outbox.envelope import JsonObject, as_dict, json_text
from celery_outbox.exceptions import OutboxValueError, UnsupportedPayloadVersion
from celery_outbox.store.dialects import CLAIM_COLUMNS
from celery_outbox.store.store import _stored_message, check_fits
from tests.integration.builders import envelope

ROW: dict[str, Any] = {
    "id": 41,
    "attempts": 3,
    "task_id": "task-id",
    "task_name": "shop.send_receipt",
    "queue": "mail",
    "exchange": "mail-exchange",
    "routing_key": "mail.receipt",
    "ordering_key": "order-7",
    "payload_version": 1,
    "body": memoryview(b"[[7], {}, {}]"),
    "content_type": "application/json",
    "content_encoding": "utf-8",
    "headers": '{"id": "task-id", "retries": 0}',
    "properties": '{"priority": 5, "delivery_mode": 2}',
    "declare_queues": '["mail"]',
    "arguments_preview": "(7,)",
    "log_context": '{"request_id": "r-1"}',
    "state": None,
}


def claimed(**changes: Any) -> tuple[Any, ...]:
    values = {**ROW, **changes}
    return (*(values[column] for column in CLAIM_COLUMNS), 2.5)


def test_every_claimed_column_lands_in_its_field() -> None:
    assert set(ROW) == set(CLAIM_COLUMNS)
    message = _stored_message(claimed())
    envelope = message.envelope
    assert (message.id, message.attempts, message.age_seconds) == (41, 3, 2.5)
    assert (envelope.task_id, envelope.task_name, envelope.queue) == (
        "task-id",
        "shop.send_receipt",
        "mail",
    )
    assert (envelope.exchange, envelope.routing_key, envelope.ordering_key) == (
        "mail-exchange",
        "mail.receipt",
        "order-7",
    )
    assert envelope.body == b"[[7], {}, {}]"
    assert (envelope.content_type, envelope.content_encoding) == (
        "application/json",
        "utf-8",
    )
    assert dict(envelope.headers) == {"id": "task-id", "retries": 0}
    assert envelope.priority == 5
    assert envelope.declare == ("mail",)
    assert envelope.arguments_preview == "(7,)"
    assert dict(envelope.log_context) == {"request_id": "r-1"}
    assert message.republish is False


def test_a_running_row_claimed_again_is_a_republish() -> None:
    # A strict head whose worker never reported: its running lease ended.
    assert _stored_message(claimed(state="running")).republish is True


def test_headers_keep_their_stored_text_until_read() -> None:
    headers = _stored_message(claimed()).envelope.headers
    assert isinstance(headers, JsonObject)
    assert json_text(headers) == ROW["headers"]
    assert as_dict(headers) == {"id": "task-id", "retries": 0}
    assert headers == {"id": "task-id", "retries": 0}


def test_a_newer_payload_version_is_refused_by_row() -> None:
    with pytest.raises(UnsupportedPayloadVersion, match="Outbox row 41"):
        _stored_message(claimed(payload_version=2))


def test_the_enqueue_length_limits_are_the_columns_widths() -> None:
    from celery_outbox.models import OutboxMessage
    from celery_outbox.store.dialects import COLUMN_LIMITS

    widths = {
        column: OutboxMessage._meta.get_field(column).max_length
        for column in COLUMN_LIMITS
    }
    assert widths == COLUMN_LIMITS


def test_every_text_column_is_checked_at_the_call() -> None:
    good = envelope("fine", task_id="fine")
    check_fits(good)
    check_fits(good)
    with pytest.raises(OutboxValueError, match=r"task_id 'bad\\x00' contains a NUL"):
        check_fits(dataclasses.replace(good, task_id="bad\x00"))
    with pytest.raises(
        OutboxValueError, match=r"arguments_preview '\\udc80' contains a lone"
    ):
        check_fits(dataclasses.replace(good, arguments_preview="\udc80"))
    with pytest.raises(OutboxValueError, match="queue is 256 characters"):
        check_fits(dataclasses.replace(good, queue="q" * 256))
