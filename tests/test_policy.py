"""The default (adaptive) policy: when it drafts, when it decodes plainly, and
that mixing plain rounds into the loop keeps generation lossless."""

import itertools
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from test_copying import copy_bias, repeated_walk
from test_sampling import (
    CONFIGS,
    PROMPT,
    chi_square,
    chi_square_critical,
    exact_joint,
    sample_first_three,
)
from test_schedint import fitted

from mlx_dspark import stream_generate
from mlx_dspark.benchmark import randomize_weights
from mlx_dspark.decoding import loop
from mlx_dspark.decoding.loop import (
    GenerationStats,
    RoundStats,
    speculative_generate_step,
)
from mlx_dspark.loading import load
from mlx_dspark.policy.adaptive import AdaptivePolicy
from mlx_dspark.policy.scheduler import StepRateCurve
from mlx_dspark.policy.settings import COPY_DRAFTS
from mlx_dspark.proposers import copying
from mlx_dspark.proposers.base import Proposal
from mlx_dspark.proposers.copying import COPY_CONFIG, pair_proposer
from mlx_dspark.proposers.suffix_store import context_copy
from mlx_dspark.sampling.processing import SamplingParams
from mlx_dspark.targets.adapter import TargetAdapter

NO_PROPOSAL = Proposal(mx.zeros((1, 0), mx.int32), mx.zeros((1, 0, 1)))
PLAIN_SECONDS = 0.010


def drafted_seconds(n: int) -> tuple[float, float]:
    """(draft, verify) seconds of a round with n drafts: a CPU-like verify."""
    return 0.002, PLAIN_SECONDS * (1.0 + 0.1 * n)


def play(policy, rounds: int, accept, cap: int = 7) -> list[int]:
    """Drive the policy's hooks as the loop does; ``accept(n)`` says how many of
    n verified drafts the target keeps. Returns the lengths chosen."""
    chosen = []
    for _ in range(rounds):
        n = policy.round_cap(cap)
        chosen.append(n)
        if n == 0:
            stats = RoundStats(0, 0, 0, verify_time=PLAIN_SECONDS)
            policy.observe(NO_PROPOSAL, stats)
            continue
        draft, verify = drafted_seconds(n)
        stats = RoundStats(n, n, accept(n), draft, verify)
        policy.observe(NO_PROPOSAL, stats)
    return chosen


def test_never_accepted_drafts_mean_plain_decoding():
    policy = AdaptivePolicy()
    chosen = play(policy, 200, lambda n: 0)
    assert chosen[0] > 0  # it tries drafting first
    assert chosen[-100:].count(0) >= 97  # then decodes plainly, probing rarely
    assert set(chosen[-100:]) <= {0, 1}
    assert policy.text.interval == policy.probe_max  # failed probes back off


def test_always_accepted_drafts_mean_full_rounds():
    policy = AdaptivePolicy()
    chosen = play(policy, 30, lambda n: n)
    assert 0 not in chosen
    assert chosen[-10:] == [7] * 10


def test_acceptance_that_stops_at_three_drafts_three():
    policy = AdaptivePolicy()
    chosen = play(policy, 60, lambda n: min(n, 3))
    assert chosen[-10:].count(3) >= 8 or set(chosen[-10:]) <= {3, 4}


def test_probing_brings_drafting_back_when_the_text_turns_easy():
    policy = AdaptivePolicy()
    play(policy, 100, lambda n: 0)
    assert policy.best_length(7) == 0
    chosen = play(policy, 150, lambda n: n)
    assert chosen[-10:] == [7] * 10
    assert 0 in chosen[:5]  # it was still decoding plainly at first


def test_probe_schedule():
    policy = AdaptivePolicy(probe_after=4, probe_max=16)
    chosen = play(policy, 120, lambda n: 0)
    probes = [i for i in range(1, 120) if chosen[i] == 1 and chosen[i - 1] == 0]
    first_plain = chosen.index(0)
    assert probes[0] - first_plain == 4  # probe_after plain rounds, then a probe
    assert np.diff(probes).tolist()[:4] == [9, 17, 17, 17]  # waits 8, then 16 (max)


def test_a_short_run_of_rejections_near_break_even_does_not_stop_drafting():
    """A draft costs 0.3 of a plain round here, so drafting pays above an
    acceptance of 0.3. After the first draft was kept every other round, eight
    rejected rounds in a row (one chance in 250 at 0.5) still leave the
    optimistic acceptance above break-even; more stop drafting."""
    policy = AdaptivePolicy()
    for _ in range(5):
        policy.observe(NO_PROPOSAL, RoundStats(0, 0, 0, verify_time=PLAIN_SECONDS))
    kept = iter([1, 0] * 30)
    assert 0 not in play(policy, 60, lambda n: min(n, next(kept)))
    chosen = play(policy, 16, lambda n: 0)
    assert 0 not in chosen[:9]
    assert chosen[-4:] == [0] * 4
    assert policy.acceptance(1)[0] < 0.3  # the estimate alone would have stopped


def play_kinds(policy, rounds, offered, accept, cap=7, copies_known=True):
    """``play`` with rounds the context offers a copy every ``offered``-th
    round (the policy is told only when ``copies_known``); ``accept(n,
    copy)``. Returns the lengths chosen per kind and the tokens per second."""
    chosen, tokens, seconds = {True: [], False: []}, 0, 0.0
    for i in range(rounds):
        copy = i % offered == 0
        told = copy and copies_known
        n = policy.round_cap(cap, copy=told)
        chosen[copy].append(n)
        times = drafted_seconds(n) if n else (0.0, PLAIN_SECONDS)
        stats = RoundStats(n, n, accept(n, copy), *times, copy_offered=told)
        tokens, seconds = tokens + stats.accepted + 1, seconds + sum(times)
        policy.observe(NO_PROPOSAL, stats)
    return chosen, tokens / seconds


def test_rounds_offered_a_copy_are_sized_by_copied_rounds():
    """Copies always kept, the drafter's own guesses never: every round
    offered a copy verifies the whole cap while the others decode plainly,
    probing now and then (copied rounds do not postpone those probes)."""
    policy = AdaptivePolicy()
    accept = lambda n, copy: n if copy else 0  # noqa: E731
    chosen, rate = play_kinds(policy, 300, 3, accept)
    assert chosen[True][-50:] == [7] * 50
    assert chosen[False][-100:].count(0) >= 95
    text = chosen[False]
    probes = sum(1 for i in range(1, len(text)) if text[i] == 1 and text[i - 1] == 0)
    assert 3 <= probes <= 6  # after 8, 16, 32, 64 plain rounds
    # A policy told nothing about copies drafts every round: slower.
    _, blind = play_kinds(AdaptivePolicy(), 300, 3, accept, copies_known=False)
    assert rate > 1.3 * blind, (rate, blind)


def test_copies_that_stop_paying_go_plain_and_are_probed():
    policy = AdaptivePolicy()
    chosen, _ = play_kinds(policy, 400, 2, lambda n, copy: 0 if copy else n)
    assert chosen[False][-20:] == [7] * 20
    assert chosen[True][-100:].count(0) >= 95
    assert policy.copies.interval == policy.probe_max


def test_plain_rounds_cost_no_policy_arithmetic(monkeypatch):
    policy = AdaptivePolicy()
    play(policy, 50, lambda n: 0)
    while policy.text.plain_left < 2:
        play(policy, 1, lambda n: 0)
    calls = []
    original = policy.best_length
    monkeypatch.setattr(
        policy, "best_length", lambda cap, copy=False: calls.append(cap) or 0
    )
    chosen = play(policy, policy.text.plain_left, lambda n: 0)
    assert set(chosen) == {0} and not calls
    monkeypatch.setattr(policy, "best_length", original)


def test_costs_come_from_the_profile_until_measured():
    # A profile where a verify of 8 tokens costs 4x one token: drafting loses
    # even with fair acceptance, before any round has been measured.
    curve = StepRateCurve([1, 8], [100.0, 25.0], draft_seconds=0.01)
    policy = AdaptivePolicy(profile=curve)
    costs = policy.round_costs(7)
    assert costs[0] == pytest.approx(0.01)
    assert costs[7] == pytest.approx(0.05)
    policy.text.successes, policy.text.failures = [1.0], [3.0]
    assert policy.best_length(7) == 0
    assert AdaptivePolicy().best_length(7) > 0  # no profile: the optimistic start


def test_calibration_cuts_inside_a_drafted_block():
    policy = AdaptivePolicy(calibration=fitted(temperatures=[1.0] * 4))
    play(policy, 10, lambda n: n, cap=4)
    confident = Proposal(mx.zeros((1, 4), mx.int32), None, mx.array([[9.0] * 4]))
    doubtful = Proposal(
        mx.zeros((1, 4), mx.int32), None, mx.array([[9.0, -9.0, 9.0, 9.0]])
    )
    assert policy.draft_length(confident, 4) == 4
    assert policy.draft_length(doubtful, 4) == 1
    assert AdaptivePolicy().draft_length(doubtful, 4) == 4  # no calibration
    # A round offered a copy verifies the length chosen for copies.
    n = policy.round_cap(4, copy=True)
    assert n > 1 and policy.draft_length(doubtful, n) == n
    assert policy.round_cap(4) == 4
    assert policy.draft_length(doubtful, 4) == 1


def test_the_drafts_top_probability_cuts_where_the_calibration_weighs_it():
    """With a weight on the drafts' top log-probability, the same confidence
    logits give a shorter block where a draft's distribution is flat."""
    calibration = fitted(
        temperatures=[1.0] * 4, top_weights=[2.0] * 4, offsets=[0.0] * 4
    )
    policy = AdaptivePolicy(calibration=calibration)
    play(policy, 10, lambda n: n, cap=4)

    def proposal(tops: list[float]) -> Proposal:
        return Proposal(mx.zeros((1, 4), mx.int32), None, mx.array([[4.0] * 4]),
                        top_logprob=mx.array([tops]))  # fmt: skip

    assert policy.draft_length(proposal([0.0] * 4), 4) == 4
    assert policy.draft_length(proposal([0.0, -5.0, 0.0, 0.0]), 4) == 1
    with pytest.raises(ValueError, match="top log-probabilities"):
        policy.draft_length(
            Proposal(mx.zeros((1, 4), mx.int32), None, mx.array([[4.0] * 4])), 4
        )


def test_scheduler_corrects_an_overconfident_calibration():
    """Algorithm 1 reads the calibrated survival scaled by what was accepted:
    a head that promises every draft while only the first is kept ends up
    verifying one draft, and one that is right keeps full blocks."""
    from mlx_dspark.policy.policies import SchedulerPolicy
    from mlx_dspark.policy.scheduler import SchedulerSettings

    confident = Proposal(mx.zeros((1, 4), mx.int32), None, mx.array([[4.0] * 4]))
    settings = SchedulerSettings(warmup_steps=0, n_draft_min=0)
    curve = StepRateCurve.linear(1.0, 0.15)

    def after(accepted: int) -> SchedulerPolicy:
        policy = SchedulerPolicy(None, curve=curve, settings=settings)
        assert policy.draft_length(confident, 4) == 4  # before any round
        for _ in range(40):
            n = policy.draft_length(confident, 4)
            policy.observe(confident, RoundStats(4, n, min(accepted, n)))
        return policy

    assert after(4).draft_length(confident, 4) == 4
    overconfident = after(1)
    assert overconfident.draft_length(confident, 4) == 1
    survival = overconfident.survival(confident, 4)
    assert survival[0] > 0.9 and survival[1] < 0.5
    assert np.all(np.diff(survival) <= 0)


def test_a_later_generation_remembers_what_was_measured():
    policy = AdaptivePolicy()
    play(policy, 40, lambda n: 0)
    fresh = AdaptivePolicy()
    assert fresh.best_length(7) > 0  # the optimistic start
    fresh.remember(policy)
    assert fresh.best_length(7) == 0 and fresh.text.plain_left == 0
    assert fresh.text.interval == policy.text.interval > fresh.probe_after
    assert fresh.copies.interval == fresh.probe_after  # no copy was offered
    assert fresh.round_costs(7) == policy.round_costs(7)
    play(fresh, 1, lambda n: 0)  # measures its own from there on
    assert fresh.costs.rounds == policy.costs.rounds + 1


def test_a_calibration_that_measured_poor_acceptance_means_plain_from_the_start(
    tmp_path,
):
    from mlx_dspark.policy.calibration import CalibrationResult

    def calibration(survived):
        # reliability bins per position: [mean prediction, mean outcome, count]
        rounds = 60
        bins = [[[0.5, s / rounds, rounds]] for s in survived]
        return CalibrationResult([1.0] * 3, *[[0.1] * 3] * 4, rounds, 1, bins, bins)

    poor = calibration([4, 0, 0]).acceptance()
    assert poor[0] == pytest.approx(4.5 / 61) and poor[1] == pytest.approx(0.5 / 5)
    good = calibration([54, 48, 42]).acceptance()
    assert good[0] > 0.85 and good[2] > 0.85
    cap = 3
    assert play(AdaptivePolicy(prior=poor), 1, lambda n: 0, cap) == [0]
    # Saved and loaded, with empty bins beside the full ones: the same rates.
    empty = [[None, None, 0.0]]
    result = calibration([4, 0, 0])
    result.reliability_before = [pos + empty for pos in result.reliability_before]
    result.save(tmp_path / "c.json")
    assert CalibrationResult.load(tmp_path / "c.json").acceptance() == pytest.approx(
        poor
    )
    assert play(AdaptivePolicy(prior=good), 1, lambda n: n, cap) == [cap]


# -- in the generation loop --------------------------------------------------


@pytest.fixture(scope="module")
def useless_pair(pair_factory):
    *_, target_dir, drafter_dir, _ = pair_factory(vocab_size=512, block_size=8)
    model, tokenizer, drafter = load(target_dir, drafter_dir)
    randomize_weights(drafter, seed=3)
    return model, tokenizer, drafter


def greedy_target(model, prompt, max_tokens):
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    return [int(t) for t, _ in steps]


def run_default(model, tokenizer, drafter, prompt, max_tokens, **kwargs):
    responses = list(
        stream_generate(
            model, tokenizer, drafter, prompt, max_tokens=max_tokens, **kwargs
        )
    )
    return [r.token for r in responses], responses[-1].stats


def test_useless_drafter_decodes_plainly_and_losslessly(useless_pair):
    model, tokenizer, drafter = useless_pair
    prompt = [1, 2, 3]
    tokens, stats = run_default(model, tokenizer, drafter, prompt, 160)
    assert tokens == greedy_target(model, prompt, 160)
    plain = [r.drafted == 0 for r in stats.rounds]
    assert sum(plain[-60:]) >= 54, " ".join(
        f"{r.drafted}/{r.accepted}" for r in stats.rounds
    )
    assert all(r.draft_time == 0.0 for r in stats.rounds if r.drafted == 0)


def cache_profile(model, drafter, draft_share: float) -> None:
    """Cache a cost profile for the pair whose drafting round costs
    ``draft_share`` of a target step: on these toy models drafting (Python
    calls on tiny arrays) costs more than the target's step, which no real
    pair does."""
    from mlx_dspark.policy.profile import profile_key, profile_path

    key = profile_key(model, drafter)
    curve = StepRateCurve.linear(1e-3, 1e-4, drafter.block_size + 1)
    curve.draft_seconds = draft_share * 1e-3
    curve.meta["key"] = key
    profile_path(key).parent.mkdir(parents=True, exist_ok=True)
    curve.save(profile_path(key))


def fake_loop_clock(monkeypatch) -> None:
    """Each reading of the loop's clock advances it by 1 ms: a round's measured
    cost depends on its kind (a drafted round 3 ms, a plain one 2 ms), not on
    the machine's load, so the policy's choices are the same on every run."""
    readings = itertools.count()
    clock = SimpleNamespace(perf_counter=lambda: next(readings) * 1e-3)
    monkeypatch.setattr(loop, "time", clock)


def test_structured_pair_drafts_by_default(pair_factory, tmp_path, monkeypatch):
    fake_loop_clock(monkeypatch)
    model, tokenizer, drafter, *_ = pair_factory(block_size=8)
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    cache_profile(model, drafter, 0.1)
    for prompt in ([1, 2, 3], [20, 4, 11, 9]):
        # Each from a fresh start: what one generation leaves to the next is
        # tested apart, and the first one's runs of short acceptances (8 drafts,
        # 1 kept) can leave the second starting plain on a busy machine.
        drafter.policy_memory = None
        tokens, stats = run_default(model, tokenizer, drafter, prompt, 96)
        assert tokens == greedy_target(model, prompt, 96)
        assert stats.mean_accepted_length > 2.0
        assert sum(r.drafted > 0 for r in stats.rounds) >= 0.8 * len(stats.rounds)


def test_the_next_generation_starts_plain_after_a_useless_one(useless_pair):
    model, tokenizer, drafter = useless_pair
    drafter.policy_memory = None
    run_default(model, tokenizer, drafter, [1, 2, 3], 60)
    tokens, stats = run_default(model, tokenizer, drafter, [4, 5, 6], 24)
    assert tokens == greedy_target(model, [4, 5, 6], 24)
    assert all(r.drafted == 0 for r in stats.rounds[:8])


def test_explicit_num_draft_always_drafts_that_many(useless_pair):
    model, tokenizer, drafter = useless_pair
    _, stats = run_default(model, tokenizer, drafter, [1, 2, 3], 40, num_draft=3)
    assert {r.drafted for r in stats.rounds[:-3]} == {3}  # then the last tokens


class Alternate:
    """Plain and drafted rounds by a fixed pattern (decided before drafting)."""

    def __init__(self, pattern):
        self.pattern = itertools.cycle(pattern)

    def round_cap(self, cap, copy=False, phrases=False):
        return cap if next(self.pattern) else 0

    def draft_length(self, proposal, cap):
        return cap


@pytest.mark.parametrize("bias", [0.0, 1e3], ids=["own", "copying"])
@pytest.mark.parametrize("pattern", [(0, 1), (1, 0), (0, 0, 1)], ids=str)
def test_greedy_identical_with_plain_rounds_mixed_in(pair_factory, pattern, bias):
    model, _, drafter, *_ = pair_factory(block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    for prompt in ([1, 2, 3], [13, 5, 5, 21, 2, 17]):
        stats = GenerationStats()
        with copy_bias(drafter, bias):
            tokens = speculative_generate_step(
                mx.array(prompt),
                target,
                pair_proposer(drafter),
                num_draft=drafter.block_size,
                max_tokens=64,
                policy=Alternate(pattern),
                stats=stats,
            )
            tokens = [t for t, _ in tokens]
        assert tokens == greedy_target(model, prompt, 64)
        assert {r.drafted == 0 for r in stats.rounds} == {True, False}


def test_default_policy_with_copying_is_lossless_and_knows_the_copies(
    pair_factory, monkeypatch
):
    fake_loop_clock(monkeypatch)  # how far copied rounds reach: the same every run
    model, tokenizer, drafter, *_ = pair_factory(block_size=8)
    offered, longest = [], 0
    for prompt in (
        [1, 2, 3, 4, 1, 2, 3],
        [13, 5, 5, 21, 2, 17],
        repeated_walk(model, 32),
    ):
        with copy_bias(drafter, 1e3):
            tokens, stats = run_default(model, tokenizer, drafter, prompt, 64)
        assert tokens == greedy_target(model, prompt, 64)
        done = 1
        for r in stats.rounds[:-1]:
            copy = context_copy([*prompt, *tokens[:done]], 1, COPY_CONFIG)[0] >= 0
            assert r.copy_offered == copy
            assert r.verified <= (COPY_DRAFTS if copy else drafter.block_size)
            offered.append(copy)
            longest = max(longest, r.accepted)
            done += r.accepted + 1
    assert True in offered and False in offered
    # Copied rounds kept drafts past the drafter's block (the copy's own tokens).
    assert longest > drafter.block_size


@pytest.mark.parametrize("pattern", [(0,), (0, 1), (1, 0)], ids=str)
def test_sampling_exact_with_plain_rounds_mixed_in(pair_factory, pattern):
    model, _, drafter, *_ = pair_factory(
        markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    params = CONFIGS[0]
    joint = exact_joint(model, params)
    seeds = 1500
    samples, _ = sample_first_three(
        model, drafter, params, seeds=seeds, policy=lambda: Alternate(pattern)
    )
    stat, dof = chi_square(samples, joint, seeds)
    assert dof >= 5
    assert stat < chi_square_critical(dof), (stat, dof)


def test_a_biased_plain_round_is_caught(pair_factory, monkeypatch):
    """The exactness test can fail: plain rounds that sample at temperature 1
    instead of the requested processing are detected."""
    import mlx_dspark.decoding.loop as loop

    model, _, drafter, *_ = pair_factory(
        markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    params = CONFIGS[0]
    joint = exact_joint(model, params)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    original = loop.sample
    monkeypatch.setattr(
        loop,
        "sample",
        lambda logits, p, key: original(logits, SamplingParams(1.0), key),
    )
    samples = {}
    for seed in range(1500):
        tokens = speculative_generate_step(
            mx.array(PROMPT),
            target,
            pair_proposer(drafter),
            num_draft=drafter.block_size,
            params=params,
            max_tokens=3,
            seed=seed,
            policy=Alternate((0,)),
            sampling="residual",  # coupled plain rounds: checked in test_seed
        )
        key = tuple(t for t, _ in tokens)
        samples[key] = samples.get(key, 0) + 1
    stat, dof = chi_square(samples, joint, 1500)
    assert stat > chi_square_critical(dof)


def test_the_summary_names_the_cost_profile(useless_pair, tmp_path, monkeypatch):
    from mlx_dspark.generation import format_stats
    from mlx_dspark.policy.profile import profile_key, profile_path

    model, tokenizer, drafter = useless_pair
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))

    def summary() -> list[str]:
        drafter.policy_memory = None
        responses = list(stream_generate(model, tokenizer, drafter, [1, 2], 8))
        return format_stats(responses[-1])

    path = profile_path(profile_key(model, drafter))
    assert not path.exists()
    assert f"Cost profile: {path}" in summary()  # measured once, then cached
    assert path.is_file()


def summary_of(stats, telemetry) -> list[str]:
    from mlx_dspark.generation import DSparkResponse, format_stats

    response = DSparkResponse(
        text="",
        token=0,
        logprobs=None,
        from_draft=False,
        prompt_tokens=3,
        prompt_tps=1.0,
        generation_tokens=10,
        generation_tps=1.0,
        peak_memory=0.0,
        stats=stats,
        telemetry=telemetry,
    )
    return format_stats(response)


def test_the_summary_gives_each_kind_of_round_and_the_heads_own_check():
    """Issue 80: copies carry no prediction, so counting them as unexpected
    made the old line read "expected 0.24 vs actual 1.71 accepted drafts per
    round, draft length now 1" on a run that kept 2.71 tokens a round. Each
    kind of round gets its own figures, and the confidence head is checked
    on the rounds it predicted only."""
    from mlx_dspark.policy.recording import RecordingPolicy

    # Raw confidence 0 predicts survival 0.5, 0.25, 0.125: 0.875 drafts.
    predicted = Proposal(mx.zeros((1, 3), mx.int32), None, mx.zeros((1, 3)))
    policy, stats = RecordingPolicy(), GenerationStats()
    rounds = [
        (predicted, RoundStats(3, 3, 1)),
        (predicted, RoundStats(3, 3, 0)),
        (NO_PROPOSAL, RoundStats(0, 0, 0)),
        (NO_PROPOSAL, RoundStats(15, 15, 15, copy_offered=True)),
        (NO_PROPOSAL, RoundStats(15, 9, 9, copy_offered=True)),
        (NO_PROPOSAL, RoundStats(6, 6, 2, copy_offered=True, phrases_offered=True)),
    ]
    for proposal, round_stats in rounds:
        policy.observe(proposal, round_stats)
        stats.rounds.append(round_stats)
    tele = policy.telemetry
    tele.policy, tele.n_current = "adaptive", 1
    # What the old line said: copies as unexpected, the last cap as the length.
    assert tele.expected_accepted / tele.n_rounds == pytest.approx(0.29, abs=0.005)
    assert tele.drafts_accepted / tele.n_rounds == pytest.approx(4.5)
    assert tele.predicted_check == pytest.approx((0.875, 0.5))
    lines = summary_of(stats, tele)
    start = lines.index(
        "Policy: adaptive (the draft length with the best measured tokens/s)"
    )
    assert lines[start + 1 : start + 6] == [
        "Plain rounds: 1 of 6 rounds (one target step, 1 token each)",
        "Drafter's own block: 2 of 6 rounds, 3.00 drafts verified and 1.50 tokens "
        "kept per round, longest verified 3",
        "Context copy: 2 of 6 rounds, 12.00 drafts verified and 13.00 tokens kept "
        "per round, longest verified 15",
        "Phrase-store copy: 1 of 6 rounds, 6.00 drafts verified and 3.00 tokens "
        "kept per round, longest verified 6",
        "Confidence head: expected 0.88 vs accepted 0.50 drafts per round over the "
        "2 rounds it predicted; uncalibrated (raw confidences): run "
        "mlx_dspark.calibrate",
    ]
    assert not any("draft length now" in line for line in lines)
    tele.calibration = "pair.calibration.json"
    check = summary_of(stats, tele)[start + 5]
    assert check.endswith(
        "; the calibration is over-confident on this text: run "
        "mlx_dspark.calibrate on prompts like it"
    )
    # A calibration that predicts what was kept holds.
    held = RecordingPolicy()
    held.telemetry.calibration = "pair.calibration.json"
    held.observe(predicted, RoundStats(3, 3, 1))
    assert held.telemetry.predicted_check == pytest.approx((0.875, 1.0))
    assert summary_of(GenerationStats([RoundStats(3, 3, 1)]), held.telemetry)[
        -3
    ].endswith("; the calibration holds")


def test_a_run_with_copies_sums_up_each_kind(pair_factory, monkeypatch):
    """A real run of the default policy with copying: the summary's figures
    are the rounds' own, and the confidence head is checked on the rounds
    whose drafts it predicted (a copy verified as it is has no prediction)."""
    from mlx_dspark.decoding.loop import round_kind
    from mlx_dspark.generation import format_stats

    fake_loop_clock(monkeypatch)
    model, tokenizer, drafter, *_ = pair_factory(block_size=8)
    drafter.policy_memory = None
    with copy_bias(drafter, 1e3):
        responses = list(
            stream_generate(model, tokenizer, drafter, [13, 5, 5, 21, 2, 17], 96)
        )
    stats, tele = responses[-1].stats, responses[-1].telemetry
    lines = format_stats(responses[-1])
    copies = [r for r in stats.rounds if round_kind(r) == "copy"]
    own = [r for r in stats.rounds if round_kind(r) == "own"]
    assert copies and own
    kept = sum(r.accepted + 1 for r in copies) / len(copies)
    longest = max(r.verified for r in copies)
    assert any(
        line.startswith(f"Context copy: {len(copies)} of {len(stats.rounds)} rounds")
        and line.endswith(
            f"{kept:.2f} tokens kept per round, longest verified {longest}"
        )
        for line in lines
    ), lines
    assert longest > drafter.block_size
    assert 0 < tele.predicted_rounds <= len(own)
    check = next(line for line in lines if line.startswith("Confidence head"))
    assert f"over the {tele.predicted_rounds} rounds it predicted" in check


def test_copies_start_from_their_own_prior_not_the_calibrations():
    """The calibration measured the drafter's own drafts on its prompts: deep
    positions it rarely kept say nothing about how far a copy holds."""
    policy = AdaptivePolicy(prior=[0.3, 0.1, 0.05])
    assert policy.acceptance(5) == pytest.approx([0.3, 0.1, 0.05, 0.05, 0.05])
    assert policy.acceptance(5, policy.copies) == pytest.approx([0.5] * 5)
    for _ in range(20):
        policy.observe(NO_PROPOSAL, RoundStats(9, 9, 9, copy_offered=True))
    assert min(policy.acceptance(9, policy.copies)) > 0.9


class Scripted:
    """Caps from a script (then full rounds), and a ``plain_ahead`` that
    tells the truth about the next one."""

    def __init__(self, script):
        self.script = list(script)

    def round_cap(self, cap, copy=False, phrases=False):
        return min(cap, self.script.pop(0)) if self.script else cap

    def plain_ahead(self, phrases=True):
        return bool(self.script) and self.script[0] == 0

    def draft_length(self, proposal, cap):
        return cap


PLAIN_RUNS = [0, 0, 0, 8, 0, 0, 8, 8, 0, 0, 0, 0, 8] * 6


@pytest.mark.parametrize("bias", [0.0, 1e3], ids=["own", "copying"])
def test_greedy_identical_with_plain_steps_queued_ahead(pair_factory, bias):
    model, _, drafter, *_ = pair_factory(block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    for prompt in ([1, 2, 3], [13, 5, 5, 21, 2, 17]):
        with copy_bias(drafter, bias):
            tokens = speculative_generate_step(
                mx.array(prompt),
                target,
                pair_proposer(drafter),
                num_draft=drafter.block_size,
                max_tokens=64,
                policy=Scripted(PLAIN_RUNS),
            )
            tokens = [t for t, _ in tokens]
        assert tokens == greedy_target(model, prompt, 64)


def test_sampling_exact_with_plain_steps_queued_ahead(pair_factory):
    model, _, drafter, *_ = pair_factory(
        markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    params = CONFIGS[0]
    joint = exact_joint(model, params)
    with copy_bias(drafter, 1e3):
        samples, _ = sample_first_three(
            model, drafter, params, seeds=1500, policy=lambda: Scripted([0, 0])
        )
    stat, dof = chi_square(samples, joint, 1500)
    assert dof >= 5
    assert stat < chi_square_critical(dof), (stat, dof)


def test_with_copying_a_plain_step_is_queued_before_the_lookup(
    pair_factory, monkeypatch
):
    """Copying needs the token to look the next copy up; a policy that knows
    the next round is plain anyway lets the loop queue that round's step
    first, as mlx-lm's loop does, instead of leaving the device idle."""
    model, _, drafter, *_ = pair_factory(block_size=8)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    events = []
    step, lookup = loop.plain_step, copying.context_copy
    monkeypatch.setattr(
        loop, "plain_step", lambda *a: events.append("step") or step(*a)
    )
    monkeypatch.setattr(
        copying, "context_copy", lambda *a: events.append("lookup") or lookup(*a)
    )

    def run(policy) -> str:
        events.clear()
        with copy_bias(drafter, 1e3):
            list(
                speculative_generate_step(
                    mx.array([1, 2, 3]),
                    target,
                    pair_proposer(drafter),
                    num_draft=8,
                    max_tokens=6,
                    policy=policy,
                )
            )
        return " ".join(events)

    told = Scripted([0] * 5)
    blind = Alternate((0,))
    # The first step is queued in its own round; each later one, told, before
    # the lookup that plans its round (blind, after it); no step after the last.
    assert run(told) == "lookup step" + " step lookup" * 4 + " lookup"
    assert run(blind) == "lookup step" + " lookup step" * 4 + " lookup"


def test_the_default_policy_says_plain_ahead_only_when_it_is():
    """Whenever ``plain_ahead`` is true, the next round is plain whatever it
    is offered; on a target whose verify of k tokens costs k steps that is
    nearly every round, copies and phrases offered or not."""
    import random

    from test_costs import curve_for, linear

    rng = random.Random(0)
    policy = AdaptivePolicy(profile=curve_for(linear))
    ahead = 0
    for _ in range(400):
        said = policy.plain_ahead()
        copy = rng.random() < 0.3
        phrases = not copy and rng.random() < 0.3
        n = policy.round_cap(7, copy=copy, phrases=phrases)
        assert n == 0 or not said
        ahead += said
        seconds = (0.002, linear(n + 1)) if n else (0.0, linear(1))
        kept = rng.randint(0, n)
        policy.observe(
            NO_PROPOSAL, RoundStats(n, n, kept, *seconds, 0.0, copy or phrases, phrases)
        )
    assert ahead >= 0.95 * 400
