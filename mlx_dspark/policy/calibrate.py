"""Calibrate a drafter's confidence head against its target.

Usage (the command line is in :mod:`mlx_dspark.cli.calibrate`)::

    mlx_dspark calibrate --model T --draft-model D [--prompts FILE] [--rounds N] [--out PATH]

Runs full-block speculative rounds through the generation loop on held-out
prompts, records per position the raw confidence logit, the draft's top
log-probability and whether the draft survived, fits per position a
temperature, an offset and a weight on the top log-probability (left to
right, :func:`~mlx_dspark.policy.calibration.fit_sts_offset`), reports ECE and ROC-AUC
before/after, cross-validated by prompt (:func:`fit_records`), and stores the
result beside the drafter (``<drafter>/dspark_calibration.json``) or, when
that directory is not writable, in the user cache keyed by the pair. :func:`find_calibration` (used
by the generation path) looks in both places.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..decoding.loop import RoundStats, speculative_generate_step
from ..errors import DSparkError
from ..proposers.base import Proposal
from ..proposers.copying import Drafter, pair_proposer
from ..sampling.coupled import UNSEEDED_SAMPLING
from ..sampling.processing import SamplingParams
from ..targets.adapter import TargetAdapter
from ..utils import cache_dir, encode_chat_prompt, write_atomic
from .calibration import (
    CalibrationRecord,
    CalibrationResult,
    apply_sts,
    evaluate,
    fit_sts,
    fit_sts_offset,
    records_per_position,
    records_to_arrays,
)
from .profile import _digest, model_fingerprint
from .settings import SpeculationSettings, build_settings

CALIBRATION_FILE = "dspark_calibration.json"

BUILTIN_PROMPTS = [
    # chat
    "What are some good ways to stay focused while working from home?",
    "Write a short, friendly email declining a meeting invitation.",
    "Explain the difference between weather and climate to a child.",
    # code
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Implement binary search over a sorted list in Python and explain it.",
    "def merge_sort(values):\n    # Sort a list with merge sort\n",
    # math
    "Solve for x: 3x + 7 = 22. Show each step.",
    "What is the sum of the first 100 positive integers? Explain.",
    "A train travels 120 km in 1.5 hours. What is its average speed in km/h?",
]


@dataclass
class RecordingPolicy:
    """Verify every drafted position and record (confidence, outcome) per round."""

    records: list[CalibrationRecord] = field(default_factory=list)

    def draft_length(self, proposal: Proposal, cap: int) -> int:
        return cap

    def observe(self, proposal: Proposal, round_stats: RoundStats) -> None:
        if proposal.confidence is None or round_stats.drafted == 0:
            return
        n = round_stats.drafted
        z = np.array(proposal.confidence[0, :n].astype(mx.float32))
        top, copied = proposal.top_logprob, proposal.copied
        top = None if top is None else np.array(top[0, :n])
        copied = None if copied is None else np.array(copied[0, :n])
        self.records.append(
            CalibrationRecord(
                z, round_stats.verified, round_stats.accepted, top, copied
            )
        )


def pair_key(model: nn.Module, drafter: Drafter) -> str:
    return _digest(
        [model_fingerprint(model), model_fingerprint(drafter, drafter.config.to_dict())]
    )


def cached_calibration_path(model: nn.Module, drafter: Drafter) -> Path:
    return cache_dir() / "calibration" / f"{pair_key(model, drafter)}.json"


def beside_drafter_path(drafter: Drafter) -> Path | None:
    source = getattr(drafter, "source_path", None)
    return None if source is None else Path(source) / CALIBRATION_FILE


def find_calibration(
    model: nn.Module, drafter: Drafter
) -> tuple[CalibrationResult, Path] | None:
    """The stored calibration of this pair (beside the drafter first, then the
    user cache), or None; an unreadable file counts as missing."""
    for path in (beside_drafter_path(drafter), cached_calibration_path(model, drafter)):
        if path is not None and path.is_file():
            try:
                result = CalibrationResult.load(path)
            except DSparkError:
                continue
            if result.temperatures:
                return result, path
    return None


def _writable(directory: Path) -> bool:
    return directory.is_dir() and os.access(directory, os.W_OK | os.X_OK)


def default_output(model: nn.Module, drafter: Drafter) -> Path:
    beside = beside_drafter_path(drafter)
    if beside is not None and _writable(beside.parent):
        return beside
    return cached_calibration_path(model, drafter)


def encode_prompts(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    encoded = []
    for text in prompts:
        tokens = encode_chat_prompt(tokenizer, text)
        if tokens:
            encoded.append(list(tokens))
    if not encoded:
        raise DSparkError("No calibration prompt produced any tokens.")
    return encoded


def calibration_settings(drafter: Drafter) -> SpeculationSettings:
    """Calibration's speculation setup: chains of the full block, every draft
    verified (a threshold in the environment does not apply)."""
    return build_settings(drafter.block_size, confidence_threshold=0.0, scheduler="off")


def collect_records(
    model: nn.Module,
    drafter: Drafter,
    prompts: list[list[int]],
    rounds: int,
    params: SamplingParams = SamplingParams(),
    max_tokens: int = 128,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[CalibrationRecord], list[int]]:
    """Full-block rounds spread over the prompts, and each round's prompt.

    A visit to a prompt records at most ``ceil(rounds / len(prompts))``
    rounds, and the prompts are visited in turn (again with new seeds) until
    ``rounds`` are recorded, so every prompt weighs alike rather than the
    first few filling the count. ``progress(recorded, rounds)`` follows every
    visit.
    """
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    settings = calibration_settings(drafter)
    policy = RecordingPolicy()
    per_visit = -(-rounds // len(prompts))
    groups: list[int] = []
    attempt = 0
    while len(policy.records) < rounds:
        index = attempt % len(prompts)
        before = len(policy.records)
        budget = min(per_visit, rounds - before)
        for _ in speculative_generate_step(
            mx.array(prompts[index]),
            target,
            pair_proposer(drafter),
            params=params,
            num_draft=settings.num_draft,
            max_tokens=max_tokens,
            policy=policy,
            mode=settings.make_mode(),
            seed=seed + attempt,
            # Its own keys (the seed), and the rule unseeded generation uses.
            sampling=UNSEEDED_SAMPLING,
        ):
            if len(policy.records) - before >= budget:
                break
        groups += [index] * (len(policy.records) - before)
        if progress is not None:
            progress(min(len(policy.records), rounds), rounds)
        attempt += 1
        if attempt >= len(prompts) and not policy.records:
            raise DSparkError(
                "The drafter produced no confidence scores; it has no "
                "confidence head to calibrate."
            )
    return policy.records[:rounds], groups[:rounds]


def fit_records(
    records: list[CalibrationRecord], groups: list[int], n_positions: int
) -> CalibrationResult:
    """Fit the calibration on all rounds and report ECE and ROC-AUC
    cross-validated by prompt: the prompts fall in three folds (by index),
    each fold's rounds are scored by the fit on the other two, and the
    metrics are read over all rounds, each scored by a fit that never saw its
    prompt. With fewer than 40 rounds or 3 prompts the fit is reported on the
    rounds it was fitted on. With the drafts' top log-probabilities recorded
    the fit is STS with an offset and a weight on them
    (:func:`fit_sts_offset`), and on the copy flags of a drafter that copies
    from the context; else plain STS."""
    logits, survived, valid = records_to_arrays(records, n_positions)
    tops = records_per_position(records, "top_logprobs", n_positions)
    copied = records_per_position(records, "copied", n_positions)

    def rows(values: np.ndarray | None, mask: np.ndarray) -> np.ndarray | None:
        return None if values is None else values[mask]

    def fit(mask: np.ndarray) -> dict[str, np.ndarray]:
        if tops is None:
            return {
                "temperatures": fit_sts(logits[mask], survived[mask], valid=valid[mask])
            }
        fitted = fit_sts_offset(
            logits[mask],
            tops[mask],
            survived[mask],
            valid=valid[mask],
            copied=rows(copied, mask),
        )._asdict()
        if copied is None:
            for name in ("copy_weights", "copy_logit_weights", "copy_top_weights"):
                del fitted[name]
        return fitted

    folds = np.array(groups) % 3
    calibrated = None
    if len(records) >= 40 and len(set(groups)) >= 3:
        calibrated = np.zeros_like(logits)
        for fold in range(3):
            held = folds == fold
            calibrated[held] = apply_sts(
                logits[held],
                tops=rows(tops, held),
                copied=rows(copied, held),
                **fit(~held),
            )[1]
    return evaluate(
        logits,
        survived,
        valid=valid,
        tops=tops,
        copied=copied,
        calibrated=calibrated,
        **fit(np.ones(len(records), dtype=bool)),
    )


def calibrate_pair(
    model: nn.Module,
    tokenizer: Any,
    drafter: Drafter,
    prompts: list[str] | None = None,
    rounds: int = 300,
    params: SamplingParams = SamplingParams(),
    max_tokens: int = 128,
    seed: int = 0,
    out: str | Path | None = None,
    plot: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[CalibrationResult, Path, Path | None]:
    """Collect rounds, fit STS, save; returns (result, json path, png path)."""
    if rounds < 1:
        raise DSparkError(f"--rounds must be at least 1, got {rounds}.")
    if getattr(drafter, "confidence_head", None) is None:
        raise DSparkError(
            "The drafter has no confidence head to calibrate (an EAGLE-3 or "
            "DFlash drafter); the default policy runs it as it is."
        )
    encoded = encode_prompts(tokenizer, prompts or BUILTIN_PROMPTS)
    records, groups = collect_records(
        model, drafter, encoded, rounds, params, max_tokens, seed, progress
    )
    result = fit_records(records, groups, drafter.block_size)
    path = Path(out) if out is not None else default_output(model, drafter)
    try:
        write_atomic(path, result.save)
    except OSError as error:
        raise DSparkError(
            f"Could not write the calibration to {path}: {error.strerror}."
        ) from None
    png = None
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            plot = False
    if plot:
        png = path.with_suffix(".png")
        write_atomic(png, result.reliability_diagram)
    return result, path, png
