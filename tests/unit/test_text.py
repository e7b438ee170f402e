"""Failures are made storable; callers' keys are refused at the call, never changed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_outbox.exceptions import OutboxValueError
from celery_outbox.text import REPLACEMENT, check_text, storable, unrecorded


def test_storable_replaces_nul_and_lone_surrogates() -> None:
    assert (
        storable("bad\x00byte \udc80 é 😀")
        == f"bad{REPLACEMENT}byte {REPLACEMENT} é 😀"
    )


def test_storable_keeps_the_start_and_says_how_long_the_whole_was() -> None:
    text = storable("x" * 5000, 4000)
    assert len(text) == 4000
    assert text.startswith("x" * 3900)
    assert text.endswith("cut, 5000 characters in all]")


def test_storable_can_keep_the_end_of_a_traceback() -> None:
    traceback = "Traceback:\n" + "  frame\n" * 1000 + "ValueError: caf\udce9\n"
    text = storable(traceback, 4000, keep_end=True)
    assert len(text) == 4000
    assert text.startswith(f"[... cut, {len(traceback)} characters in all] ")
    assert text.endswith(f"ValueError: caf{REPLACEMENT}\n")


def test_the_note_of_an_unrecorded_failure_is_ascii() -> None:
    refused = ValueError("Incorrect string value: '\U0001f5ce\x00'")
    note = unrecorded(OSError("caf\udce9"), refused)
    assert note.startswith("OSError (its text could not be recorded: Incorrect")
    assert note.isascii() and "\x00" not in note


def test_storable_leaves_short_text_alone() -> None:
    assert storable("ValueError: no", 4000) == "ValueError: no"


@given(st.text(alphabet=st.characters(codec=None), max_size=300))
def test_storable_text_always_encodes_to_utf8_without_nul(text: str) -> None:
    for stored in (storable(text, 200), storable(text, 200, keep_end=True)):
        assert len(stored) <= 200
        assert "\x00" not in stored
        stored.encode("utf-8")


@pytest.mark.parametrize(
    ("value", "position", "named"),
    [("k\x00", 1, "NUL"), ("ab\udc80", 2, "lone surrogate")],
)
def test_check_text_names_the_value_the_character_and_its_position(
    value: str, position: int, named: str
) -> None:
    with pytest.raises(OutboxValueError) as caught:
        check_text(value, "ordering_key", "Cannot enqueue task 'shop.send'")
    message = str(caught.value)
    assert message.startswith("Cannot enqueue task 'shop.send': ordering_key")
    assert named in message
    assert f"at position {position}" in message
    assert message.endswith("Nothing was written.")


def test_check_text_refuses_other_types_and_long_values() -> None:
    with pytest.raises(OutboxValueError, match="must be a string, got int"):
        check_text(42, "shard", "Cannot emit")
    with pytest.raises(OutboxValueError, match="at most 3"):
        check_text("abcd", "shard", "Cannot emit", limit=3)
    assert check_text("é😀", "shard", "Cannot emit", limit=3) == "é😀"


def test_a_long_refused_value_is_shown_around_its_culprit() -> None:
    value = "a" * 500 + "\x00" + "b" * 500
    with pytest.raises(OutboxValueError) as caught:
        check_text(value, "arguments_preview", "Cannot enqueue task 'shop.send'")
    message = str(caught.value)
    assert f"...{'a' * 40 + chr(0) + 'b' * 40!r}..." in message
    assert "at position 500" in message
    assert len(message) < 400
