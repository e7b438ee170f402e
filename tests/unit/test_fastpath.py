"""The short path's own rules, without a database."""

from __future__ import annotations

import decimal
import enum
import uuid
from typing import Any

import pytest
from celery.utils.saferepr import saferepr

from celery_outbox.fastpath import arguments_repr


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
