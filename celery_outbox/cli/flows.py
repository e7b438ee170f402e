"""``outbox flows <verb>``: flow control's flows, their backlog and their rates.

``rate`` changes a flow's rates for every relay at its next decision, without a
restart; the settings' rates come back with ``rate NAME --reset``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from django.core.management.base import CommandError

from ..conf import get_settings
from ..flow.core import Flow, parse_rate, rates_text
from .options import Streams, add_format

HELP = "Flow control: each flow's rows waiting, recent publishes and rates."


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
    rate = verbs.add_parser(
        "rate",
        help="Change a flow's rates on every relay now, no restart (--reset: "
        "back to the settings').",
        **kwargs,
    )
    rate.add_argument("flow", metavar="FLOW", help="The flow's name.")
    rate.add_argument(
        "rates",
        metavar="RATE",
        nargs="*",
        help="The rates in force from now: '20/s', '1000/h', ... (units s, m, h, d).",
    )
    rate.add_argument(
        "--reset",
        action="store_true",
        help="Go back to the rates of CELERY_OUTBOX_FLOWS.",
    )
    rate.set_defaults(run=run_rate)
    return verbs


def configured() -> dict[str, Flow]:
    """The flows of the settings, by name."""
    return {flow.name: flow for flow in get_settings().flows}


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
        streams.line(
            f"{flow.name}: waiting {flow.waiting}  published in the last minute "
            f"{flow.published_last_minute}  rate {rates_text(flow.rates)} ({source})"
        )


def run_rate(options: dict[str, Any], streams: Streams) -> None:
    """Put new rates in force for a flow, or its settings' rates back."""
    from ..store import outbox_stores

    flows = configured()
    name = options["flow"]
    if name not in flows:
        known = ", ".join(sorted(flows)) or "none"
        raise CommandError(
            f"No flow {name!r} in CELERY_OUTBOX_FLOWS (configured: {known})."
        )
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
