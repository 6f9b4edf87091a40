"""Load EAGLE-3 drafters: DeepSpec checkpoints (Qwen3 / Gemma-4), vLLM
speculators ``eagle3`` checkpoints, and MLX ones written by ``convert``.

``--draft-model`` dispatch: call :func:`is_eagle3` on the draft model's
config before the DSpark loader (which takes any speculators config for its
own), and :func:`load_eagle3` when it says yes.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import DSparkError
from ..proposers.eagle3 import Eagle3Drafter
from ..proposers.eagle3_config import ARCHITECTURES, Eagle3Config
from ..targets.adapter import TargetAdapter
from .weights import (
    attach_embeddings,
    check_trained_for,
    dequantize_on_cpu,
    load_checked_weights,
    read_config,
    read_weights,
    resolve_path,
)

# Speculators tensors that are not drafter weights: the verifier's head and
# norm (rebuilt from the target) and the target-to-draft mask (implied by d2t).
SPECULATORS_DROPPED = ("verifier_lm_head.weight", "verifier_norm.weight", "t2d")


def is_speculators_eagle3(config: dict) -> bool:
    kind = config.get("speculators_model_type")
    if kind is None:
        kind = (config.get("speculators_config") or {}).get("algorithm")
    return kind == "eagle3"


def is_eagle3(config: dict) -> bool:
    """Whether a draft model's ``config.json`` describes an EAGLE-3 drafter."""
    architectures = config.get("architectures") or []
    return is_speculators_eagle3(config) or any(
        a in ARCHITECTURES for a in architectures
    )


def is_eagle3_path(path_or_repo: str | Path) -> bool:
    """:func:`is_eagle3` of a local directory or Hugging Face repo id."""
    return is_eagle3(read_config(resolve_path(path_or_repo, "draft model")))


def read_eagle3_config(raw: dict, num_target_layers: int | None = None) -> Eagle3Config:
    if is_speculators_eagle3(raw):
        return Eagle3Config.from_speculators(raw, num_target_layers)
    return Eagle3Config.from_deepspec(raw)


def speculators_weights(
    weights: dict[str, mx.array], config: Eagle3Config
) -> dict[str, mx.array]:
    """Speculators tensors in DeepSpec names: the verifier's copies dropped and
    ``d2t`` (offsets, target = draft id + d2t) turned into ``draft_to_target``."""
    from .weights import draft_to_target_ids

    t2d = weights.get("t2d")
    for name in SPECULATORS_DROPPED:
        weights.pop(name, None)
    d2t = weights.pop("d2t", None)
    if not config.reduced_vocab:
        return weights
    if d2t is None:
        raise DSparkError("The reduced-vocabulary speculators checkpoint has no d2t.")
    ids = draft_to_target_ids(
        np.array(d2t), None if t2d is None else np.array(t2d), config.vocab_size
    )
    weights["draft_to_target"] = mx.array(ids.astype(np.int32))
    return weights


def check_eagle3_pair(config: Eagle3Config, target: TargetAdapter) -> None:
    check_trained_for(config, target, "EAGLE-3 drafter")
    if config.target_hidden_size != target.hidden_size:
        raise DSparkError(
            f"The EAGLE-3 drafter reads target features of width "
            f"{config.target_hidden_size}, but the target's are {target.hidden_size}."
        )


def build_eagle3(
    config: Eagle3Config,
    weights: dict[str, mx.array],
    target: TargetAdapter | None,
    dequantize: bool = True,
) -> Eagle3Drafter:
    """Instantiate the drafter from DeepSpec-named tensors, sharing the
    target's embedding and LM head where the checkpoint omits them or holds
    exact copies (a reduced-vocabulary head is always the drafter's own)."""
    drafter = Eagle3Drafter(config)
    attach_embeddings(
        drafter, config, weights, target, "EAGLE-3 drafter", keep_whole=False
    )
    load_checked_weights(drafter, weights, config, "EAGLE-3 drafter")
    if dequantize:
        dequantize_on_cpu(drafter)
    mx.eval(drafter.parameters())
    return drafter


def load_eagle3(
    path_or_repo: str | Path,
    target: nn.Module | None = None,
    *,
    dequantize: bool = True,
) -> Eagle3Drafter:
    """Load an EAGLE-3 drafter (DeepSpec, speculators or MLX), optionally for
    ``target`` (an mlx-lm model), whose embedding and LM head it then shares
    where it may. ``dequantize=False`` keeps quantized weights on the CPU."""
    path = resolve_path(path_or_repo, "draft model")
    raw = read_config(path)
    if not is_eagle3(raw):
        raise DSparkError(f"{path} is not an EAGLE-3 drafter.")
    adapter = None
    layers = None
    if target is not None:
        layers = TargetAdapter(target).num_layers
    config = read_eagle3_config(raw, layers)
    if target is not None:
        adapter = TargetAdapter(target, config.target_layer_ids)
        check_eagle3_pair(config, adapter)
    weights = read_weights(path)
    if is_speculators_eagle3(raw):
        weights = speculators_weights(weights, config)
    drafter = build_eagle3(config, weights, adapter, dequantize)
    drafter.source_path = path
    return drafter
