"""The EAGLE-3 drafter's configuration: DeepSpec's ``Qwen3Eagle3Model`` /
``Gemma4Eagle3Model`` configs and vLLM speculators ``eagle3`` configs.

``target_layer_ids`` always use DeepSpec indexing (``i`` is the output of
target layer ``i``); speculators counts the embedding output as layer 0, so
its ids are DeepSpec's plus one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import DSparkError

DEEPSPEC_ARCHITECTURES = {
    "Qwen3Eagle3Model": "qwen3",
    "Gemma4Eagle3Model": "gemma4",
}
FLAVOURS = ("qwen3", "gemma4", "llama")

_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "target_layer_ids",
)
_REQUIRED_GEMMA4 = ("global_head_dim", "rope_parameters")


@dataclass
class Eagle3Config:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    # qwen3 (DeepSpec): q/k RMS norms; gemma4 (DeepSpec): Gemma-4 block;
    # llama (speculators): no q/k norms.
    flavour: str = "qwen3"
    head_dim: int | None = None
    # Width of each tapped target feature (fc takes len(ids) of them).
    target_hidden_size: int | None = None
    draft_vocab_size: int | None = None
    ttt_length: int = 7
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    mlp_bias: bool = False
    # speculators: the residual is taken after hidden_norm instead of before.
    norm_before_residual: bool = False
    num_target_layers: int | None = None
    # Gemma-4 only.
    global_head_dim: int | None = None
    num_global_key_value_heads: int | None = None
    attention_k_eq_v: bool = False
    final_logit_softcapping: float | None = None
    rope_parameters: dict | None = None
    quantization: dict | None = None
    raw: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.flavour not in FLAVOURS:
            raise DSparkError(
                f"Unknown EAGLE-3 flavour {self.flavour!r}; expected one of "
                f"{', '.join(FLAVOURS)}."
            )
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if not self.target_layer_ids:
            raise DSparkError("The EAGLE-3 config has no target_layer_ids.")
        if self.num_hidden_layers < 1:
            raise DSparkError("The EAGLE-3 drafter needs at least one layer.")
        if self.ttt_length < 1:
            raise DSparkError(f"ttt_length must be at least 1, got {self.ttt_length}.")
        if self.draft_vocab_size is not None:
            self.draft_vocab_size = int(self.draft_vocab_size)
            if not 0 < self.draft_vocab_size <= self.vocab_size:
                raise DSparkError(
                    f"draft_vocab_size {self.draft_vocab_size} must be between 1 "
                    f"and the vocabulary size {self.vocab_size}."
                )

    @property
    def is_gemma4(self) -> bool:
        return self.flavour == "gemma4"

    @property
    def reduced_vocab(self) -> bool:
        """Whether the LM head covers a reduced draft vocabulary whose ids map
        to target ids through ``draft_to_target``."""
        return (
            self.draft_vocab_size is not None
            and self.draft_vocab_size != self.vocab_size
        )

    @property
    def output_vocab_size(self) -> int:
        return self.draft_vocab_size if self.reduced_vocab else self.vocab_size

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features ``fc`` projects."""
        return len(self.target_layer_ids) * self.target_hidden_size

    @classmethod
    def from_deepspec(cls, params: dict[str, Any]) -> Eagle3Config:
        architectures = params.get("architectures") or []
        flavour = next(
            (
                DEEPSPEC_ARCHITECTURES[a]
                for a in architectures
                if a in DEEPSPEC_ARCHITECTURES
            ),
            None,
        )
        if flavour is None:
            raise DSparkError(
                f"Not a DeepSpec EAGLE-3 config (architectures {architectures}); "
                f"expected one of {', '.join(DEEPSPEC_ARCHITECTURES)}."
            )
        missing = [k for k in _REQUIRED if k not in params]
        if flavour == "gemma4":
            missing += [k for k in _REQUIRED_GEMMA4 if not params.get(k)]
            if params.get("attention_k_eq_v") and not params.get(
                "num_global_key_value_heads"
            ):
                missing.append("num_global_key_value_heads")
            if params.get("enable_moe_block") or params.get(
                "hidden_size_per_layer_input"
            ):
                raise DSparkError(
                    "Gemma4Eagle3Model drafters with MoE blocks or per-layer inputs "
                    "are not supported."
                )
        if missing:
            raise DSparkError(f"The EAGLE-3 config is missing {', '.join(missing)}.")
        values = _known_fields(cls, params)
        rope_parameters = params.get("rope_parameters") or {}
        if "rope_theta" not in values and "rope_theta" in rope_parameters:
            values["rope_theta"] = rope_parameters["rope_theta"]
        values["flavour"] = flavour
        values.setdefault("ttt_length", 7)
        return _build(cls, values, params)

    def to_dict(self) -> dict[str, Any]:
        """The config as loaded, with every key of the original file kept."""
        out = dict(self.raw)
        for name in self.__dataclass_fields__:
            if name in ("raw", "quantization"):
                continue
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.quantization is not None:
            out["quantization"] = self.quantization
        return out


def _known_fields(cls, params: dict[str, Any]) -> dict[str, Any]:
    known = {f for f in cls.__dataclass_fields__ if f != "raw"}
    return {k: v for k, v in params.items() if k in known}


def _build(cls, values: dict[str, Any], raw: dict[str, Any]) -> Eagle3Config:
    try:
        return cls(**values, raw=dict(raw))
    except TypeError as error:
        raise DSparkError(f"The EAGLE-3 config is invalid: {error}.") from None
