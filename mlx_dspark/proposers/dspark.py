"""The DSpark drafter: a parallel draft backbone plus its small heads.

The backbone sees one block ``[anchor, mask, ..., mask]`` at absolute
positions ``start ..``; every layer attends, without a causal mask, to the
block and to the projected target features of the committed tokens. The
context keys/values are cached (committed tokens only); the block's own are
recomputed each round and never stored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.rope_utils import initialize_rope

from ..sampling.coupled import TokenKey, mlx_lm_draw
from ..sampling.processing import SamplingParams, processed_logits
from .base import Proposal, Round, RowBias, top_logprob
from .dspark_config import DraftConfig
from .dspark_heads import ConfidenceHead, build_markov_head
from .vocabulary import DraftVocabulary


@dataclass
class DraftCache:
    """Per-layer context keys/values of the committed tokens."""

    keys: list[mx.array | None]
    values: list[mx.array | None]
    length: int = 0

    def copy(self) -> DraftCache:
        """A copy that later rounds can change without changing this one."""
        return replace(self, keys=list(self.keys), values=list(self.values))

    def arrays(self) -> list[mx.array]:
        return [a for a in (*self.keys, *self.values) if a is not None]

    def extend(self, layer: int, keys: mx.array, values: mx.array) -> None:
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = keys, values
        else:
            self.keys[layer] = mx.concatenate([self.keys[layer], keys], axis=2)
            self.values[layer] = mx.concatenate([self.values[layer], values], axis=2)


class DraftAttention(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        dim, head_dim = config.hidden_size, config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.scale = head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.rope = initialize_rope(
            head_dim,
            base=config.rope_theta,
            traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )

    def _heads(self, x: mx.array, n_heads: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n_heads, -1).transpose(0, 2, 1, 3)

    def key_values(self, x: mx.array, offset) -> tuple[mx.array, mx.array]:
        keys = self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads))
        values = self._heads(self.v_proj(x), self.n_kv_heads)
        return self.rope(keys, offset=offset), values

    def __call__(
        self,
        x: mx.array,
        offset,
        context_keys: mx.array | None,
        context_values: mx.array | None,
        mask: mx.array | None = None,
    ) -> mx.array:
        B, L, _ = x.shape
        queries = self.rope(
            self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=offset
        )
        keys, values = self.key_values(x, offset)
        if context_keys is not None:
            keys = mx.concatenate([context_keys, keys], axis=2)
            values = mx.concatenate([context_values, values], axis=2)
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=mask
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DraftMLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DraftLayer(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = DraftMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )

    def __call__(self, x, offset, context_keys, context_values, mask=None):
        h = x + self.self_attn(
            self.input_layernorm(x), offset, context_keys, context_values, mask
        )
        return h + self.mlp(self.post_attention_layernorm(h))


class Gemma4DraftAttention(DraftAttention):
    """DeepSpec's Gemma-4 draft attention: ``global_head_dim`` heads, RMS-normed
    queries and keys, values normed without a scale, K = V (before their
    norms) when ``attention_k_eq_v``, the target's full-attention RoPE and an
    attention scale of 1."""

    def __init__(self, config: DraftConfig):
        nn.Module.__init__(self)
        dim, head_dim = config.hidden_size, config.global_head_dim
        self.n_heads = config.num_attention_heads
        self.k_eq_v = bool(config.attention_k_eq_v)
        self.n_kv_heads = (
            config.num_global_key_value_heads
            if self.k_eq_v
            else config.num_key_value_heads
        )
        self.scale = 1.0
        self.eps = config.rms_norm_eps
        bias = config.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        if not self.k_eq_v:
            self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        full = (config.rope_parameters or {}).get("full_attention", {})
        self.rope = initialize_rope(
            head_dim,
            base=full.get("rope_theta", config.rope_theta),
            traditional=False,
            scaling_config=full,
            max_position_embeddings=config.max_position_embeddings,
        )

    def key_values(self, x: mx.array, offset) -> tuple[mx.array, mx.array]:
        keys = self._heads(self.k_proj(x), self.n_kv_heads)
        values = keys if self.k_eq_v else self._heads(self.v_proj(x), self.n_kv_heads)
        values = mx.fast.rms_norm(values, None, self.eps)
        return self.rope(self.k_norm(keys), offset=offset), values


class Gemma4DraftMLP(DraftMLP):
    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class Gemma4DraftLayer(nn.Module):
    """Gemma-4's sandwich-normed block: each branch is normed before and
    after, and the layer output is multiplied by ``layer_scalar``."""

    def __init__(self, config: DraftConfig, index: int):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4DraftAttention(config)
        # Gemma-4's rule for double-width MLPs (KV-shared layers), as the
        # target's text config carries over to the drafter.
        first_shared = config.num_hidden_layers - config.num_kv_shared_layers
        wide = config.use_double_wide_mlp and index >= first_shared > 0
        self.mlp = Gemma4DraftMLP(d, config.intermediate_size * (2 if wide else 1))
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(d, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x, offset, context_keys, context_values, mask=None):
        h = self.self_attn(
            self.input_layernorm(x), offset, context_keys, context_values, mask
        )
        h = x + self.post_attention_layernorm(h)
        h = h + self.post_feedforward_layernorm(
            self.mlp(self.pre_feedforward_layernorm(h))
        )
        return h * self.layer_scalar


class DSparkDrafter(DraftVocabulary, nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        if config.is_gemma4:
            self.layers = [
                Gemma4DraftLayer(config, i) for i in range(config.num_hidden_layers)
            ]
        else:
            self.layers = [DraftLayer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.markov_head = build_markov_head(config)
        if config.enable_confidence_head:
            self.confidence_head = ConfidenceHead(config.confidence_input_dim)
        else:
            self.confidence_head = None
        self.init_vocabulary()
        self._compiled_chain: dict[type, Callable] | None = None
        # The default policy of this drafter's last generation, whose
        # measurements (costs, acceptance) the next generation starts from.
        self.policy_memory = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def logits(self, hidden: mx.array) -> mx.array:
        """Base logits over the drafter's output vocabulary (see ``to_target``)."""
        return self.head(hidden)

    def make_cache(self) -> DraftCache:
        n = len(self.layers)
        return DraftCache([None] * n, [None] * n)

    def block_tokens(self, anchor: mx.array) -> mx.array:
        """``[anchor, mask, ..., mask]`` for a batch of anchors ``[B]``."""
        masks = mx.full(
            (anchor.shape[0], self.block_size - 1), self.config.mask_token_id
        )
        return mx.concatenate(
            [anchor[:, None].astype(mx.int32), masks.astype(mx.int32)], axis=1
        )

    def __call__(
        self,
        block: mx.array,
        start: int,
        context: mx.array | None,
        cache: DraftCache,
    ) -> mx.array:
        """Backbone hidden states of ``block`` (positions ``start ..``).

        ``context`` holds the target features of the committed tokens the
        cache has not seen yet; they are projected, cached and attended to.
        """
        h = self.embed(block)
        self._ingest(start, context, cache)
        for i, layer in enumerate(self.layers):
            h = layer(h, start, cache.keys[i], cache.values[i])
        return self.norm(h)

    def _ingest(self, start: int, context: mx.array | None, cache: DraftCache) -> None:
        """Project and cache the features of the committed tokens before ``start``."""
        if context is not None and context.shape[1] > 0:
            offset = start - context.shape[1]
            if offset != cache.length:
                raise ValueError(
                    f"context starts at {offset} but the draft cache holds {cache.length}"
                )
            projected = self.hidden_norm(self.fc(context))
            for i, layer in enumerate(self.layers):
                cache.extend(i, *layer.self_attn.key_values(projected, offset))
            cache.length = start

    def forward_batch(
        self,
        blocks: mx.array,
        starts: Sequence[int],
        contexts: Sequence[mx.array | None],
        caches: Sequence[DraftCache],
    ) -> mx.array:
        """:meth:`__call__` for B requests in one backbone pass: ``blocks`` is
        ``[B, block]``, and request r has its own position ``starts[r]``,
        unseen ``contexts[r]`` and cache ``caches[r]``.

        Each request's cached context is left-padded to the longest and a
        mask hides the padding; RoPE takes one offset per row, so every row
        equals that request's own :meth:`__call__`.
        """
        for start, context, cache in zip(starts, contexts, caches, strict=True):
            self._ingest(start, context, cache)
        lengths = [c.length for c in caches]
        longest = max(lengths)
        width = blocks.shape[1]
        columns = mx.arange(longest + width)[None, :]
        pads = mx.array([longest - n for n in lengths])[:, None]
        mask = (columns >= pads)[:, None, None, :]
        offsets = mx.array([int(s) for s in starts])
        h = self.embed(blocks)
        for i, layer in enumerate(self.layers):
            keys, values = [], []
            for cache in caches:
                k, v = cache.keys[i], cache.values[i]
                if k is None:
                    raise ValueError("every request needs committed context")
                pad = [(0, 0), (0, 0), (longest - k.shape[2], 0), (0, 0)]
                keys.append(mx.pad(k, pad))
                values.append(mx.pad(v, pad))
            h = layer(
                h,
                offsets,
                mx.concatenate(keys, axis=0),
                mx.concatenate(values, axis=0),
                mask,
            )
        return self.norm(h)

    def confidence(self, hidden: mx.array, prev_tokens: mx.array) -> mx.array | None:
        """Raw confidence logits from hidden states and the previous tokens."""
        if self.confidence_head is None:
            return None
        if self.config.confidence_head_with_markov:
            prev = self.markov_head.prev_embeddings(prev_tokens).astype(hidden.dtype)
            hidden = mx.concatenate([hidden, prev], axis=-1)
        return self.confidence_head(hidden).astype(mx.float32)

    def propose(
        self,
        hidden: mx.array,
        anchor: mx.array,
        n: int,
        params: SamplingParams,
        key: mx.array | list[TokenKey] | None,
        *,
        confidence: bool = True,
        bias: RowBias | None = None,
    ) -> Proposal:
        """Sample ``n`` drafts left to right through the sequential head.

        ``key``: one key the drafts' keys are split from, or (coupled
        sampling, one request) the token keys of the ``n`` positions drafted
        (:class:`~mlx_dspark.sampling.coupled.TokenKeys`): draft ``k`` is then the
        token mlx-lm would sample from the drafter's row ``k`` with those
        keys, over the full target vocabulary, so it is the target's own
        token wherever the two rows are close.

        ``hidden`` is ``[B, block, d]``; ``anchor`` is ``[B]``. The returned
        rows are those the drafts were drawn from (see :class:`Proposal`),
        over the target vocabulary (a reduced draft vocabulary is scattered
        into it). Greedy drafts are taken from the draft-vocabulary rows
        directly, so their full-vocabulary logits are left unevaluated until
        a consumer reads them. ``confidence=False`` skips the confidence head
        and the top log-probabilities the calibration reads beside it.
        ``bias`` is added to the rows after the sequential head's
        (:class:`RowBias`).
        """
        hidden = hidden[:, :n]
        base = self.logits(hidden)
        coupled = isinstance(key, list)
        if self.markov_head is None and bias is None and not coupled:
            rows = base
            if params.greedy:
                tokens = self.draft_ids_to_target(base)
            else:
                drawn = processed_logits(base, self._in_draft_vocab(params))
                tokens = self._draw(drawn, key)
        elif params.greedy:
            tokens, rows = self._greedy_chain(base, hidden, anchor, bias)
        else:
            if coupled:
                keys = key
            else:
                keys = [None] * n if key is None else list(mx.random.split(key, n))
            draft_params = self._in_draft_vocab(params)
            state = self._head_state(anchor)
            prev, carry, tokens, rows, drawn = anchor, None, [], [], []
            for k in range(n):
                state, row, carry, forced = self._draft_row(
                    base, hidden, k, state, prev, bias, carry
                )
                if coupled:
                    prev, weights = mlx_lm_draw(self.to_target(row), params, keys[k])
                    drawn.append(weights)
                else:
                    drawn.append(processed_logits(row, draft_params))
                    prev = self._draw(drawn[-1], keys[k])
                if forced is not None:
                    prev = mx.where(forced >= 0, forced, prev)
                tokens.append(prev)
                rows.append(row)
            tokens, rows = mx.stack(tokens, axis=1), mx.stack(rows, axis=1)
            drawn = mx.stack(drawn, axis=1)
        if coupled:
            corrected = drawn  # already over the target vocabulary
        else:
            corrected = self.to_target(rows if params.greedy else drawn)
        proposal = Proposal(tokens, corrected)
        if confidence:
            proposal.confidence = self.chain_confidence(hidden, anchor, tokens)
            proposal.top_logprob = top_logprob(rows)
        if bias is not None:
            proposal = bias.finish(proposal, rows, self.draft_ids())
        return proposal

    def _draw(self, weights: mx.array, key: mx.array | None) -> mx.array:
        """A target id per row of draft-vocabulary log-weights."""
        return self.target_ids(mx.random.categorical(weights, key=key))

    def _head_state(self, anchor: mx.array) -> mx.array | None:
        head = self.markov_head
        return None if head is None else head.initial_state(anchor.shape)

    def _draft_row(
        self,
        base: mx.array,
        hidden: mx.array,
        k: int,
        state: mx.array | None,
        prev: mx.array,
        bias: RowBias | None,
        carry,
    ) -> tuple[mx.array | None, mx.array, object, mx.array | None]:
        """Draft ``k``'s draft-vocabulary row after ``prev``: the backbone's
        logits, the sequential head's bias and ``bias``'s; with the head's
        state and ``bias``'s carry and forced tokens (:class:`RowBias`)."""
        row = base[:, k]
        if self.markov_head is not None:
            state, head_bias = self.markov_head.step(state, prev, hidden[:, k])
            row = row + head_bias.astype(row.dtype)
        forced = None
        if bias is not None:
            row, carry, forced = bias.row(k, row, prev, carry, self.draft_ids())
        return state, row, carry, forced

    def greedy_chain(
        self,
        base: mx.array,
        hidden: mx.array,
        anchor: mx.array,
        bias: RowBias | None = None,
    ) -> tuple[mx.array, mx.array]:
        """Greedy drafts through the sequential head: ``(tokens, corrected rows)``.

        ``base`` holds the backbone's draft-vocabulary logits ``[B, n, V]``; the
        corrected rows stay in the draft vocabulary. ``bias`` as in
        :meth:`propose`.
        """
        state = self._head_state(anchor)
        prev, carry, tokens, rows = anchor, None, [], []
        for k in range(base.shape[1]):
            state, row, carry, forced = self._draft_row(
                base, hidden, k, state, prev, bias, carry
            )
            prev = self.draft_ids_to_target(row)
            if forced is not None:
                prev = mx.where(forced >= 0, forced, prev)
            tokens.append(prev)
            rows.append(row)
        return mx.stack(tokens, axis=1), mx.stack(rows, axis=1)

    def _greedy_chain(
        self,
        base: mx.array,
        hidden: mx.array,
        anchor: mx.array,
        bias: RowBias | None,
    ) -> tuple[mx.array, mx.array]:
        """:meth:`greedy_chain`, compiled (one graph per kind of bias) after
        :meth:`compile_greedy_chain`."""
        if self._compiled_chain is None:
            return self.greedy_chain(base, hidden, anchor, bias)
        kind = type(bias)
        if kind not in self._compiled_chain:

            def chain(base, hidden, anchor, values):
                made = None if values is None else kind(*values)
                return self.greedy_chain(base, hidden, anchor, made)

            self._compiled_chain[kind] = mx.compile(chain, inputs=self.state)
        values = None
        if bias is not None:
            values = [getattr(bias, f.name) for f in fields(bias)]
        return self._compiled_chain[kind](base, hidden, anchor, values)

    def compile_greedy_chain(self, enabled: bool = True) -> None:
        """Run :meth:`greedy_chain` as one ``mx.compile``d graph (one trace per
        draft length and kind of bias); the drafts are identical either way.
        The drafter's arrays are the graph's inputs, so later weight updates
        are seen."""
        self._compiled_chain = {} if enabled else None

    def chain_confidence(
        self, hidden: mx.array, anchor: mx.array, tokens: mx.array
    ) -> mx.array | None:
        """Raw confidence logits of a chain of drafts ``tokens`` after ``anchor``."""
        prev_tokens = mx.concatenate([anchor[:, None], tokens[:, :-1]], axis=1)
        return self.confidence(hidden[:, : tokens.shape[1]], prev_tokens)


@dataclass
class DrafterProposer:
    """The DSpark drafter as a :class:`~mlx_dspark.proposers.base.Proposer`: one
    backbone pass over ``[anchor, mask, ...]`` (ingesting the round's
    features into its cache, its state), then at most a block of drafts
    through the sequential head. A DFlash model is a drafter without Markov
    and confidence heads."""

    drafter: DSparkDrafter

    def make_state(self) -> DraftCache:
        return self.drafter.make_cache()

    def tree_source(
        self, state: DraftCache, round: Round
    ) -> tuple[DSparkDrafter, mx.array]:
        """The drafter and its backbone's hidden states ``[1, block, d]``,
        from which a tree's per-position rows come."""
        anchor = mx.array([round.anchor])
        block = self.drafter.block_tokens(anchor)
        return self.drafter, self.drafter(block, round.start, round.features, state)

    def propose(
        self, state: DraftCache, round: Round, bias: RowBias | None = None
    ) -> Proposal:
        """The round's chain; ``bias`` on its rows (:class:`RowBias`)."""
        _, hidden = self.tree_source(state, round)
        n = min(round.cap, hidden.shape[1])
        key = None if round.params.greedy else round.key
        anchor = mx.array([round.anchor])
        return self.drafter.propose(hidden, anchor, n, round.params, key, bias=bias)
