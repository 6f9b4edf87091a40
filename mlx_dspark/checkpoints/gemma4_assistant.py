"""Load Gemma-4 assistant drafters: Hugging Face ``*-assistant`` checkpoints
and the MLX ones ``mlx_dspark.convert`` writes (same tensor names, with
mlx-lm's ``quantization`` block when quantized)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import DSparkError
from ..proposers.gemma4_assistant import AssistantDrafter
from ..proposers.gemma4_assistant_config import AssistantConfig, is_assistant
from ..targets.adapter import TargetAdapter
from .weights import (
    dequantize_on_cpu,
    load_checked_weights,
    read_config,
    read_weights,
    resolve_path,
)

TARGET_TYPES = ("gemma4", "gemma4_text")


def is_assistant_path(path_or_repo: str | Path) -> bool:
    """:func:`is_assistant` of a local directory or Hugging Face repo id."""
    return is_assistant(read_config(resolve_path(path_or_repo, "draft model")))


def assistant_weights(
    weights: dict[str, mx.array], config: AssistantConfig
) -> dict[str, mx.array]:
    """The checkpoint's tensors as the drafter's parameters: a tied
    ``lm_head`` copy dropped, the cluster table as int32."""
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    if "masked_embedding.token_ordering" in weights:
        table = weights["masked_embedding.token_ordering"]
        weights["masked_embedding.token_ordering"] = table.astype(mx.int32)
    return weights


def check_assistant_pair(config: AssistantConfig, target: TargetAdapter) -> None:
    """Refuse, in one sentence, a target the assistant cannot draft for."""
    if target.model_type not in TARGET_TYPES:
        raise DSparkError(
            f"A Gemma-4 assistant drafts for Gemma-4 targets, not {target.model_type}."
        )
    if config.backbone_hidden_size != target.hidden_size:
        raise DSparkError(
            f"The Gemma-4 assistant was trained for a target of width "
            f"{config.backbone_hidden_size}, but this target's is {target.hidden_size}."
        )
    if config.vocab_size != target.vocab_size:
        raise DSparkError(
            f"The Gemma-4 assistant's vocabulary ({config.vocab_size}) is not "
            f"the target's ({target.vocab_size})."
        )
    args = getattr(target.inner, "config", None)
    for name in ("head_dim", "global_head_dim", "num_key_value_heads"):
        ours, theirs = getattr(config.text, name), getattr(args, name, None)
        if theirs is not None and ours != theirs:
            raise DSparkError(
                f"The Gemma-4 assistant attends with {name} {ours}, but the "
                f"target's keys have {theirs}."
            )


def build_assistant(
    config: AssistantConfig,
    weights: dict[str, mx.array],
    target: TargetAdapter | None,
    dequantize: bool = True,
) -> AssistantDrafter:
    drafter = AssistantDrafter(config)
    load_checked_weights(drafter, weights, config, "Gemma-4 assistant")
    if dequantize:
        dequantize_on_cpu(drafter)
    if target is not None:
        drafter.bind(target.input_embedding, target.num_layers)
    mx.eval(drafter.parameters())
    return drafter


def load_assistant(
    path_or_repo: str | Path,
    target: nn.Module | None = None,
    *,
    dequantize: bool = True,
) -> AssistantDrafter:
    """Load a Gemma-4 assistant drafter (Hugging Face layout or MLX),
    paired with ``target`` (an mlx-lm Gemma-4 model) when given."""
    path = resolve_path(path_or_repo, "draft model")
    raw = read_config(path)
    if not is_assistant(raw):
        raise DSparkError(f"{path} is not a Gemma-4 assistant drafter.")
    config = AssistantConfig.from_dict(raw)
    adapter = None
    if target is not None:
        adapter = TargetAdapter(target)
        check_assistant_pair(config, adapter)
    weights = assistant_weights(read_weights(path), config)
    drafter = build_assistant(config, weights, adapter, dequantize)
    drafter.source_path = path
    return drafter
