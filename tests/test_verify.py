"""The acceptance rule shared by chain and tree verification, on its own."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.decoding.verify import (
    Verdict,
    accept_sampled,
    draw,
    rejection_step,
    without,
)
from mlx_dspark.sampling.processing import (
    SamplingParams,
    log_probs,
    probabilities,
    processed_logits,
)


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


PROCESSINGS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2, min_tokens_to_keep=3),
    SamplingParams(temperature=0.9, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, top_k=8),
    SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.05),
    SamplingParams(
        temperature=0.8,
        xtc_probability=1.0,
        xtc_threshold=0.05,
        xtc_special_tokens=(3,),
    ),
]


@pytest.mark.parametrize("params", PROCESSINGS)
def test_host_probabilities_are_the_processed_distribution(params):
    """Normalised on the host from the unnormalised log-weights a draw uses:
    the processed distribution (:func:`log_probs`, which the tests against
    mlx-lm's sampler check), in float64."""
    logits = mx.array(np.random.default_rng(0).normal(0, 4, (3, 40)), mx.float32)
    logits[:, 7] = logits[:, 8]  # a tie
    logits[0, 2] = 60.0  # exp would overflow float32 without the shift
    probs = probabilities(logits, params)
    expected = np.exp(np.array(log_probs(logits, params), dtype=np.float64))
    assert probs.dtype == np.float64 and np.allclose(probs.sum(axis=-1), 1.0)
    assert ((probs == 0) == (expected == 0)).all()
    assert np.allclose(probs, expected, atol=1e-6)


def test_sampled_acceptance_walks_rows_as_all_rows_at_once_would():
    """The walk processes a target row when it reaches it and reads the
    drafts' processed log-weights as they are; its verdicts equal those of
    processing every row first, draw for draw of the same generator."""
    params = SamplingParams(temperature=0.8, top_p=0.95)
    rng = np.random.default_rng(0)
    outcomes = set()
    for case in range(200):
        n = case % 6
        target = rng.normal(0, 1.5, (n + 1, 30))
        draft = target[:n] + rng.normal(0, 1.0, (n, 30))
        q = probabilities(mx.array(draft, mx.float32), params) if n else []
        drafts = np.array([draw(row, rng) for row in q], dtype=np.int64)
        target, draft = mx.array(target, mx.float32), mx.array(draft, mx.float32)
        seed = int(rng.integers(1 << 30))
        weights = processed_logits(draft, params) if n else draft
        walked = accept_sampled(
            drafts, weights, target, params, np.random.default_rng(seed)
        )
        assert walked == all_rows_first(drafts, draft, target, params, seed)
        outcomes.add((n, walked.accepted))
    assert {(5, 0), (5, 2), (5, 5)} <= outcomes  # early, middle and full acceptance


def all_rows_first(drafts, draft_logits, target_logits, params, seed) -> Verdict:
    rng = np.random.default_rng(seed)
    p = np.exp(np.array(log_probs(target_logits, params), dtype=np.float64))
    q = (
        np.exp(np.array(log_probs(draft_logits, params), dtype=np.float64))
        if len(drafts)
        else None
    )
    for i, x in enumerate(drafts):
        if rng.random() * q[i, x] >= p[i, x]:
            residual = np.maximum(p[i] - q[i], 0.0)
            return Verdict(i, draw(residual / residual.sum(), rng))
    return Verdict(len(drafts), draw(p[len(drafts)], rng))
