"""Draft policies that plug the scheduler into the generation loop, and the
batched verification entry point.

:class:`SchedulerPolicy` is Algorithm 1 on the calibrated prefix survival
``a_j = prod_{i<=j} sigmoid(z_i / T_i + w_i t_i + b_i)``
(:mod:`~mlx_dspark.policy.calibration`). ``a_j`` is a function of the drafts before
``j`` only (the confidence head reads the previous sampled token, and ``t_i``
is the top log-probability of draft ``i``'s distribution, not of its token), and
:func:`~mlx_dspark.policy.scheduler.schedule` decides position ``k`` from ``a_1..a_k``,
so the verified length never depends on the draft being tested: lossless. The
round's cap comes from the memory guard, which reads memory pressure, never
drafts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from ..decoding.loop import DraftPolicy, RoundStats
from ..decoding.modes import settle_chain
from ..decoding.verify import Verdict
from ..errors import DSparkError
from ..proposers.base import Proposal
from ..proposers.copying import copies
from ..sampling.processing import SamplingParams
from ..targets.adapter import TargetAdapter
from .memory import MemoryGuard
from .recording import RecordingPolicy, guarded_cap, proposal_survival
from .scheduler import SchedulerSettings, StepRateCurve, schedule
from .settings import SpeculationSettings
from .telemetry import Telemetry

if TYPE_CHECKING:
    from .adaptive import AdaptivePolicy


@dataclass
class MonitoredPolicy(RecordingPolicy):
    """Another policy (fixed length, threshold) with telemetry."""

    inner: DraftPolicy | None = None

    def round_cap(self, cap: int, copy: bool = False, phrases: bool = False) -> int:
        self.telemetry.n_current = cap
        return cap

    def draft_length(self, proposal: Proposal, cap: int) -> int:
        return cap if self.inner is None else self.inner.draft_length(proposal, cap)


@dataclass
class SchedulerPolicy(RecordingPolicy):
    """Algorithm 1 on calibrated survival, capped by the memory guard.

    The first ``settings.warmup_steps`` rounds verify the whole cap (decided
    before drafting, so lossless); after that, ``schedule`` decides. At least
    ``settings.n_draft_min`` drafts are verified when the cap allows.

    A calibration fitted on other prompts can be off by a constant on this
    text (a temperature cannot remove a bias), so each position's survival is
    scaled by the ratio of drafts accepted there to the survival predicted for
    them, over past verified drafts (decaying by ``decay`` a round; a prior of
    ``prior_weight`` drafts at ratio 1). From past rounds only: lossless.
    """

    curve: StepRateCurve | None = None
    settings: SchedulerSettings = field(default_factory=SchedulerSettings)
    guard: MemoryGuard | None = None
    rounds_seen: int = 0
    decay: float = 0.98
    prior_weight: float = 4.0
    predicted: np.ndarray = field(default_factory=lambda: np.zeros(0))
    accepted: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def __post_init__(self) -> None:
        if self.curve is None:
            raise ValueError("SchedulerPolicy needs a step-rate curve")

    def round_cap(self, cap: int, copy: bool = False, phrases: bool = False) -> int:
        cap = guarded_cap(self.guard, self.telemetry, cap)
        self.telemetry.n_current = cap
        return cap

    def survival(self, proposal: Proposal, cap: int, row: int = 0) -> np.ndarray:
        survival = proposal_survival(proposal, cap, self.calibration, row)
        if survival is None:
            return np.ones(0)
        n = min(survival.size, self.predicted.size)
        w = self.prior_weight
        ratio = np.ones(survival.size)
        ratio[:n] = (self.accepted[:n] + w) / (self.predicted[:n] + w)
        return np.minimum.accumulate(np.minimum(survival * ratio, 1.0))

    def draft_lengths(
        self, proposals: Sequence[Proposal], caps: Sequence[int]
    ) -> list[int]:
        """Algorithm 1 over R requests verified in one batch."""
        caps = [max(0, int(c)) for c in caps]
        if self.rounds_seen < self.settings.warmup_steps:
            return caps
        if any(p.confidence is None for p in proposals):
            return caps
        survival = [self.survival(p, c) for p, c in zip(proposals, caps, strict=True)]
        lengths = schedule(survival, self.curve, caps)
        floor = self.settings.n_draft_min
        return [max(n, min(floor, c)) for n, c in zip(lengths, caps, strict=True)]

    def draft_length(self, proposal: Proposal, cap: int) -> int:
        return self.draft_lengths([proposal], [cap])[0]

    def observe(self, proposal: Proposal, round_stats: RoundStats) -> None:
        survival = self._record(proposal, round_stats)
        self.rounds_seen += 1
        if survival is None:
            return
        if survival.size > self.predicted.size:
            grow = survival.size - self.predicted.size
            self.predicted = np.concatenate([self.predicted, np.zeros(grow)])
            self.accepted = np.concatenate([self.accepted, np.zeros(grow)])
        self.predicted *= self.decay
        self.accepted *= self.decay
        self.predicted[: survival.size] += survival
        self.accepted[: round_stats.accepted] += 1.0


def mean_ece(ece: Sequence[float]) -> float:
    values = [v for v in ece if v is not None and math.isfinite(v)]
    return float(np.mean(values)) if values else float("nan")


def verify_batch(
    target: TargetAdapter,
    caches: Sequence[list],
    anchors: Sequence[int],
    proposals: Sequence[Proposal],
    lengths: Sequence[int],
    params: SamplingParams,
    rngs: Sequence[np.random.Generator],
) -> list[tuple[Verdict, list[int], mx.array]]:
    """Verify R requests' chains in one target forward.

    Request r sends its anchor and its first ``lengths[r]`` drafts; each
    request keeps its own cache (rolled back after its own rejection) and its
    own random stream. Per request the result equals
    :meth:`~mlx_dspark.decoding.modes.ChainMode.verify` on that request alone:
    ``(verdict, drafts verified, features to commit)``.
    """
    drafts = [
        np.array(p.tokens[0, :n]).tolist()
        for p, n in zip(proposals, lengths, strict=True)
    ]
    outputs = target.forward_batch(
        [[int(a), *d] for a, d in zip(anchors, drafts, strict=True)], caches
    )
    mx.eval([o for out in outputs for o in out if o is not None])
    return [
        settle_chain(target, cache, chain, proposal, logits, features, params, rng)
        for cache, proposal, chain, rng, (logits, features) in zip(
            caches, proposals, drafts, rngs, outputs, strict=True
        )
    ]


def telemetry_for(found) -> Telemetry:
    telemetry = Telemetry()
    if found is not None:
        telemetry.ece = mean_ece(found[0].ece_after)
    return telemetry


@dataclass
class ResolvedPolicy:
    """What :func:`resolve_policy` built: the policy, its name and why."""

    policy: SchedulerPolicy | MonitoredPolicy | AdaptivePolicy
    mode: str
    note: str | None = None
    calibration_path: str | None = None
    profile_path: str | None = None  # the cached cost profile it read


def resolve_policy(
    model,
    drafter,
    settings: SpeculationSettings,
    memory_source=None,
    progress: Callable[[int, int], None] | None = None,
    suffix: bool = False,
) -> ResolvedPolicy:
    """Build the draft policy ``settings.policy`` names for this pair (see
    :func:`~mlx_dspark.policy.settings.build_settings`, which decides it).
    ``suffix``: the pair's copies are suffix drafts verified as they are
    (:class:`~mlx_dspark.proposers.suffix.SuffixPairProposer`).

    ``adaptive`` and ``auto`` use the pair's calibration when there is one
    (``auto`` uses raw confidences otherwise) and the pair's cost profile,
    measured once on this machine and cached (``settings.profile ==
    "refresh"`` always re-measures); ``adaptive``'s reaches its longest
    round, copied rounds included.
    """
    from ..decoding.loop import ThresholdPolicy
    from .calibrate import find_calibration
    from .profile import cached_profile_path, get_profile, reaches

    knobs = settings.scheduler
    found = find_calibration(model, drafter)
    calibration = None if found is None else found[0]
    cal_path = None if found is None else str(found[1])
    if settings.policy == "adaptive":
        from .adaptive import AdaptivePolicy

        longest = settings.num_draft
        if copies(drafter) or suffix:
            longest = settings.copy_draft or longest
        guard = MemoryGuard.from_settings(knobs, longest, memory_source)
        earlier = drafter.policy_memory
        curve = None if earlier is None else earlier.profile
        if curve is None or not reaches(curve, longest):
            curve = get_profile(model, drafter, progress=progress, n_max=longest)
        policy = AdaptivePolicy(
            calibration,
            telemetry_for(found),
            curve,
            guard,
            prior=None if found is None else found[0].acceptance(),
            suffix=suffix,
        )
        if earlier is not None and earlier.suffix == suffix:
            policy.remember(earlier)
        drafter.policy_memory = policy
        used = cached_profile_path(model, drafter)
        return ResolvedPolicy(policy, "adaptive", None, cal_path, used)
    telemetry = telemetry_for(found)
    if settings.policy != "auto":
        inner = ThresholdPolicy(knobs.confidence_threshold)
        policy = MonitoredPolicy(calibration, telemetry, inner)
        return ResolvedPolicy(policy, settings.policy, None, cal_path)
    note = None
    if found is None:
        note = (
            "[dspark] scheduler: auto with raw confidences, because this pair has "
            "no calibration (run mlx_dspark.calibrate)."
        )
    curve = get_profile(model, drafter, settings.profile, progress=progress)
    guard = MemoryGuard.from_settings(knobs, settings.num_draft, memory_source)
    policy = SchedulerPolicy(calibration, telemetry, curve, knobs, guard)
    used = cached_profile_path(model, drafter)
    return ResolvedPolicy(policy, "auto", note, cal_path, used)


def resolve_suffix_policy(
    settings: SpeculationSettings, memory_source=None
) -> ResolvedPolicy:
    """The draft policy of suffix drafts with no drafter (see
    :mod:`~mlx_dspark.proposers.suffix`): ``adaptive`` prices rounds from what
    this generation measures (no cost profile, no calibration: there is no
    drafter to key them by), and measures the rounds offered a suffix draft
    as their own kind (copies); ``off`` verifies ``settings.num_draft`` drafts
    whenever there is a draft. Suffix drafts have no confidences, so the
    threshold and the calibrated scheduler are refused in one sentence."""
    from ..decoding.loop import ThresholdPolicy

    knobs = settings.scheduler
    if settings.policy == "adaptive":
        from .adaptive import AdaptivePolicy

        guard = MemoryGuard.from_settings(knobs, settings.num_draft, memory_source)
        return ResolvedPolicy(AdaptivePolicy(guard=guard), "adaptive")
    if settings.policy == "off":
        policy = MonitoredPolicy(None, Telemetry(), ThresholdPolicy(0.0))
        return ResolvedPolicy(policy, "off")
    raise DSparkError(
        f"Suffix drafts have no confidences to schedule by: use the adaptive "
        f"or off scheduler, not {settings.policy}."
    )
