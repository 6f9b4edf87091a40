"""Round costs follow what rounds take: a wrong cached profile is corrected by
the rounds themselves. Costs are simulated (no wall clock): each round reports
the seconds a machine with known costs would take."""

import itertools
from collections import Counter

import mlx.core as mx
import pytest

from mlx_dspark.decoding.loop import RoundStats
from mlx_dspark.policy.adaptive import AdaptivePolicy
from mlx_dspark.policy.costs import RoundCosts
from mlx_dspark.policy.scheduler import StepRateCurve
from mlx_dspark.proposers.base import Proposal

NO_PROPOSAL = Proposal(mx.zeros((1, 0), mx.int32), mx.zeros((1, 0, 1)))
DRAFT = 0.002
# Target steps/s for 1..9 query tokens in a profile measured while another
# process ran (issue 71): non-monotone.
CONTENDED = [13.1, 10.5, 9.1, 1.8, 1.8, 1.7, 2.9, 3.9, 6.8]


def flat(q: int) -> float:
    """A float target with a good BLAS: 9 tokens cost little more than one."""
    return 0.010 * (1.0 + 0.03 * (q - 1))


def linear(q: int) -> float:
    """A 4-bit target on MLX's CPU backend: q tokens cost q times one."""
    return 0.010 * q


MACHINES = {"flat": flat, "linear": linear}
# Drafts the target keeps each round, cycled (min(kept, verified) are kept).
TEXTS = {
    "uneven": [0, 1, 2, 3, 4, 5, 6, 7],
    "short": [0, 0, 1, 2, 3],
    "easy": [7, 7, 7, 0, 7, 3],
    "poor": [0, 0, 1, 2],
}
WRONG = {
    "verify 10x too high": (lambda q: 10.0 if q > 1 else 1.0, 1.0),
    "verify 10x too low": (lambda q: 0.1 if q > 1 else 1.0, 1.0),
    "verify of 4-9 tokens 10x too high": (lambda q: 10.0 if 4 <= q <= 9 else 1.0, 1.0),
    "drafting 10x too high": (lambda q: 1.0, 10.0),
}


def curve_for(verify, wrong=lambda q: 1.0, draft_factor=1.0, sizes=9):
    qs = list(range(1, sizes + 1))
    rates = [1.0 / (verify(q) * wrong(q)) for q in qs]
    return StepRateCurve(qs, rates, DRAFT * draft_factor)


def contended(verify):
    """The issue's contended profile, as errors against ``verify``."""
    return lambda q: (CONTENDED[0] / CONTENDED[q - 1]) / (verify(q) / verify(1))


def simulate(policy, verify, kept, rounds=100, cap=7):
    """Drive the policy's hooks as the loop does, each round taking the time
    ``verify`` (and ``DRAFT``) say; returns the lengths chosen and the
    tokens and seconds of each round."""
    kept = itertools.cycle(kept)
    chosen, tokens, seconds = [], [], []
    for _ in range(rounds):
        n = policy.round_cap(cap)
        k = next(kept)
        if n == 0:
            stats = RoundStats(0, 0, 0, 0.0, verify(1))
        else:
            stats = RoundStats(n, n, min(n, k), DRAFT, verify(n + 1))
        policy.observe(NO_PROPOSAL, stats)
        chosen.append(n)
        tokens.append(stats.accepted + 1)
        seconds.append(stats.draft_time + stats.verify_time)
    return chosen, tokens, seconds


@pytest.mark.parametrize("wrong", WRONG, ids=str)
@pytest.mark.parametrize(
    "machine,text",
    [("flat", "uneven"), ("flat", "short"), ("flat", "easy"), ("linear", "poor")],
)
def test_a_wrong_profile_converges_to_the_choices_of_a_right_one(machine, text, wrong):
    verify, kept = MACHINES[machine], TEXTS[text]
    right = simulate(AdaptivePolicy(profile=curve_for(verify)), verify, kept)
    errors, draft_factor = WRONG[wrong]
    policy = AdaptivePolicy(profile=curve_for(verify, errors, draft_factor))
    chosen, tokens, seconds = simulate(policy, verify, kept)
    # After a few dozen rounds: the same lengths, as often, and the same speed.
    start = 40
    most = Counter(chosen[start:]).most_common(1)[0][0]
    assert most == Counter(right[0][start:]).most_common(1)[0][0], (chosen, right[0])
    rate = sum(tokens[start:]) / sum(seconds[start:])
    right_rate = sum(right[1][start:]) / sum(right[2][start:])
    assert rate >= 0.99 * right_rate, (chosen, right[0])


@pytest.mark.parametrize("machine,slowest", [("flat", 0.99), ("linear", 0.95)])
def test_the_contended_profile_of_the_issue_is_corrected_by_the_rounds(
    machine, slowest
):
    """Issue 71's profile (non-monotone, drafting 7x too dear), as if it had
    contradicted itself again when measured again. On the linear machine the
    profile's cheap long verifies keep the one-draft probes going (which
    acceptance alone would schedule), so it stays a little behind."""
    verify = MACHINES[machine]
    kept = TEXTS["uneven" if machine == "flat" else "poor"]
    right = simulate(AdaptivePolicy(profile=curve_for(verify)), verify, kept, 300)
    bad = curve_for(verify, contended(verify), draft_factor=7.0)
    chosen, tokens, seconds = simulate(AdaptivePolicy(profile=bad), verify, kept, 300)
    start = 40
    rate = sum(tokens[start:]) / sum(seconds[start:])
    assert rate >= slowest * sum(right[1][start:]) / sum(right[2][start:])


def test_a_target_whose_verify_costs_k_steps_decodes_plainly():
    """A 4-bit target on MLX's CPU backend: verifying k tokens costs k steps,
    so no acceptance makes drafting pay. With a right profile the policy
    decodes plainly from the start and, once a probe has measured a
    one-draft round, stops probing even when drafts are kept."""
    for text in TEXTS.values():
        policy = AdaptivePolicy(profile=curve_for(linear))
        chosen, tokens, seconds = simulate(policy, linear, text, 300)
        assert chosen[:8] == [0] * 8
        assert sum(n > 0 for n in chosen) <= 2, chosen
        assert sum(tokens) / sum(seconds) >= 0.99 / linear(1)


def test_every_round_prices_its_length_and_corrects_the_others():
    """A profile 10x too cheap everywhere: one measured round at 8 tokens
    prices 8 tokens as measured and, by the same factor, every other length
    (the profile's shape is kept between measurements)."""
    truth = curve_for(flat)
    costs = RoundCosts(curve_for(flat, lambda q: 0.1, 0.1))
    assert costs.costs(7)[7] == pytest.approx(0.1 * (DRAFT + flat(8)))
    costs.observe(RoundStats(7, 7, 3, DRAFT, flat(8)), steady=True)
    assert costs.verify_seconds([8]) == [flat(8)]
    predicted = costs.verify_seconds(list(range(1, 9)))
    assert predicted == pytest.approx([truth.step_seconds(q) for q in range(1, 9)])
    assert costs.draft_seconds() == DRAFT  # measured in a steady round


def test_a_length_between_measured_ones_is_priced_between_them():
    """The profile prices 5 tokens 10x too high; measured 3 and 7 tokens
    bound it, whatever the profile says."""
    costs = RoundCosts(curve_for(linear, lambda q: 10.0 if q == 5 else 1.0))
    for q in (3, 7):
        costs.observe(RoundStats(q - 1, q - 1, 0, DRAFT, linear(q)), steady=True)
    assert costs.verify_seconds([5]) == pytest.approx([linear(5)])
    # Without a measurement above it, a length costs no less than a shorter one.
    costs = RoundCosts(curve_for(linear, lambda q: 0.1 if q == 8 else 1.0))
    costs.observe(RoundStats(6, 6, 0, DRAFT, linear(7)), steady=True)
    assert costs.verify_seconds([8]) == [linear(7)]


def test_measurements_are_forgotten_after_memory_rounds():
    costs = RoundCosts(curve_for(flat), memory=10)
    costs.observe(RoundStats(3, 3, 0, DRAFT, 10 * flat(4)), steady=True)
    assert costs.verify_seconds([4]) == [10 * flat(4)]
    for _ in range(10):
        costs.observe(RoundStats(0, 0, 0, 0.0, flat(1)), steady=False)
    assert costs.verify_seconds([4]) == pytest.approx([flat(4)])


def test_a_length_priced_too_high_is_tried_and_then_priced_as_measured():
    """Without exploration a length whose prediction loses is never measured:
    here the profile prices 3 to 9 tokens 10x too high and 2 tokens right."""
    wrong = curve_for(flat, lambda q: 10.0 if q > 2 else 1.0)
    policy = AdaptivePolicy(profile=wrong)
    chosen, *_ = simulate(policy, flat, TEXTS["easy"], rounds=30)
    assert max(chosen) == 7 and chosen[-10:] == [7] * 10
    never = AdaptivePolicy(profile=wrong, explore_every=10**9)
    chosen, *_ = simulate(never, flat, TEXTS["easy"], rounds=30)
    assert max(chosen) == 1


def test_exploration_is_bounded():
    """With drafts never kept nothing is worth trying; with a profile whose
    every drafted length is priced 10x too high and drafts always kept, a
    few tries find the truth, and no length is tried twice."""
    policy = AdaptivePolicy(profile=curve_for(linear))
    simulate(policy, linear, [0], rounds=300)
    assert policy.explored_at == 0
    policy = AdaptivePolicy(profile=curve_for(flat, lambda q: 10.0 if q > 1 else 1.0))
    tries = []
    kept = itertools.cycle([7])
    for _ in range(200):
        before = policy.explored_at
        n = policy.round_cap(7)
        if policy.explored_at != before:
            tries.append(n)
        stats = RoundStats(n, n, min(n, next(kept)), DRAFT, flat(n + 1))
        policy.observe(NO_PROPOSAL, stats if n else RoundStats(0, 0, 0, 0, flat(1)))
    assert len(tries) == len(set(tries)) <= 3, tries


def test_plain_rounds_are_measured_when_only_extrapolation_prices_them():
    """Verifies of 2+ tokens priced 10x too low, a one-token step right, and
    drafts that do not pay: drafting rounds alone would price a plain round
    by the drafted rounds' ratio to the profile (10x too high) and never
    leave them."""
    verify = linear
    wrong = curve_for(verify, lambda q: 0.1 if q > 1 else 1.0)
    chosen, *_ = simulate(AdaptivePolicy(profile=wrong), verify, TEXTS["poor"])
    assert chosen[0] > 0 and chosen[-50:].count(0) >= 45


def test_one_slow_plain_round_does_not_price_plain_rounds():
    """Plain rounds are not re-measured while drafting: one measured during a
    hiccup would otherwise price them all, and a plain round priced like a
    one-draft verify makes drafting one look nearly free on a target whose
    verify of 2 tokens costs 2 steps. The drafted rounds' price for it votes
    until a window of plain rounds is measured."""
    costs = RoundCosts(curve_for(linear))
    for _ in range(5):
        costs.observe(RoundStats(1, 1, 0, DRAFT, linear(2)), steady=True)
    costs.observe(RoundStats(0, 0, 0, 0.0, 3 * linear(1)), steady=False)
    plain, one = costs.costs(1)
    assert plain == pytest.approx(linear(1)) and one == pytest.approx(DRAFT + linear(2))
    for _ in range(4):  # slow every time: that is what plain rounds cost
        costs.observe(RoundStats(0, 0, 0, 0.0, 3 * linear(1)), steady=False)
    assert costs.costs(1)[0] == pytest.approx(linear(2))  # no more than a verify
