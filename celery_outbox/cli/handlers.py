"""``outbox handlers <verb>``: the handler outboxes (``emit()`` to ``@receiver``s).

The flags of each verb, then the work each does (through the handler store and the
processor of :mod:`celery_outbox.handlers`).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict
from fnmatch import fnmatchcase
from typing import Any

from django.core.management.base import CommandError

from ..conf import get_settings
from ..exceptions import OutboxDatabaseError
from ..store.handlers import KEY_LENGTH, ReplayReport, StatementRefused
from ..text import check_text
from .options import Streams, add_databases, add_format, add_top, positive
from .selectors import Selection, add_selectors, is_glob

HELP = "Handler outboxes: run their receivers, their backlog, dead letters, pauses."
#: Dead letters ``replay`` writes back per transaction, unless ``--chunk-size``.
REPLAY_CHUNK = 500


def add(lane: argparse.ArgumentParser, kwargs: dict[str, Any]) -> None:
    """Add ``handlers``'s verbs to its parser."""
    verbs = lane.add_subparsers(dest="verb", required=True, metavar="VERB")
    run = verbs.add_parser(
        "run", help="Run the receivers of the handler outboxes (no broker).", **kwargs
    )
    add_run_arguments(run)
    stats = verbs.add_parser(
        "stats", help="Print the backlog, blocked and paused shards.", **kwargs
    )
    add_format(stats)
    add_top(stats, "deepest and blocked shards")
    add_databases(stats)
    stats.set_defaults(run=run_stats)
    replay = verbs.add_parser(
        "replay", help="Write dead letters back at the end of their shards.", **kwargs
    )
    add_selectors(
        replay,
        ids="Dead-letter ids (the admin shows them).",
        name="Category (receiver name) or glob over the registered ones.",
        key="Shard key, e.g. org:42 (repeat for several).",
        everything="Every dead letter.",
        dry_run="Only say what would be replayed.",
        chunk_size=REPLAY_CHUNK,
    )
    add_databases(replay)
    replay.set_defaults(run=run_replay)
    for verb, text in (("pause", "Stop"), ("resume", "Restart")):
        parser = verbs.add_parser(
            verb, help=f"{text} a category or a shard, at runtime.", **kwargs
        )
        add_switch_arguments(parser, verb)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``run``'s flags."""
    parser.add_argument(
        "--until-empty",
        action="store_true",
        help=(
            "Exit once no shard is due: 0 when no message is left, 1 when some wait "
            "unrun (a failing receiver's shard backing off) or a database did not "
            "answer, 3 when only a pause holds them."
        ),
    )
    parser.add_argument(
        "--lease-seconds",
        type=positive(float),
        default=None,
        metavar="SECONDS",
        help="How long a shard's lease lasts (CELERY_OUTBOX_HANDLER_LEASE_SECONDS).",
    )
    parser.add_argument(
        "--poll-interval",
        type=positive(float),
        default=None,
        metavar="SECONDS",
        help="Longest wait between two looks for due shards.",
    )
    parser.add_argument(
        "--liveness-file",
        default=None,
        metavar="PATH",
        help="Touch this file while the processor runs (a liveness probe).",
    )
    parser.add_argument(
        "--metrics-port",
        type=positive(int),
        default=None,
        metavar="PORT",
        help="Serve Prometheus metrics on this port (needs prometheus_client).",
    )
    add_databases(parser)
    parser.set_defaults(run=run_processor)


def add_switch_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    """``pause``'s or ``resume``'s flags: one category or one shard."""
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--name", default=None, help="A category (receiver name).")
    target.add_argument("--key", default=None, help="A shard key, e.g. org:42.")
    if verb == "pause":
        parser.add_argument("--reason", default="", help="Shown by stats and admin.")
    add_databases(parser)
    parser.set_defaults(run=run_switch, verb=verb)


def run_processor(options: dict[str, Any], streams: Streams) -> None:
    """Run the handler processor."""
    _run_processor(
        selected=options["database"],
        lease_seconds=options["lease_seconds"],
        poll_interval=options["poll_interval"],
        until_empty=options["until_empty"],
        liveness_file=options["liveness_file"],
        metrics_port=options["metrics_port"],
        write=streams.line,
    )


def run_stats(options: dict[str, Any], streams: Streams) -> None:
    """Print the handler outboxes' backlog."""
    databases = _databases(options["database"])
    _print_stats(databases, options["format"], options["top"], streams.line)


def run_replay(options: dict[str, Any], streams: Streams) -> None:
    """Write the selected dead letters back; exit 1 for ids that match none."""
    verb = "handlers replay"
    selection = Selection.of(options)
    selection.require(verb, "ids, --name GLOB, --key KEY")
    if len(selection.keys) > 1:
        raise CommandError(f"{verb}: give one --key (one shard) at a time")
    ids = list(selection.numbers(verb))
    shard = _checked(selection.keys[0], "--key", verb) if selection.keys else None
    name = _checked(selection.name, "--name", verb) if selection.name else None
    databases = _databases(options["database"])
    found: set[int] = set()
    for category in _categories(name):
        for report in _replay(
            databases,
            ids=ids or None,
            category=category,
            shard=shard,
            chunk=options["chunk_size"],
            dry_run=selection.dry_run,
            write=streams.line,
        ):
            found.update(report.ids, report.superseded_ids)
    missing = sorted(set(ids) - found)
    if missing:
        # The ids that matched were replayed; a script must still hear of the rest.
        shown = ", ".join(map(str, missing[:10])) + (", ..." if missing[10:] else "")
        raise CommandError(
            f"{verb}: {len(missing)} of the {len(set(ids))} id(s) given match no "
            f"handler dead letter on {', '.join(databases)} ({shown}): already "
            f"replayed or purged? Check the ids in the admin."
        )


def _checked(value: str, flag: str, verb: str) -> str:
    """A category or shard key from the command line, as a table can hold it."""
    return check_text(value, flag, verb, limit=KEY_LENGTH)


def _categories(name: str | None) -> list[str | None]:
    """``--name``: itself when plain, else the registered categories it matches."""
    if name is None or not is_glob(name):
        return [name]
    from ..handlers.registry import registry

    matched = [each for each in registry.names() if fnmatchcase(each, name)]
    if not matched:
        raise CommandError(
            f"--name {name!r} matches no registered category ("
            f"{', '.join(registry.names()) or 'none registered'}); give the exact name "
            f"of one that is no longer registered"
        )
    return list(matched)


def run_switch(options: dict[str, Any], streams: Streams) -> None:
    """Pause or resume a category or a shard."""
    verb = f"handlers {options['verb']}"
    kind, flag = (
        ("category", "--name") if options["name"] is not None else ("shard", "--key")
    )
    value = options["name"] if kind == "category" else options["key"]
    if not value:
        raise CommandError(f"{verb}: give a non-empty {flag}")
    value = _checked(value, flag, verb)
    databases = _databases(options["database"])
    if kind == "category":
        _require_category(value, databases, verb)
    _switch(
        options["verb"],
        databases,
        kind=kind,
        value=value,
        reason=options.get("reason", ""),
        write=streams.line,
    )


def _require_category(name: str, databases: tuple[str, ...], verb: str) -> None:
    """Refuse a ``--name`` no one knows: a typo must not say "paused".

    Known: registered in this process, or paused, or with messages or dead letters
    on one of ``databases`` (a category whose receiver is gone).
    """
    from ..handlers.registry import registry
    from ..store.handlers.sql import HandlerStore

    registered = registry.names()
    if name in registered:
        return
    for alias in databases:
        with _on(alias):
            store = HandlerStore(alias)
            if store.is_paused("category", name) or store.knows_category(name):
                return
    close = difflib.get_close_matches(name, registered, n=3)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise CommandError(
        f"{verb}: --name {name!r} is no handler category: no receiver of it is "
        f"registered in this process, and no message or dead letter of it is on "
        f"{', '.join(databases)}.{hint} Registered categories: "
        f"{', '.join(registered) or 'none (import your receivers in an AppConfig.ready())'}."
    )


@contextlib.contextmanager
def _on(alias: str) -> Iterator[None]:
    """Work on handler database ``alias``: an error of it names it, with the fix."""
    try:
        yield
    except StatementRefused as exc:  # it answered: not a connection to check
        raise CommandError(str(exc)) from exc
    except OutboxDatabaseError as exc:
        raise CommandError(
            f"{exc}\nCheck that database {alias!r} runs and that DATABASES[{alias!r}] "
            f"points at it (the handler databases: --database, else "
            f"CELERY_OUTBOX_HANDLER_DATABASES, else every alias the router lets the "
            f"handler tables migrate to)."
        ) from exc


# -- the work ------------------------------------------------------------------


def _databases(selected: list[str] | None) -> tuple[str, ...]:
    """The aliases to act on: ``selected``, else every one the processor serves."""
    from ..handlers.processor import config_from_settings

    chosen = tuple(selected) if selected else None
    return config_from_settings(get_settings(), databases=chosen).databases


def _run_processor(
    *,
    selected: list[str] | None,
    lease_seconds: float | None,
    poll_interval: float | None,
    until_empty: bool,
    liveness_file: str | None,
    metrics_port: int | None,
    write: Callable[[str], None],
) -> None:
    """Run the handler processor until it stops (a signal, or empty with ``until_empty``)."""
    from ..handlers.metrics import processor_observers
    from ..handlers.processor import Processor, config_from_settings

    config = config_from_settings(
        get_settings(),
        databases=tuple(selected) if selected else None,
        lease_seconds=lease_seconds,
        poll_interval=poll_interval,
        until_empty=until_empty or None,
        liveness_file=liveness_file,
    )
    observers = processor_observers(get_settings(), config.databases, metrics_port)
    try:
        _run(Processor(config, observers=observers), write)
    finally:
        for observer in observers:
            observer.close()


def _run(processor: Any, write: Callable[[str], None]) -> None:
    from ..engine.loop import stop_on_signals
    from .exits import ExitStatus, exit_status

    with stop_on_signals(processor.stop):
        reason = processor.run()
    write(f"handler processor stopped: {reason.value}")
    status = exit_status(reason)  # the one table of exit statuses, as the relay's
    if status is not ExitStatus.OK:
        raise CommandError(
            f"handler processor stopped: {reason.value}: "
            f"{processor.loop.left.describe()}",
            returncode=status,
        )


def _print_stats(
    databases: tuple[str, ...], fmt: str, top: int, write: Callable[[str], None]
) -> None:
    """Print the backlog of the handler outboxes on ``databases``."""
    from ..store.handlers.sql import HandlerStore

    reports = []
    for alias in databases:
        with _on(alias):
            reports.append(HandlerStore(alias).stats(top))
    if fmt == "json":
        write(json.dumps([asdict(r) for r in reports], indent=2))
        return
    for r in reports:
        write(f"database {r.database}:")
        write(f"  messages: {r.messages} in {r.shards} shard(s)")
        write(f"  shards waiting for a processor: {r.waiting}")
        write(f"  shards held by a processor: {r.leased}")
        write(f"  blocked shards (head failing): {r.blocked}")
        for b in r.blocked_shards:
            error = (b.last_error.strip().splitlines() or [""])[-1][:200]
            write(
                f"    {b.shard}: {b.category or '?'} message {b.head_id}, "
                f"{b.attempts} attempt(s), failing for {_seconds(b.failing_seconds)}, "
                f"next in {_seconds(b.next_attempt_seconds)}: {error}"
            )
        write(f"  paused shards: {r.paused_shards}")
        write(f"  paused categories: {', '.join(r.paused_categories) or '-'}")
        write(f"  paused shard keys: {', '.join(r.paused_shard_keys) or '-'}")
        write(f"  oldest message (a shard's head): {_seconds(r.oldest_age)}")
        write(f"  processing lag (oldest not blocked or paused): {_seconds(r.lag)}")
        write(f"  dead letters: {r.dead_letters}")
        for name, count in sorted(r.coalesced.items()):
            write(f"  coalesced {name}: {count}")
        if r.deepest:
            write("  deepest shards:")
            for depth in r.deepest:
                write(f"    {depth.shard}: {depth.messages}")


def _replay(
    databases: tuple[str, ...],
    *,
    ids: list[int] | None,
    category: str | None,
    shard: str | None,
    chunk: int,
    dry_run: bool,
    write: Callable[[str], None],
) -> list[ReplayReport]:
    """Write the selected dead letters back at the end of their shards."""
    from ..handlers.registry import registry
    from ..store.handlers.sql import HandlerStore

    reports = []
    for alias in databases:
        with _on(alias):
            report = HandlerStore(alias).replay(
                ids=ids,
                category=category,
                shard=shard,
                coalesces=registry.coalesces,
                chunk=chunk,
                dry_run=dry_run,
            )
        reports.append(report)
        if dry_run:
            line = f"{alias}: would replay {report.replayed} dead letter(s) (dry run)"
        else:
            line = f"{alias}: {report.replayed} dead letter(s) replayed"
        if report.superseded:
            line += (
                f"; {report.superseded} left (a newer message of their object "
                f"waits in their shard)"
            )
        write(line)
    return reports


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _switch(
    command: str,
    databases: tuple[str, ...],
    *,
    kind: str,
    value: str,
    reason: str,
    write: Callable[[str], None],
) -> None:
    """``pause`` or ``resume`` a category or a shard (``kind``) on every database."""
    from ..store.handlers.sql import HandlerStore

    for alias in databases:
        store = HandlerStore(alias)
        with _on(alias):
            if command == "pause":
                changed = store.pause(kind, value, reason)
                state = "paused" if changed else "already paused"
            else:
                changed = store.resume(kind, value)
                state = "resumed" if changed else "was not paused"
        write(f"{kind} {value!r} on {alias}: {state}")
