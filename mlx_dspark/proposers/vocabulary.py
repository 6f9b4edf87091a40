"""The token embedding, LM head and draft vocabulary a drafter (DSpark or
EAGLE-3) has: its own copies or the target's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..sampling.processing import SamplingParams


class DraftVocabulary:
    """Embedding, head and draft-to-target ids of a drafter ``nn.Module``.

    The drafter has ``config`` (``vocab_size``, ``hidden_size``,
    ``output_vocab_size``, ``reduced_vocab``, ``is_gemma4``,
    ``final_logit_softcapping``) and, with a reduced draft vocabulary,
    ``draft_to_target`` (the target id of each draft id)."""

    def init_vocabulary(self) -> None:
        """No shared embedding or head yet, and with a reduced draft
        vocabulary a frozen ``draft_to_target`` (filled in by loading or
        training). Call in ``__init__``."""
        if self.config.reduced_vocab:
            self.draft_to_target = mx.arange(
                self.config.draft_vocab_size, dtype=mx.int32
            )
            self.freeze(keys=["draft_to_target"], recurse=False)
        self._shared_embed: Callable[[mx.array], mx.array] | None = None
        self._shared_head: Callable[[mx.array], mx.array] | None = None

    def own_embeddings(self, embed: bool = True, head: bool = True) -> None:
        """Give the drafter its own embedding and/or LM head (checkpoint copies).

        With a reduced draft vocabulary the LM head has ``draft_vocab_size`` rows.
        """
        c = self.config
        if embed:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
            self._shared_embed = None
        if head:
            self.lm_head = nn.Linear(c.hidden_size, c.output_vocab_size, bias=False)
            self._shared_head = None

    def share_embeddings(
        self,
        embed: Callable[[mx.array], mx.array] | None,
        lm_head: Callable[[mx.array], mx.array] | None,
    ) -> None:
        """Use the target's embedding and/or LM head instead of a second copy
        (``None`` leaves that part as it is)."""
        if lm_head is not None and self.config.reduced_vocab:
            raise ValueError("a reduced-vocabulary drafter needs its own LM head")
        for name, shared in (("embed_tokens", embed), ("lm_head", lm_head)):
            if shared is not None and name in self:
                del self[name]
        if embed is not None:
            self._shared_embed = embed
        if lm_head is not None:
            self._shared_head = lm_head

    @property
    def shares_embeddings(self) -> bool:
        return self._shared_embed is not None

    def embed(self, tokens: mx.array) -> mx.array:
        """Token embeddings (target ids); Gemma-4 scales them by
        ``sqrt(hidden_size)`` (in their dtype, as its scaled embedding does)."""
        if self._shared_embed is None:
            h = self.embed_tokens(tokens)
        else:
            h = self._shared_embed(tokens)
        if self.config.is_gemma4:
            h = h * mx.array(self.config.hidden_size**0.5, dtype=h.dtype)
        return h

    def head(self, hidden: mx.array) -> mx.array:
        """Logits over the drafter's output vocabulary (see :meth:`to_target`).

        Gemma-4 soft-caps them with ``final_logit_softcapping``; a head shared
        with a Gemma-4 target is the target's, which caps them already."""
        if self._shared_head is not None:
            return self._shared_head(hidden)
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if self.config.is_gemma4 and cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def to_target(self, logits: mx.array) -> mx.array:
        """Scatter draft-vocabulary logits into the target vocabulary.

        Target tokens outside a reduced draft vocabulary get ``-inf`` (draft
        probability 0), so drafts, acceptance and residuals all work in target
        ids. The identity for a full-vocabulary drafter.
        """
        if not self.config.reduced_vocab:
            return logits
        shape = (*logits.shape[:-1], self.config.vocab_size)
        full = mx.full(shape, -mx.inf, dtype=logits.dtype)
        index = mx.broadcast_to(self.draft_to_target, logits.shape)
        return mx.put_along_axis(full, index, logits, axis=-1)

    def draft_ids(self) -> mx.array:
        """The target id of every row of the drafter's output vocabulary."""
        if self.config.reduced_vocab:
            return self.draft_to_target
        return mx.arange(self.config.output_vocab_size, dtype=mx.int32)

    def target_ids(self, draft_ids: mx.array) -> mx.array:
        """The target ids of draft-vocabulary ids."""
        if not self.config.reduced_vocab:
            return draft_ids
        return self.draft_to_target[draft_ids]

    def draft_ids_to_target(self, draft_logits: mx.array) -> mx.array:
        """Greedy target ids from draft-vocabulary rows without full rows.

        Equal to ``argmax(to_target(draft_logits))``: among the maxima the
        smallest target id wins, as ``argmax`` over the full row picks it.
        """
        if not self.config.reduced_vocab:
            return mx.argmax(draft_logits, axis=-1)
        best = draft_logits.max(axis=-1, keepdims=True)
        ids = mx.where(
            draft_logits == best, self.draft_to_target, self.config.vocab_size
        )
        return ids.min(axis=-1)

    def _in_draft_vocab(self, params: SamplingParams) -> SamplingParams:
        """``params`` for processing draft-vocabulary rows: XTC's special
        tokens as draft positions.

        Sampled drafts are drawn from their short rows processed (a top-p sort
        over 4,096 tokens instead of 49,152); tokens outside the draft
        vocabulary have probability 0 either way, and the drafts are verified
        against these very weights, so sampling stays exact.
        """
        special = params.xtc_special_tokens
        if not (self.config.reduced_vocab and special):
            return params
        inside = np.flatnonzero(np.isin(np.array(self.draft_to_target), special))
        return replace(params, xtc_special_tokens=tuple(inside.tolist()))
