"""Context copying and the phrase store, as a proposer composed with a drafter.

The copy is the suffix store's chain (:mod:`~mlx_dspark.proposers.suffix_store`):
what the request's own text says comes next
(:func:`~mlx_dspark.proposers.suffix_store.context_copy`), else what the
drafter's phrase store (``phrases.npy``, a pre-filled global store) says. A
round offered such a copy (:meth:`CopyProposer.offer`)
is drafted by the inner proposer with :class:`CopyBias` on its rows, goes on
past the drafter's block with the copy's own tokens (:func:`follow_copy`), or,
with ``as_is``, verifies the copy itself without running the drafter
(:func:`copied_proposal`). Every draft is drawn from the row it is verified
against, so the output is unchanged; only the proposal moves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import numpy as np

from .base import Backlog, Offer, Proposal, Proposer, Round, point_mass, tree_source
from .chain import ChainProposer
from .dspark import DrafterProposer, DSparkDrafter
from .eagle3 import Eagle3Drafter, Eagle3Proposer
from .gemma4_assistant import AssistantDrafter, AssistantProposer
from .mtp import MTPDrafter, MTPProposer
from .suffix_store import SuffixConfig, SuffixStore, context_copy, store_copy

# A copy follows the latest earlier occurrence of the text's last three (else
# two) tokens, as far as the round asks: small targets repeat runs far longer
# than the few tokens that start them, and the latest run is the one they
# repeat. One token seen before is weak evidence. (Chosen on the recipe's
# validation answers with examples/tune_copy_bias.py.)
COPY_CONFIG = SuffixConfig(
    max_depth=3, alpha=32.0, max_draft=32, min_prob=0.0, min_match=2, max_occurrences=1
)
# A phrase-store copy: the longest suffix of six to three tokens found there,
# then token by token what most often followed it (the latest on a tie).
PHRASE_CONFIG = SuffixConfig(
    max_depth=6,
    alpha=32.0,
    max_draft=32,
    min_prob=0.0,
    min_match=3,
    max_occurrences=4096,
)


@dataclass
class CopyBias:
    """A :class:`~mlx_dspark.proposers.base.RowBias` toward copied tokens.

    ``copy`` ``[B, >= n]`` holds target ids (-1 for none): draft ``k``'s row
    adds ``bias`` to ``copy[:, k]`` while drafts ``1 .. k-1`` equal
    ``copy[:, :k-1]``. A copied token outside a reduced draft vocabulary,
    which no row can hold, is drafted from a point mass on it instead (as
    :func:`follow_copy` drafts past the block): its returned row is that
    point mass, and its top log-probability the lowest of the drafter's own
    row.
    """

    copy: mx.array
    bias: mx.array

    def row(
        self, k: int, row: mx.array, prev: mx.array, following: Any, ids: mx.array
    ) -> tuple[mx.array, mx.array, mx.array]:
        copy = self.copy
        if k == 0:
            following = copy[:, 0] >= 0
        else:
            following = following & (prev == copy[:, k - 1])
        hit = following[:, None] & (ids == copy[:, k : k + 1])
        row = row + hit.astype(row.dtype) * self.bias.astype(row.dtype)
        outside = following & (copy[:, k] >= 0) & ~hit.any(axis=-1)
        return row, following, mx.where(outside, copy[:, k], -1)

    def finish(self, proposal: Proposal, rows: mx.array, ids: mx.array) -> Proposal:
        copy = self.copy[:, : proposal.tokens.shape[1]]
        hits, outside = copy_hits(proposal.tokens, copy, ids)
        logits = proposal.logits
        masses = point_mass(copy, logits.shape[-1], logits.dtype)
        logits = mx.where(outside[..., None], masses, logits)
        if proposal.top_logprob is None:
            return replace(proposal, logits=logits)
        own = rows - hits.astype(rows.dtype) * self.bias.astype(rows.dtype)
        top = mx.argmax(rows, axis=-1, keepdims=True)
        own_top = mx.take_along_axis(own, top, axis=-1).squeeze(-1)
        own_top = mx.where(outside, own.min(axis=-1), own_top)
        own_logprob = (own_top - mx.logsumexp(own, axis=-1)).astype(mx.float32)
        return replace(
            proposal,
            logits=logits,
            top_logprob=own_logprob,
            copied=hits.any(axis=-1) | outside,
        )


def copy_hits(
    tokens: mx.array, copy: mx.array, ids: mx.array
) -> tuple[mx.array, mx.array]:
    """Where each draft row carried the copy bias (``[B, n, V]``) and which
    rows were a point mass on a copied token outside the draft vocabulary
    (``[B, n]``), from the drafts and the copied tokens (the rule of
    :meth:`CopyBias.row`)."""
    agree = tokens[:, :-1] == copy[:, :-1]
    following = mx.concatenate([copy[:, :1] >= 0, agree], axis=1)
    following = mx.cumprod(following.astype(mx.int32), axis=1) > 0
    hits = following[..., None] & (ids == copy[..., None])
    return hits, following & (copy >= 0) & ~hits.any(axis=-1)


def follow_copy(proposal: Proposal, copy: mx.array) -> Proposal:
    """``proposal`` extended with the copy's tokens past its drafts, when its
    drafts are the copy's first ones (else unchanged).

    Each added draft is drawn from a point mass on the copied token: its row
    is 0 there and -inf elsewhere, and rejection sampling against it keeps
    the token with the target's probability of it and otherwise draws from
    the target's distribution without it, so sampled output stays exact.
    Whether drafts are added depends on the drafts before them only. Their
    confidences and top log-probabilities are not defined: those arrays keep
    the drafter's length.
    """
    n = proposal.tokens.shape[1]
    if copy.shape[1] <= n or not mx.array_equal(proposal.tokens, copy[:, :n]):
        return proposal
    more = copy[:, n:]
    rows = point_mass(more, proposal.logits.shape[-1], proposal.logits.dtype)
    return replace(
        proposal,
        tokens=mx.concatenate([proposal.tokens, more], axis=1),
        logits=mx.concatenate([proposal.logits, rows], 1),
    )


def copied_proposal(copy: mx.array, vocab_size: int) -> Proposal:
    """Drafts that are a copy ``[1, n]`` as it is, each drawn from a point mass
    on its token as :func:`follow_copy` draws those past the block (so greedy
    keeps the copy as far as the target agrees, and sampling stays exact). No
    drafter runs for them: they have no confidences."""
    tokens = copy.astype(mx.int32)
    return Proposal(tokens, point_mass(tokens, vocab_size, mx.float32))


@dataclass
class CopyProposer:
    """Context copying and the phrase store composed with ``inner``: a
    drafter's proposer (DSpark's or EAGLE-3's), whose rows a copy biases by
    ``bias``, or any other proposer, which copies only extend past its
    drafts or replace (``as_is``).

    ``longest``: drafts at most in a round offered a copy (None: the
    loop's ``num_draft``); past the inner proposer's drafts they are the
    copy's own tokens. ``as_is``: a round whose copy covers all its drafts
    verifies the copy as it is, without running ``inner``. ``phrases``: a
    read-only global store a copy comes from when the context offers none;
    the policy may decline its copies
    (:class:`~mlx_dspark.proposers.base.Offer`), leaving the round to
    ``inner``'s own guesses. ``config``, ``phrase_config``: how copies are
    found in the context and in the store.
    """

    inner: Proposer
    bias: float
    vocab_size: int
    longest: int | None = None
    as_is: bool = False
    phrases: SuffixStore | None = None
    config: SuffixConfig = COPY_CONFIG
    phrase_config: SuffixConfig = PHRASE_CONFIG

    def make_state(self) -> Backlog:
        return Backlog(self.inner.make_state())

    def offer(self, state: Backlog, tokens: list[int], longest: int) -> list[Offer]:
        """A copy from the context, else the store's (declinable); then the
        inner proposer's own guesses."""
        own = Offer(longest)
        length = self.longest or longest
        if length == 0:
            return [own]
        copy, phrased = context_copy(tokens, length, self.config), False
        if copy[0] < 0 and self.phrases is not None:
            found = store_copy(self.phrases, tokens, length, self.phrase_config)
            copy, phrased = found, True
        if copy[0] < 0:
            return [own]
        found = Offer(length, True, phrased, declinable=phrased, payload=copy)
        return [found, own]

    def propose(self, state: Backlog, round: Round) -> Proposal:
        copy = None if round.offer is None else round.offer.payload
        if copy is None:
            proposal = self.inner.propose(state.inner, state.take(round))
            if proposal.top_logprob is None:
                return proposal
            return replace(proposal, copied=mx.zeros(proposal.tokens.shape, mx.bool_))
        found = copy[: round.cap]
        copy = mx.array(found)[None]
        if self.as_is and bool((found >= 0).all()):
            state.skip(round)
            return copied_proposal(copy, self.vocab_size)
        inner_round = state.take(round)
        if isinstance(self.inner, DrafterProposer | ChainProposer):
            block = copy[:, : self.inner.drafter.block_size]
            bias = CopyBias(block, mx.array(self.bias, mx.float32))
            proposal = self.inner.propose(state.inner, inner_round, bias)
        else:
            proposal = self.inner.propose(state.inner, inner_round)
        if round.cap > proposal.tokens.shape[1]:
            mx.eval(proposal.tokens, proposal.confidence)  # one sync for both
            proposal = follow_copy(proposal, copy)
        return proposal

    def tree_source(self, state: Backlog, round: Round):
        """Trees do not copy: the inner proposer's tree rows."""
        return tree_source(self.inner)(state.inner, state.take(round))


# What mlx_dspark.load returns as a pair's drafter: a DSpark (or DFlash)
# drafter, an EAGLE-3 one, a Gemma-4 assistant or an MTP module.
Drafter = DSparkDrafter | Eagle3Drafter | AssistantDrafter | MTPDrafter


def copies(drafter: Drafter) -> bool:
    """Whether a drafter's pair copies from the context (its config's
    ``context_copy_bias``)."""
    return drafter.config.context_copy_bias > 0


def own_proposer(drafter: Drafter) -> Proposer:
    """The drafter's own proposer, without copying."""
    if isinstance(drafter, Eagle3Drafter):
        return Eagle3Proposer(drafter)
    if isinstance(drafter, AssistantDrafter):
        return AssistantProposer(drafter)
    if isinstance(drafter, MTPDrafter):
        return MTPProposer(drafter)
    return DrafterProposer(drafter)


def pair_proposer(
    drafter: Drafter,
    copy_draft: int | None = None,
    copy_as_is: bool = False,
) -> Proposer:
    """The proposer a drafter's pair has: the drafter's own, composed with
    context copying (and the ``phrases.npy`` store loading attached) when its
    config has a copy bias. ``copy_draft`` and ``copy_as_is``: see
    :class:`CopyProposer`'s ``longest`` and ``as_is``."""
    proposer = own_proposer(drafter)
    if not copies(drafter):
        return proposer
    return CopyProposer(
        proposer,
        drafter.config.context_copy_bias,
        drafter.config.vocab_size,
        copy_draft,
        copy_as_is,
        getattr(drafter, "phrase_store", None),
    )


def context_bias(
    drafter: DSparkDrafter, contexts: list[list[int]], n: int
) -> CopyBias | None:
    """The copy bias of requests batched in one draft pass: each context's
    ``n`` copied tokens (no phrase store), or None when the drafter's pair
    does not copy."""
    if not copies(drafter):
        return None
    copy = mx.array(np.stack([context_copy(c, n, COPY_CONFIG) for c in contexts]))
    return CopyBias(copy, mx.array(drafter.config.context_copy_bias, mx.float32))
