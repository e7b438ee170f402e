"""Showing a stored body's arguments (admin): any body gives arguments or a reason."""

from __future__ import annotations

import json
import zlib

import pytest

from celery_outbox.decoding import decode_arguments


def body(value: object) -> bytes:
    return json.dumps(value).encode()


def test_a_protocol_2_body_gives_its_arguments() -> None:
    decoded = decode_arguments(
        body([[1, "a"], {"k": 2}, {}]), "application/json", "utf-8", {}
    )
    assert (decoded.args, decoded.kwargs, decoded.error) == ([1, "a"], {"k": 2}, "")


def test_a_protocol_1_body_gives_its_arguments() -> None:
    decoded = decode_arguments(
        body({"args": [3], "kwargs": {"x": 1}}), "application/json", "utf-8", {}
    )
    assert (decoded.args, decoded.kwargs, decoded.error) == ([3], {"x": 1}, "")


def test_a_compressed_body_is_decompressed_first() -> None:
    decoded = decode_arguments(
        zlib.compress(body([[7], {}, {}])),
        "application/json",
        "utf-8",
        {"compression": "application/x-gzip"},
    )
    assert decoded.args == [7]


@pytest.mark.parametrize(
    "value",
    [[1, 2], ["text", "more"], [[1], [2]], {"args": 5, "kwargs": {}}],
    ids=["numbers", "strings", "two-lists", "protocol-1-number"],
)
def test_a_body_that_is_not_a_celery_task_gives_a_reason_not_an_error(
    value: object,
) -> None:
    decoded = decode_arguments(body(value), "application/json", "utf-8", {})
    assert (decoded.args, decoded.kwargs) == ([], {})
    assert decoded.error.startswith("cannot decode: not a Celery task body")


def test_a_pickled_body_is_never_loaded_for_display() -> None:
    decoded = decode_arguments(
        b"\x80\x04.", "application/x-python-serialize", "binary", {}
    )
    assert decoded.error.startswith("not decoded: content type")
