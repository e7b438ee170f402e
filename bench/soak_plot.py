"""Plot soak runs (``python -m bench.soak --json FILE``) side by side as a PNG.

``python -m bench.soak_plot OUT.png LABEL=FILE.json [LABEL=FILE.json ...]``

Needs matplotlib, which the package does not depend on: ``pip install matplotlib``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MB = 1024 * 1024

#: (title, unit, how to read the figure from one sample of the JSON)
PANELS: tuple[tuple[str, str, Any], ...] = (
    ("drain", "messages/s", lambda s: s["drain"]),
    ("claim p99", "ms", lambda s: s["claim_p99_ms"]),
    ("table", "MB", lambda s: s["sizes"]["table"] / MB),
    ("indexes", "MB", lambda s: sum(s["sizes"]["indexes"].values()) / MB),
    ("dead tuples", "rows", lambda s: s["sizes"]["dead"]),
)


def plot(out: Path, runs: dict[str, list[dict[str, Any]]]) -> None:
    """One panel per figure, one line per run, over the run's elapsed seconds."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("bench.soak_plot needs matplotlib: pip install matplotlib")
    figure, axes = plt.subplots(len(PANELS), 1, figsize=(8, 2.2 * len(PANELS)))
    for axis, (title, unit, value) in zip(axes, PANELS, strict=True):
        for label, samples in runs.items():
            xs = [s["elapsed"] for s in samples]
            axis.plot(xs, [value(s) for s in samples], marker=".", label=label)
        axis.set_title(title, fontsize=10)
        axis.set_ylabel(unit)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel("elapsed s")
    figure.tight_layout()
    figure.savefig(out, dpi=90)


def main(argv: list[str]) -> int:
    """Parse ``OUT LABEL=FILE ...`` and write the plot."""
    if len(argv) < 2 or any("=" not in arg for arg in argv[1:]):
        print(__doc__, file=sys.stderr)
        return 2
    runs = {}
    for arg in argv[1:]:
        label, _, name = arg.partition("=")
        runs[label] = json.loads(Path(name).read_text())["samples"]
    plot(Path(argv[0]), runs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
