"""The options every lane spells alike: ``--format``, ``--top``, ``--database``."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

#: ``--top``'s default on every ``stats``.
TOP = 10


class Output(Protocol):
    """Where a command writes (a file, Django's ``OutputWrapper``)."""

    def write(self, text: str) -> Any: ...

    def flush(self) -> Any: ...


@dataclass(frozen=True)
class Streams:
    """The command's standard output and error."""

    out: Any
    err: Any

    def line(self, text: str) -> None:
        """Write one line on standard output (Django's wrapper adds the newline)."""
        self.out.write(text)


#: A verb's body: the parsed options and where to write.
Run = Callable[[dict[str, Any], Streams], None]


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse ``type`` taking a positive, finite ``kind`` (int or float)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a {kind.__name__}"
            ) from None
        if not value > 0 or not math.isfinite(value):  # nan compares false
            raise argparse.ArgumentTypeError(
                f"must be a positive, finite number, got {text}"
            )
        return value

    return parse


def add_format(parser: argparse.ArgumentParser, *extra: str) -> None:
    """``--format text|json`` (plus ``extra`` choices, e.g. ``prometheus``)."""
    parser.add_argument(
        "--format",
        choices=["text", "json", *extra],
        default="text",
        help="Output format (default: text).",
    )


def add_top(parser: argparse.ArgumentParser, what: str) -> None:
    """``--top N``, default :data:`TOP`."""
    parser.add_argument(
        "--top",
        type=positive(int),
        default=TOP,
        metavar="N",
        help=f"List the N {what} (default: {TOP}).",
    )


def add_databases(parser: argparse.ArgumentParser) -> None:
    """``--database ALIAS`` (repeatable), for the lanes that live on several databases."""
    parser.add_argument(
        "--database",
        action="append",
        default=None,
        metavar="ALIAS",
        help="A database alias (repeat for several); default: every one.",
    )
