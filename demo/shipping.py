"""The shipping service's app: ``celery -A demo.shipping worker``."""

from __future__ import annotations

from demo.services import service

app = service("shipping")
