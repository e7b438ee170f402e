"""An in-memory publisher: a real implementation of the interface for tests and the plugin."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from ..envelope import Envelope, StoredMessage
from ..outcomes import Outcome, PublishResult
from .base import Budget


class InMemoryPublisher:
    """Keeps published envelopes in a list.

    ``behaviour`` decides each message's outcome (default: published); tests use it to
    simulate a broker that refuses some messages or is down.
    """

    def __init__(
        self, behaviour: Callable[[StoredMessage], PublishResult | None] | None = None
    ) -> None:
        self.published: list[Envelope] = []
        self.behaviour = behaviour
        self.down = False
        self._lock = threading.Lock()

    def publish(
        self, messages: Sequence[StoredMessage], budget: Budget
    ) -> list[PublishResult]:
        """Record each message unless ``down`` or ``behaviour`` says otherwise."""
        results: list[PublishResult] = []
        with self._lock:
            for message in messages:
                if not budget.keep_going():
                    results.append(PublishResult(message.id, Outcome.NOT_SENT))
                    continue
                if self.down:
                    results.append(
                        PublishResult(
                            message.id, Outcome.OUTAGE, "ConnectionRefusedError: down"
                        )
                    )
                    continue
                result = self.behaviour(message) if self.behaviour else None
                if result is None:
                    self.published.append(message.envelope)
                    result = PublishResult(message.id, Outcome.PUBLISHED)
                results.append(result)
        return results

    def depth(self, queues: Sequence[str]) -> dict[str, int]:
        """The messages of each of ``queues`` in :attr:`published` (a test takes
        out what a worker received or the broker lost); raises while ``down``."""
        self.ping()
        with self._lock:
            return {
                name: sum(1 for e in self.published if e.queue == name)
                for name in queues
            }

    def ping(self) -> None:
        """Raise while ``down``."""
        if self.down:
            raise ConnectionRefusedError("in-memory broker is down")

    def close(self) -> None:
        """Nothing to close."""

    def task_names(self) -> list[str]:
        """Names of the published tasks, in order."""
        return [e.task_name for e in self.published]
