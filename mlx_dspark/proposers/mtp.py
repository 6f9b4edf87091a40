"""Multi-token-prediction (MTP) drafters: the MTP module of Qwen3-Next,
Qwen3.5 and Qwen3.5-MoE checkpoints, run as an autoregressive chain drafter.

At position ``p`` the module reads the trunk's final normalised state ``h_p``
and the embedding of the token at ``p + 1``:
``norm(layer(fc([norm_e(embed(x_{p+1})) ; norm_h(h_p)])))``, one
full-attention decoder layer of the target's own kind (gated ``q_proj``,
partial rotary, the target's MLP or mixture of experts) at RoPE position
``p``, then the target's LM head predicts the token at ``p + 2``. Further
drafts feed the module's own (normalised) output back as ``h``. Its KV cache
holds committed positions only, ingested with the trunk's true states
(:class:`~mlx_dspark.proposers.chain.ChainDrafter`); the layer is mlx-lm's
own class for the family, with mlx-lm's ``KVCache``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from .chain import ChainDrafter, ChainProposer
from .mtp_config import MTPConfig
from .vocabulary import DraftVocabulary


@dataclass
class MTPCache:
    """The MTP layers' KV caches (positions ``0 .. length - 1``) and the
    module's output at the last committed position."""

    layers: list[KVCache] = field(default_factory=list)
    length: int = 0
    hidden: mx.array | None = None

    def copy(self) -> MTPCache:
        """A copy that later rounds can change without changing this one."""
        layers = []
        for c in self.layers:
            fresh = KVCache()
            if c.keys is not None:
                fresh.update_and_fetch(*c.keys_and_values())
            layers.append(fresh)
        return MTPCache(layers, self.length, self.hidden)

    def arrays(self) -> list[mx.array]:
        cached = [
            a for c in self.layers if c.keys is not None for a in (c.keys, c.values)
        ]
        return cached + ([] if self.hidden is None else [self.hidden])

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on."""
        for c in self.layers:
            if c.offset > length:
                c.trim(c.offset - length)


def mtp_layer(config: MTPConfig) -> nn.Module:
    """One full-attention decoder layer of the target's family (mlx-lm's class)."""
    text = dict(config.text_config, full_attention_interval=1)
    if config.target_model_type == "qwen3_next":
        text.update(mlp_only_layers=[], decoder_sparse_step=1)
        return qwen3_next.Qwen3NextDecoderLayer(
            qwen3_next.ModelArgs.from_dict(text), layer_idx=0
        )
    if text.get("rope_parameters"):
        text["rope_parameters"] = dict(text["rope_parameters"])
    return qwen3_5.DecoderLayer(qwen3_5.TextModelArgs.from_dict(text), layer_idx=0)


class MTPDrafter(ChainDrafter, DraftVocabulary, nn.Module):
    """The MTP module. Parameter names are the checkpoint's without ``mtp.``:
    ``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``,
    ``layers.{i}.*`` (mlx-lm's names for the family's layer), ``norm``; the
    embedding and LM head are the target's."""

    def __init__(self, config: MTPConfig):
        super().__init__()
        self.config = config
        d, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(d, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(d, eps=eps)
        self.layers = [mtp_layer(config) for _ in range(config.num_mtp_layers)]
        self.norm = nn.RMSNorm(d, eps=eps)
        self.init_vocabulary()
        # As the other drafters': the default policy of the last generation.
        self.policy_memory = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def project(self, features: mx.array) -> mx.array:
        """The trunk's final normalised state goes in as it is."""
        return features

    def logits(self, hidden: mx.array) -> mx.array:
        """Rows of the target's LM head at the module's (normalised) output."""
        return self.head(hidden)

    def make_cache(self) -> MTPCache:
        return MTPCache([KVCache() for _ in self.layers])

    def __call__(
        self,
        hidden: mx.array,
        tokens: mx.array,
        offset: int,
        cache: MTPCache | None = None,
    ) -> mx.array:
        """The module's normalised outputs ``[B, L, d]`` at positions
        ``offset ..`` from the states ``hidden`` there and the tokens after
        them; ``cache`` (positions ``< offset``) gets the new ones appended."""
        embeds = self.pre_fc_norm_embedding(self.embed(tokens))
        h = self.fc(mx.concatenate([embeds, self.pre_fc_norm_hidden(hidden)], -1))
        layers = [None] * len(self.layers) if cache is None else cache.layers
        for layer, c in zip(self.layers, layers, strict=True):
            if c is not None and c.offset != offset:
                raise ValueError(f"the MTP cache holds {c.offset}, not {offset}")
            h = layer(h, create_attention_mask(h, c), c)
        return self.norm(h)


@dataclass
class MTPProposer(ChainProposer):
    """An :class:`MTPDrafter` as a :class:`~mlx_dspark.proposers.base.Proposer`
    (chains only)."""

    drafter: MTPDrafter
    name = "MTP drafter"
