"""The EAGLE-3 drafter (DeepSpec's ``Qwen3Eagle3Model`` / ``Gemma4Eagle3Model``
and the speculators Llama-style ``eagle3``) and its chain-drafting API.

One (or a few) decoder layers whose attention reads
``[input_norm(embed(token)) ; hidden_norm(h)]`` (twice the width), where ``h``
is ``fc(target features)`` at committed positions and the drafter's own
previous output while it drafts. Position ``p`` pairs the target feature of
token ``p`` with token ``p + 1`` at RoPE position ``p``: the drafter predicts
token ``p + 2`` there. Its KV cache holds committed positions only; each
proposal's own entries are cropped away, and the committed tokens are then
ingested with the target's true features (:meth:`Eagle3Drafter.extend`).
:class:`Eagle3Proposer` runs it in the generation loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.rope_utils import initialize_rope

from .chain import ChainDrafter, ChainProposer
from .eagle3_config import Eagle3Config
from .vocabulary import DraftVocabulary


@dataclass
class Eagle3Cache:
    """Per-layer keys/values of the committed positions, and the drafter's
    output at the last of them (what the next proposal starts from)."""

    keys: list[mx.array | None]
    values: list[mx.array | None]
    length: int = 0
    hidden: mx.array | None = None

    def append(self, layer: int, keys: mx.array, values: mx.array):
        if self.keys[layer] is not None:
            keys = mx.concatenate([self.keys[layer], keys], axis=2)
            values = mx.concatenate([self.values[layer], values], axis=2)
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def copy(self) -> Eagle3Cache:
        """A copy that later rounds can change without changing this one."""
        return replace(self, keys=list(self.keys), values=list(self.values))

    def arrays(self) -> list[mx.array]:
        return [a for a in (*self.keys, *self.values, self.hidden) if a is not None]

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        for i, k in enumerate(self.keys):
            if k is not None and k.shape[2] > length:
                self.keys[i] = k[:, :, :length]
                self.values[i] = self.values[i][:, :, :length]


def causal_mask(queries: int, past: int) -> mx.array | None:
    """Query ``i`` (position ``past + i``) sees keys ``0 .. past + i``."""
    if queries == 1:
        return None
    rows = mx.arange(queries)[:, None] + past
    return mx.arange(past + queries)[None, :] <= rows


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config, eagle: bool = True):
        super().__init__()
        c = config
        wide = (2 if eagle else 1) * c.hidden_size
        bias = c.attention_bias
        self.k_eq_v = c.is_gemma4 and bool(c.attention_k_eq_v)
        if c.is_gemma4:
            head_dim = c.global_head_dim
            self.n_kv_heads = (
                c.num_global_key_value_heads if self.k_eq_v else c.num_key_value_heads
            )
            self.scale = 1.0
            full = (c.rope_parameters or {}).get("full_attention", {})
            rope_base, rope_scaling = full.get("rope_theta", c.rope_theta), full
        else:
            head_dim = c.head_dim
            self.n_kv_heads = c.num_key_value_heads
            self.scale = head_dim**-0.5
            rope_base, rope_scaling = c.rope_theta, c.rope_scaling
        self.n_heads = c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.value_norm = c.is_gemma4
        self.q_proj = nn.Linear(wide, self.n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(wide, self.n_kv_heads * head_dim, bias=bias)
        if not self.k_eq_v:
            self.v_proj = nn.Linear(wide, self.n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, c.hidden_size, bias=bias)
        if c.flavour != "llama":
            self.q_norm = nn.RMSNorm(head_dim, eps=c.rms_norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, eps=c.rms_norm_eps)
        self.rope = initialize_rope(
            head_dim,
            base=rope_base,
            traditional=False,
            scaling_config=rope_scaling,
            max_position_embeddings=c.max_position_embeddings,
        )

    def _heads(self, x: mx.array, n_heads: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n_heads, -1).transpose(0, 2, 1, 3)

    def __call__(
        self,
        x: mx.array,
        offset: int,
        cache: Eagle3Cache | None,
        layer: int,
        mask: mx.array | None,
    ) -> mx.array:
        B, L, _ = x.shape
        queries = self._heads(self.q_proj(x), self.n_heads)
        keys = self._heads(self.k_proj(x), self.n_kv_heads)
        values = keys if self.k_eq_v else self._heads(self.v_proj(x), self.n_kv_heads)
        if "q_norm" in self:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        if self.value_norm:
            values = mx.fast.rms_norm(values, None, self.eps)
        queries = self.rope(queries, offset=offset)
        keys = self.rope(keys, offset=offset)
        if cache is not None:
            keys, values = cache.append(layer, keys, values)
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=mask
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, bias: bool, gelu: bool):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)
        self.gelu = gelu

    def __call__(self, x: mx.array) -> mx.array:
        if self.gelu:
            return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class Eagle3Layer(nn.Module):
    """One EAGLE-3 decoder layer: attention over ``[embeddings ; hidden]``,
    then the MLP (Gemma-4: sandwich norms and ``layer_scalar``). With
    ``eagle=False`` a plain decoder layer over ``hidden`` alone (speculators'
    layers after the first)."""

    def __init__(self, config: Eagle3Config, eagle: bool = True):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.gemma4 = config.is_gemma4
        self.eagle = eagle
        self.norm_before_residual = config.norm_before_residual
        self.self_attn = Eagle3Attention(config, eagle)
        self.mlp = Eagle3MLP(
            d, config.intermediate_size, config.mlp_bias, gelu=config.is_gemma4
        )
        if eagle:
            self.hidden_norm = nn.RMSNorm(d, eps=eps)
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        if self.gemma4:
            self.pre_feedforward_layernorm = nn.RMSNorm(d, eps=eps)
            self.post_feedforward_layernorm = nn.RMSNorm(d, eps=eps)
            self.layer_scalar = mx.ones((1,))

    def __call__(
        self,
        embeds: mx.array,
        hidden: mx.array,
        offset: int,
        cache: Eagle3Cache | None,
        layer: int,
        mask: mx.array | None,
    ) -> mx.array:
        if self.eagle:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        else:
            residual, x = hidden, self.input_layernorm(hidden)
        attn = self.self_attn(x, offset, cache, layer, mask)
        if not self.gemma4:
            h = residual + attn
            return h + self.mlp(self.post_attention_layernorm(h))
        h = residual + self.post_attention_layernorm(attn)
        h = h + self.post_feedforward_layernorm(
            self.mlp(self.pre_feedforward_layernorm(h))
        )
        return h * self.layer_scalar


class Eagle3Drafter(ChainDrafter, DraftVocabulary, nn.Module):
    """The EAGLE-3 draft model. Parameter names follow DeepSpec's checkpoints:
    ``fc``, ``layers.{i}.{hidden_norm, input_layernorm, self_attn.*, mlp.*,
    post_attention_layernorm}``, ``norm``, and ``embed_tokens`` / ``lm_head``
    when not shared with the target; ``draft_to_target`` (frozen) maps a
    reduced draft vocabulary to target ids."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        d = config.hidden_size
        eps = config.rms_norm_eps
        if config.norm_before_fc:
            self.input_norm = nn.RMSNorm(config.feature_size, eps=eps)
        if config.fc_norm:
            self.fc_norm = [
                nn.RMSNorm(config.target_hidden_size, eps=eps)
                for _ in config.target_layer_ids
            ]
        self.fc = nn.Linear(config.feature_size, d, bias=False)
        self.layers = [
            Eagle3Layer(config, eagle=i == 0 or not config.plain_later_layers)
            for i in range(config.num_hidden_layers)
        ]
        self.norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.init_vocabulary()
        # As DSparkDrafter's: the default policy of the last generation.
        self.policy_memory = None

    @property
    def block_size(self) -> int:
        """The most drafts a round proposes: the training-time-test length."""
        return self.config.ttt_length

    def project(self, features: mx.array) -> mx.array:
        """``fc`` of the concatenated target features ``[B, L, feature_size]``
        (normed first where the checkpoint says so)."""
        if "input_norm" in self:
            features = self.input_norm(features)
        if "fc_norm" in self:
            parts = mx.split(features, len(self.fc_norm), axis=-1)
            features = mx.concatenate(
                [norm(x) for norm, x in zip(self.fc_norm, parts, strict=True)], axis=-1
            )
        return self.fc(features)

    def logits(self, hidden: mx.array) -> mx.array:
        """Draft-vocabulary logits of the drafter's hidden states (after
        ``norm``, unless ``norm_output`` normed them already)."""
        h = hidden if self.config.norm_output else self.norm(hidden)
        return self.head(h)

    # -------------------------------------------------------------- forward
    def make_cache(self) -> Eagle3Cache:
        n = len(self.layers)
        return Eagle3Cache([None] * n, [None] * n)

    def __call__(
        self,
        hidden: mx.array,
        tokens: mx.array,
        offset: int,
        cache: Eagle3Cache | None = None,
        mask: mx.array | str | None = "causal",
    ) -> mx.array:
        """Hidden states ``[B, L, d]`` at positions ``offset ..`` from ``hidden``
        (``fc``-projected features or the drafter's own outputs) and the next
        tokens. ``cache`` (keys/values of positions ``< offset``) gets the new
        positions appended. ``mask="causal"`` is causal over cache and block;
        pass an array to attend otherwise (training)."""
        past = 0 if cache is None or cache.keys[0] is None else cache.keys[0].shape[2]
        if isinstance(mask, str):
            mask = causal_mask(tokens.shape[1], past)
        embeds = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            hidden = layer(embeds, hidden, offset, cache, i, mask)
        return self.norm(hidden) if self.config.norm_output else hidden


@dataclass
class Eagle3Proposer(ChainProposer):
    """An :class:`Eagle3Drafter` as a :class:`~mlx_dspark.proposers.base.Proposer`:
    each round ingests the newly committed positions (the feature of position
    ``p`` with the token at ``p + 1``, :meth:`~mlx_dspark.proposers.base.Round.following`),
    then drafts autoregressively up to the round's cap (at most the drafter's
    :attr:`~Eagle3Drafter.block_size`). Chains only: trees refuse it."""

    drafter: Eagle3Drafter
    name = "EAGLE-3 drafter"
