"""What the subscribers of the events part's services ran, kept in Redis.

The services (``bench.events_services``) write, the driver (``bench.events_e2e``)
reads: one Redis list per service and kind, named after the run's events exchange,
of ``<number> <monotonic time>`` entries (every process of the run shares the
machine's monotonic clock).
"""

from __future__ import annotations

import time

import redis

from bench import env

#: The lists subscribers record into: events handled, probe attempts.
HANDLED = "handled"
PROBED = "probed"

_clients: dict[str, redis.Redis] = {}


def service_name(name: str) -> str:
    """A service's app name in the events part."""
    return f"bench-{name}"


class Records:
    """The records of one run (one events exchange), on the bench's Redis."""

    def __init__(self, exchange: str) -> None:
        self.exchange = exchange
        client = _clients.get(env.REDIS_URL)
        if client is None:
            client = _clients[env.REDIS_URL] = redis.Redis.from_url(env.REDIS_URL)
        self.client = client

    def key(self, service: str, kind: str) -> str:
        """The list of ``service``'s records of ``kind`` (HANDLED or PROBED)."""
        return f"{self.exchange}:{service}:{kind}"

    def add(self, service: str, kind: str, number: int) -> None:
        """Record that ``service`` ran event ``number``, now."""
        self.client.rpush(self.key(service, kind), f"{number} {time.monotonic():.6f}")

    def attempt(self, service: str, number: int) -> int:
        """Count one more attempt of probe ``number``; returns the count."""
        return int(self.client.incr(f"{self.key(service, PROBED)}:{number}"))

    def count(self, service: str, kind: str) -> int:
        """How many records the list holds."""
        return int(self.client.llen(self.key(service, kind)))

    def clear(self, service: str, kind: str) -> None:
        """Empty the list."""
        self.client.delete(self.key(service, kind))

    def read(self, service: str, kind: str) -> list[tuple[int, float]]:
        """Every record of the list: (event number, monotonic time)."""
        entries = self.client.lrange(self.key(service, kind), 0, -1)
        pairs = (
            (entry.decode() if isinstance(entry, bytes) else str(entry)).split()
            for entry in entries
        )
        return [(int(number), float(at)) for number, at in pairs]

    def forget(self) -> None:
        """Delete every key of the run."""
        for key in self.client.scan_iter(f"{self.exchange}:*"):
            self.client.delete(key)
