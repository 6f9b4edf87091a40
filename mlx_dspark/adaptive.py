"""The default draft policy: each round, the draft length with the best
predicted tokens per second, 0 (plain target decoding) included.

Predicted tokens/s for ``n`` drafts is ``E(n) / cost(n)``:

* ``E(n) = 1 + sum_{k<=n} prod_{i<=k} p_i`` from running conditional
  acceptance ``p_k = P(draft k kept | drafts before it kept)``, each a Beta
  posterior whose counts decay by ``decay`` per observation (so the estimate
  follows the text) and whose prior mean is position ``k-1``'s estimate (an
  unseen deeper position is assumed as good as the one before it, which is
  what lets a pair that drafts well reach long rounds);
* ``cost(n)`` the median wall time of the last ``window`` rounds that
  verified ``n`` drafts (``cost(0)``: a pipelined plain round). A length not
  measured yet comes from the cached cost profile scaled to the measured
  rounds when there is a profile, else from a line fitted to the measured
  lengths.

The choice is made before drafting from past rounds only, so it cannot
depend on the drafts it admits: lossless like any fixed length. With an STS
calibration, Algorithm 1 (:func:`~mlx_dspark.scheduler.schedule`) then cuts
the drafted block on the calibrated prefix survival, priced with the same
costs. Once the policy stops drafting it probes with one draft after
``probe_after`` plain rounds, doubling the wait (up to ``probe_max``) after
every probe that does not bring drafting back, so a pair that starts badly and
improves (a repetitive passage) drafts again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .drafter import Proposal
from .loop import RoundStats
from .memory import MemoryGuard
from .policies import _raw_confidence, _Recording, calibrated_survival
from .scheduler import StepRateCurve, schedule

# Without any measurement or profile: a drafting round costs this many plain
# rounds plus this much per draft (a CPU-like verify whose cost grows with its
# query length). Measurements replace both after the first rounds.
_DRAFT_OVERHEAD = 1.3
_PER_DRAFT = 0.08


@dataclass
class AdaptivePolicy(_Recording):
    """Per-round draft length 0..cap maximising predicted tokens/s.

    ``profile`` (a cached :class:`StepRateCurve`) seeds costs not measured
    yet; ``temperatures`` (an STS calibration) turn on Algorithm 1 inside a
    drafted block; ``guard`` lowers the cap under memory pressure.
    """

    profile: StepRateCurve | None = None
    guard: MemoryGuard | None = None
    decay: float = 0.9
    prior_strength: float = 2.0
    window: int = 5
    probe_after: int = 8
    probe_max: int = 128
    costs: dict[int, deque] = field(default_factory=dict)
    successes: list[float] = field(default_factory=list)
    failures: list[float] = field(default_factory=list)
    choice: int | None = None  # the length decided for the coming rounds
    interval: int = 0
    plain_left: int = 0
    probing: bool = False
    _stale: bool = True
    _cap: int = -1

    def __post_init__(self) -> None:
        self.interval = self.probe_after

    def renew(self) -> AdaptivePolicy:
        """A fresh policy for the next generation that keeps what was measured
        (costs and acceptance) and forgets the plain-round schedule."""
        return AdaptivePolicy(
            self.temperatures,
            self.telemetry,
            self.profile,
            self.guard,
            self.decay,
            self.prior_strength,
            self.window,
            self.probe_after,
            self.probe_max,
            {n: deque(d, maxlen=self.window) for n, d in self.costs.items()},
            list(self.successes),
            list(self.failures),
        )

    # -- estimates ---------------------------------------------------------

    def acceptance(self, cap: int) -> list[float]:
        """Conditional acceptance estimates p_1..p_cap."""
        rates, prior = [], 0.5
        strength = self.prior_strength
        for k in range(cap):
            s = self.successes[k] if k < len(self.successes) else 0.0
            f = self.failures[k] if k < len(self.failures) else 0.0
            prior = (strength * prior + s) / (strength + s + f)
            rates.append(prior)
        return rates

    def _measured(self) -> dict[int, float]:
        return {n: float(np.median(d)) for n, d in self.costs.items() if d}

    def _profile_cost(self, n: int) -> float:
        if n == 0:
            return self.profile.step_seconds(1)
        return self.profile.draft_seconds + self.profile.step_seconds(n + 1)

    def round_costs(self, cap: int) -> list[float]:
        """Predicted seconds of a round verifying n = 0..cap drafts."""
        measured = self._measured()
        if self.profile is not None:
            ratios = [t / self._profile_cost(n) for n, t in measured.items()]
            scale = float(np.median(ratios)) if ratios else 1.0
            return [
                measured.get(n, scale * self._profile_cost(n)) for n in range(cap + 1)
            ]
        drafted = {n: t for n, t in measured.items() if n > 0}
        plain = measured.get(0)
        if plain is None:
            plain = (
                min(drafted.values()) / (_DRAFT_OVERHEAD + _PER_DRAFT)
                if drafted
                else 1.0
            )
        slope = _PER_DRAFT * plain
        if len(drafted) >= 2:
            xs = np.array(list(drafted), dtype=np.float64)
            ys = np.array(list(drafted.values()))
            slope = max(0.0, float(np.polyfit(xs, ys, 1)[0]))
            base = float(np.mean(ys - slope * xs))
        elif drafted:
            (n1, t1), *_ = drafted.items()
            base = t1 - slope * n1
        else:
            base = _DRAFT_OVERHEAD * plain
        return [plain] + [
            drafted.get(n, max(base + slope * n, 1e-9)) for n in range(1, cap + 1)
        ]

    def predicted_rates(self, cap: int) -> list[float]:
        """Predicted tokens per second for n = 0..cap drafts per round."""
        costs = self.round_costs(cap)
        rates, expected, survive = [1.0 / costs[0]], 1.0, 1.0
        for n, p in enumerate(self.acceptance(cap), start=1):
            survive *= p
            expected += survive
            rates.append(expected / costs[n])
        return rates

    def best_length(self, cap: int) -> int:
        rates = self.predicted_rates(cap)
        return int(np.argmax(rates))

    # -- the loop's hooks --------------------------------------------------

    def round_cap(self, cap: int) -> int:
        if self.guard is not None:
            try:
                cap = min(cap, int(self.guard.cap()))
                self.telemetry.memory_pressure_level = int(self.guard.level)
            except Exception:
                pass  # the guard never stops a generation
        n = self._decide(cap) if cap > 0 else 0
        self.telemetry.n_current = n
        return n

    def _decide(self, cap: int) -> int:
        if self.plain_left > 0:  # counting plain rounds: no arithmetic
            self.plain_left -= 1
            return 0
        if self._stale or cap != self._cap:
            previous = self.choice
            self.choice, self._cap = self.best_length(cap), cap
            self._stale = False
            probed, self.probing = self.probing, False
            if self.choice == 0:
                if probed:  # the probe did not bring drafting back: wait longer
                    self.interval = min(2 * self.interval, self.probe_max)
                elif previous != 0:
                    self.interval = self.probe_after
                self.plain_left = self.interval - 1
                return 0
            if probed:
                self.interval = self.probe_after
            return min(self.choice, cap)
        if self.choice == 0:  # the plain run is over: probe with one draft
            self.probing = True
            return 1
        return min(self.choice, cap)

    def draft_length(self, proposal: Proposal, cap: int) -> int:
        if self.temperatures is None:
            return cap
        z = _raw_confidence(proposal, cap)
        if z is None:
            return cap
        costs = self.round_costs(cap)
        costs[0] = costs[1]  # the block is drafted already: verifying 0 saves little
        curve = StepRateCurve(list(range(1, cap + 2)), [1.0 / t for t in costs])
        return schedule([calibrated_survival(z, self.temperatures)], curve, [cap])[0]

    def observe(self, proposal: Proposal, round_stats: RoundStats) -> None:
        super().observe(proposal, round_stats)
        n = round_stats.verified
        key = max(n, 1) if round_stats.drafted else 0
        seconds = round_stats.draft_time + round_stats.verify_time
        if key not in self.costs:
            self.costs[key] = deque(maxlen=self.window)
        self.costs[key].append(seconds)
        if round_stats.drafted == 0:
            return
        accepted = round_stats.accepted
        while len(self.successes) < n:
            self.successes.append(0.0)
            self.failures.append(0.0)
        for k in range(min(n, accepted + 1)):
            self.successes[k] *= self.decay
            self.failures[k] *= self.decay
            if k < accepted:
                self.successes[k] += 1.0
            else:
                self.failures[k] += 1.0
        self._stale = True
