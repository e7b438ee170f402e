"""Flow control's values: a flow's rates and limits per key, and the decisions over
them, as pure functions (no database, no clock). The settings, the stores and the
engine read them; the flow lane (:mod:`celery_outbox.flow`) applies them.

* :func:`parse_rate` and :func:`parse_flows`: ``CELERY_OUTBOX_FLOWS`` read and checked;
* :func:`use_of`: how much of one rate's sliding window the publish records use;
* :func:`grant`: how many of the wanted rows the rates let through now, and when
  the window takes more;
* :func:`by_key`: which rows of a flow's keys their limits let go now, round-robin
  between the keys, and which wait for a slot of their key.

Which claimed rows go to the broker and which go back, with when, is the flow
gate's :func:`~celery_outbox.flow.gate.plan`.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

#: The window of each unit a rate may name, in seconds.
UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

#: The keys a flow's entry in ``CELERY_OUTBOX_FLOWS`` takes.
FLOW_KEYS = ("tasks", "rate", "running", "queued", "keys", "lease")
#: The limits a flow sets on each of its keys (and ``keys`` on some of them).
LIMIT_KEYS = ("running", "queued")
#: What a flow needs at least one of.
POLICY_KEYS = ("rate", "running", "queued", "keys")

#: The header that carries a task's flow key (``flow_key=``) to the relay and the worker.
KEY_HEADER = "outbox_flow_key"
#: The header that names the flow of a keyed task, for the worker's reports.
FLOW_HEADER = "outbox_flow"
#: The longest flow key (the column's length).
KEY_LIMIT = 255
#: Seconds a slot of a key stays taken without its worker's report (the default of
#: a flow's ``lease``): a worker killed mid-task frees its slot then.
SLOT_LEASE = 300.0

#: The longest flow name (the primary key of its row).
NAME_LIMIT = 255

_RATE = re.compile(r"\s*(\d+)\s*/\s*([a-z]+)\s*")

_EXAMPLE = (
    "e.g. {'partner': {'tasks': ['shop.call_partner', 'shop.sync_*'], "
    "'rate': ['10/s', '100000/d'], 'running': 2}}"
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
class KeyLimit:
    """What one key of a flow may have at once; None: no such limit."""

    #: Published and not finished (the worker reports the end).
    running: int | None = None
    #: Published and not started (the worker reports the start): how many of the
    #: key's tasks the broker's queue holds at most, so that the keys take turns.
    queued: int | None = None

    def over(self, other: KeyLimit) -> KeyLimit:
        """This limit with ``other``'s values where ``other`` sets one."""
        return KeyLimit(
            self.running if other.running is None else other.running,
            self.queued if other.queued is None else other.queued,
        )

    def as_dict(self) -> dict[str, int]:
        """The limits set, as the setting writes them."""
        return {
            name: value
            for name, value in (("running", self.running), ("queued", self.queued))
            if value is not None
        }

    def __str__(self) -> str:
        return ", ".join(f"{n} {v}" for n, v in self.as_dict().items()) or "none"


@dataclass(frozen=True)
class Limits:
    """A flow's limits per key: one for every key, and others for keys that match."""

    every: KeyLimit = KeyLimit()
    #: ``(key or glob pattern, limit)``: the first that matches a key adds to
    #: ``every`` (a premium tenant 10 running, the others 1).
    keys: tuple[tuple[str, KeyLimit], ...] = ()

    def __bool__(self) -> bool:
        return self.every != KeyLimit() or bool(self.keys)

    @property
    def counts_starts(self) -> bool:
        """Whether any key's limit needs the worker's report of a start (``queued``)."""
        return self.every.queued is not None or any(
            limit.queued is not None for _, limit in self.keys
        )

    def of(self, key: str) -> KeyLimit:
        """The limit of ``key``: the first of :attr:`keys` that matches it, in the
        order stored (:meth:`put` puts an operator's key first)."""
        for pattern, limit in self.keys:
            if fnmatchcase(key, pattern):
                return self.every.over(limit)
        return self.every

    def put(self, pattern: str, change: KeyLimit) -> Limits:
        """These limits with ``change`` over ``pattern``'s own, and ``pattern`` first:
        the key an operator names last is the one :meth:`of` finds first, so the
        limit a command prints is the one its keys get. The others keep their order."""
        own = dict(self.keys).get(pattern, KeyLimit()).over(change)
        others = tuple((p, limit) for p, limit in self.keys if p != pattern)
        return Limits(self.every, ((pattern, own), *others))

    def without(self, pattern: str) -> Limits:
        """These limits with ``pattern``'s own dropped, the others in their order."""
        return Limits(
            self.every, tuple((p, lim) for p, lim in self.keys if p != pattern)
        )

    def as_dict(self) -> dict[str, Any]:
        """The limits as the setting writes them (``running``, ``queued``, ``keys``)."""
        found: dict[str, Any] = dict(self.every.as_dict())
        if self.keys:
            found["keys"] = {pattern: limit.as_dict() for pattern, limit in self.keys}
        return found

    def text(self) -> str:
        """JSON text of :meth:`as_dict`, as an operator's change is stored: the keys
        in their order, which is the order :meth:`of` reads them in."""
        return json.dumps(self.as_dict())

    def __str__(self) -> str:
        parts = [str(self.every)] if self.every != KeyLimit() else []
        parts += [f"{pattern}: {limit}" for pattern, limit in self.keys]
        return "; ".join(parts) or "none"


@dataclass(frozen=True)
class Flow:
    """Tasks that share limits for the whole deployment, however many relays run."""

    name: str
    #: Task names or glob patterns (``fnmatch``, case counts).
    tasks: tuple[str, ...]
    rates: tuple[Rate, ...] = ()
    #: Limits per flow key (``flow_key=``); none: the rates alone.
    limits: Limits = field(default_factory=Limits)
    #: Seconds a key's slot stays taken without its worker's report.
    lease: float = SLOT_LEASE

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
            f"is a dict with the key 'tasks' and a limit ('rate', 'running', "
            f"'queued') ({_EXAMPLE}), got {entry!r}"
        )
    _refuse_unknown(entry, FLOW_KEYS, _EXAMPLE)
    if "tasks" not in entry or not any(key in entry for key in POLICY_KEYS):
        raise ValueError(
            f"needs 'tasks' and at least one limit: 'rate', 'running' or 'queued' "
            f"({_EXAMPLE})"
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
    rates = parse_rates(entry["rate"]) if "rate" in entry else ()
    return Flow(
        name,
        tuple(tasks),
        rates,
        parse_limits(entry),
        _lease(entry.get("lease", SLOT_LEASE)),
    )


def _refuse_unknown(
    entry: Mapping[str, Any], known: Sequence[str], example: str
) -> None:
    unknown = sorted(set(map(str, entry)) - set(known))
    if unknown:
        raise ValueError(
            f"takes the keys {', '.join(known)}; unknown: {unknown} ({example})"
        )


_LIMITS_EXAMPLE = "e.g. {'running': 2, 'keys': {'premium-*': {'running': 10}}}"


def read_limits(value: Any) -> Limits:
    """An operator's limits per key (``outbox flows limit``, the admin), checked as
    the setting's are: a dict of ``running``, ``queued`` and ``keys`` that sets at
    least one limit.

    Raises :class:`ValueError` saying what is wrong and what to write instead.
    """
    if not isinstance(value, Mapping):
        raise ValueError(
            f"limits per key are a dict ({_LIMITS_EXAMPLE}), got {value!r}"
        )
    _refuse_unknown(value, (*LIMIT_KEYS, "keys"), _LIMITS_EXAMPLE)
    limits = parse_limits(value)
    if not limits:
        raise ValueError(
            f"{value!r} sets no limit: give 'running', 'queued' or 'keys' "
            f"({_LIMITS_EXAMPLE}); to go back to the settings' limits, store none"
        )
    return limits


def changeable(flow: Flow | None, name: str) -> Flow:
    """``flow`` (the settings' flow ``name``) when an operator may change its limits
    per key: it has some in the settings, so its relays decide per key and its
    workers report. Raises :class:`ValueError` naming the fix."""
    if flow is None:
        raise ValueError(f"No flow {name!r} in CELERY_OUTBOX_FLOWS")
    if not flow.limits:
        raise ValueError(
            f"Flow {name!r} has no limits per key in CELERY_OUTBOX_FLOWS: add "
            f"'running' or 'queued' to it there first (its workers report the "
            f"starts and ends of its keys' tasks only then); 'outbox flows rate' "
            f"changes its rates"
        )
    return flow


def parse_limits(entry: Mapping[str, Any]) -> Limits:
    """A flow's ``running``, ``queued`` and ``keys`` (any may be missing) as Limits.

    Raises :class:`ValueError` saying what is wrong and what to write instead.
    """
    every = _key_limit(entry, "")
    keys = entry.get("keys") or {}
    if not isinstance(keys, Mapping):
        raise ValueError(
            f"'keys' is a dict of limits by flow key or glob pattern, e.g. "
            f"{{'premium-*': {{'running': 10}}}}, got {keys!r}"
        )
    found = []
    for pattern, limit in keys.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(
                f"'keys' is keyed by flow keys or glob patterns (texts such as "
                f"'premium-*'), got {pattern!r}"
            )
        if not isinstance(limit, Mapping) or set(map(str, limit)) - set(LIMIT_KEYS):
            raise ValueError(
                f"'keys' {pattern!r}: a dict with 'running' and/or 'queued', e.g. "
                f"{{'running': 10}}, got {limit!r}"
            )
        found.append((pattern, _key_limit(limit, f"'keys' {pattern!r}: ")))
    return Limits(every, tuple(found))


def _key_limit(entry: Mapping[str, Any], where: str) -> KeyLimit:
    values: dict[str, int] = {}
    for name in LIMIT_KEYS:
        value = entry.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"{where}'{name}' is a whole number of at least 1 (tasks of one key "
                f"at once), got {value!r}; to stop a flow's tasks, use 'outbox "
                f"tasks pause'"
            )
        values[name] = value
    return KeyLimit(**values)


def _lease(value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 < value < 366 * 86400
    ):
        raise ValueError(
            f"'lease' is the seconds a key's slot stays taken without its worker's "
            f"report (e.g. 300, more than the longest run of the flow's tasks), "
            f"got {value!r}"
        )
    return float(value)


def limits_in_force(flow: Flow, changed: str | None) -> Limits:
    """An operator's limits (as stored, :meth:`Limits.text`) if any, else the flow's.

    A stored text that no longer reads (edited by hand) is ignored: the settings'
    limits hold.
    """
    if not changed:
        return flow.limits
    try:
        return read_limits(json.loads(changed))
    except ValueError:
        return flow.limits


def check_key(value: Any, where: str) -> str:
    """A call's ``flow_key`` as stored: a text of 1 to :data:`KEY_LIMIT` characters.

    Raises :class:`ValueError` naming the mistake and the fix.
    """
    if not isinstance(value, str) or not value or len(value) > KEY_LIMIT:
        raise ValueError(
            f"{where}: flow_key must be a text of 1 to {KEY_LIMIT} characters (a "
            f"tenant's id as str(), say), got {value!r}. Nothing was written."
        )
    return value


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
class KeyUse:
    """A key's slots taken when a decision is made (every relay's, not expired)."""

    #: Published and not finished.
    running: int = 0
    #: Published and not started (part of ``running``).
    queued: int = 0


@dataclass(frozen=True)
class Candidate:
    """A claimed row of a flow, as its decision sees it."""

    id: int
    #: Its flow key (``flow_key=``); None: the key limits do not apply to it.
    key: str | None
    task_id: str = ""
    #: The broker queue it goes to (the one its slot asks the depth of).
    queue: str = ""


@dataclass(frozen=True)
class Unstarted:
    """A slot of a published task that no worker has reported started."""

    #: The slot's id: a task published later has a larger one.
    id: int
    key: str
    queue: str
    #: Past its lease: its task may have left the queue without a report.
    overdue: bool


def outlived(
    slots: Sequence[Unstarted], depths: Mapping[str, int] | None
) -> tuple[tuple[Unstarted, ...], tuple[Unstarted, ...]]:
    """Which overdue slots of ``slots`` (a flow's unstarted ones) stay and which
    free, given how many messages wait in each of their queues (``depths``).

    A queue hands its messages out oldest first, so the tasks it still holds are
    the flow's newest unstarted ones on it, as many as it holds: an overdue slot
    among them waits in the queue and stays (counted as ``queued`` however long it
    waits); an older one has left the queue without a start report (a lost
    message, a lost report, a worker that cannot report, a prefetch held past the
    lease) and frees. Other tasks in the same queue make the guess keep more, never
    free a waiting one. ``depths`` None: the broker cannot count its queues, and
    every overdue slot frees (the lease alone).
    """
    keep: list[Unstarted] = []
    free: list[Unstarted] = []
    left = dict(depths or {})
    for slot in sorted(slots, key=lambda s: s.id, reverse=True):
        waiting = left.get(slot.queue, 0) > 0
        if waiting:
            left[slot.queue] -= 1
        if slot.overdue:
            (keep if waiting else free).append(slot)
    return tuple(keep), tuple(free)


@dataclass(frozen=True)
class ByKey:
    """The rows of a flow its key limits let go, and those that wait for a slot."""

    #: Rows free to go, round-robin between their keys (each key's in id order).
    free: tuple[Candidate, ...]
    #: Rows whose key is at a limit: they wait for a slot of their key.
    waiting: tuple[Candidate, ...] = ()


def by_key(
    candidates: Sequence[Candidate], limits: Limits, uses: Mapping[str, KeyUse]
) -> ByKey:
    """Which of a flow's rows their keys' limits let go now; round-robin order.

    A key's rows go while its running and queued counts (``uses``, plus the rows
    this decision lets go) stay under its limits; the rest wait. The rows that go
    are ordered key by key in turns (each key's first row, then each key's second
    ...), so that a rate that takes only some of them shares its room between
    the keys instead of giving it to the oldest key's backlog. Rows with no key
    go first, in id order.
    """
    unkeyed: list[Candidate] = []
    lanes: dict[str, list[Candidate]] = {}
    waiting: list[Candidate] = []
    for row in sorted(candidates, key=lambda c: c.id):
        if row.key is None:
            unkeyed.append(row)
            continue
        limit = limits.of(row.key)
        use = uses.get(row.key, KeyUse())
        taken = len(lanes.setdefault(row.key, []))
        if (limit.running is not None and use.running + taken >= limit.running) or (
            limit.queued is not None and use.queued + taken >= limit.queued
        ):
            waiting.append(row)
            continue
        lanes[row.key].append(row)
    turns: list[Candidate] = []
    depth = max((len(rows) for rows in lanes.values()), default=0)
    for turn in range(depth):
        turns.extend(rows[turn] for rows in lanes.values() if turn < len(rows))
    return ByKey((*unkeyed, *turns), tuple(waiting))


def frees_a_place(limits: Limits, key: str, started: Sequence[bool]) -> bool:
    """Whether the end of a task of ``key`` whose slots were ``started`` (none:
    its slot is gone, expired) frees a place a waiting row may take. A started
    task holds a place of the ``running`` limit only: with a ``queued`` limit
    alone its end frees none, and a row woken for it would only wait again."""
    return limits.of(key).running is not None or not started or not all(started)


@dataclass(frozen=True)
class Decided:
    """A flow's decision for the rows of one batch."""

    #: What the rates let through of ``free``.
    grant: Grant
    #: The rows free to go, in the order the grant takes them (:func:`by_key`).
    free: tuple[int, ...]
    #: Rows put back to wait for a slot of their key (done by the store).
    waiting: tuple[int, ...] = ()
    #: The queues of the flow's unstarted slots past their lease, still counted:
    #: the gate asks the broker how many messages they hold (:func:`outlived`).
    overdue: tuple[str, ...] = ()


#: How the reason a flow records on every row it holds back begins: the store
#: counts these rows as held, not unsent (:class:`~celery_outbox.store.types.Leftover`).
HELD_PREFIX = "held "


def waiting_reason(flow: str, key: str) -> str:
    """The ``last_error`` of a row put back to wait for a slot of its key."""
    return f"waiting for a slot of key {key!r} in flow {flow!r}"


def held_reason(flow: str, rates: Iterable[Rate]) -> str:
    """The ``last_error`` of a row a flow's ``rates`` hold back."""
    return f"{HELD_PREFIX}by flow {flow!r} ({rates_text(rates)})"


def behind_reason(key: str) -> str:
    """The ``last_error`` of a row held behind a held row of its ordering key."""
    return f"{HELD_PREFIX}behind the held row before it in ordering key {key!r}"


def holder(reason: str, key: str | None) -> str | None:
    """The flow a row's ``last_error`` says parked it (``key``: its ``flow_key``)
    or, with no key, held it by its rates; None when it names none. The reverse of
    :func:`waiting_reason` and :func:`held_reason`: the name is the ``repr``
    they wrote (a rate's text has no parenthesis, so the last ``" ("`` ends it)."""
    if key is not None:
        prefix = f"waiting for a slot of key {key!r} in flow "
    else:
        prefix = f"{HELD_PREFIX}by flow "
    if not reason.startswith(prefix):
        return None
    written = reason[len(prefix) :]
    if key is None:
        written = written.rsplit(" (", 1)[0]
    try:
        name = ast.literal_eval(written)
    except (ValueError, SyntaxError):
        return None  # cut to the column's length, or not ours
    return name if isinstance(name, str) else None


@dataclass(frozen=True)
class Holding:
    """A row a flow put back: parked for a slot of its key, or held by its rates."""

    id: int
    task_name: str
    #: The flow its ``last_error`` names (:func:`holder`).
    flow: str
    #: Parked for a slot (a report wakes it); else held by the flow's rates.
    parked: bool


def stale(
    flows: tuple[Flow, ...],
    holdings: Iterable[Holding],
    rates: Mapping[str, str | None],
) -> tuple[Holding, ...]:
    """The rows no flow of the settings would hold as they are held: the flow that
    covers the task now is another or none, or it no longer has limits per key (for a
    parked row: no relay decides per key, no report wakes it) or rates in force (for
    a held row; ``rates``: the operator's by flow name). The rest stay as they are."""
    found = []
    for row in holdings:
        now = flow_of(flows, row.task_name)
        if (
            now is None
            or now.name != row.flow
            or (row.parked and not now.limits)
            or (not row.parked and not rates_in_force(now, rates.get(now.name)))
        ):
            found.append(row)
    return tuple(found)


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
    #: The limits per key in force: an operator's change, else the settings'.
    limits: Limits = field(default_factory=Limits)
    #: Whether ``limits`` is an operator's change (``outbox flows limit``).
    limits_changed: bool = False
    #: Slots taken, all keys: published and not finished.
    running: int = 0
    #: Of those, published and not started.
    queued: int = 0
    #: The busiest keys: most running, then most waiting.
    keys: tuple[KeyStats, ...] = ()
    #: Rows the flow parked (its name in their ``last_error``), every key.
    parked: int = 0
    #: False for a flow no longer in the settings whose parked rows are left (a
    #: relay's start releases them).
    configured: bool = True

    def as_dict(self) -> dict[str, Any]:
        """The stats as JSON-ready values."""
        return {
            "name": self.name,
            "tasks": list(self.tasks),
            "rates": [str(rate) for rate in self.rates],
            "changed": self.changed,
            "limits": self.limits.as_dict(),
            "limits_changed": self.limits_changed,
            "waiting": self.waiting,
            "published_last_minute": self.published_last_minute,
            "running": self.running,
            "queued": self.queued,
            "keys": [key.as_dict() for key in self.keys],
            "parked": self.parked,
            "configured": self.configured,
        }


@dataclass(frozen=True)
class KeyStats:
    """One flow key as an operator sees it."""

    key: str
    #: Published and not finished (its slots).
    running: int
    #: Published and not started.
    queued: int
    #: Rows put back to wait for a slot of the key.
    waiting: int
    #: The key's limits in force.
    limit: KeyLimit

    def as_dict(self) -> dict[str, Any]:
        """The stats as JSON-ready values."""
        return {
            "key": self.key,
            "running": self.running,
            "queued": self.queued,
            "waiting": self.waiting,
            "limit": self.limit.as_dict(),
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
