"""Flow decisions, as pure functions over values (no database, no clock).

* :func:`parse_rate` and :func:`parse_flows`: ``CELERY_OUTBOX_FLOWS`` read and checked;
* :func:`use_of`: how much of one rate's sliding window the publish records use;
* :func:`grant`: how many of the wanted rows the rates let through now, and when
  the window takes more;
* :func:`plan`: which claimed rows go to the broker and which go back, with when.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from ..envelope import StoredMessage
from ..outcomes import Action, Decision

#: The window of each unit a rate may name, in seconds.
UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

#: The keys a flow's entry in ``CELERY_OUTBOX_FLOWS`` takes.
FLOW_KEYS = ("tasks", "rate")

#: The longest flow name (the primary key of its row).
NAME_LIMIT = 255

_RATE = re.compile(r"\s*(\d+)\s*/\s*([a-z]+)\s*")

_EXAMPLE = (
    "e.g. {'partner': {'tasks': ['shop.call_partner', 'shop.sync_*'], "
    "'rate': ['10/s', '100000/d']}}"
)


@dataclass(frozen=True)
class Rate:
    """At most ``count`` publishes in any window of ``seconds`` (sliding)."""

    count: int
    seconds: float

    def __str__(self) -> str:
        unit = next(u for u, s in UNITS.items() if s == self.seconds)
        return f"{self.count}/{unit}"

    @property
    def pace(self) -> float:
        """Seconds between publishes when the rate is used evenly."""
        return self.seconds / self.count


def parse_rate(text: Any) -> Rate:
    """A :class:`Rate` from ``"N/s"``, ``"N/m"``, ``"N/h"`` or ``"N/d"`` (N >= 1).

    Raises :class:`ValueError` saying what is wrong and what to write instead.
    """
    if not isinstance(text, str):
        raise ValueError(
            f"a rate is a text such as '10/s' (units s, m, h, d), got {text!r}"
        )
    found = _RATE.fullmatch(text.lower())
    if found is None or found.group(2) not in UNITS:
        raise ValueError(
            f"{text!r} is not a rate: write '<count>/<unit>' with the unit s, m, h "
            f"or d, e.g. '10/s' or '100000/d'"
        )
    count = int(found.group(1))
    if count == 0:
        raise ValueError(
            f"{text!r} lets nothing through: write a rate of at least 1 (e.g. "
            f"'1/{found.group(2)}'); to stop a flow's tasks, use 'outbox tasks pause'"
        )
    return Rate(count, UNITS[found.group(2)])


def parse_rates(value: Any) -> tuple[Rate, ...]:
    """One rate (a text) or several (a list of texts), each as :func:`parse_rate`."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(
            f"'rate' is a rate such as '10/s' or a list of them such as "
            f"['10/s', '100000/d'], got {value!r}"
        )
    rates = tuple(parse_rate(item) for item in items)
    windows = [rate.seconds for rate in rates]
    if len(set(windows)) != len(windows):
        raise ValueError(
            f"{value!r} names one unit twice: keep the lower rate of each unit"
        )
    return rates


def rates_text(rates: Iterable[Rate]) -> str:
    """``"10/s, 100000/d"``: rates as an operator writes them."""
    return ", ".join(str(rate) for rate in rates)


@dataclass(frozen=True)
class Flow:
    """Tasks that share rates for the whole deployment, however many relays run."""

    name: str
    #: Task names or glob patterns (``fnmatch``, case counts).
    tasks: tuple[str, ...]
    rates: tuple[Rate, ...]

    def covers(self, task_name: str) -> bool:
        """Whether ``task_name`` is one of the flow's tasks."""
        return any(fnmatchcase(task_name, pattern) for pattern in self.tasks)


def parse_flows(value: Any) -> tuple[Flow, ...]:
    """``CELERY_OUTBOX_FLOWS`` as flows, in the order written.

    Raises :class:`ValueError` naming the flow, what is wrong and the fix.
    """
    if not isinstance(value, Mapping):
        raise ValueError(f"must be a dict of flows by name ({_EXAMPLE}), got {value!r}")
    flows = []
    for name, entry in value.items():
        if not isinstance(name, str) or not name or len(name) > NAME_LIMIT:
            raise ValueError(
                f"a flow's name is a text of 1 to {NAME_LIMIT} characters, got {name!r}"
            )
        try:
            flows.append(_flow(name, entry))
        except ValueError as exc:
            raise ValueError(f"flow {name!r}: {exc}") from None
    return tuple(flows)


def _flow(name: str, entry: Any) -> Flow:
    if not isinstance(entry, Mapping):
        raise ValueError(
            f"is a dict with the keys 'tasks' and 'rate' ({_EXAMPLE}), got {entry!r}"
        )
    unknown = sorted(set(map(str, entry)) - set(FLOW_KEYS))
    missing = [key for key in FLOW_KEYS if key not in entry]
    if unknown or missing:
        raise ValueError(
            f"takes the keys 'tasks' and 'rate' (unknown: {unknown}, missing: "
            f"{missing}) ({_EXAMPLE})"
        )
    tasks = entry["tasks"]
    if isinstance(tasks, str) or not isinstance(tasks, (list, tuple)) or not tasks:
        raise ValueError(
            f"'tasks' is a list of task names or glob patterns such as "
            f"['shop.call_partner', 'shop.sync_*'], got {tasks!r}"
        )
    bad = [task for task in tasks if not isinstance(task, str) or not task]
    if bad:
        raise ValueError(
            f"'tasks' holds entries that are not task names or glob patterns (texts "
            f"such as 'shop.sync_*'; regular expressions and other types are not "
            f"read): {bad!r}"
        )
    return Flow(name, tuple(tasks), parse_rates(entry["rate"]))


@functools.lru_cache(maxsize=4096)
def flow_of(flows: tuple[Flow, ...], task_name: str) -> Flow | None:
    """The first of ``flows`` that covers ``task_name``; None when none does."""
    return next((flow for flow in flows if flow.covers(task_name)), None)


@dataclass(frozen=True)
class Use:
    """How much of one rate's window the publish records use at the decision's time."""

    rate: Rate
    #: Publishes recorded in the window.
    used: int
    #: Age in seconds of the oldest record in the window; None when it is empty.
    oldest_age: float | None = None


def use_of(records: Iterable[tuple[float, int]], rate: Rate, now: float) -> Use:
    """The use of ``rate``'s window ending at ``now`` by ``(time, publishes)`` records.

    A record counts while it is younger than the window: one exactly ``seconds``
    old has left it.
    """
    inside = [(at, count) for at, count in records if at > now - rate.seconds]
    if not inside:
        return Use(rate, 0)
    return Use(rate, sum(c for _, c in inside), now - min(at for at, _ in inside))


@dataclass(frozen=True)
class Grant:
    """What a flow's rates let through now."""

    #: How many of the wanted publishes may go now (recorded as published).
    granted: int
    #: Seconds until the window takes more, when something had to wait; else 0.
    wait: float = 0.0
    #: Seconds between publishes after that, at the rate that stopped them.
    pace: float = 0.0
    #: The rates the grant was decided under (an operator's, or the settings').
    rates: tuple[Rate, ...] = ()
    #: How many of the wanted publishes have to wait.
    held: int = 0

    @property
    def paced_for(self) -> float:
        """Seconds from now until the slots of the held publishes are all taken:
        the next held publish of the flow waits at least that long."""
        return self.wait + self.held * self.pace


def grant(uses: Sequence[Use], wanted: int, paced_for: float = 0.0) -> Grant:
    """How many of ``wanted`` publishes the rates' windows take now, and the wait.

    Each window takes ``count - used`` more; the grant is the smallest room. A rate
    whose window is then full stops the rest until its oldest record leaves the
    window (a record of this grant is the oldest when the window held none).
    ``paced_for``: seconds until the slots already given to held rows run out (the
    last holding grant's :attr:`Grant.paced_for`, counted down). Rows held now wait
    behind them, so that a backlog held over many batches comes back at the rate,
    each row once, instead of every batch's rows due in the same few seconds.
    """
    rates = tuple(use.rate for use in uses)
    room = min((max(0, u.rate.count - u.used) for u in uses), default=wanted)
    granted = min(wanted, room)
    if granted == wanted:
        return Grant(granted, rates=rates)
    full = [u for u in uses if u.rate.count - u.used - granted <= 0]
    wait = max(max(_frees_in(u) for u in full), paced_for)
    pace = max(u.rate.pace for u in full)
    return Grant(granted, wait, pace, rates, wanted - granted)


def _frees_in(use: Use) -> float:
    """Seconds until the oldest record leaves a full window (this grant's: now)."""
    if not use.used or use.oldest_age is None:
        return use.rate.seconds
    return max(0.0, use.rate.seconds - use.oldest_age)


@dataclass(frozen=True)
class Admission:
    """A gate's answer for a claimed batch: what goes now, what goes back and when."""

    admitted: tuple[StoredMessage, ...]
    #: Released rows (no attempt used), each due again after its delay.
    held: tuple[Decision, ...] = ()


def plan(
    messages: Sequence[StoredMessage],
    flow_name: Callable[[str], str | None],
    grants: Mapping[str, Grant],
) -> Admission:
    """Admit each flow's first ``granted`` rows (id order); hold the rest, paced.

    The k-th held row of a flow is due again after ``wait + k * pace``: the rows come
    back spread over the time the window frees, not all at once. A keyed row after
    a held row of its key is held too (delay 0: the claim takes a key's rows in
    order), so that holding never reorders a key.
    """
    taken: dict[str, int] = {}
    held: list[Decision] = []
    stopped: set[str] = set()
    admitted: list[StoredMessage] = []
    for message in sorted(messages, key=lambda m: m.id):
        key = message.envelope.ordering_key
        name = flow_name(message.envelope.task_name)
        if key is not None and key in stopped:
            held.append(Decision(message.id, Action.RELEASE, 0.0, _behind(key)))
            continue
        if name is not None:
            found = grants[name]
            done = taken.get(name, 0)
            taken[name] = done + 1
            if done >= found.granted:
                late = done - found.granted
                delay = found.wait + late * found.pace
                held.append(
                    Decision(message.id, Action.RELEASE, delay, _held(name, found))
                )
                if key is not None:
                    stopped.add(key)
                continue
        admitted.append(message)
    return Admission(tuple(admitted), tuple(held))


def _held(name: str, found: Grant) -> str:
    return f"held by flow {name!r} ({rates_text(found.rates)})"


def _behind(key: str) -> str:
    return f"held behind the held row before it in ordering key {key!r}"


@dataclass(frozen=True)
class FlowStats:
    """One flow as an operator sees it (``outbox flows stats``)."""

    name: str
    tasks: tuple[str, ...]
    #: The rates in force: an operator's change, else the settings'.
    rates: tuple[Rate, ...]
    #: Whether ``rates`` is an operator's change (``outbox flows rate``).
    changed: bool
    #: Rows of the flow's tasks in the outbox (due, held back, leased or retrying).
    waiting: int
    #: Publishes recorded in the last 60 seconds, all relays together.
    published_last_minute: int

    def as_dict(self) -> dict[str, Any]:
        """The stats as JSON-ready values."""
        return {
            "name": self.name,
            "tasks": list(self.tasks),
            "rates": [str(rate) for rate in self.rates],
            "changed": self.changed,
            "waiting": self.waiting,
            "published_last_minute": self.published_last_minute,
        }


def rates_in_force(flow: Flow, changed: str | None) -> tuple[Rate, ...]:
    """An operator's rates (as stored, ``rates_text``) if any, else the flow's own.

    A stored text that no longer reads (edited by hand) is ignored: the settings'
    rates hold.
    """
    if not changed:
        return flow.rates
    try:
        return parse_rates([part.strip() for part in changed.split(",")])
    except ValueError:
        return flow.rates
