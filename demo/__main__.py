"""``python -m demo``: run the outbox demo and exit non-zero if the guarantee broke."""

from __future__ import annotations

import sys

from demo.run import main

if __name__ == "__main__":
    sys.exit(main())
