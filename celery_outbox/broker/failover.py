"""Connecting to a broker named by a failover list, the way kombu does it.

Celery names the nodes of a cluster with one URL per node (``"amqp://a//;amqp://b//"``
or a list); kombu's ``Connection`` keeps them as its alternates and orders them by
``broker_failover_strategy`` (round-robin unless set). kombu goes to the next node
when one does not answer, and sleeps only once every node was tried. :func:`connect`
asks kombu for exactly one such round: every node is tried once, in kombu's order,
with no sleep in between, so a node that is down costs one refused connection and a
cluster with no node up is an outage after one pass over its nodes.

The publishers, ``outbox health`` and the ``outbox events`` commands connect through
:func:`connect`; it logs which node answered when the URL names several. When the
node a publisher was connected to goes away in the middle of a batch, the publisher
sends what did not go out once more, on the next node that answers
(:func:`publish_again`), as kombu's ``Producer`` retries a publish on the next
node: an outage is a cluster with no node up, not one node down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..envelope import StoredMessage
from ..outcomes import Outcome, PublishResult
from .base import Budget, explain, underlying

logger = logging.getLogger("celery_outbox.broker")


class NoNodeAnswered(ConnectionError):
    """No node of a failover list answered; :attr:`failures` says why, node by node."""

    def __init__(self, failures: Sequence[tuple[str, BaseException]]) -> None:
        self.failures = tuple(failures)
        reasons = "; ".join(f"{node}: {explain(exc)}" for node, exc in self.failures)
        super().__init__(f"no node of the broker's failover list answered ({reasons})")


def nodes_of(connection: Any) -> int:
    """How many nodes ``connection``'s URL names (1 without a failover list)."""
    return max(len(getattr(connection, "alt", None) or ()), 1)


def node_of(connection: Any) -> str:
    """The node ``connection`` is on (or tries next), as a URL with its password masked."""
    return str(connection.as_uri())


def connect(connection: Any, between: Callable[[], object] | None = None) -> str:
    """Connect ``connection`` to the first node that answers; returns that node.

    Every node of the failover list is tried once, in the order of the connection's
    failover strategy (kombu's own ``ensure_connection`` does the trying and the
    switching). ``between`` is called between two nodes (the relay keeps its leases
    and liveness file fresh there). Raises :class:`NoNodeAnswered` naming every node
    and its reason when none answered; an error kombu does not retry on another node
    (RabbitMQ refusing the credentials, say) is raised as kombu raises it, and so is
    the error of a URL of one node.
    """
    nodes = nodes_of(connection)
    failures: list[tuple[str, BaseException]] = []

    def failed(exc: BaseException, _interval: float) -> None:
        # kombu calls this before it switches to the next node.
        failures.append((node_of(connection), exc))

    try:
        connection.ensure_connection(
            errback=failed,
            max_retries=nodes - 1,
            interval_start=0,
            interval_step=0,
            interval_max=0,
            callback=between,
        )
    except Exception as exc:
        if nodes == 1 or len(failures) + 1 < nodes:
            raise  # one node, or kombu does not try the others on this error
        failures.append((node_of(connection), exc))
        raise NoNodeAnswered(failures) from exc
    node = node_of(connection)
    if nodes > 1:
        for each, error in failures:
            logger.warning("broker node %s did not answer: %s", each, explain(error))
        logger.info(
            "broker node %s: connected (%d of the failover list's %d nodes tried)",
            node,
            len(failures) + 1,
            nodes,
        )
    return node


def node_lost(connection: Any, exc: BaseException) -> bool:
    """Whether ``exc`` broke an open ``connection`` whose URL names other nodes.

    Then what did not go out may be sent at once on the next node that answers. Not
    after a timeout: a slow node may still take what was written to it, and the
    next batch connects anew anyway.
    """
    return (
        connection is not None
        and nodes_of(connection) > 1
        and not isinstance(underlying(exc), TimeoutError)
    )


def time_left(budget: Budget) -> bool:
    """Whether ``budget`` lets a batch start again now (no shutdown, deadline ahead)."""
    return budget.keep_going() and budget.deadline() > time.monotonic()


def publish_on_nodes(
    messages: Sequence[StoredMessage],
    budget: Budget,
    publish: Callable[[Sequence[StoredMessage]], list[PublishResult]],
    node_lost: Callable[[], bool],
) -> list[PublishResult]:
    """``publish(messages)``; when the node went away under it and time is left,
    what did not go out is sent once more on the next node (:func:`publish_again`).

    ``node_lost()`` says whether the publisher's connection broke under its last
    ``publish`` with other nodes to try, and forgets it.
    """
    if not messages:
        return []
    node_lost()  # an earlier batch's is no concern of this one
    results = publish(messages)
    if node_lost() and time_left(budget):
        results = publish_again(messages, results, publish)
        node_lost()
    return results


def publish_again(
    messages: Sequence[StoredMessage],
    results: Sequence[PublishResult],
    publish: Callable[[Sequence[StoredMessage]], list[PublishResult]],
) -> list[PublishResult]:
    """``results``, with the messages an outage left unsent published once more.

    The caller's connection broke under a batch and the URL names other nodes:
    ``publish`` connects again (trying every node) and sends the outage's messages
    there. A message that was in flight when the first connection broke stays marked
    so if the second try is an outage too (a message that breaks every connection is
    found out the same way on one node or several).
    """
    first = {r.message_id: r for r in results}
    again = [m for m in messages if first[m.id].outcome is Outcome.OUTAGE]
    if not again:
        return list(results)
    second = {r.message_id: r for r in publish(again)}
    merged: list[PublishResult] = []
    for result in results:
        retried = second.get(result.message_id)
        if retried is None:
            merged.append(result)
        elif retried.outcome is Outcome.OUTAGE and result.in_flight:
            merged.append(
                PublishResult(
                    retried.message_id, Outcome.OUTAGE, retried.error, in_flight=True
                )
            )
        else:
            merged.append(retried)
    return merged


class OnNodes:
    """A publisher's part that is the same on every transport: the batch published,
    then, when the node of a failover list went away under it, what did not go out
    sent once more on the next node that answers (:func:`publish_on_nodes`).

    The publisher sets ``_node_lost`` when its connection breaks under a batch with
    other nodes to try (:func:`node_lost`), and implements ``_publish``.
    """

    _node_lost = False

    def publish(
        self, messages: Sequence[StoredMessage], budget: Budget
    ) -> list[PublishResult]:
        """Publish a batch, on the next node too when its node went away under it."""
        return publish_on_nodes(
            messages, budget, lambda rest: self._publish(rest, budget), self._take_lost
        )

    def _take_lost(self) -> bool:
        """Whether the node went away under the last batch; forgotten once asked."""
        lost, self._node_lost = self._node_lost, False
        return lost

    def _publish(
        self, messages: Sequence[StoredMessage], budget: Budget
    ) -> list[PublishResult]:
        raise NotImplementedError
