"""Chain acceptance: which drafts the target keeps, and the token after them.

Greedy keeps the longest prefix equal to the target's argmax. Sampling uses
rejection sampling with residual resampling (a NumPy generator as the random
stream), or Gumbel coupling (:class:`~mlx_dspark.sampling.coupled.TokenKeys` as the
stream, see :mod:`mlx_dspark.sampling.coupled`); either way committed tokens are an
exact sample of the processed target distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..sampling.coupled import TokenKeys, mlx_lm_tokens
from ..sampling.processing import SamplingParams, normalised, probabilities

# What a sampled verdict draws with: a NumPy generator (residual rejection
# sampling) or a generation's token keys (Gumbel coupling).
Randomness = np.random.Generator | TokenKeys


@dataclass
class Verdict:
    accepted: int
    next_token: int


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw from an unnormalised probability vector."""
    cdf = np.cumsum(probs, dtype=np.float64)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(index, len(probs) - 1)


def rejection_step(
    p: np.ndarray, q: np.ndarray, x: int, rng: np.random.Generator
) -> tuple[bool, np.ndarray]:
    """Keep draft ``x ~ q`` with probability ``min(1, p(x) / q(x))``.

    Returns (kept, the distribution to continue from): ``p`` when kept, else
    the normalised residual ``max(p - q, 0)`` (``p`` itself when that is empty).
    The rule of both chain and tree verification.
    """
    if rng.random() * q[x] < p[x]:
        return True, p
    residual = np.maximum(p - q, 0.0)
    if residual.sum() <= 0.0:
        residual = p
    return False, residual / residual.sum()


def without(q: np.ndarray, x: int) -> np.ndarray:
    """``q`` with ``x`` removed and renormalised: the law of the next draw of a
    sample without replacement."""
    q = q.copy()
    q[x] = 0.0
    total = q.sum()
    return q / total if total > 0 else q


def accept_greedy(drafts: np.ndarray, target_logits: mx.array) -> Verdict:
    """``target_logits`` is ``[n + 1, V]``: rows for the anchor and each draft."""
    best = np.array(mx.argmax(target_logits, axis=-1))
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == best[accepted]:
        accepted += 1
    return Verdict(accepted, int(best[accepted]))


def accept_sampled(
    drafts: np.ndarray,
    draft_weights: mx.array,
    target_logits: mx.array,
    params: SamplingParams,
    rng: np.random.Generator,
) -> Verdict:
    """Keep draft ``i`` with probability ``min(1, p_i(x) / q_i(x))``.

    ``draft_weights`` are the processed log-weights the drafts were drawn
    from (a sampled :class:`~mlx_dspark.proposers.dspark.Proposal`'s rows); the
    target's rows are processed here with ``params``. On the first rejection
    the next token is drawn from ``max(p_i - q_i, 0)``; if every draft
    survives it is drawn from the target's row after them. Rows are read only
    as far as the walk goes: most rounds stop at their first or second draft.
    """
    for i, x in enumerate(drafts):
        p = probabilities(target_logits[i], params)
        kept, rest = rejection_step(p, normalised(draft_weights[i]), x, rng)
        if not kept:
            return Verdict(i, draw(rest, rng))
    n = len(drafts)
    return Verdict(n, draw(probabilities(target_logits[n], params), rng))


def accept_coupled(
    drafts: np.ndarray,
    target_logits: mx.array,
    params: SamplingParams,
    keys: TokenKeys,
) -> Verdict:
    """Keep draft ``i`` iff it is the token mlx-lm samples from row ``i``
    with that token's keys; the next token is the first row's own token
    that differs (or the row after the drafts). Uses up the keys of the
    committed tokens."""
    n = len(drafts)
    own = np.array(mlx_lm_tokens(target_logits[: n + 1], params, keys.peek(n + 1)))
    accepted = 0
    while accepted < n and drafts[accepted] == own[accepted]:
        accepted += 1
    keys.take(accepted + 1)
    return Verdict(accepted, int(own[accepted]))


def verdict(
    drafts: np.ndarray,
    draft_rows: mx.array,
    target_logits: mx.array,
    params: SamplingParams,
    rng: Randomness,
) -> Verdict:
    """The chain's verdict; ``draft_rows`` are a proposal's rows (read only
    by residual sampling, see :func:`accept_sampled`); ``rng`` picks the
    sampled rule (:data:`Randomness`)."""
    if params.greedy:
        return accept_greedy(drafts, target_logits)
    if isinstance(rng, TokenKeys):
        return accept_coupled(drafts, target_logits, params, rng)
    return accept_sampled(drafts, draft_rows, target_logits, params, rng)
