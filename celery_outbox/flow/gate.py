"""The flow gate: a claimed batch's rows of each flow, as many as its limits allow.

Rows of no flow go through without a query. For each flow with rows in the batch,
one transaction decides and records how many may go: a reservation of the rates
(:meth:`~celery_outbox.store.protocol.FlowStore.reserve`), or, for a flow with
limits per key, a decision (:meth:`~celery_outbox.store.protocol.FlowStore.decide`)
that also takes the keys' slots and puts back the rows whose key is at a limit.
:func:`plan` picks the rows that go and paces the rest.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Mapping, Sequence

from ..conf import OutboxSettings
from ..engine.gate import RUNNING_SECONDS, Admission, Gate
from ..envelope import StoredMessage
from ..exceptions import OutboxDatabaseError
from ..flow_limits import (
    FLOW_HEADER,
    KEY_HEADER,
    Candidate,
    Decided,
    Flow,
    behind_reason,
    flow_of,
    held_reason,
)
from ..ordering.gate import KeyGate
from ..outcomes import Action, Decision, Settlement
from ..store.protocol import FlowStore

logger = logging.getLogger("celery_outbox.flow")


class FlowGate(KeyGate):
    """Applies ``flows`` on the state ``store`` keeps (the same for every relay),
    and ordered keys' policy after the publish."""

    def __init__(
        self,
        flows: Sequence[Flow],
        store: FlowStore,
        running_seconds: float = RUNNING_SECONDS,
        depth: Callable[[Sequence[str]], Mapping[str, int]] | None = None,
    ) -> None:
        """``depth`` counts the messages waiting in the broker's queues (the
        publisher's); without it a slot whose task did not start frees at its lease."""
        super().__init__(running_seconds)
        self.flows = tuple(flows)
        self.store = store
        self.depth = depth
        self._by_name = {flow.name: flow for flow in self.flows}

    def flow_name(self, task_name: str) -> str | None:
        """The name of the flow that covers ``task_name``; None when none does."""
        found = flow_of(self.flows, task_name)
        return None if found is None else found.name

    def admit(self, messages: Sequence[StoredMessage], token: str = "") -> Admission:
        """The rows the flows let through now; the rest released, paced, or put
        back (under the claim's ``token``) to wait for a slot of their key."""
        wanted: dict[str, list[Candidate]] = {}
        for message in messages:
            name = self.flow_name(message.envelope.task_name)
            if name is not None:
                wanted.setdefault(name, []).append(candidate(message))
        if not wanted:
            return Admission(tuple(messages))
        # One transaction per flow, in name order, each short: no relay holds one
        # flow's lock while it waits for another's.
        decisions: dict[str, Decided] = {}
        slotted: set[str] = set()
        for name, rows in sorted(wanted.items()):
            flow = self._by_name[name]
            if flow.limits and token:
                decisions[name] = self.store.decide(flow, rows, token)
                slotted.add(name)
                if decisions[name].overdue:
                    self._outlived(flow, decisions[name].overdue)
            else:
                found = self.store.reserve(flow, len(rows))
                decisions[name] = Decided(found, tuple(c.id for c in rows))
        admission = plan(messages, self.flow_name, decisions)
        return self._named(admission, slotted) if slotted else admission

    def settled(
        self, settlement: Settlement, published: Sequence[StoredMessage]
    ) -> Settlement:
        """Ordered keys' settlement, after freeing the slots of the rows that took
        one and did not reach the broker (refused, dead-lettered, put back by an
        outage or a shutdown): no worker will report them. A row that comes back
        takes a slot again when it is decided again.

        Freed in a transaction of their own, before the settlement's: the flow
        store holds the flows' locks and wakes the keys' parked rows, which the
        relay's settlement knows nothing of. Freed first, a crash between the two
        leaves a leased row that takes its slot again when it comes back; a
        database error leaves the slots to their lease, as before.
        """
        found = super().settled(settlement, published)
        went = {*found.delete, *(d.message_id for d in found.hold)}
        unsent: dict[str, list[Candidate]] = {}
        for message in published:
            name = self.flow_name(message.envelope.task_name)
            row = candidate(message)
            if message.id in went or row.key is None or name is None:
                continue
            if self._by_name[name].limits:
                unsent.setdefault(name, []).append(row)
        for name, rows in sorted(unsent.items()):
            try:
                self.store.not_published(self._by_name[name], rows)
            except OutboxDatabaseError as exc:
                self.store.reset_connection()
                logger.warning(
                    "flow %r: cannot free the slots of %d rows the broker did not "
                    "take (%s); they free at the flow's lease",
                    name,
                    len(rows),
                    exc,
                )
        return found

    def _outlived(self, flow: Flow, queues: Sequence[str]) -> None:
        """Settle ``flow``'s unstarted slots past their lease by what ``queues``
        hold now (:func:`~celery_outbox.flow_limits.outlived`): a task that waits in its queue keeps
        its slot however long it waits; one that left the queue unreported frees
        its own. A broker that cannot be asked now keeps them all another lease."""
        named = [queue for queue in queues if queue]
        depths: Mapping[str, int] | None = None
        if self.depth is not None:
            try:
                depths = self.depth(named) if named else {}
            except Exception as exc:
                logger.warning(
                    "flow %r: cannot count the messages in queues %s (%s); the "
                    "slots of tasks not started in them stay another lease",
                    flow.name,
                    ", ".join(named),
                    exc,
                )
                # Every task may still wait: none of the slots frees.
                depths = dict.fromkeys(named, sys.maxsize)
        try:
            self.store.outlived(flow, depths)
        except OutboxDatabaseError as exc:
            self.store.reset_connection()
            logger.warning(
                "flow %r: cannot settle the slots of tasks not started past their "
                "lease (%s); the next decision tries again",
                flow.name,
                exc,
            )

    def _named(self, admission: Admission, slotted: set[str]) -> Admission:
        """The admitted rows of the ``slotted`` flows (a slot of their key taken)
        naming their flow (:func:`named`)."""
        admitted = []
        for message in admission.admitted:
            name = self.flow_name(message.envelope.task_name)
            admitted.append(named(message, name) if name in slotted else message)
        return dataclasses.replace(admission, admitted=tuple(admitted))


def candidate(message: StoredMessage) -> Candidate:
    """A claimed row as a flow's decision sees it: its id, flow key and task id."""
    envelope = message.envelope
    key = envelope.headers.get(KEY_HEADER)
    return Candidate(
        message.id,
        key if isinstance(key, str) and key else None,
        envelope.task_id,
        envelope.queue,
    )


def named(message: StoredMessage, flow: str) -> StoredMessage:
    """``message`` as it goes out when it took a slot of its key in ``flow``:
    naming ``flow``, and with no time to live in the broker.

    The worker reports its start and end to the flow its headers name, so they
    name the flow whose slot the relay took. The sender named the flow of its own
    settings: none for a row written before the flow was configured (its slot
    would wait for the lease), or another flow under other settings.

    A task sent with ``expires=`` carries it twice: the ``expires`` header, which
    a worker reads (it discards the expired task with ``task_revoked``, whose
    report frees the slot), and a broker TTL (``expiration``), by which RabbitMQ
    drops it unseen, and then no one frees the slot until the lease. The TTL goes;
    the header still expires the task, at the same moment.
    """
    envelope = message.envelope
    if candidate(message).key is None:
        return message
    headers, properties = envelope.headers, envelope.properties
    ttl = "expiration" in properties and headers.get("expires") is not None
    if headers.get(FLOW_HEADER) == flow and not ttl:
        return message
    if ttl:
        properties = {k: v for k, v in properties.items() if k != "expiration"}
    envelope = dataclasses.replace(
        envelope, headers={**headers, FLOW_HEADER: flow}, properties=properties
    )
    return dataclasses.replace(message, envelope=envelope)


def gate_for(
    settings: OutboxSettings,
    store: FlowStore,
    depth: Callable[[Sequence[str]], Mapping[str, int]] | None = None,
) -> Gate:
    """The flow gate when flows are configured; else ordered keys' gate (no query).
    ``depth``: the publisher's count of its queues (:func:`~celery_outbox.broker.base.queue_depth`)."""
    if not settings.flows:
        return KeyGate(settings.strict_lease_seconds)
    return FlowGate(settings.flows, store, settings.strict_lease_seconds, depth)


def reconcile(flows: Sequence[Flow], store: FlowStore) -> dict[str, int]:
    """Release the rows a flow parked or held that ``flows`` (the settings) no
    longer hold so (:meth:`~celery_outbox.store.protocol.FlowStore.reconcile`),
    with a log line per flow that held them; how many, by that flow. Run when a
    relay starts and by ``outbox flows limit``: a state a setting made is
    reconciled with the settings, not left to its lease."""
    released = store.reconcile(flows)
    for name, count in released.items():
        logger.warning(
            "released %d row(s) flow %r had parked or held: the settings no longer "
            "hold them by it (removed, renamed, its limits or rates gone, or the "
            "task now in another flow); they are due now",
            count,
            name,
        )
    return released


def plan(
    messages: Sequence[StoredMessage],
    flow_name: Callable[[str], str | None],
    decisions: Mapping[str, Decided],
) -> Admission:
    """Admit each flow's first ``granted`` free rows; hold the rest, paced.

    The k-th held row of a flow is due again after ``wait + k * pace``: the rows come
    back spread over the time the window frees, not all at once. A row waiting for
    its key's slot was put back by the store. A row with an ordering key after a
    held or waiting row of that key is held too (delay 0: the claim takes a key's
    rows in order), so that holding never reorders a key.
    """
    go: set[int] = set()
    late: dict[int, Decision] = {}
    parked: set[int] = set()
    for name, decided in decisions.items():
        found = decided.grant
        go.update(decided.free[: found.granted])
        for index, row_id in enumerate(decided.free[found.granted :]):
            delay = found.wait + index * found.pace
            late[row_id] = Decision(
                row_id, Action.RELEASE, delay, held_reason(name, found.rates)
            )
        parked.update(decided.waiting)
    held: list[Decision] = []
    stopped: set[str] = set()
    admitted: list[StoredMessage] = []
    for message in sorted(messages, key=lambda m: m.id):
        key = message.envelope.ordering_key
        if message.id in parked:
            if key is not None:
                stopped.add(key)
            continue
        if key is not None and key in stopped:
            held.append(Decision(message.id, Action.RELEASE, 0.0, behind_reason(key)))
            continue
        if message.id in late:
            held.append(late[message.id])
            if key is not None:
                stopped.add(key)
            continue
        if flow_name(message.envelope.task_name) is None or message.id in go:
            admitted.append(message)
    return Admission(tuple(admitted), tuple(held), tuple(sorted(parked)))
