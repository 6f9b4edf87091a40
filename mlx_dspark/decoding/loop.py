"""The one generation loop: prefill, then draft / verify / commit rounds.

How a round drafts and verifies (a chain or a tree) and how many drafts it
sends to the target (fixed, threshold, scheduler, adaptive) are parts plugged
into :func:`speculative_generate_step`; the loop itself never changes. A round
whose cap is 0 is a plain round: no drafter, one target step pipelined like
mlx-lm's ``generate_step`` (the next plain step is queued before the current
token is read), so a policy that stops drafting decodes as fast as the target
alone.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..proposers.base import Offer, Proposal, Proposer, Round, cut_at_stop, joined
from ..sampling.coupled import TokenKey, TokenKeys, mlx_lm_token, resolve_sampling
from ..sampling.processing import SamplingParams, probabilities, sample
from ..targets.adapter import TargetAdapter
from .modes import ChainMode, RoundMode
from .verify import Randomness, draw


@dataclass
class RoundStats:
    drafted: int
    verified: int
    accepted: int
    draft_time: float = 0.0
    verify_time: float = 0.0
    # Since the previous round ended, including the caller's time with the
    # previous round's tokens (which a pipelined plain round overlaps).
    wall_time: float = 0.0
    copy_offered: bool = False  # the context had a copy for this round
    phrases_offered: bool = False  # the copy came from the phrase store
    source: str = ""  # the offer's word on where the draft came from


# The kinds of rounds, in the order a summary lists them: plain (no drafts),
# the drafter's own block, a copy from the context, a copy from the phrase
# store (:mod:`~mlx_dspark.proposers.copying`).
ROUND_KINDS = ("plain", "own", "copy", "phrases")


def round_kind(stats: RoundStats) -> str:
    """Which of :data:`ROUND_KINDS` a finished round was."""
    if stats.drafted == 0:
        return "plain"
    if stats.phrases_offered:
        return "phrases"
    return "copy" if stats.copy_offered else "own"


@dataclass
class KindSummary:
    """The rounds of one kind: how many, drafts verified and tokens kept
    (accepted drafts plus the target's token) in all, the longest verified."""

    rounds: int = 0
    verified: int = 0
    kept: int = 0
    longest: int = 0

    def add(self, stats: RoundStats) -> None:
        self.rounds += 1
        self.verified += stats.verified
        self.kept += stats.accepted + 1
        self.longest = max(self.longest, stats.verified)

    @property
    def verified_per_round(self) -> float:
        return self.verified / self.rounds if self.rounds else 0.0

    @property
    def kept_per_round(self) -> float:
        return self.kept / self.rounds if self.rounds else 0.0


@dataclass
class GenerationStats:
    rounds: list[RoundStats] = field(default_factory=list)
    prompt_tokens: int = 0
    prompt_time: float = 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per round: accepted drafts plus the target's token."""
        if not self.rounds:
            return 0.0
        return sum(r.accepted + 1 for r in self.rounds) / len(self.rounds)

    @property
    def acceptance_by_position(self) -> list[float]:
        """For draft position k, the share of rounds verifying it that kept it."""
        longest = max((r.verified for r in self.rounds), default=0)
        rates = []
        for k in range(1, longest + 1):
            tried = [r for r in self.rounds if r.verified >= k]
            rates.append(sum(r.accepted >= k for r in tried) / len(tried))
        return rates

    def by_kind(self) -> dict[str, KindSummary]:
        """The rounds by kind (:func:`round_kind`), in :data:`ROUND_KINDS`
        order, the kinds that ran only."""
        kinds: dict[str, KindSummary] = {}
        for r in self.rounds:
            kinds.setdefault(round_kind(r), KindSummary()).add(r)
        return {k: kinds[k] for k in ROUND_KINDS if k in kinds}

    @property
    def draft_time(self) -> float:
        return sum(r.draft_time for r in self.rounds)

    @property
    def verify_time(self) -> float:
        return sum(r.verify_time for r in self.rounds)

    def summary(self) -> dict:
        return {
            "rounds": len(self.rounds),
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_by_position": self.acceptance_by_position,
            "draft_time_s": self.draft_time,
            "verify_time_s": self.verify_time,
        }


class DraftPolicy(Protocol):
    """Decides how many drafts each round verifies.

    Two optional methods are called when a policy has them: ``round_cap(cap,
    copy, phrases) -> int`` may lower a round's cap before drafting (it must
    not look at the round's drafts; the memory guard uses it; ``copy`` says
    whether the round is offered a copy, see :mod:`~mlx_dspark.proposers.copying`, and
    ``phrases`` whether that copy comes from the drafter's phrase store), and
    ``observe(proposal, round)`` sees every finished round (calibration,
    telemetry).
    """

    def draft_length(self, proposal: Proposal, cap: int) -> int:
        """How many of the proposal's first ``cap`` drafts to verify."""


# A round whose cap is 0 is a plain round: one pipelined target step and no
# drafter. ``round_cap`` for the round after a plain one is asked before that
# plain round's token reaches the host (and before its ``observe``), so that a
# following plain step can be queued on the lazy token; it must not sync. A
# proposer that makes offers (copying from the context) needs that token to
# make them, so then the next plain step is queued once the token is known,
# unless the policy has a third optional method, ``plain_ahead(phrases) ->
# bool``, that says (without syncing or changing its state) that the coming
# round is plain whatever it is offered (``phrases``: the proposer has a
# phrase store): then its step is queued first, as without offers, and the
# round is plain whatever ``round_cap`` says.


@dataclass
class ThresholdPolicy:
    """Cut at the first draft whose own confidence is below ``threshold``."""

    threshold: float = 0.0

    def draft_length(self, proposal: Proposal, cap: int) -> int:
        if proposal.confidence is None:
            return cap
        return threshold_cut(np.array(proposal.confidence[0, :cap]), self.threshold)


def prefill(
    target: TargetAdapter, prompt: mx.array, cache: list, step: int = 512
) -> tuple[mx.array, mx.array]:
    """Run the prompt through the target; last logits and every token's features.

    Only the last position goes through the LM head: no other prompt
    position's logits are used, and on SmolLM2 the head is a fifth of a
    prompt token's cost. The features are None when the target taps none
    (a proposer that reads no features).
    """
    features = []
    for begin in range(0, prompt.size, step):
        hidden, feats = target.hidden(prompt[None, begin : begin + step], cache)
        mx.eval(hidden[:, -1], feats)
        features.append(feats)
    context = joined(features) if features[0] is not None else None
    return target.lm_head(hidden[:, -1:])[0, -1], context


def plain_step(
    target: TargetAdapter,
    cache: list,
    token: mx.array,
    params: SamplingParams,
    key: mx.array | TokenKey | None,
) -> tuple[mx.array, mx.array | None]:
    """One lazy target step: the next token ``[1]`` and the step's features.

    ``key``: the draw's key, or (coupled sampling) the token's keys.

    ``token`` may itself be lazy (the previous step's output), which is what
    lets plain rounds overlap the host's work with the device's.
    """
    logits, features = target(token[None], cache)
    if isinstance(key, tuple):
        return mlx_lm_token(logits[0, -1:], params, key), features
    return sample(logits[0, -1:], params, key), features


def first_token(logits: mx.array, params: SamplingParams, rng: Randomness) -> int:
    """The token after the prompt from its logits ``[V]``, drawn with
    ``rng`` (see :data:`~mlx_dspark.decoding.verify.Randomness`)."""
    if params.greedy:
        return int(mx.argmax(logits).item())
    if isinstance(rng, TokenKeys):
        return int(mlx_lm_token(logits, params, rng.take(1)[0]).item())
    return draw(probabilities(logits, params), rng)


def speculative_generate_step(
    prompt: mx.array,
    target: TargetAdapter,
    proposer: Proposer,
    *,
    params: SamplingParams = SamplingParams(),
    num_draft: int,
    max_tokens: int = 256,
    policy: DraftPolicy | None = None,
    mode: RoundMode | None = None,
    seed: int | None = None,
    stats: GenerationStats | None = None,
    prefill_step_size: int = 512,
    sampling: str | None = None,
    stop_ids: Collection[int] = (),
) -> Iterator[tuple[int, bool]]:
    """Yield ``(token, from_draft)`` until ``max_tokens`` tokens are produced.

    ``proposer`` proposes each drafted round
    (:mod:`~mlx_dspark.proposers.base`; a pair's is built by
    :func:`~mlx_dspark.proposers.copying.pair_proposer`). ``num_draft``
    bounds the drafts of every round the proposer offers nothing else for
    (the setup's :attr:`~mlx_dspark.policy.settings.SpeculationSettings.num_draft`).
    A proposer with ``offer`` offers kinds of rounds, which the policy picks
    among.

    ``sampling`` (sampled ``params`` only): ``"coupled"`` commits the very
    tokens ``mlx_lm.generate`` samples after ``mx.random.seed(seed)``
    (:mod:`~mlx_dspark.sampling.coupled`), ``"residual"`` uses rejection sampling
    with residual resampling; both are exact samples. None: coupled with a
    seed, else :data:`~mlx_dspark.sampling.coupled.UNSEEDED_SAMPLING`. With a seed
    the global key state is never read or moved; coupled without one goes on
    from it and moves it as mlx-lm's sampler does, so after
    ``mx.random.seed(S)`` the output is mlx-lm's with that seed.

    Stopping on end-of-sequence tokens is the caller's job; rounds may commit
    past it, which does not change the tokens before it. ``stop_ids`` (the
    tokenizer's end-of-sequence tokens) go to the proposer with each round,
    and a policy whose ``cut_at_stop`` is true never has drafts after a
    drafted stop token verified (:func:`~mlx_dspark.proposers.base.cut_at_stop`).
    """
    policy = policy or ThresholdPolicy()
    mode = mode or ChainMode()
    stop_ids = frozenset(int(t) for t in stop_ids)
    cut_stops = bool(stop_ids) and getattr(policy, "cut_at_stop", False)
    cut_stops = cut_stops and isinstance(mode, ChainMode)  # a tree is no chain
    stats = stats if stats is not None else GenerationStats()
    keys = None
    if resolve_sampling(sampling, seed) == "coupled" and not params.greedy:
        if seed is None:
            keys = TokenKeys.from_global(params)
        else:
            keys = TokenKeys.from_seed(seed, params)
    seed = secrets.randbits(63) if seed is None else seed
    rng: Randomness = np.random.default_rng(seed) if keys is None else keys
    key = mx.random.key(seed)

    cache = target.make_cache()
    state = proposer.make_state()
    tic = time.perf_counter()
    logits, context = prefill(target, prompt, cache, prefill_step_size)
    anchor = first_token(logits, params, rng)
    stats.prompt_tokens, stats.prompt_time = prompt.size, time.perf_counter() - tic
    ended = time.perf_counter()
    yield anchor, False

    produced = 1
    round_cap = getattr(policy, "round_cap", None)
    observe = getattr(policy, "observe", None)
    plain_ahead = getattr(policy, "plain_ahead", None)
    no_proposal = Proposal(mx.zeros((1, 0), mx.int32), mx.zeros((1, 0, 1)))
    unseen = [context]  # target features the proposer has not been given yet
    history = [*prompt.tolist(), anchor]  # every committed token
    offer_rounds = getattr(proposer, "offer", None)
    phrases = getattr(proposer, "phrases", None) is not None
    ahead = None  # a plain step already launched for the coming round

    def split(key: mx.array) -> tuple[mx.array, mx.array | TokenKey | None]:
        """The loop's key and a plain step's key (coupled: the token's keys)."""
        if keys is not None:
            return key, keys.take(1)[0]
        return (key, None) if params.greedy else mx.random.split(key)

    def next_cap(offer: Offer) -> int:
        cap = min(offer.longest, max_tokens - produced - 1)
        if round_cap is not None:
            told = round_cap(cap, copy=offer.copy, phrases=offer.phrases)
            cap = max(0, min(cap, int(told)))
        return cap

    def plan() -> tuple[Offer, int]:
        """The coming round's offer and cap: the first offer the policy does
        not decline (a cap of 0 on an offer that is not declinable is a
        plain round)."""
        offers = [Offer(num_draft)]
        if offer_rounds is not None:
            offers = offer_rounds(state, history, num_draft)
        for offer in offers:
            cap = next_cap(offer)
            if cap > 0 or not offer.declinable:
                break
        return offer, cap

    offer, cap = plan()
    while produced < max_tokens:
        tic = time.perf_counter()
        if cap == 0:
            # A plain round: one target step, pipelined like mlx-lm's
            # generate_step. The next round's cap is decided before this
            # round's token reaches the host; when it is plain too, its step
            # is queued on the lazy token first, so the device never idles.
            if ahead is None:
                key, step_key = split(key)
                ahead = plain_step(target, cache, mx.array([anchor]), params, step_key)
                mx.async_eval([a for a in ahead if a is not None])
            token, features = ahead
            ahead = None
            produced += 1
            kind = offer.copy, offer.phrases  # this round's
            if offer_rounds is not None:
                ahead_known = produced < max_tokens and plain_ahead is not None
                if ahead_known and plain_ahead(phrases):  # whatever is offered
                    key, step_key = split(key)
                    ahead = plain_step(target, cache, token, params, step_key)
                    mx.async_eval([a for a in ahead if a is not None])
                history.append(token.item())
            offer, cap = plan()
            if ahead is not None:
                cap = 0  # the policy said so before the offers were known
            elif cap == 0 and produced < max_tokens:
                key, step_key = split(key)
                ahead = plain_step(target, cache, token, params, step_key)
                mx.async_eval([a for a in ahead if a is not None])
            anchor = token.item()
            if offer_rounds is None:
                history.append(anchor)
            unseen.append(features)
            now = time.perf_counter()
            stats.rounds.append(RoundStats(0, 0, 0, 0.0, now - tic, now - ended, *kind))
            ended = now
            if observe is not None:
                observe(no_proposal, stats.rounds[-1])
            yield anchor, False
            continue
        if keys is not None:
            round_key = keys.peek(cap)  # the drafted tokens' keys, not used up
        else:
            key, round_key = mx.random.split(key)
        round = Round(
            history, joined(unseen), cap, params, round_key, offer, stop_ids,
            partial(target.attention_kv, cache),
        )  # fmt: skip
        proposal = mode.propose(proposer, state, round)
        cap = min(cap, proposal.tokens.shape[1])
        n = policy.draft_length(proposal, cap)
        if cut_stops and n > 1:
            n = cut_at_stop(proposal.tokens[0, :n], stop_ids)
        drafted_at = time.perf_counter()
        result, drafts, committed = mode.verify(
            target, cache, anchor, proposal, n, params, rng
        )
        unseen = [committed]  # the proposer was given every earlier one
        now = time.perf_counter()
        stats.rounds.append(
            RoundStats(
                drafted=cap,
                verified=n,
                accepted=result.accepted,
                draft_time=drafted_at - tic,
                verify_time=now - drafted_at,
                wall_time=now - ended,
                copy_offered=offer.copy,
                phrases_offered=offer.phrases,
                source=offer.source,
            )
        )
        ended = now
        if observe is not None:
            observe(proposal, stats.rounds[-1])
        for token in drafts[: result.accepted]:
            yield token, True
        yield result.next_token, False
        produced += result.accepted + 1
        anchor = result.next_token
        history.extend([*drafts[: result.accepted], anchor])
        offer, cap = plan()


def threshold_cut(raw_conf: np.ndarray, threshold: float) -> int:
    """Drafts kept by the static rule: index of the first position whose own
    sigmoid(raw_conf[k]) is strictly below ``threshold``; 0 (off) keeps all.

    ``raw_conf`` are the confidence head's logits (pre-sigmoid).
    """
    z = np.asarray(raw_conf, dtype=np.float64).ravel()
    if threshold <= 0.0:
        return int(z.size)
    below = np.flatnonzero(0.5 * (1.0 + np.tanh(0.5 * z)) < threshold)
    return int(below[0]) if below.size else int(z.size)
