from __future__ import annotations

from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "tests.project.shop"
    label = "shop"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # The handler processors that tests start as subprocesses need the receiver.
        from . import receivers  # noqa: F401
