"""The one selector set: which dead letters, messages or keys a verb acts on.

Positional ids, ``--name GLOB``, ``--key`` (where keys exist), ``--since/--until``,
``--all``, ``--dry-run`` and ``--chunk-size`` mean the same on every lane. A lane
offers the ones its store can honour; a verb that changes or deletes refuses an
empty selection and names ``--all`` as the way to say "every one".
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from django.core.management.base import CommandError

from .options import positive


def add_selectors(
    parser: argparse.ArgumentParser,
    *,
    ids: str | None = None,
    name: str | None = None,
    key: str | None = None,
    since: str | None = None,
    until: str | None = None,
    everything: str | None = None,
    dry_run: str | None = None,
    chunk_size: int | None = None,
) -> None:
    """Add the selectors a verb offers; each argument is its help text (None: not offered).

    ``since`` and ``until`` name the event they date (e.g. "Died").
    """
    if ids is not None:
        parser.add_argument("ids", nargs="*", metavar="ID", help=ids)
    if name is not None:
        parser.add_argument("--name", default=None, metavar="GLOB", help=name)
    if key is not None:
        parser.add_argument(
            "--key", action="append", default=None, metavar="KEY", help=key
        )
    if since is not None:
        parser.add_argument(
            "--since",
            default=None,
            metavar="WHEN",
            help=f"{since} at or after: ISO datetime or 2h, 30m, 7d ago.",
        )
    if until is not None:
        parser.add_argument(
            "--until",
            default=None,
            metavar="WHEN",
            help=f"{until} before: ISO datetime or 2h, 30m, 7d ago.",
        )
    if everything is not None:
        parser.add_argument("--all", action="store_true", help=everything)
    if dry_run is not None:
        parser.add_argument("--dry-run", action="store_true", help=dry_run)
    if chunk_size is not None:
        parser.add_argument(
            "--chunk-size",
            type=positive(int),
            default=chunk_size,
            metavar="N",
            help=f"Rows per transaction (default: {chunk_size}).",
        )


@dataclass(frozen=True)
class Selection:
    """The selectors as parsed (those a verb does not offer read as unset)."""

    ids: tuple[str, ...] = ()
    name: str | None = None
    keys: tuple[str, ...] = ()
    since: str | None = None
    until: str | None = None
    everything: bool = False
    dry_run: bool = False

    @classmethod
    def of(cls, options: dict[str, Any]) -> Selection:
        """The selection in a command's parsed ``options``."""
        name = options.get("name")
        if name is not None and not name.strip():
            raise CommandError("--name needs a name or a glob (e.g. 'billing.*')")
        return cls(
            ids=tuple(str(each) for each in options.get("ids") or ()),
            name=name,
            keys=tuple(options.get("key") or ()),
            since=options.get("since"),
            until=options.get("until"),
            everything=bool(options.get("all")),
            dry_run=bool(options.get("dry_run")),
        )

    @property
    def is_empty(self) -> bool:
        """Whether no selector narrows anything (``--all`` aside)."""
        return not (self.ids or self.name or self.keys or self.since or self.until)

    def require(self, verb: str, offered: str) -> None:
        """Refuse an empty selection, and ``--all`` mixed with selectors.

        ``offered`` lists the selectors ``verb`` takes, for the message.
        """
        if self.everything and not self.is_empty:
            raise CommandError(f"{verb}: --all cannot be combined with {offered}")
        if self.is_empty and not self.everything:
            raise CommandError(
                f"{verb}: say which: {offered}, or --all for every one "
                f"(add --dry-run to see what it would do)"
            )

    def numbers(self, verb: str) -> tuple[int, ...]:
        """The ids as positive integers; refuses any other."""
        numbers = []
        for text in self.ids:
            if not (text.isascii() and text.isdigit()) or int(text) <= 0:
                raise CommandError(f"{verb}: ids are positive integers, got {text!r}")
            numbers.append(int(text))
        return tuple(numbers)


def is_glob(text: str) -> bool:
    """Whether ``text`` is an ``fnmatch`` pattern rather than a plain name."""
    return any(char in text for char in "*?[")
