"""The report files: JSON (schema-checked) and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from ..utils import write_atomic
from .schema import REPORT_SCHEMA, validate


def write_json(report: dict, path: Path) -> None:
    errors = validate(report, REPORT_SCHEMA)
    if errors:
        raise RuntimeError(f"benchmark report breaks its schema: {errors[0]}")
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(report, indent=2)))


def write_plots(report: dict, directory: Path) -> list[Path] | None:
    """PNGs of speed and acceptance; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    tag = "SYNTHETIC " if report["synthetic"] else ""
    records_ = report["records"]
    names = [r["mode"] for r in records_]
    written = []

    fig, ax = plt.subplots(figsize=(max(6, len(names) * 1.1), 4))
    rates = [r["tok_per_s"] for r in records_]
    low = [r["tok_per_s"] - r["tok_per_s_min"] for r in records_]
    high = [r["tok_per_s_max"] - r["tok_per_s"] for r in records_]
    ax.bar(names, rates, yerr=[low, high], capsize=4)
    ceiling = report["machine"]["ceiling_tok_per_s"]
    if ceiling <= 2 * max(rates):
        ax.axhline(ceiling, color="red", linestyle="--", label="plain-decoding ceiling")
        ax.legend()
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{tag}{report['pair']['label']}: decoding speed")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    speed = directory / "speed.png"
    write_atomic(speed, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
    written.append(speed)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in records_:
        if r["acceptance_by_position"]:
            xs = range(1, len(r["acceptance_by_position"]) + 1)
            ax.plot(xs, r["acceptance_by_position"], marker="o", label=r["mode"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"{tag}{report['pair']['label']}: acceptance by position")
    if ax.lines:
        ax.legend(fontsize="small")
    fig.tight_layout()
    acceptance = directory / "acceptance.png"
    write_atomic(acceptance, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
    written.append(acceptance)
    return written
