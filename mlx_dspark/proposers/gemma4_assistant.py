"""The Gemma-4 assistant drafter (Hugging Face's ``Gemma4AssistantForCausalLM``,
the ``*-assistant`` checkpoints published beside Gemma-4 models) and its chain
proposer.

A few ``gemma4_text`` decoder layers (mlx-lm's own) that have no key or value
projections: every layer attends to the target's cached keys and values,
those of the target's last layer of the same kind (full or sliding-window
attention; :meth:`~mlx_dspark.targets.adapter.TargetAdapter.attention_kv`).
One step reads ``pre_projection([target_embed(token) * embed_scale ; h])``,
where ``h`` is the target's final normalised state at the position before the
anchor (for the first draft) or the drafter's previous ``post_projection``
output (after it), at that same RoPE position for every draft of a round.
Its logits come from its own (tied) embedding, or a centroid-routed head
(``use_ordered_embeddings``): the top clusters' tokens are scored, every other
token gets the lowest of those scores less one. The drafter keeps no cache of
its own: a round needs only the target's last state and cache.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma4_text import DecoderLayer

from ..errors import DSparkError
from ..sampling.coupled import TokenKey, mlx_lm_draw
from ..sampling.processing import SamplingParams, processed_logits
from .base import Proposal, Round, top_logprob
from .gemma4_assistant_config import AssistantConfig


class CentroidHead(nn.Module):
    """The centroid-routed LM head (``masked_embedding``): ``centroids``
    scores token clusters; ``token_ordering`` lists each cluster's tokens."""

    def __init__(self, config: AssistantConfig):
        super().__init__()
        vocab = config.vocab_size
        if vocab % config.num_centroids:
            raise DSparkError(
                f"The assistant's vocabulary ({vocab}) does not split into "
                f"{config.num_centroids} centroids."
            )
        self.top_k = config.centroid_intermediate_top_k
        self.per_centroid = vocab // config.num_centroids
        self.centroids = nn.Linear(config.hidden_size, config.num_centroids, bias=False)
        self.token_ordering = mx.zeros((vocab,), mx.int32)
        self.freeze(keys=["token_ordering"], recurse=False)

    def __call__(self, hidden: mx.array, embedding: nn.Module) -> mx.array:
        """Logits ``[B, L, V]`` of ``hidden`` ``[B, L, d]``."""
        B, L, d = hidden.shape
        scores = self.centroids(hidden)
        top = mx.argpartition(scores, kth=-self.top_k, axis=-1)[..., -self.top_k :]
        table = self.token_ordering.astype(mx.int32).reshape(-1, self.per_centroid)
        ids = table[top].reshape(B, L, -1)
        rows = embedding(ids)  # [B, L, K, d] (a quantized embedding dequantizes)
        picked = (rows @ hidden[..., None]).squeeze(-1)
        floor = picked.min() - 1.0
        out = mx.full((B, L, table.size), floor, dtype=picked.dtype)
        return mx.put_along_axis(out, ids, picked, axis=-1)


class AssistantModel(nn.Module):
    """The assistant's ``model``: its embedding (the LM head), layers, norm."""

    def __init__(self, config: AssistantConfig):
        super().__init__()
        args = config.text
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class AssistantDrafter(nn.Module):
    """The assistant drafter; parameter names are the checkpoint's
    (``model.*``, ``pre_projection``, ``post_projection``, ``lm_head`` when
    untied, ``masked_embedding.*``). :meth:`bind` gives it the target's
    input embedding before it drafts."""

    def __init__(self, config: AssistantConfig):
        super().__init__()
        self.config = config
        d, backbone = config.hidden_size, config.backbone_hidden_size
        self.model = AssistantModel(config)
        self.pre_projection = nn.Linear(2 * backbone, d, bias=False)
        self.post_projection = nn.Linear(d, backbone, bias=False)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        if config.use_ordered_embeddings:
            self.masked_embedding = CentroidHead(config)
        self.target_embed = None  # the target's scaled input embedding
        self.policy_memory = None  # as every drafter's: the last default policy
        self.phrase_store = None

    @property
    def block_size(self) -> int:
        """The most drafts a round proposes."""
        return self.config.num_drafts

    def bind(self, target_embed, target_layers: int) -> None:
        """Pair with a target: ``target_embed(tokens)`` is its input embedding
        as its own forward scales it, ``target_layers`` its layer count (the
        last layer's normalised output is the state the assistant reads)."""
        self.target_embed = target_embed
        self.config.target_layer_ids = [target_layers - 1]

    def logits(self, hidden: mx.array) -> mx.array:
        """Logits over the vocabulary of the drafter's normed states."""
        if "masked_embedding" in self:
            return self.masked_embedding(hidden, self.model.embed_tokens)
        if "lm_head" in self:
            return self.lm_head(hidden)
        return self.model.embed_tokens.as_linear(hidden)

    def step(
        self,
        embeds: mx.array,
        hidden: mx.array,
        kv: dict[str, tuple[mx.array, mx.array]],
        position: int,
    ) -> tuple[mx.array, mx.array]:
        """One draft step at RoPE ``position``: the next step's state
        ``[B, 1, backbone]`` and the logits ``[B, 1, V]``, from the token's
        target embedding and the state ``[B, 1, backbone]``."""
        x = self.pre_projection(mx.concatenate([embeds, hidden], axis=-1))
        offset = mx.array(position)
        for layer in self.model.layers:
            shared = kv.get(layer.layer_type)
            if shared is None:
                raise DSparkError(
                    f"The target has no {layer.layer_type} layer for the "
                    "assistant's layer of that kind to read."
                )
            x, _, _ = layer(x, None, None, shared_kv=shared, offset=offset)
        x = self.model.norm(x)
        return self.post_projection(x), self.logits(x)

    def draft(
        self,
        hidden: mx.array,
        kv: dict[str, tuple[mx.array, mx.array]],
        anchor: mx.array,
        start: int,
        n: int,
        params: SamplingParams,
        key: mx.array | list[TokenKey] | None = None,
        stop_ids: Collection[int] = (),
    ) -> Proposal:
        """At most ``n`` drafts after the anchor at position ``start``:
        ``hidden`` ``[1, 1, backbone]`` is the target's final normalised state
        at ``start - 1`` and ``kv`` its cached keys and values of positions
        before ``start``. Rows as every proposer's (greedy: the logits;
        sampled: the processed log-weights the draft was drawn from;
        coupled: mlx-lm's, with the token keys in ``key``). The chain ends at
        a drafted token of ``stop_ids``."""
        if self.target_embed is None:
            raise DSparkError(
                "The Gemma-4 assistant drafter was not paired with its target; "
                "load it with mlx_dspark.load(target, draft_model)."
            )
        coupled = isinstance(key, list)
        if params.greedy or coupled:
            keys = key if coupled else [None] * n
        else:
            keys = [None] * n if key is None else list(mx.random.split(key, n))
        token, tokens, rows, drawn = anchor, [], [], []
        for k in range(n):
            embeds = self.target_embed(token[None])
            hidden, logits = self.step(embeds, hidden, kv, start - 1)
            row = logits[:, -1]
            if params.greedy:
                token = mx.argmax(row, axis=-1)
            elif coupled:
                token, weights = mlx_lm_draw(row, params, keys[k])
                drawn.append(weights)
            else:
                drawn.append(processed_logits(row, params))
                token = mx.random.categorical(drawn[-1], key=keys[k])
            token = token.astype(mx.int32)
            tokens.append(token)
            rows.append(row)
            if stop_ids and int(token.item()) in stop_ids:
                break
        tokens, rows = mx.stack(tokens, axis=1), mx.stack(rows, axis=1)
        out = rows if params.greedy else mx.stack(drawn, axis=1)
        return Proposal(tokens, out, top_logprob=top_logprob(rows))


@dataclass
class AssistantState:
    """The target's final normalised state at the position before the
    coming anchor (the last feature the proposer was given)."""

    hidden: mx.array | None = None

    def copy(self) -> AssistantState:
        return AssistantState(self.hidden)

    def arrays(self) -> list[mx.array]:
        return [] if self.hidden is None else [self.hidden]


@dataclass
class AssistantProposer:
    """An :class:`AssistantDrafter` as a
    :class:`~mlx_dspark.proposers.base.Proposer`: each round reads the last
    committed position's target state (``round.features``) and the target's
    cache (``round.target_kv``) and drafts up to the round's cap (at most the
    drafter's :attr:`~AssistantDrafter.block_size`). Chains only."""

    drafter: AssistantDrafter

    def make_state(self) -> AssistantState:
        return AssistantState()

    def propose(self, state: AssistantState, round: Round) -> Proposal:
        if self.drafter.target_embed is None:
            raise DSparkError(
                "The Gemma-4 assistant drafter was not paired with its target; "
                "load it with mlx_dspark.load(target, draft_model)."
            )
        if round.features is not None:
            state.hidden = round.features[:, -1:]
        if state.hidden is None or round.target_kv is None:
            raise DSparkError(
                "The Gemma-4 assistant drafts from the target's state and cache, "
                "which this round did not carry."
            )
        width = self.drafter.config.backbone_hidden_size
        if state.hidden.shape[-1] != width:
            raise DSparkError(
                f"The Gemma-4 assistant reads target states of width {width}, "
                f"but the target's are {state.hidden.shape[-1]}."
            )
        n = min(round.cap, self.drafter.block_size)
        key = None if round.params.greedy else round.key
        return self.drafter.draft(
            state.hidden, round.target_kv(), mx.array([round.anchor]),
            round.start, n, round.params, key, round.stop_ids,
        )  # fmt: skip
