"""The acceptance rule shared by chain and tree verification, on its own."""

import numpy as np

from mlx_dspark.verify import draw, rejection_step, without


def test_a_draft_then_the_rejection_step_samples_the_target():
    """x ~ q, kept with min(1, p/q), else a draw from the residual: exactly p."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.1, 0.6, 0.1, 0.2])
    rng = np.random.default_rng(0)
    n = 40_000
    counts = np.zeros(4)
    for _ in range(n):
        x = draw(q, rng)
        kept, rest = rejection_step(p, q, x, rng)
        counts[x if kept else draw(rest, rng)] += 1
    assert np.abs(counts / n - p).max() < 0.01, counts / n


def test_the_residual_is_normalised_and_falls_back_to_the_target():
    p = np.array([0.2, 0.8])
    rng = np.random.default_rng(1)
    rejected = [rejection_step(p, np.array([0.9, 0.1]), 0, rng) for _ in range(50)]
    assert any(not kept for kept, _ in rejected)
    assert all(np.allclose(rest, [0.0, 1.0]) for kept, rest in rejected if not kept)
    kept, rest = rejection_step(p, p, 0, np.random.default_rng(2))
    assert kept and rest is p  # q == p is always kept
    never = np.array([0.0, 1.0])
    assert not rejection_step(never, never, 0, rng)[0]  # p(x) = 0: never kept


def test_without_removes_a_drawn_token():
    assert np.allclose(without(np.array([0.5, 0.25, 0.25]), 0), [0.0, 0.5, 0.5])
    assert np.allclose(without(np.array([1.0, 0.0]), 0), [0.0, 0.0])
