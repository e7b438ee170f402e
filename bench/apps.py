"""The bench's Django app: declares the receiver of the handler latency part."""

from __future__ import annotations

from django.apps import AppConfig


class BenchConfig(AppConfig):
    """``bench``: its models, and the ``bench.latency`` handler receiver."""

    name = "bench"

    def ready(self) -> None:
        # Every bench process declares it, so the processor subprocess has it too.
        from bench.handlers_latency import register

        register()
