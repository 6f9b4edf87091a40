"""The drafter's configuration, read from a DeepSpec `config.json`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import DSparkError

SUPPORTED_ARCHITECTURES = ("Qwen3DSparkModel", "Gemma4DSparkModel")
KNOWN_ARCHITECTURES = ("Qwen3DSparkModel", "Gemma4DSparkModel")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")

_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
)
# What a Gemma-4 drafter's attention needs beyond the common fields.
_REQUIRED_GEMMA4 = ("global_head_dim", "rope_parameters")


@dataclass
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    num_target_layers: int | None = None
    num_anchors: int = 512
    markov_rank: int = 0
    markov_head_type: str | None = None
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    draft_vocab_size: int | None = None
    # mlx-dspark's own: the logit bias on tokens copied from the context
    # (``mlx_dspark.proposers.copying``); 0 leaves drafting as DeepSpec defines it.
    context_copy_bias: float = 0.0
    # Gemma-4 (DeepSpec's Gemma4DSparkModel): full-attention layers with
    # global_head_dim, K = V when attention_k_eq_v, scaled embeddings and
    # soft-capped logits.
    global_head_dim: int | None = None
    num_global_key_value_heads: int | None = None
    attention_k_eq_v: bool = False
    final_logit_softcapping: float | None = None
    rope_parameters: dict | None = None
    use_double_wide_mlp: bool = False
    num_kv_shared_layers: int = 0
    architectures: list[str] = field(default_factory=lambda: ["Qwen3DSparkModel"])
    quantization: dict | None = None
    raw: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.markov_rank > 0:
            kind = str(self.markov_head_type or "vanilla").lower()
            if kind not in MARKOV_HEAD_TYPES:
                raise DSparkError(
                    f"Unsupported markov_head_type {self.markov_head_type!r}; "
                    f"expected one of {', '.join(MARKOV_HEAD_TYPES)}."
                )
            self.markov_head_type = kind
        if self.confidence_head_with_markov and self.markov_rank == 0:
            self.confidence_head_with_markov = False
        if self.draft_vocab_size is not None:
            self.draft_vocab_size = int(self.draft_vocab_size)
            if not 0 < self.draft_vocab_size <= self.vocab_size:
                raise DSparkError(
                    f"draft_vocab_size {self.draft_vocab_size} must be between 1 "
                    f"and the vocabulary size {self.vocab_size}."
                )
        self.context_copy_bias = float(self.context_copy_bias)
        if not self.context_copy_bias >= 0:
            raise DSparkError(
                f"context_copy_bias must be >= 0, got {self.context_copy_bias}."
            )
        if self.block_size < 1:
            raise DSparkError(f"block_size must be at least 1, got {self.block_size}.")

    @property
    def is_gemma4(self) -> bool:
        return "Gemma4DSparkModel" in self.architectures

    @property
    def reduced_vocab(self) -> bool:
        """True when the LM head and Markov W2 cover a reduced draft vocabulary
        whose ids map to target ids through ``draft_to_target``."""
        return (
            self.draft_vocab_size is not None
            and self.draft_vocab_size != self.vocab_size
        )

    @property
    def output_vocab_size(self) -> int:
        """Rows of the drafter's own LM head and of the Markov W2."""
        return self.draft_vocab_size if self.reduced_vocab else self.vocab_size

    @property
    def confidence_input_dim(self) -> int:
        extra = self.markov_rank if self.confidence_head_with_markov else 0
        return self.hidden_size + extra

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> DraftConfig:
        architectures = params.get("architectures") or []
        arch = next((a for a in architectures if a in KNOWN_ARCHITECTURES), None)
        if arch is None:
            raise DSparkError(
                f"Not a DSpark drafter config (architectures {architectures}); "
                f"expected one of {', '.join(KNOWN_ARCHITECTURES)}."
            )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise DSparkError(f"Drafter architecture {arch} is not supported yet.")
        missing = [k for k in _REQUIRED if k not in params]
        if missing:
            raise DSparkError(f"Drafter config is missing {', '.join(missing)}.")
        if arch == "Gemma4DSparkModel":
            missing = [k for k in _REQUIRED_GEMMA4 if not params.get(k)]
            if params.get("attention_k_eq_v") and not params.get(
                "num_global_key_value_heads"
            ):
                missing.append("num_global_key_value_heads")
            if missing:
                raise DSparkError(
                    f"The Gemma4DSparkModel config is missing {', '.join(missing)}."
                )
            if params.get("enable_moe_block") or params.get(
                "hidden_size_per_layer_input"
            ):
                raise DSparkError(
                    "Gemma4DSparkModel drafters with MoE blocks or per-layer inputs "
                    "are not supported."
                )
        rope_parameters = params.get("rope_parameters") or {}
        known = {f for f in cls.__dataclass_fields__ if f != "raw"}
        values = {k: v for k, v in params.items() if k in known}
        if "rope_theta" not in values and "rope_theta" in rope_parameters:
            values["rope_theta"] = rope_parameters["rope_theta"]
        values.setdefault("markov_rank", 0)
        values["markov_rank"] = int(values.get("markov_rank") or 0)
        try:
            return cls(**values, raw=dict(params))
        except TypeError as error:
            raise DSparkError(f"Drafter config is invalid: {error}.") from None

    def to_dict(self) -> dict[str, Any]:
        """The DeepSpec config with every key of the original file kept."""
        out = dict(self.raw)
        for name in self.__dataclass_fields__:
            if name in ("raw", "quantization"):
                continue
            value = getattr(self, name)
            if name == "context_copy_bias" and not value and name not in self.raw:
                continue
            if value is not None:
                out[name] = value
        if self.quantization is not None:
            out["quantization"] = self.quantization
        return out
