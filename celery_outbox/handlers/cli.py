"""The ``outbox`` subcommands of the handler outboxes: parse, configure, call."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from django.core.management.base import CommandError, CommandParser

from ..conf import get_settings

#: The ``outbox`` subcommands this module runs.
SUBCOMMANDS = ("handlers", "handler-stats", "handler-replay", "pause", "resume")


def add_parsers(
    sub: Any, kwargs: dict[str, Any], positive: Callable[[type], Any]
) -> None:
    """Add ``handlers``, ``handler-stats``, ``handler-replay``, ``pause``, ``resume``."""
    run = sub.add_parser(
        "handlers", help="Run handler-outbox receivers (no broker).", **kwargs
    )
    run.add_argument(
        "--until-empty", action="store_true", help="Exit once no shard is due."
    )
    run.add_argument("--lease-seconds", type=positive(float), default=None)
    run.add_argument("--poll-interval", type=positive(float), default=None)
    run.add_argument(
        "--liveness-file",
        default=None,
        help="Touch this file while the processor runs (a liveness probe).",
    )
    run.add_argument(
        "--metrics-port",
        type=positive(int),
        default=None,
        help="Serve Prometheus metrics on this port (needs prometheus_client).",
    )
    _databases(run)
    stats = sub.add_parser(
        "handler-stats", help="Print the handler outboxes' backlog.", **kwargs
    )
    stats.add_argument("--format", choices=["text", "json"], default="text")
    stats.add_argument("--top", type=positive(int), default=10, metavar="N")
    _databases(stats)
    replay = sub.add_parser(
        "handler-replay",
        help="Write handler dead letters back at the end of their shards.",
        **kwargs,
    )
    replay.add_argument("--id", type=positive(int), action="append", default=None)
    replay.add_argument("--category", default=None)
    replay.add_argument("--shard", default=None, help="A shard key, e.g. org:42.")
    replay.add_argument(
        "--all", action="store_true", help="Every dead letter (no filter needed)."
    )
    _databases(replay)
    for verb, text in (("pause", "Stop"), ("resume", "Restart")):
        parser = sub.add_parser(
            verb, help=f"{text} a handler category or shard, at runtime.", **kwargs
        )
        target = parser.add_mutually_exclusive_group(required=True)
        target.add_argument("--category", default=None)
        target.add_argument("--shard", default=None, help="A shard key, e.g. org:42.")
        if verb == "pause":
            parser.add_argument("--reason", default="")
        _databases(parser)


def _databases(parser: CommandParser) -> None:
    parser.add_argument(
        "--database",
        action="append",
        default=None,
        help="A database alias (repeat for several); default: every one.",
    )


def handle(options: dict[str, Any], write: Callable[[str], None]) -> None:
    """Run the subcommand ``options["subcommand"]``."""
    from .processor import Processor, config_from_settings

    config = config_from_settings(
        get_settings(),
        databases=tuple(options["database"]) if options["database"] else None,
        lease_seconds=options.get("lease_seconds"),
        poll_interval=options.get("poll_interval"),
        until_empty=options.get("until_empty") or None,
        liveness_file=options.get("liveness_file"),
    )
    command = options["subcommand"]
    if command == "handlers":
        from .metrics import processor_listeners

        listeners = processor_listeners(
            get_settings(), config.databases, options.get("metrics_port")
        )
        try:
            _run(Processor(config, listeners=listeners), write)
        finally:
            for listener in listeners:
                listener.close()
    elif command == "handler-stats":
        _stats(config.databases, options["format"], options["top"], write)
    elif command == "handler-replay":
        _replay(config.databases, options, write)
    else:
        _switch(command, config.databases, options, write)


def _run(processor: Any, write: Callable[[str], None]) -> None:
    from ..engine.loop import stop_on_signals

    with stop_on_signals(processor.stop):
        reason = processor.run()
    write(f"handler processor stopped: {reason.value}")


def _stats(
    databases: tuple[str, ...], fmt: str, top: int, write: Callable[[str], None]
) -> None:
    from ..store.handlers.sql import HandlerStore

    reports = [HandlerStore(alias).stats(top) for alias in databases]
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
    databases: tuple[str, ...], options: dict[str, Any], write: Callable[[str], None]
) -> None:
    from ..store.handlers.sql import HandlerStore
    from .registry import registry

    ids, category, shard = options["id"], options["category"], options["shard"]
    if not (ids or category or shard or options["all"]):
        raise CommandError(
            "name what to replay: --id N (repeatable), --category, --shard, or --all"
        )
    for alias in databases:
        report = HandlerStore(alias).replay(
            ids=ids, category=category, shard=shard, coalesces=registry.coalesces
        )
        line = f"{alias}: {report.replayed} dead letter(s) replayed"
        if report.superseded:
            line += (
                f"; {report.superseded} left (a newer message of their object "
                f"waits in their shard)"
            )
        write(line)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _switch(
    command: str,
    databases: tuple[str, ...],
    options: dict[str, Any],
    write: Callable[[str], None],
) -> None:
    from ..store.handlers.sql import HandlerStore

    kind = "category" if options["category"] is not None else "shard"
    value = options[kind]
    if not value:
        raise CommandError(f"give a non-empty --{kind}")
    for alias in databases:
        store = HandlerStore(alias)
        if command == "pause":
            changed = store.pause(kind, value, options["reason"])
            state = "paused" if changed else "already paused"
        else:
            changed = store.resume(kind, value)
            state = "resumed" if changed else "was not paused"
        write(f"{kind} {value!r} on {alias}: {state}")
