"""Logit processing shared by the drafter and the target.

Drafts and the target go through the same processing (:func:`processed_logits`),
so the drafter proposes from the distribution the target samples from; exactness
needs only that verification reads the very weights a draft was drawn from. The
filters follow mlx-lm's sampler: top-p, then min-p, then top-k on the untempered
log-probabilities, then the temperature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import DSparkError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # As mlx-lm's: the min-p filter always keeps this many of the top tokens.
    min_tokens_to_keep: int = 1
    # XTC as mlx-lm's sampler: with this probability per token, drop every
    # token above the threshold but the least likely of them (never the
    # special tokens). Sampling uses the mixture of the two distributions, the
    # per-token distribution mlx-lm's coin flip produces.
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise DSparkError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise DSparkError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise DSparkError(f"top_k must be >= 0, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise DSparkError(f"min_p must be in [0, 1], got {self.min_p}.")
        if not 0.0 <= self.xtc_probability <= 1.0:
            raise DSparkError(
                f"xtc_probability must be in [0, 1], got {self.xtc_probability}."
            )
        if not 0.0 <= self.xtc_threshold <= 0.5:
            raise DSparkError(
                f"xtc_threshold must be in [0, 0.5], got {self.xtc_threshold}."
            )
        if self.min_tokens_to_keep < 1:
            raise DSparkError(
                f"min_tokens_to_keep must be >= 1, got {self.min_tokens_to_keep}."
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _top_p(logprobs: mx.array, top_p: float) -> mx.array:
    sorted_logprobs = mx.sort(logprobs, axis=-1)
    sorted_probs = mx.exp(sorted_logprobs)
    mass_above = mx.cumsum(sorted_probs, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + sorted_probs[..., :1]
    dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(sorted_logprobs, dropped, axis=-1)
    return mx.where(logprobs < threshold, -mx.inf, logprobs)


def _min_p(logprobs: mx.array, min_p: float, keep: int = 1) -> mx.array:
    floor = logprobs.max(axis=-1, keepdims=True) + math.log(min_p)
    dropped = logprobs < floor
    keep = min(keep, logprobs.shape[-1])
    if keep > 1:
        top = mx.argpartition(logprobs, kth=-keep, axis=-1)[..., -keep:]
        dropped = mx.put_along_axis(dropped, top, mx.array(False), axis=-1)
    return mx.where(dropped, -mx.inf, logprobs)


def _top_k(logprobs: mx.array, top_k: int) -> mx.array:
    if top_k >= logprobs.shape[-1]:
        return logprobs
    dropped = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(
        logprobs, dropped, mx.array(-mx.inf, logprobs.dtype), axis=-1
    )


def _xtc_cut(logprobs: mx.array, threshold: float, special: tuple[int, ...]):
    """mlx-lm's XTC when its coin says apply: drop the tokens above
    ``threshold`` except the least likely of them, keeping ``special``."""
    probs = mx.softmax(logprobs, axis=-1)
    least = mx.where(probs > threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    dropped = probs > least
    if special:
        dropped[..., list(special)] = False
    return mx.where(dropped, -mx.inf, logprobs)


def _finish(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """Top-k, then the temperature; the rows are left unnormalised."""
    if params.top_k > 0:
        logprobs = _top_k(logprobs, params.top_k)
    return logprobs * (1.0 / params.temperature)


def _normalise(weights: mx.array) -> mx.array:
    return weights - mx.logsumexp(weights, axis=-1, keepdims=True)


def processed_logits(logits: mx.array, params: SamplingParams) -> mx.array:
    """The processed distribution's log-weights (float32), up to a constant
    per row: :func:`log_probs` without its last normalisation, which neither
    a categorical draw nor a normalisation on the host (:func:`probabilities`)
    needs. On MLX's CPU backend a logsumexp over a 50k-token row costs about
    0.7 ms, a sizeable share of a sampled round."""
    logits = logits.astype(mx.float32)
    if 0.0 < params.top_p < 1.0:
        logits = _top_p(_normalise(logits), params.top_p)
    if params.min_p > 0.0:
        logits = _min_p(logits, params.min_p, params.min_tokens_to_keep)
    chance = params.xtc_probability
    if chance == 0.0:
        return _finish(logits, params)
    cut = _finish(
        _xtc_cut(logits, params.xtc_threshold, params.xtc_special_tokens), params
    )
    if chance == 1.0:
        return cut
    plain = _normalise(_finish(logits, params))
    return mx.logaddexp(plain + math.log1p(-chance), _normalise(cut) + math.log(chance))


def log_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Processed log-probabilities (float32) that sampling draws from."""
    return _normalise(processed_logits(logits, params))


def normalised(weights: mx.array) -> np.ndarray:
    """Log-weights exponentiated and normalised on the host, in float64."""
    weights = np.array(weights, dtype=np.float64)
    weights = np.exp(weights - weights.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def probabilities(logits: mx.array, params: SamplingParams) -> np.ndarray:
    """:func:`log_probs` exponentiated, as float64 NumPy, normalised on the host."""
    return normalised(processed_logits(logits, params))


def sample(logits: mx.array, params: SamplingParams, key: mx.array | None) -> mx.array:
    """One token per row: argmax when greedy, else a draw from :func:`log_probs`."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(processed_logits(logits, params), key=key)
