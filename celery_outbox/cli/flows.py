"""``outbox flows <verb>``: flow control's flows, their backlog, rates and limits.

``rate`` changes a flow's rates and ``limit`` its limits per key, for every relay
at its next decision, without a restart; the settings' come back with ``--reset``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from django.core.management.base import CommandError

from ..conf import get_settings
from ..flow.gate import reconcile
from ..flow_limits import (
    Flow,
    Limits,
    changeable,
    parse_limits,
    parse_rate,
    rates_text,
    read_limits,
)
from .exits import ExitStatus
from .options import Streams, add_format

HELP = "Flow control: each flow's rows waiting, recent publishes, rates and limits."


def add(lane: argparse.ArgumentParser, kwargs: dict[str, Any]) -> None:
    """Add ``flows``'s verbs to its parser."""
    verbs = lane.add_subparsers(dest="verb", required=True, metavar="VERB")
    stats = verbs.add_parser(
        "stats",
        help="Print each flow's rows waiting, publishes in the last minute and "
        "the rates in force.",
        **kwargs,
    )
    add_format(stats)
    stats.set_defaults(run=run_stats)
    rate = _change_verb(
        verbs, "rate", "rates", "Go back to the rates of CELERY_OUTBOX_FLOWS.", kwargs
    )
    rate.add_argument(
        "rates",
        metavar="RATE",
        nargs="*",
        help="The rates in force from now: '20/s', '1000/h', ... (units s, m, h, d).",
    )
    rate.set_defaults(run=run_rate)
    limit = _change_verb(
        verbs,
        "limit",
        "limits per key",
        "Go back to the limits of CELERY_OUTBOX_FLOWS (with --key: drop that "
        "key's own limits).",
        kwargs,
    )
    limit.add_argument(
        "--key",
        metavar="KEY",
        help="Change the limits of this flow key (or glob pattern, e.g. "
        "'premium-*') only; without it, the limits of every key.",
    )
    for name, what in (
        ("running", "published and not finished"),
        ("queued", "published and not started"),
    ):
        limit.add_argument(
            f"--{name}",
            type=int,
            metavar="N",
            help=f"At most N tasks of a key {what} (N >= 1).",
        )
    limit.set_defaults(run=run_limit)


def _change_verb(
    verbs: Any, verb: str, what: str, reset: str, kwargs: dict[str, Any]
) -> argparse.ArgumentParser:
    """A verb that changes a flow's ``what`` on every relay: ``FLOW`` and ``--reset``."""
    parser: argparse.ArgumentParser = verbs.add_parser(
        verb,
        help=f"Change a flow's {what} on every relay now, no restart (--reset: "
        f"back to the settings').",
        **kwargs,
    )
    parser.add_argument("flow", metavar="FLOW", help="The flow's name.")
    parser.add_argument("--reset", action="store_true", help=reset)
    return parser


def configured() -> dict[str, Flow]:
    """The flows of the settings, by name."""
    return {flow.name: flow for flow in get_settings().flows}


def named(flows: dict[str, Flow], name: str) -> str:
    """``name`` when the settings have a flow of that name; else the command fails."""
    if name not in flows:
        known = ", ".join(sorted(flows)) or "none"
        raise CommandError(
            f"No flow {name!r} in CELERY_OUTBOX_FLOWS (configured: {known}); the "
            f"rows a flow no longer configured parked or held are released when a "
            f"relay starts, and 'outbox flows stats' counts them until then."
        )
    return name


def run_stats(options: dict[str, Any], streams: Streams) -> None:
    """Print every flow's statistics."""
    from ..store import outbox_stores

    stats = outbox_stores().flows().flow_stats(tuple(configured().values()))
    if options["format"] == "json":
        streams.line(json.dumps([s.as_dict() for s in stats], indent=2))
        return
    if not stats:
        streams.line("no flow configured (CELERY_OUTBOX_FLOWS)")
    for flow in stats:
        if not flow.configured:
            streams.line(
                f"{flow.name}: not in CELERY_OUTBOX_FLOWS  parked {flow.parked} "
                f"(released when a relay starts)"
            )
            continue
        source = "changed by an operator" if flow.changed else "settings"
        rate = f"rate {rates_text(flow.rates)} ({source})" if flow.rates else "no rate"
        streams.line(
            f"{flow.name}: waiting {flow.waiting}  published in the last minute "
            f"{flow.published_last_minute}  {rate}"
        )
        if not flow.limits:
            continue
        source = "changed by an operator" if flow.limits_changed else "settings"
        streams.line(
            f"  per key: {flow.limits} ({source})  running {flow.running}  "
            f"queued {flow.queued}  parked {flow.parked}"
        )
        for key in flow.keys:
            streams.line(
                f"  key {key.key!r}: running {key.running}  queued {key.queued}  "
                f"waiting {key.waiting}  limit {key.limit}"
            )


def run_rate(options: dict[str, Any], streams: Streams) -> None:
    """Put new rates in force for a flow, or its settings' rates back."""
    from ..store import outbox_stores

    flows = configured()
    name = named(flows, options["flow"])
    if options["reset"] == bool(options["rates"]):
        raise CommandError(
            "Give the new rates (e.g. 'outbox flows rate partner 20/s 100000/d') or "
            "--reset, not both and not neither."
        )
    try:
        rates = tuple(parse_rate(text) for text in options["rates"])
    except ValueError as exc:
        raise CommandError(f"{exc}.") from None
    if len({rate.seconds for rate in rates}) != len(rates):
        raise CommandError("One rate per unit: keep the lower rate of each unit.")
    outbox_stores().flows().set_rates(name, rates or None)
    shown = rates_text(rates or flows[name].rates)
    if rates:
        streams.line(f"flow {name!r}: rate {shown} on every relay from now")
    else:
        streams.line(f"flow {name!r}: back to the settings' rate {shown}")


def run_limit(options: dict[str, Any], streams: Streams) -> None:
    """Put new limits per key in force for a flow, or its settings' back."""
    from ..store import outbox_stores

    flows = configured()
    name = named(flows, options["flow"])
    try:
        flow = changeable(flows[name], name)
    except ValueError as exc:
        raise CommandError(f"{exc}.") from None
    given = {k: options[k] for k in ("running", "queued") if options[k] is not None}
    if options["reset"] == bool(given):
        raise CommandError(
            "Give the new limits (e.g. 'outbox flows limit partner --running 2', "
            "'--key premium-* --running 10') or --reset, not both and not neither."
        )
    key = options["key"]
    if key is not None:
        try:
            parse_limits({"keys": {key: {}}})  # the setting's rule for a key
        except ValueError as exc:
            raise CommandError(
                f"--key: {exc}; name a flow key or a glob, e.g. --key 'premium-*'.",
                returncode=ExitStatus.USAGE,
            ) from None
    store = outbox_stores().flows()
    found = store.flow_stats((flow,))[0]
    if options["reset"] and key is not None and key not in dict(found.limits.keys):
        own = ", ".join(pattern for pattern, _ in found.limits.keys) or "none"
        raise CommandError(
            f"Flow {name!r}: key {key!r} has no limits of its own (keys with their "
            f"own: {own}); nothing changed."
        )
    try:
        limits = changed_limits(found.limits, key, given, options["reset"])
    except ValueError as exc:
        raise CommandError(f"{exc}.") from None
    store.set_limits(name, limits)
    shown = limits if limits is not None else flow.limits
    source = "on every relay from now" if limits is not None else "the settings'"
    streams.line(f"flow {name!r}: limits {shown} ({source})")
    for old, count in reconcile(tuple(flows.values()), store).items():
        streams.line(
            f"flow {old!r}: {count} row(s) it held released (settings changed)"
        )


def changed_limits(
    current: Limits, key: str | None, given: dict[str, int], reset: bool
) -> Limits | None:
    """``current`` with an operator's change; None: back to the settings'. A key
    named goes first (:meth:`Limits.put`): the limit printed is the one its keys get.

    Raises :class:`ValueError` for a limit below 1, or a change that would leave
    no limit (checked as the setting is: :func:`read_limits`).
    """
    if reset and key is None:
        return None
    if reset:
        changed = current.without(str(key))
    else:
        change = parse_limits(given).every  # a limit below 1 is refused with the fix
        changed = (
            Limits(current.every.over(change), current.keys)
            if key is None
            else current.put(key, change)
        )
    return read_limits(changed.as_dict())
