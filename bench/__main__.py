"""``python -m bench``: run the benchmark and print its table."""

from __future__ import annotations

import sys

from bench.run import main

if __name__ == "__main__":
    sys.exit(main())
