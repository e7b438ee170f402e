"""How a claimed row becomes a message: by position, so the order must match CLAIM_COLUMNS."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from celery_outbox.envelope import Envelope, JsonObject, as_dict, json_text
from celery_outbox.exceptions import OutboxValueError, UnsupportedPayloadVersion
from celery_outbox.store.dialects import (
    CLAIM_COLUMNS,
    INSERT_COLUMNS,
    MESSAGE_COLUMNS,
    literal,
)
from celery_outbox.store.store import (
    _INLINE_HEAD,
    _check_fits,
    _inline_row,
    _message_values,
    _stored_message,
)
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


# -- the other way: a message as the inline INSERT's row ----------------------------


def inline_values(
    envelope: Envelope,
) -> dict[str, str]:
    """``_inline_row``'s values by column, read back from its text."""
    text = _inline_row(envelope, "now()")
    expected_order = [*_INLINE_HEAD.split("(", 1)[1].rstrip(")").split(", ")]
    literals = {
        column: literal(value)
        for column, value in zip(
            MESSAGE_COLUMNS, _message_values(envelope), strict=True
        )
    }
    rebuilt = ", ".join(
        [literals[c] for c in expected_order[: len(MESSAGE_COLUMNS)]]
        + ["0", "''", "now()", "now()"]
    )
    assert text == f"({rebuilt})"
    return literals


def test_the_inline_row_writes_every_message_column_in_the_heads_order() -> None:
    head_columns = _INLINE_HEAD.split("(", 1)[1].rstrip(")").split(", ")
    assert sorted(head_columns) == sorted(INSERT_COLUMNS)
    first = envelope(
        "first",
        task_id="id-1",
        task_name="shop.it's",
        exchange="ex",
        routing_key="rk",
        body=b"[[1], {}, {}]",
        headers=JsonObject('{"id": "id-1"}'),
        properties={"priority": 5},
        declare=("q1",),
        queue="q1",
        arguments_preview="(1,)",
        ordering_key="order-'7'",
        log_context={"request_id": "r-1"},
    )
    inline_values(first)
    # Same repeated values: the row's first part comes from the cache, the rest is its own.
    second = dataclasses.replace(first, task_id="id-2", body=b"[[2], {}, {}]")
    assert inline_values(second)["task_id"] == "'id-2'"
    # One repeated value differs: a row of its own, not the first one's text.
    third = dataclasses.replace(second, queue="other", declare=["other"])  # type: ignore[arg-type]
    assert inline_values(third)["declare_queues"] == "'[\"other\"]'"
    assert "'other'" in _inline_row(third, "now()")
    # No log context: the constant.
    inline_values(dataclasses.replace(first, log_context={}))


def test_a_repeated_value_is_checked_once_and_a_per_row_value_every_time() -> None:
    good = envelope("fine", task_id="fine")
    _check_fits(good)
    _check_fits(good)
    with pytest.raises(OutboxValueError, match="task_id contains a NUL"):
        _check_fits(dataclasses.replace(good, task_id="bad\x00"))
    with pytest.raises(OutboxValueError, match="arguments_preview contains a lone"):
        _check_fits(dataclasses.replace(good, arguments_preview="\udc80"))
    with pytest.raises(OutboxValueError, match="queue is 256 characters"):
        _check_fits(dataclasses.replace(good, queue="q" * 256))
