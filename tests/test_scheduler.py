import itertools

import numpy as np
import pytest

from mlx_dspark.decoding.loop import threshold_cut
from mlx_dspark.errors import DSparkError
from mlx_dspark.policy.scheduler import (
    SchedulerSettings,
    StepRateCurve,
    expected_throughput,
    schedule,
)


def best_prefix_lengths_bruteforce(survival, sps, caps):
    """Exhaustive search over every combination of verify lengths."""
    best, best_theta = None, -1.0
    for lengths in itertools.product(*(range(c + 1) for c in caps)):
        theta = expected_throughput(survival, list(lengths), sps)
        if theta > best_theta + 1e-12:
            best, best_theta = list(lengths), theta
    return best, best_theta


def random_survival(rng, r, k):
    return [np.cumprod(rng.uniform(0.3, 1.0, size=k)) for _ in range(r)]


def concave_curves():
    b = np.arange(1, 65)
    return {
        # concave, decreasing SPS: linear
        "linear_sps": StepRateCurve(b.tolist(), (100.0 - 1.2 * b).tolist()),
        # concave: flat while memory-bound, then falling (roofline-ish, smoothed)
        "concave_knee": StepRateCurve(
            b.tolist(), (50.0 - 0.02 * np.maximum(b - 6, 0) ** 2).clip(1).tolist()
        ),
        # affine step time (1/SPS convex, SPS itself convex)
        "affine_time": StepRateCurve.linear(0.010, 0.0015),
        # roofline max(c, s*B) step time plus draft cost
        "roofline_draft": StepRateCurve(
            b.tolist(),
            (1.0 / np.maximum(0.02, 0.004 * b)).tolist(),
            draft_seconds=0.003,
        ),
    }


@pytest.mark.parametrize("curve", list(concave_curves()))
def test_greedy_matches_bruteforce_on_concave_curves(curve):
    sps = concave_curves()[curve]
    rng = np.random.default_rng(0)
    for _ in range(60):
        r = int(rng.integers(1, 4))
        caps = rng.integers(0, 5, size=r).tolist()
        survival = random_survival(rng, r, 5)
        lengths = schedule(survival, sps, caps)
        assert all(0 <= n <= c for n, c in zip(lengths, caps, strict=True))
        _, best = best_prefix_lengths_bruteforce(survival, sps, caps)
        got = expected_throughput(survival, lengths, sps)
        assert got == pytest.approx(best, rel=1e-12), (survival, caps, lengths)


def test_nonconvex_step_time_can_stop_early():
    """Documented gap: with a tile-quantised step time the first non-improving
    admission is not the global optimum. t(B) = 1 for B <= 2 and 1.5 for B > 2."""
    b = list(range(1, 9))
    sps = StepRateCurve(b, [1.0 if x <= 2 else 1 / 1.5 for x in b])
    survival = [np.full(7, 0.95)]
    assert schedule(survival, sps, [7]) == [1]  # 1.95 tok/s; 2 drafts: 2.9/1.5
    best, theta = best_prefix_lengths_bruteforce(survival, sps, [7])
    assert best == [7] and theta == pytest.approx((1 + 7 * 0.95) / 1.5)


def test_prefix_order_and_anchor():
    sps = StepRateCurve.linear(0.01, 0.0001)
    # cheap tokens: everything with a > 0 is worth verifying up to the caps
    assert schedule([np.array([0.9, 0.8, 0.1])], sps, [3]) == [3]
    assert schedule([np.array([0.9, 0.8, 0.1])], sps, [2]) == [2]
    assert schedule([np.array([0.9, 0.8]), np.array([])], sps, [2, 5]) == [2, 0]
    assert schedule([], sps, []) == []
    # expensive tokens: nothing beats the anchor alone
    assert schedule([np.array([0.2, 0.1])], StepRateCurve.linear(0.001, 1.0), [2]) == [
        0
    ]
    # ties inside a request keep prefix order
    assert schedule([np.array([0.5, 0.5, 0.5])], sps, [3]) == [3]
    with pytest.raises(ValueError):
        schedule([np.array([0.5])], sps, [1, 1])


def test_stops_at_first_non_improving_admission():
    # Theta: 1*rate(1)=1/1.0; +0.9 at t=1.5 -> 1.267; +0.2 at t=2 -> 1.05 stop.
    sps = StepRateCurve.linear(0.5, 0.5)
    assert schedule([np.array([0.9, 0.2, 0.2])], sps, [3]) == [1]


def test_decision_for_k_ignores_later_drafts():
    """Lossless: whether position k is verified depends on a_1..a_k (and other
    requests) only. Rewriting a request's survivals after k never changes it."""
    rng = np.random.default_rng(1)
    curves = list(concave_curves().values())
    for trial in range(200):
        sps = curves[trial % len(curves)]
        r = int(rng.integers(1, 4))
        survival = random_survival(rng, r, 6)
        caps = [6] * r
        base = schedule(survival, sps, caps)
        req = int(rng.integers(r))
        k = int(rng.integers(1, 6))  # keep a_1..a_k, resample after
        changed = [a.copy() for a in survival]
        tail = np.cumprod(rng.uniform(0.0, 1.0, size=6 - k))
        changed[req][k:] = changed[req][k - 1] * tail
        new = schedule(changed, sps, caps)
        assert (base[req] >= k) == (new[req] >= k)
        for j in range(1, k + 1):
            assert (base[req] >= j) == (new[req] >= j)


def test_step_rate_curve_interpolation_and_json(tmp_path):
    curve = StepRateCurve.from_measurements(
        {4: [0.02, 0.03, 0.02], 1: 0.01, 2: [0.012]}, draft_seconds=0.004
    )
    assert curve.batch_sizes == [1, 2, 4]
    assert curve.sps(1) == pytest.approx(100.0)
    assert curve.sps(4) == pytest.approx(50.0)  # median of 3 timings
    assert curve.step_seconds(3) == pytest.approx(0.016)  # time interpolated
    assert curve.step_seconds(6) == pytest.approx(0.028)  # last slope 0.004/token
    assert curve.step_seconds(0.5) == pytest.approx(0.01)
    assert curve.round_rate(1) == pytest.approx(1 / 0.014)
    again = StepRateCurve.from_json(curve.to_json())
    assert again == curve
    path = tmp_path / "sps.json"
    curve.save(path)
    assert StepRateCurve.load(path) == curve
    with pytest.raises(DSparkError, match="does not exist"):
        StepRateCurve.load(tmp_path / "nope.json")
    with pytest.raises(ValueError):
        StepRateCurve([1, 2], [1.0])
    # extrapolation never speeds up
    flat = StepRateCurve([1, 2], [10.0, 20.0])
    assert flat.sps(10) == pytest.approx(20.0)


def test_threshold_cut():
    logits = np.array([3.0, 2.0, -1.0, 4.0])
    assert threshold_cut(logits, 0.0) == 4  # off
    assert threshold_cut(logits, 0.5) == 2  # sigmoid(-1) < 0.5
    assert threshold_cut(logits, 0.9) == 1  # sigmoid(2) = 0.88 < 0.9
    assert threshold_cut(logits, 0.99) == 0
    assert threshold_cut(np.array([0.0, 0.0]), 0.5) == 2  # strictly below only
    assert threshold_cut(np.array([]), 0.5) == 0


def test_settings_from_env():
    s = SchedulerSettings.from_env({})
    assert s == SchedulerSettings()
    env = {
        "DSPARK_SCHEDULER_ENABLED": "yes",
        "DSPARK_CONFIDENCE_THRESHOLD": "0.4",
        "DSPARK_N_DRAFT_MIN": "2",
        "DSPARK_N_DRAFT_MAX": "6",
        "DSPARK_SCHEDULER_INTERVAL_MS": "250",
        "DSPARK_WARMUP_STEPS": "0",
        "DSPARK_MEMORY_WARNING_FRACTION": "0.7",
        "DSPARK_MEMORY_CRITICAL_FRACTION": "0.9",
        "UNRELATED": "x",
    }
    s = SchedulerSettings.from_env(env)
    assert s == SchedulerSettings(True, 0.4, 2, 6, 250.0, 0, 0.7, 0.9)
    # env overrides a base built from CLI flags, leaving the rest alone
    base = SchedulerSettings(enabled=True, n_draft_max=4)
    s = SchedulerSettings.from_env({"DSPARK_SCHEDULER_ENABLED": "0"}, base=base)
    assert not s.enabled and s.n_draft_max == 4
    assert s.n_max(7) == 4 and SchedulerSettings().n_max(7) == 7
    assert SchedulerSettings(n_draft_min=3, n_draft_max=8).n_min(2) == 2


@pytest.mark.parametrize(
    "env, name",
    [
        ({"DSPARK_SCHEDULER_ENABLED": "maybe"}, "DSPARK_SCHEDULER_ENABLED"),
        ({"DSPARK_CONFIDENCE_THRESHOLD": "abc"}, "DSPARK_CONFIDENCE_THRESHOLD"),
        ({"DSPARK_CONFIDENCE_THRESHOLD": "1.5"}, "DSPARK_CONFIDENCE_THRESHOLD"),
        ({"DSPARK_CONFIDENCE_THRESHOLD": "nan"}, "DSPARK_CONFIDENCE_THRESHOLD"),
        ({"DSPARK_N_DRAFT_MIN": "1.5"}, "DSPARK_N_DRAFT_MIN"),
        ({"DSPARK_N_DRAFT_MIN": "-1"}, "DSPARK_N_DRAFT_MIN"),
        ({"DSPARK_N_DRAFT_MAX": "0"}, "DSPARK_N_DRAFT_MAX"),
        ({"DSPARK_N_DRAFT_MIN": "5", "DSPARK_N_DRAFT_MAX": "3"}, "DSPARK_N_DRAFT_MAX"),
        ({"DSPARK_SCHEDULER_INTERVAL_MS": "0"}, "DSPARK_SCHEDULER_INTERVAL_MS"),
        ({"DSPARK_WARMUP_STEPS": "-2"}, "DSPARK_WARMUP_STEPS"),
        ({"DSPARK_MEMORY_WARNING_FRACTION": "2"}, "DSPARK_MEMORY_WARNING_FRACTION"),
        (
            {
                "DSPARK_MEMORY_WARNING_FRACTION": "0.9",
                "DSPARK_MEMORY_CRITICAL_FRACTION": "0.5",
            },
            "DSPARK_MEMORY_CRITICAL_FRACTION",
        ),
    ],
)
def test_settings_invalid_env_is_one_sentence(env, name):
    with pytest.raises(DSparkError) as info:
        SchedulerSettings.from_env(env)
    msg = str(info.value)
    assert msg.startswith(name) and msg.endswith(".")
    assert "\n" not in msg
