"""A cost profile that contradicts itself (measured while other processes
ran) is measured again, cached or fresh, and written by renaming a whole
file; measurements are faked where the test needs a given curve."""

import json

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
