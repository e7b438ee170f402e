"""The enqueue-time check of what py-amqp can encode, without a broker."""

from __future__ import annotations

import decimal
import enum
import re
from typing import Any

import pytest

from celery_outbox.broker.amqpcodec import amqp_problem, shortstr_problem
from celery_outbox.envelope import Envelope


def message(**overrides: Any) -> Envelope:
    values: dict[str, Any] = {
        "task_id": "t-1",
        "task_name": "shop.record",
        "exchange": "",
        "routing_key": "celery",
        "body": b"[[], {}, {}]",
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "headers": {"id": "t-1", "task": "shop.record"},
        "properties": {"correlation_id": "t-1", "delivery_mode": 2, "priority": 0},
        "declare": ("celery",),
        "queue": "celery",
    }
    values.update(overrides)
    return Envelope(**values)


@pytest.mark.parametrize(
    "headers",
    [
        {"n": 2**63 - 1, "m": -(2**63)},  # the widest AMQP integer, both ends
        {"list": (1, "two", 3.0, None, True), "nested": {"a": [{"b": 1}]}},
        {"k" * 255: 1},  # a header name of exactly 255 bytes
        # A number key is no AMQP table key, but the store keeps JSON, where every
        # key is a string: the relay would send it as "1".
        {"nested": {1: "one"}},
    ],
    ids=["64-bit ends", "containers", "255-byte name", "number key"],
)
def test_what_the_relay_can_send_passes(headers: dict[str, Any]) -> None:
    assert amqp_problem(message(headers=headers)) is None


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"headers": {"n": 2**63}}, "its header 'n' holds a value AMQP cannot carry"),
        (
            {"headers": {"deep": {"list": [-(2**63) - 1]}}},
            "its header 'deep' holds a value",
        ),
        ({"headers": {"é" * 128: 1}}, "is 256 bytes long in UTF-8"),
        ({"exchange": "x" * 256}, "its exchange is 256 bytes long"),
        ({"declare": ("q" * 300,)}, r"its queue name 'q+'\.\.\. is 300 bytes"),
        ({"content_type": "t" * 256}, "its content type is 256 bytes"),
        (
            {"properties": {"correlation_id": "t-1", "priority": 256}},
            "its priority property 256 is not a valid AMQP octet",
        ),
        (
            {"properties": {"correlation_id": "t-1", "priority": "high"}},
            "its priority 'high' is not a number",
        ),
        (
            {"properties": {"correlation_id": "t-1", "delivery_mode": -1}},
            "its delivery_mode property -1 is not a valid AMQP octet",
        ),
        (
            {"properties": {"correlation_id": "t-1", "reply_to": "r" * 256}},
            "its reply_to property is 256 bytes long",
        ),
    ],
    ids=[
        "2**63",
        "nested below -2**63",
        "256-byte header name",
        "exchange",
        "queue",
        "content type",
        "priority 256",
        "priority text",
        "delivery mode",
        "reply_to",
    ],
)
def test_what_the_relay_could_never_send_is_named(
    overrides: dict[str, Any], problem: str
) -> None:
    found = amqp_problem(message(**overrides))
    assert found is not None
    assert re.search(problem, found), found


class Level(enum.IntEnum):
    HIGH = 9


def test_values_of_unusual_kinds_the_encoder_takes_pass() -> None:
    # The quick walk only knows plain kinds; py-amqp's encoder decides the rest.
    found = amqp_problem(
        message(
            headers={"level": Level.HIGH, "amount": decimal.Decimal("1.5")},
            properties={"correlation_id": "t-1", "priority": True},
        )
    )
    assert found is None


def test_a_priority_the_relay_turns_into_a_number_passes() -> None:
    # The relay sends int(priority): "5" and 5.0 are priority 5.
    for priority in ("5", 5.0):
        found = amqp_problem(
            message(properties={"correlation_id": "t-1", "priority": priority})
        )
        assert found is None, priority


def test_the_task_id_is_named_when_it_is_the_correlation_id() -> None:
    task_id = "é" * 200
    found = amqp_problem(
        message(task_id=task_id, properties={"correlation_id": task_id})
    )
    assert found is not None
    assert found.startswith("its task id is 400 bytes long")


def test_short_strings_are_measured_in_bytes() -> None:
    assert shortstr_problem("name", "x" * 255) is None
    assert shortstr_problem("name", "é" * 127) is None  # 254 bytes
    assert shortstr_problem("name", "é" * 128) == (
        "its name is 256 bytes long in UTF-8 and AMQP carries at most 255 bytes there"
    )
