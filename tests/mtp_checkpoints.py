"""Tiny original (Hugging Face layout) Qwen3-Next / Qwen3.5 / Qwen3.5-MoE
checkpoints with an MTP module, for the MTP drafter's tests.

The trunk is the tiny family model of :mod:`tiny_families` (mlx-lm's own
class, a permuted embedding map perturbed by its random layers) written back
in Hugging Face's layout: zero-centred norms, per-expert (Qwen3-Next) or
fused (Qwen3.5-MoE) experts, ``[C, 1, K]`` convolutions, and ``mtp.*``
tensors in a shard of their own. The MTP module's ``fc`` passes the
embedding half through (plus ``hidden_mix`` of the trunk's state), so with
the target's LM head it predicts the trunk's permutation map: often, not
always, what the target says.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tiny_families import build_model

from mlx_dspark.checkpoints.mtp import OFFSET_NORMS
from mlx_dspark.pairs.structured import PairSpec, _tokenizer_files
from mlx_dspark.proposers.mtp import MTPDrafter
from mlx_dspark.proposers.mtp_config import MTPConfig

TRUNK_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def _experts_to_hf(name: str, value, model_type: str) -> dict:
    """mlx-lm's stacked ``switch_mlp`` as the checkpoint stores experts."""
    base, proj = name.split(".switch_mlp.")
    proj = proj[: -len(".weight")]
    if model_type == "qwen3_next":
        return {
            f"{base}.experts.{e}.{proj}.weight": value[e] for e in range(len(value))
        }
    if proj == "down_proj":
        return {f"{base}.experts.down_proj": value}
    return {f"{base}.experts.{proj}": value}  # fused below


def _fuse(hf: dict) -> dict:
    for key in [k for k in hf if k.endswith(".experts.gate_proj")]:
        base = key[: -len(".gate_proj")]
        gate, up = hf.pop(key), hf.pop(f"{base}.up_proj")
        hf[f"{base}.gate_up_proj"] = np.concatenate([gate, up], axis=-2)
    return hf


def trunk_to_hf(weights: dict, model_type: str) -> dict:
    hf = {}
    for name, value in weights.items():
        if model_type != "qwen3_next":
            name = name.replace("language_model.model.", "model.language_model.")
            name = name.replace("language_model.lm_head", "lm_head")
        if "conv1d.weight" in name:
            value = np.moveaxis(value, 1, 2)
        if name.endswith(TRUNK_NORMS) and value.ndim == 1:
            value = value - 1.0
        if ".switch_mlp." in name:
            hf.update(_experts_to_hf(name, value, model_type))
        else:
            hf[name] = value
    return _fuse(hf)


def mtp_weights(
    model_type: str, text: dict, seed: int, hidden_mix: float
) -> dict[str, np.ndarray]:
    """The MTP module's tensors in the drafter's (MLX) names."""
    config = MTPConfig(model_type, text, text["num_hidden_layers"])
    drafter = MTPDrafter(config)
    rng = np.random.default_rng(seed + 100)
    weights = {}
    for name, value in tree_flatten(drafter.parameters()):
        if value.ndim == 1:
            weights[name] = 1.0 + 0.2 * rng.standard_normal(value.shape)
        else:
            weights[name] = rng.standard_normal(value.shape) / np.sqrt(value.shape[-1])
    d = text["hidden_size"]
    fc = hidden_mix * weights["fc.weight"]
    fc[:, :d] += np.eye(d)
    weights["fc.weight"] = fc
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] *= 0.3
    return weights


def mtp_to_hf(weights: dict, model_type: str) -> dict:
    hf = {}
    for name, value in weights.items():
        if name.endswith(OFFSET_NORMS) and value.ndim == 1:
            value = value - 1.0
        if ".switch_mlp." in name:
            hf.update(_experts_to_hf(name, value, model_type))
        else:
            hf[name] = value
    return {f"mtp.{k}": v for k, v in _fuse(hf).items()}


def save_hf_checkpoint(
    directory: Path,
    model_type: str,
    seed: int = 0,
    hidden_mix: float = 0.3,
    with_mtp: bool = True,
) -> Path:
    """Write an original checkpoint: two shards (trunk, MTP) and their index."""
    model, config = build_model(model_type, seed)
    text = config.get("text_config", config)
    text["mtp_num_hidden_layers"] = 1
    if "rope_parameters" in text:  # as the published Qwen3.5 configs have
        rotary = int(text["head_dim"] * 0.25) // 2
        text["rope_parameters"].update(
            mrope_section=[rotary - rotary // 2, rotary // 2, 0], mrope_interleaved=True
        )
    trunk = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    shards = {"model-00001-of-00002.safetensors": trunk_to_hf(trunk, model_type)}
    if with_mtp:
        mtp = mtp_weights(model_type, text, seed, hidden_mix)
        shards["model-00002-of-00002.safetensors"] = mtp_to_hf(mtp, model_type)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file, tensors in shards.items():
        arrays = {k: mx.array(np.asarray(v, np.float32)) for k, v in tensors.items()}
        mx.save_safetensors(str(directory / file), arrays)
        weight_map.update(dict.fromkeys(tensors, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for name, body in _tokenizer_files(PairSpec(vocab_size=text["vocab_size"])).items():
        (directory / name).write_text(body)
    return directory
