"""The interface every publisher implements, and how broker errors are classified."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any, Protocol

from ..envelope import StoredMessage, as_dict
from ..outcomes import Outcome, PublishResult


class Budget(Protocol):
    """How long a batch may take, and whether to start the next message.

    The relay's budget stops new sends when shutdown begins, shortens the deadline to
    the shutdown timeout, touches the liveness file and renews leases of slow batches.
    """

    def keep_going(self) -> bool:
        """False once no further message should be started (shutdown)."""
        ...

    def deadline(self) -> float:
        """The ``time.monotonic()`` value by which in-flight work must end."""
        ...


class FixedBudget:
    """A budget with a fixed deadline that never stops early."""

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    def keep_going(self) -> bool:
        """Always go on."""
        return True

    def deadline(self) -> float:
        """The deadline given at creation."""
        return self._deadline


class Publisher(Protocol):
    """Publishes a batch of stored messages and says what happened to each.

    ``publish`` never raises for a broker problem: a message the broker refused is
    ``FAILED``, an unreachable broker is ``OUTAGE``, a message not started because
    the budget said stop is ``NOT_SENT``.
    """

    def publish(
        self, messages: Sequence[StoredMessage], budget: Budget
    ) -> list[PublishResult]:
        """Publish ``messages`` in order; one result per message, same order."""
        ...

    def ping(self) -> None:
        """Raise if the broker cannot be reached now (for health probes)."""
        ...

    def close(self) -> None:
        """Drop any connection held."""
        ...


def describe(exc: BaseException) -> str:
    """``Type: message`` for ``last_error`` and logs."""
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


def is_outage(
    exc: BaseException, connection_errors: tuple[type[BaseException], ...] = ()
) -> bool:
    """Whether an error means the broker is unreachable rather than refusing a message."""
    if isinstance(exc, (socket.timeout, TimeoutError, ConnectionError, EOFError)):
        return True
    if isinstance(exc, OSError):
        return True
    if connection_errors and isinstance(exc, connection_errors):
        return True
    try:
        from kombu.exceptions import OperationalError
    except ImportError:  # pragma: no cover - kombu is a dependency
        return False
    if isinstance(exc, OperationalError):
        return True
    try:
        import amqp.exceptions as amqp_errors
    except ImportError:  # pragma: no cover - the amqp transport is optional
        return False
    return isinstance(
        exc, (amqp_errors.RecoverableConnectionError, amqp_errors.ConnectionError)
    )


def all_with(
    messages: Sequence[StoredMessage], outcome: Outcome, error: str = ""
) -> list[PublishResult]:
    """The same outcome for every message."""
    return [PublishResult(m.id, outcome, error) for m in messages]


def envelope_properties(message: StoredMessage) -> dict[str, Any]:
    """AMQP properties of a stored message, without the ones passed separately."""
    properties = as_dict(message.envelope.properties)
    properties.pop("priority", None)
    return properties
