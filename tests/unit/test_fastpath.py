"""The short path's own rules, without a database."""

from __future__ import annotations

import decimal
import enum
import threading
import uuid
from typing import Any

import pytest
from celery.utils.saferepr import saferepr

from celery_outbox.envelope import JsonTemplate, dump_json
from celery_outbox.fastpath import arguments_repr, new_task_id


class Colour(enum.IntEnum):
    RED = 1


class Text(str):
    def __repr__(self) -> str:
        return "Text!"


VALUES: list[Any] = [
    0,
    -7,
    10**40,
    True,
    None,
    1.5,
    float("nan"),
    "",
    "plain",
    "a-b_c.d:e@f/g+h=i",
    str(uuid.uuid4()),
    "it's",
    'say "hi"',
    "back\\slash",
    "new\nline",
    "tab\t",
    "ünïcødé",
    "x" * 600,
    b"bytes",
    decimal.Decimal("1.50"),
    uuid.UUID(int=5),
    Colour.RED,
    Text("text"),
    [1, [2, [3, [4]]]],
    {"k": "v"},
    {1, 2},
    (),
]


def argument_lists() -> list[Any]:
    lists: list[Any] = [(), [], (1,), [1, 2]]
    lists += [(value,) for value in VALUES]
    lists += [(1, value, "id-1") for value in VALUES]
    lists += [[value, value] for value in VALUES]
    lists += [tuple(range(400)), ("y" * 300, "z" * 300)]
    return lists


@pytest.mark.parametrize("args", argument_lists(), ids=repr)
@pytest.mark.parametrize("maxlevels", [3, 1, 0])
def test_argument_reprs_are_celerys(args: Any, maxlevels: int) -> None:
    assert arguments_repr(args, 1024, maxlevels) == saferepr(
        args, 1024, maxlevels=maxlevels
    )


@pytest.mark.parametrize(
    "kwargs", [{}, {"a": 1}, {"when": decimal.Decimal("2")}, {"s": "it's"}]
)
def test_keyword_argument_reprs_are_celerys(kwargs: dict[str, Any]) -> None:
    assert arguments_repr(kwargs, 1024, 3) == saferepr(kwargs, 1024, maxlevels=3)


def test_a_small_limit_is_celerys_too() -> None:
    args = ("abcdefghij", 1234567890, "k")
    for limit in (1, 5, 12, 30, 60):
        assert arguments_repr(args, limit, 3) == saferepr(args, limit, maxlevels=3)


def test_new_task_ids_are_random_uuid4_text_as_celery_writes_it() -> None:
    ids = [new_task_id() for _ in range(2_000)]
    assert len(set(ids)) == len(ids)
    for text in ids:
        parsed = uuid.UUID(text)
        assert parsed.version == 4
        assert parsed.variant == uuid.RFC_4122
        assert str(parsed) == text  # lower-case hex, dashes where Celery's are
    # Every random bit is used: each hex digit outside the fixed ones takes many values.
    columns = list(zip(*(text.replace("-", "") for text in ids), strict=True))
    fixed = {12, 16}  # the version digit, and the variant digit (8, 9, a or b)
    assert {
        len(set(column)) for index, column in enumerate(columns) if index not in fixed
    } == {16}
    assert set(columns[12]) == {"4"}
    assert set(columns[16]) == set("89ab")


# -- the stored JSON of a repeated call's headers ----------------------------------

#: Strings whose JSON escaping is not trivial.
AWKWARD = [
    "",
    "plain",
    'quote " and \\ backslash',
    "".join(map(chr, range(32))) + "\x7f",
    "ünïcødé ✓ 😀 \ud800",  # a lone surrogate, as repr() can hand it over
    "</script>\u2028\u2029",
    "x" * 5_000,
]


@pytest.mark.parametrize("value", AWKWARD, ids=repr)
def test_a_json_template_writes_what_dump_json_writes(value: str) -> None:
    example = {
        "lang": "py",
        "id": "first",
        "timelimit": [None, None],
        "argsrepr": "(1,)",
        "stamps": {},
        "kwargsrepr": "{}",
        "retries": 0,
    }
    template = JsonTemplate.of(example, ("id", "argsrepr", "kwargsrepr"))
    assert template is not None
    assert template.fill(example) == dump_json(example)
    call = dict(example, id=value, argsrepr=value[::-1], kwargsrepr=value * 2)
    assert template.fill(call) == dump_json(call)


def test_open_keys_may_come_first_or_last() -> None:
    example = {"id": "a", "n": 1, "last": "z"}
    template = JsonTemplate.of(example, ("last", "id"))
    assert template is not None
    call = {"id": "b'c", "n": 1, "last": "y\n"}
    assert template.fill(call) == dump_json(call)


@pytest.mark.parametrize(
    "example",
    [{"id": None, "n": 1}, {"id": 7}, {"n": 1}],
    ids=["None", "int", "missing"],
)
def test_only_string_values_are_left_open(example: dict[str, Any]) -> None:
    assert JsonTemplate.of(example, ("id",)) is None


def test_values_kombu_encodes_stay_as_kombu_wrote_them() -> None:
    example = {"id": "a", "amount": decimal.Decimal("1.50"), "when": uuid.UUID(int=5)}
    template = JsonTemplate.of(example, ("id",))
    assert template is not None
    call = dict(example, id="b")
    assert template.fill(call) == dump_json(call)
    assert '"__type__"' in template.fill(call)


def test_task_running_follows_celerys_task_stack() -> None:
    from celery import Celery
    from celery._state import _task_stack

    from celery_outbox.fastpath import task_running

    app = Celery("probe", set_as_current=False)

    @app.task(shared=False)
    def probe() -> None:
        return None

    assert task_running() is False
    _task_stack.push(probe)
    try:
        assert task_running() is True
        _task_stack.push(probe)
        _task_stack.pop()
        assert task_running() is True  # still one on the stack
    finally:
        _task_stack.pop()
    assert task_running() is False
    seen: list[bool] = []
    thread = threading.Thread(target=lambda: seen.append(task_running()))
    _task_stack.push(probe)
    try:
        thread.start()
        thread.join(10)
    finally:
        _task_stack.pop()
    assert seen == [False]  # another thread's stack is its own
