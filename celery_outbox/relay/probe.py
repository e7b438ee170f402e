"""The relay's start-up probe: where it connects, and whether that works.

Run once before the loop starts, it logs one line for the outbox database and one for
the broker, each naming the target (the broker URL with its password masked; the
database's vendor, host, port and name) and the outcome. A broker that cannot be
reached is a warning: the relay starts anyway and its outage handling takes over. A
database that cannot be reached stops the relay, as before, after saying where it is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.db import connections
from kombu.utils.url import maybe_sanitize_url

from ..broker import Publisher
from ..broker.base import explain
from ..exceptions import OutboxError
from ..store.store import RelayQueries

logger = logging.getLogger("celery_outbox.relay")


@dataclass(frozen=True)
class Probe:
    """What one probe reached, and what it said if it failed."""

    target: str
    error: str | None = None
    #: The failure itself, for a caller that must stop on it.
    failure: Exception | None = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        """Whether the target answered."""
        return self.error is None


def broker_location(app: Any) -> str:
    """The app's broker URL(s) as an operator would check them, passwords masked."""
    url = app.conf.broker_write_url or app.conf.broker_url
    if not url:  # Celery's default broker
        return str(app.connection_for_write().as_uri())
    urls: Iterable[str] = url.split(";") if isinstance(url, str) else url
    return ";".join(str(maybe_sanitize_url(str(u).strip())) for u in urls)


def database_location(alias: str) -> str:
    """``'default' (postgresql at db:5432, database 'app')``: never the password."""
    connection = connections[alias]
    settings = connection.settings_dict
    name = settings.get("NAME") or ""
    if connection.vendor == "sqlite":
        return f"{alias!r} (sqlite, file {str(name)!r})"
    host = settings.get("HOST") or "localhost"
    port = settings.get("PORT")
    at = f"{host}:{port}" if port else str(host)
    return f"{alias!r} ({connection.vendor} at {at}, database {str(name)!r})"


def probe_database(store: RelayQueries) -> Probe:
    """Ask the outbox database for its tables once; log where it is and how it went."""
    where = database_location(store.alias)
    try:
        store.dialect  # noqa: B018 - refuses an unsupported database
        store.ping()
    except OutboxError as exc:
        logger.error("outbox database %s: not usable: %s", where, exc)
        return Probe(where, str(exc), exc)
    logger.info("outbox database %s: connected", where)
    return Probe(where)


def probe_broker(publisher: Publisher, where: str) -> Probe:
    """Connect to the broker once; a failure is logged and the relay goes on."""
    try:
        node = publisher.ping()
    except Exception as exc:  # every failure is worth a line; none stops the relay
        publisher.close()
        error = explain(exc)
        logger.warning(
            "broker %s: not reachable at start: %s. The relay starts anyway and "
            "retries as for any outage (no attempt used).",
            where,
            error,
        )
        return Probe(where, error, exc)
    if node and ";" in where:  # a failover list: say which node answered
        logger.info("broker %s: connected to node %s", where, node)
    else:
        logger.info("broker %s: connected", where)
    return Probe(where)
