"""The billing service's app: ``celery -A demo.billing worker``."""

from __future__ import annotations

from demo.services import service

app = service("billing")
