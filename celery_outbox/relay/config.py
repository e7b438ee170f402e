"""The relay's configuration: settings, with command-line overrides on top."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..conf import OutboxSettings
from ..exceptions import OutboxConfigurationError
from .core import RetryPolicy


@dataclass(frozen=True)
class RelayConfig:
    """Everything the relay loop needs to know, validated once."""

    batch_size: int
    lease_seconds: float
    poll_interval: float
    send_timeout: float
    policy: RetryPolicy
    until_empty: bool = False
    shutdown_timeout: float = 30.0
    breaker_threshold: int = 3
    liveness_file: str | None = None
    liveness_interval: float = 5.0
    error_pause: float = 1.0
    min_poll_interval: float = 0.01
    #: While a full batch is published, claim the next one on a second connection.
    prefetch: bool = False
    #: A row in flight when this many connections broke is next sent alone.
    isolate_after: int = 1
    #: How often the relay writes its heartbeat; one silent for three intervals is
    #: taken for dead and its leased rows are claimed again at once.
    heartbeat_interval: float = 1.5
    #: How long a published strict head waits for its worker (celery_outbox.ordering).
    strict_lease_seconds: float = 300.0

    @classmethod
    def from_settings(cls, settings: OutboxSettings, **overrides: Any) -> RelayConfig:
        """Settings first; a non-None override (e.g. a command-line flag) wins."""
        given = {k: v for k, v in overrides.items() if v is not None}
        policy = RetryPolicy(
            max_attempts=given.pop("max_attempts", settings.max_attempts),
            base_seconds=given.pop("retry_base_seconds", settings.retry_base_seconds),
            max_seconds=given.pop("retry_max_seconds", settings.retry_max_seconds),
            outage_cooldown=given.pop(
                "broker_outage_cooldown", settings.broker_outage_cooldown
            ),
        )
        values: dict[str, Any] = {
            "batch_size": settings.batch_size,
            "lease_seconds": settings.lease_seconds,
            "poll_interval": settings.poll_interval,
            "send_timeout": settings.send_timeout,
            "prefetch": settings.prefetch,
            "strict_lease_seconds": settings.strict_lease_seconds,
            "policy": policy,
        }
        unknown = set(given) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise OutboxConfigurationError(f"Unknown relay options: {sorted(unknown)}")
        values.update(given)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        """Refuse combinations that would break the lease guarantee."""
        numbers = {
            "batch size": self.batch_size,
            "lease seconds": self.lease_seconds,
            "poll interval": self.poll_interval,
            "send timeout": self.send_timeout,
            "shutdown timeout": self.shutdown_timeout,
            "max attempts": self.policy.max_attempts,
            "isolate after": self.isolate_after,
            "heartbeat interval": self.heartbeat_interval,
            "strict lease seconds": self.strict_lease_seconds,
        }
        for name, value in numbers.items():
            if value <= 0:
                raise OutboxConfigurationError(
                    f"The relay's {name} must be positive, got {value}."
                )
        if self.policy.max_seconds < self.policy.base_seconds:
            raise OutboxConfigurationError(
                f"The retry cap ({self.policy.max_seconds}s) must not be smaller than the "
                f"retry base ({self.policy.base_seconds}s)."
            )
        if self.lease_seconds <= self.send_timeout:
            raise OutboxConfigurationError(
                f"The lease ({self.lease_seconds}s) must be longer than the send timeout "
                f"({self.send_timeout}s), or another relay could claim rows still being "
                f"published. Raise CELERY_OUTBOX_LEASE_SECONDS or lower the send timeout."
            )
