"""What every draft policy shares: the calibrated prefix survival of a
proposal, the memory guard's cap, and per-round telemetry.

Below both :mod:`~mlx_dspark.policy.policies` and :mod:`~mlx_dspark.policy.adaptive`, so that
neither imports the other's module for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..decoding.loop import RoundStats
from ..proposers.base import Proposal
from .calibration import CalibrationResult, apply_sts
from .memory import MemoryGuard
from .telemetry import Telemetry


def _raw_confidence(proposal: Proposal, cap: int, row: int = 0) -> np.ndarray | None:
    if proposal.confidence is None or cap <= 0:
        return None
    return np.array(proposal.confidence[row, :cap].astype(mx.float32))


def _top_logprobs(proposal: Proposal, cap: int, row: int = 0) -> np.ndarray | None:
    if proposal.top_logprob is None or cap <= 0:
        return None
    return np.array(proposal.top_logprob[row, :cap])


def proposal_survival(
    proposal: Proposal,
    cap: int,
    calibration: CalibrationResult | None,
    row: int = 0,
) -> np.ndarray | None:
    """Calibrated prefix survival of a proposal's first ``cap`` drafts (None
    without confidences; uncalibrated, T = 1, without a calibration). The top
    log-probabilities are evaluated only for a calibration that weighs them."""
    z = _raw_confidence(proposal, cap, row)
    if z is None:
        return None
    if calibration is None:
        return apply_sts(z, np.ones(z.size))[1]
    tops = _top_logprobs(proposal, cap, row) if calibration.reads_tops else None
    copied = proposal.copied
    if copied is not None and calibration.reads_copies:
        copied = np.array(copied[row, :cap])
    else:
        copied = None
    return calibration.survival(z, tops, copied)


def guarded_cap(guard: MemoryGuard | None, telemetry: Telemetry, cap: int) -> int:
    """``cap`` lowered by the memory guard under pressure; a failing guard
    never stops a generation."""
    if guard is not None:
        try:
            cap = min(cap, int(guard.cap()))
            telemetry.memory_pressure_level = int(guard.level)
        except Exception:
            pass
    return cap


@dataclass
class RecordingPolicy:
    """Telemetry for every round: cap, admitted, expected vs actual accepted."""

    calibration: CalibrationResult | None = None
    telemetry: Telemetry = field(default_factory=Telemetry)

    def observe(self, proposal: Proposal, round_stats: RoundStats) -> None:
        self._record(proposal, round_stats)

    def _record(self, proposal: Proposal, round_stats: RoundStats) -> np.ndarray | None:
        """Record the round's telemetry; returns the calibrated survival of its
        verified drafts (None without confidences)."""
        survival = proposal_survival(proposal, round_stats.verified, self.calibration)
        expected = 0.0 if survival is None else float(survival.sum())
        self.telemetry.record_round(
            round_stats.drafted,
            round_stats.verified,
            expected,
            round_stats.accepted,
            round_stats.verify_time * 1000.0,
            0 if survival is None else int(survival.size),
        )
        return survival
