"""Optional integrations: Sentry, OpenTelemetry and structlog.

Each one switches itself on when its library is in use and costs nothing otherwise.
The core package never imports these libraries: :mod:`.otel` and :mod:`.sentry`
import theirs at module level and are only imported once the library itself has been
imported by the application; :mod:`.logcontext` only looks in ``sys.modules``.
"""

from __future__ import annotations

import sys


def library_in_use(module: str) -> bool:
    """Whether the application has imported ``module`` (cheap: no import is attempted)."""
    return module in sys.modules
