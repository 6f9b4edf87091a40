"""Plot held-out learning curves: validation tau against training time.

Reads the ``validation`` rows that ``mlx_dspark.train --val-sequences K``
writes into each drafter's ``training_record.json`` and draws one line per
drafter (needs the ``plot`` extra: ``pip install 'mlx-dspark[plot]'``)::

    python examples/plot_learning_curves.py RUN_A RUN_B --out curves.png

``--chain`` draws runs that continue one another (``--init-from``) on one
time axis: each starts where the one before ended.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def curve(drafter: Path) -> tuple[list[float], list[float]]:
    """Training minutes and validation tau of one drafter's record."""
    record = json.loads((drafter / "training_record.json").read_text())
    rows = record.get("validation") or []
    if not rows:
        raise SystemExit(
            f"{drafter} has no validation rows (train with --val-sequences)."
        )
    columns = record["validation_columns"]
    time, tau = columns.index("train_time_s"), columns.index("tau")
    return [row[time] / 60 for row in rows], [row[tau] for row in rows]


def chained(
    curves: list[tuple[list[float], list[float]]],
) -> list[tuple[list[float], list[float]]]:
    """Curves of runs that continue one another, each shifted to start at
    the previous one's last point."""
    out, start = [], 0.0
    for minutes, tau in curves:
        out.append(([start + m for m in minutes], tau))
        start += minutes[-1]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafters", type=Path, nargs="+", help="drafter directories")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--chain", action="store_true",
                        help="each run continues the one before: one time axis")  # fmt: skip
    args = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("Plots need matplotlib: pip install 'mlx-dspark[plot]'.")
    curves = [curve(drafter) for drafter in args.drafters]
    if args.chain:
        curves = chained(curves)
    fig, ax = plt.subplots(figsize=(6, 4))
    for drafter, (minutes, tau) in zip(args.drafters, curves, strict=True):
        ax.plot(minutes, tau, marker="o", label=drafter.name)
    ax.set_xlabel("training time (minutes)")
    ax.set_ylabel("validation tau (expected accepted length)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = args.out.with_name(args.out.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
