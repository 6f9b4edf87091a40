"""What a round costs: the pair's cost profile as a prior, every round the
generation loop runs as a measurement.

A drafted round verifying ``n`` drafts costs ``draft + verify(n + 1) + host``:
the drafter's pass, the target's forward over the anchor and the drafts (with
acceptance and rollback), and the rest of the round's wall time (the
caller's time with the tokens, Python). A plain round is measured whole: it
is pipelined, so it is not a one-token verify plus host time. Plain rounds
are not measured while drafting, so until a window of them is, the price the
drafted rounds give a plain one (a one-token verify plus host time) votes
for the rest: one plain round timed during a hiccup does not decide.

Each verified query length keeps its own recent measurements (their median
is its cost). A length not measured lately is the profile's cost for it times
the measured-to-profile ratio interpolated (in log space) between the nearest
measured lengths, so a profile that is wrong by a factor everywhere is right
again after one round, and its shape is trusted only between measurements.
Without a profile, unmeasured lengths lie on a robust line through the
measured ones.

A longer query costs no less than a shorter one (up to small dips, which
measuring them corrects), so a length between two measured ones is priced
between their costs whatever the profile says. A length longer than every
measured one and priced too high would never be chosen, so never measured:
:meth:`RoundCosts.optimistic` prices the next one at the least it can cost,
the longest measured query's verify, and the policy tries it when even that
price clearly beats its best choice
(:class:`~mlx_dspark.policy.adaptive.AdaptivePolicy`); once measured it is priced
as measured, until its measurements are ``memory`` rounds old, and the
lengths past it by the profile scaled to it.

A plain round is priced, until plain rounds are measured, at the plain cost
an earlier run wrote into the profile (scaled like the verifies), else as the
drafted rounds price it. What a run measured is handed back as
:class:`MeasuredCosts` (:meth:`RoundCosts.take_measured`) for
:func:`~mlx_dspark.policy.profile.save_measured` to merge into the cached
profile, so that the next process starts from it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from statistics import median

import numpy as np

from ..decoding.loop import RoundStats
from .scheduler import StepRateCurve

# Without any measurement or profile: a drafting round costs this many plain
# rounds plus this much per draft (a CPU-like verify whose cost grows with its
# query length). Measurements replace both after the first rounds.
DRAFT_OVERHEAD = 1.3
PER_DRAFT = 0.08


def robust_line(
    ns: list[float], ts: list[float], relative_slope: float
) -> tuple[float, float]:
    """Robust ``t = base + slope * n``: Theil-Sen (the median of the pairwise
    slopes, never negative) once a few pairs of points differ in ``n``, else
    the slope ``relative_slope * base``. The base is the median residual, and
    at least half the cheapest point (one noisy pair must not make a short
    round look free). Plain Python: a few dozen points."""
    pairs = [(i, j) for i in range(len(ns)) for j in range(i) if ns[i] != ns[j]]
    if len(pairs) >= 4:
        slope = max(0.0, median((ts[i] - ts[j]) / (ns[i] - ns[j]) for i, j in pairs))
        base = median(t - slope * n for n, t in zip(ns, ts, strict=True))
        return max(base, 0.5 * min(ts)), slope
    base = median(t / (1.0 + relative_slope * n) for n, t in zip(ns, ts, strict=True))
    return base, relative_slope * base


@dataclass
class MeasuredCosts:
    """What a run measured since its costs were last written back: per
    verified query length, per drafting pass of the drafter's own block and
    per plain round, ``(median recent seconds, rounds measured)``."""

    verify: dict[int, tuple[float, int]] = field(default_factory=dict)
    draft: tuple[float, int] | None = None
    plain: tuple[float, int] | None = None

    def __bool__(self) -> bool:
        return bool(self.verify) or self.draft is not None or self.plain is not None


@dataclass
class RoundCosts:
    """Recent measured costs of rounds, by kind and query length.

    ``window`` measurements are kept per query length and for plain rounds,
    ``drafted_window`` for drafting and host times; verify measurements
    older than ``memory`` rounds are forgotten (the machine's load moves; a
    stale plain cost is kept, bounded by the drafted rounds' verifies, since
    the lengths still measured would price it through the profile's shape).
    """

    profile: StepRateCurve | None = None
    window: int = 5
    drafted_window: int = 12
    memory: int = 256
    rounds: int = 0
    plain: deque = field(default_factory=deque)
    verify: dict[int, deque] = field(default_factory=dict)  # q: (round, seconds)
    drafting: deque = field(default_factory=deque)  # rounds in steady state
    catching_up: deque = field(default_factory=deque)  # after a plain run
    host: deque = field(default_factory=deque)
    # The drafter's own block in steady rounds (a copy may skip the drafter),
    # and what was measured since the last write-back (take_measured).
    own_drafting: deque = field(default_factory=deque)
    # Rounds that verified a draft without running the drafter (suffix drafts
    # with a drafter): their proposing time.
    undrafted: deque = field(default_factory=deque)
    unsaved: dict = field(default_factory=dict)  # q, "draft", "plain": rounds

    def __post_init__(self) -> None:
        self.plain = deque(self.plain, maxlen=self.window)
        self.verify = {q: deque(v, maxlen=self.window) for q, v in self.verify.items()}
        self.drafting = deque(self.drafting, maxlen=self.drafted_window)
        self.catching_up = deque(self.catching_up, maxlen=self.window)
        self.host = deque(self.host, maxlen=self.drafted_window)
        self.own_drafting = deque(self.own_drafting, maxlen=self.drafted_window)
        self.undrafted = deque(self.undrafted, maxlen=self.drafted_window)
        self.unsaved = dict(self.unsaved)

    def copy(self) -> RoundCosts:
        """An independent copy (a later generation starts from it)."""
        return replace(self)

    def observe(self, stats: RoundStats, steady: bool, drafter: bool = True) -> None:
        """Record a finished round. ``steady``: a drafted round that follows a
        drafted round (the first one after a plain run also feeds the drafter
        all the context since, so its drafting time is only an upper bound).
        ``drafter``: whether the drafter ran (not for a draft verified as it
        is, whose proposing time is kept apart)."""
        self.rounds += 1
        if stats.drafted == 0:
            self.plain.append(stats.wall_time or stats.verify_time)
            self._unsaved("plain")
            return
        q = stats.verified + 1
        times = self.verify.setdefault(q, deque(maxlen=self.window))
        times.append((self.rounds, stats.verify_time))
        self._unsaved(q)
        if not drafter:
            self.undrafted.append(stats.draft_time)
        elif steady:
            self.drafting.append(stats.draft_time)
        else:
            self.catching_up.append(stats.draft_time)
        if drafter and steady and not stats.copy_offered:
            self.own_drafting.append(stats.draft_time)
            self._unsaved("draft")
        if stats.wall_time:
            self.host.append(
                max(0.0, stats.wall_time - stats.draft_time - stats.verify_time)
            )

    def _unsaved(self, what: int | str) -> None:
        self.unsaved[what] = self.unsaved.get(what, 0) + 1

    def take_measured(self) -> MeasuredCosts:
        """What was measured since the last call (the median of each cost's
        recent measurements, and how many rounds measured it since), and
        start counting again."""
        measured = MeasuredCosts()
        recent = self.measured()
        for what, rounds in self.unsaved.items():
            if what == "plain" and self.plain:
                measured.plain = (median(self.plain), rounds)
            elif what == "draft" and self.own_drafting:
                measured.draft = (median(self.own_drafting), rounds)
            elif isinstance(what, int) and what in recent:
                measured.verify[what] = (recent[what], rounds)
        self.unsaved = {}
        return measured

    # -- estimates ---------------------------------------------------------

    def _recent(self, times: deque) -> list[float]:
        oldest = self.rounds - self.memory
        return [t for at, t in times if at > oldest]

    def measured(self) -> dict[int, float]:
        """Median recent verify seconds by measured query length."""
        out = {}
        for q in sorted(self.verify):
            recent = self._recent(self.verify[q])
            if recent:
                out[q] = median(recent)
        return out

    def host_seconds(self) -> float:
        return median(self.host) if self.host else 0.0

    def _measured_plain(
        self, measured: dict[int, float], plain: float | None = None
    ) -> float | None:
        """Median of the last plain rounds (or ``plain``), never above the
        shortest measured drafted round's verify plus host time (a plain
        round does less)."""
        if not self.plain:
            return None
        plain = median(self.plain) if plain is None else plain
        if measured:
            plain = min(plain, measured[min(measured)] + self.host_seconds())
        return plain

    def _log_ratios(self, measured: dict[int, float]) -> tuple[list[int], list[float]]:
        """log(measured / profile) at the measured lengths; without any, the
        plain rounds' against a one-token forward; else 0."""
        step = self.profile.step_seconds
        if measured:
            qs = list(measured)
            return qs, [math.log(measured[q] / step(q)) for q in qs]
        plain = self._measured_plain(measured)
        return [1], [0.0 if plain is None else math.log(plain / step(1))]

    def verify_seconds(self, qs: list[int]) -> list[float]:
        """Predicted verify seconds at each query length of ``qs``: measured
        lengths their median, others the prior (the profile scaled to the
        measurements, or a line through them) held to what the measured
        lengths around them allow: no less than a shorter one, and between
        two, on the line joining them where the prior falls outside."""
        measured = self.measured()
        if self.profile is not None:
            known, logs = self._log_ratios(measured)
            ratios = np.exp(np.interp(qs, known, logs))
            step = self.profile.step_seconds
            prior = [r * step(q) for q, r in zip(qs, ratios, strict=True)]
        elif measured:
            points = [(q, t) for q in measured for t in self._recent(self.verify[q])]
            base, slope = robust_line(
                [q - 1 for q, _ in points], [t for _, t in points], PER_DRAFT
            )
            prior = [max(base + slope * (q - 1), 1e-9) for q in qs]
        else:
            plain = self._measured_plain(measured) or 1.0
            prior = [plain * (1.0 + PER_DRAFT * (q - 1)) for q in qs]
        out = []
        for q, t in zip(qs, prior, strict=True):
            below = [k for k in measured if k <= q]
            above = [k for k in measured if k > q]
            if below and below[-1] == q:
                t = measured[q]
            elif below and above:
                a, b = below[-1], above[0]
                if not measured[a] <= t <= measured[b]:
                    t = measured[a] + (measured[b] - measured[a]) * (q - a) / (b - a)
            elif below:
                t = max(t, measured[below[-1]])
            elif above:
                t = min(t, measured[above[0]])
            out.append(float(t))
        return out

    def draft_seconds(self) -> float:
        """The drafter's pass: measured in steady rounds; else the profile's
        (scaled like the verifies), never above what rounds after a plain run
        took (an upper bound); without a profile a share of a plain round."""
        if self.drafting:
            return median(self.drafting)
        measured = self.measured()
        if self.profile is not None:
            logs = self._log_ratios(measured)[1]
            prior = self.profile.draft_seconds * math.exp(median(logs))
        else:
            prior = (DRAFT_OVERHEAD - 1.0) * (self._measured_plain(measured) or 1.0)
        if self.catching_up:
            return min(prior, median(self.catching_up))
        return prior

    def costs(self, cap: int, drafter: bool = True) -> list[float]:
        """Predicted seconds of a round verifying n = 0..cap drafts (with
        ``drafter=False``, drafts proposed without running the drafter)."""
        verify = self.verify_seconds(list(range(1, cap + 2)))
        host = self.host_seconds()
        measured = self.measured()
        plain = verify[0] + host  # as the drafted rounds price a plain one
        stored = self._stored_plain(measured)
        if stored is not None:  # as an earlier run measured it
            plain = stored
            if measured:  # a plain round does less than a drafted one
                plain = min(plain, measured[min(measured)] + host)
        if self.plain:
            # Until a full window of plain rounds is measured (perhaps under
            # another load than the drafted ones, and not again while
            # drafting), that price votes for the missing ones.
            votes = [*self.plain, *[plain] * (self.window - len(self.plain))]
            plain = self._measured_plain(measured, median(votes))
        draft = self.draft_seconds()
        if not drafter:
            draft = median(self.undrafted) if self.undrafted else 0.0
        return [plain] + [draft + v + host for v in verify[1:]]

    def _stored_plain(self, measured: dict[int, float]) -> float | None:
        """The plain round's cost an earlier run wrote into the profile,
        scaled like the verifies (None without one)."""
        meta = {} if self.profile is None else self.profile.meta
        stored = meta.get("plain_seconds")
        if not stored:
            return None
        known, logs = self._log_ratios(measured)
        return float(stored) * math.exp(float(np.interp(1, known, logs)))

    def optimistic(self, cap: int) -> list[float]:
        """:meth:`costs` with the rounds not measured (lately) whose price
        rests on extrapolation priced at the least they can cost: the drafted length
        one past the longest measured at that one's verify (plus draft and
        host time), and a plain round at the profile's own one-token forward
        (its scale to measured rounds is what is unsure). One length at a
        time: the next one's least cost is then the measured one's, close to
        its true cost wherever costs climb steeply (quantized targets on a
        CPU), where trying a long round on the floor of a short one would
        cost several plain rounds."""
        costs = self.costs(cap)
        measured = self.measured()
        if self.profile is not None and not self.plain:
            costs[0] = min(costs[0], self.profile.step_seconds(1))
        if measured and max(measured) <= cap:
            n = max(measured)  # verifies n + 1 tokens
            least = self.draft_seconds() + measured[n] + self.host_seconds()
            costs[n] = min(costs[n], least)
        return costs
