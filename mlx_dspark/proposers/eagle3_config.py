"""The EAGLE-3 drafter's configuration: DeepSpec's ``Qwen3Eagle3Model`` /
``Gemma4Eagle3Model`` configs and vLLM speculators ``eagle3`` configs.

``target_layer_ids`` always use DeepSpec indexing (``i`` is the output of
target layer ``i``); speculators counts the embedding output as layer 0, so
its ids are DeepSpec's plus one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import DSparkError

# DeepSpec's architectures, and ours for a Llama-style (speculators) drafter
# written back in the DeepSpec layout by ``mlx_dspark.convert``.
ARCHITECTURES = {
    "Qwen3Eagle3Model": "qwen3",
    "Gemma4Eagle3Model": "gemma4",
    "LlamaEagle3Model": "llama",
}
FLAVOURS = ("qwen3", "gemma4", "llama")
SPECULATORS_LAYER_TYPES = ("llama", "qwen3")
# What a speculators transformer_layer_config carries over.
_LAYER_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "attention_bias",
    "mlp_bias",
)
_SPECULATORS_KEYS = (
    "draft_vocab_size",
    "norm_before_residual",
    "target_hidden_size",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
)

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
    # speculators options: the residual taken after hidden_norm; an RMSNorm
    # over the concatenated features (``input_norm``) or one per tapped
    # feature (``fc_norm``) before ``fc``; the normed output fed back while
    # drafting (EAGLE 3.1); layers after the first are plain decoder layers.
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    plain_later_layers: bool = False
    num_target_layers: int | None = None
    # Gemma-4 only.
    global_head_dim: int | None = None
    num_global_key_value_heads: int | None = None
    attention_k_eq_v: bool = False
    final_logit_softcapping: float | None = None
    rope_parameters: dict | None = None
    quantization: dict | None = None
    # > 0: the pair copies from the context (and its phrase store), adding
    # this to the copied tokens' logits (copying.CopyBias).
    context_copy_bias: float = 0.0
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
        if self.norm_before_fc and self.fc_norm:
            raise DSparkError("norm_before_fc and fc_norm cannot both be set.")
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

    @property
    def architecture(self) -> str:
        return next(a for a, f in ARCHITECTURES.items() if f == self.flavour)

    @classmethod
    def from_deepspec(cls, params: dict[str, Any]) -> Eagle3Config:
        architectures = params.get("architectures") or []
        flavour = next(
            (ARCHITECTURES[a] for a in architectures if a in ARCHITECTURES), None
        )
        if flavour is None:
            raise DSparkError(
                f"Not a DeepSpec EAGLE-3 config (architectures {architectures}); "
                f"expected one of {', '.join(ARCHITECTURES)}."
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

    @classmethod
    def from_speculators(
        cls, params: dict[str, Any], num_target_layers: int | None = None
    ) -> Eagle3Config:
        """A vLLM speculators ``eagle3`` config. Without
        ``eagle_aux_hidden_state_layer_ids`` the taps are speculators'
        default for a target of ``num_target_layers`` layers."""
        layer = params.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise DSparkError("The speculators config has no transformer_layer_config.")
        model_type = layer.get("model_type", "qwen3")
        if model_type not in SPECULATORS_LAYER_TYPES:
            raise DSparkError(
                f"Speculators EAGLE-3 drafters with {model_type} layers are not "
                f"supported; only {', '.join(SPECULATORS_LAYER_TYPES)} are."
            )
        if layer.get("layer_types") and any(
            t != "full_attention" for t in layer["layer_types"]
        ):
            raise DSparkError(
                "Speculators EAGLE-3 drafters with sliding-window layers are not supported."
            )
        missing = [k for k in _REQUIRED if k != "target_layer_ids" and k not in layer]
        if missing:
            raise DSparkError(
                f"The speculators transformer_layer_config is missing {', '.join(missing)}."
            )
        values = {k: layer[k] for k in _LAYER_KEYS if layer.get(k) is not None}
        rope = layer.get("rope_parameters") or {}
        if "rope_theta" not in values and "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        if (
            "rope_scaling" not in values
            and rope.get("rope_type", "default") != "default"
        ):
            values["rope_scaling"] = rope
        values.update(
            {k: params[k] for k in _SPECULATORS_KEYS if params.get(k) is not None}
        )
        # vLLM's default for a config that does not say.
        values.setdefault("norm_before_residual", True)
        aux = params.get("eagle_aux_hidden_state_layer_ids")
        if aux is None:
            if num_target_layers is None:
                raise DSparkError(
                    "The speculators config names no eagle_aux_hidden_state_layer_ids; "
                    "load it with its target to use the default layers."
                )
            n = int(num_target_layers)
            aux = [2, n // 2, n - 3]
        # Speculators index the verifier's hidden-state list (0 = embeddings).
        values["target_layer_ids"] = [int(i) - 1 for i in aux]
        speculators = params.get("speculators_config") or {}
        methods = speculators.get("proposal_methods") or [{}]
        values["ttt_length"] = int(methods[0].get("speculative_tokens") or 3)
        values["flavour"] = model_type
        values["plain_later_layers"] = True
        if num_target_layers is not None:
            values["num_target_layers"] = int(num_target_layers)
        return _build(cls, values, params)

    def to_dict(self) -> dict[str, Any]:
        """The config in the DeepSpec layout (``architectures`` naming the
        flavour), which :meth:`from_deepspec` reads back."""
        out = {"architectures": [self.architecture]}
        if "model_type" in self.raw:
            out["model_type"] = self.raw["model_type"]
        for name in self.__dataclass_fields__:
            if name in ("raw", "flavour"):
                continue
            value = getattr(self, name)
            if value is not None and (value or name != "context_copy_bias"):
                out[name] = value
        return out


def _known_fields(cls, params: dict[str, Any]) -> dict[str, Any]:
    known = {f for f in cls.__dataclass_fields__ if f != "raw"}
    return {k: v for k, v in params.items() if k in known}


def _build(cls, values: dict[str, Any], raw: dict[str, Any]) -> Eagle3Config:
    try:
        return cls(**values, raw=dict(raw))
    except TypeError as error:
        raise DSparkError(f"The EAGLE-3 config is invalid: {error}.") from None
