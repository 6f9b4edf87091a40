"""The configuration of a Gemma-4 assistant drafter (Hugging Face's
``Gemma4AssistantForCausalLM``, ``model_type`` ``gemma4_assistant``).

An assistant checkpoint's ``config.json`` holds the drafter's own settings
(``backbone_hidden_size``: the target's width; ``use_ordered_embeddings``
with ``num_centroids`` and ``centroid_intermediate_top_k``: the
centroid-routed LM head) and a ``text_config``: a ``gemma4_text`` model whose
layers all read the target's keys and values (``num_kv_shared_layers`` equal
to its layer count).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_lm.models.gemma4_text import ModelArgs

from ..errors import DSparkError

MODEL_TYPE = "gemma4_assistant"
ARCHITECTURES = ("Gemma4AssistantForCausalLM",)
# Drafts a round proposes when the config names no block: mlx-vlm's default
# verify width of 4 (the anchor and three drafts).
DEFAULT_BLOCK = 4


def is_assistant(config: dict) -> bool:
    """Whether a draft model's ``config.json`` describes a Gemma-4 assistant."""
    architectures = config.get("architectures") or []
    return config.get("model_type") == MODEL_TYPE or any(
        a in ARCHITECTURES for a in architectures
    )


@dataclass
class AssistantConfig:
    text: ModelArgs
    backbone_hidden_size: int
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True
    block: int = DEFAULT_BLOCK
    quantization: dict | None = None
    raw: dict = field(default_factory=dict)
    # Set when the drafter is paired (:meth:`bind_target`): the target's last
    # layer, whose (normalised) output is the state the assistant reads.
    target_layer_ids: list[int] = field(default_factory=list)
    # What the pair machinery reads of every drafter's config.
    context_copy_bias: float = 0.0
    reduced_vocab: bool = False

    # A Gemma-4 drafter: the server drafts for one request at a time.
    is_gemma4 = True

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def num_drafts(self) -> int:
        """The most drafts a round proposes (the verify width less the anchor)."""
        return max(1, self.block - 1)

    @classmethod
    def from_dict(cls, raw: dict) -> AssistantConfig:
        if not is_assistant(raw):
            raise DSparkError("This config.json is not a Gemma-4 assistant drafter's.")
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise DSparkError(
                "The Gemma-4 assistant config.json has no text_config object."
            )
        text = dict(text)
        layers = text.get("num_hidden_layers")
        if not isinstance(layers, int) or layers < 1:
            raise DSparkError(
                "The Gemma-4 assistant's text_config has no num_hidden_layers."
            )
        # Every assistant layer reads the target's keys and values.
        if not text.get("num_kv_shared_layers"):
            text["num_kv_shared_layers"] = layers
        if text["num_kv_shared_layers"] != layers:
            raise DSparkError(
                f"A Gemma-4 assistant shares keys and values in all its layers, "
                f"but its text_config shares {text['num_kv_shared_layers']} of {layers}."
            )
        if text.get("hidden_size_per_layer_input") or text.get("enable_moe_block"):
            raise DSparkError(
                "A Gemma-4 assistant has no per-layer inputs or experts, but this "
                "text_config has them."
            )
        text["hidden_size_per_layer_input"] = 0
        text["use_double_wide_mlp"] = False
        backbone = raw.get("backbone_hidden_size")
        if not isinstance(backbone, int):
            raise DSparkError(
                "The Gemma-4 assistant config has no backbone_hidden_size."
            )
        return cls(
            text=ModelArgs.from_dict(text),
            backbone_hidden_size=backbone,
            use_ordered_embeddings=bool(raw.get("use_ordered_embeddings", False)),
            num_centroids=int(raw.get("num_centroids", 2048)),
            centroid_intermediate_top_k=int(raw.get("centroid_intermediate_top_k", 32)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            block=int(raw.get("block_size", DEFAULT_BLOCK)),
            quantization=raw.get("quantization"),
            raw=dict(raw),
        )

    def to_dict(self) -> dict[str, Any]:
        """The config as written next to converted weights (the source's,
        with the quantization block of the conversion)."""
        out = {k: v for k, v in self.raw.items() if k != "quantization"}
        out["model_type"] = MODEL_TYPE
        out.setdefault("architectures", list(ARCHITECTURES))
        if self.quantization:
            out["quantization"] = dict(self.quantization)
        return out
