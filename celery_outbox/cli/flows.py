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
from ..flow.core import Flow, KeyLimit, Limits, parse_limits, parse_rate, rates_text
from .options import Streams, add_format

HELP = "Flow control: each flow's rows waiting, recent publishes, rates and limits."


def add(lane: argparse.ArgumentParser, kwargs: dict[str, Any]) -> Any:
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
    return verbs


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
            f"No flow {name!r} in CELERY_OUTBOX_FLOWS (configured: {known})."
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
            f"queued {flow.queued}"
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
    if not flows[name].limits:
        raise CommandError(
            f"Flow {name!r} has no limits per key in CELERY_OUTBOX_FLOWS: add "
            f"'running' or 'queued' to it there first (its workers report the "
            f"starts and ends of its keys' tasks only then); 'outbox flows rate' "
            f"changes its rates."
        )
    given = {k: options[k] for k in ("running", "queued") if options[k] is not None}
    if options["reset"] == bool(given):
        raise CommandError(
            "Give the new limits (e.g. 'outbox flows limit partner --running 2', "
            "'--key premium-* --running 10') or --reset, not both and not neither."
        )
    store = outbox_stores().flows()
    (found,) = store.flow_stats((flows[name],))
    try:
        limits = changed_limits(found.limits, options["key"], given, options["reset"])
    except ValueError as exc:
        raise CommandError(f"{exc}.") from None
    store.set_limits(name, limits)
    shown = limits if limits is not None else flows[name].limits
    source = "on every relay from now" if limits is not None else "the settings'"
    streams.line(f"flow {name!r}: limits {shown} ({source})")


def changed_limits(
    current: Limits, key: str | None, given: dict[str, int], reset: bool
) -> Limits | None:
    """``current`` with an operator's change; None: back to the settings'.

    Raises :class:`ValueError` for a limit below 1.
    """
    if reset and key is None:
        return None
    entries = dict(current.keys)
    if reset:
        entries.pop(str(key), None)
        return Limits(current.every, tuple(entries.items()))
    checked = parse_limits(given)  # a limit below 1 is refused with the fix
    change = checked.every
    if key is None:
        return Limits(current.every.over(change), current.keys)
    entries[key] = entries.get(key, KeyLimit()).over(change)
    return Limits(current.every, tuple(entries.items()))
