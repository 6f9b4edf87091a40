"""Extract the MTP module of an original Qwen3-Next / Qwen3.5 / Qwen3.5-MoE
checkpoint (a local directory or Hugging Face repo id) as a drafter directory.

Only the shards that hold ``mtp.*`` tensors are read (found through
``model.safetensors.index.json``); the norms get their ``1 +`` offset once,
the experts are stacked as mlx-lm stacks them, and the weights are written
float (the checkpoint's dtype, or ``dtype``) or 4/8-bit. The directory pairs
with any mlx-lm conversion of the same model, which has no MTP module:
``mlx_dspark.generate --model T --draft-model D``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_dspark.checkpoints.mtp import (
    INDEX,
    drafter_weights,
    read_mtp_tensors,
    source_mtp_config,
)
from mlx_dspark.checkpoints.weights import load_checked_weights, read_config
from mlx_dspark.errors import DSparkError
from mlx_dspark.proposers.mtp import MTPDrafter
from mlx_dspark.proposers.mtp_config import DEFAULT_BLOCK_SIZE, MTPConfig

from .common import atomic_output_dir

# Routers stay float, as mlx-lm keeps them at 8 bits at least.
_FLOAT_LAYERS = ("mlp.gate", "shared_expert_gate")


@dataclass
class MTPExtraction:
    config: MTPConfig
    tensors: int
    bits: int | None


def _source_dir(source: str | Path) -> Path:
    """A local directory, or the repo's configs, index and the shards with
    ``mtp.*`` (only those) from the hub."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    name = str(source)
    if name.startswith((".", "/", "~")) or name.count("/") != 1 or path.exists():
        raise DSparkError(f"The checkpoint {name} is not a model directory.")
    from huggingface_hub import hf_hub_download, snapshot_download

    try:
        root = Path(
            snapshot_download(name, allow_patterns=["*.json"], local_files_only=False)
        )
        index = root / INDEX
        shards = {"model.safetensors"}
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            shards = {f for k, f in weight_map.items() if k.startswith("mtp.")}
        for shard in sorted(shards):
            hf_hub_download(name, shard)
        return root
    except Exception:
        raise DSparkError(
            f"The checkpoint {name} is neither a local directory nor a reachable "
            "Hugging Face repository."
        ) from None


def extract_mtp(
    source: str | Path,
    out: str | Path,
    *,
    bits: int | None = None,
    group_size: int = 64,
    dtype: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    force: bool = False,
) -> MTPExtraction:
    """Write ``out``: the MTP drafter of the original checkpoint ``source``
    (``bits``: 4 or 8 for a quantized drafter; ``dtype`` of float weights)."""
    if bits not in (None, 4, 8):
        raise DSparkError(
            f"MTP drafters are written float, 4-bit or 8-bit, not {bits}."
        )
    path = _source_dir(source)
    config = source_mtp_config(read_config(path), block_size)
    weights = drafter_weights(read_mtp_tensors(path))
    if dtype is not None:
        weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
    drafter = MTPDrafter(config)
    load_checked_weights(drafter, dict(weights), config, "MTP drafter")
    if bits is not None:
        nn.quantize(
            drafter,
            group_size=group_size,
            bits=bits,
            class_predicate=lambda p, m: (
                hasattr(m, "to_quantized")
                and not p.endswith(_FLOAT_LAYERS)
                and m.weight.shape[-1] % group_size == 0
            ),
        )
        config.quantization = {"group_size": group_size, "bits": bits}
    tensors = dict(tree_flatten(drafter.parameters()))
    mx.eval(tensors)
    with atomic_output_dir(out, force) as tmp:
        mx.save_safetensors(
            str(tmp / "model.safetensors"), tensors, metadata={"format": "mlx"}
        )
        (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return MTPExtraction(config, len(tensors), bits)
