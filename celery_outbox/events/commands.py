"""``manage.py outbox events ...``: show and declare the topology, inspect and replay
the archive. Parsing lives here; the work is in :mod:`.declare` and :mod:`.archive`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, Protocol

from django.utils.module_loading import import_string

from ..conf import get_settings
from . import archive
from .declare import declare
from .registry import registry_of
from .topology import ServiceTopology, describe


class Output(Protocol):
    """Where a command writes (a file, Django's ``OutputWrapper``)."""

    def write(self, text: str) -> Any: ...

    def flush(self) -> Any: ...


def add_arguments(parser: argparse.ArgumentParser, **kwargs: Any) -> None:
    """Add ``events``'s own subcommands to its parser."""
    parser.add_argument(
        "--app",
        default=None,
        help="Dotted path of the service's app (default: CELERY_OUTBOX_APP or the only one).",
    )
    parser.add_argument(
        "--service",
        default=None,
        help="Act on this service's archive (default: the app's name).",
    )
    sub = parser.add_subparsers(dest="events_command", required=True)
    sub.add_parser("show", help="Print the service's exchanges and queues.", **kwargs)
    declare_parser = sub.add_parser(
        "declare", help="Declare the service's topology (idempotent).", **kwargs
    )
    declare_parser.add_argument(
        "--dry-run", action="store_true", help="Print it, declare nothing."
    )
    sub.add_parser(
        "stats", help="Messages per queue: events, retries, archive.", **kwargs
    )
    archive_parser = sub.add_parser("archive", help="The archive queue.", **kwargs)
    actions = archive_parser.add_subparsers(dest="archive_command", required=True)
    actions.add_parser("count", help="Print how many events are archived.", **kwargs)
    listing = actions.add_parser("list", help="Print archived events.", **kwargs)
    listing.add_argument("--limit", type=int, default=100)
    replay = actions.add_parser(
        "replay", help="Put archived events back into their queues.", **kwargs
    )
    replay.add_argument("ids", nargs="*", help="Task ids of archived events.")
    replay.add_argument(
        "--event", default=None, metavar="GLOB", help="Event name or glob."
    )
    replay.add_argument(
        "--all", action="store_true", help="Replay every archived event."
    )
    actions.add_parser("purge", help="Delete every archived event.", **kwargs)


def run(options: dict[str, Any], out: Output) -> None:
    """Run the ``events`` subcommand ``options`` describe, writing to ``out``."""
    app = _app(options.get("app"))
    topology = (
        registry_of(app).topology()
        if options.get("service") is None
        else (ServiceTopology(get_settings(), options["service"], ()))
    )
    command = options["events_command"]
    if command == "show" or (command == "declare" and options.get("dry_run")):
        out.write(describe(topology.all_queues()) + "\n")
        return
    with app.connection_for_write() as connection:
        if command == "declare":
            declare(connection, topology.all_queues(), get_settings())
            out.write(f"declared {len(topology.all_queues())} queues\n")
        elif command == "stats":
            for name, ready in archive.stats(connection, topology).items():
                out.write(f"{name}\t{'missing' if ready is None else ready}\n")
        else:
            _archive(connection, topology, options, out)


def _archive(
    connection: Any, topology: ServiceTopology, options: dict[str, Any], out: Output
) -> None:
    from ..exceptions import OutboxError

    command = options["archive_command"]
    if command == "count":
        out.write(f"{archive.count(connection, topology)}\n")
    elif command == "list":
        for each in archive.list_archive(connection, topology, options["limit"]):
            out.write(
                f"{each.id}\t{each.event}\tretries={each.retries}\t{each.failed_at}\t"
                f"{each.error}\n"
            )
    elif command == "purge":
        out.write(f"purged {archive.purge(connection, topology)}\n")
    else:
        if not (options["ids"] or options["event"] or options["all"]):
            raise OutboxError("Say what to replay: ids, --event GLOB or --all.")
        result = archive.replay(
            connection,
            topology,
            event=options["event"],
            ids=options["ids"],
            on_progress=_progress(out),
        )
        out.write(
            f"\nreplayed {result.replayed}, left {result.left} in the archive"
            + (
                f", kept {result.missing_queue} whose queue no longer exists"
                if result.missing_queue
                else ""
            )
            + "\n"
        )


def _progress(out: Output) -> Callable[[int, int], None]:
    def show(done: int, total: int) -> None:
        width = 30
        filled = width * done // max(total, 1)
        out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        out.flush()

    return show


def _app(path: str | None) -> Any:
    if path is not None:
        return import_string(path)
    from ..app import resolve_app

    return resolve_app()
