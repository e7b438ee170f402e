"""The relay's own publish frames are the bytes py-amqp's frame writer writes.

Each case encodes one publish both ways: with :func:`publish_frames` and with
:func:`library_frames`, py-amqp's ``frame_writer`` fed exactly what
``channel.basic_publish`` feeds it. The bytes must be equal, or both must refuse the
message with the same kind of error, or the relay's encoder must leave the message
to py-amqp. :class:`PublishEncoder` uses the relay's encoder only once its start-up
check found the two equal; the last tests hand it encoders that fail the check.
"""

from __future__ import annotations

import datetime
import decimal
import logging
import math
import struct
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_outbox.broker.amqpframes import (
    SAMPLES,
    PublishEncoder,
    library_frames,
    publish_frames,
    self_check,
)


def outcome(encode: Any) -> tuple[str, Any]:
    try:
        return "bytes", encode()
    except Exception as exc:
        return "error", type(exc)


def assert_same(
    properties: dict[str, Any],
    *,
    body: bytes = b'[[1], {}, {"callbacks": null}]',
    exchange: Any = "",
    routing_key: Any = "celery",
    mandatory: bool = True,
    frame_max: int = 131072,
    channel_id: int = 1,
) -> None:
    args = (channel_id, frame_max, exchange, routing_key, mandatory, body, properties)
    ours = outcome(lambda: publish_frames(*args))
    theirs = outcome(lambda: library_frames(*args))
    assert ours != ("bytes", None), "left to py-amqp"
    assert ours == theirs


def assert_left_to_py_amqp(
    properties: dict[str, Any],
    *,
    exchange: Any = "",
    routing_key: Any = "celery",
) -> None:
    """The relay's encoder leaves the message to py-amqp's ``basic_publish``."""
    body = b'[[1], {}, {"callbacks": null}]'
    args = (1, 131072, exchange, routing_key, True, body, properties)
    assert publish_frames(*args) is None


def celery_properties(task_id: str, **headers: Any) -> dict[str, Any]:
    """A Celery message's properties as the relay passes them."""
    return {
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "application_headers": {
            "lang": "py",
            "task": "shop.send_receipt",
            "id": task_id,
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": task_id,
            "parent_id": None,
            "argsrepr": "(42,)",
            "kwargsrepr": "{}",
            "origin": "gen1@web-1",
            "ignore_result": False,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
            **headers,
        },
        "priority": 0,
        "correlation_id": task_id,
        "reply_to": "6c7f2b1e-1d4b-3f0a-9a53-5d1c1e0c2a11",
        "delivery_mode": 2,
    }


def test_a_celery_message_is_encoded_as_py_amqp_encodes_it() -> None:
    for number in range(3):  # the second and third reuse what the first kept
        assert_same(celery_properties(f"task-{number}", argsrepr=f"({number},)"))


@pytest.mark.parametrize(
    "headers",
    [
        # py-amqp's integer bounds: -2**31 + 1 is its last 32-bit value.
        {"a": 2**31 - 1, "b": 2**31, "c": -(2**31) + 1, "d": -(2**31)},
        {"wide": 2**63 - 1, "low": -(2**63)},
        {"too_wide": 2**63},  # refused by both
        {"x": 1.5, "y": -0.0, "z": math.inf, "nan": math.nan},
        {"nested": {"a": [1, "two", None, True, {"b": []}]}, "tuple": (1, 2)},
        {"text": "déjà vu \U0001f600", "lone": "\ud800"},  # surrogatepass
        {"k" * 255: 1},
        {"k" * 256: 1},  # a key over 255 bytes: refused by both
        {},
    ],
)
def test_header_values_of_every_json_kind(headers: dict[str, Any]) -> None:
    assert_same(celery_properties("t-1", **headers))


def test_a_value_kept_from_the_last_message_never_stands_for_an_equal_one_of_another_type() -> (
    None
):
    # 1 == True == 1.0 and 0.0 == -0.0: the kept encodings must not mix them up.
    for value in (1, True, 1.0, "1", 0.0, -0.0, 0, False, None, "", 1):
        assert_same(celery_properties("t-1", retries=value))


@pytest.mark.parametrize(
    "value",
    [
        decimal.Decimal("1.25"),
        datetime.datetime(2026, 1, 2, 3, 4, 5),
        b"raw bytes",
        type("Text", (str,), {})("a str subclass"),
        object(),  # no AMQP type: py-amqp refuses it
    ],
)
def test_values_outside_json_go_through_py_amqp(value: Any) -> None:
    assert_left_to_py_amqp(celery_properties("t-1", unusual=value))


@pytest.mark.parametrize(
    "properties",
    [
        {"priority": 256},  # an octet
        {"priority": "high"},
        {"delivery_mode": 1.5},
        {"correlation_id": "c" * 256},  # a short string
        {"expiration": "60000", "message_id": "m-1", "timestamp": 1_700_000_000},
        {"type": "", "user_id": "guest", "app_id": "shop", "cluster_id": "c"},
        {"application_headers": None, "priority": None},
        {"unknown_property": "py-amqp leaves it out"},
    ],
)
def test_properties(properties: dict[str, Any]) -> None:
    assert_same({**celery_properties("t-1"), **properties})


@pytest.mark.parametrize(
    "properties",
    [
        {"correlation_id": 12},
        {"correlation_id": b"bytes"},
        {"application_headers": [("not", "a table")]},
    ],
)
def test_properties_outside_json_go_through_py_amqp(properties: dict[str, Any]) -> None:
    assert_left_to_py_amqp({**celery_properties("t-1"), **properties})


@pytest.mark.parametrize(
    ("exchange", "routing_key", "mandatory"),
    [
        ("", "celery", True),
        ("orders", "orders.created", False),
        ("ex", "r" * 255, True),
        ("ex", "r" * 256, True),  # refused by both
        (None, None, True),
    ],
)
def test_method_arguments(exchange: Any, routing_key: Any, mandatory: bool) -> None:
    assert_same(
        celery_properties("t-1"),
        exchange=exchange,
        routing_key=routing_key,
        mandatory=mandatory,
    )


@pytest.mark.parametrize("size", [0, 1, 4088, 4089, 10_000, 100_000])
def test_bodies_are_split_into_frames_as_py_amqp_splits_them(size: int) -> None:
    assert_same(
        celery_properties("t-1"),
        body=(bytes(range(256)) * (size // 256 + 1))[:size],
        frame_max=4096,
        channel_id=7,
    )


def test_a_routing_key_of_bytes_is_left_to_py_amqp() -> None:
    assert_left_to_py_amqp(celery_properties("t-1"), routing_key=b"bytes key")


def test_a_message_py_amqp_would_read_differently_is_left_to_py_amqp() -> None:
    for name in ("body", "channel", "children", "frame_method", "frame_args"):
        properties = {**celery_properties("t-1"), name: "x"}
        assert publish_frames(1, 131072, "", "q", True, b"{}", properties) is None
    text_body: Any = "a str body is encoded by py-amqp"
    assert publish_frames(1, 131072, "", "q", True, text_body, {}) is None


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    headers=st.dictionaries(st.text(max_size=12), json_values, max_size=8),
    priority=st.none() | st.integers(min_value=-1, max_value=300),
    correlation_id=st.none() | st.text(max_size=40),
    routing_key=st.text(max_size=30),
)
def test_any_json_headers_encode_as_py_amqp_encodes_them(
    headers: dict[str, Any],
    priority: int | None,
    correlation_id: str | None,
    routing_key: str,
) -> None:
    properties = {
        **celery_properties("t-1"),
        "application_headers": headers,
        "priority": priority,
        "correlation_id": correlation_id,
    }
    assert_same(properties, routing_key=routing_key)
    # Again, now that the first encoding kept its values.
    assert_same(properties, routing_key=routing_key)


def test_struct_is_what_refuses_an_octet_out_of_range() -> None:
    # The error kind a caller sees is py-amqp's own (struct.error), not a new one.
    with pytest.raises(struct.error):
        publish_frames(1, 131072, "", "q", True, b"{}", {"priority": 256})


# -- the start-up check ----------------------------------------------------------

WARNED = "does not write what py-amqp"


def encode_sample(encoder: PublishEncoder, index: int = 0) -> bytes | None:
    frame_max, channel_id, exchange, routing_key, mandatory, body, props = SAMPLES[
        index
    ]
    return encoder.frames(
        channel_id, frame_max, exchange, routing_key, mandatory, body, props
    )


def warnings_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "celery_outbox.broker" and r.levelno == logging.WARNING
    ]


def off_by_one_byte(*args: Any) -> bytes | None:
    """The relay's encoder with its last byte changed: a check must catch it."""
    frames = publish_frames(*args)
    assert frames is not None
    return frames[:-1] + bytes([frames[-1] ^ 1])


def refusing(*args: Any) -> bytes | None:
    raise ValueError("an encoder that cannot encode")


def leaving_all_to_py_amqp(*args: Any) -> bytes | None:
    return None


def test_the_check_passes_with_the_installed_py_amqp(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert self_check() is None
    encoder = PublishEncoder()
    assert encoder.check()
    for index, sample in enumerate(SAMPLES):
        frame_max, channel_id, exchange, routing_key, mandatory, body, props = sample
        assert encode_sample(encoder, index) == library_frames(
            channel_id, frame_max, exchange, routing_key, mandatory, body, props
        )
    assert warnings_logged(caplog) == []


def test_the_samples_hold_a_celery_message_with_every_kind_of_value() -> None:
    kinds: set[type] = set()

    def collect(value: Any) -> None:
        kinds.add(type(value))
        children = value.values() if isinstance(value, Mapping) else value
        if isinstance(value, (Mapping, list)):
            for child in children:
                collect(child)

    for *_, properties in SAMPLES:
        collect(properties["application_headers"])
        assert {"priority", "delivery_mode", "correlation_id"} <= properties.keys()
    assert {str, int, type(None), list, dict, bool, float} <= kinds


@pytest.mark.parametrize("encode", [off_by_one_byte, refusing, leaving_all_to_py_amqp])
def test_an_encoder_that_fails_the_check_leaves_every_message_to_py_amqp(
    encode: Any, caplog: pytest.LogCaptureFixture
) -> None:
    encoder = PublishEncoder(encode)
    assert self_check(encode) is not None
    for index in (0, 1, 0, 1):
        assert encode_sample(encoder, index) is None  # py-amqp's basic_publish
    assert not encoder.check()
    [warning] = warnings_logged(caplog)  # once, however many messages
    assert WARNED in warning


def test_when_py_amqp_cannot_encode_the_samples_it_encodes_every_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken_library(*args: Any) -> bytes:
        raise TypeError("a py-amqp whose frame writer takes other arguments")

    encoder = PublishEncoder(reference=broken_library)
    assert encode_sample(encoder) is None
    [warning] = warnings_logged(caplog)
    assert "TypeError" in warning


def test_the_check_runs_once_before_the_first_message() -> None:
    calls: list[int] = []

    def counted(*args: Any) -> bytes | None:
        calls.append(1)
        return publish_frames(*args)

    encoder = PublishEncoder(counted)
    assert calls == []  # nothing runs at construction
    assert encoder.check()
    checked = len(calls)
    assert checked == 2 * len(SAMPLES)
    for _ in range(5):
        assert encode_sample(encoder) is not None
    assert encoder.check()
    assert len(calls) == checked + 5


def test_without_an_encoder_py_amqp_encodes_everything_unchecked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    encoder = PublishEncoder(None)
    assert not encoder.check()
    assert encode_sample(encoder) is None
    assert warnings_logged(caplog) == []
