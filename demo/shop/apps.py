from __future__ import annotations

from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "demo.shop"
    # A label of its own, so the demo's tables never clash with another project's
    # "shop" app when both share a database.
    label = "demo_shop"
    verbose_name = "Demo shop"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Receivers must be registered in every process that may run them.
        from . import receivers  # noqa: F401
