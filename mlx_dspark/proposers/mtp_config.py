"""The configuration of a multi-token-prediction (MTP) drafter: the MTP
module Qwen3-Next, Qwen3.5 and Qwen3.5-MoE checkpoints ship beside their
trunk, written out as a drafter directory by ``mlx_dspark.convert --mtp``.

The directory's ``config.json`` holds ``architectures: ["MTPDrafter"]``, the
target's ``model_type`` (``mtp_target_model_type``), its text configuration
(``text_config``: what the MTP layer is built from), ``num_target_layers``,
``block_size`` (the most drafts a round proposes) and, for a quantized
drafter, ``quantization``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ARCHITECTURE = "MTPDrafter"
MTP_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
DEFAULT_BLOCK_SIZE = 3


@dataclass
class MTPConfig:
    target_model_type: str
    text_config: dict
    num_target_layers: int
    block_size: int = DEFAULT_BLOCK_SIZE
    num_mtp_layers: int = 1
    quantization: dict | None = None
    extra: dict = field(default_factory=dict)

    # What the shared drafter helpers read (DraftVocabulary, attach_embeddings).
    reduced_vocab = False
    is_gemma4 = False
    final_logit_softcapping = None
    context_copy_bias = 0.0

    @property
    def hidden_size(self) -> int:
        return int(self.text_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.text_config["vocab_size"])

    @property
    def output_vocab_size(self) -> int:
        return self.vocab_size

    draft_vocab_size = output_vocab_size

    @property
    def rms_norm_eps(self) -> float:
        return float(self.text_config.get("rms_norm_eps", 1e-6))

    @property
    def num_hidden_layers(self) -> int:
        return self.num_mtp_layers

    @property
    def target_layer_ids(self) -> list[int]:
        """The trunk's final normalised state (the target adapter's tap of the
        last layer is that state): what the MTP module reads."""
        return [self.num_target_layers - 1]

    @classmethod
    def from_dict(cls, raw: dict) -> MTPConfig:
        return cls(
            target_model_type=raw["mtp_target_model_type"],
            text_config=dict(raw["text_config"]),
            num_target_layers=int(raw["num_target_layers"]),
            block_size=int(raw.get("block_size", DEFAULT_BLOCK_SIZE)),
            num_mtp_layers=int(raw.get("num_mtp_layers", 1)),
            quantization=raw.get("quantization"),
        )

    def to_dict(self) -> dict:
        out = {
            "architectures": [ARCHITECTURE],
            "mtp_target_model_type": self.target_model_type,
            "text_config": self.text_config,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "num_mtp_layers": self.num_mtp_layers,
        }
        if self.quantization:
            out["quantization"] = self.quantization
        return out


def is_mtp_config(raw: dict) -> bool:
    """Whether a drafter's ``config.json`` describes an MTP drafter."""
    return ARCHITECTURE in (raw.get("architectures") or [])


def text_config_of(raw: dict) -> dict:
    """The text part of a target's (or original checkpoint's) config."""
    return dict(raw.get("text_config") or raw)
