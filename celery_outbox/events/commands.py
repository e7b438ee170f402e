"""What ``manage.py outbox events <verb>`` does: show and declare the topology, count
the queues, inspect, replay and purge the archive. The flags are in
:mod:`celery_outbox.cli.events`; the work is in :mod:`.declare` and :mod:`.archive`."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.utils.url import maybe_sanitize_url

from ..broker.base import explain
from ..broker.failover import NoNodeAnswered, connect, node_of, nodes_of
from ..conf import get_settings
from ..exceptions import OutboxError
from ..progress import ProgressBar
from . import archive, dbarchive
from .declare import declare
from .modes import Retries, transport_of
from .registry import registry_of
from .topology import ServiceTopology, describe


class Output(Protocol):
    """Where a command writes (a file, Django's ``OutputWrapper``)."""

    def write(self, text: str) -> Any: ...

    def flush(self) -> Any: ...


def run(app: Any, options: dict[str, Any], out: Output) -> None:
    """Run the ``events`` subcommand ``options`` describe for ``app``'s services,
    writing to ``out``. The command resolves the app (``--app``, else the relay's)."""
    registry = registry_of(app)
    topology = (
        registry.topology()
        if options.get("service") is None
        else ServiceTopology(get_settings(), options["service"], (), registry.retries())
    )
    command = options["verb"]
    if command == "show" or (command == "declare" and options.get("dry_run")):
        out.write(describe(topology.all_queues()) + "\n")
        return
    held = topology.retries is Retries.DATABASE
    if command in _ARCHIVE and held:
        _archive_command(_held_archive(topology), options, out)
        return
    with app.connection_for_write() as connection, _broker_errors(connection):
        # Every node of a failover list, in kombu's order, before any verb's work.
        node = connect(connection)
        if command == "declare":
            settings = get_settings()
            declare(connection, topology.all_queues(), settings, topology.service)
            out.write(f"declared {len(topology.all_queues())} queues on {node}\n")
        elif command == "stats":
            _stats(connection, topology, held, options, out)
        else:
            _archive_command(_queue_archive(connection, topology), options, out)


@contextlib.contextmanager
def _broker_errors(connection: Any) -> Iterator[None]:
    """The broker's errors (unreachable, a refused declaration) as ours, with the fix."""
    errors = (
        *connection.connection_errors,
        *connection.channel_errors,
        KombuOperationalError,
        OSError,
    )
    where = node_of(connection)
    if nodes_of(connection) > 1:
        where = ";".join(str(maybe_sanitize_url(str(url))) for url in connection.alt)
    try:
        yield
    except (*errors, NoNodeAnswered) as exc:
        raise OutboxError(
            f"broker {where}: {explain(exc)}. Check that it runs and "
            f"that the app's broker_url points at it."
        ) from exc


@dataclass(frozen=True)
class _Archive:
    """One service's archive: the broker's archive queue, or the outbox's dead letters."""

    count: Callable[[], int]
    listing: Callable[[int], Iterable[archive.ArchivedEvent]]
    purge: Callable[[], int]
    replay: Callable[..., Any]
    #: What the line after a replay adds about the result.
    note: Callable[[Any], str]


def _queue_archive(connection: Any, topology: ServiceTopology) -> _Archive:
    """The archive queue on the broker (broker-side retries)."""
    return _Archive(
        count=partial(archive.count, connection, topology),
        listing=partial(archive.list_archive, connection, topology),
        purge=partial(archive.purge, connection, topology),
        replay=partial(archive.replay, connection, topology),
        note=lambda result: (
            f", kept {result.missing_queue} whose queue no longer exists"
            if result.missing_queue
            else ""
        ),
    )


def _held_archive(topology: ServiceTopology) -> _Archive:
    """The outbox's dead letters (retries held in the database)."""
    return _Archive(
        count=partial(dbarchive.count, topology),
        listing=partial(dbarchive.list_archive, topology),
        purge=partial(dbarchive.purge, topology),
        replay=partial(dbarchive.replay, topology),
        note=lambda result: " (the outbox's dead letters)",
    )


#: The verbs that act on the archive.
_ARCHIVE = ("inspect", "replay", "purge")


def _stats(
    connection: Any,
    topology: ServiceTopology,
    held: bool,
    options: dict[str, Any],
    out: Output,
) -> None:
    """Messages per queue (the ``--top`` fullest), then the outbox's held retries."""
    counts = archive.stats(connection, topology)
    fullest = sorted(counts, key=lambda name: -(counts[name] or 0))
    shown = {name: counts[name] for name in fullest[: options["top"]]}
    if held:
        shown["outbox: retries waiting"] = dbarchive.waiting(topology)
        shown["outbox: archived (dead letters)"] = dbarchive.count(topology)
    if options["format"] == "json":
        out.write(json.dumps(shown, indent=2) + "\n")
        return
    # Redis keeps no empty list: a queue there reads as missing until used.
    unknown = "missing" if transport_of(connection) == "amqp" else "0"
    for name, ready in shown.items():
        out.write(f"{name}\t{unknown if ready is None else ready}\n")


def _archive_command(target: _Archive, options: dict[str, Any], out: Output) -> None:
    command = options["verb"]
    if command == "inspect":
        for each in target.listing(options["limit"]):
            _write_archived(out, each)
    elif command == "purge":
        if not options.get("all"):
            raise OutboxError(
                "events purge deletes the whole archive: say so with --all "
                "(add --dry-run to count it first)."
            )
        if options.get("dry_run"):
            out.write(f"would purge {target.count()} (dry run)\n")
        else:
            out.write(f"purged {target.purge()}\n")
    else:
        ids, name = options["ids"], options["name"]
        if ids or name:
            if options["all"]:
                raise OutboxError(
                    "events replay: --all cannot be combined with ids or --name."
                )
        elif not options["all"]:
            raise OutboxError(
                "events replay: say which: ids, --name GLOB, or --all for every one."
            )
        bar = _progress(out)
        try:
            result = target.replay(event=name, ids=ids, on_progress=bar.update)
        finally:
            bar.close()
        summary = (
            f"replayed {result.replayed}, left {result.left} in the archive"
            f"{target.note(result)}"
        )
        unknown = sorted(set(options["ids"]) - result.matched)
        if unknown:
            # The ids that did match were replayed; a script must still hear of the rest.
            raise OutboxError(
                f"{summary}; {len(unknown)} of the {len(set(options['ids']))} id(s) "
                f"given match no archived event of this service: {', '.join(unknown)} "
                f"(already replayed or purged? 'outbox events inspect' lists them)."
            )
        out.write(f"\n{summary}\n")


def _write_archived(out: Output, each: archive.ArchivedEvent) -> None:
    out.write(
        f"{each.id}\t{each.event}\tretries={each.retries}\t{each.failed_at}\t"
        f"{each.error}\n"
    )


def _progress(out: Output) -> ProgressBar:
    """A bar for an archive replay on ``out`` (tqdm; none without the extra)."""
    return ProgressBar(out, "replaying", unit=" events")
