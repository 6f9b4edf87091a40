"""Sampled DSpark output is an exact sample of the processed target distribution."""

import itertools
import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.decoding.loop import GenerationStats, speculative_generate_step
from mlx_dspark.decoding.modes import ChainMode
from mlx_dspark.decoding.verify import Verdict
from mlx_dspark.proposers.copying import pair_proposer
from mlx_dspark.sampling.processing import SamplingParams, log_probs
from mlx_dspark.targets.adapter import TargetAdapter

PROMPT = [3, 14, 15]
SEEDS = 2000
CONFIGS = [
    SamplingParams(temperature=0.7, top_p=0.9, top_k=8),
    SamplingParams(temperature=1.0),
]


def exact_joint(model, params: SamplingParams, prompt=PROMPT) -> dict[tuple, float]:
    """P(x1, x2, x3 | prompt) of target-only sampling, by enumeration."""
    first = np.exp(np.array(log_probs(model(mx.array([prompt]))[0, -1], params)))
    support = [int(a) for a in np.flatnonzero(first > 0)]
    pairs = [(a, b) for a in support for b in range(first.size)]
    logits = model(mx.array([prompt + [a, b] for a, b in pairs]))
    second = np.exp(np.array(log_probs(logits[:, -2], params)))
    third = np.exp(np.array(log_probs(logits[:, -1], params)))
    joint = {}
    for i, (a, b) in enumerate(pairs):
        p_ab = first[a] * second[i, b]
        if p_ab == 0:
            continue
        for c in np.flatnonzero(third[i] > 0):
            joint[(int(a), int(b), int(c))] = p_ab * third[i, c]
    return joint


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z=3.09: p=0.001)."""
    h = 2.0 / (9.0 * dof)
    return dof * (1.0 - h + z * math.sqrt(h)) ** 3


def chi_square(samples: Counter, joint: dict, n: int) -> tuple[float, int]:
    """Statistic over outcomes expected >= 5 times, the rest lumped into one bin."""
    stat, dof, rest_expected, rest_seen = 0.0, -1, 0.0, n
    for outcome, p in joint.items():
        expected = p * n
        if expected >= 5:
            seen = samples.get(outcome, 0)
            stat += (seen - expected) ** 2 / expected
            dof += 1
            rest_seen -= seen
        else:
            rest_expected += expected
    if rest_expected > 0:
        stat += (rest_seen - rest_expected) ** 2 / max(rest_expected, 1e-9)
        dof += 1
    return stat, dof


def sample_first_three(
    model,
    drafter,
    params,
    mode=None,
    seeds=SEEDS,
    policy=None,
    prompt=PROMPT,
    proposer=None,
    copy_draft=None,
    copy_as_is=False,
    **loop,
):
    """``policy``, when given, makes each seed's draft policy; ``proposer``
    stands for the pair's (``copy_draft`` and ``copy_as_is`` configure that
    one); ``loop`` holds other arguments of the generation loop."""
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    samples, stats = Counter(), GenerationStats()
    loop = {"num_draft": drafter.block_size, "max_tokens": 3, **loop}
    for seed in range(seeds):
        tokens = speculative_generate_step(
            mx.array(prompt),
            target,
            proposer or pair_proposer(drafter, copy_draft, copy_as_is),
            params=params,
            seed=seed,
            mode=mode,
            stats=stats,
            policy=None if policy is None else policy(),
            **loop,
        )
        samples[tuple(t for t, _ in itertools.islice(tokens, 3))] += 1
    return samples, stats


class AcceptEverything(ChainMode):
    """A wrong verifier: commits the drafts without rejection sampling."""

    def verify(self, target, cache, anchor, proposal, n, params, rng):
        drafts = np.array(proposal.tokens[0, :n]).tolist()
        _, features = target(mx.array([[anchor, *drafts]]), cache)
        bonus = int(mx.random.categorical(proposal.logits[0, n - 1]).item())
        return Verdict(n, bonus), drafts, features


@pytest.mark.parametrize("sampling", ["residual", "coupled"])
@pytest.mark.parametrize("params", CONFIGS, ids=["t0.7-p0.9-k8", "t1"])
@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_joint_distribution_of_first_three_tokens(pair_factory, params, head, sampling):
    """Both sampled rules: rejection sampling with residuals, and Gumbel
    coupling (the target's own draw at every row, seed by seed)."""
    model, _, drafter, *_ = pair_factory(
        markov_head_type=head, sharpness=0.6, block_size=4
    )
    joint = exact_joint(model, params)
    assert abs(sum(joint.values()) - 1.0) < 1e-4
    samples, stats = sample_first_three(model, drafter, params, sampling=sampling)
    stat, dof = chi_square(samples, joint, SEEDS)
    assert dof >= 5
    assert stat < chi_square_critical(dof), (stat, dof)
    accepted = [r.accepted for r in stats.rounds]
    assert 0 < np.mean(accepted) < max(r.verified for r in stats.rounds)


def test_the_statistical_test_catches_a_biased_verifier(pair_factory):
    model, _, drafter, *_ = pair_factory(
        markov_head_type="vanilla", sharpness=0.6, block_size=4
    )
    params = CONFIGS[1]
    joint = exact_joint(model, params)
    samples, _ = sample_first_three(model, drafter, params, mode=AcceptEverything())
    stat, dof = chi_square(samples, joint, SEEDS)
    assert stat > chi_square_critical(dof)
