"""Proposers: whatever proposes a round's drafts to the one generation loop.

A proposer turns what the target committed into a :class:`Proposal`; the
loop (:func:`~mlx_dspark.decoding.loop.speculative_generate_step`) verifies it, and
neither knows how the other works. The DSpark drafter (parallel block plus
sequential head; a DFlash model is one without Markov and confidence heads)
is :class:`~mlx_dspark.proposers.dspark.DrafterProposer`; context copying and the
phrase store compose with it (:class:`~mlx_dspark.proposers.copying.CopyProposer`).

**The contract.** :meth:`Proposer.make_state` makes one generation's state
(its caches); each drafted round the loop calls :meth:`Proposer.propose`
with that state and a :class:`Round`:

* ``round.features`` ``[1, m, D]``: the target's tapped features (its
  ``target_layer_ids`` outputs, concatenated) of positions
  ``start - m .. start - 1``: every position committed since this proposer's
  previous ``propose`` (the whole prompt at the first), plain rounds
  included. Each position arrives exactly once.
* ``round.tokens``: every committed token, the prompt's first; the last is
  the anchor, at position ``round.start`` (the loop's own list: read it
  during the call, do not keep it). The feature of position ``p``
  goes with the token at ``p + 1`` (:meth:`Round.following`: the ``m``
  tokens after the ``m`` features, the anchor last), which is what an
  autoregressive drafter such as EAGLE-3 pairs with it.
* ``round.cap`` (>= 1), ``round.params``, ``round.key``: the most drafts to
  propose, the sampling parameters, and the draw's randomness (not
  used when greedy): one MLX key to split, or (coupled sampling) one
  :data:`~mlx_dspark.sampling.coupled.TokenKey` per draft position, with which draft
  ``k`` is :func:`~mlx_dspark.sampling.coupled.mlx_lm_draw` from its row so that it
  is the target's own token wherever the two rows agree.

It returns a chain: ``tokens`` ``[1, n]`` with ``1 <= n <= cap`` (fewer is
fine) and ``logits`` ``[1, n, V]`` over the target vocabulary, the rows the
drafts were drawn from (greedy: any logits whose argmax is the draft;
sampled: the processed log-weights, :func:`~mlx_dspark.sampling.processing.processed_logits`,
that verification reads as the draft distribution ``q``; exactness rests on
the drafts really being drawn from them). ``confidence``, ``top_logprob``
and ``copied`` are optional (schedulers and calibration read them).

Whatever the state holds for positions ``>= start - m`` (an autoregressive
drafter's K/V of last round's drafts) is stale: the target may have
rejected those drafts. Trim it before taking the new features. The loop
verifies the first ``policy.draft_length`` drafts and never calls the
proposer between rounds, so a proposer need not hear about the verdict.

Tree rounds (:class:`~mlx_dspark.decoding.modes.TreeMode`) need the per-position
rows of one backbone pass: a proposer that offers them has ``tree_source``
(see :class:`~mlx_dspark.proposers.dspark.DrafterProposer`); or the tree itself:
a proposer with ``propose_tree(state, round, budget)`` returns one (see
:meth:`TreeMode.propose <mlx_dspark.decoding.modes.TreeMode.propose>`,
:class:`~mlx_dspark.proposers.suffix.SuffixProposer`).

A proposer may also have ``offer(state, tokens, longest) -> list[Offer]``:
what it could propose the coming round before anything is drafted, best
first, which the draft policy picks among (:class:`Offer`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import mlx.core as mx

from ..errors import DSparkError
from ..sampling.coupled import TokenKey
from ..sampling.processing import SamplingParams


@dataclass
class Proposal:
    """Draft tokens for one round with the distributions they were drawn from.

    ``logits`` holds one row over the target vocabulary per draft: greedy,
    the TSH-corrected logits it was taken from; sampled, the processed
    log-weights (:func:`~mlx_dspark.sampling.processing.processed_logits`, unnormalised)
    it was drawn from, which verification reads as they are.
    ``top_logprob[:, k]`` is the proposer's own log-probability (before any
    :class:`RowBias` and sampling temperature) of the most likely token of
    draft ``k``'s row: without a bias, the largest log-probability of that
    row. ``copied[:, k]`` says whether row ``k`` carried a copy's bias
    (:mod:`~mlx_dspark.proposers.copying`). Both describe draft ``k``'s distribution,
    not the token drawn from it, so a scheduler may read them before deciding
    to verify draft ``k``.
    """

    tokens: mx.array
    logits: mx.array
    confidence: mx.array | None = None
    extra: dict = field(default_factory=dict)
    top_logprob: mx.array | None = None
    copied: mx.array | None = None


def top_logprob(logits: mx.array) -> mx.array:
    """The largest log-probability of each row's softmax, in float32."""
    logits = logits.astype(mx.float32)
    return logits.max(axis=-1) - mx.logsumexp(logits, axis=-1)


def point_mass(tokens: mx.array, vocab_size: int, dtype: mx.Dtype) -> mx.array:
    """Logit rows ``[..., vocab_size]`` that put all the mass on ``tokens``:
    0 there and -inf elsewhere."""
    rows = mx.where(mx.arange(vocab_size) == tokens[..., None], 0.0, -mx.inf)
    return rows.astype(dtype)


class RowBias(Protocol):
    """Something a caller adds to a drafter's rows, left to right, that may
    depend on the drafts before each row (context copying adds one,
    :class:`~mlx_dspark.proposers.copying.CopyBias`).

    Its dataclass fields are arrays (or None): a compiled greedy chain takes
    them as inputs and rebuilds the bias with ``type(bias)(*fields)``, so
    one trace serves every value. ``ids`` is the target id of each column of
    the drafter's rows.
    """

    def row(
        self, k: int, row: mx.array, prev: mx.array, carry: Any, ids: mx.array
    ) -> tuple[mx.array, Any, mx.array | None]:
        """Row ``k`` ``[B, V]`` after the drafts so far (``prev``: draft
        ``k - 1``, the anchor for ``k == 0``; ``carry``: what the previous
        call returned, None for row 0): the biased row, the carry for row
        ``k + 1``, and None or ``[B]`` target ids that draft ``k`` must be
        (-1: drawn from the row as usual)."""

    def finish(self, proposal: Proposal, rows: mx.array, ids: mx.array) -> Proposal:
        """The proposal of drafts drawn from the biased ``rows`` (drafter
        vocabulary), its ``logits`` over the target vocabulary; fills in what
        the bias changes (forced drafts' rows, ``top_logprob``, ``copied``)."""


@dataclass
class Offer:
    """One kind of round a proposer could draft next, known before drafting.

    ``longest``: the most drafts such a round may verify. ``copy`` and
    ``phrases`` are the kind, as the draft policy's ``round_cap`` and the
    round's stats name it (a copy from the context, one from the phrase
    store; neither: the proposer's own guesses). ``payload`` is the
    proposer's own (what it found); ``source`` a word on where the draft
    comes from, which the round's stats keep (the suffix proposer's
    ``"request"`` or ``"global"``). When the policy gives an offer a cap of
    0 the round is plain, unless ``declinable``: then the next offer is
    asked.
    """

    longest: int
    copy: bool = False
    phrases: bool = False
    declinable: bool = False
    payload: Any = None
    source: str = ""


@dataclass
class Round:
    """What a proposer is given for one round (see the module's contract)."""

    tokens: list[int]
    features: mx.array | None
    cap: int
    params: SamplingParams
    key: mx.array | list[TokenKey] | None
    offer: Offer | None = None
    # The tokens that end the generation (the tokenizer's end of sequence):
    # a chain past one of them is never kept (:func:`cut_at_stop`).
    stop_ids: frozenset[int] = frozenset()
    # The target's attention keys/values of the committed positions before
    # the anchor, per layer kind, for a proposer that attends to them (the
    # Gemma-4 assistant); asked for only by such a proposer.
    target_kv: Callable[[], dict] | None = None

    @property
    def start(self) -> int:
        """The anchor's position."""
        return len(self.tokens) - 1

    @property
    def anchor(self) -> int:
        return self.tokens[-1]

    def following(self) -> list[int]:
        """The token after each of ``features``' positions; the anchor last."""
        m = 0 if self.features is None else self.features.shape[1]
        return self.tokens[len(self.tokens) - m :]


class Proposer(Protocol):
    """Whatever proposes a round's drafts (see the module's contract)."""

    def make_state(self) -> Any:
        """One generation's state (caches); passed back to every call."""

    def propose(self, state: Any, round: Round) -> Proposal:
        """A chain of at most ``round.cap`` drafts after ``round.anchor``."""


def cut_at_stop(tokens: Sequence[int] | mx.array, stop_ids: Collection[int]) -> int:
    """How many of a chain's drafts to keep: up to and including the first
    stop token (a draft after it can only be rejected or thrown away, as the
    generation ends there), all of them when there is none. DeepSpec's
    EAGLE-3 evaluator ends its chains there."""
    if isinstance(tokens, mx.array):
        tokens = tokens.reshape(-1).tolist()
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return i + 1
    return len(tokens)


def tree_source(proposer: Proposer) -> Callable[[Any, Round], tuple[Any, mx.array]]:
    """The proposer's ``tree_source`` (a tree's per-position rows), or one
    sentence saying that it proposes chains only."""
    source = getattr(proposer, "tree_source", None)
    if source is None:
        raise DSparkError(
            f"Tree drafting needs a proposer with per-position draft rows "
            f"(the DSpark drafter); {type(proposer).__name__} proposes "
            "chains only."
        )
    return source


@dataclass
class Backlog:
    """A composed proposer's state for one inner proposer: the inner one's
    state, and the features of the rounds it was not asked to propose (a
    copy verified as it is, another proposer's turn), which it is given with
    the next round it proposes."""

    inner: Any
    pending: list = field(default_factory=list)

    def skip(self, round: Round) -> None:
        """Keep ``round``'s features for the next :meth:`take`."""
        if round.features is not None:
            self.pending.append(round.features)

    def take(self, round: Round) -> Round:
        """``round`` with every feature the inner proposer has not seen."""
        self.skip(round)
        pending, self.pending = self.pending, []
        return replace(round, features=joined(pending))


def joined(features: list[mx.array]) -> mx.array | None:
    """Feature chunks ``[1, m_i, D]`` of consecutive positions as one array
    (None for none: a target that taps no features gives None chunks)."""
    features = [f for f in features if f is not None]
    if not features:
        return None
    return features[0] if len(features) == 1 else mx.concatenate(features, 1)
