"""Gumbel-coupled sampling: the very tokens ``mlx_lm.generate`` samples.

After ``mx.random.seed(S)``, mlx-lm's sampler draws token ``i`` with
``mx.random.categorical(logprobs_i * (1 / T))`` on the global key state:
each draw splits it (``state, key = split(state)``) and samples with
``key``; XTC first splits off a key of its own for its coin. Those keys
depend on ``S`` and ``i`` only, never on the logits, so :class:`TokenKeys`
computes them (from a seed without touching the global state), and :func:`mlx_lm_token`
computes the token mlx-lm would sample from any row. Coupled verification
keeps a draft iff it equals the target's own token at its row; the token
after the kept drafts is the target's own token at the next row. So the
output *is* the target's sample, whatever the drafts were: exact by
construction. The drafter draws its drafts with the same keys from its own
rows, so drafts agree with the target wherever the two distributions are
close.

Without a seed a generation uses residual rejection sampling
(:mod:`mlx_dspark.decoding.verify`), which keeps more drafts, unless asked for
``sampling="coupled"``; see :func:`resolve_sampling` and
:data:`UNSEEDED_SAMPLING`.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..errors import DSparkError
from .processing import SamplingParams, _xtc_cut

SAMPLING_METHODS = ("coupled", "residual")
# Without a seed: residual rejection sampling keeps more drafts (it accepts
# a draft with probability 1 - TV(p, q), Gumbel coupling with at most that).
# Default pair, held-out prompts, 7 drafts a round, mean accepted length
# coupled / residual: T=0.7 1.49 / 1.57, T=1 1.23 / 1.45
# (examples/coupled_vs_residual.py --max-tokens 64 --seeds 2).
UNSEEDED_SAMPLING = "residual"

# One token's keys: XTC's coin key (None without XTC) and the draw's key.
TokenKey = tuple[mx.array | None, mx.array]


def resolve_sampling(sampling: str | None, seed: int | None) -> str:
    """The sampling rule a generation uses: ``sampling`` when given, else
    coupled with a seed (the output then equals mlx-lm's with that seed) and
    :data:`UNSEEDED_SAMPLING` without."""
    if sampling is None:
        return "coupled" if seed is not None else UNSEEDED_SAMPLING
    if sampling not in SAMPLING_METHODS:
        raise DSparkError(f"sampling must be coupled or residual, got {sampling!r}.")
    return sampling


def _set_global_key(key: mx.array) -> None:
    """Make ``key`` MLX's global key state (what ``mx.random.seed`` sets)."""
    mx.random.state[0][...] = key


@contextmanager
def own_keys() -> Iterator[None]:
    """Leave the global key state as it was: random draws inside (weight
    initialisation, profiling) come from keys mlx-lm's sampler then draws
    again, as if they had never happened."""
    saved = mx.array(mx.random.state[0])
    mx.eval(saved)
    try:
        yield
    finally:
        _set_global_key(saved)


@dataclass
class TokenKeys:
    """The per-token keys of mlx-lm's sampler from a key state: after
    ``mx.random.seed(seed)`` that state is ``mx.random.key(seed)``.

    ``peek(n)`` gives the keys of the next ``n`` tokens without using them up,
    ``take(n)`` uses them up. With ``follow_global`` the stream starts from
    the global key state and moves it on as tokens are taken, as mlx-lm's
    sampler does; otherwise the global state is never read or moved.
    """

    state: mx.array
    coin: bool = False  # XTC splits off its coin's key before each draw
    follow_global: bool = False
    # Each token's keys and the key state after them.
    ahead: list[tuple[TokenKey, mx.array]] = field(default_factory=list)

    @classmethod
    def from_seed(cls, seed: int | None, params: SamplingParams) -> TokenKeys:
        seed = secrets.randbits(63) if seed is None else seed
        return cls(mx.random.key(seed), params.xtc_probability > 0)

    @classmethod
    def from_global(cls, params: SamplingParams) -> TokenKeys:
        """Go on from the global key state, moving it as mlx-lm would."""
        return cls(mx.array(mx.random.state[0]), params.xtc_probability > 0, True)

    def peek(self, n: int) -> list[TokenKey]:
        while len(self.ahead) < n:
            coin = None
            if self.coin:
                self.state, coin = mx.random.split(self.state)
            self.state, draw = mx.random.split(self.state)
            self.ahead.append(((coin, draw), self.state))
        return [keys for keys, _ in self.ahead[:n]]

    def take(self, n: int) -> list[TokenKey]:
        keys = self.peek(n)
        if self.follow_global and n:
            _set_global_key(self.ahead[n - 1][1])
        del self.ahead[:n]
        return keys


def mlx_lm_logprobs(
    logits: mx.array, params: SamplingParams, coin: mx.array | None
) -> mx.array:
    """mlx-lm's processed log-probabilities of rows ``[1, V]``, before the
    temperature, op for op as its sampler computes them (top-p, min-p, XTC
    with the coin drawn with key ``coin``, top-k), so that a draw from them
    matches mlx-lm's bit for bit."""
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    if 0.0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, params.min_tokens_to_keep)
    if params.xtc_probability > 0.0:
        cut = _xtc_cut(logprobs, params.xtc_threshold, params.xtc_special_tokens)
        keep = mx.random.uniform(0, 1, key=coin) > params.xtc_probability
        logprobs = mx.where(keep, logprobs, cut)
    if 0 < params.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs


def mlx_lm_draw(
    logits: mx.array, params: SamplingParams, key: TokenKey
) -> tuple[mx.array, mx.array]:
    """The token ``[1]`` mlx-lm samples (sampled ``params``) from a row
    ``[1, V]`` with the token's keys, and the tempered log-weights ``[1, V]``
    it was drawn from (both lazy)."""
    coin, draw = key
    weights = mlx_lm_logprobs(logits, params, coin) * (1.0 / params.temperature)
    return mx.random.categorical(weights, key=draw), weights


def mlx_lm_token(logits: mx.array, params: SamplingParams, key: TokenKey) -> mx.array:
    """The token ``[1]`` mlx-lm samples from a row ``[1, V]`` (or ``[V]``)
    with the token's keys (lazy). Greedy: the argmax."""
    logits = logits.reshape(1, -1)
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return mlx_lm_draw(logits, params, key)[0]


def mlx_lm_tokens(
    rows: mx.array, params: SamplingParams, keys: list[TokenKey]
) -> mx.array:
    """:func:`mlx_lm_token` of each row ``[n, V]`` with its own keys: ``[n]``.

    Row by row: a categorical draw over ``[n, V]`` with one key is not the
    same draws as ``n`` draws over ``[1, V]``."""
    return mx.concatenate(
        [mlx_lm_token(rows[i : i + 1], params, k) for i, k in enumerate(keys)]
    )
