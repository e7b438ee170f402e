"""The interface every publisher implements, and how broker errors are classified."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

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

    def ping(self) -> str | None:
        """Raise if the broker cannot be reached now (for health probes).

        Returns the node that answered (a URL, its password masked), or None when
        the publisher has no such notion.
        """
        ...

    def close(self) -> None:
        """Drop any connection held."""
        ...


@runtime_checkable
class QueueDepth(Protocol):
    """A publisher that can count the messages waiting in its broker's queues."""

    def depth(self, queues: Sequence[str]) -> dict[str, int]:
        """How many messages wait, ready, in each of ``queues`` (a queue that does
        not exist holds none); raises when the broker cannot be asked now."""
        ...


def queue_depth(
    publisher: object,
) -> Callable[[Sequence[str]], Mapping[str, int]] | None:
    """``publisher``'s way to count its queues; None when it has none."""
    return publisher.depth if isinstance(publisher, QueueDepth) else None


def describe(exc: BaseException) -> str:
    """``Type: message`` for ``last_error`` and logs."""
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}"


def is_outage(
    exc: BaseException, connection_errors: tuple[type[BaseException], ...] = ()
) -> bool:
    """Whether an error means the broker is unreachable rather than refusing a message.

    Everything about the connection rather than a message is an outage: no attempt is
    used and nothing is dead-lettered (see :func:`broker_condition`).
    """
    if broker_condition(exc) is not None:
        return True
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


class ResourceAlarm(Exception):
    """The broker blocked the connection (a memory or disk alarm) while we published."""


#: AMQP reply codes that are about the connection, the credentials or the broker's
#: state, never about one message, and what to do about each.
_AMQP_CONDITIONS = {
    403: (
        "the broker refused the credentials or a permission",
        "check the user and password in CELERY_BROKER_URL and the user's "
        "permissions on the virtual host (rabbitmqctl list_user_permissions)",
    ),
    530: (
        "the broker refused access to the virtual host",
        "check the virtual host in CELERY_BROKER_URL and that the user may use it "
        "(rabbitmqctl set_permissions)",
    ),
    320: (
        "the broker closed the connection (shutdown or an operator)",
        "the relay reconnects once the broker accepts connections again",
    ),
}

#: Redis errors about the server or the credentials, by class name (redis-py's
#: classes; the redis extra is optional, so they are not imported here).
_REDIS_CONDITIONS = {
    "AuthenticationError": (
        "Redis refused the credentials",
        "check the user and password in CELERY_BROKER_URL",
    ),
    "AuthenticationWrongNumberOfArgsError": (
        "Redis refused the credentials",
        "check the user and password in CELERY_BROKER_URL",
    ),
    "NoPermissionError": (
        "the Redis user lacks a permission (ACL)",
        "grant the user the commands and keys the relay uses (ACL SETUSER)",
    ),
    "BusyLoadingError": (
        "Redis is loading its data set",
        "the relay goes on once Redis has loaded it",
    ),
    "ReadOnlyError": (
        "the Redis server is a read-only replica",
        "point CELERY_BROKER_URL at the primary",
    ),
    "MasterDownError": (
        "the Redis replica lost its primary",
        "point CELERY_BROKER_URL at the primary (behind Sentinel the relay "
        "reconnects to the one Sentinel names)",
    ),
    "OutOfMemoryError": (
        "Redis reached its maxmemory and refuses writes",
        "free memory on the Redis server or raise maxmemory",
    ),
}
#: The same for the replies redis-py raises as a plain ``ResponseError`` (all of
#: them before redis-py 5), by the reply's first word.
_REDIS_REPLIES = {
    "NOREPLICAS": (
        "the Redis primary has fewer replicas than its min-replicas-to-write (a "
        "failover under way, or its replicas down)",
        "the relay reconnects; behind Sentinel it finds the new primary",
    ),
    "MASTERDOWN": _REDIS_CONDITIONS["MasterDownError"],
    "OOM": _REDIS_CONDITIONS["OutOfMemoryError"],
    "BUSY": (
        "Redis is busy running a script",
        "the relay goes on once the script ends (SCRIPT KILL stops it)",
    ),
}


def broker_condition(exc: BaseException) -> str | None:
    """Why ``exc`` is the connection's or the broker's problem, or None.

    Wrong credentials, a refused virtual host or permission, a resource alarm, TLS
    errors, a broker shutting down, a Redis replica, a loading, full or busy Redis, a
    Redis primary short of replicas: no message
    is to blame, so these are outages that no message is ever charged for, however
    often they repeat and whatever was in flight. The text says what to check.
    """
    exc = underlying(exc)
    code = getattr(exc, "reply_code", None)
    if type(exc).__module__.startswith("amqp") and code in _AMQP_CONDITIONS:
        what, fix = _AMQP_CONDITIONS[code]
        return f"{what} ({describe(exc)}): {fix}"
    if isinstance(exc, ResourceAlarm):
        return (
            f"the broker blocked publishing ({describe(exc)}): it has a resource "
            f"alarm (memory or disk); see the broker's logs"
        )
    if isinstance(exc, ssl.SSLError):
        return (
            f"the TLS connection to the broker failed ({describe(exc)}): check the "
            f"broker's certificate and the broker_use_ssl settings"
        )
    if type(exc).__module__.startswith("redis"):
        for klass in type(exc).__mro__:
            if klass.__name__ in _REDIS_CONDITIONS:
                what, fix = _REDIS_CONDITIONS[klass.__name__]
                return f"{what} ({describe(exc)}): {fix}"
        if str(exc).startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
            return (
                f"Redis refused the credentials or a permission ({describe(exc)}): "
                f"check the user and password in CELERY_BROKER_URL and its ACL"
            )
        reply = str(exc).split(" ", 1)[0]
        if reply in _REDIS_REPLIES:
            what, fix = _REDIS_REPLIES[reply]
            return f"{what} ({describe(exc)}): {fix}"
    return None


def underlying(exc: BaseException) -> BaseException:
    """The broker's own error when a socket error raised while handling it hid it.

    py-amqp closes the socket when the broker closes the connection; restoring the
    socket's timeout afterwards then fails with ``EBADF`` and replaces the broker's
    reason (``frame_too_large``, ``ACCESS_REFUSED``) with an ``OSError``. kombu
    re-raises a transport's connection errors as its ``OperationalError``.
    """
    if type(exc).__module__.startswith("kombu") and exc.__cause__ is not None:
        return underlying(exc.__cause__)
    context = exc.__context__
    if isinstance(exc, OSError) and type(context).__module__.startswith(
        ("amqp", "redis")
    ):
        assert context is not None
        return context
    return exc


def explain(exc: BaseException) -> str:
    """What to log and store for a failed publish: the reason, and the fix if known."""
    return broker_condition(exc) or describe(underlying(exc))


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
