"""Wiring: build a relay from settings, the app and its broker."""

from __future__ import annotations

from typing import Any

from django.db import connections

from ..app import resolve_app
from ..broker import Publisher, build_publisher
from ..conf import OutboxSettings
from ..enqueue import outbox_alias
from ..store import OutboxStore
from ..store.notify import PgNotifyListener
from .config import RelayConfig
from .loop import Relay


def build_relay(
    settings: OutboxSettings, *, publisher: Publisher | None = None, **overrides: Any
) -> Relay:
    """A relay for the configured app and outbox alias; fails early on bad configuration."""
    config = RelayConfig.from_settings(settings, **overrides)
    alias = outbox_alias(settings)
    store = OutboxStore(alias)
    store.dialect  # noqa: B018 - refuses an unsupported database before the loop starts
    connections[alias].ensure_connection()
    if publisher is None:
        publisher = build_publisher(resolve_app(settings), settings)
    wakeup = None
    if settings.notify and connections[alias].vendor == "postgresql":
        wakeup = PgNotifyListener(alias)
    return Relay(store, publisher, config, wakeup=wakeup)
