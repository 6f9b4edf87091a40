"""A cost profile that contradicts itself (measured while other processes
ran) is measured again, cached or fresh, and written by renaming a whole
file; measurements are faked where the test needs a given curve."""

import json
from collections import Counter

import mlx.core as mx
import pytest

from mlx_dspark.policy import profile as profile_module
from mlx_dspark.policy.profile import (
    contradiction,
    fastest_of,
    get_profile,
    profile_key,
    profile_path,
    trusted,
)
from mlx_dspark.policy.scheduler import StepRateCurve
from mlx_dspark.proposers.base import Proposal

NO_PROPOSAL = Proposal(mx.zeros((1, 0), mx.int32), mx.zeros((1, 0, 1)))

# Target steps/s for 1..9 query tokens in a profile measured while another
# process ran (issue 71): non-monotone.
CONTENDED = [13.1, 10.5, 9.1, 1.8, 1.8, 1.7, 2.9, 3.9, 6.8]


def test_contradiction_names_what_cannot_be():
    issue = StepRateCurve(list(range(1, 10)), CONTENDED, 0.05)
    assert contradiction(issue) == (
        "a forward over 4 tokens measured 3.8x slower than one over 9"
    )
    dear_draft = StepRateCurve.linear(0.01, 0.001, 9, draft_seconds=0.05)
    assert "drafting pass measured 2.6x dearer" in contradiction(dear_draft)
    assert contradiction(StepRateCurve.linear(0.01, 0.001, 9, 0.005)) is None
    # A longer forward a little faster (BLAS kernels change with the size).
    dip = StepRateCurve([1, 8, 9, 16], [100.0, 80.0, 70.0, 90.0], 0.002)
    assert contradiction(dip) is None


def test_fastest_of_two_measurements_takes_each_size_s_faster():
    first = StepRateCurve([1, 2, 3], [10.0, 1.0, 8.0], 0.5, {"a": 1})
    second = StepRateCurve([1, 2, 3], [5.0, 9.0, 7.0], 0.1)
    both = fastest_of(first, second)
    assert both.steps_per_second == [10.0, 9.0, 8.0]
    assert both.draft_seconds == 0.1 and both.meta == {"a": 1}


@pytest.fixture
def pair(pair_factory, tmp_path, monkeypatch):
    model, _, drafter, *_ = pair_factory(block_size=8)
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    return model, drafter


def fake_measurements(monkeypatch, *curves):
    """``measure_profile`` returns these curves in turn; returns the calls."""
    calls = []
    queue = iter(curves)

    def measure(*args, **kwargs):
        calls.append(args)
        return StepRateCurve.from_json(next(queue).to_json())

    monkeypatch.setattr(profile_module, "measure_profile", measure)
    return calls


CONSISTENT = StepRateCurve.linear(0.01, 0.001, 9, draft_seconds=0.002)
SELF_CONTRADICTING = StepRateCurve(list(range(1, 10)), CONTENDED, 0.002)


def test_a_cached_profile_that_contradicts_itself_is_measured_again(
    pair, monkeypatch, caplog
):
    model, drafter = pair
    path = profile_path(profile_key(model, drafter))
    cached = StepRateCurve.from_json(SELF_CONTRADICTING.to_json())
    cached.meta["key"] = profile_key(model, drafter)
    path.parent.mkdir(parents=True, exist_ok=True)
    cached.save(path)
    calls = fake_measurements(monkeypatch, CONSISTENT)
    with caplog.at_level("INFO", logger="mlx_dspark"):
        curve = get_profile(model, drafter)
    assert [r.getMessage() for r in caplog.records] == [
        f"The cached cost profile {path} contradicts itself (a forward over 4 "
        "tokens measured 3.8x slower than one over 9): measuring it again."
    ]
    assert len(calls) == 1 and curve.steps_per_second == CONSISTENT.steps_per_second
    stored = json.loads(path.read_text())
    assert stored["steps_per_second"] == CONSISTENT.steps_per_second
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # renamed over
    assert get_profile(model, drafter).steps_per_second == stored["steps_per_second"]
    assert len(calls) == 1  # a consistent profile is cached for good


def test_a_measurement_that_contradicts_itself_is_taken_again(pair, monkeypatch):
    model, drafter = pair
    second = StepRateCurve(list(range(1, 10)), [13.0] + CONTENDED[1:3] + [9.0] * 6)
    calls = fake_measurements(monkeypatch, SELF_CONTRADICTING, second)
    curve = get_profile(model, drafter)
    assert len(calls) == 2 and contradiction(curve) is None
    assert curve.steps_per_second == [13.1, 10.5, 9.1] + [9.0] * 6
    assert curve.meta["remeasured"] == contradiction(SELF_CONTRADICTING)


def test_a_profile_that_contradicts_itself_twice_is_kept(pair, monkeypatch):
    """Measured twice with the same contradiction, it may be this machine's
    truth (the rounds correct what it gets wrong): not measured a third time,
    not in every later process either."""
    model, drafter = pair
    calls = fake_measurements(monkeypatch, SELF_CONTRADICTING, SELF_CONTRADICTING)
    curve = get_profile(model, drafter)
    assert len(calls) == 2 and "contradiction" in curve.meta
    assert get_profile(model, drafter).meta["remeasured"] == curve.meta["remeasured"]
    assert len(calls) == 2


def test_the_real_measurement_is_checked_too(pair_factory, tmp_path, monkeypatch):
    """The default setup's path, unfaked: a tiny pair's profile is measured
    (twice if it contradicts itself) and cached once."""
    model, _, drafter, *_ = pair_factory(block_size=4)
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    curve = get_profile(model, drafter, repeats=1, contexts=(16,))
    assert curve.batch_sizes == list(range(1, 6))
    assert contradiction(curve) is None or "remeasured" in curve.meta
    again = get_profile(model, drafter)
    assert again.steps_per_second == curve.steps_per_second


def test_a_profile_is_trusted_if_consistent_or_measured_twice():
    assert trusted(CONSISTENT) and not trusted(SELF_CONTRADICTING)
    twice = StepRateCurve.from_json(SELF_CONTRADICTING.to_json())
    twice.meta["remeasured"] = contradiction(twice)
    assert trusted(twice)


# -- what a run measured is written back ------------------------------------


def measured_run(costs, verify, draft, plain, rounds=8):
    """Feed ``costs`` rounds taking known seconds: drafted rounds verifying
    each query length of ``verify`` (``{q: seconds}``, drafting ``draft``),
    and plain rounds of ``plain`` seconds."""
    from mlx_dspark.decoding.loop import RoundStats

    for _ in range(rounds):
        for q, seconds in verify.items():
            costs.observe(RoundStats(q - 1, q - 1, 0, draft, seconds), steady=True)
        costs.observe(RoundStats(0, 0, 0, 0.0, plain, plain), steady=False)


def test_a_run_s_costs_blend_into_the_profile_by_the_rule():
    from mlx_dspark.decoding.loop import RoundStats
    from mlx_dspark.policy.costs import MeasuredCosts, RoundCosts
    from mlx_dspark.policy.profile import merge_measured

    costs = RoundCosts(CONSISTENT)
    measured_run(costs, {2: 0.004, 4: 0.5}, 0.001, 0.02)
    costs.observe(RoundStats(8, 8, 0, 0.001, 0.003), steady=True)
    measured = costs.take_measured()
    assert measured.verify == {2: (0.004, 8), 4: (0.5, 8), 9: (0.003, 1)}
    assert measured.draft == (0.001, 17) and measured.plain == (0.02, 8)
    assert not costs.take_measured()  # counted once

    merged = merge_measured(CONSISTENT, measured)
    stored = [1.0 / r for r in CONSISTENT.steps_per_second]
    after = [1.0 / r for r in merged.steps_per_second]
    # 8 rounds against the profile's 8: halfway in log space.
    assert after[1] == pytest.approx((stored[1] * 0.004) ** 0.5)
    # 0.5 s is 36x the stored 0.014 s: it counts as 4x at most.
    assert after[3] == pytest.approx(stored[3] * 2.0)
    # Lengths not measured (9 once only) move by the ratio the run priced
    # them with: 2's below it, 4's beyond it, interpolated in log space between.
    ratio = 0.004 / stored[1]
    assert after[0] == pytest.approx(stored[0] * ratio**0.5)
    assert after[2] == pytest.approx(stored[2] * (ratio * 4.0) ** 0.25)
    assert after[4:] == pytest.approx([t * 2.0 for t in stored[4:]])
    # 17 rounds count as 16 at most.
    assert merged.draft_seconds == pytest.approx((0.002**8 * 0.001**16) ** (1 / 24))
    assert merged.meta["plain_seconds"] == pytest.approx((stored[0] * 0.02) ** 0.5)
    assert merged.meta["merged"] == {"2": 8, "4": 8, "draft": 17, "plain": 8}
    assert merged.meta["runs"] == 1
    # Runs merged before weigh in: 8 + 8 rounds against this run's 8.
    again = merge_measured(merged, MeasuredCosts({2: (0.004, 8)}))
    assert 1.0 / again.steps_per_second[1] == pytest.approx(
        (after[1] ** 16 * 0.004**8) ** (1 / 24)
    )
    assert again.meta["runs"] == 2 and again.meta["merged"]["2"] == 16

    # A later RoundCosts starts from the merged costs, before measuring any.
    later = RoundCosts(merged)
    assert later.verify_seconds([2, 4, 9]) == pytest.approx(
        [after[1], after[3], after[8]]
    )
    assert later.draft_seconds() == pytest.approx(merged.draft_seconds)
    assert later.costs(1)[0] == pytest.approx(merged.meta["plain_seconds"])
    assert RoundCosts(CONSISTENT).costs(1)[0] == pytest.approx(stored[0])


def written(path):
    return StepRateCurve.from_json(path.read_text())


@pytest.fixture
def full_pair(pair_factory, tmp_path, monkeypatch):
    model, tokenizer, drafter, *_ = pair_factory(block_size=8)
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    drafter.policy_memory = None
    yield model, tokenizer, drafter
    drafter.policy_memory = None


def cached(model, drafter, curve=CONSISTENT) -> StepRateCurve:
    """``curve`` as the cached profile of the pair would hold it."""
    fresh = StepRateCurve.from_json(curve.to_json())
    fresh.meta["key"] = profile_key(model, drafter)
    return fresh


def spy_on_saves(monkeypatch) -> list:
    """The measurements each write-back was given."""
    saved = []
    save = profile_module.save_measured

    def spy(key, measured):
        saved.append(measured)
        return save(key, measured)

    monkeypatch.setattr(profile_module, "save_measured", spy)
    return saved


def drafted_lengths(responses) -> dict[int, int]:
    rounds = responses[-1].stats.rounds
    return dict(Counter(r.verified + 1 for r in rounds if r.drafted > 0))


def test_a_generation_writes_its_costs_back(full_pair, monkeypatch):
    """The default policy's generation merges what it measured into the
    cached profile; a policy built on the cached profile (the next process)
    starts from the written costs. (The tiny pair's drafting pass costs more
    than its target's forward, which a profile may say only once measured
    twice: any merge of its real costs contradicts a consistent profile.)"""
    from mlx_dspark import stream_generate
    from mlx_dspark.policy.adaptive import AdaptivePolicy
    from mlx_dspark.policy.profile import load_profile, merge_measured

    model, tokenizer, drafter = full_pair
    path = profile_path(profile_key(model, drafter))
    fake_measurements(monkeypatch, SELF_CONTRADICTING, SELF_CONTRADICTING)
    before = get_profile(model, drafter)
    assert "remeasured" in before.meta and path.is_file()
    saved = spy_on_saves(monkeypatch)
    first = list(stream_generate(model, tokenizer, drafter, [1, 2, 3], 48))
    assert len(saved) == 1
    assert {q: n for q, (_, n) in saved[0].verify.items()} == drafted_lengths(first)
    stored = written(path)
    assert stored.meta["runs"] == 1
    assert stored.meta["key"] == profile_key(model, drafter)
    expected = merge_measured(before, saved[0])
    assert stored.steps_per_second == pytest.approx(expected.steps_per_second)
    assert stored.draft_seconds == pytest.approx(expected.draft_seconds)
    assert stored.steps_per_second != before.steps_per_second
    # A new process: the policy built on the cached profile starts from it.
    curve = load_profile(model, drafter, drafter.block_size)
    assert curve.steps_per_second == stored.steps_per_second
    qs = list(range(1, 10))
    assert AdaptivePolicy(profile=curve).costs.verify_seconds(qs) == pytest.approx(
        [stored.step_seconds(q) for q in qs]
    )
    # A second generation in this process writes only what it measured.
    second = list(stream_generate(model, tokenizer, drafter, [4, 5, 6], 48))
    assert len(saved) == 2 and written(path).meta["runs"] == 2
    assert {q: n for q, (_, n) in saved[1].verify.items()} == drafted_lengths(second)


def test_a_generation_read_to_its_end_or_not_writes_once(full_pair, monkeypatch):
    from mlx_dspark import stream_generate

    model, tokenizer, drafter = full_pair
    fake_measurements(monkeypatch, CONSISTENT)
    saved = spy_on_saves(monkeypatch)
    responses = stream_generate(model, tokenizer, drafter, [1, 2, 3], 48)
    for _, _ in zip(range(5), responses, strict=False):
        pass
    responses.close()  # the caller stopped reading
    assert len(saved) == 1


def unreadable(path):
    path.write_text('{"batch_sizes": [1, 2')


def read_only(path):
    path.chmod(0o444)


@pytest.mark.parametrize(
    "spoil",
    [unreadable, read_only, "unwritable directory", "absent"],
    ids=lambda spoil: getattr(spoil, "__name__", spoil),
)
def test_a_profile_that_cannot_take_the_run_s_costs_is_left_alone(
    full_pair, monkeypatch, spoil
):
    """Corrupt, marked read-only, in a directory that refuses the write, or
    gone: the file stays as it was and the generation still runs, losslessly."""
    from mlx_dspark import stream_generate
    from mlx_dspark.policy.costs import MeasuredCosts

    model, tokenizer, drafter = full_pair
    path = profile_path(profile_key(model, drafter))
    fake_measurements(monkeypatch, CONSISTENT)
    saved = spy_on_saves(monkeypatch)
    first = [r.token for r in stream_generate(model, tokenizer, drafter, [1, 2], 32)]
    # The next generation starts from the profile this process holds.
    if spoil == "absent":
        path.unlink()
    elif spoil == "unwritable directory":

        def refuse(*args):
            raise PermissionError("read-only file system")

        monkeypatch.setattr(profile_module, "write_text_atomic", refuse)
    else:
        spoil(path)
    before = path.read_bytes() if path.exists() else None
    again = [r.token for r in stream_generate(model, tokenizer, drafter, [1, 2], 32)]
    assert again == first and len(saved) == 2 and saved[1]
    assert (path.read_bytes() if path.exists() else None) == before
    assert [p.name for p in path.parent.iterdir()] == ([path.name] if before else [])
    key = profile_key(model, drafter)
    assert not profile_module.save_measured(key, MeasuredCosts({2: (0.01, 9)}))
    assert (path.read_bytes() if path.exists() else None) == before


def test_no_write_back_that_would_contradict_the_profile(full_pair):
    from mlx_dspark.policy.costs import MeasuredCosts
    from mlx_dspark.policy.profile import save_measured

    model, _, drafter = full_pair
    path = profile_path(profile_key(model, drafter))
    path.parent.mkdir(parents=True)
    cached(model, drafter).save(path)
    before = path.read_text()
    key = profile_key(model, drafter)
    # A few rounds are not enough to write anything.
    assert not save_measured(key, MeasuredCosts({2: (0.02, 2)}))
    # 9 tokens four times cheaper than 2: the merge would contradict itself.
    noisy = MeasuredCosts({2: (0.05, 16), 9: (0.001, 16)})
    assert not save_measured(key, noisy)
    assert path.read_text() == before
    # Another pair's profile (a key that does not match) is not touched.
    other = dict(key, drafter="another")
    assert not save_measured(other, MeasuredCosts({2: (0.011, 9)}))
    assert save_measured(key, MeasuredCosts({2: (0.011, 9)}))
    assert written(path).meta["runs"] == 1


def test_a_policy_whose_profile_is_not_the_cache_s_writes_nothing(
    full_pair, monkeypatch
):
    from mlx_dspark.decoding.loop import RoundStats
    from mlx_dspark.policy.adaptive import AdaptivePolicy

    saved = spy_on_saves(monkeypatch)
    policy = AdaptivePolicy(profile=CONSISTENT)  # no meta["key"]
    policy.observe(NO_PROPOSAL, RoundStats(2, 2, 1, 0.001, 0.01))
    assert not policy.save_costs() and saved == []
    assert not AdaptivePolicy().save_costs()
