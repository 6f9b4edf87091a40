"""Several drafters for one target, side by side (``benchmark --compare``).

Per temperature, the target alone (mlx-lm's own decoding, seeded) and every
drafter drafting a fixed number of tokens each round (no scheduler, no
confidence cut, no copying beyond what the drafter itself does), all in one
interleaved :func:`~.measure.measure`, so that machine noise falls on every
drafter alike. Each drafter row reports its mean accepted length, acceptance
by position, speed against the target alone at the same temperature and
whether its output equals the target's (seeded sampling is lossless token
for token). A drafter is whatever the drafter loader returns: a DSpark,
DFlash or EAGLE-3 drafter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DSparkError
from ..policy.settings import build_settings
from .measure import Measurement, records
from .modes import Variant, dspark_runner, run_target, sampled_target_runner


@dataclass
class Contender:
    """A drafter under comparison and the name its rows carry."""

    name: str
    drafter: Any


def parse_contender(value: str) -> tuple[str, str]:
    """``NAME=PATH`` or ``PATH`` (named after its last path component)."""
    name, sep, path = value.partition("=")
    if sep and name and "/" not in name and not Path(value).exists():
        return name, path
    return Path(value.rstrip("/")).name or value, value


def compare_variants(
    contenders: list[Contender],
    num_draft: int,
    temperatures: list[float],
    seed: int = 0,
) -> list[Variant]:
    """Per temperature: the target alone, then each contender at
    ``num_draft`` drafts a round (its block size when smaller)."""
    if len({c.name for c in contenders}) != len(contenders):
        raise DSparkError("Each --compare drafter needs a name of its own.")
    variants = []
    for temperature in temperatures:
        tag = f"T={temperature:g}"
        target = (
            run_target if temperature == 0 else sampled_target_runner(temperature, seed)
        )
        variants.append(Variant(f"target {tag}", "target", target))
        for c in contenders:
            block = getattr(c.drafter, "block_size", num_draft)
            n = min(num_draft, block)
            settings = build_settings(
                block, num_draft=n, confidence_threshold=0.0, scheduler="off"
            )
            run = dspark_runner(settings, c.drafter, temperature, seed)
            variants.append(
                Variant(f"{c.name} {tag}", "dspark", run, n, None, settings)
            )
    return variants


def compare_records(
    results: list[Measurement],
    contenders: list[Contender],
    temperatures: list[float],
    ceiling: float | None,
) -> list[dict]:
    """The records of :func:`~.measure.records`, per temperature against its
    own target-alone run, with ``drafter`` and ``temperature`` added."""
    per_temperature = len(contenders) + 1
    out = []
    for i, temperature in enumerate(temperatures):
        group = results[i * per_temperature : (i + 1) * per_temperature]
        names = ["target", *(c.name for c in contenders)]
        for name, record in zip(names, records(group, ceiling, False), strict=True):
            out.append({**record, "drafter": name, "temperature": temperature})
    return out
