"""MTP drafters: finding the ``mtp.*`` tensors of an original Qwen3-Next /
Qwen3.5 checkpoint, mapping them to the drafter's names, and loading a drafter
directory written by ``mlx_dspark.convert --mtp``
(:mod:`mlx_dspark.convert.mtp`).

Hugging Face's layout stores these models' RMSNorm weights zero-centred (the
norm scales by ``1 + weight``); mlx-lm adds the 1 when it converts the trunk
and drops ``mtp.*`` altogether, so an mlx-community conversion has no MTP
module. :func:`drafter_weights` adds the 1 to the MTP norms once; a drafter
directory holds them as MLX's ``RMSNorm`` reads them.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..errors import DSparkError
from ..proposers.mtp import MTPDrafter
from ..proposers.mtp_config import MTP_MODEL_TYPES, MTPConfig, is_mtp_config
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

PREFIX = "mtp."
INDEX = "model.safetensors.index.json"
# The MTP norms Hugging Face stores as ``weight`` for a ``1 + weight`` scale.
OFFSET_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)
_EXPERT = re.compile(r"(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def is_mtp(config: dict) -> bool:
    """Whether a draft model's ``config.json`` describes an MTP drafter."""
    return is_mtp_config(config)


def _header_keys(file: Path) -> list[str]:
    """The tensor names of a safetensors file, from its header alone."""
    try:
        with open(file, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        raise DSparkError(f"{file} is not a valid safetensors file.") from None
    return [k for k in header if k != "__metadata__"]


def mtp_shards(path: Path) -> dict[Path, list[str]]:
    """The ``mtp.*`` tensor names of a checkpoint directory, by the shard that
    holds them: from ``model.safetensors.index.json`` when there is one (no
    shard is opened), else from each file's header."""
    index = path / INDEX
    found: dict[Path, list[str]] = {}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise DSparkError(f"{index} is not a safetensors index.") from None
        for key, name in weight_map.items():
            if key.startswith(PREFIX):
                found.setdefault(path / name, []).append(key)
        return found
    for file in sorted(path.glob("*.safetensors")):
        keys = [k for k in _header_keys(file) if k.startswith(PREFIX)]
        if keys:
            found[file] = keys
    return found


def carries_mtp(name: str) -> bool | None:
    """Whether a checkpoint (directory, or hub repo by its index alone) holds
    ``mtp.*`` tensors; None when that cannot be told without downloading
    weights."""
    path = Path(name).expanduser()
    if path.is_dir():
        return bool(mtp_shards(path))
    from huggingface_hub import hf_hub_download

    for local_only in (True, False):
        try:
            index = Path(hf_hub_download(name, INDEX, local_files_only=local_only))
        except Exception:
            continue
        return bool(mtp_shards(index.parent))
    return None


def read_mtp_tensors(path: Path) -> dict[str, mx.array]:
    """The checkpoint's ``mtp.*`` tensors, reading only the shards that hold them."""
    shards = mtp_shards(path)
    if not shards:
        raise DSparkError(
            f"{path} carries no MTP weights (no mtp.* tensors): give the original "
            "Hugging Face checkpoint, not an mlx-lm conversion."
        )
    tensors: dict[str, mx.array] = {}
    for file, keys in shards.items():
        if not file.is_file():
            raise DSparkError(f"{file}, which the index names for mtp.*, is missing.")
        try:
            from safetensors import safe_open

            with safe_open(str(file), framework="mlx") as handle:
                tensors.update({k: handle.get_tensor(k) for k in keys})
        except Exception:
            try:
                shard = mx.load(str(file))
                tensors.update({k: shard[k] for k in keys})
            except Exception:
                raise DSparkError(
                    f"{file} is truncated or not a valid safetensors file."
                ) from None
    return tensors


def drafter_weights(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """``mtp.*`` tensors in the drafter's names: the prefix dropped, the
    zero-centred norms made ``1 + weight`` (once), and the experts stacked as
    mlx-lm's ``switch_mlp`` (one tensor per expert, or Qwen3.5-MoE's fused
    ``gate_up_proj``)."""
    if any(k.endswith(("weight_scale_inv", "weight_scale")) for k in tensors):
        raise DSparkError(
            "The checkpoint's MTP weights are FP8-quantized; extract them from "
            "the bfloat16 release."
        )
    out: dict[str, mx.array] = {}
    experts: dict[tuple[str, str], dict[int, mx.array]] = {}
    for key, value in tensors.items():
        name = key[len(PREFIX) :]
        if name.endswith(OFFSET_NORMS) and value.ndim == 1:
            value = value.astype(mx.float32) + 1.0
        if match := _EXPERT.match(name):
            base, e, proj = match.groups()
            experts.setdefault((base, proj), {})[int(e)] = value
            continue
        if name.endswith(".experts.gate_up_proj"):
            base = name[: -len(".experts.gate_up_proj")]
            gate, up = mx.split(value, 2, axis=-2)
            out[f"{base}.switch_mlp.gate_proj.weight"] = gate
            out[f"{base}.switch_mlp.up_proj.weight"] = up
            continue
        if name.endswith(".experts.down_proj"):
            base = name[: -len(".experts.down_proj")]
            out[f"{base}.switch_mlp.down_proj.weight"] = value
            continue
        out[name] = value
    for (base, proj), by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise DSparkError(f"The MTP experts of {base} are not numbered 0..n-1.")
        out[f"{base}.switch_mlp.{proj}.weight"] = mx.stack(
            [by_index[e] for e in range(len(by_index))]
        )
    return out


def source_mtp_config(raw: dict, block_size: int) -> MTPConfig:
    """The drafter's config from an original checkpoint's ``config.json``."""
    model_type = raw.get("model_type")
    if model_type not in MTP_MODEL_TYPES:
        raise DSparkError(
            f"Model type {model_type!r} has no MTP drafter here; MTP extraction "
            f"supports {', '.join(MTP_MODEL_TYPES)}."
        )
    text = dict(raw.get("text_config") or raw)
    text.pop("quantization_config", None)
    layers = int(text.get("mtp_num_hidden_layers", 1) or 1)
    return MTPConfig(
        target_model_type=model_type,
        text_config=text,
        num_target_layers=int(text["num_hidden_layers"]),
        block_size=block_size,
        num_mtp_layers=layers,
    )


def check_mtp_pair(config: MTPConfig, target: TargetAdapter) -> None:
    check_trained_for(config, target, "MTP drafter")
    if target.model_type != config.target_model_type:
        raise DSparkError(
            f"The MTP drafter was extracted from a {config.target_model_type} "
            f"checkpoint, but the target is {target.model_type}."
        )


def build_mtp(
    config: MTPConfig,
    weights: dict[str, mx.array],
    target: TargetAdapter | None,
    dequantize: bool = True,
) -> MTPDrafter:
    """The drafter from its tensors, with the target's embedding and LM head."""
    drafter = MTPDrafter(config)
    attach_embeddings(drafter, config, weights, target, "MTP drafter")
    load_checked_weights(drafter, weights, config, "MTP drafter")
    if dequantize:
        dequantize_on_cpu(drafter)
    mx.eval(drafter.parameters())
    return drafter


def load_mtp(path_or_repo: str | Path, target: nn.Module | None = None) -> MTPDrafter:
    """Load an MTP drafter directory (or hub repo) for ``target`` (an mlx-lm
    model of the family it was extracted from)."""
    path = resolve_path(path_or_repo, "draft model")
    raw = read_config(path)
    if not is_mtp(raw):
        raise DSparkError(f"{path} is not an MTP drafter.")
    config = MTPConfig.from_dict(raw)
    adapter = None
    if target is not None:
        adapter = TargetAdapter(target, config.target_layer_ids)
        check_mtp_pair(config, adapter)
    drafter = build_mtp(config, read_weights(path), adapter)
    drafter.source_path = path
    return drafter
