"""Chain drafting for autoregressive drafters with their own KV cache
(EAGLE-3, :mod:`.eagle3`; multi-token prediction, :mod:`.mtp`).

Such a drafter pairs the target feature of position ``p`` with the token at
``p + 1`` and predicts the token at ``p + 2``; while it drafts, its own output
stands in for the target's feature. Its cache holds committed positions only:
each proposal's own entries are cropped away, and the committed tokens are
then ingested with the target's true features (:meth:`ChainDrafter.extend`).

A drafter using :class:`ChainDrafter` has ``project(features)`` (what the
target's features become before the drafter reads them), ``logits(hidden)``
(its draft-vocabulary rows), ``__call__(hidden, tokens, offset, cache)`` (its
outputs at positions ``offset ..``, appended to ``cache``), ``block_size`` and
the :class:`~mlx_dspark.proposers.vocabulary.DraftVocabulary` methods; its
cache has ``length``, ``hidden`` (the output at the last committed position)
and ``crop(length)``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx

from ..errors import DSparkError
from ..sampling.coupled import TokenKey, mlx_lm_draw
from ..sampling.processing import SamplingParams, processed_logits
from .base import Proposal, Round, RowBias, top_logprob


class ChainDrafter:
    """Ingesting committed positions and drafting a chain (see the module)."""

    def extend(
        self,
        cache: Any,
        features: mx.array,
        next_tokens: mx.array,
        start: int,
    ) -> None:
        """Ingest committed positions ``start .. start + L - 1``: their target
        features ``[1, L, feature_size]`` and the token after each ``[1, L]``.

        Entries past ``start`` (a proposal's, or committed ones ingested
        again) are cropped first. After a
        prefill ``start`` is 0 and ``next_tokens`` are the prompt's tokens
        after the first plus the first generated token; after a round they
        are the accepted drafts and the verifier's token, with the features
        of the rows verifying the anchor and those drafts.
        """
        if features.shape[1] != next_tokens.shape[1]:
            raise ValueError("one feature row per next token is required")
        if start > cache.length:
            raise ValueError(
                f"extension starts at {start} but the draft cache holds {cache.length}"
            )
        cache.crop(start)
        hidden = self(self.project(features), next_tokens, start, cache)
        cache.hidden = hidden[:, -1:]
        cache.length = start + next_tokens.shape[1]

    def draft(
        self,
        cache: Any,
        anchor: mx.array,
        start: int,
        n: int,
        params: SamplingParams,
        key: mx.array | list[TokenKey] | None = None,
        bias: RowBias | None = None,
        stop_ids: Collection[int] = (),
    ) -> Proposal:
        """``n`` drafts after the anchor at position ``start`` (the cache holds
        ``start`` positions and has already seen the anchor as the token after
        the last one). Tokens ``[1, n]`` are target ids; the proposal's rows
        are over the target vocabulary: greedy, the logits; sampled, the
        processed log-weights each draft was drawn from (coupled: mlx-lm's,
        with the token keys in ``key``). ``bias`` is added to each row before
        its draft is drawn (:class:`~mlx_dspark.proposers.base.RowBias`, as
        context copying biases a DSpark drafter's rows). The chain ends at a
        drafted token of ``stop_ids`` (:func:`~mlx_dspark.proposers.base.cut_at_stop`),
        as DeepSpec's evaluator ends it. The cache is cropped back to ``start``.
        """
        if cache.hidden is None or cache.length != start:
            raise ValueError(
                f"drafting at {start} needs a cache of {start} committed positions"
            )
        coupled = isinstance(key, list)
        if params.greedy or coupled:
            keys = key if coupled else [None] * n
        else:
            keys = [None] * n if key is None else list(mx.random.split(key, n))
        draft_params = self._in_draft_vocab(params)
        ids = self.draft_ids()
        hidden, prev, carry = cache.hidden, anchor, None
        tokens, rows, drawn = [], [], []
        for k in range(n):
            row, forced = self.logits(hidden)[:, -1], None
            if bias is not None:
                row, carry, forced = bias.row(k, row, prev, carry, ids)
            if params.greedy:
                token = self.draft_ids_to_target(row)
            elif coupled:
                token, weights = mlx_lm_draw(self.to_target(row), params, keys[k])
                drawn.append(weights)
            else:
                drawn.append(processed_logits(row, draft_params))
                index = mx.random.categorical(drawn[-1], key=keys[k])
                token = self.target_ids(index)
            if forced is not None:
                token = mx.where(forced >= 0, forced, token)
            prev = token = token.astype(mx.int32)
            tokens.append(token)
            rows.append(row)
            if stop_ids and int(token.item()) in stop_ids:
                break
            if k + 1 < n:
                hidden = self(hidden, token[:, None], start + k, cache)
        cache.crop(start)
        tokens, rows = mx.stack(tokens, axis=1), mx.stack(rows, axis=1)
        if params.greedy:
            out = self.to_target(rows)
        elif coupled:
            out = mx.stack(drawn, axis=1)
        else:
            out = self.to_target(mx.stack(drawn, axis=1))
        proposal = Proposal(tokens, out, top_logprob=top_logprob(rows))
        return proposal if bias is None else bias.finish(proposal, rows, ids)


@dataclass
class ChainProposer:
    """A :class:`ChainDrafter` as a :class:`~mlx_dspark.proposers.base.Proposer`:
    each round ingests the newly committed positions (the feature of position
    ``p`` with the token at ``p + 1``, :meth:`~mlx_dspark.proposers.base.Round.following`),
    then drafts autoregressively up to the round's cap (at most the drafter's
    ``block_size``). Chains only: trees refuse it."""

    drafter: Any
    name: ClassVar[str] = "drafter"

    def make_state(self) -> Any:
        return self.drafter.make_cache()

    def propose(
        self, state: Any, round: Round, bias: RowBias | None = None
    ) -> Proposal:
        """The round's chain; ``bias`` on its rows (:class:`RowBias`)."""
        if round.features is not None:
            m = round.features.shape[1]
            following = mx.array([round.following()])
            self.drafter.extend(state, round.features, following, round.start - m)
        if state.length != round.start:
            raise DSparkError(
                f"The {self.name} holds {state.length} positions but the round "
                f"drafts at {round.start}: every committed feature must reach it."
            )
        n = min(round.cap, self.drafter.block_size)
        key = None if round.params.greedy else round.key
        anchor = mx.array([round.anchor])
        params = round.params
        return self.drafter.draft(
            state, anchor, round.start, n, params, key, bias, round.stop_ids
        )
