"""The message body as the outbox serializes it: byte for byte what kombu writes."""

from __future__ import annotations

import datetime
import decimal
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kombu.serialization import dumps, register, register_json

from celery_outbox.enqueue import serialize
from celery_outbox.exceptions import OutboxSerializationError

NO_CANVAS = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}

BODIES: list[Any] = [
    ((), {}, NO_CANVAS),
    ((1, "two", 3.5, None, True), {"k": [1, {"n": "ünïcødé ✓"}]}, NO_CANVAS),
    ((10**30, -0.0, float("nan"), float("inf")), {}, NO_CANVAS),
    (('quote " back \\ \x00 \u2028',), {"😀": "\ud800"}, NO_CANVAS),
    ((decimal.Decimal("1.50"), uuid.UUID(int=7)), {}, NO_CANVAS),  # kombu's types
    ((datetime.datetime(2026, 11, 21, 12, 0, tzinfo=datetime.timezone.utc),), {}, {}),
]


@pytest.mark.parametrize("body", BODIES, ids=repr)
def test_a_json_body_is_kombus_byte_for_byte(body: Any) -> None:
    content_type, content_encoding, payload = dumps(body, serializer="json")
    assert serialize(body, "json", "shop.work") == (
        content_type,
        content_encoding,
        payload.encode(content_encoding),
    )


@pytest.fixture
def compact_json() -> Iterator[None]:
    """An application's own ``json`` serializer, registered over kombu's."""
    register(
        "json",
        lambda value: json.dumps(value, separators=(",", ":")),
        json.loads,
        content_type="application/json",
        content_encoding="utf-8",
    )
    try:
        yield
    finally:
        register_json()


@pytest.mark.usefixtures("compact_json")
def test_a_json_serializer_the_application_registered_is_used() -> None:
    assert serialize(((1, 2), {}, {}), "json", "shop.work")[2] == b"[[1,2],{},{}]"


def test_what_json_cannot_encode_is_named() -> None:
    with pytest.raises(
        OutboxSerializationError,
        match=r"positional argument 1 of type builtins\.object",
    ):
        serialize(((1, object()), {}, NO_CANVAS), "json", "shop.work")


def test_a_body_too_deep_to_encode_is_refused_with_the_outbox_error() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(OutboxSerializationError, match="Nothing was written"):
        serialize(((deep,), {}, NO_CANVAS), "json", "shop.work")
