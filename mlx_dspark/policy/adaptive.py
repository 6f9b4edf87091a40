"""The default draft policy: each round, the draft length with the best
predicted tokens per second, 0 (plain target decoding) included.

Predicted tokens/s for ``n`` drafts is ``E(n) / cost(n)``:

* ``E(n) = 1 + sum_{k<=n} prod_{i<=k} p_i`` from running conditional
  acceptance ``p_k = P(draft k kept | drafts before it kept)``, each a Beta
  posterior whose counts decay by ``decay`` per observation (so the estimate
  follows the text; the prior's weight decays alike) and whose prior mean is
  the acceptance the pair's calibration measured, or without one (and for
  copies, which the calibration's prompts say little about) position
  ``k-1``'s estimate (an unseen deeper position is assumed as good as the one
  before it, which is what lets a pair that drafts well reach long rounds);
  a later generation with the same drafter in the same process starts from
  what the earlier one measured;
* ``cost(n)`` the wall time of a round that verifies ``n`` drafts, the
  caller's time with its tokens included (a pipelined plain round overlaps
  the two), from :class:`~mlx_dspark.policy.costs.RoundCosts`: every round is a
  measurement of its kind and query length, and the pair's cost profile
  (which the default setup measures once and caches,
  :func:`~mlx_dspark.policy.policies.resolve_policy`) only prices the lengths not
  measured lately, scaled to the measured ones. So that a length the profile
  prices too high is measured at all, the policy now and then tries one whose
  least possible cost would clearly win (:meth:`AdaptivePolicy.exploration`).
  When a generation ends, what it measured is merged into the cached
  profile (:meth:`AdaptivePolicy.save_costs`), so a later process starts
  from it.

Drafting stops only when even an optimistic first-draft acceptance (the
estimate plus ``optimism`` standard errors of its decayed counts) predicts
plain rounds faster: near the break-even acceptance a short run of rejected
drafts says little, and once plain the policy learns only from probes.

With a drafter that copies from the context (:mod:`~mlx_dspark.proposers.copying`),
rounds the context offers a copy and rounds it does not are two kinds, each
with its own acceptance, chosen length, plain runs and probes (costs are
shared): copied runs are kept far longer than the drafter's own guesses, and
averaging the two would cut the one and overdraw the other. Whether there is
a copy is known before drafting. Rounds offered a copy may be longer than the
drafter's block (the loop's ``copy_draft``): past it they verify the copy's
own tokens. This policy never reads the drafter's rows in such rounds, which
is what lets the default setup verify a copy that covers a round as it is,
without running the drafter (the loop's ``copy_as_is``). Rounds offered a
copy from the drafter's phrase store are a third kind, whose alternative is
the drafter's own guesses rather than a plain round
(:meth:`AdaptivePolicy.best_length`): a store's copy the policy declines
leaves the round to the kind without a copy.

With suffix drafts and a drafter (``suffix``,
:class:`~mlx_dspark.proposers.suffix.SuffixPairProposer`), the copies are suffix
drafts from the request's index (the copy kind) or the drafter's phrase store
(the phrase-store kind), verified as they are: their rounds are priced
without the drafter's pass, and both kinds' alternative is the best of the
drafter's own block and a plain round, so each round takes whichever of the
three predicts the most tokens per second.

The choice is made before drafting from past rounds only, so it cannot
depend on the drafts it admits: lossless like any fixed length. With an STS
calibration, Algorithm 1 (:func:`~mlx_dspark.policy.scheduler.schedule`) then cuts
the drafted block on the calibrated prefix survival, priced with the same
costs, except in rounds offered a copy: how far a copy holds depends on the
text (code repeats far more than the calibration prompts), which the copies'
own acceptance, measured on this text, already says. Once the policy stops
drafting it probes with one draft after ``probe_after`` plain rounds,
doubling the wait (up to ``probe_max``) after every rejected probe and going
back to ``probe_after`` after a kept one, so a pair that starts badly and
improves (a repetitive passage) drafts again. Where no length would pay even
if every draft were kept (a quantized target on a CPU, whose verify of k
tokens costs about k steps), it does not probe once a one-draft round has
been measured, and says so ahead (:meth:`AdaptivePolicy.plain_ahead`) so the
loop keeps plain steps pipelined.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..decoding.loop import RoundStats
from ..proposers.base import Proposal
from .costs import RoundCosts
from .memory import MemoryGuard
from .recording import RecordingPolicy, guarded_cap, proposal_survival
from .scheduler import StepRateCurve, schedule


@dataclass
class RoundKind:
    """What the policy measured and decided for one kind of round (offered no
    copy, a copy from the context, or one from the phrase store).

    Per draft position the decayed kept and rejected counts and how many
    rounds reached it; how many drafts recent rounds kept; the length chosen
    for the coming rounds of this kind, and the plain-run / probe state.
    """

    successes: list[float] = field(default_factory=list)
    failures: list[float] = field(default_factory=list)
    observations: list[int] = field(default_factory=list)
    kept: deque = field(default_factory=deque)
    choice: int | None = None
    interval: int = 0
    plain_left: int = 0
    probing: bool = False
    probe_hits: float = 0.0
    stale: bool = True
    cap: int = -1

    def add(self, verified: int, accepted: int, decay: float) -> None:
        self.kept.append(accepted)
        while len(self.successes) < verified:
            self.successes.append(0.0)
            self.failures.append(0.0)
            self.observations.append(0)
        for k in range(min(verified, accepted + 1)):
            self.successes[k] *= decay
            self.failures[k] *= decay
            self.observations[k] += 1
            if k < accepted:
                self.successes[k] += 1.0
            else:
                self.failures[k] += 1.0

    def remember(self, earlier: RoundKind) -> None:
        self.interval = earlier.interval
        self.kept.extend(earlier.kept)
        self.successes = list(earlier.successes)
        self.failures = list(earlier.failures)
        self.observations = list(earlier.observations)


@dataclass
class AdaptivePolicy(RecordingPolicy):
    """Per-round draft length 0..cap maximising predicted tokens/s.

    ``profile`` (a cached :class:`StepRateCurve`) seeds costs not measured
    yet; ``calibration`` (the pair's) turns on Algorithm 1 inside a drafted
    block; ``guard`` lowers the cap under memory pressure.
    """

    profile: StepRateCurve | None = None
    guard: MemoryGuard | None = None
    prior: list[float] | None = None  # measured acceptance per position
    decay: float = 0.9
    prior_strength: float = 4.0
    optimism: float = 1.0
    window: int = 5
    drafted_window: int = 12
    probe_after: int = 8
    probe_max: int = 128
    explore_every: int = 16
    explore_margin: float = 1.1
    costs: RoundCosts | None = None
    text: RoundKind = field(default_factory=RoundKind)  # rounds without a copy
    copies: RoundKind = field(default_factory=RoundKind)  # rounds offered one
    phrases: RoundKind = field(default_factory=RoundKind)  # offered the store's
    suffix: bool = False  # copies are suffix drafts verified as they are
    # Never verify drafts past a drafted stop token (the loop reads it).
    cut_at_stop: bool = True
    last_drafted: bool = False
    explored_at: int = 0  # the round of the last exploration
    _offered: bool = False  # the coming round is offered a copy

    def __post_init__(self) -> None:
        if self.costs is None:
            self.costs = RoundCosts(self.profile, self.window, self.drafted_window)
        for kind in (self.text, self.copies, self.phrases):
            kind.interval = self.probe_after
            kind.kept = deque(kind.kept, maxlen=self.drafted_window)

    def remember(self, earlier: AdaptivePolicy) -> None:
        """Start from what an earlier generation measured (costs, acceptance,
        how long drafts were kept, how long to wait before probing), not
        from the prior."""
        self.costs = earlier.costs.copy()
        self.costs.profile = self.profile
        self.explored_at = earlier.explored_at
        self.text.remember(earlier.text)
        self.copies.remember(earlier.copies)
        self.phrases.remember(earlier.phrases)

    # -- estimates ---------------------------------------------------------

    def _kind(self, copy: bool, phrases: bool) -> RoundKind:
        """The kind of a round offered a copy or not, and whether it is the
        phrase store's (the loop's flags)."""
        return self.phrases if phrases else self.copies if copy else self.text

    def _as_is(self, kind: RoundKind) -> bool:
        """Whether rounds of ``kind`` verify a suffix draft as it is: no
        drafter pass, and the drafter's block (or a plain round) as their
        alternative."""
        return self.suffix and kind is not self.text

    def _counts(self, k: int, kind: RoundKind) -> tuple[float, float, float]:
        """Position ``k``'s decayed kept and rejected counts and prior weight."""
        s = kind.successes[k] if k < len(kind.successes) else 0.0
        f = kind.failures[k] if k < len(kind.failures) else 0.0
        seen = kind.observations[k] if k < len(kind.observations) else 0
        return s, f, self.prior_strength * self.decay**seen  # the prior fades too

    def acceptance(self, cap: int, kind: RoundKind | None = None) -> list[float]:
        """Conditional acceptance estimates p_1..p_cap of a kind of round
        (default: rounds without a copy, the only kind the calibration's
        acceptance is a prior for)."""
        kind = self.text if kind is None else kind
        rates, prior = [], 0.5
        measured = self.prior if kind is self.text else None
        for k in range(cap):
            if measured is not None and k < len(measured):
                prior = measured[k]
            s, f, weight = self._counts(k, kind)
            prior = (weight * prior + s) / (weight + s + f)
            rates.append(prior)
        return rates

    def drafting_may_pay(
        self, kind: RoundKind | None = None, beat: float | None = None
    ) -> bool:
        """Whether one draft a round beats plain rounds (or the rate ``beat``)
        at the optimistic first-draft acceptance (``optimism`` standard errors
        above the estimate)."""
        kind = self.text if kind is None else kind
        p = self.acceptance(1, kind)[0]
        s, f, weight = self._counts(0, kind)
        p = min(
            1.0, p + self.optimism * (p * (1.0 - p) / (weight + s + f + 1.0)) ** 0.5
        )
        plain, one = self.round_costs(1, not self._as_is(kind))
        return (1.0 + p) / one > (1.0 / plain if beat is None else beat)

    def round_costs(self, cap: int, drafter: bool = True) -> list[float]:
        """Predicted seconds of a round verifying n = 0..cap drafts (drafted
        by the drafter, or not: a suffix draft verified as it is)."""
        return self.costs.costs(cap, drafter)

    def _rates(self, costs: list[float], kind: RoundKind | None) -> list[float]:
        rates, expected, survive = [1.0 / costs[0]], 1.0, 1.0
        for n, p in enumerate(self.acceptance(len(costs) - 1, kind), start=1):
            survive *= p
            expected += survive
            rates.append(expected / costs[n])
        return rates

    def predicted_rates(self, cap: int, kind: RoundKind | None = None) -> list[float]:
        """Predicted tokens per second for n = 0..cap drafts per round."""
        drafter = kind is None or not self._as_is(kind)
        return self._rates(self.round_costs(cap, drafter), kind)

    def exploration(self, cap: int, kind: RoundKind | None = None) -> int | None:
        """A length to try this round although it is not the best predicted:
        one whose price rests on extrapolation and whose least possible cost
        (:meth:`RoundCosts.optimistic <mlx_dspark.policy.costs.RoundCosts.optimistic>`)
        would beat the best predicted rate by ``explore_margin``. Plain rounds
        first (the cheapest kind to try; most of a ``window`` of them, so
        that their measurements outvote their prior); a drafted length at
        most once every ``explore_every`` rounds. Once measured, a length is
        priced as measured, so each is tried at most once per the costs'
        ``memory``. None when there is none. Lengths beyond
        :meth:`best_length`'s reach are not tried."""
        kind = self.text if kind is None else kind
        if self.costs.rounds == self.explored_at:  # nothing measured since
            return None
        reach = max(kind.kept, default=1) + 1
        longest = min(cap, 2 * reach)
        costs = self.costs.costs(longest)
        least = self.costs.optimistic(longest)
        best = self.explore_margin * max(self._rates(costs, kind))
        rates = self._rates(least, kind)
        tries = [n for n in range(longest + 1) if least[n] < costs[n]]
        tries = [n for n in tries if rates[n] > best]
        if tries and tries[0] > 0:
            waited = self.costs.rounds - self.explored_at
            tries = tries if waited >= self.explore_every else []
        if not tries:
            return None
        self.explored_at = self.costs.rounds
        return tries[0] if tries[0] == 0 else max(tries, key=lambda n: rates[n])

    def drafting_can_pay(self, cap: int) -> bool:
        """Whether some length would beat plain rounds if every draft were
        kept (also when a one-draft round was not measured lately: probes
        measure it). When not, probing for better acceptance is pointless:
        on a target whose verify of k tokens costs k steps (quantized on a
        CPU) it only costs time."""
        costs = self.costs.costs(cap)
        if 2 not in self.costs.measured():
            return True
        return max((n + 1) / costs[n] for n in range(1, cap + 1)) > 1.0 / costs[0]

    def best_length(self, cap: int, kind: RoundKind | None = None) -> int:
        """The best predicted length; among lengths within 1% of the best, the
        longest (cheap deeper drafts keep their acceptance measured). Lengths
        beyond twice the longest recently kept prefix (plus one) are not
        considered: deep drafts are only tried once shallow ones are kept.
        Plain (0) only when :meth:`drafting_may_pay` says no; else at least 1.

        For rounds offered the phrase store's copy, 0 is the drafter's own
        guesses instead (the best rate of rounds without a copy), which the
        loop then drafts as such a round."""
        kind = self.text if kind is None else kind
        reach = max(kind.kept, default=1) + 1
        rates = self.predicted_rates(min(cap, 2 * reach), kind)
        phrases = kind is self.phrases or self._as_is(kind)
        if phrases:
            own_reach = max(self.text.kept, default=1) + 1
            own_cap = self.text.cap if self.text.cap > 0 else cap
            rates[0] = max(self.predicted_rates(min(own_cap, 2 * own_reach)))
        best = 0.99 * max(rates)
        length = max(n for n, rate in enumerate(rates) if rate >= best)
        beat = rates[0] if phrases else None
        if length == 0 and cap > 0 and self.drafting_may_pay(kind, beat):
            return 1
        return length

    # -- the loop's hooks --------------------------------------------------

    def plain_ahead(self, phrases: bool = True) -> bool:
        """Whether the coming round is plain whatever copy it is offered
        (``phrases``: a copy may come from a phrase store): every kind it can
        be is in a plain run, or at its end with no length that could pay.
        The loop then queues its step before the previous token reaches the
        host, even with copying."""
        kinds = [self.text, self.copies] + ([self.phrases] if phrases else [])
        return all(self._plain_next(kind) for kind in kinds)

    def _plain_next(self, kind: RoundKind) -> bool:
        if kind.plain_left > 0:
            return True
        ended = kind.choice == 0 and not kind.stale and kind.cap > 0
        return ended and not self.drafting_can_pay(kind.cap)

    def round_cap(self, cap: int, copy: bool = False, phrases: bool = False) -> int:
        cap = guarded_cap(self.guard, self.telemetry, cap)
        self._offered = copy
        n = self._decide(cap, self._kind(copy, phrases)) if cap > 0 else 0
        self.telemetry.n_current = n
        return n

    def _decide(self, cap: int, kind: RoundKind) -> int:
        if kind.plain_left > 0:  # counting plain rounds: no arithmetic
            kind.plain_left -= 1
            return 0
        if kind.stale or cap != kind.cap:
            previous = kind.choice
            kind.choice, kind.cap = self.best_length(cap, kind), cap
            kind.stale = False
            probed, kind.probing = kind.probing, False
            trial = None
            if kind is not self.phrases and not self._as_is(kind) and not probed:
                trial = self.exploration(cap, kind)
            if trial is not None and trial != kind.choice:
                kind.stale = True  # decide again after the trial
                if trial == 0:  # enough plain rounds to outvote their prior
                    kind.plain_left = self.window // 2
                return trial
            if kind.choice == 0:
                if probed and self._counts(0, kind)[0] > kind.probe_hits:
                    kind.interval = self.probe_after  # a kept probe: look again soon
                elif probed:  # a rejected probe: wait longer
                    kind.interval = min(2 * kind.interval, self.probe_max)
                elif previous != 0:
                    kind.interval = self.probe_after
                kind.plain_left = kind.interval - 1
                return 0
            if probed:
                kind.interval = self.probe_after
            return min(kind.choice, cap)
        if kind.choice == 0:  # the plain run is over: probe with one draft
            if not self.drafting_can_pay(cap):  # as after a rejected probe
                kind.interval = min(2 * kind.interval, self.probe_max)
                kind.plain_left = kind.interval - 1
                return 0
            kind.probing = True
            kind.probe_hits = self._counts(0, kind)[0]
            return 1
        return min(kind.choice, cap)

    def draft_length(self, proposal: Proposal, cap: int) -> int:
        if self.calibration is None or self._offered:
            return cap
        survival = proposal_survival(proposal, cap, self.calibration)
        if survival is None:
            return cap
        costs = self.round_costs(cap)
        costs[0] = costs[1]  # the block is drafted already: verifying 0 saves little
        curve = StepRateCurve(list(range(1, cap + 2)), [1.0 / t for t in costs])
        return schedule([survival], curve, [cap])[0]

    def save_costs(self) -> bool:
        """Merge the costs measured since the last call into the cached
        profile this policy started from
        (:func:`~mlx_dspark.policy.profile.save_measured`), so that the next
        process starts from them; whether it was written. Nothing is written
        for a profile that did not come from the cache (no ``meta["key"]``)."""
        from .profile import save_measured

        measured = self.costs.take_measured()
        key = None if self.profile is None else self.profile.meta.get("key")
        return key is not None and save_measured(key, measured)

    def observe(self, proposal: Proposal, round_stats: RoundStats) -> None:
        super().observe(proposal, round_stats)
        steady, self.last_drafted = self.last_drafted, round_stats.drafted > 0
        as_is = self.suffix and round_stats.copy_offered and self.last_drafted
        self.costs.observe(round_stats, steady, drafter=not as_is)
        if not self.last_drafted:
            return
        kind = self._kind(round_stats.copy_offered, round_stats.phrases_offered)
        if self._as_is(kind):  # the drafter did not run
            self.last_drafted = False
        kind.add(round_stats.verified, round_stats.accepted, self.decay)
        kind.stale = True
