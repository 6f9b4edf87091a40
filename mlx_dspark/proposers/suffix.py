"""Suffix drafts: a proposer that needs no drafter.

:class:`SuffixProposer` drafts from what the target has written
(:mod:`~mlx_dspark.proposers.suffix_store`): the request's own index over the
prompt and the output so far, and optionally a global
:class:`~mlx_dspark.proposers.suffix_store.SuffixStore` shared with other
requests. Before each round its :meth:`~SuffixProposer.offer` brings the
request's index up to date with the committed tokens and offers the draft the
index finds, as a copy (``Offer(copy=True)``: the draft policy measures these
rounds' acceptance on their own); with no draft it offers a plain round (an
offer whose cap is 0). A round given a cap verifies the draft's first ``cap``
tokens, each drawn from a point mass on its token
(:func:`~mlx_dspark.proposers.copying.copied_proposal`): greedy keeps the draft as
far as the target agrees, and sampled rounds stay exact samples (a point-mass
draft ``x`` is kept with the target's probability of ``x``, and on rejection
the token is drawn from the target's distribution without ``x``).

With ``tree=True`` the store's best-first tree is offered instead, and
:meth:`~SuffixProposer.propose_tree` returns it as an explicit tree (each node's
row a point mass on its own token) that
:class:`~mlx_dspark.decoding.modes.TreeMode` verifies as it is. The proposer
never reads the target's features.

With a drafter, :class:`SuffixPairProposer` offers the suffix draft first
(declinable: the policy may leave the round to the drafter), verified as it
is without running the drafter, then the drafter's own block; a round the
policy gives neither is a plain step. The drafter's pair's phrase store
(``phrases.npy``, loaded as ``drafter.phrase_store``) is the global part
there, pre-filled and read-only: a draft from it is offered as a phrase-store
copy (``Offer(phrases=True)``), one from the request's index as a context copy,
so the policy measures the two apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from .base import Backlog, Offer, Proposal, Proposer, Round, point_mass
from .copying import Drafter, copied_proposal, own_proposer
from .suffix_store import (
    SuffixConfig,
    SuffixDraft,
    SuffixState,
    SuffixStore,
    best_chain,
)

# Drafts a suffix round may verify at most (the default SuffixConfig's).
SUFFIX_MAX_DRAFT = SuffixConfig().max_draft


def depths(parents: np.ndarray) -> np.ndarray:
    """The depth (1 for a child of the root) of each node of a draft tree
    whose parents come before their children (-1: the root)."""
    out = np.zeros(parents.size, np.int64)
    for i, p in enumerate(parents.tolist()):
        out[i] = 1 if p < 0 else out[p] + 1
    return out


def tree_proposal(draft: SuffixDraft, cap: int, vocab_size: int) -> Proposal:
    """The nodes of ``draft`` at depth ``<= cap`` as an explicit tree: tokens
    ``[1, N]``, each node's row a point mass on its own token, and
    ``extra['parents']`` in :class:`~mlx_dspark.decoding.modes.TreeMode`'s
    numbering (0 is the anchor, proposal node ``i`` is node ``i + 1``).
    Keeping the shallow nodes keeps the tree closed under ancestors."""
    keep = np.flatnonzero(depths(draft.parents) <= cap)
    renumber = {-1: 0, **{int(old): new + 1 for new, old in enumerate(keep)}}
    parents = [renumber[int(draft.parents[i])] for i in keep]
    tokens = mx.array(draft.tokens[keep][None].astype(np.int32))
    rows = point_mass(tokens, vocab_size, mx.float32)
    return Proposal(tokens, rows, None, {"parents": parents, "explicit": True})


@dataclass
class SuffixProposer:
    """Suffix drafts (see the module), chains or (``tree``) trees.

    ``vocab_size``: the target's logits' width (the point-mass rows').
    ``config``: how drafts are found and how long they may be. ``store``: a
    global store shared with other requests (None: the request's own index
    only); a generation's output goes into it live, as a document that
    :meth:`close` finishes. ``tree_budget``: the most nodes of an offered
    tree (TreeMode passes its own budget to :meth:`propose_tree`).
    """

    vocab_size: int
    config: SuffixConfig = field(default_factory=SuffixConfig)
    store: SuffixStore | None = None
    tree: bool = False
    tree_budget: int = SUFFIX_MAX_DRAFT
    _open: list[SuffixState] = field(default_factory=list, repr=False)

    def make_state(self) -> SuffixState:
        state = SuffixState()
        if self.store is not None:
            self._open.append(state)  # until closed
        return state

    def offer(self, state: SuffixState, tokens: list[int], longest: int) -> list[Offer]:
        """The suffix draft of the committed ``tokens`` as a copy, at most
        ``longest`` deep; a plain round when there is none."""
        request = state.sync(tokens, self.store, self.config)
        size = self.tree_budget if self.tree else min(longest, self.config.max_draft)
        draft = request.propose(tree=self.tree, max_tokens=max(0, size))
        if len(draft) == 0 or longest <= 0:
            return [Offer(0)]
        deepest = int(depths(draft.parents).max())
        return [
            Offer(min(longest, deepest), copy=True, payload=draft, source=draft.source)
        ]

    def propose(self, state: SuffixState, round: Round) -> Proposal:
        """The offered draft's first ``round.cap`` tokens, as point masses (a
        tree's deepest root path when a chain is asked for)."""
        draft: SuffixDraft = round.offer.payload
        tokens = chain_of(draft)[: round.cap]
        return copied_proposal(mx.array(tokens[None]), self.vocab_size)

    def propose_tree(self, state: SuffixState, round: Round, budget: int) -> Proposal:
        """The offered tree's first ``budget`` nodes at depth ``<= round.cap``,
        as an explicit tree (see :func:`tree_proposal`)."""
        draft: SuffixDraft = round.offer.payload
        if len(draft) > budget:
            draft = SuffixDraft(
                draft.tokens[:budget],
                draft.parents[:budget],
                draft.probs[:budget],
                draft.match_length,
                draft.source,
            )
        return tree_proposal(draft, round.cap, self.vocab_size)

    def close(self, state: SuffixState, tokens: list[int] | None = None) -> None:
        """Finish the generation's document in the global store (if any),
        after adding what ``tokens`` (every committed token, the prompt's
        included, as :meth:`offer` takes them) holds beyond the last offer.
        Closing twice does nothing."""
        if any(s is state for s in self._open):
            self._open = [s for s in self._open if s is not state]
        if state.request is None:
            return
        if tokens is not None and state.request.doc is not None:
            state.sync(tokens, self.store, self.config)
        state.request.close()

    def close_all(self, tokens: list[int] | None = None) -> None:
        """Close every state made and not closed yet (a generation's one,
        with its ``tokens``)."""
        for state in list(self._open):
            self.close(state, tokens)


def chain_of(draft: SuffixDraft) -> np.ndarray:
    """A chain's tokens; for a tree, those of its deepest root path (the
    first of the deepest nodes, which the store ranks best first)."""
    parents = draft.parents
    if np.array_equal(parents, np.arange(parents.size) - 1):
        return draft.tokens
    node = int(np.argmax(depths(parents)))
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return draft.tokens[path[::-1]]


@dataclass
class PairState:
    """One generation's state of a :class:`SuffixPairProposer`: the
    drafter's (with the features of the rounds it did not draft) and the
    request's suffix index."""

    backlog: Backlog
    suffix: SuffixState = field(default_factory=SuffixState)


@dataclass
class SuffixPairProposer:
    """Suffix drafts and a drafter's block, chosen round by round.

    :meth:`offer` offers the suffix draft of the committed tokens (a chain:
    the request's index's, or ``store``'s when that scores higher), as a
    declinable copy at most as long as the draft, then ``inner``'s own
    block. A round given the suffix draft verifies it as it is, each token
    drawn from a point mass on itself, without running ``inner``, which
    takes that round's features with the next round it drafts. ``store`` is
    read, never written: a generation's output stays in its own index.
    ``longest``: the most drafts of a suffix round (None: the loop's
    ``num_draft``).
    """

    inner: Proposer
    vocab_size: int
    store: SuffixStore | None = None
    config: SuffixConfig = field(default_factory=SuffixConfig)
    longest: int | None = None

    @property
    def phrases(self) -> SuffixStore | None:
        """The global store (the loop asks whether offers may come from one)."""
        return self.store

    def make_state(self) -> PairState:
        return PairState(Backlog(self.inner.make_state()))

    def offer(self, state: PairState, tokens: list[int], longest: int) -> list[Offer]:
        """The suffix draft (declinable), then the drafter's own block."""
        own = Offer(longest)
        request = state.suffix.sync(tokens, None, self.config)
        draft = best_chain(request, self.store, self.longest or longest)
        if len(draft) == 0:
            return [own]
        phrases = draft.source == "global"
        found = Offer(len(draft), True, phrases, declinable=True, payload=draft)
        return [found, own]

    def propose(self, state: PairState, round: Round) -> Proposal:
        draft = None if round.offer is None else round.offer.payload
        if draft is None:
            proposal = self.inner.propose(
                state.backlog.inner, state.backlog.take(round)
            )
            if proposal.top_logprob is None:
                return proposal
            copied = mx.zeros(proposal.tokens.shape, mx.bool_)
            return replace(proposal, copied=copied)
        state.backlog.skip(round)
        tokens = draft.tokens[: round.cap]
        return copied_proposal(mx.array(tokens[None]), self.vocab_size)


def suffix_pair_proposer(drafter: Drafter, longest: int | None = None) -> Proposer:
    """The proposer of a drafter's pair with suffix drafts (see
    :class:`SuffixPairProposer`): the drafter's own block, unbiased (the
    suffix draft verified as it is stands in for the copy bias), and the
    drafter's phrase store as the global part."""
    return SuffixPairProposer(
        own_proposer(drafter),
        drafter.config.vocab_size,
        getattr(drafter, "phrase_store", None),
        longest=longest,
    )
