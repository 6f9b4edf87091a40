"""How a round drafts and verifies: the modes of the one generation loop.

A mode owns the round's target forward and what it commits to the caches:
:class:`ChainMode` verifies a chain of drafts, :class:`TreeMode` a tree.
Acceptance itself is the pure rules of :mod:`mlx_dspark.decoding.verify`.

**Trees.** The drafter's backbone runs once per round; its hidden
states and base logits at block position ``k`` are shared by every node at
depth ``k + 1``. Each node carries its own sequential-head state (the previous
token for the Markov heads, the recurrent state for ``rnn``): expanding a node
runs ``head.step`` on its token and state, and all nodes expanded together go
through one batched ``head.step``. Without a sequential head the children at
depth ``k + 1`` come from the base logits of position ``k``. A reduced draft
vocabulary is scattered into the target's, as in chain drafting.

Nodes are added best-first under a node budget, depth at most the round's cap
(<= block size). Each expanded node ``u`` has an ordered list of candidate
children; adding a node means taking the next candidate of the frontier node
with the highest score:

* greedy: candidates in decreasing draft probability (softmax of the
  TSH-corrected logits); the score is the candidate's cumulative draft
  probability, so the tree is the budget's most probable root paths;
* sampled: candidates are a sample *without replacement* from the processed
  draft distribution ``q_u`` (Gumbel-top-k); the score of ``u`` is its
  cumulative probability times the draft mass not yet drawn at ``u``. The
  decision to add a candidate never looks at the candidate itself, which is
  what the exactness argument below needs.

Expansion is lazy: a node is expanded (batched with every other selected,
unexpanded node) only once its children could outscore the best frontier move.

**Explicit trees.** A proposer may give the tree itself
(``propose_tree``: the suffix store's trees, each node drawn from a point
mass on its token) instead of per-position rows; it is verified the same way,
except that each child is tried against its own row (its token's law given
its earlier siblings: here a point mass, so rejecting child ``c`` leaves the
target's distribution without ``c``), not against a shared row.

**Verification.** One target forward over ``[anchor, nodes...]`` with
per-node positions and an ancestor mask (:meth:`TargetAdapter.tree_forward`).
Greedy keeps the longest root path whose tokens equal the target's argmax at
every step, so output equals target-only greedy decoding. Sampled uses
recursive rejection sampling over each node's children in draw order: with
``p_1 = p`` (target, processed) and ``q_1 = q`` (draft, processed), child
``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; on
rejection ``p_{i+1} = norm(max(p_i - q_i, 0))`` and ``q_{i+1}`` is ``q_i``
with ``x_i`` removed and renormalised; after the last child the token is drawn
from the current ``p``. The accepted path's K/V moves into contiguous cache
slots; the draft context gets the accepted path's features only.

Why it is exact. Given the earlier draws ``x_1..x_{i-1}``, a draw without
replacement ``x_i`` has law ``q`` restricted to the remaining tokens and
renormalised, which is ``q_i``. Whether ``x_i`` exists at all (the node got an
``i``-th child) was decided before ``x_i`` was drawn, so conditioning on its
existence leaves that law unchanged; the same holds for reaching ``u`` at all,
which depends only on earlier draws and independent coins. At step ``i`` the
rejection-sampling lemma then gives: if the continuation after a rejection
yields a sample of ``norm(max(p_i - q_i, 0))``, the step yields a sample of
``p_i``. The continuation is step ``i + 1`` (by induction it yields ``p_{i+1}``)
or, with no children left, a direct draw from ``p_{i+1}``. So each committed
token is an exact sample of the target's processed distribution given the
committed path, and by induction on depth so is the whole sequence. Drawing
siblings without replacement but keeping ``q`` fixed breaks the lemma's
premise ``x_i ~ q_i``; the test suite checks that this variant is caught. For
an explicit tree ``q_i`` is child ``i``'s own row, which is the law of ``x_i``
given the earlier draws by the proposer's contract, so the same argument holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from ..proposers.base import Proposal, Proposer, Round, tree_source
from ..proposers.dspark import DSparkDrafter
from ..sampling.coupled import TokenKeys, mlx_lm_token
from ..sampling.processing import SamplingParams, log_probs, normalised, probabilities
from ..targets.adapter import TargetAdapter
from .verify import Randomness, Verdict, draw, rejection_step, verdict, without


class RoundMode(Protocol):
    """How a round drafts and verifies: a chain (:class:`ChainMode`) or a tree."""

    def propose(self, proposer: Proposer, state: Any, round: Round) -> Proposal:
        """Drafts for one round from ``proposer`` (see
        :mod:`~mlx_dspark.proposers.base`)."""

    def verify(
        self,
        target: TargetAdapter,
        cache: list,
        anchor: int,
        proposal: Proposal,
        n: int,
        params: SamplingParams,
        rng: Randomness,
    ) -> tuple[Verdict, list[int], mx.array]:
        """The verdict, the accepted drafts in order and the features to commit."""


class ChainMode:
    """Verify the first ``n`` drafts of one chain in a single target forward."""

    def propose(self, proposer: Proposer, state: Any, round: Round) -> Proposal:
        """The proposer's chain, its tokens and confidences evaluated."""
        proposal = proposer.propose(state, round)
        # Greedy acceptance never reads the draft logits: leave them lazy.
        logits = () if round.params.greedy else (proposal.logits,)
        mx.eval(proposal.tokens, proposal.confidence, *logits)
        return proposal

    def verify(
        self,
        target: TargetAdapter,
        cache: list,
        anchor: int,
        proposal: Proposal,
        n: int,
        params: SamplingParams,
        rng: Randomness,
    ) -> tuple[Verdict, list[int], mx.array]:
        """Returns the verdict, the drafts verified and the features to commit."""
        drafts = np.array(proposal.tokens[0, :n]).tolist()
        logits, features = target(mx.array([[anchor, *drafts]]), cache)
        mx.eval(logits, features)
        return settle_chain(
            target, cache, drafts, proposal, logits, features, params, rng
        )


def settle_chain(
    target: TargetAdapter,
    cache: list,
    drafts: list[int],
    proposal: Proposal,
    logits: mx.array,
    features: mx.array | None,
    params: SamplingParams,
    rng: Randomness,
) -> tuple[Verdict, list[int], mx.array | None]:
    """Accept from a verified chain, roll the cache back, keep the committed features."""
    n = len(drafts)
    result = verdict(
        np.array(drafts, dtype=np.int64),
        proposal.logits[0, :n],
        logits[0],
        params,
        rng,
    )
    target.rollback(cache, n - result.accepted)
    committed = None if features is None else features[:, : result.accepted + 1]
    return result, drafts, committed


@dataclass
class _Node:
    token: int
    parent: int  # index into the node list; -1 for the root
    depth: int  # 0 for the root (the anchor)
    cum: float  # cumulative draft probability of the root path
    state: mx.array | None = None  # sequential-head state on input
    child_state: mx.array | None = None  # the state its children start from
    row: mx.array | None = None  # its children's row (see Proposal.logits)
    candidates: np.ndarray | None = None
    probs: np.ndarray | None = None  # draft probability of each candidate
    taken: int = 0
    remaining: float = 1.0  # draft mass not yet drawn (sampled mode)
    children: list[int] = field(default_factory=list)


@dataclass
class TreeRound:
    """One verified tree: node count, depth, accepted length and the kept
    path (indices into ``[anchor, verified nodes...]``)."""

    nodes: int
    depth: int
    accepted: int
    path: list[int] = field(default_factory=lambda: [0])


class TreeMode:
    """Draft a token tree of at most ``budget`` nodes and verify it at once."""

    def __init__(self, budget: int, *, force_reference_attention: bool = False):
        self.budget = int(budget)
        self.force_reference_attention = force_reference_attention
        self.rounds: list[TreeRound] = []

    # -- construction -------------------------------------------------------

    def _expand(
        self,
        drafter: DSparkDrafter,
        nodes: list[_Node],
        pending: list[int],
        hidden: mx.array,
        base: mx.array,
        params: SamplingParams,
        key: mx.array,
    ) -> None:
        """Compute the children distributions of ``pending`` in one batch."""
        depth = mx.array([nodes[i].depth for i in pending])
        rows = base[depth]
        head, state = drafter.markov_head, None
        if head is not None:
            prev = mx.array([nodes[i].token for i in pending])
            state = nodes[pending[0]].state
            if state is not None:
                state = mx.stack([nodes[i].state for i in pending])
            state, bias = head.step(state, prev, hidden[depth])
            rows = rows + bias.astype(rows.dtype)
        rows = drafter.to_target(rows)
        if params.greedy:
            logq = rows.astype(mx.float32)
            logq = logq - mx.logsumexp(logq, axis=-1, keepdims=True)
            keys = logq
        else:
            logq = log_probs(rows, params)
            keys = logq + mx.random.gumbel(logq.shape, key=key)
        k = min(self.budget, logq.shape[-1])
        order = mx.argsort(-keys, axis=-1)[:, :k]
        probs = mx.exp(mx.take_along_axis(logq, order, axis=-1))
        mx.eval(rows, order, probs, state)
        order, probs = np.array(order), np.array(probs, dtype=np.float64)
        for j, i in enumerate(pending):
            node = nodes[i]
            node.row = rows[j] if params.greedy else logq[j]
            support = int(np.count_nonzero(probs[j] > 0))
            node.candidates, node.probs = order[j, :support], probs[j, :support]
            node.child_state = None if state is None else state[j]

    def _score(self, node: _Node, greedy: bool) -> float:
        """Score of adding ``node``'s next candidate (-1 when it has none)."""
        if node.candidates is None or node.taken >= len(node.candidates):
            return -1.0
        if greedy:
            return node.cum * node.probs[node.taken]
        return node.cum * node.remaining

    def build(
        self,
        drafter: DSparkDrafter,
        hidden: mx.array,
        anchor: int,
        cap: int,
        params: SamplingParams,
        key: mx.array,
    ) -> tuple[list[_Node], mx.array]:
        """The tree (root first, topological order) and the base logits."""
        base = drafter.logits(hidden[0, :cap])
        head = drafter.markov_head
        state = None if head is None else head.initial_state(())
        nodes = [_Node(anchor, -1, 0, 1.0, state)]
        pending = [0]
        frontier: list[int] = []
        greedy = params.greedy
        while len(nodes) - 1 < self.budget:
            scores = [self._score(nodes[i], greedy) for i in frontier]
            best = max(range(len(frontier)), key=scores.__getitem__, default=None)
            best_score = -1.0 if best is None else scores[best]
            if pending and best_score <= max(nodes[i].cum for i in pending):
                key, wave_key = mx.random.split(key)
                self._expand(drafter, nodes, pending, hidden[0], base, params, wave_key)
                frontier += pending
                pending = []
                continue
            if best is None or best_score <= 0.0:
                break
            parent = nodes[frontier[best]]
            token = int(parent.candidates[parent.taken])
            prob = float(parent.probs[parent.taken])
            parent.taken += 1
            parent.remaining = max(parent.remaining - prob, 0.0)
            child = _Node(
                token,
                frontier[best],
                parent.depth + 1,
                parent.cum * prob,
                parent.child_state,
            )
            parent.children.append(len(nodes))
            nodes.append(child)
            if child.depth < cap:
                pending.append(len(nodes) - 1)
        return nodes, base

    def propose(self, proposer: Proposer, state: Any, round: Round) -> Proposal:
        """A tree as a proposal: ``tokens[0, i]`` is node ``i + 1`` of the
        tree whose node 0 is the anchor; ``logits[0, i]`` the row it was
        drawn from (see :class:`~mlx_dspark.proposers.base.Proposal`);
        ``extra['parents'][i]`` its parent's index.
        Trees do not copy from the context. Given token keys (coupled
        sampling), the tree is drawn with a key split from the first one:
        any tree keeps the output exact, coupled verification commits the
        target's own tokens. The proposer must give per-position rows
        (``tree_source``, as :class:`~mlx_dspark.proposers.dspark.DrafterProposer`
        does), or explicit trees: ``propose_tree(state, round, budget)``
        returning a tree of at most ``budget`` nodes, depth at most
        ``round.cap``, with ``extra['explicit']`` (each node's row is the
        law of its token given its earlier siblings' tokens, a point mass
        for a deterministic tree; see :meth:`verify`), or None to draw the
        round's tree from ``tree_source``."""
        explicit = getattr(proposer, "propose_tree", None)
        if explicit is not None:
            proposal = explicit(state, round, self.budget)
            if proposal is not None:
                logits = () if round.params.greedy else (proposal.logits,)
                mx.eval(proposal.tokens, *logits)
                return proposal
        drafter, hidden = tree_source(proposer)(state, round)
        key = round.key
        if isinstance(key, list):
            key = mx.random.split(key[0][1])[0]
        nodes, base = self.build(
            drafter, hidden, round.anchor, round.cap, round.params, key
        )
        drafts = nodes[1:]
        if not drafts:
            return Proposal(
                mx.zeros((1, 0), mx.int32), mx.zeros((1, 0, base.shape[-1]))
            )
        tokens = mx.array([[n.token for n in drafts]], dtype=mx.int32)
        logits = mx.stack([nodes[n.parent].row for n in drafts])[None]
        parents = [n.parent for n in drafts]
        return Proposal(tokens, logits, None, {"parents": parents})

    # -- verification -------------------------------------------------------

    def rejection_step(
        self, p: np.ndarray, q: np.ndarray, x: int, rng: np.random.Generator
    ) -> tuple[bool, np.ndarray, np.ndarray]:
        """Try sibling ``x``: (accepted, residual target, draft for the next sibling)."""
        kept, rest = rejection_step(p, q, x, rng)
        return kept, rest, q if kept else without(q, x)

    def verify(
        self,
        target: TargetAdapter,
        cache: list,
        anchor: int,
        proposal: Proposal,
        n: int,
        params: SamplingParams,
        rng: Randomness,
    ) -> tuple[Verdict, list[int], mx.array]:
        """Verify every node whose depth is at most ``n`` in one forward."""
        parents = list(proposal.extra.get("parents", ()))
        drafts = np.array(proposal.tokens[0]).tolist()
        # Node 0 is the anchor; proposal node i is node i + 1.
        tree_parents, depths, keep = [-1], [0], [0]
        for i, p in enumerate(parents):
            depth = depths[p] + 1
            depths.append(depth)
            if depth <= n:
                keep.append(i + 1)
        if len(keep) == 1:
            result, _, features = ChainMode().verify(
                target, cache, anchor, proposal, 0, params, rng
            )
            self.rounds.append(TreeRound(0, 0, 0))
            return result, [], features
        index = {old: new for new, old in enumerate(keep)}
        tokens = [anchor] + [drafts[i - 1] for i in keep[1:]]
        tree_parents += [index[parents[i - 1]] for i in keep[1:]]
        children: list[list[int]] = [[] for _ in keep]
        for i in range(1, len(keep)):
            children[tree_parents[i]].append(i)

        start = cache[0].offset
        logits, features = target.tree_forward(
            mx.array([tokens]),
            tree_parents,
            cache,
            force_reference=self.force_reference_attention,
        )
        mx.eval(logits, features)
        if params.greedy:
            path, next_token = self._walk_greedy(logits[0], tokens, children)
        elif isinstance(rng, TokenKeys):
            path, next_token = self._walk_coupled(
                logits[0], tokens, children, params, rng
            )
        else:
            own_rows = bool(proposal.extra.get("explicit", False))
            path, next_token = self._walk_sampled(
                logits[0],
                proposal.logits[0],
                keep,
                tokens,
                children,
                params,
                rng,
                own_rows,
            )
        target.commit_path(cache, start, path)
        self.rounds.append(
            TreeRound(len(keep) - 1, max(depths[i] for i in keep), len(path) - 1, path)
        )
        accepted = [tokens[i] for i in path[1:]]
        if features is not None:
            features = features[:, mx.array(path)]
        return Verdict(len(accepted), next_token), accepted, features

    @staticmethod
    def _walk_greedy(
        logits: mx.array, tokens: list[int], children: list[list[int]]
    ) -> tuple[list[int], int]:
        best = np.array(mx.argmax(logits, axis=-1)).tolist()
        path, u = [0], 0
        while True:
            match = [c for c in children[u] if tokens[c] == best[u]]
            if not match:
                return path, best[u]
            u = match[0]
            path.append(u)

    @staticmethod
    def _walk_coupled(
        logits: mx.array,
        tokens: list[int],
        children: list[list[int]],
        params: SamplingParams,
        keys: TokenKeys,
    ) -> tuple[list[int], int]:
        """Follow the child that is the target's own token (drawn with the
        keys of its depth); uses up the committed tokens' keys."""
        path, u = [0], 0
        while True:
            key = keys.peek(len(path))[-1]
            own = int(mlx_lm_token(logits[u], params, key).item())
            match = [c for c in children[u] if tokens[c] == own]
            if not match:
                keys.take(len(path))
                return path, own
            u = match[0]
            path.append(u)

    def _walk_sampled(
        self,
        logits: mx.array,
        draft_logits: mx.array,
        keep: list[int],
        tokens: list[int],
        children: list[list[int]],
        params: SamplingParams,
        rng: np.random.Generator,
        own_rows: bool = False,
    ) -> tuple[list[int], int]:
        """Recursive rejection over each node's children in order. A drawn
        tree's children were drawn without replacement from one row (their
        first's): after a rejection the next child's law is that row without
        the rejected tokens. ``own_rows`` (an explicit tree): each child's
        own row is already its token's law given the earlier siblings (a
        point mass for a deterministic tree, so a rejected child ``c`` leaves
        the target's distribution without ``c``)."""
        path, u = [0], 0
        while True:
            p = probabilities(logits[u], params)
            if not children[u]:
                return path, draw(p, rng)
            # Every child of u was drawn from the same row, the one of its
            # first child (proposal index keep[c] - 1).
            row = draft_logits[keep[children[u][0]] - 1]
            q = normalised(row)
            for c in children[u]:
                if own_rows:
                    q = normalised(draft_logits[keep[c] - 1])
                accepted, p, q = self.rejection_step(p, q, tokens[c], rng)
                if accepted:
                    u = c
                    path.append(u)
                    break
            else:
                return path, draw(p, rng)
